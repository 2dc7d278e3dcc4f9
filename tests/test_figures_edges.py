"""Figures and derived quantiles on valid files at the edges: rows without a finite value, counts beyond float64's
integers, cadences beyond int64, steps at the ends of the i64 range."""

from __future__ import annotations

import numpy as np
import pytest

import trainhist
from trainhist import frames
from trainhist.figures import contact_sheet, quantiles_from_sketch, site_figure, waterfall
from trainhist.grid import index_min, nbins

FAST = dict(fsync="never")
SCALE = 2  # (4 bins per octave: the writer's)


def _mids(scale: int = SCALE) -> np.ndarray:
    return 2.0 ** ((np.arange(nbins(scale)) + index_min(scale) + 0.5) / 2**scale)


# --- quantiles from a sketch: exact counts -----------------------------------------------------------------------


def test_q1_of_counts_not_exact_in_float64_is_the_highest_bin() -> None:
    """One bin of 2**53 and 255 of 1 (u64 counts, spec 6.1): the float total (pairwise) exceeded the float CDF's
    last value (sequential), and q = 1 raised IndexError; the float CDF also stalls at 2**53, so q = 1 would be the
    first bin. Counts are added exactly now: q = 1 is the highest occupied bin, q = 0 the lowest."""
    nb = nbins(SCALE)
    pos = np.zeros((1, nb), np.uint64)
    pos[0, :256] = 1
    pos[0, 0] = 2**53
    z = np.zeros((1, nb), np.uint64)
    q = quantiles_from_sketch(pos, z, np.zeros((1, 4), np.uint64), np.zeros(1, np.uint64), SCALE, (0.0, 0.5, 1.0))
    mids = _mids()
    assert q[0].tolist() == [mids[0], mids[0], mids[255]]


def test_a_zero_count_beyond_2_53_is_kept_exact() -> None:
    """2**53 + 1 zeros and one positive value: as float64 the zeros were 2**53 and the total 2**53 too, so q = 1
    was 0; the positive value is the greatest."""
    nb = nbins(SCALE)
    pos = np.zeros((1, nb), np.uint64)
    pos[0, 100] = 1
    z = np.zeros((1, nb), np.uint64)
    q = quantiles_from_sketch(pos, z, np.zeros((1, 4), np.uint64), np.array([2**53 + 1], np.uint64), SCALE,
                              (0.0, 0.5, 1.0))
    assert q[0].tolist() == [0.0, 0.0, _mids()[100]]


def test_a_sketch_total_beyond_u64_is_added_exactly() -> None:
    """Bins plus bands may exceed the row's count (spec 5.5), and their total 2**64 - 1: a u64 sum wraps around."""
    nb = nbins(SCALE)
    big = 2**64 - 1
    pos = np.zeros((1, nb), np.uint64)
    neg = np.zeros((1, nb), np.uint64)
    neg[0, 3], pos[0, 7], pos[0, 9] = big, big, 1
    q = quantiles_from_sketch(pos, neg, np.zeros((1, 4), np.uint64), np.zeros(1, np.uint64), SCALE,
                              (0.0, 0.4, 0.6, 1.0))
    mids = _mids()
    assert q[0].tolist() == [-mids[3], -mids[3], mids[7], mids[9]]


hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
_COUNT = st.one_of(st.integers(1, 10), st.integers(1, 2**64 - 1), st.sampled_from([2**53, 2**53 + 1, 2**63]))


@st.composite
def _sketches(draw):
    scale = draw(st.sampled_from([0, 1, 2]))
    nb = nbins(scale)
    pos, neg = np.zeros((1, nb), np.uint64), np.zeros((1, nb), np.uint64)
    for a in (pos, neg):
        for k, c in draw(st.dictionaries(st.integers(0, nb - 1), _COUNT, max_size=6)).items():
            a[0, k] = c
    zero = np.array([draw(st.one_of(st.just(0), _COUNT))], np.uint64)
    return scale, pos, neg, zero


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(_sketches(), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8))
def test_every_quantile_lies_in_the_sketch_and_grows_with_q(sk, qs) -> None:
    """Any u64 counts, any q in [0, 1]: a value of an occupied cell (within the sketch's range), q = 0 the lowest
    and q = 1 the highest, non-decreasing in q."""
    scale, pos, neg, zero = sk
    mids = _mids(scale)
    occupied = np.r_[-mids[neg[0] > 0], [0.0] * int(zero[0] > 0), mids[pos[0] > 0]]
    qs = sorted(qs)
    got = quantiles_from_sketch(pos, neg, np.zeros((1, 4), np.uint64), zero, scale, (0.0, *qs, 1.0))[0]
    if not occupied.size:
        assert np.isnan(got).all()
        return
    assert got[0] == occupied.min() and got[-1] == occupied.max()
    assert np.isin(got, occupied).all()
    assert (np.diff(got) >= 0).all()


