"""Two CPU ranks (gloo) running DDP: each writes its own shard file; replicated parameters agree across ranks, and
the merged shards are one run: replicas kept once, the ranks' activations summed.

The ranks are plain subprocesses (env:// rendezvous on a free port), so nothing is pickled.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

import trainhist

from torch_helpers import run_ranks

WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from trainhist.torch import Collector
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, sys.argv[1], every=1, sketch_every=1)
    col.attach(optimizer=opt)
    g = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data
    for step in range(3):
        with col.step(step):
            model(torch.randn(5, 6, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    col.close()
    dist.destroy_process_group()
""")


def test_ddp_two_ranks_write_shard_files(tmp_path):
    outs = run_ranks(WORKER, tmp_path, str(tmp_path / "ddp.thist"))
    assert not any("trainhist:" in o for o in outs), outs  # no warning (the run id was agreed)
    h = [trainhist.open(tmp_path / f"ddp.rank{r}.thist") for r in range(2)]
    for r in range(2):
        (w,) = h[r].writers
        assert (w["rank"], w["world_size"]) == (r, 2)
        # names are the user's (no "module." prefix from the DDP wrapper)
        assert {s.path for s in h[r].sites if s.stream == "param"} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for s in h[0].sites:
        if s.stream.startswith("param"):
            assert s.sharing == "replica", s
            a, b = (x.spine(s.path, s.stream) for x in h)
            for col in ("count", "nan", "zero", "min", "max", "sum", "sumsq"):
                np.testing.assert_array_equal(a.columns[col], b.columns[col], err_msg=f"{s.key} {col}")
            ka, kb = (x.sketch(s.path, s.stream) for x in h)
            np.testing.assert_array_equal(ka.pos, kb.pos)
        elif s.stream == "activation":
            assert s.sharing == "shard"
    a, b = (x.spine("0", "activation") for x in h)
    assert not np.array_equal(a.columns["sum"], b.columns["sum"])  # different data per rank

    # one run: rank 0 published its run id, the other rank recorded it, so merge sums the ranks
    assert h[0].runs[0]["run_id"] == h[1].runs[0]["run_id"]
    merged = tmp_path / "ddp.thist"
    report = trainhist.merge([tmp_path / "ddp.rank1.thist", tmp_path / "ddp.rank0.thist"], merged)
    m = trainhist.open(merged)
    assert len(m.segments) == 1 and len(m.runs) == 1 and len(m.writers) == 2, report
    for s in m.sites:
        if s.stream == "scalar":
            continue
        mine = m.spine(s.path, s.stream, s.facet)
        per_rank = [x.spine(s.path, s.stream, s.facet) for x in h]
        np.testing.assert_array_equal(mine.step, per_rank[0].step)
        if s.sharing == "replica":  # kept once, not summed
            np.testing.assert_array_equal(mine.columns["count"], per_rank[0].columns["count"])
            np.testing.assert_array_equal(mine.columns["sum"], per_rank[0].columns["sum"])
        else:  # the ranks' batches together
            np.testing.assert_array_equal(mine.columns["count"], sum(x.columns["count"] for x in per_rank))
            np.testing.assert_array_equal(mine.min, np.minimum(*(x.min for x in per_rank)))
            np.testing.assert_array_equal(mine.max, np.maximum(*(x.max for x in per_rank)))


EARLY = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from trainhist.torch import Collector
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    col = Collector(net, sys.argv[1], mode="w")  # before the process group exists
    dist.init_process_group("gloo")
    col.attach()
    for step in range(2):
        with col.step(step):
            net(torch.randn(4, 3)).sum().backward()
        col.commit()
    col.close()
    dist.destroy_process_group()
""")


def test_a_collector_made_before_the_process_group_writes_one_file_per_rank(tmp_path):
    """The rank is read when the file is opened: made before init_process_group, every rank wrote one file as
    rank 0 of 1, interleaving their records into a file no reader could read."""
    run_ranks(EARLY, tmp_path, str(tmp_path / "e.thist"))
    assert not (tmp_path / "e.thist").exists()
    for r in range(2):
        h = trainhist.open(tmp_path / f"e.rank{r}.thist")
        h.verify()
        (w,) = h.writers
        assert (w["rank"], w["world_size"]) == (r, 2)
        assert h.spine("(root)", "activation").step.tolist() == [0, 1]


RESUME = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from trainhist.torch import Collector
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run_id = sys.argv[4] if len(sys.argv) > 4 else None
    col = Collector(model, sys.argv[1], commit_every=1, run_id=run_id).attach(optimizer=opt)  # appends to a file
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(int(sys.argv[2]), int(sys.argv[3])):
        with col.step(step):
            model(torch.randn(4, 3, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
    col.close()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("run_id", [None, "ab" * 16])
def test_a_rank_that_lost_its_file_rejoins_the_resumed_run_at_its_segment(tmp_path, run_id):
    """A resumed job where one rank's file is gone (a replaced node): that rank starts its file at the segment the
    other ranks resume at (spec 2.4), so merge pairs the attempts as they ran; it paired the new attempt's rank 1
    with the first attempt's rank 0 and reported a replica divergence that did not exist. With the same ``run_id=``
    given to every rank, the ranks skipped the exchange, and with it the segment: rank 1 started segment 0 again,
    which merge paired with rank 0's first attempt (its steps 2, 3 counted twice, steps 4 of one rank only)."""
    path = str(tmp_path / "r.thist")
    given = () if run_id is None else (run_id,)
    run_ranks(RESUME, tmp_path, path, "0", "4", *given)
    (tmp_path / "r.rank1.thist").unlink()
    outs = run_ranks(RESUME, tmp_path, path, "2", "5", *given)
    assert "rank 0 at segment" not in "".join(outs)
    shards = [trainhist.open(tmp_path / f"r.rank{r}.thist") for r in range(2)]
    assert [[(g.id, g.reason) for g in h.segments] for h in shards] == [[(0, "start"), (1, "resume")], [(1, "start")]]
    trainhist.merge([tmp_path / "r.rank0.thist", tmp_path / "r.rank1.thist"], tmp_path / "m.thist")
    m = trainhist.open(tmp_path / "m.thist")
    sp = m.spine("(root)", "activation")
    rows = sorted(zip(sp.segment.tolist(), sp.step.tolist(), sp.columns["count"].tolist()))
    # the first attempt: rank 0 alone (rank 1's file is gone); the second: both ranks, each step once
    assert rows == [(0, s, 8) for s in range(4)] + [(1, s, 16) for s in range(2, 5)]
    if run_id is not None:
        assert {m.runs[0]["run_id"]} == {h.runs[0]["run_id"] for h in shards} == {run_id} and len(m.runs) == 1
