"""Loops the collector must record truthfully although they step outside the usual shape: evaluation steps, an
unattached optimizer, another model's clip, a parameter replaced mid-run, scalars given late or twice, sparse
gradients, a clip that raises, two collectors on one scaler (each test fails on the code before its fix)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import trainhist
from trainhist.errors import UsageError
from trainhist.torch import Collector, StepTruth


def small(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def presence(h: trainhist.History, path: str, stream: str, phase: str | None = None) -> dict[int, str]:
    s = h.spine(path, stream, phase=phase)
    return dict(zip(s.step.tolist(), s.presence_names))


def scalar(h: trainhist.History, name: str) -> dict[int, float]:
    """Each step's value of a scalar (NaN for a non-finite one: the sums leave it out)."""
    s = h.spine(name, "scalar")
    return {int(st): math.nan if n else float(v) for st, v, n in zip(s.step, s.sum, s.nan + s.pinf + s.ninf)}


def norm(model: torch.nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None))


def test_a_step_without_backward_does_not_record_the_previous_steps_gradients(tmp_path) -> None:
    """The loop clears gradients at the start of a training step; step 1 only evaluates. Its param_grad rows read
    the step-0 gradients as its own, and grad_norm repeated step 0's; they are absent now, with no norm."""
    m = small()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(m, tmp_path / "e.thist", streams=("param_grad",))
    col.attach(optimizer=opt)
    for step in range(3):
        with col.step(step):
            if step == 1:
                with torch.no_grad():
                    m(torch.randn(2, 4))
            else:
                opt.zero_grad()
                m(torch.randn(2, 4)).square().mean().backward()
                opt.step()
    col.close()
    with trainhist.open(tmp_path / "e.thist") as h:
        assert presence(h, "0.weight", "param_grad") == {0: "observed", 1: "absent", 2: "observed"}
        assert sorted(scalar(h, "grad_norm")) == [0, 2]


def test_parameters_of_an_unattached_optimizer_are_never_absent_when_they_had_a_gradient(tmp_path) -> None:
    """Matrices in one optimizer (attached), vectors in another (not). Gradients cleared by model.zero_grad() at the
    step's end: the vectors' param_grad read absent and grad_norm left them out (0.3595 for 0.4696); now unknown,
    with a warning, and no norm. A GAN-style step (the unattached optimizer's backward after the attached one's
    step) and a GradScaler (which unscales each optimizer's gradients at its own step) read them right."""
    def run(path, clear: bool, scaler: bool = False, gan: bool = False):
        m = small()
        mats = [p for p in m.parameters() if p.ndim == 2]
        vecs = [p for p in m.parameters() if p.ndim < 2]
        o1, o2 = torch.optim.SGD(mats, lr=0.1), torch.optim.AdamW(vecs, lr=0.1)
        sc = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
        col = Collector(m, path, streams=("param_grad",))
        col.attach(optimizer=o1, scaler=sc)
        true = []
        for step in range(2):
            with col.step(step):
                m.zero_grad()
                loss = m(torch.randn(2, 4)).square().mean()
                if sc is not None:
                    sc.scale(loss).backward()
                    sc.step(o1)
                    sc.step(o2)
                    true.append((float(m[0].bias.grad.max()), norm(m)))
                    sc.update()
                elif gan:  # (the matrices' step first; then a backward that fills the vectors' gradients)
                    loss.backward()
                    o1.step()
                    m.zero_grad()
                    m(torch.randn(2, 4)).abs().mean().backward()
                    true.append((float(m[0].bias.grad.max()), None))
                    o2.step()
                else:
                    loss.backward()
                    true.append((float(m[0].bias.grad.max()), norm(m)))
                    o1.step()
                    o2.step()
                if clear:
                    m.zero_grad()
        col.close()
        return true

    with pytest.warns(RuntimeWarning, match="parameters no attached optimizer holds"):
        run(tmp_path / "c.thist", clear=True)
    with trainhist.open(tmp_path / "c.thist") as h:
        assert presence(h, "0.bias", "param_grad") == {0: "unknown", 1: "unknown"}
        assert "grad_norm" not in {s.path for s in h.sites}
    for name, kw in (("s", {"scaler": True}), ("g", {"gan": True}), ("n", {})):
        true = run(tmp_path / f"{name}.thist", clear=False, **kw)
        with trainhist.open(tmp_path / f"{name}.thist") as h:
            assert h.spine("0.bias", "param_grad").max.tolist() == [t[0] for t in true], name
            if true[0][1] is not None:
                assert list(scalar(h, "grad_norm").values()) == pytest.approx([t[1] for t in true], rel=1e-12)


