"""Reading a file a writer is using (spec/crash-safety.md, reader obligations): a reader that opens a file while a
writer appends to it reads its last commit; a reader whose file is started over (``mode="w"``) while it holds it
gets a typed error when it reads rows, not a SIGBUS that kills its process (the reader maps the file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trainhist
from trainhist.writer import HistoryWriter

SRC = str(Path(trainhist.__file__).resolve().parent.parent)

SCRIPT = r'''
import sys
import numpy as np
import pytest
import trainhist
from trainhist import HistoryWriter
p, grow, in_memory = sys.argv[1], sys.argv[2] == "grow", sys.argv[3] == "copy"
with HistoryWriter(p, fsync="never") as w:
    sites = [w.site(f"s{i}", "activation") for i in range(40)]
    for step in range(10):
        for s in sites:
            w.observe(s, step, np.arange(64, dtype=np.float32) + step)
h = trainhist.open(p, in_memory=in_memory)
print(len(h.spine("s0", "activation")), flush=True)
w = HistoryWriter(p, mode="w", fsync="never")  # (the job starts over: the file is cut to nothing)
if grow:  # (and grows again, with another salt, past what the reader found)
    sites = [w.site(f"s{i}", "activation") for i in range(40)]
    for step in range(12):
        for s in sites:
            w.observe(s, step, np.arange(64, dtype=np.float32) + step)
    w.commit()
    assert w._offset > h.committed_bytes
for query in (lambda: h.spine("s39", "activation").max.tolist(), lambda: h.verify()["rows"],
              lambda: len(h.steps["step"])):
    try:
        print("read", query(), flush=True)
    except trainhist.TrainhistError as e:
        print(e.code, flush=True)
w.close()
'''


def _run(tmp_path: Path, grow: bool, in_memory: bool = False) -> subprocess.CompletedProcess:
    script = tmp_path / "live.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(script), str(tmp_path / "a.thist"), "grow" if grow else "cut",
                           "copy" if in_memory else "map"], capture_output=True, text=True, env=env, check=False)


def test_a_file_started_over_while_it_is_read_is_a_typed_error_not_a_sigbus(tmp_path: Path) -> None:
    r = _run(tmp_path, grow=False)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])  # (-7: killed by SIGBUS)
    assert r.stdout.split() == ["10", "file_changed", "file_changed", "file_changed"]


def test_a_file_started_over_and_grown_past_the_old_commits_is_a_typed_error(tmp_path: Path) -> None:
    r = _run(tmp_path, grow=True)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.split() == ["10", "file_changed", "file_changed", "file_changed"]


@pytest.mark.parametrize("grow", [False, True])
def test_a_history_read_into_memory_reads_on_what_it_found_while_the_file_is_started_over(
        tmp_path: Path, grow: bool) -> None:
    """``in_memory=True`` (spec/crash-safety.md): the file is read once, when opened; a writer starting it over
    (cut to nothing, then grown again or not) changes nothing the history answers: the first history's rows, no
    file_changed."""
    r = _run(tmp_path, grow=grow, in_memory=True)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.splitlines() == ["10", f"read {[63.0 + s for s in range(10)]}", "read 400", "read 0"]


def _outcome(path: Path, in_memory: bool) -> tuple:
    """What opening and verifying ``path`` gives: the error's type, code and offset, or the recovery and counts."""
    try:
        with trainhist.open(path, in_memory=in_memory) as h:
            return ("read", h.recovery, h.size, h.verify(), [s.key for s in h.sites])
    except trainhist.TrainhistError as e:
        return ("error", type(e).__name__, getattr(e, "code", None), getattr(e, "offset", None))


def test_a_history_read_into_memory_reads_every_vector_as_the_map_does() -> None:
    """The copy is scanned and queried by the same code as the map: every conformance vector file gives the same
    outcome both ways (the same error, code and offset, or the same recovery, sizes and checks)."""
    files = sorted((Path(SRC).parent / "conformance" / "vectors").rglob("*.thist"))
    assert len(files) > 150
    outcomes = {"read": 0, "error": 0}
    for f in files:
        mapped = _outcome(f, in_memory=False)
        assert _outcome(f, in_memory=True) == mapped, f
        outcomes[mapped[0]] += 1
    assert outcomes["read"] > 50 and outcomes["error"] > 50, outcomes


def test_a_history_read_into_memory_holds_a_read_only_copy_and_checks_its_argument(tmp_path: Path) -> None:
    p = tmp_path / "a.thist"
    with HistoryWriter(p, fsync="never") as w:
        w.observe(w.site("a", "activation"), 0, np.arange(4, dtype=np.float32))
    with trainhist.open(p, in_memory=True) as h:
        os.truncate(p, 0)
        assert h.size > 0 and not np.frombuffer(h._buf, np.uint8).flags.writeable
        assert h.spine("a", "activation").max.tolist() == [3.0]
    with pytest.raises(trainhist.UsageError) as e:
        trainhist.open(p, in_memory="yes")  # type: ignore[arg-type]
    assert e.value.code == "bad_value"


