"""The collector around a real training loop when things go wrong: a full disk, a collector left open, parameters
replaced between steps."""

from __future__ import annotations

import dataclasses
import errno
import threading
import warnings

import numpy as np
import pytest
import torch

import trainhist
from trainhist.errors import UsageError
from trainhist.torch import Collector


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


class FillingDisk:
    """The writer's file, whose writes and flushes fail with ENOSPC while ``full``."""

    def __init__(self, f: object) -> None:
        self.f, self.full = f, False

    def write(self, b: bytes) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(b)

    def flush(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.f.flush()

    def __getattr__(self, name: str) -> object:
        return getattr(self.f, name)


def train(col: Collector | None, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range,
          at: dict | None = None) -> list[float]:
    """A plain loop; ``at[step]()`` runs before that step (the disk fills, space comes back)."""
    losses = []
    for s in steps:
        if at and s in at:
            at[s]()
        g = torch.Generator().manual_seed(s)
        x = torch.randn(3, 4, generator=g)
        with col.step(s) if col is not None else torch.enable_grad():
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        if col is not None:
            col.scalars(s, loss=loss)
        losses.append(loss.item())
    return losses


def test_a_full_disk_warns_once_what_is_kept_and_how_to_go_on_and_the_history_continues_after(tmp_path):
    """The disk fills mid-run, then space comes back: training runs on unchanged; one warning says the file keeps
    every commit before the failure, that nothing more is recorded, and how to go on; the file reads clean up to its
    last commit; close() then a new Collector on the path continues it as a new segment."""
    path = tmp_path / "full.thist"
    ref_model = mlp()
    ref = train(None, ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), range(8))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, path, mode="w", commit_every=2).attach(optimizer=opt)
    disk: list[FillingDisk] = []

    def fill() -> None:
        disk.append(FillingDisk(col._writer._f))
        col._writer._f = disk[0]
        disk[0].full = True

    def free() -> None:
        disk[0].full = False

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(col, model, opt, range(8), {5: fill, 7: free})
        col.close()
    assert losses == ref  # training unchanged
    said = [str(w.message) for w in caught if "No space left" in str(w.message)]
    assert len(said) == 1, said
    msg = said[0]
    assert "last commit" in msg and "records nothing more" in msg and "close()" in msg and "new Collector" in msg
    assert col.writer_errors >= 1
    h = trainhist.open(path)
    assert h.recovery.status == "clean"
    assert h.spine("0.weight", "param").step.tolist() == [0, 1, 2, 3]  # committed after steps 1 and 3
    assert h.steps["step"].tolist() == [0, 1, 2, 3]

    col2 = Collector(model, path, commit_every=2).attach(optimizer=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(col2, model, opt, range(8, 10))
        col2.close()
    h = trainhist.open(path)
    segs = h.segments
    assert [(g.first_step, g.reason, g.previous) for g in segs] == [(0, "start", None), (8, "resume", segs[0].id)]
    sp = h.spine("0.weight", "param")
    assert sp.step.tolist() == [0, 1, 2, 3, 8, 9]
    assert sp.segment.tolist() == [segs[0].id] * 4 + [segs[1].id] * 2


def test_a_collector_left_open_in_this_process_is_named_when_another_opens_its_file(tmp_path):
    """``del col`` does not close a collector (the model's hooks hold it) and its writer keeps the file's lock: a
    second Collector on the same path says so, and how to release it, not 'give each process its own file'."""
    path = tmp_path / "left.thist"
    model = mlp()
    col = Collector(model, path, mode="w").attach()
    with col.step(0):
        model(torch.randn(2, 4)).sum().backward()
    col2 = Collector(model, path)
    with pytest.raises(UsageError, match=r"earlier in this process.*close\(\)") as e:
        col2.attach()
    assert e.value.code == "file_in_use"
    col.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the resume warning)
        col2.attach()
        with col2.step(1):
            model(torch.randn(2, 4)).sum().backward()
        col2.close()
    h = trainhist.open(path)
    assert h.spine("0", "activation").step.tolist() == [0, 1]


