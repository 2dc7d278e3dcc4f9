"""Merge and coarsen (spec section 11): algebraic properties byte for byte, semantics, and every refusal.

Property tests draw random sets of shards written through ``HistoryWriter``: subnormals, -0.0, NaN payloads,
infinities, values on exact bin edges and at the window edges, empty tensors, absent/failed/skipped/unknown rows,
duplicate rows, several segments, negative steps, micro-batches and phases, a replica site, step truth, and
precomputed Summaries with counts near 2**60 and exact sums that are not floats. Example counts are set per test
(``EXAMPLES``); the whole file runs in well under two minutes on two cores.
"""

from __future__ import annotations

import gc
import importlib
import math
import os
import struct
import subprocess
import sys
import tempfile
import uuid

import numpy as np
import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainhist
from trainhist.dump import canonical
from trainhist.dyadic import Dyadic
from trainhist.errors import MergeError
from trainhist.model import Presence
from trainhist.summary import Sketch, Summary, summarize

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

merge_mod = importlib.import_module("trainhist.merge")  # the module (trainhist.merge is also the function)

EXAMPLES = {"algebra": 40, "coarsen": 40, "roundtrip": 30, "partition": 30, "semantics": 50}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
if os.environ.get("TRAINHIST_NO_SHRINK"):
    from hypothesis import Phase

    SETTINGS["phases"] = [Phase.explicit, Phase.reuse, Phase.generate]


def _nan(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


SPECIAL = [
    0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, -2.2250738585072014e-308, 2.0**-48, -(2.0**-48),
    2.0**-48 * (1 + 2**-52), 2.0**16, -(2.0**16), 2.0**16 * (1 + 2**-52), 1.0, -1.0, 0.5, 2.0**0.25, 2.0**0.5,
    2.0**0.75, math.inf, -math.inf, math.nan, _nan(0x7FF0000000000001), _nan(0xFFF8000000000123), 1e300, -1e300,
    3.0, 0.1, -7.25, 1e-20,
]
value = st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=True, allow_infinity=True, width=64),
                  st.floats(min_value=-100, max_value=100, width=32))
values = st.lists(value, min_size=0, max_size=12)

PRESENCES = ["absent", "failed", "skipped", "unknown", "not_scheduled"]
event = st.tuples(
    st.sampled_from(["obs", "obs", "obs", "big", "mark", "segment"]),
    st.integers(0, 1),  # site
    st.integers(-3, 12),  # step
    st.sampled_from(["default", "pre_clip"]),
    st.sampled_from([None, None, 0, 1]),  # micro
    values,
    st.sampled_from(PRESENCES),
    st.integers(0, 2**20),  # seed for big summaries
    st.sampled_from(["f32", "f64"]),
)
shard = st.lists(event, min_size=0, max_size=10)
truth = st.lists(st.tuples(st.integers(-3, 12), st.sampled_from([None, True, False]), st.integers(0, 3),
                           st.sampled_from([None, 1024.0, 2048.0])), max_size=6)
shards = st.lists(st.tuples(shard, truth), min_size=1, max_size=4)
replica_steps = st.lists(st.tuples(st.integers(-3, 12), values), max_size=4, unique_by=lambda t: t[0])


def big_summary(seed: int) -> Summary:
    r = np.random.default_rng(seed)
    count = int(r.integers(2**59, 2**60))
    nan, pinf, ninf = (int(x) for x in r.integers(0, 2**56, 3))
    finite = count - nan - pinf - ninf
    zero = int(r.integers(0, 2**50))
    sk = Sketch.empty()
    rest = finite - zero
    k = int(r.integers(0, 256))
    sk.pos[k] = rest // 2
    sk.neg[(k * 7) % 256] = rest - rest // 2 - 3
    sk.under_pos, sk.over_neg, sk.over_pos = 1, 1, 1
    m = (int(r.integers(1, 2**62)) << 8 | int(r.integers(0, 256))) | 1
    return Summary(count=count, nan=nan, pinf=pinf, ninf=ninf, zero=zero, min=-float(r.integers(1, 9)) * 2.0**-30,
                   max=float(r.integers(1, 9)) * 2.0**10, sum=Dyadic.make(m if seed % 2 else -m, -int(seed % 90)),
                   sumsq=Dyadic.make(m * m, -2 * int(seed % 90)), sum_method=[0, 1, 2, 255][seed % 4], sketch=sk)


def allow_repeats(w: trainhist.HistoryWriter) -> None:
    """Let ``w`` write a row that repeats the identity of the last one of its site, phase and micro-batch, which the
    reference writer refuses (duplicate_row): spec 2.8 lets a file hold such rows (other writers, crafted files) and
    merge must combine them, so the generated shards keep them. (It forgets the last rows the check compares with.)"""
    w._whole_has[:] = False
    w._micro_last.clear()


def write_shards(d: str, spec: list, rep: list, run_id: str) -> list[str]:
    """Shards of generated events; rows that repeat an identity are written too (:func:`allow_repeats`)."""
    paths = []
    for rank, (events, steps) in enumerate(spec):
        p = os.path.join(d, f"shard{rank}.th")
        with trainhist.HistoryWriter(p, run_id=run_id, rank=rank, world_size=len(spec), fsync="never",
                                     host="h", commit_every=4) as w:
            sites = [w.site("enc.0", "activation"), w.site("enc.0.weight", "param_grad", dtype="float32")]
            emb = w.site("emb", "param", sharing="replica")
            for kind, si, step, phase, micro, vals, pres, seed, width in events:
                allow_repeats(w)
                if kind == "segment":
                    w.new_segment(step, reason="manual")
                elif kind == "obs":
                    arr = np.array(vals, np.float64 if width == "f64" else np.float32)
                    w.observe(sites[si], step, arr, phase=phase, micro=micro, sketch=seed % 3 != 0)
                elif kind == "big":
                    w.observe(sites[si], step, summary=big_summary(seed), phase=phase, micro=micro)
                else:
                    w.mark(sites[si], step, pres, phase=phase, micro=micro)
            for step, vals in rep:
                allow_repeats(w)
                w.observe(emb, step, np.array(vals, np.float32))
            for step, applied, mb, ls in steps:
                w.step_truth(step, applied=applied, micro_batches=mb or None, loss_scale=ls,
                             tokens=100 * (rank + 1) + step + 3, samples=None if mb == 3 else rank + 1)
        paths.append(p)
    return paths


def read(p: str) -> bytes:
    with open(p, "rb") as f:
        return f.read()


class Dir:
    """A scratch directory with numbered output names."""

    def __init__(self) -> None:
        self.t = tempfile.TemporaryDirectory()
        self.n = 0

    def __enter__(self) -> "Dir":
        return self

    def __exit__(self, *a: object) -> None:
        self.t.cleanup()

    @property
    def path(self) -> str:
        return self.t.name

    def out(self) -> str:
        self.n += 1
        return os.path.join(self.t.name, f"out{self.n}.th")

    def merge(self, inputs: list[str], **kw) -> str:
        o = self.out()
        trainhist.merge(inputs, o, **kw)
        return o

    def coarsen(self, p: str, **kw) -> str:
        o = self.out()
        trainhist.coarsen(p, o, **kw)
        return o