def test_frames_quantiles_q0_and_q1_are_the_least_and_greatest_bins(tmp_path) -> None:
    pytest.importorskip("pandas")
    p = tmp_path / "q.thist"
    x = np.array([0.001, 0.5, 3.0, 7.0, 1000.0])
    with trainhist.HistoryWriter(p, **FAST) as w:
        w.observe(w.site("a", "activation"), 0, x)
    with trainhist.open(p) as h:
        df = frames.quantiles(h, "a", q=(0.0, 1.0))
    lo, hi = df[["approx_q0", "approx_q1"]].iloc[0].tolist()
    assert abs(lo - 0.001) <= 0.19 * 0.001 and abs(hi - 1000.0) <= 0.19 * 1000.0


# --- site figures of rows without a finite value -----------------------------------------------------------------


@pytest.fixture
def close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


NAN, INF = np.nan, np.inf
#: each case: rows written at steps 0, 1, ...: values (sketched), ("nosketch", values), or a mark's state
_ROWS = {
    "all_nan": [[NAN, NAN]],
    "all_inf": [[INF, -INF]],
    "two_nan_rows": [[NAN], [NAN]],
    "zeros_only": [[0.0, 0.0]],
    "nan_between_values": [[1.0, 2.0], [NAN, NAN], [3.0, 4.0]],
    "inf_between_values": [[1.0, 2.0], [INF], [3.0, 4.0]],
    "values_unsketched_then_nan": [("nosketch", [1.0, 2.0]), [NAN]],
    "nan_and_failed": [[NAN], "failed"],
    "never_observed": ["failed", "skipped", "absent"],
}


def _write(path, rows, **site) -> None:
    with trainhist.HistoryWriter(path, **FAST) as w:
        a = w.site("a", "activation", **site)
        for step, r in enumerate(rows):
            if isinstance(r, str):
                w.mark(a, step, r)
            elif isinstance(r, tuple):
                w.observe(a, step, np.array(r[1], np.float32), sketch=False)
            else:
                w.observe(a, step, np.array(r, np.float32))


@pytest.mark.parametrize("case", sorted(_ROWS))
def test_site_figure_draws_rows_without_a_finite_value(tmp_path, case, close_figures) -> None:
    """One all-NaN observation (its sketch is empty, spec 6.1) from the public writer: site_figure and `trainhist
    plot --site` raised numpy's IndexError (a mask of one for no rows). Every figure draws such files now."""
    p = tmp_path / f"{case}.thist"
    _write(p, _ROWS[case])
    with trainhist.open(p) as h:
        fig = site_figure(h, "a", out=tmp_path / "s.png")
        waterfall(h, "a", out=tmp_path / "w.png")
        assert contact_sheet(h, tmp_path / "sheet")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()] if fig.axes[0].get_legend() else []
    sketched = case in ("zeros_only", "nan_between_values", "inf_between_values")  # (a sketched finite value)
    # (quantiles are drawn, and said to be, only where a sketched row holds a finite value)
    assert any("derived from sketch" in t for t in labels) == sketched
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert ("no row holds a finite value" in texts) == (not sketched and case != "values_unsketched_then_nan")
    from trainhist.cli import main

    assert main(["plot", str(p), "-o", str(tmp_path / "png"), "--site", "a"]) == 0
    assert (tmp_path / "png" / "a.activation.site.png").stat().st_size > 1000