def test_attach_after_load_state_dict_assign_does_not_warn_that_followed_parameters_are_lost(tmp_path):
    """Parameters replaced by tensors of the same shape, dtype and device (``load_state_dict(assign=True)``) are
    followed at the next step: attach() in between does not also warn that the sites record the old tensors."""
    model = mlp()
    col = Collector(model, tmp_path / "p.thist", mode="w")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col.attach(optimizer=opt)
    with col.step(0):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    model.load_state_dict({k: v.clone() for k, v in mlp(1).state_dict().items()}, assign=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        col.attach(optimizer=opt)
        with col.step(1):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    said = [str(w.message) for w in caught]
    assert not any("would record the old tensors" in m for m in said), said
    assert any("record the new ones" in m for m in said), said
    col.close()
    h = trainhist.open(tmp_path / "p.thist")
    assert h.spine("0.weight", "param").max[1] == model[0].weight.max().item()


def _on_cpu_kernel(path):
    """An MLP, its SGD and a collector writing ``path``, on the CPU kernel's path (else the test is skipped)."""
    import trainhist.torch.collector as cm

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, path, mode="w").attach(optimizer=opt)
    if col._ledger.device.type != "cpu" or cm._reduction.CPU_METHOD != "fused":
        col.close()
        pytest.skip("the CPU kernel's path")
    return model, opt, path, col


@pytest.mark.parametrize("breaks", ["batch", "one"])
def test_a_batched_reduction_that_raises_fails_its_sites_and_training_goes_on(tmp_path, monkeypatch, breaks):
    """Parameters, gradients and updates are reduced by one compiled call per stream on the CPU: when that call
    raises ('batch'), its sites record 'failed' at that step, nothing raises into the loop and training is
    unchanged; when reading one tensor's memory raises ('one'), that site alone is 'failed'."""
    import trainhist.torch.collector as cm

    ref_model = mlp()
    ref = train(None, ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), range(3))
    model, opt, path, col = _on_cpu_kernel(tmp_path / "r.thist")
    bias = model[0].bias
    real_many, real_ats, real_at = cm.fused_many_at, cm.fusable_ats, cm.fusable_at

    def broken_many(*a, **k):
        raise RuntimeError("boom")

    def broken_ats(tensors):
        if any(t.data_ptr() == bias.data_ptr() for t in tensors):
            raise RuntimeError("boom")
        return real_ats(tensors)

    def broken_at(t):
        if t.data_ptr() == bias.data_ptr():
            raise RuntimeError("boom")
        return real_at(t)

    def fail() -> None:
        if breaks == "batch":
            monkeypatch.setattr(cm, "fused_many_at", broken_many)
        else:
            monkeypatch.setattr(cm, "fusable_ats", broken_ats)
            monkeypatch.setattr(cm, "fusable_at", broken_at)

    def mend() -> None:
        monkeypatch.setattr(cm, "fused_many_at", real_many)
        monkeypatch.setattr(cm, "fusable_ats", real_ats)
        monkeypatch.setattr(cm, "fusable_at", real_at)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(col, model, opt, range(3), {1: fail, 2: mend})
        col.close()
    assert losses == ref and all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    assert any("recorded as 'failed'" in str(w.message) for w in caught)
    h = trainhist.open(path)
    for name in ("0.weight", "0.bias", "2.weight"):
        for stream in ("param", "param_grad"):
            got = h.spine(name, stream).presence_names
            bad = breaks == "batch" or (name, stream) == ("0.bias", "param")  # (its gradient: other memory)
            assert got == ["observed", "failed" if bad else "observed", "observed"], (name, stream, got)
    assert h.spine("0", "activation").presence_names == ["observed"] * 3


def test_a_kernel_that_writes_nothing_for_one_site_fails_that_site_alone(tmp_path, monkeypatch):
    """A reduction that returns without writing its row (a kernel bug: the row's counts then say zeros, its min and
    max are unset) is caught when the step's rows are decoded: that site records 'failed' at that step, with a
    warning naming it, and every other site's row of the step is written (the writer, which refuses a row no
    tensor could give, never sees it: it would refuse the step's whole table)."""
    import trainhist.torch.collector as cm

    model, opt, path, col = _on_cpu_kernel(tmp_path / "k.thist")
    real = cm.fused_at
    target = ("activation", "1", None, "default")

    def writes_nothing_for_target(address, n, dt, row_address, sketch):
        if target in col._ledger.rows and row_address == col._ledger.address(target):
            return
        real(address, n, dt, row_address, sketch)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(col, model, opt, range(3), {1: lambda: monkeypatch.setattr(cm, "fused_at", writes_nothing_for_target),
                                          2: lambda: monkeypatch.setattr(cm, "fused_at", real)})
        col.close()
    said = [str(w.message) for w in caught]
    assert any("decoding '1' (activation) failed" in m and "min <= max" in m for m in said), said
    assert not any("writing" in m for m in said), said
    h = trainhist.open(path)
    assert h.spine("1", "activation").presence_names == ["observed", "failed", "observed"]
    for name, stream in [("0", "activation"), ("2", "activation"), ("1", "activation_grad"),
                         ("0.weight", "param"), ("0.weight", "param_grad"), ("2.bias", "param_delta")]:
        assert h.spine(name, stream).presence_names == ["observed"] * 3, (name, stream)


