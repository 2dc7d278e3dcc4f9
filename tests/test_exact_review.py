"""An adversarial review of the exact arithmetic (spec 5.3, 6.2, 11.2, 11.9): exact sums against
``fractions.Fraction``, the canonical form of exact zeros and merges in every grouping. Each test names the defect
it pins down."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from history_helpers import obs_payload, rewrite

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


def test_an_empty_sketch_range_is_written_from_bin_zero(tmp_path):
    """Spec 7.5, 11.9: a reader accepts any range, so an empty side may start anywhere (``sk_pn = 0`` with
    ``sk_plo = 7``), but a canonical chunk stores an empty side as ``lo = n = 0``. A row that combined with nothing
    kept its stored ``lo``, so two files with the same content merged to different bytes."""
    p = tmp_path / "neg.thist"
    with trainhist.HistoryWriter(p, codec="raw", fsync="never") as w:
        a = w.site("a", "activation")
        w.observe(a, 0, np.array([-1.0, -2.0]))  # no positive value: the positive side is empty
    data = bytearray(p.read_bytes())
    pos, payload, cols = obs_payload(bytes(data), 0)
    _, _, codec, off, _, _ = cols["sk_plo"]
    assert codec == 0 and struct.unpack_from("<H", payload, off) == (0,)
    struct.pack_into("<H", payload, off, 7)
    rewrite(data, pos, bytes(payload))
    q = tmp_path / "neg7.thist"
    q.write_bytes(bytes(data))
    assert trainhist.open(q).verify()["rows"] == 1
    trainhist.merge([p], tmp_path / "m.thist", workers=1, codec="raw")
    trainhist.merge([q], tmp_path / "m7.thist", workers=1, codec="raw")
    out = (tmp_path / "m7.thist").read_bytes()
    _, payload, cols = obs_payload(out, 0)
    _, _, codec, off, _, _ = cols["sk_plo"]
    assert codec == 0 and struct.unpack_from("<H", payload, off) == (0,)
    assert out == (tmp_path / "m.thist").read_bytes()
