"""``HistoryWriter``: append observations from numpy (or precomputed summaries) to a trainhist file.

The writer buffers rows per site and writes them as one chunk per site at each commit, followed by a commit
record; a crash loses at most what was not yet committed. Any framework can record through it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import json
import math
import operator
import os
import socket
import stat
import time
import uuid
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate, chain, repeat
from operator import attrgetter
from typing import Any, Sequence

import numpy as np
import numpy.typing as npt

from . import __version__, grid
from .chunk import DTYPES, MAX_ROWS, Codec, assemble_chunks, encode_chunk, pack_segments
from .dyadic import MANT_BITS, ZERO, Dyadic, floats_of
from .errors import NotFoundError, ReadOnlyError, UsageError, not_a_file, path_problem
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
from .model import (
    CANONICAL_NAN,
    MICRO_ALL,
    SHARING,
    STREAMS,
    U64_UNKNOWN,
    Applied,
    Clipped,
    GradBasis,
    Phase,
    Presence,
    extreme_pair_ok,
    row_problem,
)
from .schemas import integers, lone_surrogate, validate_manifest
from .summary import Sketch, SpineTable, Summary, SumMethod, summarize

__all__ = ["HistoryWriter", "SiteHandle"]

NO_ID = 0xFFFFFFFF
_FLUSH_ROWS = MAX_ROWS // 16  #: rows of one (site, segment) written as a chunk without waiting for the commit
_PHASE_CODES = {name: code for code, name in enumerate(Phase.NAMES)}
_SEGMENT_REASONS = ("start", "resume", "manual")  #: a segment manifest's reasons (spec 2.4, segment.schema.json)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class SiteHandle:
    """A site of this file: pass it to :meth:`HistoryWriter.observe`."""

    id: int
    path: str
    stream: str
    facet: str | None


GROUP_ROWS = _FLUSH_ROWS  #: rows of the chunks a commit encodes together, at most (or one site's chunk)
_EMPTY = Summary(count=0)  # the numbers of a row that has none (a mark)
_COUNTS = ("count", "nan", "pinf", "ninf", "zero")
_counts_of = attrgetter(*_COUNTS)
_range_of = attrgetter("min", "max")
_sums_of = attrgetter("sum", "sumsq")
_id_of = attrgetter("id")
_SKETCH_COLUMNS = ("sk", "sk_plo", "sk_pn", "sk_nlo", "sk_nn", "sk_up", "sk_un", "sk_op", "sk_on")
_SKETCH_DTYPES = ("u1", "u2", "u2", "u2", "u2", "u8", "u8", "u8", "u8")


def _gather(fields: Any, items: list, dtype: type, width: int) -> np.ndarray:
    """``width`` values per item (``fields(item)``, a tuple) as a ``(width, len(items))`` array, one row a field."""
    flat = np.fromiter(chain.from_iterable(map(fields, items)), dtype, width * len(items))
    return flat.reshape(-1, width).T.copy()


_TABLE_METHODS = (SumMethod.F64, SumMethod.F32, SumMethod.UNKNOWN)  #: the sum methods a SpineTable may state


def _any_equal(values: np.ndarray, of: tuple[int, ...]) -> np.ndarray:
    """``numpy.isin(values, of)`` of an integer array and a few integers, as comparisons (isin's setup costs
    tens of microseconds, once a step for a collector)."""
    hit = values == of[0]
    for v in of[1:]:
        hit |= values == v
    return hit


class _Spines:
    """A :class:`SpineTable` as the encoder stores it: counts (5 rows, uint64), min/max (canonical NaN), the sums
    as their stored float64 values (0 for an unknown bound; +0.0 for a zero sum), the method codes and the sketch
    key counts (uint64, a row per observation; None: no sketches)."""

    __slots__ = ("counts", "ranges", "sums", "method", "keys")

    def __init__(self, t: SpineTable) -> None:
        n = _table_rows(t)
        cols = (t.count, t.nan, t.pinf, t.ninf, t.zero, t.min, t.max, t.sum, t.sumsq, t.method)
        ints = [np.asarray(c) for c in cols[:5]]
        for name, c in zip(_COUNTS, ints):
            if c.dtype.kind not in "iu" or (c.size and c.min() < 0):
                found = f"{c.dtype} values" if c.dtype.kind not in "iu" else f"{c.min()} in row {int(c.argmin())}"
                raise UsageError(f"the {name} column of a SpineTable must hold non-negative integers, found {found}",
                                 code="bad_table")
        counts = np.array(ints, dtype=np.uint64).reshape(5, n)
        for name, c in zip(("min", "max", "sum", "sumsq"), cols[5:9]):
            if np.asarray(c).dtype.kind not in "fiu":
                raise UsageError(f"the {name} column of a SpineTable must be numbers (float64 values), found "
                                 f"{np.asarray(c).dtype} values", code="bad_table")
        ranges = np.array([t.min, t.max], dtype=np.float64).reshape(2, n)
        _refuse_impossible("SpineTable", counts, ranges)
        finite = counts[0] - counts[1] - counts[2] - counts[3]  # (no wrap: checked above)
        method = np.asarray(t.method)
        if method.dtype.kind not in "iu" or not _any_equal(method, _TABLE_METHODS).all():
            bad = np.flatnonzero(~_any_equal(method, _TABLE_METHODS))[0] if method.dtype.kind in "iu" else None
            found = f"{method.dtype} values" if bad is None else f"{method[bad]} in row {bad}"
            raise UsageError(f"the method column of a SpineTable must hold SumMethod.F64, F32 or UNKNOWN, found "
                             f"{found} (exact sums, SumMethod.EXACT, need a Summary and observe())", code="bad_table")
        sums = np.array([t.sum, t.sumsq], dtype=np.float64).reshape(2, n)
        known = method != SumMethod.UNKNOWN
        bad = np.flatnonzero(known & ~np.isfinite(sums).all(axis=0))
        if bad.size:
            raise UsageError(f"the sums of a SpineTable must be finite where the method states a bound, found sum "
                             f"{float(sums[0, bad[0]])!r}, sumsq {float(sums[1, bad[0]])!r} in row {bad[0]}; state "
                             "method SumMethod.UNKNOWN for a row whose sums overflowed", code="bad_table")
        bad = np.flatnonzero(known & ((sums[1] < 0) | ((finite == 0) & (sums != 0).any(axis=0))))
        if bad.size:
            raise UsageError(f"a SpineTable's sum of squares cannot be negative, nor its sums other than 0 in a row "
                             f"with no finite value: found sum {float(sums[0, bad[0]])!r}, sumsq "
                             f"{float(sums[1, bad[0]])!r} in row {bad[0]}", code="bad_table")
        self.keys = None if t.sketch is None else _sketch_keys(t.sketch, finite - counts[4])
        self.counts = counts
        self.ranges = ranges
        self.ranges[np.isnan(ranges)] = CANONICAL_NAN
        self.sums = np.where(known, sums, 0.0) + 0.0  # (+ 0.0: a zero sum is stored as +0.0, as its dyadic is)
        self.method = method.astype(np.uint8)

    def sketch(self, i: int) -> Sketch:
        """The sketch of row ``i``."""
        return Sketch.from_key_counts(self.keys[i])  # type: ignore[index]


_SUMMARY_TYPES = (
    "count, nan, pinf, ninf and zero: int in [0, 2**64); min and max: float (NaN when no value is finite); sum and "
    "sumsq: trainhist.dyadic.Dyadic, the exact value m * 2**e in canonical form (Dyadic.from_float(x), "
    "Dyadic.make(m, e)), e an i32 and |m| < 2**8191; sum_method: a trainhist.SumMethod code (EXACT, F64, F32 or "
    "UNKNOWN); sketch: None or a trainhist.Sketch of scale 0, 1 or 2 whose pos and neg are integer arrays of "
    "grid.nbins(scale) counts")


_U64_END = 2**64
_NBINS = {scale: grid.nbins(scale) for scale in (0, 1, 2)}  #: the in-window bins per sign of each scale (spec 6)


def _is_count(c: object) -> bool:
    """Whether ``c`` is an int (numpy's too, not a bool) a u64 column holds."""
    return (type(c) is int or isinstance(c, np.integer)) and 0 <= c < _U64_END  # type: ignore[operator]


def _is_real(v: object) -> bool:
    """Whether ``v`` is a real number (a Python or numpy float or int, not a bool) a min or max can be."""
    return type(v) is float or isinstance(v, (int, np.floating, np.integer)) and not isinstance(v, bool)


def _is_dyadic(d: object) -> bool:
    """Whether ``d`` is a canonical :class:`Dyadic` of int parts whose exponent an i32 holds and whose mantissa is
    within the width bound (spec 5.3)."""
    if not isinstance(d, Dyadic) or type(d.m) is not int or type(d.e) is not int:
        return False
    return (d.m & 1 == 1 or d.m == d.e == 0) and -(2**31) <= d.e < 2**31 and abs(d.m).bit_length() <= MANT_BITS


def _is_sketch(k: object) -> bool:
    """Whether ``k`` is None or a :class:`Sketch` the writer can store: scale 0, 1 or 2, ``grid.nbins(scale)``
    non-negative integer counts per sign in numpy arrays, band counts a u64 holds."""
    if k is None:
        return True
    if not isinstance(k, Sketch) or type(k.scale) is not int or k.scale not in _NBINS:
        return False
    shape = (_NBINS[k.scale],)
    for side in (k.pos, k.neg):
        if type(side) is not np.ndarray or side.shape != shape:
            return False
        kind = side.dtype.kind
        if kind != "u" and (kind != "i" or side.min() < 0):
            return False
    return _is_count(k.under_pos) and _is_count(k.under_neg) and _is_count(k.over_pos) and _is_count(k.over_neg)


def _summary_type_problems(s: Summary) -> list[str]:
    """The fields of ``s`` whose type (or form) the file cannot hold, each as ``name (type value)``; none for a
    Summary such as :func:`~trainhist.summarize` makes (the common case takes the shortest path)."""
    if (_is_count(s.count) and _is_count(s.nan) and _is_count(s.pinf) and _is_count(s.ninf) and _is_count(s.zero)
            and _is_real(s.min) and _is_real(s.max) and _is_dyadic(s.sum) and _is_dyadic(s.sumsq)
            and _is_method(s.sum_method) and _is_sketch(s.sketch)):
        return []
    checks = ((_is_count, _COUNTS), (_is_real, ("min", "max")), (_is_dyadic, ("sum", "sumsq")),
              (_is_method, ("sum_method",)), (_is_sketch, ("sketch",)))
    bad = [f for ok, fields in checks for f in fields if not ok(getattr(s, f))]
    return [f"{f} ({type(getattr(s, f)).__name__} {_short(getattr(s, f))})" for f in bad]


def _is_method(m: object) -> bool:
    """Whether ``m`` is the code of a sum method this writer writes (spec 5.4; 3 to 254 are reserved)."""
    return (type(m) is int or isinstance(m, np.integer)) and m in SumMethod.NAMES


def _short(v: object) -> str:
    """``repr(v)``, cut to 60 characters (a sketch's arrays are long)."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _check_summary(s: Summary) -> None:
    """Refuse a caller's :class:`Summary` whose fields the file cannot hold (``bad_summary``), or that no tensor
    could give (spec 5.5), which readers would refuse: written, it would fail the commit or make its site
    unreadable."""
    problems = _summary_type_problems(s)
    if problems:
        raise UsageError(
            f"a Summary with fields of the wrong type or form: {'; '.join(problems)}. Each field must be: "
            f"{_SUMMARY_TYPES}. Build one with trainhist.summarize(values), or by hand with Dyadic.from_float for "
            "the sums; nothing of this call was recorded", code="bad_summary")
    counts = (s.count, s.nan, s.pinf, s.ninf, s.zero)
    # spec 5.5's rules for one observed row, in plain Python (numpy's per-call cost on one row was most of
    # observe(summary=)'s time); the same test as model.row_problem, whose messages it gives
    count, nan, pinf, ninf, zero = (int(c) for c in counts)
    mn, mx = float(s.min), float(s.max)
    sums_zero = all(getattr(v, "m", 0) == 0 for v in (s.sum, s.sumsq))  # (rule 3: no finite value sums to 0)
    msg = None
    if nan + pinf + ninf + zero > count:
        msg = "nan + pinf + ninf + zero exceed count"
    elif count - nan - pinf - ninf > 0:
        if not extreme_pair_ok(mn, mx):
            msg = "an observed row with finite values needs finite min <= max"
    elif not (math.isnan(mn) and math.isnan(mx) and sums_zero):
        msg = "an observed row without finite values has NaN min and max and zero sums"
    if msg is not None:
        raise UsageError(_impossible("Summary", msg), code="bad_summary")


def _refuse_impossible(what: str, counts: np.ndarray, ranges: np.ndarray) -> None:
    """Refuse rows (``counts``: count, NaN, +inf, -inf, zero; ``ranges``: min, max) that break spec 5.5's rules
    for an observed row, with readers' own test (:func:`~trainhist.model.row_problem`): ``bad_table``."""
    n = counts.shape[1]
    cols = dict(zip(("count", "nan", "pinf", "ninf", "zero"), counts), min=ranges[0], max=ranges[1],
                presence=np.full(n, Presence.OBSERVED, np.uint8), sum=np.zeros(n), sumsq=np.zeros(n))
    problem = row_problem(cols)
    if problem is not None:
        row, msg = problem
        raise UsageError(_impossible(f"{what} (row {row})", msg.removeprefix("row {row}: ")), code="bad_table")


def _impossible(what: str, rule: str) -> str:
    """The message refusing a row that breaks spec 5.5's ``rule``."""
    return (f"a {what} that no tensor could give (spec 5.5): {rule}; min and max are the finite extremes in IEEE "
            "total order (-0.0 before +0.0), NaN when no value is finite (and the sums then 0)")


def _table_rows(t: SpineTable) -> int:
    """The rows of ``t``, checked: every column one-dimensional and of one length (``bad_table``)."""
    cols = {f: getattr(t, f) for f in (*_COUNTS, "min", "max", "sum", "sumsq", "method")}
    n = np.shape(cols["count"])[0] if np.ndim(cols["count"]) == 1 else None
    for name, c in cols.items():
        if np.ndim(c) != 1 or len(c) != n:
            raise UsageError(f"every column of a SpineTable must be one-dimensional, of one value per row "
                             f"({'as many as count' if n is None else n}), found {name} {type(c).__name__} of shape "
                             f"{np.shape(c)}", code="bad_table")
    return n  # type: ignore[return-value]  # (count is one-dimensional)


def _sketch_keys(sketch: np.ndarray, nonzero: np.ndarray) -> np.ndarray:
    """A :class:`SpineTable`'s sketch key counts as uint64, checked: one row of ``grid.NKEYS`` non-negative
    integers per observation, whose bins and bands count no more values than its ``nonzero`` finite ones."""
    keys = np.asarray(sketch)
    if keys.ndim != 2 or keys.shape != (len(nonzero), grid.NKEYS) or keys.dtype.kind not in "iu":
        raise UsageError(f"a SpineTable's sketch must be integer key counts of shape ({len(nonzero)}, "
                         f"{grid.NKEYS}) (a row of grid.NKEYS per observation), not {keys.dtype} {keys.shape}",
                         code="bad_table")
    if keys.size and keys.min() < 0:
        raise UsageError(f"a SpineTable's sketch counts must be non-negative, found {keys.min()}", code="bad_table")
    keys = np.array(keys, dtype=np.uint64)  # (a copy: the rows are read at the commit, the caller's array may change)
    binned = keys[:, : 2 * (grid.KEY_OVER + 1)]  # the bins and bands of both sides (the other keys are not read)
    # (a float sum first: the exact uint64 one cannot wrap when it is below 2**64 with room for rounding)
    if (binned.sum(axis=1, dtype=np.float64) > 1.8e19).any() or (
            binned.sum(axis=1, dtype=np.uint64) > nonzero).any():
        raise UsageError("a SpineTable row's sketch counts more values than its finite non-zero ones (count - nan - "
                         "pinf - ninf - zero): the bins and bands count only those", code="bad_table")
    return keys


_ROW_BITS = 32  #: a table row is buffered as the int ``table << _ROW_BITS | row`` (see _row_columns)


def _row_columns(summaries: tuple, tables: Sequence[_Spines]) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                      np.ndarray, list[bool], list]:
    """The number columns of rows whose numbers are a :class:`Summary`, ``None`` (a mark) or an int ``t << 32 |
    i`` (row ``i`` of ``tables[t]``: a buffered row of ints only, which the garbage collector stops tracking):
    method, the five counts, min and max, the sums' float64 values, whether each sum is exactly that float (two a
    row, interleaved) and the sums themselves (interleaved; ``None`` for a table's, always floats)."""
    n = len(summaries)
    refs = [i for i, s in enumerate(summaries) if type(s) is int]
    plain: Any = slice(None)  # the Summary (or mark) rows: all, or a list of positions
    if refs:
        plain = [i for i, s in enumerate(summaries) if type(s) is not int]
    sums = [s if s is not None else _EMPTY for s in (summaries if not refs else (summaries[i] for i in plain))]
    method = np.empty(n, np.uint8)
    counts = np.empty((5, n), np.uint64)
    ranges = np.empty((2, n), np.float64)
    floats = np.empty((2, n), np.float64)
    values: list = [None] * (2 * n)
    is_float = [True] * (2 * n)
    if sums:
        method[plain] = [s.sum_method for s in sums]
        counts[:, plain] = _gather(_counts_of, sums, np.uint64, 5)
        r = _gather(_range_of, sums, np.float64, 2)
        r[np.isnan(r)] = CANONICAL_NAN
        ranges[:, plain] = r
        vals = list(chain.from_iterable(map(_sums_of, sums)))  # sum, sumsq of row 0, then of row 1, ...
        f, exact = floats_of(vals)
        floats[:, plain] = f.reshape(-1, 2).T
        if not refs:
            values, is_float = vals, exact
        else:
            for j, i in enumerate(plain):
                values[2 * i : 2 * i + 2] = vals[2 * j : 2 * j + 2]
                is_float[2 * i : 2 * i + 2] = exact[2 * j : 2 * j + 2]
    if refs:
        ref = np.fromiter((summaries[i] for i in refs), np.int64, len(refs))
        at, which, idx = np.array(refs, np.int64), ref >> _ROW_BITS, ref & ((1 << _ROW_BITS) - 1)
        for key in np.unique(which).tolist():  # (a commit holds a few tables a step)
            t = tables[key]
            take = which == key
            pos, k = at[take], idx[take]
            method[pos] = t.method[k]
            counts[:, pos] = t.counts[:, k]
            ranges[:, pos] = t.ranges[:, k]
            floats[:, pos] = t.sums[:, k]
    return method, counts, ranges, floats, is_float, values