def test_values_at_both_ends_of_float64_with_a_non_finite_one_are_drawn(tmp_path, close_figures) -> None:
    """A row holding -1.8e308, 1.8e308 and inf (public writer; it verifies): the min/max lines autoscaled the still
    linear y axis to a span that overflows, and the non-finite mark raised numpy's LinAlgError ("Singular matrix")
    from inside matplotlib in site_figure and `trainhist plot --site`. The value axis is set before the marks."""
    big = np.finfo(np.float64).max
    p = tmp_path / "ends.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        a = w.site("a", "activation")
        w.observe(a, 0, np.array([1.0, 2.0]))
        w.observe(a, 1, np.array([-big, big, np.inf]))
    with trainhist.open(p) as h:
        fig = site_figure(h, "a", out=tmp_path / "s.png")
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert "non-finite values" in labels
        lo, hi = fig.axes[0].get_ylim()
        assert lo <= -big / 2 and hi >= big / 2
    from trainhist.cli import main

    assert main(["plot", str(p), "-o", str(tmp_path / "png"), "--site", "a"]) == 0


@pytest.mark.parametrize("rows", [[[1.7976931348623157e308, 8.98846567431158e307]], [[0.0], [1.7976931348623157e308]]],
                         ids=["one_rms_near_max", "zero_then_max"])
def test_a_contact_sheet_tile_of_rms_near_the_float_max_is_drawn(tmp_path, rows, monkeypatch, close_figures) -> None:
    """A site whose rms is near 1.8e308 on a linear tile (public writer; it verifies): matplotlib autoscaled the
    tile to limits that overflow and its MaxNLocator raised ValueError ("arange: cannot compute length") from
    contact_sheet and `trainhist plot`. Such a tile gets limits set without overflow and ticks within them."""
    import matplotlib.figure

    p = tmp_path / "max.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        a = w.site("a", "activation")
        for step, vals in enumerate(rows):
            w.observe(a, step, np.array(vals))
    drawn = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k)))
    with trainhist.open(p) as h:
        rms = h.spine("a").rms
        assert contact_sheet(h, tmp_path / "sheet")
    (tile,) = [ax for ax in drawn[0].axes if ax.axison]
    lo, hi = tile.get_ylim()
    assert tile.get_yscale() == "linear" and np.isfinite(hi - lo) and lo <= rms.min() and rms.max() <= hi
    assert all(lo <= t <= hi for t in tile.get_yticks())
    from trainhist.cli import main

    assert main(["plot", str(p), "-o", str(tmp_path / "png")]) == 0

# --- cadences beyond int64 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cadence", [2**62, 2**63, 2**64, 10**30])
def test_a_cadence_beyond_int64_is_drawn(tmp_path, cadence, close_figures) -> None:
    """A spine cadence >= 2**63 (a manifest integer of any size, spec 9; the reader takes it) raised OverflowError
    from site_figure, contact_sheet and `trainhist plot`. Its only multiple among drawable steps is 0: rows at -2
    and 3 leave step 0 due without a row (unknown, in the strip), rows at 1 and 3 nothing."""
    p = tmp_path / "gap.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        a = w.site("a", "activation", cadence_spine=cadence)
        for step in (-2, 3):
            w.observe(a, step, np.array([1.0, 2.0]))
    with trainhist.open(p) as h:
        assert h.sites[0].cadence_spine == cadence
        fig = site_figure(h, "a")
        labels = [" ".join(t.get_text().split()) for t in fig.axes[0].get_legend().get_texts()]
        assert "unknown: 0 rows without numbers, 1 due step without a row" in labels
        waterfall(h, "a")
        assert contact_sheet(h, tmp_path / "sheet")
    q = tmp_path / "nogap.thist"
    with trainhist.HistoryWriter(q, **FAST) as w:
        a = w.site("a", "activation", cadence_spine=cadence)
        for step in (1, 3):
            w.observe(a, step, np.array([1.0, 2.0]))
    with trainhist.open(q) as h:
        assert len(site_figure(h, "a").axes) == 1  # (no strip: nothing due without a row)
    from trainhist.cli import main

    assert main(["plot", str(p), "-o", str(tmp_path / "png")]) == 0
    assert main(["plot", str(p), "-o", str(tmp_path / "png"), "--site", "a"]) == 0


