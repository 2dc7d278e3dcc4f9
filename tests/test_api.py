"""The public API refuses misuse with a typed :class:`~trainhist.errors.TrainhistError` (a stable ``code``, a message
that says what was expected and what was found), never a bare ValueError/TypeError/IndexError from deep inside, and
never records a wrong value silently."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import trainhist
from trainhist import errors, grid
from trainhist.errors import UsageError


def _refused(fn, code: str, *words: str) -> UsageError:
    with pytest.raises(UsageError) as ei:
        fn()
    assert ei.value.code == code, str(ei.value)
    for w in words:
        assert w in str(ei.value), str(ei.value)
    return ei.value


# -- exports ------------------------------------------------------------------------------------------------------
def test_every_exported_name_exists():
    import trainhist.frames
    import trainhist.reader
    import trainhist.summary
    import trainhist.writer

    for mod in (trainhist, errors, trainhist.reader, trainhist.writer, trainhist.summary, trainhist.frames):
        for name in mod.__all__:
            assert hasattr(mod, name), f"{mod.__name__}.{name}"


def _section9() -> dict[str, set[str]]:
    """The backticked names of each ``- `trainhist.X`: ...`` bullet of docs/guide.md section 9."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "guide.md").read_text(encoding="utf-8")
    sec = text.split("## 9. Public API", 1)[1].split("\n## ", 1)[0]
    out = {}
    for bullet in re.split(r"\n- ", sec)[1:]:
        m = re.match(r"`(trainhist(?:\.\w+)?)`:", bullet)
        if m:
            out[m.group(1)] = set(re.findall(r"`([A-Za-z_]\w*)`", bullet[m.end():]))
    return out


@pytest.mark.parametrize("module", ["trainhist", "trainhist.errors", "trainhist.reader", "trainhist.writer",
                                    "trainhist.summary", "trainhist.frames"])
def test_section9_lists_every_export(module):
    import importlib

    mod = importlib.import_module(module)
    documented = _section9()[module]
    if module == "trainhist":  # ("the error classes of trainhist.errors")
        documented |= {name for name in errors.__all__ if name.endswith("Error")}
    assert set(mod.__all__) <= documented, sorted(set(mod.__all__) - documented)
    attributes = {"code", "path", "offset"}  # (TrainhistError's, named in the errors bullet)
    assert documented - attributes <= set(dir(mod)), sorted(documented - attributes - set(dir(mod)))


# -- HistoryWriter() ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [123, None, 1.5])
def test_writer_path_of_wrong_type(path):
    _refused(lambda: trainhist.HistoryWriter(path), "bad_path", type(path).__name__, "os.PathLike")


@pytest.mark.parametrize("opener", [trainhist.HistoryWriter, trainhist.open])
def test_path_problems_are_typed(tmp_path, opener):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(errors.NotFoundError) as ei:
        opener(tmp_path / "f" / "a.thist")
    assert "is a file, not a folder" in str(ei.value) and str(tmp_path / "f") in str(ei.value)
    with pytest.raises(UsageError) as ei:
        opener(str(tmp_path / "a\0.thist"))
    assert ei.value.code == "bad_path" and "NUL" in str(ei.value)


@pytest.mark.parametrize("opener", [trainhist.HistoryWriter, trainhist.open, trainhist.History])
@pytest.mark.parametrize("path", ["", b""])
def test_an_empty_path_is_refused_as_such(opener, path):
    """'' was taken by the OS as a missing file: 'the folder <the working folder's parent> exists, but ...'."""
    _refused(lambda: opener(path), "bad_path", "empty path")


def test_writer_refuses_a_device():
    with pytest.raises(errors.NotAFileError) as ei:
        trainhist.HistoryWriter("/dev/null")
    assert ei.value.code == "not_a_file" and "regular file" in str(ei.value)


