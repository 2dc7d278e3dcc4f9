"""Files a buggy or hostile writer could produce, with every CRC right: each reader surface (the History API, dump,
verify, merge, coarsen) gives a typed error naming the record, or reads the file with bounded work; merge never
writes a file the reader refuses. Found by a fuzzing campaign of resealed mutants (session 10)."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
from history_helpers import obs_payload, records, rewrite

import trainhist
from trainhist import cli
from trainhist.dump import dumps
from trainhist.errors import TrainhistError
from trainhist.framing import RECORD_HEADER_SIZE, RecordType


def _base(path: Path) -> bytes:
    """Three steps of one site, sketches, step truth, raw codec (every column value sits at a fixed place)."""
    with trainhist.HistoryWriter(path, codec="raw", fsync="never", run_id="1" * 32, writer_id="a" * 32) as w:
        a = w.site("a", "activation")
        for step in range(3):
            w.observe(a, step, np.array([1.0, -2.0, 3.0], np.float32))
            w.step_truth(step, applied=True)
    return path.read_bytes()


def _set(payload: bytearray, cols: dict, name: str, row: int, value: object) -> None:
    _, dt, codec, off, _, _ = cols[name]
    assert codec == 0  # raw
    np.frombuffer(payload, np.dtype("<" + dt), count=row + 1, offset=off)  # (checks the row lies inside)
    fmt = "<" + {"u4": "I", "u1": "B", "u8": "Q", "f8": "d", "i8": "q"}[dt]
    struct.pack_into(fmt, payload, off + row * np.dtype(dt).itemsize, value)


def _steps_payload(data: bytes) -> tuple[int, bytearray, dict]:
    pos = records(data, RecordType.STEPS)[0]
    length = struct.unpack_from("<I", data, pos + 4)[0]
    payload = bytearray(data[pos + RECORD_HEADER_SIZE : pos + RECORD_HEADER_SIZE + length])
    (mlen,) = struct.unpack_from("<I", payload)
    return pos, payload, {c[0]: c for c in msgpack.unpackb(bytes(payload[4 : 4 + mlen]))["cols"]}


def _mutant(tmp_path: Path, name: str, edit: object, *, steps: bool = False) -> Path:
    data = bytearray(_base(tmp_path / "base.thist"))
    pos, payload, cols = _steps_payload(bytes(data)) if steps else obs_payload(bytes(data), 0)
    edit(payload, cols)  # type: ignore[operator]
    rewrite(data, pos, bytes(payload))
    p = tmp_path / f"{name}.thist"
    p.write_bytes(bytes(data))
    return p


def _surfaces(p: Path, tmp_path: Path) -> dict[str, str]:
    """What each reader surface does with ``p``: "ok", or the code of the TrainhistError it raised (any other
    exception fails the test). Merge and coarsen outputs must read back."""
    other = tmp_path / "other.thist"
    if not other.exists():
        with trainhist.HistoryWriter(other, fsync="never", run_id="1" * 32, writer_id="b" * 32) as w:
            w.observe(w.site("a", "activation"), 0, np.array([1.0], np.float32))
    out: dict[str, str] = {}

    def run(name: str, fn: object) -> None:
        try:
            fn()  # type: ignore[operator]
            out[name] = "ok"
        except TrainhistError as e:
            assert e.path is not None and e.offset is not None or name in ("merge", "coarsen"), (name, e)
            out[name] = e.code

    def api() -> None:
        h = trainhist.open(p)
        for s in h.sites:
            sp = h.spine(s.path, s.stream, s.facet, phase="*")
            for i in range(len(sp)):
                sp.summary(i)
            h.presence(s.path, s.stream, s.facet)
            if s.stream != "scalar":
                sk = h.sketch(s.path, s.stream, s.facet, phase="*")
                for i in range(len(sk)):
                    sk.sketch(i)
        h.step_truth_rows()

    def merged(kind: str) -> None:
        dst = tmp_path / f"{p.stem}.{kind}.thist"
        if kind == "merge":
            trainhist.merge([p, other], dst, workers=1)
        else:
            trainhist.coarsen(p, dst, steps=2)
        trainhist.open(dst).verify()  # what merge writes, the reader takes

    run("api", api)
    run("verify", lambda: trainhist.open(p).verify())
    run("dump", lambda: dumps(trainhist.open(p)))
    run("merge", lambda: merged("merge"))
    run("coarsen", lambda: merged("coarsen"))
    return out


def test_base_file_reads_everywhere(tmp_path):
    p = tmp_path / "b.thist"
    _base(p)
    assert set(_surfaces(p, tmp_path).values()) == {"ok"}


def test_span_zero_is_refused(tmp_path):
    """Spec 7.5: a row spans at least one step (as in steps chunks)."""
    p = _mutant(tmp_path, "span0", lambda pl, c: _set(pl, c, "span", 0, 0))
    assert set(_surfaces(p, tmp_path).values()) == {"bad_span"}


def test_a_huge_span_is_read_with_work_bounded_by_the_rows(tmp_path):
    """A row may span 2**32 - 1 steps (a coarsened row): presence() answers for the steps asked without walking the
    span (it used to build a dict entry per covered step: MemoryError from a 2.6 KB file)."""
    p = _mutant(tmp_path, "span_huge", lambda pl, c: _set(pl, c, "span", 0, 2**32 - 1))
    h = trainhist.open(p)
    assert h.presence("a") == {0: "observed", 1: "observed", 2: "observed"}
    assert h.presence("a", steps=[2**32 - 2, 2**32 - 1, -1]) == {2**32 - 2: "observed", 2**32 - 1: "unknown",
                                                                 -1: "unknown"}
    surfaces = _surfaces(p, tmp_path)
    assert surfaces == {"api": "ok", "verify": "ok", "dump": "ok", "merge": "ok", "coarsen": "incompatible_span"}


def test_presence_of_coarsened_rows_covers_their_span(tmp_path):
    """A coarsened row answers for every step of its window when asked, by the precedence of spec 2.6."""
    src, dst = tmp_path / "s.thist", tmp_path / "c.thist"
    with trainhist.HistoryWriter(src, fsync="never") as w:
        a = w.site("a", "activation")
        for step in range(8):
            if step == 5:
                w.mark(a, step, "failed")
            else:
                w.observe(a, step, np.array([1.0], np.float32))
    trainhist.coarsen(src, dst, steps=4)
    h = trainhist.open(dst)
    assert h.presence("a") == {0: "observed", 4: "failed"}  # (a window with a failed row is failed: spec 11.4)
    got = h.presence("a", steps=range(10))
    assert got == {0: "observed", 1: "observed", 2: "observed", 3: "observed", 4: "failed", 5: "failed",
                   6: "failed", 7: "failed", 8: "unknown", 9: "unknown"}


def test_dtype_that_is_not_a_string_is_a_bad_chunk(tmp_path):
    def edit(pl: bytearray, cols: dict) -> None:
        i = bytes(pl).index(b"\xa4span\xa2u4")  # the span column's entry: dtype "u4" -> the array [1, 2]
        pl[i + 5 : i + 8] = b"\x92\x01\x02"

    p = _mutant(tmp_path, "dtype", edit)
    assert set(_surfaces(p, tmp_path).values()) == {"bad_chunk"}


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_non_finite_sum_without_exact_value_is_refused(tmp_path, value):
    """Spec 5.3: an observed row's non-finite f64 sum with no sum_x holds no sum; verify and dump used to pass it
    or fail deep inside with a ValueError."""
    p = _mutant(tmp_path, "suminf", lambda pl, c: _set(pl, c, "sum", 0, value))
    s = _surfaces(p, tmp_path)
    assert s == {"api": "bad_exact_value", "verify": "bad_exact_value", "dump": "bad_exact_value",
                 "merge": "bad_exact_value", "coarsen": "bad_exact_value"}


def test_a_missing_sketch_column_is_named_by_merge_too(tmp_path):
    def edit(pl: bytearray, cols: dict) -> None:
        i = bytes(pl).index(b"\xa5sk_on")  # renamed to an ignorable unknown column: sk_on is missing
        pl[i + 1 : i + 6] = b"x-_on"

    p = _mutant(tmp_path, "nosk", edit)
    assert set(_surfaces(p, tmp_path).values()) == {"missing_column"}


@pytest.mark.parametrize("column", ["sum_xn", "sumsq_xn", "sk"])
def test_an_optional_group_without_its_first_column_is_refused_by_merge_and_coarsen_too(tmp_path, column):
    """Spec 7.5: exact-sum columns come in pairs, the sketch columns all together (`missing_column`). Merge and
    coarsen (canonical.read_obs) checked `<name>_xn` without `<name>_x` but not the reverse, and the sketch group
    only when `sk` was there: they took `sum_x` without `sum_xn`, or the sketch columns without `sk`, and dropped
    them silently, where verify refuses the file (spec 11: with verify's code and offset)."""
    p = tmp_path / "x.thist"
    with trainhist.HistoryWriter(p, codec="raw", fsync="never", writer_id="a" * 32) as w:
        w.observe(w.site("a", "activation"), 0, np.array([2.0**60, 1.0, -3.0]))  # sums that need the exact form
    data = bytearray(p.read_bytes())
    pos, payload, cols = obs_payload(bytes(data), 0)
    assert {"sum_xn", "sumsq_xn", "sk"} <= set(cols)
    (mlen,) = struct.unpack_from("<I", payload)
    name = column.encode()
    i = payload.index(bytes([0xA0 | len(name)]) + name, 4, 4 + mlen)
    payload[i + 1 : i + 1 + len(name)] = b"x-" + name[2:]  # an ignorable unknown column now: `column` is missing
    rewrite(data, pos, bytes(payload))
    p.write_bytes(bytes(data))
    assert set(_surfaces(p, tmp_path).values()) == {"missing_column"}
    for fn in (lambda: trainhist.merge([p], tmp_path / "m.thist", workers=1),
               lambda: trainhist.coarsen(p, tmp_path / "c.thist", steps=2, workers=1)):
        with pytest.raises(TrainhistError) as e:
            fn()
        assert (e.value.code, e.value.offset) == ("missing_column", pos), e.value


@pytest.mark.parametrize("column", ["applied", "grad_basis", "clipped"])
def test_unknown_step_truth_codes_are_refused_by_merge_too(tmp_path, column):
    """Merge used to copy an unknown step-truth code into a file the reader then refused."""
    p = _mutant(tmp_path, "code", lambda pl, c: _set(pl, c, column, 0, 255), steps=True)
    assert set(_surfaces(p, tmp_path).values()) == {"unknown_code"}



@pytest.mark.parametrize("column,value", [("nan", 2**64 - 1), ("zero", 4), ("min", 1e300), ("max", -1e300),
                                          ("min", np.nan), ("max", np.inf), ("presence", 2), ("presence", 4)])
def test_rows_no_tensor_could_give_are_bad_row_everywhere(tmp_path, column, value):
    """Spec 5.5: counts beyond count, min above max or not finite, numbers on a row that is not observed; the
    reader's batch and per-chunk paths and merge name the same chunk."""
    p = _mutant(tmp_path, "row", lambda pl, c: _set(pl, c, column, 0, value))
    s = _surfaces(p, tmp_path)
    assert s == {"api": "bad_row", "verify": "bad_row", "dump": "bad_row", "merge": "bad_row", "coarsen": "bad_row"}
    with pytest.raises(TrainhistError) as ei:
        trainhist.open(p).spine("a")
    assert ei.value.offset == records(p.read_bytes(), RecordType.OBS)[0]


def test_a_row_without_finite_values_but_with_sums_is_bad_row_everywhere(tmp_path):
    """Spec 5.5 rule 3: the sums of no finite value are 0. Such a row (every element NaN, sums kept) used to be
    read and shown as stored."""
    def edit(pl: bytearray, cols: dict) -> None:
        _set(pl, cols, "nan", 0, 3)  # (the row's three elements)
        for name in ("min", "max"):
            _set(pl, cols, name, 0, np.nan)

    p = _mutant(tmp_path, "nofinite", edit)
    s = _surfaces(p, tmp_path)
    assert s == {"api": "bad_row", "verify": "bad_row", "dump": "bad_row", "merge": "bad_row", "coarsen": "bad_row"}


@pytest.mark.parametrize("case", ["bad_row_no_finite_exact_sums", "bad_row_not_observed_exact_sums"])
def test_a_tiny_exact_sum_in_a_row_without_numbers_is_bad_row_everywhere(tmp_path, case):
    """Spec 5.5 rules 3 and 4 on the exact forms: a row without finite values, or not observed, whose f64 sums are
    +0.0 but whose sum_x holds 2^-1100. Merge and coarsen used to take it (they checked the f64 columns only) and
    write a file the reader then refused with bad_row. (The dump of the absent row reads no sum: that check is lazy,
    spec 8, so only verify and the conformance read refuse it there.)"""
    src = Path(__file__).resolve().parent.parent / "conformance" / "vectors" / "invalid" / case / "input.thist"
    p = tmp_path / "tiny.thist"
    p.write_bytes(src.read_bytes())
    surfaces = {"verify": lambda: trainhist.open(p).verify(), "dump": lambda: dumps(trainhist.open(p)),
                "merge": lambda: trainhist.merge([p], tmp_path / "m.thist"),
                "coarsen": lambda: trainhist.coarsen(p, tmp_path / "c.thist", steps=2)}
    if "not_observed" in case:
        del surfaces["dump"]
    for name, fn in surfaces.items():
        with pytest.raises(TrainhistError) as ei:
            fn()
        assert ei.value.code == "bad_row", name
        assert ei.value.offset == records(p.read_bytes(), RecordType.OBS)[0] and "row 0" in str(ei.value), name
    assert not (tmp_path / "m.thist").exists() and not (tmp_path / "c.thist").exists()


def test_the_writer_refuses_a_summary_without_finite_values_but_with_sums(tmp_path):
    """What the reader refuses (spec 5.5 rule 3) the writer does not write; zero sums (of either form) pass."""
    from trainhist.dyadic import Dyadic
    from trainhist.errors import UsageError
    from trainhist.summary import Summary

    with trainhist.HistoryWriter(tmp_path / "w.thist", fsync="never") as w:
        a = w.site("a", "activation")
        for sums in ((Dyadic(5, 0), Dyadic(0, 0)), (Dyadic(0, 0), Dyadic(1, -1100))):
            with pytest.raises(UsageError, match="zero sums"):
                w.observe(a, 0, summary=Summary(count=2, nan=2, sum=sums[0], sumsq=sums[1]))
        w.observe(a, 0, summary=Summary(count=2, nan=1, pinf=1))
    assert trainhist.open(tmp_path / "w.thist").verify()["rows"] == 1


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_a_pipe_or_directory_is_refused_without_waiting(tmp_path):
    """Opening a FIFO for reading used to wait for a writer forever (every CLI command hung)."""
    fifo = tmp_path / "pipe.thist"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):
        with pytest.raises(TrainhistError) as ei:
            trainhist.open(path)
        assert ei.value.code == "not_a_file"
    assert cli.main(["info", str(fifo)]) == 1


