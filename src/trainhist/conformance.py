"""Conformance runner: run an implementation (any language, as a command) against conformance/vectors.

    trainhist conformance [--impl "COMMAND"] [--vectors DIR] [--strict] [-k PATTERN]

The contract is conformance/README.md. Without ``--impl`` the reference implementation is run as a subprocess
(``python -m trainhist.conformance_impl``), exactly as a third-party one would be. Files an implementation
produces (write, merge, coarsen) are judged by the reference reader.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CATEGORIES", "OPTIONAL", "Case", "Result", "load_cases", "run_case", "run_suite", "main", "resolve_impl",
           "default_impl", "default_vectors", "error_code", "error_offset", "json_equal", "pointer_tokens"]

CATEGORIES = ("valid", "invalid", "truncated", "forward-compat", "writer", "merge", "coarsen", "presence")
OPTIONAL = frozenset({"writer", "merge", "coarsen", "presence"})
EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_TORN, EXIT_UNSUPPORTED = 0, 1, 2, 3, 4
_CODE = re.compile(r"\[([A-Za-z0-9_.-]+)\]")
_OFFSET = re.compile(r"\boffset ([0-9]+)\b")


@dataclass(frozen=True)
class Case:
    id: str  # "<category>/<name>"
    dir: Path
    doc: dict

    @property
    def category(self) -> str:
        return self.id.split("/", 1)[0]


@dataclass(frozen=True)
class Result:
    case: Case
    status: str  # "pass", "fail", "skip"
    detail: str = ""


def default_impl() -> list[str]:
    """The reference implementation's command line."""
    return [sys.executable, "-m", "trainhist.conformance_impl"]


def default_vectors() -> Path | None:
    """conformance/vectors of the source checkout this package runs from, if there is one."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent / "conformance" / "vectors"
        if cand.is_dir():
            return cand
    return None


def load_cases(vectors: Path, pattern: str | None = None) -> list[Case]:
    """Every ``<category>/<name>/case.json`` under ``vectors``, validated against conformance/case.schema.json."""
    import jsonschema

    schema_path = vectors.parent / "case.schema.json"
    validator = None
    if schema_path.is_file():
        schema = json.loads(schema_path.read_text("utf-8"))
        validator = jsonschema.validators.validator_for(schema)(schema)
    cases = []
    for cat in CATEGORIES:
        d = vectors / cat
        if not d.is_dir():
            continue
        for cdir in sorted(p for p in d.iterdir() if (p / "case.json").is_file()):
            cid = f"{cat}/{cdir.name}"
            if pattern and not (fnmatch.fnmatch(cid, pattern) or pattern in cid):
                continue
            doc = json.loads((cdir / "case.json").read_text("utf-8"))
            if validator is not None:
                err = jsonschema.exceptions.best_match(validator.iter_errors(doc))
                if err is not None:
                    raise ValueError(f"{cid}/case.json does not validate: {err.message}")
            for pointer in doc.get("expect", {}).get("ignore", []):
                try:
                    pointer_tokens(pointer)
                except ValueError as e:
                    raise ValueError(f"{cid}/case.json does not validate: expect.ignore: {e}") from None
            if doc.get("category") != cat:
                raise ValueError(f"{cid}/case.json says category {doc.get('category')!r}")
            cases.append(Case(cid, cdir, doc))
    return cases


def error_code(stderr: str) -> str | None:
    """The first ``[code]`` token of an implementation's stderr."""
    m = _CODE.search(stderr)
    return m.group(1) if m else None


def error_offset(stderr: str, path: str | None = None) -> int | None:
    """The offset an implementation's stderr names: the first ``offset N`` after its first ``[code]`` token (or
    anywhere, without one), once every occurrence of ``path`` (the input file's) is removed."""
    if path:
        stderr = stderr.replace(path, "")
    m = _CODE.search(stderr)
    o = _OFFSET.search(stderr, m.end() if m else 0)
    return int(o.group(1)) if o else None


