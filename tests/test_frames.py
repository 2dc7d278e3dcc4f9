"""trainhist.frames: a history as pandas data frames and Parquet / CSV files, equal to what the reader gives; rows
without numbers carry NA (never 0); counts beyond 2**53 stay exact; `trainhist export`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import trainhist
from trainhist import frames
from trainhist.cli import main
from trainhist.dyadic import Dyadic
from trainhist.errors import UsageError
from trainhist.summary import Summary, SumMethod

FAST = dict(fsync="never", commit_every=10**9, commit_seconds=1e18)
BIG = 2**63 + 5  # a count beyond 2**53 (and 2**63): exact only as an integer
SRC = str(Path(trainhist.__file__).resolve().parent.parent)


@pytest.fixture
def pd():
    return pytest.importorskip("pandas")


@pytest.fixture
def pq():
    pytest.importorskip("pandas")
    return pytest.importorskip("pyarrow.parquet")


def write_rich(p: Path) -> None:
    """Every presence state, NaN/inf/zero counts, sketched and unsketched rows, phases and micro-batches, unknown
    sums, a count beyond 2**53, scalars (one NaN), partly known step truth and a second segment."""
    rng = np.random.default_rng(7)
    with trainhist.HistoryWriter(p, run_name="frames", config={"lr": 0.1}, **FAST) as w:
        a = w.site("enc.0", "activation")
        g = w.site("enc.0.weight", "param_grad")
        u = w.site("dec.0", "activation", facet="hidden", cadence_sketch=0)
        for step in range(6):
            x = rng.standard_normal(200).astype(np.float32) * (step + 1)
            x[:3] = (np.nan, np.inf, -np.inf) if step % 2 else (0.0, 0.0, np.inf)
            w.observe(a, step, x, sketch=step != 4)
            w.observe(g, step, x[:50], phase="pre_clip", sketch=False)
            w.observe(g, step, x[50:60], phase="post_clip", micro=step % 2, sketch=False)
            w.scalar("loss", step, (math.nan, math.inf)[step - 3] if step in (3, 4) else 1.0 / (step + 1))
            w.step_truth(step, applied=step != 2, loss_scale=2.0**16 if step < 3 else None,
                         tokens=128 * step if step != 1 else None, micro_batches=2 if step else None,
                         clipped=step == 5 or None, grad_basis="unscaled" if step == 0 else None)
        for step, state in zip(range(6, 11), ("failed", "unknown", "absent", "not_scheduled", "skipped")):
            w.mark(a, step, state)
        w.observe(u, 0, summary=Summary(count=4, min=1.0, max=2.0, sum_method=SumMethod.UNKNOWN))
        w.observe(u, 1, np.array([np.nan, np.nan]))  # observed, nothing finite
        w.observe(u, 2, summary=Summary(count=BIG, nan=2, pinf=1, ninf=1, zero=2**63 - 1, min=-1.0, max=1.0,
                                        sum=Dyadic.from_float(0.0), sumsq=Dyadic.from_float(2.0)))
        w.new_segment(20, reason="resume")
        for step in (20, 21):
            w.observe(a, step, rng.standard_normal(64).astype(np.float32))
            w.step_truth(step, applied=True, tokens=128 * step, samples=4)


def reader_columns(h: trainhist.History) -> dict[str, list]:
    """The reader's rows of every site (all phases), in the frame's order, as plain Python values."""
    out: dict[str, list] = {k: [] for k in frames.SPINE_COLUMNS}
    for site in h.sites:
        s = h.spine(site.path, site.stream, site.facet, phase="*")
        for i in range(len(s)):
            out["path"].append(site.path)
            out["stream"].append(site.stream)
            out["facet"].append(site.facet)
            out["phase"].append(trainhist.model.Phase.name(int(s.phase[i])))
            for k in ("segment", "step", "span", "micro"):
                out[k].append(int(s.columns[k][i]))
            out["presence"].append(s.presence_names[i])
            obs = bool(s.observed[i])
            for k in ("count", "nan", "pinf", "ninf", "zero"):
                out[k].append(int(s.columns[k][i]) if obs else None)
            known = obs and int(s.method[i]) != SumMethod.UNKNOWN
            out["min"].append(float(s.min[i]))
            out["max"].append(float(s.max[i]))
            out["sum"].append(float(s.sum[i]) if known else math.nan)
            out["sumsq"].append(float(s.sumsq[i]) if known else math.nan)
            out["method"].append(SumMethod.NAMES[int(s.method[i])] if obs else None)
            # (mean and rms of unknown sums are undefined, spec 5.2: NaN, whatever a reader derives from them)
            out["mean"].append(float(s.mean[i]) if known else math.nan)
            out["rms"].append(float(s.rms[i]) if known else math.nan)
            out["has_sketch"].append(bool(s.sk_row[i] >= 0))
            for k in trainhist.model.TALLY_COLUMNS:  # (a row as written: 1 in its own state)
                out[k].append(int(s.columns[k][i]))
    return out


def frame_columns(pd, df) -> dict[str, list]:
    """The frame's columns as plain Python values (NA as None)."""
    out = {}
    for k in df.columns:
        floats = df[k].dtype == np.float64  # (NaN there is compared as a float)
        out[k] = [None if (not floats and pd.isna(v)) else v for v in df[k].tolist()]
        if df[k].dtype.kind in "iu" or str(df[k].dtype) in ("UInt64", "UInt32"):
            out[k] = [None if v is None else int(v) for v in out[k]]
    return out


