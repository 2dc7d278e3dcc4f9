"""Fused CPU reduction kernels: one read of a float32/float64 tensor accumulates a whole ledger row.

The torch-op reduction of :mod:`trainhist.torch.reduce` makes a dozen passes over every tensor (each a separate
kernel with its own output); on a CPU that costs more than many layers' own forward (``tools/bench_reduce.py``
measures both). These
kernels, compiled by numba, make the same row in one pass over memory, in blocks of :data:`BLOCK` elements: a loop
of vector lanes takes the float64 sums (asking for the memory ahead of it), another over the now L1-resident block
the zero counts and the extreme bit patterns (from which min and max follow), and a block that turns out to hold
NaN or infinity (rare) is redone element by element; sketches add the grid key of every element (integer arithmetic
on the bits, in vector lanes) and a histogram of the keys.

They write exactly what :func:`trainhist.torch.reduce.reduce_into` writes: the same counts, bins and min/max bits;
the float64 sums accumulate in another order (``SumMethod.F64`` bounds any order). Nothing here is used off the CPU.
The compiled code is cached on disk by numba (the entry points capture only numbers), so only the first use on a
machine pays the few seconds of compilation.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from numba import carray, njit, types
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["make", "make_merge", "gather_f32", "BLOCK"]

BLOCK = 4096  #: elements per block: the loops of one block share its L1-resident data
#: elements whose keys are computed (in vector lanes) before they are counted (scalar): small enough that the CPU
#: overlaps one group's counting with the next group's arithmetic, which one loop over the block would serialise (a
#: multiple of 8: the counting loop takes two words of four keys per turn)
GROUP = 32
#: the float loop of a block asks for the memory this far ahead of it (8 KiB: measured best, ad hoc, among 2 to 64 KiB
#: on this project's 2-CPU benchmark machine; the spine configuration's kernels took 15-16 ms a step instead of 20)
AHEAD_BYTES = 8192
CHUNK_BYTES = 1024  #: ... one chunk (16 cache lines) at a time, between chunks of its arithmetic
#: lets LLVM split the float64 sums into vector lanes and fuse the square into its sum (exact for float32, whose
#: square fits a float64; within the f64_accumulate bound for float64); no NaN/inf assumptions
_FASTMATH = {"reassoc", "nsz", "contract"}


@intrinsic
def _pointer(typingctx, address):  # noqa: ARG001 -- numba's intrinsic signature
    """The integer ``address`` as a ``void*`` (numba has no cast for it; this is its documented intrinsic)."""

    def codegen(context, builder, signature, args):  # noqa: ARG001
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


# The helpers below take the width's constants as a tuple ``c`` of unsigned integers of the element's width (top
# bit index, sign bit, |x| mask, exponent mask, 1, all ones), ``smin`` (the least signed integer of the width) and the
# unsigned type ``T`` itself: numba widens arithmetic on narrow integers to 64 bits, so every step is cast back to
# keep the vector lanes as narrow as the elements. Inlined into the entry points, where all of it is a compile-time
# constant.


@intrinsic
def _prefetch(typingctx, address):  # noqa: ARG001 -- numba's intrinsic signature
    """A hint to fetch the cache line at the integer ``address`` (LLVM's ``llvm.prefetch``: no effect on the
    program's behaviour, and no fault at any address)."""

    def codegen(context, builder, signature, args):  # noqa: ARG001
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32]), "llvm.prefetch.p0")
        # read, keep in every cache level, data cache
        builder.call(fn, [builder.inttoptr(args[0], cgutils.voidptr_t), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.none(address), codegen


@njit(inline="always")
def _block(x, u, v, acc, cnt, ext, smax_, zeros, c, T):
    """Accumulate one block (``x``, ``u``, ``v``: its elements as floats, unsigned and signed integers): the float64
    sums in one loop, then the least and greatest bit patterns read as unsigned integers and the greatest read as
    signed in another, over the now L1-resident block. Two loops, because one loop takes the vector width of its
    float64 sums for the integers too (half the lanes). The three patterns give the min and max with no per-element
    transform: a set sign bit makes a pattern the largest unsigned, a negative signed one. A block holding NaN or
    infinity (its sum of squares is then not finite; for float64 also a square beyond the range) is redone by
    :func:`_masked`. (The block is passed as views starting at index 0, so the loops need no negative-index handling
    and stay plain vector loops.)

    The float loop goes in chunks of :data:`CHUNK_BYTES`, each first asking for the memory :data:`AHEAD_BYTES`
    further on (past the block's end, into the next block): a tensor the training step wrote a while ago comes
    from memory, and the hardware's own prefetcher does not run that far ahead of the loop, nor across pages.

    The zeros are counted in the integer loop when the previous block held some (``zeros``; ReLU outputs have them
    in every block); otherwise that loop also takes the least signed pattern (+0 is the least unsigned one, -0 the
    least signed one), and a block holding either is counted again in a third loop. Returns whether the block held
    a zero.

    ``acc`` = [min, max, sum, sum of squares] (float64) of the masked blocks' elements and of all blocks; ``cnt`` =
    [NaN, +inf, -inf, zeros, negative zeros, NaN with the sign bit set]; ``ext`` (least, greatest unsigned pattern),
    ``smax_`` (greatest signed pattern): of the other blocks' elements (combined across blocks; made floats once, in
    :func:`_finish`).
    """
    sign, allones = c[1], c[5]
    size = x.itemsize
    chunk = CHUNK_BYTES // size
    base = x.ctypes.data + AHEAD_BYTES
    s = 0.0
    q = 0.0
    for j in range(0, x.size, chunk):
        for line in range(j * size, (j + chunk) * size, 64):
            _prefetch(base + line)
        xs = x[j:j + chunk]
        for i in range(xs.size):
            d = np.float64(xs[i])
            s += d
            q += d * d
    pz = T(0)
    nz = T(0)
    umin = allones
    umax = T(0)
    smax = smax_[0]
    if zeros:
        for i in range(u.size):
            b = u[i]
            pz = T(pz + T(b == T(0)))
            nz = T(nz + T(b == sign))
            umin = min(umin, b)
            umax = max(umax, b)
            smax = max(smax, v[i])
    else:
        smin = v[0]
        for i in range(u.size):
            b = u[i]
            umin = min(umin, b)
            umax = max(umax, b)
            smax = max(smax, v[i])
            smin = min(smin, v[i])
        if umin == 0 or T(smin) == sign:  # +0 is the least unsigned pattern, -0 the least signed one
            for i in range(u.size):
                b = u[i]
                pz = T(pz + T(b == T(0)))
                nz = T(nz + T(b == sign))
    cnt[3] += np.int64(pz) + np.int64(nz)
    cnt[4] += np.int64(nz)
    if not np.isfinite(q):
        _masked(x, u, acc, cnt, c, T)
    else:
        ext[0] = min(ext[0], umin)
        ext[1] = max(ext[1], umax)
        smax_[0] = smax
        acc[2] += s
        acc[3] += q
    return pz + nz > 0


@njit(inline="always")
def _masked(x, u, acc, cnt, c, T):
    """A block holding NaN or infinity: count them (NaN also by sign, for the sketch's keys), and take min/max/sums
    over the finite elements only."""
    top, absmask, expmask = c[0], c[2], c[3]
    mn, mx = acc[0], acc[1]
    s = 0.0
    q = 0.0
    for i in range(x.size):
        b = u[i]
        a = T(b & absmask)
        if a >= expmask:
            if a > expmask:
                cnt[0] += 1
                cnt[5] += np.int64(b >> top)
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
def _start(address, n, row_address, row_len, col_min, F, U, S, c, smin):
    """The views an entry point works on (the elements as floats and as unsigned and signed integers, the row and
    its float64 slots) and the running state :func:`_block` takes."""
    p = _pointer(address)
    row = carray(_pointer(row_address), row_len, np.int64)
    fl = carray(_pointer(row_address + 8 * col_min), row_len - col_min, np.float64)
    acc = np.array([np.inf, -np.inf, 0.0, 0.0])
    cnt = np.zeros(6, dtype=np.int64)
    ext = np.array([c[5], U(0)], dtype=U)
    smax = np.array([smin], dtype=S)
    return carray(p, n, F), carray(p, n, U), carray(p, n, S), row, fl, acc, cnt, ext, smax


@njit(inline="always")
def _finish(acc, ext, smax, fl, ftype, c, T):
    """Add the sums to the row and merge its min and negated max (when some element was finite)."""
    sign = c[1]
    if ext[0] <= ext[1]:  # some element came from a block without NaN or infinity
        tmp = ext.copy()
        tmp[0] = ext[1] if ext[1] >= sign else ext[0]  # the most negative value, else the least non-negative one
        tmp[1] = T(smax[0]) if smax[0] >= 0 else ext[0]  # the greatest non-negative value, else the least negative one
        lo, hi = tmp.view(ftype)
        acc[0] = min(acc[0], np.float64(lo))
        acc[1] = max(acc[1], np.float64(hi))
    fl[2] += acc[2]
    fl[3] += acc[3]
    if acc[0] <= acc[1]:
        fl[0] = min(fl[0], acc[0])
        fl[1] = min(fl[1], -acc[1])


@njit(inline="always")
def _spine(address, n, row_address, L, F, U, S, c, smin):
    """Add the spine of the ``n`` elements at ``address`` to the row at ``row_address``: five raw counts, min,
    -max, sum and sum of squares (``L`` = the row layout: its length, COL_MIN, COL_SPINE)."""
    row_len, col_min, col_spine = L
    x, u, v, row, fl, acc, cnt, ext, smax = _start(address, n, row_address, row_len, col_min, F, U, S, c, smin)
    zeros = False
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        zeros = _block(x[start:stop], u[start:stop], v[start:stop], acc, cnt, ext, smax, zeros, c, U)
    _finish(acc, ext, smax, fl, F, c, U)
    nan, pinf, ninf, zeros, negzeros = cnt[0], cnt[1], cnt[2], cnt[3], cnt[4]
    fin_nz = n - nan - pinf - ninf - zeros
    fin_nzbits = fin_nz + negzeros
    row[col_spine] += fin_nz
    row[col_spine + 1] += fin_nzbits
    row[col_spine + 2] += n - (zeros - negzeros)
    row[col_spine + 3] += fin_nzbits + nan
    row[col_spine + 4] += fin_nzbits + pinf


@njit(inline="always")
def _key(b, k, U):
    """The grid key of the element with bit pattern ``b`` (unsigned type ``U``; ``k``: see :func:`make`), plus
    ``offset - 1``: the caller subtracts that in its histogram's index (for free: an address offset).

    The key of a finite non-zero value with biased exponent ``e`` is ``clamp(4*e + q + 1 - offset, under, over)``,
    plus ``side`` when it is negative; ``q + 1`` is how many of 0 and the three quarter-octave thresholds lie below
    its fraction ``f`` (see :class:`trainhist.torch.reduce._Width`). ``4*e + q`` is read from ``d = b - 1``, as
    ``4*exp(d)`` plus how many of the thresholds minus one lie below ``frac(d)``: when ``f`` is not zero, ``d`` has
    the exponent ``e`` and the fraction ``f - 1``, so that count is ``q + 1`` less the one for ``f > 0``; when ``f``
    is zero, ``d`` has the exponent ``e - 1`` and an all-ones fraction, above every threshold: ``4*(e - 1) + 3`` is
    ``4*e + q`` with ``q = -1`` all the same (one subtraction instead of a comparison with 0 and an addition).
    Clamped to ``[lo, hi] = [offset - 1 + under, offset - 1 + over]``, ``4*e + q`` is the key plus ``offset - 1``.
    Subnormals (``e = 0``) fall below ``lo``: the underflow key, as they should.
    Zeros, infinities and NaN land in their side's overflow (+0 wraps to all ones: the negative side; -0 to the
    positive one) and :func:`_sketch` moves them from there.

    The fraction comparisons take the element's width; the rest is done on its top 32 bits (sign, exponent: for
    float64, four lanes then fill half a vector register). Narrow integers are cast back at every step (numba widens
    them to 64 bits otherwise), and the sign is a signed comparison, not a shift (x86 runs vector shifts on one port).
    """
    fracmask, t1, t2, t3, hshift, eshift, emask, lo, hi, side = k
    W = np.uint32
    d = U(b - U(1))
    frac = U(d & fracmask)
    q = W(U(frac > t1) + U(frac > t2) + U(frac > t3))
    top = W(d >> hshift)
    idx = W(W(W(top >> eshift) & emask) + q)
    return np.uint16(min(max(idx, lo), hi) + W(np.int32(top) < np.int32(0)) * side)


@njit(inline="always")
def _sketch(address, n, row_address, L, F, U, S, c, smin, k, cols, ncount):
    """Add the grid-key counts, min, -max and the sums of the ``n`` elements at ``address`` to the row (``k`` = the
    key constants of :func:`_key`; ``cols`` = the row's key columns: underflow, overflow, the side offset, zero, NaN,
    +inf, -inf, -0.0).

    Each group of :data:`GROUP` elements has its keys computed in vector lanes (:func:`_key`) and then counted in
    eight histograms in turn: neighbours often share a key (a constant tensor, the zeros of a ReLU), and one
    histogram would make each count wait for the previous one's store (four still waited on constant data). Zeros,
    NaN and infinities were counted in their side's overflow key; the spine counts of :func:`_block` (which this
    kernel keeps anyway) move them to their own keys at the end.
    """
    row_len, col_min, _ = L
    x, u, v, row, fl, acc, cnt, ext, smax = _start(address, n, row_address, row_len, col_min, F, U, S, c, smin)
    hist = np.zeros((8, ncount), dtype=np.int64)
    h0, h1, h2, h3, h4, h5, h6, h7 = hist[0], hist[1], hist[2], hist[3], hist[4], hist[5], hist[6], hist[7]
    keys = np.empty(GROUP, dtype=np.uint16)
    # read four keys at a time (which histogram gets which key of a word does not matter, so neither does the
    # byte order)
    words = keys.view(np.uint64)
    under, over, side, kzero, knan, kpinf, kninf, cnegzero = cols
    shift = np.uint64(k[7] - under)  # _key's keys plus this; unsigned: no negative-index fixup
    mask = np.uint64(0xFFFF)
    zeros = False
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        xb, ub, vb = x[start:stop], u[start:stop], v[start:stop]
        m = ub.size
        mg = m - m % GROUP
        for g in range(0, mg, GROUP):
            for i in range(GROUP):
                keys[i] = _key(ub[g + i], k, U)
            for j in range(0, GROUP // 4, 2):
                w = words[j]
                h0[(w & mask) - shift] += 1
                h1[((w >> np.uint64(16)) & mask) - shift] += 1
                h2[((w >> np.uint64(32)) & mask) - shift] += 1
                h3[(w >> np.uint64(48)) - shift] += 1
                w = words[j + 1]
                h4[(w & mask) - shift] += 1
                h5[((w >> np.uint64(16)) & mask) - shift] += 1
                h6[((w >> np.uint64(32)) & mask) - shift] += 1
                h7[(w >> np.uint64(48)) - shift] += 1
        for i in range(mg, m):
            h0[np.uint64(_key(ub[i], k, U)) - shift] += 1
        zeros = _block(xb, ub, vb, acc, cnt, ext, smax, zeros, c, U)
    _finish(acc, ext, smax, fl, F, c, U)
    for j in range(ncount):
        row[j] += h0[j] + h1[j] + h2[j] + h3[j] + h4[j] + h5[j] + h6[j] + h7[j]
    nan, pinf, ninf, zero, negzero, negnan = cnt
    row[over] -= nan - negnan + pinf + negzero
    row[over + side] -= negnan + ninf + zero - negzero
    row[kzero] += zero - negzero
    row[cnegzero] += negzero
    row[knan] += nan
    row[kpinf] += pinf
    row[kninf] += ninf


def make(bits: int, mbits: int, ebits: int, thresh: tuple[int, int, int], offset: int, cols: tuple[int, ...],
         col_spine: int, ncount: int, col_min: int, row_len: int) -> tuple[Callable, ...]:
    """The ``(spine, sketch, many)`` kernels of one IEEE width, for the ledger row layout of :mod:`.reduce` (grid
    keys ``clamp(4*exp + q + 1 - offset, under, over)`` for the quarter-octave ``thresh`` and the key columns
    ``cols`` = underflow, overflow, the negative side's offset, zero, NaN, +inf, -inf and -0.0 (see :func:`_key`),
    :data:`~.reduce.COL_SPINE`, :data:`~.reduce.NCOUNT`, :data:`~.reduce.COL_MIN`, ``row_len`` int64 entries); the
    constants are frozen into the compiled code.

    ``spine`` and ``sketch`` take ``(address, n, row_address)``: the addresses of ``n`` contiguous elements and of
    the int64 ledger row. Passing addresses, not arrays, spares the few microseconds per call that making numpy
    views of a torch tensor costs (hundreds of reductions a step); the caller keeps both alive and guarantees the
    layout. ``many(addresses, ns, row_addresses, sketch)`` makes one of them per entry of three int64 arrays in a
    single call (the parameters, gradients and updates of a step: a hundred calls' dispatch saved).
    """
    U = np.uint32 if bits == 32 else np.uint64
    S = np.int32 if bits == 32 else np.int64
    F = np.float32 if bits == 32 else np.float64
    W = np.uint32
    c = (U(bits - 1), U(1 << (bits - 1)), U((1 << (bits - 1)) - 1), U(((1 << ebits) - 1) << mbits), U(1),
         U((1 << bits) - 1))
    smin = S(-(1 << (bits - 1)))
    under, over, side = cols[:3]
    lo, hi = offset - 1 + under, offset - 1 + over
    emax = (1 << ebits) - 1  # the all-ones exponent: infinities and NaN
    # (the kernel indexes its histograms and the row unchecked: every key and column must lie inside them)
    if not (0 <= under <= over < side and 2 * side <= ncount and all(0 <= x < ncount for x in cols[3:])
            and ncount <= col_spine and col_spine + 5 <= col_min and col_min + 4 <= row_len):
        raise ValueError(f"key columns {cols} do not fit the layout of _key in {ncount} columns of a {row_len}-entry "
                         f"row (spine counts at {col_spine}, floats at {col_min})")
    # keys are uint16; subnormals must clamp to the underflow key, the largest finite values, infinities and NaN
    # (whose 4*exp + q is at least 4*(emax - 1) + 3) to the overflow key, from where _sketch moves the last two
    if not (4 <= lo and hi <= 4 * (emax - 1) + 3 and hi + side < 1 << 16):
        raise ValueError(f"grid offset {offset} puts the keys at [{lo}, {hi}] (side {side}): they must lie in "
                         f"[4, {4 * (emax - 1) + 3}] and below {(1 << 16) - side}")
    hshift = bits - 32  # the top 32 bits: the sign, the exponent and 20 bits of the fraction (float64)
    k = (U((1 << mbits) - 1), U(thresh[0] - 1), U(thresh[1] - 1), U(thresh[2] - 1), U(hshift), W(mbits - hshift - 2),
         W(((1 << ebits) - 1) << 2), W(offset - 1 + under), W(offset - 1 + over), W(side))
    L = (row_len, col_min, col_spine)

    @njit(cache=True, nogil=True, fastmath=_FASTMATH, boundscheck=False)
    def spine(address, n, row_address):
        _spine(address, n, row_address, L, F, U, S, c, smin)

    @njit(cache=True, nogil=True, fastmath=_FASTMATH, boundscheck=False)
    def sketch(address, n, row_address):
        _sketch(address, n, row_address, L, F, U, S, c, smin, k, cols, ncount)

    @njit(cache=True, nogil=True, fastmath=_FASTMATH, boundscheck=False)
    def many(addresses, ns, row_addresses, with_sketch):
        for j in range(addresses.size):
            if with_sketch:
                _sketch(addresses[j], ns[j], row_addresses[j], L, F, U, S, c, smin, k, cols, ncount)
            else:
                _spine(addresses[j], ns[j], row_addresses[j], L, F, U, S, c, smin)

    return spine, sketch, many


@njit(cache=True, nogil=True)
def gather_f32(addresses, numels, index, offsets, out, subtract):
    """For each float32 tensor ``j`` of ``numels[j]`` elements at ``addresses[j]``: its elements at the flat
    positions ``index[offsets[j]:offsets[j+1]]`` into the same slice of ``out``, or (``subtract``) those elements
    minus what ``out`` holds there, in IEEE float32 arithmetic (no fast-math: the sign of a zero difference is
    kept). The parameter update of a step, ``after - before`` on the seeded subvectors of every parameter, in two
    calls. Every position is checked against its tensor's size before anything is read: returns -1, or the first
    ``j`` with a position outside its tensor (then nothing was read or written)."""
    for j in range(addresses.size):
        for i in range(offsets[j], offsets[j + 1]):
            if index[i] < 0 or index[i] >= numels[j]:
                return j
    for j in range(addresses.size):
        x = carray(_pointer(addresses[j]), numels[j], np.float32)
        for i in range(offsets[j], offsets[j + 1]):
            if subtract:
                out[i] = x[index[i]] - out[i]
            else:
                out[i] = x[index[i]]
    return -1


def make_merge(col_min: int, row_len: int) -> Callable:
    """``merge(dst_address, src_address)``: merge one int64 ledger row into another in place (counts add, min and
    negated max take the minimum, sums add), by address like the kernels; the rows must not overlap."""

    @njit(cache=True, nogil=True)
    def merge(dst_address, src_address):
        d = carray(_pointer(dst_address), row_len, np.int64)
        r = carray(_pointer(src_address), row_len, np.int64)
        for k in range(col_min):
            d[k] += r[k]
        f = carray(_pointer(dst_address + 8 * col_min), row_len - col_min, np.float64)
        g = carray(_pointer(src_address + 8 * col_min), row_len - col_min, np.float64)
        f[0] = min(f[0], g[0])
        f[1] = min(f[1], g[1])
        f[2] += g[2]
        f[3] += g[3]

    return merge
