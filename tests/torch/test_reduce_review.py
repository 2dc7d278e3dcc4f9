"""Review checks of the torch reductions and the plan's cost table against independent references."""

from __future__ import annotations

import torch

import trainhist
from trainhist.torch import Collector
from trainhist.torch.plan import SKETCH_ROW_BYTES, SPINE_ROW_BYTES


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
