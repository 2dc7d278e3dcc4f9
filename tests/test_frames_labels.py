"""Exports label what is approximate: every column of every exported table says whether it is exact, and the
rounded or derived ones (sum, sumsq, mean, rms) say how, in the data frame and in the files' metadata."""

from __future__ import annotations

import json

import numpy as np
import pytest

import trainhist
from trainhist import frames
from trainhist.summary import SumMethod

pd = pytest.importorskip("pandas")
pq = pytest.importorskip("pyarrow.parquet")

FAST = dict(fsync="never")


def _write(p) -> None:
    rng = np.random.default_rng(3)
    with trainhist.HistoryWriter(p, **FAST) as w:
        a = w.site("a", "activation")
        for step in range(3):
            w.observe(a, step, rng.standard_normal(100) * 1e-3)
        w.mark(a, 3, "failed")
        t = trainhist.summarize(np.array([1.0, 2.0]), sketch=False)
        t.sum_method = SumMethod.F64
        w.observe(a, 4, summary=t)
        w.scalar("loss", 0, 0.1)
        w.step_truth(0, applied=True, tokens=10)


def _check(columns: dict, df) -> None:
    assert set(columns) == set(df.columns)  # (every column)
    for name in ("sum", "sumsq", "mean", "rms"):
        if name in columns:
            assert columns[name].startswith("approximate"), (name, columns[name])
    for name in ("count", "nan", "pinf", "ninf", "zero", "min", "max", "step", "n_failed"):
        if name in columns:
            assert columns[name].startswith("exact"), (name, columns[name])


def test_every_exported_column_says_whether_it_is_exact(tmp_path) -> None:
    """The spines' sum and sumsq are the stored sums rounded to float64 and their mean and rms derived from them
    (within the bound of their ``method``, spec 5.4), beside exact counts and extremes, but nothing in a frame or an
    exported file said which columns are which: a Parquet or CSV reader saw ``mean`` as exact as ``max``."""
    p = tmp_path / "l.thist"
    _write(p)
    with trainhist.open(p) as h:
        sp, st, sc = frames.spines(h), frames.steps(h), frames.scalars(h)
        frames.to_parquet(h, tmp_path / "pq")
        frames.to_csv(h, tmp_path / "csv")
    for df in (sp, st, sc):
        _check(df.attrs["columns"], df)
    doc = json.loads((tmp_path / "csv" / "manifests.json").read_text())
    for name, df in (("spines", sp), ("steps", st), ("scalars", sc)):
        meta = pq.read_schema(tmp_path / "pq" / f"{name}.parquet").metadata
        columns = json.loads(meta[b"trainhist.columns"])[name]
        _check(columns, df)
        assert doc["trainhist.columns"][name] == columns
        assert pd.read_parquet(tmp_path / "pq" / f"{name}.parquet").attrs["columns"] == columns


def test_the_column_notes_are_not_copied_by_each_operation_on_a_frame(tmp_path) -> None:
    """pandas deep-copies ``df.attrs`` into the result of every operation (a filter, a column, each group of a
    groupby): the notes, a dict of some thirty texts, made a loop over the spines' sites twice as slow (18 -> 39 ms
    for 500 sites). They are shared with the frames derived from one (read-only text), not copied."""
    import copy

    p = tmp_path / "l.thist"
    _write(p)
    with trainhist.open(p) as h:
        sp = frames.spines(h)
    notes = sp.attrs["columns"]
    assert copy.deepcopy(notes) is notes and notes == frames.COLUMN_NOTES["spines"]
    assert sp[sp["step"] >= 0].attrs["columns"] is notes
    assert json.loads(json.dumps(sp.attrs)) == {"columns": frames.COLUMN_NOTES["spines"]}
