"""``trainhist.merge``: combine histories of shards, ranks or runs into one canonical file (spec section 11).

The engine streams: inputs are scanned for their manifests and commit entries only, then every output site is
built segment by segment from a sweep over the input chunks ordered by step, so memory holds a few chunks at a
time whatever the input size. Input files are read with ``pread`` through a small pool of descriptors, so
hundreds of shards never hold hundreds of maps. The output is written to a temporary file next to ``output``
and renamed into place only when complete. :func:`trainhist.coarsen` runs the same engine with a step window
and a coarser sketch scale.
"""

from __future__ import annotations

import contextlib
import errno
import math
import multiprocessing as mp
import os
import pickle
import shutil
import struct
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .canonical import (
    CHUNK_ROWS,
    CODECS,
    CanonicalWriter,
    Rows,
    StepRows,
    blank,
    canonical_salt,
    check_payload,
    ObsChunk,
    Sparse,
    decode_obs_batch,
    decode_obs_columns,
    read_obs,
    decode_steps,
    derive_presence,
    encode_obs,
    encode_steps,
    ranges,
)
from .dyadic import fits_float
from .exactvec import group_sum
from .fastpath import kernels
from . import errors
from .errors import CorruptError, FormatError, MergeError, TrainhistError, UsageError
from .framing import RECORD_HEADER_SIZE, pad8
from .grid import nbins
from .model import CANONICAL_NAN, CANONICAL_NAN_BITS, MICRO_ALL, U64_UNKNOWN, Phase, Presence
from .batchdecode import Fallback, all_patched, check_chunk, gather, join, layout, upper_bound
from .chunk import _INT_CODES, _RANGE, DTYPES, Codec
from .framing import crc32c
from .model import OBS_COLUMNS, SKETCH_COLUMNS, TALLY_COLUMNS
from .reader import History, payload_problem
from .summary import SumMethod

__all__ = ["merge", "canonicalize", "MergeReport", "BATCH_ROWS", "FD_POOL"]

BATCH_ROWS = 32768  #: input rows decoded together before they are combined (memory: ~2 KiB per row of ~100 sketch bins)
FD_POOL = 64  #: input files held open at once
MAX_MISSING_RANKS = 16  #: missing ranks listed per segment and run in ``MergeReport.missing_ranks``
AUTO_WORKERS_BYTES = 64 << 20  #: with ``workers=None``, inputs of at least this many bytes use worker processes
MAX_WORKERS = 8  #: with ``workers=None``, at most this many workers (and no more than the CPUs)
MAX_DIVERGENCES = 1000  #: at most this many replica divergences are listed in a report
SYNC_BYTES = 32 << 20  #: with workers, the output's data is synced after every this many bytes (not all at the end)
_U64 = 1 << 64
_I64_MAX = np.iinfo(np.int64).max
_I64_MIN = np.iinfo(np.int64).min
_LOW63 = np.int64(0x7FFFFFFFFFFFFFFF)
_U64_MASK = (1 << 64) - 1
#: merge's refusals that are about no input's content (the output, an input changed while read, a worker): not
#: preceded by a full check of the inputs (spec 11, validation order)
_NOT_ABOUT_INPUTS = frozenset({"output_unwritable", "input_changed", "worker_failed", "worker_lost"})
_UNPACKED = frozenset({-1, Codec.RAW, Codec.FOR, Codec.PATCHED})  #: the codecs mergekernel.unpack decodes


@dataclass
class MergeReport:
    """What a merge or coarsen did: inputs (with their recovery state), sizes, rows, and replica divergences."""

    output: str
    inputs: list[dict]
    sites: int = 0
    segments: int = 0
    rows_in: int = 0
    rows_out: int = 0
    step_rows_in: int = 0
    step_rows_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    workers: int = 1  #: processes that built the sites (1: this one)
    #: replica divergences (spec 11.5, ``replica_divergence="report"``): the first ``MAX_DIVERGENCES`` in site order
    divergences: list[dict] = field(default_factory=list)
    #: how many replica divergences there were in all (``divergences`` lists at most ``MAX_DIVERGENCES`` of them)
    divergences_total: int = 0
    #: segments whose inputs disagree on their first step: ranks that numbered their segments differently (a resume
    #: that died before its first commit on one of them) have their steps split across two output segments
    segment_mismatches: list[dict] = field(default_factory=list)
    #: output segments whose writers recorded with different settings (a rank with another cadence or site
    #: selection): their rows combine what each writer recorded, e.g. one rank's rows alone where only it recorded
    settings_mismatches: list[dict] = field(default_factory=list)
    #: output segments where the writers of a run all declare one ``world_size`` but some of its ranks contributed
    #: nothing (spec 11.3: a shard lost or not given): ``segment``, ``run``, ``world_size``, ``ranks`` (how many
    #: contributed), ``missing`` (the first ``MAX_MISSING_RANKS``), ``missing_total``
    missing_ranks: list[dict] = field(default_factory=list)
    #: sites whose inputs recorded them at different cadences (spec 11.5): the merged cadence is their greatest
    #: common divisor; ``unplanned_steps_due`` when it makes due steps that no input's cadence made due;
    #: ``cadences`` groups the files by cadence, ``inputs`` lists every input of the site (``input``: its index in
    #: the inputs, ``path``, ``spine``/``sketch``: its cadences, ``window``: the width of its coarsened windows,
    #: read from its step-truth rows as :meth:`_Source.step_window` does (1: rows of one step, or no step truth),
    #: ``rows``: its rows of the site, ``steps``: the first and last step its rows start at, null when it has none)
    cadence_mismatches: list[dict] = field(default_factory=list)
    #: sites and segments whose merged rows cover the same steps under different spans (an input coarsened,
    #: another not, spec 11.1): the first such pair of rows of each, and the file of the later one
    span_overlaps: list[dict] = field(default_factory=list)
    #: what a person should know about the result, one sentence each (the command line prints them as notes)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# -- inputs --------------------------------------------------------------------------------------------------
class _Source:
    """One input: its manifests and commit entries (the file is not kept open)."""

    def __init__(self, idx: int, path: str) -> None:
        self.idx = idx
        self.path = os.fspath(path)
        h = History(self.path)
        try:
            self.size = h.size
            self.status = h.recovery.status
            self.committed_bytes = h.committed_bytes
            self.runs = list(h.runs)
            self.writers = list(h.writers)
            self.settings = list(h.settings)
            self.sites = list(h.sites)
            self.segments = list(h.segments)
            self.obs = {sid: list(es) for sid, es in h._obs.items()}
            self.steps = list(h._steps)
            # committed records of an unknown ignorable type: (offset, type, payload length, payload CRC32C)
            self.ignored = [(off, rtype, *struct.unpack_from("<I", h._view, off + 4),
                             *struct.unpack_from("<I", h._view, off + 24)) for off, rtype in h.ignored_records]
        finally:
            h.close()
        self.run_of_writer = {w["writer_id"]: w["run_id"] for w in self.writers}
        self._step_window: int | None = None

    def step_window(self) -> int:
        """The narrowest span of the file's step-truth rows: the width of its windows when it was coarsened, 1 when
        some row spans one step or the file has no step truth (read once, only for a site of differing cadences)."""
        if self._step_window is None:
            width = 0
            h = History(self.path)
            try:
                for e in h._steps:
                    ch = h.chunk(e)
                    if not ch.has("span"):  # (a chunk without the column: every row spans one step)
                        width = 1
                        break
                    col = ch.column("span", e.rows)
                    width = int(col.min()) if not width else min(width, int(col.min()))
            finally:
                h.close()
            self._step_window = max(width, 1)
        return self._step_window

    def leaf_writers(self) -> list[str]:
        """The writers whose observations this file holds (spec 11.8): its writer manifests' ids and its segments'
        writers (``origin.writers``, or the writer of a segment without ``origin``), each once, sorted."""
        ids = {w["writer_id"] for w in self.writers}
        for g in self.segments:
            o = g.manifest.get("origin")
            ids.update(o["writers"] if o is not None else [g.writer_id])
        return sorted(ids)

    def segment_origin(self, g: Any) -> tuple[list[str], int, list[str]]:
        """(runs, source segment number, leaf writers) of one of this file's segments."""
        o = g.manifest.get("origin")
        if o is not None:
            return sorted(o["runs"]), int(o["segment"]), sorted(o["writers"])
        run = self.run_of_writer.get(g.writer_id)
        if run is None:
            if not self.runs:
                raise MergeError(f"segment {g.id} names writer {g.writer_id}, which has no writer manifest and the "
                                 "file has no run manifest", code="unknown_writer", path=self.path)
            run = self.runs[0]["run_id"]
        return [run], g.id, [g.writer_id]