def test_a_missing_file_or_a_directory_is_a_typed_error_that_is_still_an_os_error(tmp_path):
    """trainhist.open("missing") raised a bare FileNotFoundError though every error is a TrainhistError with a
    code: now `not_found` (still a FileNotFoundError, errno and filename set), and a directory `not_a_file` (an
    IsADirectoryError too); the writer says the same of a missing folder and of a directory."""
    import errno

    missing, nofolder = tmp_path / "missing.thist", tmp_path / "no" / "such" / "x.thist"
    for open_ in (trainhist.open, lambda p: trainhist.merge([p], tmp_path / "m.thist"),
                  lambda p: trainhist.coarsen(p, tmp_path / "c.thist", steps=2)):
        for path, says in ((missing, "check the path"), (nofolder, "does not exist either")):
            with pytest.raises(FileNotFoundError) as ei:
                open_(path)
            e = ei.value
            assert isinstance(e, TrainhistError) and e.code == "not_found" and e.path == str(path), e
            assert e.errno == errno.ENOENT and e.filename == str(path) and says in str(e)
            assert str(e).startswith(f"[not_found] {path}: no such file")
        with pytest.raises(IsADirectoryError) as ei:
            open_(tmp_path)
        assert isinstance(ei.value, TrainhistError) and ei.value.code == "not_a_file"
        assert ei.value.errno == errno.EISDIR and str(ei.value).startswith(f"[not_a_file] {tmp_path}: a directory")
    with pytest.raises(FileNotFoundError) as ei:
        trainhist.HistoryWriter(nofolder)
    assert ei.value.code == "not_found" and "create it first" in str(ei.value)
    with pytest.raises(IsADirectoryError) as ei:
        trainhist.HistoryWriter(tmp_path)
    assert ei.value.code == "not_a_file" and "give a file name" in str(ei.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # (nothing written)
    assert cli.main(["info", str(missing)]) == 1


def test_presence_of_a_segment_the_file_lacks_is_refused(tmp_path):
    """presence(segment=5) of a file whose segments are 0 and 1 answered every step `unknown`: a typo read as a
    history of gaps. Now a UsageError naming the segments there are; a segment of the file without rows of the
    site answers as before."""
    p = tmp_path / "s.thist"
    with trainhist.HistoryWriter(p, fsync="never") as w:
        a = w.site("a", "activation")
        w.observe(a, 0, np.ones(2, np.float32))
        w.step_truth(0, applied=True)
        w.new_segment(first_step=1)
        w.step_truth(1, applied=True)
    h = trainhist.open(p)
    for bad in (5, -1, "0", 1.0, True):
        with pytest.raises(trainhist.UsageError) as ei:
            h.presence("a", steps=[0, 1], segment=bad)
        assert ei.value.code == "unknown_segment" and "its segments: 0, 1" in str(ei.value), bad
    assert h.presence("a", steps=[0, 1], segment=0) == {0: "observed", 1: "unknown"}
    assert h.presence("a", steps=[0, 1], segment=1) == {0: "unknown", 1: "unknown"}  # (step 1 was due: no row)


def test_merge_and_coarsen_never_replace_an_input_or_a_special_file(tmp_path):
    """The output is written beside its path and renamed over it: an output naming an input (under any name) would
    have replaced the input (it did, exit 0), and a FIFO or device would have become a regular file."""
    a = tmp_path / "a.thist"
    data = _base(a)
    link = tmp_path / "link.thist"
    link.symlink_to(a)
    for out in (a, tmp_path / "." / "a.thist", link):
        with pytest.raises(TrainhistError) as ei:
            trainhist.merge([a], out)
        assert ei.value.code == "output_is_input"
        with pytest.raises(TrainhistError) as ei:
            trainhist.coarsen(a, out, steps=2)
        assert ei.value.code == "output_is_input"
    assert cli.main(["merge", str(a), "-o", str(a)]) == 2
    assert a.read_bytes() == data
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "out.fifo"
        os.mkfifo(fifo)
        with pytest.raises(TrainhistError) as ei:
            trainhist.merge([a], fifo)
        assert ei.value.code == "bad_output" and stat.S_ISFIFO(os.stat(fifo).st_mode)
    for out in (tmp_path, tmp_path / "no" / "such" / "m.thist", tmp_path / "a.thist" / "m.thist"):
        with pytest.raises(TrainhistError) as ei:
            trainhist.merge([a], out)
        assert ei.value.code == "bad_output" and ".tmp" not in str(ei.value)
    left = sorted(p.name for p in tmp_path.iterdir())  # (no output, no temporary file)
    assert left == ["a.thist", "link.thist", "out.fifo"][: 3 if hasattr(os, "mkfifo") else 2]


def test_an_output_that_cannot_be_written_is_named_not_its_temporary_file(tmp_path, monkeypatch):
    """A folder that refuses new files (/proc) and a file system that fills up while the output is written: merge and
    coarsen raised the OSError of a hidden temporary file the user never named; now `output_unwritable` on the
    output, with nothing left behind. An input that fails to read is not relabelled as an output problem."""
    import errno

    from trainhist import canonical

    a = tmp_path / "a.thist"
    _base(a)
    if os.path.isdir("/proc/self"):
        with pytest.raises(TrainhistError) as ei:
            trainhist.merge([a], "/proc/trainhist-out.thist")
        assert ei.value.code == "output_unwritable" and ei.value.path == "/proc/trainhist-out.thist"
    real_close = canonical.CanonicalWriter.close

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(canonical.CanonicalWriter, "close", full)
    for run in (lambda: trainhist.merge([a], tmp_path / "m.thist"),
                lambda: trainhist.coarsen(a, tmp_path / "m.thist", steps=2)):
        with pytest.raises(TrainhistError) as ei:
            run()
        assert ei.value.code == "output_unwritable" and "No space left" in str(ei.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.thist"]
    monkeypatch.setattr(canonical.CanonicalWriter, "close", real_close)
    real_open = os.open

    def unreadable(path, *args, **kwargs):
        if os.fspath(path) == str(a):
            raise OSError(errno.EIO, "Input/output error", str(a))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", unreadable)
    with pytest.raises(Exception) as ei:
        trainhist.merge([a], tmp_path / "m.thist")
    assert getattr(ei.value, "code", None) != "output_unwritable" and "Input/output error" in str(ei.value)


def test_the_ignored_sketch_fields_of_a_row_without_a_sketch_stay_ignored(tmp_path):
    """Spec 7.5: a row with sk = 0 has no ranges or bands; readers ignore what it stores there. Coarsen added such
    a row's bands into the combined row's sketch (wrong counts), and merge checked its range against the bins (a
    file the reader accepts, refused)."""
    from history_helpers import obs_payload, rewrite

    p = tmp_path / "a.thist"
    with trainhist.HistoryWriter(p, codec="raw") as w:
        s = w.site("x", "activation")
        w.observe(s, 0, np.array([1e9, 2.0]))
        w.observe(s, 1, np.array([1e9, 3.0]), sketch=False)
    data = bytearray(p.read_bytes())
    pos, payload, cols = obs_payload(bytes(data), 0)
    struct.pack_into("<Q", payload, cols["sk_up"][3] + 8, 5)  # row 1 (sk = 0): a band of 5
    struct.pack_into("<H", payload, cols["sk_plo"][3] + 2, 65535)  # and a range start past the bins
    rewrite(data, pos, bytes(payload))
    p.write_bytes(data)
    with trainhist.open(p) as h:
        assert h.verify()["rows"] == 2 and h.sketch("x").bands.tolist() == [[0, 0, 1, 0]]
    trainhist.merge([p], tmp_path / "m.thist")
    trainhist.coarsen(p, tmp_path / "c.thist", steps=2)
    for out in ("m.thist", "c.thist"):
        with trainhist.open(tmp_path / out) as h:
            assert h.sketch("x").bands.tolist() == [[0, 0, 1, 0]], out


def test_replicas_compare_what_the_rows_say_not_how_a_zero_or_a_nan_is_stored(tmp_path):
    """Spec 11.5: replica rows are compared as numbers. A rank that stores a zero sum as -0.0 (readers accept it, spec
    5.5) was a replica divergence; a NaN min of a row without finite values is no number at all. The merged row
    holds +0.0 and the canonical NaN."""
    from history_helpers import obs_payload, rewrite

    files = []
    for rank in range(2):
        p = tmp_path / f"r{rank}.thist"
        with trainhist.HistoryWriter(p, run_id="ab" * 16, rank=rank, world_size=2, codec="raw") as w:
            s = w.site("w", "param", sharing="replica")
            w.observe(s, 0, np.array([np.nan, np.nan]))
            w.observe(s, 1, np.array([0.0, 0.0]))
        files.append(p)
    data = bytearray(files[1].read_bytes())
    pos, payload, cols = obs_payload(bytes(data), 0)
    struct.pack_into("<Q", payload, cols["min"][3], 0x7FF8000000000001)
    struct.pack_into("<d", payload, cols["sum"][3] + 8, -0.0)
    rewrite(data, pos, bytes(payload))
    files[1].write_bytes(data)
    trainhist.merge(files, tmp_path / "m.thist")
    text = dumps(trainhist.open(tmp_path / "m.thist"))
    assert '"sum":"d:0p0"' in text and "7ff8000000000001" not in text


def test_a_window_that_would_start_before_the_least_step_is_refused_not_wrapped(tmp_path):
    """Coarsening by 3 a row at step -2**63 (window start -2**63 - 2): the step wrapped around to 2**63 - 2, and
    the row moved to the far end of the run. Rows, step-truth rows and a segment's first step: step_overflow."""
    cases = {"first": (-2**63, None), "row": (5, -2**63), "steps": (5, None)}
    for name, (first, later) in cases.items():
        p = tmp_path / f"{name}.thist"
        with trainhist.HistoryWriter(p) as w:
            s = w.site("x", "activation")
            w.observe(s, first, np.ones(3))
            if later is not None:
                w.observe(s, later, np.ones(3))
            if name == "steps":
                w.step_truth(-2**63, applied=True)
        with pytest.raises(TrainhistError) as ei:
            trainhist.coarsen(p, tmp_path / "c.thist", steps=3)
        assert ei.value.code == "step_overflow", name
        trainhist.coarsen(p, tmp_path / "c.thist", steps=4)  # (a power of two divides 2**63: it fits)
        with trainhist.open(tmp_path / "c.thist") as h:
            assert h.spine("x").step.min() >= -2**63 and (h.spine("x").step <= 5).all(), name


def test_a_lying_variable_column_is_refused_before_it_is_decoded(tmp_path):
    """sk_counts stored as an 8-byte constant frame-of-reference block that declares 256 MiB (within the column
    limit of spec 12) while the sketch ranges use 40 values: every surface refuses it (bad_sketch) from the
    declared size, before decoding it (it used to allocate the 256 MiB first)."""
    import sys
    import tracemalloc

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gen_vectors as gv

    from trainhist.chunk import Codec

    recs = gv.parse(_base(tmp_path / "base.thist"))

    def bomb(meta: dict, cols: list) -> None:
        c = gv.col(cols, "sk_counts")
        c.codec, c.block, c.raw = Codec.FOR, struct.pack("<Q", 1), 256 << 20

    gv.edit_chunk(gv.first(recs, RecordType.OBS), bomb)
    p = tmp_path / "bomb.thist"
    p.write_bytes(gv.build(recs)[0])
    tracemalloc.start()
    try:
        assert set(_surfaces(p, tmp_path).values()) == {"bad_sketch"}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def test_the_writer_refuses_rows_the_reader_would_refuse(tmp_path):
    """A Summary or SpineTable row that breaks spec 5.5 is a UsageError at observe(), not a site made unreadable
    after its commit (reversed signed zeros, NaN or infinite extremes, counts above count)."""
    from trainhist.errors import UsageError
    from trainhist.summary import SpineTable, Summary

    bad = [Summary(count=1), Summary(count=2, zero=2, min=0.0, max=-0.0), Summary(count=1, min=np.inf, max=np.inf),
           Summary(count=1, nan=1, min=1.0, max=1.0), Summary(count=1, nan=1, zero=1)]
    with trainhist.HistoryWriter(tmp_path / "w.thist", fsync="never") as w:
        s = w.site("x", "activation")
        for summ in bad:
            with pytest.raises(UsageError) as e:
                w.observe(s, 0, summary=summ)
            assert e.value.code == "bad_summary" and "no tensor could give (spec 5.5)" in str(e.value)
        w.observe(s, 0, summary=Summary(count=2, zero=2, min=-0.0, max=0.0))  # (total order: fine)
        one = dict(count=np.array([2]), nan=np.array([0]), pinf=np.array([0]), ninf=np.array([0]),
                   zero=np.array([2]), sum=np.array([0.0]), sumsq=np.array([0.0]), method=np.array([1]))
        with pytest.raises(UsageError) as e:
            w.observe_spines([s], 1, SpineTable(min=np.array([0.0]), max=np.array([-0.0]), **one))
        assert e.value.code == "bad_table" and "SpineTable (row 0) that no tensor could give" in str(e.value)
        w.observe_spines([s], 1, SpineTable(min=np.array([-0.0]), max=np.array([0.0]), **one))
    h = trainhist.open(tmp_path / "w.thist")
    assert h.spine("x").step.tolist() == [0, 1] and h.verify()["rows"] == 2


def test_replica_rows_coarsened_to_different_windows_are_refused_not_added(tmp_path):
    """Two ranks' copies of one parameter coarsened by 2 and by 4, then merged: the rows cover the same steps under
    different spans and merge kept both, so coarsening the result counted the tensor twice (spec 11.5)."""
    files = []
    for rank, n in ((0, 2), (1, 4)):
        p = tmp_path / f"r{rank}.thist"
        with trainhist.HistoryWriter(p, run_id="cd" * 16, rank=rank, world_size=2) as w:
            s = w.site("w", "param", sharing="replica")
            for st in range(8):
                w.observe(s, st, np.ones(4))
        trainhist.coarsen(p, tmp_path / f"c{rank}.thist", steps=n)
        files.append(tmp_path / f"c{rank}.thist")
    with pytest.raises(TrainhistError) as ei:
        trainhist.merge(files, tmp_path / "m.thist")
    assert ei.value.code == "incompatible_span" and "count the replicated tensor twice" in str(ei.value)


@pytest.mark.parametrize("batch_rows", [4, 10**6])
def test_replica_rows_of_different_spans_are_refused_across_sweep_batches(tmp_path, monkeypatch, batch_rows):
    """The check of spec 11.5 ran inside one sweep batch of the merge: once the overlapping rows fell in two
    batches (inputs of more than BATCH_ROWS rows) they were added, and the output counted the replica twice."""
    import sys

    merge_mod = sys.modules["trainhist.merge"]
    monkeypatch.setattr(merge_mod, "BATCH_ROWS", batch_rows)
    run = "ab" * 16
    a0, b, ok = tmp_path / "a0.thist", tmp_path / "b.thist", tmp_path / "ok.thist"
    with trainhist.HistoryWriter(a0, run_id=run, rank=0, world_size=2) as w:
        s = w.site("emb", "param", sharing="replica")
        for st in list(range(10, 20)) + list(range(40, 50)):
            w.observe(s, st, np.ones(1))
    a = tmp_path / "a.thist"
    trainhist.coarsen(a0, a, steps=10)  # rows (10, span 10) and (40, span 10), in one chunk
    for path, late in ((b, range(41, 50)), (ok, range(50, 55))):
        with trainhist.HistoryWriter(path, run_id=run, rank=1, world_size=2) as w:
            s = w.site("emb", "param", sharing="replica")
            for st in [x for x in range(30) if not 10 <= x < 20]:
                w.observe(s, st, np.ones(1))
            w.commit()  # (a chunk of its own: a later sweep batch than A's chunk, with BATCH_ROWS small)
            for st in late:
                w.observe(s, st, np.ones(1))
    with pytest.raises(TrainhistError) as ei:
        trainhist.merge([a, b], tmp_path / "m.thist")
    assert ei.value.code == "incompatible_span" and "step 40 (span 10) and step 41 (span 1)" in str(ei.value)
    assert not (tmp_path / "m.thist").exists()
    # rows of several steps that overlap nothing in a later batch pass, with the same bytes whatever the batches
    trainhist.merge([a, ok], tmp_path / "m2.thist")
    sp = trainhist.open(tmp_path / "m2.thist").spine("emb", "param")
    assert list(zip(sp.step.tolist(), sp.span.tolist())) == (
        [(x, 1) for x in range(10)] + [(10, 10)] + [(x, 1) for x in range(20, 30)] + [(40, 10)]
        + [(x, 1) for x in range(50, 55)])
    monkeypatch.setattr(merge_mod, "BATCH_ROWS", 10**6 if batch_rows == 4 else 4)
    trainhist.merge([a, ok], tmp_path / "m3.thist")
    assert (tmp_path / "m3.thist").read_bytes() == (tmp_path / "m2.thist").read_bytes()


def test_cli_merge_of_a_torn_input_exits_3_and_triage_shows_windows(tmp_path, capsys):
    """merge and coarsen exited 0 on a torn input (verify, info and triage exit 3); the triage named a coarsened
    window by its first step only ("at step 10" for a NaN at step 13)."""
    p = tmp_path / "a.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("x", "activation")
        for st in range(20):
            w.observe(s, st, np.array([np.nan if st == 13 else 1.0]))
    data = p.read_bytes()
    torn = tmp_path / "t.thist"
    torn.write_bytes(data + b"\x01" * 7)  # (an incomplete record after the last commit)
    assert cli.main(["merge", str(torn), "-o", str(tmp_path / "m.thist")]) == 3
    assert cli.main(["coarsen", str(p), "-o", str(tmp_path / "c.thist"), "--steps", "10"]) == 0
    capsys.readouterr()
    assert cli.main(["triage", str(tmp_path / "c.thist")]) == 0
    assert "steps 10–19" in capsys.readouterr().out


def test_ranks_whose_segments_start_at_different_steps_are_reported(tmp_path, capsys):
    """Rank 1's first resume died before its first commit: its later segment is numbered one lower than rank 0's
    and merge (which matches segments by number, spec 11.3) splits those steps across two segments; it said
    nothing. The report and the command line now name the disagreement."""
    starts = {0: (10, 15), 1: (15,)}
    paths = []
    for rank, resumes in starts.items():
        p = tmp_path / f"r{rank}.thist"
        with trainhist.HistoryWriter(p, run_id="ef" * 16, rank=rank, world_size=2) as w:
            s = w.site("x", "activation")
            w.observe(s, 0, np.ones(2))
            for first in resumes:
                w.new_segment(first, "resume")
                w.observe(s, first, np.ones(2))
        paths.append(str(p))
    rep = trainhist.merge(paths, tmp_path / "m.thist")
    assert [m["segment"] for m in rep.segment_mismatches] == [1]
    assert cli.main(["merge", *paths, "-o", str(tmp_path / "m2.thist")]) == 0
    assert "start at different steps (10 in" in capsys.readouterr().out


def test_a_replica_divergence_names_the_row_and_the_fields(tmp_path):
    """The message named only the site, segment and step: not the phase (only post_clip differed) nor what."""
    files = []
    for rank in range(2):
        p = tmp_path / f"r{rank}.thist"
        with trainhist.HistoryWriter(p, run_id="ab" * 16, rank=rank, world_size=2) as w:
            s = w.site("w", "param", sharing="replica")
            w.observe(s, 0, np.ones(3))
            w.observe(s, 1, np.ones(3) * (1 + rank), phase="post_clip")
        files.append(p)
    with pytest.raises(TrainhistError) as ei:
        trainhist.merge(files, tmp_path / "m.thist")
    assert "step 1, phase post_clip: replica site rows differ in min, max, sum, sumsq" in str(ei.value)
    rep = trainhist.merge(files, tmp_path / "m2.thist", replica_divergence="report")
    assert rep.divergences[0]["row"] == "step 1, phase post_clip" and "min" in rep.divergences[0]["fields"]


def test_a_step_truth_overflow_names_its_step(tmp_path):
    files = []
    for rank in range(2):
        p = tmp_path / f"r{rank}.thist"
        with trainhist.HistoryWriter(p, run_id="ab" * 16, rank=rank, world_size=2) as w:
            w.step_truth(2, tokens=5)
            w.step_truth(3, tokens=2**63)
        files.append(p)
    with pytest.raises(TrainhistError) as ei:
        trainhist.merge(files, tmp_path / "m.thist")
    assert ei.value.code == "count_overflow" and "step 3: step-truth tokens overflows" in str(ei.value)


def _resumed(p: Path, failed_at: int | None = None) -> Path:
    """Steps 0-5 (one of them failed, if asked), then a resume at step 3 that records steps 3-5 again."""
    with trainhist.HistoryWriter(p) as w:
        s = w.site("x", "activation")
        for st in range(6):
            (w.mark(s, st, "failed") if st == failed_at else w.observe(s, st, np.ones(2)))
            w.step_truth(st, applied=True)
        w.new_segment(3, "resume")
        for st in range(3, 6):
            w.observe(s, st, np.ones(2))
            w.step_truth(st, applied=True)
    return p


def test_reader_arguments_are_checked_and_info_counts_distinct_steps(tmp_path, capsys):
    """sketch(i) out of range raised numpy's IndexError; presence(steps="12") read the string as steps 1 and 2;
    info counted a step that a resumed segment recorded again twice."""
    p = _resumed(tmp_path / "r.thist")
    with trainhist.open(p) as h:
        sk = h.sketch("x")
        with pytest.raises(TrainhistError) as ei:
            sk.sketch(len(sk))
        assert ei.value.code == "bad_index"
        for bad in ("12", [1.5]):
            with pytest.raises(TrainhistError) as ei:
                h.presence("x", steps=bad)
            assert ei.value.code == "bad_steps"
    assert cli.main(["info", str(p)]) == 0
    assert "steps     6 with step truth (3 of them again in a later segment), 0..5" in capsys.readouterr().out


def test_info_shows_the_steps_of_the_rows_as_well_as_the_step_truth(tmp_path, capsys):
    """A file with one step-truth row and 100 observed steps said 'steps 1 recorded, 0..0'; one with scalars alone
    said nothing of its steps. The rows' steps come from the commit entries (nothing decoded)."""
    p = tmp_path / "i.thist"
    with trainhist.HistoryWriter(p) as w:
        w.step_truth(0, applied=True)
        s = w.site("a", "activation")
        for st in range(100):
            w.observe(s, st, np.ones(4))
            w.scalar("loss", st, 1.0)
    assert cli.main(["info", str(p)]) == 0
    out = capsys.readouterr().out
    assert "steps     1 with step truth, 0..0" in out and "rows      200 starting at steps 0..99" in out


def test_the_numbers_of_a_row_without_numbers_are_refused_not_zero(tmp_path):
    """sum_exact(i) of a failed row returned Dyadic(0) and summary(i) a count of 0: missing is never zero."""
    p = tmp_path / "f.thist"
    with trainhist.HistoryWriter(p) as w:
        s = w.site("x", "activation")
        w.observe(s, 0, np.ones(2))
        w.mark(s, 1, "failed")
    with trainhist.open(p) as h:
        sp = h.spine("x")
        assert sp.sum_exact(0) == trainhist.summarize(np.ones(2)).sum
        for call in (sp.sum_exact, sp.sumsq_exact, sp.summary):
            with pytest.raises(TrainhistError) as ei:
                call(1)
            assert ei.value.code == "not_observed" and "failed" in str(ei.value)


def test_presence_keeps_segments_apart_and_knows_the_steps_of_a_coarsened_window(tmp_path):
    """A run resumed at step 3 recorded steps 3-5 again: presence() merged both segments (step 5 read 'failed'
    from the first one). In a coarsened file, the steps inside a step-truth window read 'unknown' though the
    window says they were recorded (and not due)."""
    p = _resumed(tmp_path / "r.thist", failed_at=5)
    with trainhist.open(p) as h:
        with pytest.raises(TrainhistError) as ei:
            h.presence("x")
        assert ei.value.code == "segment_ambiguous"
        assert h.presence("x", steps=[5], segment=0) == {5: "failed"}
        assert h.presence("x", steps=[5], segment=1) == {5: "observed"}
        assert h.presence("x", steps=[1], segment=1) == {1: "unknown"}
    from history_helpers import coarsened_sparse

    with trainhist.open(coarsened_sparse(tmp_path, "y", "c.thist")) as h:
        assert h.presence("y", steps=range(4, 8)) == dict.fromkeys(range(4, 8), "not_scheduled")


def test_ranks_recorded_with_different_settings_are_reported(tmp_path, capsys):
    """Two ranks of one run whose collectors had different cadences: merge combines what each recorded, so a step
    only one rank recorded holds its rows alone; the report and the command line name the settings that differ."""
    paths = []
    for rank, every in ((0, 1), (1, 2)):
        p = tmp_path / f"r{rank}.thist"
        with trainhist.HistoryWriter(p, run_id="ef" * 16, rank=rank, world_size=2,
                                     settings={"every": every, "streams": ["activation"]}) as w:
            s = w.site("x", "activation")
            for step in range(0, 4, every):
                w.observe(s, step, np.ones(2))
        paths.append(str(p))
    rep = trainhist.merge(paths, tmp_path / "m.thist")
    assert [(m["segment"], m["keys"]) for m in rep.settings_mismatches] == [(0, ["every"])]
    assert cli.main(["merge", *paths, "-o", str(tmp_path / "m2.thist")]) == 0
    assert "recorded with different settings (every)" in capsys.readouterr().out
    same = []
    for rank in (0, 1):  # the same settings: nothing to report
        p = tmp_path / f"s{rank}.thist"
        with trainhist.HistoryWriter(p, run_id="ab" * 16, rank=rank, world_size=2, settings={"every": 1}) as w:
            w.observe(w.site("x", "activation"), 0, np.ones(2))
        same.append(str(p))
    assert trainhist.merge(same, tmp_path / "m3.thist").settings_mismatches == []


def test_open_refuses_what_is_not_a_path() -> None:
    import pytest

    from trainhist.errors import UsageError

    for bad in (None, 3, ["a.thist"]):
        with pytest.raises(UsageError) as e:
            trainhist.open(bad)
        assert e.value.code == "bad_path"


def test_junk_appended_after_the_last_commit_names_the_intact_prefix(tmp_path):
    """Bytes appended to a closed file fail the record header check (spec 8: corruption, not a torn tail); the
    error names the committed size that reads correctly and how to recover it, and truncating does."""
    import pytest

    from trainhist.errors import CorruptError

    p = tmp_path / "j.thist"
    with trainhist.HistoryWriter(p) as w:
        w.observe(w.site("a", "activation"), 0, np.ones(4))
    good = p.read_bytes()
    p.write_bytes(good + bytes(range(1, 81)))
    with pytest.raises(CorruptError) as e:
        trainhist.open(p)
    assert e.value.code == "bad_record_header" and f"truncating the file to {len(good)} bytes" in str(e.value)
    with open(p, "r+b") as f:
        f.truncate(len(good))
    assert trainhist.open(p).spine("a", "activation").step.tolist() == [0]


def test_a_steps_chunk_whose_steps_disagree_with_its_commit_entry_is_a_bad_chunk(tmp_path):
    """Spec 7.2: the step range of a commit entry is checked against the chunk, steps chunks included (merge
    already checked it; the reader did not)."""
    def edit(payload: bytearray, cols: dict) -> None:
        _set(payload, cols, "step", 0, 99)

    p = _mutant(tmp_path, "steps_range", edit, steps=True)
    got = _surfaces(p, tmp_path)
    assert got == {k: "bad_chunk" for k in got}, got


def test_a_raw_length_that_is_not_a_multiple_of_the_item_size_is_a_bad_chunk():
    """Spec 7.4: `raw` not a multiple of the item size is bad_chunk (column_too_large is the 512 MiB limit only),
    for a variable-length column as for a fixed-width one."""
    from trainhist.chunk import decode_chunk

    def chunk(name: str, dt: str, raw: int, rows: int) -> memoryview:
        entry = [name, dt, 0, 0, raw, raw]
        for _ in range(3):
            d = msgpack.packb({"rows": rows, "cols": [entry]})
            entry[3] = 4 + len(d) + (-(4 + len(d)) % 8)
        d = msgpack.packb({"rows": rows, "cols": [entry]})
        head = struct.pack("<I", len(d)) + d
        head += b"\0" * (-len(head) % 8)
        return memoryview(head + b"\0" * raw + b"\0" * (-raw % 8))

    for name, dt, variable in (("count", "u8", frozenset()), ("sk_counts", "u8", frozenset({"sk_counts"}))):
        with pytest.raises(TrainhistError) as e:
            decode_chunk(chunk(name, dt, 11, 1), 0, None, {name: dt}, variable)
        assert e.value.code == "bad_chunk", e.value


def test_the_dump_puts_a_null_facet_before_an_empty_one(tmp_path):
    """Spec 10: sites sorted by (path, stream, facet) with a null facet first, even before "" declared earlier."""
    import json

    p = tmp_path / "f.thist"
    with trainhist.HistoryWriter(p, fsync="never") as w:
        w.observe(w.site("a", "activation", facet=""), 0, np.ones(2))
        w.observe(w.site("a", "activation"), 0, np.ones(3))
    assert [s["facet"] for s in json.loads(dumps(trainhist.open(p)))["sites"]] == [None, ""]


def test_errors_of_the_file_header_name_offset_0(tmp_path):
    """Spec 8, Offsets: an error of the file header names offset 0, whichever field fails (the reader named the
    field's offset, 8 or 12, for a newer read version and an unknown required feature)."""
    from dataclasses import replace

    from trainhist.framing import FileHeader

    good = _base(tmp_path / "h.thist")
    h = FileHeader.unpack(good[:32])
    for code, fields in (("unsupported_read_version", dict(read_version=2, write_version=2)),
                         ("unsupported_feature", dict(required_features=1))):
        p = tmp_path / f"{code}.thist"
        p.write_bytes(replace(h, **fields).pack() + good[32:])
        with pytest.raises(TrainhistError) as e:
            trainhist.open(p)
        assert (e.value.code, e.value.offset) == (code, 0), e.value


def _mixed_scales(tmp_path: Path, which: int) -> tuple[Path, int]:
    """A site of three chunks (scale 2), chunk ``which`` rewritten to scale 1; and the offset `mixed_scale` names."""
    p = tmp_path / "m.thist"
    with trainhist.HistoryWriter(p, codec="raw", fsync="never") as w:
        a = w.site("a", "activation")
        for step in range(3):  # bins inside the window at scale 1 as at scale 2
            w.observe(a, step, np.array([2.0**-40, -(2.0**-40), 3 * 2.0**-40]))
            w.commit()
    data = bytearray(p.read_bytes())
    pos, payload, _ = obs_payload(bytes(data), which)
    (mlen,) = struct.unpack_from("<I", payload)
    i = payload.index(b"\xa5scale\x02", 4, 4 + mlen)
    payload[i + 6] = 1
    rewrite(data, pos, bytes(payload))
    p.write_bytes(bytes(data))
    return p, records(bytes(data), RecordType.OBS)[max(which, 1)]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_mixed_scales_name_the_first_chunk_that_disagrees_with_the_first(tmp_path, which):
    """Spec 8, Offsets: `mixed_scale` names the first of a site's chunks, in file order, whose scale differs from
    the first chunk's: the second chunk when the first or the second is the odd one, else the third."""
    p, want = _mixed_scales(tmp_path, which)
    for fn in (lambda: trainhist.open(p).verify(), lambda: trainhist.open(p).sketch("a", "activation"),
               lambda: dumps(trainhist.open(p))):
        with pytest.raises(TrainhistError) as e:
            fn()
        assert (e.value.code, e.value.offset) == ("mixed_scale", want), e.value


@pytest.mark.parametrize("which", [0, 1, 2])
def test_mixed_scales_are_refused_by_merge_and_coarsen_as_verify_refuses_them(tmp_path, which):
    """Spec 11: an input a full check refuses is refused with that check's code and offset. A site of one input
    whose chunks mix scales used to be refused by merge and ``coarsen --steps`` as ``incompatible_grid`` (no
    offset), and ACCEPTED by ``coarsen --bins-per-octave 1``, which brings every chunk to one scale; a clean file
    at another scale merged with it (``incompatible_grid`` across inputs, 11.2) must not hide it either."""
    p, want = _mixed_scales(tmp_path, which)
    fine, other, coarse = tmp_path / "fine.thist", tmp_path / "other.thist", tmp_path / "coarse.thist"
    for q, wid in ((fine, "f"), (other, "e")):
        with trainhist.HistoryWriter(q, codec="raw", fsync="never", writer_id=wid * 32) as w:
            w.observe(w.site("a", "activation"), 0, np.array([2.0**-40]))
    trainhist.coarsen(other, coarse, bins_per_octave=1)
    out = tmp_path / "out.thist"
    calls = {"merge": lambda: trainhist.merge([p], out, workers=1),
             "merge, a file at scale 2 first": lambda: trainhist.merge([fine, p], out, workers=1),
             "merge, a file at scale 0 first": lambda: trainhist.merge([coarse, p], out, workers=1),
             "coarsen --steps 2": lambda: trainhist.coarsen(p, out, steps=2, workers=1),
             "coarsen --bins-per-octave 2": lambda: trainhist.coarsen(p, out, bins_per_octave=2, workers=1),
             "coarsen --bins-per-octave 1": lambda: trainhist.coarsen(p, out, bins_per_octave=1, workers=1)}
    for name, fn in calls.items():
        with pytest.raises(TrainhistError) as e:
            fn()
        assert (e.value.code, e.value.offset, e.value.path) == ("mixed_scale", want, str(p)), (name, e.value)
        assert not out.exists()
    with pytest.raises(TrainhistError) as e:  # different scales across inputs stay incompatible_grid (11.2)
        trainhist.merge([fine, coarse], out, workers=1)
    assert e.value.code == "incompatible_grid"


def test_a_sample_of_more_elements_than_the_tensor_is_refused_by_writer_and_reader(tmp_path):
    """spec 2.2: a sample is a subset, elements <= of; the schema cannot say it, so the writer accepted a sample of
    5 of 4 elements and every reader read it. Both refuse it now (the reader: conformance invalid/
    sample_exceeds_whole)."""
    from trainhist.errors import SchemaError

    with trainhist.HistoryWriter(tmp_path / "t.thist") as w:
        with pytest.raises(SchemaError) as e:
            w.site("a", "param_delta", shape=(4,), sample={"elements": 5, "of": 4, "seed": 0})
        assert e.value.code == "bad_manifest" and "elements must not exceed of" in str(e.value)
        w.site("b", "param_delta", shape=(4,), sample={"elements": 4, "of": 4, "seed": 0})  # (all of it: fine)
