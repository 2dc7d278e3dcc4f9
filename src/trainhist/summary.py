"""Reduce one tensor (a numpy array) to its spine and, optionally, its sketch (spec sections 5 and 6).

This is the reference reduction: every other reducer (the torch collector's on-device kernels included) must
produce the same counts, bins, min and max, and labels its sums with the method it used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from . import grid
from .dyadic import ZERO, Dyadic, exact_sums
from .errors import UsageError

__all__ = ["SumMethod", "Sketch", "Summary", "SpineTable", "summarize"]


class SumMethod:
    """How the sum and sum of squares relate to the true values of the tensor (spec 5.4)."""

    EXACT = 0  #: the stored dyadic is the exact value
    F64 = 1  #: float64 accumulation; |error| <= 2 * n**2 * 2**-53 * maxabs**p + n * 2**-1074
    F32 = 2  #: float32 accumulation; |error| <= 2 * n**2 * 2**-24 * maxabs**p + n * 2**-149
    UNKNOWN = 255  #: the sums are unknown (stored as 0): no bound, and no mean or rms (spec 5.4)

    NAMES = {EXACT: "exact", F64: "f64_accumulate", F32: "f32_accumulate", UNKNOWN: "unknown"}
    UNIT = {EXACT: 0.0, F64: 2.0**-53, F32: 2.0**-24}  #: the unit roundoff of each accumulation
    TINY = {EXACT: 0.0, F64: 2.0**-1074, F32: 2.0**-149}  #: the smallest subnormal of each accumulation

    @staticmethod
    def bound(method: int, finite: int, maxabs: float, p: int) -> float:
        """The most a stored sum (``p = 1``) or sum of squares (``p = 2``) of ``finite`` values of magnitude at most
        ``maxabs`` may differ from the exact one under ``method`` (spec 5.4); infinite for UNKNOWN."""
        if method not in SumMethod.UNIT:
            return math.inf
        return 2 * finite * finite * SumMethod.UNIT[method] * maxabs**p + finite * SumMethod.TINY[method]


@dataclass
class Sketch:
    """Counts of the signed-log2 grid at ``scale``: in-window bins per sign plus under/overflow per sign."""

    scale: int
    pos: np.ndarray  # uint64[nbins(scale)], index 0 = bin index_min(scale)
    neg: np.ndarray
    under_pos: int = 0
    under_neg: int = 0
    over_pos: int = 0
    over_neg: int = 0

    @staticmethod
    def from_key_counts(counts: npt.ArrayLike) -> "Sketch":
        """The native-scale sketch from counts indexed by :func:`grid.bin_keys` keys (length ``grid.NKEYS``)."""
        a = np.asarray(counts)
        if a.shape != (grid.NKEYS,) or a.dtype.kind not in "iu" or (a.size and a.min() < 0):
            raise UsageError(f"a sketch's key counts must be grid.NKEYS ({grid.NKEYS}) non-negative integers, as "
                             f"np.bincount(grid.bin_keys(x), minlength=grid.NKEYS) gives them; got {a.dtype} of "
                             f"shape {a.shape}", code="bad_value")
        c = a.astype(np.uint64)
        side = grid.KEY_OVER + 1
        return Sketch(
            scale=grid.NATIVE_SCALE,
            pos=c[1 : grid.KEY_OVER].copy(),
            neg=c[side + 1 : side + grid.KEY_OVER].copy(),
            under_pos=int(c[grid.KEY_UNDER]),
            over_pos=int(c[grid.KEY_OVER]),
            under_neg=int(c[side + grid.KEY_UNDER]),
            over_neg=int(c[side + grid.KEY_OVER]),
        )

    @staticmethod
    def empty(scale: int = grid.NATIVE_SCALE) -> "Sketch":
        """The sketch of no values at ``scale`` (0, 1 or 2: spec 6)."""
        if type(scale) is not int and not isinstance(scale, np.integer) or scale not in (0, 1, 2):
            raise UsageError(f"a sketch's scale must be 0, 1 or 2 (spec 6), got {type(scale).__name__} {scale!r}",
                             code="bad_value")
        n = grid.nbins(int(scale))
        return Sketch(scale, np.zeros(n, np.uint64), np.zeros(n, np.uint64))

    def total(self) -> int:
        """Number of finite non-zero values the sketch counts."""
        return int(self.pos.sum(dtype=np.uint64)) + int(self.neg.sum(dtype=np.uint64)) + (
            self.under_pos + self.under_neg + self.over_pos + self.over_neg
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Sketch)
            and self.scale == other.scale
            and np.array_equal(self.pos, other.pos)
            and np.array_equal(self.neg, other.neg)
            and (self.under_pos, self.under_neg, self.over_pos, self.over_neg)
            == (other.under_pos, other.under_neg, other.over_pos, other.over_neg)
        )


@dataclass
class Summary:
    """The spine of one observation (and its sketch, when one was taken)."""

    count: int
    nan: int = 0
    pinf: int = 0
    ninf: int = 0
    zero: int = 0
    min: float = math.nan  # finite minimum in IEEE total order; NaN when there is no finite value
    max: float = math.nan
    sum: Dyadic = ZERO
    sumsq: Dyadic = ZERO
    sum_method: int = SumMethod.EXACT
    sketch: Sketch | None = field(default=None)

    @property
    def finite(self) -> int:
        """Number of finite values (the population of min, max, sum and sumsq)."""
        return self.count - self.nan - self.pinf - self.ninf

    @staticmethod
    def scalar(value: float) -> "Summary":
        """The spine of one number (a run-level scalar such as the loss)."""
        if isinstance(value, (str, bytes)) or np.ndim(value) != 0 or np.asarray(value).dtype.kind not in "biuf":
            raise UsageError(f"Summary.scalar() takes one real number, got {type(value).__name__} {value!r:.60}",
                             code="bad_value")
        if np.asarray(value).dtype.kind in "iu" and int(value) != float(value):
            raise UsageError(f"Summary.scalar() takes a number a float64 holds exactly, got the integer {value}: "
                             "integers beyond 2**53 are rounded; convert it with float() if that is meant",
                             code="bad_value")
        return summarize(np.array([value], dtype=np.float64), sketch=False)


@dataclass(frozen=True)
class SpineTable:
    """The spines of many observations as columns, row ``i`` one observation, and optionally a native-scale sketch
    of each: what :meth:`trainhist.HistoryWriter.observe_spines` takes to record hundreds of sites a step without a
    :class:`Summary` each. Counts are non-negative integers (``count`` at least the other four together); ``min``,
    ``max`` the finite extremes in IEEE total order (NaN where a row has no finite value); ``sum``, ``sumsq`` the
    sums as finite float64 values, bounded as ``method`` says (:class:`SumMethod`: F32, F64 or UNKNOWN, whose sums
    are stored as 0). ``sketch``: ``None``, or the counts of every row by grid key (shape ``(rows,
    grid.NKEYS)``, as ``np.bincount`` of :func:`grid.bin_keys` gives them; the bin and band keys make the
    sketch, :meth:`Sketch.from_key_counts`), no more of them than the row's finite non-zero values."""

    count: np.ndarray
    nan: np.ndarray
    pinf: np.ndarray
    ninf: np.ndarray
    zero: np.ndarray
    min: np.ndarray
    max: np.ndarray
    sum: np.ndarray
    sumsq: np.ndarray
    method: np.ndarray
    sketch: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.count)

    def row(self, i: int) -> Summary:
        """Row ``i`` as a :class:`Summary`."""
        s = Summary(count=int(self.count[i]), nan=int(self.nan[i]), pinf=int(self.pinf[i]), ninf=int(self.ninf[i]),
                    zero=int(self.zero[i]), min=float(self.min[i]), max=float(self.max[i]),
                    sum_method=int(self.method[i]))
        if s.sum_method != SumMethod.UNKNOWN:
            s.sum, s.sumsq = Dyadic.from_float(float(self.sum[i])), Dyadic.from_float(float(self.sumsq[i]))
        if self.sketch is not None:
            s.sketch = Sketch.from_key_counts(np.asarray(self.sketch[i]))
        return s


