"""Writer -> reader round trips, append after a crash, and forward compatibility (spec sections 2-5, 8, 3, 4.2).

Everything written is read back bit for bit: spines (counts, min/max in total order, exact sums, including sums
that a float64 cannot hold and that therefore live in the ``sum_x``/``sumsq_x`` columns), sketches, presence
states, step truth with unknowns, phases, micro-batches, segments. Files for the forward-compatibility rules are
built by hand with ``framing`` (file header and records with valid CRCs, and a valid commit that lists them).
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import numpy as np
import pytest

import trainhist
from trainhist import summarize
from trainhist.dyadic import Dyadic
from trainhist.errors import CorruptError, ReadOnlyError, UnsupportedError, UsageError
from trainhist.framing import (
    FILE_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    FileHeader,
    RecordHeader,
    RecordType,
    crc32c,
    pad8,
)
from trainhist.model import MICRO_ALL
from trainhist.summary import Sketch, Summary, SumMethod
from trainhist.writer import HistoryWriter

FAST = dict(fsync="never", commit_every=10**9, commit_seconds=1e18)
NO_ID = 0xFFFFFFFF


def bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def assert_row_equals(s: trainhist.reader.SpineSeries, i: int, want: Summary) -> None:
    """Row ``i`` of a spine is exactly ``want``: counts, min/max bit patterns (signed zeros, canonical NaN), sums."""
    got = s.summary(i)
    assert (got.count, got.nan, got.pinf, got.ninf, got.zero) == (want.count, want.nan, want.pinf, want.ninf,
                                                                   want.zero)
    for name in ("min", "max"):
        g, w = getattr(got, name), getattr(want, name)
        if math.isnan(w):
            assert math.isnan(g)
        else:
            assert bits(g) == bits(w), (name, g, w)
    assert got.sum == want.sum and got.sumsq == want.sumsq
    assert got.sum_method == want.sum_method
    assert s.columns["sum"][i] == want.sum.to_float() and s.columns["sumsq"][i] == want.sumsq.to_float()


# -- spine, exact sums, sketches -------------------------------------------------------------------------------------
def tensors() -> list[tuple[str, np.ndarray, str | None]]:
    rng = np.random.default_rng(5)
    f32 = (rng.standard_normal(3000) * 0.02).astype(np.float32)
    f32[[3, 9]] = [-0.0, 0.0]
    special = np.array([np.nan, -np.inf, np.inf, -0.0, 1e-40, -3e38, 7.5, np.nan], np.float32)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
    return [
        ("f32", f32, None),
        ("f32_special", special, None),
        ("f16", (rng.standard_normal(500) * 100).astype(np.float16), None),
        ("bf16", bf16, "bfloat16"),
        ("f64", rng.standard_normal(700) * np.exp2(rng.integers(-60, 60, 700)), None),
        ("i32", rng.integers(-1000, 1000, 50).astype(np.int32), None),
        ("neg_zeros", np.array([-0.0, -0.0], np.float64), None),
        ("all_nan", np.array([np.nan, np.nan], np.float32), None),
        ("empty", np.zeros(0, np.float32), None),
    ]


@pytest.mark.parametrize("codec", ["packed", "shuffle", "zlib", "raw"])
def test_spine_and_sketch_roundtrip(tmp_path: Path, codec: str) -> None:
    p = tmp_path / "rt.thist"
    want: dict[str, list[Summary]] = {}
    with HistoryWriter(p, codec=codec, **FAST) as w:
        for step in range(3):
            for name, x, dt in tensors():
                site = w.site(name, "activation")
                with np.errstate(over="ignore"):  # -3e38 * 2 is -inf in float32: fine, it is counted
                    y = x if dt else x * (step + 1) if x.dtype.kind == "f" else x
                s = summarize(y, dtype=dt, sketch=step != 1)  # step 1: spine only
                w.observe(site, step, y, dtype=dt, sketch=step != 1)
                want.setdefault(name, []).append(s)
            if step == 0:
                w.commit()
    with trainhist.open(p) as h:
        assert h.recovery.status == "clean"
        assert h.verify()["rows"] == 3 * len(tensors())
        for name, rows in want.items():
            sp = h.spine(name)
            assert sp.step.tolist() == [0, 1, 2] and sp.observed.all()
            assert sp.micro.tolist() == [MICRO_ALL] * 3 and sp.span.tolist() == [1, 1, 1]
            for i, s in enumerate(rows):
                assert_row_equals(sp, i, s)
            assert sp.sk_row.tolist() == [0, -1, 1]
            sk = h.sketch(name)
            assert sk.columns["step"].tolist() == [0, 2] and sk.scale == 2
            assert sk.sketch(0) == rows[0].sketch and sk.sketch(1) == rows[2].sketch
            with np.errstate(all="ignore"):
                fin = np.array([float(r.finite) for r in rows])
                mean = np.array([r.sum.to_float() for r in rows]) / fin
            assert np.array_equal(sp.mean, np.where(fin > 0, mean, np.nan), equal_nan=True)


def test_exact_sums_beyond_float64(tmp_path: Path) -> None:
    """Sums a float64 cannot hold are stored exactly (sum_x/sumsq_x) with the correctly rounded float beside them."""
    big = np.finfo(np.float64).max
    cases = {
        "tiny_tail": np.array([1.0, 2.0**-60], np.float64),  # 1 + 2**-60; sumsq 1 + 2**-120
        "cancel": np.array([1e300, 3.0, -1e300], np.float64),  # sum 3 exactly; sumsq overflows
        "overflow": np.array([big, big], np.float64),  # sum and sumsq beyond the float64 range
        "subnormal": np.array([5e-324, 1.0], np.float64),
        "plain": np.array([0.5, 0.25], np.float64),  # both sums are floats: no exact column needed
        "f32_many": np.full(10, np.float32(1.1), np.float32),
    }
    p = tmp_path / "exact.thist"
    with HistoryWriter(p, **FAST) as w:
        for name, x in cases.items():
            w.observe(w.site(name, "param"), 0, x)
    with trainhist.open(p) as h:
        for name, x in cases.items():
            sp = h.spine(name, "param")
            s = summarize(x)
            assert_row_equals(sp, 0, s)
            from fractions import Fraction

            exact = sum((Fraction(float(v)) for v in x), Fraction(0))
            got = sp.sum_exact(0)
            assert Fraction(got.m) * Fraction(2) ** got.e == exact
            stored = sp.exact["sum"][0] is not None, sp.exact["sumsq"][0] is not None
            assert stored == (not s.sum.is_float(), not s.sumsq.is_float()), name
        assert h.spine("tiny_tail", "param").exact["sum"][0] == Dyadic.make((1 << 60) + 1, -60)
        assert h.spine("overflow", "param").sum[0] == math.inf
        assert h.spine("cancel", "param").sum[0] == 3.0 and h.spine("cancel", "param").sumsq[0] == math.inf
        assert h.spine("plain", "param").exact == {"sum": [None], "sumsq": [None]}


def test_precomputed_summaries_and_methods(tmp_path: Path) -> None:
    """observe(summary=...) stores a Summary as given, its sum method and a sketch at another scale included; the
    sums of one whose method is unknown are stored as zero (spec 5.4: they are no numbers), read as NaN."""
    x = np.linspace(-3, 5, 101)
    s = summarize(x)
    s.sum_method = SumMethod.F32
    coarse = Sketch(1, np.zeros(128, np.uint64), np.zeros(128, np.uint64), under_pos=2, over_neg=3)
    coarse.pos[[0, 5, 127]] = [1, 2**40, 7]
    s1 = Summary(count=12, zero=0, min=-1.0, max=1.0, sum=Dyadic.from_float(0.5), sumsq=Dyadic.from_float(6.0),
                 sum_method=SumMethod.UNKNOWN, sketch=coarse)
    p = tmp_path / "pre.thist"
    with HistoryWriter(p, **FAST) as w:
        a, b = w.site("a", "activation"), w.site("b", "activation")
        w.observe(a, 0, summary=s)
        w.observe(b, 0, summary=s1)
        with pytest.raises(UsageError):
            w.observe(a, 1, x, summary=s)
        with pytest.raises(UsageError):
            w.observe(a, 1)
    with trainhist.open(p) as h:
        assert_row_equals(h.spine("a"), 0, s)
        assert h.spine("a").method.tolist() == [SumMethod.F32]
        b = h.spine("b")
        got = b.summary(0)
        assert (got.count, got.min, got.max, got.sum_method) == (12, -1.0, 1.0, SumMethod.UNKNOWN)
        assert got.sum == got.sumsq == Dyadic(0, 0) and not b.sums_known[0]
        assert np.isnan(b.sum[0]) and np.isnan(b.sumsq[0]) and np.isnan(b.mean[0]) and np.isnan(b.rms[0])
        with pytest.raises(UsageError) as ei:
            b.sum_exact(0)
        assert ei.value.code == "sums_unknown"
        raw = h._site_data(h.site("b", "activation"), None, sketches=False)[0]
        assert raw["sum"].tolist() == raw["sumsq"].tolist() == [0.0]  # (stored as zero)
        sk = h.sketch("b")
        assert sk.scale == 1 and sk.sketch(0) == coarse


# -- presence, phases, micro-batches, step truth, segments -----------------------------------------------------------
def test_presence_phases_micro(tmp_path: Path) -> None:
    p = tmp_path / "presence.thist"
    x = np.arange(6, dtype=np.float32) - 2
    with HistoryWriter(p, **FAST) as w:
        a = w.site("blk", "activation")
        every2 = w.site("blk.w", "param", cadence_spine=2)
        g = w.site("blk.w", "param_grad")
        for step in range(8):
            w.step_truth(step)
            if step % 2 == 0 and step != 4:
                w.observe(every2, step, x)
            if step == 4:
                w.mark(every2, step, "failed")
            w.observe(g, step, x, phase="pre_clip")
            w.observe(g, step, x / 2, phase="post_clip")
        for step, state in zip(range(8), ["observed", "absent", "not_scheduled", "failed", "skipped", "unknown",
                                          "observed", "observed"]):
            if state == "observed":
                w.observe(a, step, x, micro=step % 2)
            else:
                w.mark(a, step, state, micro=step % 2)
        w.observe(a, 6, x)  # the whole step, beside micro-batch 0
        with pytest.raises(UsageError):
            w.mark(a, 9, "observed")
        with pytest.raises(ValueError):
            w.mark(a, 9, "lost")
    with trainhist.open(p) as h:
        sp = h.spine("blk")
        assert sp.presence_names == ["observed", "absent", "not_scheduled", "failed", "skipped", "unknown",
                                     "observed", "observed", "observed"]
        assert sp.micro.tolist() == [0, 1, 0, 1, 0, 1, 0, 1, MICRO_ALL]
        gaps = ~sp.observed
        assert (sp.count[gaps] == 0).all() and np.isnan(sp.min[gaps]).all() and np.isnan(sp.mean[gaps]).all()
        assert (sp.sk_row[gaps] == -1).all() and len(h.sketch("blk")) == 4
        # a canonical NaN, not a payload, in min/max of rows that carry no numbers
        assert {bits(v) for v in sp.min[gaps]} == {0x7FF8000000000000}
        assert h.presence("blk") == {0: "observed", 1: "absent", 2: "not_scheduled", 3: "failed", 4: "skipped",
                                     5: "unknown", 6: "observed", 7: "observed"}
        # cadence 2: odd steps are not due; even steps without a row are unknown, the failed one stays failed
        pr = h.presence("blk.w", "param", steps=range(9))
        assert pr == {0: "observed", 1: "not_scheduled", 2: "observed", 3: "not_scheduled", 4: "failed",
                      5: "not_scheduled", 6: "observed", 7: "not_scheduled", 8: "unknown"}
        with pytest.raises(UsageError) as ei:
            h.spine("blk.w", "param_grad")
        assert ei.value.code == "phase_ambiguous"
        pre = h.spine("blk.w", "param_grad", phase="pre_clip")
        post = h.spine("blk.w", "param_grad", phase="post_clip")
        assert len(pre) == len(post) == 8
        assert pre.sum[0] == 3.0 and post.sum[0] == 1.5
        assert h.sketch("blk.w", "param_grad", phase="post_clip").sketch(0) == summarize(x / 2).sketch
        assert len(h.spine("blk.w", "param_grad", phase="default")) == 0
        with pytest.raises(UsageError) as ei:
            h.spine("blk.x")
        assert ei.value.code == "unknown_site" and "blk" in str(ei.value)


def test_step_truth_with_unknowns(tmp_path: Path) -> None:
    p = tmp_path / "steps.thist"
    with HistoryWriter(p, **FAST) as w:
        w.step_truth(0)
        w.step_truth(1, applied=True, loss_scale=65536.0, grad_basis="scaled", clipped=True, clip_threshold=1.0,
                     micro_batches=4, tokens=0, samples=2**63)
        w.step_truth(2, applied=False, grad_basis="unscaled", clipped=False, loss_scale=0.0, tokens=12)
        w.commit()
        w.new_segment(10, reason="resume")
        w.step_truth(10, applied=True)
    with trainhist.open(p) as h:
        rows = h.step_truth_rows()
    unknown = dict(span=1, applied="unknown", grad_basis="unknown", clipped="unknown", loss_scale=None,
                   clip_threshold=None, micro_batches=None, tokens=None, samples=None, n_rows=1)
    assert rows == [
        dict(unknown, step=0, segment=0),
        dict(step=1, span=1, segment=0, applied="applied", loss_scale=65536.0, grad_basis="scaled", clipped="clipped",
             clip_threshold=1.0, micro_batches=4, tokens=0, samples=2**63, n_rows=1),
        dict(unknown, step=2, segment=0, applied="skipped", grad_basis="unscaled", clipped="not_clipped",
             loss_scale=0.0, tokens=12),
        dict(unknown, step=10, segment=1, applied="applied"),
    ]


def test_segments_and_scalars(tmp_path: Path) -> None:
    p = tmp_path / "seg.thist"
    with HistoryWriter(p, run_name="segs", config={"lr": 3e-4}, **FAST) as w:
        a = w.site("x", "activation")
        w.observe(a, 0, np.ones(3))
        w.scalar("loss", 0, 2.5)
        w.new_segment(None)  # nothing recorded in it: replaced by the next one
        w.new_segment(5, reason="resume")
        w.observe(a, 5, np.ones(3))
        w.scalar("loss", 5, float("nan"))
        w.scalar("loss", 6, -float("inf"))
        w.scalar("loss", 7, -0.0)
        seg = w.new_segment(8)
        w.observe(a, 8, np.ones(3))
    with trainhist.open(p) as h:
        assert h.run["name"] == "segs" and h.run["config"] == {"lr": 3e-4}
        assert [(g.id, g.first_step, g.reason, g.previous) for g in h.segments] == [
            (0, 0, "start", None), (1, 5, "resume", 0), (2, 8, "manual", 1)]
        assert seg == 2
        assert h.spine("x").segment.tolist() == [0, 1, 2]
        loss = h.spine("loss", "scalar")
        assert loss.step.tolist() == [0, 5, 6, 7] and loss.segment.tolist() == [0, 1, 1, 1]
        assert (loss.count.tolist(), loss.nan.tolist(), loss.ninf.tolist(), loss.zero.tolist()) == (
            [1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1])
        assert loss.sum[0] == 2.5 and loss.sumsq[0] == 6.25 and math.isnan(loss.mean[1])
        assert bits(loss.min[3]) == bits(-0.0)
        assert h.site("loss", "scalar").cadence_sketch == 0 and len(h.sketch("loss", "scalar")) == 0


def test_reader_sees_commits_while_writer_is_open(tmp_path: Path) -> None:
    p = tmp_path / "live.thist"
    w = HistoryWriter(p, fsync="never", commit_every=2, commit_seconds=1e18)
    a = w.site("x", "activation")
    seen = []
    for step in range(7):
        w.observe(a, step, np.full(4, step, np.float32))
        with trainhist.open(p) as h:
            seen.append(len(h.spine("x")) if h.sites else 0)
            assert h.recovery.status in ("clean", "torn")
    w.close()
    assert seen == sorted(seen) and seen[-1] < 7 and seen[-1] >= 4  # auto-commits every 2 steps
    with trainhist.open(p) as h:
        assert len(h.spine("x")) == 7 and h.recovery.status == "clean"
    with pytest.raises(UsageError):
        w.observe(a, 8, np.ones(2))


# -- append after a crash --------------------------------------------------------------------------------------------
def write_three_commits(p: Path) -> list[int]:
    """A file with commits after steps 1, 3 and 5; returns the commit boundaries."""
    with HistoryWriter(p, **FAST) as w:
        a = w.site("x", "activation")
        b = w.site("y", "param")
        for step in range(6):
            w.observe(a, step, np.full(3, step, np.float32))
            w.observe(b, step, np.full(2, -step, np.float64))
            w.step_truth(step, applied=True)
            if step in (1, 3):
                w.commit()
    data = p.read_bytes()
    bounds, pos = [], FILE_HEADER_SIZE
    while pos < len(data):
        hdr = RecordHeader.parse(data, pos)
        assert hdr is not None
        pos += RECORD_HEADER_SIZE + hdr.padded_length
        if hdr.type == RecordType.COMMIT:
            bounds.append(pos)
    assert len(bounds) == 3 and bounds[-1] == len(data)
    return bounds


@pytest.mark.parametrize("cut", ["mid_commit", "uncommitted_records", "zeros", "clean"])
def test_append_after_crash(tmp_path: Path, cut: str) -> None:
    p = tmp_path / "crash.thist"
    bounds = write_three_commits(p)
    data = p.read_bytes()
    if cut == "mid_commit":  # killed while writing the last commit record
        p.write_bytes(data[: len(data) - 20])
        keep, kept_steps = bounds[1], 4
    elif cut == "uncommitted_records":  # killed after the first chunk of the last batch
        first = RecordHeader.parse(data, bounds[1])
        assert first is not None
        p.write_bytes(data[: bounds[1] + RECORD_HEADER_SIZE + first.padded_length])
        keep, kept_steps = bounds[1], 4
    elif cut == "zeros":  # power loss: the file system extended the file with zeros
        p.write_bytes(data + bytes(3000))
        keep, kept_steps = bounds[2], 6
    else:
        keep, kept_steps = bounds[2], 6
    with trainhist.open(p) as h:
        assert h.committed_bytes == keep
        assert h.recovery.status == ("clean" if cut == "clean" else "torn")
        n_records = h.committed_records
    with HistoryWriter(p, mode="a", **FAST) as w:
        assert p.read_bytes()[:keep] == data[:keep]  # the torn tail was dropped, the committed prefix kept
        a = w.site("x", "activation")
        assert a.id == 0 and w.site("y", "param").id == 1
        w.observe(a, 100, np.full(3, 100, np.float32))
        w.step_truth(100, applied=False)
        z = w.site("z", "activation")
        assert z.id == 2
        w.observe(z, 100, np.ones(1))
    with trainhist.open(p) as h:
        assert h.recovery.status == "clean"
        h.verify()
        assert p.read_bytes()[:keep] == data[:keep]
        first_new = RecordHeader.parse(p.read_bytes(), keep)  # the resumed writer continues right at the cut
        assert first_new is not None and first_new.seq == n_records and first_new.type == RecordType.MANIFEST
        x = h.spine("x")
        assert x.step.tolist() == list(range(kept_steps)) + [100]
        assert x.sum.tolist() == [3.0 * s for s in range(kept_steps)] + [300.0]
        assert x.segment.tolist() == [0] * kept_steps + [1]
        assert [(g.id, g.reason, g.previous) for g in h.segments] == [(0, "start", None), (1, "resume", 0)]
        assert h.segments[1].first_step == 100
        assert len(h.writers) == 2 and h.writers[0]["writer_id"] != h.writers[1]["writer_id"]
        assert len(h.runs) == 1 and h.writers[1]["run_id"] == h.run["run_id"]
        assert h.steps["step"].tolist() == list(range(kept_steps)) + [100]
        assert h.committed_records > n_records
        salt = h.header.salt
    assert FileHeader.unpack(data[:FILE_HEADER_SIZE]).salt == salt
    # a second resume chains to the first
    with HistoryWriter(p, mode="a", **FAST) as w:
        w.observe(w.site("x", "activation"), 200, np.ones(3, np.float32))
    with trainhist.open(p) as h:
        assert [(g.id, g.previous) for g in h.segments] == [(0, None), (1, 0), (2, 1)]
        assert h.spine("x").step.tolist()[-2:] == [100, 200]


def test_append_mode_creates_a_new_file(tmp_path: Path) -> None:
    p = tmp_path / "new.thist"
    with HistoryWriter(p, mode="a", **FAST) as w:
        w.observe(w.site("x", "activation"), 0, np.ones(2))
    with trainhist.open(p) as h:
        assert [g.reason for g in h.segments] == ["start"] and len(h.spine("x")) == 1


# -- forward compatibility -------------------------------------------------------------------------------------------
def with_header(data: bytes, **changes: int) -> bytes:
    """``data`` with its file header fields changed and the header CRC recomputed."""
    h = FileHeader.unpack(data[:FILE_HEADER_SIZE])
    f = dict(read_version=h.read_version, write_version=h.write_version, required_features=h.required_features,
             optional_features=h.optional_features, salt=h.salt)
    f.update(changes)
    return FileHeader(**f).pack() + data[FILE_HEADER_SIZE:]


def append_committed(data: bytes, records: list[tuple[int, int, bytes]], commit: bool = True) -> tuple[bytes, list]:
    """Append records ``(type, flags, payload)`` with valid headers, then a commit listing them (writer.commit's
    layout: seq, n, then per record offset u64, type u16, reserved u16, site u32, segment u32, rows u32, steps)."""
    salt = FileHeader.unpack(data[:FILE_HEADER_SIZE]).salt
    seq, pos = 0, FILE_HEADER_SIZE
    while pos < len(data):  # count the existing records
        hdr = RecordHeader.parse(data, pos)
        assert hdr is not None
        pos += RECORD_HEADER_SIZE + hdr.padded_length
        seq += 1
    out = bytearray(data)
    entries, offsets = [], []
    for rtype, flags, payload in records:
        offsets.append(len(out))
        entries.append(struct.pack("<QHHIIIqq", len(out), rtype, 0, NO_ID, NO_ID, 0, 0, 0))
        out += RecordHeader(rtype, flags, len(payload), seq, salt, crc32c(payload)).pack()
        out += payload + bytes(pad8(len(payload)))
        seq += 1
    if commit:
        body = struct.pack("<QQ", seq, len(entries)) + b"".join(entries)
        out += RecordHeader(RecordType.COMMIT, 0, len(body), seq, salt, crc32c(body)).pack() + body
    return bytes(out), offsets


def content(p: Path) -> tuple:
    with trainhist.open(p) as h:
        x = h.spine("x")
        return (repr(h.sites), repr(h.segments), x.step.tobytes(), x.sum.tobytes(), h.sketch("x").pos.tobytes(),
                h.steps["step"].tobytes())


@pytest.fixture
def base(tmp_path: Path) -> tuple[Path, bytes, tuple]:
    p = tmp_path / "base.thist"
    write_three_commits(p)
    return p, p.read_bytes(), content(p)


def test_newer_read_version_refused(base: tuple[Path, bytes, tuple], tmp_path: Path) -> None:
    p, data, _ = base
    q = tmp_path / "rv.thist"
    q.write_bytes(with_header(data, read_version=2, write_version=2))
    with pytest.raises(UnsupportedError) as ei:
        trainhist.open(q)
    assert ei.value.code == "unsupported_read_version"
    with pytest.raises(UnsupportedError):
        HistoryWriter(q, mode="a", **FAST)
    assert q.read_bytes() == with_header(data, read_version=2, write_version=2)  # untouched


def test_required_and_optional_features(base: tuple[Path, bytes, tuple], tmp_path: Path) -> None:
    p, data, want = base
    q = tmp_path / "feat.thist"
    q.write_bytes(with_header(data, required_features=1 << 7))
    with pytest.raises(UnsupportedError) as ei:
        trainhist.open(q)
    assert ei.value.code == "unsupported_feature"
    q.write_bytes(with_header(data, optional_features=0xFFFFFFFF))  # unknown optional features: ignored
    assert content(q) == want


def test_newer_write_version_is_read_only(base: tuple[Path, bytes, tuple], tmp_path: Path) -> None:
    p, data, want = base
    q = tmp_path / "wv.thist"
    newer = with_header(data, write_version=7)
    q.write_bytes(newer)
    with trainhist.open(q) as h:
        assert h.read_only and h.recovery.status == "clean"
    assert content(q) == want
    with pytest.raises(ReadOnlyError) as ei:
        HistoryWriter(q, mode="a", **FAST)
    assert ei.value.code == "read_only"
    assert q.read_bytes() == newer  # the refused append changed nothing
    with trainhist.open(p) as h:
        assert not h.read_only


def test_unknown_required_record_type_refused(base: tuple[Path, bytes, tuple], tmp_path: Path) -> None:
    p, data, _ = base
    q = tmp_path / "req.thist"
    out, offs = append_committed(data, [(77, 0, b"from the future")])
    q.write_bytes(out)
    with pytest.raises(UnsupportedError) as ei:
        trainhist.open(q)
    assert (ei.value.code, ei.value.offset) == ("unknown_record_type", offs[0])
    # uncommitted, it is only a torn tail: not read, so not refused
    out, _ = append_committed(data, [(77, 0, b"from the future")], commit=False)
    q.write_bytes(out)
    with trainhist.open(q) as h:
        assert (h.recovery.status, h.committed_bytes) == ("torn", len(data))


def test_unknown_ignorable_record_type_skipped(base: tuple[Path, bytes, tuple], tmp_path: Path) -> None:
    p, data, want = base
    q = tmp_path / "ign.thist"
    out, offs = append_committed(data, [(1000, 1, b"x" * 13), (65535, 1, b"")])
    q.write_bytes(out)
    with trainhist.open(q) as h:
        assert h.recovery.status == "clean" and h.ignored_records == [(offs[0], 1000), (offs[1], 65535)]
        assert h.verify()["ignored_records"] == 2
    assert content(q) == want
    # its payload is never interpreted (spec 4.2 only asks to skip it), so damage there changes no data;
    # its header is checked like any other (CRC, salt, sequence, flags)
    bad = bytearray(out)
    bad[offs[0] + RECORD_HEADER_SIZE] ^= 1
    q.write_bytes(bytes(bad))
    assert content(q) == want
    bad[offs[0] + 4] ^= 1  # the length field
    q.write_bytes(bytes(bad))
    with pytest.raises(CorruptError) as ei:
        trainhist.open(q)
    assert (ei.value.code, ei.value.offset) == ("bad_record_header", offs[0])
    # reserved flag bits are refused, not ignored
    out, offs = append_committed(data, [(1000, 3, b"x")])
    q.write_bytes(out)
    with pytest.raises(CorruptError) as ei:
        trainhist.open(q)
    assert (ei.value.code, ei.value.offset) == ("bad_record_flags", offs[0])
    # and the writer can append after an ignorable record (it keeps the sequence numbering)
    out, _ = append_committed(data, [(1000, 1, b"keep me")])
    q.write_bytes(out)
    with HistoryWriter(q, mode="a", **FAST) as w:
        w.observe(w.site("x", "activation"), 50, np.ones(3, np.float32))
    with trainhist.open(q) as h:
        assert len(h.ignored_records) == 1 and h.spine("x").step.tolist()[-1] == 50 and h.recovery.status == "clean"


@pytest.mark.parametrize("damage", ["payload", "padding", None])
def test_merge_checks_an_ignorable_record_as_verify_does(base: tuple[Path, bytes, tuple], tmp_path: Path,
                                                         damage: str | None) -> None:
    """An input with a committed ignorable record whose payload fails its CRC (or whose padding is not zero):
    `trainhist verify` refuses it as corrupt, yet merge accepted it. Spec 11 checks every input as verify does:
    merge refuses it with verify's code and offset (it copies nothing of the record), and merges it when sound."""
    p, data, want = base
    out, offs = append_committed(data, [(1000, 1, b"x" * 13)])
    bad = bytearray(out)
    if damage == "payload":
        bad[offs[0] + RECORD_HEADER_SIZE] ^= 1
    elif damage == "padding":
        bad[offs[0] + RECORD_HEADER_SIZE + 13] = 1  # (13 bytes, then 3 of padding)
    q = tmp_path / "ign.thist"
    q.write_bytes(bytes(bad))
    if damage is None:
        rep = trainhist.merge([q], tmp_path / "m.thist")
        assert rep.inputs[0]["status"] == "clean" and content(tmp_path / "m.thist") == want
        return
    with trainhist.open(q) as h, pytest.raises(CorruptError) as v:
        h.verify()
    code = "bad_payload_crc" if damage == "payload" else "bad_padding"
    assert (v.value.code, v.value.offset) == (code, offs[0])
    for workers in (1, 2):
        with pytest.raises(CorruptError) as ei:
            trainhist.merge([q], tmp_path / "m.thist", workers=workers)
        assert (ei.value.code, ei.value.offset, ei.value.path) == (code, offs[0], str(q))
        assert str(ei.value) == str(v.value)
        assert not (tmp_path / "m.thist").exists()


