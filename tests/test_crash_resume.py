"""Resuming after a crash at any byte: a file of two writer sessions cut at the offsets around every record edge
(where a killed writer leaves it) reads as the last commit before the cut, and ``HistoryWriter(mode="a")`` then
drops the rest, appends, and leaves a file that reads clean with the committed prefix and the new rows
(spec/crash-safety.md: a resuming writer recovers the file as a reader would, truncates it to its last commit and
continues). Every byte offset of this file was checked the same way once (11 153 cuts); the test keeps the edges."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import trainhist
from trainhist.framing import (
    FILE_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    RecordHeader,
    RecordType,
)
from trainhist.writer import HistoryWriter

FIXED = dict(fsync="never", commit_every=10**9, commit_seconds=1e18)


def _v(step: int, k: int) -> np.ndarray:
    return (np.arange(5, dtype=np.float32) - 2) * (step + 1) + k


def _content(p: Path) -> tuple[str, int, list[int], dict[str, list[int]]]:
    with trainhist.open(p) as h:
        h.verify()
        sites = {s.path: h.spine(s.path, s.stream).step.tolist() for s in h.sites}
        return h.recovery.status, h.committed_bytes, h.steps["step"].tolist(), sites


@pytest.fixture(scope="module")
def two_sessions(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[int, tuple], list[int]]:
    """The file's bytes, the content at each commit's end, and the offsets to cut at."""
    d = tmp_path_factory.mktemp("resume")
    src = d / "src.thist"
    with HistoryWriter(src, salt=7, **FIXED) as w:
        a, b = w.site("a", "activation"), w.site("b", "param")
        for st in range(4):
            w.observe(a, st, _v(st, 0))
            w.observe(b, st, _v(st, 1))
            w.scalar("loss", st, st * 0.5)
            w.step_truth(st, tokens=st)
            if st in (0, 2):
                w.commit()
    with HistoryWriter(src, mode="a", **FIXED) as w:
        a = w.site("a", "activation")
        for st in range(4, 6):
            w.observe(a, st, _v(st, 0))
            w.step_truth(st, tokens=st)
            w.commit()
    data = src.read_bytes()
    at_commit: dict[int, tuple] = {}
    cuts = {0, 1, 7, 8, 31, 32, 33}
    pos = FILE_HEADER_SIZE
    while pos < len(data):
        h = RecordHeader.parse(data, pos)
        assert h is not None
        end = pos + RECORD_HEADER_SIZE + h.padded_length
        cuts |= {pos + d for d in (-1, 1, 8, 31, 32, 33, 40)} | {end - 1, end - 8}
        if h.type == RecordType.COMMIT:
            cut = d / "commit.thist"
            cut.write_bytes(data[:end])
            at_commit[end] = _content(cut)
        pos = end
    cuts.add(len(data))
    return data, at_commit, sorted(c for c in cuts if 0 <= c <= len(data))


def test_resuming_a_file_cut_at_any_record_edge(two_sessions: tuple[bytes, dict[int, tuple], list[int]],
                                                tmp_path: Path) -> None:
    data, at_commit, cuts = two_sessions
    assert len(at_commit) == 5 and len(cuts) > 200
    p = tmp_path / "cut.thist"
    for n in cuts:
        p.write_bytes(data[:n])
        status, committed, steps, sites = _content(p)
        last = max((end for end in at_commit if end <= n), default=None)
        if last is None:  # (no commit yet: nothing to read)
            assert steps == [] and all(v == [] for v in sites.values()), n
            assert status == ("clean" if n == FILE_HEADER_SIZE else "torn"), n
        else:
            assert (status, committed, steps, sites) == (("clean" if n == last else "torn"), last,
                                                           *at_commit[last][2:]), n
        with HistoryWriter(p, mode="a", **FIXED) as w:
            assert w.resumed == (last is not None)
            w.observe(w.site("a", "activation"), 100, _v(100, 0))
            w.step_truth(100, tokens=1)
        status2, committed2, steps2, sites2 = _content(p)
        assert status2 == "clean" and committed2 == p.stat().st_size, n
        assert steps2 == steps + [100] and sites2["a"] == sites.get("a", []) + [100], n
        assert {k: v for k, v in sites2.items() if k != "a"} == {k: v for k, v in sites.items() if k != "a"}, n
