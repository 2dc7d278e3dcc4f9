"""The fixed signed-log2 histogram grid (spec section 6): bin of a value from its bits, no logarithm anywhere.

Bin ``i`` at scale ``s`` holds magnitudes in ``(2**(i / 2**s), 2**((i + 1) / 2**s)]`` — the OpenTelemetry
exponential-histogram bucket index at scale ``s``. The file's native scale is 2 (4 bins per octave); the window is
``(2**-48, 2**16]`` per sign, so indices run from ``INDEX_MIN[s]`` to ``INDEX_MAX[s]``.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import UsageError

__all__ = [
    "NATIVE_SCALE",
    "WINDOW_LOG2_LO",
    "WINDOW_LOG2_HI",
    "index_min",
    "index_max",
    "nbins",
    "THRESH_F32",
    "THRESH_F64",
    "KEY_UNDER",
    "KEY_OVER",
    "NKEYS",
    "KEY_ZERO",
    "KEY_NAN",
    "KEY_PINF",
    "KEY_NINF",
    "as_float_bits",
    "bin_keys",
    "bin_index_exact",
    "downscale_index",
]

NATIVE_SCALE = 2
WINDOW_LOG2_LO = -48
WINDOW_LOG2_HI = 16


def index_min(scale: int) -> int:
    """Lowest in-window bin index at ``scale`` (bin covering just above 2**-48)."""
    return WINDOW_LOG2_LO << scale


def index_max(scale: int) -> int:
    """Highest in-window bin index at ``scale`` (bin whose upper edge is 2**16)."""
    return (WINDOW_LOG2_HI << scale) - 1


def nbins(scale: int) -> int:
    """Number of in-window bins per sign at ``scale`` (256 at the native scale 2)."""
    return (WINDOW_LOG2_HI - WINDOW_LOG2_LO) << scale


def _iroot4(n: int) -> int:
    """floor(n ** (1/4)) for a non-negative integer, exactly (isqrt of isqrt is the floor fourth root)."""
    return math.isqrt(math.isqrt(n))


# Integer mantissa thresholds T_k = floor(2**F * (2**(k/4) - 1)) for k = 1, 2, 3 and F fraction bits.
# A normal value with biased exponent field and fraction f (integer) has |x| = 2**E * (1 + f / 2**F);
# since 2**(k/4) is irrational, 1 + f/2**F <= 2**(k/4)  <=>  f <= T_k.
THRESH_F32 = tuple(_iroot4(1 << (4 * 23 + k)) - (1 << 23) for k in (1, 2, 3))
THRESH_F64 = tuple(_iroot4(1 << (4 * 52 + k)) - (1 << 52) for k in (1, 2, 3))

# Key layout of one bincount over a whole tensor at the native scale (spec 6.3, informative):
#   positive side: 0 = underflow, 1..256 = bins INDEX_MIN..INDEX_MAX, 257 = overflow
#   negative side: the same plus 258; then zero, NaN, +inf, -inf.
_NB = nbins(NATIVE_SCALE)
KEY_UNDER = 0
KEY_OVER = _NB + 1
_SIDE = _NB + 2
KEY_ZERO = 2 * _SIDE
KEY_NAN = KEY_ZERO + 1
KEY_PINF = KEY_ZERO + 2
KEY_NINF = KEY_ZERO + 3
NKEYS = KEY_ZERO + 4


def as_float_bits(values: np.ndarray, dtype: str | None = None) -> np.ndarray:
    """Return the tensor as float32 or float64 (widening narrower floats exactly), flattened.

    ``dtype="bfloat16"`` reads a uint16 array as bfloat16 bit patterns (numpy has no bfloat16).
    """
    a = np.asarray(values)
    if dtype == "bfloat16":
        if a.dtype != np.uint16:
            raise UsageError("bfloat16 input must be given as a uint16 array of bit patterns", code="bad_values")
        return (a.reshape(-1).astype(np.uint32) << 16).view(np.float32)
    if a.dtype == np.float16:
        return a.reshape(-1).astype(np.float32)
    if a.dtype in (np.float32, np.float64):
        return a.reshape(-1)
    if a.dtype.kind in "iub":
        flat = a.reshape(-1)
        if a.dtype.itemsize == 8 and flat.size and (int(flat.max()) > 2**53 or int(flat.min()) < -(2**53)):
            raise UsageError("integer values beyond 2**53 have no exact float64 value: convert them explicitly",
                             code="bad_values")
        return flat.astype(np.float64)
    raise UsageError(f"unsupported dtype {a.dtype}: expected a float16/bfloat16/float32/float64 array (or integers "
                     "up to 2**53)", code="bad_values")


def bin_keys(x: np.ndarray) -> np.ndarray:
    """Key in ``[0, NKEYS)`` of every element of a flat float32 or float64 array (native scale)."""
    if x.dtype == np.float32:
        bits = x.view(np.uint32)
        mag = bits & np.uint32(0x7FFFFFFF)
        neg = (bits >> np.uint32(31)).astype(np.int64)
        exp = (mag >> np.uint32(23)).astype(np.int64)
        frac = mag & np.uint32(0x7FFFFF)
        inf_mag = 0x7F800000
        t = THRESH_F32
        bias = 127
        emax = 255
    elif x.dtype == np.float64:
        bits = x.view(np.uint64)
        mag = bits & np.uint64(0x7FFFFFFFFFFFFFFF)
        neg = (bits >> np.uint64(63)).astype(np.int64)
        exp = (mag >> np.uint64(52)).astype(np.int64)
        frac = mag & np.uint64((1 << 52) - 1)
        inf_mag = 0x7FF0000000000000
        t = THRESH_F64
        bias = 1023
        emax = 2047
    else:
        raise TypeError(f"bin_keys takes float32 or float64, got {x.dtype}")
    ft = frac.dtype.type
    q = (frac > ft(t[0])).astype(np.int64)
    q += frac > ft(t[1])
    q += frac > ft(t[2])
    q -= frac == 0
    idx = 4 * (exp - bias) + q
    # subnormals (exp == 0) are far below 2**-48 for both widths: clamp sends them to underflow.
    key = np.clip(idx - (index_min(NATIVE_SCALE) - 1), KEY_UNDER, KEY_OVER) + _SIDE * neg
    special = (exp == emax) | (mag == 0)
    if special.any():
        key[mag == 0] = KEY_ZERO
        key[(exp == emax) & (frac != 0)] = KEY_NAN
        is_inf = mag == mag.dtype.type(inf_mag)
        key[is_inf & (neg == 0)] = KEY_PINF
        key[is_inf & (neg == 1)] = KEY_NINF
    return key


def bin_index_exact(value: float) -> int | str:
    """Reference classification by exact rational comparison (for tests and the spec's examples).

    Returns the bin index, or one of ``"zero" "nan" "pinf" "ninf" "under" "over"`` (sign is the caller's).
    """
    from fractions import Fraction

    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "pinf" if value > 0 else "ninf"
    if value == 0:
        return "zero"
    a = Fraction(abs(value))
    if a <= Fraction(2) ** WINDOW_LOG2_LO:
        return "under"
    if a > Fraction(2) ** WINDOW_LOG2_HI:
        return "over"
    # find i with 2**(i/4) < a <= 2**((i+1)/4)  <=>  2**i < a**4 <= 2**(i+1)
    a4 = a**4
    i = a4.numerator.bit_length() - a4.denominator.bit_length()  # floor(log2(a4)) or one more
    while Fraction(2) ** i >= a4:
        i -= 1
    while Fraction(2) ** (i + 1) < a4:
        i += 1
    return i


def downscale_index(index: np.ndarray | int, by: int) -> np.ndarray | int:
    """Index at scale ``s - by`` of the bin with index ``index`` at scale ``s`` (floor division by 2**by)."""
    return index >> by
