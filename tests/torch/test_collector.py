"""End-to-end collector tests on a small MLP: values, cost discipline, phases, truth and robustness."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import warnings

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint
from torch_helpers import CPU_METHODS, Spy, Wrapper, assert_row, presence, ref_summary

import trainhist
from trainhist.summary import SumMethod, summarize
from trainhist.torch import Collector, StepTruth
from trainhist.torch.plan import ROOT, sample_indices
from trainhist.triage import triage


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(inplace=True), torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 3),
    )


def assert_param_rows(h: trainhist.History, step: int, after: dict, before: dict, grads: dict | None,
                      elements: int, *, sketch: bool) -> None:
    """``param``, ``param_grad`` (when ``grads`` is given) and ``param_delta`` (the seeded subvector of
    ``elements``) of every parameter at ``step`` equal the numpy reference of the values the loop saw."""
    for n in after:
        assert_row(h, n, "param", step, ref_summary([after[n]]), sketch=sketch)
        if grads is not None:
            assert_row(h, n, "param_grad", step, ref_summary([grads[n]]), sketch=sketch)
        wide = torch.promote_types(after[n].dtype, torch.float32)  # (float64 subtracted in float64, then rounded)
        d = (after[n].to(wide) - before[n].to(wide)).float().reshape(-1)
        idx = sample_indices(n, d.numel(), elements, 0)
        assert_row(h, n, "param_delta", step, ref_summary([d if idx is None else d[torch.from_numpy(idx)]]),
                   sketch=sketch)


@pytest.mark.parametrize("method", [None] + (["triton"] if "triton" in CPU_METHODS else []))
def test_mlp_matches_numpy_reference(tmp_path, monkeypatch, method):
    """Every stream, with 2 micro-batches per step, equals the numpy reference of the same tensors: with the
    CPU's default reduction, and with the GPU's (the Triton kernel, run in Triton's interpreter), whose rows hold
    key counts even at steps where only the spine is due."""
    if method is not None:
        import trainhist.torch.reduce as rd

        monkeypatch.setattr(rd, "CPU_METHOD", method)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = tmp_path / "mlp.thist"
    col = Collector(model, path, every=1, sketch_every=2, delta_elements=100)
    col.discover(torch.randn(4, 8))
    col.attach(optimizer=opt)
    mods = {ROOT if n == "" else n: m for n, m in model.named_modules()}
    spy = Spy(mods)
    params = dict(model.named_parameters())
    grads, before, after = {}, {}, {}
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        spy.step = step
        before[step] = {n: p.detach().clone() for n, p in params.items()}
        with col.step(step, truth=StepTruth(tokens=16)):
            for _ in range(2):
                x = torch.randn(8, 8, generator=gen)
                x[0, 0] = -0.0
                model(x).square().mean().backward()
            grads[step] = {n: p.grad.clone() for n, p in params.items()}
            opt.step()
            opt.zero_grad()
        after[step] = {n: p.detach().clone() for n, p in params.items()}
    spy.remove()
    col.close()

    h = trainhist.open(path)
    for step in range(4):
        sk = step % 2 == 0
        for (s, name, facet), ts in spy.acts.items():
            if s == step:
                assert len(ts) == 2
                assert_row(h, name, "activation", step, ref_summary(ts), facet=facet, sketch=sk)
        for (s, name, facet), gs in spy.grads.items():
            if s == step:
                assert_row(h, name, "activation_grad", step, ref_summary(gs), facet=facet, sketch=sk)
        assert_param_rows(h, step, after[step], before[step], grads[step], 100, sketch=sk)
    # param_delta is sampled (and says so) only where the tensor is larger than the subvector
    sites = {(s.path, s.stream): s for s in h.sites}
    assert sites[("2.weight", "param_delta")].sample == {"elements": 100, "of": 1024, "seed": 0}
    assert sites[("0.bias", "param_delta")].sample is None
    rows = h.step_truth_rows()
    assert [r["micro_batches"] for r in rows] == [2, 2, 2, 2]
    assert all(r["applied"] == "applied" for r in rows), rows
    # run-level scalars: global grad norm (no clipping) from the per-parameter sums of squares, lr, timing
    gn = h.spine("grad_norm", "scalar").max
    want = [math.sqrt(sum(float(g.double().square().sum()) for g in grads[s].values())) for s in range(4)]
    np.testing.assert_allclose(gn, want, rtol=1e-12)
    assert np.all(h.spine("lr/group0", "scalar").max == 1e-2)
    assert np.all(h.spine("tokens_per_s", "scalar").max > 0)


@pytest.mark.parametrize("method", ["index_add", "fused"] + (["triton"] if "triton" in CPU_METHODS else []))
def test_one_host_transfer_per_step_and_no_per_site_syncs(tmp_path, monkeypatch, method):
    """``index_add`` is the path every device takes (as on CUDA); ``fused`` the CPU kernel, which reads each CPU
    tensor and writes the (host) ledger row in place by address: no transfer, no host read of a tensor."""
    import trainhist.torch.reduce as rd

    monkeypatch.setattr(rd, "CPU_METHOD", method)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, tmp_path / "t.thist", every=1, sketch_every=1)
    col.discover(torch.randn(2, 8))
    col.attach(optimizer=opt)
    calls = {"item": 0, "cpu": 0, "tolist": 0, "numpy": 0, "__float__": 0}
    fused = {"calls": 0}
    in_step = {"on": False}
    real_fused, real_at = rd.fused_into, rd.fused_at

    def fused_spy(x, address, sketch):
        fused["calls"] += 1
        return real_fused(x, address, sketch)

    def at_spy(*args):
        fused["calls"] += 1
        return real_at(*args)

    import trainhist.torch.collector as cm

    monkeypatch.setattr(cm, "fused_into", fused_spy)
    monkeypatch.setattr(cm, "fused_at", at_spy)
    for name in calls:
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            if in_step["on"]:
                calls[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    before = col._ledger.transfers
    for step in range(3):
        with col.step(step):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            in_step["on"] = True  # user code above may sync; the collector's hooks below must not
            opt.step()
            opt.zero_grad()
            col.scalars(step, loss=loss)
        in_step["on"] = False
        assert col._ledger.transfers == before + step + 1
    monkeypatch.undo()
    col.close()
    # only the ledger's landed host copy is turned into numpy, once per step, after the step's single copy
    assert calls == {"item": 0, "cpu": 0, "tolist": 0, "numpy": 3, "__float__": 0}, calls
    assert (fused["calls"] > 0) == (method == "fused"), fused
    h = trainhist.open(tmp_path / "t.thist")
    assert len(h.spine("loss", "scalar")) == 3


@pytest.mark.parametrize("method", ["index_add", "fused"] + (["triton"] if "triton" in CPU_METHODS else []))
def test_hooks_do_not_sync_during_forward_and_backward(tmp_path, monkeypatch, method):
    """Neither the path every device takes (torch ops, ``index_add``) nor the CPU kernel (which reads tensors by
    address) makes a host read of a tensor inside a hook."""
    import trainhist.torch.reduce as rd

    monkeypatch.setattr(rd, "CPU_METHOD", method)
    model = mlp()
    col = Collector(model, tmp_path / "t.thist", every=1)
    col.attach()
    n = {"sync": 0}
    for name in ("item", "cpu", "tolist", "numpy", "__float__", "__bool__"):
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, **k):
            n["sync"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    with col.step(0):
        model(torch.randn(4, 8)).sum().backward()
        syncs_inside = n["sync"]
    monkeypatch.undo()
    col.close()
    assert syncs_inside == 0


def test_clipping_phases_norms_and_truth(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "c.thist"
    col = Collector(model, path, streams=("param_grad",), every=1)
    col.attach(optimizer=opt)
    pre, post, norms = {}, {}, {}
    for step in range(2):
        with col.step(step):
            model(torch.randn(16, 8)).square().sum().backward()
            pre[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
            norms[step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5 if step else 1e6))
            post[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
    col.close()
    h = trainhist.open(path)
    for step in range(2):
        for n in pre[step]:
            assert_row(h, n, "param_grad", step, ref_summary([pre[step][n]]), phase="pre_clip", sketch=step == 0)
            assert_row(h, n, "param_grad", step, ref_summary([post[step][n]]), phase="post_clip", sketch=step == 0)
    rows = h.step_truth_rows()
    assert [r["clipped"] for r in rows] == ["not_clipped", "clipped"]
    assert [r["clip_threshold"] for r in rows] == [1e6, 0.5]
    np.testing.assert_allclose(h.spine("grad_norm", "scalar").max, [norms[0], norms[1]], rtol=1e-6)
    post_norm = h.spine("grad_norm_post_clip", "scalar").max
    assert post_norm[0] == pytest.approx(norms[0], rel=1e-6) and post_norm[1] == pytest.approx(0.5, rel=1e-5)


def test_gradscaler_skipped_step_records_skipped_delta_and_basis(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    path = tmp_path / "s.thist"
    col = Collector(model, path, streams=("param_grad", "param_delta"), every=1)
    col.attach(optimizer=opt, scaler=scaler)
    w0 = w1 = model[0].weight.detach().clone()  # w1: the weight after the previous step
    for step in range(3):
        with col.step(step):
            x = torch.randn(4, 8)
            if step == 1:
                x[0, 0] = math.inf  # overflow: the scaler must skip this step
            loss = model(x).square().mean()
            scaler.scale(loss).backward()
            if step == 2:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        if step == 1:
            assert torch.equal(model[0].weight, w1)
        w1 = model[0].weight.detach().clone()
    col.close()
    assert not torch.equal(w0, w1)
    h = trainhist.open(path)
    rows = h.step_truth_rows()
    assert [r["applied"] for r in rows] == ["applied", "skipped", "applied"]
    # the scale each step's loss was multiplied by: step 1's overflow halves it for step 2, not for step 1
    assert [r["loss_scale"] for r in rows] == [1024.0, 1024.0, 512.0]
    assert [r["grad_basis"] for r in rows] == ["unscaled", "unscaled", "unscaled"]
    assert presence(h, "0.weight", "param_delta", 1) == "skipped"
    assert presence(h, "0.weight", "param_delta", 0) == "observed"
    g = h.spine("0.weight", "param_grad", phase="default")
    assert g.nan[list(g.step).index(1)] + g.pinf[list(g.step).index(1)] + g.ninf[list(g.step).index(1)] > 0
    assert presence(h, "0.weight", "param_grad", 2, phase="pre_clip") == "observed"
    np.testing.assert_array_equal(h.spine("loss_scale", "scalar").max, [1024.0, 1024.0, 512.0])


def test_scaled_basis_when_clipping_before_unscale(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    col = Collector(model, tmp_path / "b.thist", streams=("param_grad",), every=1)
    col.attach(optimizer=opt, scaler=scaler)
    with col.step(0):
        scaler.scale(model(torch.randn(4, 8)).sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # clipping the scaled gradients
        scaler.step(opt)
        scaler.update()
    col.close()
    assert trainhist.open(tmp_path / "b.thist").step_truth_rows()[0]["grad_basis"] == "scaled"


def test_truth_overrides_detection(tmp_path):
    model = mlp()
    col = Collector(model, tmp_path / "t.thist", streams=("activation",), every=1)
    with col.step(0, truth=StepTruth(applied=False, micro_batches=7, tokens=5, samples=3, grad_basis="scaled",
                                      loss_scale=8.0, clipped=True, clip_threshold=2.0)):
        model(torch.randn(2, 8))
    col.close()
    r = trainhist.open(tmp_path / "t.thist").step_truth_rows()[0]
    assert (r["applied"], r["micro_batches"], r["tokens"], r["samples"], r["grad_basis"], r["loss_scale"],
            r["clipped"], r["clip_threshold"]) == ("skipped", 7, 5, 3, "scaled", 8.0, "clipped", 2.0)
    with pytest.raises(trainhist.UsageError):
        StepTruth(grad_basis="maybe")


class Gate(torch.nn.Module):
    """Runs its branch only when told: the branch is absent at the other steps."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = torch.nn.Linear(4, 4)
        self.use = True

    def forward(self, x):
        return self.branch(x) if self.use else x


def test_absent_and_failed_sites(tmp_path, monkeypatch):
    model = Gate()
    path = tmp_path / "a.thist"
    col = Collector(model, path, streams=("activation",), every=1)
    col.discover(torch.randn(2, 4))
    for step in range(3):
        model.use = step != 1
        if step == 2:  # the reducer breaks on one site: that site is 'failed', the rest is recorded
            import trainhist.torch.collector as cm

            real = cm.fused_at  # the CPU's reduction (address, elements, dtype, row, sketch)

            def flaky(address, n, *args):
                if n == 8 and flaky.n == 0:  # the (2, 4) output
                    flaky.n += 1
                    raise RuntimeError("boom")
                return real(address, n, *args)

            flaky.n = 0
            monkeypatch.setattr(cm, "fused_at", flaky)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with col.step(step):
                model(torch.randn(2, 4))
        assert bool(caught) == (step == 2)
    col.close()
    h = trainhist.open(path)
    assert [presence(h, "branch", "activation", s) for s in range(3)] == ["observed", "absent", "failed"]
    assert [presence(h, ROOT, "activation", s) for s in range(3)] == ["observed", "observed", "observed"]


def test_writer_error_warns_once_and_training_goes_on(tmp_path):
    model = mlp()

    class FullDisk:
        def __getattr__(self, name):
            def fail(*a, **k):
                raise OSError(28, "No space left on device")
            return fail

    col = Collector(model, writer=FullDisk(), every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            with col.step(step):
                model(torch.randn(2, 8)).sum().backward()
            col.scalars(step, loss=1.0)
        col.close()
    assert len([w for w in caught if "No space left" in str(w.message)]) == 1
    assert col.writer_errors > 3


def test_commit_between_steps_makes_them_readable_before_close(tmp_path):
    """commit() writes every finished step durably: a reader sees them while the run goes on; inside a step, or
    after close, it is refused."""
    from trainhist.errors import UsageError

    model = mlp()
    col = Collector(model, tmp_path / "c.thist", every=1)
    col.discover(torch.randn(2, 8))
    for step in range(2):
        with col.step(step):
            model(torch.randn(2, 8)).sum().backward()
            with pytest.raises(UsageError, match="between steps"):
                col.commit()
    col.commit()
    h = trainhist.open(tmp_path / "c.thist")
    assert h.spine("0", "activation").step.tolist() == [0, 1]
    col.close()
    with pytest.raises(UsageError, match="closed"):
        col.commit()


def test_nan_injected_by_another_forward_hook_is_attributed_to_its_module(tmp_path):
    model = mlp()
    path = tmp_path / "n.thist"
    col = Collector(model, path, streams=("activation",), every=1)
    col.attach()

    def inject(module, args, out):  # registered after the collector's hook: must still be seen
        out = out.clone()
        out[0, 0] = math.nan
        return out

    model[2].register_forward_hook(inject)
    with col.step(0):
        model(torch.randn(2, 8))
    col.close()
    h = trainhist.open(path)
    nan = {n: int(h.spine(n, "activation").nan[0]) for n in ("0", "1", "2", "3", "4")}
    assert nan["0"] == nan["1"] == 0 and nan["2"] == 1 and nan["3"] == 1
    assert col.first_nonfinite == (0, "2", "activation", None)


def test_nan_hook_registered_inside_a_step_is_attributed_to_its_module(tmp_path):
    """A hook registered after the step began (prepended, with kwargs, or plain) still runs before the recorder's,
    so its NaN is seen at the module it hooks; the user's hooks keep their own order."""
    model = mlp()
    path = tmp_path / "n.thist"
    col = Collector(model, path, streams=("activation",), every=1)
    col.attach()
    seen = []

    def inject(module, args, out):
        out = out.clone()
        out[0, 0] = math.nan
        return out

    def look(module, args, kwargs, out):
        seen.append(bool(torch.isnan(out).any()))

    for step, how in enumerate(({}, {"prepend": True}, {"with_kwargs": True, "always_call": True})):
        with col.step(step):
            hs = [model[2].register_forward_hook(inject, **{k: v for k, v in how.items() if k == "prepend"})]
            if how.get("with_kwargs"):
                hs.append(model[2].register_forward_hook(look, **how))
            copy.deepcopy(model)  # (a copy made inside the step keeps working)
            model(torch.randn(2, 8))
            for h in hs:
                h.remove()
    with col.step(3):
        model(torch.randn(2, 8))
    col.close()
    assert seen == [True]
    assert not model[2]._forward_hooks and not model[2]._forward_pre_hooks  # (the collector's are removed)
    h = trainhist.open(path)
    nan = {n: h.spine(n, "activation").nan.tolist() for n in ("1", "2", "3")}
    assert nan == {"1": [0, 0, 0, 0], "2": [1, 1, 1, 0], "3": [1, 1, 1, 0]}
    assert col.first_nonfinite == (0, "2", "activation", None)


class KwOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, *, x, scale=1.0):
        return self.act(self.lin(x)) * scale


def test_inplace_relu_and_kwargs_only_inputs(tmp_path):
    """The Linear output is recorded before ReLU(inplace) rewrites it; its gradient is d/d(pre-ReLU output)."""
    torch.manual_seed(0)
    model = KwOnly()
    path = tmp_path / "k.thist"
    col = Collector(model, path, streams=("activation", "activation_grad"), every=1)
    col.discover({"x": torch.randn(3, 4)})
    x = torch.randn(3, 4)
    with col.step(0):
        out = model(x=x, scale=2.0)
        out.sum().backward()
    col.close()
    ref = model.lin(x).detach()
    h = trainhist.open(path)
    assert_row(h, "lin", "activation", 0, ref_summary([ref]))
    assert int(h.spine("lin", "activation").zero[0]) == 0 and int((ref < 0).sum()) > 0
    ref_grad = 2.0 * (ref > 0).float()
    assert_row(h, "lin", "activation_grad", 0, ref_summary([ref_grad]))


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        self.b = torch.nn.Linear(8, 2)
        self.reentrant = reentrant

    def forward(self, x):
        return self.b(checkpoint(self.a, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpoint_recompute_not_double_counted(tmp_path, reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    plain = Checkpointed(reentrant)
    plain.load_state_dict(model.state_dict())
    plain.forward = lambda x: plain.b(plain.a(x))
    x = torch.randn(5, 8, requires_grad=True)
    spy = Spy({n: m for n, m in plain.named_modules() if n})
    spy.step = 0
    plain(x).square().sum().backward()
    spy.remove()
    path = tmp_path / "ck.thist"
    col = Collector(model, path, streams=("activation", "activation_grad"), every=1)
    with col.step(0):
        model(x).square().sum().backward()
    col.close()
    h = trainhist.open(path)
    for (s, name, facet), ts in spy.acts.items():
        assert_row(h, name, "activation", 0, ref_summary(ts))
        assert h.step_truth_rows()[0]["micro_batches"] == 1
    for (s, name, facet), gs in spy.grads.items():
        assert_row(h, name, "activation_grad", 0, ref_summary(gs))


def test_new_segment_and_late_tensor_scalars(tmp_path):
    model = mlp()
    path = tmp_path / "seg.thist"
    col = Collector(model, path, streams=("param",), every=1)
    losses = []
    for step in range(4):
        with col.step(step, new_segment=step == 2):
            loss = model(torch.randn(2, 8)).sum()
        losses.append(float(loss.detach()))
        col.scalars(step, loss=loss, lr=0.5)  # a tensor after the step: read at the next single transfer
    col.close()
    h = trainhist.open(path)
    assert [s.first_step for s in h.segments][-1] == 2
    sp = h.spine("0.weight", "param")
    assert list(sp.step) == [0, 1, 2, 3] and list(sp.segment) == [0, 0, 1, 1]
    lo = h.spine("loss", "scalar")
    assert list(lo.step) == [0, 1, 2, 3]
    np.testing.assert_array_equal(lo.max, np.array(losses, np.float32).astype(np.float64))


def test_cadence_and_settings(tmp_path):
    model = mlp()
    path = tmp_path / "cad.thist"
    col = Collector(model, path, streams=("activation", "param"), every={"activation": 2, "param": 3},
                    sketch_every={"activation": 4, "param": 0})
    for step in range(7):
        with col.step(step):
            model(torch.randn(2, 8))
    col.close()
    h = trainhist.open(path)
    assert list(h.spine("0", "activation").step) == [0, 2, 4, 6]
    assert list(h.sketch("0", "activation").columns["step"]) == [0, 4]
    assert list(h.spine("0.weight", "param").step) == [0, 3, 6]
    assert len(h.sketch("0.weight", "param")) == 0
    site = h.site("0", "activation")
    assert (site.cadence_spine, site.cadence_sketch) == (2, 4)
    (settings,) = [d["settings"] for d in h.settings]
    assert settings["collector"] == "trainhist.torch" and settings["every"]["param"] == 3
    assert settings["param_delta"]["elements"] == 4096


@pytest.mark.parametrize("micro", [1, 2])
def test_aliased_outputs_are_reduced_once_and_recorded_for_every_site(tmp_path, monkeypatch, micro):
    """A container returning its last child's output, eval-mode dropout returning its input and a flattening view:
    the same elements (and one gradient) seen by several sites are reduced once and merged; every site still
    equals the reference."""
    import trainhist.torch.collector as cm

    merges = {"n": 0}
    real = cm.merge_row

    def counting(dst, src):
        merges["n"] += 1
        real(dst, src)

    monkeypatch.setattr(cm, "merge_row", counting)
    real_host = cm.Ledger.merge_on_host  # the CPU kernel's merge, in place by address

    def counting_host(self, dst, src):
        merges["n"] += 1
        real_host(self, dst, src)

    monkeypatch.setattr(cm.Ledger, "merge_on_host", counting_host)
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    # (Flatten returns a view of its input's memory in another shape: the same elements, reduced once too)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), inner, torch.nn.Identity(), torch.nn.Flatten(0))
    inner[1].eval()  # returns its input
    path = tmp_path / "alias.thist"
    col = Collector(model, path, streams=("activation", "activation_grad"), every=1, sketch_every=2)
    col.discover(torch.randn(2, 8))
    col.attach()
    spy = Spy({ROOT if n == "" else n: m for n, m in model.named_modules()})
    for step in range(3):
        spy.step = step
        with col.step(step):
            for _ in range(micro):
                model(torch.randn(4, 8)).square().mean().backward()
    spy.remove()
    col.close()
    assert merges["n"] > 0
    h = trainhist.open(path)
    for (s, name, facet), ts in spy.acts.items():
        assert_row(h, name, "activation", s, ref_summary(ts), facet=facet, sketch=s % 2 == 0)
    for (s, name, facet), gs in spy.grads.items():
        assert_row(h, name, "activation_grad", s, ref_summary(gs), facet=facet, sketch=s % 2 == 0)


class _Halves(torch.nn.Module):
    """Returns the two halves of its input's last dimension: two outputs of one autograd node (``chunk``)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.chunk(2, dim=-1)


def test_outputs_of_one_autograd_node_get_their_own_gradients(tmp_path):
    """The facets of a module output made by one autograd node (its outputs 0 and 1; the gradient of each is read
    on that node, at its own position) each get their own gradient, equal to a tensor hook's reference; a half that
    no gradient reaches in a step (its consumer skipped) reads absent there, not the other half's."""
    torch.manual_seed(0)
    lin, halves = torch.nn.Linear(8, 8), _Halves()
    model = torch.nn.Sequential(lin, halves)
    path = tmp_path / "halves.thist"
    col = Collector(model, path, streams=("activation", "activation_grad"), every=1, sketch_every=1)
    col.discover(torch.randn(2, 8))
    col.attach()
    spy = Spy({"1": halves})
    for step in range(3):
        spy.step = step
        with col.step(step):
            a, b = model(torch.randn(4, 8))
            loss = (a * 3).sum() + b.square().sum() if step != 1 else (a * 3).sum()
            loss.backward()
    spy.remove()
    col.close()
    h = trainhist.open(path)
    assert set(spy.grads) == {(0, "1", "0"), (0, "1", "1"), (1, "1", "0"), (2, "1", "0"), (2, "1", "1")}
    for (s, name, facet), gs in spy.grads.items():
        assert_row(h, name, "activation_grad", s, ref_summary(gs), facet=facet)
    assert presence(h, "1", "activation_grad", 1, facet="1") == "absent"
    assert presence(h, "1", "activation_grad", 1, facet="0") == "observed"


def test_defaults_are_spine_every_step_and_sparser_sketches(tmp_path):
    """Issue 4: the spine every step by default, sketches sparser."""
    col = Collector(mlp(), tmp_path / "d.thist")
    try:
        assert set(col.every.values()) == {1} and set(col.sketch_every.values()) == {10}
    finally:
        col.close()


def test_a_cadence_still_records_the_gradient_norm_every_step(tmp_path):
    """At a cadence: per-site spines every 5 steps, sketches every 10, and the global gradient norm (a run-level
    scalar) every step, equal to clip_grad_norm_'s own norm."""
    every, sketch_every = 5, 10

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    path = tmp_path / "default.thist"
    col = Collector(model, path, every=every, sketch_every=sketch_every)
    col.attach(optimizer=opt)
    norms = []
    n = every + 2
    for step in range(n):
        with col.step(step):
            loss = model(torch.randn(4, 8)).square().mean()
            if step == every + 1:
                loss = loss * math.nan
            loss.backward()
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
            opt.step()
            opt.zero_grad()
    col.close()
    h = trainhist.open(path)
    assert list(h.spine("0", "activation").step) == [0, every]
    assert list(h.spine("0.weight", "param_grad").step) == [0, every]
    assert list(h.sketch("0", "activation").columns["step"]) == [0]
    g = h.spine("grad_norm", "scalar")
    assert list(g.step) == list(range(n))
    got = np.asarray(g.max, dtype=np.float64)
    np.testing.assert_allclose(got[:-1], norms[:-1], rtol=1e-5)
    assert math.isnan(got[-1])  # the step the gradient went non-finite, though no spine was due


def test_tensor_subclass_outputs_are_reduced_through_torch_ops(tmp_path):
    """Two modules returning different wrapper-subclass tensors (no storage of their own, data_ptr 0, like quantised
    or distributed types): neither is read by address nor mistaken for the other by the alias shortcut; each site
    records its own values."""

    class Wrap(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, x):
            return Wrapper(x.detach() * self.scale)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ModuleList([Wrap(1.0), Wrap(-3.0)]))
    model.forward = lambda x: [m(model[0](x)) for m in model[1]]  # noqa: E731 -- two outputs, same shape
    path = tmp_path / "w.thist"
    col = Collector(model, path, streams=("activation",), every=1)
    x = torch.randn(2, 4)
    with col.step(0):
        outs = model(x)
    col.close()
    h = trainhist.open(path)
    for name, out in (("1.0", outs[0]), ("1.1", outs[1])):
        assert_row(h, name, "activation", 0, ref_summary([out.inner]))


class _Scaled(torch.nn.Module):
    """A float32 layer and a float64 parameter: the CPU kernel batches the first, the second takes the torch path."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(8, 70)
        self.scale = torch.nn.Parameter(torch.rand(70, dtype=torch.float64) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale.float()


@pytest.mark.parametrize("case", ["batched", "one by one", "replaced mid-step"])
def test_batched_parameter_reductions_match_the_reference(tmp_path, monkeypatch, case):
    """Parameters, gradients and updates go through one compiled call per width on the CPU kernel's path (float32
    only for the update); the rows equal the numpy reference whether batched, reduced one by one (the batched call
    disabled), or when the loop replaces a parameter's memory inside the step (the updates then take the torch
    path from the same snapshot)."""
    import trainhist.torch.collector as cm

    if case == "one by one":
        monkeypatch.setattr(cm, "fused_many_at", lambda ats, rows, sketch: [])
    model = _Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "b.thist"
    col = Collector(model, path, every=1, sketch_every=2, delta_elements=64)
    col.discover(torch.randn(2, 8))
    col.attach(optimizer=opt)
    params = dict(model.named_parameters())
    grads, before, after = {}, {}, {}
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        before[step] = {n: p.detach().clone() for n, p in params.items()}
        with col.step(step):
            model(torch.randn(5, 8, generator=gen)).square().mean().backward()
            grads[step] = {n: p.grad.clone() for n, p in params.items()}
            opt.step()
            if case == "replaced mid-step" and step == 1:  # same values, now a transposed (non-contiguous) view
                model.lin.weight.data = model.lin.weight.data.t().contiguous().t()
            opt.zero_grad()
        after[step] = {n: p.detach().clone() for n, p in params.items()}
    col.close()
    # the float32 contiguous ones (after the replacement, the weight is neither)
    assert set(col._delta_batch.names) == ({"lin.bias"} if case == "replaced mid-step" else {"lin.weight", "lin.bias"})
    h = trainhist.open(path)
    for step in range(3):
        assert_param_rows(h, step, after[step], before[step], grads[step], 64, sketch=step % 2 == 0)


def test_a_parameter_resized_between_steps_is_sampled_again(tmp_path):
    """The loop replaces a float32 weight by a smaller (then a larger) one between steps: its update positions are
    drawn again for the new size (no read past the new tensor), and the rows equal the reference."""
    model = _Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "r.thist"
    col = Collector(model, path, streams=("param", "param_delta"), every=1, delta_elements=64)
    col.discover(torch.randn(2, 8))
    col.attach(optimizer=opt)
    before, after = {}, {}
    for step, rows in enumerate((70, 3, 40)):
        if rows != model.lin.weight.shape[0]:  # between steps: a new (smaller, then larger) weight and bias
            model.lin.weight.data = torch.randn(rows, 8)
            model.lin.bias.data = torch.randn(rows)
            model.scale.data = torch.rand(rows, dtype=torch.float64) + 0.5
        before[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        with col.step(step):
            model(torch.randn(5, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        after[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
    col.close()
    h = trainhist.open(path)
    for step in range(3):
        assert_param_rows(h, step, after[step], before[step], None, 64, sketch=False)


def test_gather_refuses_positions_outside_a_tensor_before_reading():
    """The kernel that takes the update subvectors checks every position against its tensor's size first."""
    from trainhist.torch.cpukernel import gather_f32

    a, b = torch.arange(10, dtype=torch.float32), torch.arange(4, dtype=torch.float32)
    addresses = np.array([a.data_ptr(), b.data_ptr()], dtype=np.int64)
    out = np.full(5, -1.0, dtype=np.float32)
    index, offsets = np.array([1, 9, 0, 2, 3], dtype=np.int64), np.array([0, 2, 5], dtype=np.int64)
    assert gather_f32(addresses, np.array([10, 4], dtype=np.int64), index, offsets, out, False) == -1
    assert out.tolist() == [1.0, 9.0, 0.0, 2.0, 3.0]
    out[:] = -1.0
    assert gather_f32(addresses, np.array([10, 3], dtype=np.int64), index, offsets, out, True) == 1
    assert out.tolist() == [-1.0] * 5  # nothing read or written


def test_parameters_are_reduced_in_the_model_order(tmp_path):
    """Parameters (and their updates) are reduced in the model's order, whatever the hash seed: the first
    non-finite value is the first one in that order."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, tmp_path / "o.thist", streams=("param", "param_delta"), every=1)
    col.discover(torch.randn(2, 8))
    col.attach(optimizer=opt)
    assert list(col._sel_params) == [n for n, _ in model.named_parameters()]
    with col.step(0):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        with torch.no_grad():
            model[4].weight[0, 0] = math.nan
            model[0].bias[1] = math.inf
    col.close()
    assert col.first_nonfinite == (0, "0.bias", "param", None)


class Shared(torch.nn.Module):
    """A module called twice in one forward (one site, two reductions in a step), an in-place ReLU after a Linear,
    a tuple output, and an in-place change of a child's output inside the parent's forward (switched on later)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.act = torch.nn.ReLU(inplace=True)
        self.block = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 2)
        self.late_inplace = False

    def forward(self, x):
        h = self.act(self.inp(x))
        h = self.block(torch.tanh(self.block(h)))
        y = self.head(h)
        if self.late_inplace:
            y.mul_(2.0)  # changes head's output after its hook saw it
        return y, h


