"""The writer after an exception in the middle of its work (spec/crash-safety.md: a writer stopped by an exception
at any byte leaves a prefix of what it meant to write; the file reads ``clean`` or ``torn`` with exactly the
committed prefix, and appending to it works)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import trainhist
from trainhist import writer as writer_mod
from trainhist.errors import ReadOnlyError, UsageError
from trainhist.writer import HistoryWriter

FIXED = dict(fsync="never", commit_every=10**9, commit_seconds=1e18)


def _values(step: int) -> np.ndarray:
    return np.arange(8, dtype=np.float32) + step


def _read(path: Path) -> tuple[str, list[int], dict[str, list[int]]]:
    """Outcome, step-truth steps and each site's steps, after a full check."""
    with trainhist.open(path) as h:
        h.verify()
        sites = {s.path: h.spine(s.path, s.stream).step.tolist() for s in h.sites}
        return h.recovery.status, h.steps["step"].tolist(), sites


@pytest.mark.parametrize("first_step", [1.5, "3", 2**63, True])
def test_new_segment_refuses_a_first_step_the_manifest_cannot_hold_before_anything_changes(tmp_path: Path,
                                                                                          first_step) -> None:
    p = tmp_path / "a.thist"
    with HistoryWriter(p, **FIXED) as w:
        s = w.site("a", "activation")
        w.observe(s, 0, _values(0))
        segment = w.segment
        with pytest.raises(UsageError):
            w.new_segment(first_step)
        assert w.segment == segment
        w.observe(s, 1, _values(1))
        w.new_segment(2)
        w.observe(s, 2, _values(2))
    assert _read(p) == ("clean", [], {"a": [0, 1, 2]})


def test_new_segment_refuses_an_unknown_reason(tmp_path: Path) -> None:
    p = tmp_path / "a.thist"
    with HistoryWriter(p, **FIXED) as w:
        s = w.site("a", "activation")
        w.observe(s, 0, _values(0))
        with pytest.raises(UsageError):
            w.new_segment(1, reason="restart")
        w.observe(s, 1, _values(1))
    assert _read(p) == ("clean", [], {"a": [0, 1]})


def test_a_segment_manifest_whose_writing_failed_is_written_by_the_next_commit(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception while the deferred segment manifest is encoded (here an interrupt) left the segment undeclared,
    and the next commit named its chunks anyway: a corrupt file (bad_commit)."""
    p = tmp_path / "a.thist"
    encode = writer_mod._encode_manifest
    failed = []

    def interrupted(doc: dict) -> bytes:
        if doc["kind"] == "segment" and doc["id"] == 1 and not failed:
            failed.append(doc)
            raise KeyboardInterrupt
        return encode(doc)

    monkeypatch.setattr(writer_mod, "_encode_manifest", interrupted)
    with HistoryWriter(p, **FIXED) as w:
        s = w.site("a", "activation")
        w.observe(s, 0, _values(0))
        w.new_segment(1)
        w.observe(s, 1, _values(1))
        with pytest.raises(KeyboardInterrupt):
            w.commit()
        w.observe(s, 2, _values(2))
    assert failed
    assert _read(p) == ("clean", [], {"a": [0, 1, 2]})
    with trainhist.open(p) as h:
        assert [g.id for g in h.segments] == [0, 1]
