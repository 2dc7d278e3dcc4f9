"""The vectorised exact-sum path of merge (``trainhist.exactvec``) against plain Python integer arithmetic.

Decoding (canonical checks, correct rounding), group sums (alignment, carries, cancellation, wide spans that take
the Python path, subnormal and infinite results) and encoding are compared value by value with ``Dyadic``, and the
sparse sketch scatter-add with the dense sums, including counts whose sum reaches 2**64.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainhist
from trainhist import exactvec as xv
from trainhist.dyadic import Dyadic
from trainhist.errors import CorruptError, MergeError
from trainhist.summary import Sketch, Summary

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def canon(m: int, e: int) -> Dyadic:
    return Dyadic.make(m, e)


def column(vals: list[Dyadic]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The f64, _xn and _x columns a writer stores for these exact values (spec 5.3)."""
    f = np.array([v.to_float() for v in vals], np.float64)
    blobs = [b"" if v.is_float() else v.to_bytes() for v in vals]
    return f, np.array([len(b) for b in blobs], np.uint32), np.frombuffer(b"".join(blobs), np.uint8)


def locate(i: int) -> tuple[str, int, int]:
    return "f", 0, i


def decode(vals: list[Dyadic]) -> tuple[np.ndarray, xv.ExactCol]:
    f, lens, blob = column(vals)
    return f, xv.decode_exact("sum", f, lens, blob, np.ones(len(vals), bool), locate)


# values: floats of every kind, dyadics of up to ~600 bits with exponents across and beyond the binary64 range
_special_m = st.sampled_from([1, -1, 3, (1 << 53) - 1, (1 << 53) + 1, (1 << 64) - 1, -(1 << 64) + 1, (1 << 255) - 1,
                              (1 << 256) + 1, -((1 << 256) - 1), (1 << 300) + 1, 0])
mant = st.one_of(_special_m, st.integers(-(1 << 70), 1 << 70), st.integers(-(1 << 600), 1 << 600))
expo = st.one_of(st.integers(-80, 80), st.integers(-1200, 1100), st.sampled_from([-1074, -1075, -1126, 971, 1023]))
dyadic = st.builds(canon, mant, expo)
flt = st.floats(allow_nan=False, allow_infinity=False).map(Dyadic.from_float)
_edges = [Dyadic(0, 0), Dyadic(1, -1074), Dyadic(-1, -1074), Dyadic.from_float(2.0**-1022),
          Dyadic.from_float(1.7976931348623157e308)]
value = st.one_of(dyadic, flt, st.sampled_from(_edges))


def ref_sum(vals: list[Dyadic]) -> Dyadic:
    out = Dyadic(0, 0)
    for v in vals:
        out = out + v
    return out


@settings(max_examples=300, **SETTINGS)
@given(groups=st.lists(st.lists(value, min_size=1, max_size=6), min_size=1, max_size=8))
def test_group_sums_equal_python(groups):
    vals = [v for g in groups for v in g]
    f, x = decode(vals)
    for i, v in enumerate(vals):  # decode keeps every value exactly
        assert x.get(i) == v
    sizes = np.array([len(g) for g in groups])
    starts = np.cumsum(sizes) - sizes
    fo, xo = xv.group_sum(f, x, starts, sizes)
    rf, rx = decode(vals[::-1])  # the same rows stored in reverse, taken in order
    fr, xr = xv.group_sum(rf, rx, starts, sizes, np.arange(len(vals))[::-1].copy())
    assert fr.view(np.uint64).tolist() == fo.view(np.uint64).tolist()
    assert [xr.get(k) for k in range(len(groups))] == [xo.get(k) for k in range(len(groups))]
    want = [ref_sum(g) for g in groups]
    for k, w in enumerate(want):
        assert xo.get(k) == w
        assert bits(fo[k]) == bits(w.to_float()) or (fo[k] == 0.0 and w.m == 0)
    enc = xv.encode_exact(xo)
    wf, wl, wb = column(want)
    if enc is None:
        assert not wl.any()
    else:
        assert enc[0].tolist() == wl.tolist() and enc[1] == wb.tobytes()


