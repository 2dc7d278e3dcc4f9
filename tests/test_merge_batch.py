"""Merge's batched input decode (``merge._batch_columns``, on the reader's ``batchdecode``) against its per-chunk
path: the same output bytes for inputs that mix codecs, sketch scales, exact and tally columns; the batched path
is the one taken on clean inputs; a damaged input chunk is reported with the input's path, the record's offset and
the code the reader gives."""

from __future__ import annotations

import importlib
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
from history_helpers import FAST, write_mixed

import trainhist
from trainhist.chunk import Codec
from trainhist.errors import CorruptError
from trainhist.framing import RECORD_HEADER_SIZE, RecordType, crc32c
from trainhist.writer import HistoryWriter

merge_mod = importlib.import_module("trainhist.merge")  # the package exports the function as ``merge``


def _shard(p: Path, rank: int, world: int, run_id: str, codecs: tuple[str, ...]) -> None:
    write_mixed(p, codecs, seed=rank, run_id=run_id, rank=rank, world_size=world)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("mergebatch")
    out = []
    for r, codecs in enumerate((("raw", "packed", "shuffle", "packed"), ("packed",), ("shuffle", "raw"))):
        p = d / f"r{r}.thist"
        _shard(p, r, 3, "0123456789abcdef0123456789abcdef", codecs)
        out.append(p)
    return out


def _per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: object) -> None:
        raise merge_mod.Fallback

    monkeypatch.setattr(merge_mod, "_batch_columns", refuse)


def _batched_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*a: object) -> None:
        raise AssertionError("the per-chunk path was taken on clean inputs")

    monkeypatch.setattr(merge_mod._Engine, "_decode_each", never)


def _both(monkeypatch: pytest.MonkeyPatch, fn, out: Path) -> None:
    """``fn(output)`` through the batched path, then through the per-chunk path: the same bytes."""
    with monkeypatch.context() as m:
        _batched_only(m)
        fn(out.with_suffix(".batch"))
    with monkeypatch.context() as m:
        _per_chunk(m)
        fn(out.with_suffix(".each"))
    assert out.with_suffix(".batch").read_bytes() == out.with_suffix(".each").read_bytes()


@pytest.mark.parametrize("workers", [1, 2])
def test_merge_batched_equals_per_chunk(shards: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        workers: int) -> None:
    for codec in ("packed", "raw", "shuffle"):
        _both(monkeypatch, lambda o: trainhist.merge(shards, o, codec=codec, workers=workers), tmp_path / codec)


def test_coarsen_and_merge_of_merges_batched_equals_per_chunk(shards: list[Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a.th", tmp_path / "b.th"
    trainhist.merge(shards[:2], a, workers=1)  # tally columns, 4096-row chunks
    trainhist.merge(shards[2:], b, workers=1, codec="shuffle")
    _both(monkeypatch, lambda o: trainhist.merge([a, b], o, workers=1), tmp_path / "mm")
    for bpo in (4, 2, 1):  # downscaled chunks go one by one
        _both(monkeypatch, lambda o: trainhist.coarsen(shards[0], o, steps=3, bins_per_octave=bpo, workers=1),
              tmp_path / f"c{bpo}")
        _both(monkeypatch, lambda o: trainhist.coarsen(a, o, steps=2, bins_per_octave=bpo, workers=1),
              tmp_path / f"ca{bpo}")


def _records(data: bytes, rtype: int) -> list[int]:
    out, pos = [], 32
    while pos < len(data):
        t, _f, length = struct.unpack_from("<HHI", data, pos)
        if t == rtype:
            out.append(pos)
        pos += RECORD_HEADER_SIZE + length + (-length % 8)
    return out


@pytest.mark.parametrize("damage", ["for_wrap", "patched_exception", "f32_nan", "step_range", "directory",
                                    "payload_crc"])
def test_damaged_input_chunk_named_with_path_offset_code(tmp_path: Path, damage: str) -> None:
    p, q = tmp_path / "a.thist", tmp_path / "b.thist"
    for r, path in enumerate((p, q)):
        with HistoryWriter(path, run_id="fedcba9876543210fedcba9876543210", rank=r, world_size=2, commit_every=10,
                           **{k: v for k, v in FAST.items() if k != "commit_every"}) as w:
            a = w.site("a", "activation")
            rng = np.random.default_rng(r)
            for step in range(50):
                x = rng.standard_normal(5000 + step).astype(np.float32) * 1000
                x[:400] = 1.0  # one bin above 254: a patched exception per row
                w.observe(a, step, x)
    data = bytearray(q.read_bytes())
    target = _records(bytes(data), RecordType.OBS)[2]
    start = target + RECORD_HEADER_SIZE
    length = struct.unpack_from("<I", data, target + 4)[0]
    payload = bytearray(data[start : start + length])
    (mlen,) = struct.unpack_from("<I", payload)
    d = {c[0]: c for c in msgpack.unpackb(bytes(payload[4 : 4 + mlen]))["cols"]}
    want = "bad_column_data"
    if damage == "for_wrap":
        _, _, codec, off, slen, _ = d["count"]
        assert codec == Codec.FOR and slen > 8
        struct.pack_into("<Q", payload, off, 2**64 - 1)
    elif damage == "patched_exception":
        _, _, codec, off, slen, rlen = d["sk_counts"]
        assert codec == Codec.PATCHED and slen - rlen // 8 >= 8
        struct.pack_into("<Q", payload, off, 7)
    elif damage == "f32_nan":
        _, _, codec, off, _, _ = d["min"]
        assert codec == Codec.F32
        struct.pack_into("<I", payload, off, 0x7FC00001)
    elif damage == "step_range":
        _, _, codec, off, _, _ = d["step"]
        assert codec == Codec.FOR
        struct.pack_into("<q", payload, off, struct.unpack_from("<q", payload, off)[0] + 1)
        want = "bad_chunk"
    elif damage == "directory":  # the directory's row count disagrees with the commit entry
        meta = msgpack.unpackb(bytes(payload[4 : 4 + mlen]))
        meta["rows"] += 1
        new = msgpack.packb(meta)
        assert len(new) == mlen
        payload[4 : 4 + mlen] = new
        want = "bad_chunk"
    if damage == "payload_crc":  # a flipped byte, CRCs left as they were
        data[start + length - 1] ^= 0x40
        want = "bad_payload_crc"
    else:
        data[start : start + length] = payload
        struct.pack_into("<I", data, target + 24, crc32c(bytes(payload)))
        struct.pack_into("<I", data, target + 28, crc32c(bytes(data[target : target + 28])))
    q.write_bytes(bytes(data))
    with trainhist.open(q) as h:
        with pytest.raises(CorruptError) as ei:
            h.verify()
        assert (ei.value.code, ei.value.offset) == (want, target)
    for workers in (1, 2):
        with pytest.raises(CorruptError) as ei:
            trainhist.merge([p, q], tmp_path / "out.th", workers=workers)
        assert (ei.value.code, ei.value.offset, ei.value.path) == (want, target, str(q))