def _windows(arrays: list[np.ndarray]) -> tuple[list[int], list[int], np.ndarray]:
    """Where each array's values from its first to its last non-zero one start, how many they are (0, 0 for an array
    of zeros), and all those values, concatenated: with one set of numpy calls for all the arrays (sketch counts,
    uint64)."""
    flat = np.concatenate(arrays, dtype=np.uint64, casting="unsafe")
    ends = list(accumulate(len(a) for a in arrays))
    starts = [0, *ends[:-1]]
    nz = np.flatnonzero(flat)
    first_nz, past_nz = np.searchsorted(nz, starts).tolist(), np.searchsorted(nz, ends).tolist()
    nz_at = nz.tolist()
    firsts, lengths, pieces = [], [], []
    for start, a, b in zip(starts, first_nz, past_nz):
        if a == b:
            firsts.append(0)
            lengths.append(0)
        else:
            firsts.append(nz_at[a] - start)
            lengths.append(nz_at[b - 1] - nz_at[a] + 1)
            pieces.append(flat[nz_at[a] : nz_at[b - 1] + 1])
    return firsts, lengths, np.concatenate(pieces) if pieces else np.zeros(0, np.uint64)


def encode_obs_rows(rows: list[tuple], site: int, segment: int, codec: int,
                    tables: Sequence[_Spines] = ()) -> tuple[bytes, int, int]:
    """Chunk payload of obs rows ``(step, span, micro, phase, presence, Summary|None)``; returns payload, steps."""
    return encode_obs_chunks([(rows, site, segment)], codec, tables)[0]


