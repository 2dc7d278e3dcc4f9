"""The torch collector: hooks a model (and optionally its optimizer and GradScaler) and writes its history.

Per logged step every reduction lands in one preallocated device ledger (see :mod:`.reduce`); the ledger is
copied to the host once, at the end of the step, and decoded into :class:`~trainhist.summary.Summary` rows there.

Design notes (also written into the file's settings):

* Micro-batches: every forward of a step reduces into the same ledger row, so the writer receives one exactly
  merged row per (site, phase) per step with ``micro=None``; the number of forwards is ``micro_batches``.
* Parameter gradients: captured once per phase per step. Inside the step, torch's ``_clip_grads_with_norm_``
  (which ``clip_grad_norm_`` calls by its module-global name, however the loop imported ``clip_grad_norm_``) is
  wrapped: the parameters it clips get phase ``pre_clip`` before and ``post_clip`` after (and the global norms,
  when it clips all of them); the others are captured as phase ``default`` just before the optimizer step (or at
  step exit when no optimizer step ran: a gradient missing there is ``unknown``, the loop may have cleared it).
  The gradient basis is ``scaled``/``unscaled`` under an attached, enabled GradScaler (depending on whether
  ``unscale_`` ran first), otherwise unknown unless the loop says. ``loss_scale`` is the scale before the step's
  ``update()``; the learning rates are read when the optimizer step starts.
* ``param`` is the value at step exit (after the update); ``param_delta`` is exit minus entry on a seeded
  float32 subvector. A step whose update was not applied records ``param_delta`` as ``skipped``.
* Activation-checkpoint recompute runs inside backward; forward hooks firing there are not counted again (they
  only attach gradient hooks, which fire solely for reentrant checkpointing, whose first forward had no grad).
* The recording forward hook is moved behind every other forward hook of its module at each step, so the
  recorded value is the module's final output (after hooks that rewrite it).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from ..errors import UsageError
from ..model import Applied, Clipped
from ..summary import SumMethod
from ..writer import SiteHandle, _real, _whole
from .plan import (
    ROOT,
    STREAMS,
    Plan,
    PlannedSite,
    clean_name,
    flatten_output,
    local_tensor,
    param_sharing,
    replicated,
    delta_sample,
    fsdp1_units,
    fsdp_flat_layouts,
    fsdp_unsharded,
    fsdp_later_copies,
    select,
    unwrap,
)
from . import reduce as _reduction
from .reduce import (DecodedRows, Ledger, PendingTransfer, _flush_mode, _no_flush, add_zeros, decode_arrays,
                     decode_rows, fusable_at, fusable_ats, fused_at, fused_into, fused_many_at, is_plain, merge_row,
                     reduce_into, triton_batchable, triton_many)

__all__ = ["Collector", "StepTruth"]

_GRAD_BASES = ("scaled", "unscaled")
#: default cadences (steps) of the per-site spines and sketches (issue 4: spine every step, sketches sparser); see
#: the Collector docstring for the cost and for a cheaper cadence
DEFAULT_EVERY = 1
#: With ``batch_outputs=True`` on a GPU (the batched Triton kernel), module outputs and their gradients are reduced
#: in batches: each is held until this many tensors, or this many bytes of them, are waiting, or the forward ends,
#: or the step does.
DEFER_TENSORS = 64
DEFER_BYTES = 256 << 20
DEFAULT_SKETCH_EVERY = 10
#: Under torch.distributed, how long a rank other than 0 waits (seconds) for rank 0's collector to publish the
#: run id that every rank's shard records (so that merge sums the ranks). Past it, the rank records a run id of its
#: own and warns. A ``run_id=`` given to every rank's Collector makes the ranks' run ids agree without it, but not
#: their segment numbers: those ranks wait for the segment of rank 0's collector given the same id all the same
#: (paired by the id, whatever paths the ranks spell), and warn where it does not come.
RUN_ID_WAIT_S = 120.0
#: collectors made so far in this process, per recording (see Collector._open): the k-th collector of a recording on
#: each rank agrees with the k-th of the same recording on rank 0
_run_keys: dict[str, int] = {}
#: the collectors of this process that hold a file open (by its real path), to name the one left open when another
#: collector is given the same file (a collector is not closed when the loop drops it: the model's hooks keep it)
_holders: weakref.WeakValueDictionary[str, Collector] = weakref.WeakValueDictionary()
# id of the autograd graph task running on this thread, -1 outside backward (activation-checkpoint recompute
# runs forwards inside backward)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _close_writer(writer: object, pid: int, collector: "weakref.ref[Collector]") -> None:
    """Close a collector that was not closed. At interpreter exit it is still alive and closes as ``close()`` does
    (the scalars given after its last step, the steps in flight and the planned sites are written too); collected,
    its writer is closed: its finished steps are committed. Not in another process (a forked child holds the
    parent's file too: it must not write to it)."""
    if os.getpid() != pid:
        return
    col = collector()
    if col is not None:
        with contextlib.suppress(Exception):  # (what close() could not write is lost; the writer is closed below)
            col.close()
    with contextlib.suppress(Exception):  # (a writer that failed, or a file gone: what was committed stays)
        writer.close()  # type: ignore[attr-defined]


def _unwrap_optimizer(opt: object) -> torch.optim.Optimizer:
    """The torch optimizer ``opt`` is or wraps (``.optimizer``, as accelerate's ``AcceleratedOptimizer`` and
    similar wrappers hold it: the step hooks go on the optimizer that steps); a UsageError for anything else."""
    inner = opt
    for _ in range(8):
        if isinstance(inner, torch.optim.Optimizer):
            return inner
        inner = getattr(inner, "optimizer", None)
    raise UsageError(f"attach(optimizer=...) takes torch.optim.Optimizer objects (or wrappers holding one as "
                     f"'.optimizer'), or a list of them; got {type(opt).__name__}", code="bad_optimizer")


def _extend_runs(runs: list[list[int]], step: int) -> None:
    """Add ``step`` to ``runs`` ([first, last, stride] each, stride 0 for a single step): it extends the last run
    when it follows at the run's stride, so a run at a cadence takes one entry however long it is."""
    if runs:
        r = runs[-1]
        if r[2] == 0 and step > r[1]:
            r[1], r[2] = step, step - r[1]
            return
        if r[2] and step == r[1] + r[2]:
            r[1] = step
            return
    runs.append([step, step, 0])


@dataclass(frozen=True)
class StepTruth:
    """What the training loop attests about one step; every field left ``None`` is recorded as unknown."""

    applied: bool | None = None
    loss_scale: float | None = None
    grad_basis: str | None = None
    clipped: bool | None = None
    clip_threshold: float | None = None
    micro_batches: int | None = None
    tokens: int | None = None
    samples: int | None = None

    def __post_init__(self) -> None:
        # what the file can hold, checked now, not as a refused row at the end of the step (a tensor: read then)
        u64 = (1 << 64) - 2  # (the largest known count: 2^64 - 1 is unknown)
        for name, lo, hi in (("micro_batches", 1, (1 << 32) - 1), ("tokens", 0, u64), ("samples", 0, u64)):
            v = getattr(self, name)
            if v is not None and not isinstance(v, torch.Tensor):
                object.__setattr__(self, name, _whole(name, v, lo, hi))
        for name in ("loss_scale", "clip_threshold"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, torch.Tensor):
                x = _real(name, v)
                if not (math.isfinite(x) and x >= 0):
                    raise UsageError(f"{name} must be a finite number >= 0, got {v!r}", code="bad_value")
                object.__setattr__(self, name, x)
        if self.grad_basis not in (None, *_GRAD_BASES):
            raise UsageError(f"grad_basis must be 'scaled', 'unscaled' or None, got {self.grad_basis!r}")
        # applied / clipped: a bool, None, anything with a truth value (a 0-dim tensor such as found_inf == 0), or
        # the names the reader gives back; held as bool or None
        for name, names in (("applied", Applied), ("clipped", Clipped)):
            v = getattr(self, name)
            if isinstance(v, str):  # (code 0 is unknown, 1 yes, 2 no; an unknown name is refused)
                code = names.code(v)
                object.__setattr__(self, name, None if code == 0 else code == 1)
            elif v is not None and not isinstance(v, bool):
                object.__setattr__(self, name, bool(v))


@dataclass
class _Step:
    """Host-side bookkeeping of the step in progress (and, after exit, of its pending transfer)."""

    step: int
    truth: StepTruth
    due: dict[str, bool]
    sketch: dict[str, bool]
    t0: float
    counts: dict[tuple, int] = field(default_factory=dict)
    failed: set[tuple] = field(default_factory=set)
    grad_done: set[tuple] = field(default_factory=set)
    snapshots: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    batched: list[str] = field(default_factory=list)  # param_delta of these: _DeltaBatch (CPU kernel) this step
    dev_scalars: list[tuple[int, str, tuple]] = field(default_factory=list)
    host_scalars: list[tuple[int, str, float]] = field(default_factory=list)
    # the loop's own scalars (col.scalars), kept apart from the collector's: same names are resolved at writing
    user_dev: list[tuple[int, str, tuple]] = field(default_factory=list)
    user_host: list[tuple[int, str, float]] = field(default_factory=list)
    micro: int = 0
    norm_done: bool = False
    clip_seen: bool = False
    clip_threshold: float | None = None
    bases: set[str | None] = field(default_factory=set)
    unscaled: bool = False
    opt_called: bool = False
    ran_before: bool = False  # the model ran between the previous step and this one
    attached: set[int] | None = None  # ids of the attached optimizers' parameters (when asked, see _unattached)
    scaler_updated: bool = False
    pending: PendingTransfer | None = None
    decoded: dict[tuple, object] = field(default_factory=dict)
    spines: DecodedRows | None = None  # the numbers of the step's rows (_decode_all)
    spine_rows: dict[tuple, int] = field(default_factory=dict)  # key -> its row in spines (rows that decoded)
    late_only: bool = False  # carries only tensor scalars of earlier steps (the transfer at close)
    reductions: dict[tuple, int] = field(default_factory=dict)  # key -> reductions into its row this step
    seen: dict[tuple, tuple] = field(default_factory=dict)  # tensor identity -> (weakref, version, key)
    # gradient hooks on leaf tensors a module returned (a parameter through Identity or eval-mode dropout): a leaf
    # keeps its hooks, so they are removed when the step ends; (key, id of the tensor) -> handle
    leaf_hooks: dict[tuple, object] = field(default_factory=dict)
    fused: bool = False  # reductions go through the CPU kernel (a CPU ledger, reduce.CPU_METHOD == "fused")
    defer: bool = False  # outputs and gradients are reduced in batches (the GPU's batched kernel): _flush_deferred
    flush: bool = False  # the loop runs with torch.set_flush_denormal(True): reductions switch it off (_no_flush)
    lrs: dict[int, list] = field(default_factory=dict)  # optimizer index -> its groups' lr when its step began
    scale_used: torch.Tensor | None = None  # the GradScaler's scale before its update in this step
    clipped_names: set[str] = field(default_factory=set)  # parameters whose gradients a clip saw this step
    clipped_any: torch.Tensor | None = None  # whether any clip call of the step scaled gradients down
    unknown: set[tuple] = field(default_factory=set)  # rows whose state cannot be told (gradients read at exit)
    opt_state: dict[int, str] = field(default_factory=dict)  # optimizer index -> "called", "stepped" or "maybe"
    interrupted: bool = False  # the loop's code raised inside the step (or close() came first)
    blind: bool = False  # a compiled model ran without calling the module hooks: unreached sites are unknown
    outer: int = 0  # calls of a compiled model's wrapper (whose own hook runs outside the compiled code)
    thread: int = 0  # the thread that entered the step (close() from another one must not read it: see close)


class _DeltaBatch:
    """The seeded ``param_delta`` subvectors of the parameters (of these sizes) the CPU kernel snapshots: their
    flat indices, one after another (``offsets``), and one float32 buffer (``host``, with a torch view per
    parameter) that holds the values before the update, then the update itself."""

    def __init__(self, names: list[str], indices: list[np.ndarray | None], numels: list[int]) -> None:
        self.names = names
        self.sizes = np.array(numels, dtype=np.int64)
        parts = [np.arange(n, dtype=np.int64) if i is None else i.astype(np.int64) for i, n in zip(indices, numels)]
        self.index = np.concatenate(parts)
        self.offsets = np.cumsum([0] + [len(q) for q in parts], dtype=np.int64)
        self.host = np.empty(int(self.offsets[-1]), dtype=np.float32)
        out = torch.from_numpy(self.host)
        self.views = [out[int(a) : int(z)] for a, z in zip(self.offsets[:-1], self.offsets[1:])]
        self._view_ats: list | None = None

    def view_ats(self) -> list:
        """:func:`~.reduce.fusable_at` of each view, read once: views of ``host``, whose memory never moves."""
        if self._view_ats is None:
            self._view_ats = fusable_ats(self.views)
        return self._view_ats

    def gather(self, addresses: np.ndarray, subtract: bool) -> None:
        """The subvectors now (or, ``subtract``, now minus the snapshot) into ``host``, by the CPU kernel."""
        bad = _reduction.cpukernel.gather_f32(addresses, self.sizes, self.index, self.offsets, self.host, subtract)
        if bad >= 0:
            raise RuntimeError(f"parameter {self.names[bad]!r} is smaller than its sampled positions")


def _add_sumsq(total: float, count: int, nan: int, inf: int, sumsq: float) -> float:
    """The global gradient norm's sum of squares after one more gradient: NaN once any gradient held NaN, else
    infinite once any held an infinity, else plus its sum of squares (as ``torch.linalg.vector_norm``, in any
    order)."""
    if nan or total != total:
        return math.nan
    return math.inf if inf else total + sumsq


def _per_stream(value: int | Mapping[str, int], name: str) -> dict[str, int]:
    def whole(v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise UsageError(f"{name} must be a whole number of steps (0 = never), got {v!r}")
        return int(v)

    if isinstance(value, Mapping):
        bad = set(value) - set(STREAMS)
        if bad:
            raise UsageError(f"{name}: unknown stream(s) {sorted(bad)}; streams are {', '.join(STREAMS)}")
        out = {s: whole(value.get(s, DEFAULT_EVERY if name == "every" else DEFAULT_SKETCH_EVERY)) for s in STREAMS}
    else:
        out = {s: whole(value) for s in STREAMS}
    if any(v < 0 for v in out.values()):
        raise UsageError(f"{name} must be >= 0 (0 = never), got {out}")
    return out


def _dist() -> tuple[int, int]:
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank(), d.get_world_size()
    return 0, 1


def _agree_run(key: str, rank: int, own: dict | None) -> dict | None:
    """Rank 0's run (id, segment number, time, name, config), which every rank records (merge then sums the ranks,
    segment by segment, under one run manifest): rank 0 publishes ``own`` in the process
    group's store under ``key``, the others wait for it (up to :data:`RUN_ID_WAIT_S`). None where it could not be
    agreed: no store, or rank 0 did not publish in time. A key-value store, not a collective, so a rank without a
    collector delays the others by the wait at most and never pairs with the loop's own collectives."""
    from datetime import timedelta

    try:
        store = torch.distributed.distributed_c10d._get_default_store()
        if rank == 0:
            store.set(key, json.dumps(own))
            return own
        store.wait([key], timedelta(seconds=RUN_ID_WAIT_S))
        lead = json.loads(store.get(key).decode())
        return lead if isinstance(lead, dict) and isinstance(lead.get("segment"), int) else None
    except Exception:  # noqa: BLE001 -- no agreement: the caller records its own and says so
        return None


def _first_copy(p: torch.Tensor) -> bool:
    """Whether this rank holds the first copy of its part of ``p``: always, except for a DTensor both sharded and
    replicated (HSDP) on a rank whose coordinate is not 0 on some replicated mesh dimension."""
    if type(p).__name__ != "DTensor":
        return True
    try:
        placements = p.placements  # type: ignore[attr-defined]
        if all(pl.is_replicate() for pl in placements):
            return True  # (a replica: every rank records it, merge keeps one)
        coordinate = p.device_mesh.get_coordinate()  # type: ignore[attr-defined]
        return coordinate is None or all(c == 0 for c, pl in zip(coordinate, placements) if pl.is_replicate())
    except Exception:  # noqa: BLE001 -- a layout we cannot read: record it
        return True


def _u32(order: int | None) -> int | None:
    """A site's ``order`` as the manifest holds it (spec 2.2: a u32), or None (unknown) beyond it."""
    return order if order is not None and 0 <= order <= 0xFFFFFFFF else None


def _closure(args: tuple, kwargs: dict) -> bool:
    """Whether an optimizer step was given a closure (which computes the loss and gradients inside the step);
    ``args`` as torch passes them to step hooks: the optimizer, then step's own arguments."""
    return (args[1] if len(args) > 1 else kwargs.get("closure")) is not None


def _rank_path(path: str | os.PathLike, rank: int, world_size: int) -> str:
    p = os.fspath(path)
    if "{rank}" in p:
        return p.format(rank=rank)
    if world_size > 1:
        root, ext = os.path.splitext(p)
        return f"{root}.rank{rank}{ext}"
    return p


def _statistics(m: torch.nn.Module) -> bool:
    """Whether a forward of ``m`` accumulates into its buffers statistics of the data it sees: the running means
    and variances (and counts) of normalisation layers, the ranges of quantisation observers (QAT)."""
    quant = torch.ao.quantization
    bases = (torch.nn.modules.batchnorm._NormBase, quant.ObserverBase, quant.FakeQuantizeBase)
    if not isinstance(m, torch.jit.ScriptModule):
        return isinstance(m, bases)
    # (a scripted or traced module keeps only its class's name)
    todo, names = list(bases), set()
    while todo:
        c = todo.pop()
        names.add(c.__name__)
        todo.extend(c.__subclasses__())
    return getattr(m, "original_name", None) in names


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@contextlib.contextmanager
def _probe(model: torch.nn.Module) -> Iterator[None]:
    """A forward that leaves no trace on the run (discover's): the random generators its dropout draws from, and
    the statistics its batch added to normalisation layers and quantisation observers (:func:`_statistics`), are as
    they were afterwards, so that a run with a collector trains exactly as the same run without one. Other module
    state (a cache a rotary embedding fills, with the attributes that say so) is left as the forward left it, as the
    run's first forward would leave it; a statistics buffer is written back only where its bits changed (a write
    moves its version, which a buffer saved for the backward of the returned output must keep)."""
    kept = [(m, k, b, b.detach().clone()) for m in model.modules() if _statistics(m) for k, b in m._buffers.items()
            if b is not None and not torch.nn.parameter.is_lazy(b) and b.layout is torch.strided and not b.is_meta
            and not b.is_inference()]
    where = {t.device for t in (*model.parameters(), *model.buffers())} - {torch.device("cpu"), torch.device("meta")}
    kinds = {d.type for d in where}
    kind = kinds.pop() if len(kinds) == 1 else "cuda"  # (several accelerator kinds at once: cuda's, as torch does)
    devices = sorted({d.index or 0 for d in where if d.type == kind})
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=kind))
        except Exception as e:  # noqa: BLE001 -- a device kind without a random-state module (XLA unregistered)
            stack.enter_context(torch.random.fork_rng(devices=[]))
            warnings.warn(f"trainhist: discover() could not keep the {kind} random state ({e!r}); only the CPU's is "
                          "restored after its forward", RuntimeWarning, stacklevel=4)
        try:
            yield
        finally:
            with torch.no_grad():
                for m, k, b, value in kept:
                    if k not in m._buffers or m._buffers[k] is not b:
                        continue  # (replaced by the module: its own state)
                    try:
                        if b.shape != value.shape:  # (an observer's range, empty until its first batch)
                            b.resize_(value.shape)
                        elif torch.equal(_bits(b), _bits(value)):
                            continue
                        b.copy_(value)
                    except (RuntimeError, TypeError) as e:
                        warnings.warn(f"trainhist: discover() could not restore the buffer {k!r} of a "
                                      f"{type(m).__name__} ({e!r}): it keeps its forward's batch",
                                      RuntimeWarning, stacklevel=4)


