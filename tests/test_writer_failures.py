"""The writer after an exception in the middle of its work (spec/crash-safety.md: a writer stopped by an exception
at any byte leaves a prefix of what it meant to write; the file reads ``clean`` or ``torn`` with exactly the
committed prefix, and appending to it works)."""

from __future__ import annotations

import os
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
    """An exception while the deferred segment manifest was encoded (here a MemoryError) left the segment undeclared,
    and the next commit named its chunks anyway: a corrupt file (bad_commit). (An interrupt there stops the writer,
    below.)"""
    p = tmp_path / "a.thist"
    encode = writer_mod._encode_manifest
    failed = []

    def interrupted(doc: dict) -> bytes:
        if doc["kind"] == "segment" and doc["id"] == 1 and not failed:
            failed.append(doc)
            raise MemoryError
        return encode(doc)

    monkeypatch.setattr(writer_mod, "_encode_manifest", interrupted)
    with HistoryWriter(p, **FIXED) as w:
        s = w.site("a", "activation")
        w.observe(s, 0, _values(0))
        w.new_segment(1)
        w.observe(s, 1, _values(1))
        with pytest.raises(MemoryError):
            w.commit()
        w.observe(s, 2, _values(2))
    assert failed
    assert _read(p) == ("clean", [], {"a": [0, 1, 2]})
    with trainhist.open(p) as h:
        assert [g.id for g in h.segments] == [0, 1]


