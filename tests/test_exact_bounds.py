"""Exact sums (spec 5.3) that are valid, or nearly so, but costly or odd: exponents at the ends of the i32, mantissas
beyond the width bound, merged sums far apart, means and rms of sums beyond binary64, and the zero a tiny value
rounds to. Work is bounded by the size of the mantissas whatever the exponents: asserted on allocation peaks
(tracemalloc) and bit lengths, never on time. Found by a fuzzer (reproducers r1, r3, r6)."""

from __future__ import annotations

import math
import struct
import tracemalloc
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from history_helpers import obs_payload, records, rewrite
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainhist
from trainhist import exactvec as xv
from trainhist.dump import dumps
from trainhist.dyadic import EXACT_BYTES, MANT_BITS, Dyadic, float_of, quotient_float, sum_within
from trainhist.errors import CorruptError, TrainhistError, UsageError
from trainhist.framing import RecordType
from trainhist.summary import Summary, SumMethod

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=300)
VECTORS = Path(__file__).resolve().parent.parent / "conformance" / "vectors"
KIB = 1024
I32_MAX, I32_MIN = 2**31 - 1, -(2**31)


def _old_float_of(m: int, e: int) -> float:
    """dyadic.float_of before the bound: the shift itself (2**|e| bits)."""
    try:
        return float(m << e) if e >= 0 else m / (1 << -e)
    except OverflowError:
        return math.inf if m > 0 else -math.inf


def bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def peak(fn):
    """``(fn(), the peak of traced allocations during it in bytes)``."""
    tracemalloc.start()
    try:
        r = fn()
        return r, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def warm(tmp_path: Path) -> None:
    """Merge and coarsen a small file once, so that what they load on first use (compiled kernels, imports) is not
    counted in a peak measured after."""
    p = one(tmp_path, "warm.thist", Dyadic(1, 0), Dyadic((1 << 300) + 1, 0))
    trainhist.merge([p], tmp_path / "warm.m.thist", workers=1)
    trainhist.coarsen(p, tmp_path / "warm.c.thist", steps=2, workers=1)
    dumps(trainhist.open(p))


def one(tmp_path: Path, name: str, *sums: Dyadic, count: int = 1, sumsq: Dyadic = Dyadic(1, 0),
        rank: int = 0, world: int = 1, method: int = SumMethod.EXACT, run: str = "1" * 32, **kw) -> Path:
    """A file of one site, one row a step, each with one of ``sums``."""
    p = tmp_path / name
    with trainhist.HistoryWriter(p, codec="raw", fsync="never", run_id=run, writer_id=f"{rank + 1:x}" * 32,
                                 rank=rank, world_size=world, **kw) as w:
        a = w.site("a", "activation", cadence_sketch=0)
        for step, s in enumerate(sums):
            unknown = method == SumMethod.UNKNOWN
            w.observe(a, step, summary=Summary(count=count, min=1.0, max=1.0, sum=Dyadic(0, 0) if unknown else s,
                                               sumsq=Dyadic(0, 0) if unknown else sumsq, sum_method=method,
                                               sketch=None))
    return p


# -- 1. rounding to binary64 whatever the exponent --------------------------------------------------------------
mant = st.one_of(st.sampled_from([1, -1, 3, (1 << 53) - 1, (1 << 53) + 1, (1 << 54) + 3, -(1 << 64) - 1]),
                 st.integers(-(1 << 70), 1 << 70), st.integers(-(1 << 600), 1 << 600))


@settings(**SETTINGS)
@given(mant, st.one_of(st.integers(-1200, 1100), st.sampled_from([-1076, -1075, -1074, -1073, -1022, 1023, 1024,
                                                                   1025])))
def test_float_of_rounds_as_the_shift_did_near_the_float_range(m, top):
    """Values within reach of the binary64 range (top bit from 2**-1200 to 2**1100): the same bits as before."""
    e = top - abs(m).bit_length()
    assert bits(float_of(m, e)) == bits(_old_float_of(m, e))


