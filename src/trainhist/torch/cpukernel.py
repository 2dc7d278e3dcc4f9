"""Fused CPU reduction kernels: one read of a float32/float64 tensor accumulates a whole ledger row.

The torch-op reduction of :mod:`trainhist.torch.reduce` makes a dozen passes over every tensor (each a separate
kernel with its own output); on a CPU that costs about 10 ns per element, more than many layers' own forward. These
kernels, compiled by numba, make the same row in one pass over blocks of :data:`BLOCK` elements: one loop of vector
lanes takes the float64 sums, the zero counts and the extreme bit patterns (from which min and max follow), and a
block that turns out to hold NaN or infinity (rare) is redone element by element; sketches add the raw bin code of
every element (integer arithmetic on the bits) and a histogram of them.

They write exactly what :func:`trainhist.torch.reduce.reduce_into` writes: the same counts, bins and min/max bits;
the float64 sums accumulate in another order (``SumMethod.F64`` bounds any order). Nothing here is used off the CPU.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["make", "BLOCK"]


@intrinsic
def _pointer(typingctx, address):  # noqa: ARG001 -- numba's intrinsic signature
    """The integer ``address`` as a ``void*`` (numba has no cast for it; this is its documented intrinsic)."""

    def codegen(context, builder, signature, args):  # noqa: ARG001
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen

BLOCK = 4096  #: elements per block: the integer and float loops of one block share the L1-resident data
_FASTMATH = {"reassoc", "nsz"}  # lets LLVM split the float64 sums into vector lanes; no NaN/inf assumptions


def make(bits: int, mbits: int, ebits: int, thresh: tuple[int, int, int], shift: int, side: int,
         col_spine: int, ncount: int, col_min: int, row_len: int, fold: np.ndarray) -> tuple[Callable, Callable]:
    """The ``(spine, sketch)`` kernels of one IEEE width, for the ledger row layout of :mod:`.reduce` (raw codes
    folded to keys by ``fold``, :data:`~.reduce.COL_SPINE`, :data:`~.reduce.NCOUNT`, :data:`~.reduce.COL_MIN`,
    ``row_len`` int64 entries); the constants are frozen into the compiled code, which numba builds on first call
    and caches on disk.

    Both take ``(address, n, row_address)``: the addresses of ``n`` contiguous elements and of the int64 ledger row.
    Passing addresses, not arrays, spares the few microseconds per call that making numpy views of a torch tensor
    costs (a thousand reductions a step); the caller keeps both alive and guarantees the layout.
    """
    U = np.uint32 if bits == 32 else np.uint64
    S = np.int32 if bits == 32 else np.int64
    F = np.float32 if bits == 32 else np.float64
    top = U(bits - 1)
    sign = U(1 << (bits - 1))
    absmask = U((1 << (bits - 1)) - 1)
    expmask = U(((1 << ebits) - 1) << mbits)  # |bits| >= expmask: inf or NaN
    fracmask = U((1 << mbits) - 1)
    one = U(1)
    t1, t2, t3 = (U(t) for t in thresh)
    umax0 = U((1 << bits) - 1)
    keys = fold.astype(np.uint16)  # raw code -> grid key (all below ncount)
    smin0, smax0 = S((1 << (bits - 1)) - 1), S(-(1 << (bits - 1)))

    @njit(inline="always")
    def block(x, u, v, start, stop, acc, cnt, ext, sext):
        """Accumulate one block: the float64 sums, the zeros and negative zeros, and the least and greatest bit
        patterns read as unsigned and as signed integers, all in one loop of vector lanes. Those four give the
        block's min and max with no per-element transform: a set sign bit makes a pattern the largest unsigned,
        the smallest signed. A block holding NaN or infinity (its sum of squares is then not finite; for float64
        also a square beyond the range) is redone by :func:`masked`.

        ``acc`` = [min, max, sum, sum of squares] (float64) of the masked blocks' elements and of all blocks; ``cnt`` =
        [NaN, +inf, -inf, zeros, negative zeros]; ``ext``, ``sext``: the least and greatest unsigned and signed
        patterns of the other blocks' elements (combined across blocks; made floats once, in :func:`finish`).
        """
        s = 0.0
        q = 0.0
        z = U(0)
        nz = U(0)
        umin = umax0
        umax = U(0)
        smin = smin0
        smax = smax0
        for i in range(start, stop):
            b = u[i]
            w = v[i]
            d = np.float64(x[i])
            s += d
            q += d * d
            z = U(z + U(U(U(b & absmask) - one) >> top))  # either zero
            nz = U(nz + U(b == sign))
            umin = min(umin, b)
            umax = max(umax, b)
            smin = min(smin, w)
            smax = max(smax, w)
        cnt[3] += np.int64(z)
        cnt[4] += np.int64(nz)
        if not np.isfinite(q):
            masked(x, u, start, stop, acc, cnt)
            return
        ext[0] = min(ext[0], umin)
        ext[1] = max(ext[1], umax)
        sext[0] = min(sext[0], smin)
        sext[1] = max(sext[1], smax)
        acc[2] += s
        acc[3] += q

    @njit(inline="always")
    def masked(x, u, start, stop, acc, cnt):
        """A block holding NaN or infinity: count them, and take min/max/sums over the finite elements only."""
        mn, mx = acc[0], acc[1]
        s = 0.0
        q = 0.0
        for i in range(start, stop):
            b = u[i]
            a = U(b & absmask)
            if a >= expmask:
                if a > expmask:
                    cnt[0] += 1
                elif b == expmask:
                    cnt[1] += 1
                else:
                    cnt[2] += 1
            else:
                d = np.float64(x[i])
                mn = min(mn, d)
                mx = max(mx, d)
                s += d
                q += d * d
        acc[0], acc[1] = mn, mx
        acc[2] += s
        acc[3] += q

    @njit(inline="always")
    def finish(acc, ext, sext, fl):
        """Add the sums to the row and merge its min and negated max (when some element was finite)."""
        if ext[0] <= ext[1]:  # some element came from a block without NaN or infinity
            tmp = np.empty(2, dtype=U)
            tmp[0] = ext[1] if ext[1] >= sign else ext[0]  # the most negative value, else the least non-negative
            tmp[1] = U(sext[1]) if sext[1] >= 0 else ext[0]  # the greatest non-negative value, else the least negative
            lo, hi = tmp.view(F)
            acc[0] = min(acc[0], np.float64(lo))
            acc[1] = max(acc[1], np.float64(hi))
        fl[2] += acc[2]
        fl[3] += acc[3]
        if acc[0] <= acc[1]:
            fl[0] = min(fl[0], acc[0])
            fl[1] = min(fl[1], -acc[1])

    @njit(nogil=True, fastmath=_FASTMATH, boundscheck=False)
    def spine(x, u, v, row, fl):
        """Add the spine of ``x`` (bits ``u``, ``v`` unsigned and signed) to ``row``: five raw counts, min, -max,
        sum and sum of squares."""
        n = u.size
        acc = np.array([np.inf, -np.inf, 0.0, 0.0])
        cnt = np.zeros(5, dtype=np.int64)
        ext = np.array([umax0, U(0)], dtype=U)
        sext = np.array([smin0, smax0], dtype=S)
        for start in range(0, n, BLOCK):
            block(x, u, v, start, min(start + BLOCK, n), acc, cnt, ext, sext)
        finish(acc, ext, sext, fl)
        nan, pinf, ninf, zeros, negzeros = cnt
        fin_nz = n - nan - pinf - ninf - zeros
        fin_nzbits = fin_nz + negzeros
        row[col_spine] += fin_nz
        row[col_spine + 1] += fin_nzbits
        row[col_spine + 2] += n - (zeros - negzeros)
        row[col_spine + 3] += fin_nzbits + nan
        row[col_spine + 4] += fin_nzbits + pinf

    @njit(nogil=True, fastmath=_FASTMATH, boundscheck=False)
    def sketch(x, u, v, row, fl):
        """Add the grid-key counts of ``x`` (raw code folded by ``keys``), min, -max and the sums to ``row``."""
        n = u.size
        acc = np.array([np.inf, -np.inf, 0.0, 0.0])
        cnt = np.zeros(5, dtype=np.int64)  # not used: the keys count zeros, NaN and infinities
        ext = np.array([umax0, U(0)], dtype=U)
        sext = np.array([smin0, smax0], dtype=S)
        hist = np.zeros(ncount, dtype=np.int64)
        codes = np.empty(BLOCK, dtype=U)  # unsigned codes and keys: numba indexes them with no negative-index fixup
        for start in range(0, n, BLOCK):
            stop = min(start + BLOCK, n)
            for i in range(start, stop):  # the raw code (see reduce._Width), in vector lanes
                b = u[i]
                a = U(b & absmask)
                frac = U(b & fracmask)
                raw = (U(4) * U(a >> U(mbits)) + one + U(frac > t1) + U(frac > t2) + U(frac > t3) - U(frac == 0)
                       + U(a >= expmask) * U(shift) + U(b >> top) * U(side))
                codes[i - start] = raw
            for j in range(stop - start):
                hist[keys[codes[j]]] += 1
            block(x, u, v, start, stop, acc, cnt, ext, sext)
        finish(acc, ext, sext, fl)
        for c in range(ncount):
            row[c] += hist[c]

    @njit(inline="always")
    def arrays(address, n, row_address):
        p = _pointer(address)
        row = carray(_pointer(row_address), row_len, np.int64)
        fl = carray(_pointer(row_address + 8 * col_min), row_len - col_min, np.float64)
        return carray(p, n, F), carray(p, n, U), carray(p, n, S), row, fl

    @njit(cache=True, nogil=True)
    def spine_at(address, n, row_address):
        x, u, v, row, fl = arrays(address, n, row_address)
        spine(x, u, v, row, fl)

    @njit(cache=True, nogil=True)
    def sketch_at(address, n, row_address):
        x, u, v, row, fl = arrays(address, n, row_address)
        sketch(x, u, v, row, fl)

    return spine_at, sketch_at


def make_merge(col_min: int, row_len: int) -> Callable:
    """``merge(dst_address, src_address)``: merge one int64 ledger row into another in place (counts add, min and
    negated max take the minimum, sums add), by address like the kernels; the rows must not overlap."""

    @njit(cache=True, nogil=True)
    def merge(dst_address, src_address):
        d = carray(_pointer(dst_address), row_len, np.int64)
        r = carray(_pointer(src_address), row_len, np.int64)
        for c in range(col_min):
            d[c] += r[c]
        f = carray(_pointer(dst_address + 8 * col_min), row_len - col_min, np.float64)
        g = carray(_pointer(src_address + 8 * col_min), row_len - col_min, np.float64)
        f[0] = min(f[0], g[0])
        f[1] = min(f[1], g[1])
        f[2] += g[2]
        f[3] += g[3]

    return merge
