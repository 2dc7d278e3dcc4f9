"""The conformance suite: vectors up to date, case files valid, the reference passes its own suite through the
external-command path, and the runner fails implementations that are wrong."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainhist import conformance as conf
from trainhist.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "conformance" / "vectors"
REFERENCE = f"{sys.executable} -m trainhist.conformance_impl"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainhist.cli", "conformance", *args], capture_output=True,
                          text=True, cwd=ROOT)


def test_vectors_are_up_to_date() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_vectors.py"), "--check"], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


def test_cases_validate_and_are_small() -> None:
    cases = conf.load_cases(VECTORS)  # validates every case.json against case.schema.json
    by_cat = {c: [x for x in cases if x.category == c] for c in conf.CATEGORIES}
    assert all(by_cat.values()), {k: len(v) for k, v in by_cat.items()}
    for c in cases:
        exp = c.doc["expect"]
        for name in [exp.get("dump"), exp.get("output"), *c.doc["args"].get("inputs", []),
                     c.doc["args"].get("file"), c.doc["args"].get("input"), c.doc["args"].get("ops")]:
            assert name is None or (c.dir / name).is_file(), (c.id, name)
        assert all(f.stat().st_size < 16 * 1024 for f in c.dir.iterdir()), c.id
    total = sum(f.stat().st_size for f in VECTORS.rglob("*") if f.is_file())
    assert total < 1536 * 1024  # (about 4.5 KB a case on average: small enough to vendor into another project)
    codes = {x.doc["expect"]["error"] for x in by_cat["invalid"]}
    assert {"bad_magic", "bad_file_header_crc", "unsupported_feature", "bad_record_header", "salt_mismatch",
            "bad_sequence", "bad_payload_crc", "bad_commit", "bad_manifest_json", "bad_manifest", "unknown_column",
            "bad_column_length", "bad_padding", "bad_column_data", "too_many_rows"} <= codes


def test_reference_passes_its_suite_strictly_as_a_subprocess() -> None:
    p = _cli("--impl", REFERENCE, "--strict")
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0, "\n".join(line for line in lines if not line.startswith("PASS")) + p.stderr
    n = len(conf.load_cases(VECTORS))
    assert lines[-1] == f"{n} passed, 0 failed"


BROKEN = """
    import json, os, sys
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd != "read":
        sys.exit(4)                                   # declares write/merge/coarsen unsupported
    data = open(args[0], "rb").read()
    if data[:8] != b"\\x89THIST\\r\\n":
        print("error: [bad_magic] not a history", file=sys.stderr)
        sys.exit(1)
    print(json.dumps({"format": "trainhist-dump/1"}))  # accepts everything else, reads nothing
"""


def test_runner_fails_a_broken_implementation(tmp_path: Path) -> None:
    impl = tmp_path / "broken.py"
    impl.write_text(textwrap.dedent(BROKEN))
    p = _cli("--impl", f"{sys.executable} {impl}")
    assert p.returncode == 1
    lines = p.stdout.strip().splitlines()
    assert any(line.startswith("PASS  invalid/bad_magic ") for line in lines)
    assert any(line.startswith("FAIL  valid/basic ") for line in lines)
    assert any(line.startswith("FAIL  invalid/bad_commit_offset ") and "exit 0, expected 1" in line for line in lines)
    assert any(line.startswith("SKIP  merge/two_ranks ") for line in lines)
    summary = lines[-1]
    cases = conf.load_cases(VECTORS)
    optional = sum(c.category in conf.OPTIONAL for c in cases)
    npass, nfail, nskip = (int(w) for w in summary.replace(",", "").split()[::2])
    assert nskip == optional and nfail > 0 and npass + nfail + nskip == len(cases), summary


DELEGATE = """
    import os, subprocess, sys
    cmd = sys.argv[1:]
    if cmd[0] == "write":                             # same content, another codec: not byte-exact
        import json, tempfile
        doc = json.load(open(cmd[1]))
        doc["codec"] = "shuffle"
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(os.path.abspath(__file__)))  # (tmp_path)
        os.write(fd, json.dumps(doc).encode()); os.close(fd)
        cmd = ["write", tmp, cmd[2]]
    p = subprocess.run([sys.executable, "-m", "trainhist.conformance_impl", *cmd], capture_output=True)
    sys.stdout.buffer.write(p.stdout.replace(b'"format"', b' "format"'))   # JSON-equal, not byte-identical
    sys.stderr.buffer.write(p.stderr.replace(b"[", b"(").replace(b"]", b")"))  # no error code
    sys.exit(p.returncode)
