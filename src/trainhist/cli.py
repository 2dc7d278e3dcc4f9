"""The ``trainhist`` command: a thin layer over the library.

Exit codes: 0 ok (clean file), 3 the file (for merge and coarsen: an input) had a torn tail and its committed
prefix was used, 1 invalid or corrupt input (the error code, file and offset go to stderr), 2 bad command-line usage,
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import itertools
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import numpy as np

from . import __version__
from .errors import TrainhistError, UsageError
from .model import Phase
from .reader import History, open_history
from .triage import printable, printable_path as _shown  # (names of the file and paths, for a terminal line)

__all__ = ["main", "EXIT_OK", "EXIT_INVALID", "EXIT_USAGE", "EXIT_TORN", "EXIT_INTERRUPTED"]

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_TORN = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  #: Ctrl-C: the shell's status for a process SIGINT ended (128 + 2)



def int_arg(lo: int, hi: int | None = None, what: str = "a whole number") -> Callable[[str], int]:
    """An argparse type: an integer in ``lo .. hi`` (no upper bound for None), or an error saying what was
    expected (``what``) and what was given."""

    def parse(text: str) -> int:
        try:
            n: int | None = int(text)
        except ValueError:
            n = None
        if n is None or n < lo or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"expected {what} {f'>= {lo}' if hi is None else f'in {lo}..{hi}'}, "
                                             f"got {text!r}")
        return n

    return parse


_count = int_arg(0)  #: a whole number >= 0
_window = int_arg(1, 0xFFFFFFFF, "a whole number of steps")  #: a window width in steps (spec 11.7)


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type)."""
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return x


def _path(text: str) -> str:
    """A file path, not empty (argparse type): an empty one read as '[not_found] : no such file'."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got an empty string ('')")
    return text


def _folder(text: str) -> str:
    """A folder path, not empty (argparse type): an empty one fell back to the default folder unsaid."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder path, got an empty string ('')")
    return text


def _command(text: str) -> str:
    """A command line to run (argparse type): words the shell's rules split (``shlex``), at least one."""
    import shlex

    try:
        words = shlex.split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a command, got {text!r}: {e} (quote as a shell does)") from None
    if not words:
        raise argparse.ArgumentTypeError(f"expected a command, got an empty command ({text!r}); leave --impl out for "
                                         "the reference implementation")
    return text


#: what the library's messages call an argument of merge and coarsen, and the flag that sets it on the command line
_FLAGS = (("replica_divergence='report'", "--report-divergence"), ("workers=1", "--workers 1"))


def _in_flags(e: TrainhistError) -> TrainhistError:
    """``e`` with the library's argument names in its message replaced by the command's flags."""
    message = e.message
    for api, flag in _FLAGS:
        message = message.replace(api, flag)
    if message == e.message:
        return e
    return type(e)(message, code=e.code, path=e.path, offset=e.offset)

def _n(n: int, one: str) -> str:
    """``n`` and its noun, singular for one."""
    return f"{n} {one}{'' if n == 1 else 's'}"


def _torn_note(h: History, done: str) -> None:
    """Say that only the committed prefix of ``h`` (a torn tail) was ``done``: the exit status 3 alone says too
    little."""
    print(f"  note: {_shown(h.path)}: {h.recovery.describe()}; only the committed prefix was {done}")


def _status(h: History) -> int:
    return EXIT_TORN if h.recovery.status == "torn" else EXIT_OK


def _repeated_steps(steps: np.ndarray, segments: np.ndarray, seg_runs: dict[int, tuple[str, ...]]) -> str:
    """What `info` says of steps that more than one segment has step truth for: how many steps (not rows) appear
    in several segments of one run (a resume that went back), and how many in segments of different runs (a merge
    that kept runs apart), or ""."""
    seen: dict[int, set[tuple[int, tuple[str, ...]]]] = {}
    for st, g in set(zip(steps.tolist(), segments.tolist())):
        seen.setdefault(st, set()).add((g, seg_runs.get(g, ())))
    pairs = {st: [(set(a[1]), set(b[1])) for a, b in itertools.combinations(sorted(v), 2)] for st, v in seen.items()}
    again = sum(any(a & b or a == b for a, b in p) for p in pairs.values())  # (segments sharing a run: a resume)
    others = sum(any(not a & b and a != b for a, b in p) for p in pairs.values())
    if not again and not others:
        return ""
    if not others:
        return f" ({again} of them again in a later segment)"
    runs = f"{others} in segments of different runs"
    return f" ({again} of them again in a later segment of their run, {runs})" if again else f" ({runs})"