def _id(v: object) -> str:
    return f"{'-' if v < 0 else ''}{abs(v).bit_length()}bits" if isinstance(v, int) and abs(v) >> 64 else repr(v)


@pytest.mark.parametrize("m, e, want", [
    (1, I32_MAX, math.inf), (-1, I32_MAX, -math.inf), (1, I32_MIN, 0.0), (-3, I32_MIN, -0.0),
    ((1 << 8190) + 1, I32_MAX - 8191, math.inf), (-((1 << 8190) + 1), I32_MIN, -0.0),
    (1, 1024, math.inf), (-1, 1024, -math.inf), ((1 << 53) - 1, 971, 1.7976931348623157e308),
    ((1 << 54) - 1, 970, math.inf),  # 2**1024 - 2**970: the halfway point above the largest float rounds up
    (1, -1075, 0.0), (-1, -1075, -0.0),  # half the smallest subnormal: a tie, to the even zero
    (3, -1076, 5e-324), (-3, -1076, -5e-324), (1, -1076, 0.0), (-1, -1076, -0.0), (1, -1074, 5e-324),
], ids=_id)
def test_float_of_huge_exponents_cost_the_size_of_m(m, e, want):
    """Spec 5.3: 1 * 2**(2**31 - 1) used to cost a 2**31-bit integer (256 MiB); the result follows from the bit length
    of m and e (±inf, or the zero of the sign of m) and the work from the size of m."""
    got, pk = peak(lambda: float_of(m, e))
    assert bits(got) == bits(want)
    assert pk < 16 * KIB + abs(m).bit_length() // 8 * 4


def _round_ref(x: Fraction) -> float:
    """The correctly rounded float64 of the rational ``x`` (Python's int / int is correctly rounded)."""
    try:
        return x.numerator / x.denominator
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _is_rounded_root(r: float, x: Fraction) -> bool:
    """Whether ``r`` is the correctly rounded float64 (ties to even) of ``sqrt(x)``: ``x`` lies between the squares of
    the midpoints around ``r``, and on one only when ``r``'s last bit is even."""
    if r == math.inf:
        return x >= Fraction(2**1024 - 2**970) ** 2
    lo = (Fraction(r) + Fraction(math.nextafter(r, -math.inf))) / 2 if r > 0 else Fraction(0)
    up = math.nextafter(r, math.inf)
    hi = (Fraction(r) + Fraction(up)) / 2 if up != math.inf else Fraction(2**1024 - 2**970)  # (a tie there: inf)
    even = bits(r) & 1 == 0
    return (lo**2 < x < hi**2) or (even and x in (lo**2, hi**2)) or (r == 0 and x <= hi**2)


@settings(**SETTINGS)
@given(mant.filter(bool), st.integers(-2400, 2400), st.one_of(st.integers(1, 10), st.integers(1, 2**64 - 1)))
def test_quotient_float_is_correctly_rounded(m, e, n):
    x = Fraction(m) * Fraction(2) ** e / n
    assert bits(quotient_float(m, e, n)) == bits(_round_ref(x))
    r = quotient_float(abs(m), e, n, root=True)
    assert _is_rounded_root(r, abs(x)), (m, e, n, r)


def test_the_rounded_root_check_at_the_ends_of_the_range():
    top = 2.0**1023 * (2 - 2.0**-52)
    assert _is_rounded_root(top, Fraction(top) ** 2) and not _is_rounded_root(top, Fraction(2**1024 - 2**970) ** 2)
    assert _is_rounded_root(math.inf, Fraction(2**1024 - 2**970) ** 2)
    assert _is_rounded_root(0.0, Fraction(1, 2**2150)) and _is_rounded_root(5e-324, Fraction(1, 2**2148))