def assert_equals_reader(pd, h: trainhist.History, df) -> None:
    want, got = reader_columns(h), frame_columns(pd, df)
    assert list(df.columns) == list(frames.SPINE_COLUMNS)
    for k in frames.SPINE_COLUMNS:
        if k in ("min", "max", "sum", "sumsq", "mean", "rms"):
            np.testing.assert_array_equal(np.array(got[k], np.float64), np.array(want[k], np.float64), err_msg=k)
        else:
            assert got[k] == want[k], k


def test_spines_equal_the_reader_and_rows_without_numbers_carry_na(tmp_path, pd) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    with trainhist.open(p) as h:
        df = frames.spines(h)
        assert_equals_reader(pd, h, df)
    assert str(df["count"].dtype) == "UInt64" and str(df["presence"].dtype) == "category"
    assert list(df["presence"].cat.categories) == list(trainhist.model.Presence.NAMES)
    a = df[df["path"] == "enc.0"]
    marked = a[a["presence"] != "observed"]
    assert sorted(marked["presence"].astype(str)) == sorted(["failed", "unknown", "absent", "not_scheduled", "skipped"])
    # missing is never zero: no count, no float and no method in a row that is not observed
    for k in ("count", "nan", "pinf", "ninf", "zero", "min", "max", "sum", "sumsq", "mean", "rms", "method"):
        assert marked[k].isna().all(), k
    assert not marked["has_sketch"].any()
    obs = a[(a["presence"] == "observed") & (a["segment"] == 0)]
    assert obs["count"].notna().all() and (obs["count"] == 200).sum() == 6
    assert obs["has_sketch"].tolist() == [True] * 4 + [False, True]  # (step 4 unsketched)
    assert (obs["nan"] == 1).sum() == 3 and (obs["zero"] >= 2).sum() == 3 and (obs["pinf"] == 1).all()
    # unknown sums (spec 5.4) and a row with nothing finite: no sum, mean or rms, yet the counts
    d = df[df["path"] == "dec.0"].reset_index(drop=True)
    assert d["facet"].tolist() == ["hidden"] * 3
    assert d.loc[0, "method"] == "unknown" and int(d.loc[0, "count"]) == 4
    assert math.isnan(d.loc[0, "sum"]) and math.isnan(d.loc[0, "sumsq"]) and math.isnan(d.loc[0, "mean"])
    assert int(d.loc[1, "nan"]) == 2 and d.loc[1, "sum"] == 0.0 and math.isnan(d.loc[1, "mean"])
    assert math.isnan(d.loc[1, "min"]) and math.isnan(d.loc[1, "rms"])
    # beyond 2**53: exact
    assert int(d.loc[2, "count"]) == BIG and int(d.loc[2, "zero"]) == 2**63 - 1 and d.loc[2, "mean"] == 0.0
    # phases and micro-batches, segments
    gr = df[df["path"] == "enc.0.weight"]
    assert sorted(set(gr["phase"].astype(str))) == ["post_clip", "pre_clip"]
    assert set(gr.loc[gr["phase"] == "post_clip", "micro"]) == {0, 1}
    assert set(gr.loc[gr["phase"] == "pre_clip", "micro"]) == {trainhist.model.MICRO_ALL}
    assert a.loc[a["segment"] == 1, "step"].tolist() == [20, 21]


def test_spines_select_streams_sites_and_phases(tmp_path, pd) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    with trainhist.open(p) as h:
        full = frames.spines(h)
        assert set(frames.spines(h, streams="scalar")["path"]) == {"loss"}
        grads = frames.spines(h, sites="*.weight", phases=["post_clip"])
        assert len(grads) == 6 and set(grads["phase"].astype(str)) == {"post_clip"}
        both = frames.spines(h, streams=["activation"], sites=["enc.*", "dec.?"])
        assert set(both["path"]) == {"enc.0", "dec.0"}
        assert len(both) == ((full["stream"] == "activation").sum())
        with pytest.raises(UsageError) as e:
            frames.spines(h, sites="encoder.*")  # a typo gives an error, not an empty frame
        assert e.value.code == "no_match" and "enc.0" in str(e.value)
        with pytest.raises(UsageError) as e:
            frames.spines(h, streams="activations")
        assert e.value.code == "unknown_name"
        with pytest.raises(UsageError) as e:
            frames.spines(h, phases="pre-clip")
        assert e.value.code == "unknown_name"