def _last_step(step: np.ndarray, span: np.ndarray) -> int:
    """The last step rows ``[step, step + span)`` cover, ``max(step + span - 1)``, as a Python integer: a row's end
    may pass the largest i64 (spec 5.5), where int64 arithmetic would wrap around to a negative step."""
    extra = span.astype(np.int64) - 1  # (0 .. 2^32 - 2)
    over = step.astype(np.int64) > np.iinfo(np.int64).max - extra
    if over.any():  # (those rows end past every other row's end)
        return max(int(a) + int(b) for a, b in zip(step[over].tolist(), extra[over].tolist()))
    return int((step.astype(np.int64) + extra).max())


def _every(k: int) -> str:
    """A cadence ``k`` in words: 0 is never (spec 2.2)."""
    return "never" if k == 0 else "every step" if k == 1 else f"every {k} steps"


def _cmd_info(args: argparse.Namespace) -> int:
    with open_history(args.file) as h:
        run = h.run
        print(f"file      {_shown(h.path)} ({h.size} bytes{': an empty file' if h.size == 0 else ''})")
        if h.header is not None:
            print(f"format    read v{h.header.read_version}, write v{h.header.write_version}"
                  + (" (newer writer: read-only)" if h.read_only else ""))
        # info reads the framing and the commits, not the chunks' payloads: "clean" alone would claim every byte
        print(f"state     {'framing ' if h.recovery.status == 'clean' else ''}{h.recovery.describe()}; chunk payloads "
              "not checked (run `trainhist verify` to check every committed byte)")
        if run is None:
            print("run       none: no run manifest was committed")
        else:
            more = "" if len(h.runs) < 2 else f" +{len(h.runs) - 1} more"
            name = "unnamed" if run.get("name") is None else repr(run.get("name"))  # (null: "None" read as a name)
            print(f"run       {name} ({run.get('run_id')}){more}")
        for w in h.writers:
            host = "an unrecorded host" if w.get("host") is None else printable(str(w["host"]))
            print(f"writer    {w['writer_id']} rank {w['rank']}/{w['world_size']} on {host}")
        from .triage import run_label, segment_runs

        seg_runs = segment_runs(h)
        several = len(set(seg_runs.values())) > 1  # (a merge kept several runs' histories apart: name each one's)
        for g in h.segments:
            prev = "" if g.previous is None else f", after segment {g.previous}"
            run_of = f"run {run_label(h, seg_runs[g.id])}, " if several and g.id in seg_runs else ""
            print(f"segment   {g.id}: {run_of}from step {g.first_step} ({g.reason}{prev})")
        steps = h.steps["step"]
        if steps.size:
            span = h.steps["span"]  # (1 for every row of a file that was never coarsened)
            last = _last_step(steps, span)
            what = "with step truth" if (span == 1).all() else "windows with step truth (coarsened)"
            distinct = int(np.unique(steps).size)
            print(f"steps     {distinct} {what}{_repeated_steps(steps, h.steps['segment'], seg_runs)}, "
                  f"{int(steps.min())}..{last}"
                  + (" (the last window runs past the largest step, 2^63 - 1: spec 5.5)" if last >= 1 << 63 else ""))
        chunks = [e for es in h._obs.values() for e in es]  # (from the commit entries: nothing decoded)
        if chunks:
            print(f"rows      {sum(e.rows for e in chunks)} starting at steps {min(e.step_min for e in chunks)}.."
                  f"{max(e.step_max for e in chunks)} (the sites' rows: observations and marks)")
        print(f"sites     {len(h.sites)}")
        by_stream: dict[str, int] = {}
        for s in h.sites:
            by_stream[s.stream] = by_stream.get(s.stream, 0) + 1
        for stream, n in sorted(by_stream.items()):
            print(f"  {stream:16s}{n}")
        if args.sites:
            for s in h.sites:
                facet = "" if s.facet is None else f"[{printable(s.facet)}]"
                shape = list(s.shape) if s.shape else None
                known = " ".join(str(x) for x in (s.dtype, shape, s.sharing) if x is not None)
                print(f"  {printable(s.path)}{facet} {s.stream} {known} cadence: spine {_every(s.cadence_spine)}, "
                      f"sketch {_every(s.cadence_sketch)}")
        return _status(h)


