"""Bin assignment (spec section 6) against exact rational classification, and exact sums against Fractions.

``grid.bin_keys`` classifies from the float's bits with integer mantissa thresholds; ``grid.bin_index_exact``
classifies with ``fractions.Fraction``. Every test here compares the two on values chosen where a wrong
threshold, an off-by-one exponent or a sign slip would show: just below / at / just above every bin edge of the
window at scale 2, for float32 and float64, both signs, plus zeros, subnormals, the window edges, infinities,
NaN payloads, every float16 and every bfloat16 bit pattern.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trainhist import grid
from trainhist.dyadic import Dyadic, exact_sums
from trainhist.errors import UsageError
from trainhist.summary import summarize

SIDE = grid.KEY_OVER + 1
LO, HI = grid.WINDOW_LOG2_LO, grid.WINDOW_LOG2_HI
IMIN, IMAX = grid.index_min(grid.NATIVE_SCALE), grid.index_max(grid.NATIVE_SCALE)

# (numpy float dtype, unsigned view dtype, fraction bits, exponent bias, thresholds)
WIDTHS = {
    "f32": (np.float32, np.uint32, 23, 127, grid.THRESH_F32),
    "f64": (np.float64, np.uint64, 52, 1023, grid.THRESH_F64),
}


# -- reference ------------------------------------------------------------------------------------------------
def exact_key(value: float) -> int:
    """Key of ``value`` in the layout of ``grid.bin_keys``, from the rational classifier only."""
    c = grid.bin_index_exact(value)
    neg = math.copysign(1.0, value) < 0
    if c == "zero":
        return grid.KEY_ZERO
    if c == "nan":
        return grid.KEY_NAN
    if c == "pinf":
        return grid.KEY_PINF
    if c == "ninf":
        return grid.KEY_NINF
    if c == "under":
        k = grid.KEY_UNDER
    elif c == "over":
        k = grid.KEY_OVER
    else:
        assert isinstance(c, int) and IMIN <= c <= IMAX, c
        k = c - IMIN + 1
    return k + SIDE * neg


def from_parts(width: str, neg: int, exp_field: int, frac: int) -> np.ndarray:
    """A one-element array with exactly the given sign bit, biased exponent field and fraction bits."""
    ft, ut, fbits, _, _ = WIDTHS[width]
    nbits = 32 if width == "f32" else 64
    bits = (neg << (nbits - 1)) | (exp_field << fbits) | frac
    return np.array([bits], ut).view(ft)


def assert_keys_match(x: np.ndarray, what: str) -> None:
    """bin_keys of every element of ``x`` equals the exact classification, with a readable failure."""
    keys = grid.bin_keys(x)
    want = np.array([exact_key(float(v)) for v in x.tolist()], np.int64)
    bad = np.flatnonzero(keys != want)
    if bad.size:
        i = int(bad[0])
        ut = np.uint32 if x.dtype == np.float32 else np.uint64
        raise AssertionError(
            f"{what}: {bad.size} of {x.size} values misclassified; first: {float(x[i])!r} "
            f"(bits 0x{int(x.view(ut)[i]):x}) -> key {int(keys[i])}, exact {int(want[i])}"
        )


# -- the reference itself ---------------------------------------------------------------------------------------
def test_exact_classifier_hand_checked_values() -> None:
    # bin i holds (2**(i/4), 2**((i+1)/4)]: upper-inclusive, so a power of two closes the bin below it
    assert grid.bin_index_exact(1.0) == -1
    assert grid.bin_index_exact(math.nextafter(1.0, 2.0)) == 0
    assert grid.bin_index_exact(2.0) == 3
    assert grid.bin_index_exact(1.5) == 2  # 2**(2/4) = 1.414.. < 1.5 <= 2**(3/4) = 1.68..
    r2 = math.sqrt(2)  # the float nearest sqrt(2) is above the irrational edge; its predecessor is below
    assert Fraction(r2) ** 2 > 2 > Fraction(math.nextafter(r2, 0.0)) ** 2
    assert grid.bin_index_exact(r2) == 2
    assert grid.bin_index_exact(math.nextafter(r2, 0.0)) == 1
    assert grid.bin_index_exact(2.0**-48) == "under"
    assert grid.bin_index_exact(math.nextafter(2.0**-48, 1.0)) == IMIN
    assert grid.bin_index_exact(2.0**16) == IMAX
    assert grid.bin_index_exact(math.nextafter(2.0**16, math.inf)) == "over"
    assert grid.bin_index_exact(-3.0) == grid.bin_index_exact(3.0)
    assert grid.bin_index_exact(-0.0) == "zero"
    assert (IMIN, IMAX, grid.nbins(2)) == (-192, 63, 256)


@pytest.mark.parametrize("width", ["f32", "f64"])
def test_thresholds_are_floor_of_irrational_edges(width: str) -> None:
    """T_k is the largest fraction f with (1 + f/2**F)**4 < 2**k, checked in integers."""
    _, _, fbits, _, thresh = WIDTHS[width]
    one = 1 << fbits
    for k, t in zip((1, 2, 3), thresh):
        assert (one + t) ** 4 < 1 << (k + 4 * fbits) < (one + t + 1) ** 4


# -- every bin edge of the window ----------------------------------------------------------------------------------
def edge_values(width: str) -> np.ndarray:
    """Floats just below, at and just above every bin edge 2**(k/4), -192 <= k <= 64, both signs.

    For k % 4 == 0 the edge is the power of two 2**(k/4) (exactly representable): its two neighbours and itself.
    Otherwise the edge is irrational and lies between fraction T and T+1 at exponent floor(k/4): fractions T-1,
    T and T+1 at every exponent of the window (the integer threshold minus one, at, plus one).
    """
    ft, _, fbits, bias, thresh = WIDTHS[width]
    vals = []
    for neg in (0, 1):
        for e in range(LO - 1, HI + 2):  # one octave beyond each window edge too
            p = from_parts(width, neg, e + bias, 0)
            vals += [np.nextafter(p, ft(0)), p, np.nextafter(p, -ft(0) if neg else ft(np.inf))]
            vals += [np.nextafter(p, ft(-np.inf) if neg else ft(np.inf))]
            for t in thresh:
                for f in (t - 1, t, t + 1):
                    vals.append(from_parts(width, neg, e + bias, f))
    out = np.concatenate(vals).astype(ft)
    return out


@pytest.mark.parametrize("width", ["f32", "f64"])
def test_every_bin_edge(width: str) -> None:
    x = edge_values(width)
    assert x.size > 2 * 64 * 12
    assert_keys_match(x, f"{width} bin edges")
    # and the thresholds are where the index changes: T -> bin below the edge, T+1 -> the bin above
    ft, _, _, bias, thresh = WIDTHS[width]
    for e in (LO, -1, 0, 7, HI - 1):
        for j, t in enumerate(thresh, start=1):
            below = grid.bin_keys(from_parts(width, 0, e + bias, t))[0]
            above = grid.bin_keys(from_parts(width, 0, e + bias, t + 1))[0]
            assert (below - 1 + IMIN, above - 1 + IMIN) == (4 * e + j - 1, 4 * e + j)


@pytest.mark.parametrize("width", ["f32", "f64"])
def test_all_powers_of_two_and_their_neighbours(width: str) -> None:
    ft, _, fbits, bias, _ = WIDTHS[width]
    emax = 2 * bias  # largest biased exponent of a finite value
    p = np.concatenate([from_parts(width, s, e, 0) for s in (0, 1) for e in range(1, emax + 1)])
    x = np.concatenate([p, np.nextafter(p, ft(0)), np.nextafter(p, np.copysign(ft(np.inf), p))])
    x = x[np.isfinite(x)]
    assert_keys_match(x, f"{width} powers of two")
    # the power of two 2**e (upper-inclusive edge) is in the bin below the one of its successor
    for e in range(LO + 1, HI + 1):
        k_at = grid.bin_keys(np.array([2.0**e], ft))[0]
        k_up = grid.bin_keys(np.nextafter(np.array([2.0**e], ft), ft(np.inf)))[0]
        assert k_at == 4 * e - 1 - IMIN + 1
        assert k_up == k_at + 1 or (e == HI and k_up == grid.KEY_OVER)


@pytest.mark.parametrize("width", ["f32", "f64"])
def test_window_edges_upper_inclusive(width: str) -> None:
    ft = WIDTHS[width][0]
    for sign in (1, -1):
        side = SIDE if sign < 0 else 0
        lo = np.array([sign * 2.0**LO], ft)
        hi = np.array([sign * 2.0**HI], ft)
        out = ft(sign * np.inf)
        assert grid.bin_keys(lo)[0] == grid.KEY_UNDER + side  # exactly 2**-48 is underflow
        assert grid.bin_keys(np.nextafter(lo, out))[0] == 1 + side  # the next float is the first bin
        assert grid.bin_keys(np.nextafter(lo, ft(0)))[0] == grid.KEY_UNDER + side
        assert grid.bin_keys(hi)[0] == grid.KEY_OVER - 1 + side  # exactly 2**16 is the last bin
        assert grid.bin_keys(np.nextafter(hi, ft(0)))[0] == grid.KEY_OVER - 1 + side
        assert grid.bin_keys(np.nextafter(hi, out))[0] == grid.KEY_OVER + side  # the next float overflows
        big = np.array([sign * np.finfo(ft).max], ft)
        assert grid.bin_keys(big)[0] == grid.KEY_OVER + side


@pytest.mark.parametrize("width", ["f32", "f64"])
def test_zeros_and_infinities(width: str) -> None:
    ft = WIDTHS[width][0]
    x = np.array([0.0, -0.0, np.inf, -np.inf], ft)
    assert np.signbit(x[1])
    assert grid.bin_keys(x).tolist() == [grid.KEY_ZERO, grid.KEY_ZERO, grid.KEY_PINF, grid.KEY_NINF]
    assert_keys_match(x, f"{width} zeros and infinities")
    s = summarize(x)
    assert (s.count, s.zero, s.pinf, s.ninf, s.nan, s.finite) == (4, 2, 1, 1, 0, 2)
    assert s.sketch is not None and s.sketch.total() == 0  # zeros and infinities are not in the grid


@pytest.mark.parametrize("width", ["f32", "f64"])
def test_subnormals_underflow(width: str) -> None:
    ft, ut, fbits, _, _ = WIDTHS[width]
    rng = np.random.default_rng(1)
    fr = rng.integers(1, 1 << fbits, 2000, dtype=np.uint64)
    fr = np.concatenate([fr, [1, 2, 3, (1 << fbits) - 1, 1 << (fbits - 1)]]).astype(np.uint64)
    vals = [from_parts(width, s, 0, int(f)) for s in (0, 1) for f in fr.tolist()]
    x = np.concatenate(vals)
    assert (np.abs(x) < np.finfo(ft).tiny).all() and (x != 0).all()
    assert_keys_match(x, f"{width} subnormals")
    keys = grid.bin_keys(x)
    assert set(keys.tolist()) == {grid.KEY_UNDER, grid.KEY_UNDER + SIDE}
    sk = summarize(x).sketch
    assert sk is not None
    assert (sk.under_pos, sk.under_neg, int(sk.pos.sum()), int(sk.neg.sum())) == (fr.size, fr.size, 0, 0)


NAN_BITS = {
    "f32": [0x7FC00000, 0x7FC00001, 0x7FFFFFFF, 0x7F800001, 0x7FBFFFFF, 0x7FA00000,
            0xFFC00000, 0xFFC00001, 0xFFFFFFFF, 0xFF800001, 0xFFBFFFFF],
    "f64": [0x7FF8000000000000, 0x7FF8000000000001, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000001,
            0x7FF7FFFFFFFFFFFF, 0xFFF8000000000000, 0xFFFFFFFFFFFFFFFF, 0xFFF0000000000001,
            0xFFF7FFFFFFFFFFFF, 0x7FF4000000000000],
}


@pytest.mark.parametrize("width", ["f32", "f64"])
def test_nan_payloads(width: str) -> None:
    """Quiet and signalling NaNs of both signs, any payload: all NaN, none in min/max/sums/sketch."""
    ft, ut, _, _, _ = WIDTHS[width]
    nans = np.array(NAN_BITS[width], ut).view(ft)
    assert np.isnan(nans).all()
    assert (grid.bin_keys(nans) == grid.KEY_NAN).all()
    assert_keys_match(nans, f"{width} NaN payloads")
    x = np.concatenate([nans, np.array([-2.5, 3.0], ft)])
    s = summarize(x)
    assert (s.count, s.nan, s.finite, s.min, s.max) == (x.size, nans.size, 2, -2.5, 3.0)
    assert s.sum == Dyadic.from_float(0.5) and s.sumsq == Dyadic.from_float(15.25)
    assert s.sketch is not None and s.sketch.total() == 2


def test_every_float16_bit_pattern() -> None:
    """All 65536 float16 values (NaN payloads, infinities, subnormals): widened, then classified exactly."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    x = grid.as_float_bits(h)
    assert x.dtype == np.float32
    # widening is exact (or NaN to NaN), sign bit kept
    fin = np.isfinite(h)
    assert np.array_equal(x[fin].astype(np.float64), h[fin].astype(np.float64))
    assert np.array_equal(np.isnan(x), np.isnan(h)) and np.array_equal(np.signbit(x), np.signbit(h))
    keys = grid.bin_keys(x)
    want = np.array([exact_key(float(v)) for v in h.tolist()], np.int64)
    assert np.array_equal(keys, want), np.flatnonzero(keys != want)[:10]
    # and through summarize: the counts are exactly those of the exact classification
    s = summarize(h)
    counts = np.bincount(want, minlength=grid.NKEYS)
    assert s.sketch is not None
    assert np.array_equal(s.sketch.pos, counts[1 : grid.KEY_OVER])
    assert np.array_equal(s.sketch.neg, counts[SIDE + 1 : SIDE + grid.KEY_OVER])
    assert (s.sketch.under_pos, s.sketch.over_pos, s.sketch.under_neg, s.sketch.over_neg) == (
        counts[grid.KEY_UNDER], counts[grid.KEY_OVER], counts[SIDE], counts[SIDE + grid.KEY_OVER])
    assert (s.sketch.under_pos, s.sketch.over_pos) == (0, 0)  # float16 fits inside the window
    assert (s.count, s.nan, s.pinf, s.ninf, s.zero) == (65536, 2046, 1, 1, 2)
    assert s.min == -65504.0 and s.max == 65504.0