def json_equal(a: Any, b: Any) -> bool:
    """Equality of parsed JSON values: numbers by value, but booleans are not numbers and null is only null."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def pointer_tokens(pointer: str) -> list[str]:
    """The reference tokens of a JSON pointer (RFC 6901): ``/``-separated after the leading ``/``, each with ``~1``
    read as ``/`` and then ``~0`` as ``~``. Every ``/`` starts a token, a trailing one too: ``/a/`` names the member
    ``""`` of ``/a``, and ``/`` the member ``""`` of the whole document. ``ValueError`` for a pointer that does not
    start with ``/`` (``""``, the whole document, is no pointer a case may ignore) or holds a ``~`` not followed by
    ``0`` or ``1``."""
    if not pointer.startswith("/"):
        raise ValueError(f"JSON pointer {pointer!r} does not start with '/' (RFC 6901)")
    tokens = pointer[1:].split("/")
    for t in tokens:
        if re.search(r"~(?![01])", t):
            raise ValueError(f"JSON pointer {pointer!r}: '~' must be followed by 0 or 1 (RFC 6901)")
    return [t.replace("~1", "/").replace("~0", "~") for t in tokens]


def _mask(doc: Any, patterns: list[str]) -> Any:
    """``doc`` with every member or item that a pattern (JSON pointer; a token ``*`` matches any key or index)
    names replaced by one placeholder."""
    for pat in patterns:
        doc = _mask_one(doc, pointer_tokens(pat))
    return doc


def _mask_one(doc: Any, parts: list[str]) -> Any:
    if not parts:
        return doc
    head, rest = parts[0], parts[1:]
    if isinstance(doc, dict):
        keys = list(doc) if head == "*" else [head] if head in doc else []
        out = dict(doc)
        for k in keys:
            if rest:
                out[k] = _mask_one(doc[k], rest)
            else:
                out[k] = "<ignored>"
        return out
    if isinstance(doc, list):
        index = re.fullmatch(r"0|[1-9][0-9]*", head) is not None  # (RFC 6901: no leading zeros, ASCII digits)
        idx = range(len(doc)) if head == "*" else [int(head)] if index and int(head) < len(doc) else []
        out_l = list(doc)
        for i in idx:
            out_l[i] = _mask_one(doc[i], rest) if rest else "<ignored>"
        return out_l
    return doc


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    """JSON pointer of the first place two values differ, with both sides, for failure messages."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            at = path + "/" + k.replace("~", "~0").replace("/", "~1")  # (RFC 6901)
            if k not in a:
                return f"{at}: missing (expected {json.dumps(b[k])[:80]})"
            if k not in b:
                return f"{at}: unexpected member {json.dumps(a[k])[:80]}"
            if not json_equal(a[k], b[k]):
                return _first_difference(a[k], b[k], at)
    elif isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if not json_equal(x, y):
                return _first_difference(x, y, f"{path}/{i}")
        if len(a) != len(b):
            return f"{path}: {len(a)} items, expected {len(b)}"
    return f"{path or '/'}: got {json.dumps(a)[:80]}, expected {json.dumps(b)[:80]}"


def _reference_dump(path: Path) -> tuple[str, str]:
    """(recovery status, canonical JSON text) of a produced file, by the reference reader (the judge)."""
    from .dump import dumps
    from .reader import open_history

    with open_history(path) as h:
        h.verify()
        return h.recovery.status, dumps(h)


def _commit_ends(data: bytes) -> list[int]:
    """End offsets (after the padding) of the commit records of a file whose framing the reference reader has
    accepted: spec 4.1's record headers walked from the file header on."""
    ends, pos = [], 32
    while pos + 32 <= len(data):
        rtype, _, length = struct.unpack_from("<HHI", data, pos)
        pos += 32 + length + (-length % 8)
        if rtype == 4:  # (commit, spec 4.2)
            ends.append(pos)
    return ends


_DIRECTORY_KEYS = ("site", "segment", "rows", "scale", "cols")


