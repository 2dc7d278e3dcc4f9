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


def test_demo_refuses_to_replace_a_file_it_did_not_write(tmp_path, capsys):
    """`trainhist demo --out FILE` opened FILE with mode="w": another run's history (or any file) was truncated
    unasked. It is refused (exit 2, the file untouched) unless it is a history an earlier demo wrote, or --force."""
    import pytest

    from trainhist import cli
    from trainhist.errors import UsageError

    other = tmp_path / "mine.thist"
    with trainhist.HistoryWriter(other, run_name="mine") as w:
        w.observe(w.site("x", "activation"), 0, np.ones(3))
    text = tmp_path / "notes.txt"
    text.write_text("not a history")
    before = other.read_bytes()
    small = ["--steps", "1", "--batch", "1", "--micro-batches", "1", "--no-figures"]
    for path, why in ((other, "run 'mine'"), (text, "not a readable trainhist history")):
        with pytest.raises(UsageError) as e:
            demo.main(["--out", str(path), *small])
        assert e.value.code == "out_exists" and why in str(e.value) and "--force" in str(e.value)
        assert cli.main(["demo", "--out", str(path), *small]) == 2
        assert "[out_exists]" in capsys.readouterr().err
    assert other.read_bytes() == before and text.read_text() == "not a history"
    out = tmp_path / "d.thist"  # the demo's own history is replaced (`make demo` twice)
    for _ in range(2):
        assert demo.main(["--out", str(out), *small]) == 0
    assert demo.main(["--out", str(other), "--force", *small]) == 0
    with trainhist.open(other) as h:
        assert h.run["name"] == demo.RUN_NAME and "force" not in h.run["config"]


def test_demo_refuses_counts_below_one(tmp_path, capsys):
    """--steps 0 or -3 ended in an IndexError traceback, --batch 0 in a RuntimeError, --micro-batches 0 ran; each
    is refused as usage (exit 2) naming the flag, and so is a --inject-nan step the demo does not train."""
    import pytest

    for flag, value in (("--steps", "0"), ("--steps", "-3"), ("--batch", "0"), ("--micro-batches", "0"),
                        ("--steps", "x"), ("--inject-nan", "-1"), ("--inject-nan", "5")):
        with pytest.raises(SystemExit) as e:
            demo.main(["--out", str(tmp_path / "d.thist"), "--steps", "5", flag, value, "--no-figures"])
        assert e.value.code == 2
        assert f"argument {flag}" in capsys.readouterr().err
    assert not (tmp_path / "d.thist").exists()


def test_demo_counts_the_sites_as_info_does(tmp_path, capsys):
    """The demo said 152 sites (the plan's) where `trainhist info` and `verify` say 155 (the run-level scalars
    too): it counts the file's sites, and says what they are."""
    from trainhist import cli

    out = tmp_path / "d.thist"
    assert demo.main(["--out", str(out), "--steps", "1", "--batch", "1", "--no-figures"]) == 0
    text = capsys.readouterr().out
    with trainhist.open(out) as h:
        n, scalars = len(h.sites), sum(s.stream == "scalar" for s in h.sites)
    assert f"{n} sites: {n - scalars} tensor sites and {scalars} run-level scalars" in text
    assert "1 step (2 micro-batches each)" in text
    assert cli.main(["info", str(out)]) == 0
    assert f"sites     {n}\n" in capsys.readouterr().out