def test_a_fault_shared_by_every_site_warns_a_few_times_not_once_a_site(tmp_path, monkeypatch):
    """Every activation of a 40-layer model fails to reduce (a fault they share): the first five sites are named
    in a warning each, one more says the others are recorded 'failed' too; every one of them is 'failed' in the
    file, and the parameters' rows (another path) are not."""
    import trainhist.torch.collector as cm

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(40)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "many.thist"
    col = Collector(model, path, mode="w", streams=("activation", "param")).attach(optimizer=opt)

    def broken(*a, **k):
        raise RuntimeError("a fault every site shares")

    monkeypatch.setattr(cm, "fused_at", broken)
    monkeypatch.setattr(cm, "fused_into", broken)
    monkeypatch.setattr(cm, "reduce_into", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(col, model, opt, range(2))
        col.close()
    said = [str(w.message) for w in caught if "trainhist:" in str(w.message)]
    named = [m for m in said if m.startswith("trainhist: reducing")]
    assert len(named) == 5 and all("a fault every site shares" in m for m in named), said
    assert sum("more than 5 sites failed this way (reduce)" in m for m in said) == 1, said
    assert len(said) == 6, said
    h = trainhist.open(path)
    for i in range(40):
        assert h.spine(str(i), "activation").presence_names == ["failed", "failed"], i
    assert h.spine("39.weight", "param").presence_names == ["observed", "observed"]


@pytest.mark.parametrize("path", ["table", "summary"])
def test_a_row_the_writer_refuses_fails_its_site_alone(tmp_path, monkeypatch, path):
    """Should a decoded row still break spec 5.5 (the decode checks the writer's rules first, so it should not),
    the writer refuses it (``bad_table`` for the step's spine table, ``bad_summary`` for one Summary): that site
    records 'failed' at that step with a warning naming it, every other site its row, and no writer error is
    reported. Here 0.weight's rows (the only ones of 32 values) come out of the decode with min = +inf."""
    import trainhist.torch.collector as cm
    from trainhist.summary import Summary
    from trainhist.torch.reduce import DecodedRows

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    file = tmp_path / "r.thist"
    col = Collector(model, file, mode="w").attach(optimizer=opt)
    real_table, real_rows = DecodedRows.spine_table, cm.decode_rows

    def bad_table(self, rows, sketch=False):
        t = real_table(self, rows, sketch)
        return dataclasses.replace(t, min=np.where(np.asarray(t.count) == 32, np.inf, t.min))

    def no_arrays(*a, **k):
        raise RuntimeError("every row by the per-row path")

    def bad_rows(data, offsets, counts, sketches):
        return [Summary(count=32, min=np.inf, max=1.0) if n == 32 else s
                for n, s in zip(counts, real_rows(data, offsets, counts, sketches))]

    def spoil() -> None:
        if path == "table":
            monkeypatch.setattr(DecodedRows, "spine_table", bad_table)
        else:
            monkeypatch.setattr(cm, "decode_arrays", no_arrays)
            monkeypatch.setattr(cm, "decode_rows", bad_rows)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(col, model, opt, range(3), {1: spoil, 2: monkeypatch.undo})
        col.close()
    said = [str(w.message) for w in caught]
    assert any("refused the row of '0.weight'" in m and "recorded as 'failed'" in m for m in said), said
    assert not any("writing" in m for m in said), said
    assert col.writer_errors == 0
    h = trainhist.open(file)
    for stream in ("param", "param_grad", "param_delta"):
        assert h.spine("0.weight", stream).presence_names == ["observed", "failed", "observed"], stream
    for name, stream in [("0", "activation"), ("1", "activation_grad"), ("0.bias", "param"), ("2.weight", "param")]:
        assert h.spine(name, stream).presence_names == ["observed"] * 3, (name, stream)


NOT_CLOSED = """
import sys, torch
from trainhist.torch import Collector
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
col = Collector(m, sys.argv[1], mode="w", commit_every=3).attach(optimizer=opt)
for s in range(5):
    with col.step(s):
        loss = m(torch.randn(2, 4)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    col.scalars(s, loss=loss)  # (after its step: read at the next step's transfer, or at close)
raise RuntimeError("the training script crashed")
"""


def test_a_process_that_ends_without_close_keeps_its_finished_steps(tmp_path):
    """A script that dies of an exception after its steps (never reaching close()) keeps every finished step, not
    only those of its last commit, and the scalars given after the last step: the collector is closed when the
    interpreter exits."""
    import subprocess
    import sys

    script = tmp_path / "crash.py"
    script.write_text(NOT_CLOSED)
    path = tmp_path / "crash.thist"
    r = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 1 and "the training script crashed" in r.stderr
    h = trainhist.open(path)
    assert h.recovery.status == "clean"
    assert h.spine("0.weight", "param").step.tolist() == [0, 1, 2, 3, 4]  # (committed after step 2, then at exit)
    assert h.spine("loss", "scalar").step.tolist() == [0, 1, 2, 3, 4]  # (step 4's: given after the last step)


def test_a_collector_dropped_with_its_model_keeps_its_finished_steps_and_a_forked_copy_writes_nothing(
        tmp_path, monkeypatch):
    """A collector garbage-collected without close() (its model dropped too) closes its writer, so the steps since
    the last commit are kept and the file is unlocked; the same in a forked child (another process id) leaves the
    parent's file alone."""
    import gc
    import os

    def run(path) -> Collector:
        model = mlp()
        col = Collector(model, path, mode="w", commit_every=100).attach()
        for s in range(3):
            with col.step(s):
                model(torch.randn(2, 4)).sum().backward()
        return col

    col = run(tmp_path / "fork.thist")
    size = os.path.getsize(tmp_path / "fork.thist")
    pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: pid + 1)  # (what a forked child sees)
    col._finalizer()
    monkeypatch.undo()
    assert os.path.getsize(tmp_path / "fork.thist") == size
    col.close()
    assert trainhist.open(tmp_path / "fork.thist").spine("0.weight", "param").step.tolist() == [0, 1, 2]

    run(tmp_path / "gc.thist")
    gc.collect()
    assert trainhist.open(tmp_path / "gc.thist").spine("0.weight", "param").step.tolist() == [0, 1, 2]
    col = Collector(mlp(), tmp_path / "gc.thist", mode="a").attach()  # (the file is not locked any more)
    col.close()