def test_group_sum_adversarial_cases():
    cases = [
        [Dyadic(1, 0), Dyadic(-1, 0)],  # cancels to zero
        [Dyadic((1 << 200) - 1, 0), Dyadic(1, 0)],  # carries through every limb
        [Dyadic(-((1 << 200) - 1), 0), Dyadic(-1, 0)],
        [Dyadic(1, -1074), Dyadic(1, -1074), Dyadic(1, -1074)],  # subnormal result
        [Dyadic(1, 1023), Dyadic(1, 1023)],  # 2**1024: overflows to inf, stored exactly
        [Dyadic((1 << 53) - 1, 971), Dyadic(1, 970)],  # rounds up past the largest float: inf
        [Dyadic(1, 2000), Dyadic(1, -2000)],  # span wider than the accumulator: Python path
        [Dyadic((1 << 53) + 1, 0), Dyadic(-(1 << 53) - 1, -100)],
        [Dyadic(3, -1075), Dyadic(1, -1075)],  # 2**-1073, a float
        [Dyadic((1 << 54) + 1, -1076), Dyadic(0, 0)],  # tie at the subnormal rounding point
        [Dyadic(5, -1), Dyadic(-3, -1), Dyadic(1, 60)],
        [Dyadic((1 << 255) + 1, 3)] * 7,  # result wider than the vectorised limbs
        [Dyadic(-(1 << 250) - 1, 0), Dyadic((1 << 250) - 1, 0)],  # wide values cancelling to -2
    ]
    for g in cases:
        test_group_sums_equal_python.hypothesis.inner_test(groups=[g, [g[0]], g[::-1]])


def _int64_sides(groups: list[list[Dyadic]]) -> np.ndarray:
    """Which of these groups (of two-limb values) group_sum adds in int64 rather than with limbs."""
    f, x = decode([v for g in groups for v in g])
    assert x.m.shape[1] == 2
    sizes = np.array([len(g) for g in groups])
    mstart = np.cumsum(sizes) - sizes
    nonzero = (x.m != 0).any(axis=1)
    gmin = np.minimum.reduceat(np.where(nonzero, x.e, 1 << 62), mstart)
    allzero = gmin == 1 << 62
    s = np.where(nonzero, x.e - np.where(allzero, 0, gmin)[np.repeat(np.arange(len(groups)), sizes)], 0)
    return xv._int64_groups(x.m, s, nonzero, mstart, sizes, gmin, allzero)


def test_int64_group_sums_both_sides_of_the_guard():
    """Groups of values of at most 64 mantissa bits are added in int64 when every aligned member and the sum stay
    below 2**62 and the sum is no subnormal, else with limbs: both give the Python sums, roundings and bytes."""
    top = (1 << 53) - 1
    quick = [
        [Dyadic(1, 0), Dyadic(-1, 0)],  # cancels to zero
        [Dyadic(top, 0), Dyadic(top, 0), Dyadic(1, 0)],  # a rounded sum (55 bits)
        [Dyadic(top, 6), Dyadic(-1, 0), Dyadic(3, 2)],  # aligned members of 59 bits
        [Dyadic((1 << 58) + 1, 0)] * 8,  # 59 + 3 bits: the largest sum the guard admits
        [Dyadic(-(1 << 58) - 1, 0)] * 8,
        [Dyadic(1, -1022), Dyadic(1, -1022)],  # the lowest exponent with no subnormal sum
        [Dyadic(top, 971), Dyadic(top, 971)],  # overflows to inf, stored exactly
        [Dyadic(3, 4), Dyadic(5, 4)],  # trailing zeros move into the exponent
        [Dyadic(0, 0), Dyadic(0, 0)],
    ]
    slow = [
        [Dyadic((1 << 59) + 1, 0)] * 8,  # 60 + 3 bits
        [Dyadic(top, 10), Dyadic(1, 0)],  # aligned member of 63 bits
        [Dyadic(1, -1023), Dyadic(1, -1023)],  # may be subnormal
        [Dyadic(-(1 << 62) - 1, 0), Dyadic(1, 0)],  # a 63-bit member
        [Dyadic(1, 0), Dyadic(1, 80)],
    ]
    assert _int64_sides(quick).all()
    assert not _int64_sides(slow).any()
    both = quick + slow
    test_group_sums_equal_python.hypothesis.inner_test(groups=both)
    test_group_sums_equal_python.hypothesis.inner_test(groups=[g[::-1] for g in both[::-1]] + [[Dyadic(7, 1)]])


