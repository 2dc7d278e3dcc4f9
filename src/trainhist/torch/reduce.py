"""On-device reduction of a tensor into one row of the step ledger, and the host-side decode of that row.

A row is ``ROW`` int64 entries. A *sketch* row holds the ``NKEYS`` grid-key counts (spec 6.3 layout: bins,
under/overflow per sign, zero, NaN, +inf, -inf; the zero key counting +0.0 only), the count of -0.0 and a spare
slot. A *spine* row (``sketch=False``) leaves those zero and holds five raw counts instead, from which
:func:`decode_row` derives the spine counts exactly (see :data:`COL_SPINE`). Both then hold the finite minimum, the
*negated* finite maximum (so that one ``minimum`` merges both) and the float64 sum and sum of squares of the finite
values, stored bit-cast in the int64 buffer. Reducing again into the same row merges exactly: counts add, min/max
clamp, sums add (float64 accumulation, ``SumMethod.F64``); the sign of a zero minimum or maximum is resolved from
the zero counts at decode time.

Three implementations write the same row. On the CPU, :mod:`.cpukernel` reads each tensor once (an order of
magnitude faster than the torch ops there: ``tools/bench_reduce.py``). On a CUDA GPU, :mod:`.tritonkernel` reads
each tensor once too, in one launch instead of a couple of dozen (it always writes the key counts: a sketch row,
which also decodes to its spine alone). On any other device, where Triton is missing, and on the CPU when asked,
torch ops:
every full-size intermediate is written into a per-device scratch buffer (``out=``), never a fresh allocation (on a
CPU a fresh multi-megabyte tensor costs more in page faults than the pass that fills it); tensors above ``CHUNK``
elements are reduced chunk by chunk so that the scratch stays bounded.

Nothing here synchronises with the device: the only host transfer is :meth:`Ledger.transfer`, once per step.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings

import numpy as np
import torch

from .. import grid
from ..dyadic import ZERO, Dyadic, dyadics_of
from ..model import extreme_pair_ok, extremes_ok
from ..summary import Sketch, SpineTable, SumMethod, Summary
try:  # the compiled CPU kernel needs numba (the torch extra installs it); without it the torch ops serve the CPU too
    from . import cpukernel
except ImportError as _e:  # numba missing, or not yet released for this Python
    cpukernel = None  # type: ignore[assignment]
    warnings.warn(f"trainhist.torch: the fused CPU reduction is unavailable ({_e}); CPU tensors are reduced with "
                  "torch operations, several times slower (pip install numba)", RuntimeWarning, stacklevel=2)

__all__ = ["ROW", "CHUNK", "METHODS", "reduce_into", "device_method", "batch_method", "triton_into", "triton_many",
           "triton_batchable", "fused_into", "fused_many_at", "fusable_at", "fusable_ats", "is_plain",
           "merge_row", "add_zeros", "decode_row", "decode_rows", "decode_arrays", "DecodedRows", "Ledger",
           "PendingTransfer"]

NK = grid.NKEYS
COL_NEGZERO = NK  # count of -0.0 (the grid's zero key counts +0.0 only here; decode adds them)
COL_SPARE = NK + 1  # target of impossible raw codes: always 0
#: spine rows, five raw counts: finite non-zero values; those and -0.0; every value but +0.0; finite non-zero,
#: -0.0 and NaN; finite non-zero, -0.0 and +inf
COL_SPINE = NK + 2
COL_MIN = NK + 7  # float64 bits; every column before this one is an additive int64 count
COL_MAX = NK + 8  # float64 bits of the NEGATED maximum
COL_SUM = NK + 9
COL_SUMSQ = NK + 10
ROW = NK + 11
NCOUNT = NK + 2

_SIDE = grid.KEY_OVER + 1


class _Width:
    """Raw-code layout of one IEEE binary format, read through its same-size signed integer view.

    Every element gets ``raw = 4*exp + q + 1`` (``q`` = how many of the three quarter-octave mantissa thresholds
    lie below the fraction, -1 for a zero fraction), shifted past all finite codes when ``exp`` is all ones
    (inf/NaN), plus ``S`` when the sign bit is set. ``raw - const`` is the grid's bin index, so one bincount
    over raw codes and a fixed fold table give the grid keys; everything is integer adds and shifts.
    """

    def __init__(self, itype: torch.dtype, mbits: int, ebits: int, thresh: tuple[int, int, int]) -> None:
        self.itype = itype
        self.mbits = mbits
        self.nbits = 1 + ebits + mbits
        self.fracmask = (1 << mbits) - 1
        self.magmask = (1 << (mbits + ebits)) - 1
        self.e = 1 << ebits
        self.shift = 4 * self.e + 1
        self.side = 8 * self.e + 2
        self.thresh = thresh
        #: a positive finite non-zero value's raw code minus its grid key before the clamp to under/overflow (_fold)
        self.offset = 4 * ((1 << (ebits - 1)) - 1) + grid.index_min(grid.NATIVE_SCALE)
        self.fold_np = self._fold(ebits)
        self.fold = torch.from_numpy(self.fold_np)
        self.kernels = None if cpukernel is None else cpukernel.make(
            self.nbits, mbits, ebits, thresh, self.offset, (grid.KEY_UNDER, grid.KEY_OVER, _SIDE, grid.KEY_ZERO,
                                                            grid.KEY_NAN, grid.KEY_PINF, grid.KEY_NINF, COL_NEGZERO),
            COL_SPINE, NCOUNT, COL_MIN, ROW)
        self._fold_dev: dict[torch.device, torch.Tensor] = {}

    def _fold(self, ebits: int) -> np.ndarray:
        bias = (1 << (ebits - 1)) - 1
        fold = np.full(2 * self.side, COL_SPARE, dtype=np.int64)
        for neg in (0, 1):
            for exp in range(self.e):
                for q in (-1, 0, 1, 2, 3):
                    raw = 4 * exp + q + 1 + (self.shift if exp == self.e - 1 else 0) + neg * self.side
                    if exp == self.e - 1:
                        key = grid.KEY_NAN if q >= 0 else (grid.KEY_NINF if neg else grid.KEY_PINF)
                    elif exp == 0 and q == -1:
                        key = COL_NEGZERO if neg else grid.KEY_ZERO
                    elif exp == 0:
                        key = grid.KEY_UNDER + neg * _SIDE
                    else:
                        idx = 4 * (exp - bias) + q
                        key = min(max(idx - (grid.index_min(grid.NATIVE_SCALE) - 1), grid.KEY_UNDER), grid.KEY_OVER)
                        key += neg * _SIDE
                    fold[raw] = key
        return fold

    def fold_on(self, device: torch.device) -> torch.Tensor:
        f = self._fold_dev.get(device)
        if f is None:
            f = self._fold_dev[device] = self.fold.to(device)
        return f


_MERGE = None if cpukernel is None else cpukernel.make_merge(COL_MIN, ROW)
_F32 = _Width(torch.int32, 23, 8, grid.THRESH_F32)
_F64 = _Width(torch.int64, 52, 11, grid.THRESH_F64)


CHUNK = 1 << 22  #: elements reduced per pass; larger tensors are reduced chunk by chunk (bounded scratch)
_tls = threading.local()


def _scratch(device: torch.device, dtype: torch.dtype, n: int, slot: str) -> torch.Tensor:
    """A reusable flat buffer of ``n`` elements (per device, thread, dtype and slot), grown geometrically."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    key = (device, dtype, slot)
    b = bufs.get(key)
    if b is None or b.numel() < n:
        size = n if b is None else min(max(n, 2 * b.numel()), CHUNK)
        with torch.inference_mode(False):  # (reused outside inference mode too)
            b = bufs[key] = torch.empty(size, dtype=dtype, device=device)
    return b[:n]


