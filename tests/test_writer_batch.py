"""The writer's batched encoding (one set of numpy calls for all the chunks of a commit) against the straightforward
path it replaces: ``dyadic.floats_of`` against ``to_float``/``is_float`` value by value, ``writer._windows`` against
``flatnonzero`` per array, ``encode_obs_chunks`` against ``encode_obs_rows`` chunk by chunk, and a whole file written
with the batched commit against one written flushing site by site (where a chunk cannot be encoded, too)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

import trainhist
from trainhist import grid
from trainhist.chunk import Codec
from trainhist.dyadic import Dyadic, dyadics_of, floats_of
from trainhist.errors import UsageError
from trainhist.model import MICRO_ALL, Presence
from trainhist.summary import Sketch, SpineTable, Summary, SumMethod, summarize
from trainhist.writer import HistoryWriter, _windows, encode_obs_chunks, encode_obs_rows

from history_helpers import FAST


def _dyadics(r: random.Random) -> list[Dyadic]:
    """Canonical and non-canonical values around every float64 edge (subnormal, largest, 53 bits), and beyond."""
    edges = [0.0, -0.0, 1.0, -1.5, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 2.0**-1074]
    out = [Dyadic.from_float(x) for x in edges] + [
        Dyadic(m, e) for m in (0, 1, -1, 2, 3, (1 << 53) - 1, (1 << 53) + 1, -(1 << 53) + 1, (1 << 63) - 1, -(1 << 63))
        for e in (0, 1, -1074, -1075, 970, 971, 972, 1023, 1024, -(1 << 20), 1 << 20)
    ]
    for _ in range(400):
        out.append(Dyadic.make(r.randint(-(1 << r.randint(1, 62)), 1 << r.randint(1, 62)), r.randint(-1200, 1100)))
        out.append(Dyadic(r.randint(-(1 << 62), 1 << 62), r.randint(-1100, 1100)))  # mostly not canonical
    return out


def test_floats_of_equals_value_by_value() -> None:
    r = random.Random(3)
    values = _dyadics(r)
    r.shuffle(values)
    for k in range(0, len(values), 7):
        part = values[k : k + 7]
        f, exact = floats_of(part)
        assert exact == [v.is_float() for v in part]
        assert f.tobytes() == np.array([v.to_float() for v in part], np.float64).tobytes()
    big = [Dyadic.make((1 << 80) + 1, -10), Dyadic(3, 0), Dyadic.make(-(1 << 70) - 1, 900)]  # m beyond int64
    f, exact = floats_of(big)
    assert exact == [v.is_float() for v in big] == [False, True, False]
    assert f.tobytes() == np.array([v.to_float() for v in big], np.float64).tobytes()
    with pytest.raises(TypeError):  # a non-integer field is refused, as value by value, never truncated
        floats_of([Dyadic(3, 0), Dyadic(1.5, 0)])


def test_windows_equal_flatnonzero_per_array() -> None:
    rng = np.random.default_rng(4)
    arrays = []
    for _ in range(50):
        a = np.zeros(int(rng.choice([1, 5, 256])), np.uint64)
        for _ in range(int(rng.integers(0, 4))):
            a[rng.integers(0, a.size)] = rng.integers(1, 1 << 62, dtype=np.uint64)
        arrays.append(a)
    firsts, lengths, counts = _windows(arrays)
    parts = []
    for a, first, length in zip(arrays, firsts, lengths):
        nz = np.flatnonzero(a)
        assert (first, length) == ((int(nz[0]), int(nz[-1] - nz[0] + 1)) if nz.size else (0, 0))
        parts.append(a[first : first + length])
    assert counts.dtype == np.uint64 and counts.tobytes() == np.concatenate(parts).tobytes()


def _summary(r: random.Random, rng: np.random.Generator, scale: int, sketch: bool) -> Summary:
    kind = r.random()
    if kind < 0.3:  # an exact reduction: sums often beyond float64
        s = summarize(rng.standard_normal(r.randint(1, 40)) * 10.0 ** r.randint(-20, 20), sketch=False)
    elif kind < 0.8:  # the torch collector's kind: float64 sums, huge counts
        sm, sq = dyadics_of(np.array([r.uniform(-1e6, 1e6), r.uniform(0, 1e12)]))
        count = r.choice([1, 1000, 1 << 33, (1 << 64) - 1])
        nan, pinf, zero = (r.choice([0, 2]), r.choice([0, 1]), r.choice([0, 300])) if count >= 1000 else (0, 0, 0)
        if r.random() < 0.2:  # nothing finite (spec 5.5: NaN extremes)
            nan, pinf, zero, sm, sq = count, 0, 0, Dyadic(0, 0), Dyadic(0, 0)
        lo, hi = ((math.nan, math.nan) if nan == count
                  else sorted([r.uniform(-5, 5), r.choice([0.0, -0.0, 5.0])]))
        s = Summary(count=count, nan=nan, pinf=pinf, zero=zero, min=lo, max=hi, sum=sm, sumsq=sq,
                    sum_method=SumMethod.F64)
    else:
        s = Summary(count=3, min=-1.0, max=1.0, sum=Dyadic.make(r.randint(-(1 << 200), 1 << 200), -40),
                    sumsq=Dyadic.make(r.randint(1, 1 << 60), r.randint(-1100, 900)))
    if sketch:
        s.sketch = Sketch.empty(scale)
        for side in (s.sketch.pos, s.sketch.neg):
            if r.random() < 0.7:
                lo = r.randrange(side.size)
                side[lo : lo + r.randint(1, 20)] = r.choice([1, 254, 255, 1 << 40])
        s.sketch.over_pos = r.choice([0, 1 << 63])
    return s


def _rows(r: random.Random, rng: np.random.Generator) -> list[tuple]:
    scale, every = r.choice([0, 1, grid.NATIVE_SCALE]), r.choice([0, 1, 3, 10])
    rows, step = [], r.choice([0, -7, 1 << 40])
    for i in range(r.choice([1, 2, 30, r.randint(1, 200)])):
        step += r.choice([0, 1, 1, 5])
        presence = Presence.OBSERVED if r.random() < 0.8 else r.choice([Presence.ABSENT, Presence.FAILED])
        summ = _summary(r, rng, scale, every > 0 and i % every == 0) if presence == Presence.OBSERVED else None
        rows.append((step, 1, r.choice([MICRO_ALL, 0, 3]), r.randrange(3), presence, summ))
    return rows


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.DEFLATE, Codec.SHUFFLE_DEFLATE, Codec.PACKED])
def test_encode_obs_chunks_equals_each_chunk_alone(codec: int) -> None:
    r, rng = random.Random(codec), np.random.default_rng(codec)
    for _ in range(6):
        chunks = [(_rows(r, rng), r.randrange(500), r.randrange(3)) for _ in range(r.randint(1, 12))]
        assert encode_obs_chunks(chunks, codec) == [encode_obs_rows(*chunk, codec) for chunk in chunks]
    mixed = [(1, 1, MICRO_ALL, 0, Presence.OBSERVED, Summary(count=1, nan=1, sketch=Sketch.empty(s))) for s in (1, 2)]
    with pytest.raises(UsageError, match=r"cannot mix sketch scales \[1, 2\]"):
        encode_obs_chunks([(_rows(r, rng), 0, 0), (mixed, 1, 0)], codec)


def _write(path: Path, one_by_one: bool, monkeypatch: pytest.MonkeyPatch) -> int:
    """A seeded run of many sites; ``one_by_one`` flushes site by site (the straightforward path). Returns the
    number of commits that raised."""
    if one_by_one:
        monkeypatch.setattr(HistoryWriter, "_flush_all",
                            lambda self: [self._flush_site(*key) for key in sorted(self._buffers)])
    r, rng = random.Random(5), np.random.default_rng(5)
    errors = 0
    with HistoryWriter(path, codec="packed", salt=1, run_id="1" * 32, writer_id="2" * 32, created="2024-01-01",
                       pid=1, host="h", software={}, **FAST) as w:
        sites = [w.site(f"s{i}", "param") for i in range(40)]
        for step in range(30):
            for k, site in enumerate(sites):
                if r.random() < 0.8:
                    w.observe(site, step, summary=_summary(r, rng, grid.NATIVE_SCALE, step % 10 == k % 10))
                else:
                    w.mark(site, step, "absent")
            if step in (12, 21):  # a site in the middle gets sketches at two scales: the next commit raises
                for scale in (1, grid.NATIVE_SCALE):  # (micro-batch rows: the whole-step row is written above)
                    w.observe(sites[17], step, summary=Summary(count=1, nan=1, sketch=Sketch.empty(scale)),
                              micro=scale)
            if step % 6 == 5:
                try:
                    w.commit()
                except UsageError:
                    errors += 1
    monkeypatch.undo()
    return errors


@pytest.mark.parametrize("group_rows", [1 << 16, 50])  # one group per commit; groups of a few sites
def test_batched_commit_writes_the_file_of_site_by_site_flushes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                group_rows: int) -> None:
    import trainhist.writer as wr

    monkeypatch.setattr(wr, "GROUP_ROWS", group_rows)
    assert _write(tmp_path / "batched.thist", False, monkeypatch) == 2
    assert _write(tmp_path / "one_by_one.thist", True, monkeypatch) == 2
    assert (tmp_path / "batched.thist").read_bytes() == (tmp_path / "one_by_one.thist").read_bytes()


def test_observe_checks_the_site_as_before(tmp_path: Path) -> None:
    """The identity shortcut for this writer's handles keeps the old check for any other object: an equal handle
    (from a writer of the same sites) is accepted, another writer's handle and non-handles are refused."""
    from trainhist.writer import SiteHandle

    with HistoryWriter(tmp_path / "a.thist", **FAST) as w, HistoryWriter(tmp_path / "b.thist", **FAST) as v:
        a = w.site("x", "param")
        w.observe(SiteHandle(a.id, a.path, a.stream, a.facet), 0, np.ones(3))  # equal, not identical
        w.observe(v.site("x", "param"), 1, np.ones(3))  # the same site of another writer: equal too
        for bad in (v.site("y", "param"), SiteHandle(a.id, "y", a.stream, a.facet), a.id, None):
            with pytest.raises(UsageError, match="is not a site of this writer"):
                w.observe(bad, 0, np.ones(3))  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="is not one of"):
            w.observe(a, 1, np.ones(3), phase="later")
        for bad_summary in (0, (object(), 0), "x"):  # (a table row's int reference among them: never taken as one)
            with pytest.raises(UsageError, match="must be a trainhist.Summary, not"):
                w.observe(a, 1, summary=bad_summary)  # type: ignore[arg-type]
    with HistoryWriter(tmp_path / "a.thist", mode="a", **FAST) as w:  # handles of a resumed file
        w.observe(w.site("x", "param"), 2, np.ones(3), phase="post_clip", micro=1)
    with pytest.raises(UsageError, match="closed"):
        w.observe(a, 3, np.ones(3))