narrow = st.builds(canon, st.one_of(st.integers(-(1 << 40), 1 << 40), st.integers(-(1 << 63) + 1, (1 << 63) - 1)),
                   st.one_of(st.integers(-8, 8), st.integers(-1080, 1000)))


@settings(max_examples=300, **SETTINGS)
@given(groups=st.lists(st.lists(st.one_of(flt, narrow), min_size=1, max_size=9), min_size=1, max_size=8))
def test_group_sums_of_narrow_values_equal_python(groups):
    """Values of at most 64 mantissa bits (two limbs), where the int64 path applies to some groups."""
    test_group_sums_equal_python.hypothesis.inner_test(groups=groups)


@settings(max_examples=300, **SETTINGS)
@given(m=st.integers(1, 1 << 300), e=st.integers(-1300, 1100), neg=st.booleans(), tie=st.sampled_from([0, 1, 2, 3]))
def test_rounding_equals_python(m, e, neg, tie):
    if tie and m.bit_length() > 80:  # an exact tie below the 53rd bit; or a tie plus or minus the last bit, far
        k = m.bit_length() - 54  # below the 63-bit window (only its sticky bit tells them apart)
        m = ((m >> (k + 1)) << (k + 1)) | (1 << k)
        m = m + 1 if tie == 2 else m - 1 if tie == 3 else m
    m = canon(-m if neg else m, e)
    f, x = decode([m, Dyadic(m.m + 2, m.e) if m.m > 0 else Dyadic(m.m - 2, m.e)])
    assert bits(f[0]) == bits(m.to_float())


def bad_exact_encodings() -> list[tuple[bytes, float]]:
    """Exact-value blobs a reader must refuse, each with the float64 column stored beside it."""
    def blob(e: int, mb: bytes) -> bytes:
        return struct.pack("<i", e) + mb

    good = Dyadic((1 << 60) + 1, -3)
    return [
        (blob(-3, ((1 << 60) + 2).to_bytes(8, "little")), (1 << 60) * 2.0**-3),  # even mantissa
        (blob(-3, ((1 << 60) + 1).to_bytes(9, "little")), good.to_float()),  # a redundant 0x00 byte
        (blob(-3, (-(1 << 60) - 1).to_bytes(9, "little", signed=True)), -good.to_float()),  # a redundant 0xff
        (blob(5, b"\x00"), 0.0),  # zero with a non-zero exponent
        (good.to_bytes(), math.nextafter(good.to_float(), 0.0)),  # f64 not the rounded value
        (blob(0, b""), 0.0),  # shorter than 5 bytes
        (blob(-3, ((1 << 300) + 2).to_bytes(39, "little")), 2.0**297),  # wide, even
        (blob(-3, ((1 << 300) + 1).to_bytes(40, "little")), 2.0**297),  # wide, redundant byte
        (blob(-3, ((1 << 300) + 1).to_bytes(39, "little")), 2.0**296),  # wide, wrongly rounded
    ]


def test_decode_refuses_bad_encodings():
    cases = bad_exact_encodings()
    for b, f in cases:
        with pytest.raises(CorruptError) as ei:
            xv.decode_exact("sum", np.array([1.0, f]), np.array([0, len(b)], np.uint32),
                            np.frombuffer(b, np.uint8), np.ones(2, bool), lambda i: ("p", 7, i))
        assert ei.value.code == "bad_exact_value" and "row 1" in str(ei.value)
    for bad in (math.inf, math.nan):  # an observed row without an exact form must be a finite float
        with pytest.raises(CorruptError) as ei:
            xv.decode_exact("sum", np.array([bad]), None, None, np.ones(1, bool), locate)
        assert ei.value.code == "bad_exact_value"
    x = xv.decode_exact("sum", np.array([math.nan]), None, None, np.zeros(1, bool), locate)  # not observed: zero
    assert x.get(0) == Dyadic(0, 0)
    # a blob for a value that is a float is accepted (the f64 alone would do), and re-encoded without it
    v = Dyadic(3, -1)
    x = xv.decode_exact("sum", np.array([1.5]), np.array([len(v.to_bytes())], np.uint32),
                        np.frombuffer(v.to_bytes(), np.uint8), np.ones(1, bool), locate)
    assert x.get(0) == v and xv.encode_exact(x) is None


