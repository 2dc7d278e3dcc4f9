"""Real crashes: a child process writing a history is killed with SIGKILL (spec/crash-safety.md, first row).

The child records three activation sites (with a mark() gap), a scalar and step truth, starts a new segment every 7
steps and commits after every step, printing ``C <step>`` (flushed) once ``commit()`` has returned. The parent
kills it right after it printed a chosen line (a committed step, the start of a ``new_segment``, of the file's
creation, of ``close()``) and checks that the file reads ``clean`` or ``torn``, that ``verify()`` passes, that every
step the child reported committed is there with exactly the values written (and no other step but a contiguous
continuation of them), and that the file resumes (``mode="a"``) and then reads clean. The kill lands wherever the
child is when the signal arrives: the checks hold for every such moment, so the tests do not depend on timing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trainhist
from trainhist import HistoryWriter, summarize

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

SRC = str(Path(trainhist.__file__).resolve().parent.parent)
NSITES = 3

CHILD = r'''
import sys
import numpy as np
from trainhist import HistoryWriter

path, mode, start = sys.argv[1], sys.argv[2], int(sys.argv[3])

def values(step, k):
    rng = np.random.default_rng(step * 1000 + k)
    return (rng.standard_normal(16 + step % 7) * (1 + step)).astype(np.float32)

def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

say("OPEN")
w = HistoryWriter(path, mode=mode, run_name="kill", commit_every=10**9, commit_seconds=1e18)
sites = [w.site(f"layer.{k}", "activation", dtype="float32") for k in range(NSITES)]
step = start
while step < start + 40:
    if step % 7 == 5:
        say(f"SEG {step}")
        w.new_segment(step, reason="manual")
    for k, s in enumerate(sites):
        if (step + k) % 5 == 4:
            w.mark(s, step, "failed")
        else:
            w.observe(s, step, values(step, k))
    w.scalar("loss", step, 1.0 / (step + 1))
    w.step_truth(step, applied=step % 3 != 0, tokens=step * 10)
    w.commit()
    say(f"C {step}")
    step += 1
say("CLOSING")
w.close()
say("CLOSED")
'''.replace("NSITES", str(NSITES))


def _values(step: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(step * 1000 + k)
    return (rng.standard_normal(16 + step % 7) * (1 + step)).astype(np.float32)


def _run_and_kill(tmp_path: Path, path: Path, mode: str, start: int, kill_after: str | None) -> list[str]:
    """Run the child; SIGKILL it as soon as it printed a line starting with ``kill_after`` (None: let it finish).
    Returns every line it printed."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, str(script), str(path), mode, str(start)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, text=True)
    lines = []
    assert p.stdout is not None
    for line in p.stdout:
        lines.append(line.strip())
        if kill_after is not None and line.startswith(kill_after):
            p.send_signal(signal.SIGKILL)
            break
    rest, err = p.communicate()
    lines += rest.split()
    if kill_after is None or not any(x.startswith(kill_after) for x in lines):
        assert p.returncode == 0, err
    else:
        assert p.returncode in (-signal.SIGKILL, 0), err
    return lines


def _reported(lines: list[str]) -> int:
    """The last step the child reported committed (-1: none)."""
    steps = [int(x.split()[1]) for x in lines if x.startswith("C ")]
    return max(steps, default=-1)


def _check(path: Path, must_have: int) -> tuple[str, int]:
    """Check the file as the module docstring says; returns its outcome and last step (-1: none)."""
    with trainhist.open(path) as h:
        status = h.recovery.status
        assert status in ("clean", "torn"), h.recovery
        assert h.recovery.committed_bytes + h.recovery.dropped_bytes == path.stat().st_size
        h.verify()
        t = h.steps
        steps = t["step"].tolist()
        assert steps == list(range(len(steps))), steps
        last = len(steps) - 1
        assert last >= must_have, (last, must_have, h.recovery.describe())
        assert t["tokens"].tolist() == [10 * s for s in steps]
        assert t["applied"].tolist() == [1 if s % 3 else 2 for s in steps]
        if not h.sites:
            assert last == -1
            return status, last
        for k in range(NSITES):
            sp = h.spine(f"layer.{k}", "activation")
            assert sp.step.tolist() == steps
            for i, s in enumerate(steps):
                if (s + k) % 5 == 4:
                    assert sp.presence_names[i] == "failed"
                    continue
                want = summarize(_values(s, k))
                assert sp.presence_names[i] == "observed"
                assert (sp.count[i], sp.min[i], sp.max[i]) == (want.count, want.min, want.max)
                assert sp.sum_exact(i) == want.sum and sp.sumsq_exact(i) == want.sumsq
        loss = h.spine("loss", "scalar")
        assert loss.step.tolist() == steps and loss.max.tolist() == [1.0 / (s + 1) for s in steps]
        assert all(g.first_step % 7 == 5 for g in h.segments if g.reason == "manual")
        return status, last


def _resume_and_check(path: Path, last: int) -> None:
    """Append a few steps to the recovered file in this process; it then reads clean, with every step."""
    with HistoryWriter(path, mode="a", commit_every=10**9, commit_seconds=1e18) as w:
        sites = [w.site(f"layer.{k}", "activation", dtype="float32") for k in range(NSITES)]
        for step in range(last + 1, last + 4):
            if step % 7 == 5:
                w.new_segment(step, reason="manual")
            for k, s in enumerate(sites):
                if (step + k) % 5 == 4:
                    w.mark(s, step, "failed")
                else:
                    w.observe(s, step, _values(step, k))
            w.scalar("loss", step, 1.0 / (step + 1))
            w.step_truth(step, applied=step % 3 != 0, tokens=step * 10)
    status, end = _check(path, last + 3)
    assert status == "clean" and end == last + 3


@pytest.mark.parametrize("kill_after", ["C 0", "C 3", "SEG 5", "C 9", "SEG 12"])
def test_a_writer_killed_after_a_commit_loses_no_reported_step_and_resumes(tmp_path: Path, kill_after: str) -> None:
    p = tmp_path / "run.thist"
    lines = _run_and_kill(tmp_path, p, "w", 0, kill_after)
    _, last = _check(p, _reported(lines))
    _resume_and_check(p, last)


@pytest.mark.parametrize("kill_after", ["OPEN", "CLOSING"])
def test_a_writer_killed_while_it_creates_or_closes_the_file(tmp_path: Path, kill_after: str) -> None:
    p = tmp_path / "run.thist"
    lines = _run_and_kill(tmp_path, p, "w", 0, kill_after)
    if not p.exists():  # (killed before it created the file)
        assert kill_after == "OPEN"
        return
    _, last = _check(p, _reported(lines))
    assert kill_after == "OPEN" or last >= 39
    _resume_and_check(p, last)


def test_a_resumed_writer_killed_again_keeps_both_sessions(tmp_path: Path) -> None:
    p = tmp_path / "run.thist"
    first = _run_and_kill(tmp_path, p, "w", 0, "C 2")
    _, last = _check(p, _reported(first))
    second = _run_and_kill(tmp_path, p, "a", last + 1, f"C {last + 3}")
    _, last2 = _check(p, _reported(second))
    assert last2 >= last + 3
    with trainhist.open(p) as h:
        assert len(h.writers) >= 2 and h.segments[-1].previous is not None
    _resume_and_check(p, last2)
