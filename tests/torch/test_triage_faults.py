"""The triage of real (tiny) torch training runs recorded by the Collector, each with one injected fault whose
site, pass and step are known: the diagnosis must name them, and claim no more than the history supports."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import trainhist
from trainhist.torch import Collector
from trainhist.triage import triage

K = 3  #: the step of the fault


class _NanBackward(torch.autograd.Function):
    """The identity, whose backward puts a NaN into the gradient it passes on."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.clone()
        g.view(-1)[0] = float("nan")
        return g


class BadBackward(nn.Module):
    """The identity in the forward; its backward yields a NaN while ``on``."""

    on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NanBackward.apply(x) if self.on else x


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def _nan_at(module: nn.Module, now: dict, value: float = float("nan"), micro: int | None = None) -> None:
    """Make ``module``'s output hold ``value`` in one element at step K (in micro-batch ``micro`` alone)."""

    def hook(mod, inputs, out):
        if now["step"] == K and micro in (None, now["micro"]):
            out = out.clone()
            out.view(-1)[0] = value
        return out

    module.register_forward_hook(hook)


def _train(tmp_path, *, model=None, steps=6, every=1, micro=1, opt=None, scaler=None, setup=None, loss_fn=None,
           before_step=None) -> trainhist.History:
    """Train ``model`` (default: a small MLP) on synthetic data for ``steps`` steps of ``micro`` micro-batches,
    recorded every ``every`` steps; ``setup(model, now)`` installs the fault (``now``: the step and micro-batch)."""
    torch.set_num_threads(1)
    m = model if model is not None else _mlp()
    opt = opt(m) if opt is not None else torch.optim.SGD(m.parameters(), lr=0.05)
    path = tmp_path / "run.thist"
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        col = Collector(m, path, mode="w", every=every, sketch_every=max(every, 10))
        col.discover(torch.randn(4, 8, generator=gen))
        col.attach(optimizer=opt, scaler=scaler)
        now = {"step": -1, "micro": -1}
        if setup is not None:
            setup(m, now)
        for step in range(steps):
            now["step"] = step
            with col.step(step):
                total = torch.zeros(())
                for mb in range(micro):
                    now["micro"] = mb
                    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
                    out = m(x)
                    loss = (loss_fn(out, y, now) if loss_fn else ((out - y) ** 2).mean()) / micro
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    total = total + loss.detach()
                if before_step is not None:
                    before_step(m, now)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
            col.scalars(step, loss=total)
        col.close()
    return trainhist.open(path)


def _first(h: trainhist.History) -> tuple[int, str, str]:
    f = triage(h).first_nonfinite
    return f.step, f.site, f.text


# -- faults the triage names exactly (regression) ------------------------------------------------------------------


def _poison_grad(m, now):
    if now["step"] == K:
        m[4].weight.grad.view(-1)[0] = float("nan")