# --- step truth at the least i64 -------------------------------------------------------------------------------------


def test_a_skipped_step_at_the_least_i64_is_said_not_drawn(tmp_path, close_figures) -> None:
    """np.abs(-2**63) is -2**63 in int64: a skipped optimizer step there passed as drawable (legend 'optimizer step
    skipped', a mark far off the axis); it is one of those beyond +-2^52, left out and said so."""
    p = tmp_path / "min.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        a = w.site("a", "activation")
        w.step_truth(-(2**63), applied="skipped")
        for step in (0, 1):
            w.observe(a, step, np.array([1.0, 2.0]))
    with trainhist.open(p) as h:
        fig = site_figure(h, "a")
    labels = [" ".join(t.get_text().split()) for t in fig.axes[0].get_legend().get_texts()]
    assert "optimizer step skipped" not in labels
    assert "1 skipped optimizer steps beyond +-2^52 not drawn" in labels


def test_the_share_a_sketch_covers_is_not_wrapped_around() -> None:
    """A sketch's total may pass u64 (spec 5.5): summed as u64 it wrapped around to 1, below the row's 3 non-zero
    values, and its row read as partly sketched (zeros estimated, no bound)."""
    from types import SimpleNamespace

    from trainhist.figures import _sketch_coverage

    nb = nbins(SCALE)
    pos = np.zeros((1, nb), np.uint64)
    pos[0, :3] = (2**64 - 1, 1, 1)
    sk = SimpleNamespace(pos=pos, neg=np.zeros((1, nb), np.uint64), bands=np.zeros((1, 4), np.uint64))
    s = SimpleNamespace(finite=np.array([3], np.uint64), zero=np.array([0], np.uint64))
    covered, nonzero = _sketch_coverage(s, sk, np.array([0]))
    assert covered[0] >= 2.0**64 and nonzero[0] == 3.0 and not covered[0] < nonzero[0]


# --- waterfall columns whose counts add past 2^64 ---------------------------------------------------------------


def _big_rows(path, steps, micros, nan: int = 0) -> None:
    """Rows of site "a" at ``steps``, ``micros`` micro-batches each (from the public writer): bin 200 of each holds
    2^63, bin 210 one value, the positive underflow band 2^63 (spec 5.5 lets bins plus bands pass the count)."""
    from trainhist.summary import Sketch, Summary

    with trainhist.HistoryWriter(path, **FAST) as w:
        a = w.site("a", "activation")
        for step in steps:
            for micro in range(micros):
                sk = Sketch.empty()
                sk.pos[200], sk.pos[210], sk.under_pos = 2**63, 1, 2**63
                w.observe(a, step, summary=Summary(count=2**63 + 1 + nan, nan=nan, min=1.0, max=2.0, sketch=sk),
                          micro=micro if micros > 1 else None)


def _image(fig) -> np.ndarray:
    return np.ma.filled(np.ma.asarray(fig.axes[0].collections[0].get_array(), np.float64), np.nan)


def test_a_waterfall_column_of_micro_batches_past_2_64_keeps_its_color(tmp_path, close_figures) -> None:
    """Two micro-batch rows of a step, each with 2^63 in a bin: their column's count, 2^64, was added as u64 and
    wrapped around to 0 (log10: no color at all). It is 2^64 now; the band total (2^64 x 3) and the NaN total
    in the legend are not wrapped either."""
    p = tmp_path / "big.thist"
    _big_rows(p, range(3), micros=2, nan=2**63 - 2)
    with trainhist.open(p) as h:
        fig = waterfall(h, "a")
    img = _image(fig)
    assert img.shape[1] == 3
    assert np.nanmax(img) == pytest.approx(64 * np.log10(2.0), rel=1e-15)  # (2^64 in every column)
    assert sorted(np.unique(img[np.isfinite(img)]).tolist()) == pytest.approx([np.log10(2.0), 64 * np.log10(2.0)])
    assert (np.isfinite(img).sum(axis=0) == 2).all()  # (two bins a column: none lost)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert f"outside the window (2^-48, 2^16]: {6 * 2**63} values in the under/overflow bands" in texts
    labels = [" ".join(t.get_text().split()) for t in fig.axes[0].get_legend().get_texts()]
    assert any(f"(NaN {6 * (2**63 - 2)}, +inf 0, -inf 0;" in t for t in labels), labels


