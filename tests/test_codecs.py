"""Column codecs 3-5 of spec 7.3 (frame of reference, binary32, patched bytes): round trips through
``encode_chunk``/``decode_chunk`` in every dtype they apply to, the writer's per-column choice, and every invalid
block refused with ``bad_column_data`` naming the record's offset."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from trainhist.chunk import DTYPES, Codec, decode_chunk, encode_chunk
from trainhist.errors import CorruptError, UnsupportedError
from trainhist.framing import pad8

OFFSET = 4096  # the record offset every error must name


def enc(cols: dict, codec: int = Codec.PACKED, rows: int | None = None) -> bytes:
    n = rows if rows is not None else len(next(iter(cols.values()))[1])
    return encode_chunk({"rows": n}, cols, codec)


def dec(payload: bytes, cols: dict, variable=frozenset()):
    return decode_chunk(memoryview(payload), OFFSET, "f", {k: v[0] for k, v in cols.items()}, frozenset(variable))


def hand(rows: int, entries: list[tuple[str, str, int, bytes, int]]) -> bytes:
    """A chunk built by hand: entries are (name, dtype, codec, block, raw)."""
    import msgpack

    cols = [[n, dt, c, 0, len(b), raw] for n, dt, c, b, raw in entries]
    meta = {"rows": rows, "cols": cols}
    for _ in range(3):
        packed = msgpack.packb(meta)
        pos = 4 + len(packed) + pad8(4 + len(packed))
        for col, (_, _, _, b, _) in zip(cols, entries):
            col[3] = pos
            pos += len(b) + pad8(len(b))
    out = bytearray(struct.pack("<I", len(packed)) + packed)
    out += b"\0" * pad8(len(out))
    for _, _, _, b, _ in entries:
        out += b + b"\0" * pad8(len(b))
    return bytes(out)


RNG = np.random.default_rng(7)
INT_CASES = {
    "u1": [np.zeros(5, np.uint8), np.array([0, 255, 7], np.uint8)],
    "u2": [np.array([65535] * 3, np.uint16), RNG.integers(0, 300, 50).astype(np.uint16)],
    "u4": [np.array([0xFFFFFFFF, 0, 17], np.uint32), RNG.integers(0, 2**32, 9, dtype=np.uint64).astype(np.uint32)],
    "u8": [np.array([2**64 - 1] * 4, np.uint64), np.array([0, 2**64 - 1], np.uint64),
           np.array([2048, 4096, 6144] * 7, np.uint64), RNG.integers(0, 2000, 200).astype(np.uint64)],
    "i1": [np.array([-128, 127], np.int8), np.array([-3] * 4, np.int8)],
    "i2": [np.array([-32768, 32767, 0], np.int16)],
    "i4": [np.array([-(2**31), 5], np.int32)],
    "i8": [np.array([-(2**63), 2**63 - 1], np.int64), np.arange(-100, 100, dtype=np.int64),
           np.array([2**62] * 3, np.int64)],
}


@pytest.mark.parametrize("dt,arr", [(dt, a) for dt, arrs in INT_CASES.items() for a in arrs])
def test_integer_round_trip_every_codec(dt: str, arr: np.ndarray) -> None:
    cols = {"c": (dt, arr)}
    for codec in (Codec.PACKED, Codec.RAW, Codec.SHUFFLE_DEFLATE):
        ch = dec(enc(cols, codec), cols)
        got = ch.column("c", arr.size)
        assert got.dtype == DTYPES[dt] and np.array_equal(got, arr)
    # frame of reference forced, whatever the writer would pick
    from trainhist.chunk import _encode_for, _encode_patched

    blk = _encode_for(arr, dt)
    got = dec(hand(arr.size, [("c", dt, Codec.FOR, blk, arr.nbytes)]), cols).column("c", arr.size)
    assert got.dtype == DTYPES[dt] and np.array_equal(got, arr)
    if dt in ("u2", "u4", "u8"):
        blk = _encode_patched(arr, dt)
        got = dec(hand(arr.size, [("c", dt, Codec.PATCHED, blk, arr.nbytes)]), cols).column("c", arr.size)
        assert got.dtype == DTYPES[dt] and np.array_equal(got, arr)


def test_packed_picks_the_smallest() -> None:
    cols = {
        "const": ("u4", np.full(100, 0xFFFFFFFF, np.uint32)),
        "steps": ("i8", np.arange(1000, 1100, dtype=np.int64)),
        "counts": ("u8", np.where(np.arange(100) % 10 == 0, 1000, np.arange(100) % 200).astype(np.uint64)),
        "minf32": ("f8", np.linspace(-1, 1, 100).astype(np.float32).astype(np.float64)),
        "sum": ("f8", np.linspace(-1, 1, 100)),
        "blob": ("bytes", b"\x01\x02\x03"),
    }
    ch = dec(enc(cols), cols, {"blob"})
    codecs = {k: ch._dir[k][2] for k in cols}
    assert codecs == {"const": Codec.FOR, "steps": Codec.FOR, "counts": Codec.PATCHED, "minf32": Codec.F32,
                      "sum": Codec.RAW, "blob": Codec.RAW}
    assert ch._dir["const"][4] == 8 and ch._dir["steps"][4] == 108 and ch._dir["minf32"][4] == 400
    for k, (dt, a) in cols.items():
        want = np.frombuffer(a, np.uint8) if dt == "bytes" else a
        assert np.array_equal(ch.column(k), want) and ch.column(k).dtype == DTYPES[dt]


def test_f32_keeps_signed_zero_infinities_and_canonical_nan() -> None:
    canon = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000000))[0]
    a = np.array([-0.0, 0.0, np.inf, -np.inf, canon, 1.5, 2.0**-149, 3.4028234663852886e38])
    cols = {"m": ("f8", a)}
    ch = dec(enc(cols), cols)
    assert ch._dir["m"][2] == Codec.F32
    assert np.array_equal(ch.column("m").view(np.uint64), a.view(np.uint64))
    # a value binary32 cannot hold, and a NaN with another payload, keep the column raw
    for bad in (1.0 + 2.0**-40, struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0], 1e300):
        b = np.append(a, bad)
        ch = dec(enc({"m": ("f8", b)}), cols)
        assert ch._dir["m"][2] == Codec.RAW
        assert np.array_equal(ch.column("m").view(np.uint64), b.view(np.uint64))


def _err(payload: bytes, cols: dict, name: str = "c", rows: int | None = None) -> CorruptError:
    with pytest.raises(CorruptError) as ei:
        dec(payload, cols).column(name, rows)
    assert ei.value.code == "bad_column_data" and ei.value.offset == OFFSET, (ei.value.code, ei.value.offset)
    return ei.value


U8 = {"c": ("u8", np.zeros(4, np.uint64))}
U1 = {"c": ("u1", np.zeros(4, np.uint8))}
I1 = {"c": ("i1", np.zeros(4, np.int8))}
I8 = {"c": ("i8", np.zeros(4, np.int64))}
F8 = {"c": ("f8", np.zeros(4))}


@pytest.mark.parametrize("case", [
    # frame of reference: sizes that are not 8 + n * w for w in {0, 1, 2, 4, 8}
    ("for_short", U8, [("c", "u8", 3, b"\0" * 7, 32)]),
    ("for_width_3", U8, [("c", "u8", 3, b"\0" * 8 + b"\0" * 12, 32)]),
    ("for_ragged", U8, [("c", "u8", 3, b"\0" * 8 + b"\0" * 5, 32)]),
    ("for_width_16", U8, [("c", "u8", 3, b"\0" * 8 + b"\0" * 64, 32)]),
    # values outside the dtype's range: a wrapped u64, an overflowing u1, a base outside i1, an i64 past 2**63-1
    ("for_u8_wraps", U8, [("c", "u8", 3, struct.pack("<Q", 2**64 - 1) + bytes([0, 1, 0, 0]), 32)]),
    ("for_u1_overflow", U1, [("c", "u1", 3, struct.pack("<Q", 200) + bytes([0, 56, 0, 0]), 4)]),
    ("for_u1_base", U1, [("c", "u1", 3, struct.pack("<Q", 256), 4)]),
    ("for_i1_base", I1, [("c", "i1", 3, struct.pack("<q", -129), 4)]),
    ("for_i8_overflow", I8, [("c", "i8", 3, struct.pack("<q", 2**63 - 2) + bytes([0, 2, 0, 0]), 32)]),
    # binary32: wrong size, a NaN other than 0x7FC00000 (negative, signalling, with a payload)
    ("f32_size", F8, [("c", "f8", 4, b"\0" * 12, 32)]),
    ("f32_neg_nan", F8, [("c", "f8", 4, struct.pack("<4I", 0, 0xFFC00000, 0, 0), 32)]),
    ("f32_snan", F8, [("c", "f8", 4, struct.pack("<4I", 0, 0x7F800001, 0, 0), 32)]),
    ("f32_payload", F8, [("c", "f8", 4, struct.pack("<4I", 0x7FC00001, 0, 0, 0), 32)]),
    # patched: too short, ragged exceptions, wrong exception count (both ways), an exception below 255
    ("patched_short", U8, [("c", "u8", 5, b"\0" * 3, 32)]),
    ("patched_ragged", U8, [("c", "u8", 5, b"\0" * 7, 32)]),
    ("patched_missing_exception", U8, [("c", "u8", 5, bytes([1, 255, 2, 3]), 32)]),
    ("patched_extra_exception", U8, [("c", "u8", 5, struct.pack("<Q", 300) + bytes([1, 2, 2, 3]), 32)]),
    ("patched_two_for_one", U8, [("c", "u8", 5, struct.pack("<QQ", 300, 400) + bytes([1, 255, 2, 3]), 32)]),
    ("patched_small_exception", U8, [("c", "u8", 5, struct.pack("<Q", 254) + bytes([1, 255, 2, 3]), 32)]),
], ids=lambda c: c[0])
def test_invalid_blocks(case) -> None:
    _, cols, entries = case
    _err(hand(4, entries), cols)


@pytest.mark.parametrize("codec,dt", [(3, "f8"), (3, "bytes"), (4, "u8"), (4, "i8"), (5, "u1"), (5, "i8"),
                                      (5, "f8")])
def test_codec_on_a_dtype_it_does_not_apply_to(codec: int, dt: str) -> None:
    size = DTYPES[dt].itemsize
    with pytest.raises(CorruptError) as ei:
        dec(hand(4, [("c", dt, codec, b"\0" * 8 + b"\0" * 4 * size, 4 * size)]), {"c": (dt, None)}, {"c"})
    assert ei.value.code == "bad_column_data" and ei.value.offset == OFFSET


def test_unknown_codec_6() -> None:
    with pytest.raises(UnsupportedError) as ei:
        dec(hand(4, [("c", "u8", 6, b"\0" * 32, 32)]), U8)
    assert ei.value.code == "unknown_codec"


def test_valid_edge_blocks() -> None:
    # a constant u8 column of 2**64-1, a w=8 block spanning the whole u64 range, patched with no exception
    chunk = hand(4, [("c", "u8", 3, struct.pack("<Q", 2**64 - 1), 32)])
    assert dec(chunk, U8).column("c", 4).tolist() == [2**64 - 1] * 4
    blk = struct.pack("<q", -(2**63)) + struct.pack("<4Q", 0, 2**64 - 1, 1, 2**63)
    assert dec(hand(4, [("c", "i8", 3, blk, 32)]), I8).column("c", 4).tolist() == [-(2**63), 2**63 - 1, -(2**63) + 1, 0]
    assert dec(hand(4, [("c", "u8", 5, bytes([0, 1, 254, 3]), 32)]), U8).column("c", 4).tolist() == [0, 1, 254, 3]
    blk = struct.pack("<QQ", 2**64 - 1, 255) + bytes([255, 1, 255, 3])
    assert dec(hand(4, [("c", "u8", 5, blk, 32)]), U8).column("c", 4).tolist() == [2**64 - 1, 1, 255, 3]


@pytest.mark.parametrize("drop", ["sk_counts", "sk_pn", "sum_x", "sumsq_xn"])
def test_partial_optional_column_group_is_missing_column(drop: str) -> None:
    """Sketch columns come all together and exact sums in pairs (spec 7.5): a chunk with part of a group is refused
    with a typed error naming the record, never a KeyError later."""
    import types

    from trainhist.batchdecode import check_chunk
    from trainhist.framing import RecordType
    from trainhist.model import EXACT_COLUMNS, OBS_COLUMNS, SKETCH_COLUMNS

    rows = 2
    cols = {n: (dt, np.zeros(rows)) for n, dt in {**OBS_COLUMNS, **SKETCH_COLUMNS, **EXACT_COLUMNS}.items()}
    cols.update(sk_counts=("u8", np.zeros(0)), sum_x=("bytes", b""), sumsq_x=("bytes", b""))
    entry = types.SimpleNamespace(type=RecordType.OBS, site=0, segment=0, rows=rows, offset=1234)
    meta = {"site": 0, "segment": 0, "rows": rows, "scale": 2}
    check_chunk(memoryview(encode_chunk(meta, cols, Codec.RAW)), entry, "f.thist")  # the whole groups pass
    del cols[drop]
    with pytest.raises(CorruptError) as ei:
        check_chunk(memoryview(encode_chunk(meta, cols, Codec.RAW)), entry, "f.thist")
    assert ei.value.code == "missing_column" and ei.value.offset == 1234 and drop in str(ei.value)