class Gate(torch.nn.Module):
    """Identity, whose forward waits for ``go`` once ``armed`` (after setting ``inside``): a training thread held
    inside a step, its first layer's output already reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.armed, self.inside, self.go = False, threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.inside.set()
            self.go.wait()
        return x


def test_close_from_another_thread_leaves_out_the_step_that_thread_is_in(tmp_path):
    """close() from another thread (the finalizer at interpreter exit, while a daemon thread trains) while a step
    is open there: that step's hooks may be reducing into the ledger, so none of its rows is read (no row of it is
    written, a warning says so); every finished step is written, with the tensor scalars given after it. The
    training thread then finishes its step without error, and nothing more is written."""
    torch.manual_seed(0)
    gate = Gate()
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), gate, torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    path = tmp_path / "threads.thist"
    col = Collector(m, path, mode="w").attach(optimizer=opt)
    errors: list[BaseException] = []

    def train() -> None:
        try:
            for s in range(4):
                gate.armed = s == 3
                with col.step(s):
                    loss = m(torch.randn(2, 4)).sum()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                if s < 3:
                    col.scalars(s, loss=loss)  # (a tensor: read at the next step's transfer, or at close)
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    t = threading.Thread(target=train)
    t.start()
    assert gate.inside.wait(60)
    with pytest.warns(RuntimeWarning, match="close\\(\\) ran in another thread while step 3 was open"):
        col.close()
    size = path.stat().st_size
    gate.go.set()
    t.join(60)
    assert not t.is_alive() and errors == []
    assert path.stat().st_size == size  # (the step ended in the training thread wrote nothing)
    h = trainhist.open(path)
    assert h.recovery.status == "clean"
    for site, stream in [("0", "activation"), ("0", "activation_grad"), ("0.weight", "param"),
                         ("0.weight", "param_grad")]:
        assert h.spine(site, stream).step.tolist() == [0, 1, 2], (site, stream)
    assert h.spine("loss", "scalar").step.tolist() == [0, 1, 2]


def test_close_from_another_thread_waits_for_a_step_that_thread_is_ending(tmp_path):
    """close() from another thread while the training thread is ending a step (reducing its parameters, writing
    its rows) waits for that to finish: the step is written whole, and nothing is written after the close."""
    torch.manual_seed(0)
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    path = tmp_path / "ending.thist"
    col = Collector(m, path, mode="w").attach(optimizer=opt)
    transfer, ending, go = col._transfer, threading.Event(), threading.Event()

    def held(st: object) -> None:
        if st.step == 2:  # type: ignore[attr-defined]
            ending.set()
            go.wait()
        transfer(st)

    col._transfer = held  # type: ignore[method-assign]

    def train() -> None:
        for s in range(3):
            with col.step(s):
                m(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()

    t = threading.Thread(target=train)
    t.start()
    assert ending.wait(60)
    closer = threading.Thread(target=col.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # (waiting for step 2 to end: it cannot go on before go is set below)
    go.set()
    t.join(60)
    closer.join(60)
    assert not t.is_alive() and not closer.is_alive()
    h = trainhist.open(path)
    assert h.recovery.status == "clean"
    for site, stream in [("0", "activation"), ("0.weight", "param"), ("0.weight", "param_grad")]:
        assert h.spine(site, stream).step.tolist() == [0, 1, 2], (site, stream)
    assert ("step_interrupted", "scalar", None) not in {x.key for x in h.sites}  # (step 2 ended whole)


def _close_in_step_1(path, n: int) -> tuple[Collector, object]:
    """Steps 0 and 1 of an MLP, with a signal handler calling close() at the ``n``-th point where it can run inside
    the collector's forward pre-hook (``_keep_last``) in step 1; the collector and the interrupter."""
    from interrupts import Interrupter

    torch.manual_seed(0)
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(m, path, mode="w").attach(optimizer=opt)
    at = Interrupter(n, col.close, function="_keep_last")
    for s in range(2):
        with col.step(s):
            if s == 1:
                with at:
                    out = m(torch.randn(2, 4))
                assert not at.where or (col._closed and m[0]._forward_hooks)  # (hooks removed when the step ends)
            else:
                out = m(torch.randn(2, 4))
            out.sum().backward()
            opt.step()
            opt.zero_grad()
    assert not at.where or not any(mod._forward_hooks or mod._forward_pre_hooks for mod in m.modules())
    return col, at