def encode_obs_chunks(chunks: list[tuple[list[tuple], int, int]], codec: int,
                      tables: Sequence[_Spines] = ()) -> list[tuple[bytes, int, int]]:
    """:func:`encode_obs_rows` of each ``(rows, site, segment)`` (``tables``: those their table rows refer to).

    A commit encodes hundreds of chunks of a few rows each: every field is gathered for the rows of all of them at
    once, and each column is packed for all the chunks together (:func:`~trainhist.chunk.pack_segments`)."""
    if not chunks:
        return []
    edges = list(accumulate((len(rows) for rows, _, _ in chunks), initial=0))  # chunk i: rows edges[i]:edges[i + 1]
    n = edges[-1]
    steps, spans, micros, phases, presences, summaries = zip(*(r for rows, _, _ in chunks for r in rows))
    method, counts, ranges, floats, is_float, values = _row_columns(summaries, tables)
    table: dict[str, tuple[str, np.ndarray]] = {  # the fixed columns, for every row
        "step": ("i8", np.array(steps, np.int64)),
        "span": ("u4", np.array(spans, np.uint32)),
        "micro": ("u4", np.array(micros, np.uint32)),
        "phase": ("u1", np.array(phases, np.uint8)),
        "presence": ("u1", np.array(presences, np.uint8)),
        "method": ("u1", method),
    }
    table.update((name, ("u8", col)) for name, col in zip(_COUNTS, counts))
    table["min"], table["max"] = ("f8", ranges[0]), ("f8", ranges[1])
    table["sum"], table["sumsq"] = ("f8", floats[0]), ("f8", floats[1])
    sketched = [i for i, s in enumerate(summaries) if s is not None and (
        tables[s >> _ROW_BITS].keys is not None if type(s) is int else s.sketch is not None)]
    if sketched:
        sketches = [tables[s >> _ROW_BITS].sketch(s & ((1 << _ROW_BITS) - 1)) if type(s) is int else s.sketch
                    for s in (summaries[i] for i in sketched)]
        firsts, lengths, counts = _windows([arr for sk in sketches for arr in (sk.pos, sk.neg)])  # type: ignore[union-attr]
        at = list(accumulate((lengths[2 * j] + lengths[2 * j + 1] for j in range(len(sketched))), initial=0))
        rows_of = np.array([(1, firsts[2 * j], lengths[2 * j], firsts[2 * j + 1], lengths[2 * j + 1], sk.under_pos,
                             sk.under_neg, sk.over_pos, sk.over_neg) for j, sk in enumerate(sketches)], np.uint64)
        sk_table = np.zeros((len(_SKETCH_COLUMNS), n), np.uint64)  # the values of _SKETCH_COLUMNS, for every row
        sk_table[:, sketched] = rows_of.T
    sizes = [hi - lo for lo, hi in zip(edges, edges[1:])]
    stored = {name: pack_segments(dt, col, sizes, codec) for name, (dt, col) in table.items()}
    sk_at = [bisect_left(sketched, lo) for lo in edges]  # chunk c's sketched rows: sketched[sk_at[c]:sk_at[c + 1]]
    with_sk = [c for c in range(len(chunks)) if sk_at[c + 1] > sk_at[c]]
    if with_sk:  # the sketch columns of the chunks with a sketched row, each column packed for all of them at once
        rows = np.concatenate([np.arange(edges[c], edges[c + 1]) for c in with_sk])
        sk_sizes = [sizes[c] for c in with_sk]
        sk_stored = [pack_segments(dt, col[rows].astype(DTYPES[dt]), sk_sizes, codec)
                     for dt, col in zip(_SKETCH_DTYPES, sk_table)]
        sk_counts = pack_segments("u8", counts, [at[sk_at[c + 1]] - at[sk_at[c]] for c in with_sk], codec)
    encoded: list[tuple[dict, list]] = []
    spans: list[tuple[int, int]] = []
    j = 0  # chunks with a sketched row so far
    for c, ((_, site, segment), lo, hi) in enumerate(zip(chunks, edges, edges[1:])):
        cols = [(name, dt, stored[name][c]) for name, (dt, _) in table.items()]
        for k, name in enumerate(("sum", "sumsq")):
            if not all(is_float[2 * lo + k : 2 * hi : 2]):
                blobs = [b"" if ok else v.to_bytes() for v, ok in zip(values[2 * lo + k : 2 * hi : 2],
                                                                       is_float[2 * lo + k : 2 * hi : 2])]
                extra = [("u4", np.array([len(b) for b in blobs], np.uint32)), ("bytes", b"".join(blobs))]
                cols += [(name + suffix, dt, pack_segments(dt, np.frombuffer(arr, np.uint8) if dt == "bytes" else arr,
                                                           [len(arr)], codec)[0])
                         for suffix, (dt, arr) in zip(("_xn", "_x"), extra)]
        meta: dict[str, Any] = {"site": site, "segment": segment, "rows": hi - lo}
        if sk_at[c + 1] > sk_at[c]:
            scales = {sketches[i].scale for i in range(sk_at[c], sk_at[c + 1])}  # type: ignore[union-attr]
            if len(scales) != 1:
                raise UsageError(f"one chunk cannot mix sketch scales {sorted(scales)}")
            meta["scale"] = scales.pop()
            cols += [(name, dt, col[j]) for name, dt, col in zip(_SKETCH_COLUMNS, _SKETCH_DTYPES, sk_stored)]
            cols.append(("sk_counts", "u8", sk_counts[j]))
            j += 1
        encoded.append((meta, cols))
        spans.append((min(steps[lo:hi]), max(steps[lo:hi])))
    return [(p, first, last) for p, (first, last) in zip(assemble_chunks(encoded), spans)]


