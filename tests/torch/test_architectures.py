"""Real architectures, tiny and randomly initialised (nothing downloaded): recurrent cells with nested (h, c)
outputs, attention that returns (out, None), torch's TransformerEncoder in train and eval mode, HF BERT, LLaMA
(rotary, RMSNorm, gradient checkpointing) and T5, tied embeddings, sparse embedding gradients, bfloat16 and float16
parameters, a module called twice per forward, modules returning None, ints and empty tensors, channels_last
convolutions, weight-norm parametrizations and TorchScript submodules. Each runs two recorded training steps under
an independent capture (torch_helpers.Spy), and every module row, parameter, gradient and update the capture
holds is compared with the file's (counts, min, max bit for bit, sums within their bound)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch_helpers import Spy, assert_row, presence, ref_summary

import trainhist
from trainhist.torch import Collector
from trainhist.torch.plan import ROOT


def _record(tmp_path, model: nn.Module, batch, loss=None, *, steps: int = 2, opt=None):
    """Record ``steps`` SGD steps of ``model`` on ``batch()`` (a tensor, or a dict of keyword arguments) with every
    stream at every step; ``loss=None``: evaluation steps under no_grad (no backward, no optimizer step). Returns
    the file, the rows compared with the capture, and the collector's warnings."""
    call = (lambda x: model(**x)) if isinstance(batch(), dict) else model
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    path = tmp_path / "run.thist"
    before: dict[int, dict] = {}
    after: dict[int, dict] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        col = Collector(model, path, mode="w", every=1, sketch_every=1)
        col.discover(batch())
        col.attach(optimizer=opt)
        spy = Spy({ROOT if n == "" else n: m for n, m in model.named_modules()
                   if not isinstance(m, torch.jit.ScriptModule)})
        for step in range(steps):
            spy.step = step
            with col.step(step):
                if loss is None:
                    with torch.no_grad():
                        call(batch())
                    continue
                loss(call(batch())).backward()
                before[step] = {n: (p.detach().clone(), p.grad) for n, p in model.named_parameters()}
                opt.step()
                opt.zero_grad()
                after[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        spy.remove()
        col.close()
    h = trainhist.open(path)
    checked = 0
    for (s, name, facet), ts in spy.acts.items():
        assert_row(h, name, "activation", s, ref_summary(ts), facet=facet)
        checked += 1
    for (s, name, facet), gs in spy.grads.items():
        assert_row(h, name, "activation_grad", s, ref_summary(gs), facet=facet)
        checked += 1
    for s, params in before.items():
        for n, (p, g) in params.items():
            assert_row(h, n, "param", s, ref_summary([after[s][n]]))  # (the parameter as the step left it)
            if g is None:
                assert presence(h, n, "param_grad", s) == "absent", n  # (no gradient reached it: never a zero)
                continue
            assert_row(h, n, "param_grad", s, ref_summary([g.to_dense() if g.is_sparse else g]))
            # the update the optimizer applied, measured in float32 (whole: these tensors are under 4096 elements)
            assert_row(h, n, "param_delta", s, ref_summary([after[s][n].float() - p.float()]))
            checked += 3
    said = [str(w.message) for w in caught if "trainhist" in str(w.message)]
    return h, checked, said


def _acts(h) -> set:
    return {(s.path, s.facet) for s in h.sites if s.stream == "activation"}


class _Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.rnn = cell(8, 6, num_layers=2, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.rnn(self.emb(x))  # (LSTM: out, (h, c); GRU: out, h)
        return self.head(out)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0])  # (out, None)


def _encoder():
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class _Tied(nn.Module):
    def __init__(self, sparse: bool = False):
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=sparse)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        if not sparse:
            self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.emb(x))))


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.block(torch.tanh(self.block(x)))))


class _Nothing(nn.Module):
    def forward(self, x):
        return None


class _Count(nn.Module):
    def forward(self, x):
        return x.shape[0]


class _Mixed(nn.Module):
    def forward(self, x):
        return (x * 2, None, 3, x[:0])


