"""What the collector will record: user-facing names, site selection, and the per-step cost table."""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
import warnings
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import grid
from ..errors import UsageError
from ..model import OBS_COLUMNS, SKETCH_COLUMNS

__all__ = [
    "STREAMS",
    "ROOT",
    "unwrap",
    "clean_name",
    "flatten_output",
    "select",
    "param_sharing",
    "local_tensor",
    "sample_indices",
    "delta_sample",
    "fsdp1_units",
    "fsdp_flat_layouts",
    "fsdp_unsharded",
    "fsdp_later_copies",
    "PlannedSite",
    "Plan",
]

STREAMS = ("activation", "activation_grad", "param", "param_grad", "param_delta")
ROOT = "(root)"  #: site path of the model's own output (module paths are never parenthesised)

_WRAPPER_SEGMENTS = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}
#: raw bytes a row costs before compression: the required obs columns (spec 7.5; an exact sum, stored only where
#: the rounded one is not exact, adds its few bytes)
SPINE_ROW_BYTES = sum(np.dtype(dt).itemsize for dt in OBS_COLUMNS.values())
#: ... and a sketch at most: its fixed columns and every bin of both sides at the native scale (a writer stores each
#: side's range from its first to its last non-zero bin)
SKETCH_ROW_BYTES = (sum(np.dtype(dt).itemsize for name, dt in SKETCH_COLUMNS.items() if name != "sk_counts")
                    + np.dtype(SKETCH_COLUMNS["sk_counts"]).itemsize * 2 * grid.nbins(grid.NATIVE_SCALE))


def unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
    """The user's module inside DDP / DataParallel / torch.compile / FSDP wrappers, and whether a DDP wrapper was
    seen. DataParallel over several devices is refused: it runs copies of the module in threads, each calling the
    hooks at once (DistributedDataParallel runs one copy per process)."""
    ddp = False
    while True:
        name = type(model).__name__
        if name == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.DataParallel):  # (a subclass too)
            if len(getattr(model, "device_ids", None) or ()) > 1:
                raise UsageError(f"nn.DataParallel over devices {model.device_ids} runs a copy of the model per device "
                                 "in threads, which the collector's hooks cannot follow: use DistributedDataParallel "
                                 "(one process per device, each recording its shard), or DataParallel on one device")
            model = model.module
        elif name in ("DistributedDataParallel", "FullyShardedDataParallel") and hasattr(model, "module"):
            ddp = ddp or name == "DistributedDataParallel"
            model = model.module
        else:
            return model, ddp


def clean_name(name: str) -> str:
    """The user's dotted name: wrapper segments (FSDP, checkpoint wrapper, compile) removed; ``""`` is the root."""
    parts = [p for p in name.split(".") if p and p not in _WRAPPER_SEGMENTS]
    return ".".join(parts) if parts else ROOT


#: how deep :func:`flatten_output` looks into nested containers (deeper tensors are not recorded: a warning says so)
MAX_DEPTH = 4


def flatten_output(out: object) -> Iterator[tuple[str | None, torch.Tensor]]:
    """Every tensor inside a module output with its facet label (key/index path; ``None`` for a bare tensor).

    Tuples and lists index by position, mappings (HF ``ModelOutput`` included) by key, dataclasses by field.
    Non-tensor leaves (caches, ints, ``None``) are skipped, and complex tensors (with a warning). Two leaves whose
    paths read the same (a key ``"a.b"`` beside ``"a"`` → ``"b"``, keys ``0`` and ``"0"``) would be one site: the
    later ones get ``#2``, ``#3``, ...
    """
    if isinstance(out, torch.Tensor) and not out.is_complex():
        yield None, out
        return
    seen: set[str | None] = set()
    for label, t in _flatten(out, "", 0):
        if label in seen:
            k = 2
            while f"{label}#{k}" in seen:
                k += 1
            warnings.warn(f"trainhist: two tensors of a module output have the facet path {label!r}: the later one "
                          f"is recorded as {label}#{k}", RuntimeWarning, stacklevel=2)
            label = f"{label}#{k}"
        seen.add(label)
        yield label, t


