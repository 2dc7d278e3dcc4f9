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
    # (window [4, 8) has no row: the file keeps the writer's cadence 1 (spec 11.7), so every step of it was due and
    # the whole window is cut out and hatched as unknown)
    assert [(a, b) for a, b, _ in cols] == [(-0.5, 3.5), (3.5, 7.5), (7.5, 11.5)]
    assert cols[1][2] == []


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
        assert len(lines) == 2  # min, max: each broken (NaN) between the segments, every piece going forward
        for ln in lines:
            pieces = _pieces(ln)
            assert [(x[0, 0], x[-1, 0]) for x in pieces] == [(0, 30), (20, 40)]
            assert all((np.diff(x[:, 0]) >= 0).all() for x in pieces)
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
        ax = site_figure(h, "a").axes[0]
        med = [ln for ln in ax.lines if "median" in str(ln.get_label())]
        assert med and abs(med[0].get_ydata()[0] - 3.0) < 0.6
        legend = " ".join(" ".join(t.get_text().split()) for t in ax.get_legend().get_texts())
        # (a sketch of part of the row: no bound is claimed for it, and the legend says so)
        assert "at 0 of 1 sketched rows; at the other 1 the sketch holds only part of the row's values" in legend
        assert "zeros estimated, no bound for the row's" in legend


def _pieces(line) -> list[np.ndarray]:
    """The (x, y) points of each unbroken piece of a line (NaN breaks it)."""
    xy = np.asarray(line.get_xydata(), float)
    pieces = [p[~np.isnan(p).any(axis=1)] for p in np.split(xy, np.flatnonzero(np.isnan(xy).any(axis=1)))]
    return [p for p in pieces if p.size]


def _ramp(tmp_path, sketch: bool):
    """Steps 0..29 of values +-(step + 1), coarsened into the windows [0, 10), [10, 20), [20, 30)."""
    p, c = tmp_path / f"ramp{sketch}.thist", tmp_path / f"ramp{sketch}_c.thist"
    with trainhist.HistoryWriter(p) as w:
        a = w.site("fc", "activation")
        for st in range(30):
            w.observe(a, st, np.array([st + 1.0, -(st + 1.0)]), sketch=sketch)
    trainhist.coarsen(p, c, steps=10)
    return c


def test_coarsened_rows_are_drawn_over_their_windows(tmp_path, monkeypatch):
    """Spec 2.3: a coarsened row is shown as its span. The site figure drew each window as a point at its first
    step (the x axis ended at 20; the window [20, 30) was a point), and so did the contact sheet."""
    with trainhist.open(_ramp(tmp_path, sketch=False)) as h:
        ax = site_figure(h, "fc").axes[0]
    lines = {str(ln.get_label()): ln for ln in ax.lines}
    mx = [ln for ln in ax.lines if ln.get_linestyle() == ":"]
    for ln, top in ((mx[0], [-10.0, -20, -30]), (mx[1], [10.0, 20, 30]), (lines["mean (from exact sums)"], [0.0] * 3)):
        (piece,) = _pieces(ln)  # one unbroken line: the windows follow each other
        assert piece[:, 0].tolist() == [0, 10, 10, 20, 20, 30] and piece[::2, 1].tolist() == top
        assert piece[1::2, 1].tolist() == top  # flat over each window
    assert ax.get_xlim()[1] >= 30 and "coarsened windows of up to 10 steps" in ax.get_title()
    with trainhist.open(_ramp(tmp_path, sketch=True)) as h:
        ax = site_figure(h, "fc").axes[0]
    (med,) = [ln for ln in ax.lines if "median" in str(ln.get_label())]
    assert _pieces(med)[0][:, 0].tolist() == [0, 10, 10, 20, 20, 30]
    fans = [c for c in ax.collections if "p5" in str(c.get_label()) or "p25" in str(c.get_label())]
    assert len(fans) == 2 and all(max(p.vertices[:, 0].max() for p in c.get_paths()) == 30 for c in fans)
    from matplotlib.figure import Figure

    drawn = []  # (the sheet's figures, as they are saved)
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (drawn.append(self), real(self, *a, **k)))
    with trainhist.open(_ramp(tmp_path, sketch=False)) as h:
        contact_sheet(h, tmp_path / "sheet")
    (rms,) = drawn[0].axes[0].lines
    assert _pieces(rms)[0][:, 0].tolist() == [0, 10, 10, 20, 20, 30]