def _widen(x: torch.Tensor) -> torch.Tensor:
    """Flat contiguous float32/float64 view of ``x``: half types are widened exactly to float32, integers to
    float64; non-contiguous or widened values are copied into a scratch buffer (valid until the next reduction)."""
    x = x.detach()
    if x.is_neg():  # a lazily negated view: its memory holds the opposite values, and bit views would read them
        x = x.resolve_neg()
    if x.dtype in (torch.float32, torch.float64):
        dt = x.dtype
    elif x.dtype in (torch.float16, torch.bfloat16):
        dt = torch.float32
    elif x.is_complex():
        raise TypeError(f"cannot summarise a complex tensor ({x.dtype})")
    else:
        dt = torch.float64
    if dt == x.dtype and x.is_contiguous():
        return x.view(-1)
    if x.numel() > CHUNK:  # contiguous: a strided or expanded view would be misread (or read past its end) by address
        return x.to(dt).contiguous().view(-1)
    return _scratch(x.device, dt, x.numel(), "w").view(x.shape).copy_(x).view(-1)


def _raw_codes(bits: torch.Tensor, w: _Width) -> torch.Tensor:
    """Raw code of every element (see :class:`_Width`), computed with integer adds and shifts only (in scratch)."""
    dev, it, n = bits.device, bits.dtype, bits.numel()
    top = w.nbits - 1
    frac = torch.bitwise_and(bits, w.fracmask, out=_scratch(dev, it, n, "frac"))
    exp = torch.bitwise_and(bits, w.magmask, out=_scratch(dev, it, n, "exp"))
    torch.bitwise_right_shift(exp, w.mbits, out=exp)
    raw = torch.bitwise_left_shift(exp, 2, out=_scratch(dev, it, n, "raw"))
    raw += 1
    tmp = _scratch(dev, it, n, "tmp")
    for t in w.thresh:  # (t - frac) >> top is -1 exactly when frac > t
        torch.bitwise_right_shift(torch.sub(t, frac, out=tmp), top, out=tmp)
        raw -= tmp
    torch.bitwise_right_shift(torch.sub(frac, 1, out=tmp), top, out=tmp)  # -1 when the fraction is zero
    raw += tmp
    torch.bitwise_right_shift(torch.sub(w.e - 2, exp, out=tmp), top, out=tmp)  # exponent all ones: inf or NaN
    raw.sub_(tmp, alpha=w.shift)
    torch.bitwise_right_shift(bits, top, out=tmp)
    tmp &= w.side  # sign
    raw += tmp
    return raw


#: reduction methods: one fused pass (CPU, :mod:`.cpukernel`; GPU, ``triton``: :mod:`.tritonkernel`), or torch ops
#: with the bin counts by ``bincount`` (CPU) or ``index_add_`` (any device; ``bincount`` would synchronise on CUDA)
METHODS = ("fused", "triton", "bincount", "index_add")
CPU_METHOD = "fused" if cpukernel is not None else "bincount"  #: the method used on the CPU when none is given
#: the Triton kernels' module once imported; ``loaded``: it was imported (and may have written rows), ``failed``: the
#: import or a launch failed (the torch ops serve from then on)
_TRITON: dict[str, object] = {"module": None, "loaded": False, "failed": False}
#: out of memory (a lack of memory, not a broken kernel); torch.OutOfMemoryError exists from torch 2.4 on
_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _tritonkernel() -> object | None:
    """The Triton kernels' module, imported on first use (Triton is heavy, and CPU-only users never need it); None
    where Triton is missing or a launch has failed (then the torch ops serve, and say so once)."""
    tk = _TRITON["module"]
    if tk is None and not _TRITON["failed"]:
        try:
            from . import tritonkernel as tk
        except Exception as e:  # noqa: BLE001 -- no Triton (or a broken one): the torch ops serve
            _triton_failed(e, "is unavailable")
            return None
        _TRITON["module"], _TRITON["loaded"] = tk, True
    return tk


def _triton_failed(e: BaseException, what: str) -> None:
    _TRITON["module"], _TRITON["failed"] = None, True
    warnings.warn(f"trainhist.torch: the fused GPU reduction {what} ({e!r}); tensors off the CPU are reduced with "
                  "torch operations, many times slower", RuntimeWarning, stacklevel=3)


def _triton_device(device: torch.device) -> bool:
    """Whether the Triton kernels serve ``device`` (while they work): CUDA (and the CPU where :data:`CPU_METHOD` is
    ``triton``, as the tests set it to run the kernels in Triton's interpreter)."""
    dev = device.type
    return dev == "cuda" or (dev == "cpu" and CPU_METHOD == "triton")


def _wants_triton(x: torch.Tensor) -> bool:
    """Whether the default method for ``x`` is the Triton kernel (while it works): a plain tensor it serves."""
    return is_plain(x) and _triton_device(x.device)


def device_method(x: torch.Tensor) -> str:
    """The method :func:`reduce_into` uses for ``x`` when none is given."""
    if _wants_triton(x):
        return "triton" if _tritonkernel() is not None else "index_add"
    if x.device.type == "cpu":  # (the kernels read memory by address: a subclass goes through the torch ops)
        return CPU_METHOD if CPU_METHOD not in ("fused", "triton") or is_plain(x) else "bincount"
    return "index_add"