def test_close_from_a_signal_handler_inside_a_hook_leaves_the_forward_running(tmp_path):
    """A signal handler calling close() while the collector's forward pre-hook ran (at any point of it where a
    handler can run, in each module): close() removed the hooks there and then, and the pre-hook, iterating the
    module's hooks, raised 'OrderedDict mutated during iteration' into the training loop. Now the step so far is
    recorded, as interrupted, the forward goes on, and the hooks are removed when the step ends."""
    col, count = _close_in_step_1(tmp_path / "count.thist", 10**9)
    assert count.where is None and count.points >= 6
    col.close()
    for n in range(1, count.points + 1):
        path = tmp_path / f"{n}.thist"
        col, at = _close_in_step_1(path, n)
        assert col._closed and at.where is not None
        h = trainhist.open(path)
        assert h.recovery.status == "clean"
        assert h.spine("0", "activation").step.tolist() == [0, 1]  # (the first layer ran before any pre-hook)
        assert h.spine("step_interrupted", "scalar").step.tolist() == [1]


def _rows(path) -> dict[tuple, dict]:
    """Each row of the file by its identity (spec 2.8); a row twice fails."""
    from trainhist.dump import canonical

    rows: dict[tuple, dict] = {}
    for x in canonical(trainhist.open(path))["sites"]:
        for r in x["rows"]:
            ident = (x["path"], x["stream"], x["facet"], r["phase"], r["micro"], r["segment"], int(r["step"][2:]))
            assert ident not in rows, f"a row twice: {ident}"
            rows[ident] = r
    return rows


