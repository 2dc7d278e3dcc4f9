"""Merges of real-world shard sets (elastic training, many shards, a model changed mid-run), checked against an
independent numpy reference, and the report that tells the user what the merge did (guide section 5)."""

from __future__ import annotations

import numpy as np

import trainhist

RUN = "ad" * 16


def _shard(path, rank: int, world: int, steps, *, mode: str = "w", min_segment: int = 0, settings=None) -> str:
    with trainhist.HistoryWriter(path, run_id=RUN, rank=rank, world_size=world, fsync="never", mode=mode,
                                 min_segment=min_segment, settings=settings,
                                 run_created="2026-01-01T00:00:00+00:00") as w:
        s = w.site("enc", "activation")
        for st in steps:
            w.observe(s, st, np.full(4, rank + 1.0, np.float32))
            w.step_truth(st, tokens=1)
    return str(path)


def test_report_notes_hold_segment_and_settings_mismatches(tmp_path, capsys):
    """Elastic training: 4 ranks, then 2, then 3; rank 2 comes back by resuming its own file without
    ``min_segment``, so its segment is numbered 1 where ranks 0 and 1 are at 2, and its steps 20-29 land in
    output segment 1. The report listed it in ``segment_mismatches`` but ``notes`` (which the guide says holds
    each such finding as a sentence, as the command line prints it) was empty for an API user."""
    p = [tmp_path / f"r{r}.thist" for r in range(4)]
    for r in range(4):
        _shard(p[r], r, 4, range(10), settings={"every": 1 + (r == 3)})
    for r in range(2):
        _shard(p[r], r, 2, range(10, 20), mode="a")
    for r in range(3):
        _shard(p[r], r, 3, range(20, 30), mode="a")
    rep = trainhist.merge([str(x) for x in p], tmp_path / "m.thist")
    assert [m["segment"] for m in rep.segment_mismatches] == [1]
    assert [(m["segment"], m["keys"]) for m in rep.settings_mismatches] == [(0, ["every"])]
    seg_notes = [n for n in rep.notes if "output segment 1 start at different steps" in n]
    assert len(seg_notes) == 1 and "20 in " in seg_notes[0]
    assert sum("output segment 0 recorded with different settings (every)" in n for n in rep.notes) == 1
    with trainhist.open(tmp_path / "m.thist") as h:  # segment 1 holds ranks 0, 1 at 10-19 and rank 2 at 20-29
        c = h.spine("enc").columns
        one = c["segment"] == 1
        assert c["step"][one].tolist() == list(range(10, 30))
        assert c["count"][one].tolist() == [8] * 10 + [4] * 10
    from trainhist.cli import main  # (the command line prints the report's notes, each once)

    assert main(["merge", *map(str, p), "-o", str(tmp_path / "c.thist")]) == 0
    out = capsys.readouterr().out
    assert out.count("output segment 1 start at different steps") == 1, out
    assert out.count("output segment 0 recorded with different settings") == 1, out


