"""Columnar chunk payloads (spec section 7): a msgpack directory, then 8-aligned little-endian column blocks.

Raw columns are read with ``np.frombuffer`` straight from the file map (no copy); deflated columns are inflated
once, bounded by their declared raw length; the lightweight codecs (frame of reference, binary32 narrowing,
patched bytes: spec 7.3) are decoded with a few numpy operations and widened to the column's registered dtype.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np

from .errors import CorruptError, LimitError, UnsupportedError
from .framing import pad8

__all__ = ["Codec", "DTYPES", "encode_chunk", "encode_chunks", "assemble_chunks", "pack_segments", "decode_chunk",
           "Chunk", "MAX_ROWS", "MAX_COLUMNS"]

MAX_ROWS = 1 << 20
MAX_COLUMNS = 64
MAX_META = 64 * 1024

DTYPES = {
    "u1": np.dtype("<u1"),
    "u2": np.dtype("<u2"),
    "u4": np.dtype("<u4"),
    "u8": np.dtype("<u8"),
    "i1": np.dtype("<i1"),
    "i2": np.dtype("<i2"),
    "i4": np.dtype("<i4"),
    "i8": np.dtype("<i8"),
    "f8": np.dtype("<f8"),
    "bytes": np.dtype("u1"),
}
_CODE_OF = {v.str: k for k, v in DTYPES.items() if k != "bytes"}


class Codec:
    """Column codecs (spec 7.3): the stored codes, and ``PACKED``, a writer's choice of one per column."""

    RAW = 0
    DEFLATE = 1  #: zlib stream (RFC 1950) of the raw bytes
    SHUFFLE_DEFLATE = 2  #: byte-transpose by item size, then a zlib stream
    FOR = 3  #: frame of reference: an 8-byte base, then one unsigned offset of 0, 1, 2, 4 or 8 bytes per value
    F32 = 4  #: f8 values that are all exactly binary32, stored as binary32
    PATCHED = 5  #: unsigned values as one byte each, 0xFF escaping to a full-width exception stored first
    STORED = (RAW, DEFLATE, SHUFFLE_DEFLATE, FOR, F32, PATCHED)
    #: not a stored code: ``encode_chunk`` picks, per column, the smallest of raw, FOR, F32 and PATCHED
    PACKED = 256
    BY_NAME = {"raw": RAW, "zlib": DEFLATE, "shuffle": SHUFFLE_DEFLATE, "packed": PACKED}


def _shuffle(raw: bytes, itemsize: int) -> bytes:
    if itemsize == 1:
        return raw
    return np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T.tobytes()


def _unshuffle(data: bytes, itemsize: int) -> bytes:
    if itemsize == 1:
        return data
    return np.frombuffer(data, np.uint8).reshape(itemsize, -1).T.tobytes()


_INT_CODES = ("u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8")
_UNSIGNED = {"u1": 255, "u2": 0xFFFF, "u4": 0xFFFFFFFF, "u8": 0xFFFFFFFFFFFFFFFF}
_RANGE = {**{k: (0, v) for k, v in _UNSIGNED.items()},
          **{f"i{b}": (-(1 << (8 * b - 1)), (1 << (8 * b - 1)) - 1) for b in (1, 2, 4, 8)}}
