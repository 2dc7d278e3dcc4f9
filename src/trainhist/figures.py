"""Figures of a history (needs the ``viz`` extra: matplotlib). Every approximation is labelled on the figure.

Every row is drawn over the steps it covers, ``[step, step + span)`` (a coarsened row over its whole window, spec
2.3), and no line joins two rows across a row without numbers, a step the cadence called for that has no row, or
a segment boundary.

- :func:`site_figure`: one site over steps — quantile fan DERIVED from the sketch (its bin-width bound in the
  legend), drawn over the sketched rows only and never joined across a row with values but no sketch, the EXACT
  min/max envelope from the spine, non-finite events, skipped optimizer steps and segment boundaries marked; rows
  without numbers (every presence but ``observed``) in a strip of their own below the values, never on the value
  axis.
- :func:`waterfall`: steps × signed-log2 bins, the sketch counts as they are stored (never rebinned); a long
  history's rows are added into at most about one column a pixel (labelled); the axis covers every step of the
  spine, and steps without a sketch are hatched by what the spine says of them (failed, unknown, skipped, absent,
  not_scheduled: the colors of the site figure's strip; else "no sketch").
- :func:`contact_sheet`: every site as a small tile, non-finite sites first then by drift, paginated with an
  "N of M — page k of P" footer; rows without numbers are marked in each state's color (failed, unknown, skipped,
  absent); nothing is silently left out.
"""

from __future__ import annotations

import bisect
import itertools
import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from .errors import UsageError
from .grid import index_min, nbins
from .model import Applied, Presence
from .reader import History, Site, SketchSeries, SpineSeries
from .summary import SumMethod

__all__ = ["quantiles_from_sketch", "quantile_bound", "sketch_row_quantiles", "site_figure", "waterfall",
           "contact_sheet"]


def _mpl():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def quantiles_from_sketch(pos: np.ndarray, neg: np.ndarray, bands: np.ndarray, zero: np.ndarray, scale: int,
                          qs: tuple[float, ...]) -> np.ndarray:
    """Quantiles per row, each the geometric middle of the bin that holds it (relative error < one bin width).

    Rows are sketches; ``zero`` is how many of the sketched values are zero (the spine's zero count when the
    sketch covers its row; a float estimate is rounded to a whole count). The quantile ``q`` of a row's ``n``
    sketched values (finite ones: NaN and ±inf are in no cell) is the lower, inverted-CDF one, with no
    interpolation: the cell of the value of rank ``max(1, ceil(q * n))`` in ascending order (``q * n`` in float64,
    never above ``n``), as ``numpy.quantile(..., method="inverted_cdf")``; so ``q = 0`` and ``1`` are the lowest and
    highest occupied cells. The counts are u64 and added exactly (never through a float: 2^53 and one more count
    are no float64), so the cell found is always an occupied one. A quantile that falls in an under- or overflow
    band (outside the window (2^-48, 2^16]) cannot be placed within a bin: it is NaN, never the window's edge.
    Returns (rows, len(qs)); NaN for rows with nothing finite.
    """
    n = pos.shape[0]
    nb = nbins(scale)
    lo = index_min(scale)
    mids = 2.0 ** ((np.arange(nb) + lo + 0.5) / 2**scale)
    # value-ordered cells: over_neg, neg bins (large to small), under_neg, zero, under_pos, pos bins, over_pos
    vals = np.concatenate([[np.nan], -mids[::-1], [np.nan], [0.0], [np.nan], mids, [np.nan]])  # (bands: NaN)
    pos, neg, bands, zero = (_whole(a) for a in (pos, neg, bands, zero))
    qf = [float(q) for q in qs]
    out = np.full((n, len(qs)), np.nan)
    for i in range(n):
        b = bands[i]
        counts = np.concatenate([b[3:4], neg[i, ::-1], b[1:2], zero[i : i + 1], b[0:1], pos[i], b[2:3]])
        cdf: np.ndarray | list[int] = np.cumsum(counts, dtype=np.uint64)
        if (cdf[1:] < cdf[:-1]).any():  # (wrapped: a total beyond u64, which a sketch may hold, spec 5.5)
            cdf = list(itertools.accumulate(counts.tolist()))  # (Python integers: exact at any size)
        total = int(cdf[-1])
        if total == 0:
            continue
        for j, q in enumerate(qf):  # (the rank of at least the first value: q = 0 is the lowest occupied cell)
            rank = total if q >= 1 else min(total, max(1, math.ceil(q * float(total))))
            out[i, j] = vals[bisect.bisect_left(cdf, rank) if isinstance(cdf, list) else
                             int(np.searchsorted(cdf, np.uint64(rank), side="left"))]
    return out


def _whole(a: np.ndarray) -> np.ndarray:
    """Counts as u64: integers as they are, floats (an estimate, or counts given as floats) rounded to whole
    counts (NaN and negatives 0)."""
    a = np.asarray(a)
    if a.dtype.kind == "f":
        a = np.clip(np.nan_to_num(np.rint(a), nan=0.0), 0.0, float(2**64 - 2048))
    return a.astype(np.uint64)


def quantile_bound(scale: int) -> float:
    """The relative bound of every quantile :func:`quantiles_from_sketch` derives at ``scale``: one bin width,
    ``2**(1 / 2**scale) - 1`` (the geometric middle of a bin lies within it of every value in the bin)."""
    return 2 ** (1 / 2**scale) - 1


