"""An adversarial review of the exact arithmetic (spec 5.3, 6.2, 11.2, 11.9): exact sums against
``fractions.Fraction``, the canonical form of exact zeros and merges in every grouping. Each test names the defect
it pins down."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import trainhist

VECTORS = Path(__file__).resolve().parent.parent / "conformance" / "vectors"


def test_an_exact_zero_stored_with_negative_zero_is_written_as_positive_zero(tmp_path):
    """Spec 5.3: the exact zero (m = 0, e = 0) may come with an f64 of -0.0, but a derived file stores the value 0
    as +0.0. Merge passed the -0.0 of a row that combined with nothing through, so ``merge([a])`` held -0.0 and was
    not the canonical form: merging it again (where the -0.0 no longer has an exact form) gave other bytes."""
    src = VECTORS / "valid" / "exact_form_of_binary64" / "input.thist"
    once, twice, coarse = tmp_path / "m1.thist", tmp_path / "m2.thist", tmp_path / "c.thist"
    trainhist.merge([src], once, workers=1)
    trainhist.merge([once], twice, workers=1)
    trainhist.coarsen(src, coarse, steps=1, workers=1)
    for p in (once, coarse):
        s = trainhist.open(p).spine("e").columns["sum"]
        assert s[2] == 0.0 and not np.signbit(s[2]), p
    assert once.read_bytes() == twice.read_bytes() == coarse.read_bytes()