def test_permission_denied_is_typed(tmp_path, monkeypatch):
    import os

    def deny(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", deny)
    for opener in (trainhist.HistoryWriter, trainhist.open):
        with pytest.raises(errors.PermissionDeniedError) as ei:
            opener(tmp_path / "a.thist")
        assert ei.value.code == "permission_denied" and isinstance(ei.value, PermissionError)
        assert "permission denied" in str(ei.value) and ei.value.filename == str(tmp_path / "a.thist")


@pytest.mark.parametrize("salt", ["abc", 2**64, -1, 1.5, True])
def test_writer_salt_checked(tmp_path, salt):
    _refused(lambda: trainhist.HistoryWriter(tmp_path / "a.thist", salt=salt), "bad_value", "salt")
    assert not (tmp_path / "a.thist").exists() or (tmp_path / "a.thist").stat().st_size == 0


@pytest.mark.parametrize("kw", [{"min_segment": "x"}, {"min_segment": -5}, {"commit_every": "5"},
                                {"commit_every": 0}, {"commit_every": 2.5}, {"commit_seconds": math.nan},
                                {"commit_seconds": "30"}, {"commit_seconds": -1.0}])
def test_writer_numbers_checked(tmp_path, kw):
    (name,) = kw
    _refused(lambda: trainhist.HistoryWriter(tmp_path / "a.thist", **kw), "bad_value", name)


def test_writer_commit_settings_still_work(tmp_path):
    with trainhist.HistoryWriter(tmp_path / "a.thist", commit_every=1, commit_seconds=math.inf, salt=2**64 - 1,
                                 min_segment=3) as w:
        w.scalar("loss", 0, 1.0)
        w.scalar("loss", 1, 2.0)
    with trainhist.open(tmp_path / "a.thist") as h:
        assert h.segments[0].id == 3
        assert len(h.spine("loss", "scalar")) == 2


# -- HistoryWriter.site() -----------------------------------------------------------------------------------------
@pytest.fixture
def w(tmp_path):
    with trainhist.HistoryWriter(tmp_path / "a.thist") as writer:
        yield writer


@pytest.mark.parametrize("kw", [{"cadence_spine": "a"}, {"cadence_spine": 1.5}, {"cadence_spine": True},
                                {"cadence_sketch": -1}, {"cadence_sketch": None}, {"order": "a"}, {"order": 2.5},
                                {"order": 2**32}])
def test_site_numbers_checked(w, kw):
    (name,) = kw
    _refused(lambda: w.site("x", "activation", **kw), "bad_value", name)
    assert w.site("x", "activation").id == 0  # (nothing was declared by the refused call)


def test_site_shape_not_a_sequence(w):
    _refused(lambda: w.site("x", "activation", shape=5), "bad_value", "shape", "5")


def test_site_numbers_of_numpy_types(w, tmp_path):
    w.site("x", "activation", shape=(np.int64(3),), cadence_spine=np.int32(2), cadence_sketch=np.uint8(4),
           order=np.int64(7))
    w.close()
    with trainhist.open(tmp_path / "a.thist") as h:
        s = h.site("x")
        assert (s.shape, s.cadence_spine, s.cadence_sketch, s.order) == ((3,), 2, 4, 7)


# -- observe() / summarize() --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "float8", "x", 16])
def test_unknown_dtype_name_refused(w, dtype):
    s = w.site("x", "activation")
    bits = np.array([0x3F80, 0x4000], np.uint16)  # bfloat16 1.0, 2.0: never to be read as the integers 16256, 16384
    _refused(lambda: w.observe(s, 0, bits, dtype=dtype), "bad_values", repr(dtype), "bfloat16")
    _refused(lambda: trainhist.summarize(bits, dtype=dtype), "bad_values", repr(dtype))


def test_bfloat16_still_read(w):
    assert trainhist.summarize(np.array([0x3F80, 0x4000], np.uint16), dtype="bfloat16").max == 2.0


@pytest.mark.parametrize("sketch", ["no", None, 0.0])
def test_sketch_flag_must_be_bool(w, sketch):
    s = w.site("x", "activation")
    _refused(lambda: w.observe(s, 0, np.ones(3), sketch=sketch), "bad_value", "sketch")


def test_sketch_flag_numpy_bool(w):
    assert trainhist.summarize(np.ones(3), sketch=np.bool_(False)).sketch is None


def test_big_endian_floats_read_exactly():
    x = np.array([1.5, -2.25, 3e300], ">f8")
    assert trainhist.summarize(x) == trainhist.summarize(x.astype("<f8"))


_TABLE = {"count": [3, 3], "nan": [0, 0], "pinf": [0, 0], "ninf": [0, 0], "zero": [0, 0], "min": [1.0, 1.0],
          "max": [2.0, 2.0], "sum": [4.0, 4.0], "sumsq": [6.0, 6.0], "method": [1, 1]}


@pytest.mark.parametrize("bad,found", [({"count": None}, "count NoneType"), ({"zero": 3}, "zero int"),
                                       ({"max": [2.0]}, "max list of shape (1,)"),
                                       ({"nan": [0, -1]}, "-1 in row 1"), ({"pinf": [0.0, 0.0]}, "float64"),
                                       ({"min": ["a", "b"]}, "<U1"), ({"method": [1, 0]}, "0 in row 1"),
                                       ({"sum": [4.0, math.inf]}, "inf"),
                                       ({"sketch": np.ones((2, 3), int)}, "(2, 3)")])
def test_observe_spines_table_columns(w, bad, found):
    from trainhist.summary import SpineTable

    s = [w.site("a", "activation"), w.site("b", "activation")]
    (name,) = bad
    _refused(lambda: w.observe_spines(s, 0, SpineTable(**{**_TABLE, **bad})), "bad_table", name, found)


def test_observe_spines_table_type(w):
    s = w.site("x", "activation")
    _refused(lambda: w.observe_spines([s], 0, None), "usage", "SpineTable", "NoneType")


# -- scalar values ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [2**53 + 1, -(2**60) - 1, np.int64(2**53 + 1), np.uint64(2**63 + 1)])
def test_scalar_int_without_exact_float_refused(w, value):
    _refused(lambda: w.scalar("loss", 0, value), "bad_value", "2**53")
    _refused(lambda: w.step_truth(0, loss_scale=value), "bad_value", "2**53")


def test_scalar_exact_ints_kept(w, tmp_path):
    w.scalar("loss", 0, 2**53)
    w.scalar("loss", 1, np.int64(-7))
    w.close()
    with trainhist.open(tmp_path / "a.thist") as h:
        assert h.spine("loss", "scalar").max.tolist() == [2.0**53, -7.0]


@pytest.mark.parametrize("value", ["x", None, [1.0, 2.0]])
def test_summary_scalar_refuses_non_numbers(value):
    _refused(lambda: trainhist.Summary.scalar(value), "bad_value", "number")


def test_summary_scalar_exact():
    _refused(lambda: trainhist.Summary.scalar(2**53 + 1), "bad_value", "2**53")
    assert trainhist.Summary.scalar(np.float32(0.5)).max == 0.5 and trainhist.Summary.scalar(-3).min == -3.0


# -- Sketch -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [7, -1, "2", 1.0])
def test_sketch_empty_scale(scale):
    _refused(lambda: trainhist.Sketch.empty(scale), "bad_value", "scale", "0, 1 or 2")


@pytest.mark.parametrize("counts", [np.zeros(3), np.zeros((2, grid.NKEYS)), np.full(grid.NKEYS, -1),
                                    np.full(grid.NKEYS, 0.5)])
def test_sketch_from_key_counts_shape(counts):
    _refused(lambda: trainhist.Sketch.from_key_counts(counts), "bad_value", "NKEYS")


# -- reading ------------------------------------------------------------------------------------------------------
@pytest.fixture
def hist(tmp_path):
    p = tmp_path / "r.thist"
    with trainhist.HistoryWriter(p) as writer:
        s = writer.site("layer.0", "activation")
        for step in range(3):
            writer.observe(s, step, np.arange(4.0) + step)
    with trainhist.open(p) as h:
        yield h


@pytest.mark.parametrize("i", [3, -4, "0", 1.0, None, True])
@pytest.mark.parametrize("method", ["sum_exact", "sumsq_exact", "summary"])
def test_spine_row_index_checked(hist, method, i):
    sp = hist.spine("layer.0")
    _refused(lambda: getattr(sp, method)(i), "bad_index", "3 rows")


def test_spine_row_index_numpy_and_negative(hist):
    sp = hist.spine("layer.0")
    assert sp.summary(np.int64(2)) == sp.summary(-1)
    assert sp.sum_exact(-1) == sp.sum_exact(2)


@pytest.mark.parametrize("steps", [5, 2.0, np.array(1), np.zeros((1, 2), int)])
def test_presence_steps_not_iterable(hist, steps):
    _refused(lambda: hist.presence("layer.0", steps=steps), "bad_steps", "steps")


def test_presence_steps_any_iterable(hist):
    want = {0: "observed", 2: "observed"}
    assert hist.presence("layer.0", steps=(k for k in (0, 2))) == want  # (a generator: not read twice, found empty)
    assert hist.presence("layer.0", steps={0, 2}) == want == hist.presence("layer.0", steps=np.array([0, 2]))


def test_presence_steps_checked_without_converting_a_list(hist, monkeypatch):
    """The check of steps= converted a list (or range) of steps to a numpy array (np.ndim) and copied it, besides the
    check of each element: presence(steps=range(200_000)) took 59 ms instead of 49. A list of lists is still refused
    (its elements are no integers), a 2-d array by its dimension."""
    from trainhist import reader

    calls = []
    ndim, asarray = np.ndim, np.asarray
    monkeypatch.setattr(reader.np, "ndim", lambda a: calls.append("ndim") or ndim(a))
    monkeypatch.setattr(reader.np, "asarray", lambda a, *k, **kw: calls.append(type(a)) or asarray(a, *k, **kw))
    want = {0: "observed", 2: "observed"}
    assert hist.presence("layer.0", steps=[0, 2]) == want == hist.presence("layer.0", steps=range(0, 3, 2))
    assert not [c for c in calls if c in ("ndim", list, range)], calls
    monkeypatch.undo()
    _refused(lambda: hist.presence("layer.0", steps=[[0, 2]]), "bad_steps", "steps")
    _refused(lambda: hist.presence("layer.0", steps=np.zeros((1, 2), int)), "bad_steps", "steps")


def test_unknown_site_says_how_to_find_names(hist):
    e = _refused(lambda: hist.spine("layer.O"), "unknown_site", "layer.0", "h.sites")
    assert e.path == hist.path


# -- frames -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn,args", [("spines", ()), ("steps", ()), ("scalars", ()), ("quantiles", ("layer.0",)),
                                     ("to_csv", ("out/",)), ("to_parquet", ("out/",))])
