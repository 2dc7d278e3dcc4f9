"""Two CPU ranks (gloo) training under FSDP2 (``fully_shard``): each rank records its shards of the parameters and
gradients; the merged shards give every parameter's and gradient's whole distribution, checked against the full
tensors the ranks gathered; the norms say whether they are the whole model's or one rank's part.
"""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pytest

import trainhist

from torch_helpers import run_ranks

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")

WORKER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from trainhist.torch import Collector
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    for m in (model[0], model[2]):
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # (updates measured on 5 seeded positions of each larger parameter, drawn over the whole parameter)
    col = Collector(model, sys.argv[1], every=1, sketch_every=1, mode="w", delta_elements=5)
    col.attach(optimizer=opt)
    g = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data
    ref = {"params": {}, "grads": {}, "clip_norm": {}, "norm": {}, "delta": {}}
    for step in range(3):
        before = {n: p.full_tensor().reshape(-1) for n, p in model.named_parameters()}
        with col.step(step):
            model(torch.randn(5, 6, generator=g)).square().mean().backward()
            # the whole gradients (a collective: the test's reference only)
            full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            ref["grads"][step] = {n: [t.numel(), float(t.min()), float(t.max())] for n, t in full.items()}
            ref["norm"][step] = float(torch.cat([t.reshape(-1) for t in full.values()]).double().norm())
            if step < 2:  # clipped steps; step 2 is not clipped
                n = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                ref["clip_norm"][step] = float(n.full_tensor())
            opt.step()
            opt.zero_grad()
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        ref["params"][step] = {n: [t.numel(), float(t.min()), float(t.max())] for n, t in full.items()}
        ref["delta"][step] = {n: (full[n].reshape(-1) - before[n]).tolist() for n in full}
    col.close()
    if rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(ref, f)
    dist.destroy_process_group()
""")


def test_fsdp2_shards_merge_into_whole_parameters(tmp_path):
    outs = run_ranks(WORKER, tmp_path, str(tmp_path / "f.thist"), str(tmp_path / "ref.json"))
    assert not any("trainhist:" in o for o in outs), outs  # no warning: nothing failed, the run id was agreed
    ref = json.loads((tmp_path / "ref.json").read_text())
    shards = [trainhist.open(tmp_path / f"f.rank{r}.thist") for r in range(2)]
    assert shards[0].runs[0]["run_id"] == shards[1].runs[0]["run_id"]
    trainhist.merge([tmp_path / "f.rank0.thist", tmp_path / "f.rank1.thist"], tmp_path / "f.thist")
    h = trainhist.open(tmp_path / "f.thist")
    assert len(h.segments) == 1
    names = ("0.weight", "0.bias", "2.weight", "2.bias")
    for name in names:
        for stream in ("param", "param_grad", "param_delta"):
            s = h.site(name, stream)
            assert s.sharing == "shard", s  # each rank holds a part
            assert s.shape == tuple(shards[0].site(name, stream).shape)
    from trainhist.torch.plan import sample_indices

    for name in names:  # one sample per parameter, the same on every rank: drawn over the whole parameter
        size = int(np.prod(h.site(name, "param").shape))
        want = None if size <= 5 else {"elements": 5, "of": size, "seed": 0}
        assert h.site(name, "param_delta").sample == want, name
    assert h.site("2.weight", "param_delta").sample is not None  # (3 rows on 2 ranks: an uneven split)
    for step in range(3):
        for name in names:  # the ranks' update rows add up to the sampled positions of the whole parameter
            delta = np.array(ref["delta"][str(step)][name], dtype=np.float32)
            idx = sample_indices(name, delta.size, 5, 0)
            sampled = delta if idx is None else delta[idx]
            dp = h.spine(name, "param_delta")
            i = int(np.flatnonzero(dp.step == step)[0])
            assert int(dp.columns["count"][i]) == sampled.size, name
            assert (float(dp.min[i]), float(dp.max[i])) == (float(sampled.min()), float(sampled.max())), name
        # the merged parameter rows are the whole parameters' (every element once; exact min and max)
        for name in names:
            numel, lo, hi = ref["params"][str(step)][name]
            sp = h.spine(name, "param")
            i = int(np.flatnonzero(sp.step == step)[0])
            assert (int(sp.columns["count"][i]), float(sp.min[i]), float(sp.max[i])) == (numel, lo, hi), name
            numel, lo, hi = ref["grads"][str(step)][name]
            gp = h.spine(name, "param_grad", phase="pre_clip" if step < 2 else "default")
            i = int(np.flatnonzero(gp.step == step)[0])
            assert (int(gp.columns["count"][i]), float(gp.min[i]), float(gp.max[i])) == (numel, lo, hi), name
        # the whole model's gradient norm from the merged rows' sums of squares
        phase = "pre_clip" if step < 2 else "default"
        sq = 0.0
        for n in names:
            gp = h.spine(n, "param_grad", phase=phase)
            sq += float(gp.columns["sumsq"][gp.step == step][0])
        assert math.isclose(math.sqrt(sq), ref["norm"][str(step)], rel_tol=1e-6)
    # clipped steps: clip_grad_norm_'s norm is the whole model's (a replicated DTensor), recorded as grad_norm, and
    # whether it clipped is known
    gn = h.spine("grad_norm", "scalar")
    for step in (0, 1):
        i = int(np.flatnonzero(gn.step == step)[0])
        assert float(gn.max[i]) == ref["clip_norm"][str(step)]
    truth = {r["step"]: r for r in h.step_truth_rows()}
    assert truth[0]["clipped"] == truth[1]["clipped"] == "clipped"
    # the step without a clip: each rank knows only its part's norm, recorded as grad_norm_local; the ranks' squares
    # add up to the whole norm's (the merged row's sum of squares)
    assert 2 not in set(gn.step.tolist())
    loc = h.spine("grad_norm_local", "scalar")
    i = int(np.flatnonzero(loc.step == 2)[0])
    assert int(loc.columns["count"][i]) == 2
    assert math.isclose(math.sqrt(float(loc.columns["sumsq"][i])), ref["norm"]["2"], rel_tol=1e-6)


TP = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from trainhist.torch import Collector
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6), torch.nn.Linear(6, 2))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    # "2"'s output is all-reduced: every rank holds it, and "3" (plain) computes the same on every rank, as does
    # the model's own output
    col = Collector(model, sys.argv[1], mode="w", replicas=["2", "3", "(root)"]).attach()
    torch.manual_seed(1)  # the same batch on every rank, as tensor parallelism needs
    for step in range(2):
        with col.step(step):
            model(torch.randn(4, 6)).sum().backward()
    col.close()
    dist.destroy_process_group()
""")