def test_steps_unknown_values_are_na(tmp_path, pd) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    with trainhist.open(p) as h:
        t = frames.steps(h)
        rows = h.step_truth_rows()
    assert len(t) == len(rows) == 8
    for i, r in enumerate(rows):
        for k in ("segment", "step", "span"):
            assert int(t.loc[i, k]) == r[k]
        for k in ("applied", "grad_basis", "clipped"):
            v = t.loc[i, k]
            assert (r[k] == "unknown" and pd.isna(v)) or v == r[k], (i, k)
        for k in ("loss_scale", "clip_threshold", "micro_batches", "tokens", "samples"):
            v = t.loc[i, k]
            assert (r[k] is None and pd.isna(v)) or v == r[k], (i, k)
    assert t["tokens"].isna().tolist() == [False, True] + [False] * 6  # unknown, not 0
    assert int(t.loc[0, "tokens"]) == 0 and t.loc[0, "micro_batches"] is pd.NA and int(t.loc[1, "micro_batches"]) == 2
    assert t["samples"].isna().sum() == 6 and t["clip_threshold"].isna().all()
    assert str(t["tokens"].dtype) == "UInt64" and list(t["applied"].cat.categories) == ["applied", "skipped"]


def test_scalars_tell_a_recorded_nan_from_a_missing_value(tmp_path, pd) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    with trainhist.open(p) as h:
        s = frames.scalars(h)
        assert frames.scalars(h, names="lo*").equals(s)
    assert s["name"].tolist() == ["loss"] * 6 and s["step"].tolist() == list(range(6))
    v = s["value"].tolist()
    assert v[:3] == [1.0, 0.5, 1 / 3] and math.isnan(v[3]) and v[4] == math.inf and v[5] == 1 / 6
    assert (s["presence"] == "observed").all()  # step 3's NaN is a recorded value
    with trainhist.open(p) as h, pytest.raises(UsageError) as e:
        frames.scalars(h, names="Loss")  # (case sensitive)
    assert e.value.code == "no_match" and "scalar name pattern 'Loss'" in str(e.value) and "loss" in str(e.value)
    assert "site" not in e.value.message


def test_coarsened_merged_and_segmented_files(tmp_path, pd) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    c = tmp_path / "coarse.thist"
    trainhist.coarsen(p, c, steps=4, bins_per_octave=1)
    with trainhist.open(c) as h:
        df = frames.spines(h)
        assert_equals_reader(pd, h, df)
        t = frames.steps(h)
    a = df[(df["path"] == "enc.0") & (df["segment"] == 0)]
    assert a["span"].tolist() == [4, 4, 4] and a["step"].tolist() == [0, 4, 8]
    # windows 4..7 (observed, then failed at 6 and unknown at 7) and 8..11 (absent, not_scheduled, skipped) take the
    # state of highest precedence (spec 11.4) and carry no numbers
    assert a["presence"].astype(str).tolist() == ["observed", "failed", "skipped"]
    assert a["count"].isna().tolist() == [False, True, True] and int(a["count"].iloc[0]) == 800
    assert (t["span"] > 1).any()
    # two ranks of one run, merged: counts add, exactly
    ranks = []
    for rank in (0, 1):
        r = tmp_path / f"r{rank}.thist"
        with trainhist.HistoryWriter(r, run_id="ab" * 16, rank=rank, world_size=2, **FAST) as w:
            s = w.site("h", "param_grad")
            for step in range(3):
                w.observe(s, step, summary=Summary(count=BIG // 2, zero=BIG // 2 - 1, min=2.0, max=2.0,
                                                   sum=Dyadic.from_float(2.0), sumsq=Dyadic.from_float(4.0)))
            w.mark(s, 3, "failed" if rank else "absent")
        ranks.append(r)
    m = tmp_path / "merged.thist"
    trainhist.merge(ranks, m)
    with trainhist.open(m) as h:
        df = frames.spines(h)
        assert_equals_reader(pd, h, df)
    assert [int(x) for x in df["count"].iloc[:3]] == [2 * (BIG // 2)] * 3 and df["sum"].iloc[:3].tolist() == [4.0] * 3
    assert df["presence"].astype(str).iloc[3] == "failed" and df["count"].iloc[3] is pd.NA


def test_parquet_round_trip_with_manifests(tmp_path, pq, pd) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    out = tmp_path / "out"
    with trainhist.open(p) as h:
        written = frames.to_parquet(h, out)
        want = {"spines": frames.spines(h), "steps": frames.steps(h), "scalars": frames.scalars(h)}
        runs, segments = h.runs, [g.manifest for g in h.segments]
    assert [(e.table, e.path.name, e.rows) for e in written] == [
        (k, f"{k}.parquet", len(v)) for k, v in want.items()]
    for name, df in want.items():
        back = pd.read_parquet(out / f"{name}.parquet")
        pd.testing.assert_frame_equal(back, df)
        meta = pq.read_schema(out / f"{name}.parquet").metadata
        assert meta[b"trainhist.table"] == name.encode()
        assert json.loads(meta[b"trainhist.runs"]) == runs and runs[0]["config"] == {"lr": 0.1}
        assert json.loads(meta[b"trainhist.segments"]) == segments and len(segments) == 2
        assert len(json.loads(meta[b"trainhist.writers"])) == 1
        assert json.loads(meta[b"trainhist.recovery"])["status"] == "clean"
    back = pd.read_parquet(out / "spines.parquet")
    assert int(back["count"].max()) == BIG and back["count"].isna().sum() == 5
    # a path ending in .parquet: the spines alone, here of one stream
    with trainhist.open(p) as h:
        one = frames.to_parquet(h, tmp_path / "acts.parquet", streams="activation")
        acts = frames.spines(h, streams="activation")
    assert [e.table for e in one] == ["spines"]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "acts.parquet"), acts)
    assert sorted(os.listdir(tmp_path)) == sorted(["acts.parquet", "out", "rich.thist"])  # (no temporary left)