def test_a_long_waterfall_adds_columns_past_2_64_exactly(tmp_path, close_figures) -> None:
    """1500 steps: each column adds the rows of 5 steps (at most about 700 columns), 5 x 2^63 in bin 200, which a
    u64 sum wrapped around to 2^63 (a color 5 times too faint on a log scale of 2^64)."""
    p = tmp_path / "long.thist"
    _big_rows(p, range(1500), micros=1)
    with trainhist.open(p) as h:
        fig = waterfall(h, "a")
    img = _image(fig)
    assert "added over 5 steps" in fig.axes[-1].get_ylabel()
    assert np.nanmax(img) == pytest.approx(np.log10(5 * 2.0**63), rel=1e-15)
    assert np.nanmin(img) == pytest.approx(np.log10(5.0), rel=1e-15)


def test_a_waterfall_of_zeros_says_so_not_no_finite_value(tmp_path, close_figures) -> None:
    """Zeros are counted by the spine, never by a sketch (spec 6.1): a step of 1000 zeros was hatched 'a sketch
    that holds no finite value', as if nothing had been there, and 999 zeros beside one value drew that one value
    alone, unsaid. The legend says what an all-0 sketch means, and the figure how many zeros it does not draw."""
    p = tmp_path / "z.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        a = w.site("a", "activation")
        w.observe(a, 0, np.zeros(1000, np.float32))
        w.observe(a, 1, np.r_[np.zeros(999), 1.0].astype(np.float32))
        w.observe(a, 2, np.array([NAN, 2.0], np.float32))
    with trainhist.open(p) as h:
        ax = waterfall(h, "a").axes[0]
    labels = [" ".join(t.get_text().split()) for t in ax.get_legend().get_texts()]
    assert not any("no finite value" in t for t in labels)
    assert "a sketch with every count 0: no non-zero finite value (zeros and NaN/inf are never in a sketch)" in labels
    (note,) = [t.get_text() for t in ax.texts if "outside the window" in t.get_text()]
    assert note.endswith("zeros, not drawn (never in a sketch; the spine's count): 1999 values at 2 sketched rows")


# --- names that matplotlib would not draw as they are ---------------------------------------------------------------


@pytest.mark.parametrize("name,shown", [("w$\\frac$", "w$\\frac$"), ("a$b$c", "a$b$c"), ("層.0", "\\u5c64.0"),
                                        ("é\nx", "é\\nx")])
def test_site_names_are_drawn_as_they_are(tmp_path, name, shown, close_figures) -> None:
    """matplotlib reads text between two '$' as math: a site named ``w$\\frac$`` made site_figure, waterfall,
    contact_sheet and `trainhist plot` raise ValueError from deep inside savefig, and ``a$b$c`` drew as "abc" with
    an italic b. A character the font has no glyph for (CJK in the default font) drew an empty box (and warned),
    so that two such names read the same; a newline broke the title. Each is drawn as it is, or as its escape."""
    import warnings

    from trainhist.figures import _has_glyph

    if name == "層.0" and _has_glyph("層"):  # (a font setup with CJK glyphs draws the name itself)
        shown = name
    p = tmp_path / "n.thist"
    with trainhist.HistoryWriter(p, **FAST, run_name="r$\\frac$") as w:
        a = w.site(name, "activation")
        for step in range(3):
            w.observe(a, step, np.array([1.0, 2.0], np.float32))
    with trainhist.open(p) as h, warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Glyph.*missing", category=UserWarning)
        for draw in (site_figure, waterfall):
            fig = draw(h, name, out=tmp_path / "f.png")
            title = fig.axes[0].title
            text, math = title._preprocess_math(title.get_text())  # (what matplotlib draws)
            assert not math and text.startswith(f"{shown} · activation"), text
        assert contact_sheet(h, tmp_path / "sheet")
    from trainhist.cli import main

    assert main(["plot", str(p), "-o", str(tmp_path / "png"), "--site", name]) == 0
    assert main(["plot", str(p), "-o", str(tmp_path / "png")]) == 0