def test_frames_take_a_history(hist, fn, args):
    pytest.importorskip("pandas")
    from trainhist import frames

    for h in (hist.path, None):
        _refused(lambda h=h: getattr(frames, fn)(h, *args), "bad_argument", f"frames.{fn}() takes an open History",
                 "trainhist.open")


@pytest.mark.parametrize("call", [lambda f, h: f.spines(h, streams=5), lambda f, h: f.spines(h, sites=1.5),
                                  lambda f, h: f.scalars(h, names=3), lambda f, h: f.quantiles(h, "layer.0", q=0.5),
                                  lambda f, h: f.to_csv(h, 5)])
def test_frames_arguments_of_wrong_type(hist, call):
    pytest.importorskip("pandas")
    from trainhist import frames

    with pytest.raises(UsageError) as ei:
        call(frames, hist)
    assert ei.value.code in ("bad_argument", "bad_output"), str(ei.value)


def test_closed_writer_says_how_to_go_on(tmp_path):
    w = trainhist.HistoryWriter(tmp_path / "a.thist")
    s = w.site("x", "activation")
    w.close()
    _refused(lambda: w.observe(s, 0, np.ones(2)), "writer_closed", "mode='a'")


def test_observe_values_or_summary(w):
    s = w.site("x", "activation")
    _refused(lambda: w.observe(s, 0), "usage", "got neither")
    _refused(lambda: w.observe(s, 0, np.ones(1), summary=trainhist.summarize(np.ones(1))), "usage", "got both")


