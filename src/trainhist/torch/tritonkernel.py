"""Fused GPU reduction kernel (Triton): one read of a tensor accumulates a whole ledger row, in one launch.

The torch-op reduction of :mod:`trainhist.torch.reduce` launches a couple of dozen kernels per tensor; on a GPU the
host spends more time launching them than the device spends running them, and every one of them reads the tensor
again. Here one kernel reads it once: each program walks a strided set of blocks, computes every element's grid key
from its bits (integer arithmetic, the same as :func:`reduce._raw_codes` and the fold table), histograms the keys
in registers and adds its histogram to the row with integer atomics (exact in any order), and writes its finite
min, negated max and float64 sums to a partials buffer; the last program to finish (an atomic ticket) folds the
partials, in program order, into the row's float columns: the row, sums included, is the same from run to run
(for the same kernel and tensor sizes: another method, or the batched kernel, sums in another order).

The row is always written with its full key counts (a *sketch* row; decoding it asks for the spine alone where no
sketch is due): on a GPU the keys cost no extra pass. float16 and bfloat16 are read as they are and widened in
registers (exactly: bfloat16 by shifting its bits), float32 and float64 natively; other dtypes and non-contiguous
tensors are widened by the caller.

Needs Triton (installed with torch's CUDA builds on Linux). With ``TRITON_INTERPRET=1`` the kernels run on CPU
tensors in Triton's interpreter, which is how the test suite checks them on a machine without a GPU.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["reduce_row", "reduce_many", "NBINS", "BLOCK", "CHUNK_BLOCKS"]

BLOCK = 1024  #: elements per program per turn of its loop
NBINS = 1024  #: histogram width: a power of two above every key (the keys past the row's counts land in DUMP)
MAXPROG = 1024  #: most programs of one reduction (the last one reads all their partials in one block)
CHUNK_BLOCKS = 8  #: blocks per program in a batched reduction (each tensor is cut into chunks of this many blocks)


@triton.jit
def _start(BLOCK: tl.constexpr, NBINS: tl.constexpr):
    """A program's empty accumulators: histogram, min, negated max, sum, sum of squares (per lane)."""
    inf = tl.full([BLOCK], float("inf"), dtype=tl.float64)
    zero = tl.zeros([BLOCK], dtype=tl.float64)
    return tl.zeros([NBINS], dtype=tl.int64), inf, inf, zero, zero


@triton.jit
def _block(x_ptr, offs, m, fold_ptr, hist, mn, nmx, s1, s2,
           BF16: tl.constexpr, ITYPE: tl.constexpr, FTYPE: tl.constexpr, MBITS: tl.constexpr, EMAX: tl.constexpr,
           T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, SHIFT: tl.constexpr, SIDE: tl.constexpr,
           DUMP: tl.constexpr, NBINS: tl.constexpr):
    """One block: the grid key of every element into the histogram, the finite ones into min, -max and sums."""
    if BF16:  # (read as int16: its bits shifted up are the float32's, exactly, subnormals included)
        bits = tl.load(x_ptr + offs, mask=m, other=0).to(tl.int32) << 16
        v = bits.to(tl.float32, bitcast=True)
    else:
        v = tl.load(x_ptr + offs, mask=m, other=0.0).to(FTYPE)  # float16 widens exactly
        bits = v.to(ITYPE, bitcast=True)
    frac = bits & ((1 << MBITS) - 1)
    exp = (bits >> MBITS) & EMAX
    raw = (exp * 4 + 1 + (frac > T0).to(ITYPE) + (frac > T1).to(ITYPE) + (frac > T2).to(ITYPE)
           - (frac == 0).to(ITYPE))
    raw = raw + tl.where(exp == EMAX, SHIFT, 0) + tl.where(bits < 0, SIDE, 0)
    key = tl.load(fold_ptr + raw, mask=m, other=DUMP)
    key = tl.where(m, key, DUMP).to(tl.int32)
    hist += tl.histogram(key, NBINS).to(tl.int64)
    fin = m & (exp != EMAX)
    w = v.to(tl.float64)
    z = tl.where(fin, w, 0.0)
    mn = tl.minimum(mn, tl.where(fin, w, float("inf")))
    nmx = tl.minimum(nmx, tl.where(fin, -w, float("inf")))
    return hist, mn, nmx, s1 + z, s2 + z * z