def _writer_rules(data: bytes) -> str | None:
    """None if a file the reference reader accepted keeps the rules of a *writer* that readers do not check (they
    ignore those bytes), else which one it breaks: spec 4.3, a commit entry's reserved field 0, its site
    ``0xFFFFFFFF`` for records other than obs chunks, its segment ``0xFFFFFFFF`` and rows and steps 0 for records
    other than chunks; spec 7.2, a chunk directory's keys in the order of its table and every integer in its
    shortest MessagePack encoding; the values of :func:`_writer_values`."""
    import msgpack

    pos, none = 32, 0xFFFFFFFF
    while pos + 32 <= len(data):
        rtype, _, length = struct.unpack_from("<HHI", data, pos)
        body = data[pos + 32: pos + 32 + length]
        if rtype == 4:
            for i in range(struct.unpack_from("<Q", body, 8)[0]):
                off, etype, reserved, site, seg, rows, lo, hi = struct.unpack_from("<QHHIIIqq", body, 16 + 40 * i)
                want = {"reserved": 0}
                if etype != 2:
                    want["site"] = none
                if etype not in (2, 3):
                    want.update(segment=none, rows=0, smallest=0, largest=0)
                got = {"reserved": reserved, "site": site, "segment": seg, "rows": rows, "smallest": lo, "largest": hi}
                bad = [f"{k} {got[k]}" for k in want if got[k] != want[k]]
                if bad:
                    should = ", ".join(f"{k} {v:#x}" if v else f"{k} 0" for k, v in want.items())
                    return (f"commit at offset {pos}, entry {i} (record type {etype} at offset {off}): "
                            f"{', '.join(bad)}; writers write {should} (spec 4.3)")
        elif rtype in (2, 3) and length >= 4:
            n = struct.unpack_from("<I", body, 0)[0]
            raw = bytes(body[4: 4 + n])
            directory = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            keys = [k for k in directory if k in _DIRECTORY_KEYS]
            if keys != sorted(keys, key=_DIRECTORY_KEYS.index):
                return (f"chunk at offset {pos}: directory keys in the order {keys}; writers write them in the order "
                        f"{list(_DIRECTORY_KEYS)} (spec 7.2)")
            if msgpack.packb(directory, use_bin_type=True) != raw:
                return (f"chunk at offset {pos}: its directory is not in the shortest MessagePack encoding of every "
                        "integer (spec 7.2: writers MUST use it)")
            why = _writer_values(bytes(body), pos, rtype == 2)
            if why:
                return why
        pos += 32 + length + (-length % 8)
    return None


_CANONICAL_NAN = 0x7FF8000000000000


def _writer_values(payload: bytes, pos: int, obs: bool) -> str | None:
    """None if a chunk holds the values writers store where a reader accepts others (spec 2.6, 5.1, 5.3, 5.5,
    2.7), else the first it does not: the canonical NaN as the min and max of a row without finite values and of a
    row that is not observed, +0.0 as a sum of 0 in such rows, the canonical NaN for an unknown loss scale or clip
    threshold."""
    import numpy as np

    from .batchdecode import OBS_KNOWN, OBS_VARIABLE, STEPS_KNOWN
    from .chunk import decode_chunk

    ch = decode_chunk(memoryview(payload), pos, None, OBS_KNOWN if obs else STEPS_KNOWN,
                      OBS_VARIABLE if obs else frozenset())
    needed = ("count", "nan", "pinf", "ninf", "presence", "min", "max", "sum", "sumsq") if obs else (
        "loss_scale", "clip_threshold")
    if not all(ch.has(c) for c in needed):  # (no chunk the reference reader accepted)
        return None

    def bits(name: str) -> np.ndarray:
        return np.asarray(ch.column(name)).view("<u8")

    if obs:
        finite = (np.asarray(ch.column("count"), dtype=object) - np.asarray(ch.column("nan"), dtype=object)
                  - np.asarray(ch.column("pinf"), dtype=object) - np.asarray(ch.column("ninf"), dtype=object))
        empty = (np.asarray(ch.column("presence")) != 1) | (finite == 0)
        for name, want, what in (("min", _CANONICAL_NAN, "the canonical NaN"), ("max", _CANONICAL_NAN,
                                                                                "the canonical NaN"),
                                 ("sum", 0, "+0.0"), ("sumsq", 0, "+0.0")):
            bad = np.flatnonzero(empty & (bits(name) != want))
            if bad.size:
                return (f"chunk at offset {pos}, row {int(bad[0])} (not observed, or no finite value): {name} has the "
                        f"bits {int(bits(name)[bad[0]]):#018x}; writers store {what} there (spec 2.6, 5.1, 5.3)")
        return None
    for name in ("loss_scale", "clip_threshold"):
        b = bits(name)
        bad = np.flatnonzero(((b & 0x7FF0000000000000) == 0x7FF0000000000000) & ((b & 0xFFFFFFFFFFFFF) != 0)
                             & (b != _CANONICAL_NAN))
        if bad.size:
            return (f"steps chunk at offset {pos}, row {int(bad[0])}: {name} is the NaN {int(b[bad[0]]):#018x}; "
                    "writers store the canonical NaN 0x7ff8000000000000 for an unknown value (spec 2.7)")
    return None


