"""Triage names the first non-finite site, pass and step, and reports failures, skips and segments."""

from __future__ import annotations

import os

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
    assert err.startswith("trainhist: error [not_a_file]") and "Traceback" not in err
    assert main(["verify", str(tmp_path / "missing.thist")]) == 1
    assert "[not_found]" in capsys.readouterr().err


def test_site_spines_at_a_cadence_bracket_the_origin(tmp_path) -> None:
    # a Collector at a cadence: a per-step scalar (grad_norm) and site spines every 5 steps; the NaN starts at step 7
    p = tmp_path / "t.thist"
    ok = np.ones(4, np.float32)
    bad = np.array([np.nan, 1, 1, 1], np.float32)
    with trainhist.HistoryWriter(p) as w:
        a = w.site("h.0", "activation", cadence_spine=5)
        for step in range(12):
            w.scalar("grad_norm", step, float("nan") if step >= 7 else 1.0)
            if step % 5 == 0:
                w.observe(a, step, bad if step >= 7 else ok)
    with trainhist.open(p) as h:
        t = triage(h)
    first = t.first_nonfinite
    assert first.step == 7 and first.site == "grad_norm"
    site = next(f for f in t.findings if f.kind == "first_nonfinite_site")
    assert site.step == 10 and site.site == "h.0"
    assert "previous observation, at step 5" in site.text and "steps 6..9 were not observed" in site.text


def test_no_bracket_when_the_site_was_observed_the_step_before(tmp_path) -> None:
    p = tmp_path / "t.thist"
    with trainhist.HistoryWriter(p) as w:
        a = w.site("h.0", "activation")
        for step in range(3):
            w.observe(a, step, np.array([np.inf if step == 2 else 1.0]))
    with trainhist.open(p) as h:
        t = triage(h)
    assert t.first_nonfinite.step == 2 and "first_nonfinite_site" not in [f.kind for f in t.findings]