def test_every_bfloat16_bit_pattern() -> None:
    """All 65536 bfloat16 patterns given as uint16 (dtype="bfloat16"): same result as the exact widening."""
    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = (u.astype(np.uint32) << 16).view(np.float32)
    x = grid.as_float_bits(u, "bfloat16")
    assert np.array_equal(x.view(np.uint32), wide.view(np.uint32))
    keys = grid.bin_keys(x)
    want = np.array([exact_key(float(v)) for v in wide.tolist()], np.int64)
    assert np.array_equal(keys, want), np.flatnonzero(keys != want)[:10]
    s = summarize(u, dtype="bfloat16")
    counts = np.bincount(want, minlength=grid.NKEYS)
    assert s.sketch is not None
    assert np.array_equal(s.sketch.pos, counts[1 : grid.KEY_OVER])
    assert np.array_equal(s.sketch.neg, counts[SIDE + 1 : SIDE + grid.KEY_OVER])
    assert (s.sketch.under_pos, s.sketch.under_neg, s.sketch.over_pos, s.sketch.over_neg) == (
        counts[grid.KEY_UNDER], counts[SIDE], counts[grid.KEY_OVER], counts[SIDE + grid.KEY_OVER])
    assert s.sketch.under_pos > 0 and s.sketch.over_pos > 0  # bfloat16 reaches far outside the window
    assert (s.count, s.nan, s.pinf, s.ninf, s.zero) == (65536, 2 * 127, 1, 1, 2)
    fin = wide[np.isfinite(wide)].astype(np.float64)
    assert s.sum == sum_fraction_dyadic(fin) and s.sumsq == sum_fraction_dyadic(fin, squares=True)
    with pytest.raises(UsageError):  # (a typed error with a code: bad_values)
        summarize(u.astype(np.int32), dtype="bfloat16")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_bit_patterns_f32_f64(data: st.DataObject) -> None:
    """Random bit patterns, biased towards the window and the thresholds, for both widths."""
    width = data.draw(st.sampled_from(["f32", "f64"]))
    ft, ut, fbits, bias, thresh = WIDTHS[width]
    exps = st.one_of(st.integers(0, 2 * bias + 1), st.integers(LO - 2 + bias, HI + 2 + bias))
    fracs = st.one_of(
        st.integers(0, (1 << fbits) - 1),
        st.sampled_from(thresh).flatmap(lambda t: st.integers(t - 2, t + 2)),
    )
    parts = data.draw(st.lists(st.tuples(st.integers(0, 1), exps, fracs), min_size=1, max_size=40))
    x = np.concatenate([from_parts(width, s, e, f) for s, e, f in parts])
    assert_keys_match(x, f"{width} random patterns")


