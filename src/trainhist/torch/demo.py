"""Train a tiny GPT-2 on the CPU for real and record its distribution history (the ``trainhist demo`` command).

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

from ..cli import _path, int_arg
from ..errors import TrainhistError, UsageError
from ..triage import printable_path as _shown  # (paths, for a line of output)
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


RUN_NAME = "trainhist-demo"  #: the run name of every history the demo writes (with config model MODEL)
MODEL = "gpt2-tiny"


_positive = int_arg(1)  #: a whole number >= 1 (argparse type)
_step = int_arg(0, what="a step, a whole number")  #: a step >= 0 (argparse type)
#: (argparse type) a seed as torch keeps it: torch.manual_seed maps -2^63 .. -1 onto this range too
_seed = int_arg(0, (1 << 64) - 1, "a seed, a whole number")


def _demo_history(path: str) -> str | None:
    """Why ``path`` may not be replaced by the demo (None: it is a history an earlier demo wrote)."""
    from .. import open as open_history

    try:
        with open_history(path) as h:
            run = h.run or {}
    except TrainhistError as e:
        return f"it is not a readable trainhist history ([{e.code}])"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if run.get("name") != RUN_NAME or (run.get("config") or {}).get("model") != MODEL:
        return (f"it holds the history of run {run.get('name')!r}, not one the demo wrote" if run
                else "it holds no run manifest, so nothing says the demo wrote it")
    return None


def _check_out(args: argparse.Namespace) -> None:
    """Refuse (``bad_output``) an ``--out`` the demo could not write, before it trains: not a regular file, under a
    file, or with a file where its figures/ folder goes."""
    out = Path(args.out)
    if out.exists() and not out.is_file():  # (a link to nothing is a file to be: the writer creates it)
        what, e_g = (("a directory", f" (e.g. --out {out / 'demo.thist'})") if out.is_dir()
                     else ("something that is not a regular file (a device, a pipe)", ""))
        raise UsageError(f"{what} is there, where --out names the history file; pass a file path{e_g}",
                         code="bad_output", path=str(out))
    folder = out.absolute().parent
    above = next(p for p in (folder, *folder.parents) if os.path.lexists(p))
    if not above.is_dir():
        raise UsageError(f"{above} is a file, not a folder, so --out cannot go there; pass a path in a folder",
                         code="bad_output", path=str(out))
    figures = folder / "figures"
    if not args.no_figures and os.path.lexists(figures) and not figures.is_dir():
        raise UsageError(f"{figures} is a file, where the demo draws its figures (a figures/ folder beside --out); "
                         "move it, pass another --out, or --no-figures", code="bad_output", path=str(out))


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status."""
    ap = argparse.ArgumentParser(
        prog="trainhist demo",
        description="Train a tiny GPT-2 on the CPU for real, record its distribution history, then triage it and "
                    "draw its figures.",
        epilog="An existing --out file is replaced only when it is a history an earlier demo wrote (run "
               f"'{RUN_NAME}', model '{MODEL}'); any other file is refused unless --force is given. Exit status: 0 "
               "trained, written and triaged; 1 the history or its figures could not be written; 2 bad usage (an "
               "option, or an --out the demo may not replace or cannot place); 130 interrupted (Ctrl-C: the steps "
               "recorded so far are kept)")
    ap.add_argument("--out", type=_path, default=os.path.join("demo_out", "demo.thist"),
                    help="history file to write; the figures go to a figures/ folder beside it "
                         "(default: %(default)s)")
    ap.add_argument("--force", action="store_true",
                    help="replace --out even when it is not a history an earlier demo wrote")
    ap.add_argument("--steps", type=_positive, default=30, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--micro-batches", type=_positive, default=2,
                    help="gradient-accumulation micro-batches per step (default: %(default)s)")
    ap.add_argument("--batch", type=_positive, default=8,
                    help="sequences of 64 tokens per micro-batch (default: %(default)s)")
    ap.add_argument("--inject-nan", type=_step, metavar="STEP",
                    help=f"make {FAULT_SITE} emit a NaN at STEP, 0 .. --steps - 1 (default: none)")
    ap.add_argument("--seed", type=_seed, default=0,
                    help="seed of the model and the data, 0 .. 2^64 - 1 (default: %(default)s)")
    ap.add_argument("--no-figures", action="store_true",
                    help="skip the figures: the contact sheet, site.png and waterfall.png (they need matplotlib)")
    args = ap.parse_args(argv)
    if args.inject_nan is not None and args.inject_nan >= args.steps:
        ap.error(f"argument --inject-nan: step {args.inject_nan} is not among the {args.steps} steps trained "
                 f"(0 .. {args.steps - 1}): pass a smaller STEP or more --steps")
    _check_out(args)
    if os.path.lexists(args.out) and not args.force:
        why = _demo_history(args.out)
        if why is not None:
            raise UsageError(f"the demo would replace this file, but {why}; pass another --out, or --force to "
                             "replace it", code="out_exists", path=args.out)

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

    folder = Path(args.out).absolute().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrainhistError(f"cannot create the folder {folder} of --out ({e.strerror or e}); pass a path in a "
                             "folder you may write to", code="output_unwritable", path=args.out) from None
    # spines every step (the default) let the triage name the faulty site at the very step it went wrong; a tiny
    # model affords sketches every 5 steps (the default is every 10) for denser figures
    col = Collector(model, args.out, mode="w", run_name=RUN_NAME, every=1, sketch_every=5,  # a fresh file (main()
                    # refused to replace one the demo did not write)
                    config={"model": MODEL, **{k: v for k, v in vars(args).items() if k not in ("out", "force")}})
    first = batch()
    col.discover({"input_ids": first, "labels": first})
    plan = col.plan
    col.attach(optimizer=opt)
    col.commit()  # (the run manifest on disk now: should the demo be killed, the next one knows the file is its own)
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
    from .. import open as open_history

    with open_history(args.out) as h:  # (the sites as `trainhist info` counts them: the run-level scalars too)
        scalars = sum(x.stream == "scalar" for x in h.sites)
        tensors = len(h.sites) - scalars
    steps = f"{args.steps} step{'' if args.steps == 1 else 's'}"
    micro = f"{args.micro_batches} micro-batch{'' if args.micro_batches == 1 else 'es'}"
    print(f"trained tiny GPT-2 for {steps} ({micro} each) in {elapsed:.1f}s")
    print(f"loss {float(losses[0]):.3f} -> {float(losses[-1]):.3f}")
    print(f"history: {_shown(args.out)} ({size / 1024:.0f} KiB, {tensors + scalars} sites: {tensors} tensor sites and "
          f"{scalars} run-level scalars; {plan.elements_per_step():,.0f} elements reduced per step)")
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
    from ..triage import printable, triage

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
        first = report.first_nonfinite
        site = next((s for s in h.sites if first is not None and s.path == first.site
                     and s.stream == "activation"), None) or h.site(FAULT_SITE, "activation")
        try:
            pages = contact_sheet(h, out)
            site_figure(h, site.path, site.stream, site.facet, out=out / "site.png")
            waterfall(h, site.path, site.stream, site.facet, out=out / "waterfall.png")
        except OSError as e:  # (a read-only figures/ folder, a full disk)
            raise TrainhistError(f"cannot write the figures ({e.strerror or e}); the history is complete: pass an "
                                 "--out in a folder you may write to, or --no-figures", code="output_unwritable",
                                 path=str(e.filename or out)) from None
        n = f"{len(pages)} {'page' if len(pages) == 1 else 'pages'}"
        print(f"figures: contact sheet ({n}), site.png and waterfall.png of {printable(site.path)} in {_shown(out)}")


if __name__ == "__main__":
    raise SystemExit(main())