"""


def test_strict_grading_checks_codes_bytes_and_text(tmp_path: Path) -> None:
    impl = tmp_path / "sloppy.py"
    impl.write_text(textwrap.dedent(DELEGATE))
    cmd = [sys.executable, str(impl)]
    cases = {c.id: c for c in conf.load_cases(VECTORS)}
    for cid in ("invalid/bad_magic", "valid/basic", "writer/basic"):
        assert conf.run_case(cases[cid], cmd).status == "pass", cid
        r = conf.run_case(cases[cid], cmd, strict=True)
        assert r.status == "fail", cid
    assert "error code None" in conf.run_case(cases["invalid/bad_magic"], cmd, strict=True).detail
    assert "byte-identical" in conf.run_case(cases["writer/basic"], cmd, strict=True).detail


WRONG_OFFSET = """
    import re, subprocess, sys
    p = subprocess.run([sys.executable, "-m", "trainhist.conformance_impl", *sys.argv[1:]], capture_output=True)
    sys.stdout.buffer.write(p.stdout)
    err = p.stderr.decode()
    if MODE == "shift":                               # the right code, the offset of the record's payload
        err = re.sub(r"offset ([0-9]+)", lambda m: f"offset {int(m.group(1)) + 32}", err, count=1)
    else:                                             # the right code, no offset at all
        err = re.sub(r", offset [0-9]+", "", err)
    sys.stderr.write(err)
    sys.exit(p.returncode)
