"""Kill a training process with SIGKILL mid-run, resume it from its checkpoint, and read both segments back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np

import trainhist

TRAIN = textwrap.dedent("""
    import os, sys, time, torch
    from trainhist.torch import Collector
    path, ckpt, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start, mode = 0, "w"
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
        start, mode = int(state["step"]) + 1, "a"
    col = Collector(model, path, mode=mode, fsync="commit", commit_every=1, every=1, sketch_every=10)
    col.attach(optimizer=opt)
    for step in range(start, last + 1):
        with col.step(step):
            model(torch.randn(3, 4)).square().mean().backward()
            opt.step(); opt.zero_grad()
            time.sleep(0.02)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
        print(f"committed {step}", flush=True)
        time.sleep(0.02)
    col.close()
""")


def test_sigkill_then_resume_starts_a_new_segment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    path, ckpt = str(tmp_path / "run.thist"), str(tmp_path / "ckpt.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.Popen([sys.executable, str(script), path, ckpt, "1000"], env=env, stdout=subprocess.PIPE,
                         text=True)
    committed = -1
    for line in p.stdout:
        committed = int(line.split()[1])
        if committed >= 5:
            break
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    p.stdout.close()
    assert committed >= 5
    r = subprocess.run([sys.executable, str(script), path, ckpt, "12"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    resumed_at = int(r.stdout.split()[1])
    assert committed + 1 <= resumed_at

    h = trainhist.open(path)
    segs = h.segments
    assert len(segs) == 2 and segs[1].first_step == resumed_at and segs[1].previous == segs[0].id
    sp = h.spine("0.weight", "param")
    steps0 = sp.step[sp.segment == segs[0].id]
    steps1 = sp.step[sp.segment == segs[1].id]
    assert set(range(committed + 1)) <= set(steps0.tolist())  # nothing committed before the kill was lost
    np.testing.assert_array_equal(steps1, np.arange(resumed_at, 13))
    t = h.steps
    assert set(t["step"][t["segment"] == segs[1].id].tolist()) == set(range(resumed_at, 13))


def test_a_resume_whose_sample_changed_is_refused_once_per_site(tmp_path, monkeypatch) -> None:
    """A run resumed with another delta_elements: its param_delta sites are declared in the file with the first
    sample, and the writer refuses them (site_redeclared, spec 2.2). The collector says so once, naming the cause,
    and asks the writer once per site; it called site() again at every step (an exception per site per step), and
    warned that writing the file failed."""
    import warnings

    import torch

    from trainhist.torch import Collector

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "r.thist"

    def session(delta: int, first: int) -> tuple[Collector, list[str]]:
        col = Collector(model, path, every=1, delta_elements=delta, mode="w" if first == 0 else "a")
        col.attach(optimizer=opt)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            for step in range(first, first + 4):
                with col.step(step):
                    model(torch.randn(4, 16)).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
            col.close()
        return col, [str(w.message) for w in ws if "trainhist" in str(w.message) and "appended" not in str(w.message)]

    session(8, 0)
    calls: list[tuple] = []
    site = trainhist.HistoryWriter.site
    monkeypatch.setattr(trainhist.HistoryWriter, "site",
                        lambda self, *a, **k: calls.append((a, k.get("sample"))) or site(self, *a, **k))
    col, said = session(12, 4)
    assert col.writer_errors == 0
    assert len(said) == 1 and "site_redeclared" in said[0] and "failed" not in said[0], said
    refused = [a for a, sample in calls if a[1] == "param_delta" and sample is not None]
    assert len(refused) == len({a[0] for a in refused}) == 3, refused  # (each once; 1.bias, 2 elements: whole)
    with trainhist.open(path) as h:
        assert h.spine("0.weight", "param_delta").columns["step"].tolist() == [0, 1, 2, 3]
        assert h.spine("0.weight", "param").columns["step"].tolist() == list(range(8))
        assert h.spine("1.bias", "param_delta").columns["step"].tolist() == list(range(8))
