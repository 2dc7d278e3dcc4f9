"""Compiled kernels for merge's per-count loops (numba; loaded through :func:`trainhist.fastpath.kernels`).

Each kernel does in one pass over the data what the numpy code beside its caller does with whole-array
operations (each docstring names it), and gives the same values bit for bit, with the same checks: numpy spent
much of a merge of writer-default shards there, in temporaries and index arrays. The kernels decode the integer
columns of a batch of chunks (:func:`unpack`) and its exact values (:func:`decode_dyadics`), and combine rows:
sparse sketch ranges and counts (:func:`union_add`), exact group sums (:func:`group_sums`). Values are integers
throughout, but for the correctly rounded float64 of an exact value, which takes the same operations as
``exactvec._round``. The compiled code is cached on disk (``cache=True``): only the first use on a machine pays
the compilation.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["union_add", "decode_dyadics", "group_sums", "unpack"]


@njit(cache=True, nogil=True)
def union_add(order: np.ndarray, starts: np.ndarray, sizes: np.ndarray, lo: np.ndarray, n: np.ndarray,
              counts: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sparse sketches of groups of rows (the rows ``order[starts[k]:starts[k] + sizes[k]]`` of group ``k``):
    per group and sign the union of its rows' ranges (``lo``, ``n``: (rows, 2) first bin and length; ``counts``:
    every range's counts in row-major order), an empty union at bin 0, and the counts added into it (no sum
    wraps: the caller checked; the additions run in the order of ``counts``, which gives the same sums). Returns
    the groups' first bins, lengths and counts, as ``merge._union_add`` makes them."""
    g = starts.size
    group = np.empty(lo.shape[0], np.int64)
    glo = np.empty((g, 2), np.int64)
    gn = np.empty((g, 2), np.int64)
    gfirst = np.empty((g, 2), np.int64)
    total = 0
    for k in range(g):
        for s in range(2):
            a = nb
            b = 0
            for j in range(starts[k], starts[k] + sizes[k]):
                r = order[j]
                group[r] = k
                if n[r, s] > 0:
                    a = min(a, lo[r, s])
                    b = max(b, lo[r, s] + n[r, s])
            if b <= a:
                a = b = 0
            glo[k, s] = a
            gn[k, s] = b - a
            gfirst[k, s] = total
            total += b - a
    acc = np.zeros(total, np.uint64)
    c = 0
    for r in range(lo.shape[0]):
        k = group[r]
        for s in range(2):
            m = n[r, s]
            at = gfirst[k, s] - glo[k, s] + lo[r, s]
            dst = acc[at : at + m]  # (slices: the loop below then runs in vector lanes)
            src = counts[c : c + m]
            for t in range(m):
                dst[t] += src[t]
            c += m
    return glo, gn, acc


# -- exact values: m * 2**e, the mantissa as 32-bit limbs in int64 (exactvec's layout) --------------------------
@njit(cache=True)
def _normalize(t: np.ndarray) -> None:
    """Propagate carries in place: every limb but the top in [0, 2**32) (exactvec._normalize on one row)."""
    for k in range(t.size - 1):
        t[k + 1] += t[k] >> 32
        t[k] &= 0xFFFFFFFF


@njit(cache=True)
def _bitlen(v: int) -> int:
    """Bit length of ``0 <= v < 2**53`` (through float64, as exactvec._bitlen)."""
    return math.frexp(float(v))[1]


@njit(cache=True)
def _nbits_tz(a: np.ndarray) -> tuple[int, int]:
    """Bit length and trailing zero bits of non-negative normalized limbs (0 and 0 for zero)."""
    h = -1
    z = -1
    for k in range(a.size):
        if a[k] != 0:
            h = k
            if z < 0:
                z = k
    if h < 0:
        return 0, 0
    return 32 * h + _bitlen(a[h]), 32 * z + _bitlen(a[z] & -a[z]) - 1


@njit(cache=True)
def _nonzero(m: np.ndarray, r: int) -> bool:
    """Whether row ``r`` of the limbs ``m`` is not zero."""
    for k in range(m.shape[1]):
        if m[r, k] != 0:
            return True
    return False


@njit(cache=True)
def _limb(a: np.ndarray, k: int) -> int:
    return a[k] if k < a.size else 0


@njit(cache=True)
def _round(a: np.ndarray, e: int, neg: bool, nbits: int, tz: int) -> tuple[float, bool]:
    """Correctly rounded float64 of ``+-a * 2**e`` and whether the result is subnormal (which the caller must
    take from the Python path): exactvec._round on one row, the same operations (the top 63 bits with a sticky
    bit, one int64 to float64 rounding, an exact scaling)."""
    ps = max(nbits - 63, 0)
    q = ps >> 5
    r = ps & 31
    v = (_limb(a, q) >> r) | (_limb(a, q + 1) << (32 - r))  # below 2**63: the bits ps .. ps + 62 of a
    if r:
        v |= _limb(a, q + 2) << (64 - r)
    if ps > 0 and tz < ps:
        v |= 1
    f = math.ldexp(float(v), min(max(e + ps, -4000), 4000))
    return -f if neg else f, nbits > 0 and e + nbits - 1 < -1022