_FOR_WIDTHS = {0: None, 1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
#: which stored codecs apply to which dtype codes (spec 7.3)
APPLIES = {
    Codec.RAW: frozenset(DTYPES), Codec.DEFLATE: frozenset(DTYPES), Codec.SHUFFLE_DEFLATE: frozenset(DTYPES),
    Codec.FOR: frozenset(_INT_CODES), Codec.F32: frozenset({"f8"}), Codec.PATCHED: frozenset({"u2", "u4", "u8"}),
}
_CANONICAL_NAN32 = 0x7FC00000


def _for_width(span: int) -> int:
    """The narrowest frame-of-reference offset width (bytes) that holds ``span``."""
    return next(w for w in (0, 1, 2, 4, 8) if span < (1 << (8 * w)))


def _encode_for(arr: np.ndarray, dt: str, lo: int | None = None, w: int | None = None) -> bytes | None:
    """Frame of reference: base = the least value, offsets at the narrowest width that holds the range (``lo`` and
    ``w``: that base and width, when the caller has them)."""
    if arr.size == 0:
        return None
    if lo is None or w is None:
        lo = int(arr.min())
        w = _for_width(int(arr.max()) - lo)
    signed = dt.startswith("i")
    base = struct.pack("<q" if signed else "<Q", lo)
    if w == 0:
        return base
    if signed:
        off = arr.astype(np.int64, copy=False) - np.int64(lo)
    else:
        off = arr.astype(np.uint64, copy=False) - np.uint64(lo)
    return base + off.astype(_FOR_WIDTHS[w]).tobytes()


def _encode_f32(arr: np.ndarray) -> bytes | None:
    """binary32 when every value (NaN bit patterns included) survives the round trip exactly."""
    if arr.size == 0:
        return None
    with np.errstate(all="ignore"):
        n = arr.astype("<f4")
    if not np.array_equal(n.astype("<f8").view("<u8"), arr.view("<u8")):
        return None
    return n.tobytes()


def _encode_patched(arr: np.ndarray, dt: str, big: np.ndarray | None = None) -> bytes | None:
    """One byte per value below 255; 0xFF escapes to the next full-width exception, stored before the bytes
    (``big``: the mask ``arr >= 255``, when the caller has it)."""
    if arr.size == 0:
        return None
    if big is None:
        big = arr >= 255
    codes = np.minimum(arr, 255).astype(np.uint8)
    return arr[big].astype(DTYPES[dt]).tobytes() + codes.tobytes()


def _padded(n: int) -> int:
    return n + pad8(n)


def _pack_column(dt: str, arr: np.ndarray | bytes, raw: bytes | None = None) -> tuple[int, bytes]:
    """The smallest of raw and the lightweight codecs that apply to ``dt`` (raw on ties: it is read in place), as
    :func:`_pack_columns` picks it. ``raw``: the raw bytes, when the caller has them."""
    codec, blk, _ = _pack_columns([(dt, arr)])[0]
    return codec, raw if codec == Codec.RAW and raw is not None else blk


def _pack_columns(columns: list[tuple[str, np.ndarray | bytes]]) -> list[tuple[int, bytes, int]]:
    """``(codec, stored block, raw length)`` of each ``(dtype code, array or bytes)`` under ``Codec.PACKED``: the
    smallest (after padding) of raw and the lightweight codecs that apply to the dtype, raw on ties.

    A commit packs thousands of short columns, and a numpy call costs more than its work on one of them: the
    columns of one dtype are joined and packed by :func:`pack_segments`, each a segment of the joined array."""
    out: list[tuple[int, bytes, int]] = [(Codec.RAW, b"", 0)] * len(columns)
    groups: dict[str, tuple[list[int], list[np.ndarray]]] = {}
    for i, (dt, arr) in enumerate(columns):
        if isinstance(arr, (bytes, bytearray)):
            out[i] = (Codec.RAW, arr, len(arr))
            continue
        a = np.ascontiguousarray(arr, DTYPES[dt])
        if dt == "bytes" or not a.size:
            out[i] = (Codec.RAW, a.tobytes(), a.nbytes)
        else:
            at, arrays = groups.setdefault(dt, ([], []))
            at.append(i)
            arrays.append(a.ravel())
    for dt, (at, arrays) in groups.items():
        flat = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        for i, packed in zip(at, pack_segments(dt, flat, [a.size for a in arrays], Codec.PACKED)):
            out[i] = packed
    return out


def pack_segments(dt: str, flat: np.ndarray, sizes: list[int], codec: int) -> list[tuple[int, bytes, int]]:
    """``(codec, stored block, raw length)`` of each of the columns that ``flat`` (contiguous, of the dtype of
    ``dt``) holds one after another, ``sizes[k]`` values each: what :func:`encode_chunks` stores for them under
    ``codec``. Under ``Codec.PACKED`` the choice of each is made with one set of numpy calls for all of them
    (statistics by ``reduceat``, blocks cut from shared buffers): only the block that wins is built."""
    flat = np.ascontiguousarray(flat, DTYPES[dt]).reshape(-1)  # (no copy when it already is)
    if sum(sizes) != flat.size:
        raise ValueError(f"segments of {sum(sizes)} values in all, of an array of {flat.size}")
    if codec != Codec.PACKED or dt == "bytes":
        starts = itertools.accumulate(sizes, initial=0)
        return [_encode_column(dt, flat[s : s + n], Codec.RAW if codec == Codec.PACKED else codec)
                for s, n in zip(starts, sizes)]
    out: list[tuple[int, bytes, int]] = [(Codec.RAW, b"", 0)] * len(sizes)
    at = [k for k, n in enumerate(sizes) if n]
    if not at:
        return out
    n_ = np.array(sizes, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(n_)[:-1]))[at]
    n_ = n_[at]
    (_pack_f8 if dt == "f8" else _pack_ints)(dt, flat, at, starts, n_, out)
    return out