def test_observe_refuses_a_summary_of_wrong_field_types_before_writing(tmp_path: Path) -> None:
    """A hand-built Summary whose fields the file cannot hold (float sums, a non-canonical dyadic, a method code of
    no method, a sketch of the wrong shape) is refused at observe() with ``bad_summary``, naming the field and how
    to build one; it used to be taken, then fail the commit at close() (TypeError) and leave a torn file."""
    good = Summary(count=3, min=1.0, max=3.0, sum=Dyadic.from_float(6.0), sumsq=Dyadic.from_float(14.0))
    n = grid.nbins(grid.NATIVE_SCALE)
    bad = {
        "sum": dict(sum=6.0, sumsq=Dyadic.from_float(14.0)),
        "sumsq": dict(sumsq=Dyadic(14, 0)),  # (14 * 2**0 is Dyadic(7, 1): not canonical, the file would be corrupt)
        "sum_method": dict(sum_method=7),
        "min": dict(min="1"),
        "count": dict(count=3.0),
        "sketch": dict(sketch=Sketch(grid.NATIVE_SCALE, np.zeros(n, np.float64), np.zeros(n, np.uint64))),
    }
    path = tmp_path / "s.thist"
    with HistoryWriter(path, **FAST) as w:
        a = w.site("a", "activation")
        for field, change in bad.items():
            with pytest.raises(UsageError, match=rf"fields of the wrong type or form: {field} \(") as e:
                w.observe(a, 0, summary=Summary(**{**good.__dict__, **change}))
            assert e.value.code == "bad_summary"
            assert "Dyadic.from_float" in str(e.value) and "trainhist.summarize" in str(e.value)
        w.observe(a, 0, summary=good)  # (step 0 again: nothing of the refused calls was recorded)
    h = trainhist.open(path)
    assert h.verify()["rows"] == 1 and h.recovery.status == "clean"
    sp = h.spine("a", "activation")
    assert (sp.sum.tolist(), sp.sumsq.tolist(), sp.mean.tolist()) == ([6.0], [14.0], [2.0])