@pytest.mark.parametrize("cut", ["uncommitted", "header_only", "inside_header"])
def test_append_after_crash_before_first_commit(tmp_path: Path, cut: str) -> None:
    """A run that died before its first commit (an early OOM) can be resumed: nothing was readable, so the
    resumed writer starts the file afresh instead of failing."""
    p = tmp_path / "early.thist"
    w = HistoryWriter(p, **FAST)
    w.observe(w.site("x", "activation"), 0, np.ones(3))
    w._f.flush()  # the process dies here: manifests on disk, no commit
    data = p.read_bytes()
    w._f.close()
    p.write_bytes({"uncommitted": data, "header_only": data[:FILE_HEADER_SIZE], "inside_header": data[:10]}[cut])
    with trainhist.open(p) as h:
        assert h.recovery.status == "torn" or (cut == "header_only" and h.recovery.status == "clean")
        assert h.sites == [] and h.committed_bytes in (0, FILE_HEADER_SIZE)
    with HistoryWriter(p, mode="a", **FAST) as w2:
        w2.observe(w2.site("x", "activation"), 1, np.ones(3))
    with trainhist.open(p) as h:
        assert h.recovery.status == "clean" and h.spine("x").step.tolist() == [1]
        assert [(g.id, g.reason, g.previous) for g in h.segments] == [(0, "start", None)] and len(h.runs) == 1