def _cmd_verify(args: argparse.Namespace) -> int:
    with open_history(args.file) as h:
        report = h.verify()
        if args.json:
            print(json.dumps(report, sort_keys=True))
        else:
            print(f"{_shown(h.path)}: {h.recovery.describe()}; {_n(report['chunks'], 'chunk')}, "
                  f"{_n(report['rows'], 'row')}, {_n(report['sites'], 'site')} verified")
        return _status(h)


def _cmd_dump(args: argparse.Namespace) -> int:
    from .dump import dumps

    with open_history(args.file) as h:
        sys.stdout.write(dumps(h))
        return _status(h)


def _cmd_conformance(args: argparse.Namespace) -> int:
    from .conformance import CATEGORIES, default_vectors, load_cases
    from .conformance import main as conformance_main

    if args.vectors and not Path(args.vectors).is_dir():
        found = "a file, not a folder" if os.path.lexists(args.vectors) else "no such folder"
        raise UsageError(f"{found}; --vectors names the folder of the conformance vectors (<category>/<case>/"
                         "case.json): pass conformance/vectors of a trainhist checkout", code="no_vectors",
                         path=args.vectors)
    if args.vectors and not any(
            (c / "case.json").is_file() for cat in CATEGORIES if (Path(args.vectors) / cat).is_dir()
            for c in (Path(args.vectors) / cat).iterdir()):  # (not 'no cases matched': there are none to match)
        raise UsageError(f"no conformance vectors in {args.vectors}: expected folders <category>/<case>/case.json, "
                         f"with categories {', '.join(CATEGORIES)}; pass --vectors conformance/vectors of a trainhist "
                         "checkout", code="no_vectors")
    vectors = Path(args.vectors) if args.vectors else default_vectors()
    if args.k and vectors is not None and not load_cases(vectors.resolve(), args.k):
        import difflib

        ids = sorted(f"{cat}/{c.name}" for cat in CATEGORIES if (vectors / cat).is_dir()
                     for c in (vectors / cat).iterdir() if (c / "case.json").is_file())
        close = difflib.get_close_matches(args.k, ids, 3, 0.5)
        raise UsageError(f"-k {args.k!r} matches no case id of the {len(ids)} in {vectors} (ids are <category>/<case>"
                         f"{f', e.g. {ids[0]}' if ids else ''}; -k takes a glob or a substring of one)"
                         + (f"; closest: {', '.join(close)}" if close else ""), code="no_match")
    return conformance_main(args.impl, args.vectors, args.strict, args.k, args.timeout, args.jobs)


def _print_report(rep, as_json: bool) -> None:
    if as_json:
        print(json.dumps(rep.as_dict(), sort_keys=True))
        return
    torn = [i["path"] for i in rep.inputs if i["status"] != "clean"]
    # (a throughput of inputs under 1 MB is mostly fixed costs, and printed as 0.0 MB/s: the bytes and time instead)
    speed = (f"{rep.bytes_in / max(rep.seconds, 1e-9) / 1e6:.1f} MB/s of input" if rep.bytes_in >= 1e6
             else f"{_n(rep.bytes_in, 'input byte')} in {rep.seconds:.2f} s")
    print(f"{_shown(rep.output)}: {_n(rep.bytes_out, 'byte')}, {_n(rep.sites, 'site')}, {_n(rep.segments, 'segment')}, "
          f"{_n(rep.rows_in, 'row')} in, {_n(rep.rows_out, 'row')} out ({speed})")
    for p in torn:
        print(f"  note: {_shown(p)} had a torn tail; its committed prefix was used")
    for d in rep.divergences:
        files = " vs ".join(map(_shown, d["files"]))
        print(f"  replica divergence: {printable(d['where'])}, step {d['step']}: {files}")
    more = rep.divergences_total - len(rep.divergences)
    if more > 0:  # (the report lists the first ones; --json has divergences_total)
        print(f"  ... and {more} more replica divergence{'' if more == 1 else 's'} "
              f"({len(rep.divergences) + more} in all; the first {len(rep.divergences)} are listed)")
    for note in rep.notes:
        print(f"  note: {printable(note)}")