# -- summarize: min/max in total order, counts ---------------------------------------------------------------
def test_min_max_total_order_of_zeros() -> None:
    for ft in (np.float32, np.float64, np.float16):
        cases = [  # a list, not a dict: (0.0,) and (-0.0,) are equal keys
            ((0.0,), (0.0, False, 0.0, False)),
            ((-0.0,), (0.0, True, 0.0, True)),
            ((0.0, -0.0), (0.0, True, 0.0, False)),
            ((-0.0, 0.0, -0.0), (0.0, True, 0.0, False)),
            ((-0.0, 1.0), (0.0, True, 1.0, False)),
            ((-1.0, 0.0), (-1.0, True, 0.0, False)),
            ((-1.0, -0.0), (-1.0, True, 0.0, True)),
            ((0.0, -0.0, np.nan, -np.inf), (0.0, True, 0.0, False)),
        ]
        for vals, (mn, mn_neg, mx, mx_neg) in cases:
            s = summarize(np.array(vals, ft))
            assert s.min == mn and bool(np.signbit(s.min)) == mn_neg, (ft, vals, s.min)
            assert s.max == mx and bool(np.signbit(s.max)) == mx_neg, (ft, vals, s.max)
    s = summarize(np.array([np.nan, np.inf], np.float32))
    assert math.isnan(s.min) and math.isnan(s.max) and s.finite == 0 and s.sum == Dyadic(0, 0)