@pytest.mark.parametrize("path", [5, None])
def test_history_constructor_checks_path(path):
    _refused(lambda: trainhist.History(path), "bad_path", type(path).__name__)


@pytest.mark.parametrize("vector,words", [
    ("bad_commit_short", ["of 12 bytes", "16-byte head"]),
    ("chunk_steps_disagree", ["chunk steps 0..1", "step range 0..0"]),
    ("steps_chunk_steps_disagree", ["steps 0..0", "step range 3..3"]),
    ("tally_disagrees", ["presence observed", "n_absent 1"]),
])
def test_format_errors_say_what_was_found(vector, words):
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "conformance" / "vectors" / "invalid" / vector / "input.thist"
    with pytest.raises(errors.CorruptError) as ei, trainhist.open(path) as h:
        h.verify()
    assert ei.value.path == str(path) and ei.value.offset is not None
    for w in words:
        assert w in str(ei.value), str(ei.value)


def test_a_site_declared_again_with_another_sharing_or_sample_is_refused(tmp_path) -> None:
    """Spec 2.2: a site's sharing and sample hold for all its rows in the file. A writer resuming a file with a
    site recorded as 'shard' got the old handle back for sharing='replica' and its rows were then added as shards
    by merge (a DDP run resumed under FSDP, or the reverse, counted twice), silently. The same sharing and sample
    still get the same handle, whatever the cadence."""
    import trainhist
    from trainhist.errors import UsageError

    p = tmp_path / "s.thist"
    smp = {"elements": 2, "of": 4, "seed": 0}
    with trainhist.HistoryWriter(p) as w:
        a = w.site("w", "param", sharing="shard")
        d = w.site("w", "param_delta", sample=smp)
        w.observe(a, 0, np.ones(4))
    with trainhist.HistoryWriter(p, mode="a") as w:
        assert w.site("w", "param", sharing="shard", cadence_spine=5).id == a.id
        assert w.site("w", "param_delta", sample=dict(smp)).id == d.id
        r = w.site("r", "param", sharing="replica")
        assert w.site("r", "param").id == r.id and w.site("w", "param_delta").id == d.id  # (a lookup: defaults)
        with pytest.raises(UsageError) as ei:
            w.site("w", "param", sharing="replica")
        assert ei.value.code == "site_redeclared" and "'shard'" in str(ei.value) and "new file" in str(ei.value)
        with pytest.raises(UsageError) as ei:
            w.site("w", "param_delta", sample={"elements": 3, "of": 4, "seed": 0})
        assert ei.value.code == "site_redeclared"
        w.observe(a, 1, np.ones(4))
    with trainhist.open(p) as h:
        assert h.recovery.status == "clean"
        assert [s.sharing for s in h.sites if s.stream == "param"] == ["shard", "replica"]


