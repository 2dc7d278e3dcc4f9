"""Train a tiny GPT-2 on the CPU for real and record its distribution history (``trainhist demo``).

The model is random-init ``GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)``; the data
is the bytes of the project's own README and spec (or of trainhist's source when those are not installed), so it
runs offline in well under a minute. ``--inject-nan STEP`` makes one MLP emit a NaN at that step.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from ..errors import UsageError
from .collector import Collector, StepTruth

__all__ = ["main"]

SEQ = 64
FAULT_SITE = "transformer.h.1.mlp.c_fc"


def _corpus() -> torch.Tensor:
    """Byte tokens of the README and spec next to the source tree, else of trainhist's own source files."""
    pkg = Path(__file__).resolve().parents[1]
    repo = pkg.parents[1]
    files = [repo / "README.md", repo / "spec" / "format.md", repo / "spec" / "crash-safety.md"]
    files = [f for f in files if f.is_file()] or sorted(pkg.rglob("*.py"))
    data = b"\n".join(f.read_bytes() for f in files)
    if len(data) < 4 * SEQ:  # nothing readable: a deterministic synthetic text
        data = b"".join(b"step %d: the quick brown fox jumps over the lazy dog\n" % i for i in range(200))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status."""
    ap = argparse.ArgumentParser(prog="trainhist demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("demo_out", "demo.thist"), help="history file to write")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    ap.add_argument("--micro-batches", type=int, default=2, help="gradient-accumulation micro-batches per step")
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--inject-nan", type=int, metavar="STEP", help=f"make {FAULT_SITE} emit a NaN at STEP")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-figures", action="store_true", help="skip the contact sheet (needs matplotlib)")
    args = ap.parse_args(argv)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: worker threads cost more than they give (and suffer on busy CPUs)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise UsageError(f"the demo builds a tiny GPT-2 with transformers: pip install 'trainhist[demo]' ({e})",
                         code="needs_torch") from None

    hf_logging.set_verbosity_error()  # config notices about the tiny vocabulary are not the demo's point

    torch.manual_seed(args.seed)
    tokens = _corpus()
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=SEQ, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    gen = torch.Generator().manual_seed(args.seed)

    def batch() -> torch.Tensor:
        start = torch.randint(0, tokens.numel() - SEQ - 1, (args.batch,), generator=gen)
        return torch.stack([tokens[s : s + SEQ] for s in start.tolist()])

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # spines every step (the default) let the triage name the faulty site at the very step it went wrong; a tiny
    # model affords sketches every 5 steps (the default is every 10) for denser figures
    col = Collector(model, args.out, mode="w", run_name="trainhist-demo", every=1, sketch_every=5,  # a fresh file
                    config={"model": "gpt2-tiny", **{k: v for k, v in vars(args).items() if k != "out"}})
    first = batch()
    col.discover({"input_ids": first, "labels": first})
    plan = col.plan
    col.attach(optimizer=opt)
    current = {"step": -1}

    def inject(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        if current["step"] == args.inject_nan:
            output = output.clone()
            output.view(-1)[0] = float("nan")
        return output

    if args.inject_nan is not None:
        model.get_submodule(FAULT_SITE).register_forward_hook(inject)

    t0 = time.perf_counter()
    losses = []
    for step in range(args.steps):
        current["step"] = step
        with col.step(step, truth=StepTruth(tokens=args.micro_batches * args.batch * SEQ)):
            total = torch.zeros(())
            for _ in range(args.micro_batches):
                ids = batch()
                loss = model(input_ids=ids, labels=ids).loss / args.micro_batches
                loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        col.scalars(step, loss=total, lr=sched.get_last_lr()[0])
        sched.step()
        losses.append(total)
    col.close()
    elapsed = time.perf_counter() - t0

    size = os.path.getsize(args.out)
    print(f"trained tiny GPT-2 for {args.steps} steps ({args.micro_batches} micro-batches each) in {elapsed:.1f}s")
    print(f"loss {float(losses[0]):.3f} -> {float(losses[-1]):.3f}")
    print(f"history: {args.out} ({size / 1024:.0f} KiB, {len(plan.sites)} sites, "
          f"{plan.elements_per_step():,.0f} elements reduced per step)")
    if col.first_nonfinite is not None:
        s, path, stream, facet = col.first_nonfinite
        print(f"first non-finite value: step {s}, {path} ({stream}{', ' + facet if facet else ''})")
    else:
        print("no non-finite values recorded")
    _follow_up(args)
    return 0


def _follow_up(args: argparse.Namespace) -> None:
    """Triage the history and draw its figures (the figures need matplotlib, the ``viz`` extra)."""
    from .. import open as open_history
    from ..triage import triage

    with open_history(args.out) as h:
        report = triage(h)
        print(report.format())
        if args.no_figures:
            return
        try:
            from ..figures import contact_sheet, site_figure, waterfall
        except ImportError:
            print("figures skipped: install the viz extra (matplotlib)")
            return
        out = Path(args.out).parent / "figures"
        pages = contact_sheet(h, out)
        first = report.first_nonfinite
        site = next((s for s in h.sites if first is not None and s.path == first.site
                     and s.stream == "activation"), None) or h.site(FAULT_SITE, "activation")
        site_figure(h, site.path, site.stream, site.facet, out=out / "site.png")
        waterfall(h, site.path, site.stream, site.facet, out=out / "waterfall.png")
        print(f"figures: contact sheet ({len(pages)} page(s)), site.png and waterfall.png of {site.path} in {out}")


if __name__ == "__main__":
    raise SystemExit(main())