# -- properties ----------------------------------------------------------------------------------------------
@settings(max_examples=EXAMPLES["algebra"], **SETTINGS)
@given(spec=shards, rep=replica_steps, perm_seed=st.integers(0, 1000))
def test_merge_commutative_associative_identity(spec, rep, perm_seed):
    with Dir() as d:
        paths = write_shards(d.path, spec, rep, uuid.uuid4().hex)
        flat = read(d.merge(paths))
        perm = list(np.random.default_rng(perm_seed).permutation(len(paths)))
        assert read(d.merge([paths[i] for i in perm])) == flat
        if len(paths) >= 2:
            left = d.merge([d.merge(paths[:2])] + paths[2:])
            right = d.merge(paths[:1] + [d.merge(paths[1:])])
            assert read(left) == flat
            assert read(right) == flat
        empty = d.merge([])
        assert read(empty)[:8] == b"\x89THIST\r\n" and len(read(empty)) == 32
        assert read(d.merge(paths + [empty])) == flat
        assert read(d.merge([empty] + paths)) == flat


@settings(max_examples=EXAMPLES["partition"], **SETTINGS)
@given(spec=st.lists(st.tuples(shard, truth), min_size=2, max_size=6), rep=replica_steps,
       tree_seed=st.integers(0, 10**6))
def test_any_partition_tree_gives_identical_bytes(spec, rep, tree_seed):
    rng = np.random.default_rng(tree_seed)
    with Dir() as d:
        paths = write_shards(d.path, spec, rep, uuid.uuid4().hex)
        flat = read(d.merge(paths))

        def build(items: list[str]) -> str:
            if len(items) == 1:
                return items[0] if rng.random() < 0.5 else d.merge(items)
            k = int(rng.integers(2, len(items) + 1))  # split into k non-empty groups
            cuts = sorted(rng.choice(np.arange(1, len(items)), size=k - 1, replace=False).tolist())
            groups = [items[a:b] for a, b in zip([0] + cuts, cuts + [len(items)])]
            return d.merge([build(g) for g in groups])

        shuffled = [paths[i] for i in rng.permutation(len(paths))]
        assert read(build(shuffled)) == flat


@settings(max_examples=EXAMPLES["coarsen"], **SETTINGS)
@given(spec=shards, rep=replica_steps, a=st.sampled_from([1, 2, 3]), b=st.sampled_from([1, 2, 3]),
       bpo=st.sampled_from([4, 2, 1]))
def test_coarsen_commutes_with_merge_and_composes(spec, rep, a, b, bpo):
    with Dir() as d:
        paths = write_shards(d.path, spec, rep, uuid.uuid4().hex)
        m = d.merge(paths)
        n = a * b
        lhs = read(d.coarsen(m, steps=n, bins_per_octave=bpo))
        rhs = read(d.merge([d.coarsen(p, steps=n, bins_per_octave=bpo) for p in paths]))
        assert lhs == rhs
        # composition: by a, then by a*b (absolute window widths) == by a*b; 4 -> 2 -> 1 bins == 4 -> 1
        two = d.coarsen(d.coarsen(m, steps=a, bins_per_octave=max(bpo, 2)), steps=n, bins_per_octave=bpo)
        assert read(two) == lhs
        assert read(d.coarsen(m, steps=1, bins_per_octave=4)) == read(m)  # the identity coarsening
        # totals survive coarsening
        cm = trainhist.open(d.coarsen(m, steps=n, bins_per_octave=bpo))
        mm = trainhist.open(m)
        for site in mm.sites:
            for phase in ("default", "pre_clip"):
                s0 = mm.spine(site.path, site.stream, site.facet, phase=phase)
                s1 = cm.spine(site.path, site.stream, site.facet, phase=phase)
                assert int(s0.count[s0.observed].sum()) >= int(s1.count[s1.observed].sum())
                assert (s1.span == n).all() and (s1.step % n == 0).all()
        cm.close()
        mm.close()


@settings(max_examples=EXAMPLES["roundtrip"], **SETTINGS)
@given(spec=shards, rep=replica_steps)
def test_write_read_write_is_byte_identical(spec, rep):
    with Dir() as d:
        paths = write_shards(d.path, spec, rep, uuid.uuid4().hex)
        for p in paths[:2]:
            c1 = d.merge([p])
            assert read(trainhist.canonicalize(c1, d.out()).output) == read(c1)
            h0, h1 = trainhist.open(p), trainhist.open(c1)
            assert h1.verify()["status"] == "clean"
            # canonicalising keeps the observations: same sites, same observed totals per site
            for site in h0.sites:
                for phase in ("default", "pre_clip"):
                    a = h0.spine(site.path, site.stream, site.facet, phase=phase)
                    b = h1.spine(site.path, site.stream, site.facet, phase=phase)
                    if site.sharing == "shard":
                        assert int(a.count[a.observed].sum()) == int(b.count[b.observed].sum()) or \
                            (b.presence != 1).any()
            h0.close()
            h1.close()
        m = d.merge(paths)
        assert read(d.merge([m])) == read(m)


@settings(max_examples=EXAMPLES["semantics"], **SETTINGS)
@given(parts=st.lists(st.lists(values, min_size=1, max_size=3), min_size=1, max_size=4),
       width=st.sampled_from([np.float32, np.float64]))
def test_merged_row_equals_summary_of_concatenation(parts, width):
    """Merging shards of one tensor gives exactly the spine and sketch of the whole tensor."""
    run = uuid.uuid4().hex
    with Dir() as d:
        paths = []
        for r, steps in enumerate(parts):
            p = os.path.join(d.path, f"s{r}.th")
            with trainhist.HistoryWriter(p, run_id=run, rank=r, world_size=len(parts), fsync="never") as w:
                s = w.site("x", "activation")
                for step, vals in enumerate(steps):
                    w.observe(s, step, np.array(vals, width))
            paths.append(p)
        h = trainhist.open(d.merge(paths))
        sp = h.spine("x")
        sk = h.sketch("x")
        for i, step in enumerate(sp.step.tolist()):
            allv = np.concatenate([np.array(steps[step], width) for steps in parts if step < len(steps)])
            want = summarize(allv)
            got = sp.summary(i, sk.sketch(int(sp.sk_row[i])) if sp.sk_row[i] >= 0 else None)
            assert (got.count, got.nan, got.pinf, got.ninf, got.zero) == (want.count, want.nan, want.pinf, want.ninf,
                                                                           want.zero)
            assert struct.pack("<d", got.min) == struct.pack("<d", want.min if not math.isnan(want.min) else
                                                             struct.unpack("<d", struct.pack("<Q", 0x7FF8 << 48))[0])
            assert struct.pack("<d", got.max) == struct.pack("<d", want.max if not math.isnan(want.max) else
                                                             struct.unpack("<d", struct.pack("<Q", 0x7FF8 << 48))[0])
            assert got.sum == want.sum and got.sumsq == want.sumsq
            assert got.sketch == want.sketch
        h.close()


# mixed cadences: shards recording one site at different cadences, with their own step tables and missing rows
cadenced = st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 6]), st.sets(st.integers(-3, 12), max_size=10),
                              st.sets(st.integers(-3, 12), max_size=10), st.integers(0, 3)), min_size=2, max_size=4)


def write_cadenced(d: str, spec: list, run_id: str) -> list[str]:
    """Shards of site ``x`` at the drawn cadence: a row at every step of ``rows`` that the cadence makes due (and at
    a step it does not, when ``extra`` says so: a cadence does not restrict the rows, spec 2.2), step truth at
    ``truth``; the due steps of the step table without a row are missing rows."""
    paths = []
    for rank, (k, rows, truth_steps, extra) in enumerate(spec):
        p = os.path.join(d, f"cad{rank}.th")
        with trainhist.HistoryWriter(p, run_id=run_id, rank=rank, world_size=len(spec), fsync="never", host="h",
                                     commit_every=3) as w:
            s = w.site("x", "activation", cadence_spine=k, cadence_sketch=k)
            for step in sorted(rows):
                if step % k == 0 or step % 4 == extra:
                    w.observe(s, step, np.full(2, float(rank + 1)))
            for step in sorted(truth_steps):
                w.step_truth(step, applied=True, tokens=rank + 1)
        paths.append(p)
    return paths