# --- the contact sheet: its footer, and tiles without numbers -------------------------------------------------------


def test_contact_sheet_footer_fits_and_tiles_say_what_is_missing(tmp_path, monkeypatch, close_figures) -> None:
    """The footer ("sites a–b of M — page k of P", what a tile shows, the ranking) was one line wider than the page:
    both ends cut off, the page count among them. A tile whose rows all failed was an empty 0..1 axis, an all-NaN
    one an axis of -0.04..0.04 (values near 0?), and failed rows between values an unmarked gap; a tile of rms 2..6
    was a log axis with no tick in it. Each is said now: rows without numbers are marked, each state in its own
    color (failed red dashed; the key says: missing, not zero)."""
    from matplotlib.colors import to_rgba
    from matplotlib.figure import Figure

    p = tmp_path / "sheet.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        a, b, c, e = (w.site(n, "activation") for n in ("nan", "failed", "ok", "gap"))
        for st in range(6):
            w.mark(b, st, "failed")
            w.observe(a, st, np.full(3, NAN))
            w.observe(c, st, np.arange(4.0) + st)
            if st in (2, 3):
                w.mark(e, st, "failed")
            else:
                w.observe(e, st, np.arange(4.0) + st)
    drawn = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (real(self, *a, **k), drawn.append((self, k))))
    with trainhist.open(p) as h:
        contact_sheet(h, tmp_path / "sheet")
    ((fig, kw),) = drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig.set_dpi(kw.get("dpi", fig.dpi))  # (measured as saved: text is not laid out in proportion to the dpi)
    renderer = FigureCanvasAgg(fig).get_renderer()  # (the page was closed: a canvas of its own to measure on)
    page = fig.bbox
    (footer,) = fig.texts
    box = footer.get_window_extent(renderer)
    assert footer.get_text().startswith("sites 1–4 of 4 — page 1 of 1 · ")
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0, (box, page)
    (key,) = fig.legends
    assert any("rows without numbers" in t.get_text() and "missing, not zero" in t.get_text()
               for t in key.get_texts())
    tiles = {ax.get_title().split(" · ")[0]: ax for ax in fig.axes if ax.axison}
    assert [t.get_text() for t in tiles["nan"].texts] == ["no row holds a finite value"]
    assert [t.get_text() for t in tiles["failed"].texts] == ["no row with numbers"]
    assert not tiles["nan"].get_yticks().size and not tiles["failed"].get_yticks().size
    red = to_rgba("red")
    marks = [sorted(seg[0][0] for seg in col.get_segments()) for col in tiles["gap"].collections
             if col.get_segments() and tuple(col.get_colors()[0]) == red]
    assert marks == [[2.5, 3.5]]
    ok = tiles["ok"]
    lo, hi = ok.get_ylim()
    assert ok.get_yscale() == "linear" and sum(lo <= t <= hi for t in ok.get_yticks()) >= 2


def test_contact_sheet_of_a_file_without_sites_says_so(tmp_path, monkeypatch, close_figures) -> None:
    """A file without sites (an empty or torn one; `trainhist plot` draws it, exit 3) got a blank page whose footer
    read "sites 1–0 of 0"."""
    from matplotlib.figure import Figure

    p = tmp_path / "empty.thist"
    p.write_bytes(b"")
    drawn = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (real(self, *a, **k), drawn.append(self)))
    with trainhist.open(p) as h:
        assert len(contact_sheet(h, tmp_path / "sheet")) == 1
    texts = [t.get_text() for t in drawn[0].texts]
    assert "this file has no sites: nothing to draw" in texts
    assert any(t.startswith("no sites (the file names none) — page 1 of 1") for t in texts)
    assert not any("1–0" in t for t in texts)


