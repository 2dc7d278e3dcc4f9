"""Triage names the first non-finite site, pass and step, and reports failures, skips and segments."""

from __future__ import annotations

import numpy as np

import trainhist
from trainhist.cli import main
from trainhist.triage import triage


def test_first_nonfinite_is_the_earliest_pass_of_the_earliest_step(tmp_path, capsys) -> None:
    p = tmp_path / "t.thist"
    ok = np.ones(8, np.float32)
    bad = ok.copy()
    bad[3] = np.nan
    with trainhist.HistoryWriter(p) as w:
        a0 = w.site("h.0", "activation")
        a1 = w.site("h.1", "activation")
        g0 = w.site("h.0", "activation_grad")
        g1 = w.site("h.1", "activation_grad")
        for step in range(6):
            # from step 4, h.1's forward output is NaN; its gradient and h.0's gradient follow in backward
            w.observe(a0, step, ok)
            w.observe(a1, step, bad if step >= 4 else ok)
            w.observe(g1, step, bad if step >= 4 else ok)
            w.observe(g0, step, bad if step >= 3 else ok)  # an earlier, backward-only NaN at step 3
            w.step_truth(step, applied=step != 5)
        w.mark(a0, 6, "failed")
        w.new_segment(10, reason="resume")
        w.observe(a0, 10, ok)
    with trainhist.open(p) as h:
        t = triage(h)
    first = t.first_nonfinite
    assert first is not None and first.step == 3 and first.site == "h.0"
    assert "backward" in first.text and "1 NaN" in first.text
    kinds = [f.kind for f in t.findings]
    assert kinds[0] == "first_nonfinite"
    assert {"failed", "skipped_step", "segment"} <= set(kinds)
    assert main(["triage", str(p)]) == 0
    out = capsys.readouterr().out
    assert "step 3" in out and "h.0" in out


def test_forward_outranks_backward_within_a_step(tmp_path) -> None:
    p = tmp_path / "t.thist"
    bad = np.array([np.inf, 1.0], np.float32)
    with trainhist.HistoryWriter(p) as w:
        g = w.site("h.0", "activation_grad")
        a = w.site("h.1", "activation")
        w.observe(g, 2, bad)
        w.observe(a, 2, bad)
    with trainhist.open(p) as h:
        first = triage(h).first_nonfinite
    assert first.site == "h.1" and "forward" in first.text and "1 inf" in first.text


def test_clean_history_has_no_findings(tmp_path) -> None:
    p = tmp_path / "t.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("x", "param")
        w.observe(s, 0, np.arange(4.0))
        w.step_truth(0, applied=True)
    with trainhist.open(p) as h:
        t = triage(h)
    assert t.findings == [] and "no non-finite" in t.format()


def test_cli_reports_io_errors_without_a_traceback(tmp_path, capsys) -> None:
    assert main(["info", str(tmp_path)]) == 1  # a directory, not a file
    err = capsys.readouterr().err
    assert err.startswith("trainhist: error [io_error]") and "Traceback" not in err
    assert main(["verify", str(tmp_path / "missing.thist")]) == 1
    assert "[not_found]" in capsys.readouterr().err