class _Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.none = _Nothing()
        self.count = _Count()
        self.mixed = _Mixed()
        self.empty = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        self.none(y)
        m = self.mixed(y)
        return (m[0].square().sum() * self.count(y) + self.empty(x[:0]).sum()).reshape(1)


class _Scripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 6)
        self.jit = torch.jit.script(nn.Sequential(nn.Linear(6, 6), nn.Tanh()))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.jit(self.pre(x)))


def _hf(name: str):
    transformers = pytest.importorskip("transformers")
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        return transformers.BertModel(cfg)
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                       use_cache=False)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                                num_heads=2, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
                                pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def _ids(n: int = 8):
    return lambda: torch.randint(0, 50, (2, n))


def _lm():
    ids = torch.randint(0, 50, (2, 8))
    return {"input_ids": ids, "labels": ids}


def _seq2seq():
    return {"input_ids": torch.randint(0, 50, (2, 6)), "labels": torch.randint(0, 50, (2, 4))}


def _sq(o):
    return o.float().square().mean()


CASES = {
    # name: (model maker, batch maker, loss of the output, activation sites (path, facet) the file must hold)
    "lstm": (lambda: _Recurrent(nn.LSTM), lambda: torch.randint(0, 20, (2, 5)), _sq,
             {("rnn", "0"), ("rnn", "1.0"), ("rnn", "1.1"), ("head", None)}),
    "gru": (lambda: _Recurrent(nn.GRU), lambda: torch.randint(0, 20, (2, 5)), _sq, {("rnn", "0"), ("rnn", "1")}),
    "multihead_attention": (_Attention, lambda: torch.randn(2, 5, 8), _sq, {("attn", "0"), ("head", None)}),
    "transformer_encoder": (_encoder, lambda: torch.randn(2, 5, 8), _sq,
                            {("layers.1.self_attn", "0"), ("layers.1.linear2", None), (ROOT, None)}),
    # eval mode under no_grad: torch refuses its fused fast path where forward hooks are attached, so the
    # submodules run and are recorded
    "transformer_encoder_eval": (lambda: _encoder().eval(), lambda: torch.randn(2, 5, 8), None,
                                 {("layers.0.self_attn", "0"), ("layers.0.linear1", None), ("layers.1.norm2", None)}),
    "hf_bert": (lambda: _hf("bert"), lambda: {"input_ids": _ids()()}, lambda o: o.last_hidden_state.square().mean(),
                {("embeddings.word_embeddings", None), ("encoder.layer.0.attention.self", "0"),
                 (ROOT, "last_hidden_state"), (ROOT, "pooler_output")}),
    "hf_llama": (lambda: _hf("llama"), _lm, lambda o: o.loss,
                 {("model.rotary_emb", "0"), ("model.rotary_emb", "1"), ("model.layers.0.input_layernorm", None),
                  ("model.layers.0.self_attn", "0"), (ROOT, "loss"), (ROOT, "logits")}),
    "hf_t5": (lambda: _hf("t5"), _seq2seq, lambda o: o.loss,
              {("encoder", "last_hidden_state"), ("decoder.block.0", "0"), (ROOT, "encoder_last_hidden_state")}),
    "tied_embeddings": (_Tied, lambda: torch.randint(0, 20, (2, 5)), _sq, {("emb", None), ("out", None)}),
    "sparse_embedding": (lambda: _Tied(sparse=True), lambda: torch.randint(0, 20, (2, 5)), _sq, {("emb", None)}),
    "bfloat16": (lambda: nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2)).bfloat16(),
                 lambda: torch.randn(3, 6, dtype=torch.bfloat16), _sq, {("2", None)}),
    "float16": (lambda: nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2)).half(),
                lambda: torch.randn(3, 6, dtype=torch.float16), _sq, {("2", None)}),
    "called_twice": (_Twice, lambda: torch.randn(3, 6), _sq, {("block", None)}),
    "none_int_empty": (_Odd, lambda: torch.randn(3, 4), lambda o: o.sum(),
                       {("a", None), ("mixed", "0"), ("mixed", "3"), ("empty", None)}),
    "channels_last": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3))
                      .to(memory_format=torch.channels_last),
                      lambda: torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last), _sq, {("1", None)}),
    "weight_norm": (lambda: nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 6)), nn.Tanh(),
                                          nn.utils.parametrizations.spectral_norm(nn.Linear(6, 2))),
                    lambda: torch.randn(3, 4), _sq, {("0.parametrizations.weight.0", None), ("2", None)}),
    "torchscript_submodule": (_Scripted, lambda: torch.randn(3, 4), _sq, {("pre", None), ("head", None)}),
}


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_real_architectures_record_what_ran(tmp_path, name):
    make, batch, loss, sites = CASES[name]
    torch.manual_seed(0)
    h, checked, said = _record(tmp_path, make(), batch, loss)
    assert sites <= _acts(h), sorted(_acts(h), key=str)
    assert checked >= 4 * len(sites), checked
    if name != "torchscript_submodule":
        assert not said, said  # (nothing here deserves a warning)
    for s in h.sites:  # every row says what it is: observed, or why not (never a zero standing for missing)
        assert set(h.spine(s.path, s.stream, s.facet).presence_names) <= {"observed", "absent", "skipped", "unknown"}
    if name == "transformer_encoder_eval":  # no optimizer step: no update, gradients unknown (not zero)
        assert presence(h, "layers.0.linear1.weight", "param_delta", 1) == "skipped"
        assert presence(h, "layers.0.linear1.weight", "param_grad", 1) == "unknown"
    if name == "tied_embeddings":  # one parameter under its first name
        assert {s.path for s in h.sites if s.stream == "param"} == {"emb.weight", "mid.weight", "mid.bias"}
    if name == "none_int_empty":  # no site for None or an int; empty tensors are observed with no elements
        assert not {p for p, _ in _acts(h)} & {"none", "count"}
        sp = h.spine("empty", "activation")
        assert list(sp.presence_names) == ["observed"] * 2 and sp.count.tolist() == [0, 0]
        assert presence(h, "mixed", "activation_grad", 1, facet="3") == "absent"  # (no gradient reached it)
    if name == "lstm":  # (h, c) take no part in the loss: their gradients are absent, not zero
        assert presence(h, "rnn", "activation_grad", 0, facet="1.1") == "absent"
    if name == "torchscript_submodule":
        # a TorchScript module takes no hooks: its outputs are not recorded (a warning names it), its parameters are
        assert not {p for p, _ in _acts(h) if p.startswith("jit")}
        assert len(said) == 1 and "TorchScript" in said[0] and "'jit'" in said[0], said
        assert {"jit.0.weight", "jit.0.bias"} <= {s.path for s in h.sites if s.stream == "param_delta"}


