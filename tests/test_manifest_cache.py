"""Manifest validation remembered by the manifest's bytes (``schemas.validate_manifest(raw=...)``): the schema
check runs once per distinct manifest however many files repeat it, and an invalid manifest is refused every
time, with its own file and offset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from history_helpers import FAST, records, rewrite

import trainhist
from trainhist import schemas
from trainhist.errors import SchemaError
from trainhist.framing import RECORD_HEADER_SIZE, RecordType


def _shard(p: Path, rank: int) -> None:
    with trainhist.HistoryWriter(p, run_id="00112233445566778899aabbccddeeff", rank=rank, world_size=2,
                                 **FAST) as w:
        sites = [w.site(f"s{i}", "activation") for i in range(5)]
        for step in range(3):
            for s in sites:
                w.observe(s, step, np.arange(8, dtype=np.float32) + rank)


def test_each_distinct_manifest_checked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schemas, "_valid", set())
    checked: list[str] = []
    orig = schemas._check

    def count(doc, path, offset):
        checked.append(doc["kind"])
        return orig(doc, path, offset)

    monkeypatch.setattr(schemas, "_check", count)
    a, b = tmp_path / "a.th", tmp_path / "b.th"
    _shard(a, 0)
    _shard(b, 1)
    checked.clear()
    trainhist.open(a).close()
    first = len(checked)
    assert checked.count("site") == 5
    trainhist.open(b).close()  # the same site manifests (its writer and segment manifests differ)
    assert checked[first:].count("site") == 0
    n = len(checked)
    trainhist.open(a).close()
    trainhist.open(b).close()
    assert len(checked) == n  # nothing checked again
    trainhist.merge([a, b], tmp_path / "m.th", workers=1)
    assert checked[n:].count("site") == 0


def test_invalid_manifest_refused_every_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schemas, "_valid", set())
    a, b = tmp_path / "a.th", tmp_path / "b.th"
    _shard(a, 0)
    data = bytearray(a.read_bytes())
    for pos in records(bytes(data), RecordType.MANIFEST):
        length = int.from_bytes(data[pos + 4 : pos + 8], "little")
        payload = bytes(data[pos + RECORD_HEADER_SIZE : pos + RECORD_HEADER_SIZE + length])
        if b'"path":"s3"' in payload:
            rewrite(data, pos, payload.replace(b'"sharing":"shard"', b'"sharing":"xxxxx"'))
            bad_at = pos
    b.write_bytes(bytes(data))
    for path in (a, b, a, b):  # the valid file's manifests are remembered; the invalid one never is
        if path == b:
            with pytest.raises(SchemaError) as ei:
                trainhist.open(path)
            assert (ei.value.code, ei.value.offset, ei.value.path) == ("bad_manifest", bad_at, str(b))
        else:
            trainhist.open(path).close()