def _pack_f8(dt: str, flat: np.ndarray, at: list[int], starts: np.ndarray, sizes: np.ndarray,
             out: list[tuple[int, bytes, int]]) -> None:
    """Binary32 (codec 4) for each f8 segment whose values (NaN bit patterns included) all survive the round trip
    and whose block is smaller after padding, raw otherwise; into ``out`` at the positions ``at``."""
    with np.errstate(all="ignore"):
        narrow = flat.astype("<f4")
    exact = np.logical_and.reduceat(narrow.astype("<f8").view("<u8") == flat.view("<u8"), starts).tolist()
    f32, raw = narrow.tobytes(), flat.tobytes()
    for i, ok, s, n in zip(at, exact, starts.tolist(), sizes.tolist()):
        if ok and _padded(4 * n) < _padded(8 * n):
            out[i] = (Codec.F32, f32[4 * s : 4 * (s + n)], 8 * n)
        else:
            out[i] = (Codec.RAW, raw[8 * s : 8 * (s + n)], 8 * n)


#: frame-of-reference widths by ``searchsorted(_FOR_LIMITS, span, "right")``: 0 bytes for span 0, 1 below 256, ...
_FOR_LIMITS = np.array([1, 1 << 8, 1 << 16, 1 << 32], np.uint64)
_FOR_WIDTH_AT = np.array([0, 1, 2, 4, 8], np.int64)
_SIGN = np.uint64(1 << 63)


