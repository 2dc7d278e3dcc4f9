"""Figures render, label their approximations and mark gaps, segments and non-finite events."""

from __future__ import annotations

import numpy as np
import pytest

import trainhist
from trainhist.figures import _step_columns, contact_sheet, quantiles_from_sketch, site_figure, waterfall

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


def _mesh_columns(fig) -> list[tuple[float, float, list[int]]]:
    """(x from, x to, occupied bin rows) of each column of a waterfall's mesh."""
    mesh = fig.axes[0].collections[0]
    xs = mesh.get_coordinates()[0, :, 0]
    arr = np.ma.masked_invalid(np.ma.filled(mesh.get_array().astype(float), np.nan).reshape(-1, len(xs) - 1))
    return [(float(xs[j]), float(xs[j + 1]), np.flatnonzero(~arr.mask[:, j]).tolist()) for j in range(len(xs) - 1)]


def test_waterfall_draws_each_sketch_over_its_own_steps(tmp_path):
    """Rows at steps 0, 1, 2, 10, 11 (nothing in between): each column sits over its step and steps 3..9 are
    blank (an image of equal columns used to draw step 10's sketch over steps 6..9). A coarsened row spans its
    window; rows of one step are summed."""
    p = tmp_path / "w.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("a", "activation")
        for st in (0, 1, 2, 10, 11):
            w.observe(s, st, np.full(8, 1.0 if st < 10 else 1000.0))
        w.observe(s, 11, np.full(8, 1000.0), micro=1)
    with trainhist.open(p) as h:
        fig = waterfall(h, "a")
        assert "rows of one step summed" in fig.axes[0].get_title()
    cols = _mesh_columns(fig)
    assert [(a, b) for a, b, _ in cols] == [(-0.5, 0.5), (0.5, 1.5), (1.5, 2.5), (2.5, 9.5), (9.5, 10.5),
                                            (10.5, 11.5)]
    assert cols[3][2] == [] and cols[0][2] == cols[1][2] == cols[2][2] != cols[4][2] == cols[5][2] != []
    assert cols[4][2][0] > cols[0][2][0]  # 1000 lies in a higher bin than 1
    c = tmp_path / "c.thist"
    trainhist.coarsen(p, c, steps=4)
    with trainhist.open(c) as h:
        cols = _mesh_columns(waterfall(h, "a"))
    assert [(a, b) for a, b, _ in cols] == [(-0.5, 3.5), (3.5, 7.5), (7.5, 11.5)] and cols[1][2] == []


def test_waterfall_counts_rows_that_overlap_instead_of_drawing_them_at_zero_width():
    """A span-1 row at the step where a span-10 row starts used to get a zero-width column (drawn nowhere, said
    nowhere); a row whose span reaches past the next row's step is cut there. Both are counted for the title."""
    grid = np.eye(3)
    edges, img, summed, overlapped = _step_columns(np.array([5, 5, 20]), np.array([1, 10, 1]), grid)
    assert edges.tolist() == [4.5, 14.5, 19.5, 20.5] and overlapped == 1 and not summed
    assert img.shape == (3, 3) and np.isnan(img[:, 1]).all() and img[1, 0] == 0.0  # the span-10 row's counts
    edges, img, summed, overlapped = _step_columns(np.array([0, 2]), np.array([4, 1]), grid[:2])
    assert edges.tolist() == [-0.5, 1.5, 2.5] and overlapped == 1
    edges, img, summed, overlapped = _step_columns(np.array([0, 4]), np.array([4, 1]), grid[:2])
    assert edges.tolist() == [-0.5, 3.5, 4.5] and overlapped == 0