def total_order_key(v: float) -> tuple:
    return (v, math.copysign(1.0, v))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_summarize_counts_and_extremes(data: st.DataObject) -> None:
    width = data.draw(st.sampled_from([16, 32, 64]))
    ft = {16: np.float16, 32: np.float32, 64: np.float64}[width]
    x = data.draw(hnp.arrays(ft, st.integers(0, 60), elements=st.floats(width=width)))
    s = summarize(x)
    xf = x.astype(np.float64)
    fin = xf[np.isfinite(xf)]
    assert s.count == x.size
    assert s.nan == int(np.isnan(xf).sum())
    assert s.pinf == int((xf == np.inf).sum()) and s.ninf == int((xf == -np.inf).sum())
    assert s.zero == int((xf == 0).sum())
    assert s.finite == fin.size
    assert s.sketch is not None and s.sketch.total() == fin.size - s.zero
    if fin.size:
        vals = fin.tolist()
        mn, mx = min(vals, key=total_order_key), max(vals, key=total_order_key)
        assert total_order_key(s.min) == total_order_key(mn)
        assert total_order_key(s.max) == total_order_key(mx)
        assert s.sum == sum_fraction_dyadic(fin) and s.sumsq == sum_fraction_dyadic(fin, squares=True)
    else:
        assert math.isnan(s.min) and math.isnan(s.max)
    # per-element keys agree with the exact classifier for these too
    if x.size:
        assert_keys_match(grid.as_float_bits(x), f"float{width} summarize input")