def test_rows_without_numbers_are_marked_apart_from_the_values(tmp_path):
    """failed, absent and skipped rows were points at value 0 (read as zeros: missing is never zero), unknown and
    not_scheduled rows were not marked, and the lines ran straight across all of them and across steps the
    cadence called for that have no row. Now each state has a line of a strip below the values and a legend entry,
    and no line crosses a row without numbers or a due step without a row."""
    p = tmp_path / "gaps.thist"
    marks = {7: "failed", 12: "absent", 20: "skipped", 25: "unknown", 27: "not_scheduled"}
    with trainhist.HistoryWriter(p) as w:
        a = w.site("a", "activation")
        b = w.site("b", "activation", cadence_spine=10)
        for st in range(41):
            if st in marks:
                w.mark(a, st, marks[st])
            elif st not in (30, 31, 32, 40):  # due steps without a row: unknown
                w.observe(a, st, np.array([1.0, 2.0 + st]))
            if st % 10 == 0 and st != 30:
                w.observe(b, st, np.array([1.0, 2.0 + st]))
        w.mark(b, 5, "failed")  # (recorded after later steps: drawn where its step is)
    with trainhist.open(p) as h:
        fig = site_figure(h, "a")
        fig_b = site_figure(h, "b")
    ax, strip = fig.axes[:2]
    assert not [c for c in ax.collections if type(c).__name__ == "PathCollection"]  # (no scatter on the values)
    legend = [" ".join(t.get_text().split()) for t in ax.get_legend().get_texts()]  # (labels are wrapped)
    for name in ("failed", "absent", "skipped", "unknown", "not_scheduled"):
        assert any(t.startswith(name) for t in legend), name
    assert any("3 due steps without a row" in t for t in legend)
    assert [t.get_text() for t in strip.get_yticklabels()] == ["failed", "unknown", "skipped", "absent",
                                                               "not_scheduled"]
    at = {str(ln.get_label()).split(":")[0]: ln.get_xdata().tolist() for ln in strip.lines}
    assert at["failed"] == [7.5] and at["absent"] == [12.5] and at["unknown"] == [25.5, 31.5]
    breaks = [(7, 8), (12, 13), (20, 21), (25, 26), (30, 33)]  # (not_scheduled: the cadence did not call for it)
    for ln in ax.lines:
        for piece in _pieces(ln):
            x0, x1 = piece[:, 0].min(), piece[:, 0].max()
            assert not any(x0 < e and x1 > s for s, e in breaks) or piece.shape[0] == 1, (ln.get_label(), x0, x1)
    mn = next(ln for ln in ax.lines if ln.get_linestyle() == ":")
    assert [(p[0, 0], p[-1, 0]) for p in _pieces(mn)] == [(0, 7), (8, 12), (13, 20), (21, 25), (26, 30), (33, 40)]
    # cadence 10: rows at 10 and 20 are joined (nothing was due between them); step 30 was due and has no row
    ax_b, strip_b = fig_b.axes[:2]
    mn = next(ln for ln in ax_b.lines if ln.get_linestyle() == ":")
    assert [(p[0, 0], p[-1, 0]) for p in _pieces(mn)] == [(0, 1), (10, 21), (40, 41)]
    assert [ln.get_xdata().tolist() for ln in strip_b.lines] == [[5.5], [30.5]]


def _resumed(tmp_path, name: str = "a", nan: bool = False):
    """Steps 0..29, resumed at 20..39 (values of another magnitude); NaN everywhere when ``nan``."""
    p = tmp_path / "res.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site(name, "activation")
        for st in range(30):
            w.observe(s, st, np.full(8, np.nan if nan else 1.0))
            if st == 5:
                w.observe(s, st, np.full(8, np.nan if nan else 1.0), micro=1)  # (rows of one step summed: a note)
    with trainhist.HistoryWriter(p, mode="a") as w:
        s = w.site(name, "activation")
        for st in range(20, 40):
            w.observe(s, st, np.full(8, np.nan if nan else 1000.0))
    return p


