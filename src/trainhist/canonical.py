"""Canonical low-level I/O for derived files (spec section 11): row batches as numpy columns, their decoding
from a source chunk and their encoding into a canonical chunk, and a writer that lays records out canonically.

A :class:`Rows` batch holds every field of an obs row: the exact sums as :class:`~trainhist.exactvec.ExactCol`
limb arrays, the sketch either as the stored ranges (:class:`Sparse`, as decoded) or as dense ``(rows, bins)``
count arrays, and the per-presence tally of leaf rows (``TALLY_COLUMNS``). Rows whose tally has no ``observed``
leaf carry no numbers: they are zeroed on decode, so every numeric field combines with them as with an identity.
Chunks are read one by one (:func:`read_obs`) and checked and decoded many at a time (:func:`decode_obs_batch`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .batchdecode import missing_obs_columns
from .chunk import Codec, decode_chunk, encode_chunk
from .exactvec import ExactCol, decode_exact, encode_exact
from .errors import CorruptError, UnsupportedError, truncation_hint
from .framing import (
    FILE_HEADER_SIZE,
    READ_VERSION,
    WRITE_VERSION,
    FileHeader,
    RecordHeader,
    RecordType,
    crc32c,
    pack_commit,
    pad8,
)
from .grid import nbins
from .summary import SumMethod
from .model import (
    CANONICAL_NAN,
    PRIORITY,
    derive_presence,
    legacy_skipped,
    tally_disagrees,
    row_problem,
    sketch_problem,
    unknown_steps_code,
    EXACT_COLUMNS,
    OBS_COLUMNS,
    SKETCH_COLUMNS,
    STEPS_COLUMNS,
    STEPS_OPTIONAL_COLUMNS,
    TALLY_COLUMNS,
    Phase,
    Presence,
)

__all__ = [
    "CHUNK_ROWS",
    "PRIORITY",
    "Rows",
    "StepRows",
    "decode_obs",
    "decode_steps",
    "encode_obs",
    "encode_steps",
    "derive_presence",
    "blank",
    "canonical_salt",
    "CanonicalWriter",
]

CHUNK_ROWS = 4096  #: rows per obs/steps chunk of a canonical file (the last chunk of a site-segment may be shorter)
NO_ID = 0xFFFFFFFF
_OBS_KNOWN = {**OBS_COLUMNS, **EXACT_COLUMNS, **SKETCH_COLUMNS, **TALLY_COLUMNS}
_OBS_VARIABLE = frozenset({"sum_x", "sumsq_x", "sk_counts"})
_STEPS_KNOWN = {**STEPS_COLUMNS, **STEPS_OPTIONAL_COLUMNS}
_TALLY_NAMES = list(TALLY_COLUMNS)
_COUNT_NAMES = ("count", "nan", "pinf", "ninf", "zero")

_IOTA = {np.dtype(np.int32): np.arange(1 << 16, dtype=np.int32), np.dtype(np.int64): np.arange(1 << 16)}


def ranges(base: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Flat indices ``base[i] + j`` for ``j < n[i]``, given ``base`` already less the starts ``cumsum(n) - n``
    (int32 when every index fits, which halves the memory traffic)."""
    total = int(n.sum())
    dt = np.dtype(np.int32) if total < (1 << 31) and (base.size == 0 or (int(base.max()) + total < (1 << 31)
                                                                        and int(base.min()) >= -(1 << 31))) \
        else np.dtype(np.int64)
    idx = np.repeat(base.astype(dt), n)
    iota = _IOTA[dt]
    if idx.size > iota.size:
        iota = _IOTA[dt] = np.arange(max(idx.size, 2 * iota.size), dtype=dt)
    idx += iota[: idx.size]
    return idx