def total_order_min(x: np.ndarray) -> float:
    """Minimum of a non-empty finite array with -0.0 < +0.0 (IEEE 754 totalOrder)."""
    m = float(x.min())
    if m == 0.0:
        return -0.0 if bool(np.any((x == 0) & np.signbit(x))) else 0.0
    return m


def total_order_max(x: np.ndarray) -> float:
    """Maximum of a non-empty finite array with -0.0 < +0.0 (IEEE 754 totalOrder)."""
    m = float(x.max())
    if m == 0.0:
        return 0.0 if bool(np.any((x == 0) & ~np.signbit(x))) else -0.0
    return m


def summarize(values: npt.ArrayLike, *, dtype: str | None = None, sketch: bool = True) -> Summary:
    """Spine (always) and sketch (when ``sketch``) of ``values``, with exact sums.

    ``values`` may be float16, float32, float64, an integer array, or bfloat16 bit patterns as uint16 with
    ``dtype="bfloat16"``. Narrow floats are widened exactly first.
    """
    if dtype is not None and (type(dtype) is not str or dtype != "bfloat16"):
        raise UsageError(f"dtype={dtype!r} is not a dtype summarize() reads: give dtype='bfloat16' for bfloat16 bit "
                         "patterns in a uint16 array, or leave dtype out for a float16/float32/float64 or integer "
                         "array, whose own dtype is used (any other name would read the bits as integers)",
                         code="bad_values")
    if type(sketch) is not bool and not isinstance(sketch, np.bool_):
        raise UsageError(f"sketch must be True or False, got {type(sketch).__name__} {sketch!r:.60}",
                         code="bad_value")
    a = np.asarray(values)
    if a.dtype.kind == "f" and not a.dtype.isnative:  # (big-endian floats: the same values in native order, exactly)
        a = a.astype(a.dtype.newbyteorder("="))
    x = grid.as_float_bits(a, dtype)
    keys = grid.bin_keys(x)
    counts = np.bincount(keys, minlength=grid.NKEYS).astype(np.uint64)
    nan, pinf, ninf, zero = (int(counts[k]) for k in (grid.KEY_NAN, grid.KEY_PINF, grid.KEY_NINF, grid.KEY_ZERO))
    s = Summary(count=int(x.size), nan=nan, pinf=pinf, ninf=ninf, zero=zero)
    if nan or pinf or ninf:
        fin = x[np.isfinite(x)]
    else:
        fin = x
    if fin.size:
        s.min = total_order_min(fin)
        s.max = total_order_max(fin)
        s.sum, s.sumsq = exact_sums(fin)
    if sketch:
        s.sketch = Sketch.from_key_counts(counts)
    return s
