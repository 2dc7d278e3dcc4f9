"""Vectorised exact dyadic columns for merge and coarsen (spec 5.3 and 11.2).

A column of exact values ``m * 2**e`` is held as :class:`ExactCol`: an int64 exponent per row and the mantissa as
``L`` 32-bit limbs in an int64 matrix, two's complement with the top limb signed (every lower limb in
``[0, 2**32)``). Every value is canonical (``m`` odd, or ``m = 0`` and ``e = 0``), so equal values have equal
limbs and exponents. Values whose canonical encoding needs more than ``4 * MAX_LIMBS`` mantissa bytes are *wide*:
they are kept as :class:`~trainhist.dyadic.Dyadic` objects in ``w`` (their limbs and exponent are zero) and handled
by the Python path, as are group sums whose aligned span exceeds ``MAX_ACC`` limbs and results that round to a
subnormal float. Everything else (decode with its checks, group sums, rounding to float64, encode) is done with
whole-array integer arithmetic, and gives the same bits as the Python path: the tests compare the two. Where
numba is installed, decoding and group sums run instead through the compiled loops of :mod:`trainhist.mergekernel`
(:func:`trainhist.fastpath.kernels`), which give the same values; the numpy code here is the fallback.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .dyadic import (EXACT_BYTES, MANT_BITS, Dyadic, canonical_parts, float_of, float_parts, mant_bytes, same_float,
                     sum_within)
from .errors import CorruptError
from .fastpath import kernels

__all__ = ["ExactCol", "MAX_LIMBS", "MAX_ACC", "decode_exact", "group_sum", "encode_exact"]

MAX_LIMBS = 8  #: mantissas of up to 8 x 32 bits (32 encoded bytes) are vectorised; wider ones are Python ints
MAX_ACC = 64  #: widest aligned group sum (limbs) done with arrays; wider spans use Python ints
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1  #: the range of an encoded exponent (spec 5.3)
_MASK = np.int64(0xFFFFFFFF)
_BIG = np.int64(1 << 62)


# -- limb helpers (all on int64 matrices, one row per value) --------------------------------------------------
def _normalize(t: np.ndarray) -> np.ndarray:
    """Propagate carries in place: every limb but the top in [0, 2**32); the top keeps the sign."""
    for k in range(t.shape[1] - 1):
        c = t[:, k] >> 32
        t[:, k] &= _MASK
        t[:, k + 1] += c
    return t


def _widen(m: np.ndarray, width: int) -> np.ndarray:
    """The same normalized values in ``width`` limbs (sign-extended)."""
    n, w0 = m.shape
    if w0 >= width:
        return m
    out = np.zeros((n, width), np.int64)
    out[:, :w0] = m
    top = m[:, w0 - 1]
    out[:, w0 - 1] = top & _MASK
    neg = top < 0
    if neg.any():
        out[neg, w0:width - 1] = _MASK
        out[neg, width - 1] = -1
    return out


def _magnitude(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(negative?, |m| as normalized non-negative limbs)."""
    neg = m[:, -1] < 0
    if not neg.any():
        return neg, m
    a = m.copy()
    a[neg] = -a[neg]
    return neg, _normalize(a)


def _bitlen(v: np.ndarray) -> np.ndarray:
    """Bit length of non-negative int64 values below 2**53."""
    return np.frexp(v.astype(np.float64))[1].astype(np.int64)