@njit(cache=True)
def _magnitude(t: np.ndarray, a: np.ndarray) -> bool:
    """``|t|`` (normalized limbs, the top signed) into ``a`` (which may be ``t``), normalized; whether ``t`` is
    negative."""
    neg = t[t.size - 1] < 0
    for k in range(t.size):
        a[k] = -t[k] if neg else t[k]
    if neg:
        _normalize(a)
    return neg


@njit(cache=True, nogil=True)
def decode_dyadics(blob: np.ndarray, st: np.ndarray, ml: np.ndarray, f: np.ndarray, width: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The encoded dyadics (spec 5.3) at ``blob[st[i]:st[i] + 4 + ml[i]]`` (``ml[i] >= 1`` mantissa bytes, at most
    ``4 * width``) as ``width`` normalized limbs and an exponent each, and a status each: 0 fine, 1 not canonical,
    2 ``f[i]`` is not its correctly rounded float64, 3 that float64 would be subnormal (the caller checks it with
    Python ints): ``exactvec.decode_exact``'s narrow rows in one pass."""
    k = st.size
    limbs = np.empty((k, width), np.int64)
    e = np.empty(k, np.int64)
    status = np.zeros(k, np.int8)
    a = np.empty(width, np.int64)
    for i in range(k):
        s0 = st[i]
        n = ml[i]
        p = s0 + 4
        ev = np.int64(blob[s0]) | (np.int64(blob[s0 + 1]) << 8) | (np.int64(blob[s0 + 2]) << 16) | \
            (np.int64(blob[s0 + 3]) << 24)
        if ev >= 1 << 31:
            ev -= 1 << 32
        e[i] = ev
        top = blob[p + n - 1]
        fill = np.int64(0xFF) if top >= 0x80 else np.int64(0)
        for j in range(width):  # (into a, not a view of limbs: a view per row costs as much as the rest)
            u = np.int64(0)
            for b in range(4):
                at = 4 * j + b
                u |= (np.int64(blob[p + at]) if at < n else fill) << (8 * b)
            a[j] = u
        if a[width - 1] >= 1 << 31:
            a[width - 1] -= 1 << 32
        for j in range(width):
            limbs[i, j] = a[j]
        nxt = blob[p + max(n - 2, 0)]
        redundant = n > 1 and ((top == 0 and nxt < 0x80) or (top == 0xFF and nxt >= 0x80))
        mzero = n == 1 and top == 0
        if redundant or (mzero and ev != 0) or (not mzero and (blob[p] & 1) == 0):
            status[i] = 1
            continue
        neg = _magnitude(a, a)
        nbits, tz = _nbits_tz(a)
        fr, sub = _round(a, ev, neg, nbits, tz)
        if sub:
            status[i] = 3
        elif fr != f[i]:
            status[i] = 2
    return limbs, e, status


@njit(cache=True, nogil=True)
def group_sums(m: np.ndarray, e: np.ndarray, order: np.ndarray, gstart: np.ndarray, gsize: np.ndarray,
               wide: np.ndarray, max_acc: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Exact sums of groups of exact values (``m``: normalized limbs, ``e``: exponents; group ``g`` holds the rows
    ``order[gstart[g]:gstart[g] + gsize[g]]``), each aligned to its group's lowest exponent in an accumulator of
    ``A`` limbs (the widest group's span, as ``exactvec.group_sum``). Per group: the correctly rounded float64,
    the canonical mantissa as ``A`` normalized limbs (the top signed) and its exponent, its minimal encoded
    length in bytes (spec 5.3), and a status: 0 fine, 1 left to the Python path (a ``wide`` member, or a span of
    more than ``max_acc`` limbs; nothing else is set), 2 the float64 is subnormal (the caller takes it from
    Python ints)."""
    g = gstart.size
    w = m.shape[1]
    status = np.zeros(g, np.int8)
    base = np.zeros(g, np.int64)
    acc = 0
    for j in range(g):
        lo = np.int64(1) << 62
        for i in range(gstart[j], gstart[j] + gsize[j]):
            r = order[i]
            if _nonzero(m, r):
                lo = min(lo, e[r])
        if lo == np.int64(1) << 62:
            lo = 0
        span = 0
        for i in range(gstart[j], gstart[j] + gsize[j]):
            r = order[i]
            if wide[r]:
                status[j] = 1
            if _nonzero(m, r):
                span = max(span, e[r] - lo)
        need = span // 32 + w + 2
        if need > max_acc:
            status[j] = 1
        base[j] = lo
        if status[j] == 0:
            acc = max(acc, need)
    f = np.zeros(g, np.float64)
    mc = np.zeros((g, acc), np.int64)
    eo = np.zeros(g, np.int64)
    nbytes = np.zeros(g, np.int64)
    t = np.empty(acc, np.int64)
    a = np.empty(acc, np.int64)
    for j in range(g):
        if status[j] == 1:
            continue
        t[:] = 0
        for i in range(gstart[j], gstart[j] + gsize[j]):
            r = order[i]
            if not _nonzero(m, r):  # (its exponent is 0, not aligned)
                continue
            s = e[r] - base[j]
            q = s >> 5
            sh = s & 31
            for k in range(w):
                v = m[r, k] << sh
                t[q + k] += v & 0xFFFFFFFF
                t[q + k + 1] += v >> 32
        _normalize(t)
        neg = _magnitude(t, a)
        nbits, tz = _nbits_tz(a)
        f[j], sub = _round(a, base[j], neg, nbits, tz)
        if sub:
            status[j] = 2
        eo[j] = 0 if nbits == 0 else base[j] + tz
        nbytes[j] = (nbits - tz) // 8 + 1
        q = tz >> 5
        sh = tz & 31
        out = mc[j]
        for k in range(acc):  # a >> tz, negated when t is
            v = ((_limb(a, q + k) >> sh) | (_limb(a, q + k + 1) << (32 - sh))) & 0xFFFFFFFF
            out[k] = -v if neg else v
        if neg:
            _normalize(out)
    return f, mc, eo, nbytes, status


# -- integer columns ----------------------------------------------------------------------------------------
@njit(cache=True)
def _le(buf: np.ndarray, at: int, size: int) -> np.uint64:
    """The unsigned little-endian integer of ``size`` bytes at ``buf[at:]``."""
    v = np.uint64(0)
    for b in range(size):
        v |= np.uint64(buf[at + b]) << np.uint64(8 * b)
    return v


@njit(cache=True, nogil=True)
def unpack(buf: np.ndarray, codec: np.ndarray, start: np.ndarray, slen: np.ndarray, ns: np.ndarray, out: np.ndarray,
           signed: bool, lo: np.uint64, hi: np.uint64) -> tuple[int, bool]:
    """One integer column of many chunks (block ``i``: ``slen[i]`` bytes at ``buf[start[i]:]``, ``ns[i]`` values
    stored with codec ``codec[i]``: -1 absent (zeros), raw, frame of reference or patched bytes; spec 7.3)
    concatenated into ``out`` (the unsigned integers of the column's item size; ``signed``, ``lo``, ``hi``: whether
    the column is signed, and its range as 64-bit patterns). Returns a bound on the values of patched blocks (254,
    or their largest exception) and whether every block passes the checks of ``batchdecode._decode_run`` (the
    layout's checks passed already): ``batchdecode.gather`` in one pass."""
    size = out.itemsize
    bound = np.uint64(254)
    at = 0
    for i in range(ns.size):
        n = ns[i]
        x = start[i]
        dst = out[at : at + n]
        c = codec[i]
        if c == -1:
            dst[:] = 0
        elif c == 0:  # raw
            for j in range(n):
                dst[j] = _le(buf, x + size * j, size)
        elif c == 3:  # frame of reference: an 8-byte base, then n offsets of w bytes
            w = (slen[i] - 8) // n if n else -1
            if (w != 0 and w != 1 and w != 2 and w != 4 and w != 8) or slen[i] != 8 + n * w:
                return bound, False
            base = _le(buf, x, 8)
            if (np.int64(base) < np.int64(lo) or np.int64(base) > np.int64(hi)) if signed else base > hi:
                return bound, False
            room = hi - base
            for j in range(n):
                v = _le(buf, x + 8 + w * j, w)
                if v > room:
                    return bound, False
                dst[j] = base + v
        elif c == 5:  # patched bytes: the exceptions, then a code byte per value (255: the next exception)
            kb = slen[i] - n
            if kb < 0 or kb % size:
                return bound, False
            src = buf[x + kb : x + kb + n]
            esc = 0
            for j in range(n):  # (a loop of vector lanes: no branch)
                v = src[j]
                dst[j] = v
                esc += v == 255
            if esc * size != kb:
                return bound, False
            for j in range(n if esc else 0):
                if src[j] == 255:
                    v = _le(buf, x, size)
                    if v < 255:
                        return bound, False
                    bound = max(bound, v)
                    dst[j] = v
                    x += size
        else:
            return bound, False
        at += n
    return bound, True