def test_append_refuses_a_file_that_is_not_trainhist(tmp_path: Path) -> None:
    p = tmp_path / "notes.txt"
    p.write_bytes(b"precious notes, not a history file\n" * 3)
    with pytest.raises(trainhist.FormatError) as ei:
        HistoryWriter(p, mode="a", **FAST)
    assert ei.value.code == "bad_magic"
    assert p.read_bytes() == b"precious notes, not a history file\n" * 3


def test_integers_beyond_2_53_are_refused_not_rounded() -> None:
    import pytest

    from trainhist import summarize

    assert summarize(np.array([2**53, -(2**53)], np.int64)).max == 2.0**53
    with pytest.raises(ValueError, match="2\\*\\*53"):
        summarize(np.array([2**53 + 1], np.int64))
    with pytest.raises(ValueError):
        summarize(np.array([2**64 - 1], np.uint64))


def test_commit_header_with_zero_payload_is_a_torn_tail(tmp_path) -> None:
    """A machine crash can persist a record header but not its payload: that is a torn tail, not corruption."""
    import trainhist
    from trainhist.framing import RECORD_HEADER_SIZE

    p = tmp_path / "z.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("a", "param")
        w.observe(s, 0, np.arange(3.0))
        w.commit()
        w.observe(s, 1, np.arange(3.0))
    data = bytearray(p.read_bytes())
    with trainhist.open(p) as h:
        last = h.committed_bytes
    # find the commit records, then zero the last one's payload and everything after it (keep its header)
    import struct

    pos, commits = 32, []
    while pos < len(data):
        t, _f, length = struct.unpack_from("<HHI", data, pos)
        if t == 4:
            commits.append((pos, length))
        pos += RECORD_HEADER_SIZE + length + (-length % 8)
    cpos, clen = commits[-1]
    first_commit_end = commits[0][0] + RECORD_HEADER_SIZE + commits[0][1] + (-commits[0][1] % 8)
    data[cpos + RECORD_HEADER_SIZE :] = bytes(len(data) - cpos - RECORD_HEADER_SIZE)
    p.write_bytes(bytes(data))
    with trainhist.open(p) as h:
        assert h.recovery.status == "torn" and "zero-filled" in h.recovery.reason
        assert h.committed_bytes == first_commit_end < last
        assert h.spine("a", "param").step.tolist() == [0]


