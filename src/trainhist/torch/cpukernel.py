"""Fused CPU reduction kernels: one read of a float32/float64 tensor accumulates a whole ledger row.

The torch-op reduction of :mod:`trainhist.torch.reduce` makes a dozen passes over every tensor (each a separate
kernel with its own output); on a CPU that costs about 10 ns per element, more than many layers' own forward. These
kernels, compiled by numba, make the same row in one pass: integer work on the bit patterns (counts, the raw bin
code, a monotone integer key for min/max) in lanes of the element's own width, and the float64 sums in a separate
loop over the same cache-resident block, unmasked when the block holds no NaN or infinity (the common case).

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
    F = np.float32 if bits == 32 else np.float64
    top = U(bits - 1)
    sign = U(1 << (bits - 1))
    absmask = U((1 << (bits - 1)) - 1)
    expmask = U(((1 << ebits) - 1) << mbits)  # |bits| >= expmask: inf or NaN
    nonfin_bias = U((1 << (bits - 1)) - (((1 << ebits) - 1) << mbits))  # (a + bias) >> top == (a >= expmask)
    fracmask = U((1 << mbits) - 1)
    one = U(1)
    t1, t2, t3 = (U(t) for t in thresh)
    kmax0 = U((1 << bits) - 1)

    @njit(inline="always")
    def key(b):
        """Unsigned integer key with the float order of ``b`` (-0.0 just below +0.0): negatives flipped."""
        return U(b ^ U(U(U(0) - U(b >> top)) | sign))

    @njit(inline="always")
    def unkey(k, tmp):
        """The float whose key is ``k``, as float64 (via the one-element bit buffer ``tmp``)."""
        tmp[0] = U(k ^ sign) if k & sign else U(~k)
        return np.float64(tmp.view(F)[0])

    @njit(inline="always")
    def masked(x, u, start, stop, kr, fl, cnt):
        """A block holding NaN or infinity: count them, and take min/max/sums over the finite elements only."""
        kmin, kmax = kr[0], kr[1]
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
                k = key(b)
                kmin = min(kmin, k)
                kmax = max(kmax, k)
                d = np.float64(x[i])
                s += d
                q += d * d
        kr[0], kr[1] = kmin, kmax
        fl[2] += s
        fl[3] += q

    @njit(inline="always")
    def finish(kr, fl, tmp):
        """Merge the finite min/max keys into the row (its min and negated max, float64)."""
        if kr[0] <= kr[1]:  # some element was finite
            fl[0] = min(fl[0], unkey(kr[0], tmp))
            fl[1] = min(fl[1], -unkey(kr[1], tmp))

    @njit(nogil=True, fastmath=_FASTMATH, boundscheck=False)
    def spine(x, u, row, fl):
        """Add the spine of ``x`` (bits ``u``) to ``row``: five raw counts, min, -max, sum and sum of squares."""
        n = u.size
        kr = np.array([kmax0, U(0)], dtype=U)
        tmp = np.empty(1, dtype=U)
        cnt = np.zeros(2, dtype=np.int64)  # NaN, +inf (masked blocks only)
        nonfin = 0
        zeros = 0
        negzeros = 0
        s = 0.0
        q = 0.0
        for start in range(0, n, BLOCK):
            stop = min(start + BLOCK, n)
            nf = U(0)
            z = U(0)
            nz = U(0)
            kmin = kmax0
            kmax = U(0)
            for i in range(start, stop):
                b = u[i]
                a = U(b & absmask)
                nf = U(nf + U(U(a + nonfin_bias) >> top))
                iz = U(U(a - one) >> top)  # 1 for either zero
                z = U(z + iz)
                nz = U(nz + U(iz & U(b >> top)))
                k = key(b)
                kmin = min(kmin, k)
                kmax = max(kmax, k)
            nonfin += np.int64(nf)
            zeros += np.int64(z)
            negzeros += np.int64(nz)
            if nf == 0:
                kr[0] = min(kr[0], kmin)
                kr[1] = max(kr[1], kmax)
                for i in range(start, stop):
                    d = np.float64(x[i])
                    s += d
                    q += d * d
            else:
                masked(x, u, start, stop, kr, fl, cnt)
        fl[2] += s
        fl[3] += q
        finish(kr, fl, tmp)
        fin_nz = n - nonfin - zeros
        fin_nzbits = fin_nz + negzeros
        row[col_spine] += fin_nz
        row[col_spine + 1] += fin_nzbits
        row[col_spine + 2] += n - (zeros - negzeros)
        row[col_spine + 3] += fin_nzbits + cnt[0]
        row[col_spine + 4] += fin_nzbits + cnt[1]

    @njit(nogil=True, fastmath=_FASTMATH, boundscheck=False)
    def sketch(x, u, row, fl):
        """Add the grid-key counts of ``x`` (raw code folded by ``fold``), min, -max and the sums to ``row``."""
        n = u.size
        kr = np.array([kmax0, U(0)], dtype=U)
        tmp = np.empty(1, dtype=U)
        cnt = np.zeros(2, dtype=np.int64)  # unused here: the NaN/inf counts come from the keys
        hist = np.zeros((4, ncount), dtype=np.int64)  # four copies: consecutive equal keys do not serialise
        codes = np.empty(BLOCK, dtype=np.int32)
        s = 0.0
        q = 0.0
        for start in range(0, n, BLOCK):
            stop = min(start + BLOCK, n)
            nf = U(0)
            kmin = kmax0
            kmax = U(0)
            for i in range(start, stop):
                b = u[i]
                a = U(b & absmask)
                inf_nan = U(U(a + nonfin_bias) >> top)
                nf = U(nf + inf_nan)
                frac = U(b & fracmask)
                e = U(a >> U(mbits))
                raw = (U(4) * e + one + U(frac > t1) + U(frac > t2) + U(frac > t3) - U(frac == 0)
                       + inf_nan * U(shift) + U(b >> top) * U(side))
                codes[i - start] = np.int32(raw)
                k = key(b)
                kmin = min(kmin, k)
                kmax = max(kmax, k)
            for j in range(stop - start):
                hist[j & 3, fold[codes[j]]] += 1
            if nf == 0:
                kr[0] = min(kr[0], kmin)
                kr[1] = max(kr[1], kmax)
                for i in range(start, stop):
                    d = np.float64(x[i])
                    s += d
                    q += d * d
            else:
                masked(x, u, start, stop, kr, fl, cnt)
        fl[2] += s
        fl[3] += q
        finish(kr, fl, tmp)
        for c in range(ncount):
            row[c] += hist[0, c] + hist[1, c] + hist[2, c] + hist[3, c]

    @njit(inline="always")
    def arrays(address, n, row_address):
        x = carray(_pointer(address), n, F)
        row = carray(_pointer(row_address), row_len, np.int64)
        return x, x.view(U), row, row[col_min:].view(np.float64)

    @njit(cache=True, nogil=True)
    def spine_at(address, n, row_address):
        x, u, row, fl = arrays(address, n, row_address)
        spine(x, u, row, fl)

    @njit(cache=True, nogil=True)
    def sketch_at(address, n, row_address):
        x, u, row, fl = arrays(address, n, row_address)
        sketch(x, u, row, fl)

    return spine_at, sketch_at
