"""Triage: where and when a history first went wrong, read from the spine alone (no torch).

The order of checks follows a training-monitor doctrine: first non-finite values (which site, which pass, which
step), then failed reductions, sites stuck at zero (a dead layer, a parameter that stopped changing), skipped
optimizer steps and missing rows, then segment boundaries. Every finding names the site, stream, phase and step so
that a person can go straight to it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .model import Presence
from .reader import History, Site

__all__ = ["Finding", "Triage", "triage", "PASS_ORDER", "segment_runs", "run_label", "other_runs"]

# Within one step, the order in which a training step produces its streams: a NaN in an earlier pass explains the
# later ones. Backward runs through the modules in reverse, so activation gradients are ranked in the reverse of
# their modules' forward (activation site) order.
#: stream -> rank of its pass within a step (used by the triage and by the figures' site order)
PASS_ORDER = {"scalar": 5, "activation": 0, "activation_grad": 1, "param_grad": 2, "param_delta": 3, "param": 4}
_PASS_NAME = {"activation": "forward", "activation_grad": "backward", "param_grad": "gradient",
              "param_delta": "update", "param": "parameter", "scalar": "scalar"}
#: what a stream's value is, where its pass's name alone could mislead: the gradient reaching a module's output is
#: made by the backward of what consumes that output, before the module's own backward runs
_WHAT = {"activation_grad": "activation_grad: the gradient reaching its output"}


def site_orders(h: History) -> dict[int, int]:
    """Site id -> its rank within its pass of a step. Backward visits modules in the reverse of the forward order, so
    a gradient site ranks by its module's forward position, reversed.

    The positions are the sites' ``order`` (spec 2.2; a gradient site without one takes its output site's), since
    a merged file numbers its sites by key; a site whose position is unknown (its inputs disagreed, say) ranks
    after those with one. In a file without any ``order`` the ids stand in (writers declare output sites in forward
    order) and a gradient site takes its output site's id, whatever order its own id came in (a writer that
    declares sites as it first sees them declares gradients in backward order)."""
    forward = {(x.path, x.facet): x for x in h.sites if x.stream == "activation"}

    def position(x: Site) -> int | None:
        if x.order is None and x.stream == "activation_grad" and (x.path, x.facet) in forward:
            return forward[(x.path, x.facet)].order
        return x.order

    pos = {x.id: position(x) for x in h.sites if x.stream != "scalar"}
    known = [v for v in pos.values() if v is not None]
    n = len(h.sites)
    if known:
        top = max(known)
        return {x.id: _scalar_rank(x) * n + x.id if x.stream == "scalar" else top + 1 + x.id if pos[x.id] is None
                else top - pos[x.id] if x.stream in _BACKWARD else pos[x.id]  # type: ignore[operator]
                for x in h.sites}
    forward_id = {key: x.id for key, x in forward.items()}
    return {x.id: _scalar_rank(x) * n + x.id if x.stream == "scalar"
            else n - forward_id.get((x.path, x.facet), x.id) if x.stream in _BACKWARD else x.id for x in h.sites}


#: streams that backward produces, in the reverse of the modules' forward order (a parameter's gradient when its
#: module's backward runs: the last layer's first)
_BACKWARD = ("activation_grad", "param_grad")


#: a training loss's rank among the passes of a step: computed from the forward's output, before the backward that
#: it starts (so a loss made non-finite by its own computation, or overflowing from a finite forward, comes before
#: the backward's non-finite gradients); every other run-level scalar ranks after the update (PASS_ORDER)
_LOSS_RANK = 0.5


def _training_loss(name: str) -> bool:
    """Whether a run-level scalar's name says it is the step's training loss (``loss``, ``train/loss``,
    ``train_loss``): an evaluation's (``val_loss``, ``eval/loss``), which may be computed after the update, is not."""
    n = name.lower()
    leaf = n.rsplit("/", 1)[-1]
    return (leaf in ("loss", "train_loss", "training_loss", "loss_train")
            and not any(w in n for w in ("val", "eval", "test")))


def _pass_rank(site: Site) -> float:
    """The rank of ``site``'s pass within a step (PASS_ORDER; a training loss between the forward and backward)."""
    return _LOSS_RANK if site.stream == "scalar" and _training_loss(site.path) else PASS_ORDER[site.stream]


def _scalar_rank(x: Site) -> int:
    """A run-level scalar's place among the scalars of a step: the loss (computed in the forward) before the
    gradient norms (after backward); the others between, by id."""
    name = x.path.lower()
    return 2 if name.startswith("grad_norm") else 0 if "loss" in name and "loss_scale" not in name else 1


@dataclass(frozen=True)
class Finding:
    """One thing a person should look at."""

    kind: str  # first_nonfinite(_site, _segment), model_finite, nonfinite, ranks, scaler_overflow, failed,
    # rows_absent/_skipped/_unknown/_missing, rows_partly_skipped, skipped_step, interrupted, truth_partial,
    # unknown_applied, segment, segment_run, zero_forward, zero_update
    step: int | None
    site: str | None
    text: str


