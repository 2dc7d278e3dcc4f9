"""Every approximation and every gap is labelled on the figure, read from the figure's own texts: derived quantiles
that no bin places, sketches whose values lie outside the grid's window, and rows without numbers by state."""

from __future__ import annotations

import numpy as np
import pytest

import trainhist

pytest.importorskip("matplotlib")

from trainhist.figures import contact_sheet, site_figure, waterfall

FAST = dict(fsync="never")


@pytest.fixture
def close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _texts(ax) -> list[str]:
    """The legend entries, free texts and title of ``ax``, each on one line."""
    leg = ax.get_legend()
    out = [t.get_text() for t in leg.get_texts()] if leg is not None else []
    out += [t.get_text() for t in ax.texts] + [ax.get_title()]
    return [" ".join(t.split()) for t in out]


def _band_history(path, rows: dict[int, np.ndarray]) -> None:
    with trainhist.HistoryWriter(path, **FAST) as w:
        a = w.site("a", "activation")
        for step, x in sorted(rows.items()):
            w.observe(a, step, x)


def test_a_waterfall_of_values_outside_the_window_does_not_say_no_value(tmp_path, close_figures) -> None:
    """A sketch whose values all lie in the under/overflow bands (|x| <= 2^-48 or > 2^16) has every in-window bin
    0, but holds values: its column was hatched "a sketch with every count 0: no non-zero finite value", and a
    waterfall of such rows alone said "the sketches hold no non-zero finite value". They say where the values
    are."""
    rng = np.random.default_rng(0)
    p = tmp_path / "b.thist"
    _band_history(p, {0: rng.standard_normal(50), 1: rng.standard_normal(50) * 1e-20,
                      2: rng.standard_normal(50) * 1e7, 3: np.zeros(5)})
    with trainhist.open(p) as h:
        texts = _texts(waterfall(h, "a").axes[0])
    band = [t for t in texts if "no value inside the window" in t]
    assert band and "2 columns" in band[0], texts
    empty = [t for t in texts if "every count 0" in t]
    assert len(empty) == 1, texts  # (the zeros' row: nothing non-zero at all)
    p2 = tmp_path / "b2.thist"
    _band_history(p2, {0: rng.standard_normal(50) * 1e-20, 1: rng.standard_normal(50) * 1e9})
    with trainhist.open(p2) as h:
        texts = _texts(waterfall(h, "a").axes[0])
    assert not any("no non-zero finite value" in t for t in texts), texts
    assert any("outside the window" in t and "100 values" in t for t in texts), texts


def test_a_site_figure_says_where_derived_quantiles_lie_outside_the_window(tmp_path, close_figures) -> None:
    """A quantile that falls in an under/overflow band has no bin to place it (NaN, never the window's edge): the
    fan and median had a hole there while the legend said "every derived quantile ... within ±19%", and nothing
    said why none was drawn. The legend says at how many rows a quantile is not drawn, and why."""
    rng = np.random.default_rng(1)
    p = tmp_path / "q.thist"
    rows = {k: rng.standard_normal(100) for k in range(10)}
    rows.update({k: rng.standard_normal(100) * 1e-20 for k in (3, 4)})  # (every quantile in the under band)
    rows[7] = rng.standard_normal(100) * 1e7  # (most in the overflow band)
    _band_history(p, rows)
    with trainhist.open(p) as h:
        texts = _texts(site_figure(h, "a").axes[0])
    notes = [t for t in texts if "outside the window" in t]
    assert notes and "3 of 10 sketched rows" in notes[0] and "not drawn" in notes[0], texts
    p2 = tmp_path / "q2.thist"
    _band_history(p2, {k: rng.standard_normal(100) for k in range(4)})
    with trainhist.open(p2) as h:
        texts = _texts(site_figure(h, "a").axes[0])
    assert not any("outside the window" in t for t in texts), texts  # (every quantile placed: nothing to say)


def test_contact_sheet_tiles_tell_the_states_without_numbers_apart(tmp_path, monkeypatch, close_figures) -> None:
    """A tile marked every row without numbers in one grey, failed, unknown, skipped and absent alike (the key
    said "grey: rows without numbers (failed, skipped, absent, unknown)"), so a failed reduction read as a site
    that did not run. Each state has its own mark, in the colours of site_figure's strip, and the key names them."""
    from matplotlib.colors import to_rgba
    from matplotlib.figure import Figure

    p = tmp_path / "states.thist"
    states = {2: "failed", 4: "unknown", 6: "skipped", 8: "absent"}
    with trainhist.HistoryWriter(p, **FAST) as w:
        a = w.site("a", "activation")
        for st in range(10):
            if st in states:
                w.mark(a, st, states[st])
            else:
                w.observe(a, st, np.arange(4.0) + st)
    drawn = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (real(self, *a, **k), drawn.append(self)))
    with trainhist.open(p) as h:
        contact_sheet(h, tmp_path / "sheet")
    (fig,) = drawn
    (tile,) = [ax for ax in fig.axes if ax.axison]
    marks: dict[tuple, list[float]] = {}
    for col in tile.collections:
        segs = col.get_segments()
        if segs and len(col.get_colors()):
            key = (tuple(np.round(col.get_colors()[0], 3)), str(col.get_linestyle()[0]))
            marks.setdefault(key, []).extend(float(s[0][0]) for s in segs)
    by_x = {tuple(v): k for k, v in marks.items()}
    assert sorted(by_x) == [(2.5,), (4.5,), (6.5,), (8.5,)], marks  # (one mark a state, each apart)
    assert len(set(by_x.values())) == 4, marks
    colors = {x[0]: k[0] for x, k in by_x.items()}
    assert colors[4.5] == tuple(np.round(to_rgba("purple"), 3)) and colors[6.5] == tuple(np.round(to_rgba("orange"), 3))
    (key,) = fig.legends
    text = " ".join(" ".join(t.get_text().split()) for t in key.get_texts())
    assert "missing, not zero" in text
    for name in states.values():
        assert name in text