def _cmd_merge(args: argparse.Namespace) -> int:
    from .merge import merge

    try:
        rep = merge(args.inputs, args.output, across_runs=args.across_runs,
                    replica_divergence="report" if args.report_divergence else "error", codec=args.codec,
                    workers=args.workers or None)
    except TrainhistError as e:
        raise _in_flags(e) from None
    _print_report(rep, args.json)
    return _inputs_status(rep)


def _cmd_coarsen(args: argparse.Namespace) -> int:
    from .coarsen import coarsen

    try:
        rep = coarsen(args.input, args.output, steps=args.steps, bins_per_octave=args.bins_per_octave,
                      replica_divergence="report" if args.report_divergence else "error", codec=args.codec,
                      workers=args.workers or None)
    except TrainhistError as e:
        raise _in_flags(e) from None
    _print_report(rep, args.json)
    return _inputs_status(rep)


def _inputs_status(rep: object) -> int:
    """3 when an input had a torn tail (its committed prefix went in), as the reading commands say of a file."""
    return EXIT_TORN if any(i.get("status") == "torn" for i in rep.inputs) else EXIT_OK  # type: ignore[attr-defined]


def _cmd_triage(args: argparse.Namespace) -> int:
    from .triage import triage

    with open_history(args.file) as h:
        t = triage(h)
        if args.json:  # (every finding, whatever --limit says)
            print(json.dumps({"path": t.path, "recovery": h.recovery.status, "findings": [
                {"kind": f.kind, "step": f.step, "site": f.site, "text": f.text} for f in t.findings]},
                sort_keys=True))
        else:
            print(t.format(limit=args.limit))
        return _status(h)


def _cmd_export(args: argparse.Namespace) -> int:
    from .frames import to_csv, to_parquet

    with open_history(args.file) as h:
        write = to_parquet if args.format == "parquet" else to_csv
        sites = None if args.sites is None else [_as_utf8(x) for x in args.sites]
        for e in write(h, args.output, streams=args.streams, sites=sites, phases=args.phases):
            print(f"{_shown(e.path)}: {_n(e.rows, 'row') if e.table != 'manifests' else 'the manifests'}")
        if h.recovery.status != "clean":  # (as merge and triage say it: the exit status 3 alone says too little)
            _torn_note(h, "exported (its trainhist.recovery metadata says so too)")
        return _status(h)


def _file_stem(parts: list[str]) -> str:
    """A file name stem for a figure of ``parts`` (path, stream, facet, phase): joined by ``.``, every character
    other than ASCII letters, digits, ``.``, ``_`` and ``-`` replaced by ``_``; where that changed a name, a
    checksum of the names follows, so that two names that read the same (``a b``, ``a_b``) get two files."""
    safe = ["".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in x) for x in parts]
    stem = ".".join(safe)
    if safe != parts:
        stem += f"-{zlib.crc32(chr(0).join(parts).encode()):08x}"
    return stem


def _as_utf8(text: str) -> str:
    """A name from the command line as the file holds it (UTF-8, spec 9): in a locale that cannot decode its bytes
    (LC_ALL=C without Python's UTF-8 mode) Python holds them as lone surrogates (PEP 383), and ``--site 層.0``
    matched no site; such bytes are decoded as UTF-8 where they are UTF-8."""
    if text.isascii() or not any("\udc80" <= c <= "\udcff" for c in text):
        return text
    import os

    try:
        return os.fsencode(text).decode("utf-8")
    except (UnicodeError, ValueError):
        return text