def test_waterfall_marks_are_visible_on_any_background(tmp_path):
    """The band-count text was white on the white axes, the segment boundary a white line without a legend entry,
    and an all-NaN site a blank plot: the steps that held non-finite values are now marked from the spine."""
    from matplotlib.colors import to_rgba

    with trainhist.open(_resumed(tmp_path)) as h:
        ax = waterfall(h, "a").axes[0]
    (note,) = [t for t in ax.texts if "outside the window" in t.get_text()]
    box = note.get_bbox_patch()
    assert sum(to_rgba(note.get_color())[:3]) < 1.0 and box is not None
    assert to_rgba(box.get_facecolor())[:3] == (1.0, 1.0, 1.0) and box.get_alpha() >= 0.5
    (line,) = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert to_rgba(line.get_color())[:3] != (1.0, 1.0, 1.0) and line.get_path_effects()
    assert "segment boundary" in [t.get_text() for t in ax.get_legend().get_texts()]
    with trainhist.open(_resumed(tmp_path, "n", nan=True)) as h:
        ax = waterfall(h, "n").axes[0]
    (marks,) = [ln for ln in ax.lines if ln.get_marker() == "v"]
    assert marks.get_xdata().tolist() == list(range(40))  # (steps 20..29 of the replaced segment, step 5: once)
    assert any(t.get_text().startswith("non-finite values at 41 rows (NaN 328") for t in ax.get_legend().get_texts())
    assert any("no non-zero finite value" in t.get_text() for t in ax.texts)


def test_waterfall_title_fits_in_the_figure(tmp_path):
    """A title with the notes (rows summed, a resume's replayed rows) ran past both edges of the figure."""
    name = "transformer.h.11.mlp.c_fc.a_rather_long_module_name"
    with trainhist.open(_resumed(tmp_path, name)) as h:
        fig = waterfall(h, name)
    fig.canvas.draw()
    title = fig.axes[0].title
    box = title.get_window_extent(fig.canvas.get_renderer())
    assert "replayed" in title.get_text() and "summed" in title.get_text()
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height


def test_long_waterfall_adds_rows_into_few_columns_and_hatches_missing_steps(tmp_path, monkeypatch):
    """An image of one column per step took 39 s and 6.6 GB for 100k rows, and sketches every 10 steps made
    false stripes. Now consecutive rows of a segment add their counts (exactly) into at most about _MAX_COLUMNS
    columns, the figure says how many steps a column adds, and a column without a sketch is hatched, not zero."""
    from trainhist import figures

    monkeypatch.setattr(figures, "_MAX_COLUMNS", 20)
    p = tmp_path / "long.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("a", "activation", cadence_sketch=5)
        for st in range(250):
            w.observe(s, st, np.full(8, 2.0), sketch=st % 5 == 0 and not 100 <= st < 160)
    with trainhist.HistoryWriter(p, mode="a") as w:  # a resume inside a column: the column is split there
        s = w.site("a", "activation", cadence_sketch=5)
        for st in range(250, 400):
            w.observe(s, st, np.full(8, 2.0), sketch=st % 5 == 0)
    with trainhist.open(p) as h:
        fig = waterfall(h, "a")
    ax = fig.axes[0]
    assert "each column adds the sketches of 20 steps" in ax.get_title()
    cols = _mesh_columns(fig)
    edges = [a for a, _, _ in cols] + [cols[-1][1]]
    assert len(cols) <= 22 and 249.5 in edges and edges[0] == -0.5 and edges[-1] == 399.5
    mesh = ax.collections[0]
    counts = 10 ** np.ma.filled(mesh.get_array().astype(float), np.nan).reshape(-1, len(cols))
    total = np.nansum(counts, axis=0)
    sketched = [sum(1 for st in range(round(a + 0.5), round(b + 0.5)) if st % 5 == 0 and not 100 <= st < 160)
                for a, b, _ in cols]
    assert np.allclose(total, [8 * n if n else 0 for n in sketched])  # every sketch's 8 values, added
    blank = [(a, b) for (a, b, occ), n in zip(cols, sketched) if not n]
    assert blank == [(99.5, 159.5)] and all(not occ for (_, _, occ), n in zip(cols, sketched) if not n)
    (hatch,) = [c for c in ax.collections if "no sketch" in str(c.get_label())]
    assert hatch.get_hatch() and [p.vertices[:, 0].min() for p in hatch.get_paths()] == [99.5]