def _call(model: torch.nn.Module, batch: object) -> object:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


_COMPILED_BLIND = ("trainhist: the compiled model ran without calling the module hooks trainhist added "
                   "(torch.compile keeps code compiled before they existed): its module sites are not seen; those "
                   "discover() found are recorded as 'unknown', the others not at all. Create the Collector, "
                   "discover() and attach() before the first compiled call, or call torch._dynamo.reset() after "
                   "attach()")
#: room between the forward positions of the modules of the first forward, for modules first seen later (an
#: expert routed to from some step on: up to this many between two modules); a million modules fit the u32 of
#: spec 2.2
_ORDER_GAP = 1 << 12
_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _no_forward(m: torch.nn.Module) -> bool:
    """A container that is never called itself (ModuleList, ModuleDict: the base class's forward)."""
    return type(m).forward is torch.nn.Module.forward


#: what :func:`~.reduce.fusable_at` compares with, bound once for :meth:`Collector._reduce_alias`'s inlined copy
_TENSOR, _PARAMETER, _STRIDED, _FLOAT32, _FLOAT64 = (torch.Tensor, torch.nn.Parameter, torch.strided, torch.float32,
                                                    torch.float64)
#: integer dtypes whose values need not be binary64 values (beyond 2^53): such a row is recorded 'failed'
_WIDE_INTS = tuple(getattr(torch, n) for n in ("int64", "uint64") if hasattr(torch, n))


def _keep_last(hid: int, module: torch.nn.Module, args: tuple) -> None:
    """A forward pre-hook: make forward hook ``hid`` the module's last before its hooks run, so that it sees the
    final output even when another hook was registered after it, inside a step too (a NaN injected for a test is
    then seen at the module that made it, not at the one that consumes it)."""
    hooks = module._forward_hooks
    if hid in hooks and next(reversed(hooks)) != hid:
        hooks.move_to_end(hid)


#: sites whose failing one kind of warning names (the rest of that kind are counted in one more warning)
_SITE_WARNINGS = 5

#: the writer's codes for a value it refuses (the rest of the call's rows are written): not a failing writer
_REFUSED_VALUES = frozenset({"bad_value", "duplicate_row", "bad_summary", "bad_manifest_value", "unknown_name"})


