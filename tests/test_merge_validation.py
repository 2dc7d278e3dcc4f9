"""Which error merge and coarsen give an input with several defects (spec 11, validation order): an input that a
full check (``trainhist verify``, spec 8) refuses is refused with that check's code and offset, the one section 8's
order finds first in it, before any rule of merge (11.1-11.8) is applied; merge's own refusals are only about
inputs that are each valid."""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path

import numpy as np
import pytest
from history_helpers import records, rewrite

import trainhist
from trainhist.errors import TrainhistError
from trainhist.framing import RECORD_HEADER_SIZE, RecordType


def _verify_error(p: Path) -> tuple[str, int | None]:
    with pytest.raises(TrainhistError) as ei:
        trainhist.open(p).verify()
    return ei.value.code, ei.value.offset


def _damage_chunk(p: Path, index: int, rtype: int = RecordType.OBS) -> int:
    """Flip a byte of the payload of the ``index``-th chunk of type ``rtype`` (its payload CRC then fails: a
    corruption the reader finds only when it reads the chunk); its record offset."""
    data = bytearray(p.read_bytes())
    pos = records(bytes(data), rtype)[index]
    data[pos + RECORD_HEADER_SIZE + 5] ^= 0x40
    p.write_bytes(bytes(data))
    return pos


def _writer(p: Path, run: str, rank: int = 0, world: int = 1) -> trainhist.HistoryWriter:
    return trainhist.HistoryWriter(p, run_id=run, rank=rank, world_size=world, fsync="never",
                                   created="2026-01-01T00:00:00+00:00")


def _refused(fn, out: Path) -> TrainhistError:
    with pytest.raises(TrainhistError) as ei:
        fn(out)
    assert not out.exists()
    return ei.value


def _set_origin_number(p: Path, seg: int, number: int) -> None:
    """Rewrite the one-digit ``origin.segment`` of segment ``seg`` of the derived file ``p`` (CRCs fixed)."""
    data = bytearray(p.read_bytes())
    for pos in records(bytes(data), RecordType.MANIFEST):
        length = struct.unpack_from("<I", data, pos + 4)[0]
        payload = bytes(data[pos + RECORD_HEADER_SIZE: pos + RECORD_HEADER_SIZE + length])
        doc = json.loads(payload)
        if doc["kind"] == "segment" and doc["id"] == seg:
            old = b'"segment":%d,' % doc["origin"]["segment"]
            rewrite(data, pos, payload.replace(old, b'"segment":%d,' % number))
    p.write_bytes(bytes(data))


def test_a_damaged_input_that_also_breaks_segment_order_gets_the_readers_error(tmp_path: Path) -> None:
    """segment_order was decided from the manifests before any chunk was read, so a derived input whose segment
    numbers are out of order and whose chunk is damaged was refused as segment_order, not as verify refuses it."""
    run = uuid.uuid4().hex
    with _writer(src := tmp_path / "w.th", run) as w:
        s = w.site("x", "activation")
        w.observe(s, 0, np.ones(3))
        w.new_segment(1, "resume")
        w.observe(s, 1, np.ones(3))
    trainhist.merge([src], bad := tmp_path / "bad.th")
    _set_origin_number(bad, 0, 5)  # segment 1 (number 1) continues segment 0 (number 5): segment_order
    assert trainhist.open(bad).verify()["status"] == "clean"
    e = _refused(lambda o: trainhist.merge([bad], o), tmp_path / "o0.th")
    assert e.code == "segment_order"  # (valid input: merge's own refusal)
    at = _damage_chunk(bad, 1)
    code, offset = _verify_error(bad)
    assert (code, offset) == ("bad_payload_crc", at)
    for i, fn in enumerate((lambda o: trainhist.merge([bad], o), lambda o: trainhist.merge([bad], o, across_runs=True),
                            lambda o: trainhist.coarsen(bad, o, steps=2))):
        e = _refused(fn, tmp_path / f"o{i + 1}.th")
        assert (e.code, e.offset, e.path) == (code, offset, str(bad)), e