def test_rows_recorded_out_of_step_order_are_drawn_in_step_order(tmp_path, monkeypatch):
    """A writer may record a step after a later one: the lines follow the steps, not the file order (the series
    reordered keeps its exact sums, which the reader may derive a row's mean and rms from)."""
    from matplotlib.figure import Figure

    p = tmp_path / "o.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("a", "activation", cadence_spine=5)
        for st in (0, 10, 15, 5):
            w.observe(s, st, np.array([1.0, 3.0 + st]), sketch=False)
    drawn = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (drawn.append(self), real(self, *a, **k)))
    with trainhist.open(p) as h:
        ax = site_figure(h, "a").axes[0]
        contact_sheet(h, tmp_path / "sheet")
    (mean,) = [ln for ln in ax.lines if "mean" in str(ln.get_label())]
    (rms,) = drawn[0].axes[0].lines
    for ln, y in ((mean, [2.0, 4.5, 7.0, 9.5]), (rms, [np.sqrt((1 + (3 + st) ** 2) / 2) for st in (0, 5, 10, 15)])):
        (piece,) = _pieces(ln)
        assert piece[:, 0].tolist() == [0, 1, 5, 6, 10, 11, 15, 16] and np.allclose(piece[::2, 1], y)


def test_skipped_steps_and_boundaries_beyond_a_float_axis_are_left_out_and_said(tmp_path):
    """A skipped optimizer step or a segment's first step beyond 2^52 (the site's own rows drawable) stretched the
    step axis to 2^60, squashing every row into one pixel: such marks are left out, and the figure says how many."""
    p = tmp_path / "far.thist"
    with trainhist.HistoryWriter(p) as w:
        a = w.site("a", "activation")
        for st in range(5):
            w.observe(a, st, np.arange(1.0, 4.0) + st)
        w.step_truth(3, applied="skipped")
        w.step_truth(2**60, applied="skipped")
        w.new_segment(2**60, reason="resume")
        w.new_segment(-(2**62), reason="resume")
        w.observe(a, 6, np.ones(3))
    with trainhist.open(p) as h:
        fig = site_figure(h, "a")
        ax = fig.axes[0]
        lo, hi = ax.get_xlim()
        assert -10 < lo and hi < 20  # (the drawn rows and marks only)
        labels = [t.get_text().replace("\n", " ") for t in ax.get_legend().get_texts()]
        assert "1 skipped optimizer steps and 1 segment boundaries beyond +-2^52 not drawn" in labels
        assert "optimizer step skipped" in labels  # (step 3 is drawn)
        wf = waterfall(h, "a")
        assert "1 segment boundaries beyond +-2^52 not drawn" in wf.axes[0].get_title().replace("\n", " ")
        lo, hi = wf.axes[0].get_xlim()
        assert -10 < lo and hi < 20


def test_steps_no_float_axis_can_hold_are_refused_and_every_later_segment_is_a_boundary(tmp_path):
    """Rows at steps near 2^63 were drawn across the whole axis or at negative steps (the ends overflowed): a figure
    refuses steps beyond 2^52 with a typed error. A merged file of two runs kept apart has two segments that both
    'start': the second is marked too (only resumed segments were), as the start of another run."""
    from trainhist.errors import UsageError

    p = tmp_path / "big.thist"
    with trainhist.HistoryWriter(p) as w:
        a = w.site("a", "activation")
        for st in (0, 2**62, 2**63 - 1):
            w.observe(a, st, np.ones(3))
    with trainhist.open(p) as h:
        import matplotlib.pyplot as plt

        before = plt.get_fignums()
        for draw in (lambda: site_figure(h, "a"), lambda: waterfall(h, "a")):
            with pytest.raises(UsageError) as e:
                draw()
            assert e.value.code == "undrawable_steps"
            assert f"steps from 0 to {2**63 - 1} cannot be drawn" in str(e.value)
        assert plt.get_fignums() == before  # (refused before a figure was made)
    with trainhist.HistoryWriter(p, mode="a") as w:  # another site, drawable: the contact sheet draws it
        w.observe(w.site("b", "activation"), 1, np.ones(3))
    with trainhist.open(p) as h:
        (page,) = contact_sheet(h, tmp_path / "sheet")
        assert page.stat().st_size > 1000
    runs = []
    for i, rid in enumerate(("ab" * 16, "cd" * 16)):
        q = tmp_path / f"r{i}.thist"
        with trainhist.HistoryWriter(q, run_id=rid) as w:
            a = w.site("a", "activation")
            for st in range(10 * i, 10 * i + 10):
                w.observe(a, st, np.ones(3))
        runs.append(q)
    trainhist.merge(runs, tmp_path / "m.thist")
    with trainhist.open(tmp_path / "m.thist") as h:
        assert [g.reason for g in h.segments] == ["start", "start"]
        fig = site_figure(h, "a")
        labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        assert any("[cdcdcdcd] (another run) from here" in t for t in labels), labels