def _plot_targets(h: History, args: argparse.Namespace) -> list[tuple[object, str, bool]]:
    """The (site, phase, phase named in the file name) each ``--site`` path asks for, narrowed by ``--stream``,
    ``--facet`` and ``--phase``; a path or filter that selects nothing, or a site whose steps no figure can hold
    (beyond +-2^52, ``undrawable_steps``), is refused, naming what there is."""
    import difflib

    from .figures import _extent

    targets = []
    for path in map(_as_utf8, args.site):
        sites = [s for s in h.sites if s.path == path]
        if not sites:
            close = difflib.get_close_matches(path, sorted({s.path for s in h.sites}), 5)
            raise UsageError(f"no site path {path!r} in this file; closest: {close or 'none'} (trainhist info "
                             f"{h.path} --sites lists them)", code="unknown_site", path=h.path)
        kept = [s for s in sites if (args.stream is None or s.stream == args.stream)
                and (args.facet is None or (s.facet or "") == _as_utf8(args.facet))]
        if not kept:
            own = " without a facet (--facet '')" if args.facet is not None else ""  # (asked for facets: say so)
            there = sorted(f"{s.stream}{own if s.facet is None else ' facet ' + repr(s.facet)}" for s in sites)
            want = " ".join(w for w in (args.stream and f"stream {args.stream!r}",
                                        args.facet is not None and f"facet {args.facet!r}") if w)
            raise UsageError(f"site {path!r} has no {want}: it has {there}", code="unknown_site", path=h.path)
        found = []
        for s in kept:
            rows = h.spine(s.path, s.stream, s.facet, phase="*")
            _extent(rows)  # (steps a figure cannot hold are refused here too, before anything is drawn)
            phases = [Phase.name(int(c)) for c in np.unique(rows.columns["phase"])] or ["default"]
            found += [f"{s.stream} {ph}" for ph in phases]
            if args.phase is not None:
                phases = [args.phase] if args.phase in phases else []
            targets.extend((s, ph, len(phases) > 1 or args.phase is not None) for ph in phases)
        if args.phase is not None and not any(t[0].path == path for t in targets):
            raise UsageError(f"site {path!r} has no rows in phase {args.phase!r}: it has {found}",
                             code="unknown_phase", path=h.path)
    return targets


def _figures_folder(out: Path) -> None:
    """Create the folder ``out`` the figures go to, or refuse it: under a file (``bad_output``), or
    one the file system will not create (``output_unwritable``), saying what to pass instead."""
    folder = out.absolute()
    above = next(p for p in (folder, *folder.parents) if os.path.lexists(p))
    if not above.is_dir():
        raise UsageError(f"{_shown(above)} is a file, not a folder, so -o cannot go there; pass -o a folder path "
                         "(created if missing)", code="bad_output", path=str(out))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrainhistError(f"cannot create the folder for the figures ({e.strerror or e}); pass -o a folder you "
                             "may write to", code="output_unwritable", path=str(out)) from None


