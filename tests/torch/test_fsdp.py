"""Two CPU ranks (gloo) training under FSDP2 (``fully_shard``): each rank records its shards of the parameters and
gradients; the merged shards give every parameter's and gradient's whole distribution, checked against the full
tensors the ranks gathered; the norms say whether they are the whole model's or one rank's part. FSDP1
(``FullyShardedDataParallel``, on CPU with ``device_id=cpu``) likewise, with and without ``use_orig_params``.
"""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pytest

import trainhist
from trainhist.model import Presence

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


FSDP1 = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from trainhist.torch import Collector
    dist.init_process_group("gloo")
    from torch.distributed.fsdp import ShardingStrategy
    rank, orig = dist.get_rank(), sys.argv[3] in ("orig", "noshard", "clip", "hybrid", "hybridclip", "noopt")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    # (without device_id FSDP1 asks for an accelerator; on CPU it runs with device_id=cpu)
    cpu = dict(device_id=torch.device("cpu"), use_orig_params=orig)
    if sys.argv[3] == "noshard":
        cpu["sharding_strategy"] = ShardingStrategy.NO_SHARD
    if sys.argv[3] in ("hybrid", "hybridclip"):  # (4 ranks: 2 groups replicating each other, sharding within each)
        from torch.distributed.device_mesh import init_device_mesh
        cpu.update(sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=init_device_mesh("cpu", (2, 2)))
    model[0], model[2] = FSDP(model[0], **cpu), FSDP(model[2], **cpu)
    model = FSDP(model, **cpu)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    noopt = sys.argv[3] == "noopt"  # (no optimizer attached: gradients read at step exit; cleared before the step)
    col = Collector(model, sys.argv[1], every=1, sketch_every=1, mode="w", delta_elements=5).attach(
        optimizer=None if noopt else opt)
    name = lambda n: ".".join(x for x in n.split(".") if x != "_fsdp_wrapped_module")  # noqa: E731

    def whole(grads=False):  # the unsharded flat values (collectives: the test's reference only)
        if orig:  # the user's parameters, gathered by FSDP
            with FSDP.summon_full_params(model, with_grads=grads):
                return {name(n): (p.grad if grads else p).detach().reshape(-1).tolist()
                        for n, p in model.named_parameters()}
        out = {}  # the units' flat parameters: the ranks' equal runs of the padded concatenation, in rank order
        for n, p in model.named_parameters():
            t = (p.grad if grads else p).detach()
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t)
            out[name(n)] = torch.cat(parts).tolist()
        return out

    g = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data
    ref = {"params": [], "grads": [], "before": [], "out": [], "clip_norm": []}
    for step in range(3):
        ref["before"].append(whole())
        with col.step(step):
            if noopt:
                opt.zero_grad()
            out = model(torch.randn(5, 6, generator=g))
            out.square().mean().backward()
            ref["grads"].append(whole(grads=True))
            if sys.argv[3] == "clip" and step < 2:  # (FSDP1's own clip: it always clips at this threshold)
                ref["clip_norm"].append(float(model.clip_grad_norm_(0.01)))
            if sys.argv[3] == "hybridclip":  # (torch's clip, which never clips here: the norm of the rank's part)
                ref["clip_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
            if noopt and step == 0:  # (a max-norm clip that does not clip: its norm is not a grad_norm)
                model.clip_grad_norm_(1e9, norm_type=float("inf"))
            opt.step()
            if not noopt:
                opt.zero_grad()
        ref["params"].append(whole())
        ref["out"].append(out.detach().reshape(-1).tolist())
    col.close()
    with open(f"{sys.argv[2]}.{rank}", "w") as f:
        json.dump(ref, f)
    dist.destroy_process_group()
""")


def _fsdp1_run(tmp_path, mode, world=2):
    """Run the FSDP1 worker (``mode``: ``orig`` for use_orig_params=True, ``flat`` for False, ``noshard`` for
    use_orig_params=True with ShardingStrategy.NO_SHARD); return the ranks' outputs, their shard files, the merged
    history and the ranks' references."""
    outs = run_ranks(FSDP1, tmp_path, str(tmp_path / "f.thist"), str(tmp_path / "ref"), mode, world=world)
    files = [tmp_path / f"f.rank{r}.thist" for r in range(world)]
    shards = [trainhist.open(f) for f in files]
    assert len({x.runs[0]["run_id"] for x in shards}) == 1
    trainhist.merge(files, tmp_path / "f.thist")
    refs = [json.loads((tmp_path / f"ref.{r}").read_text()) for r in range(world)]
    return outs, shards, trainhist.open(tmp_path / "f.thist"), refs


def _check_fsdp1_whole(h, refs, names, shards=None):
    """The merged param, param_grad and param_delta rows of ``names`` are the whole (unsharded) tensors': counts,
    zeros, min and max of a float64 numpy reference, the update sampled at the same positions of the whole; and
    the root's output rows are both ranks' outputs together. The gradient norm: the merged ranks' parts
    (``grad_norm_local``), or where the gradients are whole on every rank each rank's ``grad_norm`` (``shards``:
    the ranks' files)."""
    from trainhist.torch.plan import sample_indices

    ref = refs[0]  # (the gathered tensors are the same on both ranks)
    assert all(r["params"] == ref["params"] and r["grads"] == ref["grads"] for r in refs[1:])
    for step in range(3):
        for n in names:
            for stream, values in (("param", ref["params"][step][n]), ("param_grad", ref["grads"][step][n])):
                v = np.array(values, dtype=np.float64)
                sp = h.spine(n, stream)
                (i,) = np.flatnonzero(sp.step == step)
                got = (int(sp.columns["count"][i]), int(sp.columns["zero"][i]), float(sp.min[i]), float(sp.max[i]))
                assert got == (v.size, int((v == 0).sum()), v.min(), v.max()), (n, stream, step)
            # the update at the seeded positions of the whole parameter, every position measured by one rank
            delta = np.float32(ref["params"][step][n]) - np.float32(ref["before"][step][n])
            idx = sample_indices(n, delta.size, 5, 0)
            sampled = delta if idx is None else delta[idx]
            assert h.site(n, "param_delta").sample == (None if idx is None else {"elements": 5, "of": delta.size,
                                                                              "seed": 0}), n
            dp = h.spine(n, "param_delta")
            (i,) = np.flatnonzero(dp.step == step)
            assert (int(dp.columns["count"][i]), float(dp.min[i]), float(dp.max[i])) == (
                sampled.size, float(sampled.min()), float(sampled.max())), (n, step)
        # the whole model's gradient norm from the merged rows' sums of squares, and from the ranks' own norms
        norm = math.sqrt(sum(float(np.square(np.array(ref["grads"][step][n], dtype=np.float64)).sum())
                             for n in names))
        sq = sum(float(h.spine(n, "param_grad").columns["sumsq"][step]) for n in names)
        assert math.isclose(math.sqrt(sq), norm, rel_tol=1e-6)
        if shards is None:
            loc = h.spine("grad_norm_local", "scalar")
            (i,) = np.flatnonzero(loc.step == step)
            assert math.isclose(math.sqrt(float(loc.columns["sumsq"][i])), norm, rel_tol=1e-6)
        else:  # (whole gradients on every rank: each rank's own norm is the whole norm)
            for x in shards:
                g = x.spine("grad_norm", "scalar")
                (i,) = np.flatnonzero(g.step == step)
                assert math.isclose(float(g.columns["sum"][i]), norm, rel_tol=1e-6)
        # the model's output on each rank's own batch: the merged row holds both
        out = np.array(sum((r["out"][step] for r in refs), []), dtype=np.float64)
        sp = h.spine("(root)", "activation")
        (i,) = np.flatnonzero(sp.step == step)
        assert (int(sp.columns["count"][i]), float(sp.min[i]), float(sp.max[i])) == (out.size, out.min(), out.max())


def test_fsdp1_use_orig_params_records_the_users_parameters_as_shards(tmp_path):
    """FSDP1 (``FullyShardedDataParallel``, nested units, ``use_orig_params=True``) on CPU: each rank holds a flat
    run of every parameter (maybe none of it); its sites carry the user's names, are shards of the whole shape,
    and the merged rows are the whole parameters' and gradients'. The update's positions are drawn over the whole
    parameter: drawn over each rank's run, the ranks' sites stated different samples and merge refused them."""
    outs, shards, h, refs = _fsdp1_run(tmp_path, "orig")
    assert not any("trainhist:" in o for o in outs), outs  # no warning
    shapes = {"0.weight": (12, 6), "0.bias": (12,), "2.weight": (3, 12), "2.bias": (3,)}
    for x in shards:
        assert not any("_fsdp" in s.path or "_flat_param" in s.path for s in x.sites), x.sites
        assert {s.path for s in x.sites if s.stream == "param"} == set(shapes)
        assert {s.path for s in x.sites if s.stream == "activation"} == {"0", "1", "2", "(root)"}
    # really sharded: "0.weight" is split between the ranks, whose rows add up to it
    split = [int(x.spine("0.weight", "param").columns["count"][0]) for x in shards]
    assert 0 < split[0] < 72 and sum(split) == 72, split
    for name, shape in shapes.items():
        for stream in ("param", "param_grad", "param_delta"):
            s = h.site(name, stream)
            assert (s.sharing, s.shape) == ("shard", shape), s
    for path, per_rank in (("0", 5 * 12), ("1", 5 * 12), ("2", 5 * 3)):
        for stream in ("activation", "activation_grad"):
            assert h.spine(path, stream).columns["count"].tolist() == [2 * per_rank] * 3, (path, stream)
    _check_fsdp1_whole(h, refs, list(shapes))


def test_fsdp1_flat_params_are_recorded_as_the_units_flat_parameters(tmp_path):
    """FSDP1 with ``use_orig_params=False``: the model's parameters are the units' flat parameters, so those are
    what the collector records, as ``<unit>._flat_param`` shards of the padded whole (a warning says that the
    per-parameter sites need use_orig_params=True); the modules' outputs keep the user's names. The merged rows
    are the whole flat parameters' (padding included), and the update's sample is drawn over the whole: it was
    drawn over each rank's run, so the ranks measured twice as many positions as the sample they stated."""
    outs, shards, h, refs = _fsdp1_run(tmp_path, "flat")
    assert all("use_orig_params=False" in o and "'<unit>._flat_param'" in o for o in outs), outs
    sizes = {"0._flat_param": 6 * 12 + 12, "2._flat_param": 12 * 3 + 3 + 1}  # (39 padded to 40 for 2 ranks)
    for x in shards:
        assert {s.path for s in x.sites if s.stream == "param"} == set(sizes)
        assert {s.path for s in x.sites if s.stream == "activation"} == {"0", "1", "2", "(root)"}
        assert [int(x.spine(n, "param").columns["count"][0]) for n in sizes] == [n // 2 for n in sizes.values()]
    for name, size in sizes.items():
        assert len(refs[0]["params"][0][name]) == size
        for stream in ("param", "param_grad", "param_delta"):
            s = h.site(name, stream)
            assert (s.sharing, s.shape) == ("shard", (size,)), s
    assert int(h.spine("2._flat_param", "param").columns["zero"][0]) >= 1  # (the padding)
    _check_fsdp1_whole(h, refs, list(sizes))


def test_fsdp1_no_shard_parameters_are_replicas_counted_once(tmp_path):
    """FSDP1 with ``ShardingStrategy.NO_SHARD``: every rank holds every parameter whole, as under DDP, so they are
    replicas and the merge keeps one copy: recorded as shards, the merged rows counted every element twice."""
    outs, shards, h, refs = _fsdp1_run(tmp_path, "noshard")
    assert not any("trainhist:" in o for o in outs), outs
    shapes = {"0.weight": (12, 6), "0.bias": (12,), "2.weight": (3, 12), "2.bias": (3,)}
    for x in shards:
        assert [int(x.spine("0.weight", "param").columns["count"][0])] == [72]  # whole on each rank
    for name, shape in shapes.items():
        for stream in ("param", "param_grad", "param_delta"):
            s = h.site(name, stream)
            assert (s.sharing, s.shape) == ("replica", shape), s
    _check_fsdp1_whole(h, refs, list(shapes), shards)


def test_fsdp1_own_clip_grad_norm_is_seen(tmp_path):
    """FSDP1's ``model.clip_grad_norm_`` (its own, not torch's): the collector did not see it, so the gradients it
    scaled were recorded with no phase and ``clipped`` read unknown. Now the clipped steps record pre- and
    post-clip gradients, the whole model's norm the clip returned as ``grad_norm``, and that the step clipped."""
    outs, shards, h, refs = _fsdp1_run(tmp_path, "clip")
    assert not any("trainhist:" in o for o in outs), outs
    ref = refs[0]
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    gn = h.spine("grad_norm", "scalar")
    for step in (0, 1):
        i = int(np.flatnonzero(gn.step == step)[0])
        assert float(gn.max[i]) == ref["clip_norm"][step] == refs[1]["clip_norm"][step]
        for n in names:
            v = np.array(ref["grads"][step][n], dtype=np.float64)  # (taken before the clip)
            gp = h.spine(n, "param_grad", phase="pre_clip")
            (j,) = np.flatnonzero(gp.step == step)
            assert (int(gp.columns["count"][j]), float(gp.min[j]), float(gp.max[j])) == (v.size, v.min(), v.max())
            post = h.spine(n, "param_grad", phase="post_clip")
            (j,) = np.flatnonzero(post.step == step)
            big = max(abs(float(post.min[j])), abs(float(post.max[j])))  # scaled by the clip's own coefficient
            assert int(post.columns["count"][j]) == v.size
            assert math.isclose(big, np.abs(v).max() * 0.01 / (ref["clip_norm"][step] + 1e-6), rel_tol=1e-5)
    truth = {r["step"]: r for r in h.step_truth_rows()}
    assert truth[0]["clipped"] == truth[1]["clipped"] == "clipped"
    assert 2 not in set(gn.step.tolist())  # (no clip: each rank knows its part's norm only)
    assert int(h.spine("grad_norm_local", "scalar").columns["count"][-1]) == 2


def test_fsdp1_hybrid_shard_copies_are_counted_once(tmp_path):
    """FSDP1 ``HYBRID_SHARD`` on 4 ranks (2 groups replicating each other, each sharding the parameters over its 2
    ranks): only the first group records the parameter sites, so the merged rows are the whole parameters', each
    element counted once (they counted it twice), and the first group's norms add up to the whole model's."""
    outs, shards, h, refs = _fsdp1_run(tmp_path, "hybrid", world=4)
    assert not any("trainhist:" in o for o in outs), outs
    params = [{s.path for s in x.sites if s.stream == "param"} for x in shards]
    shapes = {"0.weight": (12, 6), "0.bias": (12,), "2.weight": (3, 12), "2.bias": (3,)}
    assert params[0] == params[1] == set(shapes) and params[2] == params[3] == set()  # (the second group: none)
    for name, shape in shapes.items():
        assert (h.site(name, "param").sharing, h.site(name, "param").shape) == ("shard", shape)
    _check_fsdp1_whole(h, refs, list(shapes))


def test_fsdp1_hybrid_shard_under_torchs_clip_counts_each_part_of_the_norm_once(tmp_path):
    """FSDP1 ``HYBRID_SHARD`` under torch's ``clip_grad_norm_``: each rank's clip returns the norm of its own part of
    the gradients, recorded as ``grad_norm_local``. The second group's ranks hold copies of the first group's parts:
    they record no norm, so the merged norm is the whole model's (it counted every part twice)."""
    outs, shards, h, refs = _fsdp1_run(tmp_path, "hybridclip", world=4)
    assert not any("trainhist:" in o for o in outs), outs
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [any(s.path == "grad_norm_local" for s in x.sites) for x in shards] == [True, True, False, False]
    loc = h.spine("grad_norm_local", "scalar")
    assert loc.step.tolist() == [0, 1, 2] and loc.columns["count"].tolist() == [2, 2, 2]
    for step in range(3):
        grads = refs[0]["grads"][step]
        norm = math.sqrt(sum(float(np.square(np.array(grads[n], dtype=np.float64)).sum()) for n in names))
        assert math.isclose(math.sqrt(float(loc.columns["sumsq"][step])), norm, rel_tol=1e-6)
        # (each rank's clip saw its own part: the first group's parts' squares add up to the whole norm's)
        parts = [refs[r]["clip_norm"][step] for r in range(4)]
        assert math.isclose(math.hypot(parts[0], parts[1]), norm, rel_tol=1e-5)
        for n in names:  # (the clip's pre-clip gradient rows count every element once)
            gp = h.spine(n, "param_grad", phase="pre_clip")
            (i,) = np.flatnonzero(gp.step == step)
            assert int(gp.columns["count"][i]) == len(grads[n]), (n, step)


def test_fsdp1_a_rank_without_part_of_a_parameter_records_an_empty_gradient(tmp_path):
    """FSDP1 drops the gradient of a parameter a rank holds none of: read at step exit (no optimizer attached), that
    rank recorded the site as 'unknown', so the merged row was unknown though the other rank observed all of it.
    Such a rank now records an empty observation, and the merged rows are the whole gradients'. A max-norm clip
    (FSDP1's own, norm_type=inf) is not recorded as the gradient norm."""
    outs, shards, h, refs = _fsdp1_run(tmp_path, "noopt")
    holders = [int(x.spine("0.bias", "param").columns["count"][0]) for x in shards]
    assert sorted(holders) == [0, 12]  # (one rank holds none of 0.bias)
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    for step in range(3):
        for n in names:
            v = np.array(refs[0]["grads"][step][n], dtype=np.float64)
            gp = h.spine(n, "param_grad", phase="pre_clip" if step == 0 else "default")
            (i,) = np.flatnonzero(gp.step == step)
            assert gp.presence[i] == Presence.OBSERVED, (n, step)
            assert (int(gp.columns["count"][i]), float(gp.min[i]), float(gp.max[i])) == (v.size, v.min(), v.max())
    assert not any(s.path == "grad_norm" for s in h.sites)  # (the inf-norm clip's value is no 2-norm)