def test_two_runs_kept_apart_are_drawn_both_and_not_as_a_resume(tmp_path):
    """Two runs merged without --across-runs are two segments over the same steps (spec 11.3): the waterfall hid
    the first run's rows as 'rows of a segment a resume replayed' and marked a segment boundary. Now each run has a
    panel of its own, nothing is said to be replayed, and the site figure names the other run."""
    paths = []
    for k, (rid, scale) in enumerate((("ab" * 16, 1.0), ("cd" * 16, 1000.0))):
        q = tmp_path / f"r{k}.thist"
        with trainhist.HistoryWriter(q, run_id=rid, run_name=f"seed{k}") as w:
            a = w.site("a", "activation")
            for st in range(10):
                w.observe(a, st, np.full(8, scale))
        paths.append(q)
    trainhist.merge(paths, tmp_path / "m.thist")
    with trainhist.open(tmp_path / "m.thist") as h:
        fig = waterfall(h, "a")
        titles = [ax.get_title().replace("\n", " ") for ax in fig.axes if ax.get_title()]
        assert not any("replayed" in t for t in titles), titles
        assert "run 'seed0' [abababab]: segment 0" in titles[0]
        assert "run 'seed1' [cdcdcdcd] (another run): segment 1" in titles[1]
        meshes = [ax.collections[0] for ax in fig.axes if ax.get_title()]  # (the panels, not their colour bars)
        assert len(meshes) == 2  # (both runs drawn, each over steps 0..9)
        for mesh in meshes:
            assert mesh.get_coordinates()[0, :, 0].tolist() == [x - 0.5 for x in range(11)]
        assert not any(line.get_linestyle() == "--" for ax in fig.axes for line in ax.lines)  # (no boundary)
        t = site_figure(h, "a").axes[0].get_title().replace("\n", " ")
        assert "2 runs kept apart (spec 11.3), drawn over the same steps: 'seed0' [abababab]; 'seed1' [cdcdcdcd]" in t


def _sparse_sketches(tmp_path):
    """Spine every step 0..14, sketches every 5 steps (0, 5, 10); step 7 failed, 8 due without a row, 11 absent,
    12 skipped, 13 and 14 observed after the last sketch."""
    p = tmp_path / "sparse.thist"
    rng = np.random.default_rng(1)
    with trainhist.HistoryWriter(p) as w:
        s = w.site("enc", "activation", cadence_sketch=5)
        for st in range(15):
            if st in (7, 11, 12):
                w.mark(s, st, {7: "failed", 11: "absent", 12: "skipped"}[st])
            elif st != 8:
                w.observe(s, st, rng.standard_normal(64) * (st + 1), sketch=st % 5 == 0)
    return p