def test_unknown_phase_or_presence_name_is_a_usage_error(tmp_path) -> None:
    """An unknown name says what it was taken for (it said only "'gone' is not one of ..."): presence, phase,
    applied, grad_basis, clipped, with the names there are and the spec section; the reader's phase= adds '*'."""
    from trainhist.errors import UsageError

    p = tmp_path / "u.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("x", "activation")
        w.observe(s, 0, np.ones(2))
        for call, said in ((lambda: w.mark(s, 1, "gone"), "presence 'gone' is not one of unknown, observed, absent, "
                            "not_scheduled, failed, skipped (the presence names of spec 2.6)"),
                           (lambda: w.observe(s, 1, np.ones(2), phase="later"),
                            "phase 'later' is not one of default, pre_clip, post_clip (the phase names of spec 2.5)"),
                           (lambda: w.step_truth(1, applied="yes"), "applied 'yes' is not one of unknown, applied, "
                            "skipped"),
                           (lambda: w.step_truth(1, grad_basis="raw"), "grad_basis 'raw' is not one of unknown, "
                            "unscaled, scaled"),
                           (lambda: w.step_truth(1, clipped="no"), "clipped 'no' is not one of unknown, clipped, "
                            "not_clipped")):
            with pytest.raises(UsageError) as ei:
                call()
            assert ei.value.code == "unknown_name" and said in str(ei.value), str(ei.value)
    with trainhist.open(p) as h, pytest.raises(UsageError) as ei:
        h.spine("x", phase="bogus")
    assert ei.value.code == "unknown_name" and str(ei.value) == (
        "[unknown_name] phase 'bogus' is not one of default, pre_clip, post_clip (the phase names of spec 2.5), or "
        "'*' for the rows of every phase")


