"""``trainhist.open``: read a history file without torch, recovering the committed prefix after a crash.

The reader follows the normative algorithm of spec section 8: walk the record headers, trust nothing it cannot
check, and end in one of three outcomes — clean end, torn tail after the last commit (the prefix is recovered
and what was dropped is reported), or corruption before the last commit (a typed error naming the offset).

Rows are read in batches (``History._batch``): the chunks of one site, or of the next sites when sites are read
in order, have their directories read together (``_directories_by_template``: one directory unpacked per
structure, the integers of the others read from their bytes at once) and checked on whole arrays
(``History._layout``), and each column of all of them is decoded with one set of numpy operations (``_gather``).
Whenever a batch check fails, the site is read again chunk by chunk (``History._site_chunks``), which raises
the error spec 8 names, with the offset of the first damaged record.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

import msgpack
import numpy as np
from crc32c import crc32c as _crc  # the same function as framing.crc32c, without a Python call around it

from .chunk import _FOR_WIDTHS, _RANGE, APPLIES, DTYPES, MAX_COLUMNS, MAX_META, MAX_ROWS, Chunk, Codec, decode_chunk
from .dyadic import Dyadic
from .errors import CorruptError, FormatError, UnsupportedError, UsageError
from .framing import (
    COMMIT_ENTRY,
    COMMIT_HEAD,
    FILE_HEADER_SIZE,
    FLAG_IGNORABLE,
    MAGIC,
    RECORD_HEADER_SIZE,
    WRITE_VERSION,
    FileHeader,
    RecordHeader,
    RecordType,
    crc32c,
    pad8,
)
from .model import (
    EXACT_COLUMNS,
    OBS_COLUMNS,
    PRIORITY,
    derive_presence,
    SKETCH_COLUMNS,
    STEPS_COLUMNS,
    STEPS_OPTIONAL_COLUMNS,
    TALLY_COLUMNS,
    U64_UNKNOWN,
    Applied,
    Clipped,
    GradBasis,
    Phase,
    Presence,
)
from .schemas import validate_manifest
from .summary import Sketch, Summary

__all__ = ["open_history", "History", "Site", "Segment", "Recovery", "SpineSeries", "SketchSeries"]

_OBS_KNOWN = {**OBS_COLUMNS, **EXACT_COLUMNS, **SKETCH_COLUMNS, **TALLY_COLUMNS}
_STEPS_KNOWN = {**STEPS_COLUMNS, **STEPS_OPTIONAL_COLUMNS}
_OBS_VARIABLE = frozenset({"sum_x", "sumsq_x", "sk_counts"})
_ENTRY_DTYPE = np.dtype([("offset", "<u8"), ("type", "<u2"), ("reserved", "<u2"), ("site", "<u4"),
                         ("segment", "<u4"), ("rows", "<u4"), ("step_min", "<i8"), ("step_max", "<i8")])
_REC = struct.Struct("<HHIQQII")
NO_ID = 0xFFFFFFFF


@dataclass(frozen=True)
class Site:
    """A site as declared by its manifest."""

    id: int
    path: str
    stream: str
    facet: str | None
    shape: tuple[int, ...] | None
    dtype: str | None
    sharing: str
    cadence_spine: int
    cadence_sketch: int
    sample: dict | None
    manifest: dict = field(compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str, str | None]:
        """The stable identity of a site across files: (path, stream, facet)."""
        return (self.path, self.stream, self.facet)


@dataclass(frozen=True)
class Segment:
    """A contiguous stretch of one writer's history (a resume starts a new one)."""

    id: int
    first_step: int | None
    reason: str
    previous: int | None
    writer_id: str
    manifest: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class Recovery:
    """How reading ended: ``clean``, or ``torn`` with what was dropped after the last commit and why."""

    status: str
    committed_bytes: int
    dropped_bytes: int
    dropped_records: int
    reason: str | None
    offset: int | None

    def describe(self) -> str:
        if self.status == "clean":
            return f"clean: {self.committed_bytes} bytes committed"
        return (
            f"torn tail recovered: kept {self.committed_bytes} committed bytes, dropped {self.dropped_bytes} bytes "
            f"({self.dropped_records} uncommitted records) from offset {self.offset}: {self.reason}"
        )


class _Entry(NamedTuple):
    """One committed obs or steps record, as its commit entry names it (the file's index)."""

    offset: int  # record header offset
    type: int
    site: int
    segment: int
    rows: int
    step_min: int
    step_max: int
    length: int
    payload_crc: int


class _Exact:
    """The exact-sum column of a series (spec 5.3), decoded and checked only when a row's exact value is asked for."""

    def __init__(self, name: str, rounded: np.ndarray, off: np.ndarray, n: np.ndarray, blob: bytes,
                 where: np.ndarray, path: str) -> None:
        self.name, self.rounded, self.off, self.n, self.blob, self.where, self.path = (
            name, rounded, off, n, blob, where, path)

    def get(self, i: int) -> Dyadic | None:
        n = int(self.n[i])
        if n == 0:
            return None
        o = int(self.off[i])
        try:
            d = Dyadic.from_bytes(self.blob[o : o + n])
        except ValueError as err:
            raise _bad(f"{self.name}_x: {err}", "bad_exact_value", self.path, int(self.where[i])) from None
        if d.to_float() != float(self.rounded[i]) and not (math.isnan(d.to_float()) and math.isnan(self.rounded[i])):
            raise _bad(f"{self.name} is not the correctly rounded value of {self.name}_x", "bad_exact_value",
                       self.path, int(self.where[i]))
        return d

    def take(self, keep: np.ndarray, rounded: np.ndarray) -> "_Exact":
        return _Exact(self.name, rounded, self.off[keep], self.n[keep], self.blob, self.where[keep], self.path)


@dataclass
class SpineSeries:
    """One site's rows (optionally one phase), as numpy columns; only ``observed`` rows carry numbers."""

    site: Site
    columns: dict[str, np.ndarray]
    _x: dict[str, _Exact] = field(repr=False)

    def __len__(self) -> int:
        return int(self.columns["step"].size)

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["columns"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def presence_names(self) -> list[str]:
        return [Presence.name(int(c)) for c in self.columns["presence"]]

    @property
    def observed(self) -> np.ndarray:
        return self.columns["presence"] == Presence.OBSERVED

    @property
    def finite(self) -> np.ndarray:
        c = self.columns
        return c["count"] - c["nan"] - c["pinf"] - c["ninf"]

    def _derived(self, values: np.ndarray) -> np.ndarray:
        out = np.full(len(self), np.nan)
        ok = self.observed & (self.finite > 0)
        out[ok] = values[ok]
        return out

    @property
    def mean(self) -> np.ndarray:
        """Mean of the finite values (NaN where nothing finite was observed); a derived float."""
        with np.errstate(all="ignore"):
            return self._derived(self.columns["sum"] / self.finite)

    @property
    def rms(self) -> np.ndarray:
        """Root mean square of the finite values; a derived float."""
        with np.errstate(all="ignore"):
            return self._derived(np.sqrt(self.columns["sumsq"] / self.finite))

    @property
    def exact(self) -> dict[str, list[Dyadic | None]]:
        """Per row, the exact value stored beside the rounded f64 (None where the f64 is exact); all checked."""
        return {k: [x.get(i) for i in range(len(self))] for k, x in self._x.items()}

    def sum_exact(self, i: int) -> Dyadic:
        """The exact stored sum of row ``i``."""
        x = self._x["sum"].get(i)
        return x if x is not None else Dyadic.from_float(float(self.columns["sum"][i]))

    def sumsq_exact(self, i: int) -> Dyadic:
        """The exact stored sum of squares of row ``i``."""
        x = self._x["sumsq"].get(i)
        return x if x is not None else Dyadic.from_float(float(self.columns["sumsq"][i]))

    def summary(self, i: int, sketch: Sketch | None = None) -> Summary:
        """Row ``i`` as a :class:`Summary` (for merging and re-writing)."""
        c = self.columns
        return Summary(
            count=int(c["count"][i]), nan=int(c["nan"][i]), pinf=int(c["pinf"][i]), ninf=int(c["ninf"][i]),
            zero=int(c["zero"][i]), min=float(c["min"][i]), max=float(c["max"][i]), sum=self.sum_exact(i),
            sumsq=self.sumsq_exact(i), sum_method=int(c["method"][i]), sketch=sketch,
        )


class _Patched:
    """Sketch counts as stored by the patched-bytes codec (spec 7.3), already checked: the code bytes of each block
    (ranges of the file) and the exceptions; widened to u64 on first use, so a scan that does not look at the bins
    never copies or widens them."""

    def __init__(self, view: memoryview, start: list[int], end: list[int], exc: np.ndarray) -> None:
        self.view, self.start, self.end, self.exc = view, start, end, exc
        self.size = sum(end) - sum(start)
        self._wide: np.ndarray | None = None

    def widen(self) -> np.ndarray:
        if self._wide is None:
            codes = np.frombuffer(_join(self.view, self.start, self.end), np.uint8) if self.start else \
                np.zeros(0, np.uint8)
            out = codes.astype(np.uint64)
            if self.exc.size:
                out[np.flatnonzero(codes == 255)] = self.exc
            self._wide = out
        return self._wide


class _Sparse(NamedTuple):
    """Sketch rows as stored: per row the positive range ``(plo, pn)`` and the negative range ``(nlo, nn)`` of bin
    counts, which begin at ``start`` in ``counts`` (positive first); the bands per row."""

    scale: int
    counts: "np.ndarray | _Patched"  # u64 values, or their stored bytes widened on demand (:meth:`values`)
    start: np.ndarray  # i64 per row
    plo: np.ndarray  # i64 per row
    pn: np.ndarray
    nlo: np.ndarray
    nn: np.ndarray
    bands: tuple[np.ndarray, ...]  # under_pos, under_neg, over_pos, over_neg: u64 per row

    def values(self) -> np.ndarray:
        c = self.counts
        return c.widen() if isinstance(c, _Patched) else c

    def take(self, sel: np.ndarray) -> "_Sparse":
        return _Sparse(self.scale, self.counts, self.start[sel], self.plo[sel], self.pn[sel], self.nlo[sel],
                       self.nn[sel], tuple(b[sel] for b in self.bands))

    @staticmethod
    def empty(scale: int = 2) -> "_Sparse":
        z = np.zeros(0, np.int64)
        return _Sparse(scale, np.zeros(0, np.uint64), z, z, z, z, z, (np.zeros(0, np.uint64),) * 4)

    @staticmethod
    def concat(parts: list["_Sparse"]) -> "_Sparse":
        if not parts:
            return _Sparse.empty()
        if len(parts) == 1:
            return parts[0]
        shift = np.cumsum([0] + [p.counts.size for p in parts[:-1]])
        return _Sparse(
            parts[0].scale, np.concatenate([p.values() for p in parts]),
            np.concatenate([p.start + k for p, k in zip(parts, shift.tolist())]),
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("plo", "pn", "nlo", "nn")),
            tuple(np.concatenate([p.bands[j] for p in parts]) for j in range(4)),
        )

    def dense(self, side: int) -> np.ndarray:
        """(rows, bins) u64 counts of the positive (0) or negative (1) side."""
        from .grid import nbins

        nb = nbins(self.scale)
        rows = self.start.size
        out = np.zeros((rows, nb), np.uint64)
        lo, n = (self.plo, self.pn) if side == 0 else (self.nlo, self.nn)
        first = self.start if side == 0 else self.start + self.pn
        total = int(n.sum())
        if total:
            k = np.arange(total, dtype=np.int64)
            before = np.cumsum(n) - n  # values of earlier rows on this side
            base = np.arange(rows, dtype=np.int64) * nb
            out.reshape(-1)[np.repeat(base + lo - before, n) + k] = self.values()[np.repeat(first - before, n) + k]
        return out