def _encode_manifest(doc: dict) -> bytes:
    """A manifest's payload (spec 9: sorted keys, no white space, integers without fraction: ``rank=2.0`` is
    written ``2``), after checking it against its schema."""
    try:
        validate_manifest(doc)
    except TypeError as e:  # (a value the schema's keywords cannot compare: rank=1+2j)
        raise UsageError(f"the {doc.get('kind')} manifest holds a value of the wrong type ({e}): give numbers, "
                         "strings, booleans, null, lists and string-keyed objects", code="bad_manifest_value") from None
    try:
        text = json.dumps(integers(doc), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:  # (an object JSON has no form for; a float NaN or infinity)
        raise UsageError(f"the {doc.get('kind')} manifest holds a value JSON cannot hold (spec 9: {e}): give "
                         "numbers, strings, booleans, null, lists and string-keyed objects; NaN and infinities as "
                         "strings (config={'lr': 'nan'})", code="bad_manifest_value") from None
    if "\\u" in text:  # (json.dumps escapes every non-ASCII character: else no surrogate anywhere)
        where = lone_surrogate(doc)
        if where is not None:
            raise UsageError(f"the {doc.get('kind')} manifest is refused: {where} holds a lone UTF-16 surrogate, "
                             "which is no Unicode character and has no UTF-8 form (spec 9: a manifest's strings are "
                             "Unicode text); give text without one: a name decoded from bytes with "
                             "errors='surrogateescape' (os.fsdecode) holds them, decode it with errors='replace'",
                             code="bad_manifest_value")
    return text.encode()


def _unlock(f) -> None:  # (f: BinaryIO)
    """Release the file's lock now: a process forked while it was open (a data loader's worker) shares the lock
    and would otherwise hold it after this writer closed."""
    try:
        import fcntl

        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    except (ImportError, OSError):
        pass


_I64 = (-(1 << 63), (1 << 63) - 1)


def _whole(name: str, value: object, lo: int, hi: int | float) -> int:
    """``value`` as an int in ``[lo, hi]``, or a :class:`UsageError` now: a value the file cannot hold would
    otherwise fail the next commit, and with it every row buffered since the last one."""
    dtype = getattr(value, "dtype", None)  # (a 0-dim array or tensor: not of booleans or text)
    if isinstance(value, (bool, str, bytes)) or getattr(dtype, "kind", "i") in "bUSO" or str(dtype) == "torch.bool":
        raise UsageError(f"{name} must be a whole number, got {value!r}", code="bad_value")
    try:
        v = operator.index(value)  # (ints, numpy integers, 0-dim integer arrays and tensors)
    except TypeError:
        try:
            f = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            f = math.nan
        if not f.is_integer():
            raise UsageError(f"{name} must be a whole number, got {value!r}", code="bad_value") from None
        v = int(f)
    if not lo <= v <= hi:
        raise UsageError(f"{name} must be in [{lo}, {hi}], got {v}", code="bad_value")
    return v


def _real(name: str, value: object) -> float:
    """``value`` as a float, or a :class:`UsageError` (a string is not a number here)."""
    if isinstance(value, (str, bytes)):
        raise UsageError(f"{name} must be a number, got {value!r}", code="bad_value")
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError) as e:
        raise UsageError(f"{name} must be a number, got {value!r}", code="bad_value") from e
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and int(value) != f:
        raise UsageError(f"{name} must be a number a float64 holds exactly, got the integer {int(value)}, whose "
                         f"nearest float64 is {f!r}: integers beyond 2**53 are rounded; convert it with float() "
                         "if the rounded value is meant", code="bad_value")
    return f


def _tristate(names: type, field_: str, value: bool | str | None) -> int:
    """The code of a yes/no/unknown step-truth field given as None (unknown), one of its names, or anything with a
    truth value (a bool, a 0-dim tensor): a string is a name, never read as true."""
    if value is None:
        return 0
    if isinstance(value, str):
        return names.code(value)  # type: ignore[attr-defined]
    try:
        return 1 if bool(value) else 2
    except Exception as e:  # noqa: BLE001 -- e.g. an array of several values
        raise UsageError(f"{field_} must be a bool, None or one of {', '.join(names.NAMES)}, "  # type: ignore
                         f"got {value!r}", code="unknown_name") from e


def _text(name: str, value: object, *, none: bool = False) -> None:
    """Refuse a name or choice that is not a str (``none``: or None) with a typed error, before it is hashed, compared
    or truth-tested (a list, dict or array there raised TypeError or numpy's ValueError)."""
    if not (isinstance(value, str) or (none and value is None)):
        raise UsageError(f"{name} must be a str{' or None' if none else ''}, got {type(value).__name__} "
                         f"{_short(value)}", code="bad_value")


def _open_locked(path: str):  # -> tuple[BinaryIO, bool]
    """``path`` opened for reading and writing (created if missing, not truncated) and locked against a second
    writer: two writers on one file would interleave their records into a file no reader can read. The lock is an
    advisory ``flock``, released when the file is closed or the process dies; where the platform or file system has
    none, the file is opened unlocked. Returns the file and whether this call created it."""
    try:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT, 0o666), False
        f = os.fdopen(fd, "r+b")
    except FileNotFoundError:
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(folder):  # (e.g. /proc: a folder no file can be created in)
            raise NotFoundError(f"cannot create the history: the folder {folder} exists, but the file system will "
                                "not create a file in it (a virtual file system?); give a path on a disk",
                                path=path) from None
        raise NotFoundError(f"cannot create the history: the folder {folder} does not exist; create it first, or "
                            "give a path in an existing folder", path=path) from None
    except IsADirectoryError:
        raise not_a_file("a directory: a history is written to a regular file; give a file name (e.g. "
                         f"{os.path.join(path, 'run.thist')})", path=path, directory=True) from None
    except (OSError, ValueError) as e:
        problem = path_problem(path, e, "write the history")
        if problem is None:
            raise
        raise problem from None
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise not_a_file("not a regular file (a pipe, socket or device): a history is written to a regular file, "
                         "which a reader can read back; give a file name", path=path, directory=False)
    try:
        import fcntl
    except ImportError:  # (no flock on this platform)
        return f, created
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise UsageError("another writer has this file open (it holds the file's lock): two writers would interleave "
                         "their records; give each process its own file (under torch.distributed, the collector "
                         "inserts .rank<r> once the process group exists)", code="file_in_use", path=path) from None
    except OSError:  # (a file system without flock: unlocked)
        pass
    return f, created