def _flatten(out: object, prefix: str, depth: int) -> Iterator[tuple[str | None, torch.Tensor]]:
    if isinstance(out, torch.Tensor):
        if out.is_complex():  # (the format has no complex dtype: recording it would fail at every step)
            warnings.warn(f"trainhist: a module output holds a complex tensor ({out.dtype}, at "
                          f"{prefix or 'the top'!r}): complex values are not recorded (record .real and .imag where "
                          "you need them)",
                          RuntimeWarning, stacklevel=3)
            return
        yield (prefix or None), out
        return
    if depth >= MAX_DEPTH:
        if (isinstance(out, (Mapping, tuple, list)) and len(out)) or dataclasses.is_dataclass(out):
            warnings.warn(f"trainhist: a module output nests containers deeper than {MAX_DEPTH} levels (at "
                          f"{prefix!r}): tensors inside them are not recorded", RuntimeWarning, stacklevel=3)
        return
    sep = "." if prefix else ""
    if isinstance(out, Mapping):
        items = ((str(k), v) for k, v in out.items())
    elif isinstance(out, (tuple, list)):
        items = ((str(i), v) for i, v in enumerate(out))
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        items = ((f.name, getattr(out, f.name, None)) for f in dataclasses.fields(out))
    else:
        return
    for k, v in items:
        yield from _flatten(v, prefix + sep + k, depth + 1)


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.startswith(pattern + ".") or fnmatch.fnmatchcase(name, pattern)


def _owner(param_name: str) -> str:
    return param_name.rpartition(".")[0] or ROOT


def select(module_names: list[str], param_names: list[str], patterns: list[str] | None,
           aliases: dict[str, str] | None = None,
           module_aliases: dict[str, str] | None = None) -> tuple[set[str], set[str]]:
    """Selected module and parameter names: each pattern is a module-path prefix or an fnmatch pattern.
    ``aliases``: other names of shared parameters (a tied ``lm_head.weight``) -> the name they are recorded under;
    a module selected selects its shared parameters too. ``module_aliases``: likewise for a module registered under
    several names (one block as ``enc`` and ``dec``): a pattern naming it by another name selects it.

    Raises :class:`~trainhist.errors.UsageError` naming the closest real names when a pattern matches nothing.
    """
    if patterns is None:
        return set(module_names), set(param_names)
    if not patterns:
        raise UsageError("an empty site selection records nothing; pass sites=None (the default) for every module "
                         "and parameter", code="no_such_site")
    mods: set[str] = set()
    params: set[str] = set()
    for pat in patterns:
        m = {n for n in module_names if _matches(n, pat)}
        m |= {c for a, c in (module_aliases or {}).items() if _matches(a, pat)}
        p = {n for n in param_names if _matches(n, pat) or _owner(n) in m}
        p |= {c for a, c in (aliases or {}).items() if _matches(a, pat) or _owner(a) in m}
        if not m and not p:
            close = difflib.get_close_matches(pat, module_names + param_names, n=5, cutoff=0.4)
            hint = f"; closest names: {', '.join(close)}" if close else ""
            wrapper = next((w for w in ("module.", "_orig_mod.", "_fsdp_wrapped_module.") if pat.startswith(w)), None)
            if wrapper:
                hint += (f"; names are those of the model inside DDP, torch.compile or FSDP wrappers: drop the "
                         f"{wrapper!r} prefix")
            raise UsageError(f"site selection {pat!r} matches no module or parameter of the model{hint}",
                             code="no_such_site")
        mods |= m
        params |= p
    return mods, params


def param_sharing(p: torch.Tensor, ddp: bool) -> str:
    """``"shard"`` for FSDP flat or DTensor-sharded parameters, ``"replica"`` under DDP or for a DTensor replicated
    on every mesh dimension, else ``"shard"``."""
    if type(p).__name__ == "DTensor":
        return "replica" if replicated(p) else "shard"
    if getattr(p, "_is_flat_param", False):  # (FSDP1's flat parameter: its type is Parameter)
        return "shard"
    return "replica" if ddp else "shard"


