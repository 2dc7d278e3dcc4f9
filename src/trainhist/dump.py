"""Canonical JSON of a history (spec section 10): the conformance suite compares implementations with it.

Numbers inside rows are tagged strings, so no JSON number type ever has to carry them: ``"u:12"`` an unsigned
integer, ``"i:-3"`` a signed integer, ``"f:3ff8000000000000"`` the IEEE 754 binary64 bit pattern (keeps NaN
payloads and -0.0), ``"d:3p-1"`` an exact dyadic ``3 * 2**-1`` (odd mantissa, or ``d:0p0``). Absent values are
``null``. Keys are sorted, the output is ASCII with no insignificant white space and ends with a newline.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from .dyadic import Dyadic
from .grid import index_min
from .model import MICRO_ALL, TALLY_COLUMNS, Phase, Presence
from .reader import History
from .summary import SumMethod

__all__ = ["canonical", "dumps", "tag_f", "tag_d"]

def tag_f(x: float) -> str:
    """``f:`` + the 16 hex digits of the binary64 bit pattern."""
    return "f:%016x" % struct.unpack("<Q", struct.pack("<d", float(x)))[0]


def tag_d(d: Dyadic) -> str:
    """``d:`` + canonical ``m p e``."""
    return f"d:{d.m}p{d.e}"


def _sketch(series_sk: Any, i: int) -> dict:
    sk = series_sk.sketch(i)
    lo = index_min(sk.scale)
    return {
        "scale": sk.scale,
        "pos": {str(lo + j): f"u:{int(c)}" for j, c in enumerate(sk.pos.tolist()) if c},
        "neg": {str(lo + j): f"u:{int(c)}" for j, c in enumerate(sk.neg.tolist()) if c},
        "under_pos": f"u:{sk.under_pos}",
        "under_neg": f"u:{sk.under_neg}",
        "over_pos": f"u:{sk.over_pos}",
        "over_neg": f"u:{sk.over_neg}",
    }


def _rows(h: History, site: Any) -> list[dict]:
    out = []
    for phase in Phase.NAMES:
        s = h.spine(site.path, site.stream, site.facet, phase=phase)
        if not len(s):
            continue
        sk = h.sketch(site.path, site.stream, site.facet, phase=phase)
        c = s.columns
        known = s.sums_known.tolist()
        for i in range(len(s)):
            pres = int(c["presence"][i])
            row: dict[str, Any] = {
                "segment": f"u:{int(c['segment'][i])}",
                "step": f"i:{int(c['step'][i])}",
                "span": f"u:{int(c['span'][i])}",
                "micro": "all" if int(c["micro"][i]) == MICRO_ALL else f"u:{int(c['micro'][i])}",
                "phase": phase,
                "presence": Presence.name(pres),
            }
            tally = {Presence.name(j): f"u:{int(c[n][i])}" for j, n in enumerate(TALLY_COLUMNS) if c[n][i]}
            if tally != {Presence.name(pres): "u:1"}:  # a derived row that combined several leaf rows (spec 11.4)
                row["tally"] = tally
            if pres == Presence.OBSERVED:
                finite = int(c["count"][i] - c["nan"][i] - c["pinf"][i] - c["ninf"][i])
                row.update({
                    "count": f"u:{int(c['count'][i])}", "nan": f"u:{int(c['nan'][i])}",
                    "pinf": f"u:{int(c['pinf'][i])}", "ninf": f"u:{int(c['ninf'][i])}",
                    "zero": f"u:{int(c['zero'][i])}",
                    "min": tag_f(c["min"][i]) if finite else None,
                    "max": tag_f(c["max"][i]) if finite else None,
                    # (sums a row states as unknown are no numbers: null, spec 5.4 and 10)
                    "sum": tag_d(s.sum_exact(i)) if known[i] else None,
                    "sumsq": tag_d(s.sumsq_exact(i)) if known[i] else None,
                    "method": SumMethod.NAMES.get(int(c["method"][i]), f"code-{int(c['method'][i])}"),
                    "sketch": _sketch(sk, int(c["sk_row"][i])) if c["sk_row"][i] >= 0 else None,
                })
            out.append(row)
    out.sort(key=lambda r: (int(r["segment"][2:]), int(r["step"][2:]), int(r["span"][2:]),
                            Phase.code(r["phase"]), -1 if r["micro"] == "all" else int(r["micro"][2:]),
                            json.dumps(r, sort_keys=True)))
    return out


def canonical(h: History) -> dict:
    """The canonical JSON object of everything committed in ``h``."""
    sites = []
    for site in sorted(h.sites, key=lambda s: (s.path, s.stream, s.facet is not None, s.facet or "")):
        sites.append({
            "path": site.path, "stream": site.stream, "facet": site.facet,
            "shape": None if site.shape is None else list(site.shape), "dtype": site.dtype,
            "sharing": site.sharing, "cadence": {"spine": site.cadence_spine, "sketch": site.cadence_sketch},
            "sample": site.sample, "order": site.order, "rows": _rows(h, site),
        })
    steps = []
    for r in h.step_truth_rows():
        entry = {
            "segment": f"u:{r['segment']}", "step": f"i:{r['step']}", "span": f"u:{r['span']}",
            "applied": r["applied"],
            "grad_basis": r["grad_basis"], "clipped": r["clipped"],
            "loss_scale": None if r["loss_scale"] is None else tag_f(r["loss_scale"]),
            "clip_threshold": None if r["clip_threshold"] is None else tag_f(r["clip_threshold"]),
            "micro_batches": None if r["micro_batches"] is None else f"u:{r['micro_batches']}",
            "tokens": None if r["tokens"] is None else f"u:{r['tokens']}",
            "samples": None if r["samples"] is None else f"u:{r['samples']}",
        }
        if r["n_rows"] != 1:  # a derived row that combined several writers' rows (spec 11.6)
            entry["n_rows"] = f"u:{r['n_rows']}"
        steps.append(entry)
    steps.sort(key=lambda r: (int(r["segment"][2:]), int(r["step"][2:]), int(r["span"][2:]),
                              json.dumps(r, sort_keys=True)))
    hdr = h.header
    return {
        "format": "trainhist-dump/1",
        "header": None if hdr is None else {
            "read_version": hdr.read_version, "write_version": hdr.write_version,
            "required_features": hdr.required_features, "optional_features": hdr.optional_features,
        },
        "recovery": {
            "status": h.recovery.status, "committed_bytes": f"u:{h.committed_bytes}",
            "dropped_bytes": f"u:{h.recovery.dropped_bytes}",
        },
        "runs": sorted(h.runs, key=lambda d: d["run_id"]),
        "writers": sorted(h.writers, key=lambda d: d["writer_id"]),
        "settings": sorted(h.settings, key=lambda d: json.dumps(d, sort_keys=True)),
        "segments": sorted(
            ({"id": g.id, "first_step": g.first_step, "reason": g.reason, "previous": g.previous,
              "writer_id": g.writer_id, "origin": g.manifest.get("origin")} for g in h.segments),
            key=lambda d: d["id"],
        ),
        "sites": sites,
        "steps": steps,
        "ignored_records": [{"offset": f"u:{o}", "type": t} for o, t in h.ignored_records],
    }


def dumps(h: History) -> str:
    """Canonical JSON text (sorted keys, ASCII, compact, trailing newline)."""
    return json.dumps(canonical(h), sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n"
