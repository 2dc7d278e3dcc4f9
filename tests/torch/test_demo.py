"""The demo trains for real, writes a readable history, and pins an injected NaN on the right module."""

from __future__ import annotations

import numpy as np

import trainhist
from trainhist.torch import demo


def test_demo_with_injected_nan(tmp_path, capsys):
    out = tmp_path / "demo.thist"
    assert demo.main(["--out", str(out), "--steps", "5", "--batch", "2", "--inject-nan", "3", "--no-figures"]) == 0
    text = capsys.readouterr().out
    assert f"first non-finite value: step 3, {demo.FAULT_SITE} (activation)" in text
    assert "triage of" in text
    h = trainhist.open(out)
    sp = h.spine(demo.FAULT_SITE, "activation")
    assert list(sp.step) == [0, 1, 2, 3, 4]
    assert sp.nan[2] == 0 and sp.nan[3] >= 1
    assert list(h.spine("transformer.h.0.mlp.c_fc", "activation").nan[:4]) == [0, 0, 0, 0]
    loss = h.spine("loss", "scalar").max
    assert np.isfinite(loss[:3]).all() and len(loss) == 5
    assert [r["micro_batches"] for r in h.step_truth_rows()] == [2] * 5


def test_demo_without_transformers_says_what_to_install(tmp_path, monkeypatch, capsys):
    """transformers is not in the torch extra: the demo ended in an ImportError traceback."""
    import sys

    from trainhist import cli

    monkeypatch.setitem(sys.modules, "transformers", None)  # (import transformers now raises ImportError)
    assert cli.main(["demo", "--out", str(tmp_path / "d.thist"), "--steps", "1", "--no-figures"]) == 2
    assert "pip install 'trainhist[demo]'" in capsys.readouterr().err