# -- sketches near 2**64 through the whole merge --------------------------------------------------------------
def _shards(d: str, counts: list[dict[int, int]], sites: int = 1) -> list[str]:
    run = uuid.uuid4().hex
    paths = []
    for rank, bins in enumerate(counts):
        p = os.path.join(d, f"r{rank}.th")
        with trainhist.HistoryWriter(p, run_id=run, rank=rank, world_size=len(counts), fsync="never") as w:
            for name in ["a", "0", "b"][:sites]:  # the bins go to site "a", the others get a little
                s = w.site(name, "activation")
                for step in range(3):
                    sk = Sketch.empty()
                    for k, v in (bins if name == "a" else {3: 1}).items():
                        sk.pos[k] = v
                    w.observe(s, step, summary=Summary(count=2**62, min=1.0, max=2.0, sketch=sk))  # counts: no overflow
        paths.append(p)
    return paths


def test_sketch_bins_near_2_64():
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "m.th")
        a = _shards(d, [{10: 2**63}, {10: 2**63}])
        with pytest.raises(MergeError) as ei:
            trainhist.merge(a, out)
        assert ei.value.code == "count_overflow" and "sketch bin" in str(ei.value)
        b = _shards(d, [{10: 2**63, 11: 5}, {10: 2**63 - 1, 12: 2**63}])  # large, but no sum overflows
        trainhist.merge(b, out)
        sk = trainhist.open(out).sketch("a")
        pos = np.asarray(sk.pos)
        assert pos.shape[0] == 3
        assert [int(v) for v in pos[0][[10, 11, 12]]] == [2**64 - 1, 5, 2**63]
        c = _shards(d, [{10: 2**63, 11: 5}, {10: 2**63, 12: 7}])  # patched-bytes counts: the bound is an exception
        with pytest.raises(MergeError) as ei:
            trainhist.merge(c, out)
        assert ei.value.code == "count_overflow" and "sketch bin" in str(ei.value)


def test_upper_bound_of_patched_counts():
    """batchdecode.upper_bound: at least every value of patched-bytes blocks (254, or the largest exception), None
    for a column with blocks of another codec."""
    from trainhist.batchdecode import _Col, upper_bound
    from trainhist.chunk import Codec, _encode_for, _encode_patched

    def blocks(values: list[list[int]], codecs: list[int]) -> tuple[memoryview, _Col, list[int]]:
        data, start, slen = b"", [], []
        for v, c in zip(values, codecs):
            a = np.array(v, np.uint64)
            b = (_encode_patched(a, "u8", a >= 255) or b"") if c == Codec.PATCHED else _encode_for(a, "u8", 0, 1)
            start.append(len(data))
            slen.append(len(b))
            data += b
        n = [len(v) for v in values]
        return memoryview(data), _Col(None, "c", codecs, start, slen, [8 * k for k in n], list(range(len(n)))), n

    for values, want in (([[1, 2, 3], [0, 7]], 254), ([[1, 2**63 + 5, 3], [300, 0]], 2**63 + 5), ([[], [9]], 254)):
        view, c, n = blocks(values, [Codec.PATCHED] * len(values))
        assert upper_bound(view, c, n) == want >= max(max(v, default=0) for v in values)
    view, c, n = blocks([[1, 2], [3, 4]], [Codec.PATCHED, Codec.FOR])
    assert upper_bound(view, c, n) is None