def _keyed_device(x: torch.Tensor) -> bool:
    """Whether rows of ``x``'s device may hold the Triton kernel's layout (key counts): a CUDA device once the
    kernel has loaded (a CPU one where the tests route it there). Every default reduction there writes key counts,
    so that one row never mixes that layout with the spine-only one (after a failed launch the torch ops serve,
    writing key counts too, which costs them more)."""
    return bool(_TRITON["loaded"]) and _triton_device(x.device)


_TINY, _SUBNORMAL, _ZERO = sys.float_info.min, 5e-324, 0.0  # (variables: Python folds constant expressions)


def _flush_mode() -> tuple[bool, bool]:
    """Whether this thread's float arithmetic flushes results below the normal range to zero, and whether it reads
    subnormal inputs as zero (``torch.set_flush_denormal(True)`` turns on both): the reductions' and decoders' float
    arithmetic (casts, extremes, sums) must keep them."""
    return _TINY * 0.5 == _ZERO, _SUBNORMAL + _ZERO == _ZERO


class _no_flush:  # noqa: N801 -- used as the function it was: ``with _no_flush():``
    """Keep subnormals in the block's float arithmetic (the bounds of spec 5.4 assume them): switch
    ``torch.set_flush_denormal(True)`` off for it, and back on after where it was on. (A class, not a generator-based
    context manager: entered several times a step, for a few microseconds less each.)"""

    __slots__ = ("_on",)

    def __enter__(self) -> None:
        self._on = all(_flush_mode())
        if self._on:
            torch.set_flush_denormal(False)

    def __exit__(self, *exc: object) -> None:
        if self._on:
            torch.set_flush_denormal(True)


def reduce_into(x: torch.Tensor, row: torch.Tensor, *, method: str | None = None, sketch: bool = True) -> None:
    """Accumulate the counts, finite min/max and float64 sums of ``x`` into the int64 ledger ``row``.

    ``row`` must be a contiguous int64 tensor of length ``ROW`` on ``x``'s device. Empty tensors are a no-op.
    ``method`` is one of :data:`METHODS`; the default (:func:`device_method`) is :data:`CPU_METHOD` on the CPU,
    ``triton`` on CUDA where Triton works, ``index_add`` elsewhere. All of them write the same counts, bins and
    min/max; the float64 sums differ from one method to another in their last bits (another order), and by more
    where large values cancel (``SumMethod.F64`` bounds any order).
    ``sketch=False`` skips the bin codes (the costly part) and counts only what the spine needs; every reduction
    into one row in one step must write the same layout: the same ``sketch``, and key counts (``sketch=True``)
    wherever the ``triton`` method writes to the row (it always writes them). With the default method this holds
    by itself: on a device where the Triton kernel has loaded, every reduction writes key counts. Non-finite values
    are counted and excluded from min, max and the sums; the sign of a zero min/max is resolved from the
    -0.0/+0.0 counts at decode time. Under ``torch.set_flush_denormal(True)`` the reduction switches it off while
    it runs, and back on after (it would read subnormal values as zeros).
    """
    with _no_flush():
        _reduce_into(x, row, method, sketch)


def _reduce_into(x: torch.Tensor, row: torch.Tensor, method: str | None, sketch: bool) -> None:
    """:func:`reduce_into` with the thread's subnormals kept."""
    if method is None:
        method = device_method(x)
        if method == "triton":
            if _triton_into(x, row, fallback=True):
                return
            method = "index_add"
        if not sketch and _keyed_device(x):
            sketch = True  # rows on this device hold the Triton kernel's layout (key counts): so must this one
    elif method not in METHODS:
        raise ValueError(f"unknown reduction method {method!r}: expected one of {METHODS}")
    if method == "triton":
        _triton_into(x, row, fallback=False)
        return
    if method == "fused":
        if cpukernel is None:
            raise ValueError("the fused reduction needs numba (pip install numba)")
        if (x.device.type != "cpu" or row.device.type != "cpu" or row.dtype != torch.int64 or row.numel() != ROW
                or not row.is_contiguous() or row.is_neg()):
            raise ValueError(f"the fused reduction needs a CPU tensor and a contiguous int64 CPU row of {ROW} entries")
        fused_into(x, row.data_ptr(), sketch)
        return
    x = _widen(x)
    n = x.numel()
    if n == 0:
        return
    for i in range(0, n, CHUNK):
        _reduce_chunk(x[i : i + CHUNK] if n > CHUNK else x, row, method == "bincount", sketch)


def triton_into(x: torch.Tensor, row: torch.Tensor) -> None:
    """The ``triton`` method of :func:`reduce_into`: one fused kernel launch reads ``x`` once. It always writes the
    key counts (a sketch row), whatever ``sketch`` asks: on a GPU they cost no extra pass. Runs on CUDA tensors, or
    on CPU tensors under ``TRITON_INTERPRET=1`` (tests)."""
    _triton_into(x, row, fallback=False)


def _triton_into(x: torch.Tensor, row: torch.Tensor, fallback: bool) -> bool:
    """:func:`triton_into`; with ``fallback``, a failed launch (not a bad input, not a lack of memory) turns the
    kernel off with one warning and returns False, for the caller to reduce ``x`` with the torch ops."""
    tk = _tritonkernel()
    if tk is None:
        raise ValueError("the triton reduction needs Triton (installed with torch's CUDA builds on Linux)")
    if not is_plain(x) or x.device != row.device:
        raise ValueError(f"the triton reduction reads a plain strided tensor's memory, not a {type(x).__name__} "
                         f"({x.layout}, {x.device}); the row must be on its device ({row.device})")
    if row.dtype != torch.int64 or row.numel() != ROW or not row.is_contiguous() or row.is_neg():
        raise ValueError(f"the triton reduction needs a contiguous int64 row of {ROW} entries")
    x = x.detach()
    if x.is_neg():
        x = x.resolve_neg()
    dt = x.dtype
    if not (dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16) and x.is_contiguous()):
        x = _widen(x).contiguous()  # (the kernel reads by address: contiguous, as it reads it)
        dt = x.dtype
    w = _F64 if dt is torch.float64 else _F32
    try:
        tk.reduce_row(x.view(-1), row, NCOUNT, row[COL_MIN:].view(torch.float64), w.fold_on(x.device), w)
    except _OOM:
        raise
    except Exception as e:  # noqa: BLE001 -- the launch failed (an untested GPU, say): the torch ops serve
        if not fallback:
            raise
        _triton_failed(e, "failed")
        return False
    return True


