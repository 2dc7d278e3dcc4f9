"""End-to-end on third-party model code: HF GPT-2, a CNN with BatchNorm, CPU autocast (bfloat16) + GradScaler."""

from __future__ import annotations

import numpy as np
import torch
from torch_helpers import Spy, assert_row, presence, ref_summary

import trainhist
from trainhist.torch import Collector, StepTruth
from trainhist.torch.plan import ROOT


def compare_spy(h, spy: Spy, steps, sketch_every: int) -> int:
    n = 0
    for (s, name, facet), ts in spy.acts.items():
        if s in steps:
            assert_row(h, name, "activation", s, ref_summary(ts), facet=facet, sketch=s % sketch_every == 0)
            n += 1
    for (s, name, facet), gs in spy.grads.items():
        if s in steps:
            assert_row(h, name, "activation_grad", s, ref_summary(gs), facet=facet, sketch=s % sketch_every == 0)
            n += 1
    return n


def test_hf_gpt2_with_accumulation_and_clipping(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, use_cache=False)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = tmp_path / "gpt2.thist"
    col = Collector(model, path, every=1, sketch_every=2)
    ids = torch.randint(0, 64, (2, 16))
    out = col.discover({"input_ids": ids, "labels": ids})
    assert out.logits.shape == (2, 16, 64)
    plan = col.plan
    assert plan.find(ROOT, "activation", "logits") is not None and plan.find(ROOT, "activation", "loss")
    assert plan.find("transformer.wte.weight", "param") is not None
    assert plan.find("lm_head.weight", "param") is None  # tied to transformer.wte.weight: recorded once
    col.attach(optimizer=opt)
    spy = Spy({ROOT if n == "" else n: m for n, m in model.named_modules()})
    grads = {}
    for step in range(2):
        spy.step = step
        with col.step(step, truth=StepTruth(tokens=64)):
            for _ in range(2):
                ids = torch.randint(0, 64, (2, 16))
                (model(input_ids=ids, labels=ids).loss / 2).backward()
            grads[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
    spy.remove()
    col.close()
    h = trainhist.open(path)
    assert compare_spy(h, spy, {0, 1}, 2) > 50
    for n in ("transformer.h.0.attn.c_attn.weight", "transformer.wte.weight"):
        assert_row(h, n, "param_grad", 1, ref_summary([grads[1][n]]), phase="pre_clip", sketch=False)
    rows = h.step_truth_rows()
    assert [r["micro_batches"] for r in rows] == [2, 2] and [r["clipped"] for r in rows] == ["clipped"] * 2


def test_cnn_with_batchnorm_eval_forwards_not_recorded(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = tmp_path / "cnn.thist"
    col = Collector(model, path, every=1, sketch_every=1)
    col.discover(torch.randn(2, 3, 8, 8))
    col.attach(optimizer=opt)
    spy = Spy({n: m for n, m in model.named_modules() if n})
    for step in range(2):
        spy.step = step
        with col.step(step):
            x = torch.randn(4, 3, 8, 8)
            torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (4,))).backward()
            opt.step()
            opt.zero_grad()
        spy.step = None
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, 3, 8, 8))  # outside any step: not recorded
        model.train()
    spy.remove()
    col.close()
    h = trainhist.open(path)
    assert compare_spy(h, spy, {0, 1}, 1) == 2 * 2 * 6
    assert list(h.spine("1.weight", "param").step) == [0, 1]
    assert [r["micro_batches"] for r in h.step_truth_rows()] == [1, 1]


def test_cpu_autocast_bfloat16_with_gradscaler(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)
    path = tmp_path / "amp.thist"
    col = Collector(model, path, every=1, sketch_every=1)
    col.attach(optimizer=opt, scaler=scaler)
    spy = Spy({n: m for n, m in model.named_modules() if n})
    grads = {}
    for step in range(3):
        spy.step = step
        with col.step(step):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(8, 16)).float().square().mean()
            scaler.scale(loss).backward()
            grads[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        col.scalars(step, loss=loss)
    spy.remove()
    col.close()
    h = trainhist.open(path)
    assert spy.acts[(0, "0", None)][0].dtype == torch.bfloat16
    assert h.site("0", "activation").dtype == "bfloat16"
    assert compare_spy(h, spy, {0, 1, 2}, 1) == 3 * 3 * 2
    rows = h.step_truth_rows()
    # the scale each step's loss was multiplied by (growth_interval=1: it grows after every step)
    assert [r["loss_scale"] for r in rows] == [256.0, 512.0, 1024.0]
    assert [r["applied"] for r in rows] == ["applied"] * 3
    # gradients are captured after scaler.step unscaled them (in place): basis 'unscaled'
    assert [r["grad_basis"] for r in rows] == ["unscaled"] * 3
    g = h.spine("0.weight", "param_grad")
    np.testing.assert_allclose(g.max[0], float(grads[0]["0.weight"].max()) / 256.0, rtol=1e-6)
    assert presence(h, "0.weight", "param_delta", 2) == "observed"