@dataclass
class Sparse:
    """Stored sketch ranges of a batch of rows, as in the chunk: per row and sign (pos, neg) the first bin and
    the number of bins, and every range's counts concatenated in that order."""

    lo: np.ndarray  # (rows, 2) int64
    n: np.ndarray  # (rows, 2) int64
    counts: np.ndarray  # uint64
    cmax: int  # no count exceeds it (0 when there are none)

    def _first(self) -> np.ndarray:
        """Where each range's counts begin in ``counts``, (rows, 2)."""
        nf = self.n.ravel()
        return (np.cumsum(nf) - nf).reshape(self.n.shape)

    def dense(self, nb: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self.lo.shape[0]
        d = np.zeros(2 * rows * nb, np.uint64)
        if self.counts.size:
            n = self.n.ravel()
            base = np.arange(2 * rows, dtype=np.int64) * nb + self.lo.ravel() - (np.cumsum(n) - n)
            d[ranges(base, n)] = self.counts
        d = d.reshape(rows, 2, nb)
        return d[:, 0, :], d[:, 1, :]

    def take(self, idx: np.ndarray | slice) -> Sparse:
        """The rows ``idx`` (a slice of consecutive rows, or row indices)."""
        if isinstance(idx, slice):
            a, b, step = idx.indices(self.lo.shape[0])
            assert step == 1, "a slice of consecutive rows"
            c = np.cumsum(self.n.sum(axis=1))
            c0 = int(c[a - 1]) if a > 0 else 0
            c1 = int(c[b - 1]) if b > a else c0
            return Sparse(self.lo[a:b], self.n[a:b], self.counts[c0:c1], self.cmax)
        n = self.n[idx]
        nf = n.ravel()
        first = self._first()[idx].ravel()
        return Sparse(self.lo[idx], n, self.counts[ranges(first - (np.cumsum(nf) - nf), nf)], self.cmax)

    def canonical(self) -> Sparse:
        """The ranges as a canonical chunk stores them: each cut to its first and last non-zero count, and an
        empty or all-zero range empty at first bin 0 (spec 11.9: ``lo = n = 0``)."""
        nf = self.n.ravel()
        first = np.cumsum(nf) - nf
        some = nf > 0
        c = self.counts
        if (c[first[some]] != 0).all() and (c[(first + nf - 1)[some]] != 0).all() and \
                (self.lo.ravel()[~some] == 0).all():  # (an empty range may start anywhere in a chunk read)
            return self
        nz = np.flatnonzero(c)
        seg = np.repeat(np.arange(nf.size), nf)[nz]  # the range of each non-zero count (non-decreasing)
        kept, at = np.unique(seg, return_index=True)
        lo_nz = nz[at]  # first non-zero of each kept range, as a position in counts
        hi_nz = nz[np.append(at[1:], nz.size) - 1] if at.size else nz  # its last non-zero (none: every count is 0)
        n = np.zeros(nf.size, np.int64)
        lo = np.zeros(nf.size, np.int64)
        n[kept] = hi_nz - lo_nz + 1
        lo[kept] = self.lo.ravel()[kept] + lo_nz - first[kept]
        nk = n[kept]
        counts = c[ranges(lo_nz - (np.cumsum(nk) - nk), nk)]
        return Sparse(lo.reshape(self.lo.shape), n.reshape(self.n.shape), counts, self.cmax)


@dataclass
class Rows:
    """A batch of obs rows of one site as columns (see the module docstring)."""

    cols: dict[str, np.ndarray]  # OBS_COLUMNS names (presence derived from tally), plus "src" (int32 input index)
    sum_x: ExactCol  # the exact value of every row's sum
    sumsq_x: ExactCol
    tally: np.ndarray  # (rows, 6) uint64
    has_sk: np.ndarray  # bool
    pos: np.ndarray | None  # (rows, nbins) uint64, None when no row has a sketch (or the sketch is sparse)
    neg: np.ndarray | None
    bands: np.ndarray | None  # (rows, 4): under_pos, under_neg, over_pos, over_neg
    scale: int | None
    sparse: Sparse | None = None  # the sketch as stored ranges, instead of pos/neg (decoded batches)
    #: per row, whether halving its sketch's resolution overflowed a bin's u64 count (its bins are then wrong): a
    #: merge refuses such a row only where the combined row keeps its numbers (spec 11.2); None: no row did
    over: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.cols["step"].size)

    def densify(self) -> "Rows":
        if self.sparse is not None:
            self.pos, self.neg = self.sparse.dense(nbins(self.scale))
            self.sparse = None
        return self

    def take(self, idx: np.ndarray | slice) -> "Rows":
        """The rows ``idx`` (a slice of consecutive rows, or row indices); a sparse sketch stays sparse."""
        return Rows(
            {k: v[idx] for k, v in self.cols.items()}, self.sum_x.take(idx), self.sumsq_x.take(idx),
            self.tally[idx], self.has_sk[idx], None if self.pos is None else self.pos[idx],
            None if self.neg is None else self.neg[idx], None if self.bands is None else self.bands[idx],
            self.scale, None if self.sparse is None else self.sparse.take(idx),
            None if self.over is None else self.over[idx],
        )

    @staticmethod
    def concat(parts: list["Rows"]) -> "Rows":
        parts = [p for p in parts if len(p)]
        if len(parts) == 1:
            return parts[0]
        scales = {p.scale for p in parts if p.pos is not None or p.sparse is not None}
        scale = scales.pop() if scales else None
        assert not scales, "callers check the sketch scale before concatenating"
        cols = {k: np.concatenate([p.cols[k] for p in parts]) for k in parts[0].cols}
        pos = neg = bands = sparse = None
        if scale is not None:
            bands = np.concatenate([p.bands if p.bands is not None else np.zeros((len(p), 4), np.uint64)
                                    for p in parts])
            if all(p.pos is None for p in parts):  # sparse or no sketch: stay sparse
                z = np.zeros((0,), np.uint64)
                sp = [p.sparse if p.sparse is not None else
                      Sparse(np.zeros((len(p), 2), np.int64), np.zeros((len(p), 2), np.int64), z, 0) for p in parts]
                sparse = Sparse(np.concatenate([q.lo for q in sp]), np.concatenate([q.n for q in sp]),
                                np.concatenate([q.counts for q in sp]), max(q.cmax for q in sp))
            else:
                nb = nbins(scale)
                for p in parts:
                    p.densify()

                def dense(p: Rows, a: np.ndarray | None) -> np.ndarray:
                    return a if a is not None else np.zeros((len(p), nb), np.uint64)

                pos = np.concatenate([dense(p, p.pos) for p in parts])
                neg = np.concatenate([dense(p, p.neg) for p in parts])
        over = None
        if any(p.over is not None for p in parts):
            over = np.concatenate([p.over if p.over is not None else np.zeros(len(p), bool) for p in parts])
        return Rows(
            cols, ExactCol.concat([p.sum_x for p in parts]), ExactCol.concat([p.sumsq_x for p in parts]),
            np.concatenate([p.tally for p in parts]), np.concatenate([p.has_sk for p in parts]), pos, neg, bands,
            scale, sparse, over,
        )