def _all_rows(path):
    """Every row of every site (every phase; no scalars: step times differ) of a file: presence, counts, and
    min/max bits where observed."""
    h = trainhist.open(path)
    out = {}
    for s in h.sites:
        if s.stream == "scalar":
            continue
        sp = h.spine(s.path, s.stream, s.facet, phase="*")
        for i in range(len(sp.step)):
            row = (sp.presence_names[i],)
            if row[0] == "observed":
                row += tuple(int(getattr(sp, f)[i]) for f in ("count", "nan", "pinf", "ninf", "zero"))
                row += tuple(float(getattr(sp, f)[i]).hex() for f in ("min", "max"))
            out[(s.path, s.stream, s.facet, int(sp.step[i]), i)] = row
    return out


@pytest.mark.skipif("triton" not in CPU_METHODS, reason="Triton is not installed")
def test_batched_gpu_path_records_what_the_cpu_path_records(tmp_path, monkeypatch):
    """The GPU's batched path (``batch_outputs=True``: outputs and gradients held, then reduced in batched
    launches; here the Triton kernel in its interpreter, with batches of 3 so that they fill up mid-forward and
    mid-backward) writes the same rows as the CPU kernel, row for row (counts and min/max): a module called twice
    in a forward, an in-place ReLU after a Linear (found by discover(): reduced as soon as produced), two
    micro-batches, every stream."""
    import trainhist.torch.collector as cm
    import trainhist.torch.reduce as rd

    def train(path, method):
        if method is not None:
            monkeypatch.setattr(rd, "CPU_METHOD", method)
            monkeypatch.setattr(cm, "DEFER_TENSORS", 3)
        torch.manual_seed(0)
        model = Shared()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        col = Collector(model, path, every=1, sketch_every=2, batch_outputs=True)
        col.discover(torch.randn(4, 8))
        col.attach(optimizer=opt)
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            with col.step(step):
                for _ in range(2):
                    y, h = model(torch.randn(8, 8, generator=gen))
                    (y.square().mean() + h.mean()).backward()
                opt.step()
                opt.zero_grad()
        col.close()
        monkeypatch.undo()
        return col

    train(tmp_path / "cpu.thist", None)
    cpu = _all_rows(tmp_path / "cpu.thist")
    col = train(tmp_path / "gpu.thist", "triton")
    gpu = _all_rows(tmp_path / "gpu.thist")
    assert ("activation", "inp", None) in col._eager  # discover() saw the in-place ReLU rewrite it
    assert cpu.keys() == gpu.keys()
    assert {r[0] for r in gpu.values()} == {"observed"} and len(gpu) > 80
    assert cpu == gpu