def test_quotient_float_of_huge_exponents_is_bounded():
    for m, e, n, root, want in ((1, I32_MAX, 3, False, math.inf), (-1, I32_MAX, 3, False, -math.inf),
                                (-1, I32_MIN, 3, False, -0.0), (1, I32_MAX, 3, True, math.inf),
                                (1, I32_MIN, 2**64 - 1, True, 0.0), ((1 << 3000) + 1, 0, 3, False, math.inf),
                                (-5, 2, 1, True, math.nan)):
        got, pk = peak(lambda: quotient_float(m, e, n, root))
        assert bits(got) == bits(want) and pk < 16 * KIB


# -- 2. mean and rms of sums beyond binary64 (reproducer r1) ----------------------------------------------------
def test_mean_and_rms_of_sums_beyond_binary64_are_correctly_rounded_not_an_exception(tmp_path):
    """A valid row whose exact sum is 2**3000 + 1 (f64 +inf) made SpineSeries.mean raise a bare OverflowError (and
    frames.spines, which reads it); the mean is +inf, and where the quotient is a float it is the correctly rounded
    one."""
    big = 2**63 + 1
    p = one(tmp_path, "r1.thist", Dyadic((1 << 3000) + 1, 0), Dyadic((1 << 1030) + 1, 0), Dyadic(-((1 << 1030) + 1), 0),
            count=big, sumsq=Dyadic((1 << 2000) + 1, 0))
    h = trainhist.open(p)
    h.verify()
    s = h.spine("a")
    mean, rms = s.mean, s.rms
    assert mean[0] == math.inf
    assert mean[1] == _round_ref(Fraction((1 << 1030) + 1, big)) and mean[2] == -mean[1]
    assert _is_rounded_root(float(rms[0]), Fraction((1 << 2000) + 1, big)) and math.isfinite(rms[0])
    pd = pytest.importorskip("pandas")  # noqa: F841
    from trainhist import frames

    df = frames.spines(h)
    assert df["mean"].tolist()[0] == math.inf and df["mean"].tolist()[1] == mean[1]


def test_rms_of_a_sum_of_squares_below_binary64(tmp_path):
    p = one(tmp_path, "tiny.thist", Dyadic(1, -1074), sumsq=Dyadic(1, -2148))  # one value 2**-1074
    s = trainhist.open(p).spine("a")
    assert s.columns["sumsq"][0] == 0.0 and s.rms[0] == 5e-324 and s.mean[0] == 5e-324


# -- 3. exponents at the ends of the i32 (reproducer r3) --------------------------------------------------------
def test_exponents_at_the_ends_of_the_i32_are_read_with_bounded_memory(tmp_path):
    """Spec 5.3 and 13: 9 bytes of sum_x whose value is 2**(2**31 - 1) or -2**(-2**31) used to cost a 2**31-bit integer
    (256 MiB) in each of verify, mean, dump and merge."""
    sums = [Dyadic(1, I32_MAX), Dyadic(-1, I32_MIN), Dyadic(3, I32_MAX - 1), Dyadic(-((1 << 8190) + 1), I32_MIN)]
    p = one(tmp_path, "r3.thist", *sums, sumsq=Dyadic(1, I32_MIN))
    warm(tmp_path)
    h = trainhist.open(p)
    for name, fn in {"verify": h.verify, "mean": lambda: h.spine("a").mean, "rms": lambda: h.spine("a").rms,
                     "exact": lambda: h.spine("a").exact, "dump": lambda: dumps(h)}.items():
        _, pk = peak(fn)
        assert pk < 2 * 1024 * KIB, (name, pk)
    s = h.spine("a")
    assert [bits(v) for v in s.columns["sum"]] == [bits(v) for v in (math.inf, -0.0, math.inf, -0.0)]
    assert s.mean.tolist()[0] == math.inf and bits(s.mean[1]) == bits(-0.0) and s.rms.tolist()[0] == 0.0
    assert [s.sum_exact(i) for i in range(4)] == sums
    out = tmp_path / "m.thist"
    _, pk = peak(lambda: trainhist.merge([p], out, workers=1))
    assert pk < 16 * 1024 * KIB
    assert trainhist.open(out).spine("a").exact["sum"] == sums