@dataclass
class StepRows:
    """A batch of step-truth rows as columns (STEPS_COLUMNS plus ``span`` and ``n_rows``)."""

    cols: dict[str, np.ndarray]

    def __len__(self) -> int:
        return int(self.cols["step"].size)

    def take(self, idx: np.ndarray | slice) -> "StepRows":
        return StepRows({k: v[idx] for k, v in self.cols.items()})

    @staticmethod
    def concat(parts: list["StepRows"]) -> "StepRows":
        parts = [p for p in parts if len(p)]
        if len(parts) == 1:
            return parts[0]
        return StepRows({k: np.concatenate([p.cols[k] for p in parts]) for k in parts[0].cols})


# -- decoding ------------------------------------------------------------------------------------------------
def _bad(msg: str, path: str, offset: int, code: str = "bad_chunk") -> CorruptError:
    return CorruptError(msg, code=code, path=path, offset=offset)


def check_payload(payload: bytes, crc: int, path: str, offset: int) -> memoryview:
    if crc32c(payload) != crc:
        raise _bad("payload CRC32C mismatch in a committed chunk" + truncation_hint(offset), path, offset,
                   "bad_payload_crc")
    return memoryview(payload)


def blank(r: Rows, mask: np.ndarray) -> None:
    """Clear the numbers of the rows in ``mask`` (rows that are not observed carry none, spec 2.6)."""
    if not mask.any():
        return
    cols = r.cols
    for k in _COUNT_NAMES:
        cols[k][mask] = 0
    for k in ("min", "max"):
        cols[k][mask] = CANONICAL_NAN
    for k in ("sum", "sumsq"):
        cols[k][mask] = 0.0
    cols["method"][mask] = 0
    r.sum_x.blank(mask)
    r.sumsq_x.blank(mask)
    r.has_sk[mask] = False
    if r.sparse is not None:  # zero the stored counts of those rows (the ranges stay)
        sp = r.sparse
        sp.counts = sp.counts.copy()
        sp.counts[np.repeat(np.repeat(mask, 2), sp.n.ravel())] = 0
        r.bands[mask] = 0
    if r.pos is not None:
        r.pos[mask] = 0
        r.neg[mask] = 0
        r.bands[mask] = 0


def unknown_sums(r: Rows, mask: np.ndarray) -> None:
    """Zero the sums of the rows in ``mask``, whose sums are unknown (method ``unknown``, spec 5.4: read as zero, and
    a combined row whose method is unknown stores zero sums, 11.2)."""
    if mask.any():
        for k in ("sum", "sumsq"):
            r.cols[k][mask] = 0.0
        r.sum_x.blank(mask)
        r.sumsq_x.blank(mask)


@dataclass
class ObsChunk:
    """The columns of one committed obs chunk, checked as far as the chunk alone allows (:func:`read_obs`);
    :func:`decode_obs_batch` checks and decodes many of them together."""

    path: str
    offset: int
    rows: int
    step_min: int
    step_max: int
    src: int
    cols: dict[str, np.ndarray]
    tally: list[np.ndarray] | None
    exact: dict[str, tuple[np.ndarray, np.ndarray] | None]
    sk: dict[str, np.ndarray] | None
    counts: np.ndarray | None
    scale: int | None