def batch_method(device: torch.device) -> str | None:
    """The batched reduction :func:`triton_many` serves on ``device`` (``"triton"``), or None."""
    return "triton" if _triton_device(device) and _tritonkernel() is not None else None


def triton_batchable(x: torch.Tensor, device: torch.device) -> bool:
    """Whether :func:`triton_many` reads ``x`` as it is: a plain contiguous non-empty float tensor on ``device``."""
    return (x.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16) and is_plain(x)
            and x.device == device and x.is_contiguous() and not x.is_neg() and x.numel() > 0 and x.data_ptr() != 0)


def triton_many(xs: list[torch.Tensor], offsets: list[int], ledger: "Ledger") -> list[int]:
    """:func:`triton_into` of many tensors into the rows at ``offsets`` of ``ledger`` (distinct rows), one launch
    per dtype: the positions in ``xs`` it reduced. The others (not plain contiguous float tensors on the ledger's
    device, or all of them once a launch has failed) are left to the caller's per-tensor path."""
    tk = _tritonkernel()
    if tk is None:
        return []
    groups: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(xs):
        if triton_batchable(x, ledger.device):
            groups.setdefault(x.dtype, []).append(i)
    taken: list[int] = []
    for dt, pos in groups.items():
        w = _F64 if dt is torch.float64 else _F32
        try:
            tk.reduce_many([xs[i].detach().view(-1) for i in pos], [offsets[i] for i in pos], ledger.buf, NCOUNT,
                           COL_MIN, w.fold_on(ledger.device), w)
        except _OOM:
            raise
        except Exception as e:  # noqa: BLE001 -- the per-tensor path (the torch ops from now on) reduces these
            _triton_failed(e, "failed")
            break
        taken.extend(pos)
    return taken


def is_plain(x: torch.Tensor) -> bool:
    """Whether ``x``'s memory holds its values: a plain tensor or parameter with the strided layout (a subclass,
    such as a wrapper with no storage of its own, may hold anything there)."""
    return (type(x) is torch.Tensor or type(x) is torch.nn.Parameter) and x.layout == torch.strided


def fused_into(x: torch.Tensor, row_address: int, sketch: bool) -> None:
    """The ``fused`` method of :func:`reduce_into` on a plain CPU tensor, given the address of its int64 CPU ledger
    row (:meth:`Ledger.address`): the collector's hot path, a few microseconds of Python per call. The kernel reads
    memory by address, so anything it could misread is refused with ``ValueError`` first; subnormals are kept under
    ``torch.set_flush_denormal(True)``, as :func:`reduce_into` keeps them."""
    if not is_plain(x) or not x.is_cpu:
        raise ValueError(f"the fused reduction reads a plain strided CPU tensor's memory, not a {type(x).__name__} "
                         f"({x.layout}, {x.device}): reduce it with method='bincount'")
    dt = x.dtype
    if not ((dt is torch.float32 or dt is torch.float64) and x.is_contiguous()) or x.is_neg():
        x = _widen(x)
        dt = x.dtype
    n = x.numel()
    if n:
        if not x.is_contiguous() or x.data_ptr() == 0:  # _widen's contract; a kernel must never read past storage
            raise ValueError("the fused reduction needs contiguous memory")
        with _no_flush():
            fused_at(x.data_ptr(), n, dt, row_address, sketch)


def fused_at(address: int, n: int, dtype: torch.dtype, row_address: int, sketch: bool) -> None:
    """The CPU kernel on ``n > 0`` elements of ``dtype`` at ``address``, of a tensor :func:`fusable_at` has accepted
    (the caller's checks are not repeated: the collector's hot path)."""
    spine, sketch_, _ = (_F64 if dtype is torch.float64 else _F32).kernels
    (sketch_ if sketch else spine)(address, n, row_address)


def fusable_at(x: torch.Tensor) -> tuple[int, int, torch.dtype] | None:
    """``(address, elements, dtype)`` when the CPU kernel can read ``x`` by address as it is (a non-empty plain
    contiguous float32/float64 CPU tensor, no negative view), else None (:func:`fused_into` widens or copies
    such tensors first). Each attribute is read once: a torch attribute costs a fraction of a microsecond, and a
    step reads hundreds."""
    dt = x.dtype
    if ((dt is torch.float32 or dt is torch.float64) and is_plain(x) and x.is_cpu and x.is_contiguous()
            and not x.is_neg()):
        n, address = x.numel(), x.data_ptr()
        if n > 0 and address != 0:
            return address, n, dt
    return None


def fusable_ats(xs: list[torch.Tensor]) -> list[tuple[int, int, torch.dtype] | None]:
    """:func:`fusable_at` of each tensor of ``xs``, in order (the same checks, with the names bound once: the
    parameters, gradients and updates of a step are read in lists of hundreds)."""
    f32, f64, plain, param, strided = torch.float32, torch.float64, torch.Tensor, torch.nn.Parameter, torch.strided
    out: list[tuple[int, int, torch.dtype] | None] = []
    for x in xs:
        dt = x.dtype
        at = None
        if ((dt is f32 or dt is f64) and (type(x) is plain or type(x) is param) and x.layout == strided and x.is_cpu
                and x.is_contiguous() and not x.is_neg()):
            n, address = x.numel(), x.data_ptr()
            if n > 0 and address != 0:
                at = (address, n, dt)
        out.append(at)
    return out


def fused_many_at(ats: list[tuple[int, int, torch.dtype] | None], row_addresses: list[int], sketch: bool) -> list[int]:
    """:func:`fused_into` of many tensors given by their :func:`fusable_at` (None: not reduced here), one compiled
    call per float width: the positions in ``ats`` of the tensors it reduced. The others (None, or of a width whose
    call failed) are left to the caller's per-tensor path. The same kernels run, so the rows are those of one
    :func:`fused_into` per tensor."""
    groups: dict[torch.dtype, tuple[list[int], list[int], list[int], list[int]]] = {}
    for i, at in enumerate(ats):
        if at is not None:
            g = groups.setdefault(at[2], ([], [], [], []))
            g[0].append(i)
            g[1].append(at[0])
            g[2].append(at[1])
            g[3].append(row_addresses[i])
    taken: list[int] = []
    for dt, (pos, addresses, ns, rows) in groups.items():
        many = (_F64 if dt is torch.float64 else _F32).kernels[2]
        args = (np.array(addresses, dtype=np.int64), np.array(ns, dtype=np.int64), np.array(rows, dtype=np.int64))
        try:  # (a compiled call fails at dispatch, before it writes anything)
            with _no_flush():
                many(*args, sketch)
        except Exception as e:  # noqa: BLE001 -- the per-tensor path reduces these
            warnings.warn(f"trainhist.torch: the batched CPU reduction failed ({e!r}); reducing one by one",
                          RuntimeWarning, stacklevel=2)
            continue
        taken.extend(pos)
    return taken