@pytest.mark.skipif("triton" not in CPU_METHODS, reason="Triton is not installed")
def test_batched_gpu_path_fails_a_site_changed_in_place_after_discover_then_reduces_it_at_once(tmp_path,
                                                                                                monkeypatch):
    """An output changed in place after it was held (by code discover() did not see do it) cannot be read as it
    was: that step records 'failed' for the site, with a warning that says why, and from then on the site is
    reduced as soon as it is produced, correctly."""
    import trainhist.torch.reduce as rd

    monkeypatch.setattr(rd, "CPU_METHOD", "triton")
    torch.manual_seed(0)
    model = Shared()
    path = tmp_path / "s.thist"
    col = Collector(model, path, streams=("activation",), every=1, batch_outputs=True)
    col.discover(torch.randn(4, 8))
    model.late_inplace = True
    xs = [torch.randn(4, 8) for _ in range(2)]
    with pytest.warns(RuntimeWarning, match="changed in place"):
        for step, x in enumerate(xs):
            with col.step(step):
                with torch.no_grad():
                    model(x)
    col.close()
    h = trainhist.open(path)
    assert list(h.spine("head", "activation").presence_names) == ["failed", "observed"]
    with torch.no_grad():
        ref = model.head(model.block(torch.tanh(model.block(model.act(model.inp(xs[1]))))))
    assert_row(h, "head", "activation", 1, ref_summary([ref]), sketch=False)


@pytest.mark.skipif("triton" not in CPU_METHODS, reason="Triton is not installed")
def test_outputs_are_reduced_when_produced_unless_batching_is_asked_for(tmp_path, monkeypatch):
    """By default nothing is held (a write the version counter cannot see, by a custom kernel or a collective,
    would otherwise be recorded in place of the module's value); ``batch_outputs=True`` holds outputs and
    gradients for batched launches; after a failed batched launch nothing more is held."""
    import trainhist.torch.reduce as rd

    monkeypatch.setattr(rd, "CPU_METHOD", "triton")
    held = []
    for batch in (False, True):
        model = mlp()
        col = Collector(model, tmp_path / f"{batch}.thist", every=1, batch_outputs=batch)
        col.discover(torch.randn(2, 8))
        real = col._defer
        monkeypatch.setattr(col, "_defer", lambda key, t, real=real: (held.append((batch, key)), real(key, t)))
        with col.step(0):
            model(torch.randn(4, 8)).sum().backward()
        col.close()
    assert {b for b, _ in held} == {True} and len(held) > 5

    def broken(*a, **k):
        raise RuntimeError("no kernel image is available for execution on the device")

    import types

    monkeypatch.setitem(rd._TRITON, "module", types.SimpleNamespace(reduce_row=broken, reduce_many=broken))
    monkeypatch.setitem(rd._TRITON, "failed", False)
    model = mlp()
    col = Collector(model, tmp_path / "f.thist", every=1, batch_outputs=True)
    col.discover(torch.randn(2, 8))
    with pytest.warns(RuntimeWarning, match="GPU reduction failed"):
        with col.step(0):
            model(torch.randn(4, 8)).sum().backward()
            assert not col._deferred  # the failed flush at the forward's end: nothing held since
    col.close()
    h = trainhist.open(tmp_path / "f.thist")
    assert {s.stream for s in h.sites} >= {"activation", "activation_grad"}
    assert all(h.spine(s.path, s.stream, s.facet, phase="*").presence_names[0] == "observed" for s in h.sites
               if s.stream != "scalar")


@pytest.mark.skipif("triton" not in CPU_METHODS, reason="Triton is not installed")
def test_out_of_memory_in_a_batched_launch_fails_those_sites_and_training_goes_on(tmp_path, monkeypatch):
    """Out of memory in the batched kernel (parameters, gradients, updates) records those sites as 'failed' for
    the step, keeps the kernel on, and never reaches the training loop."""
    import trainhist.torch.reduce as rd
    import trainhist.torch.tritonkernel as tk

    monkeypatch.setattr(rd, "CPU_METHOD", "triton")
    monkeypatch.setitem(rd._TRITON, "failed", False)

    def oom(*a, **k):
        raise rd._OOM("CUDA out of memory")

    monkeypatch.setattr(tk, "reduce_many", oom)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, tmp_path / "o.thist", every=1)
    col.discover(torch.randn(2, 8))
    col.attach(optimizer=opt)
    with pytest.warns(RuntimeWarning, match="out of memory"):
        with col.step(0):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    col.close()
    assert not rd._TRITON["failed"]
    h = trainhist.open(tmp_path / "o.thist")
    got = {(s.stream, h.spine(s.path, s.stream, s.facet, phase="*").presence_names[0]) for s in h.sites
           if s.stream != "scalar"}
    assert got == {("activation", "observed"), ("activation_grad", "observed"), ("param", "failed"),
                   ("param_grad", "failed"), ("param_delta", "failed")}, got


def test_grad_norm_is_infinite_where_a_sum_of_squares_overflows(tmp_path):
    """A float64 gradient whose squares sum beyond the float64 range: its row's bound is unknown, and the global
    gradient norm is infinite, not the norm of the other gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    col = Collector(model, tmp_path / "g.thist", streams=("param_grad",), every=1, sketch_every=0)
    col.discover(torch.randn(2, 4, dtype=torch.float64))
    norms = []
    for step, scale in enumerate((1.0, 1e200)):
        with col.step(step):
            (model(torch.randn(2, 4, dtype=torch.float64)).sum() * scale).backward()
            norms.append(math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters())))
        model.zero_grad()
    with col.step(2):  # no gradient at all: no norm (not a norm of 0)
        pass
    col.close()
    assert math.isfinite(norms[0]) and norms[1] == math.inf  # (torch's float64 sum of squares overflows too)
    h = trainhist.open(tmp_path / "g.thist")
    gn = h.spine("grad_norm", "scalar")
    assert gn.step.tolist() == [0, 1]
    assert gn.max[0] == pytest.approx(norms[0], rel=1e-12)
    assert gn.pinf.tolist() == [0, 1]  # (a scalar that is not finite is counted as such)
    assert h.spine("weight", "param_grad").method.tolist()[:2] == [SumMethod.F64, SumMethod.UNKNOWN]


def test_global_norm_is_nan_once_any_gradient_holds_nan_in_any_order():
    from trainhist.torch.collector import _add_sumsq

    for order in ([(0, 1), (1, 0)], [(1, 0), (0, 1)]):  # (nan, inf) of two gradients, either way round
        total = 0.0
        for nan, inf in order:
            total = _add_sumsq(total, 4, nan, inf, 1.0)
        assert math.isnan(total)
    assert _add_sumsq(_add_sumsq(0.0, 4, 0, 1, 1.0), 4, 0, 0, 1.0) == math.inf
    assert _add_sumsq(_add_sumsq(0.0, 4, 0, 0, 1.5), 4, 0, 0, 2.0) == 3.5


def test_outputs_under_inference_mode_are_recorded(tmp_path):
    """An inference tensor has no version counter: it is reduced without the aliasing shortcut, not failed."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Identity())
    col = Collector(model, tmp_path / "i.thist", streams=("activation",), every=1, sketch_every=0)
    x = torch.randn(3, 4)
    col.discover(x)
    with torch.inference_mode(), col.step(0):
        y = model(x)
    col.close()
    h = trainhist.open(tmp_path / "i.thist")
    for site in ("0", "1", ROOT):
        assert presence(h, site, "activation", 0) == "observed", site
        assert h.spine(site, "activation").max.tolist() == [float(y.max())]


