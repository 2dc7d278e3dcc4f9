"""Figures of a history (needs the ``viz`` extra: matplotlib). Every approximation is labelled on the figure.

- :func:`site_figure`: one site over steps — quantile fan DERIVED from the sketch (its bin-width bound in the
  legend), the EXACT min/max envelope from the spine, non-finite events, failed/absent rows, skipped optimizer
  steps, segment boundaries and coarsened spans marked.
- :func:`waterfall`: steps × signed-log2 bins, the sketch counts as they are stored (never rebinned).
- :func:`contact_sheet`: every site as a small tile, non-finite sites first then by drift, paginated with an
  "N of M — page k of P" footer; nothing is silently left out.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .grid import index_min, nbins
from .model import Presence
from .reader import History, Site

__all__ = ["quantiles_from_sketch", "site_figure", "waterfall", "contact_sheet"]


def _mpl():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def quantiles_from_sketch(pos: np.ndarray, neg: np.ndarray, bands: np.ndarray, zero: np.ndarray, scale: int,
                          qs: tuple[float, ...]) -> np.ndarray:
    """Quantiles per row, each the geometric middle of the bin that holds it (relative error < one bin width).

    Rows are sketches; ``zero`` is how many of the sketched values are zero (the spine's zero count when the
    sketch covers its row). A quantile that falls in an under- or overflow band (outside the window
    (2^-48, 2^16]) cannot be placed within a bin: it is NaN, never the window's edge. ``q = 0`` and ``1`` are the
    lowest and highest occupied cells. Returns (rows, len(qs)); NaN for rows with nothing finite.
    """
    n = pos.shape[0]
    nb = nbins(scale)
    lo = index_min(scale)
    mids = 2.0 ** ((np.arange(nb) + lo + 0.5) / 2**scale)
    # value-ordered cells: over_neg, neg bins (large to small), under_neg, zero, under_pos, pos bins, over_pos
    vals = np.concatenate([[np.nan], -mids[::-1], [np.nan], [0.0], [np.nan], mids, [np.nan]])  # (bands: NaN)
    out = np.full((n, len(qs)), np.nan)
    for i in range(n):
        counts = np.concatenate([[bands[i, 3]], neg[i, ::-1], [bands[i, 1]], [zero[i]], [bands[i, 0]], pos[i],
                                 [bands[i, 2]]]).astype(np.float64)
        total = counts.sum()
        if total == 0:
            continue
        cdf = np.cumsum(counts)
        for j, q in enumerate(qs):  # (the rank of at least the first value: q = 0 is the lowest occupied cell)
            out[i, j] = vals[int(np.searchsorted(cdf, max(q * total, 0.5), side="left"))]
    return out


_FMAX = float(np.finfo(np.float64).max)


def _fit_y(ax, values: np.ndarray, log: bool) -> None:
    """Set the y limits around the finite ``values`` with a 5% margin computed without overflow: matplotlib's own
    margins overflow near the ends of the float range (1e±300) and then lose the data (limits of 1..10)."""
    v = values[np.isfinite(values)]
    if log:
        v = v[v > 0]
    if not v.size:
        return
    if log:
        lo, hi = math.log10(float(v.min())), math.log10(float(v.max()))
        m = 0.05 * (hi - lo) or 0.5
        ax.set_ylim(10.0 ** max(lo - m, -323.0), 10.0 ** min(hi + m, 308.0))
    else:
        lo, hi = float(v.min()), float(v.max())
        m = (0.05 * hi - 0.05 * lo) or max(abs(lo) * 0.05, 1.0)
        ax.set_ylim(max(lo - m, -_FMAX), min(hi + m, _FMAX))


def _site_title(site: Site, phase: str | None) -> str:
    facet = "" if site.facet is None else f"[{site.facet}]"
    ph = "" if phase in (None, "default") else f" {phase}"
    return f"{site.path}{facet} · {site.stream}{ph}"


def _segment_runs(segment: np.ndarray) -> list[np.ndarray]:
    """Positions of each segment's rows (a series is ordered by segment, then step): drawn as separate lines, so
    that no line joins the end of one segment to the start of the next (a resumed run replays steps)."""
    if segment.size == 0:
        return []
    cuts = np.flatnonzero(segment[1:] != segment[:-1]) + 1
    return np.split(np.arange(segment.size), cuts)


def _boundaries(ax, h: History, step: np.ndarray, segment: np.ndarray, **style: object) -> None:
    """A dashed vertical line at the first step of every segment after the first: its manifest's ``first_step``,
    or, where the writer did not know it, the first step of its rows in this series (``step``, ``segment``)."""
    k = 0
    for g in h.segments:
        if g.reason == "start":
            continue
        at = g.first_step
        if at is None:
            mine = step[segment == g.id]
            if not mine.size:
                continue
            at = int(mine.min())
        ax.axvline(at, **{"color": "k", "ls": "--", "lw": 1.2, **style},
                   label="segment boundary (resume)" if k == 0 else None)
        k += 1


def _marks(ax, h: History, s) -> None:
    """Presence gaps, non-finite events, skipped steps and segment boundaries as visible marks."""
    steps = s.step
    for code, color, label in ((Presence.FAILED, "red", "failed"), (Presence.ABSENT, "0.6", "absent"),
                               (Presence.SKIPPED, "orange", "skipped")):
        sel = s.presence == code
        if sel.any():
            ax.scatter(steps[sel], np.zeros(sel.sum()), marker="x", color=color, label=f"{label} (no data)", zorder=5)
    nf = s.observed & ((s.nan > 0) | (s.pinf > 0) | (s.ninf > 0))
    for k, x in enumerate(steps[nf].tolist()):
        ax.axvline(x, color="red", alpha=0.35, lw=1, label="non-finite values" if k == 0 else None)
    truth = h.step_truth_rows()
    skipped = [r["step"] for r in truth if r["applied"] == "skipped"]
    for k, x in enumerate(skipped):
        ax.axvline(x, color="orange", ls=":", lw=1, label="optimizer step skipped" if k == 0 else None)
    _boundaries(ax, h, s.step, s.segment)
    spans = s.span > 1
    if spans.any():
        ax.text(0.01, 0.02, f"{int(spans.sum())} rows are coarsened spans of up to {int(s.span.max())} steps",
                transform=ax.transAxes, fontsize=7)


def site_figure(h: History, path: str, stream: str = "activation", facet: str | None = None, *,
                phase: str | None = None, out: str | Path | None = None):
    """Quantile fan (derived) with the exact min/max envelope; returns the matplotlib figure."""
    plt = _mpl()
    s = h.spine(path, stream, facet, phase=phase)
    sk = h.sketch(path, stream, facet, phase=phase)
    fig, ax = plt.subplots(figsize=(8, 4))
    obs = s.observed & (s.finite > 0)
    for k, run in enumerate(_segment_runs(s.segment)):  # (one line per segment: none joins a resume's replay)
        r = run[obs[run]]
        mark = "." if r.size == 1 else None  # (a line of one point draws nothing)
        ax.plot(s.step[r], s.min[r], ":", color="k", lw=1, marker=mark,
                label="min / max (exact, spine)" if k == 0 else None)
        ax.plot(s.step[r], s.max[r], ":", color="k", lw=1, marker=mark)
        if not len(sk):
            ax.plot(s.step[r], s.mean[r], color="C0", lw=1.5, label="mean (from exact sums)" if k == 0 else None)
    if len(sk):
        rows = s.sk_row >= 0
        zero = s.zero[rows].astype(np.float64)
        # a sketch may cover part of its row (a coarsened window with sketches at a sparser cadence, spec 11.2):
        # its own total counts; the zeros among its values are estimated in the same proportion
        nonzero = (s.finite[rows] - s.zero[rows]).astype(np.float64)
        covered = (sk.pos.sum(axis=1) + sk.neg.sum(axis=1) + sk.bands.sum(axis=1)).astype(np.float64)
        partial = covered < nonzero
        zero = np.where(partial, zero * covered / np.maximum(nonzero, 1), zero)
        q = quantiles_from_sketch(sk.pos, sk.neg, sk.bands, zero, sk.scale, (0.05, 0.25, 0.5, 0.75, 0.95))
        x = sk.columns["step"]
        width = 2 ** (1 / 2**sk.scale) - 1
        for k, r in enumerate(_segment_runs(sk.columns["segment"])):
            first = k == 0
            ax.fill_between(x[r], q[r, 0], q[r, 4], alpha=0.2, color="C0",
                            label="p5–p95 (derived from sketch)" if first else None)
            ax.fill_between(x[r], q[r, 1], q[r, 3], alpha=0.35, color="C0",
                            label="p25–p75 (derived)" if first else None)
            ax.plot(x[r], q[r, 2], color="C0", lw=1.5,
                    label=f"median (derived; ±{width:.0%} relative, {2**sk.scale} bins/octave"
                    + ("; partly sketched windows: zeros estimated" if partial.any() else "") + ")" if first else None)
    _marks(ax, h, s)
    lin = max(1e-12, float(np.nanmax(np.abs(np.r_[s.min[obs], s.max[obs], 1e-12]))) * 1e-3)
    ax.set_yscale("symlog", linthresh=lin)
    _fit_y(ax, np.r_[s.min[obs], s.max[obs], 0.0], log=False)
    ax.set_xlabel("step")
    ax.set_ylabel("value (symlog)")
    ax.set_title(_site_title(s.site, phase))
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=120)
        plt.close(fig)
    return fig


def _step_columns(steps: np.ndarray, spans: np.ndarray | None,
                  grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool, int]:
    """The x edges and log10 columns of a steps × bins image of ``grid`` (rows × bins counts): each row drawn over
    its own steps ``[step, step + span)``, rows of one step and span summed (micro-batches), and a blank column over
    steps without a row, so that no sketch is drawn at a step it does not describe. A row whose span reaches past
    the next row's step is cut there, and one that starts where a row of another span starts is left out (an image
    has one column per step): the figure says how many. Returns (edges, bins × columns, whether rows were summed,
    how many (summed) rows were cut or left out)."""
    steps = steps.astype(np.int64)
    spans = np.ones_like(steps) if spans is None else spans.astype(np.int64)
    keys, inv = np.unique(np.stack([steps, spans], axis=1), axis=0, return_inverse=True)
    counts = np.zeros((len(keys), grid.shape[1]))
    np.add.at(counts, inv.reshape(-1), grid)
    with np.errstate(divide="ignore"):
        cols = np.log10(counts.T)
    edges, out, overlapped = [float(keys[0, 0]) - 0.5], [], 0
    for i, (start, span) in enumerate(keys.tolist()):
        if start - 0.5 > edges[-1]:  # steps without a row: blank
            out.append(np.full(grid.shape[1], np.nan))
            edges.append(start - 0.5)
        end = start + span - 0.5
        if i + 1 < len(keys) and float(keys[i + 1, 0]) - 0.5 < end:  # (overlaps the next row: cut where it starts)
            end = float(keys[i + 1, 0]) - 0.5
            overlapped += 1
            if end <= edges[-1]:  # (the next row starts at the same step: nothing of this one is left to draw)
                continue
        out.append(cols[:, i])
        edges.append(end)
    return np.array(edges), np.stack(out, axis=1), len(keys) < len(steps), overlapped


def waterfall(h: History, path: str, stream: str = "activation", facet: str | None = None, *,
              phase: str | None = None, out: str | Path | None = None):
    """Steps × signed-log2 bins heat map of the stored sketch counts (log color), bands shown apart."""
    plt = _mpl()
    sk = h.sketch(path, stream, facet, phase=phase)
    fig, ax = plt.subplots(figsize=(8, 4))
    if len(sk):
        grid = np.concatenate([sk.neg[:, ::-1], sk.pos], axis=1).astype(np.float64)
        nb = nbins(sk.scale)
        lo = index_min(sk.scale) / 2**sk.scale
        hi = (index_min(sk.scale) + nb) / 2**sk.scale
        step, seg = sk.columns["step"].astype(np.int64), sk.columns["segment"]
        span = sk.columns["span"].astype(np.int64)
        # a resumed segment replays steps: where a later segment has rows, an earlier one's rows from the later
        # one's first step on are not drawn (the image has one column per step; summing them would mix two runs)
        keep = np.ones(step.size, bool)
        for g in np.unique(seg).tolist():
            later = seg > g
            if later.any():
                keep &= ~((seg == g) & (step + span > step[later].min()))
        replaced = int(step.size - keep.sum())
        x, img, summed, overlapped = _step_columns(step[keep], span[keep], grid[keep])
        ax.pcolormesh(x, np.linspace(-nb, nb, 2 * nb + 1), np.ma.masked_invalid(img), cmap="viridis",
                      shading="flat")
        ticks = np.linspace(-nb, nb, 9)
        ax.set_yticks(ticks)
        ax.set_yticklabels([f"{'-' if t < 0 else ''}2^{lo + abs(t) / nb * (hi - lo):.0f}" if t else "0"
                            for t in ticks])
        outside = int(sk.bands.sum())
        ax.set_title(_site_title(sk.site, phase) + f" · sketch, {2**sk.scale} bins/octave (never rebinned)"
                     + (" · rows of one step summed" if summed else "")
                     + (f" · {overlapped} rows overlapping later ones cut or left out" if overlapped else "")
                     + (f" · {replaced} rows of a segment a resume replayed not drawn" if replaced else ""))
        _boundaries(ax, h, step, seg, color="w")
        ax.text(0.01, 0.01, f"outside the window (2^-48, 2^16]: {outside} values in the under/overflow bands",
                transform=ax.transAxes, fontsize=7, color="w")
    else:
        ax.text(0.5, 0.5, "no sketches recorded for this site", ha="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("signed magnitude bin")
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=120)
        plt.close(fig)
    return fig


def _rank_key(h: History, site: Site, orders: dict[int, int]) -> tuple:
    """Sort key "nonfinite_first_then_drift": sites with non-finite values first, earliest step and pass first
    (the order triage uses); then the others by drift, |log(rms_last / rms_first)|, largest first."""
    from .triage import PASS_ORDER

    first_bad: int | None = None
    drift = 0.0
    for phase in ("default", "pre_clip", "post_clip"):
        s = h.spine(site.path, site.stream, site.facet, phase=phase)
        if not len(s):
            continue
        bad = s.observed & ((s.nan + s.pinf + s.ninf) > 0)
        if bad.any():
            step = int(s.step[bad].min())
            first_bad = step if first_bad is None else min(first_bad, step)
        rms = s.rms[s.observed]
        rms = rms[np.isfinite(rms) & (rms > 0)]
        if rms.size > 1:
            drift = max(drift, float(abs(math.log(rms[-1] / rms[0]))))
    order = orders[site.id]
    if first_bad is not None:
        return (0, first_bad, PASS_ORDER[site.stream], order)
    return (1, -drift, site.id)


def contact_sheet(h: History, out_dir: str | Path, *, per_page: int = 24, cols: int = 6) -> list[Path]:
    """Every site as a tile (rms over steps, exact min/max envelope), ranked "nonfinite first, then drift".

    Returns the PNG pages written; each carries the footer "sites a–b of M — page k of P".
    """
    plt = _mpl()
    from matplotlib.ticker import LogLocator, MaxNLocator

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from .triage import site_orders

    orders = site_orders(h)
    ranked = sorted(h.sites, key=lambda s: _rank_key(h, s, orders))
    pages = max(1, math.ceil(len(ranked) / per_page))
    written = []
    for k in range(pages):
        tiles = ranked[k * per_page : (k + 1) * per_page]
        rows = max(1, math.ceil(len(tiles) / cols))
        fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols, 1.8 * rows + 0.5), squeeze=False)
        for ax in axes.flat:
            ax.axis("off")
        for ax, site in zip(axes.flat, tiles):
            ax.axis("on")
            phase = _first_phase(h, site)
            s = h.spine(site.path, site.stream, site.facet, phase=phase)
            obs = s.observed & (s.finite > 0)
            for run in _segment_runs(s.segment):
                r = run[obs[run]]
                ax.plot(s.step[r], s.rms[r], lw=1, color="C0")
            _boundaries(ax, h, s.step, s.segment, lw=0.8)
            nf = s.observed & ((s.nan + s.pinf + s.ninf) > 0)
            if nf.any():
                ax.set_facecolor("#fde0e0")
                ax.vlines(s.step[nf], 0, 1, transform=ax.get_xaxis_transform(), color="red", lw=0.5)
            if obs.any() and (s.rms[obs] > 0).all():
                ax.set_yscale("log")
                _fit_y(ax, s.rms[obs], log=True)
            # few ticks and no minor ticks: tick layout dominates the drawing time of a sheet
            ax.minorticks_off()
            ax.xaxis.set_major_locator(MaxNLocator(3))
            if ax.get_yscale() == "linear":
                ax.yaxis.set_major_locator(MaxNLocator(3))
            else:
                lo, hi = ax.get_ylim()  # (three ticks over hundreds of decades overflow in matplotlib)
                ax.yaxis.set_major_locator(LogLocator(numticks=3) if math.log10(hi / lo) < 100 else LogLocator())
            ax.set_title(_site_title(site, phase), fontsize=6)
            ax.tick_params(labelsize=5)
        a, b = k * per_page + 1, k * per_page + len(tiles)
        fig.text(0.5, 0.005, f"sites {a}–{b} of {len(ranked)} — page {k + 1} of {pages} · rms per step "
                 "(from exact sums); ranked nonfinite_first_then_drift", ha="center", fontsize=7)
        fig.subplots_adjust(left=0.05, right=0.98, top=0.95, bottom=0.08, hspace=0.6, wspace=0.35)
        p = out_dir / f"contact_sheet_p{k + 1}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def _first_phase(h: History, site: Site) -> str:
    """The phase a tile shows: pre_clip for clipped gradients (what the loss produced), else the first present."""
    for phase in ("pre_clip", "default", "post_clip"):
        if len(h.spine(site.path, site.stream, site.facet, phase=phase)):
            return phase
    return "default"