@settings(max_examples=EXAMPLES["partition"], **SETTINGS)
@given(spec=cadenced, tree_seed=st.integers(0, 10**6), n=st.sampled_from([2, 3, 4, 6]))
def test_mixed_cadences_merge_in_any_grouping_and_coarsen_commutes(spec, tree_seed, n):
    """Merging shards of different cadences is associative and commutative bit for bit, and commutes with coarsening
    (spec 11.5, 11.7); a step that some shard had due and in its step table, with no row in any shard, reads unknown
    in the merge, never not_scheduled (a missing row is never hidden)."""
    rng = np.random.default_rng(tree_seed)
    with Dir() as d:
        paths = write_cadenced(d.path, spec, uuid.uuid4().hex)
        flat = read(d.merge(paths))
        a, rest = paths[0], paths[1:]
        assert read(d.merge([d.merge([a, rest[0]])] + rest[1:])) == flat  # merge(merge(a, b), c)
        assert read(d.merge([a, d.merge(rest)])) == flat  # merge(a, merge(b, c))
        assert read(d.merge([paths[i] for i in rng.permutation(len(paths))])) == flat
        m = d.merge(paths)
        assert read(d.coarsen(m, steps=n)) == read(d.merge([d.coarsen(p, steps=n) for p in paths]))
        h = trainhist.open(m)
        assert h.sites[0].cadence_spine == math.gcd(*[k for k, _, _, _ in spec])
        got = h.presence("x", steps=range(-3, 13))
        rows = set(h.spine("x").step.tolist()) if h.sites and len(h.spine("x")) else set()
        for step in range(-3, 13):
            due_somewhere = any(step % k == 0 and step in t for k, _, t, _ in spec)
            if step not in rows and due_somewhere:
                assert got[step] == "unknown", (step, got[step])
        h.close()


def test_mixed_cadences_three_inputs_any_grouping(tmp_path):
    """Cadences 2, 3 and 1 (the third rank misses its row at step 1): every grouping gives the same bytes, the
    merged cadence is 1, no row is written for a step no input planned, and step 1, due on the third rank and
    missing there, reads unknown (a not_scheduled row written by merge(a, b) would have hidden it, spec 11.5)."""
    run = uuid.uuid4().hex
    paths = []
    for rank, k in enumerate((2, 3, 1)):
        p = tmp_path / f"r{rank}.th"
        with trainhist.HistoryWriter(p, run_id=run, rank=rank, world_size=3, fsync="never") as w:
            s = w.site("x", "activation", cadence_spine=k, cadence_sketch=k)
            for step in range(12):
                if step % k == 0 and (rank, step) != (2, 1):
                    w.observe(s, step, np.ones(2))
                w.step_truth(step, applied=True)
        paths.append(str(p))
    with Dir() as d:
        a, b, c = paths
        flat = read(d.merge(paths))
        for tree in ([d.merge([a, b]), c], [a, d.merge([b, c])], [d.merge([a, c]), b], [c, b, a]):
            assert read(d.merge(tree)) == flat
        h = trainhist.open(d.merge(paths))
        assert h.sites[0].cadence_spine == 1 and 1 not in h.spine("x").step.tolist()
        assert h.presence("x", steps=[1])[1] == "unknown"
        assert (h.spine("x").presence == 1).all()  # (observed rows only: nothing was added)
        h.close()


def test_merge_reports_differing_cadences(tmp_path):
    """Guide section 5 promises a note for a rank with another cadence; the report said nothing when the writers
    wrote no settings manifest. It lists the site, each cadence with its files, the merged cadence and whether that
    makes due steps no input planned (spec 11.5), and a note says so."""
    run = uuid.uuid4().hex
    files = {}
    for rank, k in enumerate((2, 3, 4)):
        p = tmp_path / f"r{rank}.th"
        with trainhist.HistoryWriter(p, run_id=run, rank=rank, world_size=3, fsync="never") as w:
            w.observe(w.site("x", "activation", cadence_spine=k, cadence_sketch=k), 0, np.ones(2))
            w.observe(w.site("y", "activation", cadence_spine=2 * (rank > 0) or 2), 0, np.ones(2))
        files[k] = str(p)
    rep = trainhist.merge([files[2], files[3]], tmp_path / "m.th")
    [cm] = rep.cadence_mismatches
    assert cm["site"] == "x [activation]" and cm["merged"] == {"spine": 1, "sketch": 1}
    assert cm["unplanned_steps_due"] is True
    assert cm["cadences"] == [{"spine": 2, "sketch": 2, "files": [files[2]]}, {"spine": 3, "sketch": 3,
                                                                              "files": [files[3]]}]
    notes = [n for n in rep.notes if "rank 2 contributed nothing" not in n]  # (rank 2 of 3 left out: spec 11.3)
    assert len(notes) == 1 and "different cadences" in notes[0] and "no input's spine cadence (2, 3)" in notes[0]
    rep = trainhist.merge([files[2], files[4]], tmp_path / "m2.th")  # 2 divides 4: no step is due that none planned
    assert [c["unplanned_steps_due"] for c in rep.cadence_mismatches] == [False]
    assert "only some inputs made due" in rep.notes[0]
    assert trainhist.merge([files[3]], tmp_path / "m3.th").cadence_mismatches == []


def test_differing_cadences_report_says_which_input_had_which_and_where(tmp_path, capsys):
    """The report said a site's inputs had cadences 2 and 3 but not which input had which, its window, or which
    steps its rows of the site cover, so a user could not tell which shard to look at. Each mismatch lists every
    input of the site (index, path, cadences, window, rows and the first and last step its rows start at), and the
    note (which the command line prints) names them."""
    from trainhist.cli import main

    run = uuid.uuid4().hex
    paths = []
    for rank, (k, steps) in enumerate(((2, range(0, 12)), (3, range(6, 20)), (2, range(20, 24)))):
        p = tmp_path / f"r{rank}.th"
        with trainhist.HistoryWriter(p, run_id=run, rank=rank, world_size=3, fsync="never") as w:
            s = w.site("x", "activation", cadence_spine=k, cadence_sketch=2 * k)
            for st in steps:
                if st % k == 0:
                    w.observe(s, st, np.ones(2))
                w.step_truth(st, applied=True)
        paths.append(str(p))
    c4 = str(tmp_path / "r1c.th")
    trainhist.coarsen(paths[1], c4, steps=6)  # windows of 6: rows at 6, 12 and 18
    rep = trainhist.merge([paths[0], c4, paths[2]], tmp_path / "m.th")
    [cm] = rep.cadence_mismatches
    assert cm["inputs"] == [
        {"input": 0, "path": paths[0], "spine": 2, "sketch": 4, "window": 1, "rows": 6, "steps": [0, 10]},
        {"input": 1, "path": c4, "spine": 3, "sketch": 6, "window": 6, "rows": 3, "steps": [6, 18]},
        {"input": 2, "path": paths[2], "spine": 2, "sketch": 4, "window": 1, "rows": 2, "steps": [20, 22]}]
    note = rep.notes[0]
    assert f"input 1 ({c4}): 3/6, windows of 6 steps, 3 rows at steps 6 to 18" in note, note
    assert f"input 0 ({paths[0]}): 2/4, 6 rows at steps 0 to 10" in note, note
    assert main(["merge", paths[0], c4, paths[2], "-o", str(tmp_path / "cli.th")]) == 0
    assert f"input 1 ({c4}): 3/6, windows of 6 steps, 3 rows at steps 6 to 18" in capsys.readouterr().out
    # an input with the site declared but no row of it: no steps
    with trainhist.HistoryWriter(p := tmp_path / "none.th", run_id=run, rank=3, world_size=4, fsync="never") as w:
        w.site("x", "activation", cadence_spine=5, cadence_sketch=5)
        w.step_truth(0, applied=True)
    rep = trainhist.merge([paths[0], str(p)], tmp_path / "m2.th")
    assert rep.cadence_mismatches[0]["inputs"][1] == {"input": 1, "path": str(p), "spine": 5, "sketch": 5,
                                                      "window": 1, "rows": 0, "steps": None}
    assert f"input 1 ({p}): 5/5, no rows" in rep.notes[0], rep.notes[0]