def test_gradient_checkpointing_records_what_the_plain_forward_records(tmp_path):
    """HF LLaMA with gradient checkpointing recomputes each layer's forward in the backward pass: those forwards are
    not the step's (nothing counted twice), and every row equals the one the same run records without it."""
    pytest.importorskip("transformers")
    files, rerun = [], []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = _hf("llama")
        if ckpt:
            kw = {"use_reentrant": True}  # (the layers' forwards run again inside the backward pass)
            if hasattr(model, "activation_checkpointing_enable"):  # (transformers 5's name)
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
            model.model.layers[0].mlp.register_forward_hook(
                lambda *a: rerun.append(torch._C._current_graph_task_id() != -1))
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        col = Collector(model, tmp_path / f"c{ckpt}.thist", mode="w", sketch_every=1)
        col.discover(_lm())
        col.attach(optimizer=opt)
        torch.manual_seed(1)
        for step in range(2):
            with col.step(step):
                model(**_lm()).loss.backward()
                opt.step()
                opt.zero_grad()
        col.close()
        files.append(trainhist.open(tmp_path / f"c{ckpt}.thist"))
    assert rerun == [False] + [False, True] * 2  # (discover(), then each step: its forward and the recomputation)
    plain, ckpt = files
    assert {s.key for s in plain.sites} == {s.key for s in ckpt.sites}
    for s in plain.sites:
        if s.path == "step_time":
            continue
        a, b = plain.spine(s.path, s.stream, s.facet), ckpt.spine(s.path, s.stream, s.facet)
        assert list(a.presence_names) == list(b.presence_names), s.key
        for c in ("count", "nan", "zero"):
            np.testing.assert_array_equal(a.columns[c], b.columns[c], err_msg=str(s.key))
        np.testing.assert_allclose(a.max, b.max, rtol=1e-5, atol=1e-7, err_msg=str(s.key))


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_torchscript_model_records_its_parameters_and_says_why_not_its_outputs(tmp_path, how):
    """Hooks on a TorchScript module raise: a scripted or traced model crashed discover() and attach()."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    model = torch.jit.script(net) if how == "script" else torch.jit.trace(net, torch.randn(3, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        col = Collector(model, tmp_path / "s.thist", mode="w")
        col.discover(torch.randn(3, 4))
        col.attach(optimizer=opt)
        with col.step(0):
            model(torch.randn(3, 4)).square().mean().backward()
            grad = dict(model.named_parameters())["0.weight"].grad.clone()
            opt.step()
        col.close()
    said = [str(w.message) for w in caught if "trainhist" in str(w.message)]
    assert len(said) == 1 and "TorchScript" in said[0] and repr(ROOT) in said[0], said
    h = trainhist.open(tmp_path / "s.thist")
    assert {s.stream for s in h.sites} == {"param", "param_grad", "param_delta", "scalar"}
    assert_row(h, "0.weight", "param_grad", 0, ref_summary([grad]))
    assert_row(h, "0.weight", "param", 0, ref_summary([model.state_dict()["0.weight"]]))


class _Spectral(nn.Module):
    """A Fourier layer (as in Fourier neural operators): complex weights on the lowest modes."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, dtype=torch.cfloat) / 4)
        self.lift = nn.Linear(1, 4)

    def forward(self, x):  # x: (batch, points, 1)
        h = self.lift(x).transpose(1, 2)  # (batch, 4, points)
        modes = torch.fft.rfft(h)[..., :3] * self.weight
        return torch.fft.irfft(modes, n=h.shape[-1]).square().mean()