@triton.jit
def _finish(row_ptr, f_ptr, part_ptr, slot, hist, mn, nmx, s1, s2, ticket_ptr, first, nparts,
            NCOUNT: tl.constexpr, NBINS: tl.constexpr, MAXPROG: tl.constexpr):
    """Add the histogram to the row (integer atomics), write this program's partials to ``slot``; the last of the
    ``nparts`` programs of the row (atomic ticket) folds their partials (slots ``first`` on), in slot order, into
    the row's float columns and re-arms the ticket."""
    bins = tl.arange(0, NBINS)
    tl.atomic_add(row_ptr + bins, hist, mask=(bins < NCOUNT) & (hist != 0), sem="relaxed")  # (never read here)
    tl.store(part_ptr + slot * 4 + 0, tl.min(mn, axis=0))
    tl.store(part_ptr + slot * 4 + 1, tl.min(nmx, axis=0))
    tl.store(part_ptr + slot * 4 + 2, tl.sum(s1, axis=0))
    tl.store(part_ptr + slot * 4 + 3, tl.sum(s2, axis=0))
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == nparts - 1:
        lanes = tl.arange(0, MAXPROG)
        a = tl.full([MAXPROG], float("inf"), dtype=tl.float64)
        b = tl.full([MAXPROG], float("inf"), dtype=tl.float64)
        c = tl.zeros([MAXPROG], dtype=tl.float64)
        d = tl.zeros([MAXPROG], dtype=tl.float64)
        for j in range(0, nparts, MAXPROG):
            pm = j + lanes < nparts
            q = part_ptr + (first + j + lanes) * 4
            a = tl.minimum(a, tl.load(q + 0, mask=pm, other=float("inf"), cache_modifier=".cg"))
            b = tl.minimum(b, tl.load(q + 1, mask=pm, other=float("inf"), cache_modifier=".cg"))
            c += tl.load(q + 2, mask=pm, other=0.0, cache_modifier=".cg")
            d += tl.load(q + 3, mask=pm, other=0.0, cache_modifier=".cg")
        tl.store(f_ptr + 0, tl.minimum(tl.load(f_ptr + 0), tl.min(a, axis=0)))
        tl.store(f_ptr + 1, tl.minimum(tl.load(f_ptr + 1), tl.min(b, axis=0)))
        tl.store(f_ptr + 2, tl.load(f_ptr + 2) + tl.sum(c, axis=0))
        tl.store(f_ptr + 3, tl.load(f_ptr + 3) + tl.sum(d, axis=0))
        tl.store(ticket_ptr, 0)


@triton.jit(do_not_specialize=["n", "iters"])
def _row_kernel(x_ptr, n, iters, fold_ptr, row_ptr, f_ptr, part_ptr, ticket_ptr,
                BF16: tl.constexpr, ITYPE: tl.constexpr, FTYPE: tl.constexpr, MBITS: tl.constexpr,
                EMAX: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, SHIFT: tl.constexpr,
                SIDE: tl.constexpr, NCOUNT: tl.constexpr, DUMP: tl.constexpr, BLOCK: tl.constexpr,
                NBINS: tl.constexpr, MAXPROG: tl.constexpr):
    """One tensor: each program walks every ``num_programs``-th block."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    hist, mn, nmx, s1, s2 = _start(BLOCK, NBINS)
    for i in range(iters):
        offs = (pid + i * nprog).to(tl.int64) * BLOCK + lanes
        hist, mn, nmx, s1, s2 = _block(x_ptr, offs, offs < n, fold_ptr, hist, mn, nmx, s1, s2, BF16, ITYPE, FTYPE,
                                       MBITS, EMAX, T0, T1, T2, SHIFT, SIDE, DUMP, NBINS)
    _finish(row_ptr, f_ptr, part_ptr, pid, hist, mn, nmx, s1, s2, ticket_ptr, 0, nprog, NCOUNT, NBINS, MAXPROG)


@triton.jit
def _many_kernel(meta_ptr, owner_ptr, buf_ptr, fold_ptr, part_ptr, ticket_ptr,
                 ELEM: tl.constexpr, BF16: tl.constexpr, ITYPE: tl.constexpr, FTYPE: tl.constexpr,
                 MBITS: tl.constexpr, EMAX: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                 SHIFT: tl.constexpr, SIDE: tl.constexpr, NCOUNT: tl.constexpr, COL_MIN: tl.constexpr,
                 DUMP: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr, MAXPROG: tl.constexpr,
                 CHUNK_BLOCKS: tl.constexpr):
    """Many tensors: program ``pid`` reduces chunk ``pid`` (of CHUNK_BLOCKS blocks) of tensor ``owner[pid]``, whose
    meta row is (address, elements, ledger offset of its row, its first chunk, its number of chunks)."""
    pid = tl.program_id(0)
    t = tl.load(owner_ptr + pid)
    addr = tl.load(meta_ptr + t * 5 + 0)
    n = tl.load(meta_ptr + t * 5 + 1)
    row = tl.load(meta_ptr + t * 5 + 2)
    first = tl.load(meta_ptr + t * 5 + 3)
    nparts = tl.load(meta_ptr + t * 5 + 4)
    x_ptr = addr.to(tl.pointer_type(ELEM))
    start = (pid - first).to(tl.int64) * (BLOCK * CHUNK_BLOCKS)
    lanes = tl.arange(0, BLOCK)
    hist, mn, nmx, s1, s2 = _start(BLOCK, NBINS)
    for i in range(CHUNK_BLOCKS):
        offs = start + i * BLOCK + lanes
        hist, mn, nmx, s1, s2 = _block(x_ptr, offs, offs < n, fold_ptr, hist, mn, nmx, s1, s2, BF16, ITYPE, FTYPE,
                                       MBITS, EMAX, T0, T1, T2, SHIFT, SIDE, DUMP, NBINS)
    f_ptr = buf_ptr.to(tl.pointer_type(tl.float64), bitcast=True) + row + COL_MIN
    _finish(buf_ptr + row, f_ptr, part_ptr, pid, hist, mn, nmx, s1, s2, ticket_ptr + t, first, nparts, NCOUNT,
            NBINS, MAXPROG)


_NPROG: dict[torch.device, int] = {}
_SCRATCH: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _programs(device: torch.device) -> int:
    n = _NPROG.get(device)
    if n is None:
        n = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        n = _NPROG[device] = min(n, MAXPROG)
    return n


def _scratch(device: torch.device, parts: int, tickets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials (four float64 per program) and tickets (zero between reductions: the last program re-arms its
    own), reused by every reduction on the device's current stream, in stream order (one set per stream: launches
    on two streams may overlap); grown (zeroed tickets) when too small."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    got = _SCRATCH.get(key)
    if got is None or got[0].numel() < 4 * parts or got[1].numel() < tickets:
        p = max(parts, MAXPROG, 0 if got is None else got[0].numel() // 4)
        q = max(tickets, 64, 0 if got is None else got[1].numel())
        got = _SCRATCH[key] = (torch.empty(4 * p, dtype=torch.float64, device=device),
                               torch.zeros(q, dtype=torch.int32, device=device))
    return got


def _consts(width: object, bf16: bool) -> dict:
    f64 = width.itype == torch.int64
    return dict(BF16=bf16, ITYPE=tl.int64 if f64 else tl.int32, FTYPE=tl.float64 if f64 else tl.float32,
                MBITS=width.mbits, EMAX=width.e - 1, T0=width.thresh[0], T1=width.thresh[1], T2=width.thresh[2],
                SHIFT=width.shift, SIDE=width.side, DUMP=NBINS - 1, BLOCK=BLOCK, NBINS=NBINS, MAXPROG=MAXPROG)


def reduce_row(x: torch.Tensor, row: torch.Tensor, ncount: int, f_cols: torch.Tensor, fold: torch.Tensor,
               width: object) -> None:
    """Accumulate the flat contiguous float16/bfloat16/float32/float64 tensor ``x`` into the int64 ledger ``row``
    (its first ``ncount`` columns: the key counts) and ``f_cols`` (the row's four float64 columns: min, negated
    max, sum, sum of squares), all on ``x``'s device.

    ``width`` is the ``reduce._Width`` of the float type the elements are read as (float32 for the half types)
    and ``fold`` its fold table on ``x``'s device. One launch; no host synchronisation."""
    n = x.numel()
    if n == 0:
        return
    dev = x.device
    blocks = triton.cdiv(n, BLOCK)
    nprog = min(blocks, _programs(dev))
    parts, tickets = _scratch(dev, MAXPROG, 1)
    bf16 = x.dtype == torch.bfloat16
    _row_kernel[(nprog,)](x.view(torch.int16) if bf16 else x, n, triton.cdiv(blocks, nprog), fold, row, f_cols,
                          parts, tickets, NCOUNT=ncount, **_consts(width, bf16))


