"""``chunk._pack_column`` (the packed codec's choice per column, sizes first, only the winning block built)
against building every candidate block and keeping the smallest after padding, raw on ties (spec 7.3); the
same for many columns packed together (``_pack_columns``, ``encode_chunks``: one set of numpy calls for all of
them), and the directory layout against re-packing the directory until its offsets hold still."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from trainhist.chunk import (
    DTYPES,
    Codec,
    _encode_f32,
    _encode_for,
    _encode_patched,
    _pack_column,
    _pack_columns,
    _encode_column,
    decode_chunk,
    encode_chunk,
    encode_chunks,
    pack_segments,
)
from trainhist.framing import pad8


def _every_block(dt: str, arr: np.ndarray) -> tuple[int, bytes]:
    a = np.ascontiguousarray(arr, DTYPES[dt])
    best, stored = Codec.RAW, a.tobytes()
    if dt == "bytes":
        return best, stored
    cands = [(Codec.F32, _encode_f32(a))] if dt == "f8" else [(Codec.FOR, _encode_for(a, dt))]
    if dt in ("u2", "u4", "u8"):
        cands.append((Codec.PATCHED, _encode_patched(a, dt)))
    for c, blk in cands:
        if blk is not None and len(blk) + pad8(len(blk)) < len(stored) + pad8(len(stored)):
            best, stored = c, blk
    return best, stored


@pytest.mark.parametrize("dt", ["u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "f8", "bytes"])
def test_pack_column_equals_building_every_block(dt: str) -> None:
    rng = np.random.default_rng(7)
    info = np.finfo(np.float64) if dt == "f8" else np.iinfo(DTYPES[dt])
    for n in (0, 1, 2, 3, 7, 8, 9, 40, 257):
        for spread in (0, 1, 254, 255, 256, 70000, 1 << 40, None):
            if dt == "f8":
                a = rng.standard_normal(n) * (1.0 if spread is None else float(spread))
                if spread == 1:
                    a = a.astype(np.float32).astype(np.float64)
            else:
                hi = int(info.max) if spread is None else min(int(info.max), int(info.min) + spread + 1, 1 << 62)
                lo = int(info.min) if spread is None else max(int(info.min), 0 if dt[0] == "u" else -spread)
                hi = max(hi, lo + 1)
                a = rng.integers(lo, hi, n, dtype=np.int64 if hi <= 1 << 62 and lo >= -(1 << 62) else DTYPES[dt],
                                 endpoint=False).astype(DTYPES[dt])
                if n > 2 and dt[0] == "u":
                    a[rng.integers(0, n, 2)] = 255 if spread == 255 else a[0]
            for arr in (a, a.astype(np.int64) if dt in ("u2", "u4", "i4") else a):
                assert _pack_column(dt, arr) == _every_block(dt, arr), (dt, n, spread)
    assert _pack_column("bytes", b"abc") == (Codec.RAW, b"abc")


def _random_column(rng: np.random.Generator, dt: str, n: int) -> np.ndarray | bytes:
    """Values of ``dt`` that reach each codec: constant, narrow and full ranges, values of 255 and more, binary32."""
    if dt == "bytes":
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    if dt == "f8":
        a = rng.standard_normal(n) * 10.0 ** rng.integers(-300, 300)
        if rng.random() < 0.5:
            with np.errstate(over="ignore"):
                a = a.astype(np.float32).astype(np.float64)
        if n and rng.random() < 0.3:
            a[rng.integers(0, n)] = rng.choice([np.nan, np.inf, -0.0])
        return a
    info = np.iinfo(DTYPES[dt])
    lo = [int(info.min), 0, min(250, int(info.max)), int(info.max)][int(rng.integers(0, 4))]
    spread = [0, 1, 255, 256, 70000, 1 << 40][int(rng.integers(0, 6))]
    hi = min(int(info.max), lo + spread)
    a = np.array([int(v) for v in rng.integers(0, hi - lo + 1, n, dtype=np.uint64)], dtype=object) + lo
    return a.astype(DTYPES[dt])


def test_pack_columns_together_equal_each_alone() -> None:
    """Columns of every dtype and of several lengths packed in one call: each as building every block picks it."""
    rng = np.random.default_rng(11)
    dts = ["u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "f8", "bytes"]
    for _ in range(60):
        cols = []
        for _ in range(int(rng.integers(1, 40))):
            dt = str(rng.choice(dts))
            cols.append((dt, _random_column(rng, dt, int(rng.choice([0, 1, 2, 7, 30, 31, 300])))))
        got = _pack_columns(cols)
        for (dt, arr), (codec, stored, rlen) in zip(cols, got):
            want = (Codec.RAW, arr) if isinstance(arr, bytes) else _every_block(dt, arr)
            assert (codec, stored) == want, dt
            assert rlen == (len(arr) if isinstance(arr, bytes) else arr.size * DTYPES[dt].itemsize)


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.DEFLATE, Codec.SHUFFLE_DEFLATE, Codec.PACKED])
def test_pack_segments_equal_each_segment_alone(codec: int) -> None:
    """Consecutive segments of one array (empty ones among them), packed in one call: each stored as it would be
    alone (under the packed codec: as building every block picks it)."""
    rng = np.random.default_rng(13 + codec)
    for dt in ["u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "f8", "bytes"]:
        for _ in range(8):
            sizes = [int(rng.choice([0, 1, 2, 7, 31, 300])) for _ in range(int(rng.integers(1, 30)))]
            segs = [_random_column(rng, dt, n) for n in sizes]
            segs = [np.frombuffer(a, np.uint8) if isinstance(a, bytes) else a for a in segs]
            flat = np.concatenate(segs).astype(DTYPES[dt]) if segs else np.zeros(0, DTYPES[dt])
            got = pack_segments(dt, flat, sizes, codec)
            assert len(got) == len(sizes)
            for a, (c, stored, rlen) in zip(segs, got):
                want = _every_block(dt, a) if codec == Codec.PACKED else _encode_column(dt, a, codec)[:2]
                assert (c, stored) == want and rlen == a.size * DTYPES[dt].itemsize, dt


def test_pack_segments_takes_the_column_dtype() -> None:
    """Values given in another dtype are packed as the column's (as encode_chunk converts them); segments that do
    not cover the array exactly are refused."""
    wide = np.array([1, 2, 70000, 3], np.int64)
    for codec in (Codec.RAW, Codec.PACKED):
        assert pack_segments("u4", wide, [1, 3], codec) == pack_segments("u4", wide.astype(np.uint32), [1, 3], codec)
    with pytest.raises(ValueError, match="segments of 3 values"):
        pack_segments("u4", wide, [1, 2], Codec.PACKED)


def test_encode_chunks_equals_encode_chunk_of_each() -> None:
    rng = np.random.default_rng(12)
    for codec in (Codec.RAW, Codec.DEFLATE, Codec.SHUFFLE_DEFLATE, Codec.PACKED):
        chunks = []
        for k in range(8):
            n = int(rng.choice([1, 3, 30]))
            cols = {f"c{j}": (dt, _random_column(rng, dt, n))
                    for j, dt in enumerate(rng.choice(["u1", "u4", "u8", "i8", "f8", "bytes"], 6))}
            chunks.append(({"site": k, "rows": n}, cols))
        assert encode_chunks(chunks, codec) == [encode_chunk(meta, cols, codec) for meta, cols in chunks]


def _least_layout(meta: dict, blocks: list[bytes]) -> bytes:
    """The directory found the straightforward way: offsets from the directory packed with every offset 0, then
    re-packed with the offsets it implies until they hold still."""
    offsets = [0] * len(blocks)
    while True:
        packed = msgpack.packb(dict(meta, cols=[[f"c{j}", "u1", 0, o, len(b), len(b)]
                                               for j, (o, b) in enumerate(zip(offsets, blocks))]), use_bin_type=True)
        pos, new = 4 + len(packed) + pad8(4 + len(packed)), []
        for b in blocks:
            new.append(pos)
            pos += len(b) + pad8(len(b))
        if new == offsets:
            return packed
        offsets = new


@pytest.mark.parametrize("sizes", [[1], [100, 20], [120, 5, 9], [250, 3], [65400, 100, 1], [65536] * 3,
                                   [10, 65500, 7, 200]])
def test_directory_offsets_are_the_least_consistent_layout(sizes: list[int]) -> None:
    """Offsets crossing the msgpack widths (128, 256, 65536): the directory is the one re-packing settles on."""
    blocks = [bytes([j + 1]) * n for j, n in enumerate(sizes)]
    meta = {"rows": 1}
    payload = encode_chunk(meta, {f"c{j}": ("u1", b) for j, b in enumerate(blocks)}, Codec.RAW)
    (mlen,) = struct.unpack_from("<I", payload)
    assert payload[4 : 4 + mlen] == _least_layout(meta, blocks)
    ch = decode_chunk(memoryview(payload), 0, None, {f"c{j}": "u1" for j in range(len(blocks))},
                      frozenset(f"c{j}" for j in range(len(blocks))))
    assert [ch.column(f"c{j}").tobytes() for j in range(len(blocks))] == blocks