def test_complex_parameters_are_left_out_with_a_warning_and_stay_in_the_norm(tmp_path):
    """A complex parameter (the format has no complex dtype) recorded 'failed' at every step for its value and
    gradient, which also took grad_norm away at every step, and an update of its real part alone as 'observed'
    (the imaginary part's change dropped). It gets no site, one warning names it, and the norm includes it."""
    torch.manual_seed(0)
    model = _Spectral()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        col = Collector(model, tmp_path / "c.thist", mode="w")
        col.discover(torch.randn(2, 8, 1))
        col.attach(optimizer=opt)
        for step in range(2):
            with col.step(step):
                model(torch.randn(2, 8, 1)).backward()
                grad = model.lift.weight.grad.clone()
                norms.append(float(torch.linalg.vector_norm(
                    torch.cat([p.grad.reshape(-1).abs() for p in model.parameters()]).double())))
                before = model.lift.weight.detach().clone()
                opt.step()
                opt.zero_grad()
        col.close()
    said = [str(w.message) for w in caught if "trainhist" in str(w.message)]
    assert len(said) == 1 and "complex" in said[0] and "'weight'" in said[0], said
    h = trainhist.open(tmp_path / "c.thist")
    assert not [s.key for s in h.sites if s.path == "weight"]
    assert_row(h, "lift.weight", "param_grad", 1, ref_summary([grad]), sketch=False)
    assert_row(h, "lift.weight", "param_delta", 1, ref_summary([model.lift.weight.detach() - before]), sketch=False)
    sp = h.spine("grad_norm", "scalar")
    assert sp.step.tolist() == [0, 1]
    np.testing.assert_allclose(sp.max, norms, rtol=1e-6)