"""


@pytest.mark.parametrize("mode", ["shift", "none"])
def test_strict_grading_checks_the_offset_of_an_error(tmp_path: Path, mode: str) -> None:
    impl = tmp_path / "where.py"
    impl.write_text(f"MODE = {mode!r}\n" + textwrap.dedent(WRONG_OFFSET))
    cmd = [sys.executable, str(impl)]
    cases = {c.id: c for c in conf.load_cases(VECTORS)}
    for cid in ("invalid/bad_magic", "invalid/bad_commit_site", "invalid/bad_manifest_schema", "invalid/mixed_scale",
                "forward-compat/unknown_required_record"):
        want = cases[cid].doc["expect"]["offset"]
        assert conf.run_case(cases[cid], conf.default_impl(), strict=True).detail.endswith(f" offset {want}"), cid
        assert conf.run_case(cases[cid], cmd).status == "pass", cid  # lenient grading: the exit code only
        r = conf.run_case(cases[cid], cmd, strict=True)
        got = want + 32 if mode == "shift" else None
        assert r.status == "fail" and f"at offset {got}, expected offset {want}" in r.detail, (cid, r.detail)
    assert conf.run_case(cases["valid/basic"], cmd, strict=True).status == "pass"


def test_every_refused_read_states_the_offset_of_spec_8() -> None:
    cases = conf.load_cases(VECTORS)
    refused = [c for c in cases if c.doc["command"] == "read" and c.doc["expect"]["exit"] == 1]
    assert len(refused) >= 97 and all(isinstance(c.doc["expect"].get("offset"), int) for c in refused)
    assert not any("offset" in c.doc["expect"] for c in cases if c not in refused)
    header = {"bad_magic", "bad_file_header_crc", "unsupported_read_version", "unsupported_feature"}
    for c in refused:  # 0 for the file header, else a record's header: past the file header, 8-aligned
        off = c.doc["expect"]["offset"]
        assert off == 0 if c.doc["expect"]["error"] in header else off >= 32 and off % 8 == 0, (c.id, off)


def test_read_failure_message_names_the_difference(tmp_path: Path) -> None:
    impl = tmp_path / "off.py"
    impl.write_text(textwrap.dedent("""
        import subprocess, sys
        p = subprocess.run([sys.executable, "-m", "trainhist.conformance_impl", *sys.argv[1:]], capture_output=True)
        sys.stdout.buffer.write(p.stdout.replace(b'"f:c004000000000000"', b'"f:c004000000000001"'))
        sys.exit(p.returncode)
    """))
    r = conf.run_case(next(c for c in conf.load_cases(VECTORS, "valid/basic")), [sys.executable, str(impl)])
    assert r.status == "fail" and "/sites/0/rows/0/min" in r.detail, r.detail


def test_reference_impl_exit_codes(tmp_path: Path) -> None:
    run = lambda *a: subprocess.run([sys.executable, "-m", "trainhist.conformance_impl", *a],  # noqa: E731
                                    capture_output=True, text=True)
    assert run("frobnicate", "x").returncode == 4
    assert run("read").returncode == 2
    p = run("read", str(VECTORS / "truncated" / "in_commit" / "input.thist"))
    assert p.returncode == 3 and json.loads(p.stdout)["recovery"]["status"] == "torn"
    p = run("read", str(tmp_path / "missing.thist"))
    assert p.returncode == 1 and conf.error_code(p.stderr) == "not_found"


def test_helpers() -> None:
    assert conf.error_code("trainhist: error [bad_commit] f, offset 3: x [other]") == "bad_commit"
    assert conf.error_code("no code here") is None
    assert conf.error_offset("error: [bad_commit] /v/f.thist, offset 1064: entry names offset 8") == 1064
    assert conf.error_offset("offset 3 [bad_chunk] at offset 856") == 856  # the first after the code
    assert conf.error_offset("error: [bad_chunk] /offset 7/f.thist, offset 856: x", "/offset 7/f.thist") == 856
    assert conf.error_offset("error: [bad_chunk] /offset 7/f.thist: x", "/offset 7/f.thist") is None
    assert conf.error_offset("error: [bad_chunk] offsets 12") is None
    assert conf.json_equal({"a": [1, 2.0]}, {"a": [1.0, 2]})
    assert not conf.json_equal(True, 1) and not conf.json_equal(0, None) and not conf.json_equal(0, False)
    assert not conf.json_equal({"a": 1}, {"a": 1, "b": None})
    doc = {"writers": [{"created": "x", "id": 1}, {"created": "y", "id": 2}]}
    assert conf._mask(doc, ["/writers/*/created"]) == {
        "writers": [{"created": "<ignored>", "id": 1}, {"created": "<ignored>", "id": 2}]}


def test_no_vectors_is_a_usage_error(tmp_path: Path) -> None:
    out = io.StringIO()
    assert conf.run_suite(conf.default_impl(), tmp_path, out=out) == []
    assert out.getvalue().strip() == "0 passed, 0 failed"
    assert conf.main(None, str(tmp_path / "nowhere"), False) == conf.EXIT_USAGE


def test_an_implementation_that_cannot_run_stops_before_any_case(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A command that does not exist used to fail every case (195 lines of 'cannot run'); it is one UsageError
    (exit 2) naming the command and the OS error, and no case runs."""
    p = _cli("--impl", "thist-no-such-program --flag")
    assert p.returncode == conf.EXIT_USAGE, p.stdout + p.stderr
    assert "[bad_impl] cannot run the implementation thist-no-such-program --flag: [Errno 2] No such file or " \
           "directory: 'thist-no-such-program' (no such program on PATH)" in p.stderr
    assert "FAIL" not in p.stdout and "passed" not in p.stdout
    script = tmp_path / "my-thist"
    script.write_text("#!/bin/sh\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"\[Errno 13\] Permission denied: './my-thist' \(.* is not executable") as e:
        conf.resolve_impl(["./my-thist"])
    assert e.value.code == "bad_impl"
    script.chmod(0o755)  # a relative path is the caller's, not the cases' temporary directory's
    assert conf.resolve_impl(["./my-thist", "-v"]) == [str(script), "-v"]


@pytest.mark.parametrize("cid", ["writer/basic", "merge/two_ranks", "coarsen/steps2"])
def test_optional_outputs_match_byte_for_byte(cid: str) -> None:
    case = conf.load_cases(VECTORS, cid)[0]
    assert conf.run_case(case, conf.default_impl(), strict=True).status == "pass"


def test_case_schema_takes_the_coarsen_arguments_of_spec_11_7() -> None:
    """bins_per_octave is 4, 2 or 1 and steps 1 ... 2^32 - 1, as conformance/README.md says (the schema took any
    positive integer)."""
    import jsonschema

    schema = json.loads((ROOT / "conformance" / "case.schema.json").read_text("utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    case = conf.load_cases(VECTORS, "coarsen/bins2")[0].doc
    assert validator.is_valid(case)
    for args in ({"bins_per_octave": 3}, {"bins_per_octave": 8}, {"steps": 2**32}, {"steps": 0}):
        assert not validator.is_valid({**case, "args": {**case["args"], **args}}), args


def test_ignore_frees_values_and_bytes_only(tmp_path: Path) -> None:
    """conformance/README.md, `ignore`: the values it names are free (they must still be there), a case with it is
    not compared byte for byte (stdout of a read, a produced file: content that may differ makes bytes that may
    differ; a produced file used to be compared all the same), and nothing else changes: the recovery check of a
    truncated case (it failed on the placeholder when a pointer named a recovery member)."""
    impl = tmp_path / "sloppy.py"
    impl.write_text(textwrap.dedent(DELEGATE))
    sloppy = [sys.executable, str(impl)]
    cases = {c.id: c for c in conf.load_cases(VECTORS)}

    def with_ignore(cid: str, ignore: list[str]) -> conf.Case:
        c = cases[cid]
        return conf.Case(c.id, c.dir, {**c.doc, "expect": {**c.doc["expect"], "ignore": ignore}})

    cut = with_ignore("truncated/in_commit", ["/recovery/committed_bytes", "/recovery/dropped_bytes"])
    assert conf.run_case(cut, conf.default_impl(), strict=True).status == "pass"
    assert conf.run_case(cut, sloppy, strict=True).status == "pass"  # (JSON-equal, not byte-identical: ignored)
    assert conf.run_case(cases["truncated/in_commit"], sloppy, strict=True).status == "fail"
    wrong = tmp_path / "wrong.py"  # a wrong committed_bytes: the recovery check still sees it
    wrong.write_text(textwrap.dedent("""
        import re, subprocess, sys
        p = subprocess.run([sys.executable, "-m", "trainhist.conformance_impl", *sys.argv[1:]], capture_output=True)
        sys.stdout.buffer.write(re.sub(rb'"committed_bytes":"u:[0-9]+"', b'"committed_bytes":"u:8"', p.stdout))
        sys.exit(p.returncode)
    """))
    r = conf.run_case(cut, [sys.executable, str(wrong)])
    assert r.status == "fail" and "recovery.committed_bytes" in r.detail, r.detail
    missing = with_ignore("valid/basic", ["/sites/0/rows/0/nonexistent", "/header/*"])
    assert conf.run_case(missing, conf.default_impl(), strict=True).status == "pass"
    w = with_ignore("writer/basic", ["/sites/*/rows"])
    assert conf.run_case(w, sloppy).status == "pass"
    assert conf.run_case(w, sloppy, strict=True).status == "pass"
    assert "byte-identical" in conf.run_case(cases["writer/basic"], sloppy, strict=True).detail


def test_ignore_pointers_follow_rfc_6901() -> None:
    """A trailing '/' starts a token (the member ""), as RFC 6901 says: the runner dropped it, so `/a/` ignored all
    of `/a`. Indexes have no leading zeros; a pointer without a leading '/' or with a stray '~' is refused."""
    doc = {"a": {"": 1, "b": 2}, "": 3, "l": [1, 2, 3], "x/y": 4, "m~n": 5}
    assert conf.pointer_tokens("/a/") == ["a", ""] and conf.pointer_tokens("/") == [""]
    assert conf._mask(doc, ["/a/"]) == {**doc, "a": {"": "<ignored>", "b": 2}}
    assert conf._mask(doc, ["/"]) == {**doc, "": "<ignored>"}
    assert conf._mask(doc, ["/x~1y", "/m~0n"]) == {**doc, "x/y": "<ignored>", "m~n": "<ignored>"}
    assert conf._mask(doc, ["/l/01"]) == doc and conf._mask(doc, ["/l/1"])["l"] == [1, "<ignored>", 3]
    for bad in ("", "a/b", "/a~2", "/a~"):
        with pytest.raises(ValueError):
            conf.pointer_tokens(bad)
    assert conf._first_difference({"x/y": 1}, {"x/y": 2}) == "/x~1y: got 1, expected 2"
    # case.schema.json refuses exactly the pointers the runner refuses (a token like 01 is valid: it names nothing)
    import jsonschema

    sch = json.loads((ROOT / "conformance" / "case.schema.json").read_text("utf-8"))
    items = jsonschema.Draft202012Validator(sch["properties"]["expect"]["properties"]["ignore"]["items"])
    for pointer in ("/", "//", "/a/", "/x~1y/m~0n", "/l/01", "/l/-", "/*/rows/*", "/caf\u00e9", "", "a/b", "/a~2",
                    "/a~", "~0/a"):
        try:
            conf.pointer_tokens(pointer)
            ok = True
        except ValueError:
            ok = False
        assert items.is_valid(pointer) == ok, pointer


def test_writer_ops_summary_sums_are_null_exactly_when_the_method_is_unknown(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    """conformance/README.md, section 3: a summary's sum and sumsq are null exactly when its method is unknown; the
    reference stored a known zero for null sums with a known method. Any other combination is refused (bad_ops)."""
    from trainhist import conformance_impl as impl

    ops = json.loads((VECTORS / "writer" / "unknown_sums" / "ops.json").read_text("utf-8"))
    at = next(i for i, op in enumerate(ops["ops"]) if "summary" in op)
    unknown = ops["ops"][at]["summary"]
    assert unknown["method"] == "unknown" and unknown["sum"] is None and unknown["sumsq"] is None
    for k, change in enumerate(({"method": "f64_accumulate"}, {"method": "exact"}, {"sum": "d:3p0"},
                                {"sumsq": "d:1p0"}, {"method": "f64_accumulate", "sum": "d:3p0"},
                                {"method": "no_such_method"})):
        doc = json.loads(json.dumps(ops))
        doc["ops"][at]["summary"] = {**unknown, **change}
        path = tmp_path / f"ops{k}.json"
        path.write_text(json.dumps(doc), "utf-8")
        assert impl.main(["write", str(path), str(tmp_path / f"out{k}.thist")]) == impl.EXIT_INVALID, change
        assert conf.error_code(capsys.readouterr().err) == "bad_ops", change
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(ops), "utf-8")
    assert impl.main(["write", str(path), str(tmp_path / "ok.thist")]) == impl.EXIT_OK
    for bad in ({**ops, "format": "trainhist-writer-ops/2"}, {**ops, "ops": [{"op": "frobnicate"}]}):
        path.write_text(json.dumps(bad), "utf-8")
        assert impl.main(["write", str(path), str(tmp_path / "bad.thist")]) == impl.EXIT_INVALID
        assert conf.error_code(capsys.readouterr().err) == "bad_ops"


PRESENCE = """
    import json, subprocess, sys
    cmd = sys.argv[1:]
    if cmd[0] == "presence" and MODE == "unsupported":
        sys.exit(4)
    if cmd[0] == "presence":                          # every asked step unknown, in the canonical form
        doc = json.load(open(cmd[2]))
        results = [{st: "unknown" for st in q["steps"]} for q in doc["queries"]]
        print(json.dumps({"format": "trainhist-presence/1", "results": results}, sort_keys=True,
                         separators=(",", ":")))
        sys.exit(0)
    p = subprocess.run([sys.executable, "-m", "trainhist.conformance_impl", *cmd])
    sys.exit(p.returncode)
"""


@pytest.mark.parametrize("mode", ["unknown", "unsupported"])
def test_presence_cases_fail_a_wrong_answer_and_skip_exit_4(tmp_path: Path, mode: str) -> None:
    """The presence cases (spec 2.6) grade a reader's answers, not only its dump: an implementation that reads every
    (site, step) as unknown fails them; one that declares the command unsupported (exit 4) has them skipped."""
    impl = tmp_path / "presence.py"
    impl.write_text(f"MODE = {mode!r}\n" + textwrap.dedent(PRESENCE))
    cmd = [sys.executable, str(impl)]
    cases = conf.load_cases(VECTORS, "presence/*")
    assert len(cases) >= 6
    for case in cases:
        assert conf.run_case(case, conf.default_impl(), strict=True).status == "pass", case.id
        for strict in (False, True):
            r = conf.run_case(case, cmd, strict=strict)
            if mode == "unsupported":
                assert r.status == "skip" and "exit 4" in r.detail, (case.id, r)
                continue
            if case.doc["expect"]["exit"] == 1:  # (a query the reader refuses: answering it fails)
                assert r.status == "fail" and r.detail.startswith("exit 0, expected 1"), (case.id, r)
                continue
            want = json.loads((case.dir / "expected.json").read_text("utf-8"))["results"]
            if all(v == "unknown" for q in want for v in q.values()):  # (due_without_row, not_recorded)
                assert r.status == "pass", (case.id, r)
            else:
                assert r.status == "fail" and "differs at /results/" in r.detail, (case.id, r)


def test_case_schema_takes_the_presence_arguments() -> None:
    import jsonschema

    schema = json.loads((ROOT / "conformance" / "case.schema.json").read_text("utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    case = conf.load_cases(VECTORS, "presence/marks")[0].doc
    assert validator.is_valid(case)
    assert not validator.is_valid({**case, "args": {"file": "input.thist"}})
    assert not validator.is_valid({**case, "category": "valid"})
    assert not validator.is_valid({**case, "command": "read"})
    refused = conf.load_cases(VECTORS, "presence/phase_ambiguous")[0].doc  # (a refusal: exit 1, a code, no offset)
    assert refused["expect"] == {"exit": 1, "error": "phase_ambiguous"} and validator.is_valid(refused)
    assert not validator.is_valid({**refused, "expect": {**refused["expect"], "offset": 0}})


NO_COMMITS = """
    import json, os, subprocess, sys, tempfile
    cmd = sys.argv[1:]
    if cmd[0] != "write":
        sys.exit(4)
    doc = json.load(open(cmd[1]))
    doc["ops"] = [op for op in doc["ops"] if op["op"] != "commit"]   # commits once, when it closes
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(os.path.abspath(__file__)))  # (tmp_path)
    os.write(fd, json.dumps(doc).encode()); os.close(fd)
    sys.exit(subprocess.run([sys.executable, "-m", "trainhist.conformance_impl", "write", tmp, cmd[2]]).returncode)
"""


def test_writer_cases_check_every_commit(tmp_path: Path) -> None:
    """A writer that ignores the ``commit`` ops and commits only when it closes writes the final content of the
    document, but not its commits (what a reader recovers after a crash): it fails writer/full, which commits
    several times, even under lenient grading."""
    impl = tmp_path / "no_commits.py"
    impl.write_text(textwrap.dedent(NO_COMMITS))
    (case,) = conf.load_cases(VECTORS, "writer/full")
    assert conf.run_case(case, conf.default_impl()).status == "pass"
    r = conf.run_case(case, [sys.executable, str(impl)])
    assert r.status == "fail" and "readable state after commit 1" in r.detail, r


HANGS = """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # (as a wrapper script's java)
    open(PIDFILE, "w").write(str(child.pid))
    time.sleep(120)
"""


def test_a_timed_out_implementation_is_killed_with_its_children(tmp_path: Path) -> None:
    """``--timeout``: a command still running fails the case and is killed with the processes it started, not only
    the one the runner started (a shell wrapper's child would otherwise outlive the run, one per case)."""
    import os
    import time

    pidfile = tmp_path / "child.pid"
    impl = tmp_path / "hangs.py"
    impl.write_text(f"PIDFILE = {str(pidfile)!r}\n" + textwrap.dedent(HANGS))
    (case,) = conf.load_cases(VECTORS, "valid/basic")
    t0 = time.monotonic()
    r = conf.run_case(case, [sys.executable, str(impl)], timeout=3)
    assert r.status == "fail" and "timed out after 3 s" in r.detail, r
    assert time.monotonic() - t0 < 30
    child = int(pidfile.read_text())
    for _ in range(50):  # (killed: gone, or a zombie until its parent's parent reaps it)
        try:
            state = Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        raise AssertionError(f"the implementation's child {child} outlived the case")


def _damaging_writer(rtype: int, damage: str) -> str:
    """A ``write``-only implementation: the reference writer, then ``damage`` (indented code with ``b`` the file's
    bytes, ``pos`` the first record of type ``rtype`` and ``n`` its payload length) applied to its output, whose
    CRCs are then fixed."""
    return """
    import struct, subprocess, sys
    import crc32c
    cmd = sys.argv[1:]
    if cmd[0] != "write":
        sys.exit(4)
    rc = subprocess.run([sys.executable, "-m", "trainhist.conformance_impl", *cmd]).returncode
    b = bytearray(open(cmd[2], "rb").read())
    pos = 32
    while True:
        t, _, n = struct.unpack_from("<HHI", b, pos)
        if t == %d:
            break
        pos += 32 + n + (-n %% 8)
%s
    struct.pack_into("<I", b, pos + 24, crc32c.crc32c(bytes(b[pos + 32: pos + 32 + n])))
    struct.pack_into("<I", b, pos + 28, crc32c.crc32c(bytes(b[pos: pos + 28])))
    open(cmd[2], "wb").write(b)
    sys.exit(rc)
""" % (rtype, damage)


# the first commit: its first entry's reserved field set to 1
RESERVED = _damaging_writer(4, """\
    struct.pack_into("<H", b, pos + 32 + 16 + 10, 1)""")


def test_writer_cases_check_the_bytes_readers_ignore(tmp_path: Path) -> None:
    """A reader ignores a commit entry's reserved field (spec 4.3) and the order and encoding of a chunk
    directory's members (7.2), but a writer MUST write them as the spec says: lenient grading of a produced file
    checks them too, so a writer that sets the reserved field fails with the entry named."""
    impl = tmp_path / "reserved.py"
    impl.write_text(textwrap.dedent(RESERVED))
    (case,) = conf.load_cases(VECTORS, "writer/basic")
    r = conf.run_case(case, [sys.executable, str(impl)])
    assert r.status == "fail" and "entry 0" in r.detail and "reserved 1" in r.detail and "spec 4.3" in r.detail, r

    def chunk(directory: bytes) -> bytes:  # (a file header's worth of bytes, then one obs record: only its layout)
        payload = struct.pack("<I", len(directory)) + directory
        return bytes(32) + struct.pack("<HHI", 2, 0, len(payload)) + bytes(24) + payload

    import struct

    import msgpack

    good = msgpack.packb({"site": 0, "segment": 0, "rows": 1, "cols": []})
    assert conf._writer_rules(chunk(good)) is None
    order = msgpack.packb({"segment": 0, "site": 0, "rows": 1, "cols": []})
    assert "directory keys in the order" in conf._writer_rules(chunk(order))
    long_int = good.replace(b"\xa4rows\x01", b"\xa4rows\xcc\x01")  # (1 as a uint8: not the shortest encoding)
    assert long_int != good and "shortest MessagePack" in conf._writer_rules(chunk(long_int))


def _obs_columns(data: bytes) -> dict[str, bytes]:
    """The raw column blocks of the first obs chunk of a file (spec 4.1, 7.1), for tests of what a vector holds."""
    import struct

    import msgpack

    pos = 32
    while True:
        rtype, _, length = struct.unpack_from("<HHI", data, pos)
        if rtype == 2:
            payload = data[pos + 32: pos + 32 + length]
            n = struct.unpack_from("<I", payload, 0)[0]
            cols = msgpack.unpackb(payload[4: 4 + n])["cols"]
            assert all(codec == 0 for _, _, codec, _, _, _ in cols)
            return {name: payload[off: off + stored] for name, _, _, off, stored, _ in cols}
        pos += 32 + length + (-length % 8)


def test_bad_exact_noncanonical_breaks_only_the_odd_mantissa() -> None:
    """invalid/bad_exact_noncanonical stores a sum as (2m, e - 1): its one defect must be the even mantissa (spec
    5.3), with the mantissa in its fewest bytes; else a reader that checks the length alone (another case) passes it
    without checking that ``m`` is odd."""
    import struct

    cols = _obs_columns((VECTORS / "invalid" / "bad_exact_noncanonical" / "input.thist").read_bytes())
    n = struct.unpack_from("<I", cols["sum_xn"], 0)[0]
    m = int.from_bytes(cols["sum_x"][4:n], "little", signed=True)
    assert m != 0 and m % 2 == 0
    assert n - 4 == ((~m).bit_length() if m < 0 else m.bit_length()) // 8 + 1, "the mantissa is not in its fewest bytes"


def test_reader_checks_of_the_spec_have_a_case() -> None:
    """Checks of the spec that an independent reader could leave out with every earlier case still passing (found by
    disabling each check of a reader written from spec/ alone): each has a case of its own, with its code."""
    want = {"invalid/unknown_phase_code": "unknown_code",  # 2.5
            "invalid/bad_commit_steps_segment": "bad_commit",  # 4.3
            "invalid/missing_sketch_column": "missing_column",  # 7.5
            "invalid/sketch_flag_zero_with_range": "bad_sketch",  # 7.5
            "invalid/raw_stored_differs": "bad_chunk",  # 7.4
            "invalid/rows_not_integer": "bad_chunk",  # 7.2
            "invalid/exact_zero_f64_nonzero": "bad_exact_value",  # 5.3
            "forward-compat/damaged_ignorable_record_padding": "bad_padding",  # 4.1, 4.2
            "valid/method_reserved_code": None,  # 5.4: accepted, dumped code-7
            "valid/dump_order_ties": None,  # 10: orders by content
            "valid/strings_escaped": None}  # 10: escapes, code point order
    cases = {c.id: c for c in conf.load_cases(VECTORS)}
    for cid, code in want.items():
        assert cid in cases, cid
        exp = cases[cid].doc["expect"]
        assert (exp["exit"], exp.get("error")) == ((1, code) if code else (0, None)), cid
        assert conf.run_case(cases[cid], conf.default_impl(), strict=True).status == "pass", cid


def test_output_nested_too_deep_fails_the_case_not_the_runner(tmp_path: Path) -> None:
    """An implementation whose stdout is JSON nested deeper than the runner's parser goes fails its cases; the
    runner grades every other case and prints its summary (it stopped at the first one with a traceback)."""
    impl = tmp_path / "deep.py"
    impl.write_text("print('[' * 100000 + ']' * 100000)\n")
    out = io.StringIO()
    results = conf.run_suite([sys.executable, str(impl)], VECTORS, pattern="valid/b*", out=out)
    assert len(results) >= 2 and all(r.status == "fail" and "nested too deep" in r.detail for r in results), results
    assert out.getvalue().splitlines()[-1] == f"0 passed, {len(results)} failed"


def test_presence_cases_tell_the_rules_of_spec_2_6_apart() -> None:
    """Rules of spec 2.6 a presence implementation could get wrong with every case passing: failed over unknown (the
    one pair of adjacent precedence micro_batch_precedence lacked), a segment's step truth alone recording its steps,
    a spine cadence of 0 (never due)."""
    def answers(cid: str) -> list[dict]:
        return json.loads((VECTORS / "presence" / cid / "expected.json").read_text("utf-8"))["results"]

    query = json.loads((VECTORS / "presence" / "micro_batch_precedence" / "query.json").read_text("utf-8"))
    assert "failed" in answers("micro_batch_precedence")[0].values()
    assert len(query["queries"][0]["steps"]) == 6  # (the sixth step: an unknown and a failed micro-batch row)
    assert answers("micro_batch_precedence")[0]["i:5"] == "failed"
    x1, x0, z = answers("segment_step_truth_alone")
    assert x1 == {"i:1": "unknown", "i:3": "not_scheduled"} and x0 == {"i:1": "not_scheduled", "i:3": "unknown"}
    assert set(z.values()) == {"not_scheduled", "unknown"}


# the steps chunk: its canonical NaNs get payload 1
OTHER_NAN = _damaging_writer(3, """\
    body = bytes(b[pos + 32: pos + 32 + n])
    nan = struct.pack("<Q", 0x7FF8000000000000)
    assert nan in body
    b[pos + 32: pos + 32 + n] = body.replace(nan, struct.pack("<Q", 0x7FF8000000000001))""")


def test_writer_cases_check_the_values_readers_accept_in_place_of_the_written_ones(tmp_path: Path) -> None:
    """A reader takes any NaN as an unknown loss scale (spec 2.7) and any NaN as the min of a row without finite
    values (5.5), but writers store the canonical NaN: a writer storing another NaN fails, with the column named."""
    impl = tmp_path / "other_nan.py"
    impl.write_text(textwrap.dedent(OTHER_NAN))
    (case,) = conf.load_cases(VECTORS, "writer/basic")
    r = conf.run_case(case, [sys.executable, str(impl)])
    assert r.status == "fail" and "loss_scale is the NaN 0x7ff8000000000001" in r.detail, r
    import numpy as np

    nan = struct.pack("<d", float("nan"))
    assert struct.unpack("<Q", nan)[0] == 0x7FF8000000000000
    assert conf._writer_values(_absent_chunk(np.float64(-0.0)), 0, True).endswith("(spec 2.6, 5.1, 5.3)")
    assert conf._writer_values(_absent_chunk(np.float64(0.0)), 0, True) is None


def _absent_chunk(sum_value: float) -> bytes:
    """An obs chunk of one absent row whose sum is ``sum_value`` (readers accept ±0.0 there)."""
    import numpy as np

    from trainhist.chunk import Codec, encode_chunk

    def u8(v: int) -> tuple[str, np.ndarray]:
        return "u8", np.array([v], "<u8")

    def f8(v: float) -> tuple[str, np.ndarray]:
        return "f8", np.array([v], "<f8")
    cols = {"step": ("i8", np.array([0], "<i8")), "span": ("u4", np.array([1], "<u4")),
            "micro": ("u4", np.array([0xFFFFFFFF], "<u4")), "phase": ("u1", np.array([0], "u1")),
            "presence": ("u1", np.array([2], "u1")), "method": ("u1", np.array([0], "u1")),
            "count": u8(0), "nan": u8(0), "pinf": u8(0), "ninf": u8(0), "zero": u8(0),
            "min": f8(np.nan), "max": f8(np.nan), "sum": f8(sum_value), "sumsq": f8(0.0)}
    return encode_chunk({"site": 0, "segment": 0, "rows": 1}, cols, Codec.RAW)


def test_reference_writer_runs_a_scalar_op_on_a_replica_scalar_site(tmp_path) -> None:
    """A writer vector that declares a scalar site with sharing 'replica' and then records it with a scalar op: the
    reference implementation looked the site up by declaring it again with the default sharing, which the site
    re-declaration check refuses (site_redeclared)."""
    import trainhist
    from trainhist.conformance_impl import run_ops

    doc = json.loads((Path(__file__).resolve().parent.parent / "conformance/vectors/writer/full/ops.json").read_text())
    doc["ops"] = [{"op": "site", "path": "lr", "stream": "scalar", "facet": None, "shape": None, "dtype": None,
                   "sharing": "replica", "sample": None, "cadence": {"spine": 1, "sketch": 0}},
                  {"op": "scalar", "name": "lr", "step": "i:0", "value": "f:3fe0000000000000"}, {"op": "commit"}]
    run_ops(doc, str(tmp_path / "o.thist"))
    with trainhist.open(tmp_path / "o.thist") as h:
        assert [s.sharing for s in h.sites] == ["replica"]
        assert h.spine("lr", "scalar").columns["max"].tolist() == [0.5]