def test_derived_quantiles_are_not_joined_across_steps_without_a_sketch(tmp_path):
    """The median and the fan ran diagonally from the sketch at step 0 to the one at step 5 over steps 1..4, which
    have values but no sketch: quantiles that were never read. They are drawn over the sketched rows' own steps,
    and the legend says so (and that every derived quantile, not the median alone, has the bin-width bound)."""
    with trainhist.open(_sparse_sketches(tmp_path)) as h:
        ax = site_figure(h, "enc").axes[0]
    (med,) = [ln for ln in ax.lines if "median" in str(ln.get_label())]
    assert [(p[0, 0], p[-1, 0]) for p in _pieces(med)] == [(0, 1), (5, 6), (10, 11)]
    fans = [c for c in ax.collections if "p5" in str(c.get_label()) or "p25" in str(c.get_label())]
    assert len(fans) == 2
    for c in fans:
        for path in c.get_paths():
            xs = path.vertices[:, 0]
            assert xs.max() - xs.min() <= 1, (c.get_label(), xs.min(), xs.max())  # (one sketched step each)
    legend = [" ".join(t.get_text().split()) for t in ax.get_legend().get_texts()]
    note = next(t for t in legend if t.startswith("every derived quantile"))
    assert "±19% relative" in note and "drawn only at the 3 of 11 rows" in note
    assert not any("±" in t for t in legend if t.startswith("median"))


def test_waterfall_shows_every_spine_step_and_names_why_a_sketch_is_missing(tmp_path):
    """Steps after the last sketch were cut off the axis (neither hatched nor shown), and failed, absent, skipped
    and unknown steps had the same 'no sketch' hatch as steps where no sketch was scheduled. Each state now has its
    own hatch, color and legend entry, and the axis covers every step of the spine."""
    with trainhist.open(_sparse_sketches(tmp_path)) as h:
        fig = waterfall(h, "enc")
    ax = fig.axes[0]
    cols = _mesh_columns(fig)
    assert cols[0][0] == -0.5 and cols[-1][1] == 14.5 and cols[-1][2] == []
    hatched = {}
    for c in ax.collections[1:]:
        label = str(c.get_label())
        if c.get_hatch():
            hatched[label.split(":")[0].split(" (")[0]] = sorted((round(p.vertices[:, 0].min(), 1),
                                                                  round(p.vertices[:, 0].max(), 1))
                                                                 for p in c.get_paths())
    assert hatched == {"no sketch at these steps": [(0.5, 4.5), (5.5, 6.5), (8.5, 9.5), (12.5, 14.5)],
                       "failed": [(6.5, 7.5)], "unknown": [(7.5, 8.5)], "absent": [(10.5, 11.5)],
                       "skipped": [(11.5, 12.5)]}
    hatches = {str(c.get_label()).split(":")[0]: (c.get_hatch(), tuple(c.get_edgecolor()[0]))
               for c in ax.collections[1:] if c.get_hatch()}
    assert len(set(hatches.values())) == len(hatches)  # (distinct hatch and color each)
    legend = [t.get_text().replace("\n", " ") for t in ax.get_legend().get_texts()]
    assert "failed: 1 row without numbers" in legend and "unknown: 1 run of due steps without a row" in legend


def test_long_waterfall_hatches_a_failed_column_and_says_what_no_hatch_can_mark(tmp_path, monkeypatch):
    """Columns that add several steps: one that holds no sketch takes the hatch of the state of its rows; rows
    without numbers in a column that also holds sketches cannot be hatched, and the title says how many."""
    from trainhist import figures

    monkeypatch.setattr(figures, "_MAX_COLUMNS", 10)
    p = tmp_path / "lf.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("a", "activation")
        for st in range(100):
            if 40 <= st < 50 or st == 73:
                w.mark(s, st, "failed")
            else:
                w.observe(s, st, np.full(4, 2.0))
    with trainhist.open(p) as h:
        ax = waterfall(h, "a").axes[0]
    assert "each column adds the sketches of 10 steps" in ax.get_title()
    (failed,) = [c for c in ax.collections if str(c.get_label()).startswith("failed")]
    assert [(p.vertices[:, 0].min(), p.vertices[:, 0].max()) for p in failed.get_paths()] == [(39.5, 49.5)]
    assert "failed: 10 rows without numbers" in str(failed.get_label())
    assert "1 row without numbers lies in columns that hold sketches" in ax.get_title().replace("\n", " ")