def test_differing_huge_cadences_merge_without_printing_their_lcm(tmp_path, capsys):
    """Cadences are unbounded manifest integers (spec 9): two inputs at coprime cadences of 2201 digits each merged
    with a ValueError from inside merge (the note printed their least common multiple, 4401 digits, beyond what
    Python converts to text) and a traceback from `trainhist merge`. The note suggests a window only where coarsen
    can take it (at most 2^32 - 1 steps)."""
    from trainhist.cli import main

    run = uuid.uuid4().hex
    paths = []
    for rank, k in enumerate((10**2200 + 1, 10**2200 + 3)):
        p = tmp_path / f"r{rank}.th"
        with trainhist.HistoryWriter(p, run_id=run, rank=rank, world_size=2, fsync="never") as w:
            w.observe(w.site("x", "activation", cadence_spine=k), 0, np.ones(2))
        paths.append(str(p))
    rep = trainhist.merge(paths, tmp_path / "m.th")
    [cm] = rep.cadence_mismatches
    assert cm["merged"]["spine"] == 1 and cm["unplanned_steps_due"] is True
    assert "coarsen the inputs to a multiple of every cadence first to avoid that" in rep.notes[0]
    trainhist.open(tmp_path / "m.th").verify()
    assert main(["merge", *paths, "-o", str(tmp_path / "cli.th"), "--json"]) == 0
    assert '"unplanned_steps_due": true' in capsys.readouterr().out

def test_coarsen_keeps_the_writers_cadence(tmp_path):
    """Cadence 3 coarsened by 2 became cadence 2 (every window due), so window [4, 6), which holds no step the writer
    planned, read unknown. The cadence is kept (spec 11.7): that window reads not_scheduled, as steps 4 and 5 did."""
    p, c = tmp_path / "p.th", tmp_path / "c.th"
    with trainhist.HistoryWriter(p, fsync="never") as w:
        s = w.site("x", "activation", cadence_spine=3, cadence_sketch=3)
        for step in range(12):
            if step % 3 == 0:
                w.observe(s, step, np.ones(4))
            w.step_truth(step, applied=True)
    trainhist.coarsen(p, c, steps=2)
    with trainhist.open(p) as h0, trainhist.open(c) as h1:
        assert (h1.sites[0].cadence_spine, h1.sites[0].cadence_sketch) == (3, 3)
        assert h1.spine("x").step.tolist() == [0, 2, 6, 8]
        want = h0.presence("x", steps=range(12))
        got = h1.presence("x", steps=range(12))
        assert [got[k] for k in (4, 5, 10, 11)] == [want[k] for k in (4, 5, 10, 11)] == ["not_scheduled"] * 4
        assert all(got[k] == "observed" for k in (0, 1, 2, 3, 6, 7, 8, 9))  # (a row covers its window)


# -- semantics and refusals -----------------------------------------------------------------------------------
def _two(d: Dir, fn0, fn1, run: str | None = None) -> list[str]:
    run = run or uuid.uuid4().hex
    out = []
    for r, fn in enumerate((fn0, fn1)):
        d.n += 1
        p = os.path.join(d.path, f"r{r}_{d.n}.th")
        # one creation time for both ranks: their run manifests are then identical (kept once), as a real job's
        # ranks started in the same second would write them (two seconds apart they are two manifests)
        with trainhist.HistoryWriter(p, run_id=run, rank=r, world_size=2, fsync="never",
                                     created="2026-01-01T00:00:00+00:00") as w:
            fn(w)
        out.append(p)
    return out


def test_presence_table_and_tallies():
    with Dir() as d:
        def f0(w):
            s = w.site("a", "activation")
            w.observe(s, 0, np.ones(3))
            w.observe(s, 1, np.ones(3))
            w.mark(s, 2, "absent")
            w.observe(s, 3, np.ones(3))
            w.mark(s, 4, "not_scheduled")

        def f1(w):
            s = w.site("a", "activation")
            w.mark(s, 0, "absent")
            w.mark(s, 1, "failed")
            w.mark(s, 2, "not_scheduled")
            w.mark(s, 3, "unknown")
            w.mark(s, 4, "skipped")

        m = d.merge(_two(d, f0, f1))
        h = trainhist.open(m)
        s = h.spine("a")
        assert s.presence_names == ["observed", "failed", "absent", "unknown", "skipped"]
        assert s.count.tolist() == [3, 0, 0, 0, 0]  # only observed rows carry numbers (spec 2.6)
        from trainhist.canonical import decode_obs
        e = h._obs[0][0]
        r = decode_obs(h._view[e.offset + 32:e.offset + 32 + e.length], path=m, offset=e.offset, site=0, segment=0,
                       rows=e.rows, step_min=e.step_min, step_max=e.step_max, src=0)
        # tally columns: unknown, observed, absent, not_scheduled, failed, skipped
        assert r.tally.tolist() == [[0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 1, 0], [0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0],
                                    [0, 0, 0, 1, 0, 1]]
        h.close()


def test_one_input_that_repeats_a_writer_id_is_merged(tmp_path):
    """A file resumed under the same writer_id holds two writer manifests with one id (spec 2.1: the same writer):
    merge refused it alone as overlapping itself ('inputs X and X'); it now counts the id once."""
    p = tmp_path / "t.thist"
    with trainhist.HistoryWriter(p) as w:
        w.observe(w.site("a", "activation"), 0, np.ones(3))
        wid = w.writer_id
    with trainhist.HistoryWriter(p, mode="a", writer_id=wid) as w:
        w.observe(w.site("a", "activation"), 1, np.ones(3))
    rep = trainhist.merge([p], tmp_path / "m.thist")
    assert rep.inputs[0]["writers"] == [wid]
    m = trainhist.open(tmp_path / "m.thist")
    assert m.spine("a", "activation").step.tolist() == [0, 1]
    assert {w["writer_id"] for w in m.writers} == {wid}


def test_overlapping_writers_refused_naming_files_and_writer():
    with Dir() as d:
        a, b = _two(d, lambda w: w.observe(w.site("a", "activation"), 0, np.ones(2)),
                    lambda w: w.observe(w.site("a", "activation"), 0, np.ones(2)))
        m = d.merge([a, b])
        wid = trainhist.open(a).writers[0]["writer_id"]
        for inputs in ([m, a], [a, m]):
            with pytest.raises(MergeError) as ei:
                d.merge(inputs)
            assert ei.value.code == "overlapping_writers"
            msg = str(ei.value)
            assert wid in msg and inputs[0] in msg and inputs[1] in msg and "given twice" not in msg
        # one file given twice, under one name or two (a link, another spelling): said so, not "both contain"
        link = os.path.join(d.path, "link.thist")
        os.symlink(a, link)
        other = os.path.join(os.path.dirname(a), ".", os.path.basename(a))
        for second in (a, link, other):
            with pytest.raises(MergeError) as ei:
                d.merge([a, second])
            msg = str(ei.value)
            assert ei.value.code == "overlapping_writers" and "this file was given twice as an input" in msg, msg
            assert "both contain" not in msg and "give each input once" in msg
            assert (f"(also as {a}, the same file)" in msg) == (second != a), msg
        assert not [f for f in os.listdir(d.path) if f.endswith(".tmp")]