class _FlushProbe(torch.nn.Module):
    """Records the thread's flush mode when it runs (after the collector's hooks on the modules before it)."""

    def forward(self, x):
        from trainhist.torch.collector import _flush_mode

        self.mode = _flush_mode()
        return x * 1.0


def test_flush_denormal_is_kept_for_the_loop_and_off_for_the_reductions(tmp_path):
    """Under torch.set_flush_denormal(True) the rows hold the exact subnormal extremes and sums (as without it),
    and the loop's own arithmetic still flushes."""
    from trainhist.torch.collector import _flush_mode

    lin = torch.nn.Linear(4, 4, bias=False).double()
    model = torch.nn.Sequential(lin, _FlushProbe())
    w = torch.tensor([[3e-310, -5e-324, 1e-300, 2.5e-311]] * 4, dtype=torch.float64)
    x = torch.tensor([[1.0, 2.0, 0.0, -1.0]], dtype=torch.float64)
    col = Collector(model, tmp_path / "f.thist", streams=("param", "activation"), every=1, sketch_every=0)
    col.discover(x)
    torch.set_flush_denormal(True)
    try:
        assert _flush_mode() == (True, True)
        with torch.no_grad():
            lin.weight.copy_(w)  # (a copy keeps subnormals)
        with col.step(0):
            model(x)
            seen = model[1].mode
        after = _flush_mode()
    finally:
        torch.set_flush_denormal(False)
    col.close()
    assert seen == after == (True, True)
    h = trainhist.open(tmp_path / "f.thist")
    ref = summarize(w.numpy(), sketch=False)
    row = h.spine("0.weight", "param")
    assert (row.min[0], row.max[0]) == (ref.min, ref.max) == (-5e-324, 1e-300)
    for got, want, p in ((row.sum[0], ref.sum.to_float(), 1), (row.sumsq[0], ref.sumsq.to_float(), 2)):
        bound = SumMethod.bound(SumMethod.F64, 16, 1e-300, p)
        assert abs(got - want) <= bound + math.ulp(want) / 2, (p, got, want)
    assert abs(4e-300 - ref.sum.to_float()) > 1e3 * SumMethod.bound(SumMethod.F64, 16, 1e-300, 1)  # (flushed: out)


def test_flush_denormal_leaves_updates_norms_and_scalars_exact(tmp_path):
    """The rest of the collector's arithmetic under torch.set_flush_denormal(True): the update of a float64
    parameter (cast to float32 for param_delta) that did not change, the global gradient norm, tensor scalars
    (cast into the float64 ledger) and plain scalars written outside a step."""
    lin = torch.nn.Linear(4, 1, bias=False).double()
    col = Collector(lin, tmp_path / "s.thist", streams=("param_grad", "param_delta"), every={"param_grad": 0},
                    sketch_every=0)
    x = torch.full((1, 4), 1e-160, dtype=torch.float64)
    col.discover(x)
    tiny = torch.tensor(1e-40, dtype=torch.float32)  # (made before: flushing would make it 0)
    torch.set_flush_denormal(True)
    try:
        with torch.no_grad():
            lin.weight.fill_(1e-40)  # a float32 subnormal once cast
        with col.step(0):
            lin(x).sum().backward()  # gradients of 1e-160: a norm of 2e-160
            col.scalars(0, tiny=tiny)
        col.scalars(1, sub=5e-324)
    finally:
        torch.set_flush_denormal(False)
    col.close()
    h = trainhist.open(tmp_path / "s.thist")
    delta = h.spine("weight", "param_delta")
    assert (delta.zero.tolist(), delta.count.tolist()) == ([4], [4])  # no update: every difference is zero
    assert h.spine("grad_norm", "scalar").max.tolist() == [pytest.approx(2e-160, rel=1e-12)]
    row = h.spine("tiny", "scalar")
    assert (row.max.tolist(), row.zero.tolist()) == ([float(tiny)], [0]) and float(tiny) != 0
    sub = h.spine("sub", "scalar")
    assert (sub.max.tolist(), sub.zero.tolist(), sub.sum.tolist()) == ([5e-324], [0], [5e-324])


class _Shifting(torch.nn.Module):
    """A linear layer whose output is a tensor on some steps and a pair on others."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.pair = False

    def forward(self, x: torch.Tensor) -> object:
        y = self.lin(x)
        return (y, y * 2) if self.pair else y


def test_rows_follow_output_structure_and_clipping_that_change_between_steps(tmp_path):
    """Without discover(), the sites and phases a step writes change with the step: facets first seen at step 1
    get rows from then on (absent when they do not run) and an absent row at the step before (they read unknown
    there), and gradients are written in the phases of each step (pre_clip and post_clip only where the loop
    clipped)."""
    model = _Shifting()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "s.thist"
    col = Collector(model, path, streams=("activation", "param_grad"), every=1)
    col.attach(optimizer=opt)
    outs, grads = {}, {}
    for step in range(4):
        model.pair = step % 2 == 1
        with col.step(step):
            out = model(torch.randn(3, 4))
            outs[step] = [t.detach().clone() for t in (out if model.pair else (out,))]
            (sum(t.square().sum() for t in out) if model.pair else out.square().sum()).backward()
            grads[step] = {"pre": model.lin.weight.grad.clone()}
            if model.pair:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
                grads[step]["post"] = model.lin.weight.grad.clone()
            opt.step()
            opt.zero_grad()
    col.close()
    h = trainhist.open(path)
    sp = h.spine(ROOT, "activation", None)
    assert sp.step.tolist() == [0, 1, 2, 3] and sp.presence_names == ["observed", "absent"] * 2
    for step in (0, 2):
        assert_row(h, ROOT, "activation", step, ref_summary(outs[step]), sketch=False)
    for facet in ("0", "1"):
        sp = h.spine(ROOT, "activation", facet)
        assert sp.step.tolist() == [0, 1, 2, 3] and sp.presence_names == ["absent", "observed"] * 2
        for step in (1, 3):
            assert_row(h, ROOT, "activation", step, ref_summary([outs[step][int(facet)]]), facet=facet, sketch=False)
    assert h.spine("lin.weight", "param_grad", phase="default").step.tolist() == [0, 2]
    for phase, key in (("pre_clip", "pre"), ("post_clip", "post")):
        assert h.spine("lin.weight", "param_grad", phase=phase).step.tolist() == [1, 3]
        for step in (1, 3):
            assert_row(h, "lin.weight", "param_grad", step, ref_summary([grads[step][key]]), phase=phase,
                       sketch=False)
    for step in (0, 2):
        assert_row(h, "lin.weight", "param_grad", step, ref_summary([grads[step]["pre"]]), phase="default",
                   sketch=False)


# -- what a user review of the collector found (each failed before its fix) -------------------------------------


def test_lr_is_the_rate_the_update_used_even_when_the_scheduler_steps_inside(tmp_path):
    """The loop steps its scheduler inside the step: the recorded lr was the next step's."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    col = Collector(model, tmp_path / "lr.thist", streams=("param",))
    col.attach(optimizer=opt)
    for step in range(3):
        with col.step(step):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    col.close()
    np.testing.assert_allclose(trainhist.open(tmp_path / "lr.thist").spine("lr/group0", "scalar").max,
                               [0.1, 0.05, 0.025])