def test_rounding_ties_and_sticky_bits():
    """Halfway cases whose only difference from a tie lies far below the top 63 bits (seeded, 4000 cases)."""
    import random

    rng = random.Random(5)
    vals = []
    for _ in range(4000):
        top = rng.getrandbits(53) | (1 << 52)
        k = rng.randint(12, 400)
        m = (top << (k + 1)) | (1 << k)
        m += rng.choice([0, 1, -1, 1 << rng.randint(0, 9)])
        if not m & 1:
            m += rng.choice([0, 2]) if m & 2 else 0
        e = rng.randint(-1100 - k, 1000 - k)
        vals.append(canon(m if rng.random() < 0.5 else -m, e))
    f, x = decode(vals)  # raises unless every f64 matches the vectorised rounding
    assert [bits(v) for v in f.tolist()] == [bits(v.to_float()) for v in vals]


def test_worker_scan_raises_what_the_serial_scan_raises():
    """With workers, the inputs are opened in worker processes: the error of the first bad input in input order
    comes back with its type, code and path, as when they are opened one by one."""
    with tempfile.TemporaryDirectory() as d:
        good = _shards(d, [{10: 1}, {10: 2}], sites=2)
        junk = os.path.join(d, "junk.th")
        with open(junk, "wb") as f:
            f.write(b"not a history" * 100)
        missing = os.path.join(d, "missing.th")

        def error(paths: list[str], workers: int) -> tuple:
            with pytest.raises(Exception) as ei:
                trainhist.merge(paths, os.path.join(d, "out.th"), workers=workers)
            e = ei.value
            return type(e), getattr(e, "code", None), getattr(e, "path", None), str(e)

        for paths in ([good[0], junk, missing], [good[0], missing, junk], [junk, good[1]]):
            assert error(paths, 2) == error(paths, 1)
        assert error([good[0], junk, missing], 2)[2] == junk
        rep = trainhist.merge(good, os.path.join(d, "ok.th"), workers=2)
        assert rep.workers == 2 and [i["path"] for i in rep.inputs] == good



def test_worker_scan_of_manifests_nested_beyond_pickle():
    """A run config nested deeper than pickle's recursion limit (but within JSON's) is valid; with workers its input
    cannot come back from a worker, and is opened in the merging process instead: the same bytes as without."""
    config: object = 1
    for _ in range(600):
        config = {"a": config}
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for rank in range(2):
            p = os.path.join(d, f"deep{rank}.th")
            with trainhist.HistoryWriter(p, run_id="0" * 32, config=config, rank=rank, world_size=2,
                                         fsync="never") as w:
                w.scalar("loss", 0, 1.0 + rank)
            paths.append(p)
        outs = []
        for workers in (1, 2):
            out = os.path.join(d, f"m{workers}.th")
            trainhist.merge(paths, out, workers=workers)  # with 2, the inputs are opened in the worker pool
            with open(out, "rb") as f:
                outs.append(f.read())
        assert outs[0] == outs[1]

def test_worker_merge_syncs_as_it_writes(monkeypatch: pytest.MonkeyPatch):
    """With workers, the output's data is synced every SYNC_BYTES while sites are written: the same bytes."""
    import importlib

    from trainhist import canonical

    merge_mod = importlib.import_module("trainhist.merge")  # the module (trainhist.merge is also the function)

    calls = []
    sync = canonical.CanonicalWriter.sync_data
    monkeypatch.setattr(canonical.CanonicalWriter, "sync_data", lambda w: calls.append(w.bytes_written) or sync(w))
    monkeypatch.setattr(merge_mod, "SYNC_BYTES", 1)
    with tempfile.TemporaryDirectory() as d:
        paths = _shards(d, [{10: 1, 11: 2}, {10: 3}], sites=3)
        outs = []
        for n in (1, 2):
            out = os.path.join(d, f"m{n}.th")
            trainhist.merge(paths, out, workers=n)
            outs.append(open(out, "rb").read())
        assert outs[0] == outs[1]
        assert len(calls) == 3 and calls == sorted(calls)