def _table(r: random.Random, n: int, sketch: bool = False) -> SpineTable:
    """``n`` spine rows around the edges: no finite value, zero sums of either sign, overflowed sums (an unknown
    bound), float32 bounds, counts beyond 2**53; with ``sketch``, key counts too (every finite non-zero value
    binned, or only some; the zero, NaN and infinity keys, which a sketch does not read, set at random)."""
    cols: dict[str, list] = {k: [] for k in ("count", "nan", "pinf", "ninf", "zero", "min", "max", "sum", "sumsq",
                                               "method")}
    for _ in range(n):
        nan, pinf, ninf, zero = (r.choice([0, 0, 1, 7]) for _ in range(4))
        finite = r.choice([0, 1, 5, 1 << 33, (1 << 60)])
        method = r.choice([SumMethod.F64, SumMethod.F64, SumMethod.F32, SumMethod.UNKNOWN])
        lo, hi = sorted([r.uniform(-5, 5), r.choice([0.0, -0.0, 5.0, 2.0**-1074])])
        s, q = r.choice([0.0, -0.0, r.uniform(-1e6, 1e6)]), r.choice([-0.0, r.uniform(0, 1e300)])
        if method == SumMethod.UNKNOWN:
            s, q = r.choice([(math.inf, math.inf), (-math.inf, math.nan), (1.0, 2.0)])
        if finite == 0:
            lo = hi = math.nan
            if method != SumMethod.UNKNOWN:
                s, q = r.choice([0.0, -0.0]), 0.0
        for k, v in zip(cols, (finite + nan + pinf + ninf, nan, pinf, ninf, min(zero, finite), lo, hi, s, q, method)):
            cols[k].append(v)
    keys = None
    if sketch:
        keys = np.zeros((n, grid.NKEYS), np.uint64)
        for i in range(n):
            left = int(cols["count"][i] - cols["nan"][i] - cols["pinf"][i] - cols["ninf"][i] - cols["zero"][i])
            left -= r.choice([0, 0, left // 2])  # (a sketch may cover only some of them)
            side = grid.KEY_OVER + 1  # the bands (under, over) of each side often, and bins of both
            for key in r.sample([0, 1, 2, 100, grid.KEY_OVER - 1, grid.KEY_OVER, side, side + 1, side + 200,
                                 side + grid.KEY_OVER], 4):
                take = r.randint(0, left)
                keys[i, key] += take
                left -= take
            keys[i, r.choice([1, grid.KEY_OVER + 5])] += left
            keys[i, grid.KEY_ZERO : grid.NKEYS] = [r.choice([0, 3]) for _ in range(grid.NKEYS - grid.KEY_ZERO)]
    return SpineTable(**{k: np.array(v, dtype=np.float64 if k in ("min", "max", "sum", "sumsq") else np.uint64)
                         for k, v in cols.items()}, sketch=keys)


def _write_spines(path: Path, batched: bool) -> None:
    """A seeded run whose spine rows go through one observe_spines call a step (``batched``) or one observe each
    (with the table row's Summary), between marks and summaries of other sites and phases."""
    r = random.Random(9)
    with HistoryWriter(path, codec="packed", salt=1, run_id="1" * 32, writer_id="2" * 32, created="2024-01-01",
                       pid=1, host="h", software={}, **FAST) as w:
        sites = [w.site(f"s{i}", "param_grad") for i in range(25)]
        for step in range(12):
            table = _table(r, 20, sketch=step % 3 == 1)
            picked = r.sample(range(25), 20)
            phases = [r.choice(["default", "pre_clip", "post_clip"]) for _ in picked]
            w.mark(sites[picked[0]], step, "failed", phase="post_clip", micro=0)  # the same site as a table row
            if batched:
                w.observe_spines([sites[k] for k in picked], step, table, phases=phases)
            else:
                for i, (k, phase) in enumerate(zip(picked, phases)):
                    w.observe(sites[k], step, summary=table.row(i), phase=phase)
            for k in set(range(25)) - set(picked):
                w.observe(sites[k], step, summary=_summary(r, np.random.default_rng(step), 2, k == 3))
            if step % 5 == 4:
                w.commit()


def test_observe_spines_writes_the_file_of_observe_row_by_row(tmp_path: Path) -> None:
    _write_spines(tmp_path / "batched.thist", True)
    _write_spines(tmp_path / "rows.thist", False)
    assert (tmp_path / "batched.thist").read_bytes() == (tmp_path / "rows.thist").read_bytes()


def test_observe_spines_cuts_chunks_where_observe_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A site's buffer written as a chunk once it holds _FLUSH_ROWS rows, in the middle of one observe_spines call
    too (its pre_clip and post_clip rows straddling the cut); a sketch table changed by the caller after the call
    changes nothing written."""
    import trainhist.writer as wr

    monkeypatch.setattr(wr, "_FLUSH_ROWS", 3)
    r = random.Random(5)
    tables = [_table(r, 2, sketch=True) for _ in range(4)]

    def write(path: Path, batched: bool) -> None:
        with HistoryWriter(path, codec="packed", salt=1, run_id="1" * 32, writer_id="2" * 32, created="2024-01-01",
                           pid=1, host="h", software={}, **FAST) as w:
            a = w.site("a", "param_grad")
            for step, table in enumerate(tables):
                if batched:
                    w.observe_spines([a, a], step, table, phases=["pre_clip", "post_clip"])
                    table.sketch[:] = 1 << 62  # type: ignore[index] -- (too many, had it been read now)
                else:
                    for i, phase in enumerate(["pre_clip", "post_clip"]):
                        w.observe(a, step, summary=table.row(i), phase=phase)

    write(tmp_path / "rows.thist", False)
    write(tmp_path / "batched.thist", True)
    assert (tmp_path / "batched.thist").read_bytes() == (tmp_path / "rows.thist").read_bytes()


def test_buffered_table_rows_leave_the_garbage_collector_alone(tmp_path: Path) -> None:
    """A table row waits for the commit as a tuple of ints (its table by index), which the garbage collector stops
    tracking: hundreds of rows a step, kept for up to a commit, would otherwise make its full collections longer
    and more frequent."""
    import gc

    r = random.Random(3)
    with HistoryWriter(tmp_path / "a.thist", **FAST) as w:
        sites = [w.site(f"s{i}", "param") for i in range(20)]
        for step in range(3):
            w.observe_spines(sites, step, _table(r, 20, sketch=step == 1))
        gc.collect()
        rows = [row for buf in w._buffers.values() for row in buf]
        assert len(rows) == 60 and not any(gc.is_tracked(row) for row in rows)
        w.commit()
        assert w._tables == []  # (emptied with the buffers)
    h = trainhist.open(tmp_path / "a.thist")
    assert h.spine("s0", "param").step.tolist() == [0, 1, 2]


def test_observe_spines_refuses_what_observe_could_not_write(tmp_path: Path) -> None:
    r = random.Random(2)
    with HistoryWriter(tmp_path / "a.thist", **FAST) as w, HistoryWriter(tmp_path / "b.thist", **FAST) as v:
        a, b = w.site("a", "param"), w.site("b", "param")
        good = _table(r, 2)
        w.observe_spines([a, b], 0, good, phases=["default", "pre_clip"])
        f = {k: getattr(good, k) for k in good.__dataclass_fields__}
        u = lambda *v: np.array(v, np.uint64)  # noqa: E731
        one_finite = dict(count=u(1, 1), nan=u(0, 0), pinf=u(0, 0), ninf=u(0, 0), zero=u(0, 0),
                          min=np.array([-1.0, 2.0]), max=np.array([1.0, 2.0]), sum=np.array([0.5, 2.0]),
                          sumsq=np.array([1.0, 4.0]), method=np.array([SumMethod.F64] * 2, np.uint8))
        none_finite = {**one_finite, "nan": u(1, 1), "min": np.full(2, math.nan), "max": np.full(2, math.nan),
                       "sum": np.zeros(2), "sumsq": np.zeros(2)}
        w.observe_spines([a, b], 1, SpineTable(**one_finite))  # (step 0 of a and b default: a duplicate_row)
        w.observe_spines([a, b], 0, SpineTable(**none_finite), phases=["pre_clip", "post_clip"])
        w.observe_spines([], 7, SpineTable(**{k: v[:0] for k, v in one_finite.items()}))  # nothing: no step 7
        w.observe_spines([], 8, SpineTable(**{k: [] for k in one_finite}))  # (lists: float64 when empty)
        bad_tables = {
            "one site per table row": dict(f),
            "one-dimensional": {**f, "min": np.zeros((2, 1))},
            "non-negative integers": {**f, "nan": np.array([-1, 0])},
            "zero exceed count": {**f, "count": np.array([0, 0], np.uint64),
                                                           "nan": np.array([1, 0], np.uint64)},
            "F64, F32 or UNKNOWN": {**f, "method": np.array([SumMethod.EXACT, SumMethod.F64], np.uint8)},
            "must be finite": {**f, "sum": np.array([math.inf, 0.0]),
                               "method": np.array([SumMethod.F64, SumMethod.F64], np.uint8)},
            # a sum of the four that wraps around 2**64 is still too many
            "exceed count": {**f, "count": np.array([1, 1], np.uint64), "nan": np.array([1 << 63, 0], np.uint64),
                         "pinf": np.array([1 << 63, 0], np.uint64), "ninf": np.zeros(2, np.uint64),
                         "zero": np.zeros(2, np.uint64)},
            "cannot be negative": {**one_finite, "sumsq": np.array([-1.0, 1.0])},
            "nor its sums other than 0": {**none_finite, "sum": np.array([1.0, 0.0]), "sumsq": np.zeros(2)},
            "without finite values has NaN min and max": {**none_finite, "min": np.array([0.0, math.nan]),
                                                          "max": np.array([0.0, math.nan])},
            "needs finite min <= max": {**one_finite, "min": np.array([2.0, math.nan])},
            "min <= max": {**one_finite, "min": np.array([2.0, -1.0]), "max": np.array([1.0, 1.0])},
            "with finite values needs finite": {**one_finite, "max": np.array([1.0, math.inf])},
            "must be numbers": {**one_finite, "min": np.array(["x", "y"])},
            "integer key counts of shape": {**one_finite, "sketch": np.zeros((2, 7), np.int64)},
            "integer key counts": {**one_finite, "sketch": np.zeros((2, grid.NKEYS))},
            "sketch counts must be non-negative": {**one_finite, "sketch": -np.eye(2, grid.NKEYS, dtype=np.int64)},
            "more values than its finite non-zero ones": {**one_finite,
                                                          "sketch": 2 * np.eye(2, grid.NKEYS, 1, dtype=np.int64)},
            # (bins whose exact sum wraps around 2**64 are still too many)
            "more values than": {**one_finite, "sketch": np.tile(np.array([1 << 63, 1 << 63, 1] + [0] * (
                grid.NKEYS - 3), np.uint64), (2, 1))},
        }
        for message, cols in bad_tables.items():
            sites = [a] if message.startswith("one site") else [a, b]
            with pytest.raises(UsageError, match=message):
                w.observe_spines(sites, 1, SpineTable(**cols))
        with pytest.raises(UsageError, match="is not a site of this writer"):
            w.observe_spines([a, v.site("x", "param")], 1, good)
        with pytest.raises(UsageError, match="is not one of"):
            w.observe_spines([a, b], 1, good, phases=["default", "later"])
    with pytest.raises(UsageError, match="closed"):
        w.observe_spines([a, b], 2, good)
    h = trainhist.open(tmp_path / "a.thist")
    assert h.spine("b", "param", phase="pre_clip").count.tolist() == [int(good.count[1])]
    assert h.spine("a", "param", phase="pre_clip").nan.tolist() == [1]
    assert h.spine("a", "param", phase="default").step.tolist() == [0, 1]  # (the empty table moved no step)


def test_a_row_repeating_the_last_one_of_its_site_phase_and_micro_is_refused(tmp_path: Path) -> None:
    """Spec 2.8 (the reference writer's note): observe() then mark() of one step, or one step observed twice, wrote
    two rows of one identity, which readers show as two and merge adds. The writer refuses such a row (duplicate_row)
    before anything of the call is written, in observe, mark, scalar and observe_spines (against the last call and
    within one call); other phases and micro-batches, steps out of order and a new segment are not duplicates. It
    keeps one step per (site, phase, micro-batch)."""
    p = tmp_path / "d.thist"
    u = lambda *v: np.array(v, np.uint64)  # noqa: E731
    two = SpineTable(count=u(1, 1), nan=u(0, 0), pinf=u(0, 0), ninf=u(0, 0), zero=u(0, 0), min=np.ones(2),
                     max=np.ones(2), sum=np.ones(2), sumsq=np.ones(2), method=np.array([SumMethod.F64] * 2, np.uint8))
    with HistoryWriter(p, **FAST) as w:
        a, b, c = w.site("a", "activation"), w.site("b", "param_grad"), w.site("c", "param_grad")
        w.observe(a, 5, np.ones(2))
        refused = [lambda: w.mark(a, 5, "absent"), lambda: w.observe(a, 5, np.ones(2)),
                   lambda: w.observe(a, 5, summary=trainhist.summarize(np.ones(2)))]
        w.observe(a, 5, np.ones(2), phase="pre_clip")
        w.observe(a, 5, np.ones(2), micro=0)
        w.observe(a, 5, np.ones(2), micro=1)
        refused += [lambda: w.observe(a, 5, np.ones(2), micro=1), lambda: w.mark(a, 5, "failed", phase="pre_clip")]
        w.scalar("loss", 5, 2.5)
        refused.append(lambda: w.scalar("loss", 5, 2.5))
        w.observe_spines([b, c], 5, two, phases=["pre_clip", "pre_clip"])
        w.observe_spines([b, c], 5, two, phases=["post_clip", "default"])
        refused += [lambda: w.observe_spines([c, b], 5, two, phases=["post_clip", "pre_clip"]),  # (row 1)
                    lambda: w.observe_spines([b, b], 6, two, phases=["default", "default"]),  # (within the call)
                    lambda: w.mark(b, 5, "absent", phase="post_clip")]
        for k, call in enumerate(refused):
            with pytest.raises(UsageError) as ei:
                call()
            assert ei.value.code == "duplicate_row" and "nothing of this call was recorded" in str(ei.value), k
        msg = str(ei.value)
        assert "a row marked absent of 'b' [param_grad] at step 5, phase post_clip in segment 0" in msg, msg
        with pytest.raises(UsageError, match="rows 0 and 1 of the table are both of it"):
            w.observe_spines([b, b], 6, two, phases=["default", "default"])
        w.observe(a, 6, np.ones(2))
        w.observe(a, 5, np.ones(2), micro=2)
        w.observe(a, 4, np.ones(2))  # (out of step order: legal, and not the last row of a at step 5)
        w.observe(a, 5, np.ones(2))  # (not adjacent to the first step-5 row: the writer keeps one step a key)
        w.observe_spines([b, c], 6, two, phases=["default", "default"])  # (c at step 6: nothing of it written before)
        w.new_segment(5)
        w.observe(a, 5, np.ones(2))
        w.mark(b, 5, "absent", phase="post_clip")
        assert len(w._micro_last) == 0 and w._whole_has.sum() == 2
    h = trainhist.open(p)
    rows = list(zip(*(h.spine("a", phase="*").columns[k].tolist() for k in ("segment", "step", "phase", "micro"))))
    whole, pre = 0xFFFFFFFF, 1
    assert rows == [(0, 5, 0, whole), (0, 5, pre, whole), (0, 5, 0, 0), (0, 5, 0, 1), (0, 6, 0, whole),
                    (0, 5, 0, 2), (0, 4, 0, whole), (0, 5, 0, whole), (1, 5, 0, whole)]
    assert h.spine("loss", "scalar").step.tolist() == [5]
    assert h.spine("b", "param_grad", phase="*").step.tolist() == [5, 5, 6, 5]
    assert h.spine("c", "param_grad", phase="*").step.tolist() == [5, 5, 6]


def test_the_last_rows_kept_for_the_duplicate_check_stay_bounded(tmp_path: Path) -> None:
    """One step per (site, phase, micro-batch): a long run of micro-batch rows keeps as many entries as keys."""
    with HistoryWriter(tmp_path / "m.thist", **FAST) as w:
        a = w.site("a", "activation")
        for step in range(300):
            for micro in range(4):
                w.observe(a, step, summary=trainhist.summarize(np.ones(1)), micro=micro)
        assert len(w._micro_last) == 4 and w._whole_has.shape[1] <= 64