@pytest.mark.parametrize("then_exit", [False, True])
def test_close_from_a_signal_handler_while_a_step_is_written_writes_it_once(tmp_path, then_exit):
    """A signal handler calling close() (SIGTERM before a preemption) while the collector wrote the rows of the
    step just ended (here: the writer had checked them, not yet buffered them) ended that step again and wrote its
    rows, then the step's own writing went on: every row of the step was in the file twice, and a merge would have
    counted it twice. Now close() waits for the step's writing, also when the handler then raises SystemExit."""
    torch.manual_seed(0)
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    path = tmp_path / "signal.thist"
    col = Collector(m, path, mode="w").attach(optimizer=opt)
    fired = []

    def loop() -> None:
        for s in range(4):
            with col.step(s):
                m(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            if s == 0:
                w = col._writer
                row_step = w._row_step

                def handler_inside(step: int) -> int:  # (a signal handler runs between any two bytecodes)
                    if step == 2 and not fired:
                        fired.append(step)
                        col.close()
                        if then_exit:
                            raise SystemExit(0)
                    return row_step(step)

                w._row_step = handler_inside
            if col._closed:
                break

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no writer error either)
        if then_exit:
            with pytest.raises(SystemExit):
                loop()
        else:
            loop()
    assert fired == [2] and col._closed
    _rows(path)  # (no row twice)
    h = trainhist.open(path)
    assert h.recovery.status == "clean"
    assert h.spine("0", "activation").step.tolist()[:2] == [0, 1]
    if not then_exit:  # the step whose rows were being written: whole
        for site, stream in [("0", "activation"), ("0", "activation_grad"), ("0.weight", "param"),
                             ("0.weight", "param_grad")]:
            assert h.spine(site, stream).step.tolist() == [0, 1, 2], (site, stream)


def _interrupted_run(path, n: int, action: str) -> tuple[object, str | None]:
    """Train an MLP 4 steps with a collector (a commit after step 3, then close()), interrupted at the ``n``-th
    point from step 2 on where a signal handler can run (tests/interrupts.py): Ctrl-C (``ki``), or a SIGTERM
    handler that closes the collector and exits (``close_exit``). Then close() again, as the at-exit close does.
    Returns the interrupter and the exception the loop ended with (its type's name)."""
    from interrupts import Interrupter

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(m, path, mode="w").attach(optimizer=opt)

    def act() -> None:
        if action == "close_exit":
            col.close()
            raise SystemExit(0)
        raise KeyboardInterrupt

    at = Interrupter(n, act)
    ended = None
    try:
        for s in range(4):
            if s == 2:
                at.__enter__()
            with col.step(s):
                loss = m(torch.randn(2, 4)).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
            col.scalars(s, loss=loss)
            if s == 3:
                col.commit()
        col.close()
    except (KeyboardInterrupt, SystemExit) as e:
        ended = type(e).__name__
    finally:
        at.__exit__()
    col.close()
    return at, ended


@pytest.mark.parametrize("action", ["ki", "close_exit"])
def test_an_interrupt_anywhere_in_a_step_or_in_close_keeps_every_finished_step_and_writes_nothing_wrong(tmp_path,
                                                                                                      action):
    """Ctrl-C (or a SIGTERM handler that closes the collector and exits) at 80 points spread over step 2, step 3, a
    commit and close(): the loop ends with that exception and no other; after the close at exit the file reads
    clean, holds steps 0 and 1 whole and equal to an uninterrupted run's, never a row twice, and every observed
    activation or activation_grad row of step 2 equals the uninterrupted run's (a row is whole or missing)."""
    ref_at, ended = _interrupted_run(tmp_path / "ref.thist", 10**9, action)
    assert ended is None and ref_at.where is None and ref_at.points > 5000
    ref = _rows(tmp_path / "ref.thist")
    wheres = set()
    for n in range(1 + ref_at.points // 160, ref_at.points, ref_at.points // 80):
        p = tmp_path / f"{n}.thist"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a writer stopped by the interrupt says so)
            at, ended = _interrupted_run(p, n, action)
        assert ended == ("KeyboardInterrupt" if action == "ki" else "SystemExit"), (at.where, ended)
        wheres.add(at.where)
        assert trainhist.open(p).recovery.status == "clean", at.where
        rows = _rows(p)
        for ident, row in ref.items():
            stream, step = ident[1], ident[-1]
            if stream != "scalar" and step < 2:
                assert rows.get(ident) == row, (at.where, ident)
        for ident, row in rows.items():
            if ident[1] in ("activation", "activation_grad") and ident[-1] == 2 and row["presence"] == "observed":
                assert row == ref[ident], (at.where, ident)
    assert len(wheres) > 40  # (the points are spread over the code)