# -- exact sums ----------------------------------------------------------------------------------------------
def to_fraction(d: Dyadic) -> Fraction:
    return Fraction(d.m) * Fraction(2) ** d.e


def sum_fraction_dyadic(x: np.ndarray, squares: bool = False) -> Dyadic:
    """The exact sum (or sum of squares) of x computed with Fractions, as a canonical Dyadic."""
    total = sum((Fraction(v) ** 2 if squares else Fraction(v) for v in x.tolist()), Fraction(0))
    if total == 0:
        return Dyadic(0, 0)
    d = total.denominator
    assert d & (d - 1) == 0
    return Dyadic.make(total.numerator, -(d.bit_length() - 1))


def check_exact(x: np.ndarray) -> None:
    s, q = exact_sums(x)
    assert s == Dyadic.make(s.m, s.e) and q == Dyadic.make(q.m, q.e)  # canonical
    xs = x.astype(np.float64).tolist()
    assert to_fraction(s) == sum((Fraction(v) for v in xs), Fraction(0))
    assert to_fraction(q) == sum((Fraction(v) ** 2 for v in xs), Fraction(0))


def float_strategy(width: int) -> st.SearchStrategy[float]:
    tiny = np.finfo(np.float32 if width == 32 else np.float64).smallest_subnormal
    big = float(np.finfo(np.float32 if width == 32 else np.float64).max)
    return st.one_of(
        st.floats(width=width, allow_nan=False, allow_infinity=False),
        st.floats(width=width, allow_nan=False, allow_infinity=False, allow_subnormal=True,
                  min_value=-float(tiny) * 2**30, max_value=float(tiny) * 2**30),  # subnormal range
        st.sampled_from([float(tiny), -float(tiny), big, -big, 1.0, -1.0, 0.0, -0.0]),
    )


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_exact_sums_match_fractions(data: st.DataObject) -> None:
    width = data.draw(st.sampled_from([32, 64]))
    ft = np.float32 if width == 32 else np.float64
    vals = data.draw(st.lists(float_strategy(width), min_size=0, max_size=50))
    if data.draw(st.booleans()):  # cancellation: append the negatives of a random subset
        vals = vals + [-v for v in vals if data.draw(st.booleans())]
        vals = data.draw(st.permutations(vals))
    check_exact(np.array(vals, ft))