def test_another_models_clip_is_not_this_models(tmp_path) -> None:
    """An actor recorded, the loop clips the critic alone: the actor's step read clipped at the critic's threshold,
    with the critic's norm as grad_norm_post_clip. A clip of both models' parameters clips this one's, but its norm
    is not this model's norm."""
    actor, critic = small(0), small(1)
    opt = torch.optim.SGD(actor.parameters(), lr=0.1)
    col = Collector(actor, tmp_path / "a.thist", streams=("param_grad",))
    col.attach(optimizer=opt)
    true = []
    for step in range(2):
        with col.step(step):
            x = torch.randn(2, 4)
            (actor(x).square().mean() + critic(x).square().mean()).backward()
            true.append(norm(actor))
            params = critic.parameters() if step == 0 else [*actor.parameters(), *critic.parameters()]
            torch.nn.utils.clip_grad_norm_(params, 1e-3)
            opt.step()
            actor.zero_grad()
            critic.zero_grad()
    col.close()
    with trainhist.open(tmp_path / "a.thist") as h:
        truth = {r["step"]: r for r in h.step_truth_rows()}
        assert (truth[0]["clipped"], truth[0]["clip_threshold"]) == ("unknown", None)
        assert (truth[1]["clipped"], truth[1]["clip_threshold"]) == ("clipped", 1e-3)
        # (step 1's clip norm is of both models: this one's own norms, before and after the clip, are recorded)
        assert scalar(h, "grad_norm") == {0: pytest.approx(true[0], rel=1e-12), 1: pytest.approx(true[1], rel=1e-6)}
        assert list(scalar(h, "grad_norm_post_clip")) == [1] and scalar(h, "grad_norm_post_clip")[1] < 1e-3
        assert presence(h, "0.weight", "param_grad", "pre_clip") == {1: "observed"}