# -- 4. the width bound (reproducer r6) -------------------------------------------------------------------------
def _plain_sum(values: list[Dyadic]) -> Dyadic:
    return sum(values, Dyadic(0, 0))


dyadics = st.builds(Dyadic.make, st.integers(-(1 << 100), 1 << 100), st.integers(-300, 300))


@settings(**SETTINGS)
@given(st.lists(st.one_of(dyadics, dyadics.map(lambda d: Dyadic(-d.m, d.e))), max_size=12),
       st.sampled_from([1, 8, 64, 200, 700]))
def test_sum_within_is_the_sum_or_none_when_it_is_wider_than_the_bound(values, width):
    want = _plain_sum(values)
    got = sum_within(values, width)
    assert got == (want if abs(want.m).bit_length() <= width else None)


@settings(**SETTINGS)
@given(st.lists(st.builds(Dyadic.make, st.integers(-(1 << 8190), 1 << 8190), st.integers(-20000, 20000)), min_size=1,
                max_size=6), st.data())
def test_sum_within_at_the_bound_of_spec_5_3(values, data):
    """Values up to the widest mantissa, exponents 40,000 apart at most; some cancel exactly."""
    values = values + [Dyadic(-v.m, v.e) for v in data.draw(st.lists(st.sampled_from(values), max_size=3))]
    want = _plain_sum(values)
    assert sum_within(values) == (want if abs(want.m).bit_length() <= MANT_BITS else None)


@pytest.mark.parametrize("values, want", [
    ([Dyadic(1, 2**30), Dyadic(1, -(2**30))], None),
    ([Dyadic(1, 2**30), Dyadic(1, 0), Dyadic(-1, 2**30)], Dyadic(1, 0)),
    ([Dyadic(1, I32_MAX), Dyadic(1, I32_MIN), Dyadic(-1, I32_MIN)], Dyadic(1, I32_MAX)),
    ([Dyadic(1, 2**30), Dyadic(-1, 2**30 - 1), Dyadic(-1, 2**30 - 1), Dyadic(5, -(2**30))], Dyadic(5, -(2**30))),
    ([Dyadic(1, 8190), Dyadic(1, 0)], Dyadic((1 << 8190) + 1, 0)),
    ([Dyadic(1, 8191), Dyadic(1, 0)], None),
    ([Dyadic(1, 8191), Dyadic(-1, 0)], Dyadic((1 << 8191) - 1, 0)),  # 8,191 bits: the borrow keeps it in bound
    ([Dyadic(1, 8192), Dyadic(-1, 0)], None),
])
def test_sum_within_far_apart_builds_nothing_wide(values, want):
    got, pk = peak(lambda: sum_within(values))
    assert got == want and pk < 64 * KIB


def test_the_writer_refuses_a_sum_wider_than_the_bound(tmp_path):
    one(tmp_path, "widest.thist", Dyadic((1 << 8190) + 1, 0), Dyadic(-((1 << 8191) - 1), -9000))
    for d in (Dyadic((1 << 8191) + 1, 0), Dyadic(-((1 << 8191) + 1), 5)):
        with pytest.raises(UsageError) as ei:
            one(tmp_path, "wide.thist", d)
        assert ei.value.code == "bad_summary" and "2**8191" in str(ei.value)


def _surfaces(p: Path, tmp_path: Path) -> dict[str, str]:
    """The code each reader surface refuses ``p`` with, or "ok"."""
    out = {}
    for name, fn in {"verify": lambda: trainhist.open(p).verify(), "dump": lambda: dumps(trainhist.open(p)),
                     "exact": lambda: trainhist.open(p).spine(trainhist.open(p).sites[0].path).exact,
                     "merge": lambda: trainhist.merge([p], tmp_path / "m.thist", workers=1),
                     "coarsen": lambda: trainhist.coarsen(p, tmp_path / "c.thist", steps=2, workers=1)}.items():
        try:
            fn()
            out[name] = "ok"
        except TrainhistError as e:
            assert name in ("merge", "coarsen") or e.offset == records(p.read_bytes(), RecordType.OBS)[0]
            out[name] = e.code
    return out