def test_demo_refuses_a_seed_torch_cannot_take(tmp_path, capsys):
    """--seed 2^64 (or below -2^63) ended in a ValueError traceback from torch.manual_seed after the options were
    accepted; a seed outside 0 .. 2^64 - 1 is refused as usage (exit 2) naming the flag and the range."""
    import pytest

    for value in (str(1 << 64), "-1", "99999999999999999999999"):
        with pytest.raises(SystemExit) as e:
            demo.main(["--out", str(tmp_path / "d.thist"), "--steps", "1", "--seed", value, "--no-figures"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --seed" in err and f"0..{(1 << 64) - 1}" in err and value in err
    assert not (tmp_path / "d.thist").exists()
    assert demo.main(["--out", str(tmp_path / "d.thist"), "--steps", "1", "--batch", "1", "--micro-batches", "1",
                      "--seed", str((1 << 64) - 1), "--no-figures"]) == 0


def test_demo_refuses_an_out_it_cannot_place_before_training(tmp_path, capsys):
    """--out '' said "[not_found] : ... the folder /tmp exists" (the parent of the working directory), exit 1; a
    directory was refused with advice to pass --force, which then failed with not_a_file; a path under a file
    ended in "[io_error] ...: File exists"; and a file where the figures/ folder goes failed only after training.
    Each is refused as usage (exit 2) before training, naming the path and what to pass instead."""
    from trainhist import cli

    def run(argv: list[str]) -> int:
        try:
            return cli.main(argv)
        except SystemExit as e:  # (argparse's usage errors)
            return e.code

    (tmp_path / "a_dir").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "figures").write_text("a file where the figures go")
    small = ["--steps", "1", "--batch", "1", "--micro-batches", "1"]
    cases = (([""], "expected a file path", ""),
             ([str(tmp_path / "a_dir")], "a directory is there", "--force"),
             ([str(tmp_path / "a_dir"), "--force"], "a directory is there", "--force"),
             ([str(tmp_path / "notes.txt" / "d.thist")], "notes.txt is a file, not a folder, so --out", ""),
             ([str(tmp_path / "sub" / "d.thist")], "--no-figures", ""))
    for out, said, unsaid in cases:
        assert run(["demo", *small, "--out", *out]) == 2, out
        captured = capsys.readouterr()
        assert said in captured.err and "Traceback" not in captured.err, (out, captured.err)
        assert not unsaid or unsaid not in captured.err, (out, captured.err)
        assert "trained" not in captured.out
    assert not (tmp_path / "sub" / "d.thist").exists() and (tmp_path / "notes.txt").read_text() == "x"
    assert run(["demo", *small, "--out", str(tmp_path / "sub" / "d.thist"), "--no-figures"]) == 0
    (tmp_path / "link.thist").symlink_to(tmp_path / "target.thist")  # (a link to nothing: --force writes through)
    assert run(["demo", *small, "--out", str(tmp_path / "link.thist"), "--no-figures", "--force"]) == 0
    assert (tmp_path / "target.thist").is_file()


def test_demo_prints_a_path_with_a_newline_escaped(tmp_path, capsys, monkeypatch):
    """--out 'a<newline>b.thist' split the demo's 'history:' and 'figures:' lines in two (the other commands print
    such a path escaped, as `a\\nb.thist`)."""
    monkeypatch.chdir(tmp_path)
    assert demo.main(["--out", "d\nx/a\nb.thist", "--steps", "1", "--batch", "1", "--micro-batches", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.startswith("history: d\\nx/a\\nb.thist (") for ln in lines), lines
    assert any(ln.startswith("figures: ") and ln.endswith(" in d\\nx/figures") for ln in lines), lines


def test_demo_replaces_the_history_of_an_earlier_demo_that_was_killed(tmp_path):
    """A demo killed while training (SIGKILL, out of memory) left a file whose run manifest was never committed
    (the demo's only commit was at the end), so the next `trainhist demo` refused to replace it ("nothing says
    the demo wrote it") and asked for --force. The demo commits its manifests before training."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "d.thist"
    src = str(Path(trainhist.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    killed = ("import os, sys\nfrom trainhist.torch import demo\n"
              "demo.StepTruth = lambda **kw: os._exit(9)  # (dies at its first step, as a SIGKILL leaves it)\n"
              "demo.main(sys.argv[1:])\n")
    r = subprocess.run([sys.executable, "-c", killed, "--out", str(out), "--steps", "3", "--batch", "1",
                        "--no-figures"], env=env, capture_output=True, text=True)
    assert r.returncode == 9 and out.exists(), r.stderr
    with trainhist.open(out) as h:
        assert h.run is not None and h.run["name"] == demo.RUN_NAME
    assert demo.main(["--out", str(out), "--steps", "1", "--batch", "1", "--micro-batches", "1",
                      "--no-figures"]) == 0


def test_demo_says_what_to_do_when_its_figures_cannot_be_written(tmp_path, monkeypatch, capsys):
    """A figures/ folder the demo may not write to (read-only, a full disk) ended, after training, in "[io_error]
    .../contact_sheet_p1.png: Operation not permitted"; it is output_unwritable (exit 1), saying the history is
    complete and to pass another --out or --no-figures."""
    import errno

    import pytest

    from trainhist import cli

    figures = pytest.importorskip("trainhist.figures")

    def refused(h: object, out_dir: object, **kwargs: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(out_dir) + "/contact_sheet_p1.png")

    monkeypatch.setattr(figures, "contact_sheet", refused)
    out = tmp_path / "d.thist"
    assert cli.main(["demo", "--out", str(out), "--steps", "1", "--batch", "1", "--micro-batches", "1"]) == 1
    err = capsys.readouterr().err
    assert "[output_unwritable]" in err and "contact_sheet_p1.png" in err and "Traceback" not in err, err
    assert "the history is complete" in err and "--no-figures" in err, err
    with trainhist.open(out) as h:
        assert h.recovery.status == "clean"


def test_demo_help_ends_with_its_exit_statuses(capsys):
    """`trainhist demo --help` said nothing of its exit statuses, which every other command's help now gives."""
    import pytest

    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    assert "Exit status: 0 trained, written and triaged;" in text, text
    assert "2 bad usage" in text and "130 interrupted" in text, text