def test_dyadics_of_equals_from_float_on_every_kind_of_value():
    """The vectorised conversion of float64 sums gives Dyadic.from_float's canonical value for each."""
    from trainhist.dyadic import Dyadic, dyadics_of

    rng = np.random.default_rng(0)
    vals = [0.0, -0.0, 1.0, -1.0, 0.5, 3.0, 2.0**-1074, -(2.0**-1074), 2.0**-1022, 2.0**-1023 * 3,
            1.7976931348623157e308, -1.7976931348623157e308, 2.0**52 + 1, -(2.0**53), 1e-300, 6.02e23, math.pi]
    a = np.concatenate([np.array(vals), rng.standard_normal(500) * 10.0 ** rng.integers(-300, 300, 500)])
    assert dyadics_of(a) == [Dyadic.from_float(float(v)) for v in a]
    assert dyadics_of(np.zeros(0)) == []
    with pytest.raises(ValueError):
        dyadics_of(np.array([1.0, math.nan]))


def test_step_truth_takes_the_names_it_reads_back(tmp_path) -> None:
    """``applied`` and ``clipped`` accept a truth value or the reader's names; a string was read as True (``applied=
    "skipped"`` recorded an applied step), a string that is not a name is now refused."""
    import pytest

    from trainhist.errors import UsageError

    p = tmp_path / "t.thist"
    with trainhist.HistoryWriter(p) as w:
        w.step_truth(0, applied="skipped", clipped="not_clipped")
        w.step_truth(1, applied=True, clipped=False)
        w.step_truth(2, applied="unknown", clipped=np.bool_(True))
        for bad in ("yes", np.array([True, False])):
            with pytest.raises(UsageError) as e:
                w.step_truth(3, applied=bad)
            assert e.value.code == "unknown_name"
    rows = trainhist.open(p).step_truth_rows()
    assert [(r["applied"], r["clipped"]) for r in rows] == [("skipped", "not_clipped"), ("applied", "not_clipped"),
                                                            ("unknown", "clipped")]


