"""Triage: where and when a history first went wrong, read from the spine alone (no torch).

The order of checks follows a training-monitor doctrine: first non-finite values (which site, which pass, which
step), then failed reductions, skipped optimizer steps and missing rows, then segment boundaries. Every finding
names the site, stream, phase and step so that a person can go straight to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .model import Presence
from .reader import History

__all__ = ["Finding", "Triage", "triage", "PASS_ORDER"]

# Within one step, the order in which a training step produces its streams: a NaN in an earlier pass explains the
# later ones. Backward runs through the modules in reverse, so activation gradients are ranked in reverse site order.
#: stream -> rank of its pass within a step (used by the triage and by the figures' site order)
PASS_ORDER = {"scalar": 5, "activation": 0, "activation_grad": 1, "param_grad": 2, "param_delta": 3, "param": 4}
_PASS_NAME = {"activation": "forward", "activation_grad": "backward", "param_grad": "gradient",
              "param_delta": "update", "param": "parameter", "scalar": "scalar"}


@dataclass(frozen=True)
class Finding:
    """One thing a person should look at."""

    kind: str  # first_nonfinite, first_nonfinite_site, nonfinite, failed, skipped_step, unknown_applied, segment
    step: int | None
    site: str | None
    text: str


@dataclass
class Triage:
    """The findings, most important first."""

    path: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def first_nonfinite(self) -> Finding | None:
        return next((f for f in self.findings if f.kind == "first_nonfinite"), None)

    def format(self, limit: int = 12) -> str:
        """A short report for a terminal."""
        if not self.findings:
            return f"{self.path}: no non-finite values, failures, skipped steps or gaps found"
        lines = [f"triage of {self.path}:"]
        for f in self.findings[:limit]:
            lines.append(f"  - {f.text}")
        if len(self.findings) > limit:
            lines.append(f"  ... {len(self.findings) - limit} more findings")
        return "\n".join(lines)


def _label(site: object, phase: str) -> str:
    facet = "" if site.facet is None else f"[{site.facet}]"
    ph = "" if phase == "default" else f" ({phase})"
    return f"`{site.path}{facet}` {_PASS_NAME[site.stream]} ({site.stream}){ph}"


def _what(nan: int, inf: int) -> str:
    return ", ".join(x for x in (f"{nan} NaN" if nan else "", f"{inf} inf" if inf else "") if x)


def _gap(e: tuple) -> bool:
    """Whether the site was unobserved on the step before its first non-finite row (a cadence gap)."""
    return e[7] is not None and e[7] != e[0] - 1


def _site_finding(e: tuple) -> Finding:
    """The first site-level non-finite observation, bracketed by the site's previous (finite) observation.

    With spines at a cadence the site first seen non-finite may be downstream of the origin, so the finding says
    which steps were not observed rather than attributing the origin to it.
    """
    step, _, _, phase, site, nan, inf, before = e
    where = f"the first site with non-finite values is {_label(site, phase)} at step {step} ({_what(nan, inf)})"
    if _gap(e):
        where += (f"; its previous observation, at step {before}, was finite and steps {before + 1}..{step - 1} "
                  f"were not observed there, so the values may have turned non-finite earlier, or first upstream of "
                  f"this site (record every step to pin it)")
    return Finding("first_nonfinite_site", step, site.path, where)


def triage(h: History) -> Triage:
    """Scan every site's spine of ``h`` and the step table; return the findings, most important first."""
    report = Triage(h.path)
    # step, pass, order, phase, site, nan, inf, the site's previous observed step
    events: list[tuple[int, int, int, str, object, int, int, int | None]] = []
    failed: dict[str, list[int]] = {}
    n_sites = len(h.sites)
    for site in h.sites:
        for phase in ("default", "pre_clip", "post_clip"):
            s = h.spine(site.path, site.stream, site.facet, phase=phase)
            if not len(s):
                continue
            obs = s.observed
            bad = obs & ((s.nan > 0) | (s.pinf > 0) | (s.ninf > 0))
            order = n_sites - site.id if site.stream == "activation_grad" else site.id
            obs_steps = s.step[obs]
            rows = np.flatnonzero(bad)
            earlier = np.searchsorted(obs_steps, s.step[rows]).tolist()  # observed rows at earlier steps
            for i, k in zip(rows.tolist(), earlier):
                before = int(obs_steps[k - 1]) if k else None
                events.append((int(s.step[i]), PASS_ORDER[site.stream], order, phase, site, int(s.nan[i]),
                               int(s.pinf[i] + s.ninf[i]), before))
            fails = np.flatnonzero(s.presence == Presence.FAILED)
            if fails.size:
                failed[_label(site, phase)] = s.step[fails].tolist()
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    if events:
        step, _, _, phase, site, nan, inf, _ = events[0]
        report.findings.append(Finding("first_nonfinite", step, site.path,
                                       f"the first non-finite value was in {_label(site, phase)} at step {step} "
                                       f"({_what(nan, inf)})"))
        first_site = next((e for e in events if e[4].stream != "scalar"), None)
        if first_site is not None and (site.stream == "scalar" or _gap(first_site)):
            report.findings.append(_site_finding(first_site))
        sites_hit = {(e[4].id, e[3]) for e in events}
        report.findings.append(Finding("nonfinite", None, None,
                                       f"{len(events)} observations on {len(sites_hit)} site/phase pairs held "
                                       f"non-finite values, from step {events[0][0]} to step {events[-1][0]}"))
    for label, steps in failed.items():
        report.findings.append(Finding("failed", steps[0], label,
                                       f"the reduction failed for {label} at {len(steps)} step(s), first {steps[0]}"))
    rows = h.step_truth_rows()
    skipped = [r["step"] for r in rows if r["applied"] == "skipped"]
    if skipped:
        report.findings.append(Finding("skipped_step", skipped[0], None,
                                       f"{len(skipped)} optimizer step(s) were skipped, first at step {skipped[0]}"))
    unknown = sum(r["applied"] == "unknown" for r in rows)
    if rows and unknown:
        report.findings.append(Finding("unknown_applied", None, None,
                                       f"{unknown} of {len(rows)} steps do not say whether the update was applied"))
    for g in h.segments:
        if g.reason != "start":
            report.findings.append(Finding("segment", g.first_step, None,
                                           f"segment {g.id} ({g.reason}) starts at step {g.first_step}, after "
                                           f"segment {g.previous}: the history is not continuous there"))
    return report