class _Pool:
    """Descriptors of the input files, least recently used closed first."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.fds: OrderedDict[str, int] = OrderedDict()

    def pread(self, path: str, n: int, offset: int) -> bytes:
        fd = self.fds.pop(path, None)
        if fd is None:
            if len(self.fds) >= self.cap:
                _, old = self.fds.popitem(last=False)
                os.close(old)
            while True:
                try:
                    fd = os.open(path, os.O_RDONLY)
                    break
                except OSError as e:  # the process's limit is below the cap (a low ulimit -n): hold fewer
                    if e.errno not in (errno.EMFILE, errno.ENFILE) or not self.fds:
                        raise
                    _, old = self.fds.popitem(last=False)
                    os.close(old)
                    self.cap = max(1, len(self.fds))
        self.fds[path] = fd
        data = os.pread(fd, n, offset)
        if len(data) != n:
            raise MergeError(f"input shrank while merging: wanted {n} bytes at {offset}", code="input_changed",
                             path=path, offset=offset)
        return data

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _pool_cap() -> int:
    """How many input descriptors to hold: ``FD_POOL``, or half of what the process may still open when its
    limit (``ulimit -n``) leaves less, so that the output, spool files and imports still find descriptors."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return FD_POOL
        used = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 16
    except (ImportError, OSError, ValueError):  # (no resource module: Windows)
        return FD_POOL
    return max(1, min(FD_POOL, (soft - used) // 2))


# -- small helpers -------------------------------------------------------------------------------------------
def _same_file(a: str, b: str) -> bool:
    """Whether two input paths name one file (the same device and inode: a link, another spelling of the path)."""
    try:
        return a == b or os.path.samefile(a, b)
    except OSError:
        return False


def _unplanned_due(spine: int, cads: list[tuple[int, int]]) -> bool:
    """Whether the merged spine cadence ``spine`` may make due a step that no input had due: ``cads`` holds each
    input's (spine cadence, window width), windows aligned at multiples of their width (1: rows of one step). Only
    when every input's windows are at least as wide as its cadence does each window of each input hold a step it
    had due (any ``w`` consecutive steps hold a multiple of ``c <= w``), so that every step an input covers is one
    it planned; otherwise a step may lie where no input that covers it planned it (an input that plans it may end
    earlier, or be another run's segment), and the answer is yes."""
    return spine != 0 and not all(c and w >= c for c, w in cads)


def _cadence_input(d: dict) -> str:
    """One input of a site of differing cadences, as the report's note names it (``cadence_mismatches[].inputs``)."""
    where = "no rows" if d["steps"] is None else (f"{d['rows']} row{'' if d['rows'] == 1 else 's'} at step "
                                                  f"{d['steps'][0]}" if d["steps"][0] == d["steps"][1] else
                                                  f"{d['rows']} rows at steps {d['steps'][0]} to {d['steps'][1]}")
    window = f"windows of {d['window']} steps, " if d["window"] > 1 else ""
    return f"input {d['input']} ({d['path']}): {d['spine']}/{d['sketch']}, {window}{where}"


def _site_name(key: tuple) -> str:
    path, stream, facet = key
    return f"{path} [{stream}{'' if facet is None else ':' + facet}]"


def _agree(values: list) -> Any:
    """The common value, or None when the values differ (None absorbs)."""
    first = values[0]
    return first if all(v == first for v in values[1:]) else None


def _number_segments(keys: Iterable[tuple[tuple[str, ...], int]]) -> dict[tuple[tuple[str, ...], int], int]:
    """The output segment ids of the (runs, number) keys: by number first, so that every `previous` comes before
    the segment naming it (spec 11.3: a segment of runs pooled with --across-runs can continue in a segment of fewer
    runs), then by runs."""
    return {k: i for i, k in enumerate(sorted(set(keys), key=lambda k: (k[1], k[0])))}


def _sum_u64(a: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Group sums of unsigned 64-bit counts along axis 0, and the groups (mask) whose sum overflows, if any."""
    s = np.add.reduceat(a, starts, axis=0)
    if a.size == 0 or int(a.max()) * int(sizes.max()) < _U64:
        return s, None
    hi = np.add.reduceat(a >> np.uint64(32), starts, axis=0)
    lo = np.add.reduceat(a & np.uint64(0xFFFFFFFF), starts, axis=0)
    over = ((hi + (lo >> np.uint64(32))) >> np.uint64(32)) != 0
    if over.ndim > 1:
        over = over.reshape(over.shape[0], -1).any(axis=1)
    return s, (over if over.any() else None)


def _union_add(order: np.ndarray, starts: np.ndarray, sizes: np.ndarray, sp: Sparse, nb: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group of the rows taken in ``order`` (``starts``/``sizes``) and sign: the union of its rows' sketch
    ranges (empty: bin 0), and the stored counts scatter-added into it (no sum reaches 2**64): the first bins,
    lengths and counts of the groups' sparse sketches (:func:`trainhist.mergekernel.union_add` compiled)."""
    g = len(starts)
    lo_s, n_s = sp.lo[order], sp.n[order]
    some = n_s > 0
    glo = np.minimum.reduceat(np.where(some, lo_s, nb), starts)
    gn = np.maximum(np.maximum.reduceat(np.where(some, lo_s + n_s, 0), starts) - glo, 0)
    glo[gn == 0] = 0
    gnf = gn.ravel()
    gfirst = (np.cumsum(gnf) - gnf).reshape(g, 2)
    group_of = np.empty(len(order), np.int64)
    group_of[order] = np.repeat(np.arange(g, dtype=np.int64), sizes)
    acc = np.zeros(int(gnf.sum()), np.uint64)
    if sp.counts.size:
        n = sp.n.ravel()
        base = (gfirst[group_of] - glo[group_of] + sp.lo).ravel() - (np.cumsum(n) - n)
        np.add.at(acc, ranges(base, n), sp.counts)
    return glo, gn, acc


def _order_key(x: np.ndarray) -> np.ndarray:
    """int64 keys that sort float64 values in IEEE 754 total order (-0.0 < +0.0)."""
    b = x.view(np.int64)
    return b ^ ((b >> 63) & _LOW63)


def _from_order_key(k: np.ndarray) -> np.ndarray:
    return (k ^ ((k >> 63) & _LOW63)).view(np.float64)


def _exact_key(d: Any) -> tuple:
    """Sort key of an exact value for :meth:`_Engine._row_key`: () when it is a float, else (m, e)."""
    return () if fits_float(d.m, d.e) else (d.m, d.e)


def _groups(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort order (keys[0] primary) and group starts/sizes of equal key tuples."""
    order = np.lexsort(tuple(reversed(keys)))
    n = order.size
    if n == 0:
        return order, np.zeros(0, np.intp), np.zeros(0, np.intp)
    change = np.zeros(n, bool)
    change[0] = True
    for k in keys:
        ks = k[order]
        change[1:] |= ks[1:] != ks[:-1]
    starts = np.flatnonzero(change)
    sizes = np.diff(np.append(starts, n))
    return order, starts, sizes


# -- the engine ----------------------------------------------------------------------------------------------
class _BatchColumns:
    """The columns of a batch of input chunks decoded together (:func:`_batch_columns`), concatenated in batch
    order; :meth:`decode` checks and decodes some of the chunks as :func:`canonical.decode_obs_batch` would."""

    def __init__(self, parts: list[ObsChunk], cols: dict[str, np.ndarray], tally: np.ndarray | None,
                 explicit: list[bool], exact: dict[str, tuple | None], sk: dict[str, np.ndarray] | None,
                 counts: np.ndarray, csize: list[int], scales: list[int | None], any_sk: list[bool],
                 cmax: int | None) -> None:
        self.parts, self.cols, self.tally, self.explicit, self.exact = parts, cols, tally, explicit, exact
        self.sk, self.counts, self.csize, self.scales, self.any_sk = sk, counts, csize, scales, any_sk
        self.cmax = cmax  # a bound on the counts (None: unknown)

    def decode(self, idx: list[int]) -> Rows:
        parts = [self.parts[i] for i in idx]
        scales = {self.scales[i] for i in idx if self.scales[i] is not None}
        assert len(scales) <= 1, "callers group chunks by sketch scale"
        scale = scales.pop() if scales else None
        n = len(self.parts)
        if len(idx) == n:
            cols = {k: v if v.flags.writeable else v.copy() for k, v in self.cols.items()}
            tally, sk = self.tally, self.sk
            exact = {k: None if x is None else (x[0], x[1], x[2], x[2]) for k, x in self.exact.items()}
            counts, csize = self.counts, self.csize
        else:
            sizes = np.array([p.rows for p in self.parts], np.int64)
            r0 = (np.cumsum(sizes) - sizes).tolist()
            sl = [slice(r0[i], r0[i] + self.parts[i].rows) for i in idx]

            def take(a: np.ndarray) -> np.ndarray:  # a new (writeable) array: decode_obs_columns may modify it
                return np.concatenate([a[s] for s in sl])

            cols = {k: take(v) for k, v in self.cols.items()}
            tally = None if self.tally is None else take(self.tally)
            sk = None if self.sk is None else {k: take(v) for k, v in self.sk.items()}
            exact = {}
            for k, x in self.exact.items():
                if x is None or not any(x[2][i] for i in idx):
                    exact[k] = None if x is None or not any(x[3][i] for i in idx) else \
                        (take(x[0]), np.zeros(0, np.uint8), [0] * len(idx), [0] * len(idx))
                    continue
                b0 = np.cumsum([0] + x[2]).tolist()
                blob = np.concatenate([x[1][b0[i] : b0[i + 1]] for i in idx])
                exact[k] = (take(x[0]), blob, [x[2][i] for i in idx], [x[2][i] for i in idx])
            c0 = np.cumsum([0] + self.csize).tolist()
            counts = np.concatenate([self.counts[c0[i] : c0[i + 1]] for i in idx] + [np.zeros(0, np.uint64)])
            csize = [self.csize[i] for i in idx]
        if scale is None:
            sk = counts = None
        return decode_obs_columns(parts, cols, tally, [self.explicit[i] for i in idx], exact, sk, counts, csize,
                                  scale, self.cmax)


def _gather(view: memoryview, col: Any, dt: str, ns: list[int], bound: bool = False) -> Any:
    """:func:`batchdecode.gather` (and with ``bound``, also :func:`batchdecode.upper_bound`): an integer column of
    raw, frame-of-reference and patched-bytes blocks through :func:`trainhist.mergekernel.unpack`, when the kernels
    are there."""
    kern = kernels()
    if kern is None or dt not in _INT_CODES or not set(col.codec) <= _UNPACKED:
        values = gather(view, col, dt, ns)
        return (values, upper_bound(view, col, ns)) if bound else values
    values = np.empty(sum(ns), DTYPES[dt])
    lo, hi = _RANGE[dt]
    top, ok = kern.unpack(np.frombuffer(view, np.uint8), np.array(col.codec, np.int64), np.array(col.start, np.int64),
                          np.array(col.slen, np.int64), np.array(ns, np.int64), values.view(f"<u{values.itemsize}"),
                          dt[0] == "i", np.uint64(lo & _U64_MASK), np.uint64(hi))
    if not ok:
        raise Fallback
    if not bound:
        return values
    return values, int(top) if all_patched(col) else None


def _batch_columns(batch: list[tuple[_Source, Any]], raw: list[bytes]) -> _BatchColumns:
    """Every column of the chunks of ``batch`` (``raw``: their payloads, CRC-checked), through the reader's batched
    decoder; raises (anything) where the per-chunk path must decide."""
    gap = RECORD_HEADER_SIZE
    pieces: list[bytes] = [bytes(gap)]
    entries = []
    at = gap
    for (_, e), data in zip(batch, raw):
        entries.append(e._replace(offset=at - gap))
        pad = -len(data) % 8
        pieces.append(data)
        if pad:
            pieces.append(bytes(pad))
        at += len(data) + pad
    view = memoryview(b"".join(pieces))

    def chunk_of(e: Any) -> Any:
        return check_chunk(view[e.offset + gap : e.offset + gap + e.length], e, "<batch>")

    lay = layout(view, entries, chunk_of, crc=False)
    rows = [e.rows for e in entries]
    rows_a = np.array(rows, np.int64)
    starts = np.cumsum(rows_a) - rows_a
    cols = {name: _gather(view, lay.col(name), dt, rows) for name, dt in OBS_COLUMNS.items()}
    tcols = [lay.col(name) for name in TALLY_COLUMNS]
    tp = [c.present for c in tcols]
    explicit = tp[0]
    if any(q != explicit for q in tp):
        raise Fallback
    tally = None
    if any(explicit):
        tally = np.stack([_gather(view, c, dt, rows) for c, dt in zip(tcols, TALLY_COLUMNS.values())],
                         axis=1).astype(np.uint64)
    exact: dict[str, tuple | None] = {}
    for name in ("sum", "sumsq"):
        xn, x = lay.col(name + "_xn"), lay.col(name + "_x")
        if xn.present != x.present:
            raise Fallback
        if not any(xn.present):
            exact[name] = None
            continue
        lens = _gather(view, xn, "u4", rows)
        if np.add.reduceat(lens.astype(np.int64), starts).tolist() != x.rlen:
            raise Fallback
        sub = x.subset()
        blob = bytes(join(view, sub.start, [a + b for a, b in zip(sub.start, sub.slen)])) \
            if sub.uniform and sub.codec[0] == Codec.RAW else gather(view, sub, "bytes", sub.rlen).tobytes()
        exact[name] = (lens, np.frombuffer(blob, np.uint8), list(x.rlen), xn.present)
    have = lay.col("sk").present
    sk = None
    counts = np.zeros(0, np.uint64)
    cmax = None
    csize = [0] * len(entries)
    scales: list[int | None] = [None] * len(entries)
    any_sk = [False] * len(entries)
    if any(have):
        for i, h in enumerate(have):
            if h:
                sc = lay.scales[i]
                if type(sc) is not int or sc not in (0, 1, 2):
                    raise Fallback
                scales[i] = sc
        skc = {k: lay.col(k) for k in SKETCH_COLUMNS}
        if any(c.present != have for c in skc.values()):
            raise Fallback
        sk = {k: _gather(view, c, SKETCH_COLUMNS[k], rows) for k, c in skc.items() if k != "sk_counts"}
        cc = skc["sk_counts"]
        if any(r % 8 for r in cc.rlen):
            raise Fallback
        used = np.where(sk["sk"] == 1, sk["sk_pn"].astype(np.int64) + sk["sk_nn"].astype(np.int64), 0)
        if np.add.reduceat(used, starts).tolist() != [r // 8 for r in cc.rlen]:
            raise Fallback  # (before sk_counts is decoded: the per-chunk path names the chunk, allocating nothing)
        sub = cc.subset()
        ns = [r // 8 for r in sub.rlen]
        counts, cmax = _gather(view, sub, "u8", ns, bound=True)
        csize = [r // 8 for r in cc.rlen]
        any_sk = np.logical_or.reduceat(sk["sk"] != 0, starts).tolist()
    parts = [ObsChunk(src.path, e.offset, e.rows, e.step_min, e.step_max, src.idx, {}, None, {}, None, None, sc)
             for (src, e), sc in zip(batch, scales)]
    return _BatchColumns(parts, cols, tally, explicit, exact, sk, counts, csize, scales, any_sk, cmax)


def _check_output(output: str, inputs: list[str]) -> None:
    """Refuse an output that would replace an input (the same file under any name) or something that is not a
    regular file (a device, a pipe, a directory): the output is written beside it and renamed over it."""
    import stat

    if not output or output.endswith(os.sep):
        raise UsageError(f"output {output!r} is not a file name; name the file to write (e.g. merged.thist)",
                         code="bad_output")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise UsageError(f"output {output}: the folder {parent} does not exist (or is not a folder); create it "
                         "first, or write to a path in an existing folder", code="bad_output")
    try:
        st = os.stat(output)
    except FileNotFoundError:
        return
    except OSError:  # (not reachable, a loop of links: the write reports it)
        return
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"output {output} exists and is not a regular file: it would be replaced by one; write to "
                         "another path", code="bad_output")
    for p in inputs:
        try:
            if os.path.samefile(p, output):
                raise UsageError(f"output {output} is the input {p}: writing it would replace the input; write to "
                                 "another path (then rename it if you mean to)", code="output_is_input")
        except OSError:
            continue  # (an input that cannot be opened is reported by the scan)


def _refuse_underflow(step: np.ndarray, off: np.ndarray, n: int, where: str, paths: list[str],
                      src: np.ndarray | None) -> None:
    """Refuse rows whose window of ``n`` steps would start below -2**63 (``step - off`` would wrap around to the
    far end of the range: the rows would move there)."""
    low = step < np.iinfo(np.int64).min + off
    if low.any():
        i = int(np.flatnonzero(low)[0])
        raise MergeError(f"{where}: the row at step {int(step[i])} has no window of {n} steps that a file can hold "
                         "(steps start at -2**63); coarsen by another number of steps", code="step_overflow",
                         path=paths[int(src[i])] if src is not None else paths[0])


class _Engine:
    def __init__(self, paths: list[str], output: str, *, steps: int, scale: int | None, across_runs: bool,
                 replica_divergence: str, codec: str, workers: int | None = None) -> None:
        if replica_divergence not in ("error", "report"):
            raise UsageError(f"replica_divergence must be 'error' or 'report', got {replica_divergence!r}")
        if codec not in CODECS:
            raise UsageError(f"codec must be one of {', '.join(CODECS)}, got {codec!r}")
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 0xFFFFFFFF:
            raise UsageError(f"steps must be an integer in 1..{0xFFFFFFFF}, got {steps!r}")
        if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
            raise UsageError(f"workers must be a positive integer or None, got {workers!r}")
        self.workers = workers
        self.paths = [os.fspath(p) for p in paths]
        self.output = os.fspath(output)
        _check_output(self.output, self.paths)
        self.N = steps
        self.scale = scale
        self.across_runs = across_runs
        self.divergence = replica_divergence
        self.codec = CODECS[codec]
        self.pool = _Pool(_pool_cap())
        self.report = MergeReport(self.output, [])

    # -- planning ------------------------------------------------------------------------------------------
    def _open_sources(self) -> None:
        """Open every input as the reader does (its scan: framing, commits, manifests; spec 8), in input order."""
        n = min(self._n_workers(), len(self.paths))
        if n > 1:  # each input opened in a worker; errors come back as data and the first, in input order, is raised
            self.sources = []
            results = _in_workers(n, _worker_source, list(enumerate(self.paths)))
            try:
                for (i, path), res in zip(enumerate(self.paths), results):
                    if res is _UNCARRIED:  # a result pickle cannot carry (a manifest nested beyond its recursion
                        res = ("ok", _Source(i, path))  # limit): opened here, as the serial scan does
                    self.sources.append(_unwrap(res))
            finally:
                results.close()
        else:
            self.sources = [_Source(i, p) for i, p in enumerate(self.paths)]

    def _check_writers(self) -> None:
        """Refuse inputs whose leaf writers overlap (spec 11.8); list each input in the report."""
        owner: dict[str, str] = {}
        for s in self.sources:
            leaf = s.leaf_writers()
            for wid in leaf:
                if wid in owner:
                    if _same_file(owner[wid], s.path):
                        said = "" if owner[wid] == s.path else f" (also as {owner[wid]}, the same file)"
                        msg = (f"this file was given twice as an input{said}: merging it with itself would count "
                               "its observations twice; give each input once")
                    else:
                        msg = (f"inputs {owner[wid]} and {s.path} both contain leaf writer {wid}: merging them would "
                               "count its observations twice (merge disjoint sets of shards only: is one of them a "
                               "merge of the other, or a copy?)")
                    raise MergeError(
                        msg,
                        code="overlapping_writers", path=s.path,
                    )
                owner[wid] = s.path
            self.report.inputs.append({
                "path": s.path, "bytes": s.size, "status": s.status, "committed_bytes": s.committed_bytes,
                "writers": leaf,
            })
            self.report.bytes_in += s.size
        self.leaf_writers = sorted(owner)

    def _plan_sites(self) -> None:
        by_key: dict[tuple, list[tuple[_Source, Any]]] = {}
        for s in self.sources:
            for site in s.sites:
                by_key.setdefault(site.key, []).append((s, site))
        keys = sorted(by_key, key=lambda k: (k[0], k[1], k[2] is not None, k[2] or ""))
        self.site_docs: list[dict] = []
        self.site_map: dict[tuple[int, int], int] = {}  # (source idx, source site id) -> output site id
        self.site_keys = keys
        self.site_sharing: list[str] = []
        self.site_members: list[list[tuple[_Source, Any]]] = []  # (input, its site) per output site
        for new_id, key in enumerate(keys):
            members = by_key[key]
            docs = [site.manifest for _, site in members]
            for field_ in ("sharing", "sample"):
                vals = [d.get(field_) for d in docs]
                if any(v != vals[0] for v in vals):
                    other = next((src, site) for src, site in members if site.manifest.get(field_) != vals[0])
                    raise MergeError(
                        f"site {_site_name(key)} has {field_} {vals[0]!r} in {members[0][0].path} but "
                        f"{other[1].manifest.get(field_)!r} in {other[0].path}: a site must be recorded the same way "
                        "by every writer (merge the files whose settings agree)", code="incompatible_sites",
                        path=other[0].path,
                    )
            # (the cadences of the steps the writers planned: a coarsened file keeps them, spec 11.7)
            spine = math.gcd(*[d["cadence"]["spine"] for d in docs])
            sketch = math.gcd(*[d["cadence"]["sketch"] for d in docs])
            shape = _agree([None if d.get("shape") is None else list(d["shape"]) for d in docs])
            doc = {
                "kind": "site", "id": new_id, "path": key[0], "stream": key[1], "facet": key[2], "shape": shape,
                "dtype": _agree([d.get("dtype") for d in docs]), "sharing": docs[0]["sharing"],
                "cadence": {"spine": spine, "sketch": sketch},
                "sample": docs[0].get("sample"), "order": _agree([d.get("order") for d in docs]),
            }
            self._note_cadences(key, members, spine, sketch)
            self.site_docs.append(doc)
            self.site_sharing.append(doc["sharing"])
            for src, site in members:
                self.site_map[(src.idx, site.id)] = new_id
            self.site_members.append(members)
        self.report.sites = len(keys)

    def _members_by_segment(self, members: list[tuple[_Source, Any]]) -> dict[int, list[tuple[_Source, Any]]]:
        """The inputs of a site grouped by the output segments they contribute to (numbered as
        :meth:`_plan_segments` numbers them: by number, then runs, spec 11.3); a site's cadence is its file's, for
        every segment of that file."""
        if getattr(self, "_out_segment", None) is None:
            local: dict[tuple[int, int], tuple] = {}
            try:
                for src in self.sources:
                    for g in src.segments:
                        local[(src.idx, g.id)] = self._segment_key(src, g)[0]
            except MergeError:  # (unknown_writer: refused by _plan_segments, in its turn)
                return {0: list(members)}
            ids = _number_segments(local.values())
            self._out_segment = {sk: ids[k] for sk, k in local.items()}
        out: dict[int, list[tuple[_Source, Any]]] = {}
        for src, site in members:
            for seg in sorted({self._out_segment[(src.idx, g.id)] for g in src.segments}):
                out.setdefault(seg, []).append((src, site))
        return out

    def _note_cadences(self, key: tuple, members: list[tuple[_Source, Any]], spine: int, sketch: int) -> None:
        """Report a site whose inputs differ in cadence (spec 11.5): the merged cadence is their greatest common
        divisor, which makes due steps no input planned when no input's cadence divides all the others', unless the
        inputs' rows are windows (coarsened, 11.7) that hold a step their input had due around every such step."""
        found: dict[tuple[int, int], list[str]] = {}
        for src, site in members:
            c = site.manifest["cadence"]
            found.setdefault((c["spine"], c["sketch"]), []).append(src.path)
        if len(found) < 2:
            return
        spines = sorted({k[0] for k in found})
        # a step of an output segment is planned only by the inputs of that segment (spec 11.5): a cadence changed
        # between segments makes due, in the segment of the coarser one, steps that no input of it planned
        by_seg = self._members_by_segment(members)
        unplanned_segs: list[int] = []
        windows_: set[int] = set()
        said_spines: set[int] = set()
        for seg, group in sorted(by_seg.items()):
            seg_spines = {site.manifest["cadence"]["spine"] for _, site in group}
            # a step no input planned is due when the gcd is no input's own cadence (0, never, plans nothing) ...
            if spine == 0 or spine in seg_spines:
                continue
            # ... and it reads so only where no input's window around it holds a step that input had due
            cads = sorted({(site.manifest["cadence"]["spine"], max(src.step_window(), self.N)) for src, site in group})
            windows_.update(w for _, w in cads if w > 1)
            if _unplanned_due(spine, cads):
                unplanned_segs.append(seg)
                said_spines.update(seg_spines)
        unplanned = bool(unplanned_segs)
        windows = sorted(windows_)
        inputs = []  # which input had which cadence, and where its rows of the site are (spec 11.5)
        for src, site in sorted(members, key=lambda m: m[0].idx):
            c = site.manifest["cadence"]
            es = src.obs.get(site.id, [])
            inputs.append({"input": src.idx, "path": src.path, "spine": c["spine"], "sketch": c["sketch"],
                           "window": src.step_window(), "rows": sum(e.rows for e in es),
                           "steps": [min(e.step_min for e in es), max(e.step_max for e in es)] if es else None})
        self.report.cadence_mismatches.append({
            "site": _site_name(key), "merged": {"spine": spine, "sketch": sketch}, "unplanned_steps_due": unplanned,
            "unplanned_segments": unplanned_segs,
            "cadences": [{"spine": k[0], "sketch": k[1], "files": sorted(v)} for k, v in sorted(found.items())],
            "inputs": inputs,
        })
        said = []
        for k in sorted(found):
            group = [d for d in inputs if (d["spine"], d["sketch"]) == k]
            said += [_cadence_input(d) for d in group[:2]]
            if len(group) > 2:
                said.append(f"{len(group) - 2} more input{'s' if len(group) > 3 else ''} at {k[0]}/{k[1]}")
        text = (f"site {_site_name(key)} was recorded at different cadences (spine/sketch: {'; '.join(said)}); the "
                f"merged cadence is {spine}/{sketch}, their greatest common divisor")
        lcm = math.lcm(*[c for c in spines if c]) if any(spines) else 0
        if unplanned:
            # (the least common multiple is named only as a window coarsen can take, 1 .. 2^32 - 1 steps: of huge
            # cadences, which a manifest may hold (spec 9), it can have more digits than Python prints)
            width = f" ({lcm} steps, say)" if 0 < lcm <= 0xFFFFFFFF else ""
            segs = ", ".join(map(str, unplanned_segs[:8])) + (
                f" and {len(unplanned_segs) - 8} more" if len(unplanned_segs) > 8 else "")
            where = "" if len(by_seg) < 2 else f" in output segment{'s' if len(unplanned_segs) > 1 else ''} {segs}"
            text += (f":{where} it makes due steps that no input's spine cadence "
                     f"({', '.join(map(str, sorted(said_spines)))}) made due "
                     "(spec 11.5), which read as unknown where they have no row; coarsen the inputs to a multiple of "
                     f"every cadence first{width} to avoid that")
        elif windows:
            text += (f": the steps it makes due that no input's spine cadence ({', '.join(map(str, spines))}) made "
                     f"due lie inside the inputs' coarsened windows ({', '.join(map(str, windows))} steps), each "
                     "holding a step its input had due, so they read as those windows do (spec 11.5)")
        else:
            text += (": a row at a step that only some inputs made due holds those inputs' observations alone "
                     "(spec 11.1)")
        self.report.notes.append(text)

    def _segment_key(self, src: _Source, g: Any) -> tuple[tuple[tuple[str, ...], int], list[str], list[str]]:
        """The output segment an input segment goes to, as (its runs, or none when runs are pooled; its number),
        with the segment's runs and writers (spec 11.3); raises MergeError ``unknown_writer``."""
        runs, num, writers = src.segment_origin(g)
        return (() if self.across_runs else tuple(runs), num), runs, writers

    def _plan_segments(self) -> None:
        groups: dict[tuple, list[tuple[_Source, Any, list[str], list[str]]]] = {}
        local_key: dict[tuple[int, int], tuple] = {}
        for s in self.sources:
            for g in s.segments:
                key, runs, writers = self._segment_key(s, g)
                local_key[(s.idx, g.id)] = key
                groups.setdefault(key, []).append((s, g, runs, writers))
            for g in s.segments:  # spec 11.3: a segment continues one of a smaller number, or cannot be ordered
                if g.previous is None:
                    continue
                num, prev = local_key[(s.idx, g.id)][1], local_key[(s.idx, g.previous)][1]
                if prev >= num:
                    raise MergeError(
                        f"segment {g.id} (number {num}) continues segment {g.previous} "
                        f"(number {prev}), whose number is not smaller: output segments "
                        "are ordered by number, so the segment it continues would come after it, which no file "
                        "may hold (spec 11.3, 9); writers number a segment above the one it continues: this input's "
                        "segment numbers (origin.segment) are damaged", code="segment_order", path=s.path)
        new_id = _number_segments(groups)
        keys = sorted(groups, key=new_id.__getitem__)
        self.seg_map = {sk: new_id[k] for sk, k in local_key.items()}
        self.segment_docs = []
        settings = {d["writer_id"]: d.get("settings") for s in self.sources for d in s.settings}
        ranks: dict[str, set[tuple[str, int, int]]] = {}  # writer id -> its manifests' (run, rank, world size)
        for s in self.sources:
            for d in s.writers:
                ranks.setdefault(d["writer_id"], set()).add((d["run_id"], int(d["rank"]), int(d["world_size"])))
        for k in keys:
            members = groups[k]
            starts = sorted({(g.first_step, s.path) for s, g, _, _ in members if g.first_step is not None})
            firsts = [f for f, _ in starts]
            if len(set(firsts)) > 1:
                self.report.segment_mismatches.append({"segment": new_id[k], "first_steps": starts})
            first = None if not firsts else (min(firsts) // self.N) * self.N
            if first is not None and first < -(1 << 63):
                raise MergeError(f"segment {new_id[k]}: its first step {min(firsts)} has no window of {self.N} "
                                 "steps that a file can hold (steps start at -2**63); coarsen by another number of "
                                 "steps", code="step_overflow", path=self.paths[0])
            reasons = [g.reason for _, g, _, _ in members]
            prevs = [None if g.previous is None else new_id.get(local_key.get((s.idx, g.previous)))
                     for s, g, _, _ in members]
            runs = sorted({r for _, _, rs, _ in members for r in rs})
            writers = sorted({w for _, _, _, ws in members for w in ws})
            own = [settings[w] for w in writers if isinstance(settings.get(w), dict)]
            keys_ = sorted({key for d in own for key in d if any(e.get(key) != own[0].get(key) for e in own)})
            if keys_:
                self.report.settings_mismatches.append({"segment": new_id[k], "writers": writers, "keys": keys_})
            self._note_segment(new_id[k], starts, keys_)
            writer_runs: dict[str, set[str]] = {}  # (the runs of the segments each writer recorded in this one)
            for _, _, rs, ws in members:
                for w in ws:
                    writer_runs.setdefault(w, set()).update(rs)
            self._note_missing_ranks(new_id[k], writers, ranks, writer_runs)
            self.segment_docs.append({
                "kind": "segment", "id": new_id[k], "first_step": first,
                "reason": reasons[0] if all(r == reasons[0] for r in reasons) else "manual",
                "previous": _agree(prevs), "writer_id": writers[0],
                "origin": {"runs": runs, "segment": k[1], "writers": writers},
            })
        self.report.segments = len(keys)

    def _note_segment(self, seg: int, firsts: list[tuple[int, str]], keys: list[str]) -> None:
        """The notes on an output segment whose inputs start at different steps (``firsts``: (first step, input
        path), sorted; ``segment_mismatches``) or whose writers recorded with different settings (``keys``;
        ``settings_mismatches``): guide section 5, ``notes`` holds every such finding as a sentence, for the users
        of the API as for the command line."""
        if len({f for f, _ in firsts}) > 1:
            self.report.notes.append(
                f"the inputs of output segment {seg} start at different steps "
                f"({', '.join(f'{step} in {path}' for step, path in firsts)}): if one rank lost a resume before its "
                "first commit, its later segments are numbered one lower and their steps are split across two output "
                "segments; check the per-step totals there")
        if keys:
            self.report.notes.append(
                f"the writers of output segment {seg} recorded with different settings ({', '.join(keys)}): a row "
                "holds what each of them recorded (where only some recorded a site or step, theirs alone)")

    def _note_missing_ranks(self, seg: int, writers: list[str], ranks: dict[str, set],
                            writer_runs: dict[str, set[str]]) -> None:
        """Spec 11.3: the runs of output segment ``seg`` whose writers (``writers``, leaf ids) all declare one world
        size but not every rank below it (``missing_ranks``, with a note). A writer without a manifest, or whose
        manifests disagree, leaves its run unjudged; so does an engine of one input (coarsen, canonicalize: a file
        of the one rank that recorded is not a merge that left ranks out). ``writer_runs``: the runs of the input
        segments each writer recorded in (a writer without a manifest is known by them alone)."""
        if len(self.sources) < 2:
            return
        by_run: dict[str, list[tuple[int, int]]] = {}
        unjudged = set()
        for w in writers:
            docs = ranks.get(w, set())
            if len(docs) != 1:  # (no manifest: its rank is unknown, and may be the one that looks missing)
                unjudged.update(r for r, _, _ in docs)
                unjudged.update(writer_runs.get(w, ()))
                continue
            run, rank, world = next(iter(docs))
            by_run.setdefault(run, []).append((rank, world))
        for run in sorted(by_run):
            worlds = {world for _, world in by_run[run]}
            if run in unjudged or len(worlds) != 1:
                continue
            world = worlds.pop()
            present = {rank for rank, _ in by_run[run] if rank < world}
            if len(present) == world:
                continue
            missing = []
            for r in range(world):  # (the first ones: at most len(present) + MAX_MISSING_RANKS steps)
                if r not in present:
                    missing.append(r)
                    if len(missing) == MAX_MISSING_RANKS:
                        break
            total = world - len(present)
            self.report.missing_ranks.append({"segment": seg, "run": run, "world_size": world,
                                              "ranks": len(present), "missing": missing, "missing_total": total})
            named = ", ".join(map(str, missing)) + (f" and {total - len(missing)} more" if total > len(missing) else "")
            self.report.notes.append(
                f"output segment {seg}: the writers of run {run} declare a world size of {world}, but "
                f"{'rank' if total == 1 else 'ranks'} {named} contributed nothing to it (a shard lost or not given?): "
                "its rows and step-truth totals hold the other ranks' observations alone (spec 11.3)")

    # -- reading -------------------------------------------------------------------------------------------
    def _check_ignored(self) -> None:
        """Check the committed records of an unknown ignorable type of every input as ``trainhist verify`` does
        (spec 11: every input is checked as verify checks it; 8: their CRC and padding), in the order verify
        checks them (after the obs chunks, before the steps chunks): a damaged one refuses the input with
        verify's code and offset, though merge copies nothing of it."""
        for src in self.sources:
            for off, rtype, length, pcrc in src.ignored:
                data = self.pool.pread(src.path, length + pad8(length), off + RECORD_HEADER_SIZE)
                problem = payload_problem(data, length, pcrc, rtype, off)
                if problem is not None:
                    raise CorruptError(problem[1], code=problem[0], path=src.path, offset=off)


    def _payload(self, src: _Source, e: Any) -> memoryview:
        data = self.pool.pread(src.path, e.length, e.offset + RECORD_HEADER_SIZE)
        return check_payload(data, e.payload_crc, src.path, e.offset)

    def _decode_batch(self, batch: list[tuple[_Source, Any]], out_site: int) -> Rows:
        """The rows of a batch of chunks of one output site, checked and decoded together where their sketch
        scales allow (chunks that need downscaling, or that declare a scale but hold no sketch, one by one).

        The payloads are read (and CRC-checked) first, then decoded by the batched machinery of the reader
        (:mod:`trainhist.batchdecode`: directories by template, each column of all chunks at once). When any
        check of that path fails, or a payload cannot be read or fails its CRC, the chunks are decoded one by
        one in order (:meth:`_decode_each`), which raises the error of spec 8 with the input's path and the
        record's offset, exactly as before."""
        raw = self._read_payloads(batch)
        if len(raw) == len(batch):
            try:
                dec = _batch_columns(batch, raw)
            except Exception:  # noqa: BLE001 - the per-chunk path below decides, and names the error
                dec = None
            if dec is not None:
                return self._decode_columns(batch, dec, out_site)
        return self._decode_each(batch, raw, out_site)

    def _read_payloads(self, batch: list[tuple[_Source, Any]]) -> list[bytes]:
        """The payloads of the chunks of ``batch``, CRC-checked, up to the first that cannot be read or fails its
        CRC (the per-chunk path reads that one again, in order, and names the error)."""
        raw: list[bytes] = []
        for src, e in batch:
            try:
                data = self.pool.pread(src.path, e.length, e.offset + RECORD_HEADER_SIZE)
            except TrainhistError:
                break
            if crc32c(data) != e.payload_crc:
                break
            raw.append(data)
        return raw

    def _route(self, src: _Source, p_scale: int | None, sc: int | None, out_site: int) -> int | None:
        """How a chunk joins its batch: None with the others, -1 alone, else alone and downscaled by that much
        (``p_scale``: the scale its directory declares when it has sketch columns; ``sc``: that scale when some
        row holds a sketch)."""
        if sc is None:
            return None if p_scale is None else -1
        target = sc if self.scale is None else min(sc, self.scale)
        want = self.site_scale.get(out_site)
        if want is not None and target != want:  # (an input a full check refuses gets its error first: run)
            raise MergeError(
                f"site {_site_name(self.site_keys[out_site])}: sketches at scale {want} "
                f"({2 ** want} bins per octave) in {self.scale_file[out_site]} and at scale {sc} in "
                f"{src.path}; coarsen both to the coarser scale first", code="incompatible_grid", path=src.path,
            )
        if want is None:
            self.site_scale[out_site] = target
            self.scale_file[out_site] = src.path
        return sc - target if target != sc else None

    def _decode_each(self, batch: list[tuple[_Source, Any]], raw: list[bytes], out_site: int) -> Rows:
        """The per-chunk path: each chunk parsed and checked alone, in order (``raw``: payloads already read and
        CRC-checked, for the first chunks)."""
        parts: list[ObsChunk] = []

        def read(i: int) -> tuple[int | None, bool]:
            src, e = batch[i]
            payload = memoryview(raw[i]) if i < len(raw) else self._payload(src, e)
            p = read_obs(payload, path=src.path, offset=e.offset, site=e.site, segment=e.segment,
                         rows=e.rows, step_min=e.step_min, step_max=e.step_max, src=src.idx)
            parts.append(p)
            return p.scale, p.sk is not None and bool(p.sk["sk"].any())

        return self._routed(batch, out_site, read, lambda idx: decode_obs_batch([parts[i] for i in idx]))

    def _decode_columns(self, batch: list[tuple[_Source, Any]], dec: _BatchColumns, out_site: int) -> Rows:
        """:meth:`_decode_each` on the columns of the batched path: the same routing, the same checks in the
        same order (those of each chunk alone passed already)."""
        return self._routed(batch, out_site, lambda i: (dec.scales[i], dec.any_sk[i]), dec.decode)

    def _routed(self, batch: list[tuple[_Source, Any]], out_site: int,
                scale_of: Callable[[int], tuple[int | None, bool]], decode: Callable[[list[int]], Rows]) -> Rows:
        """The rows of the chunks of ``batch``, taken in order: ``scale_of(i)`` gives chunk ``i``'s declared sketch
        scale and whether a row holds a sketch (:meth:`_route`); those that join are decoded together
        (``decode(indices)``), the others alone as they come, downscaled where the output needs it."""
        together: list[int] = []
        alone: list[Rows] = []
        for i, (src, e) in enumerate(batch):
            scale, sketched = scale_of(i)
            self.report.rows_in += e.rows
            if scale is not None and (seen := self.input_scale.setdefault((src.idx, e.site), scale)) != scale:
                # one input's site mixes scales (spec 7.5): run raises verify's error, at verify's offset (spec 11)
                raise CorruptError(f"site {e.site} has chunks at sketch scales {seen} and {scale} (spec 7.5)",
                                   code="mixed_scale", path=src.path, offset=e.offset)
            how = self._route(src, scale, scale if sketched else None, out_site)
            if how is None:
                together.append(i)
            elif how < 0:
                alone.append(decode([i]))
            else:
                alone.append(self._downscale(decode([i]), how))
        rows = ([decode(together)] if together else []) + alone
        return Rows.concat(rows) if len(rows) > 1 else rows[0]

    def _downscale(self, r: Rows, by: int) -> Rows:
        """Sketch bins at scale ``s - by``: bin ``i`` goes to ``i >> by`` (grid.downscale_index); the window maps
        onto itself, so under/overflow are unchanged. A row whose new bin overflows a u64 count is marked
        (``Rows.over``), refused only where the combined row keeps its numbers (:meth:`_refuse_over`, spec 11.2)."""
        r.densify()
        n = len(r)
        k = 1 << by
        nb = nbins(r.scale - by)
        starts = np.arange(0, n * nbins(r.scale), k)
        sizes = np.full(starts.size, k)
        out = []
        for a in (r.pos, r.neg):
            s, over = _sum_u64(a.reshape(-1), starts, sizes)
            if over is not None:
                rows = over.reshape(n, nb).any(axis=1)
                r.over = rows if r.over is None else r.over | rows
            out.append(s.reshape(n, nb))
        r.pos, r.neg = out
        r.scale -= by
        return r

    def _refuse_over(self, r: Rows, over: np.ndarray | None, kept: np.ndarray, rows_of: Callable[[int], np.ndarray],
                     where: str) -> None:
        """Refuse (``count_overflow``) the first row in ``over & kept`` (a sketch bin that overflowed when its input's
        resolution was halved, in a row that keeps its numbers); ``rows_of(i)``: the input rows of row ``i``."""
        if over is None or not (bad := over & kept).any():
            return
        i = int(np.flatnonzero(bad)[0])
        rows = rows_of(i)
        c = r.cols
        raise MergeError(f"{where}, step {int(c['step'][rows[0]])}: a sketch bin count overflows an unsigned 64-bit "
                         f"count when halving the resolution of {self._ctx_files(c['src'][rows])}",
                         code="count_overflow", path=self.paths[int(c["src"][rows[0]])])

    # -- combining ------------------------------------------------------------------------------------------
    def _ctx_files(self, src: np.ndarray) -> str:
        return ", ".join(self.paths[i] for i in sorted(set(src.tolist())) if i >= 0)

    def _add(self, r: Rows, order: np.ndarray, starts: np.ndarray, sizes: np.ndarray, where: str) -> Rows:
        """Sum the groups ``starts``/``sizes`` of the rows of ``r`` taken in ``order``."""
        sp = r.sparse
        nb = None if r.scale is None else nbins(r.scale)
        if sp is not None and sp.cmax * int(sizes.max()) >= _U64:
            r.densify()  # a sum may overflow: the dense path finds it
            sp = None
        # every per-row array taken in order, but the exact sums (group_sum takes their rows in order itself)
        c = {k: v[order] for k, v in r.cols.items() if k not in ("sum", "sumsq")}
        tally_in, has_in = r.tally[order], r.has_sk[order]
        pos_in, neg_in, bands_in = (None if a is None else a[order] for a in (r.pos, r.neg, r.bands))
        out: dict[str, np.ndarray] = {k: c[k][starts] for k in ("step", "span", "micro", "phase")}
        out["src"] = np.minimum.reduceat(c["src"], starts)

        def refused(mask: np.ndarray, what: str, code: str) -> MergeError:
            """The error of the first group in ``mask``: its step and the files of its rows."""
            g = int(np.flatnonzero(mask)[0])
            s0, n = int(starts[g]), int(sizes[g])
            return MergeError(
                f"{where}, step {int(c['step'][s0])}: {what} when adding rows from "
                f"{self._ctx_files(c['src'][s0:s0 + n])}", code=code, path=self.paths[int(c["src"][s0])],
            )

        def overflow(mask: np.ndarray, what: str) -> MergeError:
            return refused(mask, f"{what} overflows an unsigned 64-bit count", "count_overflow")

        tally, over = _sum_u64(tally_in, starts, sizes)
        if over is not None:
            raise overflow(over, "a presence tally")
        out["presence"] = derive_presence(tally)
        # spec 11.2: the refusals below are decided on the numbers a combined row keeps, which only an observed
        # row does (2.6: the others are blanked at the end, whatever their inputs add to); the tally, kept by every
        # row, was decided above
        kept = out["presence"] == Presence.OBSERVED

        def kept_over(over: np.ndarray | None) -> np.ndarray | None:
            return None if over is None or not (over := over & kept).any() else over

        if r.over is not None:  # (bins that overflowed when an input's resolution was halved: _downscale)
            self._refuse_over(r, np.logical_or.reduceat(r.over[order], starts), kept,
                              lambda g: order[int(starts[g]):int(starts[g] + sizes[g])], where)

        for k in ("count", "nan", "pinf", "ninf", "zero"):
            out[k], over = _sum_u64(c[k], starts, sizes)
            if (over := kept_over(over)) is not None:
                raise overflow(over, k)
        out["method"] = np.maximum.reduceat(c["method"], starts)
        kmin = _order_key(c["min"])
        kmin = np.where(np.isnan(c["min"]), _I64_MAX, kmin)
        gmin = np.minimum.reduceat(kmin, starts)
        kmax = _order_key(c["max"])
        kmax = np.where(np.isnan(c["max"]), _I64_MIN, kmax)
        gmax = np.maximum.reduceat(kmax, starts)
        out["min"] = _from_order_key(gmin).copy()
        out["min"][gmin == _I64_MAX] = CANONICAL_NAN
        out["max"] = _from_order_key(gmax).copy()
        out["max"][gmax == _I64_MIN] = CANONICAL_NAN
        out["sum"], sum_x = group_sum(r.cols["sum"], r.sum_x, starts, sizes, order)
        out["sumsq"], sumsq_x = group_sum(r.cols["sumsq"], r.sumsq_x, starts, sizes, order)
        unknown = out["method"] == SumMethod.UNKNOWN  # (the known rows' sums are not the sums of the group: 11.2)
        if unknown.any():
            for k, x in (("sum", sum_x), ("sumsq", sumsq_x)):
                out[k][unknown] = 0.0
                x.blank(unknown)
        for name, x in (("sum", sum_x), ("sumsq", sumsq_x)):
            big = x.out_of_range() & kept
            if big.any():
                raise refused(big, x.why_out_of_range(int(np.flatnonzero(big)[0]), name), "sum_overflow")
        has = np.logical_or.reduceat(has_in, starts)
        pos = neg = bands = sparse = None
        if sp is not None:
            # each group's range per sign is the union of its rows' ranges; the stored counts are scatter-added
            # straight into those ranges (no sum reaches 2**64), so the sketch stays sparse
            kern = kernels()
            if kern is not None:
                glo, gn, acc = kern.union_add(*(a.astype(np.int64, copy=False) for a in (order, starts, sizes, sp.lo,
                                                                                         sp.n)), sp.counts, nb)
            else:
                glo, gn, acc = _union_add(order, starts, sizes, sp, nb)
            sparse = Sparse(glo, gn, acc, sp.cmax * int(sizes.max()))  # a bound: no pass over the sums
            bands, over = _sum_u64(bands_in, starts, sizes)
            if (over := kept_over(over)) is not None:
                raise overflow(over, "a sketch under/overflow count")
        elif pos_in is not None:
            pos, over = _sum_u64(pos_in, starts, sizes)
            if (over := kept_over(over)) is not None:
                raise overflow(over, "a sketch bin")
            neg, over = _sum_u64(neg_in, starts, sizes)
            if (over := kept_over(over)) is not None:
                raise overflow(over, "a sketch bin")
            bands, over = _sum_u64(bands_in, starts, sizes)
            if (over := kept_over(over)) is not None:
                raise overflow(over, "a sketch under/overflow count")
        res = Rows(out, sum_x, sumsq_x, tally, has, pos, neg, bands, r.scale, sparse)
        blank(res, out["presence"] != Presence.OBSERVED)  # spec 2.6: a row that is not observed has no numbers
        return res

    def _overlapping_spans(self, r: Rows, reach: dict | None = None) -> tuple[int, int, int, int, int] | None:
        """The first two rows of ``r`` (after the rows of earlier batches that ``reach`` holds) of one phase and
        micro-batch whose steps overlap under different spans, as ``(step, span, step, span, src of the later)``,
        or None: rows of one identity are combined already, so two rows that overlap have different spans (an
        input coarsened to a window, another not, or to another window).

        ``reach`` carries the check from one sweep batch to the next (:meth:`_site`), and is updated: per (phase,
        micro), the row of the earlier batches whose steps reach furthest, as ``(phase, micro) -> (end, step, span,
        src)`` (``end``: its last step as an offset from -2**63, at most 2**64 - 1). A later batch holds only later
        steps (:meth:`_sweep`), so a row of it overlaps an earlier row exactly when it starts within that furthest
        reach; only rows of more than one step reach into a later batch."""
        c = r.cols
        wide = c["span"] != 1
        if not wide.any() and not reach:
            return None  # (one-step rows alone, and nothing earlier reaching beyond its own step)
        ph, mi, st, sp, src = c["phase"], c["micro"], c["step"], c["span"].astype(np.uint64), c["src"]
        if reach:  # the earlier batches' furthest rows, before this batch's (their steps are all earlier)
            held = list(reach.items())
            ph = np.concatenate([np.array([k[0] for k, _ in held], ph.dtype), ph])
            mi = np.concatenate([np.array([k[1] for k, _ in held], mi.dtype), mi])
            st = np.concatenate([np.array([v[1] for _, v in held], st.dtype), st])
            sp = np.concatenate([np.array([v[2] for _, v in held], np.uint64), sp])
            src = np.concatenate([np.array([v[3] for _, v in held], src.dtype), src])
        hit = None
        if len(st) >= 2:
            o = np.lexsort((st, mi, ph))
            ph, mi, st, sp, src = ph[o], mi[o], st[o], sp[o], src[o]
            gap = st[1:].view(np.uint64) - st[:-1].view(np.uint64)  # (sorted: the true distance, even across 0)
            over = (ph[1:] == ph[:-1]) & (mi[1:] == mi[:-1]) & (gap < sp[:-1])
            if over.any():
                i = int(np.flatnonzero(over)[0])
                hit = (int(st[i]), int(sp[i]), int(st[i + 1]), int(sp[i + 1]), int(src[i + 1]))
        if reach is None:
            return hit
        w = np.flatnonzero(sp > 1)
        if w.size:
            key = st[w].view(np.uint64) ^ np.uint64(1 << 63)  # (order-preserving offsets from -2**63)
            end = key + np.minimum(sp[w] - np.uint64(1), ~key)  # its last step, saturated at the largest step
            o = np.lexsort((end, mi[w], ph[w]))
            gp, gm = ph[w][o], mi[w][o]
            lasts = np.flatnonzero(np.r_[(gp[1:] != gp[:-1]) | (gm[1:] != gm[:-1]), True])  # each group's furthest
            for j in o[lasts].tolist():
                i, k = int(w[j]), (int(ph[w[j]]), int(mi[w[j]]))
                e = int(end[j])
                if k not in reach or e > reach[k][0]:
                    reach[k] = (e, int(st[i]), int(sp[i]), int(src[i]))
        top = int(st.max().view(np.uint64) ^ np.uint64(1 << 63))  # (later batches start after this batch's steps)
        for k in [k for k, v in reach.items() if v[0] < top]:
            del reach[k]  # (reaches no later step)
        return hit

    def _refuse_overlapping_replicas(self, r: Rows, where: str, reach: dict | None = None) -> None:
        """Replica rows kept once per (step, span) must not cover the same steps under different spans: inputs
        coarsened to different windows hold the same tensor's observations twice, and adding them would count it
        twice (spec 11.5). ``reach``: see :meth:`_overlapping_spans`."""
        hit = self._overlapping_spans(r, reach)
        if hit is not None:
            a, n, b, m, src = hit
            raise MergeError(
                f"{where}: replica rows at step {a} (span {n}) and step {b} (span {m}) cover the same steps: the "
                "inputs were coarsened to different windows, and adding them would count the replicated tensor "
                "twice; coarsen every input to the same number of steps first", code="incompatible_span",
                path=self.paths[src])

    def _note_overlapping_spans(self, r: Rows, where: str, reach: dict, seen: list) -> None:
        """Shard rows of different spans over the same steps (an input coarsened, another not) do not combine
        (spec 11.1): the merged series then holds a window and one-step rows over the same steps. The first such
        pair of a site and segment goes to the report (``span_overlaps``; ``seen``: whether it has one already)."""
        if seen:
            return
        hit = self._overlapping_spans(r, reach)
        if hit is not None:
            a, n, b, m, src = hit
            seen.append(True)
            self.report.span_overlaps.append({"where": where, "rows": [[a, n], [b, m]], "file": self.paths[src]})

    def _replica(self, r: Rows, starts: np.ndarray, sizes: np.ndarray, where: str) -> Rows:
        """Keep one row of each group of replica rows; they must be identical (or, on request, are reported)."""
        r.densify()
        n = len(r)
        first = np.repeat(starts, sizes)
        c = r.cols
        # per field, the rows that differ from their group's first row (the message names the fields)
        fields = {k: c[k] != c[k][first] for k in ("presence", "method", "count", "nan", "pinf", "ninf", "zero")}
        fields.update({k: c[k].view(np.uint64) != c[k].view(np.uint64)[first] for k in ("min", "max", "sum", "sumsq")})
        fields["tally"] = (r.tally != r.tally[first]).any(axis=1)
        sketch = r.has_sk != r.has_sk[first]
        if r.pos is not None:
            sketch |= (r.pos != r.pos[first]).any(axis=1) | (r.neg != r.neg[first]).any(axis=1)
            sketch |= (r.bands != r.bands[first]).any(axis=1)
        fields["sketch"] = sketch
        fields["sum (exact)"], fields["sumsq (exact)"] = r.sum_x.differs(first), r.sumsq_x.differs(first)
        diff = np.zeros(n, bool)
        for d in fields.values():
            diff |= d
        keep = starts.copy()
        if diff.any():
            bad_groups = np.unique(np.searchsorted(starts, np.flatnonzero(diff), side="right") - 1)
            for g in bad_groups.tolist():
                s0, sz = int(starts[g]), int(sizes[g])
                j = s0 + int(np.flatnonzero(diff[s0:s0 + sz])[0])
                a, b = self.paths[int(c["src"][s0])], self.paths[int(c["src"][j])]
                step = int(c["step"][s0])
                names = [k for k, d in fields.items() if d[j]]
                row = (f"step {step}" + (f" (span {int(c['span'][s0])})" if c["span"][s0] != 1 else "")
                       + f", phase {Phase.name(int(c['phase'][s0]))}"
                       + ("" if c["micro"][s0] == MICRO_ALL else f", micro-batch {int(c['micro'][s0])}"))
                if self.divergence == "error":
                    raise MergeError(
                        f"{where}, {row}: replica site rows differ in {', '.join(names)} between {a} and {b} (a "
                        "replicated tensor must be identical on every rank; pass replica_divergence='report' to "
                        "keep one and list the divergence)", code="replica_divergence", path=b,
                    )
                self.report.divergences_total += 1
                if len(self.report.divergences) < MAX_DIVERGENCES:
                    self.report.divergences.append({"where": where, "step": step, "files": sorted({a, b}),
                                                    "row": row, "fields": names})
                keep[g] = min(range(s0, s0 + sz), key=lambda i: self._row_key(r, i))
        out = r.take(keep)
        return out

    @staticmethod
    def _row_key(r: Rows, i: int) -> tuple:
        """A total order on row contents, to pick a deterministic representative of divergent replicas."""
        c = r.cols
        sk = () if r.pos is None else (r.pos[i].tolist(), r.neg[i].tolist(), r.bands[i].tolist())
        return (r.tally[i].tolist(), [int(c[k][i]) for k in ("count", "nan", "pinf", "ninf", "zero", "method")],
                [int(c[k][i:i + 1].view(np.uint64)[0]) for k in ("min", "max", "sum", "sumsq")],
                [_exact_key(x.get(i)) for x in (r.sum_x, r.sumsq_x)], bool(r.has_sk[i]), sk)

    def _combine(self, r: Rows, sharing: str, where: str, reach: dict | None = None, noted: list | None = None
                 ) -> Rows:
        """Combine the rows of one sweep batch of a site and segment; ``reach`` and ``noted``: the state that carries
        the check of overlapping spans from batch to batch (:meth:`_overlapping_spans`)."""
        r = self._combine_rows(r, sharing, where, reach, noted)
        if r.over is not None:  # (rows that combined with none: refused where observed, see _downscale)
            self._refuse_over(r, r.over, r.cols["presence"] == Presence.OBSERVED, lambda i: np.array([i]), where)
            r.over = None
        return r

    def _combine_rows(self, r: Rows, sharing: str, where: str, reach: dict | None, noted: list | None) -> Rows:
        """:meth:`_combine`, but for the refusal of the rows that overflowed when downscaled and combined with no
        other row."""
        c = r.cols
        if sharing == "replica" or self.N == 1:
            order, starts, sizes = _groups([c["step"], c["span"], c["phase"], c["micro"]])
            if sharing == "replica":
                r = r.take(order)
                r = self._replica(r, starts, sizes, where) if (sizes > 1).any() else r
                self._refuse_overlapping_replicas(r, where, reach)
            elif (sizes > 1).any():
                r = self._add(r, order, starts, sizes, where)
            else:
                r = r.take(order)
            if self.N == 1:
                if sharing != "replica" and reach is not None and noted is not None:
                    self._note_overlapping_spans(r, where, reach, noted)
                return r
            c = r.cols
        n = self.N
        off = c["step"] % n
        bad = off + c["span"].astype(np.int64) > n
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise MergeError(
                f"{where}: a row at step {int(c['step'][i])} spans {int(c['span'][i])} steps, which crosses a "
                f"window of {n} steps (coarsen to a multiple of the existing span)", code="incompatible_span",
                path=self.paths[int(c["src"][i])],
            )
        _refuse_underflow(c["step"], off, n, where, self.paths, c["src"])
        c["step"] = c["step"] - off
        c["span"] = np.full(len(r), n, np.uint32)
        order, starts, sizes = _groups([c["step"], c["phase"], c["micro"]])
        return self._add(r, order, starts, sizes, where) if (sizes > 1).any() else r.take(order)

    # -- steps ---------------------------------------------------------------------------------------------
    def _combine_steps(self, r: StepRows, where: str, files: str) -> StepRows:
        c = r.cols
        if self.N > 1:
            n = self.N
            off = c["step"] % n
            if (off + c["span"].astype(np.int64) > n).any():
                raise MergeError(f"{where}: a step-truth row crosses a window of {n} steps", code="incompatible_span",
                                 path=self.paths[0])
            _refuse_underflow(c["step"], off, n, where, self.paths, None)
            c["step"] = c["step"] - off
            c["span"] = np.full(len(r), n, np.uint32)
        order, starts, sizes = _groups([c["step"], c["span"]])
        r = r.take(order)
        c = r.cols
        if not (sizes > 1).any():
            return r
        out = {"step": c["step"][starts], "span": c["span"][starts]}
        for k in ("applied", "grad_basis", "clipped", "micro_batches"):
            lo, hi = np.minimum.reduceat(c[k], starts), np.maximum.reduceat(c[k], starts)
            out[k] = np.where(lo == hi, lo, 0).astype(c[k].dtype)
        for k in ("loss_scale", "clip_threshold"):
            b = c[k].view(np.uint64)
            lo, hi = np.minimum.reduceat(b, starts), np.maximum.reduceat(b, starts)
            out[k] = np.where(lo == hi, lo, np.uint64(CANONICAL_NAN_BITS)).view(np.float64)
        for k in ("tokens", "samples"):
            v = c[k]
            unknown = np.logical_or.reduceat(v == np.uint64(U64_UNKNOWN), starts)
            s, over = _sum_u64(np.where(v == np.uint64(U64_UNKNOWN), np.uint64(0), v), starts, sizes)
            bad = s == np.uint64(U64_UNKNOWN)
            if over is not None:
                bad |= over
            bad &= ~unknown  # (spec 11.6, 11.2: an unknown row keeps no sum, so none is refused)
            if bad.any():
                at = int(c["step"][starts[int(np.flatnonzero(bad)[0])]])
                raise MergeError(f"{where}, step {at}: step-truth {k} overflows an unsigned 64-bit count adding rows "
                                 f"from {files}", code="count_overflow", path=self.paths[0])
            out[k] = np.where(unknown, np.uint64(U64_UNKNOWN), s)
        out["n_rows"], over = _sum_u64(c["n_rows"], starts, sizes)
        if over is not None:
            at = int(c["step"][starts[int(np.flatnonzero(over)[0])]])
            raise MergeError(f"{where}, step {at}: step-truth n_rows overflows an unsigned 64-bit count adding rows "
                             f"from {files}", code="count_overflow", path=self.paths[0])
        return StepRows(out)

    # -- sweep ---------------------------------------------------------------------------------------------
    def _sweep(self, items: list[tuple[int, int, int, _Source, Any]]) -> Iterable[list[tuple[_Source, Any]]]:
        """Batches of chunks such that no window of a later batch occurs in an earlier one."""
        items.sort(key=lambda t: (t[0], t[2], t[4].offset))
        batch: list[tuple[_Source, Any]] = []
        cur_hi = None
        rows = 0
        for lo, hi, _, src, e in items:
            if batch and lo > cur_hi and rows >= BATCH_ROWS:
                yield batch
                batch, rows, cur_hi = [], 0, None
            batch.append((src, e))
            cur_hi = hi if cur_hi is None else max(cur_hi, hi)
            rows += e.rows
        if batch:
            yield batch

    def _n_workers(self) -> int:
        if "fork" not in mp.get_all_start_methods() or mp.current_process().daemon:
            return 1  # workers inherit the plan by fork; a daemonic process may not have children
        if self.workers is not None:
            return self.workers
        size = self.report.bytes_in if self.report.inputs else _input_bytes(self.paths)  # before the scan: stat
        if size < AUTO_WORKERS_BYTES:
            return 1
        return max(1, min(os.cpu_count() or 1, MAX_WORKERS))

    def _site(self, out_site: int) -> dict:
        """The obs records of one output site, segment by segment, in step order, and what went into them."""
        rows_in = self.report.rows_in
        divergences = len(self.report.divergences)
        total = self.report.divergences_total
        overlaps = len(self.report.span_overlaps)
        per_seg: dict[int, list] = {}
        for s, site in self.site_members[out_site]:
            for e in s.obs.get(site.id, []):
                seg = self.seg_map[(s.idx, e.segment)]
                per_seg.setdefault(seg, []).append((self._window(e.step_min), self._window(e.step_max), s.idx, s, e))
        sharing = self.site_sharing[out_site]
        records: list[tuple] = []
        for seg in sorted(per_seg):
            where = f"site {_site_name(self.site_keys[out_site])}, segment {seg}"
            buf: list[Rows] = []
            reach: dict = {}  # (rows of earlier batches that reach into later ones: spec 11.5, 11.1)
            noted: list = []  # (the segment's overlapping spans are in the report)
            for batch in self._sweep(per_seg[seg]):
                r = self._combine(self._decode_batch(batch, out_site), sharing, where, reach, noted)
                buf.append(r)
                buf = self._emit_obs(records, buf, out_site, seg, final=False)
            self._emit_obs(records, buf, out_site, seg, final=True)
        return {"records": records, "rows_in": self.report.rows_in - rows_in,
                "divergences": self.report.divergences[divergences:],
                "divergences_total": self.report.divergences_total - total,
                "span_overlaps": self.report.span_overlaps[overlaps:]}

    def _write_site(self, w: CanonicalWriter, res: dict) -> None:
        """Append a built site's records (payloads in hand, or in a worker's spool file) and commit them."""
        spool = res.get("spool")
        fd = None if spool is None else self._spool_fds.get(spool)
        if spool is not None and fd is None:
            fd = self._spool_fds[spool] = os.open(spool, os.O_RDONLY)
        for rec in res["records"]:
            if fd is None:
                payload, site, seg, rows, lo, hi = rec
                w.obs(payload, site, seg, rows, lo, hi)
            else:
                offset, length, crc, site, seg, rows, lo, hi = rec
                w.obs_from(fd, offset, length, crc, site, seg, rows, lo, hi)
            self.report.rows_out += rows
        w.commit()

    def _window(self, step: int) -> int:
        return (step // self.N) * self.N

    # -- output --------------------------------------------------------------------------------------------
    def _emit_obs(self, out: list[tuple], buf: list[Rows], site: int, seg: int, final: bool) -> list[Rows]:
        """Encode whole chunks of ``buf`` (and, when ``final``, the rest) as records appended to ``out``."""
        total = sum(len(b) for b in buf)
        if total < CHUNK_ROWS and not (final and total):
            return buf
        r = Rows.concat(buf)
        n = len(r)
        pos = 0
        while n - pos >= CHUNK_ROWS or (final and pos < n):
            part = r.take(slice(pos, min(pos + CHUNK_ROWS, n)))
            payload, lo, hi = encode_obs(part, site, seg, self.codec)
            out.append((payload, site, seg, len(part), lo, hi))
            pos += len(part)
        return [r.take(slice(pos, n))] if pos < n else []

    def _writing_failed(self, e: OSError, out_dir: str, tmp: str) -> bool:
        """Whether ``e`` came from writing the output (its temporary file, the spool folder beside it, the rename,
        or a full or read-only file system), not from reading an input."""
        names = {str(n) for n in (e.filename, e.filename2) if n is not None}
        ours = {tmp, self.output, out_dir}
        return (bool(names & ours) or any(os.path.basename(n).startswith(".trainhist-") for n in names)
                or e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG))

    def _output_error(self, e: OSError, tmp: str) -> MergeError:
        """``e`` in the output's terms: the temporary file is an implementation detail the user never named."""
        return MergeError(f"cannot write the output: {e.strerror or e} (the output is written to {tmp} beside it and "
                          "renamed over it when complete; nothing was left there). Write to a folder with room "
                          "that you may write to", code="output_unwritable", path=self.output)

    def run(self) -> MergeReport:
        t0 = time.perf_counter()
        self._open_sources()
        try:
            return self._run(t0)
        except (MergeError, FormatError) as e:
            if isinstance(e, FormatError) or e.code not in _NOT_ABOUT_INPUTS:
                self._refuse_as_reader(e)
            raise

    def _refuse_as_reader(self, e: TrainhistError) -> None:
        """Spec 11, validation order: an input that a full check refuses is refused with that check's error, before
        any rule of merge. Merge checks each chunk as it reads it, so a merge that succeeds has checked every input
        in full, reading each once; but it applies its own rules (segments, sites, overflow, replicas, ...) as it
        goes, and builds the output sites in key order where a full check takes an input's sites in id order. So
        before ``e`` (a refusal of merge's own, or a chunk error found out of section 8's order) is raised, the
        inputs are checked in full (the one ``e`` names, for a reader's error; else each, in input order) and the
        first error of that check is raised instead. Only a refused merge reads an input twice."""
        named = [s.path for s in self.sources if s.path == e.path] if isinstance(e, FormatError) else []
        for path in dict.fromkeys(named or [s.path for s in self.sources]):  # (an input given twice: checked once)
            h = History(path)
            try:
                h.verify()
            finally:
                h.close()

    def _run(self, t0: float) -> MergeReport:
        self._check_writers()
        self._plan_sites()
        self._plan_segments()
        self.site_scale: dict[int, int] = {}
        self.scale_file: dict[int, str] = {}
        self.input_scale: dict[tuple[int, int], int] = {}  # (input, its site) -> the scale its chunks declare
        out_dir = os.path.dirname(os.path.abspath(self.output))
        tmp = os.path.join(out_dir, f".{os.path.basename(self.output)}.{os.getpid()}.tmp")
        try:
            w = CanonicalWriter(tmp, canonical_salt(self.leaf_writers))
        except OSError as e:
            self.pool.close()
            raise self._output_error(e, tmp) from e
        try:
            self._write(w)
            w.close()
            os.replace(tmp, self.output)
        except BaseException as e:
            w.abort()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(e, OSError) and self._writing_failed(e, out_dir, tmp):
                raise self._output_error(e, tmp) from e
            raise
        finally:
            self.pool.close()
        self.report.bytes_out = os.path.getsize(self.output)
        self.report.seconds = time.perf_counter() - t0
        return self.report

    def _write(self, w: CanonicalWriter) -> None:
        for d in _once_sorted([d for s in self.sources for d in s.runs], "run_id"):
            w.manifest(d)
        for d in _once_sorted([d for s in self.sources for d in s.writers], "writer_id"):
            w.manifest(d)
        settings = sorted((d for s in self.sources for d in s.settings), key=lambda d: (d["writer_id"], _json(d)))
        for d in settings:
            w.manifest(d)
        for d in self.site_docs:
            w.manifest(d)
        for d in self.segment_docs:
            w.manifest(d)
        w.commit()
        # obs: site by site (sites are independent: with workers, each site is built in a worker process and its
        # records are written here in site order, so the bytes do not depend on the number of workers)
        sites = range(len(self.site_keys))
        n = min(self._n_workers(), len(sites))  # (no more workers than sites: an idle worker costs a fork)
        if n > 1:
            self.report.workers = n
            global _ENGINE
            _ENGINE = self
            self._spool_fds: dict[str, int] = {}
            # the workers' spool files: in a private folder beside the output (same file system; short names)
            spools = tempfile.mkdtemp(prefix=".trainhist-", dir=os.path.dirname(os.path.abspath(w.path)))
            try:
                synced = w.bytes_written
                results = _in_workers(n, _worker_site, sites, _worker_init, (spools,))
                try:
                    for res in results:
                        if res is _UNCARRIED:
                            raise MergeError("a worker process could not send a site's result back; merge with "
                                             "workers=1", code="worker_failed")
                        res = _unwrap(res)
                        self.report.rows_in += res["rows_in"]
                        room = MAX_DIVERGENCES - len(self.report.divergences)
                        self.report.divergences.extend(res["divergences"][:max(room, 0)])
                        self.report.divergences_total += res["divergences_total"]
                        self.report.span_overlaps.extend(res["span_overlaps"])
                        self._write_site(w, res)
                        if w.bytes_written - synced >= SYNC_BYTES:  # while the workers build the next sites
                            w.sync_data()
                            synced = w.bytes_written
                finally:
                    results.close()  # stops the workers, also when the parent raises
            finally:
                _ENGINE = None
                for fd in self._spool_fds.values():
                    with contextlib.suppress(OSError):
                        os.close(fd)
                shutil.rmtree(spools, ignore_errors=True)  # never hides the error being raised
        else:
            for out_site in sites:
                self._write_site(w, self._site(out_site))
        self._check_ignored()
        # step truth, segment by segment
        per_seg = {}
        for s in self.sources:
            for e in s.steps:
                seg = self.seg_map[(s.idx, e.segment)]
                per_seg.setdefault(seg, []).append((self._window(e.step_min), self._window(e.step_max), s.idx, s, e))
        for seg in sorted(per_seg):
            buf_s: list[StepRows] = []
            where = f"step truth of segment {seg}"
            for batch in self._sweep(per_seg[seg]):
                parts = []
                for s, e in batch:
                    parts.append(decode_steps(self._payload(s, e), path=s.path, offset=e.offset, segment=e.segment,
                                              rows=e.rows, step_min=e.step_min, step_max=e.step_max))
                    self.report.step_rows_in += e.rows
                files = ", ".join(sorted({s.path for s, _ in batch}))
                buf_s.append(self._combine_steps(StepRows.concat(parts), where, files))
            r = StepRows.concat(buf_s) if buf_s else None
            if r is not None and len(r):
                if self.N == 1:
                    self._note_step_spans(r, where)
                for p in range(0, len(r), CHUNK_ROWS):
                    part = r.take(slice(p, p + CHUNK_ROWS))
                    payload, lo, hi = encode_steps(part, seg, self.codec)
                    w.steps(payload, seg, len(part), lo, hi)
                    self.report.step_rows_out += len(part)
        w.commit()
        self._note_spans()

    def _note_step_spans(self, r: StepRows, where: str) -> None:
        """Report the first step-truth rows of one segment (``r``: in step order) that cover the same steps under
        different spans (an input coarsened, another not): they do not combine (spec 11.6)."""
        st, sp = r.cols["step"], r.cols["span"].astype(np.uint64)
        if len(st) < 2 or not (sp != 1).any():
            return
        over = (st[1:].view(np.uint64) - st[:-1].view(np.uint64)) < sp[:-1]
        if over.any():
            i = int(np.flatnonzero(over)[0])
            self.report.span_overlaps.append({"where": where, "rows": [[int(st[i]), int(sp[i])],
                                                                       [int(st[i + 1]), int(sp[i + 1])]],
                                              "file": None})

    def _note_spans(self) -> None:
        """A note on rows of different spans over the same steps (``span_overlaps``), when there are any."""
        found = self.report.span_overlaps
        if not found:
            return
        (a, n), (b, m) = found[0]["rows"]
        sites = sum(not x["where"].startswith("step truth") for x in found)
        steps = len(found) - sites
        where = " and ".join(x for x in (f"{sites} site/segment pair{'' if sites == 1 else 's'}" if sites else "",
                                         f"the step truth of {steps} segment{'' if steps == 1 else 's'}"
                                         if steps else "") if x)
        self.report.notes.append(
            f"rows of different spans cover the same steps in {where} (first: {found[0]['where']}, a row at step {a} "
            f"spanning {n} and one at step {b} spanning {m}): an input was coarsened to windows and another was not "
            "(or to other windows). Such rows do not combine (spec 11.1, 11.6): those steps' observations are split "
            "between a window and the rows inside it, each holding its own inputs' alone; coarsen every input to "
            "one window first to combine them")


# -- worker processes ----------------------------------------------------------------------------------------
_ENGINE: "_Engine | None" = None  # the engine a forked worker inherits
_UNCARRIED = object()  # a worker's result that could not come back (pickling it failed)


def _in_workers(n: int, fn: Callable[[Any], tuple], items: Iterable[Any],
                initializer: Callable[..., None] | None = None, initargs: tuple = ()) -> Iterator[Any]:
    """``fn`` over ``items`` in ``n`` forked worker processes, results in input order; ``_UNCARRIED`` for a result
    that could not be sent back. A worker that dies (killed, out of memory) raises ``MergeError`` (``worker_lost``)
    instead of waiting for it forever; closing the generator early cancels the sites not started and waits only
    for those running."""
    ex = ProcessPoolExecutor(n, mp_context=mp.get_context("fork"), initializer=initializer, initargs=initargs)
    try:
        futures = [ex.submit(fn, item) for item in items]
        for fut in futures:
            try:
                yield fut.result()
            except BrokenProcessPool as e:
                raise MergeError(f"a worker process ended without finishing its work ({e}); the machine may be "
                                 "out of memory: merge with fewer workers (workers=1 uses none)",
                                 code="worker_lost") from None
            except (RecursionError, pickle.PicklingError):
                yield _UNCARRIED
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


_SPOOL: dict = {}  # a worker's spool: the folder, and once opened the file of the encoded payloads of its sites


def _worker_init(spools: str) -> None:
    """Set up a worker. Nothing here may raise: multiprocessing replaces a worker whose initializer fails, forever."""
    assert _ENGINE is not None
    _ENGINE.pool = _Pool(_pool_cap())  # descriptors of its own (pread needs no shared offset, but keep them apart)
    _ENGINE.report.divergences = []
    _ENGINE.report.divergences_total = 0
    _ENGINE.report.span_overlaps = []
    _SPOOL.clear()
    _SPOOL["dir"] = spools


def _spool_file() -> Any:
    """This worker's spool file, created on first use (its errors reach the merging process with the site)."""
    if "file" not in _SPOOL:
        path = os.path.join(_SPOOL["dir"], f"{os.getpid()}.spool")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        _SPOOL["file"], _SPOOL["path"] = os.fdopen(fd, "wb"), path
    return _SPOOL["file"]


def _worker_site(out_site: int) -> tuple:
    """Build one site in a worker; a trainhist error comes back as data and is raised again in the parent. The
    records' payloads go to the worker's spool file (with their CRC32C), from which the parent copies them into
    the output in the kernel: through the result pipe they would be copied and pickled several times."""
    assert _ENGINE is not None
    try:
        res = _ENGINE._site(out_site)
    except TrainhistError as e:
        return _error_data(e)
    f = _spool_file()
    records = []
    for payload, site, seg, rows, lo, hi in res["records"]:
        records.append((f.tell(), len(payload), crc32c(payload), site, seg, rows, lo, hi))
        f.write(payload)
    f.flush()
    res["records"], res["spool"] = records, _SPOOL["path"]
    return ("ok", res)


def _worker_source(item: tuple[int, str]) -> tuple:
    """Open input ``(index, path)`` in a worker (:meth:`_Engine._open_sources`); any error comes back as data, raised
    again in order."""
    idx, path = item
    try:
        return ("ok", _Source(idx, path))
    except TrainhistError as e:
        return _error_data(e)
    except Exception as e:  # noqa: BLE001 - raised again in the parent, as the serial scan would
        return ("raise", e)


def _input_bytes(paths: list[str]) -> int:
    """The total size of the inputs before they are opened (0 when one cannot be read: the serial scan says why)."""
    try:
        return sum(os.path.getsize(p) for p in paths)
    except OSError:
        return 0


def _error_data(e: TrainhistError) -> tuple:
    """A trainhist error as picklable data (its class may not survive pickling), rebuilt by :func:`_unwrap`."""
    return ("error", type(e).__name__, e.message, e.code, e.path, e.offset)


def _unwrap(res: tuple) -> Any:
    if res[0] == "ok":
        return res[1]
    if res[0] == "raise":
        raise res[1]
    _, cls, message, code, path, offset = res
    raise getattr(errors, cls)(message, code=code, path=path, offset=offset)


def _once_sorted(docs: list[dict], id_key: str) -> list[dict]:
    """Manifests as a derived file carries them (spec 11.8): identical ones (same canonical text) kept once, sorted
    by ``id_key`` then canonical text."""
    kept = {(d[id_key], _json(d)): d for d in docs}
    return [kept[k] for k in sorted(kept)]


def _json(d: dict) -> str:
    from .canonical import manifest_bytes

    return manifest_bytes(d).decode("ascii")


def merge(inputs: list[str | os.PathLike], output: str | os.PathLike, *, across_runs: bool = False,
          replica_divergence: str = "error", codec: str = "packed", workers: int | None = None) -> MergeReport:
    """Merge histories of disjoint sets of writers into one canonical file at ``output`` (spec section 11).

    Rows with the same site, segment, step, span, micro-batch and phase combine: shard sites add exactly,
    replica sites keep one row (differing replicas raise ``replica_divergence``, or with
    ``replica_divergence="report"`` keep a deterministic one and list the difference in the report). Segments of
    different runs stay apart unless ``across_runs``. ``codec`` (spec 11.9) is ``"packed"`` (default),
    ``"shuffle"`` (shuffle-deflate: smaller, slower) or ``"raw"``. Sites are built in ``workers`` processes
    (forked; ``None``: one per CPU, up to ``MAX_WORKERS``, for inputs of at least ``AUTO_WORKERS_BYTES``, else
    in this process); the output bytes do not depend on it. No inputs give the empty history (a file header
    alone), the identity of merge: merging it with any inputs gives what they give alone.
    """
    if isinstance(inputs, (str, os.PathLike)):
        raise UsageError("merge() takes a list of input paths")
    inputs = list(inputs)
    if not isinstance(across_runs, bool):
        raise UsageError(f"across_runs must be True or False, got {across_runs!r}", code="bad_argument")
    return _Engine(inputs, output, steps=1, scale=None, across_runs=across_runs,
                   replica_divergence=replica_divergence, codec=codec, workers=workers).run()


def canonicalize(input: str | os.PathLike, output: str | os.PathLike, *, codec: str = "packed") -> MergeReport:
    """The canonical form of one file: the same as ``merge([input], output)``."""
    return merge([input], output, codec=codec)