def test_csv_keeps_na_empty_and_counts_exact(tmp_path, pd) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    with trainhist.open(p) as h:
        written = frames.to_csv(h, tmp_path / "csv")
    assert [e.path.name for e in written] == ["spines.csv", "steps.csv", "scalars.csv", "manifests.json"]
    lines = (tmp_path / "csv" / "spines.csv").read_text().splitlines()
    failed = next(ln for ln in lines if ",failed," in ln).split(",")
    assert failed[9:18] == [""] * 9  # count .. sumsq: empty, never 0
    assert any(f",{BIG}," in ln for ln in lines)
    back = pd.read_csv(tmp_path / "csv" / "spines.csv", dtype={"count": "UInt64"})
    assert int(back["count"].max()) == BIG
    doc = json.loads((tmp_path / "csv" / "manifests.json").read_text())
    assert doc["trainhist.runs"][0]["name"] == "frames"


def test_quantiles_are_derived_with_their_bound(tmp_path, pd) -> None:
    from trainhist.figures import quantiles_from_sketch

    p = tmp_path / "q.thist"
    rng = np.random.default_rng(3)
    data = [rng.lognormal(0, 2, 20000) * rng.choice([-1, 1], 20000) for _ in range(3)]
    with trainhist.HistoryWriter(p, **FAST) as w:
        s = w.site("x", "activation")
        for step, x in enumerate(data):
            w.observe(s, step, x, sketch=step != 1)
        w.mark(s, 3, "failed")
    qs = (0.05, 0.5, 0.95)
    with trainhist.open(p) as h:
        df = frames.quantiles(h, "x", q=qs)
        sk = h.sketch("x")
        sp = h.spine("x")
    assert df["step"].tolist() == [0, 2]  # the sketched rows
    assert [c for c in df.columns if c.startswith("approx_q")] == ["approx_q0.05", "approx_q0.5", "approx_q0.95"]
    bound = 2 ** (1 / 4) - 1
    assert (df["rel_bound"] == bound).all() and not df["zeros_estimated"].any()
    assert "approximate" in df.attrs
    at = np.flatnonzero(sp.sk_row >= 0)
    want = quantiles_from_sketch(sk.pos, sk.neg, sk.bands, sp.zero[at], sk.scale, qs)
    np.testing.assert_array_equal(df[["approx_q0.05", "approx_q0.5", "approx_q0.95"]].to_numpy(), want)
    for row, x in zip(range(2), (data[0], data[2])):
        true = np.quantile(x, qs, method="inverted_cdf")
        got = df.iloc[row][["approx_q0.05", "approx_q0.5", "approx_q0.95"]].to_numpy(np.float64)
        assert (np.abs(got - true) <= bound * np.abs(true)).all(), (got, true)
    with trainhist.open(p) as h:
        with pytest.raises(UsageError):
            frames.quantiles(h, "x", q=(0.5, 1.5))
        c = tmp_path / "c.thist"
        trainhist.coarsen(p, c, bins_per_octave=1)
    with trainhist.open(c) as h:
        assert (frames.quantiles(h, "x")["rel_bound"] == 1.0).all()  # one bin per octave: within a factor 2