def _scalar_value(name: str, v: object) -> float | torch.Tensor:
    """A scalar given to :meth:`Collector.scalars` as a float, or a one-element tensor (read at the step's transfer,
    never synced); anything else (text, several elements) is refused now, with :class:`UsageError`."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.is_complex():
            raise UsageError(f"scalar {name!r} must be a single real number; got a tensor of shape {tuple(v.shape)} "
                             f"and dtype {v.dtype} (reduce it first, e.g. loss.mean())", code="bad_scalar")
        return v
    try:
        a = np.asarray(v) if not isinstance(v, (str, bytes)) else None
    except (TypeError, ValueError):  # (a ragged list, say)
        a = None
    if a is None or a.size != 1 or a.dtype.kind not in "biuf":
        raise UsageError(f"scalar {name!r} must be a single real number (int, float, bool, a one-element array or "
                         f"tensor); got {type(v).__name__} {v!r:.60}", code="bad_scalar")
    return float(a.reshape(-1)[0])


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class Collector:
    """Record the distribution history of a torch model's training into a trainhist file (one per rank).

    ``streams``: any of ``activation, activation_grad, param, param_grad, param_delta``. ``sites``: module-path
    prefixes or fnmatch patterns (``None`` = every module and parameter). ``every`` / ``sketch_every``: spine and
    sketch cadence in steps, an int or a per-stream mapping (0 = never). ``delta_elements``: size of the seeded
    ``param_delta`` subvector. ``commit_every``: logged steps per commit — a crash loses at most the steps since
    the last commit (the writer also commits after ``commit_seconds``, default 30 s). Give ``path`` (``{rank}`` is
    substituted; under several ranks ``.rank<r>`` is inserted otherwise) or an open ``writer``; other keyword
    arguments go to :class:`~trainhist.HistoryWriter`. Under several ranks every shard records rank 0's run id
    (see :data:`RUN_ID_WAIT_S`), so merge sums them: module outputs are each rank's own (``shard``), parameters
    replicas under DDP. ``replicas``: patterns (as ``sites=``) of modules and parameters that every rank holds in
    full where the collector cannot tell (tensor parallelism's all-reduced outputs and plain parameters, a model
    wrapped in DDP after the collector was made): their outputs and plain parameters are recorded as ``replica``,
    kept once by merge (a DTensor parameter's sharing follows its placements).

    Cadence and cost (defaults ``every=1``, ``sketch_every=10``). The spine of every selected site and stream is
    recorded every step and the sketches every 10 steps, so the triage names the site, pass and step of the first
    non-finite value exactly. Every step the collector also records the run-level scalars: the global gradient norm
    (one batched reduction over all gradients), the learning rates, the loss scale and step time, and whatever the
    loop passes to :meth:`scalars` (the loss). The spine of every site every step is a full pass over every
    activation, activation gradient, parameter and gradient: on a CPU a measurable share of the training step
    (``benchmarks/overhead.md`` has the measured ratios: they depend on the CPU, and the kernels' share falls as
    the model grows wider). Where that is too much, record the per-site spines at a cadence (e.g. ``every=25,
    sketch_every=50``, measured in the same table): the scalars still give the exact *step* of the first
    non-finite gradient or loss, but the *site* is seen only at the next spine step, possibly after the values
    spread downstream (the triage then brackets it), or narrow ``sites=`` / ``streams=``.

    The file is opened when the collector attaches (``writer_options`` go to :class:`~trainhist.HistoryWriter`): one
    that already holds a history is appended to, as a new segment (``mode="a"``, the default here; a warning says
    so); ``mode="w"`` starts it over. :meth:`discover` runs one real forward in the model's current mode (a
    training-mode forward updates BatchNorm statistics and draws dropout masks, as any forward would).

    ``batch_outputs`` (GPU with Triton only; default off): hold module outputs and their gradients and reduce them in
    batches (:data:`DEFER_TENSORS`, :data:`DEFER_BYTES`, the end of each forward and step), one kernel launch per
    batch instead of one per tensor. Only for code that never writes into a module's output or gradient after it
    is produced other than through torch operations: a write torch's version counter does not see (a custom
    kernel, a collective, a fused loss that reuses the logits' memory for their gradient) would be recorded
    instead of the value the module produced. In-place torch operations are seen: such a site is reduced as
    soon as it is produced (discover() finds them; one found later records 'failed' at that step, and says why).
    Reductions are issued on the stream current at the hook: one stream per collector.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        path: str | os.PathLike | None = None,
        *,
        streams: Iterable[str] = STREAMS,
        sites: str | Iterable[str] | None = None,
        every: int | Mapping[str, int] = DEFAULT_EVERY,
        sketch_every: int | Mapping[str, int] = DEFAULT_SKETCH_EVERY,
        delta_elements: int = 4096,
        seed: int = 0,
        writer: object | None = None,
        commit_every: int = 200,
        batch_outputs: bool = False,
        replicas: str | Iterable[str] | None = None,
        **writer_options: object,
    ) -> None:
        self.streams = tuple(streams)
        bad = [s for s in self.streams if s not in STREAMS]
        if bad:
            raise UsageError(f"unknown stream(s) {bad}; streams are {', '.join(STREAMS)}")
        if (path is None) == (writer is None):
            raise UsageError("Collector needs exactly one of path= or writer=")
        rid = writer_options.get("run_id")
        if rid is not None and not (isinstance(rid, str) and re.fullmatch("[0-9a-f]{32}", rid)):
            raise UsageError(f"run_id must be 32 lowercase hex digits (spec 2.1), e.g. uuid.uuid4().hex; got {rid!r}")
        self.model = model
        self.inner, self._ddp = unwrap(model)
        self._compiled = any(hasattr(x, "_orig_mod") for x in (model, getattr(model, "module", None)) if x is not None)
        self._patterns = [sites] if isinstance(sites, str) else (None if sites is None else list(sites))
        self.every = _per_stream(every, "every")
        self.sketch_every = _per_stream(sketch_every, "sketch_every")
        self.delta_elements = int(delta_elements)
        self.seed = int(seed)
        self.rank, self.world_size = _dist()  # (again when the file is opened: the process group may come later)
        self._path_arg = path
        self.path = None if path is None else _rank_path(path, self.rank, self.world_size)
        self._writer = writer
        self._writer_options = writer_options
        self.commit_every = max(1, int(commit_every))
        self.batch_outputs = bool(batch_outputs)
        self._modules = {clean_name(n): m for n, m in self.inner.named_modules()}
        self._params = {clean_name(n): p for n, p in self.inner.named_parameters()}
        self._made_with = {id(x) for x in (*self.inner.modules(), *self.inner.parameters())}  # (see _check_params)
        # FSDP1 parameters that are this rank's run of a larger flat tensor: their whole shape and the run's start
        self._flat = fsdp_flat_layouts(model)
        self._unsharded = fsdp_unsharded(model)  # (FSDP1 NO_SHARD: whole on every rank)
        # FSDP1 units: their own clip_grad_norm_ (which calls torch's only when no unit shards) is seen by patching
        # their class during a step, as torch's is (an instance attribute would be copied with the model)
        units = fsdp1_units(model)
        self._fsdp1 = {id(m) for m in units}
        self._fsdp1_class = type(units[0]) if units else None
        # where each parameter is held, to follow one the loop replaces by another of its kind (see _follow_params);
        # FSDP1 swaps its units' parameters itself: not followed
        self._param_ids = {id(p) for p in self._params.values()}
        self._owners = {} if units or self._flat else {
            n: (m, leaf) for path, m in self.inner.named_modules() for leaf, p in m._parameters.items()
            if (n := clean_name(f"{path}.{leaf}" if path else leaf)) in self._params and self._params[n] is p
            and type(p) is torch.nn.Parameter and not isinstance(m, torch.jit.ScriptModule)}  # (TorchScript's: fixed)
        first: dict[int, str] = {id(p): n for n, p in self._params.items()}  # shared parameters: recorded once,
        aliases = {clean_name(n): first[id(p)] for n, p in self.inner.named_parameters(remove_duplicate=False)
                   if clean_name(n) not in self._params and id(p) in first}  # under their first name
        self._norm_suffix = ""  # see _open
        self._norm_params: set[str] = set(self._params)  # see _open
        first_m: dict[int, str] = {}
        for n, m in self.inner.named_modules():
            first_m.setdefault(id(m), clean_name(n))
        mod_aliases = {clean_name(n): first_m[id(m)] for n, m in self.inner.named_modules(remove_duplicate=False)
                       if clean_name(n) not in self._modules and id(m) in first_m}  # (a module under two names)
        sel_modules, sel_params = select(list(self._modules), list(self._params), self._patterns, aliases, mod_aliases)
        # modules and parameters every rank holds in full (tensor parallelism's replicated outputs and plain
        # parameters): recorded as replicas, which merge keeps once
        self._replicas = [replicas] if isinstance(replicas, str) else (None if replicas is None else list(replicas))
        self._rep_modules, self._rep_params = (
            select(list(self._modules), list(self._params), self._replicas, aliases, mod_aliases)
            if self._replicas else (set(), set()))
        # a sharded DTensor also replicated over some mesh dimension (HSDP) is held whole-shard by several ranks:
        # only the first of them (coordinate 0 on those dimensions) records it, so that merge counts it once
        later = fsdp_later_copies(model)  # (FSDP1 HYBRID_SHARD: another group's rank holds the first copy)
        self._copies = {n for n, p in self._params.items() if not _first_copy(p) or id(p) in later}
        # in the model's order (reductions run in it, and 'first non-finite' means first in execution order)
        # a TorchScript module (torch.jit.script, trace) refuses hooks: its outputs are not recorded (its parameters
        # are), and a warning names it
        self._scripted = {n for n, m in self._modules.items() if isinstance(m, torch.jit.ScriptModule)}
        self._sel_modules = dict.fromkeys(n for n in self._modules if n in sel_modules and n not in self._scripted)
        unhooked = [n for n in self._modules if n in self._scripted and n in sel_modules and not (
            n != ROOT and (n.rpartition(".")[0] or ROOT) in self._scripted)]  # (the outermost ones)
        if unhooked and {"activation", "activation_grad"} & set(self.streams):
            warnings.warn("trainhist: TorchScript modules take no hooks: the outputs of "
                          f"{', '.join(map(repr, unhooked))} and of their submodules are not recorded (their "
                          "parameters are); to record them, give the collector the model before it is scripted or "
                          "traced", RuntimeWarning, stacklevel=2)
        # a complex parameter (the format has no complex dtype; Fourier layers' weights) gets no site, as a complex
        # output gets none: a warning names it, and the gradient norms include it (torch's norm of its gradient)
        cplx = [n for n in self._params if n in sel_params and self._params[n].is_complex()]
        skip = set(cplx)
        if cplx and {"param", "param_grad", "param_delta"} & set(self.streams):
            warnings.warn(f"trainhist: complex parameters are not recorded ({', '.join(map(repr, cplx[:5]))}"
                          f"{', ...' if len(cplx) > 5 else ''}): the format has no complex dtype (record .real and "
                          ".imag where you need them); the gradient norms include them", RuntimeWarning, stacklevel=2)
        self._sel_params = dict.fromkeys(n for n in self._params if n in sel_params and n not in self._copies
                                         and n not in skip)
        self._unselected = [n for n in self._params if n not in self._sel_params and n not in self._copies]
        self._facets: dict[str, list[tuple[str | None, tuple[int, ...], str]]] | None = None
        # the sites' order (spec 2.2), kept by merge where ids are not: modules in the order their outputs were
        # first produced (discover(), or the steps), parameters in the model's order
        self._produced: dict[str, int] = {}
        self._steps_entered = False
        self._last_step: int | None = None  # (the last step entered in this segment)
        self._completed: dict[str, None] = {}  # modules of the current forward, in the order they completed
        self._elements: dict[tuple[str, str | None], int] = {}  # (path, facet): its elements in discover()'s
        # forward, over every call of the module (a module called n times a forward has n outputs a step)
        self._param_order = {n: i for i, n in enumerate(self._params)}
        self._gradless: set[tuple[str, str | None]] = set()  # (path, facet) discover() saw without a gradient
        self._plan: Plan | None = None
        self._handles: dict[tuple, object] = {}
        self._redeclared: set[tuple] = set()  # sites the file declares with another sharing or sample (_handle)
        self._emit_plans: dict[tuple, list] = {}  # see _emit_plan
        self._emit_cols: dict[int, tuple] = {}  # see _emit_columns
        self._emit_version: tuple | None = None
        self._handled: set[tuple] = set()  # row keys whose site has a handle
        # per activation stream, the steps of this segment at which a site that did not run was recorded absent, as
        # runs [first, last, stride]: a site first seen later (a module, or an output's facet) was absent at them
        self._absent_steps: dict[str, list[list[int]]] = {"activation": [], "activation_grad": []}
        self._registered = False  # the plan's sites are declared (at the first finished step, or at close)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._fwd_handles: list[tuple[torch.nn.Module, int]] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._scaler: object | None = None
        self._scaler_orig: dict[str, object] = {}
        self._scaler_wrapped: set[str] = set()  # the scaler methods that were instance attributes when wrapped
        dev = next((p.device for p in self.inner.parameters()), torch.device("cpu"))
        self._ledger = Ledger(dev)
        # whether the ledger rows' key columns hold zeros since its last reset (nothing wrote them: the fused spine
        # kernel writes only the other columns), so that the next reset copies only those (Ledger.reset)
        self._ledger_clean = False
        self._lag = 1 if self._ledger.device.type == "cuda" else 0
        # parameter -> (its size, its seeded param_delta positions as numpy and on its device; None: all of it)
        self._indices: dict[str, tuple[int, np.ndarray | None, torch.Tensor | None]] = {}
        self._delta_batch: _DeltaBatch | None = None
        self._state: _Step | None = None
        self._discovery: dict | None = None
        self._pending: list[_Step] = []
        self._late: list[tuple[int, str, torch.Tensor]] = []
        self._late_host: list[tuple[int, str, float]] = []  # (numbers given after their step: written with _late)
        self._written: dict[str, int] = {}  # each scalar's last step written in this segment
        self._ran_outside = False  # the model ran since the last step ended, outside any step
        # each parameter's gradient as the last step left it (the tensor, weakly, and its version): a gradient
        # found unchanged at the end of a step with no optimizer step is the earlier step's, not this one's
        self._grads_left: dict[str, tuple[weakref.ref, int]] = {}
        self._warned: set[object] = set()
        self._site_warnings: dict[str, int] = {}  # (by kind: the sites _warn_site has counted)
        self._dtypes: dict[tuple, str] = {}  # (path, stream, facet) -> dtype name, as first seen
        self._typed: set[tuple] = set()  # keys whose site has its dtype in _dtypes
        self._wide_ints: set[tuple] = set()  # sites of 64-bit integers: their extremes may not be binary64 values
        self._deferred: list[tuple[tuple, torch.Tensor, int]] = []  # (key, tensor, its version when recorded)
        self._deferred_bytes = 0
        self._eager: set[tuple] = set()  # (stream, path, facet) changed in place after recording: never deferred
        self._versions: list[tuple[str, str | None, torch.Tensor, int]] = []  # discover(): outputs, their versions
        self._since_commit = 0
        self._closed = False
        # held while a step begins or ends, and by commit() and close(): those touch the writer and the ledger, and
        # close() can come from another thread (at interpreter exit, while a daemon thread trains), or from a signal
        # handler in the thread that holds it (see close)
        self._lock = threading.RLock()
        self._close_deferred = False
        self._detach_later = False  # (close() inside a step: the hooks are removed when the step ends; see close)
        self._stopped = False  # the writer stopped for good (a failed write): see _writer_error
        self._finalizer: weakref.finalize | None = None  # (see _open)
        self.writer_errors = 0
        self._first_writer_error = ""
        self.first_nonfinite: tuple[int, str, str, str | None] | None = None
        if any(getattr(p, "_is_flat_param", False) for p in self._params.values()):
            self._warn_once("flat_param", "trainhist: FSDP with use_orig_params=False: the model's parameters are "
                            "its units' flat parameters, recorded as '<unit>._flat_param' (this rank's share of the "
                            "unit's parameters concatenated and padded; the whole under NO_SHARD), not parameter by "
                            "parameter; wrap "
                            "with use_orig_params=True for the parameters' own sites")

    # -- planning ------------------------------------------------------------------------------------------
    def discover(self, batch: object) -> object:
        """Run one real forward of ``batch`` to learn every module's output facets; returns the model output.

        The forward is a probe: the random state and the statistics its batch added (normalisation layers',
        quantisation observers') are restored afterwards (:func:`_probe`), so the run trains as it would without the
        collector; its output is for inspection, not a training step."""
        if self._closed:
            raise UsageError("the collector is closed: make a new one to record more")
        self._discovery = {}
        self._elements = {}
        self._completed = {}
        self._gradless = set()
        self._versions = []
        handles = [
            m.register_forward_hook(partial(self._on_discover, n)) for n, m in self._modules.items()
            if n in self._sel_modules
        ]
        try:
            with _probe(self.model):
                out = _call(self.model, batch)
            self._place_completed()
            # an output a later operation of the forward changes in place (a ReLU(inplace=True) after it, say)
            # must be reduced as soon as it is produced, never held for a batch
            self._eager.update(("activation", p, f) for p, f, t, v in self._versions if t._version != v)
        finally:
            for h in handles:
                h.remove()
            self._facets, self._discovery, self._versions = self._discovery, None, []
        self._plan = None
        if self._compiled and not self._facets and self._sel_modules:
            self._warn_once("compiled", _COMPILED_BLIND)
        return out

    def _on_discover(self, path: str, module: torch.nn.Module, args: tuple, output: object) -> None:
        if self._discovery is None:
            return
        facets = list(flatten_output(output))
        for f, t in facets:  # (each call's own shapes: a shared embedding may see inputs of several lengths)
            self._elements[(path, f)] = self._elements.get((path, f), 0) + t.numel()
        if path not in self._discovery:
            self._completed.setdefault(path)
            self._discovery[path] = [(f, tuple(t.shape), _dtype_name(t)) for f, t in facets]
            if torch.is_grad_enabled():  # (under no_grad nothing requires a gradient: that says nothing of training)
                self._gradless.update((path, f) for f, t in facets if not t.requires_grad)
            for f, t in facets:
                with contextlib.suppress(RuntimeError):  # (an inference tensor has no version counter)
                    self._versions.append((path, f, t, t._version))

    @property
    def plan(self) -> Plan:
        """Every site, stream and facet to be recorded, with per-step cost (call :meth:`discover` first for sizes)."""
        if self._plan is None:
            self._plan = self._build_plan()
        return self._plan

    def _build_plan(self) -> Plan:
        plan = Plan()
        ev, sk = self.every, self.sketch_every
        # activation sites in the order the forward produced them (post-order: a module's output is complete
        # before its parent's), so site ids follow data flow; modules not seen by discover() follow
        order = [*(self._facets or {}), *(p for p in self._modules if p not in (self._facets or {}))]
        for path in order:
            if path not in self._sel_modules:
                continue
            # after discover(), a module that did not run there has no facets until it does: a container without a
            # forward of its own never will; another (a branch not taken, an expert not routed) is listed with
            # its size unknown, so that the plan does not leave out what it may cost
            facets = None if self._facets is None else self._facets.get(path)
            if facets is None and self._facets is not None and _no_forward(self._modules[path]):
                continue
            known = facets is not None
            for facet, shape, dtype in facets if known else [("?", None, None)]:
                for stream in ("activation", "activation_grad"):
                    # (an output discover() saw without a gradient, a mask or a detached value, gets no gradient
                    # site, so no 'absent' rows at every step; one that has a gradient later gets it then)
                    if stream in self.streams and not (stream == "activation_grad" and (path, facet) in self._gradless):
                        plan.sites.append(PlannedSite(
                            path, stream, facet, shape, dtype,
                            self._elements.get((path, facet), math.prod(shape)) if known else None,
                            "replica" if path in self._rep_modules else "shard",
                            ev[stream], sk[stream], provisional=not known,
                        ))
        for name, p in self._params.items():
            if name not in self._sel_params:
                continue
            for stream in ("param", "param_grad", "param_delta"):
                if stream in self.streams and (stream == "param" or p.requires_grad):
                    plan.sites.append(self._param_site(name, p, stream))
        return plan

    def _param_site(self, name: str, p: torch.Tensor, stream: str) -> PlannedSite:
        """The planned site of parameter ``name`` in ``stream`` (also for one first trained after the plan)."""
        n, flat = local_tensor(p).numel(), self._flat.get(id(p))
        shape = tuple(p.shape) if flat is None else flat[0]  # (an FSDP1 parameter: the whole one's, as a DTensor's)
        sample, el = None, n
        if stream == "param_delta":
            idx, sample = delta_sample(name, p, self.delta_elements, self.seed, flat)
            el = n if idx is None else len(idx)
        return PlannedSite(name, stream, None, shape, _dtype_name(p), el, self._sharing(name, p), self.every[stream],
                           self.sketch_every[stream], sample)

    def settings(self) -> dict:
        """The collector settings written into the file."""
        return {
            "collector": "trainhist.torch",
            "torch": torch.__version__,
            "streams": list(self.streams),
            "sites": self._patterns,
            "replicas": self._replicas,
            "every": self.every,
            "sketch_every": self.sketch_every,
            "param_delta": {
                "elements": self.delta_elements,
                "seed": self.seed,
                "indices": "sorted numpy.random.default_rng([seed, zlib.crc32(path)]).choice(numel, elements, "
                "replace=False) over the flattened parameter (a sharded DTensor or FSDP1 shard: its whole flat "
                "positions, each rank measuring those in its shard; otherwise the rank-local tensor); exit - entry "
                "computed in float32 (float64 for a float64 parameter), rounded to float32",
            },
            "micro_batches": "merged on device: one row per (site, phase) per step, micro=None",
            "param_timing": "param at step exit (after the update); param_grad before the optimizer step",
            "sums": "float64 accumulation on device (f64_accumulate)",
        }

    # -- wiring ---------------------------------------------------------------------------------------------
    def attach(self, optimizer: object = None, scaler: object = None) -> "Collector":
        """Install the hooks; optionally watch ``optimizer`` (one or a list) and a ``torch.amp.GradScaler``."""
        if self._closed:
            raise UsageError("the collector is closed: make a new one to record more")
        if self._stopped:  # (its writer stopped: nothing could be recorded, see _writer_error)
            return self
        opts = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        opts = [_unwrap_optimizer(o) for o in opts]  # (before anything is opened or hooked)
        self._open()
        if not self._fwd_handles:
            hooked = {ROOT} - self._scripted
            if {"activation", "activation_grad"} & set(self.streams):
                hooked.update(self._sel_modules)
            for path in hooked:
                m = self._modules[path]
                # called by compiled code, not traced into it (and recompiled at every step), however and whenever
                # the model is compiled (about 0.3 us a call in eager mode)
                h = m.register_forward_hook(torch.compiler.disable(partial(self._on_forward, path)))
                self._hooks.append(h)
                self._fwd_handles.append((m, h.id))
                if not self._compiled:  # (compiled code: reordered at step entry alone, no break at each start)
                    self._hooks.append(m.register_forward_pre_hook(torch.compiler.disable(partial(_keep_last, h.id))))
            if self._compiled:  # (to see a forward that the compiled code ran without the hooks above)
                self._hooks.append(self.model.register_forward_hook(self._on_outer))
        for opt in opts:
            if any(o is opt for o in self._optimizers):
                continue
            self._optimizers.append(opt)
            self._hooks.append(opt.register_step_pre_hook(self._on_opt_pre))
            self._hooks.append(opt.register_step_post_hook(self._on_opt_post))
        if scaler is not None and self._scaler is None:
            self._scaler = scaler
            for name in ("unscale_", "step", "update"):
                self._scaler_orig[name] = getattr(scaler, name)
            self._scaler_wrapped = {n for n in self._scaler_orig if n in scaler.__dict__}
            scaler.unscale_ = self._scaler_unscale
            scaler.step = self._scaler_step
            scaler.update = self._scaler_update
        self._check_params()
        return self

    def _check_params(self) -> None:
        """Warn (once) when the model's parameters are no longer the tensors the collector was made with: a wrapper
        applied after it (FSDP2's fully_shard), to_empty() or load_state_dict(assign=True) replace them, and the
        parameter sites would record the old tensors, unchanged at every step."""
        now = {clean_name(n): p for n, p in self.inner.named_parameters()}
        followed = self._replacements()  # (recorded from the next step on: not lost)
        if any(now.get(n) is not p and n not in followed for n, p in self._params.items()):
            self._warn_once("params", "trainhist: the model's parameters were replaced after the Collector was made "
                            "(fully_shard, to_empty(), load_state_dict(assign=True)): its parameter sites would record "
                            "the old tensors; make the Collector after the model is wrapped and loaded")
        added = [clean_name(n) for n, x in self.inner.named_modules() if id(x) not in self._made_with]
        added += [n for n, x in now.items() if id(x) not in self._made_with and n not in self._params]  # (else above)
        if added:
            self._warn_once("added", "trainhist: modules or parameters were added to the model after the Collector "
                            f"was made ({', '.join(sorted(set(added))[:5])}{', ...' if len(set(added)) > 5 else ''}): "
                            "they are not recorded, and the gradient norms recorded since leave them out; make the "
                            "Collector after the model is complete")

    def _replacements(self) -> dict[str, torch.nn.Parameter]:
        """The parameters :meth:`_follow_params` follows: name -> the new tensor its module now holds."""
        out, ids = {}, set(self._param_ids)
        for n, (m, leaf) in self._owners.items():
            new = m._parameters.get(leaf)
            old = self._params[n]
            if new is old or type(new) is not torch.nn.Parameter or id(new) in ids:
                continue  # (unchanged; removed or not a plain parameter; one held under another name: tied now)
            if (new.shape, new.dtype, new.device) == (old.shape, old.dtype, old.device):
                out[n] = new
                ids.discard(id(old))
                ids.add(id(new))
        return out

    def _follow_params(self, step: int) -> None:
        """Record from a parameter the loop replaced by a new one of the same shape, dtype and device
        (``module.weight = nn.Parameter(...)``): its sites go on with the new tensor, and a warning says so; any
        other replacement is left to :meth:`_check_params`'s warning."""
        params, followed = self._params, []
        for n, new in self._replacements().items():
            old = params[n]
            params[n] = new
            self._param_ids.discard(id(old))
            self._param_ids.add(id(new))
            self._made_with.add(id(new))
            followed.append(n)
        if followed:
            self._warn_once(("rebound", step), f"trainhist: {len(followed)} parameter(s) were replaced by new tensors "
                            f"before step {step} ({', '.join(followed[:3])}{', ...' if len(followed) > 3 else ''}); "
                            "their sites record the new ones from this step on (an optimizer made before still steps "
                            "the old ones unless given the new ones)")

    def _open(self) -> None:
        if self._writer is not None:
            return
        from ..writer import HistoryWriter

        # the rank, world size and file name as of now: a collector made before init_process_group would
        # otherwise have every rank write one file as rank 0 of 1
        self.rank, self.world_size = _dist()
        if self._path_arg is not None:
            self.path = _rank_path(self._path_arg, self.rank, self.world_size)
        # gradients that are not whole on every rank (FSDP, DTensor shards, ranks without DDP): the norms this rank
        # can compute without a collective are of its own part, recorded as grad_norm_local (and _post_clip_local)
        replica = {n for n, p in self._params.items() if self._sharing(n, p) == "replica"}
        self._norm_suffix = "_local" if self.world_size > 1 and any(
            n not in replica for n, p in self._params.items() if p.requires_grad) else ""
        # the parameters in this rank's norms: all of them for a whole norm; for a rank's part, each part once over
        # the ranks (a replica on rank 0 alone), so that the ranks' squares add up to the whole norm's
        self._norm_params = {n for n in self._params if not self._norm_suffix or (
            n not in self._copies and (n not in replica or self.rank == 0))}
        opts = dict(self._writer_options)
        opts.setdefault("rank", self.rank)
        opts.setdefault("world_size", self.world_size)
        opts.setdefault("mode", "a")  # an existing history is resumed, never truncated unasked
        settings = {**self.settings(), **dict(opts.pop("settings", None) or {})}  # type: ignore[arg-type]
        # every rank's shard records rank 0's run id and segment number, so that merge sums the ranks segment by
        # segment instead of keeping each rank apart as a run of its own (a rank that lost its file rejoins at
        # rank 0's segment, spec 2.4). A run id given to every rank makes the id agree, not the segment: the ranks
        # exchange the segment (and check the ids) all the same
        key = None
        for name in ("run_id", "run_name", "config"):  # (None given: as if not given)
            if opts.get(name) is None:
                opts.pop(name, None)
        given = opts.get("run_id")
        if self.world_size > 1 and self._path_arg is not None:
            # (a run id given pairs the ranks by itself, whatever paths they spell: the k-th collector of run X on
            # each rank with rank 0's k-th of run X; without one, by the path given, the same on every rank)
            what = f"id-{given}" if given is not None else self._pairing()
            n = _run_keys[what] = _run_keys.get(what, -1) + 1
            key = f"trainhist/run/{what}/{n}"
        lead = _agree_run(key, self.rank, None) if key is not None and self.rank != 0 else None
        if lead is not None:
            opts["min_segment"] = lead["segment"]  # (segments pair by number, across runs too: --across-runs)
            if given is None or given == lead["run_id"]:  # (another run's time, name and config are not this one's)
                opts.update(run_id=lead["run_id"], run_created=lead["created"])
                opts.setdefault("run_name", lead.get("name"))  # (the run's, where this rank gives none of its own)
                opts.setdefault("config", lead.get("config"))
        try:
            self._writer = w = HistoryWriter(self.path, settings=settings, **opts)  # type: ignore[arg-type]
        except UsageError as e:
            held = _holders.get(os.path.realpath(self.path)) if e.code == "file_in_use" else None
            if held is None or held._closed:
                raise
            raise UsageError(
                "a Collector made earlier in this process still has this file open: it was not closed (dropping it "
                "does not close it: the model's hooks keep it alive, and its writer holds the file's lock). Call its "
                "close() (or make collectors with `with Collector(...) as col:`) before making another on this file",
                code="file_in_use", path=self.path) from None
        _holders[os.path.realpath(self.path)] = self
        # a collector never closed is closed as close() does when the interpreter exits (the script raised), and
        # closes its writer when it is collected (dropped with its model): its finished steps are kept either way
        self._finalizer = weakref.finalize(self, _close_writer, w, os.getpid(), weakref.ref(self))
        if key is not None and self.rank == 0:
            run = w.run_manifest
            lead = _agree_run(key, 0, {"run_id": w.run_id, "segment": w.segment, "created": run.get("created"),
                                       "name": run.get("name"), "config": run.get("config")})
        if key is not None and (lead is None or (lead["run_id"], lead["segment"]) != (w.run_id, w.segment)):
            if lead is None and given is not None and w.run_id == given:
                self._warn_once("run_id", f"trainhist: rank {self.rank} could not agree on the segment number with "
                                f"rank 0 (no collector of run {given} on rank 0 published within {RUN_ID_WAIT_S:g} s: "
                                "was it given another run_id?); "
                                f"this shard records run {w.run_id} at segment {w.segment}, which merge pairs with "
                                "the other ranks' segment of that number, whatever segment they are at. Give every "
                                "rank's collector the same run_id=")
            elif lead is None or lead["run_id"] != w.run_id:
                self._warn_once("run_id", (
                    f"trainhist: rank {self.rank} could not agree on the run id with rank 0" if lead is None else
                    f"trainhist: rank {self.rank} was given run_id {given}, rank 0 records run {lead['run_id']}"
                    if given is not None and w.run_id == given else
                    f"trainhist: {self.path} resumes run {w.run_id}, rank 0 records run {lead['run_id']}")
                    + f"; this shard records run {w.run_id}, which merge keeps apart from the other ranks' unless "
                    "given --across-runs. Give every rank the same path (the collector inserts .rank<r>) or a "
                    "'{rank}' template, or pass the same run_id= to every rank's Collector")
            else:
                self._warn_once("run_id", f"trainhist: {self.path} continues at segment {w.segment}, rank 0 at "
                                f"segment {lead['segment']} (its file lost segments): merge pairs the ranks' segments "
                                "by number, so this attempt's do not line up; merge each attempt's files apart")
        if w.resumed:
            self._warn_once("resume", f"trainhist: {self.path} already holds a history: this run is appended to it as "
                            f"segment {self._writer.segment}; pass mode='w' to start the file over")

    def _place_completed(self) -> None:
        """Give the modules the forward just completed a position (the sites' ``order``, spec 2.2) where they have
        none: those of the first forward spaced by :data:`_ORDER_GAP` in the order they completed; each run of
        modules first seen later (experts routed to from some step on) spread evenly between the positions of the
        modules that completed just before and just after them (or 0, or the next position above), so they keep
        their place."""
        seq, self._completed = list(self._completed), {}
        placed = self._produced
        if not placed:
            placed.update((path, _ORDER_GAP * (k + 1)) for k, path in enumerate(seq))
            return
        i = 0
        while i < len(seq):
            if seq[i] in placed:
                i += 1
                continue
            j = i
            while j < len(seq) and seq[j] not in placed:
                j += 1
            lo = placed[seq[i - 1]] if i else 0
            hi = placed[seq[j]] if j < len(seq) else 0  # (the module that completed after them)
            if hi <= lo:
                hi = min((v for v in placed.values() if v > lo), default=lo + _ORDER_GAP * (j - i + 1))
            taken = set(placed.values())
            for k, path in enumerate(seq[i:j]):
                pos = lo + (hi - lo) * (k + 1) // (j - i + 1)
                while pos in taken:  # (no room left between two positions: after them)
                    pos += 1
                placed[path] = pos
                taken.add(pos)
            i = j

    def _pairing(self) -> str:
        """The path this collector was given (the same on every rank: one name, the collector inserting the rank,
        or a ``{rank}`` template), as a short hash: ranks pair their collectors by it and its count, so a collector
        only some ranks make (an evaluation's, to another file) does not shift the others' pairing, and ranks with
        other settings still pair. A name each rank spells out itself pairs with no one (a wait, then a warning):
        reading a rank into a name guesses wrong on names that hold its digits anyway (``gpt2.thist``)."""
        return f"{zlib.crc32(os.fspath(self._path_arg).encode()):08x}"  # type: ignore[arg-type]

    def _sharing(self, name: str, p: torch.Tensor) -> str:
        """A parameter's sharing: a DTensor's by its placements, an FSDP1 NO_SHARD unit's a replica, a plain
        parameter's a replica when ``replicas=`` names it (or its module), else as its wrapper says."""
        if id(p) in self._unsharded:
            return "replica"
        plain = type(p).__name__ != "DTensor" and not getattr(p, "_is_flat_param", False)
        return "replica" if plain and name in self._rep_params else param_sharing(p, self._ddp)

    def _register_sites(self) -> None:
        for s in self.plan.sites:
            if not s.provisional:
                self._handle(s.path, s.stream, s.facet)

    def _handle(self, path: str, stream: str, facet: str | None) -> object | None:
        key = (path, stream, facet)
        h = self._handles.get(key)
        if h is None:
            s = self.plan.find(path, stream, facet)
            new = s is None
            if new:  # a facet first seen during training (no discover(), or a new output structure)
                self.plan.sites = [
                    x for x in self.plan.sites if not (x.provisional and (x.path, x.stream) == (path, stream))
                ]
                if stream.startswith("param") and path in self._params:  # (a parameter first trained now)
                    s = self._param_site(path, self._params[path], stream)
                else:
                    s = PlannedSite(path, stream, facet, None, self._dtypes.get(key), None,
                                    "replica" if path in self._rep_modules else "shard",
                                    self.every[stream], self.sketch_every[stream])
                self.plan.sites.append(s)
            shape = s.shape if stream.startswith("param") else None
            if path in self._completed:  # (declared inside a forward that has not ended)
                self._place_completed()
            if key in self._redeclared:  # (refused once: not asked again at every step)
                return None
            try:
                h = self._writer.site(
                    path, stream, facet=facet, shape=shape,
                    dtype=self._dtypes.get(key) or s.dtype, sharing=s.sharing,
                    cadence_spine=s.every, cadence_sketch=s.sketch_every, sample=s.sample,
                    order=_u32((self._produced if stream.startswith("activation") else self._param_order).get(path)),
                )
            except Exception as e:  # noqa: BLE001 -- a broken disk must not kill the training run
                if not (isinstance(e, UsageError) and e.code == "site_redeclared"):
                    self._refused(e)
                    return None
                # (the file declares the site with another sharing or sample: spec 2.2)
                self._redeclared.add(key)
                self._warn_once("site_redeclared", f"trainhist: {e}; this session records no rows of such "
                                "sites (each is refused once; the file keeps their earlier rows): resume with the "
                                "settings the file was written with (delta_elements, seed, the model's wrapping), or "
                                "record into a new file")
                return None
            if h is not None:
                self._handles[key] = h
                for first, last, stride in self._absent_steps.get(stream, ()) if new else ():
                    for earlier in range(first, last + 1, stride or 1):
                        self._safe(self._writer.mark, h, earlier, "absent")
        return h

    def _safe(self, fn: object, *args: object, **kwargs: object) -> object:
        """Call the writer; an error is warned about once and never propagates into training."""
        try:
            return fn(*args, **kwargs)  # type: ignore[operator]
        except Exception as e:  # noqa: BLE001 -- a broken disk must not kill the training run
            self._refused(e)
            return None

    def _refused(self, e: Exception) -> None:
        """A writer call raised ``e``: a value the file cannot hold is warned about once per code; anything else
        is a writer error (:meth:`_writer_error`)."""
        if isinstance(e, UsageError) and e.code in _REFUSED_VALUES:  # (a value the file cannot hold: no disk)
            self._warn_once(("refused", e.code), f"trainhist: the history refused a value, which is not "
                            f"recorded ({e}); training continues")
        else:
            self._writer_error(e)

    def _writer_error(self, e: Exception) -> None:
        self.writer_errors += 1
        if self.writer_errors == 1:
            self._first_writer_error = repr(e)[:300]
        if "writer_stopped" in self._warned:
            return
        stopped = (isinstance(e, OSError) or getattr(e, "code", None) == "writer_failed"
                   or getattr(self._writer, "_failed", None) is not None)
        if not stopped and "writer" in self._warned:  # (a writer that stops after another error is still said)
            return
        if stopped:  # (the writer writes nothing after a failed write or sync: see HistoryWriter._fail)
            self._stopped = True
            what = (f"the history keeps every step up to its last commit, readable as it is, and this collector "
                    f"records nothing more: from its next step on it removes its hooks and reduces nothing (training "
                    f"continues, at its own speed). To go on recording once the cause is fixed (space freed): call "
                    f"col.close(), then make a new Collector on {self.path or 'the file'}: it appends a new segment "
                    f"(mode='a', its default)")
        else:
            what = ("training continues; further write errors are not reported, unless the writer stops: "
                    "close() says how many there were")
        self._warn_once("writer_stopped" if stopped else "writer",
                        f"trainhist: writing {self.path or 'the history'} failed ({e!r}): {what}")

    def _warn_once(self, key: object, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _warn_site(self, kind: str, key: tuple, msg: str) -> None:
        """A warning about site ``key``'s failing (``kind``: how), once a site; after :data:`_SITE_WARNINGS` sites
        of one kind, one more saying that further ones are recorded without a warning (a fault shared by every site
        would otherwise warn once for each of hundreds)."""
        if (kind, key[:2]) in self._warned:
            return
        n = self._site_warnings.get(kind, 0)
        self._site_warnings[kind] = n + 1
        if n < _SITE_WARNINGS:
            self._warn_once((kind, key[:2]), msg)
        elif n == _SITE_WARNINGS:
            self._warn_once((kind, "more"), f"trainhist: more than {_SITE_WARNINGS} sites failed this way ({kind}); "
                            "the others are recorded as 'failed' too, without a warning each")

    # -- the step -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int, *, truth: StepTruth | None = None, new_segment: bool = False) -> Iterator["Collector"]:
        """Context of one training step: everything the model and optimizer do inside it is recorded."""
        try:
            with self._lock:
                st = self._begin(step, truth, new_segment)
        finally:
            self._deferred_close()
        if st is None:
            yield self
            return
        # clip_grad_norm_ computes the norm, then calls this module's _clip_grads_with_norm_ by its global name: a
        # loop that bound clip_grad_norm_ itself at import (from torch.nn.utils import ...) still goes through it
        clip_mod = torch.nn.utils.clip_grad
        inner = getattr(clip_mod, "_clip_grads_with_norm_", None)
        orig_clip = (torch.nn.utils.clip_grad_norm_, clip_mod.clip_grad_norm_)
        norm_fn = getattr(clip_mod, "_get_total_norm", None) if inner is not None else None
        if inner is not None:
            clip_mod._clip_grads_with_norm_ = partial(self._clip_with_norm, inner)
            if norm_fn is not None:
                clip_mod._get_total_norm = partial(self._clip_norm, norm_fn)
        else:  # (an older torch: the public name only)
            torch.nn.utils.clip_grad_norm_ = clip_mod.clip_grad_norm_ = partial(self._clip, orig_clip[0])
        fsdp = self._fsdp1_class
        fsdp_clip = fsdp.__dict__.get("clip_grad_norm_") if fsdp is not None else None
        if fsdp_clip is not None:

            def clip_fsdp1(unit: torch.nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
                if id(unit) not in self._fsdp1:  # (another model's unit)
                    return fsdp_clip(unit, max_norm, norm_type)
                return self._clip_fsdp1(unit, partial(fsdp_clip, unit), max_norm, norm_type)

            fsdp.clip_grad_norm_ = clip_fsdp1  # type: ignore[union-attr]
        try:
            yield self
        except BaseException:
            st.interrupted = True  # (the loop's exception: recorded as such below, then raised on)
            raise
        finally:
            if inner is not None:
                clip_mod._clip_grads_with_norm_ = inner
            if norm_fn is not None:
                clip_mod._get_total_norm = norm_fn
            torch.nn.utils.clip_grad_norm_, clip_mod.clip_grad_norm_ = orig_clip
            if fsdp_clip is not None:
                fsdp.clip_grad_norm_ = fsdp_clip  # type: ignore[union-attr]
            try:
                with self._lock:
                    if self._state is st:  # (close() inside the step, or from another thread, has ended it already)
                        try:
                            with _no_flush():  # (the step's own reductions, decoding and writing: see _no_flush)
                                self._exit(st)
                        finally:
                            self._state = None
            finally:
                self._deferred_close()
                if self._detach_later:
                    self._detach_later = False
                    self._detach()

    def _deferred_close(self) -> None:
        """The close() a signal handler asked for while this thread held the lock (see close), once it does not."""
        if self._close_deferred and not self._lock._is_owned():  # type: ignore[attr-defined]
            self._close_deferred = False
            self.close()

    def _begin(self, step: int, truth: StepTruth | None, new_segment: bool) -> "_Step | None":
        """Open step ``step`` (see :meth:`step`); None when the writer has stopped (nothing is recorded)."""
        if self._closed:
            raise UsageError("the collector is closed")
        if self._state is not None:
            raise UsageError(f"step {step} entered while step {self._state.step} is still open")
        if self._stopped:  # the writer stopped (a full disk): nothing can be recorded, so nothing is reduced
            self._drain()  # (a step still in flight: its rows are refused, as any write now is)
            self._detach()
            return None
        if not self._fwd_handles:
            self.attach()
        last, self._last_step = self._last_step, int(step)
        if not new_segment and last is not None and int(step) <= last:  # (rows of one step twice: a new segment)
            new_segment = True
            self._warn_once("step_order", f"trainhist: step {step} entered after step {last}: a new segment starts "
                            "there (a rollback; pass new_segment=True to say so). Several forwards of one step are "
                            "micro-batches inside one col.step(), not a col.step() each")
        if new_segment:
            self._write_late()  # (the scalars given after the last step belong to the segment it ended)
            self._safe(self._writer.new_segment, int(step), "resume")
            self._written.clear()
            for steps in self._absent_steps.values():
                steps.clear()
        st = _Step(
            step=int(step), truth=truth or StepTruth(), t0=time.perf_counter(), thread=threading.get_ident(),
            due={s: s in self.streams and self.every[s] > 0 and step % self.every[s] == 0 for s in STREAMS},
            sketch={s: self.sketch_every[s] > 0 and step % self.sketch_every[s] == 0 for s in STREAMS},
            fused=self._ledger.device.type == "cpu" and _reduction.CPU_METHOD == "fused",
        )
        st.defer = (self.batch_outputs and not st.fused
                    and _reduction.batch_method(self._ledger.device) is not None)
        ftz, daz = _flush_mode()
        st.flush = ftz and daz
        if ftz != daz:
            self._warn_once("flush", "trainhist: this thread's float arithmetic flushes subnormal numbers to zero "
                            f"({'results' if ftz else 'inputs'} only: not torch.set_flush_denormal, which trainhist "
                            "switches off while it reduces); sums over subnormal values may miss their stated bound")
        self._ledger.reset(keys_clean=self._ledger_clean)
        # (a step whose every reduction is the fused kernel's spine writes no key column)
        self._ledger_clean = st.fused and not any(st.sketch.values())
        if self._compiled:  # run last: see the module's final output (uncompiled: _keep_last's pre-hook, each call)
            for m, hid in self._fwd_handles:
                _keep_last(hid, m, ())
        self._state = st
        st.ran_before, self._ran_outside = self._ran_outside, False
        self._place_completed()  # (a forward cut short in the previous step)
        self._follow_params(st.step)
        if not self._steps_entered:
            self._steps_entered = True
            self._check_params()
        if st.due["param_delta"]:
            with _no_flush():  # (float64 parameters are cast to float32: a flush would change subnormals)
                self._snapshot(st)
        return st

    def _exit(self, st: _Step) -> None:
        for h in st.leaf_hooks.values():
            h.remove()  # type: ignore[attr-defined]
        self._flush_deferred()
        if (self._compiled and (st.micro or st.outer) and st.due["activation"] and len(self._sel_modules) > 1
                and not any(k[0] == "activation" and k[1] != ROOT for k in st.counts)):
            st.blind = True  # the compiled code runs no hook added after it was compiled: nothing was seen
            self._warn_once("compiled", _COMPILED_BLIND)
        if st.micro == 0 and st.ran_before and not st.outer:
            self._warn_once("fwd_outside", f"trainhist: the model ran before step {st.step} began and not inside it: "
                            "its module rows read absent (did not run); run the forward inside the `with "
                            "col.step(...)` block")
        if st.interrupted:  # gradients of a backward cut short are not the step's: their rows are unknown
            st.host_scalars.append((st.step, "step_interrupted", 1.0))
            if st.due["param_grad"]:
                st.unknown.update(("param_grad", n, None, "default") for n in self._sel_params
                                  if ("param_grad", n, None, "default") not in st.grad_done)
                st.grad_done.update(st.unknown)
        else:
            self._capture_grads("default", None, at_exit=True)  # (those no clip and no optimizer step took)
            self._grads_left = {n: (weakref.ref(g), g._version) for n, p in self._params.items()
                                if (g := p.grad) is not None and type(g) is torch.Tensor}
        if st.clipped_any is not None:
            self._put_scalar(st, st.step, "_clipped", st.clipped_any)
        seen: dict[tuple, object] = {}  # (the parameters' fusable_at, read once for both streams)
        if st.due["param"]:
            self._reduce_many([(("param", name, None, "default"), self._params[name]) for name in self._sel_params],
                              found=seen)
        if st.due["param_delta"]:
            self._deltas(st, seen)
        for oi, opt in enumerate(self._optimizers):  # the rates its step used (a scheduler may have moved on)
            lrs = st.lrs.get(oi) or [g.get("lr") for g in opt.param_groups]
            for gi, lr in enumerate(lrs):
                # (the first optimizer's names do not change when another is attached later in the run)
                name = f"lr/group{gi}" if oi == 0 else f"lr/opt{oi}.group{gi}"
                self._put_scalar(st, st.step, name, lr)
        sc = self._scaler
        if sc is not None and sc.is_enabled() and getattr(sc, "_scale", None) is not None:
            # the scale the step's loss was multiplied by: before update() changed it
            self._put_scalar(st, st.step, "loss_scale", st.scale_used if st.scale_used is not None else sc._scale)
        st.host_scalars.append((st.step, "step_time", time.perf_counter() - st.t0))
        self._transfer(st)
        while len(self._pending) > self._lag:
            self._finish(self._pending.pop(0))

    def _transfer(self, st: _Step) -> None:
        """Move late tensor scalars into the ledger and start the step's single host transfer."""
        for i, (s, name, t) in enumerate(self._late):
            key = ("late", i)
            self._to_ledger(key, t)
            st.user_dev.append((s, name, key))
        self._late = []
        st.user_host += self._late_host
        self._late_host = []
        if st.counts or st.dev_scalars or st.user_dev:  # (with no lag, decoded before the ledger is touched again)
            st.pending = self._ledger.transfer(copy=self._lag > 0)
        self._pending.append(st)

    def _to_ledger(self, key: tuple, t: torch.Tensor) -> None:
        """Copy the one-element tensor ``t`` into the ledger's float64 slot ``key`` (read at the step's transfer)."""
        with _no_flush():  # (a cast to float64 must keep a subnormal)
            self._ledger.scalar(key).copy_(t.detach().reshape(1))

    def _put_scalar(self, st: _Step, step: int, name: str, value: object) -> None:
        value = self._plain_scalar(name, value)
        if value is None:
            return
        if isinstance(value, torch.Tensor):
            key = ("scalar", name)
            self._to_ledger(key, value)
            st.dev_scalars.append((step, name, key))
        else:
            st.host_scalars.append((step, name, float(value)))  # type: ignore[arg-type]

    def scalars(self, step: int, **values: float | torch.Tensor | None) -> None:
        """Record run-level scalars (loss, lr, ...); tensors are read at the next single transfer, never synced.

        Each value is one real number (a one-element tensor or array too; None: nothing recorded); anything else
        raises :class:`UsageError` ``bad_scalar``. A name given twice inside a step keeps the last value, one given
        again after its step's row of it was written is not recorded, and a name the collector records itself
        (``grad_norm``, ``step_time``, ...) keeps the collector's: a warning says so, once for each name.
        """
        if self._closed:
            raise UsageError("the collector is closed: scalars() after close() would be lost")
        if self._stopped:  # (nothing is recorded: not kept either, see _writer_error)
            return
        with _no_flush():  # (a subnormal value is neither zero nor flushed in a cast)
            self._scalars(step, values)

    def _plain_scalar(self, name: str, value: object) -> object:
        """``value``, or a DTensor's local tensor where that is its whole value; None (and a warning) for a sharded
        or partial DTensor, whose value no rank holds without a collective."""
        if type(value).__name__ != "DTensor":
            return value
        if replicated(value):  # type: ignore[arg-type]
            return value.to_local()  # type: ignore[attr-defined]
        self._warn_once(f"dtensor:{name}", f"trainhist: scalar {name!r} is a sharded or partial DTensor, whose "
                        "value no rank holds: not recorded; pass value.full_tensor()")
        return None

    def _scalars(self, step: int, values: dict[str, float | torch.Tensor]) -> None:
        st = self._state
        # (all checked before any is kept; None: nothing to record)
        given = {name: _scalar_value(name, v) for name, v in values.items() if v is not None}
        for name, v in given.items():
            v = self._plain_scalar(name, v)  # type: ignore[assignment]
            if v is None:
                continue
            if isinstance(v, torch.Tensor):
                if st is not None and st.step == step:
                    key = ("user", len(st.user_dev))
                    self._to_ledger(key, v)
                    st.user_dev.append((step, name, key))
                else:
                    self._late.append((int(step), name, v.detach()))
            elif st is not None and st.step == step:
                st.user_host.append((step, name, v))
            else:  # (after its step: written after that step's own rows, as tensors are)
                self._late_host.append((int(step), name, v))

    def _write_scalars(self, own: dict[tuple[int, str], float], given: list[tuple[int, str, float]]) -> None:
        """Write the collector's scalars (``own``) and the loop's (``given``, in the order given): of one name
        given twice for a step the last is kept, and one the collector records itself keeps the collector's; a
        warning says so, once for each name."""
        mine: dict[tuple[int, str], float] = {}
        for s, name, v in given:
            if (s, name) in mine:
                self._warn_once(("scalar_twice", name), f"trainhist: scalar {name!r} was given more than once for "
                                f"step {s} (per micro-batch?): the last value is recorded; give the step's value once")
            mine[(s, name)] = v
        for k, v in mine.items():
            if k in own:
                self._warn_once(("scalar_own", k[1]), f"trainhist: scalar {k[1]!r} is one the collector records "
                                f"itself (step {k[0]}): its own value is kept and the one given is not; give yours "
                                "another name")
            elif self._written.get(k[1]) == k[0]:  # (given after its step, whose row of that name is written)
                self._warn_once(("scalar_after", k[1]), f"trainhist: scalar {k[1]!r} was given for step {k[0]} "
                                "after that step's value of it was recorded: the later one is not recorded")
            else:
                own[k] = v
        w, written = self._writer, self._written
        for (s, name), v in sorted(own.items(), key=lambda kv: kv[0][0]):  # (an earlier step's late ones first)
            written[name] = s
            self._safe(w.scalar, name, s, v)

    # -- reductions -----------------------------------------------------------------------------------------
    def _reduce(self, key: tuple, t: torch.Tensor, alias: bool = False) -> None:
        st = self._state
        if st is None or key in st.failed:
            return
        if st.flush:
            with _no_flush():
                self._reduce_in(st, key, t, alias)
        else:
            self._reduce_in(st, key, t, alias)

    def _reduce_alias(self, st: _Step, key: tuple, t: torch.Tensor) -> None:
        """``_reduce(key, t, alias=True)`` of a module output or of its gradient in step ``st`` (the current one),
        with the CPU kernel's common case inlined: :meth:`_reduce_in`, :func:`fusable_at` (the same checks, in the same
        order), :meth:`_reduce_plain` and :meth:`_merge_alias`. Over a hundred calls a step, each one just after a
        kernel call has streamed megabytes through the CPU's caches: every Python call and lookup costs there."""
        if key in st.failed:
            return
        if st.flush or not st.fused:
            self._reduce(key, t, alias=True)
            return
        try:
            dt = t.dtype
            tt = type(t)
            if not ((dt is _FLOAT32 or dt is _FLOAT64) and (tt is _TENSOR or tt is _PARAMETER) and t.layout == _STRIDED
                    and t.is_cpu and t.is_contiguous() and not t.is_neg()):
                self._reduce_in(st, key, t, True)  # (fusable_at: None)
                return
            n, address = t.numel(), t.data_ptr()
            if not (n > 0 and address != 0):
                self._reduce_in(st, key, t, True)
                return
            if key not in self._typed:
                self._typed.add(key)
                self._dtypes.setdefault((key[1], key[0], key[2]), _dtype_name(t))
            # (_merge_alias, ident: the kernel reads n contiguous elements at address: those three make its result)
            merged = False
            try:
                version = t._version
            except RuntimeError:  # an inference tensor has no version counter: no aliasing shortcut
                pass
            else:
                seen = st.seen
                ident = (key[0], address, n, dt)
                hit = seen.get(ident)
                if hit is not None:
                    ref, seen_version, first = hit
                    if ref() is not None and seen_version == version and first != key and st.reductions.get(first) == 1:
                        self._ledger.merge_on_host(key, first)
                        merged = True
                if not merged:
                    seen[ident] = (weakref.ref(t), version, key)
            if not merged:
                ledger = self._ledger
                off = ledger.rows.get(key)
                fused_at(address, n, dt, ledger.address(key) if off is None else ledger._base + 8 * off,
                         st.sketch.get(key[0], True))
            reductions, counts = st.reductions, st.counts
            reductions[key] = reductions.get(key, 0) + 1
            counts[key] = counts.get(key, 0) + n
        except Exception as e:  # noqa: BLE001 -- one bad site must not stop training
            self._fail(key, e)

    def _reduce_in(self, st: _Step, key: tuple, t: torch.Tensor, alias: bool) -> None:
        try:
            at = fusable_at(t) if st.fused else None
            if at is not None:  # the common case on the CPU: the kernel reads the tensor in place
                self._reduce_plain(st, key, t, alias, at)
                return
            t = local_tensor(t)
            if t.layout in _SPARSE:
                self._reduce_sparse(st, key, t)
                return
            site = (key[1], key[0], key[2])
            if site not in self._dtypes:
                self._dtypes[site] = _dtype_name(t)
                if t.dtype in _WIDE_INTS:
                    self._wide_ints.add(site)
            n = t.numel()
            if n:
                if (st.defer and key[:3] not in self._eager and triton_batchable(t, self._ledger.device)
                        and not t.is_inference()  # (an inference tensor has no version counter)
                        and _reduction.batch_method(self._ledger.device) is not None):  # (not after a failure)
                    self._defer(key, t)
                elif not (alias and not st.defer and self._merge_alias(st, key, t, self._identity(key, t))):
                    sketch = st.sketch.get(key[0], True)
                    if st.fused and is_plain(t):
                        # the CPU kernel, straight into the (host) ledger row
                        fused_into(t if t.is_cpu else t.to("cpu"), self._ledger.address(key), sketch)
                    else:  # the torch ops (on a CPU ledger: a tensor subclass, whose memory need not hold its values)
                        if t.device != self._ledger.device:
                            t = t.to(self._ledger.device, non_blocking=True)
                        reduce_into(t, self._ledger.row(key), sketch=sketch, method="bincount" if st.fused else None)
                st.reductions[key] = st.reductions.get(key, 0) + 1
            st.counts[key] = st.counts.get(key, 0) + n
        except Exception as e:  # noqa: BLE001 -- one bad site must not stop training
            self._fail(key, e)

    def _reduce_sparse(self, st: _Step, key: tuple, t: torch.Tensor) -> None:
        """A sparse tensor (``nn.Embedding(sparse=True)``'s gradient): its stored values reduced as a dense tensor
        would be, its implicit zeros counted into the row (:func:`add_zeros`): a dense copy cost the whole table's
        memory and a pass over it every step. Repeated indexes of a COO tensor add first, as they do in it."""
        vals = (t.coalesce() if t.layout is torch.sparse_coo else t).values().reshape(-1)
        site = (key[1], key[0], key[2])
        self._dtypes.setdefault(site, _dtype_name(t))
        sketch = st.sketch.get(key[0], True)
        if vals.numel():
            if st.fused and is_plain(vals):
                fused_into(vals if vals.is_cpu else vals.to("cpu"), self._ledger.address(key), sketch)
            else:
                vals = vals.to(self._ledger.device, non_blocking=True)
                reduce_into(vals, self._ledger.row(key), sketch=sketch, method="bincount" if st.fused else None)
        # (a row the Triton kernel's device writes holds key counts even between sketches: the zeros' key too)
        keyed = sketch or (not st.fused and _reduction._keyed_device(vals))
        add_zeros(self._ledger.row(key), t.numel() - vals.numel(), sketch=keyed)
        st.reductions[key] = st.reductions.get(key, 0) + 1
        st.counts[key] = st.counts.get(key, 0) + t.numel()

    def _reduce_plain(self, st: _Step, key: tuple, t: torch.Tensor, alias: bool,
                      at: tuple[int, int, torch.dtype]) -> None:
        """:meth:`_reduce` of a tensor :func:`fusable_at` accepted (``at``: what it read), with none of its checks
        repeated (hundreds of reductions a step take this path on the CPU)."""
        if key not in self._typed:
            self._typed.add(key)
            self._dtypes.setdefault((key[1], key[0], key[2]), _dtype_name(t))
        address, n, dt = at
        # (the kernel reads n contiguous elements at address: those three make its result, whatever the shape)
        if not (alias and self._merge_alias(st, key, t, (key[0], address, n, dt))):
            fused_at(address, n, dt, self._ledger.address(key), st.sketch.get(key[0], True))
        st.reductions[key] = st.reductions.get(key, 0) + 1
        st.counts[key] = st.counts.get(key, 0) + n

    def _defer(self, key: tuple, t: torch.Tensor) -> None:
        """Hold ``t`` for the next batched reduction (its version, to see a later in-place change)."""
        self._deferred.append((key, t, t._version))
        self._deferred_bytes += t.numel() * t.element_size()
        if len(self._deferred) >= DEFER_TENSORS or self._deferred_bytes >= DEFER_BYTES:
            self._flush_deferred()

    def _flush_deferred(self) -> None:
        """Reduce the held tensors with the batched kernel, in rounds that each reduce into a row once (the same
        site can be held twice: a module called twice in a forward). A tensor changed in place since it was
        held cannot be read as it was: its site records 'failed' this step and is reduced as soon as it is
        produced from then on (discover() finds most such sites before step 0)."""
        items, self._deferred, self._deferred_bytes = self._deferred, [], 0
        st = self._state
        if not items or st is None:
            return
        rounds: list[dict[tuple, torch.Tensor]] = []
        for key, t, version in items:
            if key in st.failed:
                continue
            if t._version != version:
                self._eager.add(key[:3])
                self._fail(key, RuntimeError("its values were changed in place by a later operation before the "
                                             "batched reduction read them; from now on it is reduced as soon as "
                                             "it is produced"))
                continue
            for r in rounds:
                if key not in r:
                    r[key] = t
                    break
            else:
                rounds.append({key: t})
        for r in rounds:
            keys, tensors = list(r), list(r.values())
            done = self._batched(keys, tensors)
            if done is None:
                continue
            for i, (key, t) in enumerate(zip(keys, tensors)):
                if i not in done:  # (the batched launch failed: the per-tensor path, the torch ops from now on)
                    try:
                        reduce_into(t, self._ledger.row(key))
                    except Exception as e:  # noqa: BLE001 -- one bad site must not stop training
                        self._fail(key, e)

    def _batched(self, keys: list[tuple], tensors: list[torch.Tensor]) -> set[int] | None:
        """:func:`triton_many` of ``tensors`` into the rows of ``keys`` (distinct): the positions it reduced, or
        None when it raised (out of memory, say), after recording every one of these sites as failed."""
        try:
            return set(triton_many(tensors, self._ledger.offsets(keys), self._ledger))
        except Exception as e:  # noqa: BLE001 -- these sites fail, training goes on
            for key in keys:
                self._fail(key, e)
            return None

    def _reduce_many(self, items: list[tuple[tuple, torch.Tensor]], known: dict | None = None,
                     found: dict | None = None) -> None:
        """:meth:`_reduce` of the (key, tensor) pairs of one stream, with no aliasing (parameters, gradients,
        updates), in order: on the CPU kernel's path the :func:`~.reduce.fusable_at` tensors are reduced by one
        compiled call (:func:`~.reduce.fused_many_at`), on a GPU with Triton the plain contiguous float tensors by
        one launch per dtype (:func:`triton_many`), the others one by one; the rows are the same. ``known``: the
        :func:`~.reduce.fusable_at` of some keys' tensors, which the caller has (the same tensors, unchanged);
        ``found``: filled with those read here, by key."""
        st = self._state
        if st is None or not items:
            return
        batched = st.fused or _reduction.batch_method(self._ledger.device) is not None
        if not batched:
            for key, t in items:
                self._reduce(key, t)
            return
        keys, tensors = [], []
        for key, t in items:
            if key in st.failed:
                continue
            try:
                t = local_tensor(t)
            except Exception as e:  # noqa: BLE001 -- one bad site must not stop training
                self._fail(key, e)
                continue
            keys.append(key)
            tensors.append(t)
        done: set[int] = set()
        ats: list = []
        if st.fused:
            try:
                if known:
                    ats = [known[k] if k in known else fusable_at(t) for k, t in zip(keys, tensors)]
                else:
                    ats = fusable_ats(tensors)
            except Exception:  # noqa: BLE001 -- one tensor that cannot be read: that site fails, not the others
                ats = []
                for k, t in zip(keys, tensors):
                    try:
                        ats.append(known[k] if known and k in known else fusable_at(t))
                    except Exception as e:  # noqa: BLE001
                        self._fail(k, e)
                        ats.append(None)
            if found is not None:
                found.update(zip(keys, ats))
            pick = [i for i, at in enumerate(ats) if at is not None]
            if pick:
                try:
                    rows = self._ledger.addresses([keys[i] for i in pick])
                    done = {pick[j] for j in fused_many_at([ats[i] for i in pick], rows,
                                                           st.sketch.get(keys[0][0], True))}
                except Exception as e:  # noqa: BLE001 -- its rows may hold part of it: these sites fail this step
                    for i in pick:
                        self._fail(keys[i], e)
        elif tensors:  # the GPU's batched kernel (key counts always: no sketch flag)
            got = self._batched(keys, tensors)
            if got is None:
                return
            done = got
        typed, dtypes, reductions, counts = self._typed, self._dtypes, st.reductions, st.counts
        if ats and len(done) == len(keys):  # (the common case: the compiled call took every one of them)
            for key, t, at in zip(keys, tensors, ats):
                if key not in typed:  # (its site's dtype is known once it is)
                    typed.add(key)
                    site = (key[1], key[0], key[2])
                    if site not in dtypes:
                        dtypes[site] = _dtype_name(t)
                reductions[key] = reductions.get(key, 0) + 1
                counts[key] = counts.get(key, 0) + at[1]
            return
        for i, (key, t) in enumerate(zip(keys, tensors)):
            if i not in done:
                self._reduce(key, t)
                continue
            site = (key[1], key[0], key[2])
            if site not in dtypes:
                dtypes[site] = _dtype_name(t)
            reductions[key] = reductions.get(key, 0) + 1
            counts[key] = counts.get(key, 0) + (ats[i][1] if ats else t.numel())  # type: ignore[index]

    @staticmethod
    def _identity(key: tuple, t: torch.Tensor) -> tuple | None:
        """What makes two tensors the very same values for :meth:`_merge_alias` (None: no aliasing shortcut)."""
        if not is_plain(t):
            return None  # a subclass may have no storage of its own (data_ptr 0 for all): no aliasing shortcut
        try:
            ident = (key[0], t.data_ptr(), t.get_device(), t.shape, t.stride(), t.dtype, t.is_neg())
        except Exception:  # noqa: BLE001 -- a tensor without plain storage: no aliasing shortcut
            return None
        return None if ident[1] == 0 else ident

    def _merge_alias(self, st: _Step, key: tuple, t: torch.Tensor, ident: tuple | None) -> bool:
        """Reuse an earlier reduction of the very same tensor (``ident``: same memory, layout and version) in this
        step.

        A module often returns a tensor another module already returned (a container returns its last child's
        output, dropout in eval mode or with p=0 its input), and gradient hooks of one tensor see one gradient.
        The earlier row is merged in only while it holds that reduction alone; the earlier tensor is still
        alive (weak reference), so its memory cannot have been reused by another tensor.
        """
        if ident is None:
            return False
        try:
            version = t._version
        except RuntimeError:  # an inference tensor has no version counter: no aliasing shortcut
            return False
        hit = st.seen.get(ident)
        if hit is not None:
            ref, seen_version, first = hit
            if ref() is not None and seen_version == version and first != key and st.reductions.get(first) == 1:
                if st.fused:
                    self._ledger.merge_on_host(key, first)
                else:
                    merge_row(self._ledger.row(key), self._ledger.row(first))
                return True
        st.seen[ident] = (weakref.ref(t), version, key)
        return False

    def _fail(self, key: tuple, e: BaseException) -> None:
        st = self._state
        if st is not None:
            st.failed.add(key)
            st.counts.pop(key, None)
        self._warn_site("reduce", key, f"trainhist: reducing {key[1]!r} ({key[0]}) failed: {e!r}; recorded as "
                        "'failed'")

    def _on_forward(self, path: str, module: torch.nn.Module, args: tuple, output: object) -> None:
        st = self._state
        if st is None:
            if path == ROOT:  # (a forward between steps: an evaluation, or a training forward outside the step)
                self._ran_outside = True
            return
        in_backward = _graph_task_id() != -1
        if not in_backward:
            if path in self._sel_modules:
                self._completed.setdefault(path)
            if path == ROOT:  # (the forward is over)
                st.micro += 1
                self._place_completed()
        if path in self._sel_modules:
            act, grad = st.due["activation"], st.due["activation_grad"]
            # (a bare tensor, as most modules return: flatten_output's first case, without a generator)
            facets = ((None, output),) if isinstance(output, torch.Tensor) and not output.is_complex() \
                else flatten_output(output)
            for facet, t in facets:
                if act and not in_backward:
                    self._reduce_alias(st, ("activation", path, facet, "default"), t)
                if grad and t.requires_grad:
                    key = ("activation_grad", path, facet, "default")
                    if not t.is_leaf:  # (on the node that made it, going with the graph: see _on_grad_in)
                        t.grad_fn.register_prehook(partial(self._on_grad_in, key, st, [0], t.output_nr))
                    elif (key, id(t)) not in st.leaf_hooks:  # (a leaf's hook sees its whole gradient: once a step)
                        st.leaf_hooks[(key, id(t))] = t.register_hook(partial(self._on_grad, key, st, [0]))
        if path == ROOT and self._deferred:  # the forward is over: reduce what it held
            self._flush_deferred()

    def _on_outer(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if self._state is not None:
            self._state.outer += 1

    def _on_grad_in(self, key: tuple, st: _Step, passes: list[int], nr: int, grads: tuple) -> None:
        """The pre-hook of the node that made an output (its output ``nr``): the gradient reaching that output as the
        node receives it, after every hook of the tensor itself ran, also one registered after this one (a fault
        injected into the gradient is seen at the module whose backward receives it). Cheaper than a tensor hook,
        too. A pass that does not run the node (``torch.autograd.grad`` with the output itself among ``inputs``)
        does not give it."""
        if nr < len(grads) and grads[nr] is not None:
            self._on_grad(key, st, passes, grads[nr])

    def _on_grad(self, key: tuple, st: _Step, passes: list[int], grad: torch.Tensor) -> None:
        """The gradient reaching an output that step ``st`` produced (``passes``: how often it has, this one
        included). One reaching it in a later step (a graph kept across steps) is not this step's: left out."""
        if self._state is not st:
            if self._closed:  # (close() from another thread ended the step: see close)
                return
            self._warn_once("late_grad", f"trainhist: a gradient reached the output of {key[1]!r} of step {st.step} "
                            "after that step ended (a graph kept across steps): it is not recorded; only gradients "
                            "reaching a step's own outputs during the step are")
            return
        passes[0] += 1
        if passes[0] == 2:
            self._warn_once("passes", f"trainhist: several backward passes in step {st.step} reached the output of "
                            f"{key[1]!r} (retain_graph, torch.autograd.grad): its activation_grad row combines "
                            "every pass's gradient (counts and sums add, min/max extend: spec 11.2); it does not "
                            "describe the gradient summed over the passes")
        self._reduce_alias(st, key, grad)

    def _param_names(self, params: Iterable[torch.Tensor] | None) -> list[str]:
        if params is None:
            return list(self._sel_params)  # (in the order of _params, as it was made)
        ids = {id(p) for p in params}
        return [n for n, p in self._params.items() if id(p) in ids and n in self._sel_params]

    def _basis(self, st: _Step) -> str | None:
        sc = self._scaler
        if sc is None:
            return None
        if not sc.is_enabled():
            return "unscaled"
        return "unscaled" if st.unscaled else "scaled"

    def _capture_grads(self, phase: str, params: Iterable[torch.Tensor] | None, at_exit: bool = False) -> None:
        with _no_flush():  # (the global norm too)
            self._capture_grads_in(phase, params, at_exit)

    def _capture_grads_in(self, phase: str, params: Iterable[torch.Tensor] | None, at_exit: bool) -> None:
        """Reduce the gradients of ``params`` (None: every selected parameter) in ``phase``; in phase ``default``,
        those of parameters no clip took this step. Read at step exit with no optimizer step before, a missing
        gradient may have been cleared by the loop (``zero_grad``): its row is ``unknown``, not ``absent``."""
        st = self._state
        if st is None:
            return
        cleared = at_exit and not st.opt_called
        stale = self._stale_grads() if cleared else set()
        if phase == "default" and not st.norm_done:
            if st.clip_seen:  # some gradients were clipped, not all: the norm of what the optimizer gets
                self._total_grad_norm(st, "grad_norm_post_clip" + self._norm_suffix, stale)
            elif not (st.due["param_grad"] and self._all_trainable_selected()):  # (else: from the spines)
                self._total_grad_norm(st, "grad_norm" + self._norm_suffix, stale)
        if not st.due["param_grad"]:
            return
        items = []
        missing = 0
        orphans: list[str] = []
        grad_done, all_params = st.grad_done, self._params
        clipped = st.clipped_names if phase == "default" else ()
        for name in self._param_names(params):
            if name in clipped:
                continue
            key = ("param_grad", name, None, phase)
            if key in grad_done:
                continue
            grad_done.add(key)
            if name in stale:  # (no backward reached it this step: absent)
                continue
            p = all_params[name]
            g = p.grad
            if g is None and local_tensor(p).numel() == 0:  # (no part of it on this rank: FSDP1 drops its gradient)
                g = local_tensor(p).detach()
            if g is not None:
                items.append((key, g))
            elif cleared:
                st.unknown.add(key)
                missing += 1
            elif at_exit and self._unattached(st, name, p):  # (its optimizer, not attached, stepped: the loop may have
                st.unknown.add(key)  # cleared its gradient since, as it clears the attached ones' after theirs)
                orphans.append(name)
        if orphans:
            self._warn_once("orphans", f"trainhist: parameters no attached optimizer holds ({', '.join(orphans[:3])}"
                            f"{', ...' if len(orphans) > 3 else ''}) had no gradient at the end of step {st.step}: "
                            "recorded unknown (the loop may have cleared it); attach every optimizer "
                            "(attach(optimizer=[opt1, opt2])) so that gradients are read when each one steps")
        if missing and not items and not self._optimizers:
            self._warn_once("no_grads", "trainhist: no parameter had a gradient at the end of the step and no "
                            "optimizer is attached, so gradients cannot be read when the optimizer uses them (the "
                            "loop may clear them first): param_grad is recorded as 'unknown'; call "
                            "attach(optimizer=opt)")
        self._reduce_many(items)
        if items:
            st.bases.add(self._basis(st))

    def _unattached(self, st: _Step, name: str, p: torch.Tensor) -> bool:
        """Whether no attached optimizer holds ``p``, a parameter of the model (an optimizer the loop steps without
        attaching it); not one the model no longer holds (replaced, tied to another)."""
        owner = self._owners.get(name)
        if not self._optimizers or (owner is not None and owner[0]._parameters.get(owner[1]) is not p):
            return False
        if st.attached is None:
            st.attached = {id(q) for o in self._optimizers for g in o.param_groups for q in g["params"]}
        return id(p) not in st.attached

    def _stale_grads(self) -> set[str]:
        """Parameters whose gradient is the very tensor, unchanged, that the previous step left: at the end of a
        step with no optimizer step, an earlier step's gradient (an evaluation step; the loop clears gradients at
        the start of the next training step), not this step's."""
        stale = set()
        for n, (ref, version) in self._grads_left.items():
            g = ref()
            if g is not None and g is self._params[n].grad and g._version == version:
                stale.add(n)
        return stale

    def _total_grad_norm(self, st: _Step, name: str, skip: set[str] = frozenset()) -> None:
        """The global gradient norm as a device scalar, on steps where the param_grad spines do not give it.

        One batched reduction over every trainable parameter's gradient (``torch.nn.utils.get_total_norm``, the
        norm ``clip_grad_norm_`` computes), read at the step's single transfer: a cheap whole-model check that
        shows a non-finite gradient at the step it happens, whatever the per-site cadence.
        """
        grads = [local_tensor(p.grad) for n, p in self._params.items()
                 if p.requires_grad and p.grad is not None and n in self._norm_params and n not in skip]
        grads = [g.coalesce().values() if g.is_sparse else g for g in grads]  # (sparse: repeated indexes add)
        if not grads:
            return
        st.norm_done = True
        try:
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            self._put_scalar(st, st.step, name, norm.detach().to(torch.float64))
        except Exception as e:  # noqa: BLE001 -- a scalar must not stop training
            self._warn_once("grad_norm", f"trainhist: the global gradient norm failed: {e!r:.300}")

    def _clip(self, orig: object, parameters: object, max_norm: float, *args: object, **kwargs: object) -> object:
        """``clip_grad_norm_`` on a torch without ``_clip_grads_with_norm_``: the norm is what it returns."""
        return self._around_clip(lambda ps: orig(ps, max_norm, *args, **kwargs), parameters, max_norm, None)

    def _clip_with_norm(self, orig: object, parameters: object, max_norm: float, total_norm: torch.Tensor,
                        *args: object, **kwargs: object) -> object:
        """torch's ``_clip_grads_with_norm_`` (what ``clip_grad_norm_`` calls once it has the norm), however the
        loop reached it."""
        return self._around_clip(lambda ps: orig(ps, max_norm, total_norm, *args, **kwargs), parameters, max_norm,
                                 total_norm)

    def _clip_norm(self, orig: Callable[..., torch.Tensor], tensors: object, *args: object,
                   **kwargs: object) -> torch.Tensor:
        """torch's ``_get_total_norm`` as ``clip_grad_norm_`` calls it: when it raises (``error_if_nonfinite``:
        a non-finite norm, before any clip), the gradients it was given are read first, in phase ``default`` (no
        clip took them), so that the non-finite values are recorded even if the loop then clears them."""
        try:
            return orig(tensors, *args, **kwargs)
        except Exception:
            ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)  # type: ignore[arg-type]
            ids = {id(t) for t in ts}
            params = [p for p in self._params.values() if p.grad is not None and id(p.grad) in ids]
            if params and self._state is not None:
                self._guarded(self._capture_grads, "default", params)
            raise

    def _clip_fsdp1(self, unit: torch.nn.Module, orig: Callable[..., torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
        """FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``: the norm it returns is the whole model's (it
        all-reduces the ranks' parts); one other than the 2-norm is not recorded as ``grad_norm`` (a norm that is
        no tensor, NaN here, is one :meth:`_clipped` does not record)."""
        return self._around_clip(lambda ps: orig(max_norm, norm_type), list(unit.parameters()), max_norm,
                                 None if float(norm_type) == 2.0 else math.nan, whole=True)

    def _around_clip(self, call: Callable[[object], object], parameters: object, max_norm: float,
                     norm: torch.Tensor | None, whole: bool | None = None) -> object:
        """``call`` (a clip of ``parameters``) with their gradients captured before and after it; ``norm``: the
        total norm it clips with (None: the one it returns); ``whole``: whether that is the whole model's norm
        (None: as :meth:`_clipped` tells)."""
        st = self._state
        if st is None:
            return call(parameters)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)  # type: ignore[arg-type]
        ours = self._param_ids
        if not any(id(p) in ours for p in params):  # (another model's clip: not this history's step)
            return call(params)
        mixed = not all(id(p) in ours for p in params)  # (its norm is then of other models' gradients too)
        own = mixed and not st.norm_done and self._clips_all(params)
        if own:  # (this model's own norm, before and after the clip: the clip's is of more than this model)
            self._guarded(self._total_grad_norm, st, "grad_norm" + self._norm_suffix)
        self._guarded(self._capture_grads, "pre_clip", params)
        out = call(params)
        self._guarded(self._capture_grads, "post_clip", params)
        if own:
            self._guarded(self._total_grad_norm, st, "grad_norm_post_clip" + self._norm_suffix)
        self._guarded(self._clipped, st, params, max_norm, out if norm is None else norm, whole, mixed)
        return out

    def _clips_all(self, params: list[torch.Tensor]) -> bool:
        """Whether ``params`` holds every trainable parameter of this model."""
        ids = {id(p) for p in params}
        return all(id(p) in ids for p in self._params.values() if p.requires_grad)

    def _guarded(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)``, recording, inside a call of the loop's (a clip): an error is warned about once and never
        propagates into training."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 -- recording must not break the loop's clip
            self._warn_once(("guarded", fn.__name__), f"trainhist: recording around clip_grad_norm_ failed ({e!r}); "
                            "training continues")

    def _clipped(self, st: _Step, params: list[torch.Tensor], max_norm: float, norm: object,
                 whole: bool | None = None, mixed: bool = False) -> None:
        """After a clip of ``params``: their rows are pre/post-clip ones; the global norms are the clip's own when
        it took every trainable parameter (a clip of some of them leaves the others' gradients as they are).
        ``whole``: whether a plain tensor ``norm`` is the whole model's (None: unless the gradients are sharded);
        ``mixed``: the clip took other models' parameters too, so its norm is no norm of this model's."""
        st.clip_seen = True
        ids = {id(p) for p in params}
        st.clipped_names.update(n for n, p in self._params.items() if id(p) in ids)
        if isinstance(max_norm, (int, float)):
            st.clip_threshold = float(max_norm)
        if not isinstance(norm, torch.Tensor):
            return
        if whole is None:  # (a plain tensor's norm of sharded gradients is of this rank's part)
            whole = not self._norm_suffix
        if type(norm).__name__ == "DTensor":  # (FSDP2: the whole gradients' norm when replicated, else a part's)
            whole = replicated(norm)
            norm = norm.to_local()
        norm = norm.detach()
        every = not mixed and self._clips_all(params)
        if whole:  # (of a rank's part of the gradients, the norm does not say whether clip scaled them)
            coef = max_norm / (norm + 1e-6)  # clip_grad_norm_'s own coefficient, in its dtype
            clipped = (coef < 1).to(torch.float64)
            st.clipped_any = clipped if st.clipped_any is None else torch.maximum(st.clipped_any, clipped)
            if every and not st.norm_done:
                n = norm.to(torch.float64)
                post = n * torch.clamp(coef, max=1.0).to(torch.float64)
                for name, v in (("grad_norm", n), ("grad_norm_post_clip", post)):
                    self._put_scalar(st, st.step, name, v)
                st.norm_done = True
        elif every and not st.norm_done and not self._copies:  # (the post-clip norm of this rank's part would need
            # the global one; a rank holding copies of other ranks' shards (HSDP) leaves the norm to its own parts)
            self._put_scalar(st, st.step, "grad_norm_local", norm.to(torch.float64))
            st.norm_done = True

    def _applied(self, st: _Step, before: float | None, after: float | None) -> tuple[bool | None, dict[str, str]]:
        """Whether the step's update was applied (None: unknown), and the parameters whose update is not measured:
        ``skipped`` those it certainly did not update, ``unknown`` those of an optimizer an interrupted step never
        called (no update was made, but not because the loop skipped it).

        Per attached optimizer: its step ran (the post-hook fired: applied), or it was never called (no update;
        under a GradScaler, the scaler skipped it for an overflow), or it was given ``found_inf`` (a fused step
        under a GradScaler: applied unless the scale went down, which with one optimizer means it skipped). The
        step is applied when every optimizer was, not when none was, else unknown; an interrupted step's optimizers
        that never ran are unknown, not skipped."""
        decreased = st.scaler_updated and before is not None and after is not None and after < before
        if not self._optimizers:
            return (None if not st.scaler_updated or before is None or after is None else not decreased), {}
        verdicts = []
        for oi in range(len(self._optimizers)):
            state = st.opt_state.get(oi)
            if state == "stepped":
                verdicts.append(True)
            elif state is None:
                verdicts.append(None if st.interrupted else False)
            elif state == "maybe" and st.scaler_updated and before is not None and after is not None:
                verdicts.append(True if not decreased else False if len(self._optimizers) == 1 else None)
            else:
                verdicts.append(None)
        applied = True if all(v is True for v in verdicts) else False if all(v is False for v in verdicts) else None
        if applied is False:
            return False, dict.fromkeys(self._params, "skipped")
        held: dict[str, str] = {}
        for oi, v in enumerate(verdicts):
            unrun = v is None and st.interrupted and st.opt_state.get(oi) is None
            if v is False or unrun:
                ids = {id(p) for g in self._optimizers[oi].param_groups for p in g["params"]}
                held.update((n, "skipped" if v is False else "unknown") for n, p in self._params.items()
                            if id(p) in ids)
        return applied, held

    def _opt_index(self, opt: torch.optim.Optimizer) -> int | None:
        """The position of ``opt`` among the attached optimizers (None: not attached)."""
        return next((i for i, o in enumerate(self._optimizers) if o is opt), None)

    def _on_opt_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        st = self._state
        if st is None:
            if not self._closed:
                self._warn_once("opt_outside", "trainhist: an attached optimizer stepped outside col.step(): that "
                                "update is not recorded, and the step before it reads as not applied (skipped); "
                                "call optimizer.step() inside the `with col.step(...)` block")
            return
        st.opt_called = True
        oi = self._opt_index(opt)
        if oi is not None:
            st.opt_state[oi] = "called"
        if oi is not None and oi not in st.lrs:  # the rates this update uses (a tensor lr: its value now)
            st.lrs[oi] = [lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
                          for lr in (g.get("lr") for g in opt.param_groups)]
        if not _closure(args, kwargs):  # (a closure computes the gradients inside the step: read after it)
            self._capture_grads("default", [p for g in opt.param_groups for p in g["params"]])

    def _on_opt_post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        st = self._state
        if st is None:
            return
        # a step given found_inf (a fused optimizer under a GradScaler) may have skipped inside its kernel
        maybe = kwargs.get("found_inf") is not None
        oi = self._opt_index(opt)
        if oi is not None:
            st.opt_state[oi] = "maybe" if maybe else "stepped"
        if _closure(args, kwargs):  # the gradients of the closure's last evaluation (LBFGS evaluates it repeatedly)
            self._capture_grads("default", [p for g in opt.param_groups for p in g["params"]])

    def _scaler_unscale(self, optimizer: object) -> object:
        out = self._scaler_orig["unscale_"](optimizer)  # type: ignore[operator]
        if self._state is not None:
            self._state.unscaled = True
        return out

    def _scaler_step(self, optimizer: torch.optim.Optimizer, *args: object, **kwargs: object) -> object:
        out = self._scaler_orig["step"](optimizer, *args, **kwargs)  # type: ignore[operator]
        st = self._state
        if st is not None:  # the scaler skipped the step: keep the (non-finite) gradients
            self._capture_grads("default", [p for g in optimizer.param_groups for p in g["params"]])
        return out

    def _scaler_update(self, new_scale: object = None) -> object:
        st, sc = self._state, self._scaler
        before = getattr(sc, "_scale", None)
        if st is not None and before is not None:
            used = before.detach().clone()
            self._put_scalar(st, st.step, "_scale_before", used)
            if st.scale_used is None:
                st.scale_used = used
        out = self._scaler_orig["update"](new_scale)  # type: ignore[operator]
        after = getattr(sc, "_scale", None)
        if st is not None and before is not None and after is not None:
            self._put_scalar(st, st.step, "_scale_after", after)
            st.scaler_updated = True
        return out

    def _gather(self, name: str, idx: torch.Tensor | None) -> torch.Tensor:
        """A new tensor of the ``param_delta`` subvector of ``name``, in float32 or the parameter's wider dtype (a
        float64 update is subtracted in float64 before it is rounded; ``index_select`` and ``clone`` copy once:
        fancy indexing and a copying cast cost four times as long, twice per parameter per step)."""
        flat = local_tensor(self._params[name]).detach().reshape(-1)
        g = flat.clone() if idx is None else flat.index_select(0, idx)
        wide = torch.promote_types(g.dtype, torch.float32)
        return g if g.dtype == wide else g.to(wide)

    def _sample_of(self, name: str) -> tuple[int, np.ndarray | None, torch.Tensor | None]:
        """The parameter's size and its seeded ``param_delta`` positions (numpy, and on its device; ``None``: all
        of it), drawn again when the loop has resized it."""
        p = self._params[name]
        n = local_tensor(p).numel()
        got = self._indices.get(name)
        if got is None or got[0] != n:
            idx, _ = delta_sample(name, p, self.delta_elements, self.seed, self._flat.get(id(p)))
            got = self._indices[name] = (n, idx, None if idx is None else torch.from_numpy(idx).to(p.device))
        return got

    def _snapshot(self, st: _Step) -> None:
        """The parameters' sampled values before the update: float32 ones by the CPU kernel into one buffer
        (:class:`_DeltaBatch`), the others (and all of them off the CPU path) by :meth:`_gather`."""
        batched, sizes, addresses = [], [], []
        params = self._params
        names = [name for name in self._sel_params if params[name].requires_grad]
        ats: dict[str, tuple | None] = {}
        if st.fused:  # (each parameter's _delta_at, read in one pass: the loop below reads a parameter alone only
            try:  # where this raised)
                ats = {name: (at[:2] if at is not None and at[2] is torch.float32 else None) for name, at in
                       zip(names, fusable_ats([local_tensor(params[name]) for name in names]))}
            except Exception:  # noqa: BLE001
                ats = {}
        for name in names:
            try:
                n, _, idx = self._sample_of(name)
                at = (ats[name] if name in ats else self._delta_at(name)) if st.fused else None
                if at is not None:
                    batched.append(name)
                    sizes.append(n)
                    addresses.append(at[0])
                else:
                    st.snapshots[name] = (idx, self._gather(name, idx))
            except Exception as e:  # noqa: BLE001
                self._fail(("param_delta", name, None, "default"), e)
        if not batched:
            return
        try:
            b = self._delta_batch
            if b is None or b.names != batched or b.sizes.tolist() != sizes:
                b = self._delta_batch = _DeltaBatch(batched, [self._indices[n][1] for n in batched], sizes)
            b.gather(np.array(addresses, dtype=np.int64), False)
            st.batched = batched
        except Exception as e:  # noqa: BLE001 -- the torch path takes them
            self._warn_once("delta_batch", f"trainhist: the batched param_delta snapshot failed ({e!r}); "
                            "taking it parameter by parameter")
            for name in batched:
                try:
                    st.snapshots[name] = (self._indices[name][2], self._gather(name, self._indices[name][2]))
                except Exception as e2:  # noqa: BLE001
                    self._fail(("param_delta", name, None, "default"), e2)

    def _delta_at(self, name: str, seen: dict | None = None) -> tuple[int, int] | None:
        """``(address, elements)`` of parameter ``name`` when its update can be taken by the CPU kernel: plain
        contiguous float32 CPU memory (any other dtype or layout takes the torch path, :meth:`_gather`). ``seen``:
        :meth:`_reduce_many`'s ``found`` of the ``param`` rows just before (the same tensors, unchanged since)."""
        key = ("param", name, None, "default")
        at = seen[key] if seen and key in seen else fusable_at(local_tensor(self._params[name]))
        return at[:2] if at is not None and at[2] is torch.float32 else None

    def _deltas(self, st: _Step, seen: dict | None = None) -> None:
        """``param_delta``: ``after - before`` on every snapshotted subvector, reduced in the model's order. The
        kernel's snapshot is subtracted in one compiled call; if a parameter changed kind or size during the step
        (replaced by the loop), all of them take the torch path from the same snapshot."""
        b, names, done = self._delta_batch, st.batched, {}
        if names and b is not None:
            ats = [self._delta_at(n, seen) for n in names]
            if all(at is not None and at[1] == m for at, m in zip(ats, b.sizes.tolist())):
                try:
                    b.gather(np.array([at[0] for at in ats], dtype=np.int64), True)  # type: ignore[index]
                    done = dict(zip(names, zip(b.views, b.view_ats())))
                except Exception as e:  # noqa: BLE001 -- nothing was written: the snapshot is intact
                    self._warn_once("delta_batch", f"trainhist: the batched param_delta failed ({e!r}); taking it "
                                    "parameter by parameter")
            if not done:
                for n, v in zip(names, b.views):
                    st.snapshots[n] = (self._indices[n][2], v.clone())
        items = []
        known = {}  # (the views' fusable_at)
        for name in self._sel_params:
            key = ("param_delta", name, None, "default")
            if name in done:
                view, known[key] = done[name]
                items.append((key, view))
            elif name in st.snapshots:
                idx, before = st.snapshots[name]
                try:
                    items.append((key, self._gather(name, idx).sub_(before).to(torch.float32)))
                except Exception as e:  # noqa: BLE001
                    self._fail(key, e)
        self._reduce_many(items, known)

    # -- host side: decode and write ------------------------------------------------------------------------
    def _finish(self, st: _Step) -> None:
        with _no_flush():  # (decoding and encoding compare and copy subnormal values)
            self._finish_in(st)

    def _finish_in(self, st: _Step) -> None:
        data = st.pending.wait() if st.pending is not None else None
        if data is not None:
            self._decode_all(st, data)
        w = self._writer
        dev: dict[tuple[int, str], float] = {}
        for s, name, key in st.dev_scalars:
            dev[(s, name)] = st.pending.scalar(data, key)  # type: ignore[union-attr,arg-type]
        given = [(s, name, st.pending.scalar(data, key)) for s, name, key in st.user_dev]  # type: ignore[union-attr]
        given += st.user_host
        if st.late_only:
            self._write_scalars({}, given)
            self._safe(w.commit)
            return
        t = st.truth
        before, after = dev.get((st.step, "_scale_before")), dev.get((st.step, "_scale_after"))
        applied, held = self._applied(st, before, after)
        if t.applied is not None:
            applied = t.applied
            held = dict.fromkeys(self._params, "skipped") if applied is False else {}
        loss_scale = t.loss_scale if t.loss_scale is not None else dev.get((st.step, "loss_scale"))
        basis = t.grad_basis
        if basis is None and len(st.bases) == 1:
            basis = next(iter(st.bases))
        clipped = t.clipped
        if clipped is None and (st.step, "_clipped") in dev:
            clipped = bool(dev[(st.step, "_clipped")])
        threshold = t.clip_threshold if t.clip_threshold is not None else st.clip_threshold
        self._safe(
            w.step_truth, st.step, applied=applied, loss_scale=loss_scale, grad_basis=basis, clipped=clipped,
            clip_threshold=threshold, micro_batches=t.micro_batches if t.micro_batches is not None else st.micro,
            tokens=t.tokens, samples=t.samples,
        )
        if not self._registered:  # the planned sites, in the plan's (forward) order, with the dtypes now recorded
            self._registered = True
            self._register_sites()
        handled = self._handled
        if st.failed or not handled.issuperset(st.counts):  # (every key handled: the common case, tested in C)
            for key in [*st.counts, *st.failed]:  # facets first seen in this step
                if key not in handled:
                    if self._handle(key[1], key[0], key[2]) is not None:
                        handled.add(key)
        grad_sq: float | None = 0.0 if st.due["param_grad"] and not st.clip_seen else None
        grads = 0  # gradients in grad_sq (parameters without one are not in the norm; with none, there is no norm)
        d, spine_rows = st.spines, st.spine_rows
        cols = None  # d's count, NaN, infinity and sum-of-squares columns as lists, when the norm needs them
        batch: list[tuple[object, str, int]] = []  # (handle, phase, row in d): one writer call for all of them
        entries = self._emit_plan(st)
        keys, handles, phases, normed, deltas = self._emit_columns(entries)
        rows = list(map(spine_rows.get, keys))
        if handles is not None and None not in rows and not (held and any(p in held for p in deltas)):
            # the common case: every row of the plan decoded (the loop below would batch each of them, in order)
            if grad_sq is not None and normed:
                cols = (d.count.tolist(), d.nan.tolist(), (d.pinf + d.ninf).tolist(),  # type: ignore[union-attr]
                        d.sums[:, 1].tolist())  # type: ignore[union-attr]
                counts, nans, infs, sumsqs = cols
                for j in normed:
                    i = rows[j]
                    grads += 1
                    grad_sq = _add_sumsq(grad_sq, counts[i], nans[i], infs[i], sumsqs[i])  # type: ignore[arg-type]
            entries = ()
            self._emit_rows(st, handles, phases, rows)
        for s, phase, key, h in entries:
            i = spine_rows.get(key)
            if i is not None and (s.stream != "param_delta" or s.path not in held):
                if grad_sq is not None and s.stream == "param_grad" and s.path in self._norm_params:
                    if cols is None:
                        cols = (d.count.tolist(), d.nan.tolist(), (d.pinf + d.ninf).tolist(),  # type: ignore[union-attr]
                                d.sums[:, 1].tolist())  # type: ignore[union-attr]
                    grads += 1
                    grad_sq = _add_sumsq(grad_sq, cols[0][i], cols[1][i], cols[2][i], cols[3][i])
                if h is None:
                    h = self._handle(s.path, s.stream, s.facet)
                if h is not None:
                    batch.append((h, phase, i))
                continue
            summ = self._summary(st, data, key)
            if s.stream == "param_grad" and grad_sq is not None and s.path in self._norm_params:
                if key in st.failed or key in st.unknown:  # (a gradient not read: no norm of the whole model)
                    grad_sq = None
                elif summ is not None:
                    grads += 1
                    sumsq = math.inf if summ.sum_method == SumMethod.UNKNOWN else summ.sumsq.to_float()
                    grad_sq = _add_sumsq(grad_sq, summ.count, summ.nan, summ.pinf + summ.ninf, sumsq)
            self._emit_batch(st, batch)  # (first: a site's rows stay in the order of its phases)
            self._emit(st, s, phase, key, summ, held.get(s.path))
        self._emit_batch(st, batch)
        if not (st.interrupted or st.blind):
            for stream, runs in self._absent_steps.items():
                if st.due[stream]:
                    _extend_runs(runs, st.step)
        bad = set(np.flatnonzero(d.nan | d.pinf | d.ninf).tolist()) if d is not None else set()  # type: ignore[union-attr]
        # in execution order: the first reduction that saw a NaN or inf (none when every row decoded finite)
        if self.first_nonfinite is None and (bad or len(spine_rows) != len(st.counts)):
            for key in st.counts:
                i = spine_rows.get(key)
                if i is not None:
                    if i in bad and (key[0] != "param_delta" or key[1] not in held):
                        self.first_nonfinite = (st.step, key[1], key[0], key[2])
                        break
                    continue
                summ = self._summary(st, data, key) if key[0] != "param_delta" or key[1] not in held \
                    else None
                if summ is not None and summ.finite != summ.count:
                    self.first_nonfinite = (st.step, key[1], key[0], key[2])
                    break
        if grad_sq is not None and grads and self._all_trainable_selected():
            st.host_scalars.append((st.step, "grad_norm" + self._norm_suffix, math.sqrt(grad_sq)))
        tokens = t.tokens
        elapsed = next((v for s, n, v in st.host_scalars if n == "step_time" and s == st.step), None)
        if tokens is not None and elapsed:
            st.host_scalars.append((st.step, "tokens_per_s", tokens / elapsed))
        own = {k: v for k, v in dev.items() if not k[1].startswith("_")}  # (internal values: not scalars)
        own.update({(s, name): v for s, name, v in st.host_scalars})
        self._write_scalars(own, given)
        self._since_commit += 1
        if self._since_commit >= self.commit_every:
            self._since_commit = 0
            self._safe(w.commit)
            self._check_params()  # (now and then: a walk of the model)

    def _emit_plan(self, st: _Step) -> list[tuple[PlannedSite, str, tuple, object | None]]:
        """The (site, phase, row key, handle) of every row the step writes, in the plan's order: the same for most
        steps, so kept per due streams and clipping until a site or a handle is added."""
        sites = self.plan.sites
        version = (len(sites), len(self._handles))
        if self._emit_version is None or self._emit_version[0] is not sites or self._emit_version[1] != version:
            self._emit_plans.clear()
            self._emit_cols.clear()
            self._emit_version = (sites, version)
        ident = (tuple(st.due.items()), frozenset(st.clipped_names) if st.clip_seen else None)
        entries = self._emit_plans.get(ident)
        if entries is None:
            entries = self._emit_plans[ident] = []
            for s in sites:
                if s.provisional or not st.due[s.stream]:
                    continue
                h = self._handles.get((s.path, s.stream, s.facet))
                for phase in self._phases(s, st):
                    entries.append((s, phase, (s.stream, s.path, s.facet, phase), h))
        return entries

    def _emit_columns(self, entries: list) -> tuple[list, list | None, tuple, list[int], list[str]]:
        """The columns of an :meth:`_emit_plan` list, kept with it: the row keys, handles (None where a site has
        none yet) and phases, the positions of the gradients in the global norm and the paths of the ``param_delta``
        rows."""
        got = self._emit_cols.get(id(entries))
        if got is None or got[0] is not entries or got[1] is not self._norm_params:
            norm = self._norm_params
            handles = [e[3] for e in entries]
            cols = ([e[2] for e in entries], None if any(h is None for h in handles) else handles,
                    tuple(e[1] for e in entries),
                    [j for j, e in enumerate(entries) if e[0].stream == "param_grad" and e[0].path in norm],
                    [e[0].path for e in entries if e[0].stream == "param_delta"])
            got = self._emit_cols[id(entries)] = (entries, norm, cols)  # (the list kept: its id is not reused)
        return got[2]

    def _all_trainable_selected(self) -> bool:
        # (every parameter that requires a gradient is selected or a copy: none of the others does; their names are
        # fixed when the collector is made, their tensors may be replaced since)
        params = self._params
        return not any(params[n].requires_grad for n in self._unselected)

    def _phases(self, s: PlannedSite, st: _Step) -> tuple[str, ...]:
        if s.stream == "param_grad":
            return ("pre_clip", "post_clip") if s.path in st.clipped_names else ("default",)
        return ("default",)

    def _summary(self, st: _Step, data: np.ndarray | None, key: tuple) -> object:
        if key not in st.decoded:
            st.decoded[key] = self._decode(st, data, key)
        return st.decoded[key]

    def _decode_all(self, st: _Step, data: np.ndarray) -> None:
        """Decode every reduced row of the step at once, as arrays (:func:`decode_arrays`, into ``st.spines``); a
        row that fails a check is left to :meth:`_decode`, which names the failure."""
        rows = st.pending.rows  # type: ignore[union-attr]
        failed, sketch, step_counts = st.failed, st.sketch, st.counts
        keys = [k for k, n in step_counts.items() if n]  # (hundreds of rows: lists made by C loops where it can)
        offsets = list(map(rows.get, keys))
        if failed or None in offsets:  # (rows without a ledger row, or failed: left out)
            keys = [k for k in keys if k in rows and k not in failed]
            offsets = [rows[k] for k in keys]
        counts = list(map(step_counts.__getitem__, keys))
        try:
            d = decode_arrays(data, offsets, counts, [sketch[k[0]] for k in keys])
        except Exception:  # noqa: BLE001 -- left to the per-key path, which records the failing site
            self._ledger_clean = False
            return
        st.spines = d
        ok = d.ok
        if failed or d.keyed.any() or not ok.all():  # (anything amiss: the next reset restores every column)
            self._ledger_clean = False
        if ok.all():  # (the common case: every row decoded)
            st.spine_rows = dict(zip(keys, range(len(keys))))
        else:
            st.spine_rows = {k: i for i, (k, good) in enumerate(zip(keys, ok.tolist())) if good}
        for k in [k for k in st.spine_rows if (k[1], k[0], k[2]) in self._wide_ints] if self._wide_ints else ():
            i = st.spine_rows[k]
            if d.has[i] and max(abs(float(d.min[i])), abs(float(d.max[i]))) >= 2.0 ** 53:
                del st.spine_rows[k]  # (an integer of 2^53 or more may have been rounded on its way to binary64)
                st.failed.add(k)
                self._warn_site("wide_int", k, f"trainhist: {k[1]!r} ({k[0]}) holds "
                                f"{self._dtypes[(k[1], k[0], k[2])]} values of magnitude 2^53 or more, which min and "
                                "max (binary64 values, spec 5.1) cannot hold exactly: recorded as 'failed'")

    def _decode(self, st: _Step, data: np.ndarray | None, key: tuple) -> object:
        n = st.counts.get(key)
        if n is None or key in st.failed:
            return None
        if n == 0 or key not in st.pending.rows:  # type: ignore[union-attr]
            from ..summary import Sketch, Summary

            return Summary(count=0, sketch=Sketch.empty() if st.sketch[key[0]] else None)  # (empty, not missing)
        try:
            out = decode_rows(data, [st.pending.rows[key]], [n], [st.sketch[key[0]]])[0]  # type: ignore[union-attr,arg-type]
        except Exception as e:  # noqa: BLE001 -- one bad row must not stop training
            out = e
        return self._decoded(st, key, out)

    def _decoded(self, st: _Step, key: tuple, summ: object) -> object:
        if isinstance(summ, Exception):  # a row that cannot have come from its count: the site failed this step
            st.failed.add(key)
            self._warn_site("decode", key, f"trainhist: decoding {key[1]!r} ({key[0]}) failed: {summ!r}; recorded as "
                            "'failed'")
            return None
        return summ

    def _emit_batch(self, st: _Step, batch: list[tuple[object, str, int]]) -> None:
        """Write the rows in ``batch`` (handle, phase, row of ``st.spines``) with a writer call for those without a
        sketch and one for those with one; empty it. (Each call takes all its rows or none, before it writes any:
        a call that fails loses its rows, not the other call's.)"""
        if not batch:
            return
        if not any(st.sketch.values()):  # (no row has a sketch: one call, of all of them)
            handles, phases, idx = zip(*batch)
            self._observe_spines(st, handles, phases, idx, False)
            batch.clear()
            return
        for sketch in (False, True):  # (a site's rows are all of one stream: their order is kept)
            part = [b for b in batch if st.sketch[b[0].stream] == sketch]  # type: ignore[attr-defined]
            if not part:
                continue
            handles, phases, idx = zip(*part)
            self._observe_spines(st, handles, phases, idx, sketch)
        batch.clear()

    def _emit_rows(self, st: _Step, handles: list, phases: tuple, rows: list[int]) -> None:
        """:meth:`_emit_batch` of the rows ``rows`` of ``st.spines`` for ``handles`` in ``phases`` (columns, not
        triples)."""
        if not rows:
            return
        if not any(st.sketch.values()):
            self._observe_spines(st, handles, phases, rows, False)
            return
        self._emit_batch(st, list(zip(handles, phases, rows)))

    def _observe_spines(self, st: _Step, handles: object, phases: object, idx: object, sketch: bool) -> None:
        """One writer call: rows ``idx`` of ``st.spines`` as the observations of ``handles`` in ``phases``. A table
        the writer refuses for a row no tensor could give (``bad_table``; the decode checks the same rules first,
        so none should) is written row by row: the refused row's site records 'failed', the others their rows."""
        try:
            table = st.spines.spine_table(np.array(idx, dtype=np.int64), sketch)  # type: ignore[union-attr]
            self._writer.observe_spines(handles, st.step, table, phases=phases)
        except Exception as e:  # noqa: BLE001 -- a broken disk must not kill the training run
            if not (isinstance(e, UsageError) and e.code == "bad_table"):
                self._writer_error(e)
                return
            for h, phase, i in zip(handles, phases, idx):  # type: ignore[call-overload]
                try:
                    row = st.spines.spine_table(np.array([i], dtype=np.int64), sketch)  # type: ignore[union-attr]
                    self._writer.observe_spines([h], st.step, row, phases=[phase])
                except Exception as e1:  # noqa: BLE001
                    if not (isinstance(e1, UsageError) and e1.code == "bad_table"):
                        self._writer_error(e1)
                        return
                    self._refused_row(h, st.step, phase, e1)

    def _refused_row(self, h: SiteHandle, step: int, phase: str, e: Exception) -> None:
        """The writer refused a reduced row as one no tensor could give (a reduction's fault, not the disk's): its
        site records 'failed' at that step."""
        self._warn_once("refused_row", f"trainhist: the history refused the row of {h.path!r} ({h.stream}) at step "
                        f"{step} ({e}): recorded as 'failed' (as is any other row refused so, without a warning)")
        self._safe(self._writer.mark, h, step, "failed", phase=phase)

    def _emit(self, st: _Step, s: PlannedSite, phase: str, key: tuple, summ: object, held: str | None) -> None:
        h = self._handle(s.path, s.stream, s.facet)
        if h is None:
            return
        if s.stream == "param_delta" and held:  # (no update measured: skipped, or unknown)
            self._safe(self._writer.mark, h, st.step, held, phase=phase)
        elif summ is not None:
            try:  # (the common case, without _safe's extra call)
                self._writer.observe(h, st.step, summary=summ, phase=phase)
            except Exception as e:  # noqa: BLE001 -- a broken disk must not kill the training run
                if not (isinstance(e, UsageError) and e.code == "bad_summary"):
                    self._writer_error(e)
                    return
                self._refused_row(h, st.step, phase, e)
        else:
            state = ("failed" if key in st.failed
                     else "unknown" if key in st.unknown or st.interrupted or (st.blind and key[1] != ROOT
                                                                                and key[0].startswith("activation"))
                     else "absent")
            self._safe(self._writer.mark, h, st.step, state, phase=phase)

    def _drain(self) -> None:
        while self._pending:
            self._finish(self._pending.pop(0))

    def commit(self) -> None:
        """Write every finished step now, durably (a commit of the writer), e.g. before saving a checkpoint; the
        collector otherwise commits every ``commit_every`` steps and every 30 s."""
        try:
            with self._lock:
                if self._closed:
                    raise UsageError("the collector is closed")
                if self._state is not None:
                    raise UsageError(f"commit() inside step {self._state.step}: call it between steps")
                self._write_late()
                self._since_commit = 0
                if self._writer is not None:
                    self._safe(self._writer.commit)
                self._check_params()
        finally:
            self._deferred_close()

    def _write_late(self) -> None:
        """Write every finished step, and the tensor scalars given after the last one (otherwise read at the next
        step's transfer), with one more transfer for those."""
        self._drain()
        if self._late or self._late_host:
            if self._writer is None:  # (scalars given before attach() and any step)
                self._open()
            if self._late:  # (this transfer writes scalar slots alone; plain numbers need none)
                self._ledger.reset(keys_clean=self._ledger_clean)
            st = _Step(step=-1, truth=StepTruth(), due=dict.fromkeys(STREAMS, False), sketch={}, t0=0.0, late_only=True)
            self._transfer(st)
            self._drain()

    def close(self) -> None:
        """Write what is pending, remove every hook, restore the scaler, and close the writer. Idempotent.

        Called from another thread than the one inside a step (the finalizer at interpreter exit while a daemon
        thread trains), it leaves that step out: the step's hooks may be reducing into the ledger at that moment,
        so none of its rows can be read whole. Every finished step is written; the hooks stay in place, doing
        nothing (the other thread may be running them). Called while this thread begins or ends a step, commits or
        closes (from a signal handler, whose code runs between any two of the thread's bytecodes), it closes once that
        is done, also when the handler raises next: at once, it would write the step being written twice, or half."""
        if self._lock._is_owned():  # type: ignore[attr-defined]  # (by this thread: the handler interrupted it)
            self._close_deferred = not self._closed
            return
        with self._lock:
            if self._closed:
                if self._writer is not None and self.path is not None and not self._writer.closed:
                    self._close_file()  # (the writer's close was interrupted, Ctrl-C, and taken back: again)
                return
            st = self._state
            foreign = st is not None and st.thread != threading.get_ident()
            if foreign:
                self._state = None
                self._warn_once("foreign_close", f"trainhist: close() ran in another thread while step {st.step} was "
                                "open (at interpreter exit: a daemon thread still training): that step and the "
                                "scalars given for it inside it are not recorded; every finished step is")
                # (tensor scalars of finished steps: read here, not through the ledger the step's hooks write)
                self._late_host += [(s, name, float(t)) for s, name, t in self._late]
                self._late = []
            elif st is not None:  # close() inside a step (an error handler, a signal): the step so far, interrupted
                st.interrupted = True
                try:
                    with _no_flush():
                        self._exit(st)
                finally:
                    self._state = None
            self._closed = True
            self._write_late()
            if st is None:
                self._detach()
            elif not foreign:  # (torch may be running the hooks now: close() from one, or from a signal handler
                self._detach_later = True  # inside one; removed when the step ends, they do nothing till then)
            if self._writer is not None and self._plan is not None:
                self._register_sites()  # (the planned sites no step recorded: declared, with no rows)
            if self._writer is not None and (self.path is not None):
                self._close_file()
            elif self._writer is not None:
                self._safe(self._writer.commit)
            if self._finalizer is not None:
                self._finalizer.detach()
            if self.writer_errors > 1 and not self._stopped:  # (only the first was said when it happened)
                self._warn_once("writer_tally", f"trainhist: {self.writer_errors} writer calls failed in this "
                                f"collector's run, the first {self._first_writer_error}; what each held (rows, "
                                "scalars, marks) is not in the history, the rest is")

    def _close_file(self) -> None:
        """Close the writer of the file this collector holds, and let go of the file."""
        assert self._writer is not None and self.path is not None
        self._safe(self._writer.close)
        if _holders.get(os.path.realpath(self.path)) is self:
            del _holders[os.path.realpath(self.path)]

    def _detach(self) -> None:
        """Remove every hook and restore the scaler's methods (at close, and once the writer has stopped).
        Idempotent."""
        for h in self._hooks:
            h.remove()
        self._hooks, self._fwd_handles = [], []
        if self._scaler is not None:  # (only where ours is still the method: another collector's wraps ours)
            sc, mine = self._scaler, {"unscale_": self._scaler_unscale, "step": self._scaler_step,
                                      "update": self._scaler_update}
            for name in self._scaler_orig:
                if sc.__dict__.get(name) != mine[name]:
                    continue
                owner = self  # (what we wrapped: past the wrappers of collectors closed since, to the first live one)
                while True:
                    orig, inst = owner._scaler_orig[name], name in owner._scaler_wrapped
                    under = getattr(orig, "__self__", None)
                    if not (inst and isinstance(under, Collector) and under._closed):
                        break
                    owner = under
                if inst:  # (a method set on the instance: a live collector's, or the loop's own)
                    setattr(sc, name, orig)
                else:
                    delattr(sc, name)

    def __enter__(self) -> "Collector":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