@dataclass
class Triage:
    """The findings, most important first."""

    path: str
    findings: list[Finding] = field(default_factory=list)
    #: how reading ended (``History.recovery``): a torn tail's dropped bytes were not triaged
    recovery: Any = None
    #: what the site spines did not observe (recorded at a cadence), said with a verdict of nothing found
    unobserved: str | None = None

    @property
    def first_nonfinite(self) -> Finding | None:
        return next((f for f in self.findings if f.kind == "first_nonfinite"), None)

    def format(self, limit: int = 12) -> str:
        """A short report for a terminal: the first ``limit`` findings (0: all of them). A file with a torn tail says
        so first: the findings, or their absence, cover its committed prefix alone."""
        torn = self.recovery is not None and self.recovery.status == "torn"
        note = (f"  note: {self.recovery.describe()}; only the committed prefix was triaged, so the dropped records "
                "may hold what went wrong (run `trainhist verify` for the details)" if torn else None)
        path = printable_path(self.path)  # (a newline in the name split the report's first line)
        if not self.findings:
            seen = "" if self.unobserved is None else f" ({self.unobserved})"
            if torn:
                return (f"{path}: no non-finite values, failures, skipped steps, gaps or sites stuck at zero "
                        f"found in the committed prefix{seen}, but the file's tail was torn:\n{note}")
            return (f"{path}: no non-finite values, failures, skipped steps, gaps or sites stuck at zero "
                    f"found{seen}")
        limit = len(self.findings) if limit <= 0 else limit
        lines = [f"triage of {path}:"] + ([note] if torn else [])
        for f in self.findings[:limit]:
            lines.append(f"  - {f.text}")
        if len(self.findings) > limit:
            lines.append(f"  ... {_n(len(self.findings) - limit, 'more finding', 'more findings')}")
        return "\n".join(lines)