def test_a_damaged_input_given_twice_gets_the_readers_error_not_overlapping_writers(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    run = uuid.uuid4().hex
    with _writer(a := tmp_path / "a.th", run) as w:
        w.observe(w.site("x", "activation"), 0, np.ones(3))
    checked: list[str] = []
    verify = trainhist.reader.History.verify
    monkeypatch.setattr(trainhist.reader.History, "verify", lambda h: checked.append(h.path) or verify(h))
    e = _refused(lambda o: trainhist.merge([a, a], o), tmp_path / "o0.th")
    assert e.code == "overlapping_writers" and checked == [str(a)]  # (a valid input, checked in full once)
    at = _damage_chunk(a, 0)
    e = _refused(lambda o: trainhist.merge([a, a], o), tmp_path / "o.th")
    assert (e.code, e.offset, e.path) == ("bad_payload_crc", at, str(a))


def test_merge_level_refusals_found_while_merging_wait_for_the_inputs_full_check(tmp_path: Path) -> None:
    """A replica divergence, a count overflow or sites that disagree on sharing found in one site (or in the
    manifests) are merge's refusals; an input whose steps chunk (read after every site) or later site is damaged is
    refused first with the reader's code and offset."""
    run = uuid.uuid4().hex
    paths = []
    for r in range(2):
        with _writer(p := tmp_path / f"r{r}.th", run, r, 2) as w:
            rep = w.site("a", "param", sharing="replica")
            other = w.site("b", "activation", sharing="shard" if r == 0 else "replica")
            w.observe(rep, 0, np.full(2, 1.0 + r))  # replicas differ: replica_divergence
            w.observe(other, 0, np.ones(2))
            w.step_truth(0, applied=True)
        paths.append(p)
    e = _refused(lambda o: trainhist.merge(paths, o), tmp_path / "o0.th")
    assert e.code == "incompatible_sites"
    at = _damage_chunk(paths[1], 0, RecordType.STEPS)
    assert _verify_error(paths[1]) == ("bad_payload_crc", at)
    e = _refused(lambda o: trainhist.merge(paths, o), tmp_path / "o1.th")
    assert (e.code, e.offset, e.path) == ("bad_payload_crc", at, str(paths[1]))
    # the same without the sites that disagree: replica_divergence at site a before the steps chunk is read
    for r, p in enumerate(paths):
        p.unlink()
        with _writer(p, run, r, 2) as w:
            w.observe(w.site("a", "param", sharing="replica"), 0, np.full(2, 1.0 + r))
            w.observe(w.site("z", "activation"), 0, np.ones(2))
            w.step_truth(0, applied=True)
    e = _refused(lambda o: trainhist.merge(paths, o), tmp_path / "o2.th")
    assert e.code == "replica_divergence"
    at = _damage_chunk(paths[0], 0, RecordType.STEPS)
    e = _refused(lambda o: trainhist.merge(paths, o), tmp_path / "o3.th")
    assert (e.code, e.offset, e.path) == ("bad_payload_crc", at, str(paths[0]))
    e = _refused(lambda o: trainhist.merge(paths, o, workers=2), tmp_path / "o4.th")
    assert (e.code, e.offset, e.path) == ("bad_payload_crc", at, str(paths[0]))


def test_an_input_with_two_damaged_sites_gets_the_error_of_verifys_site_order(tmp_path: Path) -> None:
    """Merge builds the output sites in key order; verify checks an input's sites in id order. An input whose site
    0 (key "z") and site 1 (key "a") are both damaged is refused with site 0's chunk, as verify refuses it."""
    with _writer(p := tmp_path / "w.th", uuid.uuid4().hex) as w:
        z = w.site("z", "activation")
        a = w.site("a", "activation")
        w.observe(z, 0, np.ones(3))
        w.observe(a, 0, np.ones(3))
    h = trainhist.open(p)
    z_at, a_at = h._obs[0][0].offset, h._obs[1][0].offset
    h.close()
    assert records(p.read_bytes(), RecordType.OBS) == sorted([z_at, a_at])
    for at in (z_at, a_at):
        data = bytearray(p.read_bytes())
        data[at + RECORD_HEADER_SIZE + 5] ^= 0x40
        p.write_bytes(bytes(data))
    assert _verify_error(p) == ("bad_payload_crc", z_at)
    for i, fn in enumerate((lambda o: trainhist.merge([p], o), lambda o: trainhist.coarsen(p, o, steps=2))):
        e = _refused(fn, tmp_path / f"o{i}.th")
        assert (e.code, e.offset) == ("bad_payload_crc", z_at), e


def test_an_output_in_a_missing_folder_or_with_no_name_says_what_to_write(tmp_path: Path) -> None:
    from trainhist.errors import UsageError

    src = tmp_path / "a.thist"
    with trainhist.HistoryWriter(src) as w:
        w.observe(w.site("x", "activation"), 0, np.ones(2))
    for out, words in ((tmp_path / "nodir" / "m.thist", "create it first"), (str(tmp_path) + os.sep, "name the file")):
        with pytest.raises(UsageError) as e:
            trainhist.merge([src], out)
        assert e.value.code == "bad_output" and words in str(e.value), str(e.value)
