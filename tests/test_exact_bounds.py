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
from history_helpers import obs_payload, rewrite
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainhist
from trainhist import exactvec as xv
from trainhist.dump import dumps
from trainhist.dyadic import Dyadic, float_of, quotient_float
from trainhist.errors import CorruptError
from trainhist.summary import Summary, SumMethod

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=300)
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
    hi = (Fraction(r) + Fraction(math.nextafter(r, math.inf))) / 2
    even = bits(r) & 1 == 0
    return (lo**2 < x < hi**2) or (even and x in (lo**2, hi**2)) or (r == 0 and x <= hi**2)


@settings(**SETTINGS)
@given(mant.filter(bool), st.integers(-2400, 2400), st.one_of(st.integers(1, 10), st.integers(1, 2**64 - 1)))
def test_quotient_float_is_correctly_rounded(m, e, n):
    x = Fraction(m) * Fraction(2) ** e / n
    assert bits(quotient_float(m, e, n)) == bits(_round_ref(x))
    r = quotient_float(abs(m), e, n, root=True)
    assert _is_rounded_root(r, abs(x)), (m, e, n, r)


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