def printable(name: str) -> str:
    """A name of the file (any Unicode, spec 9) for a line of a terminal report: each character that is not
    printable (a newline, which split a finding in two; ESC, with which a file's site name could recolor or
    rewrite the user's terminal) as its escape (``\\n``, ``\\x1b``); every other character as it is."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)


def printable_path(path: object) -> str:
    """A path (the user's, or one derived from it) for a line of output: its control characters (a newline, ESC)
    escaped, as in site names (:func:`printable`). The bytes of a name the locale could not decode (PEP 383's lone
    surrogates) are kept: the output writes them back as they were given."""
    text = os.fsdecode(path) if isinstance(path, bytes) else str(path)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or "\udc80" <= c <= "\udcff" else printable(c) for c in text)


def _label(site: object, phase: str) -> str:
    facet = "" if site.facet is None else f"[{printable(site.facet)}]"
    if site.stream == "scalar":
        return f"`{printable(site.path)}` scalar"
    what = _WHAT.get(site.stream, site.stream) + ("" if phase == "default" else f", {phase}")
    return f"`{printable(site.path)}{facet}` {_PASS_NAME[site.stream]} ({what})"


def _n(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the word for one or for several of them."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def _what(nan: int, inf: int) -> str:
    return ", ".join(x for x in (f"{nan} NaN" if nan else "", f"{inf} inf" if inf else "") if x)


class _Event(NamedTuple):
    """A non-finite observation: where it sits in time (segment, step), its pass, the site's place in that pass,
    and the site's previous observation in the same segment (its first step and the step after its span)."""

    segment: int
    step: int
    pass_rank: float
    order: int
    phase: str
    site: Any
    nan: int
    inf: int
    before: int | None
    before_end: int | None
    span: int = 1
    before_bad: bool = False  # (the previous observation held non-finite values itself: a scaler's overflow)


def _observed_end(step: int, span: int, site: Site) -> int:
    """The step after the last one a row observed: a one-step row its step; a coarsened row of a site recorded at a
    cadence ``c`` larger than the window (spec 11.7 keeps the writers' cadence) observed only the multiples of ``c``
    inside it, so the steps after the last of them were not observed; any other row its whole window (whether it
    observed every step of it is not recorded)."""
    c = site.cadence_spine
    if span > 1 and c > span:  # (c == span: the writers' cadence, or the window of an earlier rule; not known)
        last = (step + span - 1) // c * c
        if last >= step:
            return last + 1
    return step + span


def _due_without_row(entries: tuple[np.ndarray, np.ndarray], rows: list[tuple[np.ndarray, np.ndarray]],
                     cadence: int) -> list[tuple[int, int]]:
    """The step-truth rows (``entries``: arrays of steps and spans) of one segment that hold a step due at
    ``cadence`` and that no row of the site (``rows``: arrays of steps and spans) covers any step of, as
    ``(step, span)``. Vectorized on i64 where no value comes near its limits, else on exact integers (steps may lie
    anywhere in the i64 range, a coarsened window may reach past its end, and a cadence may be any integer)."""
    a, n = entries
    step = np.concatenate([x for x, _ in rows])
    span = np.concatenate([y for _, y in rows]).astype(np.int64)
    lim = 1 << 61
    safe = cadence < lim and all(v.size == 0 or (int(v.min()) > -lim and int(v.max()) < lim) for v in (a, step))
    dt = np.int64 if safe else object
    a, n, step, span = (v.astype(dt) for v in (a, n, step, span))
    due = (a + n - 1) // cadence * cadence >= a  # (a multiple of the cadence among its steps)
    o = np.argsort(step, kind="stable")
    starts, reach = step[o], np.maximum.accumulate((step + span)[o]) if o.size else step
    i = np.searchsorted(starts, a + n, side="left")  # the rows that start before its end: does one reach into it?
    covered = (i > 0) & (reach[np.maximum(i - 1, 0)] > a) if o.size else np.zeros(a.size, bool)
    lost = np.flatnonzero(due & ~covered.astype(bool))
    return [(int(a[k]), int(n[k])) for k in lost.tolist()]


def _maybe_unplanned(lost: list[tuple[int, int]], rows: list[tuple[np.ndarray, np.ndarray]], cadence: int) -> bool:
    """Whether a due step without a row (``lost``: (step, span)) of a merged site could be one that no writer
    planned (spec 11.5): the merged cadence ``cadence`` is the gcd of the writers' cadences, each a multiple ``k``
    of it, and a writer's row of one step at ``q * cadence`` says that some writer's ``k`` divides ``q`` (0 says
    nothing), so a lost step at ``m * cadence`` was planned when some such ``q`` divides ``m`` (step 0 always was).
    A row at ``±cadence`` says a writer recorded the site at the merged cadence itself. For a coarsened window or
    past a few hundred lost steps, the answer is yes (it may be); only the 4096 smallest ``q`` are tried."""
    parts = [x[n == 1] for x, n in rows]
    if not 0 < cadence < 1 << 62 or len(lost) > 256 or any(n != 1 for _, n in lost):
        return True
    one = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    one = one[(one != 0) & (one % cadence == 0)]
    qs = np.unique(np.abs(one // cadence))  # (sorted: the smallest first)
    qs = qs[qs > 0].tolist()
    if qs[:1] == [1]:
        return False
    small = qs[:4096]
    for a, _ in lost:
        m = abs(a) // cadence
        if m and not any(m % q == 0 for q in small):
            return True
    return False


def _gap(e: _Event) -> bool:
    """Whether the site was unobserved on some step just before its first non-finite row (a cadence gap)."""
    return e.before_end is not None and e.before_end < e.step


def _steps(step: int, span: int) -> str:
    """A row's steps: one step, or the window a coarsened row covers (never shown as a single step)."""
    return f"step {step}" if span <= 1 else f"steps {step}–{step + span - 1}"


def _seg(g: int, segments: int, runs: dict[int, str] | None = None) -> str:
    """How a finding places something in segment ``g``: nothing when the file has one segment, else the segment,
    and its run when the file holds several runs (``runs``: segment -> run label, empty unless it does)."""
    if segments <= 1:
        return ""
    return f" (segment {g}, run {runs[g]})" if runs and g in runs else f" (segment {g})"


def _at(e: _Event, segments: int, runs: dict[int, str] | None = None) -> str:
    return _steps(e.step, e.span) + _seg(e.segment, segments, runs)


def _site_finding(e: _Event, segments: int, runs: dict[int, str] | None = None, hit: int = 1) -> Finding:
    """The first site-level non-finite observation, bracketed by the site's previous (finite) observation (``hit``:
    the site/phase pairs non-finite at its step).

    With spines at a cadence the site first seen non-finite is only the first in the step's order among those the
    values had reached by then: over the steps not observed they spread through the updates to every site, so the
    finding says which steps were not observed and that any site may have held them first, attributing the origin
    neither to it nor to what is upstream of it.
    """
    where = (f"the first site with non-finite values is {_label(e.site, e.phase)} at {_at(e, segments, runs)} "
             f"({_what(e.nan, e.inf)})")
    held = "held only a loss scaler's overflow" if e.before_bad else "was finite"
    if _gap(e):
        covered = "" if e.before_end == e.before + 1 else f" (covering steps {e.before}..{e.before_end - 1})"
        why = ("(its rows there are missing or carry no numbers: see below)" if e.site.cadence_spine == 1 else
               "(record every step to pin it)")
        where += (f"; its previous observation, at step {e.before}{covered}, {held} and steps {e.before_end}.."
                  f"{e.step - 1} were not observed there, so the values may have turned non-finite earlier, and first "
                  "at any site (over steps not observed they can spread through the updates to every site: "
                  f"{_n(hit, 'site/phase pair')} held non-finite values at {_steps(e.step, e.span)}): which site held "
                  f"them first is not recorded {why}")
    elif e.before is not None and e.before_end - e.before > 1:  # (a coarsened window just before: not pinned)
        where += (f"; its previous row, steps {e.before}–{e.before_end - 1} (a coarsened window), {held}, but which "
                  "of its steps were observed is not recorded, so the values may have turned non-finite inside it")
    return Finding("first_nonfinite_site", e.step, e.site.path, where)


#: streams whose non-finite values a loss scaler's overflow explains at a step it skipped
_SCALED = ("activation_grad", "param_grad", "param_delta")


def _overflow(e: _Event, skipped: set[tuple[int, int, int]]) -> bool:
    """Whether ``e`` is a gradient's overflow at a step the loss scaler skipped (expected with a GradScaler)."""
    if (e.segment, e.step, e.span) not in skipped:  # (a coarsened window: when every step of it was skipped)
        return False
    return e.site.stream in _SCALED or (e.site.stream == "scalar" and e.site.path.startswith("grad_norm"))


#: streams whose rows of zeros alone, through a site's last row, are worth a finding: what they mean
_ZERO_WHAT = {"activation": "a dead layer passes no signal forward and no gradient back (a ReLU whose inputs all "
                            "turned negative, an output multiplied by 0)",
              "param_delta": "its update was 0 at every element: the parameter stopped changing (a learning rate "
                             "of 0, a gradient of 0)"}


def _zero_tail(s: Any, rows: np.ndarray) -> tuple | None:
    """The stretch of ``s``'s rows (``rows``: a mask of observed rows holding values, of one segment) that hold only
    zeros through the last of them, when it has at least two rows: (its first step, rows, last step, whether it
    starts at the first of them, the previous row's (step, step after its span) or None), else None."""
    at = np.flatnonzero(rows)
    if at.size < 2:
        return None
    at = at[np.argsort(s.step[at], kind="stable")]
    allzero = s.zero[at] == s.count[at]
    if not allzero[-1]:
        return None
    nz = np.flatnonzero(~allzero)
    start = int(nz[-1]) + 1 if nz.size else 0
    n = at.size - start
    if n < 2:
        return None
    p, q = (None, None) if start == 0 else (int(s.step[at[start - 1]]), int(s.span[at[start - 1]]))
    prev = None if p is None else (p, p + q)  # (exact integers: steps may lie anywhere in the i64 range)
    return int(s.step[at[start]]), n, int(s.step[at[-1]]) + int(s.span[at[-1]]) - 1, start == 0, prev


def _overflow_runs(rows: list[dict], skipped: set[tuple[int, int, int]]) -> tuple[set[tuple[int, int, int]], list]:
    """Split the steps the loss scaler skipped (``skipped``: (segment, step, span)) into the overflows and the rest.

    A scaler halves its scale at each skip, so an overflow clears as the scale goes down: a run of consecutive
    skipped steps that reaches a loss scale of 1 or below (gradients not amplified, so non-finite of their own) is no
    overflow, nor is any step of it. Returns the overflows, and the runs of several skips that reach their
    segment's last step-table row, each as ``((segment, first step, its span), rows, lowest loss scale or None)``:
    the data do not tell them from overflows, but they never cleared."""
    by_seg: dict[int, list[dict]] = {}
    for r in rows:
        by_seg.setdefault(r["segment"], []).append(r)
    keep = set(skipped)
    through_end = []
    for g, rs in by_seg.items():
        rs = sorted(rs, key=lambda r: r["step"])
        run: list[dict] = []
        for r in [*rs, None]:
            if r is not None and (g, r["step"], r["span"]) in skipped:
                run.append(r)
                continue
            if run:
                scales = [x["loss_scale"] for x in run if x["loss_scale"] is not None]
                if scales and min(scales) <= 1:
                    keep -= {(g, x["step"], x["span"]) for x in run}
                elif r is None and len(run) > 1:
                    through_end.append(((g, run[0]["step"], run[0]["span"]), len(run), min(scales) if scales else None))
            run = []
    return keep, through_end


def segment_runs(h: History) -> dict[int, tuple[str, ...]]:
    """Segment id -> the runs whose history it records (spec 11.3): a derived file's segment names them in its
    ``origin``, a writer's segment is its writer's run (else the file's first run). A merge keeps the segments of
    different runs apart unless asked (``across_runs``), ordered by segment number first (spec 11.3), so the
    segments of several runs interleave: a segment sharing no run with any earlier one starts another run's
    history, not a resume."""
    run_of = {w.get("writer_id"): w.get("run_id") for w in h.writers}
    default = h.runs[0]["run_id"] if h.runs else None
    out = {}
    for g in h.segments:
        o = g.manifest.get("origin") or {}
        out[g.id] = tuple(sorted(o["runs"])) if o.get("runs") else (run_of.get(g.writer_id, default),)
    return out


def run_label(h: History, runs: tuple[str, ...]) -> str:
    """How a person knows a run: its name with the start of its id (``'seed1' [dabe6a17]``), else its id's start."""
    names = {d["run_id"]: d.get("name") for d in h.runs}
    return " + ".join(f"{names[r]!r} [{r[:8]}]" if names.get(r) else f"[{(r or 'unknown')[:8]}]" for r in runs)


def other_runs(h: History) -> dict[int, tuple[str, ...]]:
    """The segments that start another run's history (:func:`segment_runs`): id -> that run. A segment sharing a
    run with an earlier one (a resume, of runs pooled with --across-runs too) continues that run's history."""
    runs = segment_runs(h)
    out: dict[int, tuple[str, ...]] = {}
    seen: set[str] = set()
    for g in sorted(runs):
        if seen and not seen & set(runs[g]):
            out[g] = runs[g]
        seen.update(runs[g])
    return out


def _ranks_note(h: History) -> str | None:
    """What the file's writers say about ranks, where it matters to where a value came from."""
    ranks = sorted({(w.get("rank"), w.get("world_size")) for w in h.writers if w.get("world_size", 1) > 1},
                   key=lambda r: (r[0] is None, r))
    if len(ranks) > 1:
        return (f"this history merges the shards of {_n(len(ranks), 'rank')} (a merged row sums them): which rank "
                "held a value is not recorded here; triage each rank's shard to find it")
    if len(ranks) == 1:
        r, n = ranks[0]
        return (f"this is the shard of rank {r} of {n}: a value another rank produced reaches this one through "
                "collectives (a gradient all-reduce spreads one rank's NaN to every rank), so triage every rank's "
                "shard or their merge")
    return None


def triage(h: History) -> Triage:
    """Scan every site's spine of ``h`` and the step table; return the findings, most important first. Time runs
    by segment, then step (a run resumed at an earlier step is later in time)."""
    cadences = sorted({x.cadence_spine for x in h.sites if x.stream != "scalar" and x.cadence_spine > 1})
    every = None if not cadences else (f"every {cadences[0]}" if len(cadences) == 1 else
                                       f"every {cadences[0]} to {cadences[-1]}")
    report = Triage(h.path, recovery=h.recovery, unobserved=None if every is None else
                    f"site spines recorded {every} steps: the steps between were not observed")
    events: list[_Event] = []
    failed: dict[str, list[tuple[int, int]]] = {}  # site label -> (step, span) of its failed rows
    # presence -> (first step, (pass, site order), span, rows, site label) per site
    missing: dict[str, list[tuple[int, tuple[float, int], int, int, str]]] = {}
    partly: list[tuple[int, tuple[float, int], int, int, str]] = []  # observed rows that combine skipped ones
    # stream -> (segment, first step, (pass, order), rows, last step, from the segment's first row, label, path) of
    # the site/phase pairs whose observed rows held only zeros from some step through their last one
    zeros: dict[str, list[tuple]] = {}
    sampled: dict[str, str] = {}  # label -> what a sampled update site measured
    site_rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (segment, step, span) of sites' observed rows
    n_segments = len(h.segments)
    seg_runs = segment_runs(h)  # (a file holding several runs names each place's run: segment -> its label)
    run_of = {g: run_label(h, r) for g, r in seg_runs.items()} if len(set(seg_runs.values())) > 1 else {}
    orders = site_orders(h)
    rows = h.step_truth_rows()
    coarse = any(r["span"] != 1 for r in rows)
    # a coarsened step-truth row covers a window of steps: counted as windows, as `trainhist info` counts them
    unit = "step" if not coarse else "coarsened window"
    table: dict[int, list[tuple[int, int]]] = {}  # segment -> its step-truth rows (step, span)
    for r in rows:
        table.setdefault(r["segment"], []).append((r["step"], r["span"]))
    tables = {g: (np.array([a for a, _ in v], np.int64), np.array([n for _, n in v], np.int64))
              for g, v in table.items()}
    # (first step, its span, (pass, site order), due steps without a row, due windows without a row, label)
    no_row: list[tuple[int, int, tuple[float, int], int, int, str]] = []
    writers = {g.id: len((g.manifest.get("origin") or {}).get("writers", ())) for g in h.segments}
    merged = {g for g, n in writers.items() if n > 1}
    in_merge = False  # (a due step without a row in a segment that merges several writers)
    for site in h.sites:
        seen: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # segment -> (step, span) of its rows, any phase
        for phase in ("default", "pre_clip", "post_clip"):
            s = h.spine(site.path, site.stream, site.facet, phase=phase)
            if not len(s):
                continue
            obs = s.observed
            bad = obs & ((s.nan > 0) | (s.pinf > 0) | (s.ninf > 0))
            order = orders[site.id]
            at_pass = (_pass_rank(site), order)  # (rows without numbers: the earliest by pass, then position)
            step, span, seg = s.step, s.span.astype(np.int64), s.segment
            for g in np.unique(seg).tolist():
                seen.setdefault(int(g), []).append((step[seg == g], span[seg == g]))
            if site.stream != "scalar":
                site_rows.append((seg[obs], step[obs], span[obs]))
            for g in np.unique(seg[bad]).tolist():
                mine = np.flatnonzero(obs & (seg == g))
                mine = mine[np.argsort(step[mine], kind="stable")]  # the segment's observed rows by step
                bad_rows = np.flatnonzero(bad & (seg == g))
                earlier = np.searchsorted(step[mine], step[bad_rows])  # observed rows at earlier steps
                for i, k in zip(bad_rows.tolist(), earlier.tolist()):
                    prev = int(mine[k - 1]) if k else None
                    before = None if prev is None else int(step[prev])
                    events.append(_Event(int(g), int(step[i]), _pass_rank(site), order, phase, site,
                                         int(s.nan[i]), int(s.pinf[i] + s.ninf[i]), before,
                                         None if prev is None else _observed_end(before, int(span[prev]), site),
                                         int(span[i]), prev is not None and bool(bad[prev])))
            if site.stream in _ZERO_WHAT and (site.dtype is None or "float" in site.dtype):
                for g in np.unique(seg[obs]).tolist():
                    z = _zero_tail(s, obs & (seg == g) & (s.count > 0))
                    if z is not None:
                        smp = site.sample or {}
                        if smp.get("elements", 0) < smp.get("of", 0):
                            sampled[_label(site, phase)] = (
                                f"at each of the {smp['elements']} elements sampled of {smp['of']} (the others were "
                                "not measured): the parameter may have stopped changing")
                        zeros.setdefault(site.stream, []).append(
                            (int(g), z[0], at_pass, z[1], z[2], z[3], _label(site, phase), site.path, z[4]))
            fails = np.flatnonzero(s.presence == Presence.FAILED)
            if fails.size:
                failed[_label(site, phase)] = list(zip(s.step[fails].tolist(), s.span[fails].tolist()))
            for code, name in ((Presence.ABSENT, "absent"), (Presence.SKIPPED, "skipped"),
                               (Presence.UNKNOWN, "unknown")):
                at = np.flatnonzero(s.presence == code)
                if at.size:
                    i = int(at[np.argmin(s.step[at])])
                    missing.setdefault(name, []).append((int(s.step[i]), at_pass, int(s.span[i]), int(at.size),
                                                         _label(site, phase)))
            if "n_skipped" in s.columns:  # (a derived row: observed with skipped inputs, spec 11.4)
                at = np.flatnonzero((s.presence == Presence.OBSERVED) & (s.columns["n_skipped"] > 0))
                if at.size:
                    i = int(at[np.argmin(s.step[at])])
                    partly.append((int(s.step[i]), at_pass, int(s.span[i]), int(at.size), _label(site, phase)))
        # due steps of the step table with no row of this site at all (nothing was written: a failed write, say);
        # a coarsened step-truth window is due when the site's cadence (the writers', spec 11.7) makes a step of it
        # due, and has a row when a row of the site covers a step of it
        if site.stream != "scalar" and site.cadence_spine:
            for g, entries in tables.items():
                if g not in seen:  # (a site with no row in a segment may not have existed there)
                    continue
                lost = _due_without_row(entries, seen[g], site.cadence_spine)
                if lost:
                    steps_, windows = sum(n == 1 for _, n in lost), sum(n > 1 for _, n in lost)
                    first = min(lost)
                    no_row.append((first[0], first[1], (_pass_rank(site), orders[site.id]), steps_, windows,
                                   _label(site, "default")))
                    in_merge |= g in merged and _maybe_unplanned(lost, seen[g], site.cadence_spine)
    # gradients that overflowed at steps the loss scaler skipped: expected, reported apart from the rest
    # (a segment whose rows record a loss scale ran under a scaler: a coarsened window of differing scales keeps none)
    scaled = {r["segment"] for r in rows if r["loss_scale"] is not None}
    scaler_skipped = {(r["segment"], r["step"], r["span"]) for r in rows
                      if r["applied"] == "skipped" and (r["loss_scale"] is not None or r["segment"] in scaled)}
    # a step whose forward or training loss was non-finite too: its gradients are that value's, not an overflow (the
    # scaler skips that step as well, and the loss scale does not explain it)
    scaler_skipped -= {(e.segment, e.step, e.span) for e in events if e.pass_rank < PASS_ORDER["activation_grad"]}
    scaler_skipped, through_end = _overflow_runs(rows, scaler_skipped)
    overflows = [e for e in events if _overflow(e, scaler_skipped)]
    events = [e for e in events if not _overflow(e, scaler_skipped)]
    # within a step: forward, then backward, the pre-clip gradients before the post-clip ones, then the update
    events.sort(key=lambda e: (e.segment, e.step, e.pass_rank, e.phase == "post_clip", e.order))
    if events:
        e0 = events[0]
        end = e0.step + e0.span
        # a coarsened row covers a window: the order of sites and passes inside it is not recorded, so every site
        # non-finite in a window overlapping the first one may hold the first value
        window = [e for e in events if e.segment == e0.segment and e.step < end and e0.step < e.step + e.span]
        if e0.span > 1 and len(window) > 1:
            named = ", ".join(f"{_label(e.site, e.phase)} ({_what(e.nan, e.inf)})" for e in window[:4])
            more = f" and {len(window) - 4} more" if len(window) > 4 else ""
            report.findings.append(Finding("first_nonfinite", e0.step, None,
                                           f"the first non-finite values were within {_at(e0, n_segments, run_of)}, a "
                                           "coarsened window (which site and pass came first inside it is not "
                                           f"recorded), in {named}{more}"))
        else:
            also = [e for e in events if (e.segment, e.step) == (e0.segment, e0.step) and e.site.stream == "scalar"
                    and e is not e0]
            also_text = ("; also non-finite at that step: " + ", ".join(f"`{printable(e.site.path)}`" for e in also[:4])
                         + (" ..." if len(also) > 4 else "")) if e0.site.stream == "scalar" and also else ""
            unseen = e0.site.stream == "scalar" and not any(
                bool(np.any((g == e0.segment) & (a <= e0.step) & (a > e0.step - n))) for g, a, n in site_rows)
            recorded = " recorded" if unseen else ""
            later = any(e.site.stream != "scalar" for e in events)
            unseen_text = ("; no site spine was observed at that step, so where it started is not recorded"
                           + (": see the first site seen non-finite below" if later else "")) if unseen else ""
            report.findings.append(Finding("first_nonfinite", e0.step, e0.site.path,
                                           f"the first non-finite value{recorded} was in {_label(e0.site, e0.phase)} "
                                           f"at {_at(e0, n_segments, run_of)} ({_what(e0.nan, e0.inf)}){also_text}"
                                           f"{unseen_text}"))
        first_site = next((e for e in events if e.site.stream != "scalar"), None)
        if first_site is not None and (e0.site.stream == "scalar" or _gap(first_site)):
            hit = len({(e.site.id, e.phase) for e in events if e.site.stream != "scalar"
                       and (e.segment, e.step) == (first_site.segment, first_site.step)})
            report.findings.append(_site_finding(first_site, n_segments, run_of, hit))
        elif first_site is None:
            report.findings.append(Finding("model_finite", None, None,
                                           "no recorded site of the model held a non-finite value, only run-level "
                                           "scalars: look at how they are computed (a loss's log(0), say), or at "
                                           "what was not recorded"))
        other = other_runs(h)
        for g in sorted({e.segment for e in events} - {e0.segment}):  # (a resumed run's own first failure)
            eg = next(e for e in events if e.segment == g)
            run = f" (run {run_label(h, other[g])}, another run)" if g in other else ""
            report.findings.append(Finding("first_nonfinite_segment", eg.step, eg.site.path,
                                           f"in segment {g}{run}, the first non-finite value was in "
                                           f"{_label(eg.site, eg.phase)} at {_steps(eg.step, eg.span)} "
                                           f"({_what(eg.nan, eg.inf)})"))
        sites_hit = {(e.site.id, e.phase) for e in events}
        first_at, last_at = _at(events[0], n_segments, run_of), _at(events[-1], n_segments, run_of)
        report.findings.append(Finding("nonfinite", None, None,
                                       f"{_n(len(events), 'observation')} on {_n(len(sites_hit), 'site/phase pair')} "
                                       f"held non-finite values, "
                                       + (f"all at {first_at}" if first_at == last_at else
                                          f"from {first_at} to {last_at}")))
        note = _ranks_note(h)
        if note is not None:
            report.findings.append(Finding("ranks", None, None, note))
    if overflows:
        at = sorted({(e.segment, e.step, e.span) for e in overflows})
        scale = next((r["loss_scale"] for r in rows if (r["segment"], r["step"], r["span"]) == at[0]), None)
        where = _steps(at[0][1], at[0][2]) + _seg(at[0][0], n_segments, run_of)
        kept = "its loss scale not kept by the window" if scale is None else f"loss scale {scale:g}"
        tail = [t for t in through_end if t[0] in set(at)]
        end = ""
        if tail:  # (the longest such run: skips an overflow explains end once the scale has gone down far enough)
            (g, step0, span0), n_run, low = max(tail, key=lambda t: t[1])
            low_ = "its loss scale not kept" if low is None else f"the loss scale down to {low:g}"
            end = (f"; the last {n_run} of them ran through the end of the history{_seg(g, n_segments, run_of)} "
                   f"without an applied step ({low_}): an overflow clears as the scale goes down, so these may be "
                   f"non-finite gradients of the model's own, from {_steps(step0, span0)} on")
        report.findings.append(Finding("scaler_overflow", at[0][1], None,
                                       f"{_n(len(at), unit)} skipped by the loss scaler held non-finite gradients "
                                       f"(an overflow, expected with a GradScaler: no update was applied), first at "
                                       f"{where} ({kept}){end}; they are not counted above"))
    for label, steps in failed.items():
        report.findings.append(Finding("failed", steps[0][0], label,
                                       f"the reduction failed for {label} at {_n(len(steps), 'row')}, first at "
                                       f"{_steps(*steps[0])}"))
    for stream, found in zeros.items():  # (a dead layer; a parameter that stopped changing)
        g, step, _, n, last, whole, label, path, prev = min(found)
        since = f"from its first row, step {step}," if whole else f"from step {step}"
        if prev is not None and prev[1] < step:  # (a cadence gap before it: when they turned to zeros is not known)
            gap = f"step {prev[1]} was" if prev[1] == step - 1 else f"steps {prev[1]}..{step - 1} were"
            since += f" (its previous row, at step {prev[0]}, held other values: {gap} not observed)"
        more = f"; {_n(len(found), 'site/phase pair')} in all (the first named)" if len(found) > 1 else ""
        report.findings.append(Finding(f"zero_{'forward' if stream == 'activation' else 'update'}", step, path,
                                       f"{label} held only zeros {since} to step {last}, its last row"
                                       f"{_seg(g, n_segments, run_of)} ({_n(n, 'row')}): "
                                       + (_ZERO_WHAT[stream] if label not in sampled else _ZERO_WHAT[stream].replace(
                                           "at every element: the parameter stopped changing", sampled[label]))
                                       + more))
    why = {"absent": "did not run", "skipped": "had nothing to observe (skipped)", "unknown": "are unknown"}
    for name, found in missing.items():  # rows without numbers, by state: one finding each, naming the earliest
        step, _, span, _, label = min(found)
        report.findings.append(Finding(f"rows_{name}", step, None,
                                       f"{_n(sum(f[3] for f in found), 'row')} of "
                                       f"{_n(len(found), 'site/phase pair')} "
                                       f"{why[name]}, first {label} at {_steps(step, span)}"))
    if partly:
        step, _, span, _, label = min(partly)
        report.findings.append(Finding("rows_partly_skipped", step, None,
                                       f"{_n(sum(f[3] for f in partly), 'observed row')} of "
                                       f"{_n(len(partly), 'site/phase pair')} combine steps or inputs that had nothing "
                                       f"to observe (skipped), first {label} at {_steps(step, span)}: their numbers "
                                       "are the other steps' or inputs' (n_skipped in the tally counts them)"))
    if no_row:
        step, span, _, _, _, label = min(no_row)
        n_steps, n_windows = sum(x[3] for x in no_row), sum(x[4] for x in no_row)
        what = " and ".join(x for x in (_n(n_steps, "due step") if n_steps else "",
                                        _n(n_windows, "coarsened window") + " with a due step" if n_windows else "")
                            if x)
        have = "has" if n_steps + n_windows == 1 else "have"
        why = "nothing was written for them, a failed write say"
        if in_merge:  # (spec 11.5: the merged cadence, the gcd of the writers', can make due steps none planned)
            why += ("; in this merge of several writers, possibly also steps that none of the writers planned: if "
                    "they recorded the site at different cadences, the merged cadence, their greatest common divisor, "
                    "makes due steps that no writer's did (spec 11.5; the merge's report lists such sites as "
                    "cadence_mismatches), which this file cannot tell apart")
        read = "their due steps read" if n_windows else "read"
        report.findings.append(Finding("rows_missing", step, None,
                                       f"{what} of {_n(len(no_row), 'site')} in the step table {have} no row at "
                                       f"all ({read} as unknown: {why}), first {label} at {_steps(step, span)}"))
    skipped = [(r["step"], r["span"], r["segment"]) for r in rows if r["applied"] == "skipped"]
    if skipped:  # (the first in time: segment, then step)
        step, span, seg = min(skipped, key=lambda x: (x[2], x[0]))
        where = _steps(step, span) + _seg(seg, n_segments, run_of)
        report.findings.append(Finding("skipped_step", step, None,
                                       f"{_n(len(skipped), unit)} applied no update (the optimizer step was "
                                       "skipped, "
                                       f"e.g. for an overflow, or not called), first at {where}"))
    if any(x.path == "step_interrupted" and x.stream == "scalar" for x in h.sites):
        sp = h.spine("step_interrupted", "scalar")
        i = int(np.lexsort((sp.step, sp.segment))[0])  # (the first in time)
        seg = _seg(int(sp.segment[i]), n_segments, run_of)
        report.findings.append(Finding("interrupted", int(sp.step[i]), None,
                                       f"{_n(len(sp), 'step')} {'was' if len(sp) == 1 else 'were'} interrupted by "
                                       f"an exception in the training loop, first at "
                                       f"{_steps(int(sp.step[i]), int(sp.span[i]))}{seg}: their rows hold what was "
                                       "recorded before it, the rest are unknown"))
    short = [r for r in rows if r["span"] == 1 and r["n_rows"] < writers.get(r["segment"], 0)]
    if short:  # (spec 11.6: a merged step some writer did not record, a shard torn before it say)
        r = min(short, key=lambda x: (x["segment"], x["step"]))
        were = "was" if len(short) == 1 else "were"
        where = f"step {r['step']}{_seg(r['segment'], n_segments, run_of)}"
        report.findings.append(Finding("truth_partial", r["step"], None,
                                       f"{_n(len(short), 'step')} of the merged step table {were} recorded by "
                                       f"fewer writers than the segment's, first at {where} ({r['n_rows']} of "
                                       f"{writers[r['segment']]}): their tokens and samples are those writers' sum, "
                                       "not the step's total (a shard torn or stopped before them; the merge's "
                                       "report gives each input's recovery)"))
    unknown = sum(r["applied"] == "unknown" for r in rows)
    if rows and unknown:
        report.findings.append(Finding("unknown_applied", None, None,
                                       f"{unknown} of {_n(len(rows), unit)} {'does' if unknown == 1 else 'do'} not "
                                       "say whether the update was applied"))
    runs, other = segment_runs(h), other_runs(h)
    for g in h.segments:
        at = f"step {g.first_step}" if g.first_step is not None else "an unknown step"
        if g.id in other:  # (a merge kept two runs apart: neither a resume nor a gap in one history)
            before = runs[max(k for k in runs if k < g.id)]
            report.findings.append(Finding("segment_run", g.first_step, None,
                                           f"segment {g.id} is run {run_label(h, other[g.id])} (another run), from "
                                           f"{at}: a history of its own that the merge kept apart from run "
                                           f"{run_label(h, before)} (no --across-runs), not a resume of it"))
        elif g.reason != "start" or g.id > 0:  # (a segment after another, whatever its writers called it)
            after = f"segment {g.previous}" if g.previous is not None else "an earlier segment"
            report.findings.append(Finding("segment", g.first_step, None,
                                           f"segment {g.id} ({g.reason}) starts at {at}, after {after}: the "
                                           "history is not continuous there"))
    return report
