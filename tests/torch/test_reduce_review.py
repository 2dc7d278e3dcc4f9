"""Review checks of the torch reductions and the plan's cost table against independent references."""

from __future__ import annotations

import math
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch_helpers import CPU_METHODS, bits

import trainhist
from trainhist.dyadic import Dyadic
from trainhist.summary import SumMethod
from trainhist.torch import Collector
from trainhist.torch.plan import SKETCH_ROW_BYTES, SPINE_ROW_BYTES
from trainhist.torch.reduce import (COL_MIN, ROW, Ledger, add_zeros, decode_arrays, decode_row, decode_rows,
                                     fusable_ats, fused_into, fused_many_at, merge_row, reduce_into)

_TINY, _ZERO = sys.float_info.min, 0.0  # (variables: Python folds constant expressions)


def _flushing() -> bool:
    """Whether this thread's float arithmetic flushes subnormal results to zero."""
    return _TINY * 0.5 == _ZERO


def exact(d: Dyadic) -> Fraction:
    return Fraction(d.m) * Fraction(2) ** d.e


def test_plan_bytes_count_the_sketches_the_collector_writes(tmp_path):
    """A sketch rides on a spine row: it is written at steps where both cadences are due (every lcm of them), and
    never for a stream whose spine is off (``every=0``). The plan's raw bytes per step are the rows and sketches
    the collector really writes, amortised over the steps (it counted a sketch every ``sketch_every`` steps)."""
    m = torch.nn.Linear(3, 2)
    p = tmp_path / "t.thist"
    col = Collector(m, p, mode="w", streams=("param", "param_grad"), every={"param": 0, "param_grad": 2},
                    sketch_every={"param": 1, "param_grad": 3})
    col.discover(torch.randn(2, 3))
    plan = col.plan
    steps = 12
    for s in range(steps):
        with col.step(s):
            m(torch.randn(2, 3)).sum().backward()
    col.close()
    h = trainhist.open(p)
    for site in plan.sites:
        sp = h.spine(site.path, site.stream, site.facet)
        rows, sketches = len(sp.step), int((sp.sk_row >= 0).sum())
        written = rows * SPINE_ROW_BYTES + sketches * SKETCH_ROW_BYTES
        assert site.bytes_per_step() * steps == written, (site.path, site.stream, rows, sketches)
    assert (len(h.spine("weight", "param").step), len(h.spine("weight", "param_grad").step)) == (0, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("sketch", [True, False])
@pytest.mark.parametrize("nan", [False, True])
def test_subnormals_under_flush_denormal(dtype, method, sketch, nan):
    """Under ``torch.set_flush_denormal(True)`` (the thread's arithmetic then reads subnormals as zero and flushes
    subnormal results) a reduction still counts, bins and bounds the subnormal values as they are: min and max
    exact values of the tensor, zeros counted only where they are, sums exact here (a few values). It read them as
    zeros: a row of min +0.0 > max -0.0 (refused by a reader: spec 5.5), sums of 0, and the torch ops' spine
    counted them as zeros. The thread's setting is as it was afterwards."""
    if method == "triton" and not sketch:
        pytest.skip("the triton method always writes a sketch row")
    tiny = torch.finfo(dtype).tiny
    vals = [tiny / 2, -tiny / 4, tiny / 64, tiny / 8] + ([math.nan] if nan else [])
    x = torch.tensor(vals, dtype=torch.float64).to(dtype)
    x64 = [float(v) for v in x.to(torch.float64).tolist()]  # (exact widening, with subnormals kept)
    fin = [v for v in x64 if not math.isnan(v)]
    led = Ledger("cpu")
    assert torch.set_flush_denormal(True), "this CPU cannot flush subnormals"
    try:
        reduce_into(x, led.row("k"), method=method, sketch=sketch)
        still = _flushing()
    finally:
        torch.set_flush_denormal(False)
    assert still, "the reduction left torch.set_flush_denormal(True) switched off"
    p = led.transfer()
    got = decode_row(p.row(p.wait(), "k"), x.numel(), sketch=sketch)
    assert (got.count, got.nan, got.zero) == (len(vals), int(nan), 0)
    assert (bits(got.min), bits(got.max)) == (bits(min(fin)), bits(max(fin))), (got.min, got.max)
    assert got.sum_method == SumMethod.F64
    assert exact(got.sum) == sum(map(Fraction, fin))  # (sums of subnormals, or of a few float32 values, are exact)
    bound = SumMethod.bound(SumMethod.F64, len(fin), max(map(abs, fin)), 2)  # (float64 subnormals square to 0)
    assert abs(exact(got.sumsq) - sum(Fraction(v) ** 2 for v in fin)) <= bound
    if sketch:
        assert got.sketch.under_pos == 3 and got.sketch.under_neg == 1


def _bin(v: float) -> int:
    """Native-scale bin index ``i`` of a finite non-zero ``v``, ``2^(i/4) < |v| <= 2^((i+1)/4)``, from exact
    integers (an independent reference: ``|v|^4`` against powers of two)."""
    f = Fraction(abs(v)) ** 4
    j = f.numerator.bit_length() - f.denominator.bit_length() - 1
    while f > Fraction(2) ** j:
        j += 1
    while f <= Fraction(2) ** (j - 1):
        j -= 1
    return j - 1


def _views() -> dict[str, torch.Tensor]:
    """Tensors read in every way the reductions must see through, with special values where blocks end."""
    edges = torch.tensor([2.0 ** (i / 4) for i in range(-196, 68)], dtype=torch.float64)
    edges = torch.cat([edges, torch.nextafter(edges, torch.zeros_like(edges)),
                       torch.nextafter(edges, torch.full_like(edges, math.inf))])
    out: dict[str, torch.Tensor] = {}
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        fi = torch.finfo(dt)
        x = (torch.linspace(-3, 3, 4097, dtype=torch.float64) * 7).to(dt)  # one element past a block
        x[-1] = math.nan
        x[100] = -0.0
        out[f"{dt} nan last"] = x
        out[f"{dt} neg strided"] = torch._neg_view(x)[1::3]
        out[f"{dt} transposed"] = x[:4096].view(64, 64).t()
        out[f"{dt} expanded"] = x[:3].view(3, 1).expand(3, 11)
        out[f"{dt} extremes"] = torch.tensor([fi.max, -fi.max, fi.tiny, -fi.tiny / 4, -0.0], dtype=dt)
        out[f"{dt} edges"] = torch.cat([edges, -edges]).to(dt)
    for dt, it, pats in ((torch.float32, torch.int32, [0x7FC00000, -0x400000, 0x7F800001, -0x7FFFFF, -1]),
                         (torch.float64, torch.int64, [0x7FF8000000000000, -0x8000000000000, 0x7FF0000000000001, -1])):
        out[f"{dt} nan payloads"] = torch.cat([torch.full((33,), 1.5, dtype=dt), torch.tensor(pats, dtype=it).view(dt)])
    out["float64 squares overflow"] = torch.tensor([1e200, -3e200, 1.0], dtype=torch.float64)
    out["int16 transposed"] = torch.arange(-300, 300, dtype=torch.int16).view(20, 30).t()
    out["bool"] = torch.tensor([True, False, True])
    out["empty"] = torch.zeros(0, 5)
    return out


@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("name", list(_views()))
def test_rows_equal_an_exact_reference(name, method):
    """Every method's row of a tensor read through a view (strided, transposed, expanded, negated), of every float
    width, with NaN payloads of either sign, non-finite values in the last partial block, extremes and values on and
    beside every bin edge, equals an exact reference: counts and bins as integers, min and max bit for bit, sums
    within their method's bound (Fractions)."""
    x = _views()[name]
    vals = x.reshape(-1).to(torch.float64).tolist()  # (exact widening)
    fin = [v for v in vals if math.isfinite(v)]
    for sketch in (True, False):
        if method == "triton" and not sketch:
            continue
        led = Ledger("cpu")
        reduce_into(x, led.row("k"), method=method, sketch=sketch)
        p = led.transfer()
        got = decode_row(p.row(p.wait(), "k"), x.numel(), sketch=sketch)
        assert (got.count, got.nan, got.pinf, got.ninf, got.zero) == (
            len(vals), sum(map(math.isnan, vals)), vals.count(math.inf), vals.count(-math.inf), fin.count(0.0))
        if not fin:
            assert math.isnan(got.min) and math.isnan(got.max)
            continue
        lo = min(fin, key=lambda v: (v, math.copysign(1.0, v)))
        hi = max(fin, key=lambda v: (v, math.copysign(1.0, v)))
        assert (bits(got.min), bits(got.max)) == (bits(lo), bits(hi)), (got.min, lo, got.max, hi)
        big = max(abs(lo), abs(hi))
        if got.sum_method == SumMethod.UNKNOWN:  # (float64 accumulation overflowed: only where it could)
            assert len(fin) * big * big > 1.7e308
        else:
            assert got.sum_method == SumMethod.F64
            for power, value in ((1, got.sum), (2, got.sumsq)):
                want = sum(Fraction(v) ** power for v in fin)
                assert abs(exact(value) - want) <= Fraction(SumMethod.bound(SumMethod.F64, len(fin), big, power))
        if sketch:
            want: dict[tuple, int] = {}
            for v in fin:
                if v:
                    i = _bin(v)
                    k = (v < 0, "under" if i < -192 else "over" if i > 63 else i)
                    want[k] = want.get(k, 0) + 1
            s = got.sketch
            have = {(neg, i - 192): int(c) for neg, side in ((False, s.pos), (True, s.neg))
                    for i, c in enumerate(side.tolist()) if c}
            have.update({k: c for k, c in (((False, "under"), s.under_pos), ((False, "over"), s.over_pos),
                                            ((True, "under"), s.under_neg), ((True, "over"), s.over_neg)) if c})
            assert have == want


@pytest.mark.parametrize("sketch", [True, False])
def test_decode_under_flush_denormal(sketch):
    """Decoding a row whose extremes and sums are float64 subnormals under ``torch.set_flush_denormal(True)`` gives
    them as they are (it compared them with zero as zeros: min +0.0 > max -0.0, and sums of 0), by every decoder,
    and leaves the thread's setting as it was."""
    x = torch.tensor([1e-310, 3e-320, 5e-324], dtype=torch.float64)
    led = Ledger("cpu")
    reduce_into(x, led.row("k"), sketch=sketch)
    p = led.transfer()
    data = p.wait().copy()
    off = p.rows["k"]
    assert torch.set_flush_denormal(True), "this CPU cannot flush subnormals"
    try:
        one = decode_row(p.row(data, "k"), 3, sketch=sketch)
        (many,) = decode_rows(data, [off], [3], [sketch])
        arrays = decode_arrays(data, [off], [3], [sketch])
        still = _flushing()
    finally:
        torch.set_flush_denormal(False)
    assert still, "decoding left torch.set_flush_denormal(True) switched off"
    for s in (one, many):
        assert (bits(s.min), bits(s.max)) == (bits(5e-324), bits(1e-310)), (s.min, s.max)
        assert exact(s.sum) == Fraction(1e-310) + Fraction(3e-320) + Fraction(5e-324)
        if sketch:
            assert s.sketch.under_pos == 3
    assert (bits(float(arrays.min[0])), bits(float(arrays.max[0]))) == (bits(5e-324), bits(1e-310))


@pytest.mark.parametrize("how", ["merge_row", "Ledger.merge_on_host", "add_zeros"])
def test_row_merges_under_flush_denormal(how):
    """Merging rows (and counting a sparse tensor's implicit zeros into one) under
    ``torch.set_flush_denormal(True)`` keeps float64 subnormal extremes and sums as they are: the row equals the
    one made without it (it took them as zeros: min +0.0 > max -0.0, sums of 0, or a subnormal extreme clamped to
    zero), and the thread's setting is as it was."""
    a = torch.tensor([1e-310, -3e-320], dtype=torch.float64)
    b = torch.tensor([5e-324, -1e-321], dtype=torch.float64)
    rows = []
    for flush in (False, True):
        led = Ledger("cpu")
        reduce_into(a, led.row("a"), sketch=False)
        reduce_into(b, led.row("b"), sketch=False)
        assert torch.set_flush_denormal(flush) or not flush, "this CPU cannot flush subnormals"
        try:
            if how == "merge_row":
                merge_row(led.row("a"), led.row("b"))
            elif how == "Ledger.merge_on_host":
                led.merge_on_host("a", "b")
            else:
                add_zeros(led.row("a"), 2, sketch=False)
            assert _flushing() == flush
        finally:
            torch.set_flush_denormal(False)
        rows.append(led.transfer().wait()[led.rows["a"]: led.rows["a"] + ROW].copy())
    assert np.array_equal(rows[1], rows[0]), (rows[1][COL_MIN:].view(np.float64), rows[0][COL_MIN:].view(np.float64))
    got = decode_row(rows[1], 4, sketch=False)
    vals = [*a.tolist(), *(b.tolist() if how != "add_zeros" else [0.0, 0.0])]
    assert (bits(got.min), bits(got.max)) == (bits(min(vals)), bits(max(vals)))
    assert exact(got.sum) == sum(map(Fraction, vals))


@pytest.mark.parametrize("how", ["fused_into", "fused_many_at"])
@pytest.mark.parametrize("sketch", [True, False])
def test_fused_entry_points_under_flush_denormal(how, sketch):
    """The CPU kernel's own entry points keep subnormals under ``torch.set_flush_denormal(True)`` as
    :func:`reduce_into` does: their rows equal the ones made without it (they read the subnormals as zeros), and
    the thread's setting is as it was."""
    xs = [torch.tensor([1e-40, -3e-41, 2.0**-149, math.nan]), torch.tensor([1e-310, 5e-324, -2e-320],
                                                                             dtype=torch.float64)]
    rows = []
    for flush in (False, True):
        led = Ledger("cpu")
        addresses = led.addresses(list(range(len(xs))))
        assert torch.set_flush_denormal(flush) or not flush, "this CPU cannot flush subnormals"
        try:
            if how == "fused_into":
                for x, at in zip(xs, addresses):
                    fused_into(x, at, sketch)
            else:
                assert sorted(fused_many_at(fusable_ats(xs), addresses, sketch)) == [0, 1]
            assert _flushing() == flush
        finally:
            torch.set_flush_denormal(False)
        rows.append(led.transfer().wait().copy())
    assert np.array_equal(rows[1], rows[0])
    got = decode_row(rows[1][:ROW], 4, sketch=sketch)
    lo, hi = float(xs[0][1]), float(xs[0][0])  # (the float32 subnormals, widened exactly)
    assert (bits(got.min), bits(got.max), got.zero, got.nan) == (bits(lo), bits(hi), 0, 1)
    assert exact(got.sum) == sum(Fraction(float(v)) for v in xs[0][:3])