def test_cli_export(tmp_path, pq, pd, capsys) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    out = tmp_path / "out"
    assert main(["export", str(p), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{out / 'spines.parquet'}: " in printed and "scalars.parquet: 6 rows" in printed
    with trainhist.open(p) as h:
        pd.testing.assert_frame_equal(pd.read_parquet(out / "spines.parquet"), frames.spines(h))
        grads = frames.spines(h, streams="param_grad", phases="pre_clip")
    assert main(["export", str(p), "-o", str(tmp_path / "g.csv"), "--format", "csv", "--streams", "param_grad",
                 "--phases", "pre_clip"]) == 0
    assert len((tmp_path / "g.csv").read_text().splitlines()) == 1 + len(grads) == 7
    assert main(["export", str(p), "-o", str(tmp_path / "x"), "--sites", "nothing.*"]) == 2
    err = capsys.readouterr().err
    assert "[no_match]" in err and not (tmp_path / "x").exists()
    assert main(["export", str(p), "-o", str(p)]) == 2  # the history itself is a file, not a directory
    assert "[bad_output]" in capsys.readouterr().err
    assert main(["export", str(p), "-o", str(tmp_path / "s.csv")]) == 2  # parquet named .csv: a typo, refused
    assert "[bad_output]" in capsys.readouterr().err and not (tmp_path / "s.csv").exists()


def test_torn_file_exports_its_committed_prefix_with_exit_3(tmp_path, pq, pd, capsys) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    with open(p, "ab") as f:
        f.write(b"\x01" * 10)  # a torn tail after the last commit
    assert main(["export", str(p), "-o", str(tmp_path / "out")]) == 3
    out = capsys.readouterr().out  # (a note on stdout, as merge and triage print theirs)
    assert f"note: {p}: torn tail recovered: " in out and "dropped 10 bytes" in out and "committed prefix" in out
    clean = tmp_path / "clean.thist"
    write_rich(clean)
    assert main(["export", str(clean), "-o", str(tmp_path / "out2")]) == 0
    assert "note" not in capsys.readouterr().out
    meta = pq.read_schema(tmp_path / "out" / "steps.parquet").metadata
    assert json.loads(meta[b"trainhist.recovery"])["status"] == "torn"


CHILD = textwrap.dedent(
    r'''
    import importlib.abc, json, sys

    blocked = tuple(sys.argv[2].split(","))

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by test_frames)", name=name)
            return None

    sys.meta_path.insert(0, Block())
    import numpy as np
    import trainhist
    from trainhist import frames
    from trainhist.errors import UsageError

    with trainhist.HistoryWriter(sys.argv[1], fsync="never") as w:
        w.observe(w.site("a", "activation"), 0, np.ones(4))
    out = {}
    with trainhist.open(sys.argv[1]) as h:
        h.spine("a"), h.sketch("a"), h.steps
        out["loaded"] = sorted(m for m in ("pandas", "pyarrow") if m in sys.modules)
        for name, call in (("spines", lambda: frames.spines(h)),
                           ("to_parquet", lambda: frames.to_parquet(h, sys.argv[1] + ".parquet"))):
            try:
                call()
                out[name] = "ok"
            except UsageError as e:
                out[name] = [e.code, e.message]
    print(json.dumps(out))
    '''
)


def run_child(tmp_path: Path, blocked: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "a.thist"), blocked], capture_output=True,
                          text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_reader_needs_no_pandas_and_frames_say_how_to_install_it(tmp_path) -> None:
    out = run_child(tmp_path, "pandas,pyarrow")
    assert out["loaded"] == []  # trainhist, trainhist.frames and reading a file import neither
    for name in ("spines", "to_parquet"):
        code, message = out[name]
        assert code == "needs_export" and "pip install 'trainhist[export]'" in message


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, pd) -> None:
    out = run_child(tmp_path, "pyarrow")
    assert out["spines"] == "ok"
    code, message = out["to_parquet"]
    assert code == "needs_export" and "pyarrow" in message and "trainhist[export]" in message


def test_export_records_a_selection_given_as_generators(tmp_path, pq, pd) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    with trainhist.open(p) as h:
        written = frames.to_parquet(h, tmp_path / "pq", sites=(s for s in ["enc.*"]), streams=iter(["activation"]),
                                    phases=(x for x in ["default"]))
        csv = frames.to_csv(h, tmp_path / "csv", sites=(s for s in ["enc.*"]), streams=iter(["activation"]))
        want = frames.spines(h, sites="enc.*", streams="activation", phases="default")
    assert written[0].rows == len(want) > 0
    meta = pq.read_schema(written[0].path).metadata
    assert json.loads(meta[b"trainhist.selection"]) == {"streams": ["activation"], "sites": ["enc.*"],
                                                        "phases": ["default"]}
    doc = json.loads(csv[-1].path.read_text())
    assert doc["trainhist.selection"] == {"streams": ["activation"], "sites": ["enc.*"], "phases": None}


def test_parquet_compression_is_checked_before_anything_is_written(tmp_path, pq, pd) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    with trainhist.open(p) as h:
        for out in (tmp_path / "tables", tmp_path / "one.parquet"):
            with pytest.raises(UsageError) as e:
                frames.to_parquet(h, out, compression="bogus")
            assert e.value.code == "bad_argument" and "'bogus'" in str(e.value) and "zstd" in str(e.value)
            assert not out.exists()
        written = frames.to_parquet(h, tmp_path / "gz.parquet", compression="GZIP")
    assert pq.ParquetFile(written[0].path).metadata.row_group(0).column(0).compression == "GZIP"


