"""Review checks of the torch reductions and the plan's cost table against independent references."""

from __future__ import annotations

import math
import sys
from fractions import Fraction

import pytest
import torch
from torch_helpers import CPU_METHODS, bits

import trainhist
from trainhist.dyadic import Dyadic
from trainhist.summary import SumMethod
from trainhist.torch import Collector
from trainhist.torch.plan import SKETCH_ROW_BYTES, SPINE_ROW_BYTES
from trainhist.torch.reduce import Ledger, decode_row, reduce_into

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