def _drawn(folder: Path, draw: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``draw(*args, **kwargs)``: a figure the -o ``folder`` refuses (read-only, full) is ``output_unwritable``,
    saying what to pass (the figures printed before it were written; an error printing their list is not this)."""
    try:
        return draw(*args, **kwargs)
    except OSError as e:
        raise TrainhistError(f"cannot write the figure ({e.strerror or e}); pass -o a folder you may write to",
                             code="output_unwritable", path=str(e.filename or folder)) from None


def _cmd_plot(args: argparse.Namespace) -> int:
    try:
        from .figures import contact_sheet, site_figure, waterfall
        import matplotlib  # noqa: F401 -- (the figures module imports it when drawing)
    except ImportError as e:
        raise UsageError(f"figures need matplotlib: pip install 'trainhist[viz]' ({e})", code="needs_viz") from None
    given = [f"--{k}" for k in ("stream", "facet", "phase") if getattr(args, k) is not None]
    if given and not args.site:  # (the contact sheet was drawn of every site, the filter silently ignored)
        raise UsageError(f"{' and '.join(given)} narrow{'s' if len(given) == 1 else ''} the sites named by --site; "
                         "without --site the contact sheet shows every site: name the sites (trainhist info FILE "
                         "--sites lists them)", code="needs_site")
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {out}: a file is there; the figures go to a folder (a new or an existing one)",
                         code="bad_output")
    with open_history(args.file) as h:
        targets = _plot_targets(h, args) if args.site else []  # (every name is checked before a figure is drawn)
        _figures_folder(out)
        if not args.site:
            for page in _drawn(out, contact_sheet, h, out, per_page=args.per_page):
                print(_shown(page))
        for s, phase, named in targets:
            stem = _file_stem([x for x in (s.path, s.stream, s.facet, phase if named else None) if x is not None])
            for kind, draw in (("site", site_figure), ("waterfall", waterfall)):
                _drawn(out, draw, h, s.path, s.stream, s.facet, phase=phase, out=out / f"{stem}.{kind}.png")
                print(_shown(out / f"{stem}.{kind}.png"))
        if h.recovery.status != "clean":
            _torn_note(h, "drawn")
        return _status(h)


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        from .torch.demo import main as demo_main
    except ImportError as e:
        raise UsageError(f"the demo trains a tiny GPT-2 with torch and transformers: pip install 'trainhist[demo]' "
                         f"({e})", code="needs_torch") from None
    return demo_main(args.rest)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose error for a missing ``file`` argument ends with ``missing_file``: where to put it."""

    def __init__(self, *args: Any, missing_file: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.missing_file = missing_file

    def error(self, message: str) -> NoReturn:
        """Exit 2 with the usage and ``message``, plus the hint for a missing ``file``."""
        required = message.partition("the following arguments are required: ")[2]
        if self.missing_file and "file" in required.split(", "):
            message += f": {self.missing_file}"
        super().error(message)


#: the exit statuses a command's --help ends with (before "130 interrupted")
_FILE = ("3 a torn tail (only the committed prefix was used); 1 the file missing, invalid or corrupt (the error code, "
         "file and offset on stderr)")
_READ = f"0 a clean file; {_FILE}; 2 bad usage"
_TRIAGE = f"0 a clean file, whatever the triage finds; {_FILE}; 2 bad usage"
_WRITE = f"0 a clean file; {_FILE}, or an output that cannot be written; 2 bad usage"
_DERIVE = ("0 done; 3 an input had a torn tail (its committed prefix went in); 1 an input missing, invalid or corrupt "
           "(the error code, file and offset on stderr), or the output cannot be written; 2 bad usage")
_CONFORMANCE = "0 every case passed; 1 a case failed; 2 bad usage, or COMMAND cannot be run (no case ran)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainhist", description="Read, check and convert trainhist history files.")
    p.add_argument("--version", action="version", version=f"trainhist {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, summary: str, exits: str, **kwargs: Any) -> argparse.ArgumentParser:
        """The subcommand ``name``, listed with ``summary``; its --help starts with it and ends with ``exits``."""
        kwargs.setdefault("description", f"{summary[0].upper()}{summary[1:]}.")
        kwargs.setdefault("missing_file", f"name the history FILE (a name that starts with - goes last, after --: "
                          f"trainhist {name} -- -x.thist)")
        return sub.add_parser(name, help=summary, epilog=f"exit status: {exits}; 130 interrupted", **kwargs)

    c = command("info", "summary of a file: run, writers, segments, steps, sites (reads the framing and commits, not "
                "the chunk payloads: `verify` checks those)", _READ)
    c.add_argument("file", type=_path, help="a trainhist history (.thist)")
    c.add_argument("--sites", action="store_true", help="list every site")
    c.set_defaults(func=_cmd_info, subparser=c)
    c = command("verify", "check every committed byte; exit 0 clean, 3 torn tail, 1 corrupt", _READ)
    c.add_argument("file", type=_path, help="a trainhist history (.thist)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=_cmd_verify, subparser=c)
    c = command("dump", "canonical JSON of everything committed (spec section 10)", _READ)
    c.add_argument("file", type=_path, help="a trainhist history (.thist)")
    c.set_defaults(func=_cmd_dump, subparser=c)
    c = command("conformance", "run an implementation against the conformance vectors (conformance/)", _CONFORMANCE)
    c.add_argument("--impl", metavar="COMMAND", type=_command,
                   help="implementation command (default: the reference, as a subprocess)")
    c.add_argument("--vectors", metavar="DIR", type=_folder,
                   help="vector directory (default: conformance/vectors of this checkout)")
    c.add_argument("--strict", action="store_true", help="also require exact error codes and byte-exact outputs")
    c.add_argument("-k", metavar="PATTERN", help="only cases whose id matches (glob or substring)")
    c.add_argument("--timeout", type=_seconds, default=120.0,
                   help="seconds per case before it fails, > 0 (default 120)")
    c.add_argument("-j", "--jobs", type=_count, default=0,
                   help="cases run at once (default 0: the CPU count, at most 8)")
    c.set_defaults(func=_cmd_conformance, subparser=c)
    codec_help = ("how the output's columns are stored (spec 7.3): packed, no decompressor on the read path; shuffle, "
                  "byte shuffle + zlib, smaller, inflated when read; raw, byte-exact for comparisons (default: packed)")
    workers_help = ("worker processes (default 0: one per CPU, up to 8, for inputs of 64 MiB or more; 1: none, "
                    "the merge runs in this process)")
    c = command("merge", "merge shards/ranks/runs into one canonical file (spec section 11)", _DERIVE)
    c.add_argument("inputs", nargs="+", metavar="IN", type=_path, help="histories to merge (any order)")
    c.add_argument("-o", "--output", required=True, metavar="OUT", type=_path,
                   help="the merged history (written beside it, then renamed over it; never one of the inputs)")
    c.add_argument("--across-runs", action="store_true", help="sum segments of different runs (default: keep apart)")
    c.add_argument("--report-divergence", action="store_true",
                   help="keep one of differing replica rows and list them, instead of failing")
    c.add_argument("--codec", choices=("packed", "shuffle", "raw"), default="packed", help=codec_help)
    c.add_argument("--workers", type=_count, default=0, metavar="N", help=workers_help)
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=_cmd_merge, subparser=c)
    c = command("coarsen", "sum rows over step windows and/or halve sketch resolution (spec section 11)", _DERIVE)
    c.add_argument("input", metavar="IN", type=_path, help="the history to coarsen")
    c.add_argument("-o", "--output", required=True, metavar="OUT", type=_path,
                   help="the coarsened history (written beside it, then renamed over it; never the input)")
    c.add_argument("--steps", type=_window, default=1, metavar="N",
                   help=f"window width in steps, 1..{0xFFFFFFFF} (default 1: keep the steps)")
    c.add_argument("--bins-per-octave", type=int, choices=(4, 2, 1), default=4,
                   help="sketch resolution of the output, at most the input's (default 4: keep)")
    c.add_argument("--report-divergence", action="store_true",
                   help="keep one of differing replica rows and list them, instead of failing")
    c.add_argument("--codec", choices=("packed", "shuffle", "raw"), default="packed", help=codec_help)
    c.add_argument("--workers", type=_count, default=0, metavar="N", help=workers_help)
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=_cmd_coarsen, subparser=c)
    c = command("triage", "where and when the history first went wrong (non-finite, failed, skipped)", _TRIAGE)
    c.add_argument("file", type=_path, help="a trainhist history (.thist)")
    c.add_argument("--limit", type=_count, default=12, help="most findings to print (default 12; 0: all)")
    c.add_argument("--json", action="store_true", help="print every finding as JSON (kind, step, site, text)")
    c.set_defaults(func=_cmd_triage, subparser=c)
    c = command("export", "the spines, step truth and scalars as Parquet or CSV tables for pandas (needs pip install "
                "'trainhist[export]')", _WRITE,
                description="The spines, step truth and scalars as Parquet or CSV tables for pandas (needs pip install "
                "'trainhist[export]'). Name FILE before the options, or after --: --streams, --sites and --phases take "
                "every word that follows them (trainhist export run.thist -o out --sites 'enc.*'; or trainhist export "
                "-o out --sites 'enc.*' -- run.thist).",
                missing_file="name FILE before the options, or after --: --streams, --sites and --phases take every "
                "word that follows them (trainhist export run.thist -o out --sites 'enc.*')")
    c.add_argument("file", type=_path, help="a trainhist history (.thist)")
    c.add_argument("-o", "--output", required=True, metavar="OUT", type=_path,
                   help="a directory for spines, steps and scalars (and manifests.json for csv), created if missing "
                   "(its parent folder must exist); a path ending in .parquet or .csv gets the spines alone; another "
                   "suffix is refused (end a directory's name with / when it has a dot)")
    c.add_argument("--format", choices=("parquet", "csv"), default="parquet", help="file format (default parquet)")
    c.add_argument("--streams", nargs="+", metavar="STREAM", help="only these streams (activation, param, ...)")
    c.add_argument("--sites", nargs="+", metavar="PATTERN", help="only sites whose path matches one of these fnmatch "
                   "patterns ('encoder.*'; quote them for the shell; FILE goes before the options or after --)")
    c.add_argument("--phases", nargs="+", metavar="PHASE", help="only rows of these phases (default, pre_clip, "
                   "post_clip)")
    c.set_defaults(func=_cmd_export, subparser=c)
    c = command("plot", "figures as PNG files: a contact sheet of every site, or the quantile fan and the waterfall of "
                "named sites (needs pip install 'trainhist[viz]')", _WRITE,
                missing_file="name the history FILE (a name that starts with - goes last, after --: trainhist plot -o "
                "DIR -- -x.thist)")
    c.add_argument("file", type=_path, help="a trainhist history (.thist)")
    c.add_argument("-o", "--output", required=True, metavar="DIR", type=_path,
                   help="folder for the PNG files (created if missing; files of the same names are replaced)")
    c.add_argument("--site", action="append", metavar="PATH",
                   help="a site path (as trainhist info --sites lists it; repeat for several): its figure and "
                   "waterfall for each of its streams, facets and phases, instead of the contact sheet")
    c.add_argument("--stream", metavar="STREAM", help="with --site: only this stream (activation, param_grad, ...)")
    c.add_argument("--facet", metavar="NAME", help="with --site: only this facet ('' for the site's own tensor)")
    c.add_argument("--phase", choices=Phase.NAMES, help="with --site: only rows of this phase")
    c.add_argument("--per-page", type=int_arg(1, 400, "a number of tiles"), default=24,
                   help="contact sheet tiles per page (default 24)")
    c.set_defaults(func=_cmd_plot, subparser=c)
    c = sub.add_parser("demo", help="train a small built-in model and write, triage and plot its history",
                       add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    c.set_defaults(func=_cmd_demo)
    return p


def _escape(exc: UnicodeError) -> tuple[str | bytes, int]:
    """The error handler of the command's output (``trainhist.escape``): a character the stream's encoding cannot
    hold is written as a backslash escape (``\\xe9``, ``\\u5c64``), as Python writes it to stderr; a lone surrogate
    U+DC80..U+DCFF (a byte of a file name or argument that the locale could not decode, PEP 383) as that byte, so
    that a path is printed as the bytes it was given."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    c = exc.object[exc.start]
    if "\udc80" <= c <= "\udcff":
        return bytes([ord(c) - 0xDC00]), exc.start + 1
    return c.encode("ascii", "backslashreplace").decode("ascii"), exc.start + 1


@contextlib.contextmanager
def _escaping_output() -> Iterator[None]:
    """Let stdout and stderr write any text: a site, run or file name may hold any Unicode (spec 9), and a console
    whose encoding cannot hold it (PYTHONIOENCODING=ascii, LC_ALL=C, a Latin-1 terminal; file names of undecodable
    bytes, which Python holds as lone surrogates, to a UTF-8 one) raised UnicodeEncodeError from print: a traceback
    and exit 1 after half the output. Such characters are written by :func:`_escape`; text the encoding holds is
    unchanged, and JSON output is ASCII already (ensure_ascii). The streams' own handlers are back afterwards: a
    program that calls :func:`main` keeps its streams as they were."""
    codecs.register_error("trainhist.escape", _escape)
    changed = []
    for stream in (sys.stdout, sys.stderr):
        errors = getattr(stream, "errors", None)
        if errors in ("strict", "surrogateescape", "backslashreplace") and callable(
                getattr(stream, "reconfigure", None)):
            try:
                stream.reconfigure(errors="trainhist.escape")
                changed.append((stream, errors))
            except (ValueError, OSError, AttributeError, TypeError):  # (a replaced stream that cannot: leave it)
                pass
    try:
        yield
    finally:
        for stream, errors in changed:
            with contextlib.suppress(ValueError, OSError, AttributeError, TypeError):
                stream.reconfigure(errors=errors)


def _said(e: BaseException) -> str:
    """An error's message for the terminal, on one line: the names and paths in it (any Unicode, from the file or
    the user) with their control characters escaped, as in every report (:func:`~trainhist.triage.printable`); a
    newline in a path was a line break no one could tell from the message's own."""
    return printable(str(e))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    with _escaping_output():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "demo":  # the demo parses its own options
        args.rest = extra + list(args.rest)
    elif extra:  # (the subcommand's usage, not the top level's)
        getattr(args, "subparser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"trainhist: error {_said(e)}", file=sys.stderr)
        return EXIT_USAGE
    except TrainhistError as e:
        print(f"trainhist: error {_said(e)}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        print("trainhist: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of our output went away (`trainhist dump ... | head`): not an error
        return EXIT_OK
    except FileNotFoundError as e:
        print(f"trainhist: error [not_found] {_shown(e.filename)}: no such file", file=sys.stderr)
        return EXIT_INVALID
    except OSError as e:  # permission denied, a directory, disk full: say so, no traceback
        said = printable(str(e.strerror or e))
        if e.filename:
            said = f"{_shown(e.filename)}: {said}"
        elif e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # (no file named, no room: the command's output)
            said = (f"standard output: {said}; the command's output could not be written: send it to a file or pipe "
                    "with room")
        print(f"trainhist: error [io_error] {said}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