def _commit_states(path: Path, ignore: list[str]) -> list[Any]:
    """The readable state (spec 4.3) after each commit of a file: the reference reader's canonical JSON of the file
    cut right after each commit record, without ``/recovery/committed_bytes`` and the ``ignore`` pointers; a state
    equal to the one before it (an empty commit) is listed once."""
    data = path.read_bytes()
    states: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="thist-conf-commits-") as tmp:
        cut = Path(tmp) / "prefix.thist"
        for end in _commit_ends(data):
            cut.write_bytes(data[:end])
            _, text = _reference_dump(cut)
            state = _mask(json.loads(text), ["/recovery/committed_bytes", *ignore])
            if not states or not json_equal(state, states[-1]):
                states.append(state)
    return states


def _compare_commits(out: Path, case: Case) -> str | None:
    """None if ``out`` makes the readable states of the case's expected file commit by commit (the ``commit`` ops
    of a writer-ops document, README section 3), else why not. The final state is compared before this."""
    exp = case.doc["expect"]
    if not exp.get("output"):
        return None
    ignore = exp.get("ignore", [])
    got, want = _commit_states(out, ignore), _commit_states(case.dir / exp["output"], ignore)
    for k, (g, w) in enumerate(zip(got, want), 1):
        if not json_equal(g, w):
            return (f"the readable state after commit {k} differs from {exp['output']}'s at "
                    + _first_difference(g, w) + " (the commit ops are not followed)")
    if len(got) != len(want):
        return (f"its commits make {len(got)} readable states, {exp['output']} {len(want)} (the file cut after each "
                "commit record; the commit ops are not followed)")
    return None


def _compare_dump(text: str, case: Case, strict: bool, also_ignore: tuple[str, ...] = ()) -> str | None:
    """None if ``text`` is the expected canonical JSON of ``case``, else why not."""
    exp = case.doc["expect"]
    want_text = (case.dir / exp["dump"]).read_text("utf-8")
    try:
        full = got = json.loads(text)
    except json.JSONDecodeError as e:
        return f"output is not JSON ({e})"
    except RecursionError:
        return "output is not JSON this runner can read (nested too deep)"
    want = json.loads(want_text)
    ignore = exp.get("ignore", []) + list(also_ignore)
    if ignore:
        got, want = _mask(got, ignore), _mask(want, ignore)
    if not json_equal(got, want):
        return "canonical JSON differs at " + _first_difference(got, want)
    if strict and not exp.get("ignore") and text != want_text:  # (content it may choose: not its bytes either)
        return "canonical JSON is equal as JSON but not byte-identical (spec 10: sorted keys, ASCII, compact, newline)"
    rec = exp.get("recovery")
    if rec is not None:  # (on the output as given: ignore leaves this check alone)
        r = full.get("recovery", {}) if isinstance(full, dict) else {}
        for k in ("committed_bytes", "dropped_bytes"):
            if r.get(k) != f"u:{rec[k]}":
                return f"recovery.{k} is {r.get(k)!r}, expected u:{rec[k]}"
    return None