def _reduce_chunk(x: torch.Tensor, row: torch.Tensor, use_bincount: bool, sketch: bool) -> None:
    dev, n, f64 = x.device, x.numel(), x.dtype == torch.float64
    w = _F64 if f64 else _F32
    bits = x.view(w.itype)
    z = torch.nan_to_num(x, 0.0, 0.0, 0.0, out=_scratch(dev, x.dtype, n, "z"))  # finite values, the rest +0.0
    if not sketch:  # count_nonzero over int views and nan_to_num are the cheap passes (no bool tensors)
        y = _scratch(dev, x.dtype, n, "y")
        row[COL_SPINE : COL_SPINE + 5].add_(torch.stack([
            torch.count_nonzero(z),  # finite non-zero
            torch.count_nonzero(z.view(w.itype)),  # finite non-zero and -0.0
            torch.count_nonzero(bits),  # everything but +0.0
            torch.count_nonzero(torch.nan_to_num(x, 1.0, 0.0, 0.0, out=y).view(w.itype)),  # ... and NaN
            torch.count_nonzero(torch.nan_to_num(x, 0.0, 1.0, 0.0, out=y).view(w.itype)),  # ... and +inf
        ]))
    else:
        raw = _raw_codes(bits, w)
        fold = w.fold_on(dev)
        if use_bincount:
            row[:NCOUNT].index_add_(0, fold, torch.bincount(raw, minlength=2 * w.side))
        else:
            keys = fold[raw.long()]
            row[:NCOUNT].index_add_(0, keys, torch.ones_like(keys))
    inf = math.inf
    u = _scratch(dev, x.dtype, n, "u")
    mn = torch.nan_to_num(x, inf, inf, inf, out=u).amin()
    mx = torch.nan_to_num(x, -inf, -inf, -inf, out=u).amax()
    z64 = z if f64 else _scratch(dev, torch.float64, n, "z64").copy_(z)
    f = row[COL_MIN : COL_SUMSQ + 1].view(torch.float64)
    torch.minimum(f[0:2], torch.stack([mn, mx.neg()]).to(torch.float64), out=f[0:2])
    f[2:4].add_(torch.stack([z64.sum(), torch.dot(z64, z64)]))


