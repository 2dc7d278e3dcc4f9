"""Batched decoding of obs chunks: the directories of many chunks read together and each column of all of them
decoded with one set of numpy operations, as spec 7 asks of each chunk.

Shared by the reader (``History._batch``) and merge (``merge._Engine._decode_batch``). The entry points are
:func:`layout` (the directories of a batch, checked on whole arrays) and :func:`gather` (one column of every chunk
of a layout); :func:`check_chunk` holds the checks of one chunk's directory against its commit entry. Nothing here
names an error: any check that fails raises :class:`Fallback` (or whatever a malformed directory makes numpy or
msgpack raise), and the caller decodes the chunks again one by one on its own path, which raises the typed error
of spec 8 with the file and the record's offset.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable

import msgpack
import numpy as np
from crc32c import crc32c as _crc  # the same function as framing.crc32c, without a Python call around it

from .chunk import _FOR_WIDTHS, _RANGE, APPLIES, DTYPES, MAX_COLUMNS, MAX_META, MAX_ROWS, Chunk, Codec, decode_chunk
from .errors import CorruptError
from .framing import RECORD_HEADER_SIZE, RecordType
from .model import EXACT_COLUMNS, OBS_COLUMNS, SKETCH_COLUMNS, STEPS_COLUMNS, STEPS_OPTIONAL_COLUMNS, TALLY_COLUMNS

OBS_KNOWN = {**OBS_COLUMNS, **EXACT_COLUMNS, **SKETCH_COLUMNS, **TALLY_COLUMNS}
STEPS_KNOWN = {**STEPS_COLUMNS, **STEPS_OPTIONAL_COLUMNS}
OBS_VARIABLE = frozenset({"sum_x", "sumsq_x", "sk_counts"})


#: the optional obs column groups whose columns come together (spec 7.5): the sketch columns, each exact-sum pair
#: (the tally, all six or none, is ``bad_tally``)
OBS_GROUPS = (tuple(SKETCH_COLUMNS), ("sum_xn", "sum_x"), ("sumsq_xn", "sumsq_x"))


def missing_obs_columns(ch: Chunk) -> list[str]:
    """The columns an obs chunk lacks (``missing_column``, spec 7.5): required ones, and those of an optional
    group (:data:`OBS_GROUPS`) of which it holds some."""
    missing = [c for c in OBS_COLUMNS if not ch.has(c)]
    for group in OBS_GROUPS:
        if any(ch.has(c) for c in group):
            missing += [c for c in group if not ch.has(c)]
    return missing


def check_chunk(payload: memoryview, e: Any, path: str, offset: int | None = None) -> Chunk:
    """Decode one chunk whose payload CRC was checked and check its directory against its commit entry ``e``
    (rows, segment, site; the required columns). ``offset``: the record's offset that errors name (default
    ``e.offset``)."""
    offset = e.offset if offset is None else offset
    obs = e.type == RecordType.OBS
    ch = decode_chunk(payload, offset, path, OBS_KNOWN if obs else STEPS_KNOWN, OBS_VARIABLE if obs else frozenset())
    m = ch.meta
    want_site = e.site if obs else None
    if m.get("rows") != e.rows or m.get("segment") != e.segment or m.get("site") != want_site:
        raise CorruptError(f"chunk directory (site {m.get('site')}, segment {m.get('segment')}, rows "
                           f"{m.get('rows')}) disagrees with its commit entry", code="bad_chunk", path=path,
                           offset=offset)
    missing = missing_obs_columns(ch) if obs else [c for c in STEPS_COLUMNS if not ch.has(c)]
    if missing:
        raise CorruptError(f"chunk lacks required columns {missing}", code="missing_column", path=path,
                           offset=offset)
    return ch


_UNPACK_OPTIONS = dict(raw=True, strict_map_key=True, max_bin_len=0, max_ext_len=0, max_str_len=4096,
                       max_array_len=4096, max_map_len=64)


def _check_meta(meta: Any, e: Any) -> list:
    """The ``cols`` of a directory unpacked with byte strings, if it agrees with the commit entry and holds only
    the keys of spec 7.2; names and dtypes must then equal those of a layout that passed :func:`check_chunk`, so
    nothing ``chunk`` refuses gets through."""
    cols = meta[b"cols"]
    if (type(cols) is not list or type(meta[b"rows"]) is not int or meta[b"rows"] != e.rows
            or meta.get(b"segment") != e.segment or meta.get(b"site") != e.site or len(cols) > MAX_COLUMNS
            or not meta.keys() <= _META_KEYS):
        raise Fallback
    return cols


def _directories_unpacked(dirs: list[memoryview], entries: list) -> tuple:
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
        raise Fallback
    ints = vals[2::6] + vals[3::6] + vals[4::6] + vals[5::6]
    if set(map(type, ints)) != {int}:
        raise Fallback
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


def _directories_by_template(dirs: list[memoryview], entries: list) -> tuple | None:
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


# (column names, dtypes) of obs chunk directories that passed every check of check_chunk -> item size per
# column (negated for variable-length columns); forgotten all at once beyond _LAYOUTS_CAP entries
_LAYOUTS_OK: dict[tuple, list[int]] = {}
_LAYOUTS_CAP = 4096
_DT_INDEX = {d: i for i, d in enumerate(DTYPES)}
_META_KEYS = frozenset({b"site", b"segment", b"rows", b"scale", b"cols"})
_APPLIES = np.array([[d in APPLIES.get(c, ()) for c in range(max(Codec.STORED) + 1)] for d in DTYPES])


class Fallback(Exception):
    """The batched decode met something the per-chunk path must judge (it names the error and the offset)."""




def gather(view: memoryview, col: "_Col", dt: str, ns: list[int]) -> np.ndarray:
    """A column of every chunk of a site (``ns[i]`` values in chunk ``i``; zeros where a chunk lacks it),
    concatenated in order. Consecutive chunks with one codec (and frame-of-reference width) are decoded at once:
    their blocks are joined and decoded with one set of numpy operations, checked as in spec 7.3; a failed
    check raises :class:`Fallback`."""
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


def all_patched(col: "_Col") -> bool:
    """Whether the column is stored, and in patched-bytes blocks only (whose values have a cheap upper bound)."""
    return bool(col.codec) and all(c == Codec.PATCHED for c in col.codec)


def upper_bound(view: memoryview, col: "_Col", ns: list[int]) -> int | None:
    """An upper bound on the values of an unsigned column of patched-bytes blocks that :func:`gather` decoded
    (``ns[i]`` values in block ``i``; the blocks passed its checks): 254, the largest code, or the largest
    exception; None for other codecs (the caller takes the maximum of the values)."""
    if not all_patched(col):
        return None
    ends = [a + b - n for a, b, n in zip(col.start, col.slen, ns)]  # each block's exceptions end where codes begin
    exc = np.frombuffer(join(view, col.start, ends), "<u8") if ends != col.start else np.zeros(0, np.uint64)
    return max(254, int(exc.max()) if exc.size else 0)


def _gather_runs(view: memoryview, col: "_Col", dt: str, ns: list[int]) -> np.ndarray:
    keys = [c if c != Codec.FOR else (3, (sl - 8) // n if n else -1) for c, sl, n in zip(col.codec, col.slen, ns)]
    parts, a = [], 0
    for b in range(1, len(keys) + 1):
        if b == len(keys) or keys[b] != keys[a]:
            parts.append(_decode_run(view, col.start[a:b], col.slen[a:b], ns[a:b], keys[a], dt, col, a))
            a = b
    return np.concatenate(parts)


def join(view: memoryview, start: list[int], end: list[int]) -> bytes | memoryview | np.ndarray:
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
        return np.frombuffer(join(view, start, end), dtype)
    if codec == Codec.FOR:
        w = key[1]
        ns_a = np.array(ns, np.int64)
        if w not in _FOR_WIDTHS or ns_a.min() < 1 or (np.array(slen, np.int64) != 8 + ns_a * w).any():
            raise Fallback
        signed = dt[0] == "i"
        base_end = [a + 8 for a in start]
        bases = np.frombuffer(join(view, start, base_end), "<i8" if signed else "<u8")
        lo, hi = _RANGE[dt]
        if (bases.min() < lo) or (bases.max() > hi):  # numpy compares i8 with i8 and u8 with u8 ranges exactly
            raise Fallback
        if w == 0:
            out = np.repeat(bases if dt in ("u8", "i8") else bases.astype(dtype), ns_a)
            return out
        offs = np.frombuffer(join(view, base_end, end), _FOR_WIDTHS[w])
        top = np.maximum.reduceat(offs, np.cumsum(ns_a) - ns_a).astype(np.uint64)
        # hi - base, exact in u64 because lo <= base <= hi; every value base + offset must not pass hi
        room = np.uint64(hi & 0xFFFFFFFFFFFFFFFF) - bases.view(np.uint64)
        if (top > room).any():
            raise Fallback
        if dt in ("u8", "i8"):
            out = np.repeat(bases.view(np.uint64), ns_a)
            np.add(out, offs, out=out, casting="unsafe")  # exact: every sum lies in the range just checked
            return out.view(np.int64) if signed else out
        out = np.repeat(bases.astype(dtype), ns_a)  # narrow dtypes: base and every sum fit the dtype (checked)
        np.add(out, offs, out=out, casting="unsafe")
        return out
    if codec == Codec.F32:
        if (np.array(slen, np.int64) != 4 * np.array(ns, np.int64)).any():
            raise Fallback
        a = np.frombuffer(join(view, start, end), "<f4")
        nan = np.isnan(a)
        if nan.any() and (a.view("<u4")[nan] != 0x7FC00000).any():
            raise Fallback
        return a.astype(np.float64)
    if codec == Codec.PATCHED:
        codes, exc, esc = _patched_parts(view, start, slen, ns, dtype.itemsize, dt)
        out = codes.astype(dtype)
        if exc.size:
            out[esc] = exc
        return out
    # deflate codecs: one chunk at a time, through Chunk.column
    return np.concatenate([col.chunk(first + i).column(col.name) for i in range(len(start))])


def _patched_split(start: list[int], slen: list[int], ns: list[int], size: int) -> tuple[list[int], list[int]]:
    """Exceptions per patched-bytes block (``size``-byte items; ``ns[i]`` values) and where each block's code
    bytes begin, checked: a block stores k exceptions, then one byte per value (spec 7.3)."""
    ks = []
    for sl, n in zip(slen, ns):
        k, rem = divmod(sl - n, size)
        if sl < n or rem:
            raise Fallback
        ks.append(k)
    return ks, [a + k * size for a, k in zip(start, ks)]


def _patched_exceptions(view: memoryview, start: list[int], mid: list[int], dt: str) -> np.ndarray:
    """The exceptions of patched-bytes blocks, joined; each must be at least 255."""
    if start == mid:
        return np.zeros(0, DTYPES[dt])
    exc = np.frombuffer(join(view, start, mid), DTYPES[dt])
    if exc.size and int(exc.min()) < 255:
        raise Fallback
    return exc


def _patched_checked(view: memoryview, start: list[int], slen: list[int], ns: list[int]
                     ) -> tuple[list[int], list[int], np.ndarray, list[int]]:
    """Patched-bytes u8 blocks checked as in spec 7.3 without joining their codes: (code ranges, their ends, the
    exceptions, exceptions before each block)."""
    ks, mid = _patched_split(start, slen, ns, 8)
    end = [a + b for a, b in zip(start, slen)]
    buf = np.frombuffer(view, np.uint8)
    if [int(np.count_nonzero(buf[a:b] == 255)) for a, b in zip(mid, end)] != ks:
        raise Fallback
    return mid, end, _patched_exceptions(view, start, mid, "u8"), np.cumsum([0] + ks).tolist()


def _patched_parts(view: memoryview, start: list[int], slen: list[int], ns: list[int], size: int, dt: str
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, exceptions and escape positions of patched-bytes blocks, checked (spec 7.3): sizes, escapes per
    block, exceptions."""
    ks, mid = _patched_split(start, slen, ns, size)
    codes = np.frombuffer(join(view, mid, [a + b for a, b in zip(start, slen)]), np.uint8)
    esc = np.flatnonzero(codes == 255)
    if esc.size != sum(ks) or (esc.size and np.diff(np.searchsorted(esc, np.cumsum([0] + ns))).tolist() != ks):
        raise Fallback
    return codes, _patched_exceptions(view, start, mid, dt), esc


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
        return self.layout.chunk(self.idx[i])


