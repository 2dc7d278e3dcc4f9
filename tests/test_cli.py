"""The command line: what it says of a file, and how it names what went wrong (flags, not API parameters)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import trainhist
from trainhist.cli import main
from trainhist.framing import RECORD_HEADER_SIZE


def _history(path, steps: int = 4):
    with trainhist.HistoryWriter(path, run_name="cli") as w:
        a = w.site("h.0", "activation")
        for st in range(steps):
            w.observe(a, st, np.arange(1.0, 9.0) * (st + 1))
            w.step_truth(st, applied=True)
    return path


def test_info_does_not_call_a_file_with_a_damaged_payload_clean(tmp_path, capsys) -> None:
    """info reads the framing and the commits, not the chunk payloads: on a file with a flipped payload byte
    (verify: bad_payload_crc, exit 1) it printed 'state clean' and exited 0. It still exits 0 (its exit codes are
    those of reading), but says that the payloads were not checked and what checks them."""
    p = _history(tmp_path / "f.thist")
    with trainhist.open(p) as h:
        e = next(e for es in h._obs.values() for e in es)
    data = bytearray(p.read_bytes())
    data[e.offset + RECORD_HEADER_SIZE + e.length - 1] ^= 0xFF  # (the chunk's last payload byte)
    p.write_bytes(bytes(data))
    assert main(["verify", str(p)]) == 1
    assert "[bad_payload_crc]" in capsys.readouterr().err
    assert main(["info", str(p)]) == 0
    state = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("state"))
    assert not state.split()[1].startswith("clean")
    assert "framing clean" in state and "payloads not checked" in state and "trainhist verify" in state


def test_info_of_an_empty_file_says_so(tmp_path, capsys) -> None:
    """A 0-byte file showed `run None (None)`."""
    p = tmp_path / "e.thist"
    p.write_bytes(b"")
    assert main(["info", str(p)]) == 3
    out = capsys.readouterr().out
    assert "None" not in out and "(0 bytes: an empty file)" in out and "no run manifest" in out


def _replicas(tmp_path):
    """Two ranks' shards of one run whose replica parameter differs at step 1."""
    paths = []
    for rank in range(2):
        p = tmp_path / f"r{rank}.thist"
        with trainhist.HistoryWriter(p, run_id="ab" * 16, rank=rank, world_size=2) as w:
            s = w.site("w", "param", sharing="replica")
            for st in range(2):
                w.observe(s, st, np.ones(4) * (2.0 if rank and st else 1.0))
        paths.append(str(p))
    return paths