def replicated(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor whose local tensor is the whole value (replicated on every mesh dimension)."""
    return type(t).__name__ == "DTensor" and all(pl.is_replicate() for pl in t.placements)  # type: ignore[attr-defined]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a (possibly DTensor) tensor."""
    return t.to_local() if type(t).__name__ == "DTensor" else t


def sample_indices(name: str, numel: int, k: int, seed: int) -> np.ndarray | None:
    """Sorted flat indices of the deterministic ``param_delta`` subvector of ``name``; ``None`` when k >= numel.

    Derivation (written to the file's settings): ``numpy.random.default_rng([seed, crc32(name)])`` choosing ``k``
    of ``numel`` without replacement, sorted.
    """
    if k >= numel:
        return None
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return np.sort(rng.choice(numel, size=k, replace=False))


def _block(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(whole shape, offset of this rank's part) of a sharded DTensor whose local tensor is one block of it (FSDP2's
    dim-0 shards, even or not); None for anything else."""
    if type(p).__name__ != "DTensor" or replicated(p):
        return None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(type(pl).__name__ == "_StridedShard" for pl in p.placements):  # type: ignore[attr-defined]
            return None
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)  # type: ignore
    except Exception:  # noqa: BLE001 -- not a layout we can map: the rank-local sample
        return None
    return (tuple(p.shape), tuple(offset)) if tuple(shape) == tuple(p.to_local().shape) else None  # type: ignore


def fsdp1_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP1 (``FullyShardedDataParallel``) units in ``model``, found by class name (no FSDP import)."""
    return [m for m in model.modules() if type(m).__name__ == "FullyShardedDataParallel"]


def _flat_ids(h: object) -> set[int]:
    """``id`` of an FSDP1 handle's flat parameter and of the user's parameters viewing it; none where the handle's
    internals are not those this code knows."""
    fp = getattr(h, "flat_param", None)
    return set() if fp is None else {id(fp), *(id(q) for q in getattr(fp, "_params", None) or ())}


def fsdp_flat_layouts(model: torch.nn.Module) -> dict[int, tuple[tuple[int, ...], int]]:
    """The parameters of FSDP1 (``FullyShardedDataParallel``) units that hold this rank's run of a larger flat
    tensor: ``id(parameter)`` -> (the whole tensor's shape, where this rank's run starts in its flattened elements).

    With ``use_orig_params=True`` each of the user's parameters of a sharding unit is, outside forward and
    backward, a 1-D view of the run of its flattened elements this rank's shard holds (maybe none); with
    ``use_orig_params=False`` the parameters are the units' flat parameters, each rank holding an equal run of the
    padded concatenation (NO_SHARD: whole views, the whole flat parameter). Read from FSDP's internals; a unit
    whose layout cannot be read is left out (its parameters sampled rank-locally)."""
    out: dict[int, tuple[tuple[int, ...], int]] = {}
    for m in fsdp1_units(model):
        try:
            h = getattr(m, "_handle", None)
            if h is None:
                continue
            fp = h.flat_param
            parts = h.world_size if h.uses_sharded_strategy else 1
            out[id(fp)] = ((fp.numel() * parts,), (h.rank if parts > 1 else 0) * fp.numel())
            for q, info, shape in zip(fp._params or (), fp._shard_param_infos, fp._shapes):
                if q.numel() == (info.numel_in_shard if info.in_shard else 0):
                    out[id(q)] = (tuple(shape), info.intra_param_start_idx if info.in_shard else 0)
        except Exception:  # noqa: BLE001 -- another torch's internals: the rank-local sample
            continue
    return out


def fsdp_unsharded(model: torch.nn.Module) -> set[int]:
    """``id`` of every parameter (flat and, with ``use_orig_params=True``, the user's) of the FSDP1 units that
    shard nothing (``ShardingStrategy.NO_SHARD``): every rank holds them whole, as under DDP."""
    out: set[int] = set()
    for m in fsdp1_units(model):
        h = getattr(m, "_handle", None)
        if h is not None and not getattr(h, "uses_sharded_strategy", True):
            out |= _flat_ids(h)
    return out


def fsdp_later_copies(model: torch.nn.Module) -> set[int]:
    """``id`` of every parameter (flat and the user's) of the FSDP1 units that shard within a group of ranks and
    replicate across groups (``HYBRID_SHARD``), on a rank whose group is not the first: another rank holds the
    same shard, and only the first copy is recorded (as under HSDP)."""
    import torch.distributed as dist

    out: set[int] = set()
    for m in fsdp1_units(model):
        h = getattr(m, "_handle", None)
        group = getattr(m, "_inter_node_pg", None)
        if h is None or group is None or "HYBRID" not in str(getattr(h, "_sharding_strategy", "")):
            continue
        try:
            if dist.get_rank(group) == 0:
                continue
        except Exception:  # noqa: BLE001 -- a group we cannot read: record it
            continue
        out |= _flat_ids(h)
    return out


def delta_sample(name: str, p: torch.Tensor, k: int, seed: int,
                 flat: tuple[tuple[int, ...], int] | None = None) -> tuple[np.ndarray | None, dict | None]:
    """The ``param_delta`` subvector of parameter ``name``: sorted flat indices into its rank-local tensor (None:
    all of it), and its site's ``sample`` (None: the whole tensor).

    For a sharded DTensor, or an FSDP1 parameter that is this rank's run of a larger flat tensor (``flat``: the
    whole shape and the run's start, :func:`fsdp_flat_layouts`), the positions are drawn over the whole parameter
    and each rank measures those in its shard, so every rank's site states the same sample and the ranks' rows add
    up to it (spec 2.2); otherwise over the rank-local tensor."""
    n = local_tensor(p).numel()
    if flat is not None:
        whole = math.prod(flat[0])
        chosen = sample_indices(name, whole, k, seed)
        if chosen is None:
            return None, None
        mine = chosen[(chosen >= flat[1]) & (chosen < flat[1] + n)] - flat[1]
        return mine.astype(np.int64), {"elements": k, "of": whole, "seed": seed}
    block = _block(p)
    if block is None:
        idx = sample_indices(name, n, k, seed)
        return idx, None if idx is None else {"elements": k, "of": n, "seed": seed}
    shape, offset = block
    whole = math.prod(shape)
    chosen = sample_indices(name, whole, k, seed)
    if chosen is None:
        return None, None
    at = np.unravel_index(chosen, shape)
    local_shape = tuple(local_tensor(p).shape)
    inside = np.ones(len(chosen), dtype=bool)
    for a, o, m in zip(at, offset, local_shape):
        inside &= (a >= o) & (a < o + m)
    if not inside.any():
        return np.empty(0, dtype=np.int64), {"elements": k, "of": whole, "seed": seed}
    mine = np.ravel_multi_index(tuple(a[inside] - o for a, o in zip(at, offset)), local_shape)
    return mine.astype(np.int64), {"elements": k, "of": whole, "seed": seed}  # (row-major: still sorted)


@dataclass
class PlannedSite:
    """One (site, stream, facet) the collector records, with its per-step cost."""

    path: str
    stream: str
    facet: str | None
    shape: tuple[int, ...] | None
    dtype: str | None
    elements: int | None  # elements reduced per logged step (None: not known before it runs)
    sharing: str
    every: int
    sketch_every: int
    sample: dict | None = None
    provisional: bool = False  # facets not known yet (no discover()): replaced by the real ones when seen

    def bytes_per_step(self) -> float:
        """Raw (uncompressed) bytes written per training step, amortised over the cadences (one phase): a sketch
        rides on a spine row, so it is written where both are due (every lcm of the cadences), and never without
        the spine."""
        b = 0.0
        if self.every:
            b += SPINE_ROW_BYTES / self.every
            if self.sketch_every:
                b += SKETCH_ROW_BYTES / math.lcm(self.every, self.sketch_every)
        return b

    def elements_per_step(self) -> float | None:
        """Elements reduced per training step, amortised over the spine cadence."""
        if self.elements is None or not self.every:
            return None if self.elements is None else 0.0
        return self.elements / self.every


@dataclass
class Plan:
    """Every site the collector records and what recording it costs per step."""

    sites: list[PlannedSite] = field(default_factory=list)

    def find(self, path: str, stream: str, facet: str | None = None) -> PlannedSite | None:
        """The planned site ``(path, stream, facet)``, or ``None``."""
        for s in self.sites:
            if (s.path, s.stream, s.facet) == (path, stream, facet):
                return s
        return None

    def elements_per_step(self) -> float:
        """Total elements reduced per training step (sites of unknown size count as 0)."""
        return sum(s.elements_per_step() or 0.0 for s in self.sites)

    def bytes_per_step(self) -> float:
        """Total raw bytes written per training step."""
        return sum(s.bytes_per_step() for s in self.sites)

    def format_table(self) -> str:
        """A text table: per site and stream, elements reduced per step and raw bytes written per step."""
        head = ("site", "stream", "facet", "shape", "dtype", "elements/step", "raw bytes/step", "every", "sketch")
        rows = []
        for s in self.sites:
            eps = s.elements_per_step()
            rows.append((
                s.path, s.stream, s.facet or "", "x".join(map(str, s.shape)) if s.shape is not None else "?",
                s.dtype or "?", "?" if eps is None else f"{eps:,.0f}", f"{s.bytes_per_step():,.0f}",
                str(s.every), str(s.sketch_every),
            ))
        rows.append(("TOTAL", "", "", "", "", f"{self.elements_per_step():,.0f}", f"{self.bytes_per_step():,.0f}",
                     "", ""))
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        right = {5, 6, 7, 8}

        def fmt(r: tuple[str, ...]) -> str:
            return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

        lines = [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]
        return "\n".join(line.rstrip() for line in lines)
