"""On-device reduction of a tensor into one row of the step ledger, and the host-side decode of that row.

A row is ``ROW`` int64 entries: the ``NKEYS`` grid-key counts (spec 6.3 layout: bins, under/overflow per sign, zero,
NaN, +inf, -inf), then the finite minimum and maximum as float64 *total-order keys* (an integer whose signed order
is IEEE totalOrder, so ``-0.0 < +0.0`` falls out of an integer min/max), then the float64 sum and sum of squares of
the finite values, stored bit-cast in the int64 buffer. Reducing again into the same row merges exactly: counts
add, min/max are integer min/max, sums add (float64 accumulation, ``SumMethod.F64``).

Nothing here synchronises with the device: the only host transfer is :meth:`Ledger.transfer`, once per step.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import grid
from ..dyadic import ZERO, Dyadic
from ..summary import Sketch, SumMethod, Summary

__all__ = ["ROW", "COL_MIN", "COL_MAX", "COL_SUM", "COL_SUMSQ", "reduce_into", "decode_row", "Ledger"]

NK = grid.NKEYS
COL_MIN = NK
COL_MAX = NK + 1
COL_SUM = NK + 2
COL_SUMSQ = NK + 3
ROW = NK + 4

_I64_MAX = (1 << 63) - 1
_I64_MIN = -(1 << 63)
_SIDE = grid.KEY_OVER + 1


class _Width:
    """Bit layout constants of one IEEE binary format as seen through its same-size signed integer view."""

    def __init__(self, itype: torch.dtype, mbits: int, ebits: int, thresh: tuple[int, int, int]) -> None:
        self.itype = itype
        self.mbits = mbits
        self.fracmask = (1 << mbits) - 1
        self.magmask = (1 << (mbits + ebits)) - 1
        self.emax = (1 << ebits) - 1
        bias = (1 << (ebits - 1)) - 1
        # key of the positive side = 4*(exp - bias) + q - (index_min - 1)
        self.offset = 4 * bias + grid.index_min(grid.NATIVE_SCALE) - 1
        self.thresh = thresh
        nbits = 1 + ebits + mbits
        self.imax = (1 << (nbits - 1)) - 1
        self.imin = -(1 << (nbits - 1))


_F32 = _Width(torch.int32, 23, 8, grid.THRESH_F32)
_F64 = _Width(torch.int64, 52, 11, grid.THRESH_F64)


def _widen(x: torch.Tensor) -> torch.Tensor:
    """Flat float32/float64 view of ``x``: half types are widened exactly to float32, integers to float64."""
    x = x.detach()
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    elif x.dtype not in (torch.float32, torch.float64):
        if x.is_complex():
            raise TypeError(f"cannot summarise a complex tensor ({x.dtype})")
        x = x.to(torch.float64)
    return x.reshape(-1)


def _to_total_key64(k: torch.Tensor, w: _Width) -> torch.Tensor:
    """Float64 total-order keys of values given as total-order keys of width ``w`` (sentinels kept as sentinels)."""
    if w is _F64:
        return k
    bits = torch.where(k < 0, k ^ w.magmask, k)
    b64 = bits.view(torch.float32).to(torch.float64).view(torch.int64)
    k64 = torch.where(b64 < 0, b64 ^ _F64.magmask, b64)
    k64 = torch.where(k == w.imax, _I64_MAX, k64)
    return torch.where(k == w.imin, _I64_MIN, k64)


def reduce_into(x: torch.Tensor, row: torch.Tensor, *, use_bincount: bool | None = None) -> None:
    """Accumulate the counts, total-order min/max and float64 sums of ``x`` into the int64 ledger ``row``.

    ``row`` must be a contiguous int64 tensor of length ``ROW`` on ``x``'s device. Empty tensors are a no-op.
    ``use_bincount`` picks ``torch.bincount`` (CPU default; on CUDA it would synchronise) or ``index_add_``.
    """
    x = _widen(x)
    if x.numel() == 0:
        return
    w = _F32 if x.dtype == torch.float32 else _F64
    bits = x.view(w.itype)
    mag = bits & w.magmask
    exp = mag >> w.mbits
    frac = mag & w.fracmask
    neg = bits < 0
    t0, t1, t2 = w.thresh
    q = (frac > t0).to(w.itype) + (frac > t1) + (frac > t2) - (frac == 0).to(w.itype)
    key = torch.clamp((exp << 2) + q - w.offset, grid.KEY_UNDER, grid.KEY_OVER) + neg * _SIDE
    special = exp == w.emax
    key = torch.where(mag == 0, grid.KEY_ZERO, key)
    key = torch.where(
        special, torch.where(frac != 0, grid.KEY_NAN, torch.where(neg, grid.KEY_NINF, grid.KEY_PINF)), key
    )
    counts = row[:NK]
    if use_bincount is None:
        use_bincount = x.device.type == "cpu"
    if use_bincount:
        counts.add_(torch.bincount(key, minlength=NK))
    else:
        counts.index_add_(0, key.to(torch.int64), torch.ones_like(key, dtype=torch.int64))
    finite = ~special
    tkey = torch.where(neg, bits ^ w.magmask, bits)
    kmin = torch.where(finite, tkey, w.imax).min()
    kmax = torch.where(finite, tkey, w.imin).max()
    k64 = _to_total_key64(torch.stack([kmin, kmax]), w)
    row[COL_MIN : COL_MIN + 1].clamp_(max=k64[0:1])
    row[COL_MAX : COL_MAX + 1].clamp_(min=k64[1:2])
    xd = torch.where(finite, x, 0.0).to(torch.float64)
    row[COL_SUM : COL_SUMSQ + 1].view(torch.float64).add_(torch.stack([xd.sum(), torch.dot(xd, xd)]))


def _key_to_float(k: int) -> float:
    """The float64 whose total-order key is ``k``."""
    b = k ^ _F64.magmask if k < 0 else k
    return float(np.array([b], dtype=np.int64).view(np.float64)[0])


def decode_row(row: np.ndarray, count: int, *, sketch: bool) -> Summary:
    """The :class:`Summary` of a transferred ledger row whose reductions covered ``count`` elements in all."""
    counts = row[:NK]
    total = int(counts.sum())
    if total != count:
        raise RuntimeError(f"ledger row counts {total} values but {count} were reduced into it")
    nan, pinf, ninf, zero = (int(counts[k]) for k in (grid.KEY_NAN, grid.KEY_PINF, grid.KEY_NINF, grid.KEY_ZERO))
    s = Summary(count=count, nan=nan, pinf=pinf, ninf=ninf, zero=zero, sum_method=SumMethod.F64)
    if count - nan - pinf - ninf > 0:
        s.min = _key_to_float(int(row[COL_MIN]))
        s.max = _key_to_float(int(row[COL_MAX]))
        sm, sq = (float(v) for v in row[COL_SUM : COL_SUMSQ + 1].view(np.float64))
        if math.isfinite(sm) and math.isfinite(sq):
            s.sum, s.sumsq = Dyadic.from_float(sm), Dyadic.from_float(sq)
        else:  # float64 accumulation overflowed: no bound can be stated
            s.sum, s.sumsq, s.sum_method = ZERO, ZERO, SumMethod.UNKNOWN
    if sketch:
        c = counts.astype(np.uint64)
        s.sketch = Sketch(
            scale=grid.NATIVE_SCALE,
            pos=c[1 : grid.KEY_OVER].copy(),
            neg=c[_SIDE + 1 : _SIDE + grid.KEY_OVER].copy(),
            under_pos=int(c[grid.KEY_UNDER]),
            over_pos=int(c[grid.KEY_OVER]),
            under_neg=int(c[_SIDE + grid.KEY_UNDER]),
            over_neg=int(c[_SIDE + grid.KEY_OVER]),
        )
    return s


class Ledger:
    """One preallocated int64 device buffer holding every reduction row and scalar slot of a step.

    Rows and scalars are allocated once (on first use) and keep their offsets; the buffer grows between uses
    by reallocation. :meth:`reset` re-initialises everything with one device copy, :meth:`transfer` copies the
    whole buffer to the host with one copy (``non_blocking`` into pinned memory on CUDA).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.rows: dict[object, int] = {}
        self.scalars: dict[object, int] = {}
        self._used = 0
        self._init = np.zeros(0, dtype=np.int64)
        self.buf = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._template = self.buf
        self._pinned = self.device.type == "cuda"
        self.transfers = 0

    def _grow(self, extra: np.ndarray) -> int:
        off = self._used
        self._init = np.concatenate([self._init, extra])
        self._used = self._init.size
        if self._used > self.buf.numel():
            cap = max(self._used, 2 * self.buf.numel(), 4 * ROW)
            init = np.zeros(cap, dtype=np.int64)
            init[: self._init.size] = self._init
            self._template = torch.from_numpy(init).to(self.device)
            new = self._template.clone()
            new[: self.buf.numel()].copy_(self.buf)
            self.buf = new
        else:
            self._template[off : self._used].copy_(torch.from_numpy(extra).to(self.device))
            self.buf[off : self._used].copy_(self._template[off : self._used])
        return off

    def row(self, key: object) -> torch.Tensor:
        """The (zero-initialised this step) ledger row of ``key``, allocating it on first use."""
        off = self.rows.get(key)
        if off is None:
            init = np.zeros(ROW, dtype=np.int64)
            init[COL_MIN] = _I64_MAX
            init[COL_MAX] = _I64_MIN
            off = self.rows[key] = self._grow(init)
        return self.buf[off : off + ROW]

    def scalar(self, key: object) -> torch.Tensor:
        """A one-element float64 view of the scalar slot of ``key`` (NaN-initialised each step)."""
        off = self.scalars.get(key)
        if off is None:
            off = self.scalars[key] = self._grow(np.array([math.nan]).view(np.int64))
        return self.buf[off : off + 1].view(torch.float64)

    def reset(self) -> None:
        """Re-initialise every row and slot (one device copy)."""
        self.buf.copy_(self._template)

    def transfer(self) -> "PendingTransfer":
        """Start the step's single device-to-host copy of the whole buffer."""
        self.transfers += 1
        host = torch.empty(self.buf.shape, dtype=torch.int64, pin_memory=self._pinned)
        host.copy_(self.buf, non_blocking=self._pinned)
        event = None
        if self._pinned:
            event = torch.cuda.Event()
            event.record()
        return PendingTransfer(host, event, dict(self.rows), dict(self.scalars))


class PendingTransfer:
    """A started host copy of the ledger; :meth:`wait` returns it as a numpy array once it has landed."""

    def __init__(self, host: torch.Tensor, event: object, rows: dict, scalars: dict) -> None:
        self._host = host
        self._event = event
        self.rows = rows
        self.scalars = scalars

    def wait(self) -> np.ndarray:
        """Block until the copy is complete and return the host buffer."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()

    def row(self, data: np.ndarray, key: object) -> np.ndarray:
        """The row of ``key`` in the landed buffer ``data``."""
        off = self.rows[key]
        return data[off : off + ROW]

    def scalar(self, data: np.ndarray, key: object) -> float:
        """The scalar slot of ``key`` in the landed buffer ``data``."""
        off = self.scalars[key]
        return float(data[off : off + 1].view(np.float64)[0])
