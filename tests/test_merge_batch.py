"""Merge's batched input decode (``merge._batch_columns``, on the reader's ``batchdecode``) against its per-chunk
path: the same output bytes for inputs that mix codecs, sketch scales, exact and tally columns; the batched path
is the one taken on clean inputs; a damaged input chunk is reported with the input's path, the record's offset and
the code the reader gives."""

from __future__ import annotations

import importlib
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from history_helpers import (
    COLUMN_DAMAGE,
    damage_column,
    obs_payload,
    rewrite,
    write_mixed,
    write_patched,
)

import trainhist
from trainhist.errors import CorruptError
from trainhist.framing import RECORD_HEADER_SIZE

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
    if workers > 1:  # the sites built in worker processes (payloads handed over in spool files): the same bytes
        trainhist.merge(shards, tmp_path / "serial.th", workers=1)
        assert (tmp_path / "serial.th").read_bytes() == (tmp_path / "packed").with_suffix(".batch").read_bytes()
        assert not [f.name for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temporary file or folder


def test_workers_with_an_output_name_near_the_length_limit(shards: list[Path], tmp_path: Path) -> None:
    """Worker processes keep their spool files in a private folder with short names: an output name near the file
    system's 255-byte limit merges with workers as without (the spool files once took the output's name plus a
    suffix, failed to open in every worker, and multiprocessing replaced the workers forever). Run in a child
    process with a generous timeout, so that a hang fails the test instead of stalling the suite."""
    out = tmp_path / ("m" * 230 + ".th")
    code = ("import sys, trainhist; trainhist.merge(sys.argv[1:-1], sys.argv[-1], workers=2)")
    subprocess.run([sys.executable, "-c", code, *map(str, shards), str(out)], check=True, timeout=600)
    trainhist.merge(shards, tmp_path / "serial.th", workers=1)
    assert out.read_bytes() == (tmp_path / "serial.th").read_bytes()
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted([out.name, "serial.th"])  # no spool folder left


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


@pytest.mark.parametrize("damage", ["for_wrap", "patched_exception", "f32_nan", "step_range", "directory",
                                    "payload_crc"])
def test_damaged_input_chunk_named_with_path_offset_code(tmp_path: Path, damage: str) -> None:
    p, q = tmp_path / "a.thist", tmp_path / "b.thist"
    for r, path in enumerate((p, q)):
        write_patched(path, seed=r, run_id="fedcba9876543210fedcba9876543210", rank=r, world_size=2)
    data = bytearray(q.read_bytes())
    target, payload, cols = obs_payload(bytes(data), 2)
    start = target + RECORD_HEADER_SIZE
    length = len(payload)
    if damage in COLUMN_DAMAGE:
        damage_column(payload, cols, damage)
        want = COLUMN_DAMAGE[damage]
    elif damage == "directory":  # the directory's row count disagrees with the commit entry
        (mlen,) = struct.unpack_from("<I", payload)
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
        rewrite(data, target, bytes(payload))
    q.write_bytes(bytes(data))
    with trainhist.open(q) as h:
        with pytest.raises(CorruptError) as ei:
            h.verify()
        assert (ei.value.code, ei.value.offset) == (want, target)
    for workers in (1, 2):
        with pytest.raises(CorruptError) as ei:
            trainhist.merge([p, q], tmp_path / "out.th", workers=workers)
        assert (ei.value.code, ei.value.offset, ei.value.path) == (want, target, str(q))
        # no output, no temporary file and no worker's spool file is left behind
        assert sorted(f.name for f in tmp_path.iterdir()) == ["a.thist", "b.thist"]


def test_workers_asked_beyond_the_sites_are_capped_at_the_sites(shards: list[Path], tmp_path: Path) -> None:
    """``workers=64`` for a file of a few sites forks one worker a site, not 64 (each idle worker cost a fork: a
    thousand made a 1-second merge take 80); the bytes are those of the serial merge."""
    rep = trainhist.merge(shards, tmp_path / "many.th", workers=64)
    with trainhist.open(tmp_path / "many.th") as h:
        sites = len(h.sites)
    assert 1 < sites < 64 and rep.workers == sites
    trainhist.merge(shards, tmp_path / "serial.th", workers=1)
    assert (tmp_path / "many.th").read_bytes() == (tmp_path / "serial.th").read_bytes()