def _invoke(impl: list[str], args: list[str], timeout: float, cwd: str) -> tuple[int | None, str, str]:
    """Run the command in a process group of its own, stdin empty; past ``timeout`` the whole group is killed, so
    that a wrapper script's children (``./my-thist`` starting ``java``) do not outlive the case."""
    try:
        p = subprocess.Popen(impl + args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=cwd, start_new_session=True)
    except OSError as e:
        return None, "", f"cannot run {shlex.join(impl)}: {e}"
    with p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, 9)  # (the leader is not reaped yet, so its group id names no one else)
            except OSError:
                p.kill()
            try:
                p.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # (a child that left the group holds the pipes: stop reading)
                p.kill()
            return None, "", f"timed out after {timeout:g} s (the command and every process it started were killed)"
    return p.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def run_case(case: Case, impl: list[str], *, strict: bool = False, timeout: float = 120.0) -> Result:
    """Run one case; see conformance/README.md for what passes."""
    doc, exp, a = case.doc, case.doc["expect"], case.doc["args"]
    cmd = doc["command"]
    with tempfile.TemporaryDirectory(prefix="thist-conf-") as tmp:
        out = Path(tmp) / "out.thist"
        if cmd == "read":
            argv = ["read", str(case.dir / a["file"])]
        elif cmd == "write":
            argv = ["write", str(case.dir / a["ops"]), str(out)]
        elif cmd == "merge":
            flags = ["--across-runs"] if a.get("across_runs") else []
            argv = ["merge", *flags, str(out)] + [str(case.dir / f) for f in a["inputs"]]
        elif cmd == "coarsen":
            argv = ["coarsen", str(case.dir / a["input"]), str(out), "--steps", str(a["steps"]),
                    "--bins-per-octave", str(a["bins_per_octave"])]
        elif cmd == "presence":
            argv = ["presence", str(case.dir / a["file"]), str(case.dir / a["query"])]
        else:
            return Result(case, "fail", f"unknown command {cmd!r} in case.json")
        rc, stdout, stderr = _invoke(impl, argv, timeout, tmp)
        if rc is None:
            return Result(case, "fail", stderr)
        if rc == EXIT_UNSUPPORTED and case.category in OPTIONAL:
            return Result(case, "skip", f"{cmd} not supported (exit 4)")
        want = exp["exit"]
        last = stderr.strip().splitlines()[-1][:160] if stderr.strip() else ""
        if rc != want:
            return Result(case, "fail", f"exit {rc}, expected {want}" + (f" ({last})" if last else ""))
        if want == EXIT_INVALID:
            code = error_code(stderr)
            where = error_offset(stderr, argv[1]) if cmd == "read" else None
            if strict and code != exp["error"]:
                return Result(case, "fail", f"error code {code!r}, expected {exp['error']!r}")
            if strict and "offset" in exp and where != exp["offset"]:
                return Result(case, "fail", f"[{code}] at offset {where}, expected offset {exp['offset']}"
                              + (" (no `offset N` on stderr)" if where is None else ""))
            said = ([f"[{code}]"] if code else []) + ([f"offset {where}"] if where is not None else [])
            return Result(case, "pass", " ".join(said))
        if cmd in ("read", "presence"):  # (presence: stdout is the answer document, compared the same way)
            why = _compare_dump(stdout, case, strict)
            return Result(case, "fail" if why else "pass", why or "")
        if not out.is_file():
            return Result(case, "fail", f"exit {rc} but no output file was written")
        try:
            status, text = _reference_dump(out)
        except Exception as e:  # noqa: BLE001 -- any failure to read the output fails the case
            return Result(case, "fail", f"the reference reader refuses the output: {e}")
        if status != "clean":
            return Result(case, "fail", f"output file is not clean (recovery status {status})")
        # a produced file's size is the writer's choice (codec, layout); strict grading compares the bytes, unless
        # the case lets some content differ (`ignore`): a file whose content may differ cannot be byte-identical
        why = _compare_dump(text, case, False, ("/recovery/committed_bytes",))
        if why is None:
            try:
                why = _writer_rules(out.read_bytes())
            except Exception as e:  # noqa: BLE001 -- (bytes the reference reader accepted, read another way)
                why = f"cannot check the writer's rules of the output: {e!r}"
        if why is None and cmd == "write":
            why = _compare_commits(out, case)
        if (strict and exp.get("output") and not exp.get("ignore")
                and out.read_bytes() != (case.dir / exp["output"]).read_bytes()):
            why = f"output file is not byte-identical to {exp['output']}" + (
                " (its canonical JSON agrees)" if why is None else f"; {why}")
        return Result(case, "fail" if why else "pass", why or "")


