"""Site naming, selection and the per-step cost table."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainhist.errors import UsageError
from trainhist.torch import Collector
from trainhist.torch.collector import _rank_path
from trainhist.torch.plan import ROOT, clean_name, flatten_output, select, unwrap


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        self.attn = torch.nn.ModuleDict({"q_proj": torch.nn.Linear(4, 4), "k_proj": torch.nn.Linear(4, 4)})
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.encoder(x)
        return {"logits": self.head(h), "aux": (self.attn["q_proj"](h), self.attn["k_proj"](h))}


def test_selection_by_prefix_and_pattern():
    m = Net()
    mods = [clean_name(n) for n, _ in m.named_modules()]
    params = [n for n, _ in m.named_parameters()]
    sm, sp = select(mods, params, ["encoder"])
    assert sm == {"encoder", "encoder.0", "encoder.1"} and sp == {"encoder.0.weight", "encoder.0.bias"}
    sm, sp = select(mods, params, ["attn.*_proj"])
    assert sm == {"attn.q_proj", "attn.k_proj"} and len(sp) == 4
    sm, sp = select(mods, params, ["head.weight"])
    assert sm == set() and sp == {"head.weight"}
    assert select(mods, params, None) == (set(mods), set(params))


def test_selection_matching_nothing_names_the_closest():
    with pytest.raises(UsageError, match="closest names: encoder") as e:
        Collector(Net(), "unused.thist", sites=["encodr"])
    assert e.value.code == "no_such_site"
    with pytest.raises(UsageError, match="drop the 'module.' prefix"):  # a name copied from a DDP-wrapped model
        Collector(Net(), "unused.thist", sites=["module.encoder"])


def test_wrappers_are_unwrapped_to_the_users_names():
    m = Net()
    compiled = torch.compile(m)  # not run: only the wrapper is inspected
    inner, ddp = unwrap(compiled)
    assert inner is m and not ddp
    assert clean_name("_fsdp_wrapped_module.encoder._checkpoint_wrapped_module.0") == "encoder.0"
    assert clean_name("") == ROOT
    col = Collector(compiled, "unused.thist", sites=["head"])
    assert {s.path for s in col.plan.sites} == {"head", "head.weight", "head.bias"}


@dataclasses.dataclass
class DC:
    a: torch.Tensor
    b: object = None


def test_output_facets():
    t = torch.zeros(2)
    assert [f for f, _ in flatten_output(t)] == [None]
    out = {"x": (t, [t, 3]), "y": DC(t, {"z": t}), "none": None}
    assert [f for f, _ in flatten_output(out)] == ["x.0", "x.1.0", "y.a", "y.b.z"]
    from transformers.modeling_outputs import CausalLMOutput

    assert [f for f, _ in flatten_output(CausalLMOutput(loss=t, logits=t))] == ["loss", "logits"]


def test_output_facets_that_read_the_same_are_kept_apart_and_deep_ones_are_said():
    """Keys that flatten to one path (``"a.b"`` beside ``"a"`` → ``"b"``; ``0`` beside ``"0"``) made one site of
    two tensors, each row written twice; tensors nested deeper than the limit were left out silently."""
    t, u, v = torch.zeros(2), torch.ones(3), torch.full((4,), 2.0)
    with pytest.warns(RuntimeWarning, match="facet path 'a.b'"):
        got = list(flatten_output({"a.b": t, "a": {"b": u}, "c": {"a.b": v}}))
    assert [(f, x.numel()) for f, x in got] == [("a.b", 2), ("a.b#2", 3), ("c.a.b", 4)]
    with pytest.warns(RuntimeWarning, match="facet path '0'"):
        assert [f for f, _ in flatten_output({0: t, "0": u, "0#2": v})] == ["0", "0#2", "0#2#2"]
    deep = [[[[[t]]]], u]
    with pytest.warns(RuntimeWarning, match="deeper than 4 levels"):
        assert [f for f, _ in flatten_output(deep)] == ["1"]
    assert [f for f, _ in flatten_output([[[[t]]]])] == ["0.0.0.0"]  # (at the limit: recorded)


def test_complex_outputs_are_left_out_with_a_warning():
    """A complex output was a site recorded 'failed' (a TypeError) at every step, and the triage listed it as a
    failed reduction each time; the format has no complex dtype, so it is now left out, and a warning says so."""
    t, z = torch.zeros(2), torch.zeros(2, dtype=torch.complex64)
    with pytest.warns(RuntimeWarning, match="complex tensor"):
        assert [f for f, _ in flatten_output((t, z))] == ["0"]
    with pytest.warns(RuntimeWarning, match="complex tensor"):
        assert list(flatten_output(z)) == []


def test_plan_table_reports_elements_and_bytes():
    m = Net()
    col = Collector(m, "unused.thist", streams=("activation", "param", "param_delta"), sketch_every=5,
                    delta_elements=10)
    assert any(s.provisional for s in col.plan.sites)  # before discover(): facets unknown
    col.discover(torch.zeros(3, 4))
    p = col.plan
    assert not any(s.provisional for s in p.sites)
    assert p.find(ROOT, "activation", "aux.1").elements == 12
    assert p.find("attn.q_proj.weight", "param_delta", None).elements == 10
    assert p.find("attn.q_proj.weight", "param_delta", None).sample == {"elements": 10, "of": 16, "seed": 0}
    assert p.find("head.bias", "param_delta", None).sample is None
    table = p.format_table()
    assert "elements/step" in table and "raw bytes/step" in table and "aux.1" in table
    assert table.splitlines()[-1].startswith("TOTAL")
    assert p.bytes_per_step() > 0 and p.elements_per_step() == sum(s.elements_per_step() for s in p.sites)


def test_rank_paths():
    assert _rank_path("run.thist", 0, 1) == "run.thist"
    assert _rank_path("run.thist", 3, 4) == "run.rank3.thist"
    assert _rank_path("out/{rank}.thist", 2, 4) == "out/2.thist"


def test_plan_counts_every_call_of_a_module_called_twice(tmp_path):
    """A module applied twice in a forward (weight sharing: ALBERT's layers, a shared activation) reduces both
    outputs every step: the plan's elements per step are both calls', as the rows' counts are."""
    import trainhist
    from trainhist.torch import Collector

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.body(self.body(x))

    m = Twice()
    col = Collector(m, tmp_path / "t.thist", mode="w", streams=("activation",))
    col.discover(torch.randn(4, 8))
    (site,) = [s for s in col.plan.sites if s.path == "body"]
    assert site.elements == 2 * 4 * 8
    with col.step(0):
        m(torch.randn(4, 8))
    col.close()
    assert int(trainhist.open(tmp_path / "t.thist").spine("body", "activation").columns["count"][0]) == site.elements


def test_plan_counts_each_call_of_a_shared_module_at_its_own_shape(tmp_path):
    """A shared embedding applied to inputs of two lengths in one forward: the plan's elements per step are the sum
    of both calls' outputs, as the rows' counts are (it multiplied the first call's shape by the calls)."""
    import trainhist
    from trainhist.torch import Collector

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)

        def forward(self, a, b):
            return self.emb(a).sum() + self.emb(b).sum()

    m = Shared()
    a, b = torch.randint(0, 10, (2, 8)), torch.randint(0, 10, (2, 3))
    col = Collector(m, tmp_path / "t.thist", mode="w", streams=("activation",))
    col.discover((a, b))
    (site,) = [s for s in col.plan.sites if s.path == "emb"]
    assert site.elements == (2 * 8 + 2 * 3) * 4
    with col.step(0):
        m(a, b)
    col.close()
    assert int(trainhist.open(tmp_path / "t.thist").spine("emb", "activation").columns["count"][0]) == site.elements
