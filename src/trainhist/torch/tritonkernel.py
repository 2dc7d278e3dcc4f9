"""Fused GPU reduction kernels (Triton): one read of a tensor accumulates a whole ledger row, in two launches.

The torch-op reduction of :mod:`trainhist.torch.reduce` launches a couple of dozen kernels per tensor; on a GPU the
host spends more time launching them than the device spends running them, and every one of them reads the tensor
again. Here one kernel reads it once: each program walks a strided set of blocks, computes every element's grid key
from its bits (integer arithmetic, the same as :func:`reduce._raw_codes` and the fold table), histograms the keys
in registers and adds its histogram to the row with integer atomics (exact in any order), and writes its finite
min, negated max and float64 sums to a partials buffer. A one-program kernel then folds the partials, in a fixed
order, into the row's float columns: the row, sums included, is the same from run to run.

The row is always written with its full key counts (a *sketch* row; decoding it asks for the spine alone where no
sketch is due): on a GPU the keys cost no extra pass. float16 and bfloat16 are read as they are and widened in
registers (exactly: bfloat16 by shifting its bits), float32 and float64 natively; other dtypes and non-contiguous
tensors are widened by the caller.

Needs Triton (installed with torch's CUDA builds on Linux). With ``TRITON_INTERPRET=1`` the kernels run on CPU
tensors in Triton's interpreter, which is how the test suite checks them on a machine without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["reduce_row", "NBINS", "BLOCK"]

BLOCK = 1024  #: elements per program per turn of its loop
NBINS = 1024  #: histogram width: a power of two above every key (the keys past the row's counts land in DUMP)
MAXPROG = 1024  #: most programs of one reduction (the finishing kernel reads all their partials in one block)


@triton.jit(do_not_specialize=["n", "iters"])
def _keys_kernel(x_ptr, n, iters, fold_ptr, row_ptr, part_ptr,
                 BF16: tl.constexpr, ITYPE: tl.constexpr, FTYPE: tl.constexpr, MBITS: tl.constexpr, EMAX: tl.constexpr,
                 T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, SHIFT: tl.constexpr, SIDE: tl.constexpr,
                 NCOUNT: tl.constexpr, DUMP: tl.constexpr, BLOCK: tl.constexpr, NBINS: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    hist = tl.zeros([NBINS], dtype=tl.int64)
    mn = tl.full([BLOCK], float("inf"), dtype=tl.float64)
    nmx = tl.full([BLOCK], float("inf"), dtype=tl.float64)
    s1 = tl.zeros([BLOCK], dtype=tl.float64)
    s2 = tl.zeros([BLOCK], dtype=tl.float64)
    for i in range(iters):
        offs = (pid + i * nprog).to(tl.int64) * BLOCK + lanes
        m = offs < n
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
        s1 += z
        s2 += z * z
    bins = tl.arange(0, NBINS)
    tl.atomic_add(row_ptr + bins, hist, mask=(bins < NCOUNT) & (hist != 0))
    tl.store(part_ptr + pid * 4 + 0, tl.min(mn, axis=0))
    tl.store(part_ptr + pid * 4 + 1, tl.min(nmx, axis=0))
    tl.store(part_ptr + pid * 4 + 2, tl.sum(s1, axis=0))
    tl.store(part_ptr + pid * 4 + 3, tl.sum(s2, axis=0))


@triton.jit(do_not_specialize=["nprog"])
def _finish_kernel(part_ptr, nprog, f_ptr, MAXPROG: tl.constexpr):
    p = tl.arange(0, MAXPROG)
    m = p < nprog
    mn = tl.min(tl.load(part_ptr + p * 4 + 0, mask=m, other=float("inf")), axis=0)
    nmx = tl.min(tl.load(part_ptr + p * 4 + 1, mask=m, other=float("inf")), axis=0)
    s1 = tl.sum(tl.load(part_ptr + p * 4 + 2, mask=m, other=0.0), axis=0)
    s2 = tl.sum(tl.load(part_ptr + p * 4 + 3, mask=m, other=0.0), axis=0)
    tl.store(f_ptr + 0, tl.minimum(tl.load(f_ptr + 0), mn))
    tl.store(f_ptr + 1, tl.minimum(tl.load(f_ptr + 1), nmx))
    tl.store(f_ptr + 2, tl.load(f_ptr + 2) + s1)
    tl.store(f_ptr + 3, tl.load(f_ptr + 3) + s2)


_NPROG: dict[torch.device, int] = {}
_PARTS: dict[torch.device, torch.Tensor] = {}


def _programs(device: torch.device) -> int:
    n = _NPROG.get(device)
    if n is None:
        n = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        n = _NPROG[device] = min(n, MAXPROG)
    return n


def reduce_row(x: torch.Tensor, row: torch.Tensor, ncount: int, f_cols: torch.Tensor, fold: torch.Tensor,
               width: object) -> None:
    """Accumulate the flat contiguous float16/bfloat16/float32/float64 tensor ``x`` into the int64 ledger ``row``
    (its first ``ncount`` columns: the key counts) and ``f_cols`` (the row's four float64 columns: min, negated
    max, sum, sum of squares), all on ``x``'s device.

    ``width`` is the ``reduce._Width`` of the float type the elements are read as (float32 for the half types)
    and ``fold`` its fold table on ``x``'s device. Two launches; no host synchronisation."""
    n = x.numel()
    if n == 0:
        return
    dev = x.device
    blocks = triton.cdiv(n, BLOCK)
    nprog = min(blocks, _programs(dev))
    parts = _PARTS.get(dev)
    if parts is None:  # (the partials of one reduction are read by the next launch on the same stream)
        parts = _PARTS[dev] = torch.empty(4 * MAXPROG, dtype=torch.float64, device=dev)
    f64 = width.itype == torch.int64
    bf16 = x.dtype == torch.bfloat16
    _keys_kernel[(nprog,)](
        x.view(torch.int16) if bf16 else x, n, triton.cdiv(blocks, nprog), fold, row, parts,
        BF16=bf16, ITYPE=tl.int64 if f64 else tl.int32, FTYPE=tl.float64 if f64 else tl.float32, MBITS=width.mbits,
        EMAX=width.e - 1, T0=width.thresh[0], T1=width.thresh[1], T2=width.thresh[2], SHIFT=width.shift,
        SIDE=width.side, NCOUNT=ncount, DUMP=NBINS - 1, BLOCK=BLOCK, NBINS=NBINS)
    _finish_kernel[(1,)](parts, nprog, f_cols, MAXPROG=MAXPROG)