def test_contact_sheet_has_a_key_and_axis_labels_and_site_figure_ticks_do_not_overlap_at_zero(tmp_path,
                                                                                             monkeypatch):
    """The contact sheet had no key for its pink tiles and red lines, no y label on its tiles, and a footer naming
    an internal sort key (nonfinite_first_then_drift); the site figure labelled 10^-2, 0 and -10^-2 a hair apart."""
    from matplotlib.figure import Figure

    drawn = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (drawn.append(self), real(self, *a, **k)))
    with trainhist.open(_history(tmp_path)) as h:
        contact_sheet(h, tmp_path / "sheet")
        ax = site_figure(h, "h.1").axes[0]
    fig = drawn[0]
    footer = " ".join(t.get_text() for t in fig.texts)
    assert "nonfinite_first_then_drift" not in footer and "non-finite values first" in footer
    (key,) = fig.legends
    labels = [t.get_text() for t in key.get_texts()]
    assert any(t.startswith("pink tile") for t in labels) and any(t.startswith("red line") for t in labels)
    assert all(a.get_ylabel().startswith("rms") for a in fig.axes if a.axison)
    lin = ax.get_yscale() == "symlog" and ax.yaxis.get_transform().linthresh
    ticks = [t for t in ax.get_yticks() if t != 0]
    assert lin and ticks and all(abs(t) >= lin for t in ticks)


def test_waterfall_labels_a_sketch_of_no_finite_value(tmp_path):
    """A step whose sketch holds no finite value (every value NaN) was a white column, neither drawn nor said."""
    p = tmp_path / "n.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("a", "activation")
        for st in range(4):
            w.observe(s, st, np.full(4, np.nan if st == 2 else 1.0))
    with trainhist.open(p) as h:
        ax = waterfall(h, "a").axes[0]
    (c,) = [c for c in ax.collections if "no non-zero finite value" in str(c.get_label())]
    assert c.get_hatch() and [(p.vertices[:, 0].min(), p.vertices[:, 0].max()) for p in c.get_paths()] == [(1.5, 2.5)]


def test_the_mean_line_says_how_its_sums_were_taken_and_what_it_leaves_out(tmp_path):
    """The site figure labelled its mean 'from exact sums' whatever the rows' summation method (the collector's
    rows are f64_accumulate), and a row whose sums overflowed (method unknown) was a silent gap in it."""
    from trainhist.dyadic import Dyadic
    from trainhist.summary import Summary, SumMethod, summarize

    p = tmp_path / "m.thist"
    with trainhist.HistoryWriter(p) as w:
        a = w.site("fc", "activation")
        for st in range(4):
            s = summarize(np.array([1.0, 2.0 + st]), sketch=False)
            if st < 3:
                s.sum_method = SumMethod.F64
            else:
                s = Summary(count=2, min=1.0, max=1e300, sum=Dyadic.from_float(0.0), sumsq=Dyadic.from_float(0.0),
                            sum_method=SumMethod.UNKNOWN)
            w.observe(a, st, summary=s)
    with trainhist.open(p) as h:
        ax = site_figure(h, "fc").axes[0]
    labels = [str(ln.get_label()) for ln in ax.lines]
    assert "mean (from sums: f64_accumulate, bounded (spec 5.4); 1 row with unknown sums left out)" in labels