def test_csv_manifests_are_written_beside_and_renamed_like_the_tables(tmp_path, pd, monkeypatch) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)
    renamed = []
    real = os.replace

    def spy(src, dst):
        renamed.append((Path(src).name, Path(dst).name))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    with trainhist.open(p) as h:
        frames.to_csv(h, tmp_path / "csv")
    assert [dst for _, dst in renamed] == ["spines.csv", "steps.csv", "scalars.csv", "manifests.json"]
    assert all(src.startswith(f".{dst}.tmp") for src, dst in renamed)
    assert sorted(os.listdir(tmp_path / "csv")) == ["manifests.json", "scalars.csv", "spines.csv", "steps.csv"]


def test_quantiles_of_every_phase_say_their_phase(tmp_path, pd) -> None:
    p = tmp_path / "g.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        g = w.site("g", "param_grad")
        for step in range(2):
            w.observe(g, step, np.full(10, 1.0), phase="pre_clip")
            w.observe(g, step, np.full(10, 0.1), phase="post_clip")
    with trainhist.open(p) as h:
        every = frames.quantiles(h, "g", "param_grad", phase="*", q=[0.5])
        one = {ph: frames.quantiles(h, "g", "param_grad", phase=ph, q=[0.5]) for ph in ("pre_clip", "post_clip")}
    assert list(every.columns[:5]) == ["phase", "segment", "step", "span", "micro"]
    assert list(every["phase"].cat.categories) == list(trainhist.model.Phase.NAMES)
    assert every["phase"].astype(str).tolist() == ["pre_clip", "post_clip"] * 2
    assert every["step"].tolist() == [0, 0, 1, 1]
    for ph, df in one.items():
        assert (df["phase"] == ph).all()
        mine = every[every["phase"] == ph].reset_index(drop=True)
        pd.testing.assert_frame_equal(mine, df)
    assert every.loc[every["phase"] == "pre_clip", "approx_q0.5"].iloc[0] > 0.5 > every["approx_q0.5"].iloc[1]


def test_quantiles_are_the_lower_quantile_of_the_finite_values(tmp_path, pd) -> None:
    # the documented definition: the value of rank max(1, ceil(q n)) of the n finite values (numpy's inverted_cdf),
    # not an interpolation; NaN and ±inf are no values; q=0 and 1 the least and greatest
    p = tmp_path / "q.thist"
    data = [np.array([1.0, 100.0]), np.array([-300.0, 1e-3, 0.0, 0.0, 7.0, 50.0, 900.0]),
            10.0 ** np.arange(-5, 5), np.array([3.0, np.nan, np.inf, -np.inf, 40.0, 0.5])]
    with trainhist.HistoryWriter(p, **FAST) as w:
        s = w.site("a", "activation")
        for step, x in enumerate(data):
            w.observe(s, step, x)
    qs = (0.0, 0.1, 0.25, 0.3, 0.5, 0.6, 0.7, 0.75, 0.9, 1.0)
    with trainhist.open(p) as h:
        df = frames.quantiles(h, "a", q=qs)
    bound = df["rel_bound"].iloc[0]
    for row, x in enumerate(data):
        f = np.sort(x[np.isfinite(x)])
        for q in qs:
            got = df[f"approx_q{q:g}"].iloc[row]
            want = f[max(1, math.ceil(q * len(f))) - 1]
            assert want == np.quantile(f, q, method="inverted_cdf")
            assert abs(got - want) <= bound * abs(want), (row, q, got, want)
    assert abs(df["approx_q0.5"].iloc[0] - 1.0) <= bound and np.quantile(data[0], 0.5) == 50.5  # (interpolated)
    o = tmp_path / "over.thist"
    with trainhist.HistoryWriter(o, **FAST) as w:
        w.observe(w.site("a", "activation"), 0, np.array([1.0, 2.0**17]))  # (beyond the window's 2**16)
    with trainhist.open(o) as h:
        over = frames.quantiles(h, "a", q=(0.5, 1.0))
    assert abs(over["approx_q0.5"].iloc[0] - 1.0) <= bound and math.isnan(over["approx_q1"].iloc[0])