class _Frozen(nn.Module):
    """A linear model with a parameter whose gradient is always exactly 0 (Adam with eps=0 makes its update 0/0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 2)
        self.idle = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + 0 * self.idle.sum()


def _poison_input_grad(m, now):
    """A tensor hook, registered on ``3``'s input (``2``'s output) in the forward, after the collector's, that puts a
    NaN into the gradient reaching ``2``'s output at step K: ``2``'s backward receives it."""

    def poison(g):
        if now["step"] != K:
            return None
        g = g.clone()
        g.view(-1)[0] = float("nan")
        return g

    m[3].register_forward_pre_hook(lambda mod, inputs: inputs[0].register_hook(poison) and None)


@pytest.mark.parametrize("case", ["forward_nan", "forward_inf", "backward_only", "backward_hook",
                                  "second_micro_batch", "poisoned_gradient", "adam_eps0"])
def test_an_injected_fault_is_named_at_its_site_pass_and_step(tmp_path, case) -> None:
    if case == "forward_nan":
        h = _train(tmp_path, setup=lambda m, now: _nan_at(m[2], now))
        want = (K, "2", "`2` forward (activation) at step 3 (1 NaN)")
    elif case == "forward_inf":
        h = _train(tmp_path, setup=lambda m, now: _nan_at(m[2], now, float("inf")))
        want = (K, "2", "`2` forward (activation) at step 3 (1 inf)")
    elif case == "backward_only":  # the NaN is made by BadBackward's backward: it reaches the output of `2`
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), BadBackward(), nn.ReLU(), nn.Linear(16, 2))
        h = _train(tmp_path, model=m, setup=lambda m, now: m[3].register_forward_pre_hook(
            lambda mod, i: setattr(mod, "on", now["step"] == K)))
        want = (K, "2", "`2` backward (activation_grad: the gradient reaching its output) at step 3 (1 NaN)")
    elif case == "backward_hook":  # (recorded with a tensor hook of its own, it was named at `1`: too late)
        h = _train(tmp_path, setup=_poison_input_grad)
        want = (K, "2", "`2` backward (activation_grad: the gradient reaching its output) at step 3 (1 NaN)")
    elif case == "second_micro_batch":
        h = _train(tmp_path, micro=2, setup=lambda m, now: _nan_at(m[2], now, micro=1))
        want = (K, "2", "`2` forward (activation) at step 3 (1 NaN)")
    elif case == "poisoned_gradient":
        h = _train(tmp_path, before_step=_poison_grad)
        want = (K, "4.weight", "`4.weight` gradient (param_grad) at step 3 (1 NaN)")
    else:
        h = _train(tmp_path, model=_Frozen(), opt=lambda m: torch.optim.Adam(
            [{"params": list(m.lin.parameters())}, {"params": [m.idle], "eps": 0.0}], lr=0.01))
        want = (0, "idle", "`idle` update (param_delta) at step 0 (3 NaN)")
    with h:
        step, site, text = _first(h)
        assert (step, site) == want[:2] and want[2] in text, text
        kinds = [f.kind for f in triage(h).findings]
    assert "first_nonfinite_site" not in kinds and "scaler_overflow" not in kinds, kinds


def test_a_gradscaler_overflow_alone_is_no_divergence(tmp_path) -> None:
    """A scale so large that every step's gradients overflow (a real GradScaler, on the CPU): each step is skipped,
    and the triage names no first non-finite value, only the expected overflow."""
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)
    with _train(tmp_path, scaler=sc, loss_fn=lambda o, y, now: ((o - y) ** 2).mean() * 1e6) as h:
        t = triage(h)
    kinds = [f.kind for f in t.findings]
    assert t.first_nonfinite is None and "nonfinite" not in kinds, t.format()
    (f,) = [f for f in t.findings if f.kind == "scaler_overflow"]
    assert f.step == 0 and "6 steps skipped by the loss scaler" in f.text


# -- defects found by these runs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["nan_loss", "overflowing_loss"])
def test_a_non_finite_loss_comes_before_the_backward_it_feeds(tmp_path, case) -> None:
    """The loss is computed after the forward and before the backward. A loss made NaN by its own computation (the
    model's outputs finite), or one that overflows to inf from a finite spike in the forward (1e30 in `2`'s output:
    every module output stays finite, the squared error does not), makes the backward non-finite: the triage named
    the backward (`(root)`'s output gradient, or `4.weight`'s gradient) as the first non-finite value, because it
    ranked every run-level scalar after the update. The loss held the first one."""
    if case == "nan_loss":
        h = _train(tmp_path, loss_fn=lambda o, y, now: ((o - y) ** 2).mean() * (float("nan") if now["step"] == K
                                                                                 else 1.0))
        what, site = "(1 NaN)", "`(root)` backward (activation_grad"
    else:
        h = _train(tmp_path, setup=lambda m, now: _nan_at(m[2], now, 1e30))
        what, site = "(1 inf)", "`4.weight` gradient (param_grad) at step 3"
    with h:
        t = triage(h)
    first = t.first_nonfinite
    assert (first.step, first.site) == (K, "loss") and f"`loss` scalar at step 3 {what}" in first.text, t.format()
    (s,) = [f for f in t.findings if f.kind == "first_nonfinite_site"]
    assert s.step == K and site in s.text, t.format()


@pytest.mark.parametrize("overflowing", [False, True])
def test_a_step_the_scaler_skipped_for_a_forward_nan_is_not_called_an_overflow(tmp_path, overflowing) -> None:
    """A real GradScaler skips the step whose forward held a NaN (its gradients are non-finite too). The triage
    named the forward NaN first, but put that step's gradients aside as "an overflow, expected with a GradScaler",
    and counted the step among the overflows: gradients a non-finite forward (or loss) made non-finite are no
    overflow. With a scale that overflows every step (``overflowing``), the other steps remain the overflows."""
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)
    scale = 1e6 if overflowing else 1.0
    with _train(tmp_path, scaler=sc, setup=lambda m, now: _nan_at(m[2], now),
                loss_fn=lambda o, y, now: ((o - y) ** 2).mean() * scale) as h:
        t = triage(h)
    first = t.first_nonfinite
    assert (first.step, first.site) == (K, "2") and "forward" in first.text, t.format()
    n = next(f for f in t.findings if f.kind == "nonfinite")
    assert "all at step 3" in n.text and "1 observation" not in n.text, t.format()
    over = [f for f in t.findings if f.kind == "scaler_overflow"]
    if overflowing:
        assert len(over) == 1 and "5 steps skipped by the loss scaler" in over[0].text, t.format()
    else:
        assert not over, t.format()


def test_a_cadence_gap_does_not_place_the_origin_at_or_upstream_of_the_first_site_seen(tmp_path) -> None:
    """Spines every 5 steps, a NaN born in `2`'s forward at step 3: the per-step loss gives the exact step, and the
    first site seen non-finite is `0` (the first module) at step 5, after the update spread the NaN to every site.
    The triage said the values "may have turned non-finite earlier, or first upstream of this site": the origin,
    `2`, is downstream of `0`. Over steps not observed any site may have held them first; it must say so."""
    with _train(tmp_path, every=5, steps=8, setup=lambda m, now: _nan_at(m[2], now)) as h:
        t = triage(h)
    first = t.first_nonfinite
    assert (first.step, first.site) == (K, "loss"), t.format()
    (s,) = [f for f in t.findings if f.kind == "first_nonfinite_site"]
    assert s.step == 5 and s.site == "0" and "steps 1..4 were not observed" in s.text, s.text
    assert "upstream" not in s.text and "which site held them first is not recorded" in s.text, s.text
    assert "site/phase pairs held non-finite values at step 5" in s.text, s.text


def test_a_parameter_frozen_mid_run_is_named_by_its_gradient_first(tmp_path) -> None:
    """`4.weight` frozen (requires_grad off) during step 3: from step 4 on it has no gradient and no update. The
    finding about rows that did not run named its update as the first, although the gradient comes before the
    update in a step (rows without numbers were ranked by site position alone, whatever their pass)."""

    def freeze(m, now):
        if now["step"] == K:
            m[4].weight.requires_grad_(False)

    with _train(tmp_path, before_step=freeze) as h:
        t = triage(h)
    (f,) = [f for f in t.findings if f.kind == "rows_absent"]
    assert f.step == K + 1 and "2 site/phase pairs did not run" in f.text, t.format()
    assert "first `4.weight` gradient (param_grad) at step 4" in f.text, t.format()
    assert t.first_nonfinite is None


def _scaled_bad_backward(tmp_path, init_scale: float, steps: int) -> trainhist.History:
    """A GradScaler run whose module `3` yields a NaN in its backward at every step from K on."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), BadBackward(), nn.ReLU(), nn.Linear(16, 2))
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    return _train(tmp_path, model=m, scaler=sc, steps=steps, setup=lambda m, now: m[3].register_forward_pre_hook(
        lambda mod, i: setattr(mod, "on", now["step"] >= K)))