def test_incompatible_grid_refused_until_coarsened():
    with Dir() as d:
        a, b = _two(d, lambda w: w.observe(w.site("a", "activation"), 0, np.arange(5.0)),
                    lambda w: w.observe(w.site("a", "activation"), 0, np.arange(7.0)))
        a2 = d.coarsen(a, bins_per_octave=2)
        with pytest.raises(MergeError) as ei:
            d.merge([a2, b])
        assert ei.value.code == "incompatible_grid"
        assert a2 in str(ei.value) and b in str(ei.value) and "a [activation]" in str(ei.value)
        ok = d.merge([a2, d.coarsen(b, bins_per_octave=2)])
        assert read(ok) == read(d.coarsen(d.merge([a, b]), bins_per_octave=2))
        sk = trainhist.open(ok).sketch("a")
        assert sk.scale == 1 and int(sk.pos.sum()) == 4 + 6


def test_replica_divergence_error_and_report():
    with Dir() as d:
        def f(v):
            def fn(w):
                s = w.site("emb", "param", sharing="replica")
                for step in range(5):
                    w.observe(s, step, np.full(4, v if step == 3 else 1.0, np.float32))
            return fn

        a, b = _two(d, f(1.0), f(2.0))
        with pytest.raises(MergeError) as ei:
            d.merge([a, b])
        e = ei.value
        assert e.code == "replica_divergence"
        assert "emb [param]" in str(e) and "step 3" in str(e) and a in str(e) and b in str(e)
        o1, o2 = d.out(), d.out()
        rep = trainhist.merge([a, b], o1, replica_divergence="report")
        trainhist.merge([b, a], o2, replica_divergence="report")
        assert read(o1) == read(o2)
        assert len(rep.divergences) == 1 and rep.divergences[0]["step"] == 3
        assert set(rep.divergences[0]["files"]) == {a, b}
        s = trainhist.open(o1).spine("emb", "param")
        assert s.count.tolist() == [4] * 5  # kept once, not added
        # identical replicas are kept once
        c, e2 = _two(d, f(1.0), f(1.0))
        assert trainhist.open(d.merge([c, e2])).spine("emb", "param").count.tolist() == [4] * 5


@pytest.mark.parametrize("workers", [1, 2])
def test_replica_divergences_beyond_the_listed_ones_are_counted(monkeypatch, capsys, workers):
    """The report listed at most MAX_DIVERGENCES replica divergences and said nothing of the others: it counts them
    all (divergences_total, in --json too), and the command line says how many more there were."""
    from trainhist import cli

    monkeypatch.setattr(merge_mod, "MAX_DIVERGENCES", 3)
    with Dir() as d:
        def fn(v):
            def f(w):
                for name in ("e1", "e2"):
                    s = w.site(name, "param", sharing="replica")
                    for step in range(4):
                        w.observe(s, step, np.array([v]))
            return f

        a, b = _two(d, fn(1.0), fn(2.0))
        rep = trainhist.merge([a, b], d.out(), replica_divergence="report", workers=workers)
        assert rep.divergences_total == 8 and len(rep.divergences) == 3
        assert [(x["where"].split(",")[0], x["step"]) for x in rep.divergences] == [("site e1 [param]", 0),
                                                                                    ("site e1 [param]", 1),
                                                                                    ("site e1 [param]", 2)]
        assert rep.as_dict()["divergences_total"] == 8
        cli._print_report(rep, False)
        out = capsys.readouterr().out
        assert out.count("replica divergence:") == 3 and "... and 5 more replica divergences (8 in all; the first " \
            "3 are listed)" in out


def test_coarsen_and_merge_of_diverging_replicas_under_report_differ_as_spec_11_7_says():
    """Spec 11.7's one exception to coarsen(merge) == merge(coarsen): replica rows that differ, merged with
    replica_divergence="report" (its example: 1 and 2 at step 0, 5 and 4 at step 1, by 2: sums 5 and 6)."""
    with Dir() as d:
        def fn(vals):
            def f(w):
                s = w.site("emb", "param", sharing="replica")
                for step, v in enumerate(vals):
                    w.observe(s, step, np.array([v]))
            return f

        a, b = _two(d, fn((1.0, 5.0)), fn((2.0, 4.0)))
        lhs = d.coarsen(d.merge([a, b], replica_divergence="report"), steps=2)
        rhs = d.merge([d.coarsen(a, steps=2), d.coarsen(b, steps=2)], replica_divergence="report")
        sums = [trainhist.open(p).spine("emb", "param").sum.tolist() for p in (lhs, rhs)]
        assert sums == [[5.0], [6.0]]
        c, e = _two(d, fn((1.0, 5.0)), fn((1.0, 5.0)))  # (no divergence: equal again)
        assert read(d.coarsen(d.merge([c, e], replica_divergence="report"), steps=2)) == \
            read(d.merge([d.coarsen(c, steps=2), d.coarsen(e, steps=2)], replica_divergence="report"))


@pytest.mark.parametrize("workers", [1, 2])
def test_rows_of_different_spans_over_the_same_steps_are_noted(capsys, workers):
    """A shard coarsened by 4 merged with a raw one gave rows of spans 1 and 4 over the same steps (they do not
    combine, spec 11.1) with no word in the report. The report lists each site and segment where that happens
    (and the step truth), the first pair of rows, and a note says so; inputs of one window give none."""
    from trainhist import cli

    with Dir() as d:
        def f(w):
            for name in ("x", "y"):
                s = w.site(name, "activation")
                for step in range(8):
                    w.observe(s, step, np.ones(4))
            for step in range(8):
                w.step_truth(step, applied=True, tokens=1)

        a, b = _two(d, f, f)
        ac = d.coarsen(a, steps=4)
        rep = trainhist.merge([ac, b], d.out(), workers=workers)
        assert [(x["where"], x["rows"]) for x in rep.span_overlaps] == [
            ("site x [activation], segment 0", [[0, 1], [0, 4]]), ("site y [activation], segment 0", [[0, 1], [0, 4]]),
            ("step truth of segment 0", [[0, 1], [0, 4]])]
        assert [x["file"] for x in rep.span_overlaps[:2]] == [ac, ac]
        (note,) = rep.notes
        assert note.startswith("rows of different spans cover the same steps in 2 site/segment pairs and the step "
                               "truth of 1 segment (first: site x [activation], segment 0, a row at step 0 spanning 1")
        cli._print_report(rep, False)
        assert "  note: rows of different spans cover the same steps" in capsys.readouterr().out
        for inputs in ([a, b], [ac, d.coarsen(b, steps=4)]):
            rep = trainhist.merge(inputs, d.out(), workers=workers)
            assert rep.span_overlaps == [] and rep.notes == []