def test_a_waterfall_hatches_not_scheduled_rows_apart_from_rows_without_a_sketch(tmp_path, close_figures) -> None:
    """A ``not_scheduled`` row (no numbers: the writer did not plan one) was hatched as "no sketch at these steps",
    like a row observed without a sketch (it has numbers): two states of spec 2.6 drawn as one. Each is its own
    hatch and legend entry now, as in site_figure's strip."""
    p = tmp_path / "ns.thist"
    x = np.arange(1.0, 5.0)
    with trainhist.HistoryWriter(p, **FAST) as w:
        a = w.site("a", "activation")
        w.observe(a, 0, x)
        w.mark(a, 1, "not_scheduled")
        w.observe(a, 2, x, sketch=False)
        w.observe(a, 3, x)
        w.mark(a, 4, "absent")
        w.observe(a, 5, x)
    with trainhist.open(p) as h:
        ax = waterfall(h, "a").axes[0]
    texts = _texts(ax)
    assert "not_scheduled: 1 row without numbers" in texts, texts
    assert "no sketch at these steps (missing, not zero)" in texts and "absent: 1 row without numbers" in texts
    hatched = {}
    for col in ax.collections[1:]:  # (the mesh first, then the hatches)
        for path in col.get_paths():
            hatched[float(path.vertices[:, 0].min())] = col.get_hatch()
    assert len({hatched[0.5], hatched[1.5], hatched[3.5]}) == 3, hatched  # (steps 1, 2, 4: three states)


def test_a_site_figure_says_how_wide_the_linear_part_of_its_axis_is(tmp_path, close_figures) -> None:
    """The value axis is symlog, linear within a thousandth of the largest magnitude: rows of values near 1e-20
    beside rows near 1 drew their exact min and max on the 0 tick, as if every value were 0, and the axis said only
    "symlog". The label says where the axis is linear (values within it sit near 0, and are not 0)."""
    rng = np.random.default_rng(2)
    p = tmp_path / "lin.thist"
    _band_history(p, {0: rng.standard_normal(50) * 2.0, 1: rng.standard_normal(50) * 1e-20})
    with trainhist.open(p) as h:
        s = h.spine("a", "activation")
        ax = site_figure(h, "a").axes[0]
    lin = ax.yaxis.get_transform().linthresh
    label = " ".join(ax.get_ylabel().split())
    assert f"linear within ±{lin:.2g}" in label, label
    assert lin == pytest.approx(1e-3 * float(np.nanmax(np.abs(np.r_[s.min, s.max]))))


def test_a_waterfall_says_which_sketches_hold_only_part_of_their_rows_values(tmp_path, close_figures) -> None:
    """A coarsened window whose steps were sketched at a sparser cadence has a sketch of those steps' values alone
    (spec 11.2): its column drew a fraction of the window's counts as if they were all of them (site_figure says so
    of its quantiles; the waterfall said nothing). The title says how many sketches hold part of their row."""
    rng = np.random.default_rng(4)
    p = tmp_path / "sparse.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        a = w.site("a", "activation")
        for step in range(20):
            w.observe(a, step, rng.standard_normal(40), sketch=step % 3 == 0 or step >= 15)
    trainhist.coarsen(p, tmp_path / "c.thist", steps=5)
    with trainhist.open(tmp_path / "c.thist") as h:
        title = " ".join(waterfall(h, "a").axes[0].get_title().split())
    assert "3 of 4 sketches hold only part of their row's values" in title, title  # (the last window: all 5)
    with trainhist.open(p) as h:
        title = " ".join(waterfall(h, "a").axes[0].get_title().split())
    assert "only part" not in title, title


def test_a_mean_from_sums_of_a_newer_writers_method_claims_no_bound(tmp_path, close_figures) -> None:
    """Sum methods 3 to 254 are a newer writer's: a reader takes them with their bound unknown (spec 5.4). The site
    figure's mean line read "from sums: code-7, bounded (spec 5.4)", a bound nobody stated."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from history_helpers import obs_payload, rewrite

    p = tmp_path / "m.thist"
    with trainhist.HistoryWriter(p, codec="raw", **FAST) as w:
        a = w.site("a", "activation")
        for step in range(2):
            t = trainhist.summarize(np.array([1.0, 2.0, 4.0]), sketch=False)
            t.sum_method = trainhist.SumMethod.F64
            w.observe(a, step, summary=t)
    data = bytearray(p.read_bytes())
    pos, payload, cols = obs_payload(bytes(data), 0)
    _, _, _, off, slen, _ = cols["method"]
    payload[off : off + slen] = bytes([7]) * slen
    rewrite(data, pos, bytes(payload))
    p.write_bytes(bytes(data))
    with trainhist.open(p) as h:
        assert h.spine("a", "activation").columns["method"].tolist() == [7, 7]
        texts = _texts(site_figure(h, "a").axes[0])
    (mean,) = [t for t in texts if t.startswith("mean")]
    assert "code-7" in mean and "bounded" not in mean and "no bound known" in mean, mean