def test_a_persistent_backward_nan_under_a_gradscaler_is_not_hidden_as_overflows(tmp_path) -> None:
    """A backward that yields a NaN at every step from K on, under a GradScaler of scale 16: the scaler skips every
    step, halving the scale down to 0.25. The triage called all seven skipped steps "an overflow, expected with a
    GradScaler" and named no non-finite value at all: the divergence was hidden. Gradients that stay non-finite as
    the scale falls to 1 or below are no overflow of the scaling (unscaled, they are non-finite themselves), and
    neither are those of the skips that led there."""
    with _scaled_bad_backward(tmp_path, 2.0**4, 10) as h:
        t = triage(h)
    first = t.first_nonfinite
    assert first is not None and (first.step, first.site) == (K, "2") and "backward" in first.text, t.format()
    assert not [f for f in t.findings if f.kind == "scaler_overflow"], t.format()
    assert any(f.kind == "skipped_step" and f.step == K for f in t.findings), t.format()


def test_skips_through_the_end_of_a_run_are_not_called_expected_without_a_word(tmp_path) -> None:
    """The same fault under a scale that is still above 1 when the run ends (2^16, 6 steps): the data cannot tell
    these skips from overflows, but an overflow clears as the scale goes down, and these did not: the overflow
    finding must say that the last skips ran through the end without an applied step."""
    with _scaled_bad_backward(tmp_path, 2.0**16, 6) as h:
        t = triage(h)
    (f,) = [f for f in t.findings if f.kind == "scaler_overflow"]
    assert "3 steps skipped by the loss scaler" in f.text, f.text
    assert "the last 3 of them ran through the end" in f.text and "down to 16384" in f.text, f.text