def test_a_parameter_replaced_mid_run_is_recorded_from_the_new_tensor(tmp_path) -> None:
    m = small()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(m, tmp_path / "r.thist", streams=("param", "param_grad"))
    col.attach(optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            if step == 2:
                m[2].weight = torch.nn.Parameter(torch.full((1, 4), 5.0))
                opt.add_param_group({"params": [m[2].weight]})
            with col.step(step):
                m(torch.randn(2, 4)).square().mean().backward()
                opt.step()
                opt.zero_grad()
    col.close()
    assert any("1 parameter(s) were replaced by new tensors before step 2 (2.weight)" in str(w.message)
               for w in caught)
    with trainhist.open(tmp_path / "r.thist") as h:
        assert float(h.spine("2.weight", "param").max[2]) == float(m[2].weight.max())
        assert presence(h, "2.weight", "param_grad")[2] == "observed"


def test_scalars_given_after_a_step_stay_in_its_segment_and_are_committed(tmp_path) -> None:
    """The guide's pattern, col.scalars(step, loss=loss) after the with block: a rollback put the last loss of
    segment 0 into segment 1, and commit() left the last loss out of the file."""
    m = small()
    col = Collector(m, tmp_path / "l.thist", streams=("param",))
    col.attach()
    for step in (0, 1, 1):
        with col.step(step):
            loss = m(torch.randn(2, 4)).square().mean()
        col.scalars(step, loss=loss.detach())
    with trainhist.open(tmp_path / "l.thist") as h:  # (before commit: nothing of the last step yet)
        pass
    col.commit()
    with trainhist.open(tmp_path / "l.thist") as h:
        s = h.spine("loss", "scalar")
        assert list(zip(s.segment.tolist(), s.step.tolist())) == [(0, 0), (0, 1), (1, 1)]
    col.close()


def test_a_forward_or_optimizer_step_outside_the_step_is_warned_about(tmp_path) -> None:
    m = small()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(m, tmp_path / "o.thist", streams=("activation",))
    col.attach(optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            loss = m(torch.randn(2, 4)).square().mean()
            with col.step(step):
                loss.backward()
            opt.step()
            opt.zero_grad()
    col.close()
    said = " ".join(str(w.message) for w in caught)
    assert "the model ran before step 0 began and not inside it" in said
    assert "an attached optimizer stepped outside col.step()" in said


def test_sparse_gradients_have_a_global_norm_on_every_step(tmp_path) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    opts = [torch.optim.SparseAdam(list(m[0].parameters())), torch.optim.SGD(m[1].parameters(), lr=0.1)]
    col = Collector(m, tmp_path / "s.thist", streams=("param_grad",), every={"param_grad": 2})
    col.attach(optimizer=opts)
    true = []
    for step in range(2):
        with col.step(step):
            m(torch.tensor([[1, 1, 3]])).square().mean().backward()  # (index 1 twice: uncoalesced)
            g = m[0].weight.grad.coalesce().values()
            true.append(math.sqrt(float(g.double().square().sum()) + sum(
                float(p.grad.double().square().sum()) for p in m[1].parameters())))
            for o in opts:
                o.step()
                o.zero_grad()
    col.close()
    with trainhist.open(tmp_path / "s.thist") as h:
        assert list(scalar(h, "grad_norm").values()) == pytest.approx(true, rel=1e-6)  # (float32 off-cadence)


def test_gradients_a_clip_refuses_as_non_finite_are_recorded(tmp_path) -> None:
    """clip_grad_norm_(error_if_nonfinite=True) raises before any clip; the loop catches it and clears the
    gradients: the NaN gradient was never recorded and triage found nothing."""
    m = small()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(m, tmp_path / "c.thist", streams=("param_grad",))
    col.attach(optimizer=opt)
    for step in range(2):
        with col.step(step):
            x = torch.randn(2, 4)
            if step == 1:
                x[0, 0] = math.nan
            m(x).square().mean().backward()
            try:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=True)
                opt.step()
            except RuntimeError:
                pass
            opt.zero_grad()
    col.close()
    assert col.first_nonfinite is not None and col.first_nonfinite[0] == 1
    with trainhist.open(tmp_path / "c.thist") as h:
        assert int(h.spine("0.weight", "param_grad", phase="default").nan[-1]) > 0
        assert math.isnan(scalar(h, "grad_norm")[1])


def test_scalars_given_twice_or_named_as_the_collectors_are_resolved_without_a_write_error(tmp_path) -> None:
    """A loss per micro-batch, or the user's own grad_norm/step_time, made duplicate rows the writer refused and
    that were reported as a failing disk (hiding a real one); a tensor named _aux was dropped."""
    m = small()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(m, tmp_path / "d.thist", streams=("param_grad",))
    col.attach(optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with col.step(0):
            for micro in range(2):
                loss = m(torch.randn(2, 4)).square().mean()
                loss.backward()
                col.scalars(0, loss=float(micro))
            col.scalars(0, grad_norm=123.0, step_time=9.0, _aux=torch.tensor(0.5), nothing=None)
            opt.step()
        col.scalars(0, late=torch.tensor(2.0))
        col.scalars(0, late=torch.tensor(3.0))
    col.close()
    said = " ".join(str(w.message) for w in caught)
    assert col.writer_errors == 0 and "failed" not in said
    assert "'loss' was given more than once" in said and "'grad_norm' is one the collector records" in said
    with trainhist.open(tmp_path / "d.thist") as h:
        assert scalar(h, "loss") == {0: 1.0} and scalar(h, "_aux") == {0: 0.5} and scalar(h, "late") == {0: 3.0}
        assert scalar(h, "grad_norm")[0] != 123.0 and scalar(h, "step_time")[0] != 9.0
        assert "nothing" not in {s.path for s in h.sites}


@pytest.mark.parametrize("value", [torch.ones(2), "high", np.ones(3), 1j, [[1.0], [2.0, 3.0]]])
def test_a_scalar_that_is_not_one_real_number_is_refused_at_the_call(tmp_path, value) -> None:
    col = Collector(small(), tmp_path / "b.thist", streams=("param",))
    with pytest.raises(UsageError, match="must be a single real number") as e:
        col.scalars(0, x=value)
    assert e.value.code == "bad_scalar"
    col.scalars(0, ok=np.array([2.5]))  # (before attach(): the file is opened; it raised AttributeError)
    col.close()
    with trainhist.open(tmp_path / "b.thist") as h:
        assert scalar(h, "ok") == {0: 2.5}


@pytest.mark.parametrize("field, value", [("tokens", -1), ("micro_batches", 0), ("samples", 1.5),
                                          ("loss_scale", math.inf), ("clip_threshold", "x")])
def test_step_truth_refuses_values_the_file_cannot_hold_when_made(field, value) -> None:
    """StepTruth(tokens=-1) was accepted; the step's whole truth row was then refused at writing, behind a
    'writing failed' warning, while tokens_per_s = -1541 was written."""
    with pytest.raises(UsageError) as e:
        StepTruth(**{field: value})
    assert e.value.code == "bad_value" and field in str(e.value)


def test_closing_one_of_two_collectors_on_one_scaler_leaves_the_others_wrappers(tmp_path) -> None:
    a, b = small(0), small(1)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ca = Collector(a, tmp_path / "a.thist", streams=("param_grad",))
    cb = Collector(b, tmp_path / "b.thist", streams=("param_grad",))
    ca.attach(optimizer=oa, scaler=sc)
    cb.attach(optimizer=ob, scaler=sc)
    ca.close()
    for step in range(2):
        with cb.step(step):
            x = torch.randn(2, 4)
            if step == 1:
                x[0, 0] = math.inf
            sc.scale(b(x).square().mean()).backward()
            sc.unscale_(ob)
            sc.step(ob)
            sc.update()
            ob.zero_grad()
    cb.close()
    assert not {"unscale_", "step", "update"} & set(sc.__dict__)  # (both closed: the class's methods again)
    with trainhist.open(tmp_path / "b.thist") as h:
        rows = [(r["applied"], r["loss_scale"], r["grad_basis"]) for r in h.step_truth_rows()]
    assert rows == [("applied", 1024.0, "unscaled"), ("skipped", 1024.0, "unscaled")]


def test_discover_under_no_grad_still_plans_the_activation_gradients(tmp_path) -> None:
    col = Collector(small(), tmp_path / "n.thist", streams=("activation", "activation_grad"))
    with torch.no_grad():
        col.discover(torch.randn(2, 4))
    assert {s.path for s in col.plan.sites if s.stream == "activation_grad"} == {"0", "1", "2", "(root)"}
    col.close()


def test_weights_tied_after_the_collector_was_made_are_not_counted_twice(tmp_path) -> None:
    """lm_head.weight = embed.weight after the Collector: following it put one tensor under two names, and the
    global norm counted its gradient twice (x sqrt 2)."""

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)

        def forward(self, x):
            return self.lm_head(self.embed(x))

    torch.manual_seed(0)
    m = LM()
    col = Collector(m, tmp_path / "t.thist", streams=("param_grad",), every={"param_grad": 2})
    m.lm_head.weight = m.embed.weight
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    true = []
    with pytest.warns(RuntimeWarning, match="parameters were replaced after the Collector was made"):
        col.attach(optimizer=opt)
        for step in range(2):
            with col.step(step):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(torch.tensor([1, 2, 3])), torch.tensor([2, 3, 4])).backward()
                true.append(norm(m))
                opt.step()
    col.close()
    with trainhist.open(tmp_path / "t.thist") as h:
        assert list(scalar(h, "grad_norm").values()) == pytest.approx(true, rel=1e-6)