DAEMON_AT_EXIT = """
import sys, threading, torch
from trainhist.torch import Collector
torch.manual_seed(0)
inside = threading.Event()
class Gate(torch.nn.Module):
    armed = False
    def forward(self, x):
        if self.armed:
            inside.set()
            threading.Event().wait()  # (held inside step 3 until the interpreter ends)
        return x
gate = Gate()
m = torch.nn.Sequential(torch.nn.Linear(4, 8), gate, torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
col = Collector(m, sys.argv[1], mode="w", commit_every=100).attach(optimizer=opt)
def train():
    for s in range(10):
        gate.armed = s == 3
        with col.step(s):
            loss = m(torch.randn(2, 4)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        col.scalars(s, loss=loss)
threading.Thread(target=train, daemon=True).start()
inside.wait(60)
"""


def test_an_interpreter_that_exits_while_a_daemon_thread_is_inside_a_step_keeps_the_finished_steps(tmp_path):
    """The main thread ends while a daemon thread trains, inside step 3: the collector is closed at interpreter
    exit from the main thread, keeping steps 0-2 (none committed before) and their scalars, leaving out step 3,
    whose reductions the daemon thread may be making, and saying so."""
    import subprocess
    import sys

    script = tmp_path / "daemon.py"
    script.write_text(DAEMON_AT_EXIT)
    path = tmp_path / "daemon.thist"
    r = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "close() ran in another thread while step 3 was open" in r.stderr
    h = trainhist.open(path)
    assert h.recovery.status == "clean"
    assert h.spine("0", "activation").step.tolist() == [0, 1, 2]
    assert h.spine("0.weight", "param").step.tolist() == [0, 1, 2]
    assert h.spine("loss", "scalar").step.tolist() == [0, 1, 2]


KILLED_IN_COMMIT = """
import os, signal, sys, torch
from trainhist.framing import RecordType
from trainhist.torch import Collector
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
col = Collector(m, sys.argv[1], mode="w", commit_every=1).attach(optimizer=opt)
for s in range(10):
    if s == 4:  # killed inside step 4's commit: its data records are in the file, its commit record is not
        w = col._writer
        record = w._record

        def dying(rtype, *a, **k):
            if rtype == RecordType.COMMIT:
                w._f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return record(rtype, *a, **k)

        w._record = dying
    with col.step(s):
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
"""