def read_obs(payload: memoryview, *, path: str, offset: int, site: int, segment: int, rows: int, step_min: int,
             step_max: int, src: int) -> ObsChunk:
    """Parse one committed obs chunk (``offset``: file offset of its record header) and check its directory."""
    ch = decode_chunk(payload, offset, path, _OBS_KNOWN, _OBS_VARIABLE)
    m = ch.meta
    if m.get("rows") != rows or m.get("segment") != segment or m.get("site") != site:
        raise _bad(f"chunk directory (site {m.get('site')}, segment {m.get('segment')}, rows {m.get('rows')}) "
                   "disagrees with its commit entry", path, offset)
    missing = missing_obs_columns(ch)  # (as the reader checks them: required, and optional groups all or none)
    if missing:
        raise _bad(f"chunk lacks required columns {missing}", path, offset, "missing_column")
    cols = {name: ch.column(name, rows) for name in OBS_COLUMNS}
    tnames = [n for n in _TALLY_NAMES if ch.has(n)]
    tally = None
    if tnames:
        if len(tnames) != len(_TALLY_NAMES):
            raise _bad(f"chunk has tally columns {tnames} but not all of {_TALLY_NAMES}", path, offset,
                       "bad_tally")
        tally = [ch.column(n, rows) for n in _TALLY_NAMES]
    exact: dict[str, tuple[np.ndarray, np.ndarray] | None] = {}
    for name in ("sum", "sumsq"):
        exact[name] = None
        if ch.has(name + "_xn"):
            lens = ch.column(name + "_xn", rows)
            size = ch.raw_size(name + "_x")  # (checked against the lengths before it is decoded)
            if int(lens.sum(dtype=np.uint64)) != size:
                raise _bad(f"{name}_x holds {size} bytes, {name}_xn sums to {int(lens.sum(dtype=np.uint64))}", path,
                           offset, "bad_column_length")
            exact[name] = (lens, ch.column(name + "_x"))
    sk = counts = scale = None
    if ch.has("sk"):
        scale = m.get("scale")
        sk = {k: ch.column(k, rows) for k in SKETCH_COLUMNS if k != "sk_counts"}
        problem = sketch_problem(scale, sk, ch.raw_size("sk_counts") // 8)
        if problem is not None:
            raise _bad(problem[0], path, offset, problem[1])
        counts = ch.column("sk_counts")
    return ObsChunk(path, offset, rows, step_min, step_max, src, cols, tally, exact, sk, counts, scale)


def decode_obs(payload: memoryview, *, path: str, offset: int, site: int, segment: int, rows: int, step_min: int,
               step_max: int, src: int) -> Rows:
    """Validate and decode one committed obs chunk (``offset``: file offset of its record header)."""
    return decode_obs_batch([read_obs(payload, path=path, offset=offset, site=site, segment=segment, rows=rows,
                                      step_min=step_min, step_max=step_max, src=src)])


def decode_obs_batch(parts: list[ObsChunk]) -> Rows:
    """Check and decode chunks of one site that share a sketch scale (or have none) into one batch of rows.

    Every check runs on the whole batch at once; a failure names the chunk (its record's offset) and the row in
    it, as the per-chunk check would."""
    scales = {p.scale for p in parts if p.scale is not None}
    assert len(scales) <= 1, "callers group chunks by sketch scale"
    scale = scales.pop() if scales else None
    one = len(parts) == 1
    cols = {k: (parts[0].cols[k].copy() if one else np.concatenate([p.cols[k] for p in parts]))
            for k in OBS_COLUMNS}
    tally = None
    if any(p.tally is not None for p in parts):
        tally = np.zeros((sum(p.rows for p in parts), len(_TALLY_NAMES)), np.uint64)
        r0 = 0
        for p in parts:
            if p.tally is not None:
                tally[r0:r0 + p.rows] = np.stack(p.tally, axis=1)
            r0 += p.rows
    explicit = np.array([p.tally is not None for p in parts])
    exact = {}
    for name in ("sum", "sumsq"):
        if any(p.exact[name] is not None for p in parts):
            lens = np.concatenate([p.exact[name][0] if p.exact[name] is not None else np.zeros(p.rows, np.uint32)
                                   for p in parts])
            blobs = [p.exact[name][1] for p in parts if p.exact[name] is not None]
            blob = blobs[0] if len(blobs) == 1 else np.concatenate(blobs)
            lsum = [int(p.exact[name][0].sum(dtype=np.uint64)) if p.exact[name] is not None else 0 for p in parts]
            bsize = [p.exact[name][1].size if p.exact[name] is not None else 0 for p in parts]
            exact[name] = (lens, blob, lsum, bsize)
        else:
            exact[name] = None
    sk = counts = None
    if scale is not None:
        sk = {}
        for k, dt in SKETCH_COLUMNS.items():
            if k != "sk_counts":
                sk[k] = parts[0].sk[k] if one else np.concatenate(
                    [p.sk[k] if p.sk is not None else np.zeros(p.rows, dt) for p in parts])
        cl = [p.counts for p in parts if p.counts is not None and p.counts.size]
        counts = cl[0] if len(cl) == 1 else (np.concatenate(cl) if cl else np.zeros(0, np.uint64))
    csize = [0 if p.counts is None else p.counts.size for p in parts]
    return decode_obs_columns(parts, cols, tally, explicit, exact, sk, counts, csize, scale)


def _refuse_tiny_sums(name: str, x: ExactCol, stored: np.ndarray, cols: dict[str, np.ndarray], observed: np.ndarray,
                      locate: Callable[[int], tuple[str, int, int]]) -> None:
    """Refuse (``bad_row``, as a reader does) a row that is not observed, or has no finite value, but whose exact
    form (``stored``: the rows that have one) names a non-zero sum: spec 5.5, rules 3 and 4 (the f64 column of such
    a row is ±0.0, which :func:`~trainhist.model.row_problem` took, but its exact form may hold a value too small
    for binary64). A merge that let it through would write a file that readers refuse."""
    finite = cols["count"] - cols["nan"] - cols["pinf"] - cols["ninf"]  # (no wrap: row_problem checked the counts)
    none = stored & (~observed | (finite == 0))
    if not none.any():
        return
    for i in np.flatnonzero(none).tolist():  # (rows of a crafted file only: writers store no exact form there)
        d = x.get(i)
        if d.m:
            path, offset, j = locate(i)
            what = "that is not observed" if not observed[i] else "without finite values"
            raise CorruptError(f"row {j}: its exact {name} is {d.m}*2**{d.e}, not 0, in a row {what} (spec 5.5: "
                               "the sums of no value are 0)", code="bad_row", path=path, offset=offset)


def decode_obs_columns(parts: list[ObsChunk], cols: dict[str, np.ndarray], tally: np.ndarray | None,
                       explicit: np.ndarray, exact: dict[str, tuple | None], sk: dict[str, np.ndarray] | None,
                       counts: np.ndarray | None, csize: list[int], scale: int | None, cmax: int | None = None
                       ) -> Rows:
    """:func:`decode_obs_batch` on columns already decoded and concatenated over the chunks ``parts`` (whose
    ``path``, ``offset``, ``rows``, ``step_min``, ``step_max`` and ``src`` alone are read): ``cols`` the
    OBS_COLUMNS (writable, owned by the result), ``tally`` the (rows, 6) tally columns or None, ``explicit``
    which chunks have them, ``exact[name]`` None or (``_xn`` lengths with zeros where a chunk lacks them, the
    joined ``_x`` blobs, each chunk's sum of lengths, each chunk's blob size), ``sk`` the sketch columns (zeros
    where a chunk lacks them) and ``counts`` the joined ``sk_counts`` (``csize`` values per chunk) when ``scale``
    is not None; ``cmax`` a bound on those counts, if known (else their maximum is taken). Every check runs on
    the whole batch; a failure names the chunk and row as the per-chunk check would."""
    sizes = np.array([p.rows for p in parts], np.int64)
    row0 = np.cumsum(sizes) - sizes
    total = int(sizes.sum())

    def where(i: int) -> tuple[ObsChunk, int]:
        k = int(np.searchsorted(row0, i, side="right")) - 1
        return parts[k], i - int(row0[k])

    def fail(mask: np.ndarray, msg: str, code: str = "bad_chunk") -> CorruptError:
        p, i = where(int(np.flatnonzero(mask)[0]))
        return _bad(msg.format(row=i), p.path, p.offset, code)

    def locate(i: int) -> tuple[str, int, int]:
        p, j = where(i)
        return p.path, p.offset, j

    step = cols["step"]
    lo_s, hi_s = np.minimum.reduceat(step, row0), np.maximum.reduceat(step, row0)
    bad = (lo_s != [p.step_min for p in parts]) | (hi_s != [p.step_max for p in parts])
    if bad.any():
        p = parts[int(np.flatnonzero(bad)[0])]
        raise _bad("chunk steps disagree with the commit entry's step range", p.path, p.offset)
    unknown = (cols["phase"] >= len(Phase.NAMES)) | (cols["presence"] >= len(Presence.NAMES))
    if unknown.any():
        p, _ = where(int(np.flatnonzero(unknown)[0]))
        raise UnsupportedError("chunk uses phase or presence codes unknown to this reader", code="unknown_code",
                               path=p.path, offset=p.offset)
    if (cols["span"] == 0).any():
        raise fail(cols["span"] == 0, "obs row {row} has span 0 (a row covers at least one step)", "bad_span")
    if tally is None:
        tally = np.zeros((total, len(_TALLY_NAMES)), np.uint64)
    explicit = np.repeat(np.asarray(explicit, bool), sizes)
    implicit = ~explicit
    tally[np.flatnonzero(implicit), cols["presence"][implicit].astype(np.intp)] = 1
    presence = derive_presence(tally)
    if explicit.any():
        wrong = explicit & tally_disagrees(tally, cols["presence"])
        if wrong.any():
            raise fail(wrong, "presence column disagrees with the presence the tally columns imply", "bad_tally")
        old = explicit & legacy_skipped(tally, cols["presence"])
        if old.any():
            raise fail(old, "row {row} is skipped with observed inputs, derived under the precedence before "
                       "2026-11-30 (skipped above observed): it holds no numbers of those inputs, so it cannot be "
                       "combined; merge or coarsen its inputs again", "legacy_precedence")
    problem = row_problem({**cols, "sk": sk["sk"]} if sk is not None else cols)
    if problem is not None:
        p, i = where(problem[0])
        raise _bad(problem[1].format(row=i), p.path, p.offset, "bad_row")
    observed = presence == Presence.OBSERVED
    xcols = []
    for name in ("sum", "sumsq"):
        lens = blob = None
        if exact[name] is not None:
            lens, blob, lsum, bsize = exact[name]
            for p, ls, bs in zip(parts, lsum, bsize):  # each chunk's lengths must match its own blob
                if ls != bs:
                    raise _bad(f"{name}_x holds {bs} bytes, {name}_xn sums to {ls}", p.path, p.offset,
                               "bad_column_length")
        x = decode_exact(name, cols[name], lens, blob, observed, locate)
        if lens is not None:
            _refuse_tiny_sums(name, x, lens != 0, cols, observed, locate)
        xcols.append(x)
        c = cols[name]  # the value 0 is +0.0 whatever the sign stored (readers accept -0.0, spec 5.3, 5.5), its exact
        c[(c == 0) & x.is_zero()] = 0.0  # form (m = 0, e = 0) too; a tiny non-zero value keeps the zero of its sign
    has = np.zeros(total, bool)
    sparse = bands = None
    if scale is not None:
        nb = nbins(scale)

        skf = sk["sk"]
        if (skf > 1).any():
            raise fail(skf > 1, "sk column holds values other than 0 and 1", "bad_sketch")
        has = skf == 1
        plo, nlo = sk["sk_plo"], sk["sk_nlo"]
        pn, nn = sk["sk_pn"], sk["sk_nn"]
        stray = ~has & ((pn > 0) | (nn > 0))
        if stray.any():
            raise fail(stray, "a row without a sketch declares sketch bins", "bad_sketch")
        lo = np.stack([plo, nlo], axis=1).astype(np.int64)  # row-major: pos, neg
        lo[~has] = 0  # (spec 7.5: a row without a sketch has no ranges; what it stores there is ignored)
        n = np.stack([pn, nn], axis=1).astype(np.int64)
        per_chunk = np.add.reduceat(n.sum(axis=1), row0)
        csize = np.array(csize, np.int64)
        badr = (lo + n > nb).any(axis=1)
        badc = per_chunk != csize
        if badr.any() or badc.any():
            k = int(np.searchsorted(row0, int(np.flatnonzero(badr)[0]), side="right")) - 1 if badr.any() \
                else int(np.flatnonzero(badc)[0])
            p = parts[k]
            raise _bad(f"sketch ranges exceed {nb} bins or disagree with the {int(csize[k])} values of sk_counts",
                       p.path, p.offset, "bad_sketch")
        if cmax is None:
            cmax = int(counts.max()) if counts.size else 0
        sparse = Sparse(lo, n, counts, cmax)
        bands = np.stack([sk[k] for k in ("sk_up", "sk_un", "sk_op", "sk_on")], axis=1).astype(np.uint64)
        bands[~has] = 0  # (ignored, like the ranges: they must not add into a combined row's sketch)
    r = Rows(cols, xcols[0], xcols[1], tally, has, None, None, bands, scale, sparse)
    blank(r, ~observed)  # spec 2.6: only observed rows carry numbers
    unknown_sums(r, observed & (cols["method"] == SumMethod.UNKNOWN))  # spec 5.4: read as zero
    if r.sparse is not None and not r.has_sk.any():
        r.sparse = r.bands = None
        r.scale = None
    for k in ("min", "max"):  # every NaN is "no finite value": canonical bits
        c = cols[k]
        c[np.isnan(c)] = CANONICAL_NAN
    cols["presence"] = presence
    cols["src"] = np.repeat(np.array([p.src for p in parts], np.int32), sizes)
    return r


def decode_steps(payload: memoryview, *, path: str, offset: int, segment: int, rows: int, step_min: int,
                 step_max: int) -> StepRows:
    """Validate and decode one committed steps chunk."""
    ch = decode_chunk(payload, offset, path, _STEPS_KNOWN)
    m = ch.meta
    if m.get("rows") != rows or m.get("segment") != segment or m.get("site") is not None:
        raise _bad("steps chunk directory disagrees with its commit entry", path, offset)
    missing = [c for c in STEPS_COLUMNS if not ch.has(c)]
    if missing:
        raise _bad(f"chunk lacks required columns {missing}", path, offset, "missing_column")
    cols = {name: ch.column(name, rows).copy() for name in STEPS_COLUMNS}
    cols["span"] = ch.column("span", rows).copy() if ch.has("span") else np.ones(rows, np.uint32)
    cols["n_rows"] = ch.column("n_rows", rows).copy() if ch.has("n_rows") else np.ones(rows, np.uint64)
    if rows and (int(cols["step"].min()) != step_min or int(cols["step"].max()) != step_max):
        raise _bad("steps chunk steps disagree with the commit entry's step range", path, offset)
    if (cols["span"] == 0).any():
        raise _bad("steps row with span 0", path, offset, "bad_span")
    if (cols["n_rows"] == 0).any():
        raise _bad("steps row with n_rows 0 (a row combines at least one writer's row)", path, offset, "bad_tally")
    name = unknown_steps_code(cols)
    if name is not None:
        raise UnsupportedError(f"steps column {name} holds codes unknown to this reader", code="unknown_code",
                               path=path, offset=offset)
    for k in ("loss_scale", "clip_threshold"):
        c = cols[k]
        c[np.isnan(c)] = CANONICAL_NAN
    return StepRows(cols)


# -- encoding ------------------------------------------------------------------------------------------------
def encode_obs(r: Rows, site: int, segment: int, codec: int) -> tuple[bytes, int, int]:
    """Canonical chunk payload of a sorted batch of combined rows; returns payload, first and last step."""
    n = len(r)
    c = r.cols
    cols: dict[str, tuple[str, np.ndarray | bytes]] = {name: (dt, c[name]) for name, dt in OBS_COLUMNS.items()}
    for name, x in (("sum", r.sum_x), ("sumsq", r.sumsq_x)):
        e = encode_exact(x)
        if e is not None:
            cols[name + "_xn"] = ("u4", e[0])
            cols[name + "_x"] = ("bytes", e[1])
    meta: dict = {"site": site, "segment": segment, "rows": n}
    if (r.pos is not None or r.sparse is not None) and r.has_sk.any():
        if r.sparse is not None:
            sp = r.sparse.canonical()
            first, cnt, counts = sp.lo, sp.n, sp.counts
        else:
            nb = r.pos.shape[1]
            dense = np.stack([r.pos, r.neg], axis=1)  # (rows, 2, nb)
            nz = dense != 0
            anynz = nz.any(axis=2)
            first = np.where(anynz, nz.argmax(axis=2), 0)
            last = np.where(anynz, nb - 1 - nz[:, :, ::-1].argmax(axis=2), -1)
            cnt = np.where(anynz, last - first + 1, 0)
            cf = cnt.ravel()
            base = np.arange(2 * n, dtype=np.int64) * nb + first.ravel() - (np.cumsum(cf) - cf)
            counts = dense.reshape(-1)[ranges(base, cf)]
        cols["sk"] = ("u1", r.has_sk.astype(np.uint8))
        cols["sk_plo"], cols["sk_pn"] = ("u2", first[:, 0]), ("u2", cnt[:, 0])
        cols["sk_nlo"], cols["sk_nn"] = ("u2", first[:, 1]), ("u2", cnt[:, 1])
        for k, name in enumerate(("sk_up", "sk_un", "sk_op", "sk_on")):
            cols[name] = ("u8", r.bands[:, k])
        cols["sk_counts"] = ("u8", counts)
        meta["scale"] = r.scale
    implicit = np.zeros_like(r.tally)
    implicit[np.arange(n), c["presence"].astype(np.intp)] = 1
    if (r.tally != implicit).any():
        for k, name in enumerate(_TALLY_NAMES):
            cols[name] = ("u8", r.tally[:, k])
    step = c["step"]
    return encode_chunk(meta, cols, codec), int(step[0]), int(step[-1])


def encode_steps(r: StepRows, segment: int, codec: int) -> tuple[bytes, int, int]:
    cols = {name: (dt, r.cols[name]) for name, dt in STEPS_COLUMNS.items()}
    if (r.cols["span"] != 1).any():
        cols["span"] = ("u4", r.cols["span"])
    if (r.cols["n_rows"] != 1).any():
        cols["n_rows"] = ("u8", r.cols["n_rows"])
    step = r.cols["step"]
    return encode_chunk({"segment": segment, "rows": len(r)}, cols, codec), int(step[0]), int(step[-1])


# -- the file ------------------------------------------------------------------------------------------------
def canonical_salt(leaf_writers: list[str] | set[str]) -> int:
    """File salt of a canonical file: the first 8 bytes (little-endian) of SHA-256 over the sorted leaf writer ids."""
    text = "trainhist-canonical-salt/1\n" + "".join(w + "\n" for w in sorted(leaf_writers))
    return int.from_bytes(hashlib.sha256(text.encode("ascii")).digest()[:8], "little")


def manifest_bytes(doc: dict) -> bytes:
    """The one JSON serialisation of a manifest: sorted keys, no white space, ASCII."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


class CanonicalWriter:
    """Append records in the order a canonical file needs; commit when told."""

    def __init__(self, path: str, salt: int) -> None:
        self.path = path
        self._f = open(path, "wb")
        self._salt = salt
        self._seq = 0
        self._entries: list[tuple] = []
        self._f.write(FileHeader(READ_VERSION, WRITE_VERSION, 0, 0, salt).pack())
        self._offset = FILE_HEADER_SIZE

    def _record(self, rtype: int, payload: bytes, site: int = NO_ID, segment: int = NO_ID, rows: int = 0,
                lo: int = 0, hi: int = 0) -> None:
        self._framed(rtype, len(payload), crc32c(payload), lambda: self._f.write(payload), site, segment, rows,
                     lo, hi)

    def _framed(self, rtype: int, length: int, crc: int, write_payload: Callable[[], object], site: int = NO_ID,
                segment: int = NO_ID, rows: int = 0, lo: int = 0, hi: int = 0) -> None:
        """One record: its header (``length`` payload bytes whose CRC32C is ``crc``), the payload as
        ``write_payload`` writes it, the padding; and its commit entry."""
        hdr = RecordHeader(rtype, 0, length, self._seq, self._salt, crc).pack()
        self._f.write(hdr)
        write_payload()
        self._f.write(b"\0" * pad8(length))
        if rtype != RecordType.COMMIT:
            self._entries.append((self._offset, rtype, site, segment, rows, lo, hi))
        self._offset += len(hdr) + length + pad8(length)
        self._seq += 1

    def manifest(self, doc: dict) -> None:
        self._record(RecordType.MANIFEST, manifest_bytes(doc))

    def obs(self, payload: bytes, site: int, segment: int, rows: int, lo: int, hi: int) -> None:
        self._record(RecordType.OBS, payload, site, segment, rows, lo, hi)

    def obs_from(self, fd: int, offset: int, length: int, crc: int, site: int, segment: int, rows: int, lo: int,
                 hi: int) -> None:
        """:meth:`obs` of a payload already encoded into file ``fd`` at ``offset`` (``length`` bytes, CRC32C
        ``crc``), copied by the kernel (a merge's worker processes hand their sites over this way, not through a
        pipe)."""
        def copy() -> None:
            self._f.flush()
            _copy_range(fd, self._f.fileno(), offset, length)

        self._framed(RecordType.OBS, length, crc, copy, site, segment, rows, lo, hi)

    def steps(self, payload: bytes, segment: int, rows: int, lo: int, hi: int) -> None:
        self._record(RecordType.STEPS, payload, NO_ID, segment, rows, lo, hi)

    def commit(self) -> None:
        if not self._entries:
            return
        body = pack_commit(self._seq, self._entries)
        self._entries = []
        self._record(RecordType.COMMIT, body)

    @property
    def bytes_written(self) -> int:
        return self._offset

    def sync_data(self) -> None:
        """Write what is buffered and wait for the file's data to reach the disk (``close`` then has less to wait
        for)."""
        self._f.flush()
        getattr(os, "fdatasync", os.fsync)(self._f.fileno())

    def close(self, *, sync: bool = True) -> None:
        self.commit()
        self._f.flush()
        if sync:
            os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()


_KERNEL_COPY = [hasattr(os, "copy_file_range")]  #: False once the system refused it: copy through memory


def _copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """Append ``length`` bytes of file ``src`` from ``offset`` at ``dst``'s position (in the kernel where it can)."""
    end = offset + length
    while offset < end:
        n = 0
        if _KERNEL_COPY[0]:
            try:
                n = os.copy_file_range(src, dst, end - offset, offset)
            except OSError:  # not on this file system (or a real error, which the copy below meets again)
                _KERNEL_COPY[0] = False
        if n <= 0:  # (some file systems answer 0 instead of an error)
            data = os.pread(src, min(end - offset, 1 << 24), offset)
            if not data:
                raise OSError(f"copying a record: {end - offset} bytes missing at offset {offset} of its source")
            n = os.write(dst, data)
        offset += n


CODECS = {"packed": Codec.PACKED, "shuffle": Codec.SHUFFLE_DEFLATE, "raw": Codec.RAW}