def test_extreme_magnitudes_render_with_the_data_in_view(tmp_path):
    """rms from 1e154 down to 1e-160 (contact sheet: an OverflowError inside matplotlib's tick layout) and values
    at the ends of the float range (site figure: limits of +-0.001, the data out of view)."""
    p = tmp_path / "x.thist"
    with trainhist.HistoryWriter(p) as w:
        c, m = w.site("c", "activation"), w.site("m", "activation")
        for st in range(3):
            w.observe(c, st, np.array([1e154 if st == 0 else 1e-160]))
            w.observe(m, st, np.array([1.7976931348623157e308, -1.7976931348623157e308]))
    with trainhist.open(p) as h:
        pages = contact_sheet(h, tmp_path / "sheet")
        assert len(pages) == 1 and pages[0].stat().st_size > 1000
        lo, hi = site_figure(h, "m").axes[0].get_ylim()
        assert lo <= -1.7e308 and hi >= 1.7e308


def test_figures_keep_a_resumed_segment_apart_and_mark_its_boundary(tmp_path):
    """A run resumed at step 20 replays steps 20-29: the waterfall summed the two segments' rows there (two runs
    mixed in one column), the contact sheet and the site figure joined their lines across the boundary, and only
    the site figure marked it."""
    p = tmp_path / "r.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("a", "activation")
        for st in range(30):
            w.observe(s, st, np.full(8, 1.0))
    with trainhist.HistoryWriter(p, mode="a") as w:  # the resume: steps 20..39, values of another magnitude
        s = w.site("a", "activation")
        for st in range(20, 40):
            w.observe(s, st, np.full(8, 1000.0))
    with trainhist.open(p) as h:
        fig = waterfall(h, "a")
        assert "10 rows of a segment a resume replayed not drawn" in fig.axes[0].get_title()  # steps 20..29
        assert "summed" not in fig.axes[0].get_title()
        cols = _mesh_columns(fig)
        assert [round(a + 0.5) for a, _, _ in cols] == list(range(40))  # one column per step, none doubled
        assert cols[19][2] != cols[20][2] == cols[39][2]  # steps 20.. show the resumed run's values
        for f in (fig, site_figure(h, "a")):
            assert any(line.get_xdata()[0] == 20 and line.get_linestyle() == "--" for line in f.axes[0].lines)
        lines = [ln for ln in site_figure(h, "a").axes[0].lines if ln.get_linestyle() == ":"]
        assert all(np.all(np.diff(ln.get_xdata()) > 0) for ln in lines) and len(lines) == 4  # min, max per segment
        page = contact_sheet(h, tmp_path / "sheet")[0]
        assert page.stat().st_size > 1000


def test_quantile_edges_bands_and_partly_sketched_windows(tmp_path):
    """q = 0 gave -65536 for every row (the empty over_neg cell came first); a quantile in an overflow band was
    the window's edge (65536 for values near 1e12) with nothing to say so; and a coarsened window sketched at one
    of its steps took the zeros of all of them (median 0 of a window whose values are five 3s and three 0s)."""
    sk = trainhist.summarize(np.array([1.0, 2.0, 4.0])).sketch
    q = quantiles_from_sketch(sk.pos[None], sk.neg[None], np.zeros((1, 4)), np.array([0]), sk.scale, (0.0, 1.0))
    assert 0.8 < q[0, 0] < 1.2 and 3.5 < q[0, 1] < 4.6
    big = trainhist.summarize(np.array([1e12, 4e12])).sketch
    q = quantiles_from_sketch(big.pos[None], big.neg[None], np.array([[0, 0, 2, 0]]), np.array([0]), big.scale,
                              (0.5,))
    assert np.isnan(q[0, 0])
    p = tmp_path / "z.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("a", "activation", cadence_sketch=4)
        for st in range(4):
            w.observe(s, st, np.array([3.0, 3.0]) if st == 0 else np.array([3.0, 0.0]), sketch=st == 0)
    trainhist.coarsen(p, tmp_path / "c.thist", steps=4)
    with trainhist.open(tmp_path / "c.thist") as h:
        med = [ln for ln in site_figure(h, "a").axes[0].lines if "median" in str(ln.get_label())]
        assert med and abs(med[0].get_ydata()[0] - 3.0) < 0.6 and "zeros estimated" in med[0].get_label()