@pytest.mark.parametrize("batch_rows", [1, 10**6])
def test_rows_of_different_spans_are_noted_across_sweep_batches(monkeypatch, batch_rows):
    """The window (4, span 4) of one input and the rows 5..7 of the other fall in two sweep batches when BATCH_ROWS
    is small: the overlap is found all the same."""
    monkeypatch.setattr(merge_mod, "BATCH_ROWS", batch_rows)
    with Dir() as d:
        def fa(w):
            s = w.site("x", "activation")
            for step in range(4, 8):
                w.observe(s, step, np.ones(2))

        def fb(w):
            s = w.site("x", "activation")
            for step in (0, 1, 2, 3, None, 5, 6, 7):
                if step is None:
                    w.commit()  # (chunks [0, 3] and [5, 7] around the other input's window)
                else:
                    w.observe(s, step, np.ones(2))

        a, b = _two(d, fa, fb)
        rep = trainhist.merge([d.coarsen(a, steps=4), b], d.out())
        assert [(x["where"], x["rows"]) for x in rep.span_overlaps] == [("site x [activation], segment 0",
                                                                         [[4, 4], [5, 1]])]


def test_count_overflow_refused_and_boundary_exact():
    with Dir() as d:
        def big(c):
            def fn(w):
                w.observe(w.site("a", "activation"), 0,
                          summary=Summary(count=c, zero=c, min=0.0, max=0.0, sketch=None))
            return fn

        a, b = _two(d, big(2**63), big(2**63))
        with pytest.raises(MergeError) as ei:
            d.merge([a, b])
        assert ei.value.code == "count_overflow" and a in str(ei.value) and b in str(ei.value)
        a, b = _two(d, big(2**63), big(2**63 - 1))
        s = trainhist.open(d.merge([a, b])).spine("a")
        assert s.count.tolist() == [2**64 - 1] and s.zero.tolist() == [2**64 - 1]

        def bins(w):
            sk = Sketch.empty()
            sk.pos[10] = 2**63
            sk.pos[11] = 2**63
            w.observe(w.site("a", "activation"), 0, summary=Summary(count=2**64 - 1, min=1.0, max=2.0, sketch=sk))

        a, b = _two(d, bins, lambda w: w.site("a", "activation"))
        with pytest.raises(MergeError) as ei:  # halving the resolution adds bins 10 and 11
            d.coarsen(a, bins_per_octave=2)
        assert ei.value.code == "count_overflow" and a in str(ei.value)


def test_overflow_is_decided_on_the_numbers_a_row_keeps_so_grouping_does_not_matter():
    """Spec 11.2: count_overflow and sum_overflow are decided on the numbers a combined row keeps. Two observed rows
    of count 2^64 - 1 (and exact sums 2^(2^31 - 1)) and a failed row of that identity combine into a failed row,
    which keeps no numbers (11.4): merge([a, b, c]) refused it, while merge(merge(a, c), b), whose partial row is
    already failed and without numbers, took it. Both now give the same bytes; a window of such rows likewise."""
    sites = {"count": Summary(count=2**64 - 1, zero=2**64 - 1, min=0.0, max=0.0),
             "sum": Summary(count=1, min=1.0, max=1.0, sum=Dyadic.make(1, 2**31 - 1), sumsq=Dyadic.make(1, 0))}
    with Dir() as d:
        run = uuid.uuid4().hex
        files = []
        for k in range(3):
            files.append(os.path.join(d.path, f"w{k}.th"))
            with trainhist.HistoryWriter(files[-1], run_id=run, rank=k, world_size=3, fsync="never",
                                         created="2026-01-01T00:00:00+00:00") as w:
                for name, summary in sites.items():
                    if k < 2:
                        w.observe(w.site(name, "activation"), 0, summary=summary)
                    else:
                        w.mark(w.site(name, "activation"), 0, "failed")
        a, b, c = files
        with pytest.raises(MergeError) as ei:  # (observed + observed: the numbers are kept, and overflow)
            d.merge([a, b])
        assert ei.value.code == "count_overflow"
        once = d.merge([a, b, c])
        assert read(once) == read(d.merge([d.merge([a, c]), b])) == read(d.merge([d.merge([b, c]), a]))
        h = trainhist.open(once)
        for name in sites:
            sp = h.spine(name)
            assert sp.presence.tolist() == [Presence.FAILED] and sp.count.tolist() == [0]
        with trainhist.HistoryWriter(p := os.path.join(d.path, "one.th"), fsync="never") as w:
            for name, summary in sites.items():
                s = w.site(name, "activation")
                w.observe(s, 0, summary=summary)
                w.observe(s, 1, summary=summary)
                w.mark(s, 2, "failed")
        assert trainhist.open(d.coarsen(p, steps=4)).spine("count").presence.tolist() == [Presence.FAILED]


def _set_origin_numbers(path: str, numbers: dict[int, int]) -> None:
    """Rewrite, in the derived file ``path``, the one-digit ``origin.segment`` of segment ``k`` to ``numbers[k]``
    (the manifests keep their length; CRCs are fixed): a file the reader accepts whatever the numbers are."""
    import json

    from history_helpers import records, rewrite

    from trainhist.framing import RECORD_HEADER_SIZE, RecordType

    data = bytearray(read(path))
    for pos in records(bytes(data), RecordType.MANIFEST):
        length = struct.unpack_from("<I", data, pos + 4)[0]
        payload = bytes(data[pos + RECORD_HEADER_SIZE : pos + RECORD_HEADER_SIZE + length])
        doc = json.loads(payload)
        if doc["kind"] == "segment" and doc["id"] in numbers:
            old = b'"segment":%d,' % doc["origin"]["segment"]
            assert payload.count(old) == 1 and len(old) == 12
            rewrite(data, pos, payload.replace(old, b'"segment":%d,' % numbers[doc["id"]]))
    with open(path, "wb") as f:
        f.write(bytes(data))


def _segments_in_order(p: str) -> list[tuple[int | None, int]]:
    """(previous, origin number) of each segment of ``p``, after checking that the file reads and that every
    ``previous`` names an earlier segment of a smaller number (spec 9, 11.3)."""
    h = trainhist.open(p)
    h.verify()
    out = []
    for k, g in enumerate(h.segments):
        number = g.manifest["origin"]["segment"]
        assert g.id == k and (g.previous is None or (g.previous < k and out[g.previous][1] < number)), (p, g)
        out.append((g.previous, number))
    return out


def test_an_input_whose_segment_continues_one_of_no_smaller_number_is_refused():
    """Spec 11.3: output segments are ordered by number, so a segment that continues one of an equal or greater
    number (a derived input whose origin numbers say so; the reader accepts it) cannot follow it. Merge and coarsen
    wrote such a file with its `previous` naming a later segment, which their own reader refused
    (bad_segment_order); they refuse the input (segment_order)."""
    with Dir() as d:
        with trainhist.HistoryWriter(src := os.path.join(d.path, "w.th"), fsync="never") as w:
            s = w.site("x", "activation")
            w.observe(s, 0, np.ones(1))
            w.new_segment(1, "resume")
            w.observe(s, 1, np.ones(1))
        derived = d.merge([src])
        assert _segments_in_order(derived) == [(None, 0), (0, 1)]
        for numbers in ({0: 5}, {0: 1}, {0: 3, 1: 2}):
            bad = os.path.join(d.path, "bad.th")
            with open(bad, "wb") as f:
                f.write(read(derived))
            _set_origin_numbers(bad, numbers)
            assert trainhist.open(bad).verify()["status"] == "clean"
            for fn in (lambda o: trainhist.merge([bad], o), lambda o: trainhist.merge([bad], o, across_runs=True),
                       lambda o: trainhist.coarsen(bad, o, steps=2)):
                with pytest.raises(MergeError) as ei:
                    fn(out := d.out())
                assert ei.value.code == "segment_order" and ei.value.path == bad, numbers
                assert "segment 1" in str(ei.value) and "segment 0" in str(ei.value)
                assert not os.path.exists(out)