def merge_row(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Merge ledger row ``src`` into ``dst`` exactly, as if ``src``'s reductions had been made into ``dst`` (subnormal
    extremes and sums kept under ``torch.set_flush_denormal(True)``, as :func:`reduce_into` keeps them)."""
    dst[:COL_MIN].add_(src[:COL_MIN])
    f, g = dst[COL_MIN:].view(torch.float64), src[COL_MIN:].view(torch.float64)
    with _no_flush():
        torch.minimum(f[0:2], g[0:2], out=f[0:2])
        f[2:4].add_(g[2:4])


def add_zeros(row: torch.Tensor, zeros: int, *, sketch: bool) -> None:
    """Count ``zeros`` more +0.0 values into ledger row ``row`` without making them (a sparse tensor's implicit
    zeros): a spine row counts them from the row's element count alone (every raw count leaves +0.0 out), a sketch
    row in its zero key too; the extremes take 0 in (the sign of a zero extreme comes from the zero counts; a
    subnormal one is kept under ``torch.set_flush_denormal(True)``)."""
    if zeros:
        if sketch:
            row[grid.KEY_ZERO] += zeros
        with _no_flush():
            row[COL_MIN : COL_MAX + 1].view(torch.float64).clamp_(max=0.0)  # (min, -max)


def decode_row(row: np.ndarray, count: int, *, sketch: bool) -> Summary:
    """The :class:`Summary` of a transferred ledger row whose reductions covered ``count`` elements in all.

    ``sketch=True`` needs a row reduced with ``sketch=True``; a sketch row also decodes to its spine alone.
    Raises ``RuntimeError`` for a row that cannot have come from ``count`` elements. Like :func:`reduce_into`, the
    decoders keep subnormal values under ``torch.set_flush_denormal(True)`` (switched off while they run).
    """
    out = decode_rows(np.asarray(row, dtype=np.int64), [0], [count], [sketch])[0]
    if isinstance(out, Exception):
        raise out
    return out


class DecodedRows:
    """The numbers of many ledger rows as arrays, row ``i`` the row at ``offsets[i]`` (:func:`decode_arrays`)."""

    __slots__ = ("ok", "has", "sums_ok", "count", "nan", "pinf", "ninf", "zero", "min", "max", "sums", "keyrows",
                 "keys", "keyed")

    def __init__(self, **fields: np.ndarray) -> None:
        for name, value in fields.items():
            setattr(self, name, value)

    def spine_table(self, rows: np.ndarray, sketch: bool = False) -> SpineTable:
        """The spines of ``rows`` (rows that passed every check) as a :class:`SpineTable`, as :func:`decode_rows`
        would make their summaries: min and max where a row has a finite value, the float64 sums where they are
        finite too (else the sums are unknown, stored 0: spec 5.4); with ``sketch`` (rows decoded as sketch rows),
        their key counts (none for a row of no elements)."""
        has, sums_ok = self.has[rows], self.sums_ok[rows]
        nan = np.full(rows.size, math.nan)
        keys = None
        if sketch:
            keys = np.zeros((rows.size, NK), dtype=np.int64)
            at = np.minimum(np.searchsorted(self.keyrows, rows), max(self.keyrows.size - 1, 0))
            hit = self.keyrows[at] == rows if self.keyrows.size else np.zeros(rows.size, bool)
            keys[hit] = self.keys[at[hit]]
        return SpineTable(
            count=self.count[rows], nan=self.nan[rows], pinf=self.pinf[rows], ninf=self.ninf[rows],
            zero=self.zero[rows], min=np.where(has, self.min[rows], nan), max=np.where(has, self.max[rows], nan),
            sum=np.where(sums_ok, self.sums[rows, 0], 0.0), sumsq=np.where(sums_ok, self.sums[rows, 1], 0.0),
            method=np.where(has & ~sums_ok, SumMethod.UNKNOWN, SumMethod.F64).astype(np.uint8), sketch=keys)


def _windows(data: np.ndarray, width: int) -> np.ndarray:
    """``numpy.lib.stride_tricks.sliding_window_view(data, width)`` of a 1-D array (a read-only view, row ``i`` the
    ``width`` elements from ``data[i]``), made directly for a contiguous one: sliding_window_view's own checks cost
    tens of microseconds, twice a step."""
    if data.ndim != 1 or not data.flags.c_contiguous or width > data.size:
        return np.lib.stride_tricks.sliding_window_view(data, width)
    step = data.itemsize
    view = np.ndarray((data.size - width + 1, width), data.dtype, buffer=data, strides=(step, step))
    view.flags.writeable = False
    return view


def decode_arrays(data: np.ndarray, offsets: list[int], counts: list[int], sketches: list[bool]) -> DecodedRows:
    """The numbers of the rows at ``offsets`` in the landed ledger ``data`` with one set of numpy operations for all
    of them (a step has hundreds of rows); ``ok`` is false for a row that fails a check (:func:`decode_rows` decodes
    it alone, and names the failure).

    The key columns are summed by one pass over the buffer; a spine row (its keys sum to zero) is decoded from its
    few tail columns, a sketch row (they sum to its count) from its key counts too."""
    with _no_flush():
        return _decode_arrays(data, offsets, counts, sketches)


def _decode_arrays(data: np.ndarray, offsets: list[int], counts: list[int], sketches: list[bool]) -> DecodedRows:
    """:func:`decode_arrays` with the thread's subnormals kept."""
    off = np.asarray(offsets, dtype=np.int64)
    cnt = np.asarray(counts, dtype=np.int64)
    if off.size and (off.min() < 0 or off.max() > data.size - ROW):
        raise ValueError("a row offset lies outside the ledger")
    # (in memory order, so that the spans between one row's key columns and the next row's, summed and dropped,
    # add up to one pass over the buffer)
    order = np.argsort(off, kind="stable")
    bounds = np.empty(2 * off.size, dtype=np.int64)  # [start, end of key columns] of each row, in memory order
    bounds[0::2] = off[order]
    bounds[1::2] = off[order] + NCOUNT
    keyed = np.empty(off.size, dtype=np.int64)
    if off.size:  # (reduceat needs an index; its last span, dropped, ends at the last row: not the whole buffer)
        keyed[order] = np.add.reduceat(data[: int(bounds[-2]) + ROW], bounds)[0::2]
    window = _windows  # rows as views of the buffer: taking them copies once
    tail = window(data, ROW - COL_NEGZERO)[off + COL_NEGZERO]  # -0.0 count, spare, five spine counts, 4 floats
    spare = tail[:, 1]
    fin_nz, fin_nzbits, nzbits, with_nan, with_pinf = tail[:, 2:7].T
    f = np.ascontiguousarray(tail[:, COL_MIN - COL_NEGZERO:]).view(np.float64)
    # The array path takes a row only where every count lies in [0, count] and count < 2**53, so no int64
    # arithmetic below can wrap (the per-row path computes with Python integers); any other row takes _decode.
    small = (cnt >= 0) & (cnt < 2**53) & (spare == 0)
    # spine rows: the counts from the five raw counts (see COL_SPINE)
    negz, posz, nonfin = fin_nzbits - fin_nz, cnt - nzbits, nzbits - fin_nzbits
    nan, pinf = with_nan - fin_nzbits, with_pinf - fin_nzbits
    ninf = nonfin - nan - pinf
    sk = np.asarray(sketches, dtype=bool)
    ok = (small & (keyed == 0) & ~(sk & (cnt > 0)) & (fin_nz >= 0) & (fin_nz <= fin_nzbits) & (fin_nzbits <= nzbits)
          & (nzbits <= cnt) & (fin_nzbits <= with_nan) & (with_nan <= nzbits) & (fin_nzbits <= with_pinf)
          & (with_pinf <= nzbits) & (ninf >= 0))
    # sketch rows: the counts from the grid keys (their sum, with the -0.0 and spare slots, is the count)
    keyrows = np.flatnonzero(small & (cnt > 0) & (keyed == cnt))
    keys = window(data, NK)[off[keyrows]]
    if keyrows.size:  # (none on a step without sketches: these would change nothing)
        ok[keyrows] = ((keys.min(axis=1, initial=0) >= 0) & (keys.max(axis=1, initial=0) <= cnt[keyrows])
                       & (tail[keyrows, 0] >= 0) & (tail[keyrows, 0] <= cnt[keyrows]))
        negz[keyrows] = tail[keyrows, 0]
        posz[keyrows] = keys[:, grid.KEY_ZERO]
        keys[:, grid.KEY_ZERO] += tail[keyrows, 0]
        nan[keyrows], pinf[keyrows] = keys[:, grid.KEY_NAN], keys[:, grid.KEY_PINF]
        ninf[keyrows] = keys[:, grid.KEY_NINF]
    mn, mx = f[:, 0], -f[:, 1]
    mn = np.where(mn == 0, np.where(negz != 0, -0.0, 0.0), mn)  # the sign of a zero extreme, from the zero counts
    mx = np.where(mx == 0, np.where(posz != 0, 0.0, -0.0), mx)
    finite = cnt - nan - pinf - ninf > 0
    ok &= ~finite | extremes_ok(mn, mx)  # (spec 5.5: what a writer refuses, not decoded)
    has = ok & finite  # rows with a finite value: min, max and sums
    sums_ok = has & np.isfinite(f[:, 2:4]).all(axis=1)
    return DecodedRows(ok=ok, has=has, sums_ok=sums_ok, count=cnt, nan=nan, pinf=pinf, ninf=ninf, zero=posz + negz,
                       min=mn, max=mx, sums=f[:, 2:4], keyrows=keyrows, keys=keys, keyed=keyed)


def decode_rows(data: np.ndarray, offsets: list[int], counts: list[int],
                sketches: list[bool]) -> list[Summary | RuntimeError]:
    """:func:`decode_row` of the rows at ``offsets`` in the landed ledger ``data``: the numbers of all of them by
    :func:`decode_arrays`, then a :class:`Summary` each, or the ``RuntimeError`` of a row that cannot have come
    from its count (a row that fails a check there takes :func:`_decode`, which names the failure)."""
    if not offsets:
        return []
    with _no_flush():
        return _decode_rows(data, offsets, counts, sketches)


