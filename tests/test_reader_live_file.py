"""Reading a file a writer is using (spec/crash-safety.md, reader obligations): a reader that opens a file while a
writer appends to it reads its last commit; a reader whose file is started over (``mode="w"``) while it holds it
gets a typed error when it reads rows, not a SIGBUS that kills its process (the reader maps the file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import trainhist
from trainhist.writer import HistoryWriter

SRC = str(Path(trainhist.__file__).resolve().parent.parent)

SCRIPT = r'''
import sys
import numpy as np
import trainhist
from trainhist import HistoryWriter
p, grow = sys.argv[1], sys.argv[2] == "grow"
with HistoryWriter(p, fsync="never") as w:
    sites = [w.site(f"s{i}", "activation") for i in range(40)]
    for step in range(10):
        for s in sites:
            w.observe(s, step, np.arange(64, dtype=np.float32) + step)
h = trainhist.open(p)
print(len(h.spine("s0", "activation")), flush=True)
w = HistoryWriter(p, mode="w", fsync="never")  # (the job starts over: the file is cut to nothing)
if grow:  # (and grows again, with another salt, past what the reader found)
    sites = [w.site(f"s{i}", "activation") for i in range(40)]
    for step in range(12):
        for s in sites:
            w.observe(s, step, np.arange(64, dtype=np.float32) + step)
    w.commit()
    assert w._offset > h.committed_bytes
for query in (lambda: h.spine("s39", "activation"), h.verify, lambda: h.steps):
    try:
        query()
        print("read", flush=True)
    except trainhist.TrainhistError as e:
        print(e.code, flush=True)
w.close()
'''


def _run(tmp_path: Path, grow: bool) -> subprocess.CompletedProcess:
    script = tmp_path / "live.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(script), str(tmp_path / "a.thist"), "grow" if grow else "cut"],
                          capture_output=True, text=True, env=env)


def test_a_file_started_over_while_it_is_read_is_a_typed_error_not_a_sigbus(tmp_path: Path) -> None:
    r = _run(tmp_path, grow=False)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])  # (-7: killed by SIGBUS)
    assert r.stdout.split() == ["10", "file_changed", "file_changed", "file_changed"]


def test_a_file_started_over_and_grown_past_the_old_commits_is_a_typed_error(tmp_path: Path) -> None:
    r = _run(tmp_path, grow=True)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.split() == ["10", "file_changed", "file_changed", "file_changed"]


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