def test_plot_command_draws_the_contact_sheet_or_the_named_sites(tmp_path, capsys) -> None:
    """`trainhist plot`: the contact sheet by default; with --site, a figure and a waterfall per stream and phase
    (the phase in the name where the site has several), narrowed by --stream/--phase; names checked first."""
    from trainhist.cli import main

    p = _history(tmp_path)
    out = tmp_path / "figs"
    assert main(["plot", str(p), "-o", str(out), "--per-page", "4"]) == 0
    pages = capsys.readouterr().out.split()
    assert [x.rsplit("/", 1)[1] for x in pages] == ["contact_sheet_p1.png", "contact_sheet_p2.png"]
    assert all((out / f"contact_sheet_p{k}.png").stat().st_size > 1000 for k in (1, 2))
    assert main(["plot", str(p), "-o", str(out), "--site", "h.0", "--site", "h.3", "--stream", "activation"]) == 0
    names = sorted(x.rsplit("/", 1)[1] for x in capsys.readouterr().out.split())
    assert names == [f"h.{k}.activation.{kind}.png" for k in (0, 3) for kind in ("site", "waterfall")]
    assert main(["plot", str(p), "-o", str(out), "--site", "h.0", "--stream", "param_grad"]) == 0
    names = sorted(x.rsplit("/", 1)[1] for x in capsys.readouterr().out.split())
    assert names == [f"h.0.param_grad.{ph}.{kind}.png" for ph in ("post_clip", "pre_clip")
                     for kind in ("site", "waterfall")]
    assert main(["plot", str(p), "-o", str(out), "--site", "h.0", "--phase", "post_clip"]) == 0
    assert capsys.readouterr().out.split()[0].endswith("h.0.param_grad.post_clip.site.png")
    assert all(f.stat().st_size > 1000 for f in out.iterdir())
    drawn = sorted(out.iterdir())
    for bad, code, says in ((["--site", "h.9"], "unknown_site", "no site path 'h.9' in this file; closest: ['h.4'"),
                            (["--site", "h.1", "--site", "h.0", "--stream", "param"], "unknown_site",
                             "site 'h.1' has no stream 'param': it has ['activation']"),
                            (["--site", "h.1", "--phase", "pre_clip"], "unknown_phase",
                             "site 'h.1' has no rows in phase 'pre_clip': it has ['activation default']")):
        assert main(["plot", str(p), "-o", str(out), *bad]) == 2
        err = capsys.readouterr().err
        assert f"[{code}]" in err and says in err, err
    assert sorted(out.iterdir()) == drawn  # (a refused name draws nothing, not even the names before it)
    torn = tmp_path / "torn.thist"
    torn.write_bytes(p.read_bytes() + b"\x01\x02\x03")
    assert main(["plot", str(torn), "-o", str(tmp_path / "t"), "--site", "h.2", "--stream", "activation"]) == 3
    assert "only the committed prefix was drawn" in capsys.readouterr().out


def test_plot_command_without_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch) -> None:
    import sys

    from trainhist.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(_history(tmp_path)), "-o", str(tmp_path / "figs")]) == 2
    err = capsys.readouterr().err
    assert "[needs_viz]" in err and "pip install 'trainhist[viz]'" in err and not (tmp_path / "figs").exists()


def test_plot_command_keeps_figures_of_names_that_read_the_same_apart(tmp_path, capsys) -> None:
    """Facets 'a b' and 'a_b' (or 'α' and 'β') made one file name: the second figure replaced the first, with both
    paths printed. A file given as -o is a usage error (2), as export's is."""
    from trainhist.cli import main

    p = tmp_path / "f.thist"
    with trainhist.HistoryWriter(p) as w:
        for facet in ("a b", "a_b", "α", "β"):
            w.observe(w.site("x", "activation", facet=facet), 0, np.arange(4.0))
    assert main(["plot", str(p), "-o", str(tmp_path / "o"), "--site", "x"]) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 8 == len(set(printed)) == len(list((tmp_path / "o").iterdir()))
    assert main(["plot", str(p), "-o", str(p), "--site", "x"]) == 2
    assert "[bad_output]" in capsys.readouterr().err


def test_site_figure_says_which_rows_with_values_hold_skipped_steps(tmp_path) -> None:
    """observed outranks skipped (spec 11.4): a window holding a skipped update is drawn with the other steps'
    values, and nothing said so; the legend does now."""
    from history_helpers import skipped_updates

    raw = skipped_updates(tmp_path / "r.thist", 8, (1, 5))
    trainhist.coarsen(raw, tmp_path / "c.thist", steps=4)
    for path, said in ((tmp_path / "c.thist", True), (raw, False)):
        with trainhist.open(path) as h:
            ax = site_figure(h, "w", "param_delta").axes[0]
        legend = " ".join(" ".join(t.get_text().split()) for t in ax.get_legend().get_texts())
        assert ("2 rows with values also hold skipped steps or inputs (n_skipped)" in legend) is said, legend


def test_a_single_undrawable_step_is_named_once(tmp_path):
    """One row at step 2^62: the refusal said 'steps up to 4611686018427387904 and down to 4611686018427387904'."""
    from trainhist.errors import UsageError

    p = tmp_path / "one.thist"
    with trainhist.HistoryWriter(p) as w:
        w.observe(w.site("a", "activation"), 2**62, np.ones(3))
    with trainhist.open(p) as h, pytest.raises(UsageError) as e:
        site_figure(h, "a")
    assert e.value.code == "undrawable_steps" and f"a: step {2**62} cannot be drawn" in str(e.value)
