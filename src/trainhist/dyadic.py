"""Exact dyadic rationals ``m * 2**e`` for sums that merge by exact addition (spec section 5.3).

A value is kept canonical: ``m`` odd, or ``m == 0`` with ``e == 0``. Addition is exact integer arithmetic, so it
is associative and commutative bit for bit; ``to_float`` rounds correctly (ties to even) for display.
"""

from __future__ import annotations

import math
import operator
import struct
from itertools import chain
from typing import NamedTuple

import numpy as np

__all__ = ["Dyadic", "ZERO", "exact_sums", "float_of", "fits_float", "mant_bytes", "dyadics_of", "float_parts",
           "canonical_parts", "floats_of", "quotient_float", "same_float", "sum_within", "MANT_BITS", "EXACT_BYTES"]

#: The width bound of an exact form (spec 5.3): ``|m| < 2**MANT_BITS``, i.e. ``m`` in at most 1024 bytes of
#: two's complement, so an encoded dyadic (``sum_x`` entry) has at most ``EXACT_BYTES`` bytes. A sum of fewer than
#: 2**64 binary64 values needs at most 2,162 bits, a sum of their squares at most 4,260.
MANT_BITS = 8191
EXACT_BYTES = 4 + 1024


def float_of(m: int, e: int) -> float:
    """Correctly rounded float64 of ``m * 2**e`` (ties to even); +-inf beyond the float64 range, the zero of the
    sign of ``m`` below half the smallest subnormal. The work is bounded by the size of ``m``, whatever ``e``: only
    values within reach of the float64 range are shifted (by fewer than ``1100 + m.bit_length()`` bits)."""
    if m == 0:
        return 0.0
    top = e + (m if m > 0 else -m).bit_length()  # 2**(top - 1) <= |m * 2**e| < 2**top
    if top > 1024:  # |value| >= 2**1024: beyond the largest float64 and the halfway point above it
        return math.inf if m > 0 else -math.inf  # (copysign would convert the huge int m to float)
    if top < -1074:  # |value| < 2**-1075, half the smallest subnormal: rounds to zero
        return 0.0 if m > 0 else -0.0
    try:
        return float(m << e) if e >= 0 else m / (1 << -e)
    except OverflowError:
        return math.inf if m > 0 else -math.inf