@pytest.mark.parametrize("ft", [np.float32, np.float64])
def test_exact_sums_edge_mixes(ft: type) -> None:
    fi = np.finfo(ft)
    big, tiny, eps = fi.max, fi.smallest_subnormal, fi.eps
    cases = [
        [big, tiny, -big],  # huge cancellation leaves the subnormal
        [big, big, big, -big],  # exceeds the float range in the middle and comes back
        [1.0, eps / 4, -1.0],  # below the rounding unit
        [tiny] * 17 + [-tiny] * 5,
        [fi.tiny, -tiny, tiny],
        [big, -big / 2, -big / 2],
        [3.0, -(2.0**-30), 2.0**-60 if ft is np.float64 else 2.0**-40],
        [-0.0, 0.0, -0.0],
        list(np.nextafter(ft(1), ft(2)) * np.arange(1, 40, dtype=ft)),
    ]
    for c in cases:
        check_exact(np.array(c, ft))


@pytest.mark.parametrize("ft", [np.float32, np.float64])
def test_exact_sums_full_block_of_largest_mantissas(ft: type) -> None:
    """The limb plan's worst case: one block (and one more element) of the largest mantissa in one exponent slot.

    Every float64 partial sum inside np.bincount must stay an integer below 2**53; the expected value is
    computed in closed form.
    """
    from trainhist import dyadic

    block = dyadic._PLAN[np.dtype(ft)][2]
    for v in (np.nextafter(ft(2), ft(0)) * ft(2.0**100), -np.finfo(ft).max, np.nextafter(ft(np.finfo(ft).tiny), ft(0))):
        x = np.full(block + 1, v, ft)
        x[-1] = -v / ft(2)  # a second block with a different sign and slot
        s, q = exact_sums(x)
        f, g = Fraction(float(v)), Fraction(float(x[-1]))  # (-v/2 rounds for an odd subnormal mantissa)
        assert to_fraction(s) == block * f + g
        assert to_fraction(q) == block * f * f + g * g