def test_tensor_parallel_replicas_are_kept_once(tmp_path):
    """Under tensor parallelism a row-parallel layer's output, and what follows it, is the same on every rank: named
    in ``replicas=``, those sites are replicas and the merged rows count them once; the column-parallel output and
    the sharded parameters are the ranks' parts and add up."""
    run_ranks(TP, tmp_path, str(tmp_path / "t.thist"))
    trainhist.merge([tmp_path / "t.rank0.thist", tmp_path / "t.rank1.thist"], tmp_path / "t.thist")
    h = trainhist.open(tmp_path / "t.thist")
    want = {("0", "activation"): ("shard", 4 * 8), ("2", "activation"): ("replica", 4 * 6),
            ("3", "activation"): ("replica", 4 * 2), ("3.weight", "param"): ("replica", 12),
            ("(root)", "activation"): ("replica", 4 * 2), ("(root)", "activation_grad"): ("replica", 4 * 2),
            ("0.weight", "param"): ("shard", 48), ("2.weight", "param"): ("shard", 48)}
    for (path, stream), (sharing, count) in want.items():
        assert h.site(path, stream).sharing == sharing, (path, stream)
        assert h.spine(path, stream).columns["count"].tolist() == [count, count], (path, stream)


HSDP = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from trainhist.torch import Collector
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # HSDP
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, sys.argv[1], mode="w", delta_elements=5).attach(optimizer=opt)
    g = torch.Generator().manual_seed(dist.get_rank())
    norms = []
    for step in range(2):
        with col.step(step):
            model(torch.randn(3, 4, generator=g)).square().mean().backward()
            full = [p.grad.full_tensor().reshape(-1) for p in model.parameters()]
            norms.append(float(torch.cat(full).double().norm()))
            opt.step()
            opt.zero_grad()
    col.close()
    if dist.get_rank() == 0:
        open(sys.argv[2], "w").write(json.dumps(norms))
    dist.destroy_process_group()
""")


def test_hsdp_copies_of_a_shard_are_counted_once(tmp_path):
    """HSDP (FSDP2 on a 2-D mesh, replicated x sharded): two ranks hold each shard. Only the first copy records the
    parameter sites, so the merged rows count every element once (they counted it twice), and the ranks' own
    gradient norms add up to the whole model's."""
    run_ranks(HSDP, tmp_path, str(tmp_path / "h.thist"), str(tmp_path / "norms.json"), world=4)
    files = [tmp_path / f"h.rank{r}.thist" for r in range(4)]
    assert len({trainhist.open(f).runs[0]["run_id"] for f in files}) == 1
    trainhist.merge(files, tmp_path / "m.thist")
    h = trainhist.open(tmp_path / "m.thist")
    for name, size in (("0.weight", 32), ("0.bias", 8), ("1.weight", 16), ("1.bias", 2)):
        assert h.spine(name, "param").columns["count"].tolist() == [size, size], name
        assert h.spine(name, "param_grad").columns["count"].tolist() == [size, size], name
        assert h.spine(name, "param_delta").columns["count"].tolist() == [min(size, 5)] * 2, name
    norms = json.loads((tmp_path / "norms.json").read_text())
    local = h.spine("grad_norm_local", "scalar")
    for step in range(2):
        assert math.isclose(math.sqrt(float(local.columns["sumsq"][step])), norms[step], rel_tol=1e-6)