class SketchSeries:
    """Sketches of one site: ``pos``/``neg`` are (rows, bins) uint64 counts (built on first use from the stored
    ranges), ``bands`` (rows, 4); ``columns`` holds ``step`` etc. per row. :meth:`sketch` builds one row."""

    def __init__(self, site: Site, columns: dict[str, np.ndarray], sparse: _Sparse) -> None:
        self.site = site
        self.scale = sparse.scale
        self.columns = columns
        self._sparse = sparse
        self._dense: dict[int, np.ndarray] = {}

    def __repr__(self) -> str:
        return f"SketchSeries(site={self.site.key}, scale={self.scale}, rows={len(self)})"

    def __len__(self) -> int:
        return int(self._sparse.start.size)

    @property
    def bands(self) -> np.ndarray:
        """(rows, 4) u64: under_pos, under_neg, over_pos, over_neg."""
        if 2 not in self._dense:
            self._dense[2] = np.stack(self._sparse.bands, axis=1)
        return self._dense[2]

    @property
    def pos(self) -> np.ndarray:
        if 0 not in self._dense:
            self._dense[0] = self._sparse.dense(0)
        return self._dense[0]

    @property
    def neg(self) -> np.ndarray:
        if 1 not in self._dense:
            self._dense[1] = self._sparse.dense(1)
        return self._dense[1]

    @property
    def stored_values(self) -> int:
        """Number of bin counts stored for these rows (the ranges' total length)."""
        return int(self._sparse.pn.sum() + self._sparse.nn.sum())

    def sketch(self, i: int) -> Sketch:
        from .grid import nbins

        sp = self._sparse
        b = [int(c[i]) for c in sp.bands]
        nb = nbins(self.scale)
        st, plo, pn, nlo, nn = (int(sp.start[i]), int(sp.plo[i]), int(sp.pn[i]), int(sp.nlo[i]), int(sp.nn[i]))
        pos, neg = np.zeros(nb, np.uint64), np.zeros(nb, np.uint64)
        counts = sp.values()
        pos[plo : plo + pn] = counts[st : st + pn]
        neg[nlo : nlo + nn] = counts[st + pn : st + pn + nn]
        return Sketch(self.scale, pos, neg, int(b[0]), int(b[1]), int(b[2]), int(b[3]))



_UNPACK_OPTIONS = dict(raw=True, strict_map_key=True, max_bin_len=0, max_ext_len=0, max_str_len=4096,
                       max_array_len=4096, max_map_len=64)


def _check_meta(meta: Any, e: _Entry) -> list:
    """The ``cols`` of a directory unpacked with byte strings, if it agrees with the commit entry and holds only
    the keys of spec 7.2; names and dtypes must then equal those of a layout that passed ``History.chunk``, so
    nothing ``chunk`` refuses gets through."""
    cols = meta[b"cols"]
    if (type(cols) is not list or type(meta[b"rows"]) is not int or meta[b"rows"] != e.rows
            or meta.get(b"segment") != e.segment or meta.get(b"site") != e.site or len(cols) > MAX_COLUMNS
            or not meta.keys() <= _META_KEYS):
        raise _Fallback
    return cols


def _directories_unpacked(dirs: list[memoryview], entries: list[_Entry]) -> tuple:
    """(names, dtypes, (columns, 4) table of codec/offset/stored/raw, columns per chunk, scales) of the
    directories, each unpacked by msgpack."""
    unpackb = msgpack.unpackb
    cols_list, scales = [], []
    for d, e in zip(dirs, entries):
        meta = unpackb(d, **_UNPACK_OPTIONS)
        cols_list.append(_check_meta(meta, e))
        scales.append(meta.get(b"scale"))
    n_entries = sum(map(len, cols_list))
    # entries that are not 6-element lists misalign the slices below: an int where a name belongs, or a name
    # where an int belongs, which the layout and integer checks refuse
    vals = list(chain.from_iterable(chain.from_iterable(cols_list)))
    if len(vals) != 6 * n_entries:
        raise _Fallback
    ints = vals[2::6] + vals[3::6] + vals[4::6] + vals[5::6]
    if set(map(type, ints)) != {int}:
        raise _Fallback
    t = np.array(ints, np.int64).reshape(4, n_entries).T  # OverflowError beyond 2**63: chunk() decides
    return vals[0::6], vals[1::6], t, np.array([len(c) for c in cols_list], np.int64), scales


_INT_WIDTH = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def _int_positions(d: bytes) -> list[tuple[int, int]] | None:
    """Where the integers of a MessagePack object are: (position of the value bytes, width; 0 for a positive
    fixint, whose byte is the value), if the object uses only maps, arrays, strings and unsigned integers and
    ends exactly at the end of ``d``; else None."""
    out: list[tuple[int, int]] = []
    pos, pending, n = 0, 1, len(d)
    while pending:
        if pos >= n:
            return None
        b = d[pos]
        pending -= 1
        if b <= 0x7F:
            out.append((pos, 0))
            pos += 1
        elif b <= 0x8F:
            pending += 2 * (b & 0x0F)
            pos += 1
        elif b <= 0x9F:
            pending += b & 0x0F
            pos += 1
        elif b <= 0xBF:
            pos += 1 + (b & 0x1F)
        elif b in _INT_WIDTH:
            out.append((pos + 1, _INT_WIDTH[b]))
            pos += 1 + _INT_WIDTH[b]
        elif b == 0xD9 and pos + 1 < n:
            pos += 2 + d[pos + 1]
        elif b in (0xDA, 0xDC, 0xDE) and pos + 2 < n:
            k = int.from_bytes(d[pos + 1 : pos + 3], "big")
            if b == 0xDA:
                pos += 3 + k
            else:
                pending += k if b == 0xDC else 2 * k
                pos += 3
        else:
            return None
    return out if pos == n else None