def run_suite(impl: list[str], vectors: Path, *, strict: bool = False, pattern: str | None = None,
              timeout: float = 120.0, jobs: int = 1, out: Any = None) -> list[Result]:
    """Run every case (``jobs`` at a time), print one line per case in order and a summary line."""
    from concurrent.futures import ThreadPoolExecutor

    out = sys.stdout if out is None else out
    cases = load_cases(vectors, pattern)
    results = []
    width = max((len(c.id) for c in cases), default=10)
    def one(c: Case) -> Result:
        try:
            return run_case(c, impl, strict=strict, timeout=timeout)
        except Exception as e:  # noqa: BLE001 -- (what an implementation gave broke the runner: that case fails)
            return Result(c, "fail", f"the runner could not grade the output: {type(e).__name__}: {e}"[:300])

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        ordered = pool.map(one, cases)
        for case, r in zip(cases, ordered):
            results.append(r)
            spec = ",".join(case.doc.get("spec", []))
            print(f"{r.status.upper():4s}  {case.id:{width}s}  §{spec:8s} {r.detail}".rstrip(), file=out, flush=True)
    n = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skip")}
    print(f"{n['pass']} passed, {n['fail']} failed" + (f", {n['skip']} skipped" if n["skip"] else ""), file=out,
          flush=True)
    return results


def resolve_impl(cmd: list[str]) -> list[str]:
    """``cmd`` with its program as an absolute path, checked once before any case runs: the cases run in
    temporary directories, where a relative path (``./my-thist``) would name nothing. A program that is not
    there or cannot be run is a :class:`~trainhist.errors.UsageError` (``bad_impl``) naming it and the OS error,
    instead of every case failing with it."""
    from .errors import UsageError

    if not cmd:
        raise UsageError("--impl is empty: expected a command line such as './my-thist' or 'java -jar th.jar'",
                         code="bad_impl")
    prog = cmd[0]
    on_path = os.sep not in prog and not (os.altsep and os.altsep in prog)
    found = shutil.which(prog) if on_path else os.path.abspath(prog)
    if found is not None and os.path.isfile(found) and os.access(found, os.X_OK):
        return [found, *cmd[1:]]
    if found is None:
        code, why = errno.ENOENT, "no such program on PATH"
    elif not os.path.exists(found):
        code, why = errno.ENOENT, f"no file {found}"
    elif os.path.isdir(found):
        code, why = errno.EACCES, f"{found} is a directory"
    else:
        code, why = errno.EACCES, f"{found} is not executable: chmod +x it, or give its interpreter"
    raise UsageError(
        f"cannot run the implementation {shlex.join(cmd)}: {OSError(code, os.strerror(code), prog)} ({why}); "
        "expected a command the runner can start: a program on PATH, a path to an executable file (./my-thist), or "
        "an interpreter and its script ('python /abs/my_thist.py': the cases run in an empty temporary directory, "
        "so paths among the arguments must be absolute). No case was run", code="bad_impl")


def main(impl: str | None, vectors: str | None, strict: bool, pattern: str | None = None,
         timeout: float = 120.0, jobs: int | None = None) -> int:
    """The ``trainhist conformance`` command: exit 0 when nothing failed, 1 otherwise, 2 on bad usage."""
    vdir = Path(vectors).resolve() if vectors else default_vectors()  # (the cases run in a temporary directory)
    if vdir is None or not vdir.is_dir():
        print("trainhist: error [usage] no conformance vectors found: pass --vectors DIR (conformance/vectors "
              "of a trainhist checkout)", file=sys.stderr)
        return EXIT_USAGE
    cmd = shlex.split(impl) if impl else default_impl()
    run = resolve_impl(cmd)
    env_note = "" if impl else " (reference implementation)"
    print(f"implementation: {shlex.join(cmd)}{env_note}\nvectors: {os.fspath(vdir)}\n"
          f"grading: {'strict' if strict else 'lenient'}")
    jobs = jobs if jobs else min(8, os.cpu_count() or 1)
    results = run_suite(run, vdir, strict=strict, pattern=pattern, timeout=timeout, jobs=jobs)
    if not results:
        print("trainhist: error [usage] no cases matched", file=sys.stderr)
        return EXIT_USAGE
    return 1 if any(r.status == "fail" for r in results) else 0
