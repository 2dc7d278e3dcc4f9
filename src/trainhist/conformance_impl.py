"""The reference implementation as a conformance-suite command (conformance/README.md).

    python -m trainhist.conformance_impl read FILE
    python -m trainhist.conformance_impl write OPS.json OUT
    python -m trainhist.conformance_impl merge [--across-runs] OUT IN...
    python -m trainhist.conformance_impl coarsen IN OUT --steps N --bins-per-octave K
    python -m trainhist.conformance_impl presence FILE QUERY.json

Exit codes: 0 ok, 3 torn tail recovered (read), 1 invalid input (``[code]`` on stderr), 2 usage, 4 not supported,
70 internal error (a bug: never a verdict on the input).
"""

from __future__ import annotations

import json
import math
import struct
import sys
import traceback
from typing import Any, Callable

import numpy as np

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_TORN, EXIT_UNSUPPORTED, EXIT_INTERNAL = 0, 1, 2, 3, 4, 70

__all__ = ["main", "run_ops", "parse_tagged"]

USAGE = """usage: IMPL read FILE
       IMPL write OPS.json OUT
       IMPL merge [--across-runs] OUT IN...
       IMPL coarsen IN OUT --steps N --bins-per-octave K
       IMPL presence FILE QUERY.json"""


# -- tagged values (spec section 10) ------------------------------------------------------------------------
def parse_tagged(v: Any, kind: str) -> Any:
    """Value of a tagged string ``u:``/``i:``/``f:``/``d:`` of the expected ``kind``; ``None`` stays ``None``."""
    from .dyadic import Dyadic

    if v is None:
        return None
    if not isinstance(v, str) or not v.startswith(kind + ":"):
        raise ValueError(f"expected a {kind}: tagged string, got {v!r}")
    body = v[2:]
    if kind == "u":
        n = int(body)
        if not 0 <= n < 1 << 64:
            raise ValueError(f"{v!r} is not a u64")
        return n
    if kind == "i":
        n = int(body)
        if not -(1 << 63) <= n < 1 << 63:
            raise ValueError(f"{v!r} is not an i64")
        return n
    if kind == "f":
        if len(body) != 16:
            raise ValueError(f"{v!r}: f: takes exactly 16 hex digits")
        return struct.unpack(">d", bytes.fromhex(body))[0]
    if kind == "d":
        m, _, e = body.partition("p")
        d = Dyadic(int(m), int(e))
        if Dyadic.make(d.m, d.e) != d:
            raise ValueError(f"{v!r} is not a canonical dyadic")
        return d
    raise ValueError(kind)


def _bad_ops(message: str) -> Exception:
    """The error of a writer-ops document that breaks a rule of conformance/README.md, section 3: ``write`` exits 1
    with the code ``bad_ops``."""
    from .errors import TrainhistError

    return TrainhistError(message, code="bad_ops")


def _summary(doc: dict) -> Any:
    """A :class:`Summary` from the observed-row shape of the canonical dump; ``sum`` and ``sumsq`` are null exactly
    when ``method`` is ``unknown`` (conformance/README.md, section 3), else the document is refused (``bad_ops``)."""
    from .grid import index_min, nbins
    from .summary import Sketch, Summary, SumMethod

    methods = {name: code for code, name in SumMethod.NAMES.items()}
    method = doc.get("method", "exact")
    if method not in methods:
        raise _bad_ops(f"summary method {method!r} is not one of {', '.join(methods)}")
    nulls = [doc["sum"] is None, doc["sumsq"] is None]
    if nulls != [method == "unknown"] * 2:
        raise _bad_ops(f"a summary's sum and sumsq are null exactly when its method is unknown (spec 5.4: its sums are "
                       f"unknown), not sum {doc['sum']!r} and sumsq {doc['sumsq']!r} with method {method!r}")
    sk = None
    if doc.get("sketch") is not None:
        s = doc["sketch"]
        scale = int(s["scale"])
        lo = index_min(scale)
        sides = []
        for side in ("pos", "neg"):
            arr = np.zeros(nbins(scale), np.uint64)
            for idx, c in s.get(side, {}).items():
                arr[int(idx) - lo] = parse_tagged(c, "u")
            sides.append(arr)
        sk = Sketch(scale, sides[0], sides[1], parse_tagged(s["under_pos"], "u"), parse_tagged(s["under_neg"], "u"),
                    parse_tagged(s["over_pos"], "u"), parse_tagged(s["over_neg"], "u"))
    mn, mx = parse_tagged(doc.get("min"), "f"), parse_tagged(doc.get("max"), "f")
    return Summary(
        count=parse_tagged(doc["count"], "u"), nan=parse_tagged(doc["nan"], "u"), pinf=parse_tagged(doc["pinf"], "u"),
        ninf=parse_tagged(doc["ninf"], "u"), zero=parse_tagged(doc["zero"], "u"),
        min=math.nan if mn is None else mn, max=math.nan if mx is None else mx,
        sum=_sum(doc["sum"]), sumsq=_sum(doc["sumsq"]), sum_method=methods[method], sketch=sk,
    )