def test_path_and_facet_are_categoricals_in_declaration_order(tmp_path, pq, pd) -> None:
    p = tmp_path / "order.thist"
    names = ["layers.10", "layers.2", "head", "layers.1"]  # (neither sorted nor natural order)
    with trainhist.HistoryWriter(p, **FAST) as w:
        sites = [w.site(n, "activation", facet="out" if n == "head" else None) for n in names]
        g = w.site("layers.2", "activation_grad", facet="in")  # (a path twice: one category)
        lr = w.site("lr", "scalar")
        for step in range(3):
            for k, s in enumerate(sites):
                w.observe(s, step, np.full(4, k + 1.0))
            w.observe(g, step, np.ones(2))
            w.scalar("loss", step, 0.5)
            w.observe(lr, step, np.array([0.1]))
    with trainhist.open(p) as h:
        df = frames.spines(h)
        acts = frames.spines(h, streams="activation", sites="layers.*")
        sc = frames.scalars(h)
        frames.to_parquet(h, tmp_path / "out")
        frames.to_csv(h, tmp_path / "csv")
    assert isinstance(df["path"].dtype, pd.CategoricalDtype) and isinstance(df["facet"].dtype, pd.CategoricalDtype)
    assert list(df["path"].cat.categories) == names + ["lr", "loss"]  # (lr declared before loss's first scalar)
    assert list(df["facet"].cat.categories) == ["out", "in"]
    assert df["facet"].isna().sum() == len(df) - 6 and (df.loc[df["path"] == "head", "facet"] == "out").all()
    assert list(acts["path"].cat.categories) == ["layers.10", "layers.2", "layers.1"]  # (the chosen sites')
    assert list(acts.pivot(index="step", columns="path", values="mean").columns) == ["layers.10", "layers.2",
                                                                                     "layers.1"]
    assert list(sc["name"].cat.categories) == ["lr", "loss"] and sc["name"].tolist() == ["lr"] * 3 + ["loss"] * 3
    for name, want in (("spines", df), ("scalars", sc)):  # (categories and their order survive Parquet)
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "out" / f"{name}.parquet"), want)
    back = pd.read_csv(tmp_path / "csv" / "spines.csv", keep_default_na=False, na_values=[""])
    assert back["path"].tolist() == df["path"].tolist()


def test_a_categorical_of_no_categories_survives_parquet(tmp_path, pq, pd) -> None:
    """Where no site has a facet, ``facet`` is a categorical without categories, every value missing: Parquet kept
    it as a column of nulls, read back as ``object``; it reads back as the categorical it was."""
    p = tmp_path / "plain.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        a = w.site("enc", "activation")
        for step in range(2):
            w.observe(a, step, np.ones(3))
            w.scalar("loss", step, 0.5)
    with trainhist.open(p) as h:
        df = frames.spines(h)
        frames.to_parquet(h, tmp_path / "out")
    assert isinstance(df["facet"].dtype, pd.CategoricalDtype) and len(df["facet"].cat.categories) == 0
    back = pd.read_parquet(tmp_path / "out" / "spines.parquet")
    assert isinstance(back["facet"].dtype, pd.CategoricalDtype) and back["facet"].isna().all()
    pd.testing.assert_frame_equal(back, df)


def test_output_paths_are_checked_and_their_errors_name_them(tmp_path, pd, pq, capsys) -> None:
    p = tmp_path / "rich.thist"
    write_rich(p)

    def refused(out, code="bad_output", fmt="parquet"):
        with trainhist.open(p) as h, pytest.raises(trainhist.errors.TrainhistError) as e:
            (frames.to_parquet if fmt == "parquet" else frames.to_csv)(h, out)
        assert e.value.code == code, e.value
        assert ".tmp" not in str(e.value)  # (the temporary file beside the output is never named)
        return e.value

    # a missing parent folder is refused, for a file as for a directory (merge's check), nothing is created
    for out, fmt in ((tmp_path / "nope" / "x.parquet", "parquet"), (tmp_path / "nope" / "x.csv", "csv"),
                     (tmp_path / "nope" / "dir", "parquet"), (tmp_path / "nope" / "dir", "csv")):
        e = refused(out, fmt=fmt)
        assert str(out) in str(e) and f"the folder {tmp_path / 'nope'} does not exist" in str(e)
        assert "create it first" in str(e) and isinstance(e, UsageError)
    assert not (tmp_path / "nope").exists()
    # an empty path, as the command line refuses it; a suffix of no format
    assert "'' is not a path" in str(refused(""))
    e = refused(tmp_path / "run.pq")
    assert "ends in .pq" in str(e) and "end the path with /" in str(e) and not (tmp_path / "run.pq").exists()
    os.mkdir(tmp_path / "d.parquet")
    assert "is a directory" in str(refused(tmp_path / "d.parquet"))
    # ... but a path ending in / is a directory, whatever its name; an existing one with a dot too
    with trainhist.open(p) as h:
        assert [e.path for e in frames.to_parquet(h, f"{tmp_path / 'tables.v2'}{os.sep}")][0] == \
            tmp_path / "tables.v2" / "spines.parquet"
        assert frames.to_parquet(h, tmp_path / "tables.v2")[0].path == tmp_path / "tables.v2" / "spines.parquet"
        assert frames.to_parquet(h, str(tmp_path / "d.parquet") + "/")[0].path.parent == tmp_path / "d.parquet"
    # a file of the directory that is a directory: merge's check, per file
    os.makedirs(tmp_path / "t" / "steps.parquet")
    assert "steps.parquet exists and is not a regular file" in str(refused(tmp_path / "t"))
    # a folder that takes no files: output_unwritable on the output's path (a TrainhistError, not a UsageError)
    if os.path.isdir("/proc/self"):
        for out in ("/proc/trainhist-x.parquet", "/proc/trainhist-dir"):
            e = refused(out, code="output_unwritable")
            assert e.path == out and not isinstance(e, UsageError) and "/proc exists but takes no new files" in str(e)
        assert main(["export", str(p), "-o", "/proc/trainhist-x.parquet"]) == 1
        err = capsys.readouterr().err
        assert "[output_unwritable] /proc/trainhist-x.parquet: cannot write the output" in err and ".tmp" not in err
    assert main(["export", str(p), "-o", str(tmp_path / "nope" / "x.parquet")]) == 2
    assert f"[bad_output] output {tmp_path / 'nope' / 'x.parquet'}: the folder" in capsys.readouterr().err