def _directories_by_template(dirs: list[memoryview], entries: list[_Entry]) -> tuple | None:
    """What :func:`_directories_unpacked` returns, without unpacking every directory: directories of one length
    are compared with the first of them, unpacked, as a template. A directory whose bytes equal the template's
    everywhere except in the value bytes of its integers (same type bytes, a positive fixint still one) is the
    same MessagePack structure with other integers, which are read for all such directories at once. None when
    some directory does not match (the caller unpacks them all)."""
    n = len(dirs)
    lengths = np.fromiter((len(d) for d in dirs), np.int64, n)
    todo = [np.flatnonzero(lengths == length) for length in np.unique(lengths).tolist()]
    per_chunk_names: list = [None] * n
    per_chunk_dts: list = [None] * n
    scales: list = [None] * n
    ncols = np.zeros(n, np.int64)
    parts = []
    templates = 0
    while todo:
        idx = todo.pop()
        templates += 1
        if templates > 16:
            return None
        first = int(idx[0])
        tpl = bytes(dirs[first])
        meta = msgpack.unpackb(tpl, **_UNPACK_OPTIONS)
        cols = _check_meta(meta, entries[first])
        where = _int_positions(tpl)
        if where is None or any(type(c) is not list or len(c) != 6 or type(c[0]) is not bytes
                                or type(c[1]) is not bytes for c in cols):
            return None
        # the integers in byte order: one per map value that is an integer, four per column entry
        order: list = []
        for key, value in meta.items():
            if key == b"cols":
                order.extend((j, f) for j in range(len(cols)) for f in range(4))
                if any(type(v) is not int for c in cols for v in c[2:]):
                    return None
            elif type(value) is int:
                order.append(key)
            else:
                return None
        if len(order) != len(where):
            return None
        k = len(cols)
        length = len(tpl)
        dmat = np.frombuffer(b"".join([dirs[i] for i in idx.tolist()]), np.uint8).reshape(idx.size, length)
        literal = np.ones(length, bool)
        for p, w in where:
            literal[p : p + max(w, 1)] = False
        ref = np.frombuffer(tpl, np.uint8)
        fix = [j for j, (p, w) in enumerate(where) if w == 0]
        fixcol = dmat[:, [where[j][0] for j in fix]]
        match = (dmat[:, literal] == ref[literal]).all(axis=1) & (fixcol <= 0x7F).all(axis=1)
        if not match.all():  # another structure of the same length: its own template, later
            todo.append(idx[~match])
            idx, dmat, fixcol = idx[match], dmat[match], fixcol[match]
        vals = np.zeros((idx.size, len(where)), np.uint64)
        if fix:
            vals[:, fix] = fixcol
        for w in (1, 2, 4, 8):
            js = [j for j, (p, ww) in enumerate(where) if ww == w]
            if js:
                acc = np.zeros((idx.size, len(js)), np.uint64)
                for b in range(w):
                    acc = (acc << np.uint64(8)) | dmat[:, [where[j][0] + b for j in js]]
                vals[:, js] = acc
        if (vals >> np.uint64(63)).any():
            return None  # beyond i64: chunk() decides
        vals = vals.view(np.int64)
        pos_of = {o: j for j, o in enumerate(order)}
        rows = np.array([entries[i].rows for i in idx.tolist()], np.int64)
        seg = np.array([entries[i].segment for i in idx.tolist()], np.int64)
        site = np.array([entries[i].site for i in idx.tolist()], np.int64)
        for key, want in ((b"rows", rows), (b"segment", seg), (b"site", site)):
            if key not in pos_of or (vals[:, pos_of[key]] != want).any():
                return None
        sc = vals[:, pos_of[b"scale"]].tolist() if b"scale" in pos_of else [None] * idx.size
        names_t = tuple(c[0] for c in cols)
        dts_t = tuple(c[1] for c in cols)
        for i, v in zip(idx.tolist(), sc):
            per_chunk_names[i], per_chunk_dts[i], scales[i] = names_t, dts_t, v
        ncols[idx] = k
        table = vals[:, [pos_of[(j, f)] for j in range(k) for f in range(4)]].reshape(idx.size * k, 4)
        parts.append((idx, k, table))
    first_row = np.cumsum(ncols) - ncols
    t = np.zeros((int(ncols.sum()), 4), np.int64)
    for idx, k, table in parts:
        t[(first_row[idx][:, None] + np.arange(k)).ravel()] = table
    names = list(chain.from_iterable(per_chunk_names))
    dts = list(chain.from_iterable(per_chunk_dts))
    return names, dts, t, ncols, scales


# (column names, dtypes) of obs chunk directories that passed every check of History.chunk -> item size per
# column (negated for variable-length columns)
_LAYOUTS_OK: dict[tuple, list[int]] = {}
_DT_INDEX = {d: i for i, d in enumerate(DTYPES)}
_META_KEYS = frozenset({b"site", b"segment", b"rows", b"scale", b"cols"})
_APPLIES = np.array([[d in APPLIES.get(c, ()) for c in range(max(Codec.STORED) + 1)] for d in DTYPES])


class _Fallback(Exception):
    """The batched decode met something the per-chunk path must judge (it names the error and the offset)."""


_TALLY_SET = frozenset(TALLY_COLUMNS)
#: reading sites in id order decodes the next ones with the current one, up to this many bytes of chunks or sites
_READAHEAD_BYTES = 32 << 20
_READAHEAD_SITES = 64


def _gather(view: memoryview, col: "_Col", dt: str, ns: list[int]) -> np.ndarray:
    """A column of every chunk of a site (``ns[i]`` values in chunk ``i``; zeros where a chunk lacks it),
    concatenated in order. Consecutive chunks with one codec (and frame-of-reference width) are decoded at once:
    their blocks are joined and decoded with one set of numpy operations, checked as in spec 7.3; a failed
    check raises :class:`_Fallback`."""
    codec = col.codec
    if col.uniform:
        if codec[0] == Codec.FOR:
            n = ns[0]
            w = (col.slen[0] - 8) // n if n else -1
            key = (3, w)
            if col.slen != [8 + w * m for m in ns]:
                return _gather_runs(view, col, dt, ns)
        else:
            key = codec[0]
        return _decode_run(view, col.start, col.slen, ns, key, dt, col, 0)
    return _gather_runs(view, col, dt, ns)