def _sum(v: Any) -> Any:
    """A sum of the canonical dump: a ``d:`` dyadic, or null where the row's sums are unknown (spec 5.4: stored as
    zero; :func:`_summary` has checked that the method says so)."""
    from .dyadic import ZERO

    return ZERO if v is None else parse_tagged(v, "d")


def _micro(v: Any) -> int | None:
    return None if v is None or v == "all" else parse_tagged(v, "u")


def run_ops(doc: dict, out: str) -> None:
    """Write the file that the writer-vector document ``doc`` describes (conformance/README.md, "write")."""
    from .writer import HistoryWriter

    if doc.get("format") != "trainhist-writer-ops/1":
        raise _bad_ops(f"unknown ops format {doc.get('format')!r}")
    run, wr = doc["run"], doc["writer"]
    w = HistoryWriter(
        out, run_name=run.get("name"), run_id=run["run_id"], config=run.get("config") or {}, rank=wr["rank"],
        world_size=wr["world_size"], host=wr["host"], codec=doc.get("codec", "raw"), fsync="never",
        commit_every=1 << 62, commit_seconds=math.inf, settings=doc.get("settings"),
        salt=parse_tagged(doc["salt"], "u"), writer_id=wr["writer_id"], created=doc["created"], pid=wr["pid"],
        software=wr.get("software", {}),
    )
    sites: list[Any] = []
    handles: dict[tuple, int] = {}

    def declare(handle: Any) -> None:
        key = (handle.path, handle.stream, handle.facet)
        if key not in handles:
            handles[key] = len(sites)
            sites.append(handle)

    try:
        for i, op in enumerate(doc["ops"]):
            kind = op["op"]
            if kind == "site":
                cad = op.get("cadence", {"spine": 1, "sketch": 1})
                declare(w.site(
                    op["path"], op["stream"], facet=op.get("facet"), shape=op.get("shape"), dtype=op.get("dtype"),
                    sharing=op.get("sharing", "shard"), cadence_spine=cad["spine"], cadence_sketch=cad["sketch"],
                    sample=op.get("sample"), order=op.get("order"),
                ))
            elif kind == "observe":
                site = sites[op["site"]]
                step = parse_tagged(op["step"], "i")
                kw = dict(phase=op.get("phase", "default"), micro=_micro(op.get("micro")))
                if "summary" in op:
                    w.observe(site, step, summary=_summary(op["summary"]), **kw)
                else:
                    vals = np.array([parse_tagged(v, "f") for v in op["values"]], np.float64)
                    w.observe(site, step, vals, sketch=bool(op.get("sketch", True)), **kw)
            elif kind == "mark":
                w.mark(sites[op["site"]], parse_tagged(op["step"], "i"), op["presence"],
                       phase=op.get("phase", "default"), micro=_micro(op.get("micro")))
            elif kind == "scalar":
                w.scalar(op["name"], parse_tagged(op["step"], "i"), parse_tagged(op["value"], "f"))
                declare(w._sites[(op["name"], "scalar", None)])  # (the site scalar() found or declared)
            elif kind == "step_truth":
                tri = {None: None, "unknown": None}
                w.step_truth(
                    parse_tagged(op["step"], "i"),
                    applied={**tri, "applied": True, "skipped": False}[op.get("applied")],
                    grad_basis=tri.get(op.get("grad_basis"), op.get("grad_basis")),
                    clipped={**tri, "clipped": True, "not_clipped": False}[op.get("clipped")],
                    loss_scale=parse_tagged(op.get("loss_scale"), "f"),
                    clip_threshold=parse_tagged(op.get("clip_threshold"), "f"),
                    micro_batches=parse_tagged(op.get("micro_batches"), "u"),
                    tokens=parse_tagged(op.get("tokens"), "u"), samples=parse_tagged(op.get("samples"), "u"),
                )
            elif kind == "commit":
                w.commit()
            elif kind == "new_segment":
                fs = op.get("first_step")
                w.new_segment(None if fs is None else parse_tagged(fs, "i"), reason=op.get("reason", "manual"))
            else:
                raise _bad_ops(f"op {i}: unknown op {kind!r}")
    finally:
        w.close()