class _Layout:
    """The directories of a batch of obs chunks, checked for all chunks at once (see :func:`layout`)."""

    def __init__(self, chunk_of: Callable[[Any], Chunk], entries: list, scales: list, names: list[str],
                 table: np.ndarray, ncols: np.ndarray, payload: np.ndarray, uniform_k: int) -> None:
        """``names``: the column names of the first chunk when every chunk has the same ``uniform_k`` columns,
        else of every chunk, in table order; ``scales``: each directory's ``scale`` value (None: no key)."""
        self.chunk_of, self.entries, self.scales = chunk_of, entries, scales
        self._names, self._table, self._ncols, self._payload = names, table, ncols, payload
        self._first = np.cumsum(ncols) - ncols
        self.uniform_k = uniform_k
        self._index: dict[str, np.ndarray] | None = None
        self._by_col: tuple[list, list, list, list] | None = None
        self._chunks: dict[int, Chunk] = {}

    def chunk(self, i: int) -> Chunk:
        """Chunk ``i`` decoded by ``chunk_of`` once (its deflate columns are read through it, column by column)."""
        ch = self._chunks.get(i)
        if ch is None:
            ch = self._chunks[i] = self.chunk_of(self.entries[i])
        return ch

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


def layout(view: memoryview, entries: list, chunk_of: Callable[[Any], Chunk], *, crc: bool = True) -> _Layout:
    """The directories of obs chunks (``entries``: commit entries whose payloads lie at ``offset +
    RECORD_HEADER_SIZE`` in ``view``) with every check of :func:`check_chunk` (CRC unless ``crc`` is false,
    directory against the commit entry, spec 7.4): each layout of column names and dtypes through ``chunk_of``
    (which checks one chunk as :func:`check_chunk` does) once, then codecs, offsets, sizes and padding of all
    chunks at once. Raises (anything) where the per-chunk path must name the problem."""
    dirs: list[memoryview] = []
    dir_end: list[int] = []
    for e in entries:
        start = e.offset + RECORD_HEADER_SIZE
        payload = view[start : start + e.length]
        if (crc and _crc(payload) != e.payload_crc) or e.length < 4 or e.rows > MAX_ROWS:
            raise Fallback
        mlen = int.from_bytes(payload[:4], "little")
        if mlen > MAX_META or 4 + mlen > e.length:
            raise Fallback
        dirs.append(payload[4 : 4 + mlen])
        d = 4 + mlen
        end = d + (-d % 8)
        if end > e.length or any(payload[d:end]):  # (the directory's padding: zero, spec 7.4)
            raise Fallback
        dir_end.append(end)
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
            chunk_of(entries[i])  # the full checks of spec 7.4, once per layout
            if len(_LAYOUTS_OK) >= _LAYOUTS_CAP:
                _LAYOUTS_OK.clear()
            info = _LAYOUTS_OK[key] = [
                -DTYPES[dt.decode()].itemsize if nm.decode() in OBS_VARIABLE else DTYPES[dt.decode()].itemsize
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
        raise Fallback
    rows = np.repeat(np.array([e.rows for e in entries], np.int64), ncols)
    fixed = size > 0
    if (fixed & (rlen != rows * size)).any() or (~fixed & (rlen % np.abs(size) != 0)).any():
        raise Fallback
    padded = slen + (-slen % 8)
    excl = np.cumsum(padded) - padded
    base = np.array(dir_end, np.int64)
    if (off != np.repeat(base - excl[first], ncols) + excl).any():
        raise Fallback
    last = first + ncols - 1
    if (base + excl[last] + padded[last] - excl[first] != np.array([e.length for e in entries], np.int64)).any():
        raise Fallback
    payload_at = np.array([e.offset + RECORD_HEADER_SIZE for e in entries], np.int64)
    pad = padded - slen
    some = pad > 0
    if some.any():
        at = np.repeat(payload_at, ncols)[some] + off[some] + slen[some]
        n = pad[some]
        j = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        if np.frombuffer(view, np.uint8)[np.repeat(at, n) + j].any():
            raise Fallback
    shown = [nm.decode() for nm in (names[:k] if which is None else names)]
    return _Layout(chunk_of, entries, scales, shown, t, ncols, payload_at, k if which is None else 0)