def _decode_rows(data: np.ndarray, offsets: list[int], counts: list[int],
                 sketches: list[bool]) -> list[Summary | RuntimeError]:
    """:func:`decode_rows` of at least one row, with the thread's subnormals kept."""
    d = _decode_arrays(data, offsets, counts, sketches)
    it = iter(dyadics_of(d.sums[d.sums_ok].reshape(-1)))
    sketch_of = dict(zip(d.keyrows.tolist(), _sketches(d.keys)))
    rows = zip(d.ok.tolist(), d.has.tolist(), d.sums_ok.tolist(), d.count.tolist(), d.nan.tolist(), d.pinf.tolist(),
               d.ninf.tolist(), d.zero.tolist(), d.min.tolist(), d.max.tolist())
    out: list[Summary | RuntimeError] = []
    for i, (good, h, sok, n, a, p, q, z, lo, hi) in enumerate(rows):
        if good:
            s = Summary(count=n, nan=a, pinf=p, ninf=q, zero=z, sum_method=SumMethod.F64)
            if h:
                s.min, s.max = lo, hi
                if sok:
                    s.sum, s.sumsq = next(it), next(it)
                else:  # float64 accumulation overflowed: the sums are unknown (spec 5.4), both of them (no state
                    s.sum_method = SumMethod.UNKNOWN  # per sum, even where only the sum of squares overflowed)
            if sketches[i]:  # (a spine row's sketch holds no values)
                s.sketch = sketch_of[i] if i in sketch_of else Sketch.from_key_counts(np.zeros(NK, dtype=np.int64))
            out.append(s)
            continue
        row = data[offsets[i]: offsets[i] + ROW]
        try:
            out.append(_decode(row, counts[i], sketches[i], int(d.keyed[i]), row[COL_NEGZERO:COL_MIN].tolist(),
                              row[COL_MIN:].view(np.float64).tolist()))
        except RuntimeError as e:
            out.append(e)
    return out


def _sketches(keys: np.ndarray) -> list[Sketch]:
    """:meth:`Sketch.from_key_counts` of every row of ``keys`` (grid-key counts, the zero key with -0.0 added), with
    array operations; each sketch's bins are a row of one block per sign."""
    c = keys.astype(np.uint64)
    pos = np.ascontiguousarray(c[:, 1 : grid.KEY_OVER])
    neg = np.ascontiguousarray(c[:, _SIDE + 1 : _SIDE + grid.KEY_OVER])
    bands = c[:, [grid.KEY_UNDER, grid.KEY_OVER, _SIDE + grid.KEY_UNDER, _SIDE + grid.KEY_OVER]].tolist()
    return [Sketch(scale=grid.NATIVE_SCALE, pos=p, neg=q, under_pos=up, over_pos=op, under_neg=un, over_neg=on)
            for p, q, (up, op, un, on) in zip(pos, neg, bands)]


def _decode(row: np.ndarray, count: int, sketch: bool, keyed: int, raw: list[int], floats: list[float]) -> Summary:
    """One row of :func:`decode_rows` its array path does not take (one that fails a check there), with Python
    integers: the summary, or the RuntimeError that names the failure (``keyed``: the sum of its key columns;
    ``raw``: its columns from COL_NEGZERO, ``floats``: from COL_MIN)."""
    negzero, spare = raw[0], raw[1]
    if spare != 0:
        raise RuntimeError("ledger row has counts in its impossible slot")
    counts = None
    if count and keyed == count:  # a sketch row: grid-key counts
        counts = row[:NK].copy()
        poszero = int(counts[grid.KEY_ZERO])
        counts[grid.KEY_ZERO] += negzero
        total = int(counts.sum())
        nan, pinf, ninf, zero = (int(counts[k]) for k in (grid.KEY_NAN, grid.KEY_PINF, grid.KEY_NINF, grid.KEY_ZERO))
    else:  # a spine row: raw counts (see COL_SPINE)
        if keyed:
            raise RuntimeError(f"ledger row counts {keyed} values but {count} were reduced into it")
        if sketch and count:
            raise RuntimeError("a sketch was asked of a spine-only ledger row")
        fin_nz, fin_nzbits, nzbits, with_nan, with_pinf = raw[2:7]
        negzero, poszero, nonfinite = fin_nzbits - fin_nz, count - nzbits, nzbits - fin_nzbits
        nan, pinf = with_nan - fin_nzbits, with_pinf - fin_nzbits
        ninf, zero = nonfinite - nan - pinf, poszero + negzero
        if min(fin_nz, negzero, poszero, nan, pinf, ninf) < 0:
            raise RuntimeError(f"ledger spine row is inconsistent with {count} values reduced into it")
        total = fin_nz + zero + nonfinite
    if total != count:
        raise RuntimeError(f"ledger row counts {total} values but {count} were reduced into it")
    s = Summary(count=count, nan=nan, pinf=pinf, ninf=ninf, zero=zero, sum_method=SumMethod.F64)
    if count - nan - pinf - ninf > 0:
        mn, nmx = floats[0], floats[1]
        mx = -nmx
        s.min = (-0.0 if negzero else 0.0) if mn == 0 else mn  # -0.0 < +0.0 (IEEE totalOrder)
        s.max = (0.0 if poszero else -0.0) if mx == 0 else mx
        if not extreme_pair_ok(s.min, s.max):
            raise RuntimeError(f"ledger row holds {count - nan - pinf - ninf} finite values but not their min <= max "
                               f"(min {s.min!r}, max {s.max!r})")
        if math.isfinite(floats[2]) and math.isfinite(floats[3]):
            s.sum, s.sumsq = Dyadic.from_float(floats[2]), Dyadic.from_float(floats[3])
        else:  # float64 accumulation overflowed: the sums are unknown, both (spec 5.4: no state per sum), stored 0
            s.sum, s.sumsq, s.sum_method = ZERO, ZERO, SumMethod.UNKNOWN
    if sketch:
        s.sketch = Sketch.from_key_counts(counts if counts is not None else np.zeros(NK, dtype=np.int64))
    return s