# -- commands -------------------------------------------------------------------------------------------------
def _read(args: list[str]) -> int:
    from .dump import dumps
    from .reader import open_history

    if len(args) != 1:
        raise _Usage("read takes exactly one FILE")
    with open_history(args[0]) as h:
        h.verify()
        text = dumps(h)
        status = h.recovery.status
    sys.stdout.write(text)
    return EXIT_TORN if status == "torn" else EXIT_OK


def _write(args: list[str]) -> int:
    if len(args) != 2:
        raise _Usage("write takes OPS.json OUT")
    with open(args[0], encoding="utf-8") as f:
        doc = json.load(f)
    run_ops(doc, args[1])
    return EXIT_OK


def _merge(args: list[str]) -> int:
    flags = [a for a in args if a.startswith("--")]
    paths = [a for a in args if not a.startswith("--")]
    if len(paths) < 2 or set(flags) - {"--across-runs"}:
        raise _Usage("merge takes [--across-runs] OUT IN...")
    from .merge import merge

    merge(paths[1:], paths[0], across_runs="--across-runs" in flags, codec="raw")
    return EXIT_OK


def _coarsen(args: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="IMPL coarsen", add_help=False)
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--bins-per-octave", type=int, required=True)
    try:
        a = p.parse_args(args)
    except SystemExit:
        raise _Usage("coarsen takes IN OUT --steps N --bins-per-octave K") from None
    from .coarsen import coarsen

    coarsen(a.input, a.output, steps=a.steps, bins_per_octave=a.bins_per_octave, codec="raw")
    return EXIT_OK


def _bad_query(message: str) -> Exception:
    """The error of a presence-query document that breaks conformance/README.md, section 5: exit 1, ``bad_query``."""
    from .errors import TrainhistError

    return TrainhistError(message, code="bad_query")


def _presence(args: list[str]) -> int:
    """Answer a presence-query document (conformance/README.md, section 5) with :meth:`History.presence`."""
    from .reader import open_history

    if len(args) != 2:
        raise _Usage("presence takes FILE QUERY.json")
    with open(args[1], encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("format") != "trainhist-presence-query/1":
        raise _bad_query(f"unknown presence-query format {doc.get('format') if isinstance(doc, dict) else doc!r}")
    queries = doc.get("queries")
    if not isinstance(queries, list):
        raise _bad_query("a presence-query document has a list `queries`")
    results = []
    with open_history(args[0]) as h:
        for i, q in enumerate(queries):
            if not isinstance(q, dict) or not isinstance(q.get("path"), str):
                raise _bad_query(f"query {i}: an object with a string `path`, not {q!r:.80}")
            try:
                steps = [parse_tagged(st, "i") for st in q["steps"]]
            except (KeyError, TypeError, ValueError) as e:
                raise _bad_query(f"query {i}: `steps` must be a list of i: tagged strings ({e})") from None
            seg = q.get("segment")
            if seg is not None and (isinstance(seg, bool) or not isinstance(seg, int)):
                raise _bad_query(f"query {i}: `segment` must be an integer or null, not {seg!r}")
            ans = h.presence(q["path"], q.get("stream", "activation"), q.get("facet"), steps=steps,
                             phase=q.get("phase"), segment=seg)
            results.append({f"i:{k}": name for k, name in ans.items()})
    sys.stdout.write(json.dumps({"format": "trainhist-presence/1", "results": results}, sort_keys=True,
                                ensure_ascii=True, separators=(",", ":")) + "\n")
    return EXIT_OK


class _Usage(Exception):
    pass


COMMANDS: dict[str, Callable[[list[str]], int]] = {"read": _read, "write": _write, "merge": _merge,
                                                   "coarsen": _coarsen, "presence": _presence}


def main(argv: list[str] | None = None) -> int:
    from .errors import TrainhistError

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return EXIT_UNSUPPORTED if argv and not argv[0].startswith("-") else EXIT_USAGE
    try:
        return COMMANDS[argv[0]](argv[1:])
    except _Usage as e:
        print(f"error: {e}\n{USAGE}", file=sys.stderr)
        return EXIT_USAGE
    except TrainhistError as e:  # the message starts with "[code]"
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    except FileNotFoundError as e:
        print(f"error: [not_found] {e.filename}: no such file", file=sys.stderr)
        return EXIT_INVALID
    except Exception:  # a bug in the implementation is never a verdict on the input
        traceback.print_exc()
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