def quotient_float(m: int, e: int, n: int, root: bool = False) -> float:
    """Correctly rounded float64 (ties to even) of ``m * 2**e / n`` (``n >= 1``), or with ``root`` of its square root
    (NaN when ``m < 0``): +-inf where the value overflows, a zero of its sign where it underflows. No intermediate
    float is formed, and the work is bounded by the sizes of ``m`` and ``n``, whatever ``e``.

    An integer ``q`` of at least 57 significant bits is the quotient (or root) truncated, and the remainder adds a
    sticky bit: ``2q + 1`` lies strictly between the same two rounding boundaries as the true value (they are even
    multiples of the last bit), so one correct rounding of ``(2q + sticky) * 2**(E - 1)`` rounds the true value."""
    if m == 0:
        return 0.0
    if root and m < 0:
        return math.nan
    a = m if m > 0 else -m
    want = 112 if root else 56  # |a * 2**s / n| >= 2**want
    s = want + n.bit_length() - a.bit_length() + 1
    if root and (e - s) % 2:
        s += 1
    q, r = divmod(a << s, n) if s >= 0 else divmod(a, n << -s)
    if root:
        t = math.isqrt(q)
        return float_of((t << 1) | (r != 0 or t * t != q), (e - s) // 2 - 1)
    v = (q << 1) | (r != 0)
    return float_of(v if m > 0 else -v, e - s - 1)


def same_float(d: "Dyadic", f: float) -> bool:
    """Whether ``f`` is the correctly rounded float64 of ``d`` (spec 5.3), bit for bit: a non-zero value that
    rounds to zero needs the zero of its sign; only the exact zero takes either zero."""
    r = d.to_float()
    return r == f and (r != 0.0 or d.m == 0 or math.copysign(1.0, r) == math.copysign(1.0, f))


def fits_float(m: int, e: int) -> bool:
    """Whether canonical ``m * 2**e`` (``m`` odd, or zero) is exactly a finite float64, from the bit count alone."""
    if m == 0:
        return True
    n = (m if m > 0 else -m).bit_length()
    return n <= 53 and e >= -1074 and e + n <= 1024


def mant_bytes(m: int) -> int:
    """Bytes of ``m`` as minimal-length two's complement (spec 5.3)."""
    return (m if m >= 0 else ~m).bit_length() // 8 + 1


class Dyadic(NamedTuple):
    """The exact value ``m * 2**e``."""

    m: int
    e: int

    @staticmethod
    def make(m: int, e: int) -> "Dyadic":
        """Canonical form of ``m * 2**e``."""
        if m == 0:
            return ZERO
        tz = (m & -m).bit_length() - 1
        return Dyadic(m >> tz, e + tz)

    @staticmethod
    def from_float(x: float) -> "Dyadic":
        """The exact value of a finite float."""
        if not math.isfinite(x):
            raise ValueError(f"a dyadic needs a finite value, got {x!r}")
        n, d = float(x).as_integer_ratio()
        return Dyadic.make(n, -(d.bit_length() - 1))

    def __add__(self, other: "Dyadic") -> "Dyadic":  # type: ignore[override]
        if self.m == 0:
            return other
        if other.m == 0:
            return self
        e = min(self.e, other.e)
        return Dyadic.make((self.m << (self.e - e)) + (other.m << (other.e - e)), e)

    def to_float(self) -> float:
        """Correctly rounded float64 (ties to even); +-inf when the magnitude exceeds the float64 range."""
        return float_of(self.m, self.e)

    def is_float(self) -> bool:
        """True when the value is exactly a finite float64 (so the f64 column alone stores it)."""
        f = self.to_float()
        return math.isfinite(f) and Dyadic.from_float(f) == self

    def to_bytes(self) -> bytes:
        """Encoding of spec 5.3: int32 LE exponent, then ``m`` as minimal-length two's complement LE bytes."""
        return struct.pack("<i", self.e) + self.m.to_bytes(mant_bytes(self.m), "little", signed=True)

    @staticmethod
    def from_bytes(b: bytes) -> "Dyadic":
        """Inverse of :meth:`to_bytes`; raises ValueError on a non-canonical encoding."""
        if len(b) < 5:
            raise ValueError("a dyadic needs at least 5 bytes")
        (e,) = struct.unpack_from("<i", b)
        m = int.from_bytes(b[4:], "little", signed=True)
        d = Dyadic(m, e)
        if Dyadic.make(m, e) != d or d.to_bytes() != bytes(b):
            raise ValueError("dyadic encoding is not canonical (mantissa must be odd and minimal-length)")
        return d


ZERO = Dyadic(0, 0)


def _tree_sum(vals: list[Dyadic], lo: int, hi: int) -> tuple[int, int]:
    """``(t, e)`` with ``t * 2**e`` the exact sum of ``vals[lo:hi]`` (sorted by exponent, ``e`` the least), added
    pairwise: every integer made is no wider than the span of the values it sums, plus a bit a level."""
    if hi - lo == 1:
        return vals[lo].m, vals[lo].e
    mid = (lo + hi) // 2
    t0, e0 = _tree_sum(vals, lo, mid)
    t1, e1 = _tree_sum(vals, mid, hi)
    return t0 + (t1 << (e1 - e0)), e0


def sum_within(values: list[Dyadic], bits: int = MANT_BITS) -> Dyadic | None:
    """The exact sum of ``values`` (canonical), or None when its mantissa needs more than ``bits`` bits
    (``|m| >= 2**bits``), decided on the sum itself (values that cancel may span more), with memory linear in the
    sizes of the ``m`` of the values, whatever their exponents (spec 11.2: no sum 2**(2**31)-bit wide is built).

    The values, sorted by exponent, fall into blocks whose bounds overlap (a value joins the block below when its
    exponent is at most the block's bound on the top of its sum); each block is summed alone. Between two blocks
    lies a gap of at least one bit, so a block never changes the lowest set bit of the blocks below, and with two
    non-zero blocks or more the sum's magnitude is above 2**(top - 2), ``top`` being the top bit (exclusive) of the
    highest block: the mantissa then needs at least ``top - 1 - low`` bits, ``low`` being the lowest set bit of
    the sum, and the sum is built only when that is within ``bits``."""
    vals = sorted((v for v in values if v.m), key=lambda v: v.e)
    blocks: list[tuple[int, int]] = []  # (t, e): a block's exact sum t * 2**e
    i = 0
    while i < len(vals):
        j, bound = i + 1, vals[i].e + abs(vals[i].m).bit_length()  # |block sum| < 2**bound
        while j < len(vals) and vals[j].e <= bound:
            bound = max(bound, vals[j].e + abs(vals[j].m).bit_length()) + 1
            j += 1
        t, e = _tree_sum(vals, i, j)
        if t:
            blocks.append((t, e))
        i = j
    if not blocks:
        return ZERO
    t0, e0 = blocks[0]
    tz = (t0 & -t0).bit_length() - 1
    low = e0 + tz  # the lowest set bit of the sum: that of the lowest block
    if len(blocks) == 1:
        m = t0 >> tz
    else:
        th, eh = blocks[-1]
        if eh + abs(th).bit_length() - 1 - low > bits:
            return None
        m = (t0 >> tz) + sum(t << (e - low) for t, e in blocks[1:])
    return Dyadic(m, low) if abs(m).bit_length() <= bits else None


def canonical_parts(m: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical form of the int64 arrays ``m * 2**e`` (``|m| < 2**63``): the trailing zero bits of ``m`` moved into
    ``e``, so ``m`` is odd, or ``m == e == 0``."""
    nz = m != 0
    low = np.where(nz, m & -m, 1)  # the lowest set bit: a power of two, exact in float64
    tz = np.where(nz, np.frexp(low.astype(np.float64))[1] - 1, 0)
    return m >> tz, np.where(nz, e + tz, 0)


def float_parts(f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical ``(m, e)`` int64 arrays with ``m * 2**e == f`` for an array of finite float64 values: ``m`` odd, or
    ``m == e == 0`` (for -0.0 too), with one set of numpy operations."""
    mant, ex = np.frexp(f)
    m = (mant * 2.0**53).astype(np.int64)  # exact: 53 significant bits at most
    return canonical_parts(m, ex.astype(np.int64) - 53)


def dyadics_of(values: np.ndarray) -> list[Dyadic]:
    """``[Dyadic.from_float(v) for v in values]`` for a float64 array of finite values, through :func:`float_parts`
    (the collector turns hundreds of sums a step into dyadics)."""
    a = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    if not np.isfinite(a).all():
        raise ValueError("a dyadic needs a finite value")
    m, e = float_parts(a)
    new = tuple.__new__  # (a NamedTuple's own __new__ is a Python function: twice as slow for hundreds a step)
    return [new(Dyadic, pair) for pair in zip(m.tolist(), e.tolist())]


_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def floats_of(values: list[Dyadic]) -> tuple[np.ndarray, list[bool]]:
    """``[v.to_float() for v in values]`` as a float64 array, and ``[v.is_float() for v in values]``: with a few numpy
    operations for the values whose ``m`` and ``e`` fit int64 (a chunk stores two sums a row), the others value by
    value."""
    try:
        # (operator.index: a non-integer field raises TypeError, as the value-by-value path does, not truncated)
        me = np.fromiter(map(operator.index, chain.from_iterable(values)), np.int64, 2 * len(values))
    except OverflowError:  # the values whose fields fit int64 together, only the others one by one
        fits = [_I64_MIN <= v.m <= _I64_MAX and _I64_MIN <= v.e <= _I64_MAX for v in values]
        part, part_exact = floats_of([v for v, ok in zip(values, fits) if ok])
        f = np.empty(len(values), np.float64)
        f[np.array(fits, dtype=bool)] = part
        it = iter(part_exact)
        exact = [next(it) if ok else v.is_float() for v, ok in zip(values, fits)]
        for i, ok in enumerate(fits):
            if not ok:
                f[i] = values[i].to_float()
        return f, exact
    m, e = me[0::2], me[1::2]
    mf = m.astype(np.float64)  # exact when |m| < 2**53; larger stays >= 2**53
    bits = np.frexp(mf)[1]  # bit length of |m|, or more than 53
    # is_float: canonical (m odd, or m == e == 0) and exactly a finite float64: |m| < 2**53 and
    # -1074 <= e <= 1024 - bits (as unsigned, e + 1074 wraps past the bound when e is below -1074 or near 2**63)
    in_range = (bits <= 53) & ((e + 1074).view(np.uint64) <= (2098 - bits).astype(np.uint64))
    exact = (((m & 1) == 1) & in_range) | ((m | e) == 0)
    f = np.ldexp(mf, np.where(exact, e, 0))  # exactly the value where it is a float64
    is_float = exact.tolist()
    if False in is_float:
        for i, ok in enumerate(is_float):
            if not ok:
                f[i] = values[i].to_float()
    return f, is_float


# Limb plans: (mantissa bits, limb bits, limbs, block elements) chosen so every float64 partial sum in
# np.bincount stays an integer below 2**53 and is therefore exact.
_PLAN = {np.dtype(np.float32): (12, 2, 1 << 22), np.dtype(np.float64): (14, 4, 1 << 20)}


def _limbs(x: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, int]:
    """Split finite x into integer mantissa limbs, exponent (x = sign * sum(limb_k << kL) * 2**e) and sign."""
    lb, nl, _ = _PLAN[x.dtype]
    if x.dtype == np.float32:
        bits = x.view(np.uint32).astype(np.int64)
        neg = bits >> 31
        exp = (bits >> 23) & 0xFF
        m = bits & 0x7FFFFF
        m = np.where(exp == 0, m, m | 0x800000)
        e = np.where(exp == 0, 1, exp) - 127 - 23
    else:
        bits = x.view(np.uint64)
        neg = (bits >> np.uint64(63)).astype(np.int64)
        exp = ((bits >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64)
        m = (bits & np.uint64((1 << 52) - 1)).astype(np.int64)
        m = np.where(exp == 0, m, m | (1 << 52))
        e = np.where(exp == 0, 1, exp) - 1023 - 52
    mask = (1 << lb) - 1
    limbs = [(m >> (lb * k)) & mask for k in range(nl)]
    return limbs, e, neg, lb


def _combine(weights: dict[int, np.ndarray], base: int, shift_unit: int) -> Dyadic:
    """Sum over limb position k and exponent slot j of weights[k][j] * 2**(k*shift_unit + j + base), exactly."""
    total = 0
    for k, w in weights.items():
        nz = np.nonzero(w)[0]
        for j in nz.tolist():
            total += int(w[j]) << (k * shift_unit + j)
    return Dyadic.make(total, base)


def exact_sums(x: np.ndarray) -> tuple[Dyadic, Dyadic]:
    """Exact sum and sum of squares of a flat float32 or float64 array of finite values."""
    if x.size == 0:
        return ZERO, ZERO
    lb, nl, block = _PLAN[x.dtype]
    emin = -149 if x.dtype == np.float32 else -1074
    span = (254 if x.dtype == np.float32 else 2046) + 1
    total_s, total_q = ZERO, ZERO
    for start in range(0, x.size, block):
        limbs, e, neg, _ = _limbs(x[start : start + block])
        slot = e - emin
        sign = 1.0 - 2.0 * neg
        # every float64 partial sum inside one block is an integer below 2**53, hence exact
        s_w = {k: np.bincount(slot, weights=limbs[k] * sign, minlength=span) for k in range(nl)}
        # squares: (sum_k a_k 2^(kL))^2 = sum_c 2^(cL) * sum_{i+j=c} a_i a_j, at exponent slot 2*(e-emin)
        q_w = {}
        for c in range(2 * nl - 1):
            acc = sum(limbs[i] * limbs[c - i] for i in range(max(0, c - nl + 1), min(c, nl - 1) + 1))
            q_w[c] = np.bincount(2 * slot, weights=acc.astype(np.float64), minlength=2 * span)
        total_s = total_s + _combine(s_w, emin, lb)
        total_q = total_q + _combine(q_w, 2 * emin, lb)
    return total_s, total_q