def test_merge_never_writes_a_segment_that_continues_a_later_one():
    """Spec 9, 11.3: whatever its inputs, merge or coarsen writes a file whose every `previous` names an earlier
    segment (it reads back), or refuses them (segment_order). Inputs: runs of resumed and renumbered writers
    (min_segment), merged alone, with --across-runs and again, and derived files whose origin numbers were
    rewritten at random (the reader accepts any)."""
    rng = np.random.default_rng(20261201)
    refused = written = 0
    with Dir() as d:
        for trial in range(12):
            leaves = []
            for k, run in enumerate(rng.choice(["a", "b"], size=3)):
                leaves.append(os.path.join(d.path, f"t{trial}_{k}.th"))
                with trainhist.HistoryWriter(leaves[-1], run_id=str(run) * 32, rank=k, world_size=3, fsync="never",
                                             min_segment=int(rng.integers(0, 3)),
                                             created="2026-01-01T00:00:00+00:00") as w:
                    s = w.site("x", "activation")
                    w.observe(s, 0, np.ones(1))
                    for step in range(1, 1 + int(rng.integers(0, 3))):
                        w.new_segment(step, str(rng.choice(["resume", "manual"])))
                        w.observe(s, step, np.ones(1))
            pooled = d.merge(leaves[:2], across_runs=bool(rng.integers(0, 2)))
            n = len(_segments_in_order(pooled))
            _set_origin_numbers(pooled, {g: int(rng.integers(0, 10)) for g in range(n) if rng.integers(0, 2)})
            for inputs, kw in (([pooled], {}), ([pooled], {"across_runs": True}), ([pooled, leaves[2]], {}),
                               ([pooled, leaves[2]], {"across_runs": True}), ([pooled], {"steps": 2})):
                out = d.out()
                try:
                    if "steps" in kw:
                        trainhist.coarsen(inputs[0], out, **kw)
                    else:
                        trainhist.merge(inputs, out, **kw)
                except MergeError as e:
                    assert e.code == "segment_order", e
                    refused += 1
                    continue
                _segments_in_order(out)
                written += 1
    assert refused and written


def test_incompatible_sites_and_spans():
    with Dir() as d:
        a, b = _two(d, lambda w: w.site("p", "param", sharing="replica"), lambda w: w.site("p", "param"))
        with pytest.raises(MergeError) as ei:
            d.merge([a, b])
        assert ei.value.code == "incompatible_sites" and b in str(ei.value)
        c, _ = _two(d, lambda w: [w.observe(w.site("x", "activation"), s, np.ones(1)) for s in range(6)],
                    lambda w: None)
        c2 = d.coarsen(c, steps=2)
        with pytest.raises(MergeError) as ei:
            d.coarsen(c2, steps=3)
        assert ei.value.code == "incompatible_span"
        assert read(d.coarsen(c2, steps=6)) == read(d.coarsen(c, steps=6))


def test_segments_runs_and_step_truth():
    with Dir() as d:
        run = uuid.uuid4().hex

        def fn(rank):
            def f(w):
                s = w.site("x", "activation")
                for step in range(4):
                    w.observe(s, step, np.ones(2))
                    w.step_truth(step, applied=step != 2 or rank == 0, tokens=10 + rank, samples=None if rank else 1,
                                 loss_scale=8.0, micro_batches=2)
                w.new_segment(2, reason="resume")
                w.observe(s, 2, np.ones(2))
            return f

        a, b = _two(d, fn(0), fn(1), run)
        h = trainhist.open(d.merge([a, b]))
        assert [(g.id, g.first_step, g.reason, g.previous) for g in h.segments] == [(0, 0, "start", None),
                                                                                    (1, 2, "resume", 0)]
        origin = h.segments[0].manifest["origin"]
        assert origin["runs"] == [run] and len(origin["writers"]) == 2 and origin["segment"] == 0
        s = h.spine("x")
        assert s.segment.tolist() == [0, 0, 0, 0, 1] and s.count.tolist() == [4] * 5
        t = h.step_truth_rows()
        assert [r["tokens"] for r in t] == [21] * 4
        assert [r["applied"] for r in t] == ["applied", "applied", "unknown", "applied"]
        assert all(r["samples"] is None and r["loss_scale"] == 8.0 and r["micro_batches"] == 2 for r in t)
        assert len(h.writers) == 2 and len(h.runs) == 1  # identical run manifests? each rank wrote its own
        # different runs stay apart unless asked
        c, e = _two(d, fn(0), fn(1))  # a fresh run id
        h2 = trainhist.open(d.merge([a, c]))
        assert len(h2.segments) == 4 and len(h2.runs) == 2
        h3 = trainhist.open(d.merge([a, c], across_runs=True))
        assert len(h3.segments) == 2 and h3.spine("x").count.tolist() == [4] * 5
        assert sorted(h3.segments[0].manifest["origin"]["runs"]) == sorted({run, h2.runs[1]["run_id"],
                                                                             h2.runs[0]["run_id"]})
        # coarsened step truth: tokens add over the window, span 2
        h4 = trainhist.open(d.coarsen(d.merge([a, b]), steps=2))
        assert [(r["step"], r["tokens"], r["applied"]) for r in h4.step_truth_rows()] == [(0, 42, "applied"),
                                                                                          (2, 42, "unknown")]
        assert h4.steps["step"].tolist() == [0, 2]


def test_step_truth_counts_the_writers_rows_it_combines(tmp_path):
    """A rank that stopped early (a torn shard): the merged steps after it hold the other rank's tokens alone, and
    n_rows says so (spec 11.6), in the table, the frame, the dump and triage; coarsening adds n_rows."""
    from trainhist.frames import steps as steps_frame
    from trainhist.triage import triage

    with Dir() as d:
        def fn(rank, last):
            def f(w):
                s = w.site("x", "activation")
                for step in range(last + 1):
                    w.observe(s, step, np.ones(2))
                    w.step_truth(step, applied=True, tokens=10 + rank)
            return f

        whole = trainhist.open(d.merge(_two(d, fn(0, 3), fn(1, 3))))
        assert [r["n_rows"] for r in whole.step_truth_rows()] == [2] * 4
        assert not [f for f in triage(whole).findings if f.kind == "truth_partial"]
        m = d.merge(_two(d, fn(0, 3), fn(1, 1)))
        h = trainhist.open(m)
        assert [(r["tokens"], r["n_rows"]) for r in h.step_truth_rows()] == [(21, 2), (21, 2), (10, 1), (10, 1)]
        assert steps_frame(h)["n_rows"].tolist() == [2, 2, 1, 1]
        assert [s.get("n_rows") for s in canonical(h)["steps"]] == ["u:2", "u:2", None, None]  # (1 is not dumped)
        [f] = [f for f in triage(h).findings if f.kind == "truth_partial"]
        assert f.step == 2 and "2 steps" in f.text and "(1 of 2)" in f.text
        c = trainhist.open(d.coarsen(m, steps=4))
        assert [(r["tokens"], r["n_rows"], r["span"]) for r in c.step_truth_rows()] == [(62, 6, 4)]
        # a writer's own file: one row each, no column
        one = trainhist.open(_two(d, fn(0, 1), fn(1, 1))[0])
        assert one.steps["n_rows"].tolist() == [1, 1]