def test_merge_across_runs_must_be_a_bool(tmp_path) -> None:
    """across_runs="no" merged across runs (any non-empty string is true)."""
    import trainhist

    p = tmp_path / "a.thist"
    with trainhist.HistoryWriter(p) as w:
        w.observe(w.site("x", "activation"), 0, np.ones(2))
    with pytest.raises(UsageError) as ei:
        trainhist.merge([p], tmp_path / "m.thist", across_runs="no")
    assert ei.value.code == "bad_argument" and not (tmp_path / "m.thist").exists()


def test_scalar_records_into_a_scalar_site_declared_replica(tmp_path) -> None:
    """scalar() looks up the scalar site the loop declared (here sharing='replica'), in the session that declared it
    and in a resumed one; the site re-declaration check refused it (site_redeclared), as if scalar() declared it."""
    import trainhist

    p = tmp_path / "a.thist"
    with trainhist.HistoryWriter(p) as w:
        lr = w.site("lr", "scalar", sharing="replica", cadence_sketch=0)
        w.scalar("lr", 0, 1e-3)
    with trainhist.HistoryWriter(p, mode="a") as w:
        w.scalar("lr", 1, 5e-4)
        assert w.site("lr", "scalar", sharing="replica", cadence_sketch=0).id == lr.id
    with trainhist.open(p) as h:
        (site,) = [s for s in h.sites if s.key == ("lr", "scalar", None)]
        assert site.sharing == "replica"
        assert h.spine("lr", "scalar").columns["max"].tolist() == [1e-3, 5e-4]


def test_a_summary_whose_sum_method_is_an_array_is_refused_typed(tmp_path) -> None:
    """observe(summary=...) compared the Summary's sum_method with UNKNOWN before checking it: an array there raised
    numpy's 'truth value of an array is ambiguous' ValueError (fuzzed), not the typed refusal other wrong fields get."""
    import dataclasses

    import trainhist

    with trainhist.HistoryWriter(tmp_path / "x.thist", fsync="never") as w:
        s = w.site("a", "activation")
        bad = dataclasses.replace(trainhist.summarize(np.ones(3)), sum_method=np.array([1, 2]))
        with pytest.raises(UsageError) as ei:
            w.observe(s, 0, summary=bad)
        assert ei.value.code == "bad_summary" and "sum_method" in str(ei.value)
        w.observe(s, 0, values=np.ones(3))
    with trainhist.open(tmp_path / "x.thist") as h:
        assert h.spine("a").count.tolist() == [3]


def test_a_directory_or_a_pipe_is_refused_with_what_to_read_instead(tmp_path):
    with pytest.raises(errors.NotAFileError) as ei:
        trainhist.open(tmp_path)
    assert ei.value.code == "not_a_file" and "name a .thist file in it" in str(ei.value)
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(errors.NotAFileError) as ei:
        trainhist.open(tmp_path / "pipe")
    assert "copy what it holds to one" in str(ei.value)