def _pack_ints(dt: str, flat: np.ndarray, at: list[int], starts: np.ndarray, sizes: np.ndarray,
               out: list[tuple[int, bytes, int]]) -> None:
    """Frame of reference (codec 3), patched bytes (codec 5, unsigned of 2 or more bytes) or raw for each integer
    segment, whichever is smallest after padding (raw, then frame of reference, on ties); into ``out`` at ``at``.
    The sizes of the frame of reference and patched blocks follow from each segment's range and its number of
    values of 255 or more."""
    itemsize = flat.itemsize
    u = flat.astype(np.uint64)  # signed values sign-extend, then v + 2**63 (mod 2**64) keeps their order
    bias = _SIGN if dt[0] == "i" else np.uint64(0)
    if bias:
        u ^= bias
    lows = np.minimum.reduceat(u, starts)
    width = _FOR_WIDTH_AT[np.searchsorted(_FOR_LIMITS, np.maximum.reduceat(u, starts) - lows, "right")]
    # sizes compare in 8-byte words, after padding
    raw_words = -(-sizes * itemsize // 8)
    for_words = -(-(8 + width * sizes) // 8)
    codec = np.where(for_words < raw_words, Codec.FOR, Codec.RAW)
    nbig = np.zeros(len(at), np.int64)
    if dt in APPLIES[Codec.PATCHED]:
        nbig = np.add.reduceat(u >= 255, starts, dtype=np.int64)
        codec[-(-(nbig * itemsize + sizes) // 8) < np.minimum(for_words, raw_words)] = Codec.PATCHED
    bases = (lows ^ bias).astype("<u8").tobytes()  # each least value as stored: "<q" of it for signed columns
    offsets: dict[int, bytes] = {}  # width -> every value less the least of its segment, at that width
    used = set(width[codec == Codec.FOR].tolist()) - {0}
    if used:
        diff = u - np.repeat(lows, sizes)  # v - lo (mod 2**64), whose low bytes are the offsets
        offsets = {w: diff.astype(_FOR_WIDTHS[w]).tobytes() for w in used}
    codes = np.minimum(u, 255).astype(np.uint8).tobytes() if (codec == Codec.PATCHED).any() else b""
    raw = flat.tobytes() if (codec == Codec.RAW).any() else b""
    for k, (i, c, w, s, n, nb) in enumerate(zip(at, codec.tolist(), width.tolist(), starts.tolist(), sizes.tolist(),
                                                nbig.tolist())):
        if c == Codec.FOR:
            blk = bases[8 * k : 8 * k + 8] + (offsets[w][w * s : w * (s + n)] if w else b"")
        elif c == Codec.PATCHED:
            a = flat[s : s + n]
            blk = (a[a >= 255].tobytes() if nb else b"") + codes[s : s + n]
        else:
            blk = raw[itemsize * s : itemsize * (s + n)]
        out[i] = (c, blk, itemsize * n)


#: (value, bytes added): a non-negative integer takes 1 byte in msgpack below 128, one more from 128, one more from
#: 256, two more from 65536, four more from 2**32 (the packer takes the shortest form)
_UINT_GROWS = ((128, 1), (256, 1), (65536, 2), (1 << 32, 4))
_ZEROS = [b"\0" * k for k in range(8)]  #: padding of k bytes


def _encode_column(dt: str, arr: np.ndarray | bytes, codec: int) -> tuple[int, bytes, int]:
    """``(codec, stored block, raw length)`` of one column under a stored codec: raw, deflate, or shuffle-deflate
    (plain deflate for 1-byte items); raw when the compressed block is no smaller."""
    raw = arr if isinstance(arr, (bytes, bytearray)) else np.ascontiguousarray(arr, DTYPES[dt]).tobytes()
    c = codec
    if c == Codec.SHUFFLE_DEFLATE and DTYPES[dt].itemsize == 1:
        c = Codec.DEFLATE
    if c == Codec.DEFLATE:
        stored = zlib.compress(raw, 6)
    elif c == Codec.SHUFFLE_DEFLATE:
        stored = zlib.compress(_shuffle(raw, DTYPES[dt].itemsize), 6)
    else:
        stored = raw
    if c != Codec.RAW and len(stored) >= len(raw):
        c, stored = Codec.RAW, raw
    return c, stored, len(raw)


def encode_chunk(meta: dict, columns: dict[str, tuple[str, np.ndarray | bytes]], codec: int) -> bytes:
    """Payload of a chunk: ``meta`` plus columns given as ``name -> (dtype code, array or bytes)`` in order.

    ``codec`` applies to every column; columns of 1-byte items use plain deflate instead of shuffle.
    ``Codec.PACKED`` picks per column the smallest (after padding) of raw, FOR, F32 and PATCHED, raw on ties.
    """
    return encode_chunks([(meta, columns)], codec)[0]


def encode_chunks(chunks: list[tuple[dict, dict[str, tuple[str, np.ndarray | bytes]]]], codec: int) -> list[bytes]:
    """:func:`encode_chunk` of each ``(meta, columns)``; the columns of all of them are packed together."""
    if codec == Codec.PACKED:
        packed = iter(_pack_columns([col for _, columns in chunks for col in columns.values()]))
        stored = [[next(packed) for _ in columns] for _, columns in chunks]
    else:
        stored = [[_encode_column(dt, arr, codec) for dt, arr in columns.values()] for _, columns in chunks]
    return assemble_chunks([(meta, [(name, dt, blk) for (name, (dt, _)), blk in zip(columns.items(), got)])
                            for (meta, columns), got in zip(chunks, stored)])


def assemble_chunks(chunks: list[tuple[dict, list[tuple[str, str, tuple[int, bytes, int]]]]]) -> list[bytes]:
    """The payload of each ``(meta, columns)`` whose columns are already stored: ``(name, dtype code, (codec,
    stored block, raw length))`` in order (from :func:`pack_segments`)."""
    pack = msgpack.Packer(use_bin_type=True).pack  # (one packer for all of them: packb makes one per call)
    return [_assemble(pack, meta, [[name, dt, c, 0, len(blk), rlen] for name, dt, (c, blk, rlen) in cols],
                      [blk for _, _, (_, blk, _) in cols]) for meta, cols in chunks]


def _assemble(pack: Callable[[object], bytes], meta: dict, cols: list[list], blocks: list[bytes]) -> bytes:
    """The payload: the msgpack directory ``meta`` + ``cols`` (each ``[name, dtype, codec, offset, stored, raw]``,
    offsets 0, filled in here), then the blocks, each 8-aligned (``pack``: a msgpack packer's ``pack``)."""
    meta = dict(meta, cols=cols)
    # The offsets depend on the directory's length, which depends on the offsets' msgpack widths: starting from
    # the length with every offset 0, recompute the offsets until they hold still (the least consistent layout).
    sizes = [len(b) for b in blocks]
    rel = list(itertools.accumulate([(n + 7) & ~7 for n in sizes], initial=0))[:-1]  # padded; past the directory
    base = len(pack(meta))
    length, start = base, -1
    while start != 4 + length + (-(4 + length) & 7):
        start = 4 + length + (-(4 + length) & 7)
        length = base + sum(grow * (len(rel) - bisect_left(rel, at - start)) for at, grow in _UINT_GROWS)
    for col, r in zip(cols, rel):
        col[3] = start + r
    packed = pack(meta)
    assert len(packed) == length
    parts = [struct.pack("<I", length), packed, _ZEROS[-(4 + length) & 7]]
    for blk, n in zip(blocks, sizes):
        parts += (blk, _ZEROS[-n & 7])
    return b"".join(parts)


@dataclass
class Chunk:
    """A decoded chunk directory; columns are decoded on demand by :meth:`column`."""

    meta: dict
    payload: memoryview
    offset: int  # file offset of the record (its header), named by every error
    path: str | None
    _dir: dict

    def has(self, name: str) -> bool:
        return name in self._dir

    def raw_size(self, name: str) -> int:
        """The decoded byte length the directory declares for column ``name`` (checked within the limits, not yet
        against the data): a variable-length column's size is compared with what other columns imply before it is
        decoded, so that a lying directory costs no allocation."""
        return int(self._dir[name][5])

    def column(self, name: str, rows: int | None = None) -> np.ndarray:
        """The column as a numpy array of its registered dtype; ``rows`` checks the element count of fixed-width
        columns."""
        name_, dt, codec, off, slen, rlen = self._dir[name]
        dtype = DTYPES[dt]
        data = self.payload[off : off + slen]
        if codec == Codec.RAW:
            arr = np.frombuffer(data, dtype)
        elif codec == Codec.FOR:
            arr = self._for(name, dt, data, rlen // dtype.itemsize)
        elif codec == Codec.F32:
            arr = self._f32(name, data, rlen // 8)
        elif codec == Codec.PATCHED:
            arr = self._patched(name, dt, data, rlen // dtype.itemsize)
        else:
            try:
                d = zlib.decompressobj()
                raw = d.decompress(data, rlen)
                if len(raw) != rlen or d.unconsumed_tail or not d.eof or d.unused_data:
                    raise zlib.error("length mismatch")
            except zlib.error as e:
                raise self._data(name, f"deflate stream invalid or not exactly {rlen} bytes ({e})") from None
            if codec == Codec.SHUFFLE_DEFLATE:
                raw = _unshuffle(raw, dtype.itemsize)
            arr = np.frombuffer(raw, dtype)
        if rows is not None and arr.size != rows:
            raise CorruptError(
                f"column {name!r} holds {arr.size} values, the chunk declares {rows} rows",
                code="bad_column_length", path=self.path, offset=self.offset,
            )
        return arr

    def _data(self, name: str, msg: str) -> CorruptError:
        return CorruptError(f"column {name!r}: {msg}", code="bad_column_data", path=self.path, offset=self.offset)

    def _for(self, name: str, dt: str, data: memoryview, n: int) -> np.ndarray:
        """Frame of reference (spec 7.3, codec 3): base + offset, checked to lie in the dtype's range."""
        slen = len(data)
        w, rem = divmod(slen - 8, n) if n else (-1, 0)
        if slen < 8 or rem or w not in _FOR_WIDTHS:
            raise self._data(name, f"frame-of-reference block of {slen} bytes for {n} values: not 8 + n x (0, 1, "
                                   f"2, 4 or 8) bytes")
        signed = dt[0] == "i"
        (base,) = struct.unpack_from("<q" if signed else "<Q", data, 0)
        lo, hi = _RANGE[dt]
        if w == 0:
            if not lo <= base <= hi:
                raise self._data(name, f"frame-of-reference base {base} outside the range of {dt}")
            return np.full(n, base, DTYPES[dt])
        off = np.frombuffer(data, _FOR_WIDTHS[w], n, 8)
        top = base + int(off.max())
        if not lo <= base or top > hi:
            raise self._data(name, f"frame-of-reference values {base}..{top} outside the range of {dt}")
        out = off.astype(np.uint64)
        out += np.uint64(base & 0xFFFFFFFFFFFFFFFF)  # exact: every sum lies in the range just checked
        if signed:
            out = out.view(np.int64)
        return out if dt in ("u8", "i8") else out.astype(DTYPES[dt])

    def _f32(self, name: str, data: memoryview, n: int) -> np.ndarray:
        """binary32 values widened exactly (spec 7.3, codec 4); the only NaN allowed is 0x7FC00000."""
        if len(data) != 4 * n:
            raise self._data(name, f"binary32 block of {len(data)} bytes for {n} values")
        a = np.frombuffer(data, "<f4")
        nan = np.isnan(a)
        if nan.any() and (a.view("<u4")[nan] != _CANONICAL_NAN32).any():
            raise self._data(name, "binary32 block holds a NaN other than 0x7FC00000")
        return a.astype(np.float64)

    def _patched(self, name: str, dt: str, data: memoryview, n: int) -> np.ndarray:
        """Patched bytes (spec 7.3, codec 5): k exceptions of the item size, then n bytes, 0xFF escaping."""
        size = DTYPES[dt].itemsize
        k, rem = divmod(len(data) - n, size)
        if len(data) < n or rem:
            raise self._data(name, f"patched block of {len(data)} bytes for {n} values of {dt}")
        codes = np.frombuffer(data, np.uint8, n, k * size)
        out = codes.astype(DTYPES[dt])
        if k or len(data) > n:
            esc = np.flatnonzero(codes == 255)
            exc = np.frombuffer(data, DTYPES[dt], k)
            if esc.size != k or (k and int(exc.min()) < 255):
                raise self._data(name, f"patched block: {esc.size} escape bytes, {k} exceptions (each >= 255)")
            out[esc] = exc
        elif (codes == 255).any():
            raise self._data(name, "patched block: escape bytes without exceptions")
        return out


def _bad(msg: str, path: str | None, offset: int, code: str = "bad_chunk") -> CorruptError:
    return CorruptError(msg, code=code, path=path, offset=offset)


def decode_chunk(
    payload: memoryview, offset: int, path: str | None, known: dict[str, str], variable: frozenset[str] = frozenset()
) -> Chunk:
    """Parse and validate a chunk directory: bounds, alignment, dtypes, codecs, declared sizes (spec 7.4).

    ``offset`` is the file offset of the record holding the chunk; every error names it (spec 8).

    ``known`` maps the column names this reader understands to their dtype code; ``variable`` names the known
    columns whose length is given by other columns. An unknown column is ignorable only when its name starts
    with ``x-``; otherwise the chunk needs a newer reader.
    """
    n = len(payload)
    if n < 4:
        raise _bad("chunk payload shorter than its 4-byte directory length", path, offset)
    (mlen,) = struct.unpack_from("<I", payload, 0)
    if mlen > MAX_META or 4 + mlen > n:
        raise _bad(f"chunk directory length {mlen} exceeds the payload ({n} bytes) or {MAX_META}", path, offset)
    try:
        meta = msgpack.unpackb(
            bytes(payload[4 : 4 + mlen]), raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0,
            max_str_len=4096, max_array_len=4096, max_map_len=64,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise _bad(f"chunk directory is not valid msgpack ({type(e).__name__}: {e})", path, offset) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("cols"), list) or not isinstance(meta.get("rows"), int):
        raise _bad("chunk directory must be a map with 'rows' (int) and 'cols' (array)", path, offset)
    rows = meta["rows"]
    if not 0 < rows <= MAX_ROWS:
        raise LimitError(f"chunk declares {rows} rows; allowed 1..{MAX_ROWS}", code="too_many_rows", path=path,
                         offset=offset)
    cols = meta["cols"]
    if len(cols) > MAX_COLUMNS:
        raise LimitError(f"chunk declares {len(cols)} columns; at most {MAX_COLUMNS}", code="too_many_columns",
                         path=path, offset=offset)
    fast = _fast_directory(payload, n, mlen, rows, cols, known, variable)
    if fast is not None:
        return Chunk(meta, payload, offset, path, fast)
    directory: dict[str, list] = {}
    end = 4 + mlen + pad8(4 + mlen)
    if any(payload[4 + mlen : end]):
        raise _bad("padding after the chunk directory is not zero", path, offset)
    for c in cols:
        if (
            not isinstance(c, list) or len(c) != 6 or not isinstance(c[0], str) or not isinstance(c[1], str)
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in c[2:])
        ):
            raise _bad(f"column entry {c!r} is not [name, dtype, codec, offset, stored, raw]", path, offset)
        name, dt, codec, off, slen, rlen = c
        if name in directory:
            raise _bad(f"column {name!r} appears twice", path, offset)
        if dt not in DTYPES:
            raise UnsupportedError(f"column {name!r} has unknown dtype {dt!r}", code="unknown_dtype", path=path,
                                   offset=offset)
        if codec not in APPLIES:
            raise UnsupportedError(f"column {name!r} uses unknown codec {codec}", code="unknown_codec", path=path,
                                   offset=offset)
        if dt not in APPLIES[codec]:
            raise _bad(f"column {name!r}: codec {codec} does not apply to dtype {dt}", path, offset,
                       "bad_column_data")
        if off != end or off % 8 or slen < 0 or off + slen > n:
            raise _bad(
                f"column {name!r} at offset {off} (+{slen}) is not the next 8-aligned block ({end}) inside the "
                f"{n}-byte payload", path, offset,
            )
        if codec == Codec.RAW and slen != rlen:
            raise _bad(f"raw column {name!r} stores {slen} bytes but declares {rlen}", path, offset)
        if rlen > 64 * MAX_ROWS * 8:
            raise LimitError(f"column {name!r} declares {rlen} raw bytes", code="column_too_large", path=path,
                             offset=offset)
        if rlen % DTYPES[dt].itemsize:
            raise _bad(f"column {name!r} declares {rlen} raw bytes, not a multiple of the {dt} item size", path, offset)
        if name not in variable and rlen != rows * DTYPES[dt].itemsize:
            raise _bad(f"column {name!r} declares {rlen} bytes for {rows} rows of {dt}", path, offset)
        if name in known:
            if known[name] != dt:
                raise _bad(f"column {name!r} must have dtype {known[name]}, found {dt}", path, offset)
        elif not name.startswith("x-"):
            raise UnsupportedError(
                f"chunk has required column {name!r} unknown to this reader (unknown ignorable columns start "
                f"with 'x-'): upgrade trainhist", code="unknown_column", path=path, offset=offset,
            )
        if any(payload[off + slen : off + slen + pad8(slen)]):
            raise _bad(f"padding after column {name!r} is not zero", path, offset)
        end = off + slen + pad8(slen)
        directory[name] = c
    if end != n:
        raise _bad(f"chunk payload has {n - end} trailing bytes after its last column", path, offset)
    if len(_SIGNATURES) > 4096:
        _SIGNATURES.clear()
    _SIGNATURES[(tuple((c[0], c[1], c[2]) for c in cols), id(known), variable)] = (known, [
        -DTYPES[c[1]].itemsize if c[0] in variable else DTYPES[c[1]].itemsize for c in cols])
    return Chunk(meta, payload, offset, path, directory)


# (column (name, dtype, codec) triples, id of the known-columns map, variable names) of directories that passed
# the full validation -> (that map, item size per column, negated for variable columns). A directory with the same
# triples needs only the checks that depend on offsets and sizes.
_SIGNATURES: dict[tuple, tuple[dict, list[int]]] = {}


def _fast_directory(payload: memoryview, n: int, mlen: int, rows: int, cols: list, known: dict[str, str],
                    variable: frozenset[str]) -> dict[str, list] | None:
    """The directory of a chunk whose column triples were validated before, if every per-chunk check (entry
    types, offsets, sizes, padding) passes; None sends the chunk through the full validation, which names the
    first problem."""
    try:
        info = _SIGNATURES.get((tuple([(c[0], c[1], c[2]) for c in cols]), id(known), variable))
    except (TypeError, KeyError, IndexError):
        return None
    if info is None or info[0] is not known:
        return None
    end = 4 + mlen
    end += -end % 8
    if any(payload[4 + mlen : end]):
        return None
    directory = {}
    limit = 64 * MAX_ROWS * 8
    for c, size in zip(cols, info[1]):
        if type(c) is not list or len(c) != 6:
            return None
        _, _, codec, off, slen, rlen = c
        if type(codec) is not int or type(off) is not int or type(slen) is not int or type(rlen) is not int:
            return None
        if off != end or slen < 0 or off + slen > n or (codec == 0 and slen != rlen) or rlen > limit:
            return None
        if (rlen != rows * size) if size > 0 else rlen % -size:
            return None
        p = -slen % 8
        end = off + slen + p
        if p and any(payload[end - p : end]):
            return None
        directory[c[0]] = c
    return directory if end == n else None