def test_late_scalars_before_any_step_and_a_writer_closed_under_the_collector(tmp_path) -> None:
    """A tensor scalar before attach(): commit() raised AttributeError (and close() did, leaving hooks). A writer
    closed by the loop loses every row: that is a writer error (counted), not a refused value."""
    col = Collector(small(), tmp_path / "b.thist", streams=("param",))
    col.scalars(0, lr=torch.tensor(0.5))
    col.commit()
    col.close()
    with trainhist.open(tmp_path / "b.thist") as h:
        assert scalar(h, "lr") == {0: 0.5}
    m = small()
    w = trainhist.HistoryWriter(tmp_path / "w.thist")
    col = Collector(m, writer=w, streams=("param",))
    col.attach()
    w.close()
    with pytest.warns(RuntimeWarning, match="writing the history failed"):
        with col.step(0):
            m(torch.randn(2, 4))
        col.close()
    assert col.writer_errors > 0


@pytest.mark.parametrize("lag", [0, 1])
def test_a_scalar_given_again_after_its_step_was_recorded_is_not_written_twice(tmp_path, lag) -> None:
    """loss given inside the step and again after it: two rows of one identity (1.0 and 2.0) were written. With a
    step pending (lag 1, as on CUDA) a float grad_norm after the step was written before the collector's, whose
    own was then refused."""
    m = small()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    col = Collector(m, tmp_path / "s.thist", streams=("param_grad",))
    col.attach(optimizer=opt)
    col._lag = lag
    own = []
    with pytest.warns(RuntimeWarning, match="after that step's value of it was recorded"):
        for step in range(3):
            with col.step(step):
                opt.zero_grad()
                m(torch.randn(2, 4)).square().mean().backward()
                opt.step()
                own.append(norm(m))
                col.scalars(step, loss=torch.tensor(1.0))
            col.scalars(step, loss=torch.tensor(2.0), grad_norm=99.0)
    col.close()
    with trainhist.open(tmp_path / "s.thist") as h:
        s = h.spine("loss", "scalar")
        assert s.step.tolist() == [0, 1, 2] and s.sum.tolist() == [1.0, 1.0, 1.0]
        assert list(scalar(h, "grad_norm").values()) == pytest.approx(own, rel=1e-12)


def test_parameters_replaced_all_at_once_give_one_warning(tmp_path) -> None:
    m = small()
    col = Collector(m, tmp_path / "a.thist", streams=("param",))
    col.attach()
    m.load_state_dict({k: v.clone() + 1 for k, v in m.state_dict().items()}, assign=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with col.step(0):
            m(torch.randn(2, 4))
    col.close()
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "4 parameter(s) were replaced by new tensors before step 0" in said[0], said
    with trainhist.open(tmp_path / "a.thist") as h:
        assert float(h.spine("2.bias", "param").max[0]) == float(m[2].bias.max())