def sketch_row_quantiles(s: SpineSeries, sk: SketchSeries, qs: tuple[float, ...]
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantiles of each sketch row of ``sk``, whose spine is ``s`` (the same site and phase): ``(at, q, partial)``
    with ``at`` the spine row of each sketch row, ``q`` its (rows, len(qs)) quantiles (:func:`quantiles_from_sketch`)
    and ``partial`` whether its sketch covers only part of the row (a coarsened window with sketches at a sparser
    cadence, spec 11.2): the zeros among its values are then estimated in the proportion the sketch covers (rounded
    to a whole count)."""
    at = np.empty(len(sk), np.int64)
    rows = s.sk_row >= 0
    at[s.sk_row[rows]] = np.flatnonzero(rows)
    zero = s.zero[at].astype(np.uint64)  # (exact: a count beyond 2^53 is no float64)
    partial = ~_covers_row(s, sk, at)
    if partial.any():
        covered, nonzero = _sketch_coverage(s, sk, at)  # (an estimate, rounded to a whole count)
        share = covered[partial] / np.maximum(nonzero[partial], 1)
        zero[partial] = _whole(zero[partial].astype(np.float64) * share)
    return at, quantiles_from_sketch(sk.pos, sk.neg, sk.bands, zero, sk.scale, qs), partial


def _covers_row(s: SpineSeries, sk: SketchSeries, at: np.ndarray) -> np.ndarray:
    """Whether each sketch row of ``sk`` (spine row ``at`` of ``s``) counts at least the row's non-zero finite
    values, decided exactly: as float64 sums (:func:`_sketch_coverage`) bins of 2^53, 1 and 1 added to 2^53, below
    the row's 2^53 + 2, and a whole row read as partly sketched (zeros estimated, its bound withdrawn). The high
    and low 32 bits of the counts are added apart (:func:`_halves`) and compared as a pair."""
    hi = np.zeros(len(at), np.uint64)
    lo = np.zeros(len(at), np.uint64)
    for x in (sk.pos, sk.neg, sk.bands):
        x_hi, x_lo = _halves(x)
        hi += x_hi.sum(axis=1, dtype=np.uint64)
        lo += x_lo.sum(axis=1, dtype=np.uint64)
    carry, lo = _halves(lo)
    hi += carry
    nhi, nlo = _halves(s.finite[at] - s.zero[at])
    return (hi > nhi) | ((hi == nhi) & (lo >= nlo))


def _halves(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The high and low 32 bits of the u64 counts ``a``: added apart, neither sum wraps around for fewer than 2^32
    counts, where a u64 sum wraps past 2^64 and a float64 one is not exact past 2^53."""
    a = np.asarray(a).astype(np.uint64, copy=False)
    return a >> np.uint64(32), a & np.uint64(0xFFFFFFFF)


def _sketch_coverage(s: SpineSeries, sk: SketchSeries, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sketch row of ``sk`` (spine row ``at`` of ``s``): the values its sketch counts, and the row's non-zero
    finite values it would count if it covered the whole row (float64: a share is their quotient)."""
    # (added as float64: a sketch's u64 total may pass 2^64, spec 5.5, where a u64 sum wraps around)
    covered = sum(x.sum(axis=1, dtype=np.float64) for x in (sk.pos, sk.neg, sk.bands))
    return covered, (s.finite[at] - s.zero[at]).astype(np.float64)


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
        bottom, top = max(lo - m, -_FMAX), min(hi + m, _FMAX)
        if math.isinf(top - bottom) and math.isfinite(hi - lo):  # (limits whose span overflows break a linear
            top = min(top, lo + _FMAX)  # axis: the margins are cut instead, the values kept within)
            bottom = max(bottom, top - _FMAX)
        ax.set_ylim(bottom, top)


def _symlog_ticks(ax, lin: float) -> None:
    """The y ticks of a symlog axis without those inside its linear part (0 < |y| < ``lin``): drawn a hair from 0,
    their labels (10^-2, 0, -10^-2) overlapped."""
    from matplotlib.ticker import FixedLocator

    lo, hi = ax.get_ylim()
    ticks = ax.yaxis.get_major_locator().tick_values(lo, hi)
    keep = [t for t in ticks if lo <= t <= hi and (t == 0 or abs(t) >= lin)]
    if keep:
        ax.yaxis.set_major_locator(FixedLocator(keep))


def _site_title(site: Site, phase: str | None) -> str:
    facet = "" if site.facet is None else f"[{_shown(site.facet)}]"
    ph = "" if phase in (None, "default") else f" {phase}"
    return f"{_shown(site.path)}{facet} · {site.stream}{ph}"


def _run_label(h: History, runs: tuple[str, ...]) -> str:
    """:func:`triage.run_label` as a figure shows it (:func:`_shown`)."""
    from .triage import run_label

    return _shown(run_label(h, runs))


def _shown(name: str) -> str:
    """A name of the file (a site, facet or run: any Unicode, spec 9) as figure text that draws it as it is: a ``$``
    escaped, since matplotlib reads text between two of them as math (``a$b$c`` drew as "abc" with an italic b, and
    ``w$\\frac$`` raised ValueError from deep inside savefig), and a character the figure's font has no glyph for
    (CJK in matplotlib's default font, which drew an empty box, so that ``層.0`` and ``屋.0`` read the same) or that
    is not printable (a newline) written as its escape (``\\u5c64``), as the command line writes it to an ASCII
    console."""
    out = []
    for c in name:
        if c == "$":
            out.append("\\$")
        elif not c.isprintable():
            out.append(repr(c)[1:-1])  # (\\n, \\x85)
        elif not c.isascii() and not _has_glyph(c):
            out.append(c.encode("ascii", "backslashreplace").decode("ascii"))
        else:
            out.append(c)
    return "".join(out)


_GLYPHS: dict[str, frozenset[int] | None] = {}  #: the code points of the fonts of the current font settings


def _has_glyph(c: str) -> bool:
    """Whether the font matplotlib draws text with (its fallback fonts included) has a glyph for ``c``; True when
    that cannot be found out."""
    import matplotlib
    from matplotlib import font_manager

    key = repr((matplotlib.rcParams["font.family"], matplotlib.rcParams.get("font.sans-serif")))
    if key not in _GLYPHS:
        try:
            prop = font_manager.FontProperties()
            find = getattr(font_manager.fontManager, "_find_fonts_by_props", None)
            paths = find(prop) if find is not None else [font_manager.findfont(prop)]
            points: set[int] = set()
            for path in paths:
                points.update(font_manager.get_font(path).get_charmap())
            _GLYPHS[key] = frozenset(points)
        except Exception:  # (a font setup this cannot read: draw the names as they are)
            _GLYPHS[key] = None
    points_ = _GLYPHS[key]
    return points_ is None or ord(c) in points_


def _set_title(ax, text: str, fontsize: float = 10) -> None:
    """Set ``text`` as the title, wrapped (at its " · " separators first) to the width of the axes, over which it is
    centered, then lay the figure out again: a title with the notes of a waterfall ran past the figure's edges and
    was cut off. Call it once the figure is laid out."""
    width = ax.get_position().width * ax.figure.get_figwidth() * 72  # (points)
    per_line = max(20, int(width / (0.62 * fontsize)))  # (0.62 em: a wide average glyph)
    lines: list[str] = []
    for part in text.split(" · "):
        if lines and len(lines[-1]) + 3 + len(part) <= per_line:
            lines[-1] += " · " + part
        else:
            lines += textwrap.wrap(part, per_line) or [""]
    ax.set_title("\n".join(lines), fontsize=fontsize)
    ax.figure.tight_layout()


def _sums_note(s: SpineSeries, rows: np.ndarray) -> str:
    """How the sums behind a mean or rms line of ``rows`` were taken (their summation methods, spec 5.4), and how
    many rows have none (their float64 sums overflowed: method unknown, left out of the line)."""
    methods = {SumMethod.NAMES.get(int(m), f"code-{int(m)}") for m in s.columns["method"][rows].tolist()}
    lost = int((~s.sums_known[rows]).sum())
    methods.discard("unknown")
    # (codes 3 to 254 are a newer writer's methods: a reader knows no bound of theirs, spec 5.4)
    newer = {m for m in methods if m.startswith("code-")}
    parts = ([f"{', '.join(sorted(methods - newer))}, bounded (spec 5.4)"] if methods - newer else []) + (
        [f"{', '.join(sorted(newer))}: a newer writer's method, no bound known"] if newer else [])
    how = ("from exact sums" if methods == {"exact"} else
           f"from sums: {'; '.join(parts)}" if methods else "no sums known")
    left = f"; {lost} {'row' if lost == 1 else 'rows'} with unknown sums left out" if lost else ""
    return f"({how}{left})"


def _by_step(s: SpineSeries) -> SpineSeries:
    """The rows of ``s`` in the order of their segment, then step (file order, else: a writer may record a step
    after a later one), so that lines and gaps follow the steps."""
    o = np.lexsort((s.step, s.segment))
    if (np.diff(o) > 0).all():
        return s
    columns = {k: v[o] for k, v in s.columns.items()}
    return SpineSeries(s.site, columns, {k: x.take(o, columns[k]) for k, x in s._x.items()})  # (exact sums too)


def _extent(s: SpineSeries) -> tuple[np.ndarray, np.ndarray]:
    """First and end (exclusive) step of each row: a row covers ``[step, step + span)`` (spec 2.3). Steps beyond
    2^52 have no place on a float axis a step apart (nor room for the arithmetic of drawing): refused."""
    start = s.step.astype(np.int64)
    if len(start) and (int(start.max()) > _DRAWABLE or int(start.min()) < -_DRAWABLE):
        hi, lo = int(start.max()), int(start.min())
        steps = f"step {hi}" if hi == lo else f"steps from {lo} to {hi}"
        raise UsageError(f"{s.site.path}: {steps} cannot be drawn a step apart (figures take steps within +-2^52; "
                         "read its rows with trainhist.open, or trainhist export them)", code="undrawable_steps")
    return start, start + s.span.astype(np.int64)


_DRAWABLE = 1 << 52  #: the largest step magnitude a figure draws


def _due_gaps(s: SpineSeries) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps the site's spine cadence called for that have no row, between two rows of one segment (a reader
    reports them ``unknown``, spec 2.6): whether each pair of consecutive rows has such steps between them, and the
    first and last + 1 of those steps per such pair. Steps the cadence did not call for are no gap."""
    start, end = _extent(s)
    c = _cadence(s.site)
    a, b = end[:-1], start[1:]
    due = (b - 1) // c - (a - 1) // c if c > 0 else np.zeros(a.size, np.int64)  # (multiples of c in [a, b))
    hole = (due > 0) & (s.segment[1:] == s.segment[:-1])
    return hole, -(-a[hole] // max(c, 1)) * c, (b[hole] - 1) // max(c, 1) * c + 1


_BIG_CADENCE = 1 << 62


def _cadence(site: Site) -> int:
    """The site's spine cadence for the int64 arithmetic of a figure's steps, which lie within +-2^52 (and their
    ends within 2^52 + 2^32, :func:`_extent`): a manifest integer of any size (spec 9) is taken as 2^62 when larger,
    which has the same multiples there (0 alone), so that the steps it calls for are the same and no overflow is
    raised."""
    return min(site.cadence_spine, _BIG_CADENCE)


def _joins(s: SpineSeries, rows: np.ndarray, hole: np.ndarray) -> np.ndarray:
    """Whether each of ``rows`` (increasing positions in ``s``) is joined to the next by a line: not across a row
    without numbers (``not_scheduled`` aside: the cadence did not call for it) or without a finite value, across a
    step the cadence called for that has no row (``hole``, :func:`_due_gaps`), nor across a segment boundary."""
    no_numbers = (s.presence != Presence.OBSERVED) & (s.presence != Presence.NOT_SCHEDULED)
    breaking = no_numbers | (s.observed & (s.finite == 0))
    nb = np.r_[0, np.cumsum(breaking)]
    nh = np.r_[0, np.cumsum(hole | (s.segment[1:] != s.segment[:-1]))]
    a, b = rows[:-1], rows[1:]
    return (nb[b] == nb[a + 1]) & (nh[b] == nh[a])


def _stairs(start: np.ndarray, end: np.ndarray, y: np.ndarray, joined: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x and y of a line that draws each row flat over its steps ``[start, end)``, goes on to the next row where
    ``joined`` and is broken by a NaN elsewhere."""
    n = start.size
    x = np.stack([start, end, np.full(n, np.nan)], axis=1)
    yy = np.stack([y, y, np.full(n, np.nan)], axis=1)
    keep = np.ones((n, 3), bool)
    keep[:, 2] = np.r_[~joined, False][:n]  # (no rows: nothing to keep)
    return x[keep], yy[keep]


def _alone(joined: np.ndarray, n: int) -> np.ndarray:
    """Whether each of ``n`` rows (``joined``: whether each is joined to the next, n - 1 of them) is joined to
    neither neighbour; of no rows, none."""
    if not n:
        return np.zeros(0, bool)
    return ~np.r_[False, joined] & ~np.r_[joined, False]


def _plot_rows(ax, start: np.ndarray, end: np.ndarray, y: np.ndarray, joined: np.ndarray, **style: object) -> None:
    """One line over the rows (:func:`_stairs`); a row joined to neither neighbour gets a dot too, since a line one
    step long draws nothing visible on a long axis."""
    if not start.size:
        return
    (line,) = ax.plot(*_stairs(start, end, y, joined), **style)
    alone = _alone(joined, start.size) & np.isfinite(y)
    if alone.any():
        ax.plot((start[alone] + end[alone]) / 2, y[alone], ls="none", marker=".", ms=3, color=line.get_color())


def _vmarks(ax, start: np.ndarray, end: np.ndarray, label: str, **style: object) -> None:
    """Rows ``[start, end)`` marked over the whole height: a line at the middle of each (visible at any zoom, one
    collection however many) and a faint band over each row of several steps."""
    if not start.size:
        return
    ax.vlines((start + end) / 2, 0, 1, transform=ax.get_xaxis_transform(), label=label, **style)
    wide = end - start > 1
    if wide.any():
        ax.broken_barh(list(zip(start[wide].tolist(), (end - start)[wide].tolist())), (0, 1),
                       transform=ax.get_xaxis_transform(), color=style.get("color"), alpha=0.12, lw=0)


def _boundaries(ax, h: History, step: np.ndarray, segment: np.ndarray, segments: list[int] | None = None,
                **style: object) -> int:
    """A dashed vertical line at the first step of every segment after the first (of ``segments``; None: every
    segment): its manifest's ``first_step``, or, where the writer did not know it, the first step of its rows in
    this series (``step``, ``segment``). A segment that starts another run's history (a merge kept two runs apart,
    spec 11.3) is no boundary of one history: its line says which run begins there, a history of its own drawn
    over the same steps. Returns how many lines lie beyond +-2^52, where no float axis holds them: those are not
    drawn."""
    from .triage import other_runs

    k = beyond = 0
    mine_ = [g for g in h.segments if segments is None or g.id in segments]
    first = min((g.id for g in mine_), default=None)
    other = other_runs(h)
    for g in mine_:
        if g.id == first:  # (every other segment follows one, whatever its reason)
            continue
        at = g.first_step
        if at is None:
            mine = step[segment == g.id]
            if not mine.size:
                continue
            at = int(mine.min())
        if abs(at) > _DRAWABLE:
            beyond += 1
            continue
        if g.id in other:
            ax.axvline(at, **{"color": "C3", "ls": "-.", "lw": 1.2, **style},
                       label=f"run {_run_label(h, other[g.id])} (another run) from here: drawn over the same steps, "
                       "not a continuation")
            continue
        ax.axvline(at, **{"color": "k", "ls": "--", "lw": 1.2, **style},
                   label="segment boundary" if k == 0 else None)
        k += 1
    return beyond


def _marks(ax, h: History, s: SpineSeries) -> None:
    """Non-finite events, skipped optimizer steps and segment boundaries as marks over the whole height; skipped
    steps and boundaries beyond +-2^52 (the site's own rows are within: :func:`_extent`) are not drawn, and the
    legend says how many."""
    start, end = _extent(s)
    nf = s.observed & ((s.nan > 0) | (s.pinf > 0) | (s.ninf > 0))
    _vmarks(ax, start[nf], end[nf], "non-finite values", color="red", alpha=0.35, lw=1)
    t = h.steps
    skipped = t["applied"] == Applied.code("skipped")
    first, span = t["step"][skipped].astype(np.int64), t["span"][skipped].astype(np.int64)
    # (and so no overflow in first + span; not np.abs, which leaves the least i64 negative)
    fits = (first >= -_DRAWABLE) & (first <= _DRAWABLE) & (span <= _DRAWABLE)
    _vmarks(ax, first[fits], first[fits] + span[fits], "optimizer step skipped", color="orange", ls=":", lw=1)
    beyond = {"skipped optimizer steps": int((~fits).sum()),
              "segment boundaries": _boundaries(ax, h, s.step, s.segment)}
    if any(beyond.values()):  # (a legend entry with no mark: the figure says what it left out)
        ax.plot([], [], ls="none", label=" and ".join(f"{n} {what}" for what, n in beyond.items() if n)
                + " beyond +-2^52 not drawn")


#: every presence but ``observed`` (spec 2.6), in the order of precedence (11.4): its marker and color in the strip
_NO_DATA = ((Presence.FAILED, "X", "red"), (Presence.UNKNOWN, "d", "purple"), (Presence.SKIPPED, "s", "orange"),
            (Presence.ABSENT, "o", "0.4"), (Presence.NOT_SCHEDULED, "|", "0.6"))


def _presence_strip(ax, s: SpineSeries, gaps: tuple[np.ndarray, np.ndarray]) -> None:
    """The rows without numbers, one line of the strip ``ax`` per state that occurs: a marker at the middle of
    each row's steps and a bar over them, never a value on the value axis (missing is never zero, spec 2.6).
    ``gaps``: first and last + 1 of runs of steps the cadence called for that have no row, shown as ``unknown``."""
    start, end = _extent(s)
    names = []
    for code, marker, color in _NO_DATA:
        sel = s.presence == code
        a, b = start[sel], end[sel]
        label = f"{Presence.name(code)}: {int(sel.sum())} row{'' if sel.sum() == 1 else 's'} without numbers"
        if code == Presence.UNKNOWN and gaps[0].size:
            due = int(((gaps[1] - 1 - gaps[0]) // max(_cadence(s.site), 1) + 1).sum())
            a, b = np.r_[a, gaps[0]], np.r_[b, gaps[1]]
            label += f", {due} due step{'' if due == 1 else 's'} without a row"
        if not a.size:
            continue
        y = np.full(a.size, len(names))
        ax.hlines(y, a, b, color=color, lw=3)
        ax.plot((a + b) / 2, y, ls="none", marker=marker, color=color, label=label)
        names.append(Presence.name(code))
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_ylim(-0.7, len(names) - 0.3)
    ax.invert_yaxis()
    ax.set_ylabel("no data", fontsize=7)


def _one_phase(phase: str | None) -> None:
    """A figure draws the rows of one phase: ``"*"`` (every phase, :meth:`History.spine`) drew pre_clip and
    post_clip rows as one series, and a waterfall added their sketches into one column (the gradient before and
    after clipping counted together, twice its values); refused."""
    if phase == "*":
        raise UsageError("a figure draws one phase: name it (default, pre_clip or post_clip), not '*'; draw one "
                         "figure a phase", code="bad_argument")


def site_figure(h: History, path: str, stream: str = "activation", facet: str | None = None, *,
                phase: str | None = None, out: str | Path | None = None):
    """Quantile fan (derived) with the exact min/max envelope, rows without numbers in a strip below; returns the
    matplotlib figure."""
    _one_phase(phase)
    plt = _mpl()
    s = _by_step(h.spine(path, stream, facet, phase=phase))
    sk = h.sketch(path, stream, facet, phase=phase)
    start, end = _extent(s)
    hole, gap_from, gap_to = _due_gaps(s)
    if (~s.observed).any() or hole.any():
        fig, (ax, strip) = plt.subplots(2, 1, sharex=True, figsize=(10, 4.8), height_ratios=(5, 1))
    else:
        fig, ax = plt.subplots(figsize=(10, 4))
        strip = None
    obs = s.observed & (s.finite > 0)
    r = np.flatnonzero(obs)
    joined = _joins(s, r, hole)
    notes = []  # legend entries that are notes, not marks (kept out of the axes' lines)
    _plot_rows(ax, start[r], end[r], s.min[r], joined, ls=":", color="k", lw=1, label="min / max (exact, spine)")
    _plot_rows(ax, start[r], end[r], s.max[r], joined, ls=":", color="k", lw=1)
    rows = s.sk_row >= 0
    if not (obs & rows).any():  # (no sketched row holds a finite value, or there is no sketch: no quantile to draw)
        _plot_rows(ax, start[r], end[r], s.mean[r], joined, color="C0", lw=1.5, label="mean " + _sums_note(s, r))
    else:
        # a sketch may cover part of its row (a coarsened window with sketches at a sparser cadence, spec 11.2):
        # its own total counts; the zeros among its values are estimated in the same proportion
        at, qa, partial = sketch_row_quantiles(s, sk, (0.05, 0.25, 0.5, 0.75, 0.95))
        q = np.full((len(s), 5), np.nan)  # (per spine row)
        q[at] = qa
        f = np.flatnonzero(obs & rows)
        # the quantiles exist only at rows with a sketch: no line or fan joins two of them across a row that has
        # values but no sketch (a sketch cadence sparser than the spine's), which would draw quantiles never read
        unsketched = obs & ~rows
        nu = np.r_[0, np.cumsum(unsketched)]
        joined = _joins(s, f, hole) & (nu[f[1:]] == nu[f[:-1] + 1])
        alone = _alone(joined, f.size)
        x = _stairs(start[f], end[f], q[f, 0], joined)[0]
        for (a, b), alpha, label in (((0, 4), 0.2, "p5–p95 (derived from sketch)"),
                                     ((1, 3), 0.35, "p25–p75 (derived from sketch)")):
            lo, hi = (_stairs(start[f], end[f], q[f, j], joined)[1] for j in (a, b))
            ax.fill_between(x, lo, hi, where=np.isfinite(lo) & np.isfinite(hi), alpha=alpha, color="C0", lw=0,
                            label=label)
            if alone.any():  # (a fan one step wide draws nothing visible on a long axis: a bar at its middle too)
                ax.vlines((start[f] + end[f])[alone] / 2, q[f[alone], a], q[f[alone], b], color="C0", alpha=alpha,
                          lw=3)
        width = quantile_bound(sk.scale)
        _plot_rows(ax, start[f], end[f], q[f, 2], joined, color="C0", lw=1.5,
                   label="median (derived from sketch)")
        from matplotlib.lines import Line2D

        npart = int(partial.sum())
        notes.append(Line2D([], [], ls="none", label=(
            f"every derived quantile (p5 to p95): within ±{width:.0%} relative (one bin at {2**sk.scale} "
            "bins/octave)" if not npart else
            f"derived quantiles (p5 to p95): within ±{width:.0%} relative (one bin at {2**sk.scale} bins/octave) "
            f"at {len(at) - npart} of {len(at)} sketched rows; at the other {npart} the sketch holds only part of "
            "the row's values: quantiles of that part, zeros estimated, no bound for the row's")
            + (f"; drawn only at the {f.size} of {int(obs.sum())} rows with values that have a "
               "sketch, never joined across a row without one" if unsketched.any() else "")))
        # (a quantile in an under/overflow band has no bin to place it: NaN, a hole in the fan, said here)
        outside = int(np.isnan(q[f]).any(axis=1).sum())
        if outside:
            notes.append(Line2D([], [], ls="none", label=(
                f"at {outside} of {f.size} sketched rows a quantile (p5 to p95) lies outside the window "
                "(2^-48, 2^16], in an under/overflow band where no bin places it: not drawn there (min / max "
                "are)")))
    if obs.any():  # (before the marks: on the linear axis that values near +-1.8e308 autoscale, the limits'
        # span overflows and the marks' transform cannot be inverted, LinAlgError)
        lin = max(1e-12, float(np.nanmax(np.abs(np.r_[s.min[obs], s.max[obs], 1e-12]))) * 1e-3)
        ax.set_yscale("symlog", linthresh=lin)
        _fit_y(ax, np.r_[s.min[obs], s.max[obs], 0.0], log=False)
    _marks(ax, h, s)
    if obs.any():
        _symlog_ticks(ax, lin)
    else:  # (no value axis to draw: an empty one would suggest a scale)
        ax.set_yticks([])
        ax.text(0.5, 0.5, "no row holds a finite value", ha="center", transform=ax.transAxes)
    partly = int((s.observed & (s.columns["n_skipped"] > 0)).sum()) if "n_skipped" in s.columns else 0
    if partly:  # (observed outranks skipped, spec 11.4: a window's or merge's skipped inputs hold no numbers)
        from matplotlib.lines import Line2D

        notes.append(Line2D([], [], ls="none", label=f"{partly} {'row' if partly == 1 else 'rows'} with values "
                            "also hold skipped steps or inputs (n_skipped): their values are the others'"))
    handles, labels = ax.get_legend_handles_labels()
    handles, labels = handles + notes, labels + [n.get_label() for n in notes]
    if strip is not None:
        _presence_strip(strip, s, (gap_from, gap_to))
        more = strip.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    (ax if strip is None else strip).set_xlabel("step")
    # (values within the linear part sit near the 0 tick without being 0: the label says how far it reaches)
    ax.set_ylabel(f"value (symlog, linear within ±{lin:.2g})" if obs.any() else "value")
    ax.legend(handles, [textwrap.fill(t, 48) for t in labels], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1),
              borderaxespad=0)  # (beside the values, which it would hide)
    fig.tight_layout()
    spans = s.span > 1
    from .triage import segment_runs

    runs = segment_runs(h)
    mine = list(dict.fromkeys(runs.get(g, ()) for g in np.unique(s.segment).tolist()))
    _set_title(ax, _site_title(s.site, phase) + (f" · {int(spans.sum())} rows are coarsened windows of up to "
                                                 f"{int(s.span.max())} steps, each drawn over its window"
                                                 if spans.any() else "")
               + (f" · {len(mine)} runs kept apart (spec 11.3), drawn over the same steps: "
                  + "; ".join(_run_label(h, r) for r in mine) if len(mine) > 1 else ""), 12)
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


#: a waterfall image has at most about this many columns: one a pixel of its axes when saved at 120 dpi, so that no
#: column falls between pixels (a history sketched every 10 steps drew false stripes) and memory stays bounded
_MAX_COLUMNS = 700
_BLOCK = 4096  #: sketch rows made dense at a time when their counts are added into columns


def _not_replayed(step: np.ndarray, span: np.ndarray, segment: np.ndarray) -> np.ndarray:
    """Rows to draw where a resumed segment replays steps: where a later segment has rows, an earlier one's rows
    from the later one's first step on are not drawn (summing them into a column would mix two runs). The rows
    are those of one run's segments: a merge that kept two runs apart has segments of another run, which replay
    nothing, and :func:`waterfall` draws them in a panel of their own."""
    keep = np.ones(step.size, bool)
    for g in np.unique(segment).tolist():
        later = segment > g
        if later.any():
            keep &= ~((segment == g) & (step + span > step[later].min()))
    return keep


def _add_sketches(sk: SketchSeries, rows: np.ndarray, col: np.ndarray, n: int) -> np.ndarray:
    """(n, 2 * bins + 1) float64: the counts of sketch ``rows`` added into their column ``col`` (negative bins from
    the largest magnitude down, then positive), and last the values of the four under/overflow bands, which no bin
    of the image draws (a column of band values alone holds values, never "every count 0"). Each bin is a u64, but
    a column's sum of them is not bounded by one (a
    merged file's micro-batch rows, a long history's columns): added as u64 it wrapped around (2 x 2^63 drew as 0,
    no color), and as float64 it is not exact past 2^53. The high and low 32 bits of the counts are added apart,
    exactly (:func:`_halves`, for fewer than 2^32 rows a column), and the sum is rounded once to float64
    (relative 2^-52: the log10 color is the same). Rows are made dense a block at a time, so memory grows with the
    columns, never with the rows (a dense copy of every row of a long history took gigabytes)."""
    nb = nbins(sk.scale)
    hi = np.zeros((n, 2 * nb + 1), np.uint64)
    lo = np.zeros((n, 2 * nb + 1), np.uint64)
    order = np.argsort(col, kind="stable")
    rows, col = rows[order], col[order]
    for k in range(0, rows.size, _BLOCK):
        part = sk._sparse.take(rows[k : k + _BLOCK])  # (the stored ranges; the package's own reader)
        b_hi, b_lo = _halves(np.concatenate([part.dense(1)[:, ::-1], part.dense(0)], axis=1))
        band_hi, band_lo = _halves(np.stack(part.bands, axis=1))  # (4 u64 halves of < 2^32: no wrap)
        b_hi = np.concatenate([b_hi, band_hi.sum(axis=1, dtype=np.uint64)[:, None]], axis=1)
        b_lo = np.concatenate([b_lo, band_lo.sum(axis=1, dtype=np.uint64)[:, None]], axis=1)
        cols, first = np.unique(col[k : k + _BLOCK], return_index=True)
        hi[cols] += np.add.reduceat(b_hi, first, axis=0)
        lo[cols] += np.add.reduceat(b_lo, first, axis=0)
    return hi.astype(np.float64) * 2.0**32 + lo.astype(np.float64)


def _total(a: np.ndarray) -> int:
    """The exact sum of the u64 counts ``a`` as a Python integer (a u64 sum wraps around past 2^64, a float64 one
    is not exact past 2^53); exact for fewer than 2^32 counts."""
    hi, lo = _halves(np.ravel(a))
    return (int(hi.sum(dtype=np.uint64)) << 32) + int(lo.sum(dtype=np.uint64))


def _column_bins(step: np.ndarray, span: np.ndarray, segment: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Columns for a history too long for a column per row: each adds the rows of one segment whose first step
    falls in one aligned window of ``width`` steps, a round multiple of the longest span (a coarsened window is
    never split) chosen so that there are at most about :data:`_MAX_COLUMNS`; a window where no row begins is a
    blank column. Returns (x edges, the column of each row, the number of columns, width)."""
    longest = int(span.max())
    need = (int((step + span).max()) - int(step.min())) / _MAX_COLUMNS
    width, k = longest, 0
    while width < need:  # (1, 2, 5 × 10^k times the longest span: a width a reader can count with)
        k += 1
        width = longest * (1, 2, 5)[k % 3] * 10 ** (k // 3)
    keys, inv = np.unique(np.stack([step // width, segment.astype(np.int64)], axis=1), axis=0, return_inverse=True)
    first = np.full(len(keys), np.iinfo(np.int64).max)
    np.minimum.at(first, inv.reshape(-1), step)
    left = keys[:, 0] * width
    right = left + width
    shared = np.flatnonzero(keys[1:, 0] == keys[:-1, 0])  # (a resume inside a window: split where it begins)
    left[shared + 1] = right[shared] = first[shared + 1]
    edges, at = [float(left[0])], []
    for a, b in zip(left.tolist(), right.tolist()):
        if a > edges[-1]:  # no row begins in these steps: a blank column
            edges.append(float(a))
        at.append(len(edges) - 1)
        edges.append(float(b))
    return np.array(edges) - 0.5, np.array(at)[inv.reshape(-1)], len(edges) - 1, width


#: how a waterfall hatches a column without a sketch, by the state of the spine's rows there (the colors of
#: site_figure's "no data" strip); the first that occurs in a column names it, else the column is "no sketch"
_NO_SKETCH = ((Presence.FAILED, "xxx", "red"), (Presence.UNKNOWN, "\\\\\\", "purple"),
              (Presence.SKIPPED, "---", "orange"), (Presence.ABSENT, "...", "0.3"),
              (Presence.NOT_SCHEDULED, "oo", "0.6"))


def _split_blank(x: np.ndarray, img: np.ndarray, s: SpineSeries, first: np.ndarray, end: np.ndarray,
                 drawn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cut the columns without a sketch of ``img`` (edges ``x``) at the first and end step of every row without
    numbers (failed, unknown, skipped, absent, not_scheduled) and of every run of due steps without a row, so that
    each part is hatched by its own state (:func:`_hatch_missing`)."""
    _, gap_from, gap_to = _due_gaps(s)
    sel = drawn & np.isin(s.presence, [code for code, _, _ in _NO_SKETCH])
    cuts = np.r_[first[sel], end[sel], gap_from, gap_to].astype(np.float64) - 0.5
    blank = np.isnan(img).all(axis=0)
    j = np.searchsorted(x, cuts, side="right") - 1
    inside = (j >= 0) & (j < blank.size)
    inside[inside] &= blank[j[inside]] & (x[j[inside]] < cuts[inside])
    if not inside.any():
        return x, img
    edges = np.union1d(x, cuts[inside])
    return edges, img[:, np.searchsorted(x, edges[:-1], side="right") - 1]


def _hatch_missing(ax, x: np.ndarray, blank: np.ndarray, s: SpineSeries, first: np.ndarray, end: np.ndarray,
                   drawn: np.ndarray, nb: int) -> int:
    """Hatch the columns without a sketch (``blank``; edges ``x``) by what the spine says of their steps: failed,
    unknown (rows, or steps its cadence called for without a row), skipped, absent or ``not_scheduled`` rows each
    with their own hatch and color, the first of those in a column naming it, and the other columns (rows observed
    without a sketch, steps nothing was due at) "no sketch"; every one is missing, never zero. Returns how
    many rows without numbers lie in columns that hold sketches (a long history's added columns), which no hatch
    can mark."""
    n = blank.size
    _, gap_from, gap_to = _due_gaps(s)
    nonblank = np.r_[0, np.cumsum(~blank)]
    state = np.full(n, -1)
    found = []  # (code, first and last column of each of its rows or runs of due steps, how many are rows)
    for code, _, _ in _NO_SKETCH:
        sel = drawn & (s.presence == code)
        a, b = first[sel], end[sel]
        if code == Presence.UNKNOWN:
            a, b = np.r_[a, gap_from], np.r_[b, gap_to]
        lo = np.clip(np.searchsorted(x, a - 0.5, side="right") - 1, 0, n - 1)
        hi = np.clip(np.searchsorted(x, b - 0.5, side="left") - 1, 0, n - 1)
        d = np.zeros(n + 1, np.int64)
        np.add.at(d, lo, 1)
        np.add.at(d, hi + 1, -1)
        state[(np.cumsum(d[:-1]) > 0) & blank & (state < 0)] = code
        found.append((code, lo, hi, int(sel.sum())))
    inside = 0
    spans = [(blank & (state < 0), "///", "0.55", "0.93", "no sketch at these steps (missing, not zero)")]
    for (code, lo, hi, k), (_, hatch, color) in zip(found, _NO_SKETCH):
        inside += int((nonblank[hi + 1] - nonblank[lo] > 0)[:k].sum())
        mine = np.r_[0, np.cumsum(state == code)]
        shown = mine[hi + 1] - mine[lo] == hi + 1 - lo  # (all its columns hatched as this state)
        rows, due = int(shown[:k].sum()), int(shown[k:].sum())
        label = ", ".join(x for x in (f"{rows} row{'' if rows == 1 else 's'} without numbers" if rows else "",
                                      f"{due} run{'' if due == 1 else 's'} of due steps without a row" if due else "")
                          if x)
        label = f"{Presence.name(code)}: {label}"
        spans.append((state == code, hatch, color, "w", label))
    for here, hatch, color, face, label in spans:
        if here.any():
            ax.broken_barh(list(zip(x[:-1][here].tolist(), np.diff(x)[here].tolist())), (-nb, 2 * nb),
                           facecolor=face, edgecolor=color, hatch=hatch, lw=0, label=label)
    return inside


def waterfall(h: History, path: str, stream: str = "activation", facet: str | None = None, *,
              phase: str | None = None, out: str | Path | None = None):
    """Steps × signed-log2 bins heat map of the stored sketch counts (log color), bands shown apart; a long
    history's rows are added into at most about :data:`_MAX_COLUMNS` columns, and the figure says so."""
    _one_phase(phase)
    plt = _mpl()

    sk = h.sketch(path, stream, facet, phase=phase)
    s = _by_step(h.spine(path, stream, facet, phase=phase))
    _extent(s)  # (steps no figure can draw are refused before one is made)
    from .triage import segment_runs

    # the histories of different runs that a merge kept apart (spec 11.3): one panel each, over the same steps
    runs = segment_runs(h)
    present = sorted(set(np.unique(s.segment).tolist()) | set(np.unique(sk.columns["segment"]).tolist()))
    groups: dict[tuple, list[int]] = {}
    for g in present:
        groups.setdefault(runs.get(g, ()), []).append(g)
    panels = sorted(groups.values()) or [[]]
    # a sketch may hold part of its row's values (a coarsened window sketched at a sparser cadence, spec 11.2): its
    # column counts that part alone, and the title says how many do
    at = np.zeros(len(sk), np.int64)
    with_sketch = s.sk_row >= 0
    at[s.sk_row[with_sketch]] = np.flatnonzero(with_sketch)
    partial = ~_covers_row(s, sk, at) if len(sk) else np.zeros(0, bool)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 4 if len(panels) == 1 else 3.2 * len(panels)),
                             sharex=True, squeeze=False)
    for i, (ax, segs) in enumerate(zip(axes[:, 0], panels)):
        title = _site_title(s.site, phase) if i == 0 else ""
        if len(panels) > 1:
            title += (" · " if title else "") + (f"run {_run_label(h, runs[segs[0]])}"
                                                 + (" (another run)" if i else "") + f": segment"
                                                 f"{'s' if len(segs) > 1 else ''} {', '.join(map(str, segs))}")
        ss = _rows(s, np.isin(s.segment, segs)) if len(panels) > 1 else s
        mine = np.isin(sk.columns["segment"], segs) if len(panels) > 1 else np.ones(len(sk), bool)
        sks = _sketch_rows(sk, mine) if len(panels) > 1 else sk
        _waterfall_axes(fig, ax, h, ss, sks, title, segs if len(panels) > 1 else None, last=i == len(panels) - 1,
                        partial=partial[mine])
    if out is not None:
        fig.savefig(out, dpi=120)
        plt.close(fig)
    return fig


def _rows(s: SpineSeries, sel: np.ndarray) -> SpineSeries:
    """The rows ``sel`` of ``s`` (a mask), exact sums included."""
    o = np.flatnonzero(sel)
    columns = {k: v[o] for k, v in s.columns.items()}
    return SpineSeries(s.site, columns, {k: x.take(o, columns[k]) for k, x in s._x.items()})


def _sketch_rows(sk: SketchSeries, sel: np.ndarray) -> SketchSeries:
    """The rows ``sel`` of ``sk`` (a mask)."""
    return SketchSeries(sk.site, {k: v[sel] for k, v in sk.columns.items()}, sk._sparse.take(sel))


def _waterfall_axes(fig, ax, h: History, s: SpineSeries, sk: SketchSeries, title: str, segments: list[int] | None,
                    last: bool = True, partial: np.ndarray | None = None) -> None:
    """Draw the waterfall of ``s`` and ``sk`` (the rows of one run's segments, ``segments``; None: every row) on
    ``ax`` and set its title. ``partial``: whether each sketch row of ``sk`` holds only part of its row's values."""
    from matplotlib import patheffects

    first, end = _extent(s)
    drawn = _not_replayed(first, end - first, s.segment)  # (the spine rows a resume did not replay)
    width = 1
    if len(sk):
        nb = nbins(sk.scale)
        lo = index_min(sk.scale) / 2**sk.scale
        hi = (index_min(sk.scale) + nb) / 2**sk.scale
        step, seg = sk.columns["step"].astype(np.int64), sk.columns["segment"]
        span = sk.columns["span"].astype(np.int64)
        keep = _not_replayed(step, span, seg)
        replaced = int(step.size - keep.sum())
        rows = np.flatnonzero(keep)
        npart = int(partial[rows].sum()) if partial is not None else 0
        step, span, seg = step[rows], span[rows], seg[rows]
        if int((step + span).max()) - int(step.min()) <= _MAX_COLUMNS * int(span.min()):  # a column per row
            keys, inv = np.unique(np.stack([step, span], axis=1), axis=0, return_inverse=True)
            grid = _add_sketches(sk, rows, inv.reshape(-1), len(keys))
            x, img, _, overlapped = _step_columns(keys[:, 0], keys[:, 1], grid)
            summed, past = len(keys) < rows.size, 0
        else:
            x, col, ncols, width = _column_bins(step, span, seg)
            with np.errstate(divide="ignore"):
                img = np.log10(_add_sketches(sk, rows, col, ncols).T)
            img[:, np.setdiff1d(np.arange(ncols), col)] = np.nan
            summed, overlapped = False, 0
            past = int((step + span - 0.5 > x[col + 1]).sum())  # (rows whose span does not divide the width)
        if drawn.any():  # steps of the spine before the first sketch or after the last: blank columns, not cut off
            a, b = float(first[drawn].min()) - 0.5, float(end[drawn].max()) - 0.5
            blank_col = np.full((img.shape[0], 1), np.nan)
            if a < x[0]:
                x, img = np.r_[a, x], np.concatenate([blank_col, img], axis=1)
            if b > x[-1]:
                x, img = np.r_[x, b], np.concatenate([img, blank_col], axis=1)
        if width == 1:  # (a column a row: a column without a sketch is cut where a row without numbers starts or ends)
            x, img = _split_blank(x, img, s, first, end, drawn)
        img, banded = img[:-1], np.isfinite(img[-1])  # (the band values of each column: none drawn as a bin)
        mesh = ax.pcolormesh(x, np.linspace(-nb, nb, 2 * nb + 1), np.ma.masked_invalid(img), cmap="viridis",
                             shading="flat")
        if np.isfinite(img).any():
            fig.colorbar(mesh, ax=ax, pad=0.01,
                         label="log10 count" + (f", added over {width} steps" if width > 1 else ""))
        else:
            ax.text(0.5, 0.5, "the sketches hold no value inside the window (2^-48, 2^16]: theirs lie in the "
                    "under/overflow bands" if banded.any() else "the sketches hold no non-zero finite value",
                    ha="center", transform=ax.transAxes, bbox={"facecolor": "w", "alpha": 0.8, "edgecolor": "none"})
        blank = np.isnan(img).all(axis=0)
        inside = _hatch_missing(ax, x, blank, s, first, end, drawn, nb)
        # (a sketch of no non-zero finite value: every count 0, log10 -inf; its row may hold zeros, never sketched;
        # one whose values all lie outside the window holds values, in the bands the image has no bin for)
        empty = ~blank & ~np.isfinite(img).any(axis=0)
        nband = int((empty & banded).sum())
        for here, hatch, label in (
                (empty & ~banded, "|||", ("a sketch with every count 0: no non-zero finite value (zeros and "
                                          "NaN/inf are never in a sketch)")),
                (empty & banded, "+++", (f"{nband} column{'' if nband == 1 else 's'} whose sketches hold no value "
                                         "inside the window (2^-48, 2^16]: their values lie in the under/overflow "
                                         "bands, not drawn"))):
            if here.any():
                ax.broken_barh(list(zip(x[:-1][here].tolist(), np.diff(x)[here].tolist())), (-nb, 2 * nb),
                               facecolor="w", edgecolor="0.75", hatch=hatch, lw=0, label=label)
        ticks = np.linspace(-nb, nb, 9)
        ax.set_yticks(ticks)
        ax.set_yticklabels([f"{'-' if t < 0 else ''}2^{lo + abs(t) / nb * (hi - lo):.0f}" if t else "0"
                            for t in ticks])
        outside = _total(sk.bands)
        title += (f" · sketch, {2**sk.scale} bins/octave (never rebinned)"
                  + (f" · each column adds the sketches of {width} steps" if width > 1 else "")
                  + (" · rows of one step summed" if summed else "")
                  + (f" · {overlapped} rows overlapping later ones cut or left out" if overlapped else "")
                  + (f" · {past} rows reaching past their column's steps added where they begin" if past else "")
                  + (f" · {replaced} rows of a segment a resume replayed not drawn" if replaced else "")
                  + (f" · {npart} of {rows.size} sketches hold only part of their row's values (sketched at a "
                     "sparser cadence): their columns count that part alone" if npart else "")
                  + (f" · {inside} row{' without numbers lies' if inside == 1 else 's without numbers lie'} in "
                     "columns that hold sketches: not marked here (see site_figure's strip)" if inside else ""))
        beyond = _boundaries(ax, h, sk.columns["step"], sk.columns["segment"], segments=segments, lw=1.5,
                             path_effects=[patheffects.withStroke(linewidth=3.5, foreground="w")])
        title += f" · {beyond} segment boundaries beyond +-2^52 not drawn" if beyond else ""
        # zeros are counted by the spine, never by the sketch (spec 6.1): a column of them is no empty one
        zeros = drawn & (s.sk_row >= 0) & s.observed
        nz, zrows = _total(s.zero[zeros]), int((s.zero[zeros] > 0).sum())
        ax.text(0.01, 0.01, f"outside the window (2^-48, 2^16]: {outside} values in the under/overflow bands"
                + (f"\nzeros, not drawn (never in a sketch; the spine's count): {nz} values at {zrows} sketched "
                   f"row{'' if zrows == 1 else 's'}" if nz else ""),
                transform=ax.transAxes, fontsize=7, color="k",
                bbox={"boxstyle": "round,pad=0.2", "facecolor": "w", "alpha": 0.8, "edgecolor": "none"})
    else:
        ax.text(0.5, 0.5, "no sketches recorded for this site", ha="center", transform=ax.transAxes)
        if drawn.any():  # (the steps the spine covers: the figure says over which steps nothing was sketched)
            ax.set_xlim(float(first[drawn].min()) - 0.5, float(end[drawn].max()) - 0.5)
    nf = _not_replayed(first, end - first, s.segment) & s.observed & ((s.nan + s.pinf + s.ninf) > 0)
    if nf.any():  # (not in the sketch, which holds finite values only: from the spine's counts)
        # one mark a column: the middle of each row's steps, or of the columns that hold any of them
        at = (np.unique((first + end)[nf]) / 2 - 0.5 if width == 1
              else np.unique(first[nf] // width) * width + width / 2 - 0.5)
        ax.plot(at, np.full(at.size, 0.97), ls="none", marker="v", color="red", markeredgecolor="w",
                transform=ax.get_xaxis_transform(), label=f"non-finite values at {int(nf.sum())} rows (NaN "
                f"{_total(s.nan[nf])}, +inf {_total(s.pinf[nf])}, -inf {_total(s.ninf[nf])}; not in "
                "the sketch)")
    if last:
        ax.set_xlabel("step")
    ax.set_ylabel("signed magnitude bin")
    if ax.get_legend_handles_labels()[0]:  # (below the image, which it would hide)
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles, [textwrap.fill(t, 56) for t in labels], fontsize=7, loc="upper center",
                  bbox_to_anchor=(0.5, -0.2), ncols=2)
    fig.tight_layout()
    _set_title(ax, title)


def _rank_key(h: History, site: Site, orders: dict[int, int]) -> tuple:
    """Sort key of the contact sheet: sites with non-finite values first, earliest step and pass first
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


_NONFINITE_TILE = "#fde0e0"  #: a contact-sheet tile's background where the site held NaN or ±inf
#: a contact-sheet tile's mark of the rows without numbers of each state (not_scheduled aside: the cadence did not
#: call for them), in the colors of site_figure's strip; failed dashed, apart from the red line of non-finite rows
_NO_NUMBERS_TILE = {Presence.FAILED: ("red", "--"), Presence.UNKNOWN: ("purple", "-"),
                    Presence.SKIPPED: ("orange", "-"), Presence.ABSENT: ("0.4", "-")}


def contact_sheet(h: History, out_dir: str | Path, *, per_page: int = 24, cols: int = 6) -> list[Path]:
    """Every site as a tile (the rms of each row over its steps; rows without numbers marked, each state in its
    own color: failed, unknown, skipped, absent), ranked "nonfinite first, then drift".

    Returns the PNG pages written; each carries the footer "sites a–b of M — page k of P".
    """
    for name, n in (("per_page", per_page), ("cols", cols)):  # (0 raised ZeroDivisionError; -1 drew no tile)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise UsageError(f"contact_sheet()'s {name} must be a whole number >= 1, got {n!r}", code="bad_argument")
    plt = _mpl()
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from .triage import site_orders

    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    orders = site_orders(h)
    ranked = sorted(h.sites, key=lambda s: _rank_key(h, s, orders))
    key = [Line2D([], [], color="C0", lw=1, label="rms (from each row's sums)"),
           Patch(facecolor=_NONFINITE_TILE, label="pink tile: the site held NaN or ±inf"),
           Line2D([], [], color="red", lw=0.5, label="red line: a row with NaN or ±inf"),
           Line2D([], [], color="k", ls="--", lw=0.8, label="dashed: segment boundary"),
           tuple(Line2D([], [], color=c, ls=ls, lw=1.5) for c, ls in _NO_NUMBERS_TILE.values())]
    key_labels = [k.get_label() for k in key[:-1]] + [
        ("rows without numbers, missing, not zero: failed (red dashed), unknown (purple: rows, or due steps without "
         "one), skipped (orange), absent (grey)")]
    pages = max(1, math.ceil(len(ranked) / per_page))
    written = []
    for k in range(pages):
        tiles = ranked[k * per_page : (k + 1) * per_page]
        rows = max(1, math.ceil(len(tiles) / cols))
        a, b = k * per_page + 1, k * per_page + len(tiles)
        # (wrapped to the page's width: one line of it ran past both edges, "sites a-b of M" cut off)
        footer = textwrap.fill(
            (f"sites {a}–{b} of {len(ranked)}" if ranked else "no sites (the file names none)")
            + f" — page {k + 1} of {pages} · each tile: the rms of each row (from its "
            "sums: exact, or within their method's bound where spec 5.4 states one; rows with unknown sums left out; "
            "in the site's own units) "
            "over its steps, a coarsened row over its window; a log axis where the rms spans a decade or more · "
            "ranked: sites with non-finite values first (earliest step, then pass), then the others by drift "
            "|log(rms last / rms first)|, largest first", int(2.4 * cols * 72 / (0.6 * 6)))  # (the page's width)
        lines = footer.count("\n") + 1
        fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols, 1.8 * rows + 0.4 + 0.1 * lines), squeeze=False)
        for ax in axes.flat:
            ax.axis("off")
        if not ranked:  # (a blank page would read as a drawing that failed: "sites 1–0 of 0")
            fig.text(0.5, 0.6, "this file has no sites: nothing to draw", ha="center", va="center", fontsize=10)
        for ax, site in zip(axes.flat, tiles):
            ax.axis("on")
            phase = _first_phase(h, site)
            s = _by_step(h.spine(site.path, site.stream, site.facet, phase=phase))
            obs = s.observed & (s.finite > 0)
            try:
                start, end = _extent(s)
            except UsageError:  # (one site's steps are beyond a float axis: its tile says so, the others draw)
                ax.set_title(_site_title(site, phase), fontsize=6)
                ax.text(0.5, 0.5, "steps beyond +-2^52:\nnot drawn", ha="center", va="center", fontsize=7,
                        transform=ax.transAxes)
                continue
            r = np.flatnonzero(obs)
            hole, gap_from, gap_to = _due_gaps(s)
            _plot_rows(ax, start[r], end[r], s.rms[r], _joins(s, r, hole), lw=1, color="C0")
            # rows without numbers and due steps without a row: marked as missing, never a gap that says nothing
            for code, (color, ls) in _NO_NUMBERS_TILE.items():  # (each state its own mark: a failed reduction
                none = s.presence == code  # is no site that did not run)
                a_, b_ = start[none], end[none]
                if code == Presence.UNKNOWN:
                    a_, b_ = np.r_[a_, gap_from], np.r_[b_, gap_to]
                _vmarks(ax, a_, b_, None, color=color, ls=ls, lw=1)
            _boundaries(ax, h, s.step, s.segment, lw=0.8)  # (a tile leaves out, unsaid, those beyond +-2^52)
            nf = s.observed & ((s.nan + s.pinf + s.ninf) > 0)
            if nf.any():
                ax.set_facecolor(_NONFINITE_TILE)
                ax.vlines((start + end)[nf] / 2, 0, 1, transform=ax.get_xaxis_transform(), color="red", lw=0.5)
            v = s.rms[obs]
            if obs.any() and (v > 0).all() and float(v.max()) >= 10 * float(v.min()):  # (within a decade: no tick)
                ax.set_yscale("log")
                _fit_y(ax, v, log=True)
            if not obs.any():  # (an empty axis, or one of -0.04..0.04, would suggest values near 0)
                ax.set_yticks([])
                ax.text(0.5, 0.5, "no row holds a finite value" if s.observed.any() else
                        "no row with numbers" if len(s) else "no rows", ha="center", va="center", fontsize=6,
                        transform=ax.transAxes, bbox={"facecolor": "w", "alpha": 0.8, "edgecolor": "none"})
            # few ticks and no minor ticks: tick layout dominates the drawing time of a sheet
            ax.minorticks_off()
            ax.xaxis.set_major_locator(MaxNLocator(3))
            if not obs.any():
                pass
            elif ax.get_yscale() == "linear" and not (np.abs(v[np.isfinite(v)]) >= 1e300).any():
                ax.yaxis.set_major_locator(MaxNLocator(3))
            elif ax.get_yscale() == "linear":
                # (rms near 1.8e308 autoscaled to limits whose span overflows, and there matplotlib's locator and
                # formatter overflow too, ValueError: limits set without overflow, and ticks of our own)
                _fit_y(ax, v, log=False)
                lo, hi = ax.get_ylim()
                ax.yaxis.set_major_locator(FixedLocator([lo, lo / 2 + hi / 2, hi]))
                ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.2g}"))
            else:
                # three decades within the limits, placed here: matplotlib's LogLocator puts ticks beyond them,
                # past 1e308 for data near the ends of the float range, where its formatter overflows
                lo, hi = (math.log10(v) for v in ax.get_ylim())
                decades = np.unique(np.round(np.linspace(math.ceil(lo), math.floor(hi), 3)))
                ax.yaxis.set_major_locator(FixedLocator(10.0**decades) if math.ceil(lo) <= hi
                                           else LogLocator(numticks=3))
            ax.set_title(_site_title(site, phase), fontsize=6)
            ax.set_ylabel("rms" + (" (log)" if ax.get_yscale() == "log" else ""), fontsize=5, labelpad=1)
            ax.tick_params(labelsize=5)
        # the key in as many columns as the page's width holds (one row on a wide page ran past both edges of a
        # narrow one), its labels wrapped in one column if need be; the page grows by the key's extra height
        legend, extra = _fitted_key(fig, key, key_labels)
        tall = fig.get_figheight() + extra  # (margins in inches: on a page of one row the footer hid the tick labels)
        fig.set_figheight(tall)
        legend.set_bbox_to_anchor((0.5, (0.12 + 0.1 * lines) / tall), transform=fig.transFigure)
        fig.text(0.5, 0.06 / tall, footer, ha="center", va="bottom", fontsize=6)
        fig.subplots_adjust(left=max(0.05, 0.4 / fig.get_figwidth()), right=0.98, top=1 - 0.25 / tall,
                            bottom=(0.65 + 0.1 * lines + extra) / tall,
                            hspace=0.6, wspace=0.4)
        p = out_dir / f"contact_sheet_p{k + 1}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def _fitted_key(fig: Any, key: list, labels: list[str]) -> tuple[Any, float]:
    """The contact sheet's legend in the most columns (up to one per entry) that fit the page's width, and how much
    taller than one line of entries (inches) it is; in one column its labels are wrapped to the width. An entry
    that is a tuple of handles draws them side by side."""
    from matplotlib.legend_handler import HandlerTuple

    renderer = fig.canvas.get_renderer()
    side = {tuple: HandlerTuple(ndivide=None, pad=0.3)}
    for n in range(len(key), 0, -1):
        legend = fig.legend(handles=key, labels=labels, loc="lower center", ncols=n, fontsize=6, frameon=False,
                            handler_map=side)
        box = legend.get_window_extent(renderer)
        if box.width <= 0.98 * fig.bbox.width:
            break
        legend.remove()
        if n == 1:  # (wrapped at the characters a line of the page holds, about 3.3 points each at 6 points)
            chars = max(20, int(0.98 * fig.get_figwidth() * 72 / 3.3) - 6)
            labels = [textwrap.fill(t, chars) for t in labels]
            legend = fig.legend(handles=key, labels=labels, loc="lower center", ncols=1, fontsize=6,
                                frameon=False, handler_map=side)
            box = legend.get_window_extent(renderer)
    one_line = 0.12  # (inches: the key's height as one row of one-line entries, which the layout leaves room for)
    return legend, max(0.0, box.height / fig.dpi - one_line)


def _first_phase(h: History, site: Site) -> str:
    """The phase a tile shows: pre_clip for clipped gradients (what the loss produced), else the first present."""
    for phase in ("pre_clip", "default", "post_clip"):
        if len(h.spine(site.path, site.stream, site.facet, phase=phase)):
            return phase
    return "default"