def test_a_sketch_that_covers_its_row_past_2_53_is_not_read_as_partial(tmp_path, close_figures) -> None:
    """Bins of 2^53, 1 and 1 for a row of 2^53 + 2 non-zero values: added as float64 they came to 2^53, below the
    row's count, so the whole row was read as partly sketched (zeros estimated, and the figure withdrew its bound:
    "the sketch holds only part of the row's values"). It is decided exactly now."""
    from trainhist.figures import sketch_row_quantiles
    from trainhist.summary import Sketch, Summary

    p = tmp_path / "w.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        a = w.site("a", "activation")
        for step in range(2):
            sk = Sketch.empty()
            sk.pos[200], sk.pos[201], sk.pos[202] = 2**53, 1, 1
            w.observe(a, step, summary=Summary(count=2**53 + 2, min=1.0, max=2.0, sketch=sk))
    with trainhist.open(p) as h:
        _, _, partial = sketch_row_quantiles(h.spine("a"), h.sketch("a"), (0.5,))
        fig = site_figure(h, "a")
    assert partial.tolist() == [False, False]
    labels = [" ".join(t.get_text().split()) for t in fig.axes[0].get_legend().get_texts()]
    assert any(t.startswith("every derived quantile (p5 to p95): within ±19% relative") for t in labels), labels
    assert not any("only part of the row's values" in t for t in labels)


# --- arguments a figure cannot draw ----------------------------------------------------------------------------------


def test_figures_refuse_every_phase_at_once_and_sheets_of_no_tiles(tmp_path, close_figures) -> None:
    """phase="*" (every phase, as History.spine takes it) drew pre_clip and post_clip rows as one series, and the
    waterfall added their sketches into one column ("rows of one step summed": the gradient before and after
    clipping counted together). contact_sheet(per_page=0) or cols=0 raised ZeroDivisionError, and per_page=-1 drew
    pages without a tile. Each is refused with a typed error."""
    from trainhist.errors import UsageError

    p = tmp_path / "ph.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        g = w.site("w", "param_grad")
        for st in range(3):
            w.observe(g, st, np.ones(4) * 10, phase="pre_clip")
            w.observe(g, st, np.ones(4), phase="post_clip")
    with trainhist.open(p) as h:
        for draw in (site_figure, waterfall):
            with pytest.raises(UsageError) as e:
                draw(h, "w", "param_grad", phase="*")
            assert e.value.code == "bad_argument" and "one phase" in str(e.value)
            draw(h, "w", "param_grad", phase="post_clip")
        for kw in (dict(per_page=0), dict(cols=0), dict(per_page=-1), dict(cols=2.5)):
            with pytest.raises(UsageError) as e:
                contact_sheet(h, tmp_path / "sheet", **kw)
            assert e.value.code == "bad_argument" and "whole number >= 1" in str(e.value)
        assert len(contact_sheet(h, tmp_path / "sheet", per_page=1, cols=1)) == 1


@pytest.mark.parametrize("cols", [1, 2, 3, 4, 6])
def test_contact_sheet_key_and_footer_fit_pages_of_any_width(tmp_path, monkeypatch, close_figures, cols) -> None:
    """The key was one row of its five entries whatever the page's width: at cols=4 it ran past both edges (its
    first entry read "om each row's sums)"), at 1 and 2 further; the footer was wrapped at 60 characters at least,
    wider than a one-tile page. Both now fit, and the tiles keep room above them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    p = tmp_path / "k.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        for n in ("a", "b"):
            s = w.site(n, "activation")
            for st in range(3):
                w.observe(s, st, np.arange(4.0) + st)
    drawn = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (real(self, *a, **k), drawn.append((self, k))))
    with trainhist.open(p) as h:
        contact_sheet(h, tmp_path / "sheet", cols=cols)
    ((fig, kw),) = drawn
    fig.set_dpi(kw.get("dpi", fig.dpi))
    renderer = FigureCanvasAgg(fig).get_renderer()
    page = fig.bbox
    (key,) = fig.legends
    (footer,) = fig.texts
    boxes = {"key": key.get_window_extent(renderer), "footer": footer.get_window_extent(renderer)}
    for name, box in boxes.items():
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0, (name, box, page)
    assert boxes["footer"].y1 <= boxes["key"].y0 + 1  # (the key above the footer, not over it)
    lowest = min(ax.get_tightbbox(renderer).y0 for ax in fig.axes if ax.axison)
    assert boxes["key"].y1 <= lowest + 1, (boxes["key"], lowest)  # (and below the tiles' tick labels)
