"""Shared helpers of the torch collector tests: reference captures and row comparisons."""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import subprocess
import sys

import numpy as np
import torch

import trainhist
from trainhist.summary import SumMethod, Summary, summarize
from trainhist.torch.plan import flatten_output
from trainhist.torch.reduce import METHODS

#: the reduction methods this machine can run on CPU tensors: the Triton kernel in Triton's interpreter (conftest)
#: where Triton is installed
CPU_METHODS = tuple(m for m in METHODS if m != "triton" or importlib.util.find_spec("triton") is not None)


def ref_summary(tensors: list[torch.Tensor]) -> Summary:
    """The numpy reference reduction of the concatenation of ``tensors`` (bfloat16 passed as bit patterns)."""
    flat = [t.detach().reshape(-1).cpu() for t in tensors]
    if flat[0].dtype == torch.bfloat16:
        a = np.concatenate([f.view(torch.int16).numpy().view(np.uint16) for f in flat])
        return summarize(a, dtype="bfloat16")
    return summarize(np.concatenate([f.numpy() for f in flat]))


def bits(x: float) -> int:
    return int(np.array([x], np.float64).view(np.int64)[0])


def assert_row(h: trainhist.History, path: str, stream: str, step: int, ref: Summary, *, facet: str | None = None,
               phase: str | None = None, sketch: bool = True) -> None:
    """The file's row of (path, stream, facet, phase) at ``step`` equals ``ref``: counts, bins, min, max bit-equal,
    sums within the float64-accumulation bound."""
    sp = h.spine(path, stream, facet, phase=phase)
    (i,) = np.flatnonzero(sp.step == step)
    assert sp.presence_names[i] == "observed", (path, stream, sp.presence_names[i])
    for f in ("count", "nan", "pinf", "ninf", "zero"):
        assert int(getattr(sp, f)[i]) == getattr(ref, f), (path, stream, f, int(getattr(sp, f)[i]), getattr(ref, f))
    if ref.finite:
        assert bits(sp.min[i]) == bits(ref.min), (path, stream, sp.min[i], ref.min)
        assert bits(sp.max[i]) == bits(ref.max), (path, stream, sp.max[i], ref.max)
        n = ref.finite
        maxabs = max(abs(ref.min), abs(ref.max))
        known = bool(sp.sums_known[i])
        if not known:  # (method unknown: only where float64 sums could overflow; they read NaN)
            assert maxabs * maxabs * n > np.finfo(np.float64).max, (path, stream, "sums unknown", maxabs, n)
            assert np.isnan(sp.sum[i]) and np.isnan(sp.sumsq[i])
        for name, p in (("sum", 1), ("sumsq", 2)) if known else ():
            got = getattr(sp, name)[i]
            want = getattr(ref, name).to_float()
            bound = SumMethod.bound(SumMethod.F64, n, maxabs, p) + math.ulp(want) / 2  # (want: rounded once)
            assert abs(got - want) <= bound, (path, stream, name, got, want)
    else:
        assert np.isnan(sp.min[i]) and np.isnan(sp.max[i])
    if sketch:
        k = int(sp.sk_row[i])
        assert k >= 0, (path, stream, "no sketch")
        assert h.sketch(path, stream, facet, phase=phase).sketch(k) == ref.sketch, (path, stream)


def presence(h: trainhist.History, path: str, stream: str, step: int, *, facet: str | None = None,
             phase: str | None = None) -> str:
    sp = h.spine(path, stream, facet, phase=phase)
    (i,) = np.flatnonzero(sp.step == step)
    return sp.presence_names[i]


class Spy:
    """Independent capture of module outputs and their gradients, per step, for the reference comparison."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.step: int | None = None
        self.acts: dict[tuple, list[torch.Tensor]] = {}
        self.grads: dict[tuple, list[torch.Tensor]] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str):
        def hook(module, args, out):
            if self.step is None or torch._C._current_graph_task_id() != -1:
                return
            for facet, t in flatten_output(out):
                self.acts.setdefault((self.step, name, facet), []).append(t.detach().clone())
                if t.requires_grad:
                    key = (self.step, name, facet)
                    t.register_hook(lambda g, key=key: None if g is None  # (an output of a node whose other
                                    else self.grads.setdefault(key, []).append(g.detach().clone()))  # output got one)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Wrapper(torch.Tensor):
    """A wrapper subclass with no storage of its own (as quantised or distributed tensor types are): data_ptr 0;
    every op runs on the wrapped tensor ``inner``."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, Wrapper) else x  # noqa: E731
        tree_map = torch.utils._pytree.tree_map
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: str, tmp_path, *args: str, world: int = 2) -> list[str]:
    """Run the Python source ``worker`` as ``world`` CPU ranks (gloo, env:// rendezvous on a free port: plain
    subprocesses, nothing pickled) with ``args``; assert every rank exits 0 and return their outputs."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = [
        subprocess.Popen([sys.executable, str(script), *args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, outs
    return outs