_ELEM = {torch.float32: tl.float32, torch.float64: tl.float64, torch.float16: tl.float16, torch.bfloat16: tl.int16}


def reduce_many(xs: list[torch.Tensor], offsets: list[int], buf: torch.Tensor, ncount: int, col_min: int,
                fold: torch.Tensor, width: object) -> None:
    """:func:`reduce_row` of many non-empty flat contiguous tensors of one dtype into the rows at ``offsets`` of the
    int64 ledger buffer ``buf`` (all on one device; distinct offsets), in one launch: one program per chunk of
    ``CHUNK_BLOCKS`` blocks of a tensor. The table of addresses, sizes and rows goes to the device in one
    non-blocking copy from pinned memory; no host synchronisation."""
    if not xs:
        return
    dev = buf.device
    chunk = BLOCK * CHUNK_BLOCKS
    ns = np.fromiter((x.numel() for x in xs), dtype=np.int64, count=len(xs))
    nch = -(-ns // chunk)
    first = np.cumsum(nch) - nch
    total = int(nch.sum())
    host = np.empty(5 * len(xs) + total, dtype=np.int64)
    meta = host[: 5 * len(xs)].reshape(-1, 5)
    meta[:, 0] = [x.data_ptr() for x in xs]
    meta[:, 1], meta[:, 2], meta[:, 3], meta[:, 4] = ns, offsets, first, nch
    host[5 * len(xs):] = np.repeat(np.arange(len(xs), dtype=np.int64), nch)
    table = torch.from_numpy(host)
    if dev.type == "cuda":
        table = table.pin_memory().to(dev, non_blocking=True)
    parts, tickets = _scratch(dev, total, len(xs))
    dt = xs[0].dtype
    _many_kernel[(total,)](table, table[5 * len(xs):], buf, fold, parts, tickets, ELEM=_ELEM[dt], NCOUNT=ncount,
                           COL_MIN=col_min, CHUNK_BLOCKS=CHUNK_BLOCKS, **_consts(width, dt == torch.bfloat16))