def test_a_dead_layer_and_a_parameter_that_stopped_changing_are_said(tmp_path) -> None:
    """`3` (a ReLU) outputs only zeros from step K on, and the parameters of `4` sit in a group of learning rate 0:
    no value is non-finite, no row is missing, and the triage said "no non-finite values, failures, skipped steps or
    gaps found" and nothing more, although the spine records both exactly (zero == count)."""

    def dead(m, now):
        m[3].register_forward_hook(lambda mod, i, o: o * 0 if now["step"] >= K else o)

    def opt(m):
        return torch.optim.SGD([{"params": list(m[0].parameters()) + list(m[2].parameters())},
                                {"params": list(m[4].parameters()), "lr": 0.0}], lr=0.05)

    with _train(tmp_path, setup=dead, opt=opt) as h:
        t = triage(h)
    kinds = [f.kind for f in t.findings]
    assert t.first_nonfinite is None and "nonfinite" not in kinds, t.format()
    (z,) = [f for f in t.findings if f.kind == "zero_forward"]
    assert (z.step, z.site) == (K, "3") and "`3` forward (activation) held only zeros from step 3" in z.text, z.text
    (u,) = [f for f in t.findings if f.kind == "zero_update"]
    assert (u.step, u.site) == (0, "4.weight") and "from its first row, step 0" in u.text, u.text
    assert "update was 0 at every element: the parameter stopped changing" in u.text, u.text



def test_a_healthy_run_has_no_zero_findings(tmp_path) -> None:
    with _train(tmp_path) as h:
        assert triage(h).findings == []


def test_a_sampled_update_of_zeros_says_what_was_measured(tmp_path) -> None:
    """`param_delta` is measured on a sample of a large parameter: a zero update there says so, not 'every element'."""
    def opt(m):
        return torch.optim.SGD([{"params": list(m[0].parameters()) + list(m[2].parameters())},
                                {"params": list(m[4].parameters()), "lr": 0.0}], lr=0.05)

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 300))
    h = _train(tmp_path, model=m, opt=opt, loss_fn=lambda o, y, now: o.square().mean())
    with h:
        (u,) = [f for f in triage(h).findings if f.kind == "zero_update"]
    assert u.site == "4.weight" and "at each of the 4096 elements sampled of 4800" in u.text, u.text
    assert "may have stopped changing" in u.text and "the parameter stopped changing" not in u.text, u.text


def test_at_a_cadence_a_dead_layer_is_bracketed_and_a_clean_verdict_says_what_was_not_observed(tmp_path) -> None:
    """Spines every 2 steps, `3` dead from step K=3: its rows at 0 and 2 hold values, those from 4 on only zeros. The
    layer died at step 3 or 4, which the rows cannot tell: the finding must not say "from step 4" as if exact. And a
    run without a finding, recorded at a cadence, must not read as if every step had been looked at."""

    def dead(m, now):
        m[3].register_forward_hook(lambda mod, i, o: o * 0 if now["step"] >= K else o)

    with _train(tmp_path, every=2, steps=8, setup=dead) as h:
        (z,) = [f for f in triage(h).findings if f.kind == "zero_forward"]
    assert z.step == 4 and "its previous row, at step 2, held other values: step 3 was not observed" in z.text, z.text
    with _train(tmp_path, every=2, steps=4) as h:
        text = triage(h).format()
    assert "site spines recorded every 2 steps: the steps between were not observed" in text, text


def test_at_a_cadence_a_non_finite_loss_is_not_called_the_origin(tmp_path) -> None:
    """Spines every 5 steps, the NaN born in `2` at step 3: the per-step loss is the first non-finite value *recorded*,
    at the exact step, but no site was observed at that step, so the headline must not read as if the loss's own
    computation were where it started."""
    with _train(tmp_path, every=5, steps=8, setup=lambda m, now: _nan_at(m[2], now)) as h:
        t = triage(h)
    first = t.first_nonfinite
    assert (first.step, first.site) == (K, "loss"), t.format()
    assert "the first non-finite value recorded was in `loss` scalar at step 3" in first.text, first.text
    assert "no site spine was observed at that step" in first.text, first.text
    with _train(tmp_path, loss_fn=lambda o, y, now: ((o - y) ** 2).mean() * (float("nan") if now["step"] == K
                                                                              else 1.0)) as h:
        first = triage(h).first_nonfinite  # (every step observed: the loss is where it started)
    assert first.text.startswith("the first non-finite value was in `loss`"), first.text
