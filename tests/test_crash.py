"""Crash and corruption behaviour of the reader (spec section 8), byte by byte.

A small but representative file (sketches, exact-sum columns, scalars, step truth, a mark() gap, two phases,
two segments, several commits) is

* truncated at every byte offset: opening never raises, the readable content is exactly the content of the
  last commit boundary at or before the cut, and the recovery report accounts for every byte;
* damaged one byte at a time (xor 0xFF) over the whole committed region, and one bit at a time over a sample:
  ``open()`` + ``verify()`` raise a ``FormatError`` naming the offset of the damaged record (0 for the file
  header), and never return different data;
* spliced with records of another file (other salt), concatenated with another file, or given a record whose
  CRCs are right but whose sequence number is wrong: all rejected.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import trainhist
from trainhist.errors import CorruptError, FormatError
from trainhist.framing import FILE_HEADER_SIZE, RECORD_HEADER_SIZE, FileHeader, RecordHeader, RecordType, crc32c
from trainhist.model import Phase
from trainhist.writer import HistoryWriter

SALT_A = 0x5EED_0000_0000_00A1
SALT_B = 0x5EED_0000_0000_00B2
FIXED = dict(writer_id="0" * 31 + "1", created="2026-01-01T00:00:00+00:00", pid=1, host="test",
             software={"trainhist": "test"}, fsync="never", commit_every=10**9, commit_seconds=1e18)


def write_sample(path: Path, salt: int = SALT_A, seed: int = 0) -> dict:
    """The representative file; returns what was written (for checking the final commit against the source).

    Four sites (float32 activation with sketches; float64 param with exact sum_x columns, a failed gap and
    sketches on alternate steps; a gradient in two phases; the loss scalar), step truth with unknowns, three
    commits and a second segment.
    """
    rng = np.random.default_rng(seed)
    fed: dict = {"act": [], "w": [], "loss": []}
    with HistoryWriter(path, run_name="crash", salt=salt, config={"lr": 0.1}, settings={"k": 1}, **FIXED) as w:
        act = w.site("enc.0", "activation", shape=[24], dtype="float32")
        wt = w.site("enc.0.w", "param", shape=[6], dtype="float64", cadence_sketch=2)
        gr = w.site("enc.0.w", "param_grad", dtype="float32")
        for step in range(5):
            if step == 3:
                w.new_segment(3, reason="manual")  # commits step 2's rows first
            a = (rng.standard_normal(24) * 3).astype(np.float32)
            w.observe(act, step, a)
            fed["act"].append(a)
            if step == 2:
                w.mark(wt, step, "failed")
            else:
                # 1 + 2**-60 is not a float64: the sum is stored in the exact sum_x column; 1e300**2 overflows
                v = np.array([1.0, 2.0**-60, -0.5, 1e300, -1e300, step], np.float64)
                w.observe(wt, step, v, sketch=step % 2 == 0)
                fed["w"].append(v)
            g = rng.standard_normal(8).astype(np.float32)
            w.observe(gr, step, g, phase="pre_clip")
            w.observe(gr, step, g / 2, phase="post_clip", sketch=False)
            w.scalar("loss", step, 1.0 / (step + 1))
            fed["loss"].append(1.0 / (step + 1))
            w.step_truth(step, applied=step != 2, loss_scale=None if step % 3 else 1024.0, tokens=100 * step)
            if step == 1:
                w.commit()
    return fed


def records(data: bytes) -> list[tuple[int, int, RecordHeader]]:
    """(offset, end, header) of every record, by walking headers (the file must be intact)."""
    out = []
    pos = FILE_HEADER_SIZE
    while pos < len(data):
        h = RecordHeader.parse(data, pos)
        assert h is not None, pos
        end = pos + RECORD_HEADER_SIZE + h.padded_length
        out.append((pos, end, h))
        pos = end
    assert pos == len(data)
    return out


def commit_boundaries(data: bytes) -> list[int]:
    """File sizes at which the file ends just after a commit record (plus the bare header)."""
    return [FILE_HEADER_SIZE] + [end for _, end, h in records(data) if h.type == RecordType.COMMIT]


def extract(h: trainhist.History) -> dict:
    """Everything the reader exposes, as plain comparable values (bytes of every column)."""
    def cols(d: dict) -> dict:
        return {k: (v.dtype.str, v.tobytes()) for k, v in sorted(d.items())}

    out: dict = {
        "runs": repr(h.runs), "writers": repr(h.writers), "settings": repr(h.settings), "segments": repr(h.segments),
        "sites": [(s.key, repr(s.manifest)) for s in h.sites],
        "ignored": list(h.ignored_records), "steps": cols(h.steps),
    }
    for s in h.sites:
        for ph in Phase.NAMES:
            sp = h.spine(s.path, s.stream, s.facet, phase=ph)
            sk = h.sketch(s.path, s.stream, s.facet, phase=ph)
            if len(sp) == 0:
                assert len(sk) == 0
                continue
            out[(s.key, ph)] = {
                "spine": cols(sp.columns), "exact": (tuple(sp.exact["sum"]), tuple(sp.exact["sumsq"])),
                "sketch": (sk.scale, sk.pos.tobytes(), sk.neg.tobytes(), sk.bands.tobytes(), cols(sk.columns)),
            }
    return out


class FastReader:
    """Memoizes pure reader functions by their complete input, so every byte offset can be tried in seconds.

    * ``validate_manifest(doc)`` by the document (jsonschema costs ~2 ms a manifest);
    * ``History.chunk(e)`` by (path, commit entry, the payload's bytes), returning a Chunk over a private copy;
    * ``History._site_data(site, phase)`` by (path, site, phase, every entry of the site with its payload bytes).

    A damaged payload or a different set of committed entries is a different key, so it always takes the real
    path (CRC check and decoding); only byte-identical inputs reuse a result (or re-raise the same error). If a
    private name is missing (refactored), that memo is skipped and the test is just slower.
    """

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        from trainhist import reader
        from trainhist.chunk import Chunk
        from trainhist.framing import RECORD_HEADER_SIZE as RH

        History = reader.History
        memo: dict = {}

        def cached(key, compute, copy=lambda r: r):
            if key in memo:
                r = memo[key]
            else:
                try:
                    r = compute()
                except FormatError as err:
                    r = err
                memo[key] = r
            if isinstance(r, BaseException):
                raise r
            return copy(r)

        orig_validate = reader.validate_manifest

        def validate_manifest(doc, **kw):
            return cached(("manifest", json.dumps(doc, sort_keys=True), kw.get("offset"), kw.get("path")),
                          lambda: (orig_validate(doc, **kw), doc)[1])

        mp.setattr(reader, "validate_manifest", validate_manifest)

        def payload(h, e) -> bytes:
            return bytes(h._view[e.offset + RH : e.offset + RH + e.length])

        orig_chunk = History.chunk

        def chunk(self, e):
            data = payload(self, e)

            def compute():
                ch = orig_chunk(self, e)
                return Chunk(ch.meta, memoryview(data), ch.offset, ch.path, ch._dir)  # no view of the file map

            return cached(("chunk", self.path, tuple(e), data), compute)

        mp.setattr(History, "chunk", chunk)
        if hasattr(History, "_site_data"):
            orig_site = History._site_data

            def site_data(self, site, phase, *, sketches=True):
                key = ("site", self.path, site.id, site.key, phase, sketches,
                       tuple((tuple(e), payload(self, e)) for e in self._obs.get(site.id, [])))
                return cached(key, lambda: orig_site(self, site, phase, sketches=sketches),
                              lambda r: (dict(r[0]), dict(r[1]), r[2]))

            mp.setattr(History, "_site_data", site_data)


@pytest.fixture(scope="module", autouse=True)
def fast_reader():
    with pytest.MonkeyPatch.context() as mp:
        yield FastReader(mp)


def read(path: Path, verify: bool = True) -> tuple[trainhist.History, dict]:
    """Open, verify (optional: extract decodes every committed chunk too) and extract everything."""
    h = trainhist.open(path)
    try:
        if verify:
            h.verify()
        return h, extract(h)
    finally:
        h.close()


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict, Path]:
    d = tmp_path_factory.mktemp("crash")
    p = d / "sample.thist"
    fed = write_sample(p)
    data = p.read_bytes()
    assert 8_000 <= len(data) <= 24_000, len(data)  # small: every byte offset is opened (twice) below
    return data, fed, d


@pytest.fixture(scope="module")
def at_boundary(sample: tuple[bytes, dict, Path]) -> dict[int, dict]:
    """The content of the file truncated at each commit boundary."""
    data, _, d = sample
    out = {}
    p = d / "boundary.thist"
    for b in commit_boundaries(data):
        p.write_bytes(data[:b])
        h, content = read(p)
        assert h.recovery.status == "clean" and h.committed_bytes == b
        out[b] = content
    return out


def test_sample_is_representative(sample: tuple[bytes, dict, Path], at_boundary: dict[int, dict]) -> None:
    data, fed, d = sample
    recs = records(data)
    types = [h.type for _, _, h in recs]
    assert types.count(RecordType.COMMIT) >= 3 and types[-1] == RecordType.COMMIT
    assert RecordType.STEPS in types and RecordType.OBS in types
    p = d / "full.thist"
    p.write_bytes(data)
    with trainhist.open(p) as h:
        assert h.recovery.status == "clean" and h.committed_bytes == len(data)
        assert [g.id for g in h.segments] == [0, 1] and h.segments[1].previous == 0
        a = h.spine("enc.0")
        assert len(a) == 5 and a.observed.all()
        assert [a.summary(i).sum for i in range(5)] == [trainhist.summarize(x).sum for x in fed["act"]]
        wt = h.spine("enc.0.w", "param")
        assert wt.presence_names.count("failed") == 1
        assert any(x is not None for x in wt.exact["sum"])  # the exact column is in the file
        assert len(h.sketch("enc.0.w", "param")) == 2
        assert [wt.summary(i).sum for i in np.flatnonzero(wt.observed)] == [
            trainhist.summarize(v).sum for v in fed["w"]]
        assert h.spine("loss", "scalar").sum.tolist() == fed["loss"]
        assert len(h.spine("enc.0.w", "param_grad", phase="pre_clip")) == 5
        assert len(h.sketch("enc.0.w", "param_grad", phase="post_clip")) == 0
        assert h.steps["step"].tolist() == list(range(5))
    # each boundary's content is a prefix of the next one's, row by row
    bs = sorted(at_boundary)
    for b0, b1 in zip(bs, bs[1:]):
        c0, c1 = at_boundary[b0], at_boundary[b1]
        for key, v in c0.items():
            if isinstance(key, tuple):
                for name, (dt, raw) in v["spine"].items():
                    assert c1[key]["spine"][name][1].startswith(raw), (b0, key, name)
        assert len(c0["sites"]) <= len(c1["sites"])


def index_of(h: trainhist.History) -> tuple:
    """What the scan built: manifests, and every committed chunk's entry (offset, type, site, rows, CRC...)."""
    return (repr(h.runs), repr(h.writers), repr(h.settings), repr(h.segments),
            [(s.key, repr(s.manifest)) for s in h.sites], list(h.ignored_records), h.committed_records,
            {k: [tuple(e) for e in v] for k, v in h._obs.items()},
            [tuple(e) for e in h._steps])


def test_truncation_at_every_byte(sample: tuple[bytes, dict, Path], at_boundary: dict[int, dict]) -> None:
    """Cut at every offset: no exception, the exact committed prefix, and every byte accounted for.

    At every offset the scan's index (manifests and every committed chunk's entry, including its payload CRC)
    must equal the index at the commit boundary; since the committed bytes are the same bytes, equal indexes
    mean equal content. The content itself (every column of every site, phase, sketch and the steps table,
    decoded) is compared at every record boundary, one byte either side of it, and every 17th offset.
    """
    data, _, d = sample
    bounds = sorted(at_boundary)
    starts = {pos for pos, _, _ in records(data)}
    full_check = {x + k for x in starts | set(bounds) for k in (-1, 0, 1)} | set(range(0, len(data) + 1, 17))
    p = d / "trunc.thist"
    indexes: dict[int, tuple] = {}
    for b in bounds:
        p.write_bytes(data[:b])
        with trainhist.open(p) as h:
            indexes[b] = index_of(h)
    p.write_bytes(data)
    checked = 0
    with open(p, "r+b") as f:
        for size in range(len(data), -1, -1):
            f.truncate(size)
            f.flush()
            with trainhist.open(p) as h:  # never raises
                r = h.recovery
                if size < FILE_HEADER_SIZE:
                    assert h.header is None and r.status == "torn"
                    assert (h.committed_bytes, r.committed_bytes, r.dropped_bytes) == (0, 0, size)
                    assert h.sites == [] and h.segments == [] and h.runs == [] and h.steps["step"].size == 0
                    continue
                expect = max(b for b in bounds if b <= size)
                assert h.committed_bytes == r.committed_bytes == expect, size
                assert r.dropped_bytes == size - expect, size
                assert r.status == ("clean" if size == expect else "torn"), (size, r)
                assert index_of(h) == indexes[expect], f"index at size {size} differs from commit boundary {expect}"
                if size in full_check:
                    checked += 1
                    assert extract(h) == at_boundary[expect], f"content at size {size} differs from boundary {expect}"
    assert checked > len(data) // 17


def test_zero_filled_tail(sample: tuple[bytes, dict, Path], at_boundary: dict[int, dict]) -> None:
    """Space allocated but never written after a crash reads as a torn tail, wherever the last commit is."""
    data, _, d = sample
    p = d / "zeros.thist"
    for b in sorted(at_boundary)[1:]:
        for extra in (1, 31, 32, 33, 4096):
            p.write_bytes(data[:b] + bytes(extra))
            h, content = read(p)
            assert (h.recovery.status, h.committed_bytes, h.recovery.dropped_bytes) == ("torn", b, extra)
            assert content == at_boundary[b]
        # a chunk record whose header reached the disk but whose payload did not (zeros): uncommitted, dropped
        nxt = [r for r in records(data) if r[0] == b and r[2].type in (RecordType.OBS, RecordType.STEPS)]
        if nxt:
            pos, end, _ = nxt[0]
            p.write_bytes(data[: pos + RECORD_HEADER_SIZE] + bytes(end - pos - RECORD_HEADER_SIZE))
            h, content = read(p)
            assert (h.recovery.status, h.committed_bytes) == ("torn", b) and content == at_boundary[b]


def record_at(recs: list, i: int) -> int:
    """Offset of the record containing byte ``i`` (0 for the file header)."""
    if i < FILE_HEADER_SIZE:
        return 0
    for pos, end, _ in recs:
        if pos <= i < end:
            return pos
    raise AssertionError(i)


def check_damaged(p: Path, recs: list, i: int, full: dict, how: str) -> None:
    try:
        _, content = read(p)
    except FormatError as e:
        assert e.offset == record_at(recs, i), f"{how} at byte {i}: error {e} names offset {e.offset}"
        if i >= len(b"\x89THIST\r\n"):  # past the magic, the first check that fails is a CRC check
            assert isinstance(e, CorruptError), f"{how} at byte {i}: {type(e).__name__}: {e}"
        return
    # no error: never acceptable with changed data; with unchanged data only for a byte that carries no meaning,
    # and the writer leaves none in this file (chunk payloads are 8-aligned, manifest/commit padding is checked)
    assert content == full, f"{how} at byte {i} went undetected and changed the data"
    raise AssertionError(f"{how} at byte {i} went undetected (data unchanged): is it unchecked padding?")


def test_every_byte_flipped(sample: tuple[bytes, dict, Path], at_boundary: dict[int, dict]) -> None:
    data, _, d = sample
    recs = records(data)
    full = at_boundary[len(data)]
    p = d / "flip.thist"
    p.write_bytes(data)
    with open(p, "r+b") as f:
        for i in range(len(data)):
            f.seek(i)
            f.write(bytes([data[i] ^ 0xFF]))
            f.flush()
            check_damaged(p, recs, i, full, "xor 0xFF")
            f.seek(i)
            f.write(data[i : i + 1])
    assert p.read_bytes() == data


def test_truncating_at_a_bad_payload_crc_recovers_the_earlier_commits(sample: tuple[bytes, dict, Path],
                                                                       at_boundary: dict[int, dict]) -> None:
    """crash-safety.md: after `bad_payload_crc` at a record, truncating the file at the offset the error names gives
    back every commit before that record. The message says so, with that offset (it said only "payload CRC32C
    mismatch"); the truncated file reads as the prefix of the last commit before the record, for a damaged manifest,
    commit or committed chunk anywhere in the file, and for a commit record cut short by zeros (a power loss)."""
    data, _, d = sample
    p = d / "payload.thist"
    cases = []
    for pos, end, h in records(data):
        damaged = bytearray(data)
        damaged[pos + RECORD_HEADER_SIZE + h.length // 2] ^= 0x01  # (inside the payload: its CRC fails)
        cases.append((pos, bytes(damaged)))
        if h.type == RecordType.COMMIT and end == len(data):  # the last commit, half written, then zeros
            cut = pos + RECORD_HEADER_SIZE + 8
            cases.append((pos, data[:cut] + bytes(end - cut)))
    for pos, damaged in cases:
        p.write_bytes(damaged)
        with pytest.raises(CorruptError) as ei:
            read(p)
        assert ei.value.code == "bad_payload_crc" and ei.value.offset == pos, (pos, ei.value)
        assert f"truncate a copy of the file to {pos} bytes" in str(ei.value) and f"truncate -s {pos} " in str(
            ei.value), str(ei.value)
        p.write_bytes(damaged[:pos])
        h, content = read(p)
        before = max(b for b in at_boundary if b <= pos)
        assert h.recovery.status in ("clean", "torn") and h.committed_bytes == before
        assert content == at_boundary[before], pos
    assert len(cases) == len(records(data)) + 1


def test_single_bit_flips_sample(sample: tuple[bytes, dict, Path], at_boundary: dict[int, dict]) -> None:
    data, _, d = sample
    recs = records(data)
    full = at_boundary[len(data)]
    p = d / "bit.thist"
    p.write_bytes(data)
    rng = np.random.default_rng(3)
    # every bit of the file header and of the first and last record headers, plus a random sample elsewhere
    first, last = recs[0][0], recs[-1][0]
    spots = [(i, b) for i in list(range(32)) + list(range(first, first + 32)) + list(range(last, last + 32))
             for b in range(8)]
    spots += [(int(i), int(b)) for i, b in zip(rng.integers(0, len(data), 1500), rng.integers(0, 8, 1500))]
    with open(p, "r+b") as f:
        for i, b in spots:
            f.seek(i)
            f.write(bytes([data[i] ^ (1 << b)]))
            f.flush()
            check_damaged(p, recs, i, full, f"bit {b} flip")
            f.seek(i)
            f.write(data[i : i + 1])


def test_flip_in_torn_tail_is_not_corruption(sample: tuple[bytes, dict, Path], at_boundary: dict[int, dict]) -> None:
    """Damage inside an incomplete last record is part of the torn tail: dropped, never an error."""
    data, _, d = sample
    recs = records(data)
    pos, end, _ = recs[-1]  # the last commit
    b = max(x for x in at_boundary if x <= pos)
    cut = data[: end - 3]
    p = d / "tail.thist"
    for i in range(pos + RECORD_HEADER_SIZE, len(cut)):
        bad = bytearray(cut)
        bad[i] ^= 0xFF
        p.write_bytes(bytes(bad))
        h, content = read(p)
        assert (h.recovery.status, h.committed_bytes) == ("torn", b) and content == at_boundary[b]


# -- splices -------------------------------------------------------------------------------------------------------
def test_concatenated_files_rejected(sample: tuple[bytes, dict, Path], tmp_path: Path) -> None:
    data, _, _ = sample
    other = tmp_path / "other.thist"
    write_sample(other, salt=SALT_B, seed=1)
    p = tmp_path / "cat.thist"
    p.write_bytes(data + other.read_bytes())
    with pytest.raises(CorruptError) as ei:
        read(p)
    assert ei.value.offset == len(data)
    p.write_bytes(data + data)  # even the same file twice: its header is not a record
    with pytest.raises(CorruptError) as ei:
        read(p)
    assert ei.value.offset == len(data)


def test_record_from_another_file_rejected(sample: tuple[bytes, dict, Path], tmp_path: Path) -> None:
    """Same writer calls, other salt: a record swapped in at the same position (same seq, same length) is refused."""
    data, _, _ = sample
    other = tmp_path / "other.thist"
    write_sample(other, salt=SALT_B, seed=0)
    odata = other.read_bytes()
    ra, rb = records(data), records(odata)
    assert [(p, e, h.type) for p, e, h in ra] == [(p, e, h.type) for p, e, h in rb]
    p = tmp_path / "splice.thist"
    for k in (0, 3, len(ra) // 2, len(ra) - 1):
        pos, end, h = ra[k]
        assert rb[k][2].seq == h.seq and rb[k][2].salt != h.salt
        p.write_bytes(data[:pos] + odata[pos:end] + data[end:])
        with pytest.raises(CorruptError) as ei:
            read(p)
        assert (ei.value.offset, ei.value.code) == (pos, "salt_mismatch"), (k, ei.value)
    # the other file's whole tail after one of our commits: also refused at the first foreign record
    b = commit_boundaries(data)[2]
    p.write_bytes(data[:b] + odata[b:])
    with pytest.raises(CorruptError) as ei:
        read(p)
    assert (ei.value.offset, ei.value.code) == (b, "salt_mismatch")


def resealed(data: bytes, pos: int, **changes: int) -> bytes:
    """``data`` with the record header at ``pos`` changed and its header CRC recomputed (a "valid" header)."""
    h = RecordHeader.parse(data, pos)
    assert h is not None
    fields = dict(type=h.type, flags=h.flags, length=h.length, seq=h.seq, salt=h.salt, payload_crc=h.payload_crc)
    fields.update(changes)
    return data[:pos] + RecordHeader(**fields).pack() + data[pos + RECORD_HEADER_SIZE :]


def test_wrong_sequence_with_valid_crcs_rejected(sample: tuple[bytes, dict, Path], tmp_path: Path) -> None:
    data, _, _ = sample
    recs = records(data)
    p = tmp_path / "seq.thist"
    for k in (0, 5, len(recs) - 1):
        pos, _, h = recs[k]
        for seq in (h.seq + 1, h.seq - 1 if h.seq else 7, 2**64 - 1):
            p.write_bytes(resealed(data, pos, seq=seq))
            with pytest.raises(CorruptError) as ei:
                read(p)
            assert (ei.value.offset, ei.value.code) == (pos, "bad_sequence")
    # a replayed record (a valid record written twice) and two records swapped are refused too
    pos, end, _ = recs[4]
    p.write_bytes(data[:end] + data[pos:end] + data[end:])
    with pytest.raises(CorruptError) as ei:
        read(p)
    assert (ei.value.offset, ei.value.code) == (end, "bad_sequence")
    (p1, e1, _), (p2, e2, _) = recs[4], recs[5]
    p.write_bytes(data[:p1] + data[p2:e2] + data[p1:e1] + data[e2:])
    with pytest.raises(CorruptError) as ei:
        read(p)
    assert (ei.value.offset, ei.value.code) == (p1, "bad_sequence")


def test_resealed_headers_caught_by_commit_and_salt(sample: tuple[bytes, dict, Path], tmp_path: Path) -> None:
    """Headers rewritten with valid CRCs: a changed type fails the commit's entry list, a new salt every record."""
    data, _, _ = sample
    recs = records(data)
    p = tmp_path / "retype.thist"
    k = next(i for i, (_, _, h) in enumerate(recs) if h.type == RecordType.OBS)
    pos, _, h = recs[k]
    p.write_bytes(resealed(data, pos, type=RecordType.STEPS))
    commit_pos = next(q for q, _, hh in recs[k:] if hh.type == RecordType.COMMIT)
    with pytest.raises(CorruptError) as ei:
        read(p)
    assert (ei.value.offset, ei.value.code) == (commit_pos, "bad_commit")
    # the file header resealed with another salt: every record is then foreign
    hdr = FileHeader.unpack(data[:FILE_HEADER_SIZE])
    p.write_bytes(FileHeader(hdr.read_version, hdr.write_version, 0, 0, SALT_B).pack() + data[FILE_HEADER_SIZE:])
    with pytest.raises(CorruptError) as ei:
        read(p)
    assert (ei.value.offset, ei.value.code) == (FILE_HEADER_SIZE, "salt_mismatch")
    assert struct.unpack_from("<I", data, 28)[0] == crc32c(data[:28])


def test_truncating_again_while_the_copy_reports_another_damaged_record(tmp_path: Path) -> None:
    """crash-safety.md: a reader need not name the first damaged record of a file (the reference checks obs chunks
    site by site), so a truncated copy can report an earlier damaged record; truncating again at the offset that one
    names gives back the commits before it."""
    p = tmp_path / "two.thist"
    with HistoryWriter(p, fsync="never", codec="raw") as w:
        a, b = w.site("a", "activation"), w.site("b", "activation")
        w.observe(b, 0, np.array([1.0, 2.0]))  # site 1's chunk, in the first commit
        w.commit()
        w.observe(a, 1, np.array([3.0, 4.0]))  # site 0's chunk, in the second
    data = bytearray(p.read_bytes())
    chunks = [pos for pos, _, h in records(bytes(data)) if h.type == RecordType.OBS]
    assert len(chunks) == 2
    for pos in chunks:
        length = struct.unpack_from("<I", data, pos + 4)[0]
        data[pos + RECORD_HEADER_SIZE + length - 9] ^= 0x40
    p.write_bytes(bytes(data))
    named = []
    while True:
        try:
            h, _ = read(p)
            break
        except CorruptError as e:
            assert e.code == "bad_payload_crc"
            named.append(e.offset)
            p.write_bytes(p.read_bytes()[: e.offset])
    assert named == [chunks[1], chunks[0]]  # site 0's chunk first, though it comes later in the file
    assert h.recovery.status in ("clean", "torn") and h.committed_bytes <= chunks[0]


@pytest.mark.parametrize("size", [1, 5, 32, 4096])
def test_a_zero_filled_file_reads_torn_and_a_writer_starts_it_afresh(tmp_path: Path, size: int) -> None:
    """A power loss before the first commit can leave a file of zeros the file system allocated but never wrote,
    the header included (spec 8, crash-safety.md). It read as bad_magic, and a resuming writer (the collector
    restarting a job with mode="a") refused it: the job could not start again without deleting the file."""
    p = tmp_path / "z.thist"
    p.write_bytes(bytes(size))
    with trainhist.open(p) as h:
        assert (h.recovery.status, h.committed_bytes, h.recovery.dropped_bytes) == ("torn", 0, size)
        assert "zero-filled" in h.recovery.describe() and h.header is None and h.sites == []
    with HistoryWriter(p, mode="a", run_name="again") as w:
        w.observe(w.site("x", "activation"), 0, np.ones(3))
    with trainhist.open(p) as h:
        assert h.recovery.status == "clean" and h.runs[0]["name"] == "again" and len(h.spine("x")) == 1
    q = tmp_path / "nz.thist"
    q.write_bytes(bytes(40) + b"\x01")  # (zeros and then a non-zero byte: not a file of this format)
    with pytest.raises(FormatError) as ei:
        trainhist.open(q)
    assert ei.value.code == "bad_magic"
