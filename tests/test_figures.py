"""Figures render, label their approximations and mark gaps, segments and non-finite events."""

from __future__ import annotations

import numpy as np
import pytest

import trainhist
from trainhist.figures import contact_sheet, quantiles_from_sketch, site_figure, waterfall

pytest.importorskip("matplotlib")


def _history(tmp_path):
    p = tmp_path / "f.thist"
    rng = np.random.default_rng(0)
    with trainhist.HistoryWriter(p) as w:
        sites = [w.site(f"h.{i}", "activation") for i in range(5)]
        g = w.site("h.0", "param_grad")
        for step in range(30):
            for k, s in enumerate(sites):
                x = (rng.standard_normal(256) * (1 + step * 0.1 * k)).astype(np.float32)
                if k == 3 and step == 20:
                    x[0] = np.nan
                if k == 2 and step == 7:
                    w.mark(s, step, "failed")
                    continue
                w.observe(s, step, x, sketch=step % 2 == 0)
            w.observe(g, step, rng.standard_normal(16), phase="pre_clip")
            w.observe(g, step, rng.standard_normal(16) * 0.1, phase="post_clip")
            w.step_truth(step, applied=step != 11)
        w.new_segment(30, reason="resume")
        w.observe(sites[0], 30, rng.standard_normal(256).astype(np.float32))
    return p


def test_quantiles_from_sketch_lie_within_one_bin_of_the_truth() -> None:
    x = np.random.default_rng(1).standard_normal(10001)
    s = trainhist.summarize(x)
    sk = s.sketch
    q = quantiles_from_sketch(sk.pos[None], sk.neg[None], np.array([[0, 0, 0, 0]]), np.array([s.zero]), sk.scale,
                              (0.1, 0.5, 0.9))[0]
    true = np.quantile(x, [0.1, 0.5, 0.9])
    for est, t in zip(q, true):
        assert abs(est - t) <= abs(t) * (2**0.25 - 1) + 1e-12


def test_figures_render_with_labels(tmp_path) -> None:
    p = _history(tmp_path)
    with trainhist.open(p) as h:
        fig = site_figure(h, "h.3")
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert any("derived" in t for t in labels) and any("exact" in t for t in labels)
        assert any("non-finite" in t for t in labels)
        assert any("segment boundary" in t for t in labels)  # the resume is marked on every site of the run
        fig0 = site_figure(h, "h.0", out=tmp_path / "h0.png")
        assert (tmp_path / "h0.png").stat().st_size > 1000 and fig0 is not None
        fig2 = site_figure(h, "h.2")
        labels2 = [t.get_text() for t in fig2.axes[0].get_legend().get_texts()]
        assert any("failed" in t for t in labels2) and any("skipped" in t for t in labels2)
        waterfall(h, "h.1", out=tmp_path / "wf.png")
        assert (tmp_path / "wf.png").stat().st_size > 1000
        pages = contact_sheet(h, tmp_path / "sheet", per_page=4, cols=2)
    assert len(pages) == 2 and all(pg.stat().st_size > 1000 for pg in pages)