def test_cli_errors_name_the_flags_not_the_api_parameters(tmp_path, capsys) -> None:
    """`coarsen --steps 0` said 'steps must be an integer in 1..4294967295' ([usage], the API's parameter); merge's
    replica divergence said "pass replica_divergence='report'", which the command line spells --report-divergence."""
    import pytest

    p = _history(tmp_path / "f.thist")
    for steps in ("0", "-1", str(2**32), "x"):
        with pytest.raises(SystemExit) as e:
            main(["coarsen", str(p), "-o", str(tmp_path / "c.thist"), "--steps", steps])
        assert e.value.code == 2
        assert "argument --steps: expected a whole number of steps in 1..4294967295" in capsys.readouterr().err
    assert not (tmp_path / "c.thist").exists()
    out = str(tmp_path / "m.thist")
    assert main(["merge", "-o", out, *_replicas(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "[replica_divergence]" in err and "pass --report-divergence" in err and "replica_divergence=" not in err
    assert main(["merge", "-o", out, "--report-divergence", "--workers", "1", *_replicas(tmp_path)]) == 0
    assert "replica divergence: " in capsys.readouterr().out


def test_cli_refuses_bad_conformance_options_and_says_when_a_folder_holds_no_vectors(tmp_path, capsys) -> None:
    """`conformance --timeout -1` and `-j -2` were accepted; `--vectors EMPTYDIR` said 'no cases matched' (as if a
    -k pattern had matched nothing)."""
    import pytest

    for opts, flag in ((["--timeout", "-1"], "--timeout"), (["--timeout", "0"], "--timeout"),
                       (["-j", "-2"], "-j/--jobs")):
        with pytest.raises(SystemExit) as e:
            main(["conformance", *opts])
        assert e.value.code == 2 and f"argument {flag}: expected" in capsys.readouterr().err
    empty = tmp_path / "vectors"
    empty.mkdir()
    assert main(["conformance", "--vectors", str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"no conformance vectors in {empty}" in err and "no cases matched" not in err


def test_cli_usage_errors_are_the_subcommands(tmp_path, capsys) -> None:
    """`info FILE extra` printed the top-level usage; `info ""` said '[not_found] : no such file'."""
    import pytest

    p = _history(tmp_path / "f.thist")
    for argv, want in ((["info", str(p), "extra"], "unrecognized arguments: extra"),
                       (["info", ""], "expected a file path, got an empty string"),
                       (["triage", ""], "expected a file path, got an empty string")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"usage: trainhist {argv[0]} ") and want in err, err


def test_merge_report_of_small_inputs_gives_bytes_and_time_not_zero_throughput(tmp_path, capsys) -> None:
    """A merge of small inputs printed '(0.0 MB/s)': a rate rounded to zero, read as 'nothing moved'."""
    a, b = _replicas(tmp_path)
    out = tmp_path / "m.thist"
    assert main(["coarsen", a, "-o", str(out)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    size = (tmp_path / "r0.thist").stat().st_size
    assert "MB/s" not in line and f"({size} input bytes in " in line and " 1 site, 1 segment, 2 rows in" in line


def _cadence_shard(path, cadence: int, writer: str, steps: int = 12):
    """One shard of run '11..1' recording `x` every ``cadence`` steps, with step truth at every step."""
    with trainhist.HistoryWriter(path, run_id="1" * 32, writer_id=writer, fsync="never") as w:
        s = w.site("x", "activation", cadence_spine=cadence, cadence_sketch=cadence)
        for st in range(steps):
            if st % cadence == 0:
                w.observe(s, st, np.array([1.0, 2.0]))
            w.step_truth(st, applied=True)
    return str(path)


def test_merge_of_inputs_coarsened_to_a_multiple_of_their_cadences_does_not_advise_coarsening(tmp_path, capsys):
    """Inputs at cadences 2 and 3, both coarsened by 6 (their lcm), merged: every step reads observed, yet the
    report said `unplanned_steps_due` and the note advised coarsening the inputs to a multiple of every cadence,
    which they were. The inputs' windows are taken into account now; uncoarsened inputs still get the advice."""
    a, b = _cadence_shard(tmp_path / "a.th", 2, "b" * 32), _cadence_shard(tmp_path / "b.th", 3, "c" * 32)
    ac, bc = str(tmp_path / "a6.th"), str(tmp_path / "b6.th")
    trainhist.coarsen(a, ac, steps=6)
    trainhist.coarsen(b, bc, steps=6)
    rep = trainhist.merge([ac, bc], tmp_path / "m6.th")
    [cm] = rep.cadence_mismatches
    assert cm["merged"]["spine"] == 1 and cm["unplanned_steps_due"] is False
    [note] = rep.notes
    assert "coarsen the inputs" not in note and "coarsened windows (6 steps)" in note
    with trainhist.open(tmp_path / "m6.th") as h:
        assert set(h.presence("x", steps=range(12)).values()) == {"observed"}
    assert main(["merge", ac, bc, "-o", str(tmp_path / "m6cli.th")]) == 0
    assert "coarsen the inputs" not in capsys.readouterr().out
    # (windows narrower than an input's cadence, and rows of one step, leave steps no input planned: still said)
    a4 = str(tmp_path / "a4.th")
    trainhist.coarsen(_cadence_shard(tmp_path / "a8.th", 8, "d" * 32), a4, steps=4)
    rep = trainhist.merge([a4, _cadence_shard(tmp_path / "b12.th", 12, "e" * 32)], tmp_path / "m4.th")
    assert [c["unplanned_steps_due"] for c in rep.cadence_mismatches] == [True]
    rep = trainhist.merge([a, b], tmp_path / "m.th")
    assert [c["unplanned_steps_due"] for c in rep.cadence_mismatches] == [True]
    assert "coarsen the inputs to a multiple of every cadence first (6 steps, say)" in rep.notes[0]
    # (one input coarsened to its cadence, the other not: the first window ending before the second's steps, or
    # another run's segment, leaves steps no input covering them planned; it said no such step, read unknown)
    a4 = str(tmp_path / "a2by4.th")
    trainhist.coarsen(a, a4, steps=4)
    rep = trainhist.merge([a4, b], tmp_path / "m24.th")
    assert [c["unplanned_steps_due"] for c in rep.cadence_mismatches] == [True]


def test_info_names_each_segments_run_and_counts_steps_not_replays(tmp_path, capsys) -> None:
    """Two runs merged apart (no --across-runs): info printed 'segment 1: from step 0 (start)' without the run and
    '20 of them again in a later segment', which reads as a replay. Each segment names its run now, and the steps
    both runs recorded are counted as such; a resumed run that went back still counts its steps seen again."""
    from history_helpers import two_runs

    paths = [str(p) for p in two_runs(tmp_path)]
    trainhist.merge(paths, tmp_path / "ab.thist")
    assert main(["info", str(tmp_path / "ab.thist")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "segment   0: run 'runA' [aaaaaaaa], from step 0 (start)" in out
    assert "segment   1: run 'runB' [bbbbbbbb], from step 0 (start)" in out
    [steps] = [ln for ln in out if ln.startswith("steps")]
    assert "(20 in segments of different runs)" in steps and "again" not in steps
    assert main(["info", paths[0]]) == 0  # (one run: no run named on its segment line)
    assert "segment   0: from step 0 (start)" in capsys.readouterr().out.splitlines()


def test_info_gives_the_last_step_of_a_window_past_the_largest_i64(tmp_path, capsys) -> None:
    """Step truth at 2**63 - 1 coarsened by 100: a window from 2**63 - 8 of 100 steps, valid (spec 5.5: a row's
    end may pass the largest i64). info printed its last step as int64 step + span - 1, wrapped around to
    -9223372036854775717; it is 2**63 + 91, said to lie past the largest step."""
    p = tmp_path / "top.thist"
    with trainhist.HistoryWriter(p, fsync="never") as w:
        w.step_truth(2**63 - 1, applied=True)
        w.step_truth(2**63 - 300, applied=True)
    trainhist.coarsen(p, tmp_path / "c.thist", steps=100)
    assert main(["info", str(tmp_path / "c.thist")]) == 0
    steps = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("steps"))
    assert f"{2**63 - 308}..{2**63 + 91} (the last window runs past the largest step, 2^63 - 1" in steps
    assert main(["info", str(p)]) == 0  # (no window past it: no note)
    steps = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("steps"))
    assert steps.endswith(f"{2**63 - 300}..{2**63 - 1}")


def test_last_step_of_rows_is_a_python_integer() -> None:
    from trainhist.cli import _last_step

    big = np.iinfo(np.int64).max
    step = np.array([big - 9, -(2**63), 5, big], np.int64)
    span = np.array([100, 2**32 - 1, 1, 1], np.uint32)
    assert _last_step(step, span) == big + 90
    assert _last_step(step[1:3], span[1:3]) == 5
    assert _last_step(step[3:], span[3:]) == big


# --- names of any Unicode to a console that cannot write them -------------------------------------------------------

_ENVS = {"PYTHONIOENCODING=ascii": {"PYTHONIOENCODING": "ascii"},
         "LC_ALL=C": {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
                      "PYTHONIOENCODING": ""}}  # (no UTF-8 mode nor coercion: the C locale's own ASCII)


def _unicode_history(path):
    with trainhist.HistoryWriter(path, run_name="é-run 層", host="hôst", config={"nöte": "ü"}) as w:
        a = w.site("層.0", "activation")
        b = w.site("é", "activation", facet="fé")
        for st in range(4):
            w.observe(a, st, np.array([1.0, np.nan if st == 2 else 2.0], np.float32))
            w.observe(b, st, np.array([1.0, 3.0], np.float32))
        w.mark(a, 4, "failed")
    return path


def _run_cli(args: list[str], env: dict[str, str], cwd) -> tuple[int, str, str]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    full = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "PYTHONIOENCODING", "PYTHONUTF8"))}
    src = str(Path(trainhist.__file__).resolve().parents[1])  # (the package under test, not an installed one)
    full.update(env, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, "-c", "import sys; from trainhist.cli import main; sys.exit(main())", *args],
                       cwd=cwd, env=full, capture_output=True, timeout=300)
    return r.returncode, r.stdout.decode("utf-8"), r.stderr.decode("utf-8")


@pytest.mark.parametrize("env", sorted(_ENVS))
def test_non_ascii_names_print_escaped_to_an_ascii_console(tmp_path, env) -> None:
    """Site, run, host and file names of any Unicode (spec 9) to a stdout that holds ASCII alone, piped: info,
    triage and the merge and coarsen reports raised UnicodeEncodeError (a traceback, exit 1, after half the
    output). Every command now writes such characters as backslash escapes and exits with its normal code; a file
    name given in the C locale (its bytes not decoded: PEP 383) is written back as those bytes. JSON stays valid
    JSON (ensure_ascii) that reads back the names."""
    import json

    _unicode_history(tmp_path / "ä.thist")
    e = _ENVS[env]
    ascii_io = "ascii" in env.lower()

    def path(text: str) -> str:  # (how a path from the command line comes back)
        return text.encode("ascii", "backslashreplace").decode() if ascii_io else text

    cases = [  # (arguments, exit code, what stdout or stderr holds)
        (["info", "ä.thist", "--sites"], 0, [f"file      {path('ä.thist')} (", "run       '\\xe9-run \\u5c64'",
                                             "on h\\xf4st", "  \\u5c64.0 activation", "\\xe9[f\\xe9] activation"]),
        (["triage", "ä.thist"], 0, [f"triage of {path('ä.thist')}", "`\\u5c64.0` forward (activation) at step 2"]),
        (["verify", "ä.thist"], 0, [f"{path('ä.thist')}: clean"]),
        (["merge", "ä.thist", "-o", "mж.thist"], 0, [f"{path('mж.thist')}: "]),
        (["coarsen", "ä.thist", "-o", "cж.thist", "--steps", "2"], 0, [f"{path('cж.thist')}: "]),
        (["info", "nöж.thist"], 1, ["[not_found] n"]),
        (["plot", "ä.thist", "-o", "png", "--site", "nöж"], 2, ["[unknown_site]", "no site path 'n"]),
        # (a name given in the C locale, its bytes not decoded, still names the site: as UTF-8, as the file has it)
        (["plot", "ä.thist", "-o", "pngж", "--site", "é", "--facet", "fé"], 0,
         [f"{path('pngж')}/_.activation.f_-1f64fc1f.site.png", f"{path('pngж')}/_.activation.f_-1f64fc1f.waterfall"]),
        (["export", "ä.thist", "-o", "csvж", "--format", "csv", "--sites", "層*"], 0,
         [f"{path('csvж')}/spines.csv: 5 rows"]),
    ]
    for args, code, said in cases:
        rc, out, err = _run_cli(args, e, tmp_path)
        assert "Traceback" not in err and rc == code, (args, rc, err)
        for text in said:
            assert text in out + err, (args, out, err)
        assert set(c for c in out + err if not c.isascii()) <= set("äжö"), (args, out, err)  # (only paths' bytes)
    rc, out, err = _run_cli(["dump", "ä.thist"], e, tmp_path)
    assert rc == 0 and "Traceback" not in err and out.isascii()
    assert "層.0" in json.dumps(json.loads(out), ensure_ascii=False)
    rc, out, err = _run_cli(["triage", "ä.thist", "--json"], e, tmp_path)
    assert rc == 0 and out.isascii() and {f["site"] for f in json.loads(out)["findings"]} >= {"層.0"}
    rc, out, err = _run_cli(["merge", "ä.thist", "-o", "m2.thist", "--json"], e, tmp_path)
    assert rc == 0 and out.isascii() and json.loads(out)["output"] == "m2.thist"


def test_conformance_report_prints_to_an_ascii_console(tmp_path) -> None:
    """The conformance report marks each case's spec sections with '§': to an ASCII stdout the first case raised
    UnicodeEncodeError (exit 1), whatever the names. It is written as an escape now, and the run exits 0."""
    from pathlib import Path

    vectors = Path(__file__).resolve().parents[1] / "conformance" / "vectors"
    if not (vectors / "merge" / "overflow_not_kept").is_dir():
        pytest.skip("no conformance vectors in this checkout")
    rc, out, err = _run_cli(["conformance", "--vectors", str(vectors), "-k", "merge/overflow_not_kept", "-j", "1"],
                            _ENVS["PYTHONIOENCODING=ascii"], tmp_path)
    assert rc == 0 and "Traceback" not in err, err
    assert "PASS  merge/overflow_not_kept  \\xa7" in out and "1 passed, 0 failed" in out


def test_plot_refuses_filters_without_site(tmp_path, capsys) -> None:
    """`plot FILE -o DIR --stream param` drew the contact sheet of every site, the filter silently ignored (its help
    says: with --site). It is refused (exit 2), saying what the filters narrow, and nothing is drawn."""
    p = _history(tmp_path / "f.thist")
    for flags in (["--stream", "param"], ["--facet", ""], ["--phase", "pre_clip", "--stream", "activation"]):
        assert main(["plot", str(p), "-o", str(tmp_path / "png"), *flags]) == 2
        err = capsys.readouterr().err
        assert "[needs_site]" in err and "narrow" in err and "without --site the contact sheet shows every site" in err
    assert not (tmp_path / "png").exists()


def test_plot_refuses_a_site_beyond_2_52_before_drawing_any(tmp_path, capsys) -> None:
    """`plot --site a --site z`, z with a step past 2^52: a's figures were written, then z's refusal; every named
    site is now checked before anything is drawn, as the guide says (exit 2, undrawable_steps, no folder)."""
    p = tmp_path / "far.thist"
    with trainhist.HistoryWriter(p) as w:
        w.observe(w.site("a", "activation"), 1, np.ones(3))
        w.observe(w.site("z", "activation"), 2**53, np.ones(3))
    assert main(["plot", str(p), "-o", str(tmp_path / "png"), "--site", "a", "--site", "z"]) == 2
    err = capsys.readouterr().err
    assert "[undrawable_steps]" in err and "z:" in err
    assert not (tmp_path / "png").exists()


def test_info_of_an_unnamed_run_on_an_unrecorded_host_prints_no_none(tmp_path, capsys, monkeypatch) -> None:
    """A run manifest's name and a writer manifest's host may be null (their schemas): info printed `run None
    (…)` and `on None`, as if None were their names."""
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: None)  # (the writer records null for an unknown host)
    p = tmp_path / "u.thist"
    with trainhist.HistoryWriter(p) as w:
        w.observe(w.site("a", "activation"), 0, np.arange(3.0))
    with trainhist.open(p) as h:
        assert h.runs[0].get("name") is None and h.writers[0]["host"] is None
    assert main(["info", str(p)]) == 0
    out = capsys.readouterr().out
    assert "None" not in out and "run       unnamed (" in out and " on an unrecorded host" in out


def test_names_with_control_characters_cannot_split_or_rewrite_a_report(tmp_path, capsys) -> None:
    """A site name is any Unicode (spec 9): one holding ESC sequences or a newline was printed raw by info --sites
    and triage, recoloring the user's terminal (or rewriting what it shows) and splitting a finding over two lines.
    Such characters are printed as escapes; JSON keeps the names as they are."""
    import json

    name = "enc\x1b[31m.0\nFAKE"
    p = tmp_path / "c.thist"
    with trainhist.HistoryWriter(p, run_name="r") as w:
        a = w.site(name, "activation", facet="f\x07")
        w.observe(a, 0, np.array([1.0, np.nan]))
    assert main(["info", str(p), "--sites"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "  enc\\x1b[31m.0\\nFAKE[f\\x07] activation" in out
    assert main(["triage", str(p)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and not any(ln.startswith("FAKE") for ln in out.splitlines())
    assert "`enc\\x1b[31m.0\\nFAKE[f\\x07]` forward (activation) at step 0" in out
    assert main(["triage", str(p), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"][0]["site"] == name


def test_merge_report_prints_control_characters_in_names_as_escapes(tmp_path, capsys) -> None:
    """The merge report's replica divergences name the site as the file has it: an ESC sequence in it went to the
    terminal raw. It is printed as an escape; --json keeps the name."""
    import json

    paths = []
    for rank in range(2):
        p = tmp_path / f"r{rank}.thist"
        with trainhist.HistoryWriter(p, run_id="cd" * 16, rank=rank, world_size=2) as w:
            s = w.site("w\x1b[2J", "param", sharing="replica")
            w.observe(s, 0, np.ones(4) * (rank + 1.0))
        paths.append(str(p))
    assert main(["merge", *paths, "-o", str(tmp_path / "m.thist"), "--report-divergence"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "replica divergence: site w\\x1b[2J [param]" in out
    assert main(["merge", *paths, "-o", str(tmp_path / "m.thist"), "--report-divergence", "--json"]) == 0
    assert "w\x1b[2J" in json.loads(capsys.readouterr().out)["divergences"][0]["where"]


def test_python_m_trainhist_runs_the_command(tmp_path) -> None:
    """`python -m trainhist` said "No module named trainhist.__main__" (exit 1): the command ran only as the
    console script, which an environment without it on PATH (or a checkout on PYTHONPATH) lacks."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    p = _history(tmp_path / "f.thist")
    src = str(Path(trainhist.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "trainhist", "verify", str(p)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "clean" in r.stdout and "4 rows" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "trainhist", "info"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "usage: trainhist info" in r.stderr


def test_main_leaves_the_calling_programs_streams_as_they_were(tmp_path, monkeypatch) -> None:
    """main() reconfigured sys.stdout to escape what it cannot encode and left it so: the calling program's own
    print of a non-ASCII text no longer raised, it was silently escaped. Its handlers are back after main()."""
    import io
    import sys

    p = _unicode_history(tmp_path / "u.thist")
    for stream in ("stdout", "stderr"):
        monkeypatch.setattr(sys, stream, io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict",
                                                          write_through=True))
    assert main(["info", str(p)]) == 0
    assert main(["info", str(tmp_path / "missing.thist")]) == 1
    assert sys.stdout.errors == "strict" and sys.stderr.errors == "strict"
    assert b"\\u5c64" in sys.stdout.buffer.getvalue() or b"\\xe9" in sys.stdout.buffer.getvalue()  # (escaped)
    with pytest.raises(UnicodeEncodeError):
        print("caf\u00e9")


def test_control_characters_in_settings_keys_and_error_messages_are_escaped(tmp_path, capsys) -> None:
    """The merge report's settings keys and the messages of refusals (a site name inside) reached the terminal raw:
    an ESC in a file's names could recolour or clear the user's screen."""
    run = "ab" * 16
    for rank in (0, 1):
        with trainhist.HistoryWriter(tmp_path / f"s{rank}.thist", run_id=run, rank=rank, world_size=2,
                                     settings={"lr\x1b[2J": rank}) as w:
            w.observe(w.site("x", "activation"), 0, np.ones(3))
    assert main(["merge", "-o", str(tmp_path / "m.thist"), str(tmp_path / "s0.thist"),
                 str(tmp_path / "s1.thist")]) == 0
    out = capsys.readouterr().out
    assert "lr\\x1b[2J" in out and "\x1b" not in out
    for rank, sharing in ((0, "shard"), (1, "replica")):
        with trainhist.HistoryWriter(tmp_path / f"t{rank}.thist", run_id=run, rank=rank, world_size=2, mode="w") as w:
            w.observe(w.site("y\x1b[31m", "param", sharing=sharing), 0, np.ones(3))
    assert main(["merge", "-o", str(tmp_path / "n.thist"), str(tmp_path / "t0.thist"),
                 str(tmp_path / "t1.thist")]) == 1
    err = capsys.readouterr().err
    assert "y\\x1b[31m" in err and "\x1b" not in err


def test_paths_with_control_characters_are_printed_as_escapes(tmp_path, capsys) -> None:
    """The paths a command prints (the file of info and verify, merge's output, the figures plot wrote, the
    tables export wrote, a missing file's name) reached the terminal raw: a folder named with an ESC sequence or
    a newline recoloured the screen or split a line. They are escaped, as site names are."""
    d = tmp_path / "d\x1b[2J\n"
    d.mkdir()
    p = _history(d / "f.thist")
    esc = str(d).replace("\x1b", "\\x1b").replace("\n", "\\n")
    commands = [["info", str(p)], ["verify", str(p)], ["merge", str(p), "-o", str(d / "m.thist")],
                ["plot", str(p), "--site", "h.0", "-o", str(d / "figs")], ["export", str(p), "-o", str(d / "csv"),
                                                                             "--format", "csv"]]
    for argv in commands:
        assert main(argv) == 0, argv
        out = capsys.readouterr().out
        assert "\x1b" not in out and esc in out, (argv, out)
        assert all(not ln.startswith("f.thist") and not ln.startswith("figs") for ln in out.splitlines()), out
    assert main(["info", str(d / "missing.thist")]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and f"{esc}/missing.thist" in err


def test_plot_refuses_an_output_folder_it_cannot_create(tmp_path, capsys) -> None:
    """`plot FILE -o notes.txt/figs` said "[io_error] notes.txt/figs: Not a directory", and `-o /proc/figs`
    "[not_found] /proc/figs: no such file", naming neither what -o must be nor what to do. A folder under a file
    is refused as usage (bad_output, exit 2), one the file system will not create as output_unwritable (exit 1),
    each saying what to pass; nothing is drawn."""
    pytest.importorskip("matplotlib")
    p = _history(tmp_path / "f.thist")
    (tmp_path / "notes.txt").write_text("x")
    for site in ([], ["--site", "h.0"]):
        assert main(["plot", str(p), "-o", str(tmp_path / "notes.txt" / "figs"), *site]) == 2
        err = capsys.readouterr().err
        assert "[bad_output]" in err and "notes.txt is a file, not a folder" in err and "-o" in err, err
        if Path("/proc/self").is_dir():  # (Linux: a folder that exists but takes no new entries)
            assert main(["plot", str(p), "-o", "/proc/trainhist-figs", *site]) == 1
            err = capsys.readouterr().err
            assert "[output_unwritable] /proc/trainhist-figs: cannot create the folder for the figures" in err, err
    assert (tmp_path / "notes.txt").read_text() == "x"


def test_conformance_names_a_vectors_folder_that_is_not_there(tmp_path, capsys) -> None:
    """`conformance --vectors /no/such` said "no conformance vectors found: pass --vectors DIR" to a user who had
    passed --vectors, without naming it; a path that is no folder is refused (no_vectors, exit 2) naming it."""
    (tmp_path / "file").write_text("x")
    for given, found in ((tmp_path / "missing", "no such folder"), (tmp_path / "file", "a file, not a folder")):
        assert main(["conformance", "--vectors", str(given)]) == 2
        err = capsys.readouterr().err
        assert f"[no_vectors] {given}: {found}" in err and "conformance/vectors" in err, err
        assert len(err.strip().splitlines()) == 1


def test_export_with_file_after_a_list_option_says_where_file_goes(tmp_path, capsys) -> None:
    """`export -o out --sites 'h.*' run.thist` (FILE after --sites, which took it as a pattern) said only "the
    following arguments are required: file"; the error now says FILE goes before the options or after --."""
    p = _history(tmp_path / "f.thist")
    for opts in (["--sites", "h.*"], ["--streams", "activation"], ["--phases", "default"]):
        with pytest.raises(SystemExit) as e:
            main(["export", "-o", str(tmp_path / "out"), *opts, str(p)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "required: file" in err, err
        assert "name FILE before the options, or after --" in err.splitlines()[-1], err
    assert not (tmp_path / "out").exists()


def test_plot_with_a_facet_the_site_lacks_names_the_facets_it_has(tmp_path, capsys) -> None:
    """`plot --site h.0 --facet bogus` said "site 'h.0' has no facet 'bogus': it has ['activation']", a stream where
    facets were asked for; the site's own tensor is named as such, with the flag that selects it."""
    pytest.importorskip("matplotlib")
    p = _history(tmp_path / "f.thist")
    assert main(["plot", str(p), "-o", str(tmp_path / "png"), "--site", "h.0", "--facet", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "has no facet 'bogus': it has [\"activation without a facet (--facet '')\"]" in err, err
    assert not (tmp_path / "png").exists()


def test_info_sites_says_never_for_a_cadence_of_0(tmp_path, capsys) -> None:
    """`info --sites` printed a scalar as "loss scalar   shard cadence spine/1 sketch/0": 0 (never, spec 2.2) read as
    a cadence, and the dtype and shape it lacks left blanks. A site's line names only what it has, and a
    cadence of 0 as never."""
    p = tmp_path / "s.thist"
    with trainhist.HistoryWriter(p) as w:
        w.observe(w.site("h.0", "activation", shape=(2, 4), dtype="float32"), 0, np.ones((2, 4), np.float32))
        w.scalar("loss", 0, 1.5)
    assert main(["info", str(p), "--sites"]) == 0
    lines = [ln.strip() for ln in capsys.readouterr().out.splitlines()]
    assert "h.0 activation float32 [2, 4] shard cadence: spine every step, sketch every step" in lines, lines
    loss = next(ln for ln in lines if ln.startswith("loss "))
    assert "  " not in loss and loss.endswith("sketch never"), loss


def test_ctrl_c_ends_a_command_with_a_line_and_exit_130_not_a_traceback(tmp_path, monkeypatch, capsys) -> None:
    """Ctrl-C during a command (a long merge, the demo's training) ended in a KeyboardInterrupt traceback; it ends
    with one line saying so and the shell's status for SIGINT, 130."""
    from trainhist import cli

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_info", interrupted)
    try:
        rc = main(["info", str(_history(tmp_path / "f.thist"))])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended main() in a KeyboardInterrupt (a traceback from the console script)")
    err = capsys.readouterr().err
    assert rc == 130 and err == "trainhist: interrupted (Ctrl-C)\n", (rc, err)


@pytest.mark.parametrize("command", ["info", "verify", "dump", "triage", "merge", "coarsen", "plot", "conformance"])
def test_each_commands_help_says_what_it_does_and_its_exit_codes(command, capsys) -> None:
    """`trainhist verify --help` showed only its usage and options: what the command does (the line `trainhist
    --help` gives it) and its exit statuses were nowhere in it."""
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    listing = " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    first = listing.split(f" {command} ", 1)[1][:40]  # (the start of its line in `trainhist --help`)
    assert first[0].upper() + first[1:] in text, (first, text)
    assert "exit status:" in text and "2 bad usage" in text, text


def test_plot_into_a_folder_it_may_not_write_says_what_to_pass(tmp_path, monkeypatch, capsys) -> None:
    """A figure the -o folder refused (read-only, full) ended as "[io_error] figs/h.0.activation.site.png: Operation
    not permitted", saying neither what failed nor what to do; it is output_unwritable (exit 1), naming the file
    and saying what to pass."""
    import errno

    from trainhist import figures

    pytest.importorskip("matplotlib")
    p = _history(tmp_path / "f.thist")

    def refused(h: object, *args: object, out: object = None, **kwargs: object) -> None:
        name = out if out is not None else args[0]
        raise PermissionError(errno.EPERM, "Operation not permitted", str(name))

    for name in ("site_figure", "contact_sheet"):
        monkeypatch.setattr(figures, name, refused)
    for site in ([], ["--site", "h.0"]):
        assert main(["plot", str(p), "-o", str(tmp_path / "figs"), *site]) == 1
        err = capsys.readouterr().err
        assert "[output_unwritable]" in err and "cannot write the figure (Operation not permitted)" in err, err
        assert "pass -o a folder you may write to" in err and len(err.strip().splitlines()) == 1, err


def test_output_that_cannot_be_written_says_it_was_the_output(tmp_path, monkeypatch, capsys) -> None:
    """`trainhist dump FILE > /dev/full` (a full disk behind standard output) said "[io_error] : No space left on
    device": an empty path, and nothing of what failed or what to do."""
    import errno
    import io
    import sys

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    p = _history(tmp_path / "f.thist")
    for command in ("info", "dump", "verify", "triage"):
        monkeypatch.setattr(sys, "stdout", Full())
        assert main([command, str(p)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("trainhist: error [io_error] standard output: No space left on device; "), err
        assert "room" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", ["info", "verify", "dump", "triage"])
def test_a_file_named_like_an_option_is_told_to_go_after_double_dash(command, tmp_path, monkeypatch, capsys) -> None:
    """`trainhist info -x.thist` (a file whose name starts with -) said "the following arguments are required: file"
    to a user who had named one; the error says such a name goes after --, which reads it."""
    monkeypatch.chdir(tmp_path)
    _history(tmp_path / "-x.thist")
    with pytest.raises(SystemExit) as e:
        main([command, "-x.thist"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"after --: trainhist {command} -- -x.thist" in err.splitlines()[-1], err
    assert main([command, "--", "-x.thist"]) == 0


def test_conformance_k_that_matches_no_case_names_the_pattern_and_the_ids(capsys) -> None:
    """`conformance -k zzz` printed the implementation, vectors and grading, "0 passed, 0 failed", then "[usage] no
    cases matched", naming neither the pattern nor what a case id looks like; it is refused before anything runs,
    with the pattern, the form of the ids and the closest ones."""
    assert main(["conformance", "-k", "presense/segment"]) == 2
    out, err = capsys.readouterr()
    assert out == "", out
    assert "[no_match]" in err and "-k 'presense/segment' matches no case id" in err, err
    assert "<category>/<case>" in err and "closest: presence/segments" in err, err


def test_verify_counts_one_chunk_and_one_site_in_the_singular(tmp_path, capsys) -> None:
    """`verify` of a history of one row said "1 chunks, 1 rows, 1 sites verified"."""
    p = tmp_path / "one.thist"
    with trainhist.HistoryWriter(p) as w:
        w.observe(w.site("h.0", "activation"), 0, np.ones(3))
    assert main(["verify", str(p)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("; 1 chunk, 1 row, 1 site verified"), out


def test_conformance_refuses_an_impl_that_is_no_command(capsys) -> None:
    """`conformance --impl "'"` ended in a ValueError traceback ("No closing quotation") from shlex, and `--impl ""`
    silently ran the reference implementation instead; each is refused as usage naming --impl."""
    for impl, said in (("'", "No closing quotation"), ("", "got an empty command"), ("  ", "got an empty command")):
        with pytest.raises(SystemExit) as e:
            main(["conformance", "--impl", impl, "-k", "presence/segments"])
        err = capsys.readouterr()
        assert e.value.code == 2 and "argument --impl: expected a command" in err.err and said in err.err, err
        assert "passed" not in err.out


def test_conformance_refuses_an_empty_vectors_folder_name(capsys) -> None:
    """`conformance --vectors ""` (an unset shell variable) silently ran the checkout's vectors; it is refused."""
    with pytest.raises(SystemExit) as e:
        main(["conformance", "--vectors", "", "-k", "presence/segments"])
    err = capsys.readouterr()
    assert e.value.code == 2 and "argument --vectors: expected a folder path, got an empty string" in err.err, err
    assert "passed" not in err.out


def test_plot_to_a_full_standard_output_says_it_was_the_output(tmp_path, monkeypatch, capsys) -> None:
    """`trainhist plot FILE -o DIR > /dev/full`: the figures were written, the list of them could not be printed;
    it said "[output_unwritable] DIR: cannot write the figure (No space left on device); pass -o a folder you may
    write to", blaming the folder that holds them. It says standard output, as the other commands do."""
    import errno
    import io
    import sys

    pytest.importorskip("matplotlib")

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    p = _history(tmp_path / "f.thist")
    for site in ([], ["--site", "h.0"]):
        monkeypatch.setattr(sys, "stdout", Full())
        assert main(["plot", str(p), "-o", str(tmp_path / "figs"), *site]) == 1
        err = capsys.readouterr().err
        assert err.startswith("trainhist: error [io_error] standard output: No space left on device; "), err
        assert any((tmp_path / "figs").iterdir())  # (the figures were written)