def test_cli_export_help_says_where_the_file_goes(tmp_path, pq, pd, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # (one line per paragraph: no wrapping inside the words checked)
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Name FILE before the options, or after --" in text and "FILE goes before the options or after --" in text
    p = tmp_path / "rich.thist"
    write_rich(p)
    assert main(["export", "-o", str(tmp_path / "out"), "--sites", "enc.*", "--", str(p)]) == 0  # (as it says)
    assert (tmp_path / "out" / "spines.parquet").exists()


def test_every_metadata_key_is_documented_as_written(tmp_path, pq, pd) -> None:
    import re

    p = tmp_path / "rich.thist"
    write_rich(p)
    with trainhist.open(p) as h:
        f = frames.to_parquet(h, tmp_path / "s.parquet")[0].path
        doc = json.loads(frames.to_csv(h, tmp_path / "csv")[-1].path.read_text())
    meta = {k.decode(): v.decode() for k, v in pq.read_schema(f).metadata.items() if k.startswith(b"trainhist.")}
    documented = set(re.findall(r"``(trainhist\.[a-z]+)``", frames.__doc__))
    guide = (Path(SRC).parent / "docs" / "guide.md").read_text()
    assert set(meta) == documented and all(f"`{k}`" in guide for k in meta)
    plain = {"trainhist.table", "trainhist.version"}  # (documented as plain text; every other key as JSON)
    assert meta["trainhist.table"] == "spines" and meta["trainhist.version"] == trainhist.__version__
    for k in set(meta) - plain:
        json.loads(meta[k])
    recovery = json.loads(meta["trainhist.recovery"])
    assert recovery == {"status": "clean", "committed_bytes": p.stat().st_size, "dropped_bytes": 0, "reason": None}
    assert all(f'"{field}"' in frames.__doc__ and f"`{field}`" in guide for field in recovery)
    assert set(doc) == set(meta) - {"trainhist.table"} and doc["trainhist.version"] == trainhist.__version__


def test_quantiles_of_a_row_whose_sketch_holds_part_of_its_values_carry_no_bound(tmp_path) -> None:
    """Two ranks' rows merged, one sketched and one not: the merged sketch holds rank 0's values alone. Its q0.95
    was 1.09 against a true 1089.9 with the 0.19 bound claimed; the row's share and a NaN bound say so now."""
    run = "cd" * 16
    paths = []
    for rank, (scale, sketch) in enumerate(((1.0, True), (1000.0, False))):
        p = tmp_path / f"r{rank}.thist"
        with trainhist.HistoryWriter(p, run_id=run, rank=rank, world_size=2) as w:
            w.observe(w.site("x", "activation"), 0, scale * np.linspace(1, 1.1, 100), sketch=sketch)
        paths.append(p)
    trainhist.merge(paths, tmp_path / "m.thist")
    with trainhist.open(tmp_path / "m.thist") as h:
        df = frames.quantiles(h, "x", q=(0.5, 0.95))
    assert df["sketch_share"].tolist() == [0.5] and df["zeros_estimated"].tolist() == [True]
    assert np.isnan(df["rel_bound"].iloc[0]) and "1 of 1 rows" in df.attrs["approximate"]
    with trainhist.open(paths[0]) as h:  # (a whole sketch: share 1, the bound stated)
        df = frames.quantiles(h, "x")
    assert df["sketch_share"].tolist() == [1.0] and df["rel_bound"].iloc[0] == pytest.approx(2 ** 0.25 - 1)


def test_spines_carry_the_tally_of_a_window_that_absorbed_a_skipped_update(tmp_path, pd) -> None:
    """observed outranks skipped (spec 11.4): the frame said nothing of a window's skipped step (its count 6 where
    a whole window has 8); the tally columns say it now, and a row as written has 1 in its own state."""
    from history_helpers import skipped_updates

    raw = skipped_updates(tmp_path / "r.thist", 4, (1,))
    trainhist.coarsen(raw, tmp_path / "c.thist", steps=4)
    with trainhist.open(tmp_path / "c.thist") as h:
        row = frames.spines(h).iloc[0]
    assert (row["presence"], row["count"], row["n_observed"], row["n_skipped"]) == ("observed", 6, 3, 1)
    with trainhist.open(raw) as h:
        df = frames.spines(h)
    assert df["n_skipped"].tolist() == [0, 1, 0, 0] and df["n_observed"].tolist() == [1, 0, 1, 1]
    assert str(df["n_skipped"].dtype) == "UInt64"