def test_cli_broken_pipe_is_not_an_error(monkeypatch, capsys) -> None:
    """`trainhist dump F | head`: the reader went away; exit 0, nothing on stderr (BrokenPipeError is an OSError)."""
    import argparse
    import types

    import trainhist.cli as cli

    def closed_pipe(args: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    parsed = argparse.Namespace(command="dump", func=closed_pipe)
    monkeypatch.setattr(cli, "build_parser", lambda: types.SimpleNamespace(parse_known_args=lambda argv: (parsed, [])))
    assert main(["dump", "x.thist"]) == 0
    assert capsys.readouterr().err == ""


def test_coarsened_rows_cover_their_span(tmp_path) -> None:
    """A coarsened row covers its whole window: no steps between windows are 'not observed'."""
    src, dst = tmp_path / "s.thist", tmp_path / "c.thist"
    with trainhist.HistoryWriter(src) as w:
        a = w.site("h.0", "activation")
        for step in range(8):
            w.observe(a, step, np.array([np.nan if step == 5 else 1.0], np.float32))
    for n in (2, 4):
        trainhist.coarsen(src, dst, steps=n)
        with trainhist.open(dst) as h:
            t = triage(h)
        assert t.first_nonfinite.step == 4 and f"at steps 4–{4 + n - 1}" in t.first_nonfinite.text  # its window
        assert not any("not observed" in f.text for f in t.findings), t.format()
        os.unlink(dst)


def test_time_runs_by_segment_then_step(tmp_path) -> None:
    """A run resumed at an earlier step is later in time: the first non-finite value is the one of the earlier
    segment, and a site's previous observation is taken in its own segment."""
    p = tmp_path / "r.thist"
    with trainhist.HistoryWriter(p) as w:
        a = w.site("h.0", "activation")
        for step in range(10):
            w.observe(a, step, np.array([np.nan if step == 8 else 1.0], np.float32))
        w.new_segment(5, "resume")
        for step in (5, 6):
            w.observe(a, step, np.array([np.inf if step == 6 else 1.0], np.float32))
    with trainhist.open(p) as h:
        t = triage(h)
    assert t.first_nonfinite.step == 8 and "(segment 0)" in t.first_nonfinite.text
    assert "from step 8 (segment 0) to step 6 (segment 1)" in t.format()
    q = tmp_path / "gap.thist"
    with trainhist.HistoryWriter(q) as w:
        a = w.site("h.0", "activation")
        w.scalar("loss", 0, 1.0)
        for step in range(10):
            w.observe(a, step, np.ones(1, np.float32))
        w.new_segment(5, "resume")
        w.scalar("loss", 8, float("nan"))
        for step in (5, 8):
            w.observe(a, step, np.array([np.nan if step == 8 else 1.0], np.float32))
    with trainhist.open(q) as h:
        t = triage(h)
    site = next(f for f in t.findings if f.kind == "first_nonfinite_site")
    assert "previous observation, at step 5" in site.text and "steps 6..7 were not observed" in site.text


def test_rows_without_numbers_are_reported_by_state(tmp_path) -> None:
    """Absent, skipped and unknown rows are findings (a file of only such rows used to report nothing)."""
    p = tmp_path / "m.thist"
    with trainhist.HistoryWriter(p) as w:
        a, b = w.site("moe.1", "activation"), w.site("h.0", "param_delta")
        for step in range(4):
            w.mark(a, step, "absent")
        w.mark(b, 2, "skipped")
    with trainhist.open(p) as h:
        t = triage(h)
    kinds = {f.kind: f for f in t.findings}
    assert "4 rows of 1 site/phase pair did not run, first `moe.1` forward" in kinds["rows_absent"].text
    assert kinds["rows_skipped"].step == 2 and "no non-finite" not in t.format()


def test_coarsened_rows_without_numbers_and_skipped_steps_are_named_by_their_window(tmp_path) -> None:
    """Spec 2.3: a coarsened row is shown as its span. The findings on rows without numbers and on skipped steps
    named a window by its first step."""
    src, dst = tmp_path / "s.thist", tmp_path / "c.thist"
    with trainhist.HistoryWriter(src) as w:
        d = w.site("h.0.weight", "param_delta")
        for step in range(4):
            if step >= 2:
                w.mark(d, step, "skipped")
            else:
                w.observe(d, step, np.ones(2, np.float32))
            w.step_truth(step, applied="skipped" if step >= 2 else "applied")
    trainhist.coarsen(src, dst, steps=2)
    with trainhist.open(dst) as h:
        kinds = {f.kind: f.text for f in triage(h).findings}
    assert kinds["rows_skipped"].endswith("at steps 2–3"), kinds
    assert kinds["skipped_step"].endswith("first at steps 2–3"), kinds


def test_skipped_steps_and_segments_are_named_in_time_order(tmp_path) -> None:
    """The first skipped step is the first in time (segment, then step) in both the finding's step and its text; a
    segment whose ``previous`` is unknown (a merged segment of mixed reasons) is not said to follow 'segment
    None'."""
    p = tmp_path / "r.thist"
    with trainhist.HistoryWriter(p) as w:
        a = w.site("h.0", "activation")
        for step in range(12):
            w.observe(a, step, np.ones(1, np.float32))
            w.step_truth(step, applied=step != 11)
        w.new_segment(5, "resume")
        for step in range(5, 8):
            w.observe(a, step, np.ones(1, np.float32))
            w.step_truth(step, applied=step != 6)
    with trainhist.open(p) as h:
        f = next(f for f in triage(h).findings if f.kind == "skipped_step")
    assert f.step == 11 and f.text.endswith("first at step 11 (segment 0)"), f
    for reason, previous, first in (("manual", None, None), ("resume", 0, 5)):
        q = tmp_path / f"{reason}.thist"
        with trainhist.HistoryWriter(q) as w:
            a = w.site("h.0", "activation")
            w.observe(a, 0, np.ones(1, np.float32))
            w.new_segment(first, reason)
            w._segment_manifest["previous"] = previous  # (as a merge of mixed inputs writes it)
            w.observe(a, 5, np.ones(1, np.float32))
        with trainhist.open(q) as h:
            text = next(f.text for f in triage(h).findings if f.kind == "segment")
        assert "None" not in text, text


def test_a_site_without_a_position_ranks_after_those_with_one(tmp_path) -> None:
    """Ranks that saw an expert first at different steps give it different ``order``s, so the merged site has none:
    the other sites keep their positions (the forward's first NaN is named), the one without ranks after them."""
    p = tmp_path / "m.thist"
    with trainhist.HistoryWriter(p) as w:
        sites = {name: w.site(name, "activation", order=order) for name, order in
                 (("embed", 0), ("moe.expert3", None), ("h.0", 1024), ("lm_head", 2048))}
        for name, site in sites.items():
            w.observe(site, 4, np.array([1.0 if name == "embed" else np.nan], np.float32))
    with trainhist.open(p) as h:
        assert triage(h).first_nonfinite.site == "h.0"


def _nan_and_failed(p):
    """A file of two findings: site a holds a NaN at step 0, site b failed there."""
    with trainhist.HistoryWriter(p) as w:
        a, b = w.site("a", "activation"), w.site("b", "activation")
        w.observe(a, 0, np.array([np.nan], np.float32))
        w.mark(b, 0, "failed")
    return p


def test_cli_limit_refuses_a_negative_count(tmp_path, capsys) -> None:
    """--limit -1 printed one finding and '3 more' of two; it is refused, and 0 prints them all."""
    import pytest

    p = _nan_and_failed(tmp_path / "n.thist")
    with pytest.raises(SystemExit) as e:
        main(["triage", str(p), "--limit", "-1"])
    assert e.value.code == 2
    capsys.readouterr()
    assert main(["triage", str(p), "--limit", "0"]) == 0
    out = capsys.readouterr().out
    assert "more finding" not in out and out.count("  - ") == len(triage(trainhist.open(p)).findings)


def test_a_coarsened_window_does_not_claim_an_order_inside_it(tmp_path) -> None:
    """The backward pass went non-finite at step 5, the forward at step 6: coarsened by 10, both are in window 0–9,
    where the order of steps is not recorded. Triage named the forward site as the first (pass order applied across
    the window); it now lists both and says the order inside the window is unknown."""
    src, dst = tmp_path / "s.thist", tmp_path / "c.thist"
    with trainhist.HistoryWriter(src) as w:
        a, g = w.site("fc", "activation"), w.site("fc", "activation_grad")
        for step in range(10):
            w.observe(a, step, np.array([np.nan if step >= 6 else 1.0], np.float32))
            w.observe(g, step, np.array([np.nan if step >= 5 else 1.0], np.float32))
    with trainhist.open(src) as h:
        assert triage(h).first_nonfinite.text.startswith("the first non-finite value was in `fc` backward")
    trainhist.coarsen(src, dst, steps=10)
    with trainhist.open(dst) as h:
        first = triage(h).first_nonfinite
    assert first.site is None and "within steps 0–9" in first.text and "not recorded" in first.text
    assert "`fc` forward" in first.text and "`fc` backward" in first.text


def test_a_torn_tail_is_said_not_read_as_nothing_wrong(tmp_path, capsys) -> None:
    """A file cut inside its tail printed 'no non-finite values ... found' (exit 3 aside): the dropped records were
    never triaged, so 'nothing found' read as 'nothing wrong'. The report now says the tail was torn and what was
    dropped, with findings or without."""
    p = tmp_path / "t.thist"
    with trainhist.HistoryWriter(p) as w:
        a = w.site("h.0", "activation")
        w.observe(a, 0, np.ones(4, np.float32))
        w.commit()
        w.observe(a, 1, np.array([np.nan, 1, 1, 1], np.float32))  # (the NaN is in the part that will be torn off)
    data = p.read_bytes()
    p.write_bytes(data[:-5])
    with trainhist.open(p) as h:
        assert h.recovery.status == "torn"
        t = triage(h)
        dropped = h.recovery.dropped_bytes
    assert t.findings == []
    text = t.format()
    assert "tail was torn" in text and f"dropped {dropped} bytes" in text and "committed prefix" in text
    assert main(["triage", str(p)]) == 3
    assert "tail was torn" in capsys.readouterr().out
    q = tmp_path / "f.thist"  # with findings: the note comes first
    with trainhist.HistoryWriter(q) as w:
        a = w.site("h.0", "activation")
        w.observe(a, 0, np.array([np.inf], np.float32))
        w.commit()
        w.observe(a, 1, np.ones(1, np.float32))
    q.write_bytes(q.read_bytes()[:-5])
    with trainhist.open(q) as h:
        lines = triage(h).format().splitlines()
    assert lines[1].startswith("  note: torn tail recovered") and "first non-finite" in lines[2]


def test_counts_are_in_the_singular_for_one_and_a_coarsened_file_counts_windows(tmp_path) -> None:
    """'1 rows of 1 site/phase pairs'; on a coarsened file 'from steps 20–29 to steps 20–29' and 'N of M steps'
    where M counted the coarsened windows (`trainhist info` says windows)."""
    src, dst = tmp_path / "s.thist", tmp_path / "c.thist"
    with trainhist.HistoryWriter(src) as w:
        a, b = w.site("h.0", "activation"), w.site("h.1", "activation")
        for st in range(50):
            w.observe(a, st, np.array([np.nan if st == 25 else 1.0], np.float32))
            w.step_truth(st, applied="unknown" if st >= 40 else "skipped" if st >= 30 else "applied")
        w.mark(b, 3, "absent")
    with trainhist.open(src) as h:
        text = triage(h).format()
    assert "1 row of 1 site/phase pair did not run" in text
    assert "1 observation on 1 site/phase pair held non-finite values, all at step 25" in text
    assert "10 steps applied no update" in text and "10 of 50 steps do not say" in text
    trainhist.coarsen(src, dst, steps=10)
    with trainhist.open(dst) as h:
        text = triage(h).format()
    assert "all at steps 20–29" in text and "from steps 20–29 to" not in text
    assert "1 coarsened window applied no update" in text
    assert "1 of 5 coarsened windows does not say whether the update was applied" in text


def _bad(kind: str = "nan") -> np.ndarray:
    x = np.ones(4, np.float32)
    x[1] = np.nan if kind == "nan" else np.inf
    return x


def test_loss_scaler_overflows_are_reported_apart_and_do_not_hide_a_real_nan(tmp_path) -> None:
    """Under a GradScaler, steps whose gradients overflow are skipped: expected. They were the headline (the first
    non-finite value at step 0) and hid a real forward NaN later on. Gradients that are non-finite at a step the
    scaler skipped (a loss scale recorded, the update not applied) are now a finding of their own."""
    p = tmp_path / "amp.thist"
    ok = np.ones(4, np.float32)
    with trainhist.HistoryWriter(p) as w:
        a = w.site("h.0", "activation", order=0)
        g = w.site("h.0", "activation_grad", order=0)
        n = w.site("grad_norm", "scalar")
        for step in range(6):
            overflow = step < 3
            w.observe(a, step, _bad() if step == 5 else ok)
            w.observe(g, step, _bad("inf") if overflow else ok)
            w.observe(n, step, np.array([np.inf if overflow else 1.0]))
            w.step_truth(step, applied=not overflow, loss_scale=2.0 ** (20 - step))
    with trainhist.open(p) as h:
        t = triage(h)
    first = t.first_nonfinite
    assert first.step == 5 and first.site == "h.0" and "forward" in first.text
    (f,) = [f for f in t.findings if f.kind == "scaler_overflow"]
    assert f.step == 0 and "3 steps skipped by the loss scaler" in f.text and "loss scale 1.04858e+06" in f.text
    assert "1 observation on 1 site/phase pair" in next(f.text for f in t.findings if f.kind == "nonfinite")


def test_pre_clip_gradients_come_before_post_clip_and_backward_order_holds_for_parameter_gradients(tmp_path):
    """A NaN in one parameter's pre-clip gradient spreads through the clip's norm to every post-clip gradient: the
    post-clip gradient of an earlier site was named. Parameter gradients are also ranked in backward order (the
    last layer's first), as activation gradients are: the first layer's gradient, turned non-finite last, was."""
    p = tmp_path / "clip.thist"
    ok = np.ones(4, np.float32)
    with trainhist.HistoryWriter(p) as w:
        sites = {(name, ph): w.site(name, "param_grad", order=k)
                 for k, name in enumerate(("l0.weight", "l1.weight")) for ph in ("pre_clip", "post_clip")}
        for (name, ph), s in sites.items():
            w.observe(s, 3, _bad() if ph == "post_clip" or name == "l1.weight" else ok, phase=ph)
    q = tmp_path / "order.thist"
    with trainhist.open(p) as h:
        first = triage(h).first_nonfinite
    assert first.site == "l1.weight" and "pre_clip" in first.text
    with trainhist.HistoryWriter(q) as w:
        for k, name in enumerate(("l0.weight", "l1.weight", "l2.weight")):
            w.observe(w.site(name, "param_grad", order=k), 3, ok if name == "l2.weight" else _bad("inf"))
    with trainhist.open(q) as h:
        assert triage(h).first_nonfinite.site == "l1.weight"


def test_scalars_rank_the_loss_first_and_a_finite_model_is_said(tmp_path) -> None:
    """A NaN loss and a NaN gradient norm at one step: the norm (declared first) was named, which points at the
    backward; the loss comes first now, the norm is listed beside it, and the triage says no model site held one."""
    p = tmp_path / "loss.thist"
    with trainhist.HistoryWriter(p) as w:
        a = w.site("h.0", "activation")
        for step in range(3):
            w.scalar("grad_norm", step, float("nan") if step == 2 else 1.0)
            w.scalar("loss", step, float("nan") if step == 2 else 1.0)
            w.observe(a, step, np.ones(4, np.float32))
            w.step_truth(step, applied=True)
    with trainhist.open(p) as h:
        t = triage(h)
    assert t.first_nonfinite.site == "loss" and "also non-finite at that step: `grad_norm`" in t.first_nonfinite.text
    assert any(f.kind == "model_finite" for f in t.findings)


def test_missing_rows_later_segments_and_ranks_are_said(tmp_path) -> None:
    """Due steps with no row at all (a failed write) read as 'no gaps'; a resumed segment's own first non-finite
    value was folded into the count; a shard of several ranks never said so."""
    p = tmp_path / "gaps.thist"
    ok = np.ones(4, np.float32)
    with trainhist.HistoryWriter(p, rank=1, world_size=2) as w:
        a = w.site("h.0", "activation")
        for step in range(6):
            if step not in (2, 3):  # (the writes of steps 2 and 3 were lost)
                w.observe(a, step, _bad() if step == 5 else ok)
            w.step_truth(step, applied=True)
        w.new_segment(4, reason="resume")
        for step in range(4, 7):
            w.observe(a, step, _bad("inf") if step == 6 else ok)
            w.step_truth(step, applied=True)
    with trainhist.open(p) as h:
        t = triage(h)
    kinds = {f.kind: f for f in t.findings}
    assert "2 due steps of 1 site in the step table have no row at all" in kinds["rows_missing"].text
    assert kinds["rows_missing"].step == 2
    assert kinds["first_nonfinite_segment"].step == 6 and "in segment 1" in kinds["first_nonfinite_segment"].text
    assert "rank 1 of 2" in kinds["ranks"].text


def test_cli_triage_json_gives_every_finding(tmp_path, capsys) -> None:
    import json

    p = tmp_path / "j.thist"
    with trainhist.HistoryWriter(p) as w:
        a = w.site("h.0", "activation")
        for step in range(3):
            w.observe(a, step, _bad() if step else np.ones(4, np.float32))
            w.step_truth(step, applied=step != 2)
    assert main(["triage", str(p), "--json", "--limit", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recovery"] == "clean" and [f["kind"] for f in out["findings"]] == [
        "first_nonfinite", "nonfinite", "skipped_step"]
    assert out["findings"][0] == {"kind": "first_nonfinite", "step": 1, "site": "h.0",
                                  "text": "the first non-finite value was in `h.0` forward (activation) at step 1 "
                                          "(1 NaN)"}


def test_a_coarsened_file_recorded_at_a_cadence_keeps_its_bracket(tmp_path) -> None:
    """A site recorded every 10 steps, coarsened into 5-step windows: its window before the first non-finite one
    holds one observation (its first step), yet it was read as covering the whole window, so the bracket was lost.
    Where the window is the cadence itself (the file cannot tell which steps a window observed), it is said."""
    ok = np.ones(4, np.float32)
    for cadence, said in ((10, "steps 11..19 were not observed"), (5, "which of its steps were observed is not"),
                          (6, "at step 15 (covering steps 15..18), was finite and steps 19..19 were not observed")):
        p, c = tmp_path / f"c{cadence}.thist", tmp_path / f"c{cadence}.c5.thist"
        with trainhist.HistoryWriter(p) as w:
            a = w.site("h.0", "activation", cadence_spine=cadence)
            for step in range(40):
                if step % cadence == 0:  # (6: the window of 5 does not divide it; the file keeps it, spec 11.7)
                    w.observe(a, step, _bad() if step >= 20 else ok)
                w.scalar("loss", step, float("nan") if step >= 17 else 1.0)
                w.step_truth(step, applied=True)
        trainhist.coarsen(p, c, steps=5)
        with trainhist.open(c) as h:
            t = triage(h)
        (f,) = [f for f in t.findings if f.kind == "first_nonfinite_site"]
        assert f.step == 20 and said in f.text, (cadence, f.text)


def test_overflow_windows_of_a_coarsened_file_are_told_apart(tmp_path) -> None:
    """Coarsened windows whose every step the loss scaler skipped keep no loss scale (the scales differed), so their
    overflowed gradients were the headline again; a segment that records a loss scale ran under a scaler."""
    p, c = tmp_path / "amp.thist", tmp_path / "amp.c5.thist"
    ok = np.ones(4, np.float32)
    with trainhist.HistoryWriter(p) as w:
        a = w.site("h.0", "activation", order=0)
        g = w.site("h.0", "activation_grad", order=0)
        for step in range(20):
            overflow = step < 10
            w.observe(a, step, _bad() if step == 17 else ok)
            w.observe(g, step, _bad("inf") if overflow else ok)
            w.step_truth(step, applied=not overflow, loss_scale=2.0 ** (30 - min(step, 10)))
    trainhist.coarsen(p, c, steps=5)
    with trainhist.open(c) as h:
        t = triage(h)
    assert t.first_nonfinite.step == 15 and "forward" in t.first_nonfinite.text
    (f,) = [f for f in t.findings if f.kind == "scaler_overflow"]
    assert "2 coarsened windows skipped by the loss scaler" in f.text and "not kept by the window" in f.text


def test_a_coarsened_window_without_a_row_reads_and_triages_as_its_input(tmp_path) -> None:
    """A cadence-1 site with no row at steps 4..7 (a failed write) read unknown there, and triage reported it; coarsened
    by 4 the site took cadence 4, so the window [4, 8) read unknown at step 4 and not_scheduled at 5..7, and triage
    skipped coarsened files. The file keeps the writers' cadence now (spec 11.7): the window reads step by step as
    the input did (2.6), and triage reports the window."""
    p, c = tmp_path / "p.thist", tmp_path / "c.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("x", "activation")
        for st in range(12):
            if not 4 <= st < 8:
                w.observe(s, st, np.ones(2))
            w.step_truth(st, applied=True)
    trainhist.coarsen(p, c, steps=4)
    with trainhist.open(p) as h0, trainhist.open(c) as h1:
        assert h1.sites[0].cadence_spine == 1
        want = h0.presence("x", steps=range(12))
        assert h1.presence("x", steps=range(4, 8)) == {k: "unknown" for k in range(4, 8)} == \
            {k: want[k] for k in range(4, 8)}
        f = next(f for f in triage(h1).findings if f.kind == "rows_missing")
    assert f.step == 4 and "1 coarsened window with a due step of 1 site" in f.text and "steps 4–7" in f.text
    # a window that holds no due step (cadence 8: step 8 is due, 4..7 are not) is no finding, and reads not_scheduled
    from history_helpers import coarsened_sparse

    with trainhist.open(coarsened_sparse(tmp_path, "x", "d.thist")) as h:
        assert h.presence("x", steps=range(4, 8)) == {k: "not_scheduled" for k in range(4, 8)}
        assert not any(f.kind == "rows_missing" for f in triage(h).findings)


def test_steps_a_merged_cadence_makes_due_are_not_called_failed_writes_alone(tmp_path) -> None:
    """Ranks recording a site every 2 and every 3 steps merge into cadence 1 (their gcd, spec 11.5): steps 1, 5, 7
    and 11, which no rank planned, read unknown (the file cannot say which steps each rank planned), and triage
    said only "nothing was written for them, a failed write say". It names the other cause in a merge now."""
    run = "ef" * 16
    paths = []
    for rank, k in ((0, 2), (1, 3)):
        p = tmp_path / f"r{rank}.thist"
        with trainhist.HistoryWriter(p, run_id=run, rank=rank, world_size=2) as w:
            s = w.site("x", "activation", cadence_spine=k, cadence_sketch=k)
            for st in range(12):
                if st % k == 0:
                    w.observe(s, st, np.ones(4))
                w.step_truth(st, applied=True)
        paths.append(p)
    m = tmp_path / "m.thist"
    trainhist.merge(paths, m)
    with trainhist.open(m) as h:
        pr = h.presence("x", steps=range(12))
        assert [k for k, v in pr.items() if v == "unknown"] == [1, 5, 7, 11]
        f = next(f for f in triage(h).findings if f.kind == "rows_missing")
    assert f.step == 1 and "4 due steps" in f.text and "none of the writers planned" in f.text and "11.5" in f.text


def test_a_segment_of_another_run_is_not_called_a_resume(tmp_path) -> None:
    """Two runs merged without --across-runs: triage said segment 1 'starts at step 0, after an earlier segment: the
    history is not continuous there', as for a resume. It says which run the segment is, another run."""
    paths = []
    for k, rid in enumerate(("ab" * 16, "cd" * 16)):
        q = tmp_path / f"r{k}.thist"
        with trainhist.HistoryWriter(q, run_id=rid, run_name=f"seed{k}") as w:
            a = w.site("a", "activation")
            for st in range(4):
                w.observe(a, st, np.array([np.nan if (k, st) == (1, 2) else 1.0]))
                w.step_truth(st, applied=True)
            if k == 0:
                w.new_segment(2, reason="resume")
                w.observe(a, 2, np.ones(1))
        paths.append(q)
    m = tmp_path / "m.thist"
    trainhist.merge(paths, m)
    with trainhist.open(m) as h:
        t = triage(h)
    seg = [f for f in t.findings if f.kind in ("segment", "segment_run")]
    # (segments by number first, spec 11.3: seed0's 0, seed1's 0, then seed0's resume)
    assert [f.kind for f in seg] == ["segment_run", "segment"]
    assert "segment 2 (resume) starts at step 2, after segment 0" in seg[1].text  # (run seed0's own resume)
    assert seg[0].text.startswith("segment 1 is run 'seed1' [cdcdcdcd] (another run), from step 0: a history of its "
                                  "own that the merge kept apart from run 'seed0' [abababab]")
    assert "not continuous" not in seg[0].text
    f = next(f for f in t.findings if f.kind == "first_nonfinite")
    assert f.step == 2 and "segment 1" in f.text


def test_a_merge_of_writers_at_one_cadence_does_not_blame_unplanned_steps(tmp_path) -> None:
    """Two cadence-1 shards, each without a row at step 4, merged: triage added to the missing row 'steps that none
    of the writers planned', a cause that needs writers of different cadences, which the rows here rule out (a row
    at step 1 was due to a writer at cadence 1). Said only where it can apply: not here, still for cadences 2, 3
    (test above), and for cadences 4 and 6 merged to 2, where the lost step 2 is no multiple of a recorded one."""
    def shards(ks, lost, name):
        paths = []
        for rank, k in enumerate(ks):
            p = tmp_path / f"{name}{rank}.thist"
            with trainhist.HistoryWriter(p, run_id="12" * 16, rank=rank, world_size=len(ks), fsync="never") as w:
                s = w.site("x", "activation", cadence_spine=k, cadence_sketch=k)
                for st in range(12):
                    if st % k == 0 and st not in lost:
                        w.observe(s, st, np.ones(2))
                    w.step_truth(st, applied=True)
            paths.append(p)
        trainhist.merge(paths, tmp_path / f"{name}.thist")
        with trainhist.open(tmp_path / f"{name}.thist") as h:
            return next(f for f in triage(h).findings if f.kind == "rows_missing")
    f = shards((1, 1), {4}, "same")
    assert f.step == 4 and "failed write" in f.text and "planned" not in f.text and "11.5" not in f.text
    f = shards((4, 6), (), "gcd2")
    assert f.step == 2 and "possibly also steps that none of the writers planned" in f.text


def test_the_first_non_finite_value_names_its_run_in_a_file_of_several_runs(tmp_path) -> None:
    """In two runs merged apart, triage's first finding said 'at step 5 (segment 1)' without saying that segment 1
    is another run; it names the run there (and in the count of non-finite observations) now."""
    from history_helpers import two_runs

    trainhist.merge(two_runs(tmp_path, nan_at=5), tmp_path / "ab.thist")
    with trainhist.open(tmp_path / "ab.thist") as h:
        found = {f.kind: f.text for f in triage(h).findings}
    assert "at step 5 (segment 1, run 'runB' [bbbbbbbb])" in found["first_nonfinite"]
    assert "all at step 5 (segment 1, run 'runB' [bbbbbbbb])" in found["nonfinite"]


def test_a_window_that_absorbed_a_skipped_update_is_said(tmp_path) -> None:
    """observed outranks skipped (spec 11.4): a 4-step window with one skipped update is observed, and triage said
    'no ... skipped steps or gaps found' of a coarsened file without step truth. It names those rows now."""
    from history_helpers import skipped_updates

    raw = skipped_updates(tmp_path / "r.thist", 8, (1, 5))
    trainhist.coarsen(raw, tmp_path / "c.thist", steps=4)
    with trainhist.open(tmp_path / "c.thist") as h:
        t = triage(h)
    [f] = [f for f in t.findings if f.kind == "rows_partly_skipped"]
    assert f.step == 0 and "2 observed rows of 1 site/phase pair" in f.text and "steps 0–3" in f.text
    assert "no non-finite values" not in t.format()


def test_a_resume_of_runs_pooled_across_runs_is_a_resume_not_another_run(tmp_path, capsys) -> None:
    """Runs A and B merged with --across-runs, B resumed at step 4: segment 1 holds B alone, after segment 0 of A+B.
    Triage called it 'run B (another run) ... kept apart (no --across-runs), not a resume', and info counted its
    steps as 'in segments of different runs'; segments that share a run continue each other."""
    from trainhist.cli import main

    for name, rid, parts in (("A", "a" * 32, [(0, 10)]), ("B", "b" * 32, [(0, 6), (4, 12)])):
        for i, (lo, hi) in enumerate(parts):
            with trainhist.HistoryWriter(tmp_path / name, run_id=rid, run_name=name, mode="a" if i else "w") as w:
                s = w.site("x", "activation")
                for st in range(lo, hi):
                    w.observe(s, st, np.ones(2))
                    w.step_truth(st, applied=True)
    trainhist.merge([tmp_path / "A", tmp_path / "B"], tmp_path / "ABx", across_runs=True)
    with trainhist.open(tmp_path / "ABx") as h:
        texts = " | ".join(f.text for f in triage(h).findings)
    assert "another run" not in texts and "segment 1 (resume) starts at step 4" in texts
    assert main(["info", str(tmp_path / "ABx")]) == 0
    [steps] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("steps")]
    assert "again in a later segment" in steps and "different runs" not in steps


def test_the_report_escapes_the_files_name_and_counts_one_more_finding_as_one(tmp_path) -> None:
    """A newline in the file's name split the report's first line; one finding left out read '1 more findings'."""
    p = _nan_and_failed(tmp_path / "a\nb.thist")
    with trainhist.open(p) as h:
        report = triage(h)
    assert len(report.findings) >= 2
    text = report.format(limit=len(report.findings) - 1)
    assert text.splitlines()[0] == f"triage of {tmp_path}/a\\nb.thist:"
    assert text.splitlines()[-1] == "  ... 1 more finding"