@pytest.mark.parametrize("case", ["exact_too_wide", "exact_tiny_zero_sign"])
def test_exact_forms_beyond_the_bound_or_with_the_wrong_zero_are_refused_everywhere(tmp_path, case):
    """Spec 5.3: an entry of sum_x longer than 1028 bytes (|m| >= 2**8191), and a non-zero value too small for
    binary64 stored with the zero of the other sign (2**-1100 with -0.0: a comparison by value took it)."""
    p = tmp_path / f"{case}.thist"
    p.write_bytes((VECTORS / "invalid" / case / "input.thist").read_bytes())
    assert set(_surfaces(p, tmp_path).values()) == {"bad_exact_value"}


def test_merge_and_coarsen_refuse_a_sum_too_wide_before_building_it(tmp_path):
    """Reproducer r6: sums 2**K and 2**-K (9 bytes each) add to a mantissa of 2K + 1 bits: with K = 2**30, a
    2**31-bit integer (1.2 GiB of memory) and a record the reader refuses. The exponent fits the i32; the width does
    not (spec 5.3, 11.2): sum_overflow, with no allocation of the size of the sum."""
    k = 2**24  # (a 4 MiB sum: what the code before the bound built; the work now does not depend on K)
    r0 = one(tmp_path, "r0.thist", Dyadic(1, k), rank=0, world=2)
    r1 = one(tmp_path, "r1.thist", Dyadic(1, -k), rank=1, world=2)
    both = one(tmp_path, "both.thist", Dyadic(1, k), Dyadic(1, -k))
    warm(tmp_path)
    for what, fn in (("merge", lambda: trainhist.merge([r0, r1], tmp_path / "m.thist", workers=1)),
                     ("coarsen", lambda: trainhist.coarsen(both, tmp_path / "c.thist", steps=2, workers=1))):
        def run():
            with pytest.raises(TrainhistError) as ei:
                fn()
            return ei.value

        err, pk = peak(run)
        assert err.code == "sum_overflow" and "8191 bits" in str(err), what
        assert pk < 4 * 1024 * KIB, (what, pk)
    assert not (tmp_path / "m.thist").exists() and not (tmp_path / "c.thist").exists()


def test_far_apart_sums_that_cancel_are_added_and_unknown_sums_hide_a_wide_one(tmp_path):
    """Spec 11.2: the width is decided on the combined row (2**K + 1 - 2**K = 1 is stored), and a combined row whose
    method is unknown stores zero sums, so its known inputs' width is no refusal."""
    k = 2**24
    ranks = [one(tmp_path, f"c{i}.thist", d, rank=i, world=3) for i, d in
             enumerate((Dyadic(1, k), Dyadic(1, 0), Dyadic(-1, k)))]
    out = tmp_path / "m.thist"
    warm(tmp_path)
    _, pk = peak(lambda: trainhist.merge(ranks, out, workers=1))
    assert pk < 8 * 1024 * KIB
    s = trainhist.open(out).spine("a")
    assert s.sum_exact(0) == Dyadic(1, 0) and s.exact["sum"] == [None]
    ranks[1] = one(tmp_path, "u.thist", Dyadic(0, 0), rank=1, world=3, method=SumMethod.UNKNOWN)
    ranks[2] = one(tmp_path, "f.thist", Dyadic(1, -k), rank=2, world=3)
    trainhist.merge(ranks, out, workers=1)
    s = trainhist.open(out).spine("a")
    assert not s.sums_known[0] and s.columns["method"][0] == SumMethod.UNKNOWN