def test_many_shards_under_a_low_descriptor_limit(tmp_path):
    """128 shards merged by a process that may open fewer than the pool's 64 descriptors (a low ``ulimit -n``,
    or a training process holding many sockets): the pool gave up with a bare ``OSError: Too many open files``
    where closing its own least recently used descriptor lets the merge go on, with the same bytes."""
    import os
    import resource

    paths = []
    for r in range(128):
        with trainhist.HistoryWriter(tmp_path / f"r{r}.thist", run_id=RUN, rank=r, world_size=128, fsync="never",
                                     run_created="2026-01-01T00:00:00+00:00") as w:
            s = w.site("enc", "activation")
            for st in range(3):
                w.observe(s, st, np.full(2, float(r), np.float32))
        paths.append(str(tmp_path / f"r{r}.thist"))
    want = trainhist.merge(paths, tmp_path / "want.thist", workers=1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 24
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        rep = trainhist.merge(paths, tmp_path / "low.thist", workers=1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert rep.rows_out == want.rows_out == 3
    assert (tmp_path / "low.thist").read_bytes() == (tmp_path / "want.thist").read_bytes()
    with trainhist.open(tmp_path / "low.thist") as h:
        assert h.spine("enc").columns["count"].tolist() == [256] * 3


def test_a_rank_missing_from_one_segment_is_reported(tmp_path):
    """Elastic training with a file per rank and segment: 4 ranks, then 2, then 3. Rank 1's shard of segment 1 is
    not given (lost, or left out of the glob): its rows and step truth are missing from the merged segment 1, which
    then reads as complete (each step's ``n_rows`` equals the writers its segment names). The writers' manifests
    say the world size, so the report names the missing rank; the numbers are the ranks' present, checked against
    numpy."""
    rng = np.random.default_rng(3)
    data: dict[tuple[int, int], list[np.ndarray]] = {}
    paths = []
    for seg, world in enumerate((4, 2, 3)):
        for r in range(world):
            p = tmp_path / f"r{r}s{seg}.thist"
            with trainhist.HistoryWriter(p, run_id=RUN, rank=r, world_size=world, fsync="never", min_segment=seg,
                                         run_created="2026-01-01T00:00:00+00:00") as w:
                s = w.site("enc", "activation")
                for st in range(seg * 10, seg * 10 + 10):
                    x = rng.standard_normal(6).astype(np.float32)
                    w.observe(s, st, x)
                    w.step_truth(st, tokens=1)
                    if (r, seg) != (1, 1):
                        data.setdefault((seg, st), []).append(x)
            if (r, seg) != (1, 1):
                paths.append(str(p))
    rep = trainhist.merge(paths, tmp_path / "m.thist")
    assert rep.missing_ranks == [{"segment": 1, "run": RUN, "world_size": 2, "ranks": 1, "missing": [1],
                                  "missing_total": 1}]
    assert sum("output segment 1" in n and "rank 1" in n and "world size of 2" in n for n in rep.notes) == 1
    with trainhist.open(tmp_path / "m.thist") as h:
        c = h.spine("enc").columns
        for i in range(c["step"].size):
            x = np.concatenate(data[(int(c["segment"][i]), int(c["step"][i]))]).astype(np.float64)
            assert int(c["count"][i]) == x.size
            assert (c["min"][i], c["max"][i]) == (x.min(), x.max())
        assert h.steps["n_rows"].tolist() == [4] * 10 + [1] * 10 + [3] * 10
    everything = trainhist.merge(paths + [str(tmp_path / "r1s1.thist")], tmp_path / "all.thist")
    assert everything.missing_ranks == [] and not everything.notes
    alone = trainhist.coarsen(paths[0], tmp_path / "c.thist", steps=2)  # one input: no merge left a rank out
    assert alone.missing_ranks == [] and not alone.notes


def test_cadence_changed_between_segments_reports_the_steps_no_input_planned(tmp_path):
    """The model changed mid-run: a site recorded every 2 steps in segment 0's shards and every step in segment 1's.
    The merged cadence is 1, so segment 0's odd steps, which its inputs read as ``not_scheduled``, read ``unknown``
    in the output; the report said ``unplanned_steps_due: false`` (cadence 1 is an input's own, of another segment)
    and a note that a step only some inputs made due holds those inputs' rows: nothing about the new unknowns."""
    paths = []
    for seg, cad in ((0, 2), (1, 1)):
        for r in range(2):
            p = tmp_path / f"r{r}s{seg}.thist"
            with trainhist.HistoryWriter(p, run_id=RUN, rank=r, world_size=2, fsync="never", min_segment=seg) as w:
                s = w.site("x", "activation", cadence_spine=cad, cadence_sketch=cad)
                for st in range(seg * 10, seg * 10 + 10):
                    if st % cad == 0:
                        w.observe(s, st, np.ones(2))
                    w.step_truth(st, tokens=1)
            paths.append(str(p))
    with trainhist.open(paths[0]) as h:
        assert h.presence("x", steps=[1]) == {1: "not_scheduled"}
    rep = trainhist.merge(paths, tmp_path / "m.thist")
    with trainhist.open(tmp_path / "m.thist") as h:
        assert h.presence("x", steps=[0, 1], segment=0) == {0: "observed", 1: "unknown"}
    [cm] = rep.cadence_mismatches
    assert cm["unplanned_steps_due"] is True and cm["unplanned_segments"] == [0]
    [note] = [n for n in rep.notes if "different cadences" in n]
    assert "read as unknown" in note and "output segment 0" in note
    # the same shards within one segment (ranks at cadences 2 and 1): every step is planned by a rank
    same = []
    for r, cad in ((0, 2), (1, 1)):
        p = tmp_path / f"q{r}.thist"
        with trainhist.HistoryWriter(p, run_id="be" * 16, rank=r, world_size=2, fsync="never") as w:
            w.observe(w.site("x", "activation", cadence_spine=cad, cadence_sketch=cad), 0, np.ones(2))
        same.append(str(p))
    [cm] = trainhist.merge(same, tmp_path / "q.thist").cadence_mismatches
    assert cm["unplanned_steps_due"] is False and cm["unplanned_segments"] == []


def test_elastic_shards_merge_like_numpy_in_any_grouping(tmp_path):
    """Elastic training with the model changed on resumes (a file per rank and segment; 4, 2 then 3 ranks): a site
    of segment 0 only, one added in segment 1, one whose shape changed, a replica; values with subnormals, -0.0,
    NaN-only rows and exponents far apart. Every merged row is the summary of the concatenated values (numpy; the
    sums exact as fractions), and every grouping of the merge, with coarsening before or after, gives the same
    bytes."""
    from fractions import Fraction

    from trainhist.summary import summarize

    rng = np.random.default_rng(5)
    pool = np.array([np.nan, np.inf, -0.0, 0.0, 5e-324, -5e-324, 1e-310, 2.0**-60, -3.0, 1.5, 2.0**900, -2.0**900])
    data: dict[tuple[str, int, int], list[np.ndarray]] = {}
    paths = []
    for seg, world in enumerate((4, 2, 3)):
        for r in range(world):
            p = tmp_path / f"r{r}s{seg}.thist"
            with trainhist.HistoryWriter(p, run_id=RUN, rank=r, world_size=world, fsync="never", min_segment=seg,
                                         run_created="2026-01-01T00:00:00+00:00",
                                         created="2026-01-01T00:00:00+00:00") as w:
                sites = {"enc": w.site("enc", "activation", shape=[6 + 2 * (seg == 2)]),
                         "wt": w.site("wt", "param", sharing="replica"),
                         ("old" if seg == 0 else "new"): w.site("old" if seg == 0 else "new", "activation")}
                for st in range(seg * 6, seg * 6 + 6):
                    for name, s in sites.items():
                        if name == "wt":
                            x = np.full(3, st - 0.0, np.float64)
                        elif st % 5 == 4:
                            x = np.full(2, np.nan)
                        else:
                            x = rng.choice(pool, 6 + 2 * (seg == 2)) * 2.0 ** float(rng.integers(-40, 40))
                        w.observe(s, st, x)
                        if name != "wt" or r == 0:
                            data.setdefault((name, seg, st), []).append(x)
                    w.step_truth(st, tokens=r + 1)
            paths.append(str(p))
    out = tmp_path / "m.thist"
    rep = trainhist.merge(paths, out)
    assert rep.missing_ranks == [] and rep.notes == []
    with trainhist.open(out) as h:
        assert {s.path: s.manifest["shape"] for s in h.sites} == {"enc": None, "new": None, "old": None, "wt": None}
        for site in h.sites:
            sp, sk = h.spine(site.path, site.stream), h.sketch(site.path, site.stream)
            c = sp.columns
            assert c["step"].size == len({k for k in data if k[0] == site.path})
            for i in range(c["step"].size):
                x = np.concatenate(data[(site.path, int(c["segment"][i]), int(c["step"][i]))])
                ref = summarize(x)
                fin = x[np.isfinite(x)]
                assert (int(c["count"][i]), int(c["nan"][i]), int(c["pinf"][i]), int(c["zero"][i])) == (
                    x.size, int(np.isnan(x).sum()), int(np.isposinf(x).sum()), int((x == 0).sum()))
                for got, want in ((c["min"][i], ref.min), (c["max"][i], ref.max)):
                    assert np.float64(got).tobytes() == np.float64(want).tobytes()
                exact = sp.sum_exact(i)
                assert Fraction(exact.m) * Fraction(2) ** exact.e == sum(map(Fraction, fin.tolist()), Fraction(0))
                if ref.sketch is not None:
                    g = sk.sketch(int(c["sk_row"][i]))
                    assert np.array_equal(g.pos, ref.sketch.pos) and np.array_equal(g.neg, ref.sketch.neg)
        assert h.steps["tokens"].tolist() == [10] * 6 + [3] * 6 + [6] * 6
    n = iter(range(100))

    def m(ins):
        o = tmp_path / f"g{next(n)}.thist"
        trainhist.merge(ins, o)
        return o

    def co(i):
        o = tmp_path / f"c{next(n)}.thist"
        trainhist.coarsen(i, o, steps=3, bins_per_octave=2)
        return o

    want = out.read_bytes()
    assert m([m(paths[:5]), m(paths[5:])]).read_bytes() == want
    assert m([paths[8], m([paths[3], m(paths[4:8])]), m(paths[:3])]).read_bytes() == want
    coarse = co(out).read_bytes()
    assert m([co(x) for x in paths]).read_bytes() == coarse
    assert co(m([co(m(paths[::2])), co(m(paths[1::2]))])).read_bytes() == coarse


def test_a_writer_without_a_manifest_leaves_its_run_unjudged_for_missing_ranks(tmp_path):
    """Spec 11.3: a writer without a manifest may be the rank that looks missing, so its run is not judged. Ranks
    0-2 of a world of 3, rank 2's file without its writer manifest: rank 2 was reported missing though its rows
    are in the output."""
    import json
    import sys
    from pathlib import Path

    from trainhist.framing import RecordType

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gen_vectors as gv

    paths = [_shard(tmp_path / f"r{r}.thist", r, 3, range(3)) for r in range(3)]
    data = Path(paths[2]).read_bytes()

    def writer_manifest(r) -> bool:
        return r.type == RecordType.MANIFEST and json.loads(r.payload).get("kind") == "writer"

    recs = gv.parse(data)
    Path(paths[2]).write_bytes(gv.build([r for r in recs if not writer_manifest(r)], data[:32])[0])
    with trainhist.open(paths[2]) as h:
        assert h.writers == [] and h.recovery.status == "clean"
    rep = trainhist.merge(paths, tmp_path / "m.thist")
    assert rep.missing_ranks == [] and not any("contributed nothing" in n for n in rep.notes), rep.notes
    with trainhist.open(tmp_path / "m.thist") as h:
        assert h.spine("enc").count.tolist() == [12, 12, 12]
    two = trainhist.merge(paths[:2], tmp_path / "two.thist")  # (rank 2 left out: still said)
    assert [m["missing"] for m in two.missing_ranks] == [[2]]