def _nbits_tz(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bit length and trailing zero bits of non-negative normalized limbs (0 and 0 for zero)."""
    n, w = a.shape
    nz = a != 0
    anynz = nz.any(axis=1)
    rows = np.arange(n)
    h = w - 1 - nz[:, ::-1].argmax(axis=1)
    nbits = np.where(anynz, 32 * h + _bitlen(a[rows, h]), 0)
    z = nz.argmax(axis=1)
    low = a[rows, z]
    low = low & -low
    tz = np.where(anynz, 32 * z + _bitlen(low) - 1, 0)
    return nbits, tz


def _shr(a: np.ndarray, t: np.ndarray, width: int) -> np.ndarray:
    """Non-negative normalized limbs shifted right by ``t`` bits (per row), as ``width`` limbs."""
    n = a.shape[0]
    ap = np.concatenate([a, np.zeros((n, width + 1), np.int64)], axis=1)
    q, r = (t // 32)[:, None], (t % 32)[:, None]
    k = np.arange(width)[None, :]
    lo = np.take_along_axis(ap, q + k, axis=1)
    hi = np.take_along_axis(ap, q + k + 1, axis=1)
    return ((lo >> r) | (hi << (32 - r))) & _MASK


def _round(neg: np.ndarray, a: np.ndarray, e: np.ndarray, nbits: np.ndarray, tz: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """Correctly rounded float64 of ``+-a * 2**e`` and a mask of the rows it cannot give (subnormal results);
    ``nbits``, ``tz``: the bit length and trailing zero bits of ``a`` (:func:`_nbits_tz`).

    The top 63 bits of the magnitude, with every lower bit ORed into the last one (a sticky bit: some bit is
    set below the top 63 when the lowest set bit is), convert to float64 with a single rounding to nearest even;
    scaling by a power of two is then exact for normal results.
    """
    n = a.shape[0]
    p = nbits - 63
    big = p > 0
    ps = np.where(big, p, 0)
    q, r = ps // 32, ps % 32
    ap = np.concatenate([a, np.zeros((n, 3), np.int64)], axis=1).view(np.uint64)
    rows = np.arange(n)
    l0, l1, l2 = ap[rows, q], ap[rows, q + 1], ap[rows, q + 2]
    ru = r.astype(np.uint64)
    v = (l0 >> ru) | (l1 << (np.uint64(32) - ru))
    v |= np.where(r == 0, np.uint64(0), l2 << ((np.uint64(64) - ru) & np.uint64(63)))
    sticky = tz < ps  # the bits below the top 63 are the lowest ps
    v = np.where(big, v | sticky.astype(np.uint64), v)
    fl = v.astype(np.int64).astype(np.float64)
    with np.errstate(over="ignore"):
        f = np.ldexp(fl, np.clip(e + ps, -4000, 4000).astype(np.int32))
    f = np.where(neg, -f, f)
    bad = (nbits > 0) & (e + nbits - 1 < -1022)
    return f, bad


def _to_int(row: np.ndarray) -> int:
    """Python int of one row of normalized two's complement limbs."""
    return int.from_bytes(row.astype("<u4").tobytes(), "little", signed=True)


def _from_int(m: int, width: int) -> np.ndarray:
    """Normalized limbs of ``m`` (which fits in ``width`` limbs)."""
    b = m.to_bytes(4 * width, "little", signed=True)
    v = np.frombuffer(b, "<u4").astype(np.int64)
    if v[-1] >= 1 << 31:
        v[-1] -= 1 << 32
    return v


class ExactCol:
    """Exact values of one column of a row batch (see the module docstring). ``over`` (None, or a mask) marks the
    group sums whose mantissa is wider than spec 5.3 allows: they are not built, and their row holds zero."""

    __slots__ = ("e", "m", "w", "over")

    def __init__(self, e: np.ndarray, m: np.ndarray, w: np.ndarray | None = None,
                 over: np.ndarray | None = None) -> None:
        self.e = e
        self.m = m
        self.w = w if w is not None and any(x is not None for x in w.tolist()) else None
        self.over = over if over is not None and over.any() else None

    @staticmethod
    def zeros(n: int) -> "ExactCol":
        return ExactCol(np.zeros(n, np.int64), np.zeros((n, 2), np.int64))

    @staticmethod
    def from_floats(f: np.ndarray) -> "ExactCol":
        """Exact values of finite floats (the caller zeroes non-finite ones first)."""
        m, e = float_parts(f)
        return ExactCol(e, _two_limbs(m))

    def __len__(self) -> int:
        return int(self.e.size)

    def take(self, idx) -> "ExactCol":
        return ExactCol(self.e[idx], self.m[idx], None if self.w is None else self.w[idx],
                        None if self.over is None else self.over[idx])

    @staticmethod
    def concat(parts: list["ExactCol"]) -> "ExactCol":
        if len(parts) == 1:
            return parts[0]
        width = max(p.m.shape[1] for p in parts)
        e = np.concatenate([p.e for p in parts])
        m = np.concatenate([_widen(p.m, width) for p in parts])
        w = over = None
        if any(p.w is not None for p in parts):
            w = np.concatenate([p.w if p.w is not None else np.full(len(p), None, object) for p in parts])
        if any(p.over is not None for p in parts):
            over = np.concatenate([p.over if p.over is not None else np.zeros(len(p), bool) for p in parts])
        return ExactCol(e, m, w, over)

    def blank(self, mask: np.ndarray) -> None:
        """Set the rows in ``mask`` to zero."""
        self.e[mask] = 0
        self.m[mask] = 0
        if self.w is not None:
            self.w[mask] = None
        if self.over is not None:
            self.over[mask] = False

    def out_of_range(self) -> np.ndarray:
        """Per row: whether its exponent lies outside the i32 of the exact encoding, or its mantissa is wider than
        the bound of spec 5.3 (``over``): such a value (a sum of values near the largest exponent, or of values
        far apart) cannot be stored, and must not be wrapped."""
        bad = (self.e < I32_MIN) | (self.e > I32_MAX)
        if self.w is not None:
            bad |= np.array([v is not None and not I32_MIN <= v.e <= I32_MAX for v in self.w.tolist()], bool)
        if self.over is not None:
            bad |= self.over
        return bad

    def why_out_of_range(self, i: int, name: str) -> str:
        """What makes row ``i`` (one :meth:`out_of_range` gives) unstorable, for an error message."""
        if self.over is not None and self.over[i]:
            return (f"the exact {name} needs a mantissa of more than {MANT_BITS} bits, wider than the exact "
                    "encoding allows (spec 5.3), and cannot be stored")
        return (f"the exact {name} gets the exponent {self.get(i).e}, outside the 32 bits of the exact encoding "
                "(spec 5.3), and cannot be stored")

    def get(self, i: int) -> Dyadic:
        if self.w is not None and self.w[i] is not None:
            return self.w[i]
        return Dyadic(_to_int(self.m[i]), int(self.e[i]))

    def is_zero(self) -> np.ndarray:
        """Per row: whether its value is 0 (canonical, so every limb is zero, and no wide or unbuilt sum is held)."""
        z = ~(self.m != 0).any(axis=1)
        if self.w is not None:
            z &= np.array([v is None for v in self.w.tolist()], bool)
        if self.over is not None:
            z &= ~self.over
        return z

    def differs(self, other_idx: np.ndarray) -> np.ndarray:
        """Per row: whether its value differs from that of row ``other_idx[row]``."""
        d = (self.e != self.e[other_idx]) | (self.m != self.m[other_idx]).any(axis=1)
        if self.w is not None:
            wl, wo = self.w.tolist(), self.w[other_idx].tolist()
            d |= np.array([a != b for a, b in zip(wl, wo)], bool)
        return d

    def set_over(self, i: int) -> None:
        """Mark row ``i`` as a sum too wide to store (spec 5.3); the row holds zero."""
        self.set_py(i, 0, 0)
        if self.over is None:
            self.over = np.zeros(len(self), bool)
        self.over[i] = True

    def set_py(self, i: int, m: int, e: int) -> None:
        """Store canonical ``m * 2**e`` in row ``i`` (narrow or wide)."""
        if self.over is not None:
            self.over[i] = False
        if mant_bytes(m) > 4 * MAX_LIMBS:
            if self.w is None:
                self.w = np.full(len(self), None, object)
            self.w[i] = Dyadic(m, e)
            self.e[i] = 0
            self.m[i] = 0
            return
        need = (mant_bytes(m) + 3) // 4
        if need > self.m.shape[1]:
            self.m = _widen(self.m, need)
        self.m[i] = _from_int(m, self.m.shape[1])
        self.e[i] = e
        if self.w is not None:
            self.w[i] = None


def _decode_narrow(blob: np.ndarray, st: np.ndarray, ml: np.ndarray, f: np.ndarray, width: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The encoded dyadics at ``blob[st[i]:st[i] + 4 + ml[i]]`` (``ml[i] >= 1`` mantissa bytes, at most
    ``4 * width``): ``width`` normalized limbs and an exponent each, and masks of those that are not canonical, whose
    ``f`` is not their correctly rounded float64, and whose float64 would be subnormal (left to Python ints)
    (:func:`trainhist.mergekernel.decode_dyadics` compiled)."""
    eb = blob[st[:, None] + np.arange(4)[None, :]]
    e = np.ascontiguousarray(eb).view("<i4").ravel().astype(np.int64)
    top = blob[st + 4 + ml - 1]
    # the mantissa bytes of each row, sign-extended to 4 * width bytes: rows filled with the sign, then every
    # stored byte scattered into place
    mb = np.empty((st.size, 4 * width), np.uint8)
    mb[:] = np.where(top >= 0x80, 0xFF, 0).astype(np.uint8)[:, None]
    before = np.cumsum(ml) - ml
    iota = np.arange(int(ml.sum()))
    mb.reshape(-1)[np.repeat(np.arange(st.size) * (4 * width) - before, ml) + iota] = \
        blob[np.repeat(st + 4 - before, ml) + iota]
    nxt = blob[st + 4 + np.maximum(ml - 2, 0)]
    redundant = (ml > 1) & (((top == 0) & (nxt < 0x80)) | ((top == 0xFF) & (nxt >= 0x80)))
    mzero = (ml == 1) & (top == 0)
    noncanon = redundant | (mzero & (e != 0)) | (~mzero & ((mb[:, 0] & 1) == 0))
    limbs = mb.view("<u4").astype(np.int64)
    t = limbs[:, -1]
    limbs[:, -1] = np.where(t >= 1 << 31, t - (1 << 32), t)
    neg, a = _magnitude(limbs)
    nbits, tz = _nbits_tz(a)
    fr, sub = _round(neg, a, e, nbits, tz)
    return limbs, e, noncanon, (fr != f) & ~sub, sub


# -- decode ----------------------------------------------------------------------------------------------------
def decode_exact(name: str, f: np.ndarray, lens: np.ndarray | None, blob: np.ndarray | None, observed: np.ndarray,
                 locate: Callable[[int], tuple[str | None, int, int]]) -> ExactCol:
    """The exact values of one sum column of a chunk, with the checks of spec 5.3.

    ``f``: the f64 column; ``lens``/``blob``: the ``_xn``/``_x`` columns (None when absent; the lengths sum to the
    blob's size, which callers check chunk by chunk, naming the chunk). Rows with a blob are
    checked (canonical encoding, f64 correctly rounded); rows without one take the f64 value, which must be finite
    in observed rows. Rows that are not observed are zero. ``locate(row)`` gives the path, record offset and row
    in its chunk that an error names.
    """

    def bad(i: int, msg: str) -> CorruptError:
        path, offset, j = locate(int(i))
        return CorruptError(msg.format(row=j), code="bad_exact_value", path=path, offset=offset)

    n = f.size
    has = np.zeros(n, bool) if lens is None else lens != 0
    plain = observed & ~has
    bad_f = plain & ~np.isfinite(f)
    if bad_f.any():
        i = int(np.flatnonzero(bad_f)[0])
        raise bad(i, f"{name} row {{row}} is {float(f[i])!r} without an exact {name}_x value")
    out = ExactCol.from_floats(np.where(plain, f, 0.0)) if plain.any() else ExactCol.zeros(n)
    if not has.any():
        return out
    lens = lens.astype(np.int64)
    short = has & (lens < 5)
    if short.any():
        raise bad(np.flatnonzero(short)[0], f"{name}_x row {{row}}: a dyadic needs at least 5 bytes")
    too_long = lens > EXACT_BYTES
    if too_long.any():
        i = int(np.flatnonzero(too_long)[0])
        raise bad(i, f"{name}_x row {{row}}: a dyadic of {int(lens[i])} bytes, more than the {EXACT_BYTES} of spec 5.3 "
                  f"(a mantissa below 2**{MANT_BITS} in magnitude)")
    starts = np.cumsum(lens) - lens
    ix = np.flatnonzero(has)
    st, ml = starts[ix], lens[ix] - 4
    wide = ml > 4 * MAX_LIMBS
    nar = ~wide
    if nar.any():
        i_n, st_n, ml_n = ix[nar], st[nar], ml[nar]
        width = max(2, (int(ml_n.max()) + 3) // 4)
        kern = kernels()
        if kern is not None:
            limbs, e_n, status = kern.decode_dyadics(blob, st_n, ml_n, f[i_n], width)
            noncanon, wrong, sub = status == 1, status == 2, status == 3
        else:
            limbs, e_n, noncanon, wrong, sub = _decode_narrow(blob, st_n, ml_n, f[i_n], width)
        if noncanon.any():
            raise bad(i_n[np.flatnonzero(noncanon)[0]], f"{name}_x row {{row}}: dyadic encoding is not canonical "
                      "(mantissa must be odd and minimal-length)")
        if wrong.any():
            raise bad(i_n[np.flatnonzero(wrong)[0]],
                      f"{name} row {{row}} is not the correctly rounded value of {name}_x")
        for k in np.flatnonzero(sub).tolist():
            if not same_float(Dyadic(_to_int(limbs[k]), int(e_n[k])), float(f[i_n[k]])):
                raise bad(i_n[k], f"{name} row {{row}} is not the correctly rounded value of {name}_x")
        out.m = _widen(out.m, width)
        out.m[i_n] = limbs
        out.e[i_n] = e_n
    if wide.any():
        w = np.full(n, None, object)
        for i, s0, k in zip(ix[wide].tolist(), st[wide].tolist(), ml[wide].tolist()):
            try:
                d = Dyadic.from_bytes(blob[s0 : s0 + 4 + k].tobytes())
            except ValueError:
                raise bad(i, f"{name}_x row {{row}}: dyadic encoding is not canonical (mantissa must be odd and "
                          "minimal-length)") from None
            if not same_float(d, float(f[i])):
                raise bad(i, f"{name} row {{row}} is not the correctly rounded value of {name}_x")
            w[i] = d
        out.w = w
        out.e[ix[wide]] = 0
        out.m[ix[wide]] = 0
    return out


# -- group sums ------------------------------------------------------------------------------------------------
_INT64_SUM_BITS = 62  #: a group whose members and sum stay below 2**62 in magnitude once aligned is summed in int64


def _int64_of(m: np.ndarray) -> np.ndarray:
    """The int64 value of normalized two-limb mantissas (two's complement over 64 bits, so always exact)."""
    return (m[:, 1] << 32) | m[:, 0]


def _two_limbs(v: np.ndarray) -> np.ndarray:
    """Normalized two-limb mantissas of int64 values (the inverse of :func:`_int64_of`)."""
    limbs = np.empty((v.size, 2), np.int64)
    limbs[:, 0] = v & _MASK
    limbs[:, 1] = v >> 32
    return limbs


def _int64_groups(m: np.ndarray, s: np.ndarray, nonzero: np.ndarray, mstart: np.ndarray, sz: np.ndarray,
                  gmin: np.ndarray, allzero: np.ndarray) -> np.ndarray:
    """Per group of two-limb members aligned by ``s`` bits above the group's lowest exponent ``gmin``: whether
    every aligned member and the sum stay below ``2**_INT64_SUM_BITS`` in magnitude (the bit lengths are bounded
    from above through float64, which can only round up) and the sum is no subnormal (``gmin >= -1022``)."""
    k = np.frexp(_int64_of(m).astype(np.float64))[1].astype(np.int64)  # |m| < 2**k
    top = np.maximum.reduceat(np.where(nonzero, k + s, 0), mstart)
    grow = np.frexp((sz - 1).astype(np.float64))[1].astype(np.int64)  # ceil(log2(size)): the sum's extra bits
    return (top + grow <= _INT64_SUM_BITS) & (allzero | (gmin >= -1022))


def _int64_sums(out_f: np.ndarray, out: "ExactCol", m: np.ndarray, s: np.ndarray, mg: np.ndarray,
                mstart: np.ndarray, sz: np.ndarray, quick: np.ndarray, g0: np.ndarray, multi: np.ndarray) -> None:
    """Exact sums of the groups ``quick`` (see :func:`_int64_groups`) in int64, written to rows ``multi[quick]``
    of ``out_f`` (int64 to float64 rounds to nearest even; scaling by ``2**g0`` is exact for normal results) and
    ``out`` (canonical: the trailing zero bits moved into the exponent)."""
    v = _int64_of(m) << s  # exact for the members of quick groups
    if quick.all():
        t = np.add.reduceat(v, mstart)
    else:
        sel = np.flatnonzero(quick[mg])
        qs = sz[quick]
        t = np.add.reduceat(v[sel], np.cumsum(qs) - qs)
        g0 = g0[quick]
    gi = multi[quick]
    with np.errstate(over="ignore"):
        out_f[gi] = np.ldexp(t.astype(np.float64), g0.astype(np.int32))
    mo, eo = canonical_parts(t, g0)
    out.m[gi] = _two_limbs(mo)
    out.e[gi] = eo
    if out.w is not None:
        out.w[gi] = None


def group_sum(f: np.ndarray, x: ExactCol, starts: np.ndarray, sizes: np.ndarray, order: np.ndarray | None = None
              ) -> tuple[np.ndarray, ExactCol]:
    """Exact sums of groups of consecutive rows (``starts``/``sizes``) of the rows taken in ``order`` (default:
    as they are): the rounded f64 and the exact values.

    A group of one row passes through unchanged."""
    first = starts if order is None else order[starts]
    out = x.take(first)
    out_f = f[first].copy()
    multi = np.flatnonzero(sizes > 1)
    if multi.size == 0:
        return out_f, out
    kern = kernels()
    if kern is not None:
        wide = np.zeros(len(x), bool) if x.w is None else np.array([v is not None for v in x.w.tolist()], bool)
        rows = np.arange(len(x)) if order is None else order.astype(np.int64, copy=False)
        fr, mc, eo, nbytes, status = kern.group_sums(x.m, x.e, rows, starts[multi].astype(np.int64, copy=False),
                                                     sizes[multi].astype(np.int64, copy=False), wide, MAX_ACC)
        slow = status == 1
        if not slow.all():
            fast = ~slow
            _store(out, out_f, multi[fast], fr[fast], mc[fast], eo[fast], nbytes[fast], status[fast] == 2,
                   x.m.shape[1])
    else:
        slow = _group_sums(out, out_f, x, starts, sizes, order, multi)
    for j in np.flatnonzero(slow).tolist():
        g = int(multi[j])
        s0 = int(starts[g])
        rows = range(s0, s0 + int(sizes[g])) if order is None else order[s0 : s0 + int(sizes[g])].tolist()
        tot = sum_within([x.get(i) for i in rows])  # (None: wider than spec 5.3 allows, never built)
        if tot is None:
            out_f[g] = 0.0
            out.set_over(g)
        else:
            out_f[g] = tot.to_float()
            out.set_py(g, tot.m, tot.e)
    return out_f, out


def _group_sums(out: ExactCol, out_f: np.ndarray, x: ExactCol, starts: np.ndarray, sizes: np.ndarray,
                order: np.ndarray | None, multi: np.ndarray) -> np.ndarray:
    """:func:`group_sum` of the groups ``multi`` (of several rows each) with numpy, into ``out``/``out_f``, but for
    those returned (a mask over ``multi``: a wide member or a span beyond ``MAX_ACC`` limbs), left to Python ints
    (:func:`trainhist.mergekernel.group_sums` compiled)."""
    sz = sizes[multi]
    mstart = np.cumsum(sz) - sz  # group starts among the members
    mg = np.repeat(np.arange(multi.size), sz)
    if multi.size == starts.size:  # every group has several rows: the members are all the rows
        idx = slice(None) if order is None else order
    else:
        idx = np.repeat(starts[multi] - mstart, sz) + np.arange(mg.size)
        idx = idx if order is None else order[idx]
    e, m = x.e[idx], x.m[idx]
    width = m.shape[1]
    nonzero = (m != 0).any(axis=1)
    gmin = np.minimum.reduceat(np.where(nonzero, e, _BIG), mstart)
    allzero = gmin == _BIG
    s = np.where(nonzero, e - np.where(allzero, 0, gmin)[mg], 0)
    acc_w = np.maximum.reduceat(s, mstart) // 32 + width + 2
    slow = acc_w > MAX_ACC
    if x.w is not None:
        wide_m = np.array([v is not None for v in x.w[idx].tolist()], bool)
        slow |= np.logical_or.reduceat(wide_m, mstart)
    fast = ~slow
    if width == 2:  # groups whose sum fits in int64 are summed there (the limb path below gives the same values)
        quick = _int64_groups(m, s, nonzero, mstart, sz, gmin, allzero) & fast
        if quick.any():
            _int64_sums(out_f, out, m, s, mg, mstart, sz, quick, np.where(allzero, 0, gmin), multi)
            fast &= ~quick
    if fast.any():
        sel = fast[mg]
        A = int(acc_w[fast].max())
        if sel.all():
            sf, mf = s, m
        else:
            fm = np.flatnonzero(sel)
            sf, mf = s[fm], m[fm]
        q, r = sf // 32, sf % 32
        acc = np.zeros((sf.size, A), np.int64)
        flat = acc.reshape(-1)
        base = np.arange(sf.size) * A + q
        for k in range(width):
            v = mf[:, k] << r
            flat[base + k] += v & _MASK
            flat[base + k + 1] += v >> 32
        fstart = np.cumsum(sz[fast]) - sz[fast]
        t = _normalize(np.add.reduceat(acc, fstart, axis=0))
        neg, a = _magnitude(t)
        nbits, tz = _nbits_tz(a)
        g0 = np.where(allzero[fast], 0, gmin[fast])
        fr, sub = _round(neg, a, g0, nbits, tz)
        eo = np.where(nbits == 0, 0, g0 + tz)
        mc = _shr(a, tz, A)
        mc[neg] = -mc[neg]
        _store(out, out_f, multi[fast], fr, _normalize(mc), eo, (nbits - tz) // 8 + 1, sub, width)
    return slow


def _store(out: ExactCol, out_f: np.ndarray, gi: np.ndarray, fr: np.ndarray, mc: np.ndarray, eo: np.ndarray,
           nbytes: np.ndarray, sub: np.ndarray, width: int) -> None:
    """Store group sums in rows ``gi`` of ``out``/``out_f``: ``fr`` their float64 (wrong where ``sub``: a
    subnormal, taken from Python ints here), ``mc``/``eo`` their canonical mantissas (normalized limbs, as wide
    as the accumulator) and exponents, ``nbytes`` their encoded mantissa bytes (wider than ``MAX_LIMBS`` limbs:
    kept as Python ints); ``width``: the members' limbs."""
    wide_out = nbytes > 4 * MAX_LIMBS
    need = int(((nbytes[~wide_out] + 3) // 4).max()) if (~wide_out).any() else 2
    ow = max(width, need, 2)  # (no wider than the accumulator)
    m = mc[:, :ow].copy()
    if ow < mc.shape[1]:  # the cut top limb is signed
        tt = m[:, -1] & _MASK
        m[:, -1] = np.where(tt >= 1 << 31, tt - (1 << 32), tt)
    out.m = _widen(out.m, ow)
    out.m[gi] = np.where(wide_out[:, None], 0, m)
    out.e[gi] = np.where(wide_out, 0, eo)
    if out.w is not None:
        out.w[gi] = None
    out_f[gi] = fr
    for k in np.flatnonzero(sub | wide_out).tolist():
        g = int(gi[k])
        mm = _to_int(mc[k])
        ee = int(eo[k])
        out_f[g] = float_of(mm, ee)
        if wide_out[k]:
            out.set_py(g, mm, ee)


# -- encode ----------------------------------------------------------------------------------------------------
def encode_exact(x: ExactCol) -> tuple[np.ndarray, bytes] | None:
    """The ``_xn`` and ``_x`` columns for the rows whose value is not exactly a finite float64 (None: no row)."""
    n = len(x)
    _, a = _magnitude(x.m)
    nbits, _ = _nbits_tz(a)
    isf = (nbits <= 53) & (x.e >= -1074) & (x.e + nbits <= 1024)
    need = ~isf
    if x.w is not None:
        wide = np.array([v is not None for v in x.w.tolist()], bool)
        need |= wide
    else:
        wide = None
    if not need.any():
        return None
    lens = np.zeros(n, np.uint32)
    mb = nbits // 8 + 1
    rows = np.flatnonzero(need)
    if wide is None or not wide.any():
        width = x.m.shape[1]
        mat = np.empty((rows.size, 4 + 4 * width), np.uint8)
        mat[:, :4] = x.e[rows].astype("<i4").view(np.uint8).reshape(-1, 4)
        mat[:, 4:] = x.m[rows].astype("<u4").view(np.uint8).reshape(-1, 4 * width)
        ln = 4 + mb[rows]
        lens[rows] = ln
        return lens, mat[np.arange(4 + 4 * width)[None, :] < ln[:, None]].tobytes()
    blobs = []
    for i in rows.tolist():
        b = x.get(i).to_bytes()
        lens[i] = len(b)
        blobs.append(b)
    return lens, b"".join(blobs)