def test_segments_of_several_runs_are_ordered_by_number_so_previous_comes_first(tmp_path):
    """Spec 11.3: output segments by number, then runs. Runs kept apart interleave; a file pooled with
    across_runs, whose resume holds one run only, merges again into a file that reads (ordered by runs first, the
    resume came before the segment it continues: bad_segment_order)."""
    from trainhist.triage import triage

    def run(name, segments):
        p = str(tmp_path / f"{name}.th")
        with trainhist.HistoryWriter(p, run_id=uuid.uuid4().hex, fsync="never") as w:
            s = w.site("x", "activation")
            for k in range(segments):
                if k:
                    w.new_segment(2 * k, reason="resume")
                for step in (2 * k, 2 * k + 1):
                    w.observe(s, step, np.ones(2))
                    w.step_truth(step, applied=True)
        return p, w.run_id

    (a, ra), (b, rb), (c, _) = run("a", 2), run("b", 2), run("c", 1)
    apart = str(tmp_path / "apart.th")
    trainhist.merge([a, b], apart)
    h = trainhist.open(apart)
    first = min(ra, rb)
    assert [(g.id, g.previous, g.manifest["origin"]["runs"] == [first]) for g in h.segments] == [
        (0, None, True), (1, None, False), (2, 0, True), (3, 1, False)]
    kinds = [(f.kind, f.step) for f in triage(h).findings if f.kind.startswith("segment")]
    assert kinds == [("segment_run", 0), ("segment", 2), ("segment", 2)]  # only segment 1 is another run's
    again = str(tmp_path / "again.th")
    trainhist.merge([apart], again)
    assert open(again, "rb").read() == open(apart, "rb").read()
    pooled, pooled2 = str(tmp_path / "pooled.th"), str(tmp_path / "pooled2.th")
    trainhist.merge([a, c], pooled, across_runs=True)
    trainhist.merge([pooled], pooled2)
    h2 = trainhist.open(pooled2)
    assert [(g.id, g.previous, len(g.manifest["origin"]["runs"])) for g in h2.segments] == [(0, None, 2), (1, 0, 1)]
    assert open(pooled2, "rb").read() == open(pooled, "rb").read()


def test_many_shards_with_small_descriptor_pool(monkeypatch):
    monkeypatch.setattr(merge_mod, "FD_POOL", 3)
    monkeypatch.setattr(merge_mod, "BATCH_ROWS", 5)
    run = uuid.uuid4().hex
    with Dir() as d:
        paths = []
        for r in range(40):
            p = os.path.join(d.path, f"s{r}.th")
            with trainhist.HistoryWriter(p, run_id=run, rank=r, world_size=40, fsync="never", commit_every=3) as w:
                s = w.site("x", "activation")
                for step in range(10):
                    w.observe(s, step, np.full(3, float(r)))
            paths.append(p)
        gc.collect()  # files of earlier tests still awaiting collection would otherwise close during the merge
        fds_before = len(os.listdir("/proc/self/fd"))
        m = d.merge(paths)
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) == fds_before
        s = trainhist.open(m).spine("x")
        assert s.count.tolist() == [120] * 10 and s.max.tolist() == [39.0] * 10
        monkeypatch.setattr(merge_mod, "BATCH_ROWS", 10**6)
        assert read(d.merge(paths)) == read(m)  # batching does not change the bytes


def test_sketch_partial_coverage_under_coarsening():
    with Dir() as d:
        a, _ = _two(d, lambda w: [w.observe(w.site("x", "activation"), s, np.ones(4), sketch=s % 2 == 0)
                                  for s in range(4)], lambda w: None)
        h = trainhist.open(d.coarsen(a, steps=2))
        s, sk = h.spine("x"), h.sketch("x")
        assert s.count.tolist() == [8, 8] and sk.pos.sum(axis=1).tolist() == [4, 4]  # sketch covers half the rows


def test_raw_codec_and_torn_input_reported():
    with Dir() as d:
        a, b = _two(d, lambda w: w.observe(w.site("x", "activation"), 0, np.ones(3)),
                    lambda w: w.observe(w.site("x", "activation"), 0, np.ones(3)))
        with open(b, "ab") as f:
            f.write(b"\x01" * 7)  # a torn tail
        o = d.out()
        rep = trainhist.merge([a, b], o, codec="raw")
        assert [i["status"] for i in rep.inputs] == ["clean", "torn"]
        assert trainhist.open(o).spine("x").count.tolist() == [6]


def test_cli_merge_and_coarsen():
    with Dir() as d:
        a, b = _two(d, lambda w: [w.observe(w.site("x", "activation"), s, np.ones(3)) for s in range(4)],
                    lambda w: [w.observe(w.site("x", "activation"), s, np.ones(3)) for s in range(4)])
        exe = [sys.executable, "-m", "trainhist.cli"]
        o, c = d.out(), d.out()
        r = subprocess.run(exe + ["merge", "-o", o, a, b], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        r = subprocess.run(exe + ["coarsen", o, "-o", c, "--steps", "2", "--bins-per-octave", "1"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert read(c) == read(d.coarsen(d.merge([a, b]), steps=2, bins_per_octave=1))
        r = subprocess.run(exe + ["merge", "-o", d.out(), a, a], capture_output=True, text=True)
        assert r.returncode == 1 and "overlapping_writers" in r.stderr


def test_dump_of_merge_is_sum_of_inputs():
    """The canonical dump of a merged file agrees with the rows of its inputs (spec 10 and 11)."""
    with Dir() as d:
        a, b = _two(d, lambda w: w.observe(w.site("x", "activation"), 0, np.array([-0.0, 1.0, np.nan])),
                    lambda w: w.observe(w.site("x", "activation"), 0, np.array([0.0, -2.0, np.inf])))
        h = trainhist.open(d.merge([a, b]))
        row = canonical(h)["sites"][0]["rows"][0]
        assert row["count"] == "u:6" and row["nan"] == "u:1" and row["pinf"] == "u:1" and row["zero"] == "u:2"
        assert row["min"] == "f:c000000000000000" and row["max"] == "f:3ff0000000000000"
        assert row["sum"] == "d:-1p0" and row["sumsq"] == "d:5p0" and row["method"] == "exact"


def test_a_window_derived_under_the_old_precedence_reads_as_written_and_is_not_combined(tmp_path, monkeypatch):
    """Before 2026-11-30 skipped outranked observed (spec 11.4): such a window reads skipped, without numbers.
    Today's reader refused it as bad_tally; it reads it as written now, and merge/coarsen refuse it
    (legacy_precedence), since it holds none of its observed inputs' numbers."""
    import trainhist.model as model

    raw = tmp_path / "raw.thist"
    with trainhist.HistoryWriter(raw) as w:
        s = w.site("w", "param_delta")
        for st in range(4):
            if st == 1:
                w.mark(s, st, "skipped")
            else:
                w.observe(s, st, np.ones(2))
    with monkeypatch.context() as m:
        m.setattr(model, "PRIORITY", (4, 2, 1, 0, 5, 3))
        m.setattr(model, "_BY_PRIORITY", [4, 0, 5, 1, 2, 3])
        trainhist.coarsen(raw, tmp_path / "old.thist", steps=4)
    with trainhist.open(tmp_path / "old.thist") as h:
        assert h.spine("w", "param_delta").presence_names == ["skipped"]
    trainhist.coarsen(raw, tmp_path / "new.thist", steps=4)
    with trainhist.open(tmp_path / "new.thist") as h:
        s = h.spine("w", "param_delta")
        assert s.presence_names == ["observed"] and s.count.tolist() == [6]
    with pytest.raises(trainhist.errors.FormatError) as e:
        trainhist.coarsen(tmp_path / "old.thist", tmp_path / "again.thist", steps=8)
    assert e.value.code == "legacy_precedence"