def _fsync_folder(path: str) -> None:
    """``fsync`` the folder holding ``path``, so that the name of a file created there survives a power loss: an
    ``fsync`` of the file makes its bytes durable, not its directory entry (POSIX; ext4 in some modes, XFS and
    others can lose a new file's name whose data was synced). Skipped where a folder cannot be opened or synced
    (Windows; some network file systems answer EINVAL)."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EACCES, errno.EPERM, errno.EROFS):
            raise
    finally:
        os.close(fd)


class HistoryWriter:
    """Write a trainhist file: sites, observations, step truth, segments, commits.

    ``fsync``: ``"commit"`` (default) makes every commit durable before :meth:`commit` returns; ``"close"``
    syncs only on close; ``"never"`` leaves it to the OS. A commit happens on :meth:`commit`, on close, and
    automatically at a step boundary once ``commit_every`` steps or ``commit_seconds`` have passed.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        run_name: str | None = None,
        run_id: str | None = None,
        config: dict | None = None,
        rank: int = 0,
        world_size: int = 1,
        host: str | None = None,
        codec: str = "packed",
        fsync: str = "commit",
        mode: str = "w",
        commit_every: int = 200,
        commit_seconds: float = 30.0,
        settings: dict | None = None,
        salt: int | None = None,
        writer_id: str | None = None,
        created: str | None = None,
        pid: int | None = None,
        software: dict[str, str] | None = None,
        min_segment: int = 0,
        run_created: str | None = None,
    ) -> None:
        """``salt``, ``writer_id``, ``created`` (every manifest's timestamp), ``pid`` and ``software`` fix what is
        otherwise random or taken from the environment, for byte-reproducible files (conformance vectors);
        ``salt`` applies only to a new file (an appended file keeps its own). ``min_segment``: the least number of the
        segment this writer starts, e.g. the segment the run's other writers are at, for a rank that starts its file
        anew in a resumed run (spec 2.4: merge pairs the writers of a run by segment number). ``run_created``: the
        run manifest's time (a new file), so that every rank of a run writes the same run manifest."""
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise UsageError(f"HistoryWriter() takes a path (str or os.PathLike) to write the history to, not "
                             f"{type(path).__name__} {_short(path)}", code="bad_path")
        if not os.fspath(path):  # (the OS reads '' as no such file, which named the working folder's parent)
            raise UsageError("HistoryWriter() takes the path of the history file to write, got an empty path ('')",
                             code="bad_path")
        for name, value in (("codec", codec), ("fsync", fsync), ("mode", mode)):
            _text(name, value)
        for name, value in (("run_id", run_id), ("writer_id", writer_id), ("run_name", run_name), ("host", host),
                            ("created", created), ("run_created", run_created)):
            _text(name, value, none=True)
        for name, value in (("config", config), ("software", software), ("settings", settings)):
            if value is not None and not isinstance(value, dict):
                raise UsageError(f"{name} must be a dict or None, got {type(value).__name__} {_short(value)}",
                                 code="bad_value")
        if codec not in Codec.BY_NAME:
            raise UsageError(f"codec must be one of {', '.join(Codec.BY_NAME)}, got {codec!r}")
        if fsync not in ("commit", "close", "never"):
            raise UsageError(f"fsync must be 'commit', 'close' or 'never', got {fsync!r}")
        if mode not in ("w", "a"):
            raise UsageError(f"mode must be 'w' (create or truncate) or 'a' (append, resume), got {mode!r}")
        # (checked before the file is opened: a value refused later would leave it created or truncated)
        commit_every = _whole("commit_every", commit_every, 1, _I64[1])
        commit_seconds = _real("commit_seconds", commit_seconds)
        if not commit_seconds >= 0:
            raise UsageError(f"commit_seconds must be a number of seconds >= 0 (math.inf: no timed commits), got "
                             f"{commit_seconds!r}", code="bad_value")
        if salt is not None:
            salt = _whole("salt", salt, 0, (1 << 64) - 1)
        min_segment = _whole("min_segment", min_segment, 0, NO_ID - 1)
        self.path = os.fspath(path)
        self._codec = Codec.BY_NAME[codec]
        self._fsync = fsync
        self._commit_every = commit_every
        self._commit_seconds = commit_seconds
        self._sites: dict[tuple[str, str, str | None], SiteHandle] = {}
        self._handles: dict[int, SiteHandle] = {}  # the same handles by id
        self._site_meta: dict[int, dict] = {}
        self._buffers: dict[tuple[int, int], list[tuple]] = {}  # rows per (site, segment)
        self._tables: list[_Spines] = []  # the tables buffered rows refer to (emptied with the buffers)
        self._steps: dict[int, list[tuple]] = {}
        self._entries: list[tuple] = []
        self._closed = False
        #: why the writer stopped writing (an exception while it wrote a record or synced), or None: see _fail
        self._failed: str | None = None
        # (where commit() or site() began, to take it back when interrupted: see _marked, _take_back)
        self._mark: tuple | None = None
        self._last_step: int | None = None
        self._steps_since_commit = 0
        self._last_commit_time = time.monotonic()
        self.writer_id = writer_id or uuid.uuid4().hex
        self._created = created
        self._segment_manifest: dict | None = None
        # the step of the last row of each (site, phase, micro) in the current segment, to refuse a row that repeats
        # it (spec 2.8): whole-step rows in arrays [phase, site id] (observe_spines checks a call's rows at once),
        # micro-batch rows in a dict; one step per key, so memory stays bounded
        self._whole_last = np.zeros((len(Phase.NAMES), 0), np.int64)
        self._whole_has = np.zeros((len(Phase.NAMES), 0), bool)
        self._micro_last: dict[tuple[int, int, int], int] = {}
        self._f, created = _open_locked(self.path)
        self._folder_unsynced = created  #: the file's name is not durable yet: see _fsync_folder
        try:  # (any failure: the lock released, an existing file left as it was)
            self._open(mode, run_name, run_id, config, rank, world_size, host, pid, software, settings, salt,
                       min_segment, run_created)
        except BaseException:
            self._f.close()
            raise

    def _open(self, mode: str, run_name: str | None, run_id: str | None, config: dict | None, rank: int,
              world_size: int, host: str | None, pid: int | None, software: dict[str, str] | None,
              settings: dict | None, salt: int | None, min_segment: int, run_created: str | None) -> None:
        """Resume the locked file or start it over; every manifest is checked before the file is changed."""
        resumed = mode == "a" and os.fstat(self._f.fileno()).st_size > 0
        if resumed:
            resumed = self._open_append()  # False: nothing was ever committed, so the file starts afresh
        docs = []
        if not resumed:
            self.run_id = run_id or uuid.uuid4().hex
            self._salt = int.from_bytes(os.urandom(8), "little") if salt is None else salt
            self.run_manifest = {"kind": "run", "run_id": self.run_id, "name": run_name,
                                 "created": run_created or self._now(), "config": config or {}}
            docs.append(self.run_manifest)
            self._next_segment = 0
            self._previous_segment = None
        docs.append({
            "kind": "writer", "writer_id": self.writer_id, "run_id": self.run_id, "rank": rank,
            "world_size": world_size, "host": host if host is not None else socket.gethostname(),
            "pid": os.getpid() if pid is None else pid, "created": self._now(),
            "software": {"trainhist": __version__} if software is None else dict(software),
        })
        if settings:
            docs.append({"kind": "settings", "writer_id": self.writer_id, "settings": settings})
        encoded = [_encode_manifest(d) for d in docs]  # (refused here, before the file is touched)
        if resumed:  # drop a torn or uncommitted tail before appending
            self._f.truncate(self._offset)
            self._f.seek(self._offset)
        else:
            self._f.truncate(0)
            self._f.seek(0)
            self._seq = 0
            self._f.write(FileHeader(READ_VERSION, WRITE_VERSION, 0, 0, self._salt).pack())
            self._offset = FILE_HEADER_SIZE
        for payload in encoded:
            self._record(RecordType.MANIFEST, payload)
        self.segment = -1
        self.resumed = bool(resumed)  #: whether the file held a committed history, which this writer continues
        self._next_segment = max(self._next_segment, min_segment)
        self.new_segment(None, reason="resume" if resumed and self._previous_segment is not None else "start")

    def _now(self) -> str:
        return self._created if self._created is not None else _now()

    # -- opening an existing file ------------------------------------------------------------------------
    def _open_append(self) -> bool:
        from .reader import open_history

        with open_history(self.path) as h:
            return self._resume_from(h)

    def _resume_from(self, h: Any) -> bool:  # (h: reader.History)
        if h.header is None or (h.committed_records == 0 and h.header.write_version <= WRITE_VERSION):
            return False  # crashed before its first commit: nothing to resume, the file starts afresh
        if h.header.write_version > WRITE_VERSION:
            raise ReadOnlyError(
                f"file was written by write version {h.header.write_version}; this writer is version "
                f"{WRITE_VERSION} and may only read it", path=self.path,
            )
        if not h.runs:
            raise ReadOnlyError(
                "the file has no run manifest (its writer broke spec 4.4): a resumed writer continues the file's "
                "run (spec 2.1) and its writer manifest must name it, so this file may be read but not appended "
                "to; write the new rows to a file of their own (mode='w')", code="no_run_manifest", path=self.path)
        self.run_id = h.runs[0]["run_id"]
        self.run_manifest = dict(h.runs[0])  #: the run manifest this file holds
        self._salt = h.header.salt
        self._seq = h.committed_records
        for s in h.sites:
            handle = SiteHandle(s.id, s.path, s.stream, s.facet)
            self._sites[(s.path, s.stream, s.facet)] = handle
            self._handles[s.id] = handle
            self._site_meta[s.id] = s.manifest
        self._next_segment = max((g.id for g in h.segments), default=-1) + 1
        self._previous_segment = h.segments[-1].id if h.segments else None
        self._offset = h.committed_bytes  # (the torn or uncommitted tail beyond it is dropped by _open)
        return True

    # -- records -----------------------------------------------------------------------------------------
    def _record(self, rtype: int, payload: bytes, *, site: int = NO_ID, segment: int = NO_ID, rows: int = 0,
                steps: tuple[int, int] = (0, 0)) -> None:
        hdr = RecordHeader(rtype, 0, len(payload), self._seq, self._salt, crc32c(payload)).pack()
        data = hdr + payload + b"\0" * pad8(len(payload))
        if rtype == RecordType.COMMIT:  # (from its write on, an interrupt stops the writer: a reader may find it)
            self._mark = None
        try:
            self._f.write(data)
            if rtype != RecordType.COMMIT:
                self._entries.append((self._offset, rtype, site, segment, rows, steps[0], steps[1]))
            self._offset += len(data)
            self._seq += 1
        except BaseException as e:  # (part of the record may be in the file, and not in the offsets and entries)
            if isinstance(e, Exception) or self._mark is None:  # (else: commit() or site() takes it back)
                self._fail(e)
            raise

    def _fail(self, e: BaseException) -> None:
        """Stop writing: an exception (an I/O error, an interrupt) came while a record was written or its
        bookkeeping updated, or while a commit was made durable, so the file and this writer's offsets, sequence
        numbers and entries may disagree. Writing on (a later commit, ``close()``) would append records a reader
        refuses (bad_commit, bad_sequence), so the file is left as it is: a prefix of what was meant, which reads
        as its last commit (``clean`` or ``torn``, spec/crash-safety.md); ``mode="a"`` resumes it."""
        if self._failed is None:
            self._failed = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    def _sync(self, fsync: bool) -> None:
        """Flush the buffered records to the file, and ``fsync`` it when ``fsync``; a failure stops the writer
        (after a failed fsync the kernel may have dropped the pages it could not write: nothing later may claim
        them durable)."""
        try:
            self._f.flush()
            if fsync:
                os.fsync(self._f.fileno())
                if self._folder_unsynced:  # (the first durable commit of a file this writer created)
                    _fsync_folder(self.path)
                    self._folder_unsynced = False
        except BaseException as e:
            self._fail(e)
            raise

    def _manifest(self, doc: dict) -> None:
        self._record(RecordType.MANIFEST, _encode_manifest(doc))

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("the writer is closed: it records nothing more (its rows up to close() are in the "
                             "file); to add to the file, open it again with HistoryWriter(path, mode='a')",
                             code="writer_closed", path=self.path)
        if self._failed is not None:
            raise UsageError(
                f"the writer stopped when writing the file failed ({self._failed}): the file holds every commit "
                "before that (a reader recovers them and reports the rest as a torn tail); nothing more is written "
                "to it. Close this writer and open the file again with mode='a' to go on",
                code="writer_failed", path=self.path)

    # -- public API --------------------------------------------------------------------------------------
    def site(
        self,
        path: str,
        stream: str,
        *,
        facet: str | None = None,
        shape: tuple[int, ...] | list[int] | None = None,
        dtype: str | None = None,
        sharing: str | None = None,
        cadence_spine: int = 1,
        cadence_sketch: int = 1,
        sample: dict | None = None,
        order: int | None = None,
    ) -> SiteHandle:
        """Declare (or look up) the site ``(path, stream, facet)``; its manifest is written once, and a later call
        (a resumed file's sites included) gets the same handle: its ``shape``, ``dtype``, cadence and ``order`` stay
        as first declared, and another ``sharing`` (``None``: ``"shard"`` for a new site, any for a known one) or
        another ``sample`` than ``None`` is refused (``site_redeclared``, spec 2.2).
        ``order``: its position in the order a step produces values (spec 2.2), kept by merge where ids are not."""
        self._check_open()
        _text("site()'s path", path)
        _text("site()'s stream", stream)
        _text("site()'s facet", facet, none=True)
        _text("site()'s sharing", sharing, none=True)
        if sample is not None and not isinstance(sample, dict):
            raise UsageError(f"site()'s sample must be a dict or None, got {type(sample).__name__} {_short(sample)}",
                             code="bad_value")
        if shape is not None and np.ndim(shape) != 1:  # (a str or bytes too: numpy takes it as one value)
            raise UsageError(f"shape must be a tuple of whole numbers (e.g. (64, 128)) or None, got "
                             f"{_short(shape)}", code="bad_value")
        key = (path, stream, facet)
        if key in self._sites:
            known = self._site_meta[self._sites[key].id]
            if ((sharing is not None and sharing != known["sharing"])  # (spec 2.2: fixed for the file)
                    or (sample is not None and sample != known.get("sample"))):
                raise UsageError(
                    f"site {path!r} ({stream}{'' if facet is None else f', facet {facet!r}'}) is declared in this "
                    f"file with sharing {known['sharing']!r} and sample {known.get('sample')!r}, not "
                    f"{sharing!r} and {sample!r}: a site's rows all have the sharing and sample it was declared with "
                    "(merge adds or keeps them by it, spec 2.2); record the rows of the other kind into a new file",
                    code="site_redeclared", path=self.path)
            return self._sites[key]
        if stream not in STREAMS:
            raise UsageError(f"stream must be one of {', '.join(STREAMS)}, got {stream!r}")
        if sharing is None:
            sharing = "shard"
        if sharing not in SHARING:
            raise UsageError(f"sharing must be 'shard' or 'replica', got {sharing!r}")
        sid = len(self._site_meta)
        doc: dict[str, Any] = {
            "kind": "site", "id": sid, "path": path, "stream": stream, "facet": facet,
            "shape": None if shape is None else [_whole("shape", d, 0, (1 << 63) - 1) for d in shape], "dtype": dtype,
            "sharing": sharing,
            # (cadences are unbounded manifest integers, spec 9: a cadence past every step is due at step 0 alone)
            "cadence": {"spine": _whole("cadence_spine", cadence_spine, 0, math.inf),
                        "sketch": _whole("cadence_sketch", cadence_sketch, 0, math.inf)}, "sample": sample,
        }
        if order is not None:
            doc["order"] = _whole("order", order, 0, NO_ID)
        payload = _encode_manifest(doc)
        handle = SiteHandle(sid, path, stream, facet)
        mark = self._marked(rows=False)
        try:  # (a manifest written and its site not known would be declared twice by the next call)
            self._mark = mark
            self._record(RecordType.MANIFEST, payload)
            self._sites[key] = handle
            self._handles[sid] = handle
            self._site_meta[sid] = doc
        except BaseException as e:  # (an interrupt: the manifest taken back, the site not declared)
            if isinstance(e, Exception) or self._mark is None or not self._take_back():
                self._fail(e)
            else:
                self._sites.pop(key, None)
                self._handles.pop(sid, None)
                self._site_meta.pop(sid, None)
            raise
        finally:
            self._mark = None
        return handle

    def _at_step(self, step: int) -> None:
        if self._last_step is not None and step != self._last_step:
            self._steps_since_commit += 1
            if (
                self._steps_since_commit >= self._commit_every
                or time.monotonic() - self._last_commit_time >= self._commit_seconds
            ):
                self.commit()
        self._last_step = step

    def _check_site(self, site: SiteHandle) -> None:
        """Refuse anything but a handle of this writer (or an equal one: a writer of the same sites made it)."""
        if type(site) is not SiteHandle or self._handles.get(site.id) is not site:  # else: one of this writer's
            if not isinstance(site, SiteHandle) or self._sites.get((site.path, site.stream, site.facet)) != site:
                raise UsageError(f"{site!r} is not a site of this writer: get one from HistoryWriter.site()")

    def _as_step(self, step: int) -> int:
        """``step`` checked as an i64 step (the common case, the step of the last row, taken as it is)."""
        return step if type(step) is int and step == self._last_step else _whole("step", step, *_I64)

    def _row_step(self, step: int) -> int:
        """``step`` as an int, once the rows of an earlier step are done with (an automatic commit may follow)."""
        step = self._as_step(step)
        if step != self._last_step:
            self._at_step(step)
        if self._segment_manifest is not None and self._segment_manifest["first_step"] is None:
            self._segment_manifest["first_step"] = step
        return step

    def _add(self, site: SiteHandle, step: int, phase: str, micro: int | None, presence: int,
             summary: Summary | None) -> None:
        """Buffer one row (the collector adds hundreds a step: the common case takes the shortest path)."""
        if self._closed or self._failed is not None:
            self._check_open()
        self._check_site(site)
        micro = MICRO_ALL if micro is None else _whole("micro", micro, 0, MICRO_ALL - 1)
        code = _PHASE_CODES.get(phase) if type(phase) is str else None
        if code is None:
            code = Phase.code(phase)
        step = self._as_step(step)
        sid = site.id
        if micro == MICRO_ALL:
            whole = sid < self._whole_has.shape[1]
            if whole and self._whole_has[code, sid] and self._whole_last[code, sid] == step:
                self._refuse_duplicate(site, step, code, micro, presence)
        elif self._micro_last.get((sid, code, micro)) == step:
            self._refuse_duplicate(site, step, code, micro, presence)
        step = self._row_step(step)  # (last: a refused call records nothing, not even its step)
        row = (step, 1, micro, code, presence, summary)
        key = (sid, self.segment)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = []
        buf.append(row)
        if micro != MICRO_ALL:
            self._micro_last[(sid, code, micro)] = step
        else:
            if not whole:
                self._grow_whole(sid + 1)
            self._whole_last[code, sid] = step
            self._whole_has[code, sid] = True
        if len(buf) >= _FLUSH_ROWS:
            self._flush_site(*key)

    def _grow_whole(self, n: int) -> None:
        """Room for site ids below ``n`` in the whole-step rows' last steps."""
        have = self._whole_has.shape[1]
        if n > have:
            size = max(n, 2 * have, 64)
            last = np.zeros((len(Phase.NAMES), size), np.int64)
            has = np.zeros((len(Phase.NAMES), size), bool)
            last[:, :have], has[:, :have] = self._whole_last, self._whole_has
            self._whole_last, self._whole_has = last, has

    def _refuse_duplicate(self, site: SiteHandle, step: int, phase: int, micro: int, presence: int,
                          why: str = "the last row written for it is at that step already") -> None:
        """Refuse a row whose identity (spec 2.8) repeats the last row of its site, phase and micro-batch."""
        where = f"{site.path!r} [{site.stream}{'' if site.facet is None else ':' + site.facet}]"
        what = (f", phase {Phase.name(phase)}" if phase else "") + (
            f", micro-batch {micro}" if micro != MICRO_ALL else "")
        row = "an observation" if presence == Presence.OBSERVED else f"a row marked {Presence.name(presence)}"
        raise UsageError(
            f"{row} of {where} at step {step}{what} in segment {self.segment}: {why}. A row's identity (site, "
            "segment, step, span, phase, micro-batch; spec 2.8) is written once: a second row would be read as "
            "another observation, and merge would add both. Record each step once (observe() or mark(), not both); "
            "micro-batches take micro=, steps run again new_segment(); nothing of this call was recorded",
            code="duplicate_row", path=self.path)

    def observe(
        self,
        site: SiteHandle,
        step: int,
        values: npt.ArrayLike | None = None,
        *,
        summary: Summary | None = None,
        phase: str = "default",
        micro: int | None = None,
        sketch: bool = True,
        dtype: str | None = None,
    ) -> None:
        """Record one observation: give ``values`` (reduced here, exactly) or a precomputed ``summary``. A summary
        whose ``sum_method`` is ``SumMethod.UNKNOWN`` states that its sums are unknown: they are stored as zero
        (spec 5.4), whatever it holds."""
        if (values is None) == (summary is None):
            raise UsageError(f"observe() takes exactly one of values= (an array to reduce) or summary= (a Summary), "
                             f"got {'both' if values is not None else 'neither'}")
        if summary is not None and not isinstance(summary, Summary):
            raise UsageError(f"observe()'s summary= must be a trainhist.Summary, not {type(summary).__name__}")
        if summary is None:
            assert values is not None  # (exactly one of them is given)
            summary = summarize(values, dtype=dtype, sketch=sketch)
        else:
            if (_is_method(summary.sum_method) and summary.sum_method == SumMethod.UNKNOWN  # (others: refused below)
                    and (summary.sum is not ZERO or summary.sumsq is not ZERO)):
                summary = dataclasses.replace(summary, sum=ZERO, sumsq=ZERO)  # (no number is made of them)
            _check_summary(summary)
        self._add(site, step, phase, micro, Presence.OBSERVED, summary)

    def observe_spines(self, sites: Sequence[SiteHandle], step: int, table: SpineTable, *,
                       phases: Sequence[str] | None = None) -> None:
        """Record row ``i`` of ``table`` as the observation of ``sites[i]`` at ``step`` (in ``phases[i]``, default
        ``"default"``): the file holds what :meth:`observe` with each row's :class:`Summary` writes, for a fraction
        of the cost per site (a collector records hundreds of spines a step)."""
        if self._closed or self._failed is not None:
            self._check_open()
        if not isinstance(table, SpineTable):
            raise UsageError(f"observe_spines()'s table must be a trainhist.summary.SpineTable (one column per "
                             f"field, one row per site), not {type(table).__name__}; for one Summary use observe()")
        n = _table_rows(table)
        for name, value in (("sites", sites), ("phases", phases)):
            if value is not None and (isinstance(value, (str, bytes)) or not hasattr(value, "__len__")
                                      or np.ndim(value) != 1):
                raise UsageError(f"observe_spines()'s {name} must be a list (one per table row), got "
                                 f"{type(value).__name__} {_short(value)}", code="bad_value")
        if len(sites) != n or (phases is not None and len(phases) != n):
            raise UsageError(f"observe_spines() needs one site{' and one phase' if phases is not None else ''} per "
                             f"table row: {len(sites)} sites{f', {len(phases)} phases' if phases is not None else ''}"
                             f" for {n} rows")
        if not n:
            return
        if n >> _ROW_BITS:
            raise UsageError(f"observe_spines() takes fewer than 2**{_ROW_BITS} rows a call, not {n}")
        spines = _Spines(table)
        codes = [_PHASE_CODES.get(p) if type(p) is str else None for p in phases] if phases is not None else None
        if codes is not None and None in codes:
            codes = [Phase.code(p) for p in phases]  # type: ignore[union-attr]  # (raises for an unknown phase)
        handles = self._handles
        for site in sites:
            if type(site) is not SiteHandle or handles.get(site.id) is not site:  # (_check_site's first test)
                self._check_site(site)
        step = self._as_step(step)
        ids = np.fromiter(map(_id_of, sites), np.int64, n)
        ph = np.zeros(n, np.int64) if codes is None else np.asarray(codes, np.int64)
        self._grow_whole(int(ids.max()) + 1)
        dup = self._whole_has[ph, ids] & (self._whole_last[ph, ids] == step)
        if dup.any():
            i = int(np.flatnonzero(dup)[0])
            self._refuse_duplicate(sites[i], step, int(ph[i]), MICRO_ALL, Presence.OBSERVED,
                                   f"row {i} of the table repeats the last row written for it, at that step")
        keys = ids * len(Phase.NAMES) + ph
        order = np.argsort(keys, kind="stable")
        same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
        if same.size:  # (one site and phase twice in one call: rows a < b of the table)
            a, b = int(order[same[0]]), int(order[same[0] + 1])
            self._refuse_duplicate(sites[b], step, int(ph[b]), MICRO_ALL, Presence.OBSERVED,
                                   f"rows {a} and {b} of the table are both of it")
        step = self._row_step(step)
        default = _PHASE_CODES["default"]
        buffers, segment = self._buffers, self.segment
        ref = len(self._tables) << _ROW_BITS
        self._tables.append(spines)
        full: list[tuple[tuple[int, int], list[tuple]]] = []  # buffers that reached _FLUSH_ROWS, as observe cuts them
        observed, flush = Presence.OBSERVED, _FLUSH_ROWS
        # (every row is buffered before any is written; the sites' ids as ``ids`` holds them)
        for i, (sid, code) in enumerate(zip(ids.tolist(), repeat(default, n) if codes is None else codes)):
            key = (sid, segment)
            buf = buffers.get(key)
            if buf is None:
                buf = buffers[key] = []
            buf.append((step, 1, MICRO_ALL, code, observed, ref | i))
            if len(buf) == flush:
                full.append((key, buf))
                buffers[key] = []
        self._whole_last[ph, ids] = step
        self._whole_has[ph, ids] = True
        for k, (key, rows) in enumerate(full):
            try:
                self._write_rows(*key, rows)
            except BaseException:  # the rows not written yet stay buffered, before the later ones
                for key2, rows2 in reversed(full[k:]):
                    buffers[key2] = rows2 + buffers.get(key2, [])
                raise

    def mark(self, site: SiteHandle, step: int, presence: str, *, phase: str = "default",
             micro: int | None = None) -> None:
        """Record that ``site`` has no numbers at ``step``, and why (absent, not_scheduled, failed, ...)."""
        code = Presence.code(presence)
        if code == Presence.OBSERVED:
            raise UsageError("mark() records missing observations; use observe() for data")
        self._add(site, step, phase, micro, code, None)

    def scalar(self, name: str, step: int, value: float) -> None:
        """Record a run-level number (loss, lr, grad norm, ...) as a one-element observation of a scalar site."""
        _text("scalar()'s name", name)
        v = _real(f"scalar {name!r}", value)
        # (a scalar site the loop declared, with its own sharing, is looked up as it is: not declared again)
        s = self._sites.get((name, "scalar", None))
        if s is None:
            s = self.site(name, "scalar", cadence_sketch=0)
        if math.isfinite(v):
            d = Dyadic.from_float(v)
            summ = Summary(count=1, zero=int(v == 0), min=v, max=v, sum=d, sumsq=Dyadic.make(d.m * d.m, 2 * d.e))
        else:
            summ = Summary(count=1, nan=int(math.isnan(v)), pinf=int(v == math.inf), ninf=int(v == -math.inf))
        self._add(s, step, "default", None, Presence.OBSERVED, summ)

    def step_truth(
        self,
        step: int,
        *,
        applied: bool | str | None = None,
        loss_scale: float | None = None,
        grad_basis: str | None = None,
        clipped: bool | str | None = None,
        clip_threshold: float | None = None,
        micro_batches: int | None = None,
        tokens: int | None = None,
        samples: int | None = None,
    ) -> None:
        """Record what the loop can attest about ``step``; every ``None`` is stored as unknown. ``applied`` and
        ``clipped`` take a bool or the names the reader gives back (``"skipped"``, ``"not_clipped"``, ...)."""
        self._check_open()
        step = _whole("step", step, *_I64)
        _text("grad_basis", grad_basis, none=True)
        row = (  # (every value checked before the step counts: a refused call records nothing)
            step,
            _tristate(Applied, "applied", applied),
            GradBasis.code(grad_basis or "unknown"),
            _tristate(Clipped, "clipped", clipped),
            CANONICAL_NAN if loss_scale is None else _real("loss_scale", loss_scale),
            CANONICAL_NAN if clip_threshold is None else _real("clip_threshold", clip_threshold),
            0 if micro_batches is None else _whole("micro_batches", micro_batches, 0, (1 << 32) - 1),  # (0: unknown)
            U64_UNKNOWN if tokens is None else _whole("tokens", tokens, 0, U64_UNKNOWN - 1),
            U64_UNKNOWN if samples is None else _whole("samples", samples, 0, U64_UNKNOWN - 1),
        )
        self._at_step(step)
        self._steps.setdefault(self.segment, []).append(row)

    def new_segment(self, first_step: int | None, reason: str = "manual") -> int:
        """Start a new segment (a resume): rows after this belong to it; boundaries are never merged away."""
        self._check_open()
        # (checked now: the segment manifest is written with the segment's first rows, and a value refused then
        # would fail that commit instead of this call)
        if first_step is not None:
            first_step = _whole("first_step", first_step, *_I64)
        if type(reason) is not str or reason not in _SEGMENT_REASONS:
            raise UsageError(f"reason must be one of {', '.join(_SEGMENT_REASONS)}, got {reason!r}", code="bad_value")
        if self.segment >= 0:
            self.commit()
        if self._segment_manifest is not None:  # the current segment recorded nothing: replace it
            seg, self._previous_segment = self.segment, self._segment_manifest["previous"]
        else:
            seg = self._next_segment
            self._next_segment += 1
        self._segment_manifest = {
            "kind": "segment", "id": seg, "first_step": first_step, "reason": reason,
            "previous": self._previous_segment, "writer_id": self.writer_id, "created": self._now(),
        }
        self._previous_segment = seg
        self.segment = seg
        self._whole_has[:] = False  # (a new segment: no row of it yet)
        self._micro_last.clear()
        return seg

    def _flush_site(self, sid: int, segment: int) -> None:
        try:
            buf = self._buffers.pop((sid, segment), None)
            if buf:
                self._write_rows(sid, segment, buf)
        except Exception:  # (rows that cannot be encoded: refused, the file as it was)
            raise
        except BaseException as e:  # (an interrupt: the rows may be neither buffered nor written)
            if self._mark is None:  # (else: commit() takes the commit back)
                self._fail(e)
            raise

    def _write_rows(self, sid: int, segment: int, rows: list[tuple]) -> None:
        """Write ``rows`` of one (site, segment) as a chunk."""
        self._write_segment_manifest()
        payload, lo, hi = encode_obs_rows(rows, sid, segment, self._codec, self._tables)
        self._record(RecordType.OBS, payload, site=sid, segment=segment, rows=len(rows), steps=(lo, hi))

    def _write_segment_manifest(self) -> None:
        doc = self._segment_manifest
        if doc is not None:
            payload = _encode_manifest(doc)  # (kept until written: a failure here leaves the segment to declare)
            try:  # (written and still pending, it would be declared twice by the next commit)
                self._record(RecordType.MANIFEST, payload)
                self._segment_manifest = None
            except BaseException as e:
                if isinstance(e, Exception) or self._mark is None:  # (else: commit() takes the commit back)
                    self._fail(e)
                raise

    def _flush_all(self) -> None:
        """Write every buffered row, one chunk per (site, segment) in that order, the chunks encoded together in
        groups of at most :data:`GROUP_ROWS` rows (so a commit's extra memory stays bounded)."""
        group: list[tuple[int, int]] = []
        rows = 0
        for key in sorted(self._buffers):
            group.append(key)
            rows += len(self._buffers[key])
            if rows >= GROUP_ROWS:
                self._flush_group(group)
                group, rows = [], 0
        if group:
            self._flush_group(group)

    def _flush_group(self, keys: list[tuple[int, int]]) -> None:
        try:
            encoded = encode_obs_chunks([(self._buffers[k], *k) for k in keys], self._codec, self._tables)
        except Exception:  # noqa: BLE001 -- raised again below, by the chunk that cannot be encoded
            encoded = None
        if encoded is None:
            # chunk by chunk instead (outside the handler: the error is not shown twice): the first chunk that
            # cannot be encoded raises, after the chunks before it were written, as when each is flushed on its own
            for sid, segment in keys:
                self._flush_site(sid, segment)
            return
        self._write_segment_manifest()
        for (sid, segment), (payload, lo, hi) in zip(keys, encoded):
            rows = self._buffers.pop((sid, segment))
            self._record(RecordType.OBS, payload, site=sid, segment=segment, rows=len(rows), steps=(lo, hi))

    def commit(self) -> None:
        """Write every buffered row and a commit record; after it returns, a reader sees all of it. Interrupted
        (Ctrl-C) before its commit record, it takes itself back (see :meth:`_take_back`): nothing is lost."""
        self._check_open()
        mark = self._marked()
        try:
            self._mark = mark
            self._commit()
        except Exception:  # (rows that cannot be encoded: refused; an I/O error has stopped the writer already)
            raise
        except BaseException as e:  # (an interrupt: records may be written that the buffers and entries still hold)
            if self._mark is None or not self._take_back():
                self._fail(e)
            raise
        finally:
            self._mark = None
        self._steps_since_commit = 0
        self._last_commit_time = time.monotonic()

    def _marked(self, rows: bool = True) -> tuple:
        """What :meth:`_take_back` restores: the file's end, the sequence, the entries, the buffers, tables and step
        rows (``rows``: copies, as a commit empties them), the segment manifest still to write."""
        if rows:
            return (self._offset, self._seq, len(self._entries), dict(self._buffers), self._tables, dict(self._steps),
                    self._segment_manifest)
        return (self._offset, self._seq, len(self._entries), self._buffers, self._tables, self._steps,
                self._segment_manifest)

    def _take_back(self) -> bool:
        """Undo a commit interrupted before its commit record, or a site's manifest (spec/crash-safety.md, writer
        obligations): the file cut to where it stood at :meth:`_marked` (only records no commit names are dropped),
        and the rows, tables, step rows and segment manifest being written buffered again. False when the file could
        not be cut."""
        assert self._mark is not None
        offset, seq, entries, buffers, tables, steps, manifest = self._mark
        self._mark = None
        try:
            self._f.seek(offset)  # (a buffered file writes what it holds first)
            self._f.truncate()
        except BaseException:  # noqa: BLE001 -- the caller raises the interrupt it was taking back
            return False
        self._offset, self._seq = offset, seq
        del self._entries[entries:]
        self._buffers, self._tables, self._steps, self._segment_manifest = buffers, tables, steps, manifest
        return True

    def _commit(self) -> None:
        self._flush_all()
        if not self._buffers:  # (no row refers to a table now)
            self._tables = []
        for segment, rows in sorted(self._steps.items()):
            self._write_segment_manifest()
            step = np.array([r[0] for r in rows], np.int64)
            cols = {
                name: (dt, np.array([r[i] for r in rows], dt))
                for i, (name, dt) in enumerate(
                    (("step", "i8"), ("applied", "u1"), ("grad_basis", "u1"), ("clipped", "u1"),
                     ("loss_scale", "f8"), ("clip_threshold", "f8"), ("micro_batches", "u4"), ("tokens", "u8"),
                     ("samples", "u8"))
                )
            }
            payload = encode_chunk({"segment": segment, "rows": len(rows)}, cols, self._codec)
            self._record(RecordType.STEPS, payload, segment=segment, rows=len(rows),
                         steps=(int(step.min()), int(step.max())))
        self._steps.clear()
        if self._entries:
            self._record(RecordType.COMMIT, pack_commit(self._seq, self._entries))
            self._entries = []
            self._sync(self._fsync == "commit")

    def close(self) -> None:
        """Commit what is buffered, sync, and close the file. Idempotent. A writer stopped by a failed write (see
        ``_fail``) commits nothing more: it only releases the file."""
        if self._closed:
            return
        try:
            if self._failed is None:  # (a writer that stopped writes nothing more: see _fail)
                self.commit()
                self._sync(self._fsync != "never")
        except BaseException as e:
            if not isinstance(e, Exception) and self._failed is None:  # an interrupted commit taken back: still
                raise  # open, holding its rows (close() again commits them)
            self._release()
            raise
        self._release()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has finished (an interrupted one leaves the writer open: call it again)."""
        return self._closed

    def _release(self) -> None:
        """Mark the writer closed, unlock the file and close it."""
        self._closed = True
        _unlock(self._f)
        if self._failed is None:
            self._f.close()
        else:  # (the error that stopped it was raised already: closing raises no second one)
            try:
                self._f.close()
            except OSError:
                pass

    def __enter__(self) -> "HistoryWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