def test_clipping_is_seen_when_the_loop_imported_clip_grad_norm_itself(tmp_path):
    """`from torch.nn.utils import clip_grad_norm_` binds the function before the step patches its name: clipping
    went unseen (no pre/post-clip rows, the clipped norm recorded as the global one)."""
    from torch.nn.utils import clip_grad_norm_ as clip

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, tmp_path / "c.thist", streams=("param_grad",))
    col.attach(optimizer=opt)
    with col.step(0):
        (100 * model(torch.randn(4, 8))).square().mean().backward()
        pre = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = float(clip(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
    col.close()
    h = trainhist.open(tmp_path / "c.thist")
    assert h.step_truth_rows()[0]["clipped"] == "clipped" and norm > 1.0
    assert presence(h, "0.weight", "param_grad", 0, phase="pre_clip") == "observed"
    assert h.spine("0.weight", "param_grad", phase="pre_clip").max[0] == float(pre["0.weight"].max())
    assert h.spine("grad_norm", "scalar").max[0] == pytest.approx(norm, rel=1e-6)
    assert h.spine("grad_norm_post_clip", "scalar").max[0] == pytest.approx(1.0, rel=1e-5)


def test_clipping_some_parameters_leaves_the_others_rows_and_the_global_norm_true(tmp_path):
    """A clip of the first layer only: the other layers' gradients were recorded 'absent' and the subset's norm
    as the global one."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, tmp_path / "s.thist", streams=("param_grad",))
    col.attach(optimizer=opt)
    with col.step(0):
        (100 * model(torch.randn(4, 8))).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model[0].parameters(), 1.0)
        after = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    col.close()
    h = trainhist.open(tmp_path / "s.thist")
    assert presence(h, "0.weight", "param_grad", 0, phase="post_clip") == "observed"
    assert presence(h, "2.weight", "param_grad", 0, phase="default") == "observed"
    assert h.spine("2.weight", "param_grad", phase="default").max[0] == float(after[2].max())  # (2.weight)
    assert "grad_norm" not in {s.path for s in h.sites}
    want = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in after])))
    assert h.spine("grad_norm_post_clip", "scalar").max[0] == pytest.approx(want, rel=1e-6)


def test_a_second_collector_on_the_same_file_appends_a_segment(tmp_path):
    """A restarted job constructing its Collector on the same path truncated the history (mode 'w' by default)."""
    path = tmp_path / "r.thist"
    for start in (0, 5):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            col = Collector(model, path, streams=("param",))
            col.attach(optimizer=opt)
        assert any("appended" in str(w.message) for w in caught) == (start > 0)
        for step in range(start, start + 5):
            with col.step(step):
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        col.close()
    h = trainhist.open(path)
    assert h.spine("0.weight", "param").step.tolist() == list(range(10)) and len(h.segments) == 2
    col = Collector(mlp(), path, streams=("param",), mode="w")  # asked for: starts over
    col.attach()
    col.close()
    assert trainhist.open(path).verify()["rows"] == 0


def test_gradients_cleared_before_the_step_ends_with_no_optimizer_attached_are_unknown(tmp_path):
    """No attach(optimizer=): gradients are read at step exit, after the loop's zero_grad; they were recorded
    'absent' (did not run), silently."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, tmp_path / "u.thist", streams=("param_grad",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with col.step(0):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        col.close()
    assert any("attach(optimizer=opt)" in str(w.message) for w in caught)
    assert presence(trainhist.open(tmp_path / "u.thist"), "0.weight", "param_grad", 0) == "unknown"


def test_a_site_declares_the_dtype_it_recorded_not_the_one_seen_by_discover(tmp_path):
    """discover() in float32, training under CPU autocast: the file said float32 for bfloat16 values."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, tmp_path / "d.thist", streams=("activation",))
    col.discover(torch.randn(4, 8))
    col.attach(optimizer=opt)
    with col.step(0):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(4, 8)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    col.close()
    h = trainhist.open(tmp_path / "d.thist")
    assert h.site("0", "activation").dtype == "bfloat16" and h.site("1", "activation").dtype == "bfloat16"


def test_an_empty_selection_and_fractional_cadences_are_refused():
    with pytest.raises(trainhist.errors.UsageError, match="empty site selection"):
        Collector(mlp(), "unused.thist", sites=[])
    for bad in (1.5, "10", True):
        with pytest.raises(trainhist.errors.UsageError, match="whole number"):
            Collector(mlp(), "unused.thist", every=bad)
    with pytest.raises(trainhist.errors.UsageError, match="whole number"):
        Collector(mlp(), "unused.thist", sketch_every={"activation": 2.5})


def test_a_sparse_gradient_is_recorded_and_keeps_the_global_norm(tmp_path):
    """nn.Embedding(sparse=True): its gradient failed at every step (torch's 'copy_() between dense and sparse'),
    and with it the step's global gradient norm."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, tmp_path / "sp.thist", streams=("param_grad",))
    col.attach(optimizer=opt)
    with col.step(0):
        model(torch.tensor([1, 3, 3])).square().mean().backward()
        dense = model[0].weight.grad.to_dense()
        total = torch.linalg.vector_norm(torch.cat([dense.reshape(-1), model[1].weight.grad.reshape(-1),
                                                    model[1].bias.grad.reshape(-1)]))
        opt.step()
        opt.zero_grad()
    col.close()
    h = trainhist.open(tmp_path / "sp.thist")
    g = h.spine("0.weight", "param_grad")
    assert g.presence_names[0] == "observed" and g.count[0] == 40 and g.zero[0] == int((dense == 0).sum())
    assert g.min[0] == float(dense.min()) and g.max[0] == float(dense.max())
    assert h.spine("grad_norm", "scalar").max[0] == pytest.approx(float(total), rel=1e-6)


def test_a_module_discover_did_not_see_is_in_the_plan_with_its_size_unknown(tmp_path):
    """A branch not taken during discover() was left out of the plan (its cost unstated); containers that are
    never called themselves stay out. Its steps before its first run are absent (they read unknown: the module
    had no site yet), at the cadence's steps only; a new segment starts over."""

    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.main = torch.nn.Linear(4, 4)
            self.late = torch.nn.Linear(4, 4)
            self.later = torch.nn.Linear(4, 4)
            self.blocks = torch.nn.ModuleList([torch.nn.Tanh()])
            self.use_late = self.use_later = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.blocks[0](self.main(x))
            x = self.later(x) if self.use_later else x
            return self.late(x) if self.use_late else x

    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, tmp_path / "b.thist", streams=("activation", "activation_grad"), every=2)
    col.discover(torch.randn(2, 4))
    rows = {(s.path, s.facet, s.elements) for s in col.plan.sites}
    assert ("late", "?", None) in rows and not any(p == "blocks" for p, _, _ in rows)
    assert "late" in col.plan.format_table()
    col.attach(optimizer=opt)
    for step in [*range(12), 20, 21, 22]:  # (a gap, then a new segment at step 20)
        model.use_late, model.use_later = step in (10, 11, 22), step == 22
        with col.step(step, new_segment=step == 20):
            model(torch.randn(2, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if step == 3:
            col.commit()  # (the absent rows of committed steps are written later)
    col.close()
    h = trainhist.open(tmp_path / "b.thist")
    for stream in ("activation", "activation_grad"):
        sp = h.spine("late", stream)
        assert sp.step.tolist() == [0, 2, 4, 6, 8, 10, 20, 22], stream
        assert sp.presence_names == ["absent"] * 5 + ["observed", "absent", "observed"], stream
        assert sp.count.tolist() == [0] * 5 + [8, 0, 8] and sp.columns["segment"].tolist() == [0] * 6 + [1, 1]
        sp = h.spine("later", stream)  # (first seen in the new segment: absent at its earlier steps only)
        assert (sp.step.tolist(), sp.presence_names) == ([20, 22], ["absent", "observed"]), stream
    assert h.verify()["rows"] > 0 and h.recovery.status == "clean"


@pytest.mark.parametrize("discover", [True, False])
def test_triage_names_the_first_site_a_backward_nan_reached(tmp_path, discover):
    """A module whose backward yields a NaN (sqrt at 0) at step 2: the collector saw it first at that module's
    output gradient, and so must the triage (it named the last module backward reached: gradient sites were
    declared in backward order and the triage reversed them once more). Without discover() sites are declared as
    they are first seen, gradients in backward order: the triage ranks them by their module's forward site."""
    from trainhist.triage import triage

    class SqrtAt0(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(torch.relu(x) * 0)

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), SqrtAt0(),
                            torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    col = Collector(m, tmp_path / "bwd.thist")
    if discover:
        col.discover(torch.randn(3, 4))
    col.attach(optimizer=opt)
    for step in range(3):
        with col.step(step):
            x = m[0:3](torch.randn(3, 4))
            out = m[4](m[3](x)) if step == 2 else m[4](x)
            out.sum().backward()
            opt.step()
            opt.zero_grad()
    col.close()
    assert col.first_nonfinite[:3] == (2, "2", "activation_grad")
    h = trainhist.open(tmp_path / "bwd.thist")
    first = next(f for f in triage(h).findings if f.kind == "first_nonfinite")
    assert first.step == 2 and first.site == "2" and "backward" in first.text
    ids = {(s.path, s.stream): s.id for s in h.sites}
    if discover:  # the plan's order: each module's output, then its gradient, in forward order
        assert ids[("0", "activation")] < ids[("0", "activation_grad")] < ids[("2", "activation")]


# -- a second review: optimizers, interrupted steps, closing --------------------------------------------------


def _two_layer():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))


def test_one_scaler_two_optimizers_an_overflow_in_one_skips_only_its_parameters(tmp_path):
    """GradScaler.step skips only the optimizer whose gradients overflowed: the other one's update was recorded
    as skipped (the whole step was judged from the scale going down)."""
    m = _two_layer()
    oa, ob = torch.optim.SGD(m[0].parameters(), lr=0.1), torch.optim.SGD(m[1].parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    col = Collector(m, tmp_path / "s.thist", streams=("param_delta",))
    col.attach(optimizer=[oa, ob], scaler=scaler)
    for step in range(2):
        with col.step(step):
            scaler.scale(m(torch.randn(3, 4)).square().mean()).backward()
            if step == 1:
                m[0].weight.grad[0, 0] = math.inf  # only optimizer a sees the overflow
            b_before = m[1].weight.detach().clone()
            scaler.step(oa)
            scaler.step(ob)
            scaler.update()
            oa.zero_grad()
            ob.zero_grad()
        if step == 1:
            assert not torch.equal(m[1].weight, b_before)  # torch did update b
    col.close()
    h = trainhist.open(tmp_path / "s.thist")
    assert [r["applied"] for r in h.step_truth_rows()] == ["applied", "unknown"]
    assert presence(h, "0.weight", "param_delta", 1) == "skipped"
    assert presence(h, "1.weight", "param_delta", 1) == "observed"


def test_steps_without_an_optimizer_call_agree_with_and_without_a_scaler_and_fused_steps_are_applied(tmp_path):
    """Gradient accumulation with one col.step per micro-batch: the steps with no optimizer call were 'skipped'
    without a scaler and 'unknown' (with observed zero updates) with one; a fused optimizer's real steps were
    'unknown' without a scaler (it can only skip when given found_inf)."""
    for kind in ("plain", "scaler", "fused"):
        m = _two_layer()
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=kind == "fused")
        scaler = torch.amp.GradScaler("cpu") if kind == "scaler" else None
        col = Collector(m, tmp_path / f"{kind}.thist", streams=("param_delta",))
        col.attach(optimizer=opt, scaler=scaler)
        for step in range(4):
            with col.step(step):
                loss = m(torch.randn(3, 4)).square().mean()
                (scaler.scale(loss) if scaler else loss).backward()
                if step % 2 == 1:
                    if scaler:
                        scaler.step(opt)
                        scaler.update()
                    else:
                        opt.step()
                    opt.zero_grad()
        col.close()
        h = trainhist.open(tmp_path / f"{kind}.thist")
        assert [r["applied"] for r in h.step_truth_rows()] == ["skipped", "applied"] * 2, kind
        assert [presence(h, "0.weight", "param_delta", s) for s in range(2)] == ["skipped", "observed"], kind
        if kind == "plain":
            assert "applied no update" in triage(h).format()


def test_a_step_the_loop_aborts_is_recorded_as_interrupted_not_as_a_skipped_update(tmp_path):
    """An exception inside the step: it was written as an ordinary step (applied 'skipped', a half-finished
    backward's gradients as observed). close() inside a step lost the step and blamed a write failure; after
    close(), scalars() warned of a write failure and attach() installed hooks nothing could remove. The update of a
    step interrupted before its optimizer ran is unknown (it was an observed update of zeros)."""
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(m, tmp_path / "x.thist", streams=("activation", "param_grad", "param_delta"))
    col.attach(optimizer=opt)
    with col.step(0):
        m(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(ValueError):
        with col.step(1):
            m(torch.randn(4, 8)).square().mean().backward()
            raise ValueError("the loop's own error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no write failure is reported)
        with col.step(2):
            m(torch.randn(4, 8))
            col.close()  # an error handler closing inside the step
    with pytest.raises(trainhist.errors.UsageError, match="closed"):
        col.scalars(3, loss=1.0)
    with pytest.raises(trainhist.errors.UsageError, match="closed"):
        col.attach(optimizer=opt)
    h = trainhist.open(tmp_path / "x.thist")
    assert [r["applied"] for r in h.step_truth_rows()] == ["applied", "unknown", "unknown"]
    assert [presence(h, "0.weight", "param_grad", s) for s in range(3)] == ["observed", "unknown", "unknown"]
    assert [presence(h, "0.weight", "param_delta", s) for s in range(3)] == ["observed", "unknown", "unknown"]
    assert presence(h, "0", "activation", 2) == "observed"
    assert h.spine("step_interrupted", "scalar").step.tolist() == [1, 2]
    assert "2 steps were interrupted by an exception" in triage(h).format()


def test_an_output_without_a_gradient_gets_no_gradient_site(tmp_path):
    """A dict output with a bool mask and a detached tensor: both had activation_grad sites that were 'absent'
    (did not run) at every step, which the triage then reported, although the module ran."""

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> dict:
            y = self.lin(x)
            return {"y": y, "mask": y > 0, "ref": y.detach()}

    m = Masked()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(m, tmp_path / "g.thist", streams=("activation", "activation_grad"))
    col.discover(torch.randn(2, 4))
    assert {(s.facet, s.stream) for s in col.plan.sites if s.path == "(root)"} == {
        ("y", "activation"), ("y", "activation_grad"), ("mask", "activation"), ("ref", "activation")}
    col.attach(optimizer=opt)
    for step in range(2):
        with col.step(step):
            m(torch.randn(2, 4))["y"].sum().backward()
            opt.step()
            opt.zero_grad()
    col.close()
    h = trainhist.open(tmp_path / "g.thist")
    assert not any(s.stream == "activation_grad" and s.facet in ("mask", "ref") for s in h.sites)
    assert presence(h, "(root)", "activation_grad", 1, facet="y") == "observed"
    assert "did not run" not in triage(h).format()


def test_selecting_a_module_selects_the_parameter_it_shares(tmp_path):
    """A head tied to the embedding: sites=["head"] recorded no parameter (the shared weight is named after the
    embedding only), and said nothing."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x))

    col = Collector(Tied(), tmp_path / "t.thist", sites=["head"], streams=("activation", "param"))
    assert {(s.path, s.stream) for s in col.plan.sites} == {("head", "activation"), ("emb.weight", "param")}
    col.close()


def test_a_model_compiled_before_the_collector_is_said_not_silently_lost(tmp_path):
    """torch.compile keeps code compiled before the hooks existed: every module site was left out with no word.
    Now a warning says what to do (discover() sees nothing already), and the advice works."""
    for reset in (False, True):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        cm = torch.compile(m, backend="eager")
        cm(torch.randn(2, 4))  # a warm-up before the collector exists
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        path = tmp_path / f"c{reset}.thist"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            col = Collector(cm, path, streams=("activation",))
            col.discover(torch.randn(2, 4))
            col.attach(optimizer=opt)
            if reset:
                torch._dynamo.reset()
            with col.step(0):
                cm(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            col.close()
        said = any("torch._dynamo.reset()" in str(w.message) for w in caught)
        assert said  # (discover() ran the compiled code too: it saw no module)
        if reset:
            assert presence(trainhist.open(path), "0", "activation", 0) == "observed"
    torch._dynamo.reset()


def _as_rank_1_of_2(monkeypatch) -> torch.distributed.HashStore:
    """Make this process rank 1 of 2 with an in-process store for the run exchange (a short wait for rank 0)."""
    import trainhist.torch.collector as cm

    store = torch.distributed.HashStore()
    monkeypatch.setattr(cm, "_dist", lambda: (1, 2))
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(cm, "_run_keys", {})
    monkeypatch.setattr(cm, "RUN_ID_WAIT_S", 0.05)
    return store


def _one_step(col: Collector, model: torch.nn.Module) -> tuple[trainhist.History, list[str]]:
    """Attach, record one step of ``model``, close: the file (open) and the trainhist warnings said."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        col.attach()
    with col.step(0):
        model(torch.randn(2, 3))
    col.close()
    return trainhist.open(col.path), [str(w.message) for w in caught if "trainhist" in str(w.message)]


@pytest.mark.parametrize("published", [True, False])
def test_ranks_agree_on_the_run_id_through_the_store(tmp_path, monkeypatch, published):
    """A rank other than 0 records the run id rank 0 published in the process group's store (so merge sums the
    ranks); where none comes within the wait, it records its own and says how to merge or fix it."""
    store = _as_rank_1_of_2(monkeypatch)
    model = torch.nn.Linear(3, 2)
    col = Collector(model, tmp_path / "r.thist", mode="w")
    if published:  # (rank 0 resumed the run: it is at segment 3; this rank's file is new)
        store.set(f"trainhist/run/{col._pairing()}/0", json.dumps({
            "run_id": "ab" * 16, "segment": 3, "created": "2026-01-01T00:00:00+00:00", "name": "exp",
            "config": {"a": 1}}))
    h, said = _one_step(col, model)
    if published:  # its run and segment number, so that merge pairs it with rank 0's (spec 2.4)
        assert h.runs[0] == {"kind": "run", "run_id": "ab" * 16, "created": "2026-01-01T00:00:00+00:00", "name": "exp",
                             "config": {"a": 1}} and not said
        assert [(g.id, g.reason) for g in h.segments] == [(3, "start")]
    else:
        assert h.runs[0]["run_id"] != "ab" * 16
        assert len(said) == 1 and "could not agree" in said[0] and "run_id=" in said[0], said


@pytest.mark.parametrize("published", ["ab" * 16, "cd" * 16, None])
def test_a_run_id_given_to_every_rank_still_agrees_on_the_segment(tmp_path, monkeypatch, published):
    """With run_id= given, the ranks skipped the exchange: a rank whose file is new wrote segment 0 while rank 0
    resumed at segment 3, and merge paired the segments by number (silently wrong). It takes rank 0's segment
    (and run manifest). Ranks given a run id pair by it, not by path: a rank 0 given another id, or no word from
    rank 0, leaves the rank at its own segment, with a warning."""
    store = _as_rank_1_of_2(monkeypatch)
    model = torch.nn.Linear(3, 2)
    col = Collector(model, tmp_path / "mine_1.thist", mode="w", run_id="ab" * 16)  # (a path spelled per rank)
    lead = {"run_id": published, "segment": 3, "created": "2026-01-01T00:00:00+00:00", "name": "exp",
            "config": {"a": 1}}
    if published is not None:
        store.set(f"trainhist/run/id-{published}/0", json.dumps(lead))
    h, said = _one_step(col, model)
    assert h.runs[0]["run_id"] == "ab" * 16
    if published == "ab" * 16:  # rank 0's segment and run manifest: merge sums the ranks segment by segment
        assert h.runs[0] == {"kind": "run", **{k: lead[k] for k in ("run_id", "created", "name", "config")}}
        assert [(g.id, g.reason) for g in h.segments] == [(3, "start")] and not said
    else:  # rank 0 recorded another run, or none: this rank's own segment, and a warning naming its id
        assert h.runs[0]["name"] is None
        assert [(g.id, g.reason) for g in h.segments] == [(0, "start")]
        assert len(said) == 1 and "could not agree on the segment number" in said[0], said
        assert "no collector of run " + "ab" * 16 in said[0] and "same run_id=" in said[0], said


def test_rank_zero_publishes_its_run_id(tmp_path, monkeypatch):
    import trainhist.torch.collector as cm

    store = torch.distributed.HashStore()
    monkeypatch.setattr(cm, "_dist", lambda: (0, 2))
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(cm, "_run_keys", {})
    net = torch.nn.Linear(3, 2)
    # an evaluation's collector (to another file, the same recording) made on rank 0 alone does not shift the
    # training's pairing
    evaluation = Collector(net, tmp_path / "e.thist", mode="w").attach()
    col = Collector(net, tmp_path / "r.thist", mode="w", run_name="exp").attach()
    col.close()
    evaluation.close()
    h = trainhist.open(tmp_path / "r.rank0.thist")
    run = h.runs[0]
    assert json.loads(store.get(f"trainhist/run/{col._pairing()}/0")) == {
        "run_id": run["run_id"], "segment": 0, "created": run["created"], "name": "exp", "config": {}}


def test_ranks_pair_by_the_path_they_are_given(tmp_path, monkeypatch):
    """Ranks pair their collectors by the path as given: the same name on every rank (whatever digits it holds:
    reading a rank into 'gpt2.thist' split rank 2 off) or a {rank} template, with other settings too; a name each
    rank spells out itself pairs with no one (a wait and a warning), never with a wrong collector."""
    import trainhist.torch.collector as cm

    def keys(name: str, **kw) -> set:
        out = set()
        for rank in (0, 1, 2):
            monkeypatch.setattr(cm, "_dist", lambda rank=rank: (rank, 3))
            k = {key: v + rank for key, v in kw.items()}
            out.add(Collector(torch.nn.Linear(3, 2), tmp_path / name.format(r=rank), **k)._pairing())
        return out

    same = [keys("gpt2.thist"), keys("exp1.thist", every=1), keys("{{rank}}/run.thist"), keys("run.thist")]
    assert all(len(k) == 1 for k in same) and len({k.pop() for k in same}) == len(same)
    assert len(keys("run_{r}.thist")) == 3


def test_triage_of_merged_shards_names_the_module_where_the_nan_was_born(tmp_path):
    """A merge numbers sites by key, so '(root)' sorts first; the sites' ``order`` keeps the forward order, and the
    merged file's triage names the module whose output first held the NaN, as the rank's own file does."""
    paths = []
    for rank in (0, 1):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))
        at = {"step": -1}

        def inject(m, a, o, rank=rank, at=at):
            if rank == 1 and at["step"] == 2:
                o = o.clone()
                o[0, 3] = float("nan")
                return o

        model[1].register_forward_hook(inject)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        paths.append(tmp_path / f"r{rank}.thist")
        col = Collector(model, paths[-1], mode="w", rank=rank, world_size=2, run_id="ab" * 16)
        col.discover(torch.randn(3, 6))
        col.attach(optimizer=opt)
        for step in range(4):
            at["step"] = step
            with col.step(step):
                model(torch.randn(5, 6)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        col.close()
    trainhist.merge(paths, tmp_path / "m.thist")
    merged = trainhist.open(tmp_path / "m.thist")
    order = {s.path: s.order for s in merged.sites if s.stream == "activation"}
    assert sorted(order, key=order.get) == ["0", "1", "2", ROOT], order
    for h in (trainhist.open(paths[1]), merged):
        first = triage(h).first_nonfinite
        assert (first.step, first.site) == (2, "1"), first.text


def _sgd_recorded(make: type, path, example: torch.Tensor) -> tuple:
    """A seeded model, its SGD optimizer and a collector that discovered it on ``example`` and attached."""
    torch.manual_seed(0)
    m = make()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(m, path, mode="w")
    col.discover(example)
    col.attach(optimizer=opt)
    return m, opt, col


def test_a_forward_under_inference_mode_inside_a_step_breaks_nothing(tmp_path):
    """A forward under torch.inference_mode() (an evaluation or a rollout inside the step) that allocates ledger
    rows must not leave the ledger an inference tensor, which later steps could not write: every step records,
    nothing fails, no warning."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.head = torch.nn.Sequential(*[torch.nn.Tanh() for _ in range(64)])  # (runs only in eval mode)

        def forward(self, x):
            y = self.fc(x)
            return y if self.training else self.head(y)

    m, opt, col = _sgd_recorded(M, tmp_path / "r.thist", torch.randn(2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            with col.step(step):
                with torch.inference_mode():  # a rollout before the update
                    m(torch.randn(2, 8))
                m(torch.randn(2, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if step == 1:  # an evaluation that runs 64 modules more: the ledger grows inside inference mode
                    m.eval()
                    with torch.inference_mode():
                        m(torch.randn(2, 8))
                    m.train()
    col.close()
    assert not [str(w.message) for w in caught if "trainhist" in str(w.message)]
    h = trainhist.open(tmp_path / "r.thist")
    for stream in ("activation", "activation_grad", "param_grad"):
        path = "fc" if stream.startswith("activation") else "fc.weight"
        assert {presence(h, path, stream, step) for step in range(4)} == {"observed"}, stream
    assert presence(h, "head.3", "activation", 1) == "observed"


def test_a_parameter_returned_by_a_module_gets_one_gradient_hook_per_step(tmp_path):
    """A module that returns a leaf tensor (a parameter through Dropout(0.0)): its gradient hook would stay on the
    parameter for good, so every later step would add one more and count the gradient again; it is removed when
    the step ends, and the row counts the parameter once."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.query = torch.nn.Parameter(torch.randn(4, 8))
            self.drop = torch.nn.Dropout(0.0)
            self.fc = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.fc(x + self.drop(self.query)).mean()

    m, opt, col = _sgd_recorded(M, tmp_path / "r.thist", torch.randn(4, 8))
    grads = []
    for step in range(4):
        with col.step(step):
            m(torch.randn(4, 8)).backward()
            grads.append(m.query.grad.clone())
            opt.step()
            opt.zero_grad()
        assert not m.query._backward_hooks, step
    col.close()
    h = trainhist.open(tmp_path / "r.thist")
    for step in range(4):
        assert_row(h, "drop", "activation_grad", step, ref_summary([grads[step]]), sketch=step == 0)


def test_a_closure_optimizer_records_the_gradients_its_closure_computed(tmp_path):
    """optimizer.step(closure) (LBFGS) computes the gradients inside the step: read before it, they were the
    previous step's (or absent at step 0); they are read after it, the closure's last evaluation."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    opt = torch.optim.LBFGS(net.parameters(), max_iter=3)
    col = Collector(net, tmp_path / "r.thist", mode="w", sketch_every=1)
    col.attach(optimizer=opt)
    xs = [torch.randn(6, 4) for _ in range(3)]
    last = []
    for step in range(3):
        with col.step(step):
            def closure(x=xs[step]):
                opt.zero_grad()
                loss = net(x).square().mean()
                loss.backward()
                return loss

            opt.step(closure)
            last.append(net[0].weight.grad.clone())
    col.close()
    h = trainhist.open(tmp_path / "r.thist")
    for step in range(3):
        assert_row(h, "0.weight", "param_grad", step, ref_summary([last[step]]))


@pytest.mark.parametrize("when", ["before", "after", "in_place"])
def test_a_compiled_model_runs_the_hooks_without_tracing_them(tmp_path, caplog, when):
    """The hooks of a compiled model are called by the compiled code, not traced into it, whether the model was
    compiled before the collector was made or after it attached (torch.compile(m), m.compile()): traced, they were
    recompiled at every step (their guards hold memory addresses) until torch's recompile limit warned, naming
    trainhist's internals. The rows are the module's outputs."""
    import logging

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    cm = torch.compile(m, backend="eager") if when == "before" else m
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(cm, tmp_path / "c.thist", mode="w", sketch_every=1)
    col.discover(torch.randn(2, 16))
    col.attach(optimizer=opt)
    if when == "after":
        cm = torch.compile(m, backend="eager")
    elif when == "in_place":
        m.compile(backend="eager")
    outs = []
    with caplog.at_level(logging.WARNING):
        for step in range(12):
            x = torch.randn(2, 16)
            with torch.no_grad():  # (module 0's output: its own operation, not a call of the hooked module)
                outs.append(torch.nn.functional.linear(x, m[0].weight, m[0].bias))
            with col.step(step):
                cm(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    col.close()
    torch._dynamo.reset()
    assert not [r.getMessage() for r in caplog.records if "recompile" in r.getMessage()]
    h = trainhist.open(tmp_path / "c.thist")
    for step in range(12):
        assert_row(h, "0", "activation", step, ref_summary([outs[step]]))


def test_gradients_are_read_before_an_optimizer_that_changes_them_in_place(tmp_path):
    """An optimizer step without a closure has its gradients read before it runs: SGD with Nesterov momentum (the
    foreach implementation) adds the momentum into ``p.grad`` in place, so a read after the step records a
    different tensor. (The closure check once took the optimizer itself, which torch passes to step hooks, for a
    closure, and read every optimizer's gradients after its step.)"""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True, foreach=True)
    col = Collector(net, tmp_path / "r.thist", mode="w", sketch_every=1)
    col.attach(optimizer=opt)
    before = []
    for step in range(3):
        with col.step(step):
            net(torch.randn(5, 4)).square().mean().backward()
            before.append(net.weight.grad.clone())
            opt.step()
            opt.zero_grad()
    col.close()
    h = trainhist.open(tmp_path / "r.thist")
    for step in range(3):
        assert_row(h, "weight", "param_grad", step, ref_summary([before[step]]))


def test_step_truth_takes_a_tensor_or_a_name_for_applied(tmp_path):
    """StepTruth(applied=found_inf == 0) (a 0-dim bool tensor) and StepTruth(applied="skipped") both say what the
    loop attests: a skipped step records its update as skipped, never as an observed update, and the step truth
    row is written (a refused value used to lose every step-truth row behind one write warning)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    col = Collector(net, tmp_path / "r.thist", mode="w")
    col.attach(optimizer=opt)
    truths = [StepTruth(applied=torch.tensor(0.0) == 0, tokens=torch.tensor(32)), StepTruth(applied="skipped"),
              StepTruth(applied=torch.tensor(1.0) == 0)]
    for step, truth in enumerate(truths):
        with col.step(step, truth=truth):
            net(torch.randn(4, 3)).sum().backward()
            if truth.applied:
                opt.step()
            opt.zero_grad()
    col.close()
    assert col.writer_errors == 0
    h = trainhist.open(tmp_path / "r.thist")
    assert [r["applied"] for r in h.step_truth_rows()] == ["applied", "skipped", "skipped"]
    assert h.step_truth_rows()[0]["tokens"] == 32
    assert [presence(h, "weight", "param_delta", s) for s in range(3)] == ["observed", "skipped", "skipped"]
    with pytest.raises(trainhist.errors.UsageError):
        StepTruth(applied="yes")


def test_a_module_first_run_after_discover_keeps_its_place_in_the_forward(tmp_path):
    """An expert first routed to at step 2 runs between modules 'a' and 'b': its ``order`` falls between theirs
    (it came after '(root)'), so a NaN born in it is named, not the modules downstream of it."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.expert, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
            self.route = False

        def forward(self, x):
            x = self.a(x)
            if self.route:
                x = self.expert(x)
            return self.b(x)

    torch.manual_seed(0)
    m = M()
    col = Collector(m, tmp_path / "r.thist", mode="w")
    col.discover(torch.randn(2, 4))
    col.attach()
    m.expert.register_forward_hook(lambda mod, a, o: o.masked_fill(o > 0, float("nan")) if step == 3 else None)
    for step in range(5):
        m.route = step >= 2
        with col.step(step):
            m(torch.randn(2, 4)).sum().backward()
    col.close()
    h = trainhist.open(tmp_path / "r.thist")
    order = {s.path: s.order for s in h.sites if s.stream == "activation"}
    assert order["a"] < order["expert"] < order["b"] < order[ROOT], order
    first = triage(h).first_nonfinite
    assert (first.step, first.site) == (3, "expert"), first.text


@pytest.mark.parametrize("how", ["assign", "dtype"])
def test_parameters_replaced_after_the_collector_was_made_are_said(tmp_path, how):
    """A model whose parameters are replaced after the collector was made by tensors of another kind (here of
    another dtype; fully_shard's DTensors) would have its parameter sites record the old tensors, unchanged at every
    step: a warning says so and what to do. Replaced by tensors of the same shape, dtype and device
    (load_state_dict(assign=True)), they are followed: one warning says that, none that they are lost."""
    net = torch.nn.Linear(3, 2)
    col = Collector(net, tmp_path / "r.thist", mode="w")
    if how == "assign":
        net.load_state_dict({k: v.clone() for k, v in net.state_dict().items()}, assign=True)
    else:
        net.weight = torch.nn.Parameter(net.weight.detach().double())
        net.bias = torch.nn.Parameter(net.bias.detach().double())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        col.attach()
        with col.step(0):
            net(torch.randn(2, 3, dtype=net.weight.dtype)).sum().backward()
    col.close()
    lost = [str(w.message) for w in caught if "parameters were replaced" in str(w.message)]
    followed = [str(w.message) for w in caught if "record the new ones" in str(w.message)]
    if how == "assign":
        assert not lost and len(followed) == 1
        h = trainhist.open(tmp_path / "r.thist")
        assert h.spine("weight", "param").max[0] == net.weight.max().item()
    else:
        assert len(lost) == 1 and "make the Collector after" in lost[0] and not followed


def test_late_modules_take_their_place_before_the_first_module_and_between_two(tmp_path):
    """A module first seen in a later step that completes first in its forward goes before the known ones (it went
    after '(root)'), and 1100 modules first seen between two all fall between them, in the order they ran."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
            self.experts = torch.nn.ModuleList([torch.nn.Identity() for _ in range(1100)])
            self.b = torch.nn.Linear(2, 1)
            self.late = False

        def forward(self, x):
            x = self.first[1 if self.late else 0](x)
            if self.late:
                for e in self.experts:
                    x = e(x)
            return self.b(x)

    m = M()
    col = Collector(m, tmp_path / "r.thist", mode="w", streams=("activation",))
    col.discover(torch.randn(2, 2))
    col.attach()
    for step in range(2):
        m.late = step == 1
        with col.step(step):
            m(torch.randn(2, 2))
    col.close()
    order = {s.path: s.order for s in trainhist.open(tmp_path / "r.thist").sites if s.stream == "activation"}
    assert order["first.1"] < order["b"] < order[ROOT] and order["first.0"] < order["b"]
    assert order["first.1"] < order["first.0"]  # (in its forward it came first of all)
    assert all(order["first.1"] < order[f"experts.{i}"] < order["b"] for i in range(1100))
    assert [order[f"experts.{i}"] for i in range(1100)] == sorted(order[f"experts.{i}"] for i in range(1100))


def test_a_run_id_that_is_not_32_hex_digits_is_refused_when_the_collector_is_made():
    """run_id='r' * 32 passed the Collector and raised a SchemaError at attach(), inside the training loop."""
    with pytest.raises(trainhist.errors.UsageError):
        Collector(torch.nn.Linear(2, 2), "unused.thist", run_id="r" * 32)


def test_several_late_modules_keep_the_order_they_ran_in(tmp_path):
    """Forwards 'a b', 'x y a b', 'a x2 b', 'a z x2 b': modules first seen later are placed between the modules
    that ran around them, in the order they ran (y was put after a, z after x2)."""
    seqs = [["a", "b"], ["x", "y", "a", "b"], ["a", "x2", "b"], ["a", "z", "x2", "b"]]

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mods = torch.nn.ModuleDict({n: torch.nn.Identity() for n in ("a", "b", "x", "y", "x2", "z")})
            self.seq = seqs[0]

        def forward(self, t):
            for n in self.seq:
                t = self.mods[n](t)
            return t

    m = M()
    col = Collector(m, tmp_path / "r.thist", mode="w", streams=("activation",))
    col.attach()
    for step, seq in enumerate(seqs):
        m.seq = seq
        with col.step(step):
            m(torch.randn(2))
    col.close()
    order = {s.path: s.order for s in trainhist.open(tmp_path / "r.thist").sites if s.stream == "activation"}
    assert order["mods.x"] < order["mods.y"] < order["mods.a"] < order["mods.z"] < order["mods.x2"] < order["mods.b"]


def test_fsdp1_clip_is_patched_on_the_class_during_a_step_only(tmp_path):
    """FSDP1's own clip_grad_norm_ is wrapped on its class while a step runs, not on the instance: the model can be
    deep-copied inside the step (a wrapper stored on the instance held the collector, which cannot be copied),
    another model's unit calls the original, and the class has its own method again after the step."""
    import copy

    class FullyShardedDataParallel(torch.nn.Module):  # (a stand-in with FSDP1's name and clip signature)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

        def clip_grad_norm_(self, max_norm, norm_type=2.0):
            return torch.nn.utils.get_total_norm([p.grad for p in self.parameters()], norm_type)

    original = FullyShardedDataParallel.clip_grad_norm_
    model, other = FullyShardedDataParallel(torch.nn.Linear(3, 2)), FullyShardedDataParallel(torch.nn.Linear(3, 2))
    col = Collector(model, tmp_path / "c.thist", mode="w").attach()
    with col.step(0):
        model(torch.ones(4, 3)).sum().backward()
        other(torch.ones(4, 3)).sum().backward()
        assert FullyShardedDataParallel.clip_grad_norm_ is not original
        norm = model.clip_grad_norm_(1e9)
        assert float(other.clip_grad_norm_(1e9)) > 0  # (not this collector's model: the original, unrecorded)
        copy.deepcopy(model)
    assert FullyShardedDataParallel.clip_grad_norm_ is original and "clip_grad_norm_" not in vars(model)
    col.close()
    h = trainhist.open(tmp_path / "c.thist")
    assert float(h.spine("grad_norm", "scalar").max[0]) == float(norm)
    assert h.spine("inner.weight", "param_grad", phase="pre_clip").columns["count"].tolist() == [6]


def test_gradients_reaching_an_earlier_steps_output_are_left_out(tmp_path):
    """A graph kept across steps (backpropagation through time, no detach): the output hooks of earlier steps fired
    again in later steps, so a step's activation_grad rows held the gradients of every earlier step's outputs too
    (counts 8, 16, 24). A step now records only the gradients reaching its own outputs, and a warning says so."""
    torch.manual_seed(0)
    cell = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    path = tmp_path / "bptt.thist"
    col = Collector(cell, path, streams=("activation", "activation_grad"))
    col.discover(torch.randn(2, 4))
    col.attach()
    spy = Spy({"0": cell[0]})
    h0 = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            spy.step = step
            with col.step(step):
                h1 = cell(h0)
                h1.sum().backward(retain_graph=True)
            h0 = h1
    col.close()
    assert any("after that step ended" in str(w.message) for w in caught)
    h = trainhist.open(path)
    assert h.spine("0", "activation_grad").count.tolist() == [8, 8, 8]
    for step in range(3):  # (the spy's first gradient of the step's own output)
        assert_row(h, "0", "activation_grad", step, ref_summary(spy.grads[(step, "0", None)][:1]), sketch=False)


def test_several_backward_passes_through_one_output_are_each_recorded_and_said(tmp_path):
    """Two backward passes through one forward (retain_graph): the step's row of an output's gradient combines both
    passes' gradients (counts add, as spec 2.2 says), and a warning says that it is not their sum."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    path = tmp_path / "passes.thist"
    col = Collector(m, path, streams=("activation_grad",))
    col.discover(torch.randn(3, 4))
    col.attach()
    spy = Spy({"0": m[0]})
    spy.step = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with col.step(0):
            out = m(torch.randn(3, 4))
            out[:, 0].sum().backward(retain_graph=True)
            out[:, 1].square().sum().backward()
    col.close()
    assert any("several backward passes" in str(w.message) for w in caught)
    h = trainhist.open(path)
    assert len(spy.grads[(0, "0", None)]) == 2
    assert_row(h, "0", "activation_grad", 0, ref_summary(spy.grads[(0, "0", None)]), sketch=False)


def test_a_parameter_first_trained_after_the_plan_gets_its_sample_and_shape(tmp_path):
    """A weight frozen when the plan was made has no gradient or update site; unfrozen later (staged fine-tuning),
    its sites were made with an output's defaults: no sample although its update rows held 4096 of 6400 elements,
    no shape, and the sharing of a module output (under DDP 'shard' for a replica, so merge doubled its counts).
    They are now made as the plan's are."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(80, 80), torch.nn.Linear(80, 4))
    m[0].weight.requires_grad_(False)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    path = tmp_path / "unfreeze.thist"
    col = Collector(m, path, replicas=["0"])
    col.discover(torch.randn(2, 80))
    assert col.plan.find("0.weight", "param_delta", None) is None
    col.attach(optimizer=opt)
    before, after = {}, {}
    for step in range(3):
        if step == 1:
            m[0].weight.requires_grad_(True)
        before[step] = m[0].weight.detach().clone()
        with col.step(step):
            m(torch.randn(2, 80)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        after[step] = m[0].weight.detach().clone()
    col.close()
    h = trainhist.open(path)
    for stream in ("param_grad", "param_delta"):
        site = h.site("0.weight", stream)
        assert (site.shape, site.sharing) == ((80, 80), "replica"), stream
    assert h.site("0.weight", "param_delta").sample == {"elements": 4096, "of": 6400, "seed": 0}
    idx = sample_indices("0.weight", 6400, 4096, 0)
    for step in (1, 2):
        delta = (after[step] - before[step]).reshape(-1)[torch.from_numpy(idx)]
        assert_row(h, "0.weight", "param_delta", step, ref_summary([delta]), sketch=False)


def test_a_float64_parameters_update_is_subtracted_before_it_is_rounded(tmp_path):
    """A float64 parameter's update was taken as the difference of its float32-rounded values: updates of 1e-9 on
    weights near 1 read as exact zeros (15 of 16) or as float32 steps of 1.2e-7. It is now subtracted in float64
    and rounded to float32 after."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4, bias=False).double()
    with torch.no_grad():
        m.weight.fill_(1.0).add_(torch.rand(4, 4, dtype=torch.float64) * 1e-3)
    opt = torch.optim.SGD(m.parameters(), lr=1e-9)
    path = tmp_path / "f64.thist"
    col = Collector(m, path, streams=("param_delta",))
    col.attach(optimizer=opt)
    before = m.weight.detach().clone()
    with col.step(0):
        m(torch.randn(3, 4, dtype=torch.float64)).square().sum().backward()
        opt.step()
    col.close()
    delta = (m.weight.detach() - before).to(torch.float32)
    assert int((delta == 0).sum()) == 0
    assert_row(trainhist.open(path), "weight", "param_delta", 0, ref_summary([delta]), sketch=False)


def test_modules_and_parameters_added_after_the_collector_are_said(tmp_path):
    """A head added to the model after the Collector was made is not recorded, and the global gradient norm left
    its gradient out, silently. A warning now names them (at the first step, at every commit)."""
    m = mlp()
    col = Collector(m, tmp_path / "added.thist", streams=("param_grad",))
    col.attach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with col.step(0):
            m(torch.randn(4, 8)).square().mean().backward()
        col.commit()
    assert not any("added to the model" in str(w.message) for w in caught)
    m.add_module("head", torch.nn.Linear(2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        col.commit()
    col.close()
    (w,) = [w for w in caught if "added to the model" in str(w.message)]
    assert "head, head.bias, head.weight" in str(w.message)


class _WrappedOptimizer:
    """The shape of accelerate's AcceleratedOptimizer: no Optimizer base, the torch optimizer as ``.optimizer``."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.optimizer = opt

    def step(self, *args, **kwargs):
        return self.optimizer.step(*args, **kwargs)

    def zero_grad(self, *args, **kwargs):
        return self.optimizer.zero_grad(*args, **kwargs)


def test_a_wrapped_optimizer_is_watched_through_its_inner_optimizer(tmp_path):
    """attach(optimizer=wrapper) raised a bare AttributeError (register_step_pre_hook) after it had opened the file
    and hooked the model. A wrapper holding the optimizer as ``.optimizer`` is now watched through it (its steps are
    seen: applied, updates measured); anything else is a UsageError before any side effect; discover() after
    close() is refused like the other calls."""
    m = mlp()
    opt = _WrappedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    path = tmp_path / "w.thist"
    col = Collector(m, path, streams=("param_delta",))
    with pytest.raises(trainhist.errors.UsageError, match="takes torch.optim.Optimizer") as e:
        col.attach(optimizer=object())
    assert e.value.code == "bad_optimizer" and not path.exists() and not col._fwd_handles
    col.attach(optimizer=opt)
    before = m[0].weight.detach().clone()
    with col.step(0):
        m(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    col.close()
    with pytest.raises(trainhist.errors.UsageError, match="closed"):
        col.discover(torch.randn(4, 8))
    h = trainhist.open(path)
    assert h.step_truth_rows()[0]["applied"] == "applied"
    assert presence(h, "0.weight", "param_delta", 0) == "observed"
    assert float(h.spine("0.weight", "param_delta").max[0]) == float((m[0].weight - before).max())


def test_a_step_number_entered_again_starts_a_new_segment(tmp_path):
    """A loop that wraps each micro-batch in its own col.step(0) (or rolls back to an earlier step) wrote two
    step-truth rows and duplicate rows of one identity for step 0, and step 0 then read 'skipped' although its
    update was applied. A step not after the last one now starts a new segment, with a warning."""
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    path = tmp_path / "again.thist"
    col = Collector(m, path, streams=("activation", "param_delta"))
    col.attach(optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, last in ((0, False), (0, True), (1, True)):
            with col.step(step):
                m(torch.randn(4, 8)).square().mean().backward()
                if last:
                    opt.step()
                    opt.zero_grad()
    col.close()
    assert sum("entered after step 0" in str(w.message) for w in caught) == 1
    h = trainhist.open(path)
    assert [(g.id, g.first_step, g.reason) for g in h.segments] == [(0, 0, "start"), (1, 0, "resume")]
    assert [(r["segment"], r["step"], r["applied"]) for r in h.step_truth_rows()] == [
        (0, 0, "skipped"), (1, 0, "applied"), (1, 1, "applied")]
    sp = h.spine("0.weight", "param_delta")
    assert list(zip(sp.columns["segment"].tolist(), sp.step.tolist(), sp.presence_names)) == [
        (0, 0, "skipped"), (1, 0, "observed"), (1, 1, "observed")]


def test_int64_outputs_beyond_2_53_are_failed_not_rounded(tmp_path):
    """An int64 output holding 2^53 + 1 was recorded with max 2^53 (rounded on its way to float64), silently; the
    writer refuses such values. Such a row is now 'failed', with a warning; smaller integers are recorded exactly."""

    class Ints(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict:
            big = torch.tensor([1, 2**53 + 1, -5], dtype=torch.int64) if x.sum() > 0 else torch.tensor([1, -5])
            return {"big": big, "small": torch.tensor([3, -7], dtype=torch.int64)}

    path = tmp_path / "ints.thist"
    col = Collector(Ints(), path, streams=("activation",))
    col.attach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, sign in ((0, 1.0), (1, -1.0)):
            with col.step(step):
                col.model(torch.full((2,), sign))
    col.close()
    assert any("2^53 or more" in str(w.message) for w in caught)
    h = trainhist.open(path)
    assert h.spine(ROOT, "activation", "big").presence_names == ["failed", "observed"]
    assert h.spine(ROOT, "activation", "big").max.tolist()[1] == 1.0
    assert h.spine(ROOT, "activation", "small").max.tolist() == [3.0, 3.0]


def test_a_module_selected_by_another_of_its_names_records_its_outputs(tmp_path):
    """One block registered as ``enc`` and ``dec``: ``sites=["dec"]`` recorded its parameters (under ``enc``) but
    not its outputs, silently. The module is now selected under its first name, as a shared parameter is."""

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            blk = torch.nn.Linear(3, 3)
            self.enc, self.dec = blk, blk

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dec(self.enc(x))

    col = Collector(M(), tmp_path / "alias.thist", sites=["dec"], streams=("activation", "param"))
    assert {(s.path, s.stream) for s in col.plan.sites} == {("enc", "activation"), ("enc.weight", "param"),
                                                             ("enc.bias", "param")}
    col.close()


def test_an_empty_output_at_a_sketch_step_has_an_empty_sketch(tmp_path):
    """An output of no elements at a step whose sketches are due had no sketch (read as a missing one); it now has
    the empty sketch, as the spec says an empty sketch is not a missing one."""

    class Empty(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:0]

    path = tmp_path / "empty.thist"
    col = Collector(Empty(), path, streams=("activation",), sketch_every=2)
    col.attach()
    for step in range(2):
        with col.step(step):
            col.model(torch.randn(3))
    col.close()
    h = trainhist.open(path)
    sp = h.spine(ROOT, "activation")
    assert sp.presence_names == ["observed", "observed"] and sp.count.tolist() == [0, 0]
    assert sp.columns["sk_row"].tolist()[0] >= 0 and sp.columns["sk_row"].tolist()[1] < 0
    sk = h.sketch(ROOT, "activation").sketch(int(sp.columns["sk_row"][0]))
    assert int(sk.pos.sum() + sk.neg.sum()) == 0


def test_learning_rate_names_do_not_change_when_an_optimizer_is_attached_later(tmp_path):
    """Attaching a second optimizer mid-run renamed the first one's rates from lr/group0 to lr/opt0.group0, which
    split its series in two. The first optimizer's rates keep lr/group<g>; the later ones' are lr/opt<k>.group<g>."""
    m = mlp()
    first = torch.optim.SGD(m[0].parameters(), lr=0.1)
    second = torch.optim.SGD(m[2].parameters(), lr=0.01)
    path = tmp_path / "lrs.thist"
    col = Collector(m, path, streams=())
    col.attach(optimizer=first)
    for step in range(2):
        if step == 1:
            col.attach(optimizer=second)
        with col.step(step):
            m(torch.randn(4, 8)).square().mean().backward()
            first.step()
            second.step()
    col.close()
    h = trainhist.open(path)
    assert h.spine("lr/group0", "scalar").step.tolist() == [0, 1]
    assert h.spine("lr/group0", "scalar").max.tolist() == [0.1, 0.1]
    assert h.spine("lr/opt1.group0", "scalar").max.tolist() == [0.01]
    assert not any(s.path.startswith("lr/opt0") for s in h.sites)


def test_a_run_with_a_collector_trains_exactly_as_the_same_run_without_one(tmp_path):
    """discover()'s forward drew dropout masks from the global generator and moved BatchNorm's running statistics
    once, so the recorded run's dropout masks, weights and statistics differed from the same run's without the
    collector. The probe now leaves the random state and the buffers as they were: the two runs are bit-identical."""
    def run(record: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                    torch.nn.Dropout(0.5), torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = [torch.randn(8, 6) for _ in range(3)]
        col = None
        if record:
            col = Collector(model, tmp_path / "probe.thist", mode="w")
            col.discover(data[0])
            col.attach(optimizer=opt)
        for step, x in enumerate(data):
            with col.step(step) if col else contextlib.nullcontext():
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        if col:
            col.close()
        return {k: v.clone() for k, v in model.state_dict().items()}

    plain, recorded = run(False), run(True)
    assert plain.keys() == recorded.keys()
    for k in plain:
        assert torch.equal(plain[k], recorded[k]), k
    with trainhist.open(tmp_path / "probe.thist") as h:  # (and it did record)
        assert h.spine("3", "activation").count.tolist() == [128, 128, 128]


def test_data_parallel_is_unwrapped_on_one_device_and_refused_over_several(tmp_path):
    """nn.DataParallel was not unwrapped: names took a 'module.' prefix and sites=["0"] matched nothing. On one device
    (or the CPU) it is a plain wrapper and is unwrapped; over several it runs module copies in threads: refused."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    dp = torch.nn.DataParallel(net)
    col = Collector(dp, tmp_path / "dp.thist", sites=["0"], mode="w")
    x = torch.randn(5, 4)
    col.discover(x)
    col.attach()
    with col.step(0):
        out = dp(x)
    col.close()
    with trainhist.open(tmp_path / "dp.thist") as h:
        assert {(s.path, s.stream) for s in h.sites} >= {("0", "activation"), ("0.weight", "param")}
        assert not any(s.path.startswith("module") for s in h.sites)
        row = h.spine("0", "activation")
        ref = net[0](x).detach()
        assert row.count.tolist() == [ref.numel()] and row.max.tolist() == [float(ref.max())]
    assert out.shape == (5, 3)
    class Mine(torch.nn.DataParallel):  # (a subclass is unwrapped too)
        pass

    assert Collector(Mine(net), tmp_path / "dp3.thist", sites=["0"]).inner is net
    dp.device_ids = [0, 1]  # (as over two GPUs)
    with pytest.raises(trainhist.errors.UsageError, match="DistributedDataParallel"):
        Collector(dp, tmp_path / "dp2.thist")


class _Buffered(torch.nn.Module):
    """A buffer saved for backward (``scale``), an output viewing a buffer (``pos``), an inference-mode buffer, and
    a cache the forward replaces with one for a longer input (as dynamic rotary embeddings do) with an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("pos", torch.randn(16, 4))
        with torch.inference_mode():
            self.register_buffer("table", torch.ones(4))
        self.register_buffer("cache", torch.zeros(2))
        self.cached = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.cached:
            self.cache, self.cached = torch.arange(float(x.shape[0])), x.shape[0]  # (replaced, not changed in place)
        return self.lin(x + self.pos[: x.shape[0]]) * self.scale + self.table + self.cache[: x.shape[0], None]


class _FilledCache(torch.nn.Module):
    """A cache filled in place with an attribute that says so (rotary-embedding-torch's pattern), a sparse buffer
    (a graph's adjacency) and a BatchNorm whose running statistics hold a NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("c", torch.zeros(16, 4))
        self.register_buffer("adj", torch.eye(4).to_sparse())
        self.n = 0
        self.bn = torch.nn.BatchNorm1d(4).eval()
        self.bn.running_var[0] = float("nan")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n > self.n:
            self.c[:n] = torch.arange(float(n))[:, None]
            self.n = n
        return self.bn(x * self.c[:n].cos() + torch.sparse.mm(self.adj, x.T).T)


@pytest.mark.parametrize("case", ["script", "trace", "lazy", "buffers", "cache", "qat"])
def test_discover_probe_restores_statistics_and_leaves_other_state(tmp_path, case):
    """Reviews of the probe: it crashed on TorchScript buffers (no dict .get), lazy, inference-mode, sparse and
    resized buffers (a QAT observer's range); wrote buffers back whose values had not changed (bumping versions:
    backward through discover's output failed, also for a NaN in a statistic); and put back a cache the module had
    filled, its attribute still saying it was filled (the rotary embedding then a no-op for the whole run). Only
    the statistics of normalisation layers and observers are restored, and only where their bits changed; every
    other buffer is the module's own state, left as its forward left it."""
    torch.manual_seed(0)
    if case in ("script", "trace"):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        model = torch.jit.script(net) if case == "script" else torch.jit.trace(net, torch.randn(3, 4))
        x = torch.randn(3, 4)
    elif case == "lazy":
        model, x = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.LazyBatchNorm1d()), torch.randn(3, 5)
    elif case == "buffers":
        model, x = _Buffered(), torch.randn(8, 4)
    elif case == "cache":
        model, x = _FilledCache(), torch.randn(8, 4, requires_grad=True)
    else:
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).train()
        net.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
        model, x = torch.ao.quantization.prepare_qat(net), torch.randn(2, 3, 8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()} if case != "lazy" else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        col = Collector(model, tmp_path / "p.thist", streams=("activation",))
        out = col.discover(x)
    assert not [str(w.message) for w in caught if "discover()" in str(w.message)]
    if case == "lazy":
        assert model[1].running_mean.shape == (4,) and int(model[1].num_batches_tracked) == 0
    state = model.state_dict()
    for k, v in before.items():
        if case == "buffers" and k == "cache":
            assert model.cache.tolist() == list(range(8)) and model.cached == 8  # (the module's own replacement)
        elif case == "cache" and k == "c":
            assert model.c[:8, 0].tolist() == list(range(8)) and model.n == 8  # (filled, as its attribute says)
        elif v.layout is torch.strided:
            assert torch.equal(state[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    if case in ("buffers", "cache"):
        out.sum().backward()  # (no buffer saved for it was written: their versions did not move)
        assert not col._eager
    if case == "cache":  # and the run goes on as without the collector: the same output as a fresh copy's
        twin = _FilledCache()
        twin.load_state_dict(before)
        twin.c.zero_()
        torch.testing.assert_close(model(x.detach()), twin(x.detach()), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("method", ["index_add", "fused"] + (["triton"] if "triton" in CPU_METHODS else []))
@pytest.mark.parametrize("layout", ["coo", "coo_repeated", "empty"])
def test_a_sparse_tensor_is_reduced_from_its_values_and_implicit_zeros(tmp_path, monkeypatch, method, layout):
    """A sparse gradient went through a dense copy (to_dense): the whole table's memory and a pass over it every
    step. Its stored values are reduced, its implicit zeros counted: the same row as the dense tensor's, sketch
    (zero key) included, with repeated COO indexes added and a gradient with no stored value all zeros. A step
    without a sketch too: where the Triton kernel writes rows it writes key counts always, and the zeros' key was
    left out there (the row then failed to decode, 9 steps in 10 at the default cadence)."""
    import trainhist.torch.reduce as rd

    monkeypatch.setattr(rd, "CPU_METHOD", method)
    torch.manual_seed(0)
    dense = torch.zeros(50, 6)
    dense[[3, 7, 41]] = torch.randn(3, 6) * 4
    dense[7, 2] = -0.0  # (a stored negative zero is counted as one)
    dense[41, 5] = 0.0
    if layout == "coo":
        sparse = dense.to_sparse(1)  # (hybrid: sparse rows of dense values, as nn.Embedding's gradient)
    elif layout == "coo_repeated":  # row 3 given twice, as halves: COO adds repeated indexes
        sparse = torch.sparse_coo_tensor(torch.tensor([[3, 7, 41, 3]]), torch.stack(
            [dense[3] / 2, dense[7], dense[41], dense[3] / 2]), (50, 6))
        assert not sparse.is_coalesced()
    else:
        dense, sparse = torch.zeros(50, 6), torch.zeros(50, 6).to_sparse(1)

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(50, 6))

    m = Holder()
    col = Collector(m, tmp_path / "s.thist", streams=("param_grad",), every=1, sketch_every=2)
    col.attach()
    monkeypatch.setattr(torch.Tensor, "to_dense", lambda *a, **k: pytest.fail("a dense copy of the sparse tensor"))
    for step in (0, 1):
        with col.step(step):
            m.w.grad = sparse.clone()  # (a gradient of this step: a new tensor)
    col.close()
    monkeypatch.undo()
    with trainhist.open(tmp_path / "s.thist") as h:
        assert_row(h, "w", "param_grad", 0, ref_summary([dense]), sketch=True)
        assert_row(h, "w", "param_grad", 1, ref_summary([dense]), sketch=False)


def test_discover_restores_the_cpu_random_state_beside_meta_parameters(tmp_path):
    """Parameters on the meta device (an offloaded model) made the probe fork the 'meta' generators, which forks
    nothing, CPU included: the dropout of discover()'s forward moved the CPU random state."""
    class Offloaded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2, device="meta")
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(x)

    model = Offloaded()
    torch.manual_seed(0)
    state = torch.get_rng_state()
    Collector(model, tmp_path / "m.thist", streams=("activation",)).discover(torch.ones(64))
    assert torch.equal(torch.get_rng_state(), state)