def test_group_sums_mark_a_wide_sum_without_building_it():
    vals = [Dyadic((1 << 300) + 1, 2**30), Dyadic(1, -(2**30)), Dyadic(3, 0), Dyadic((1 << 300) + 1, -5)]
    f = np.array([v.to_float() for v in vals])
    blobs = [v.to_bytes() for v in vals]
    x = xv.decode_exact("sum", f, np.array([len(b) for b in blobs], np.uint32),
                        np.frombuffer(b"".join(blobs), np.uint8), np.ones(4, bool), lambda i: ("f", 0, i))
    xv.group_sum(f[2:], x.take(np.array([2, 3])), np.array([0]), np.array([2]))  # (compiled kernels loaded)
    (out_f, out), pk = peak(lambda: xv.group_sum(f, x, np.array([0, 2]), np.array([2, 2])))
    assert pk < 256 * KIB
    assert out.out_of_range().tolist() == [True, False] and "8191 bits" in out.why_out_of_range(0, "sum")
    assert out.get(1) == Dyadic.make(3 * 32 + (1 << 300) + 1, -5) and out_f[1] == out.get(1).to_float()
    assert out.take(np.array([1, 0])).out_of_range().tolist() == [False, True]
    assert xv.ExactCol.concat([out, out]).out_of_range().tolist() == [True, False, True, False]
    out.blank(np.array([True, False]))
    assert not out.out_of_range().any()


def test_a_stored_entry_is_refused_by_its_length_before_it_is_decoded():
    m = (1 << 8191) + 1
    for d in (Dyadic(m, 0), Dyadic(-m, -9000), Dyadic((1 << 8190) + 1, 0)):
        f = np.array([d.to_float()])
        b = d.to_bytes()
        args = ("sum", f, np.array([len(b)], np.uint32), np.frombuffer(b, np.uint8), np.ones(1, bool),
                lambda i: ("f", 0, i))
        if len(b) <= EXACT_BYTES:
            assert xv.decode_exact(*args).get(0) == d
        else:
            with pytest.raises(CorruptError) as ei:
                xv.decode_exact(*args)
            assert ei.value.code == "bad_exact_value" and "1028" in str(ei.value)


# -- 5. the zero a tiny value rounds to -------------------------------------------------------------------------
@pytest.mark.parametrize("d", [Dyadic(1, -1100), Dyadic(-1, -1100), Dyadic((1 << 300) + 1, -1600),
                               Dyadic(-((1 << 300) + 1), -1600), Dyadic(0, 0)])
def test_a_tiny_value_needs_the_zero_of_its_sign(d):
    """Spec 5.3: a non-zero value too small for binary64 rounds to the zero of its sign, compared bit for bit (the
    narrow and the wide decoder both compared by value, -0.0 == +0.0); the exact zero takes either zero."""
    b = d.to_bytes()
    for z in (0.0, -0.0):
        args = ("sum", np.array([z]), np.array([len(b)], np.uint32), np.frombuffer(b, np.uint8), np.ones(1, bool),
                lambda i: ("f", 0, i))
        if d.m == 0 or math.copysign(1.0, z) == (1.0 if d.m > 0 else -1.0):
            assert xv.decode_exact(*args).get(0) == d
        else:
            with pytest.raises(CorruptError) as ei:
                xv.decode_exact(*args)
            assert ei.value.code == "bad_exact_value"


def test_the_reader_compares_the_zero_of_a_tiny_sum_bit_for_bit(tmp_path):
    p = one(tmp_path, "tiny.thist", Dyadic(1, -1100), Dyadic(-1, -1100))
    data = bytearray(p.read_bytes())
    pos, payload, cols = obs_payload(bytes(data), 0)
    _, dt, codec, off, _, _ = cols["sum"]
    assert dt == "f8" and codec == 0 and struct.unpack_from("<2d", payload, off) == (0.0, -0.0)
    assert trainhist.open(p).verify()["rows"] == 2
    struct.pack_into("<d", payload, off, -0.0)  # row 0: 2**-1100 with -0.0
    rewrite(data, pos, bytes(payload))
    p.write_bytes(bytes(data))
    h = trainhist.open(p)
    for fn in (h.verify, lambda: h.spine("a").sum_exact(0)):
        with pytest.raises(CorruptError) as ei:
            fn()
        assert ei.value.code == "bad_exact_value" and ei.value.offset == pos