def test_worker_processes_give_the_same_bytes_and_errors():
    with tempfile.TemporaryDirectory() as d:
        run = uuid.uuid4().hex
        paths = []
        rng = np.random.default_rng(3)
        for rank in range(3):
            p = os.path.join(d, f"w{rank}.th")
            with trainhist.HistoryWriter(p, run_id=run, rank=rank, world_size=3, fsync="never", commit_every=4) as w:
                sites = [w.site(f"s{i}", "activation") for i in range(5)]
                for step in range(9):
                    for s in sites:
                        w.observe(s, step, (rng.standard_normal(50) * 1e3).astype(np.float32))
            paths.append(p)
        outs = []
        for n in (1, 2, 3):
            out = os.path.join(d, f"m{n}.th")
            rep = trainhist.merge(paths, out, workers=n)
            assert rep.rows_in == 3 * 5 * 9 and rep.rows_out == 5 * 9
            outs.append(open(out, "rb").read())
        assert outs[0] == outs[1] == outs[2]
        a = _shards(d, [{10: 2**63}, {10: 2**63}], sites=3)
        with pytest.raises(MergeError) as ei:  # raised in a worker, raised again in the caller with its details
            trainhist.merge(a, os.path.join(d, "bad.th"), workers=2)
        assert ei.value.code == "count_overflow" and ei.value.path == a[0] and "sketch bin" in str(ei.value)
        assert not os.path.exists(os.path.join(d, "bad.th"))


def test_a_worker_that_dies_is_an_error_not_a_hang(monkeypatch: pytest.MonkeyPatch):
    """A worker process that ends abruptly (the OOM killer, a signal) while opening an input or building a site
    gives ``worker_lost``; the merge neither waits for it forever nor leaves an output or spool folder behind.
    Afterwards the same inputs merge with workers."""
    import importlib

    merge_mod = importlib.import_module("trainhist.merge")
    with tempfile.TemporaryDirectory() as d:
        paths = _shards(d, [{10: 1, 11: 2}, {10: 3}], sites=3)
        site, source = merge_mod._Engine._site, merge_mod._Source

        def dying_site(self, out_site):  # runs in the forked worker, which inherits the patch
            if out_site == 1:
                os._exit(9)
            return site(self, out_site)

        def dying_source(idx, path):
            if idx == 1:
                os._exit(9)
            return source(idx, path)

        for name, patched in (("_site", dying_site), ("_Source", dying_source)):
            with monkeypatch.context() as m:
                m.setattr(merge_mod._Engine if name == "_site" else merge_mod, name, patched)
                out = os.path.join(d, f"dead{name}.th")
                with pytest.raises(MergeError) as ei:
                    trainhist.merge(paths, out, workers=2)
                assert ei.value.code == "worker_lost" and "workers=1" in str(ei.value)
                assert sorted(os.listdir(d)) == sorted(os.path.basename(p) for p in paths)  # no output, no spools
        rep = trainhist.merge(paths, os.path.join(d, "ok.th"), workers=2)
        assert rep.workers == 2 and rep.rows_out > 0


def test_sum_whose_exponent_leaves_i32_is_refused_not_wrapped():
    """Spec 11.2: an exact sum whose canonical exponent does not fit the i32 of 5.3 is refused (``sum_overflow``,
    naming the files); one step below the limit it is stored exactly."""

    def shards(d: str, e: int) -> list[str]:
        run, paths = uuid.uuid4().hex, []
        for rank in range(2):
            p = os.path.join(d, f"e{rank}.th")
            with trainhist.HistoryWriter(p, run_id=run, rank=rank, world_size=2, fsync="never") as w:
                w.observe(w.site("a", "activation"), 0,
                          summary=Summary(count=1, min=1.0, max=1.0, sum=Dyadic(1, e), sumsq=Dyadic(1, 0), sketch=None))
            paths.append(p)
        return paths

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "m.th")
        with pytest.raises(MergeError) as ei:
            trainhist.merge(shards(d, xv.I32_MAX), out)
        assert ei.value.code == "sum_overflow"
        assert "e0.th" in str(ei.value) and "e1.th" in str(ei.value) and str(2**31) in str(ei.value)
        assert not os.path.exists(out)
        trainhist.merge(shards(d, xv.I32_MAX - 1), out)  # 2 * 2**(2**31 - 2) = 2**(2**31 - 1): the largest exponent
        sp = trainhist.open(out).spine("a")
        assert len(sp) == 1 and sp.sum_exact(0) == Dyadic(1, xv.I32_MAX) and sp.columns["sum"][0] == math.inf