def test_a_resumed_writer_cutting_the_torn_tail_leaves_an_open_reader_reading(tmp_path: Path) -> None:
    p = tmp_path / "a.thist"
    with HistoryWriter(p, fsync="never") as w:
        a = w.site("a", "activation")
        for step in range(3):
            w.observe(a, step, np.arange(4, dtype=np.float32))
    with open(p, "ab") as f:
        f.write(b"\x01" * 20)  # (a torn record header)
    with trainhist.open(p) as h:
        assert h.recovery.status == "torn"
        with HistoryWriter(p, mode="a", fsync="never") as w:  # (cuts the 20 bytes, appends)
            w.observe(w.site("a", "activation"), 3, np.arange(4, dtype=np.float32))
        assert h.spine("a", "activation").step.tolist() == [0, 1, 2]
        h.verify()
    with trainhist.open(p) as h:
        assert h.recovery.status == "clean" and h.spine("a", "activation").step.tolist() == [0, 1, 2, 3]


def test_a_reader_opening_a_file_while_a_resumed_writer_rewrites_its_tail_reads_the_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader sized the file with its torn tail; a writer resuming it then cut the tail and began writing its
    first record there; the scan read half that record header and reported corruption (bad_record_header) of a
    healthy file. A scan that fails on a file whose size changed meanwhile reads it again."""
    import mmap

    p = tmp_path / "a.thist"
    with HistoryWriter(p, fsync="never") as w:
        a = w.site("a", "activation")
        step = 0
        while True:  # (room in the last page for the tail: the cut leaves no mapped page past the file's end)
            w.observe(a, step, np.arange(4, dtype=np.float32))
            w.commit()
            step += 1
            if mmap.PAGESIZE - w._offset % mmap.PAGESIZE >= 200:
                break
    committed = p.stat().st_size
    with open(p, "ab") as f:
        f.write(bytes(150))  # (the torn tail a reader sizes: zeros)
    real = mmap.mmap
    rewrites = []

    class Rewritten(real):  # type: ignore[misc,valid-type]
        def __new__(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
            m = real.__new__(cls, *args, **kwargs)
            if not rewrites:  # (the writer cuts the tail and writes half a record header, after the map was made)
                rewrites.append(committed)
                os.truncate(p, committed)
                with open(p, "r+b") as f:
                    f.seek(committed)
                    f.write(b"\x07" * 16)
            return m

    monkeypatch.setattr(mmap, "mmap", Rewritten)
    with trainhist.open(p) as h:
        assert rewrites
        assert (h.recovery.status, h.committed_bytes, h.recovery.dropped_bytes) == ("torn", committed, 16)
        assert h.spine("a", "activation").step.tolist() == list(range(step))


def test_a_corrupt_file_that_does_not_change_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "a.thist"
    with HistoryWriter(p, fsync="never") as w:
        w.observe(w.site("a", "activation"), 0, np.arange(4, dtype=np.float32))
    committed = p.stat().st_size
    with open(p, "ab") as f:
        f.write(b"\x07" * 40)
    with pytest.raises(trainhist.CorruptError) as e:
        trainhist.open(p)
    assert (e.value.code, e.value.offset) == ("bad_record_header", committed)


def test_file_change_check_runs_once_a_query_not_once_a_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check that the file was not started over (an fstat, and the salt read again) runs once for a query, not
    for each chunk it decodes: the step table of a file committed at every step has a chunk per commit, and the
    check per chunk added an fstat to each (about 1 us on a chunk's 20)."""
    from trainhist import reader

    p = tmp_path / "a.thist"
    with HistoryWriter(p, commit_every=1, fsync="never") as w:
        s = w.site("x", "activation")
        for step in range(40):
            w.observe(s, step, values=np.ones(2))
            w.step_truth(step, applied=True)
            w.commit()
    calls = []
    fstat = os.fstat
    with trainhist.open(p) as h:
        monkeypatch.setattr(reader.os, "fstat", lambda fd: calls.append(fd) or fstat(fd))
        assert h.steps["step"].tolist() == list(range(40))
        assert h.spine("x").columns["step"].tolist() == list(range(40))
        assert len(h._site_chunks(h.sites[0], True)[0]["step"]) == 40  # (the per-chunk path)
        assert h.verify()
    assert len(calls) <= 8, len(calls)  # (one a query; 40 chunks each for the step table and the site)