def _gather_runs(view: memoryview, col: "_Col", dt: str, ns: list[int]) -> np.ndarray:
    keys = [c if c != Codec.FOR else (3, (sl - 8) // n if n else -1) for c, sl, n in zip(col.codec, col.slen, ns)]
    parts, a = [], 0
    for b in range(1, len(keys) + 1):
        if b == len(keys) or keys[b] != keys[a]:
            parts.append(_decode_run(view, col.start[a:b], col.slen[a:b], ns[a:b], keys[a], dt, col, a))
            a = b
    return np.concatenate(parts)


def _join(view: memoryview, start: list[int], end: list[int]) -> bytes | memoryview | np.ndarray:
    """The bytes ``[start[i], end[i])`` of the file, concatenated: small blocks (a few bytes per chunk, such as the
    bases of frame-of-reference blocks) by one indexed gather, larger ones by joining slices."""
    n = len(start)
    if n == 1:
        return view[start[0] : end[0]]
    s = np.array(start, np.int64)
    size = np.array(end, np.int64) - s
    total = int(size.sum())
    if total <= 64 * n:
        return np.frombuffer(view, np.uint8)[np.repeat(s - (np.cumsum(size) - size), size) + np.arange(total)]
    return b"".join([view[a:b] for a, b in zip(start, end)])


def _decode_run(view: memoryview, start: list[int], slen: list[int], ns: list[int], key: Any, dt: str,
                col: "_Col", first: int) -> np.ndarray:
    dtype = DTYPES[dt]
    if key == -1:
        return np.zeros(sum(ns), dtype)
    codec = key if isinstance(key, int) else key[0]
    end = [a + b for a, b in zip(start, slen)]
    if codec == Codec.RAW:
        return np.frombuffer(_join(view, start, end), dtype)
    if codec == Codec.FOR:
        w = key[1]
        ns_a = np.array(ns, np.int64)
        if w not in _FOR_WIDTHS or ns_a.min() < 1 or (np.array(slen, np.int64) != 8 + ns_a * w).any():
            raise _Fallback
        signed = dt[0] == "i"
        base_end = [a + 8 for a in start]
        bases = np.frombuffer(_join(view, start, base_end), "<i8" if signed else "<u8")
        lo, hi = _RANGE[dt]
        if (bases.min() < lo) or (bases.max() > hi):  # numpy compares i8 with i8 and u8 with u8 ranges exactly
            raise _Fallback
        if w == 0:
            out = np.repeat(bases if dt in ("u8", "i8") else bases.astype(dtype), ns_a)
            return out
        offs = np.frombuffer(_join(view, base_end, end), _FOR_WIDTHS[w])
        top = np.maximum.reduceat(offs, np.cumsum(ns_a) - ns_a).astype(np.uint64)
        # hi - base, exact in u64 because lo <= base <= hi; every value base + offset must not pass hi
        room = np.uint64(hi & 0xFFFFFFFFFFFFFFFF) - bases.view(np.uint64)
        if (top > room).any():
            raise _Fallback
        if dt in ("u8", "i8"):
            out = np.repeat(bases.view(np.uint64), ns_a)
            np.add(out, offs, out=out, casting="unsafe")  # exact: every sum lies in the range just checked
            return out.view(np.int64) if signed else out
        out = np.repeat(bases.astype(dtype), ns_a)  # narrow dtypes: base and every sum fit the dtype (checked)
        np.add(out, offs, out=out, casting="unsafe")
        return out
    if codec == Codec.F32:
        if (np.array(slen, np.int64) != 4 * np.array(ns, np.int64)).any():
            raise _Fallback
        a = np.frombuffer(_join(view, start, end), "<f4")
        nan = np.isnan(a)
        if nan.any() and (a.view("<u4")[nan] != 0x7FC00000).any():
            raise _Fallback
        return a.astype(np.float64)
    if codec == Codec.PATCHED:
        codes, exc, esc = _patched_parts(view, start, slen, ns, dtype.itemsize, dt)
        out = codes.astype(dtype)
        if exc.size:
            out[esc] = exc
        return out
    # deflate codecs: one chunk at a time, through Chunk.column
    return np.concatenate([col.chunk(first + i).column(col.name) for i in range(len(start))])


def _patched_checked(view: memoryview, start: list[int], slen: list[int], ns: list[int]
                     ) -> tuple[list[int], list[int], np.ndarray, list[int]]:
    """Patched-bytes u8 blocks checked as in spec 7.3 without joining their codes: (code ranges, their ends, the
    exceptions, exceptions before each block)."""
    ks = []
    for sl, n in zip(slen, ns):
        k, rem = divmod(sl - n, 8)
        if sl < n or rem:
            raise _Fallback
        ks.append(k)
    mid = [a + k * 8 for a, k in zip(start, ks)]
    end = [a + b for a, b in zip(start, slen)]
    buf = np.frombuffer(view, np.uint8)
    if [int(np.count_nonzero(buf[a:b] == 255)) for a, b in zip(mid, end)] != ks:
        raise _Fallback
    exc = np.frombuffer(_join(view, start, mid), "<u8") if sum(ks) else np.zeros(0, np.uint64)
    if exc.size and int(exc.min()) < 255:
        raise _Fallback
    return mid, end, exc, np.cumsum([0] + ks).tolist()


def _patched_parts(view: memoryview, start: list[int], slen: list[int], ns: list[int], size: int, dt: str
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, exceptions and escape positions of patched-bytes blocks, checked (spec 7.3): sizes, escapes per block, exceptions."""
    ks = []
    for sl, n in zip(slen, ns):
        k, rem = divmod(sl - n, size)
        if sl < n or rem:
            raise _Fallback
        ks.append(k)
    mid = [a + k * size for a, k in zip(start, ks)]
    codes = np.frombuffer(_join(view, mid, [a + b for a, b in zip(start, slen)]), np.uint8)
    esc = np.flatnonzero(codes == 255)
    if esc.size != sum(ks):
        raise _Fallback
    exc = np.frombuffer(_join(view, start, mid), DTYPES[dt]) if esc.size else np.zeros(0, DTYPES[dt])
    if esc.size and (int(exc.min()) < 255 or np.diff(np.searchsorted(esc, np.cumsum([0] + ns))).tolist() != ks):
        raise _Fallback
    return codes, exc, esc


class _Col:
    """One column's directory entries over a site's chunks: codec (-1 where a chunk lacks the column), the
    block's file offset, stored and raw lengths."""

    def __init__(self, layout: "_Layout", name: str, codec: list[int], start: list[int], slen: list[int],
                 rlen: list[int], idx: list[int]) -> None:
        self.layout, self.name, self.codec, self.start, self.slen, self.rlen = layout, name, codec, start, slen, rlen
        self.idx = idx  # chunk index of each entry
        self.uniform = codec.count(codec[0]) == len(codec)

    @property
    def present(self) -> list[bool]:
        return [c >= 0 for c in self.codec]

    def subset(self) -> "_Col":
        """The chunks that have the column."""
        keep = [i for i, c in enumerate(self.codec) if c >= 0]
        return _Col(self.layout, self.name, [self.codec[i] for i in keep], [self.start[i] for i in keep],
                    [self.slen[i] for i in keep], [self.rlen[i] for i in keep], [self.idx[i] for i in keep])

    def chunk(self, i: int) -> Chunk:
        return self.layout.history.chunk(self.layout.entries[self.idx[i]])


class _Layout:
    """The directories of a site's obs chunks, checked for all chunks at once (see ``History._layout``)."""

    def __init__(self, history: "History", entries: list[_Entry], scales: list, names: list[str],
                 table: np.ndarray, ncols: np.ndarray, payload: np.ndarray, uniform_k: int) -> None:
        """``names``: the column names of the first chunk when every chunk has the same ``uniform_k`` columns,
        else of every chunk, in table order; ``scales``: each directory's ``scale`` value (None: no key)."""
        self.history, self.entries, self.scales = history, entries, scales
        self._names, self._table, self._ncols, self._payload = names, table, ncols, payload
        self._first = np.cumsum(ncols) - ncols
        self.uniform_k = uniform_k
        self._index: dict[str, np.ndarray] | None = None
        self._by_col: tuple[list, list, list, list] | None = None

    def _rows_of(self, name: str) -> np.ndarray:
        """Row of ``name`` in the table for each chunk, -1 where absent."""
        k = self.uniform_k
        if k:
            try:
                j = self._names.index(name, 0, k)
            except ValueError:
                return np.full(len(self.entries), -1, np.int64)
            return self._first + j
        if self._index is None:
            idx: dict[str, np.ndarray] = {}
            for i, (a, n) in enumerate(zip(self._first.tolist(), self._ncols.tolist())):
                for j, nm in enumerate(self._names[a : a + n]):
                    idx.setdefault(nm, np.full(len(self.entries), -1, np.int64))[i] = a + j
            self._index = idx
        return self._index.get(name, np.full(len(self.entries), -1, np.int64))

    def col(self, name: str) -> _Col:
        k = self.uniform_k
        if k:  # every chunk has the same columns: one transposition gives every column's lists
            if self._by_col is None:
                n = len(self.entries)
                t = self._table
                start = self._payload[:, None] + t[:, 1].reshape(n, k)
                self._by_col = (t[:, 0].reshape(n, k).T.tolist(), start.T.tolist(), t[:, 2].reshape(n, k).T.tolist(),
                                t[:, 3].reshape(n, k).T.tolist())
            try:
                j = self._names.index(name, 0, k)
            except ValueError:
                n = len(self.entries)
                return _Col(self, name, [-1] * n, [0] * n, [0] * n, [0] * n, list(range(n)))
            c, a, sl, r = self._by_col
            return _Col(self, name, c[j], a[j], sl[j], r[j], list(range(len(self.entries))))
        r = self._rows_of(name)
        have = r >= 0
        t = self._table[np.where(have, r, 0)]
        codec = np.where(have, t[:, 0], -1)
        start = self._payload + t[:, 1]
        return _Col(self, name, codec.tolist(), start.tolist(), np.where(have, t[:, 2], 0).tolist(),
                    np.where(have, t[:, 3], 0).tolist(), list(range(len(self.entries))))

    def has_any(self, names: frozenset[str]) -> bool:
        return not names.isdisjoint(self._names)


def _bad(msg: str, code: str, path: str, offset: int) -> CorruptError:
    return CorruptError(msg, code=code, path=path, offset=offset)


class History:
    """A trainhist file opened for reading (committed content only). Use :func:`trainhist.open`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._file = open(self.path, "rb")
        size = os.fstat(self._file.fileno()).st_size
        self.size = size
        if size == 0:
            self._buf: Any = b""
        else:
            self._buf = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._view = memoryview(self._buf)
        self.runs: list[dict] = []
        self.writers: list[dict] = []
        self.settings: list[dict] = []
        self.sites: list[Site] = []
        self.segments: list[Segment] = []
        self.ignored_records: list[tuple[int, int]] = []  # (offset, type) of unknown ignorable records
        self._site_by_key: dict[tuple[str, str, str | None], Site] = {}
        self._obs: dict[int, list[_Entry]] = {}
        self._steps: list[_Entry] = []
        self._steps_table: dict[str, np.ndarray] | None = None
        self._cache: dict[int, tuple] = {}  # site id -> decoded rows: the last site read and those read ahead
        self._last_site: int | None = None
        self.committed_records = 0
        self.read_only = False
        self._scan()

    # -- the scan (spec 8) ---------------------------------------------------------------------------------
    def _scan(self) -> None:
        buf, size, path = self._view, self.size, self.path
        if size < FILE_HEADER_SIZE:
            if bytes(buf[:size]) != MAGIC[:size] and bytes(buf[:8]) != MAGIC:
                raise FormatError(f"not a trainhist file: {size} bytes that do not start with {MAGIC!r}",
                                  code="bad_magic", path=path, offset=0)
            self.header = None
            self.recovery = Recovery("torn", 0, size, 0, "file ends inside its 32-byte header", 0)
            self.committed_bytes = 0
            return
        self.header = FileHeader.unpack(buf[:FILE_HEADER_SIZE], path)
        self.read_only = self.header.write_version > WRITE_VERSION
        salt = self.header.salt
        pos = FILE_HEADER_SIZE
        seq = 0
        committed_end = pos
        pending: list[tuple[int, int, int, int, int]] = []  # (offset, type, length, payload_crc, flags)
        stop: tuple[int, str] | None = None
        unpack, raw = _REC.unpack_from, self._buf
        manifest_or_commit = (RecordType.MANIFEST, RecordType.COMMIT)
        while pos < size:
            if size - pos < RECORD_HEADER_SIZE:
                stop = (pos, "file ends inside a record header")
                break
            rtype, flags, length, rseq, rsalt, pcrc, hcrc = unpack(raw, pos)
            if _crc(buf[pos : pos + 28]) != hcrc or rsalt != salt:
                if not np.any(np.frombuffer(self._buf, np.uint8, size - pos, pos)):
                    stop = (pos, "zero-filled tail (space the file system allocated but never wrote)")
                    break
                if rsalt == salt or crc32c(buf[pos : pos + 28]) != hcrc:
                    raise _bad("record header CRC32C mismatch (the length cannot be trusted)", "bad_record_header",
                               path, pos)
                raise _bad(f"record salt {rsalt:016x} differs from the file's {salt:016x} (stale or spliced bytes)",
                           "salt_mismatch", path, pos)
            RecordHeader(rtype, flags, length, rseq, rsalt, pcrc).check_limits(pos, path)
            if rseq != seq:
                raise _bad(f"record sequence number {rseq}, expected {seq} (stale or spliced bytes)",
                           "bad_sequence", path, pos)
            end = pos + RECORD_HEADER_SIZE + length + (-length % 8)
            if end > size:
                stop = (pos, f"file ends inside a {length}-byte record payload")
                break
            if rtype in manifest_or_commit:
                problem = self._check_payload(pos, length, pcrc, rtype)
                if problem is not None:
                    start = pos + RECORD_HEADER_SIZE
                    if not np.any(np.frombuffer(self._buf, np.uint8, size - start, start)):
                        # a machine crash persisted the header but not the payload (spec 8)
                        stop = (pos, "record header followed by a zero-filled tail")
                        break
                    raise _bad(problem[1], problem[0], path, pos)
            if rtype == RecordType.COMMIT:
                self._apply_commit(pos, length, seq, pending)
                self.committed_records = seq + 1
                pending = []
                committed_end = end
            else:
                pending.append((pos, rtype, length, pcrc, flags))
            pos = end
            seq += 1
        self.committed_bytes = committed_end
        if stop is None and not pending:
            self.recovery = Recovery("clean", committed_end, 0, 0, None, None)
        else:
            reason = stop[1] if stop else "the last records were never committed"
            if pending:
                reason = f"{len(pending)} complete but uncommitted record(s)" + (f", then: {reason}" if stop else "")
            self.recovery = Recovery("torn", committed_end, size - committed_end, len(pending) + (1 if stop else 0),
                                     reason, committed_end)

    def _check_payload(self, pos: int, length: int, payload_crc: int, rtype: int) -> tuple[str, str] | None:
        """(code, message) if the payload CRC or padding of the record at ``pos`` is wrong."""
        start = pos + RECORD_HEADER_SIZE
        if crc32c(self._view[start : start + length]) != payload_crc:
            return ("bad_payload_crc", f"payload CRC32C mismatch in {RecordType.NAMES.get(rtype, rtype)} record")
        if any(self._view[start + length : start + length + pad8(length)]):
            return ("bad_padding", "record padding bytes are not zero")
        return None

    def _apply_commit(self, pos: int, length: int, seq: int, pending: list[tuple[int, int, int, int, int]]) -> None:
        path = self.path
        p = self._view[pos + RECORD_HEADER_SIZE : pos + RECORD_HEADER_SIZE + length]
        if len(p) < COMMIT_HEAD.size:
            raise _bad("commit payload shorter than 16 bytes", "bad_commit", path, pos)
        cseq, n = COMMIT_HEAD.unpack_from(p, 0)
        if cseq != seq or len(p) != COMMIT_HEAD.size + n * COMMIT_ENTRY.size or n != len(pending):
            raise _bad(
                f"commit lists {n} records (payload {len(p)} bytes, seq {cseq}); {len(pending)} records precede it "
                f"since the previous commit", "bad_commit", path, pos,
            )
        entries = np.frombuffer(p, _ENTRY_DTYPE, n, COMMIT_HEAD.size).tolist()
        segments = {g.id for g in self.segments}
        for i, ((off, rtype, _res, site, seg, rows, lo, hi), (rpos, ptype, plen, pcrc, flags)) in enumerate(
            zip(entries, pending)
        ):
            if off != rpos or rtype != ptype:
                raise _bad(f"commit entry {i} names a type-{rtype} record at {off}; found type {ptype} at {rpos}",
                           "bad_commit", path, pos)
            e = _Entry(rpos, rtype, site, seg, rows, lo, hi, plen, pcrc)
            if rtype == RecordType.OBS:
                if site >= len(self.sites) or seg not in segments or rows == 0 or lo > hi:
                    raise _bad(f"commit entry {i}: obs chunk names site {site}, segment {seg}, {rows} rows, steps "
                               f"{lo}..{hi}: site/segment not declared before it, or empty", "bad_commit", path, pos)
                self._obs.setdefault(site, []).append(e)
            elif rtype == RecordType.MANIFEST:
                self._apply_manifest(e)
                segments = {g.id for g in self.segments}
            elif rtype == RecordType.STEPS:
                if seg not in segments:
                    raise _bad(f"steps chunk names undeclared segment {seg}", "bad_commit", path, pos)
                self._steps.append(e)
            elif flags & FLAG_IGNORABLE:
                self.ignored_records.append((rpos, rtype))
            else:
                raise UnsupportedError(
                    f"required record type {rtype} is unknown to this reader: upgrade trainhist",
                    code="unknown_record_type", path=path, offset=rpos,
                )

    def _apply_manifest(self, e: _Entry) -> None:
        raw = bytes(self._view[e.offset + RECORD_HEADER_SIZE : e.offset + RECORD_HEADER_SIZE + e.length])
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise _bad(f"manifest is not UTF-8 JSON ({err})", "bad_manifest_json", self.path, e.offset) from None
        validate_manifest(doc, path=self.path, offset=e.offset)
        kind = doc["kind"]
        if kind == "run":
            self.runs.append(doc)
        elif kind == "writer":
            self.writers.append(doc)
        elif kind == "settings":
            self.settings.append(doc)
        elif kind == "site":
            if doc["id"] != len(self.sites):
                raise _bad(f"site id {doc['id']} out of order: expected {len(self.sites)}", "bad_site_id", self.path,
                           e.offset)
            site = Site(doc["id"], doc["path"], doc["stream"], doc["facet"],
                        None if doc.get("shape") is None else tuple(doc["shape"]), doc.get("dtype"), doc["sharing"],
                        doc["cadence"]["spine"], doc["cadence"]["sketch"], doc.get("sample"), doc)
            if site.key in self._site_by_key:
                raise _bad(f"site {site.key} declared twice", "duplicate_site", self.path, e.offset)
            self.sites.append(site)
            self._site_by_key[site.key] = site
        elif kind == "segment":
            if any(g.id == doc["id"] for g in self.segments):
                raise _bad(f"segment {doc['id']} declared twice", "duplicate_segment", self.path, e.offset)
            self.segments.append(Segment(doc["id"], doc["first_step"], doc["reason"], doc["previous"],
                                         doc["writer_id"], doc))

    # -- public API -----------------------------------------------------------------------------------------
    @property
    def run(self) -> dict | None:
        """The (first) run manifest."""
        return self.runs[0] if self.runs else None

    def site(self, path: str, stream: str = "activation", facet: str | None = None) -> Site:
        """Look a site up by its stable key; the error lists close names."""
        s = self._site_by_key.get((path, stream, facet))
        if s is None:
            import difflib

            names = [f"{p} [{st}{'' if f is None else ':' + f}]" for p, st, f in self._site_by_key]
            close = difflib.get_close_matches(f"{path} [{stream}{'' if facet is None else ':' + facet}]", names, 5)
            raise UsageError(
                f"no site ({path!r}, {stream!r}, facet={facet!r}) in this file; closest: {close or names[:5]}",
                code="unknown_site", path=self.path,
            )
        return s

    def chunk(self, e: _Entry) -> Chunk:
        """Decode (and CRC-check) one committed chunk."""
        payload = self._view[e.offset + RECORD_HEADER_SIZE : e.offset + RECORD_HEADER_SIZE + e.length]
        if crc32c(payload) != e.payload_crc:
            raise _bad("payload CRC32C mismatch in a committed chunk", "bad_payload_crc", self.path, e.offset)
        known = _OBS_KNOWN if e.type == RecordType.OBS else _STEPS_KNOWN
        ch = decode_chunk(payload, e.offset, self.path, known,
                          _OBS_VARIABLE if e.type == RecordType.OBS else frozenset())
        m = ch.meta
        want_site = e.site if e.type == RecordType.OBS else None
        if m.get("rows") != e.rows or m.get("segment") != e.segment or m.get("site") != want_site:
            raise _bad(f"chunk directory (site {m.get('site')}, segment {m.get('segment')}, rows {m.get('rows')}) "
                       f"disagrees with its commit entry", "bad_chunk", self.path, e.offset)
        required = OBS_COLUMNS if e.type == RecordType.OBS else STEPS_COLUMNS
        missing = [c for c in required if not ch.has(c)]
        if missing:
            raise _bad(f"chunk lacks required columns {missing}", "missing_column", self.path, e.offset)
        return ch

    def _layout(self, entries: list[_Entry]) -> _Layout:
        """The directories of a site's obs chunks with every check of :meth:`chunk` (CRC, directory against the
        commit entry, spec 7.4): each layout of column names and dtypes through :meth:`chunk` once, then codecs,
        offsets, sizes and padding of all chunks at once. Raises (anything) where :meth:`chunk` must name the
        problem."""
        view = self._view
        dirs: list[memoryview] = []
        dir_end: list[int] = []
        for e in entries:
            start = e.offset + RECORD_HEADER_SIZE
            payload = view[start : start + e.length]
            if _crc(payload) != e.payload_crc or e.length < 4 or e.rows > MAX_ROWS:
                raise _Fallback
            mlen = int.from_bytes(payload[:4], "little")
            if mlen > MAX_META or 4 + mlen > e.length:
                raise _Fallback
            dirs.append(payload[4 : 4 + mlen])
            d = 4 + mlen
            dir_end.append(d + (-d % 8))
        fast = _directories_by_template(dirs, entries)
        if fast is not None:
            names, dts, t, ncols, scales = fast
        else:
            names, dts, t, ncols, scales = _directories_unpacked(dirs, entries)
        first = np.cumsum(ncols) - ncols
        k = int(ncols[0])
        n_chunks = len(entries)
        if (ncols == k).all() and names == names[:k] * n_chunks and dts == dts[:k] * n_chunks:
            groups = {(tuple(names[:k]), tuple(dts[:k])): 0}
            which = None
        else:
            groups, which = {}, []
            for i, (a, n) in enumerate(zip(first.tolist(), ncols.tolist())):
                which.append(groups.setdefault((tuple(names[a : a + n]), tuple(dts[a : a + n])), i))
        size_of: dict[tuple, list[int]] = {}
        for key, i in groups.items():
            info = _LAYOUTS_OK.get(key)
            if info is None:
                self.chunk(entries[i])  # the full checks of spec 7.4, once per layout
                info = _LAYOUTS_OK[key] = [
                    -DTYPES[dt.decode()].itemsize if nm.decode() in _OBS_VARIABLE else DTYPES[dt.decode()].itemsize
                    for nm, dt in zip(*key)]
            size_of[key] = info
        if which is None:
            (key,) = groups
            size = np.tile(np.array(size_of[key], np.int64), n_chunks)
            dtc = np.tile(np.array([_DT_INDEX[d.decode()] for d in key[1]], np.int64), n_chunks)
        else:
            keys = {i: key for key, i in groups.items()}
            size = np.array([z for i in which for z in size_of[keys[i]]], np.int64)
            dtc = np.array([_DT_INDEX[d.decode()] for d in dts], np.int64)
        codec, off, slen, rlen = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
        if ((codec < 0).any() or (codec >= _APPLIES.shape[1]).any() or not _APPLIES[dtc, codec].all()
                or (slen < 0).any() or (rlen > 64 * MAX_ROWS * 8).any() or ((codec == 0) & (slen != rlen)).any()):
            raise _Fallback
        rows = np.repeat(np.array([e.rows for e in entries], np.int64), ncols)
        fixed = size > 0
        if (fixed & (rlen != rows * size)).any() or (~fixed & (rlen % np.abs(size) != 0)).any():
            raise _Fallback
        padded = slen + (-slen % 8)
        excl = np.cumsum(padded) - padded
        base = np.array(dir_end, np.int64)
        if (off != np.repeat(base - excl[first], ncols) + excl).any():
            raise _Fallback
        last = first + ncols - 1
        if (base + excl[last] + padded[last] - excl[first] != np.array([e.length for e in entries], np.int64)).any():
            raise _Fallback
        payload_at = np.array([e.offset + RECORD_HEADER_SIZE for e in entries], np.int64)
        pad = padded - slen
        some = pad > 0
        if some.any():
            at = np.repeat(payload_at, ncols)[some] + off[some] + slen[some]
            n = pad[some]
            j = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
            if np.frombuffer(self._buf, np.uint8)[np.repeat(at, n) + j].any():
                raise _Fallback
        shown = [nm.decode() for nm in (names[:k] if which is None else names)]
        return _Layout(self, entries, scales, shown, t, ncols, payload_at, k if which is None else 0)

    def _obs_columns(self, e: _Entry) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, bytes]], Chunk]:
        ch = self.chunk(e)
        cols = {name: ch.column(name, e.rows) for name in OBS_COLUMNS}
        cols["segment"] = np.full(e.rows, e.segment, np.uint32)
        path = self.path
        if not np.array_equal(cols["step"].min(initial=np.iinfo(np.int64).max), e.step_min) or cols["step"].max() != e.step_max:
            raise _bad("chunk steps disagree with the commit entry's step range", "bad_chunk", path, e.offset)
        if (cols["phase"] >= len(Phase.NAMES)).any() or (cols["presence"] >= len(Presence.NAMES)).any():
            raise UnsupportedError("chunk uses phase or presence codes unknown to this reader",
                                   code="unknown_code", path=path, offset=e.offset)
        tnames = [n for n in TALLY_COLUMNS if ch.has(n)]
        if tnames:  # a derived file's per-presence count of combined leaf rows (spec 11.4)
            if len(tnames) != len(TALLY_COLUMNS):
                raise _bad(f"chunk has tally columns {tnames} but not all six", "bad_tally", path, e.offset)
            tally = np.stack([ch.column(n, e.rows) for n in TALLY_COLUMNS], axis=1).astype(np.uint64)
            if (derive_presence(tally) != cols["presence"]).any():
                raise _bad("presence column disagrees with the presence the tally columns imply", "bad_tally",
                           path, e.offset)
        else:
            tally = np.zeros((e.rows, len(TALLY_COLUMNS)), np.uint64)
            tally[np.arange(e.rows), cols["presence"].astype(np.intp)] = 1
        for j, n in enumerate(TALLY_COLUMNS):
            cols[n] = tally[:, j]
        exact: dict[str, tuple[np.ndarray, bytes]] = {}
        for name in ("sum", "sumsq"):
            if ch.has(name + "_xn"):
                lens = ch.column(name + "_xn", e.rows).astype(np.int64)
                blob = ch.column(name + "_x")
                if int(lens.sum()) != blob.size:
                    raise _bad(f"{name}_x holds {blob.size} bytes, {name}_xn sums to {int(lens.sum())}",
                               "bad_column_length", path, e.offset)
                exact[name] = (lens, blob.tobytes())
            else:
                exact[name] = (np.zeros(e.rows, np.int64), b"")
        return cols, exact, ch

    def _sketch_part(self, e: _Entry, ch: Chunk) -> tuple[np.ndarray, _Sparse]:
        """Sketch rows of one chunk: (has mask, the rows' stored ranges), validated against the spec's layout."""
        from .grid import nbins

        s = ch.meta.get("scale")
        if not isinstance(s, int) or isinstance(s, bool) or s not in (0, 1, 2):
            raise _bad(f"chunk with sketches declares scale {s!r}; expected 0, 1 or 2", "bad_scale", self.path,
                       e.offset)
        nb = nbins(s)
        sk = {k: ch.column(k, e.rows) for k in SKETCH_COLUMNS if k != "sk_counts"}
        counts = ch.column("sk_counts")
        if (sk["sk"] > 1).any():
            raise _bad("sk column holds values other than 0 and 1", "bad_sketch", self.path, e.offset)
        has = sk["sk"] == 1
        if (~has & ((sk["sk_pn"] > 0) | (sk["sk_nn"] > 0))).any():
            raise _bad("a row without a sketch declares sketch bins", "bad_sketch", self.path, e.offset)
        pn, nn = sk["sk_pn"][has].astype(np.int64), sk["sk_nn"][has].astype(np.int64)
        plo, nlo = sk["sk_plo"][has].astype(np.int64), sk["sk_nlo"][has].astype(np.int64)
        if (plo + pn > nb).any() or (nlo + nn > nb).any() or int(pn.sum() + nn.sum()) != counts.size:
            raise _bad(f"sketch ranges exceed {nb} bins or do not use exactly the {counts.size} values of sk_counts",
                       "bad_sketch", self.path, e.offset)
        start = np.cumsum(pn + nn) - (pn + nn)  # where each row's values begin in sk_counts
        bands = tuple(sk[k][has] for k in ("sk_up", "sk_un", "sk_op", "sk_on"))
        return has, _Sparse(s, counts, start, plo, pn, nlo, nn, bands)

    def _site_data(self, site: Site, phase: str | None, *, sketches: bool = True
                   ) -> tuple[dict[str, np.ndarray], dict[str, _Exact], _Sparse | None]:
        """All committed rows of a site (one phase, or every phase for ``"*"``), with ``sk_row`` indexing the
        site's sketch rows (-1: none).

        The site's chunks are decoded together, each column of all of them at once (:func:`_gather`), and kept
        for the next call on the same site (``spine`` then ``sketch`` decode once). Anything unusual — a check
        that fails, tally columns, mixed scales — sends the site through the per-chunk path, which names the
        first problem exactly as spec 8 asks (the record's offset).
        """
        data = self._cache.get(site.id)
        if data is None:
            group = [site]
            if self._last_site == site.id - 1 and self._obs.get(site.id):  # reading sites in order: read ahead
                budget = _READAHEAD_BYTES - sum(e.length for e in self._obs[site.id])
                for nxt in self.sites[site.id + 1 :]:
                    if budget <= 0 or len(group) >= _READAHEAD_SITES:
                        break
                    es = self._obs.get(nxt.id)
                    if es:
                        budget -= sum(e.length for e in es)
                        group.append(nxt)
            self._cache = {}
            for attempt in ([group, [site]] if len(group) > 1 else [group]):
                try:
                    if not self._obs.get(site.id):
                        raise _Fallback
                    self._cache = self._batch(attempt)
                    break
                except Exception:  # noqa: BLE001 - the per-chunk path below decides, and names the error
                    continue
            data = self._cache.get(site.id)
        self._last_site = site.id
        if data is None:
            data = self._site_chunks(site, sketches)
        columns, exact, sparse = data
        columns = dict(columns)
        ph = columns["phase"]
        phases = np.unique(ph) if ph.size and ph.min() != ph.max() else ph[:1]
        if phase is None and phases.size > 1:
            raise UsageError(
                f"site {site.key} has rows in phases {[Phase.name(int(p)) for p in phases]}: name one with phase=",
                code="phase_ambiguous", path=self.path,
            )
        if phase is not None and phase != "*":
            keep = columns["phase"] == Phase.code(phase)
            columns = {n: v[keep] for n, v in columns.items()}
            exact = {k: x.take(keep, columns[k]) for k, x in exact.items()}
        return columns, exact, sparse

    def _finish(self, columns: dict[str, np.ndarray], where: np.ndarray,
                xparts: dict[str, list[tuple[np.ndarray, bytes]]]) -> dict[str, _Exact]:
        exact: dict[str, _Exact] = {}
        for k, chunks in xparts.items():
            lens = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros(0, np.int64)
            off = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if lens.size else lens
            exact[k] = _Exact(k, columns[k], off, lens, b"".join(c[1] for c in chunks), where, self.path)
        return exact

    def _site_chunks(self, site: Site, sketches: bool
                     ) -> tuple[dict[str, np.ndarray], dict[str, _Exact], _Sparse | None]:
        """The per-chunk path: every check of spec 7 and 8 in record order, the first failure raised."""
        parts: list[dict[str, np.ndarray]] = []
        xparts: dict[str, list[tuple[np.ndarray, bytes]]] = {"sum": [], "sumsq": []}
        sparts: list[_Sparse] = []
        scale = None
        n_sk = 0
        for e in self._obs.get(site.id, []):
            cols, ex, ch = self._obs_columns(e)
            sk_row = np.full(e.rows, -1, np.int64)
            if ch.has("sk") and not sketches:  # row flags only; the sketch ranges are checked by sketch()
                has = ch.column("sk", e.rows) == 1
                sk_row[has] = n_sk + np.arange(int(has.sum()))
                n_sk += int(has.sum())
            elif ch.has("sk"):
                has, sp = self._sketch_part(e, ch)
                if scale is not None and sp.scale != scale:
                    raise _bad(f"site {site.key} mixes sketch scales {scale} and {sp.scale} (spec 7.5)",
                               "mixed_scale", self.path, e.offset)
                scale = sp.scale
                sk_row[has] = n_sk + np.arange(int(has.sum()))
                n_sk += int(has.sum())
                sparts.append(sp)
            cols["sk_row"] = sk_row
            cols["x_where"] = np.full(e.rows, e.offset, np.int64)
            parts.append(cols)
            for k in xparts:
                xparts[k].append(ex[k])
        names = list(OBS_COLUMNS) + list(TALLY_COLUMNS) + ["segment", "sk_row", "x_where"]
        if parts:
            columns = {n: np.concatenate([p[n] for p in parts]) for n in names}
        else:
            columns = {n: np.zeros(0, np.dtype({**OBS_COLUMNS, **TALLY_COLUMNS}.get(n, "i8"))) for n in names}
        where = columns.pop("x_where")
        exact = self._finish(columns, where, xparts)
        sparse = _Sparse.concat(sparts) if sparts else _Sparse.empty(2 if scale is None else scale)
        return columns, exact, sparse if sketches else None

    def _batch(self, group: list[Site]) -> dict[int, tuple[dict[str, np.ndarray], dict[str, _Exact], _Sparse]]:
        """Every chunk of the sites in ``group`` (each with rows) decoded together, the checks of the per-chunk
        path made on whole columns, then split per site; raises (anything) where the per-chunk path must decide."""
        from .grid import nbins

        per_site = [self._obs[s.id] for s in group]
        entries = [e for es in per_site for e in es]
        lay = self._layout(entries)
        if lay.has_any(_TALLY_SET):
            raise _Fallback  # derived files: the per-chunk path checks tallies
        view = self._view
        rows = [e.rows for e in entries]
        rows_a = np.array(rows, np.int64)
        starts = np.cumsum(rows_a) - rows_a
        cols = {name: _gather(view, lay.col(name), dt, rows) for name, dt in OBS_COLUMNS.items()}
        step = cols["step"]
        if (np.minimum.reduceat(step, starts).tolist() != [e.step_min for e in entries]
                or np.maximum.reduceat(step, starts).tolist() != [e.step_max for e in entries]):
            raise _Fallback
        if (cols["phase"] >= len(Phase.NAMES)).any() or (cols["presence"] >= len(Presence.NAMES)).any():
            raise _Fallback
        n = int(rows_a.sum())
        tally = np.zeros((n, len(TALLY_COLUMNS)), np.uint64)
        tally[np.arange(n), cols["presence"].astype(np.intp)] = 1
        for j, name in enumerate(TALLY_COLUMNS):
            cols[name] = tally[:, j]
        cols["segment"] = np.repeat(np.array([e.segment for e in entries], np.uint32), rows_a)
        # site k holds rows [row_at[k], row_at[k + 1]) and chunks [chunk_at[k], chunk_at[k + 1])
        chunk_at = np.cumsum([0] + [len(es) for es in per_site]).tolist()
        row_at = np.concatenate([starts, [n]])[chunk_at].tolist()
        xcols: dict[str, tuple[np.ndarray, bytes, list[int]]] = {}
        for name in ("sum", "sumsq"):
            xn, x = lay.col(name + "_xn"), lay.col(name + "_x")
            if xn.present != x.present:
                raise _Fallback
            if not any(xn.present):
                xcols[name] = (np.zeros(n, np.int64), b"", [0] * len(row_at))
                continue
            lens = _gather(view, xn, "u4", rows).astype(np.int64)
            if np.add.reduceat(lens, starts).tolist() != x.rlen:
                raise _Fallback
            sub = x.subset()
            blob = bytes(_join(view, sub.start, [a + b for a, b in zip(sub.start, sub.slen)])) \
                if sub.uniform and sub.codec[0] == Codec.RAW else _gather(view, sub, "bytes", sub.rlen).tobytes()
            xcols[name] = (lens, blob, np.concatenate([[0], np.cumsum(lens)])[row_at].tolist())  # type: ignore
        skc = lay.col("sk")
        have = skc.present
        sk_row = np.full(n, -1, np.int64)
        sparse_of: list[_Sparse] = [_Sparse.empty()] * len(group)
        if any(have):
            scale_of = []  # per chunk: its sites' scale (2 for sites without sketches)
            for k, es in enumerate(per_site):
                a, b = chunk_at[k], chunk_at[k + 1]
                scales = {sc for sc, h in zip(lay.scales[a:b], have[a:b]) if h}
                sc = scales.pop() if scales else 2
                if scales or type(sc) is not int or sc not in (0, 1, 2):
                    raise _Fallback
                scale_of.append(sc)
            sk = {k: _gather(view, lay.col(k), dt, rows) for k, dt in SKETCH_COLUMNS.items() if k != "sk_counts"}
            cc = lay.col("sk_counts")
            if cc.present != have:
                raise _Fallback
            sub = cc.subset()
            ns = [r // 8 for r in sub.rlen]
            esc = None
            lazy = None
            if sub.uniform and sub.codec[0] == Codec.PATCHED:  # kept as stored; widened when bins are read
                lazy = _patched_checked(view, sub.start, sub.slen, ns)
                counts: np.ndarray = np.zeros(0, np.uint64)
            else:
                counts = _gather(view, sub, "u8", ns)
            flag = sk["sk"]
            if (flag > 1).any():
                raise _Fallback
            hs = flag == 1
            pn_all, nn_all = sk["sk_pn"].astype(np.int64), sk["sk_nn"].astype(np.int64)
            if (~hs & ((pn_all > 0) | (nn_all > 0))).any():
                raise _Fallback
            per_chunk = [r // 8 for r in cc.rlen]
            if np.add.reduceat(pn_all + nn_all, starts).tolist() != per_chunk:
                raise _Fallback
            nbs = {nbins(sc) for sc in scale_of}
            nb = nbs.pop() if len(nbs) == 1 else np.repeat(
                np.array([nbins(sc) for sc in scale_of], np.int64), np.diff(np.array(row_at, np.int64)))[hs]
            every = bool(hs.all())  # usual: every row has a sketch, so no row needs to be taken out
            pick = (lambda a: a) if every else (lambda a: a[hs])
            pn, nn = pick(pn_all), pick(nn_all)
            plo, nlo = pick(sk["sk_plo"]).astype(np.int64), pick(sk["sk_nlo"]).astype(np.int64)
            if (plo + pn > nb).any() or (nlo + nn > nb).any():
                raise _Fallback
            size_ = pn + nn
            start = np.cumsum(size_) - size_
            bands = tuple(pick(sk[k]) for k in ("sk_up", "sk_un", "sk_op", "sk_on"))
            sk_at = np.concatenate([[0], np.cumsum(hs)])[row_at].tolist()  # sketch rows of site k
            c_at = np.cumsum([0] + per_chunk)[chunk_at].tolist()  # its values in counts
            sub_at = np.cumsum([0] + [int(h) for h in have])[chunk_at].tolist()  # its chunks among those with sketches
            for k in range(len(group)):
                s0, s1, c0, c1 = sk_at[k], sk_at[k + 1], c_at[k], c_at[k + 1]
                if lazy is not None:
                    mid, end, exc, e_at = lazy
                    a, b = sub_at[k], sub_at[k + 1]
                    vals: np.ndarray | _Patched = _Patched(view, mid[a:b], end[a:b], exc[e_at[a] : e_at[b]])
                else:
                    vals = counts[c0:c1]
                sparse_of[k] = _Sparse(scale_of[k], vals, start[s0:s1] - c0, plo[s0:s1], pn[s0:s1], nlo[s0:s1],
                                       nn[s0:s1], tuple(b[s0:s1] for b in bands))
                sk_row[row_at[k] : row_at[k + 1]][hs[row_at[k] : row_at[k + 1]]] = np.arange(s1 - s0)
        cols["sk_row"] = sk_row
        for v in cols.values():
            v.flags.writeable = False
        where = np.repeat(np.array([e.offset for e in entries], np.int64), rows_a)
        out = {}
        for k, site in enumerate(group):
            r0, r1 = row_at[k], row_at[k + 1]
            c = {name: v[r0:r1] for name, v in cols.items()}
            xparts = {name: [(lens[r0:r1], blob[b[k] : b[k + 1]])] for name, (lens, blob, b) in xcols.items()}
            out[site.id] = (c, self._finish(c, where[r0:r1], xparts), sparse_of[k])
        return out

    def spine(self, path: str, stream: str = "activation", facet: str | None = None, *,
              phase: str | None = None) -> SpineSeries:
        """Every committed row of one site, in file order; ``phase`` must be named when the site has several.

        Column ``sk_row`` gives the row's index in :meth:`sketch` of the same site and phase (-1: no sketch).
        """
        site = self.site(path, stream, facet)
        columns, exact, _ = self._site_data(site, phase, sketches=False)
        if phase is not None:  # renumber sketch rows within the phase
            sk = columns["sk_row"]
            columns["sk_row"] = np.where(sk >= 0, np.cumsum(sk >= 0) - 1, -1)
        return SpineSeries(site, columns, exact)

    def sketch(self, path: str, stream: str = "activation", facet: str | None = None, *,
               phase: str | None = None) -> SketchSeries:
        """The rows of one site that carry a sketch; dense (rows, bins) count matrices are built on first use."""
        site = self.site(path, stream, facet)
        columns, _, sparse = self._site_data(site, phase)
        assert sparse is not None
        keep = columns["sk_row"] >= 0
        if keep.size == sparse.start.size and keep.all():  # every row has a sketch: the columns as they are
            return SketchSeries(site, {k: v for k, v in columns.items() if k != "sk_row"}, sparse)
        sel = columns["sk_row"][keep]
        if sel.size != sparse.start.size:  # one phase of several: take its rows (else every row is kept, in order)
            sparse = sparse.take(sel)
        return SketchSeries(site, {k: v[keep] for k, v in columns.items() if k != "sk_row"}, sparse)

    @property
    def steps(self) -> dict[str, np.ndarray]:
        """The step-truth table: numpy columns (codes; see :func:`step_truth_rows` for named values)."""
        if self._steps_table is None:
            parts = []
            for e in self._steps:
                ch = self.chunk(e)
                cols = {name: ch.column(name, e.rows) for name in STEPS_COLUMNS}
                cols["span"] = ch.column("span", e.rows) if ch.has("span") else np.ones(e.rows, np.uint32)
                if (cols["span"] == 0).any():
                    raise _bad("steps row with span 0", "bad_span", self.path, e.offset)
                cols["segment"] = np.full(e.rows, e.segment, np.uint32)
                for name, enum in (("applied", Applied), ("grad_basis", GradBasis), ("clipped", Clipped)):
                    if (cols[name] >= len(enum.NAMES)).any():
                        raise UnsupportedError(f"steps column {name} holds codes unknown to this reader",
                                               code="unknown_code", path=self.path, offset=e.offset)
                parts.append(cols)
            names = list(STEPS_COLUMNS) + ["span", "segment"]
            if parts:
                self._steps_table = {n: np.concatenate([p[n] for p in parts]) for n in names}
            else:
                self._steps_table = {n: np.zeros(0, np.dtype(STEPS_COLUMNS.get(n, "u4"))) for n in names}
        return self._steps_table

    def step_truth_rows(self) -> list[dict]:
        """The step-truth table as dicts with named values and ``None`` for unknown."""
        t = self.steps
        out = []
        for i in range(t["step"].size):
            def f(name: str) -> float | None:
                v = float(t[name][i])
                return None if np.isnan(v) else v

            def u(name: str) -> int | None:
                v = int(t[name][i])
                return None if v == U64_UNKNOWN else v

            out.append({
                "step": int(t["step"][i]), "span": int(t["span"][i]), "segment": int(t["segment"][i]),
                "applied": Applied.name(int(t["applied"][i])), "grad_basis": GradBasis.name(int(t["grad_basis"][i])),
                "clipped": Clipped.name(int(t["clipped"][i])), "loss_scale": f("loss_scale"),
                "clip_threshold": f("clip_threshold"),
                "micro_batches": None if int(t["micro_batches"][i]) == 0 else int(t["micro_batches"][i]),
                "tokens": u("tokens"), "samples": u("samples"),
            })
        return out

    def presence(self, path: str, stream: str = "activation", facet: str | None = None, *,
                 steps: np.ndarray | list[int] | None = None, phase: str | None = None) -> dict[int, str]:
        """State of the site at each asked step (default: every step of the step table and of its rows).

        A row gives its own presence; with no row, a step the writer recorded whose site cadence says "not due"
        is ``not_scheduled``, and anything else is ``unknown``. A gap is never turned into a number.
        """
        s = self.spine(path, stream, facet, phase=phase)
        site = s.site
        known_steps = set(self.steps["step"].tolist())
        rows: dict[int, int] = {}
        for st, pr, span in zip(s.step.tolist(), s.presence.tolist(), s.span.tolist()):
            for k in range(st, st + span):
                prev = rows.get(k)
                # several rows (micro-batches) at one step: the precedence of spec 2.6 and 11.4
                if prev is None or PRIORITY[pr] > PRIORITY[prev]:
                    rows[k] = pr
        asked = sorted(known_steps | set(rows)) if steps is None else [int(x) for x in steps]
        out = {}
        for k in asked:
            if k in rows:
                out[k] = Presence.name(rows[k])
            elif k in known_steps and (site.cadence_spine == 0 or k % site.cadence_spine != 0):
                out[k] = "not_scheduled"
            else:
                out[k] = "unknown"
        return out

    def verify(self) -> dict:
        """Decode and check every committed byte (chunks, exact sums, sketches, ignored records); raise on the first
        problem."""
        rows = 0
        for site in self.sites:
            columns, exact, _ = self._site_data(site, "*")
            for x in exact.values():
                for i in np.flatnonzero(x.n).tolist():
                    x.get(i)
            rows += int(columns["step"].size)
        for off, _type in self.ignored_records:
            length, pcrc = struct.unpack_from("<I", self._view, off + 4)[0], struct.unpack_from("<I", self._view, off + 24)[0]
            problem = self._check_payload(off, length, pcrc, _type)
            if problem is not None:
                raise _bad(problem[1], problem[0], self.path, off)
        _ = self.steps
        return {
            "status": self.recovery.status, "sites": len(self.sites), "rows": rows,
            "chunks": sum(len(v) for v in self._obs.values()) + len(self._steps),
            "committed_bytes": self.committed_bytes, "dropped_bytes": self.recovery.dropped_bytes,
            "ignored_records": len(self.ignored_records),
        }

    def close(self) -> None:
        """Release the file map."""
        try:
            self._view.release()
        except BufferError:  # numpy arrays still view the map; it is released when they are
            pass
        if isinstance(self._buf, mmap.mmap):
            try:
                self._buf.close()
            except BufferError:  # numpy views still alive: the map is released when they are
                pass
        self._file.close()

    def __enter__(self) -> "History":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_history(path: str | os.PathLike) -> History:
    """Open a history file for reading; see :class:`History`."""
    return History(path)