def test_a_second_writer_on_an_open_file_is_refused(tmp_path) -> None:
    """Two writers on one file interleave their records (the second's salt splices the first's): the writer locks
    its file, a second one is refused with ``file_in_use``, and the file opens again once the first closes."""
    p = tmp_path / "t.thist"
    first = trainhist.HistoryWriter(p)
    first.observe(first.site("a", "activation"), 0, np.ones(3, np.float32))
    for mode in ("w", "a"):
        with pytest.raises(UsageError) as e:
            trainhist.HistoryWriter(p, mode=mode)
        assert e.value.code == "file_in_use"
    first.close()
    with trainhist.HistoryWriter(p, mode="a") as again:
        again.observe(again.site("a", "activation"), 1, np.ones(3, np.float32))
    h = trainhist.open(p)
    h.verify()  # (raises on any damage)
    assert h.spine("a", "activation").step.tolist() == [0, 1]


def test_a_writer_that_fails_to_open_leaves_the_file_and_its_lock_as_they_were(tmp_path) -> None:
    """A manifest the writer refuses (a config JSON cannot hold) is refused before the file is changed, and the
    lock is released: the existing history is intact and the next writer opens it."""
    p = tmp_path / "t.thist"
    with trainhist.HistoryWriter(p) as w:
        w.observe(w.site("a", "activation"), 0, np.ones(3, np.float32))
    data = p.read_bytes()
    for mode in ("w", "a"):
        for bad in (object(), float("nan"), float("-inf")):  # (no JSON form: refused with a typed error)
            with pytest.raises(UsageError) as e:
                trainhist.HistoryWriter(p, mode=mode, config={"x": bad}, settings={"y": bad})
            assert e.value.code == "bad_manifest_value"
            assert p.read_bytes() == data, mode
    with trainhist.HistoryWriter(p, mode="a") as again:
        again.observe(again.site("a", "activation"), 1, np.ones(3, np.float32))
    assert trainhist.open(p).spine("a", "activation").step.tolist() == [0, 1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_keep_the_lock_after_close(tmp_path) -> None:
    """A child forked while the writer was open (a DataLoader worker) shares the file's lock: close() releases it,
    so the file can be resumed while the child still runs."""
    p = tmp_path / "t.thist"
    w = trainhist.HistoryWriter(p)
    w.observe(w.site("a", "activation"), 0, np.ones(3, np.float32))
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait until the parent is done, then leave without cleanup
        os.close(wr)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        w.close()
        with trainhist.HistoryWriter(p, mode="a") as again:
            again.observe(again.site("a", "activation"), 1, np.ones(3, np.float32))
    finally:
        os.write(wr, b"x")
        os.close(wr)
        os.waitpid(pid, 0)
    assert trainhist.open(p).spine("a", "activation").step.tolist() == [0, 1]


@pytest.mark.parametrize("call", [
    lambda w, s: w.step_truth(5, tokens=-1), lambda w, s: w.step_truth(5, tokens=2**64),
    lambda w, s: w.step_truth(5, samples=-3), lambda w, s: w.step_truth(5, micro_batches=-1),
    lambda w, s: w.step_truth(5, loss_scale="x"), lambda w, s: w.step_truth(2**63),
    lambda w, s: w.observe(s, 5, np.ones(2), micro=-1), lambda w, s: w.observe(s, 5, np.ones(2), micro=2**40),
    lambda w, s: w.observe(s, 2**63, np.ones(2)), lambda w, s: w.observe(s, 12.7, np.ones(2)),
    lambda w, s: w.observe(s, 5, np.array([1 + 2j])), lambda w, s: w.observe(s, 5, np.array([2**60])),
    lambda w, s: w.scalar("loss", 5, "abc"), lambda w, s: w.scalar("loss", 5, None),
    lambda w, s: w.site("b", "activation", shape=("x",)),
])
def test_a_value_the_file_cannot_hold_is_refused_when_given(tmp_path, call) -> None:
    """A value out of its column's range (a negative token count, a step beyond i64, a fractional step) was taken,
    then failed the next commit, losing every row since the last one: it is refused at once, as a UsageError, and
    the history is intact."""
    p = tmp_path / "t.thist"
    w = trainhist.HistoryWriter(p)
    s = w.site("a", "activation")
    for step in range(5):
        w.observe(s, step, np.ones(3))
        w.step_truth(step, applied=True)
    with pytest.raises(UsageError):
        call(w, s)
    w.close()
    h = trainhist.open(p)
    assert h.spine("a", "activation").step.tolist() == list(range(5))
    assert len(h.step_truth_rows()) == 5


def test_mean_and_rms_of_extreme_values_come_from_the_exact_sums(tmp_path) -> None:
    """A sum of squares beyond the float range (1e300) or below it (5e-324) is stored exactly beside its rounded
    float (inf, 0): the derived rms was inf and 0; it comes from the exact value."""
    from fractions import Fraction

    p = tmp_path / "x.thist"
    with trainhist.HistoryWriter(p) as w:
        w.scalar("big", 0, 1e300)
        w.scalar("tiny", 0, 5e-324)
        w.observe(w.site("x", "activation"), 0, np.array([1e308, 1e308, -1e307]))
        w.observe(w.site("small", "activation"), 0, np.full(4, 3e-162))
    h = trainhist.open(p)
    assert (h.spine("big", "scalar").rms[0], h.spine("big", "scalar").mean[0]) == (1e300, 1e300)
    assert (h.spine("tiny", "scalar").rms[0], h.spine("tiny", "scalar").mean[0]) == (5e-324, 5e-324)
    assert math.isclose(h.spine("small", "activation").rms[0], 3e-162, rel_tol=1e-15)  # (a subnormal mean square)
    x = h.spine("x", "activation")
    values = [Fraction(v) for v in (1e308, 1e308, -1e307)]
    assert math.isclose(x.mean[0], float(sum(values) / 3), rel_tol=1e-15)
    assert math.isclose(x.rms[0], math.sqrt(float(sum(v * v for v in values) / 3 / 10**600)) * 1e300, rel_tol=1e-15)


def test_whole_numbers_come_as_tensors_and_arrays_too(tmp_path) -> None:
    """A 0-dim integer array (or tensor) is a whole number: refusing it lost every step-truth row the collector
    wrote with StepTruth(tokens=torch.tensor(32)); a string is not, and a refused micro index records nothing."""
    p = tmp_path / "t.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("a", "activation")
        w.step_truth(np.int64(0), tokens=np.array(4096), micro_batches=np.array(2.0))
        with pytest.raises(UsageError):
            w.step_truth(1, tokens="12")
        with pytest.raises(UsageError):
            w.observe(s, 1000, np.ones(2), micro=-1)
        w.observe(s, 0, np.ones(2))
    h = trainhist.open(p)
    assert [(r["tokens"], r["micro_batches"]) for r in h.step_truth_rows()] == [(4096, 2)]
    assert h.segments[0].first_step == 0


def test_a_summary_is_refused_exactly_where_readers_refuse_its_row(tmp_path: Path) -> None:
    """observe(summary=) checks one row in plain Python (numpy's per-call cost on one row was most of its time):
    it must refuse exactly the rows that the readers' test (model.row_problem) refuses, with the same rule."""
    import itertools

    from trainhist.model import Presence, row_problem

    nan, inf = math.nan, math.inf
    extremes = [(-1.0, 1.0), (1.0, -1.0), (0.0, -0.0), (-0.0, 0.0), (0.0, 0.0), (nan, nan), (nan, 1.0), (-inf, 1.0),
                (2.0, 2.0)]
    counts = [(3, 0, 0, 0, 0), (3, 3, 0, 0, 0), (3, 1, 1, 1, 0), (3, 0, 0, 0, 3), (3, 2, 1, 1, 0), (0, 0, 0, 0, 0),
              (3, 0, 0, 0, 4), (2, 1, 0, 0, 1)]
    sums = [0.0, 0.5]
    with HistoryWriter(tmp_path / "s.thist", **FAST) as w:
        site = w.site("a", "activation")
        for k, ((c, n, p, q, z), (mn, mx), sm) in enumerate(itertools.product(counts, extremes, sums)):
            s = Summary(count=c, nan=n, pinf=p, ninf=q, zero=z, min=mn, max=mx, sum=Dyadic.from_float(sm),
                        sumsq=Dyadic.from_float(sm), sum_method=SumMethod.EXACT)
            cols = {name: np.array([v]) for name, v in zip(("count", "nan", "pinf", "ninf", "zero"), (c, n, p, q, z))}
            cols.update(min=np.array([mn]), max=np.array([mx]), sum=np.array([sm]), sumsq=np.array([sm]),
                        presence=np.array([Presence.OBSERVED], np.uint8))
            want = row_problem(cols)
            try:
                w.observe(site, k, summary=s)
                got = None
            except UsageError as e:
                got = str(e)
            assert (got is None) == (want is None), (c, n, p, q, z, mn, mx, sm, want, got)
            if want is not None:
                assert want[1].removeprefix("row {row}: ") in got


def test_a_closed_history_refuses_queries_with_a_typed_error(tmp_path) -> None:
    """Queries after close raised the memoryview's bare ValueError ("operation forbidden on released memoryview");
    they are UsageError now (code ``closed``), even for the site read last (kept decoded), and the manifests stay."""
    p = tmp_path / "x.thist"
    with trainhist.HistoryWriter(p) as w:
        w.observe(w.site("a", "activation"), 0, np.ones(3))
    with trainhist.open(p) as h:
        assert h.spine("a", "activation").columns["count"].tolist() == [3]
    for query in (lambda: h.spine("a", "activation"), lambda: h.sketch("a", "activation"), lambda: h.steps,
                  lambda: h.presence("a", "activation"), h.verify, lambda: h.chunk(h._obs[h.sites[0].id][0])):
        with pytest.raises(trainhist.errors.UsageError, match="is closed") as e:
            query()
        assert e.value.code == "closed"
    assert [s.path for s in h.sites] == ["a"]