def test_exact_sums_many_blocks_smaller_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block-by-block accumulation is exact across block boundaries (a small block size forces many blocks)."""
    from trainhist import dyadic

    rng = np.random.default_rng(7)
    x64 = rng.standard_normal(1000) * np.exp2(rng.integers(-1070, 1000, 1000))
    x32 = (rng.standard_normal(1000) * np.exp2(rng.integers(-140, 120, 1000))).astype(np.float32)
    for x in (x64, x32.astype(np.float32)):
        x = x[np.isfinite(x)]
        full = exact_sums(x)
        plan = dict(dyadic._PLAN)
        lb, nl, _ = plan[x.dtype]
        monkeypatch.setitem(dyadic._PLAN, x.dtype, (lb, nl, 7))
        assert exact_sums(x) == full
        monkeypatch.setitem(dyadic._PLAN, x.dtype, plan[x.dtype])
        check_exact(x)


def test_dyadic_encoding_and_rounding() -> None:
    for v in (0.0, 1.0, -3.5, 2.0**-1074, -(2.0**1023) * 1.5, 0.1):
        d = Dyadic.from_float(v)
        assert d.to_float() == v and d.is_float()
        assert Dyadic.from_bytes(d.to_bytes()) == d
    d = Dyadic.make(1, 0) + Dyadic.make(1, -60)  # 1 + 2**-60: not a float64
    assert not d.is_float() and d.to_float() == 1.0 and Dyadic.from_bytes(d.to_bytes()) == d
    assert Dyadic.make((1 << 53) + 1, 0).to_float() == 2.0**53  # tie to even
    assert Dyadic.make((1 << 53) + 3, 0).to_float() == 2.0**53 + 4
    huge = Dyadic.make(1, 1024)
    assert huge.to_float() == math.inf and Dyadic.make(-1, 1024).to_float() == -math.inf and not huge.is_float()
    # a mantissa too large for a float itself (an overflowing exact sum of squares) must also give +-inf
    for m, e in ((3**700, 0), (-(3**700), -10), (3**700, -80), ((1 << 1100) + 1, -60)):
        assert Dyadic.make(m, e).to_float() == math.copysign(math.inf, 1 if m > 0 else -1)
        assert not Dyadic.make(m, e).is_float()
    assert Dyadic.make(3**700, -1100).to_float() == float(Fraction(3**700, 2**1100))
    with pytest.raises(ValueError):
        Dyadic.from_bytes(struct.pack("<i", 0) + b"\x02")  # even mantissa: not canonical
    with pytest.raises(ValueError):
        Dyadic.from_bytes(struct.pack("<i", 0) + b"\x01\x00")  # not minimal length