class _Interrupting:
    """The writer's file, with an exception raised by the ``at``-th write (counting from 1) after it reached the
    file (``partial``: after only half of it did, then an ``OSError``, as a full disk gives)."""

    def __init__(self, f, at: int, partial: bool = False) -> None:
        self._f, self._left, self._partial = f, at, partial
        self.fired = False

    def write(self, data: bytes) -> int:
        self._left -= 1
        if self._left == 0:
            self.fired = True
            if self._partial:
                self._f.write(data[: len(data) // 2])
                raise OSError(28, "No space left on device")
            self._f.write(data)
            raise KeyboardInterrupt
        return self._f.write(data)

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def _three_steps(p: Path) -> HistoryWriter:
    """Steps 0 and 1 of three sites committed, step 2 buffered."""
    w = HistoryWriter(p, **FIXED)
    sites = [w.site(f"s{i}", "activation") for i in range(3)]
    for step in range(3):
        for s in sites:
            w.observe(s, step, _values(step))
        w.step_truth(step, tokens=step)
        if step == 1:
            w.commit()
    return w


def _write_two_commits(p: Path, at: int, partial: bool) -> tuple[HistoryWriter, _Interrupting]:
    """Commit steps 0 and 1 of three sites, then break the ``at``-th write of the commit of step 2."""
    w = _three_steps(p)
    w._f = f = _Interrupting(w._f, at, partial)
    return w, f


@pytest.mark.parametrize(("at", "partial"), [(5, False)] + [(at, True) for at in range(1, 6)])
def test_an_exception_while_a_record_is_written_stops_the_writer_and_the_file_keeps_its_commits(
        tmp_path: Path, at: int, partial: bool) -> None:
    """A write that failed half way, or an interrupt (Ctrl-C) that came right after the commit record was written,
    before the writer counted it: close() (as ``with`` calls it) went on and wrote a commit that did not name that
    record, or named a record at an offset that was not where it was written; the file was corrupt (bad_commit,
    bad_record_header) and its commits readable only by cutting it. Now the writer stops writing: the file reads as
    its last commit, and resumes. (An interrupt before the commit record: the next test.)"""
    p = tmp_path / "a.thist"
    w, f = _write_two_commits(p, at, partial)
    with pytest.raises(KeyboardInterrupt if not partial else OSError):
        w.commit()  # (the commit of step 2 writes 3 obs chunks, 1 steps chunk and a commit record: 5 writes)
    assert f.fired
    with pytest.raises(UsageError) as e:
        w.observe(w.site("s0", "activation"), 3, _values(3))
    assert e.value.code == "writer_failed"
    with pytest.raises(UsageError, match="mode='a'"):
        w.commit()
    w.close()  # (no second error)
    w.close()
    status, steps, sites = _read(p)
    assert status in ("clean", "torn")
    committed = [0, 1, 2] if (at == 5 and not partial) else [0, 1]  # (the 5th write is the commit record itself)
    assert steps == committed and sites == {f"s{i}": committed for i in range(3)}
    with HistoryWriter(p, mode="a", **FIXED) as w2:
        assert w2.resumed
        w2.observe(w2.site("s0", "activation"), 3, _values(3))
        w2.step_truth(3, tokens=3)
    status, steps, sites = _read(p)
    assert status == "clean" and steps == committed + [3] and sites["s0"] == committed + [3]


@pytest.mark.parametrize("close", [False, True])
@pytest.mark.parametrize("at", [1, 2, 3, 4])
def test_an_interrupt_before_the_commit_record_takes_the_commit_back_and_loses_nothing(
        tmp_path: Path, at: int, close: bool) -> None:
    """Ctrl-C while a commit wrote its rows (before its commit record) stopped the writer: every row since the
    last commit was lost, those of a long run's last 30 s included, and when it came inside ``close()`` (a second
    Ctrl-C while the run ends) the rest of the run too. Now the commit is taken back (spec/crash-safety.md: the
    file cut to where the commit began, the rows buffered again) and the writer goes on; an interrupted
    ``close()`` leaves it open, and ``close()`` again commits everything."""
    p = tmp_path / "a.thist"
    w, f = _write_two_commits(p, at, partial=False)
    size = p.stat().st_size
    with pytest.raises(KeyboardInterrupt):
        w.close() if close else w.commit()
    assert f.fired and p.stat().st_size == size  # (cut back: what the commit wrote is gone)
    assert _read(p)[1] == [0, 1]
    if not close:  # the writer goes on
        for i in range(3):
            w.observe(w.site(f"s{i}", "activation"), 3, _values(3))
        w.step_truth(3, tokens=3)
    w.close()
    w.close()
    want = [0, 1, 2] if close else [0, 1, 2, 3]
    assert _read(p) == ("clean", want, {f"s{i}": want for i in range(3)})
    with trainhist.open(p) as h:
        assert h.spine("s1", "activation").columns["max"].tolist() == [7.0 + s for s in want]


@pytest.mark.parametrize("close", [False, True])
def test_an_interrupt_anywhere_in_a_commit_loses_nothing_or_leaves_the_last_commit(tmp_path: Path,
                                                                                    close: bool) -> None:
    """Ctrl-C at every third point of ``commit()`` (``close()``) where a signal handler can run (tests/interrupts.py):
    taken back, the writer goes on and ``close()`` commits steps 0-2 whole; stopped (an interrupt once the commit
    record is written), the file holds that commit, and resumes. Never a corrupt file, never a row lost or twice."""
    from interrupts import Interrupter, keyboard_interrupt

    with Interrupter(10**9, keyboard_interrupt) as count:
        w = _three_steps(tmp_path / "count.thist")
        count.points = 0  # (the commit alone)
        w.close() if close else w.commit()
    assert count.where is None and count.points > 1000
    outcomes: dict[str, int] = {}
    for n in [*range(1, count.points + 1, 3), count.points]:
        p = tmp_path / f"{n}.thist"
        w = _three_steps(p)
        with pytest.raises(KeyboardInterrupt), Interrupter(n, keyboard_interrupt) as at:
            w.close() if close else w.commit()
        assert at.where is not None
        stopped = w._failed is not None
        w.close()  # (taken back: commits now; stopped: only lets the file go)
        assert _read(p) == ("clean", [0, 1, 2], {f"s{i}": [0, 1, 2] for i in range(3)}), at.where
        outcomes["stopped" if stopped else "taken back"] = outcomes.get("stopped" if stopped else "taken back", 0) + 1
        if stopped:
            with HistoryWriter(p, mode="a", **FIXED) as w2:
                w2.observe(w2.site("s0", "activation"), 3, _values(3))
                w2.step_truth(3, tokens=3)
            assert _read(p)[1] == [0, 1, 2, 3], at.where
    # (an interrupt stops the writer only once the commit record is written: a few points of the whole commit)
    assert 0 < outcomes.get("stopped", 0) < 0.01 * outcomes["taken back"], outcomes


@pytest.mark.parametrize("partial", [False, True])
def test_an_exception_while_a_site_manifest_is_written_does_not_declare_the_site_twice(tmp_path: Path,
                                                                                      partial: bool) -> None:
    """A write of a site's manifest that failed half way stops the writer (the file reads as its last commit, and
    resumes); an interrupt right after it was written is taken back (the manifest cut off, the site not declared),
    and the writer goes on: declared again, the site is in the file once."""
    p = tmp_path / "a.thist"
    w = HistoryWriter(p, **FIXED)
    a = w.site("a", "activation")
    w.observe(a, 0, _values(0))
    w.commit()
    size = p.stat().st_size
    w._f = _Interrupting(w._f, 1, partial)
    with pytest.raises(OSError if partial else KeyboardInterrupt):
        w.site("b", "activation")
    if partial:
        w.close()
        assert _read(p)[0:2] == ("torn", [])
        with HistoryWriter(p, mode="a", **FIXED) as w2:
            w2.observe(w2.site("b", "activation"), 1, _values(1))
    else:
        assert p.stat().st_size == size
        w.observe(w.site("b", "activation"), 1, _values(1))
        w.close()
    assert _read(p) == ("clean", [], {"a": [0], "b": [1]})


def test_an_interrupt_anywhere_in_declaring_a_site_declares_it_once_or_not_at_all(tmp_path: Path) -> None:
    """Ctrl-C at every point of ``site()`` where a signal handler can run (tests/interrupts.py): the site is not
    declared and the writer goes on (declared again, it is in the file once); never a file that declares a site
    twice, never a writer stopped."""
    from interrupts import Interrupter, keyboard_interrupt

    def declare(w: HistoryWriter, at: Interrupter) -> None:
        with at:
            w.site("b", "activation", shape=(8,), dtype="float32")

    def writer(p: Path) -> HistoryWriter:
        w = HistoryWriter(p, **FIXED)
        w.observe(w.site("a", "activation"), 0, _values(0))
        w.commit()
        return w

    count = Interrupter(10**9, keyboard_interrupt)
    declare(writer(tmp_path / "count.thist"), count)
    assert count.where is None and count.points > 50
    for n in range(1, count.points + 1):
        p = tmp_path / f"{n}.thist"
        w = writer(p)
        at = Interrupter(n, keyboard_interrupt)
        with pytest.raises(KeyboardInterrupt):
            declare(w, at)
        assert at.where is not None and w._failed is None, at.where
        w.observe(w.site("b", "activation", shape=(8,), dtype="float32"), 1, _values(1))
        w.close()
        assert _read(p) == ("clean", [], {"a": [0], "b": [1]}), at.where


def test_a_failed_fsync_stops_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After an fsync that failed the kernel may have dropped the pages it could not write; a later commit whose
    fsync succeeds would claim them durable."""
    p = tmp_path / "a.thist"
    w = HistoryWriter(p, fsync="commit", commit_every=10**9, commit_seconds=1e18)
    a = w.site("a", "activation")
    w.observe(a, 0, _values(0))
    w.commit()

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(writer_mod.os, "fsync", eio)
    w.observe(a, 1, _values(1))
    with pytest.raises(OSError):
        w.commit()
    monkeypatch.undo()
    with pytest.raises(UsageError) as e:
        w.commit()
    assert e.value.code == "writer_failed"
    w.close()
    assert _read(p)[2] == {"a": [0, 1]}  # (the commit was written; whether it is on the disk is not known)


def test_appending_to_a_file_without_a_run_manifest_is_a_typed_error_that_leaves_the_file_as_it_was(
        tmp_path: Path) -> None:
    """A valid file without run manifests (conformance valid/no_run_writer_manifests) made mode="a" fail with an
    IndexError from inside the writer."""
    src = Path(__file__).parent.parent / "conformance" / "vectors" / "valid" / "no_run_writer_manifests" / "input.thist"
    p = tmp_path / "a.thist"
    p.write_bytes(src.read_bytes())
    with pytest.raises(ReadOnlyError) as e:
        HistoryWriter(p, mode="a", **FIXED)
    assert e.value.code == "no_run_manifest" and e.value.path == str(p)
    assert p.read_bytes() == src.read_bytes()
    with HistoryWriter(p, mode="w", **FIXED) as w:  # (the lock was released)
        w.observe(w.site("a", "activation"), 0, _values(0))
    assert _read(p) == ("clean", [], {"a": [0]})


@pytest.mark.parametrize("fsync", ["commit", "close"])
def test_the_first_durable_commit_of_a_new_file_syncs_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 fsync: str) -> None:
    """spec/crash-safety.md: a commit that returned with fsync="commit" survives a power loss. For a file the writer
    created, that needs the folder synced too (the file's name is in the folder); only the file was synced."""
    import stat

    synced: list[str] = []
    real = writer_mod.os.fsync

    def recording(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(writer_mod.os, "fsync", recording)
    p = tmp_path / "a.thist"
    w = HistoryWriter(p, fsync=fsync, commit_every=10**9, commit_seconds=1e18)
    a = w.site("a", "activation")
    w.observe(a, 0, _values(0))
    w.commit()
    if fsync == "commit":
        assert synced == ["file", "folder"]
    w.observe(a, 1, _values(1))
    w.commit()
    w.close()
    assert synced.count("folder") == 1 and synced[:2] == ["file", "folder"]
    synced.clear()
    with HistoryWriter(p, mode="a", fsync=fsync) as w:  # (the file exists: its name is durable already)
        w.observe(w.site("a", "activation"), 2, _values(2))
    assert "folder" not in synced and "file" in synced


@pytest.mark.parametrize("kw", [
    {"codec": ["raw"]}, {"fsync": {}}, {"mode": np.array(["w", "a"])}, {"software": 4294967295},
    {"writer_id": np.array([1, 2])}, {"run_id": np.array([1, 2])}, {"config": np.array([1, 2])},
    {"run_name": [1.5]}, {"host": b"h"},
])
def test_writer_refuses_arguments_of_the_wrong_type_with_a_typed_error(tmp_path: Path, kw: dict) -> None:
    # (fuzzed: a list, dict or array was hashed, truth-tested or dict()-ed: TypeError, numpy's ValueError)
    with pytest.raises(UsageError) as e:
        HistoryWriter(tmp_path / "x.thist", **{"fsync": "never", **kw})
    assert e.value.code in ("bad_value", "usage")


@pytest.mark.parametrize("call", [
    lambda h: h.site("b", []), lambda h: h.site(["a"], "activation"), lambda h: h.site("a", "activation", facet=[0]),
    lambda h: h.site("a", "scalar", sharing=np.array([1, 2])), lambda h: h.scalar({"k": 1.0}, 0, 1.0),
    lambda h: h.step_truth(7, grad_basis=np.array([1, 2])),
    lambda h: h.site("c", "param_grad", shape=np.array(5)),
    lambda h: (h.site("c", "param_grad"), h.site("c", "param_grad", sample=np.array([1, 2]))),
    lambda h: h.observe_spines(True, 0, _one_row_table()),
    lambda h: h.observe_spines([h.site("a", "activation")], 0, _one_row_table(), phases=1.5),
    lambda h: h.observe_spines([h.site("a", "activation")], 0, _one_row_table(), phases=np.array("default")),
])
def test_writer_methods_refuse_arguments_of_the_wrong_type_and_the_file_reads_clean(tmp_path: Path, call) -> None:
    """Names, shapes, samples and site lists of the wrong type (fuzzed: a list hashed, a 0-d array iterated, an
    array truth-tested) raised bare TypeErrors and numpy ValueErrors; now bad_value, and the writer goes on."""
    p = tmp_path / "x.thist"
    with HistoryWriter(p, fsync="never") as h:
        with pytest.raises(UsageError) as e:
            call(h)
        assert e.value.code == "bad_value"
        h.scalar("loss", 0, 1.0)  # (the writer goes on)
    trainhist.open(p).verify()


def test_writer_refuses_a_complex_rank_with_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        HistoryWriter(tmp_path / "x.thist", fsync="never", rank=1 + 2j)


def _one_row_table():
    from trainhist.summary import SpineTable
    z = np.zeros(1, np.uint64)
    return SpineTable(count=np.array([2], np.uint64), nan=z, pinf=z, ninf=z, zero=z, min=np.zeros(1), max=np.ones(1),
                      sum=np.ones(1), sumsq=np.ones(1), method=np.ones(1, np.int64))