class Ledger:
    """One preallocated int64 device buffer holding every reduction row and scalar slot of a step.

    Rows and scalars are allocated once (on first use) and keep their offsets; the buffer grows between uses
    by reallocation. :meth:`reset` re-initialises everything with one device copy, :meth:`transfer` copies the
    whole buffer to the host with one copy (``non_blocking`` into pinned memory on CUDA). Not thread-safe: one
    thread reduces into a ledger at a time (an allocation moves the buffer that an address points into).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.rows: dict[object, int] = {}
        self.scalars: dict[object, int] = {}
        self._used = 0
        self._init = np.zeros(0, dtype=np.int64)
        self.buf = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._base = self.buf.data_ptr()  # (the buffer's address, kept as it moves: for address())
        self._template = self.buf
        # the used part of the buffer and of its template (the rest, capacity for later rows, is never written):
        # what reset() copies
        self._live, self._live_template = self.buf, self._template
        self._tails: tuple[torch.Tensor, torch.Tensor] | None = None  # see reset(keys_clean=True)
        self._pinned = self.device.type == "cuda"
        self._cpu = self.device.type == "cpu"  # (torch builds the type string anew on every read)
        self.transfers = 0

    def _grow(self, extra: np.ndarray) -> int:
        # (never an inference tensor, though a forward under torch.inference_mode() may allocate the row: one could
        # not be written outside inference mode again, so every later step would fail)
        with torch.inference_mode(False):
            return self._grow_in(extra)

    def _grow_in(self, extra: np.ndarray) -> int:
        off = self._used
        self._init = np.concatenate([self._init, extra])
        self._used = self._init.size
        if self._used > self.buf.numel():
            cap = max(self._used, 2 * self.buf.numel(), 4 * ROW)
            init = np.zeros(cap, dtype=np.int64)
            init[: self._init.size] = self._init
            self._template = torch.from_numpy(init).to(self.device)
            new = self._template.clone()
            new[:off].copy_(self.buf[:off])  # this step's values so far; not the unused tail, where the new slot starts
            self.buf = new
            self._base = new.data_ptr()
        else:
            self._template[off : self._used].copy_(torch.from_numpy(extra).to(self.device))
            self.buf[off : self._used].copy_(self._template[off : self._used])
        self._live, self._live_template = self.buf[: self._used], self._template[: self._used]
        self._tails = None
        return off

    def row(self, key: object) -> torch.Tensor:
        """The (zero-initialised this step) ledger row of ``key``, allocating it on first use."""
        off = self.rows.get(key)
        if off is None:
            init = np.zeros(ROW, dtype=np.int64)
            init[COL_MIN : COL_MAX + 1] = np.array([math.inf, math.inf]).view(np.int64)  # min, -max
            off = self.rows[key] = self._grow(init)
        return self.buf[off : off + ROW]

    def merge_on_host(self, dst: object, src: object) -> None:
        """:func:`merge_row` of the row of ``src`` into that of ``dst``, in place in a CPU ledger by address (one
        compiled call, not five torch ops on fresh slices; subnormals kept as :func:`merge_row` keeps them)."""
        if not self._cpu or _MERGE is None:
            raise ValueError(f"merge_on_host needs a CPU ledger and numba, not {self.device}")
        if src == dst:
            raise ValueError("a row cannot be merged into itself")
        for key in (src, dst):  # allocate both before taking an address: an allocation may move the buffer
            if key not in self.rows:
                self.row(key)
        with _no_flush():
            _MERGE(self.address(dst), self.address(src))

    def offsets(self, keys: list[object]) -> list[int]:
        """The offsets of the rows of ``keys`` in the buffer, allocating those not yet used."""
        rows = self.rows
        for key in keys:
            if key not in rows:
                self.row(key)
        return [rows[key] for key in keys]

    def address(self, key: object) -> int:
        """The memory address of the row of ``key`` in a CPU ledger (for :func:`fused_into`), allocating the row
        on first use; valid until the next allocation grows the buffer."""
        if not self._cpu:
            raise ValueError(f"a row address is for a CPU ledger, not {self.device}")
        off = self.rows.get(key)
        if off is None:
            self.row(key)
            off = self.rows[key]
        return self._base + 8 * off

    def addresses(self, keys: list[object]) -> list[int]:
        """:meth:`address` of every key, all rows allocated first (so no later allocation moves an earlier one)."""
        if not self._cpu:
            raise ValueError(f"a row address is for a CPU ledger, not {self.device}")
        offsets = self.offsets(keys)
        base = self._base  # (after the allocations)
        return [base + 8 * off for off in offsets]

    def scalar(self, key: object) -> torch.Tensor:
        """A one-element float64 view of the scalar slot of ``key`` (NaN-initialised each step)."""
        off = self.scalars.get(key)
        if off is None:
            off = self.scalars[key] = self._grow(np.array([math.nan]).view(np.int64))
        return self.buf[off : off + 1].view(torch.float64)

    def reset(self, keys_clean: bool = False) -> None:
        """Re-initialise every row and slot (one device copy of the used part of the buffer: the capacity past it
        holds no row or slot yet, and nothing writes there).

        ``keys_clean``: the caller knows that nothing has written the key columns (``[0, COL_NEGZERO)``) of any row
        since the last reset, which left them as the template holds them (zeros): then only the rest of each row
        and the scalar slots are copied back, a few percent of the buffer (what spine-only reductions write)."""
        if keys_clean:
            tails = self._tails
            if tails is None:
                tails = self._tails = self._tail_index()
            self.buf.index_copy_(0, tails[0], tails[1])
        else:
            self._live.copy_(self._live_template)

    def _tail_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions outside the rows' key columns (the rest of each row, every scalar slot) and their
        template values."""
        rows = np.fromiter(self.rows.values(), np.int64, len(self.rows))
        at = [(rows[:, None] + np.arange(COL_NEGZERO, ROW, dtype=np.int64)).reshape(-1),
              np.fromiter(self.scalars.values(), np.int64, len(self.scalars))]
        index = torch.from_numpy(np.sort(np.concatenate(at))).to(self.device)
        return index, self._template.index_select(0, index)

    def transfer(self, copy: bool = True) -> "PendingTransfer":
        """Start the step's single device-to-host copy of the whole buffer. ``copy=False`` on a CPU ledger hands
        over the buffer itself (already host memory), for a caller that reads it before the next :meth:`reset`
        or reduction."""
        self.transfers += 1
        if not copy and self._cpu:
            return PendingTransfer(self.buf, None, dict(self.rows), dict(self.scalars))
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
