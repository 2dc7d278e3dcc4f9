"""Every approximation and every gap is labelled on the figure, read from the figure's own texts: derived quantiles
that no bin places, sketches whose values lie outside the grid's window, and rows without numbers by state."""

from __future__ import annotations

import numpy as np
import pytest

import trainhist

pytest.importorskip("matplotlib")

from trainhist.figures import contact_sheet, site_figure, waterfall  # noqa: E402

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