def test_killed_inside_a_commit_then_resumed_keeps_every_committed_step_and_starts_a_segment(tmp_path):
    """SIGKILL inside a commit leaves a torn tail (the step's records without their commit); a new collector on the
    file (mode='a') drops it, keeps steps 0-3 intact and starts a 'resume' segment after them."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "killed.py"
    script.write_text(KILLED_IN_COMMIT)
    path = tmp_path / "killed.thist"
    r = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr
    h = trainhist.open(path)
    assert h.recovery.status == "torn" and h.recovery.dropped_records > 0
    before = {n: h.spine(n, "param").sum.tolist() for n in ("0.weight", "2.bias")}
    assert h.spine("0.weight", "param").step.tolist() == [0, 1, 2, 3]

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the resume warning)
        col = Collector(model, path).attach(optimizer=opt)
        train(col, model, opt, range(4, 6))
        col.close()
    h = trainhist.open(path)
    assert h.recovery.status == "clean"
    segs = h.segments
    assert [(g.first_step, g.reason, g.previous) for g in segs] == [(0, "start", None), (4, "resume", segs[0].id)]
    sp = h.spine("0.weight", "param")
    assert sp.step.tolist() == [0, 1, 2, 3, 4, 5]
    assert sp.segment.tolist() == [segs[0].id] * 4 + [segs[1].id] * 2
    for n, sums in before.items():
        assert h.spine(n, "param").sum.tolist()[:4] == sums
    assert h.steps["step"].tolist() == [0, 1, 2, 3, 4, 5]


def test_writer_errors_said_once_are_tallied_at_close(tmp_path, monkeypatch):
    """Writer calls that raise without stopping the writer are said once, when the first happens; close() then
    says how many failed in all (with the first), so no later loss goes unreported; training and the other rows
    are unaffected."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "tally.thist"
    col = Collector(model, path, mode="w").attach(optimizer=opt)
    real = col._writer.step_truth

    def odd_steps_fail(step, *a, **k):
        if step % 2:
            raise ValueError(f"step truth of step {step} refused")
        return real(step, *a, **k)

    monkeypatch.setattr(col._writer, "step_truth", odd_steps_fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(col, model, opt, range(6))
        first = [str(w.message) for w in caught if "trainhist:" in str(w.message)]
        col.close()
    said = [str(w.message) for w in caught if "trainhist:" in str(w.message)]
    assert len(first) == 1 and "step truth of step 1 refused" in first[0], first
    assert col.writer_errors == 3
    tally = said[len(first):]
    assert len(tally) == 1 and "3 writer calls failed" in tally[0] and "step truth of step 1 refused" in tally[0]
    assert trainhist.open(path).steps["step"].tolist() == [0, 2, 4]
    assert trainhist.open(path).spine("0.weight", "param").step.tolist() == [0, 1, 2, 3, 4, 5]


def test_a_writer_that_stops_after_another_write_error_is_still_said(tmp_path, monkeypatch):
    """One writer call that raises (not an I/O error: the writer goes on) warns once; a full disk later, which stops
    the writer, is said too, once."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, tmp_path / "two.thist", mode="w", commit_every=1).attach(optimizer=opt)
    w = col._writer
    real = w.step_truth
    calls = []

    def once(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("a writer call that failed")
        return real(*a, **k)

    monkeypatch.setattr(w, "step_truth", once)

    def fill() -> None:
        w._f = FillingDisk(w._f)
        w._f.full = True

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(col, model, opt, range(6), {4: fill})
        col.close()
    said = [str(w.message) for w in caught if "trainhist: writing" in str(w.message)]
    assert len(said) == 2, said
    assert "a writer call that failed" in said[0] and "unless the writer stops" in said[0]
    assert "No space left" in said[1] and "records nothing more" in said[1]
    assert trainhist.open(tmp_path / "two.thist").steps["step"].tolist() == [0, 2, 3]  # (step 1: its call failed)


def test_after_the_writer_stops_the_collector_removes_its_hooks_and_reduces_nothing(tmp_path, monkeypatch):
    """A full disk stops the writer: from the next step on the collector removes its hooks (the model's, the
    optimizer's, the scaler's methods), reduces nothing, keeps no scalar and warns of nothing more, while training
    runs on unchanged; close() still closes the file, which reads as its last commit."""
    path = tmp_path / "stop.thist"
    ref_model = mlp()
    ref = train(None, ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), range(8))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    col = Collector(model, path, mode="w", commit_every=2).attach(optimizer=opt, scaler=scaler)
    assert "step" in scaler.__dict__ and any(m._forward_hooks for m in model.modules())
    reduced: list[int] = []
    real = col._reduce_many

    def counting(items, *a, **k):
        reduced.append(col._state.step)
        return real(items, *a, **k)

    monkeypatch.setattr(col, "_reduce_many", counting)

    def fill() -> None:
        col._writer._f = FillingDisk(col._writer._f)
        col._writer._f.full = True

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(col, model, opt, range(8), {5: fill})
        errors_then = col.writer_errors
        losses += train(col, model, opt, range(8, 10))
        col.close()
    assert losses[:8] == ref
    assert sorted(set(reduced)) == [0, 1, 2, 3, 4, 5]  # step 5's rows were reduced before its commit failed
    assert col._late == [] and col._late_host == []  # the scalars given since were not kept
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert "step" not in scaler.__dict__ and "unscale_" not in scaler.__dict__  # the class's methods again
    assert col.writer_errors == errors_then  # nothing more was asked of the writer while training went on
    said = [str(w.message) for w in caught if "trainhist" in str(w.message)]
    assert len(said) == 1 and "No space left" in said[0] and "removes its hooks" in said[0], said
    h = trainhist.open(path)
    assert h.recovery.status == "clean"
    assert h.steps["step"].tolist() == [0, 1, 2, 3]
