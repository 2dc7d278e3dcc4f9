"""Overhead of recording a training loop: interleaved A/B against the uninstrumented loop, with an A/A noise band.

    python tools/bench_overhead.py --reps 2 --steps 4 --quick              # a smoke run
    # the published file: whole runs in turn (the peers too), then step by step, then the width sweep
    python tools/bench_overhead.py --out benchmarks/overhead.md
    python tools/bench_overhead.py --lockstep --only spine sketches default params --steps 150 \
        --append --out benchmarks/overhead.md
    python tools/bench_overhead.py --widths 256 512 768 --reps 6 --steps 24 --append --out benchmarks/overhead.md

Model: a HF transformers GPT-2 with random init sized for a 2-core CPU. Every configuration trains the same model
from the same initial weights on the same synthetic tokens. Within one repetition every configuration runs once,
in a rotated order; each configuration's step time (median over the timed steps; the mean over one whole cadence
period for a configuration that records at a cadence) is divided by the baseline's of the same
repetition, both in wall-clock and in process CPU time. The A/A row (the baseline run a second time) shows the
noise band of the machine; the load average is reported because the machine may be shared. ``--lockstep`` pairs
finer: every configuration trains its own copy of the model in one process and they take turns step by step, so
a slow spell of a shared machine (runs tens of seconds apart can differ by 10%) falls on all of them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch

CONFIGS = [
    ("baseline", "no instrumentation"),
    ("baseline (A/A)", "no instrumentation, run again: the noise band"),
    ("trainhist spine, all sites, every step", "5 streams, every module and parameter; spine every step, no sketches"),
    ("trainhist sketches, all sites, every step", "5 streams, every module and parameter; spine + sketch every step"),
    ("trainhist default", "Collector defaults: 5 streams, every module and parameter; spine every step, sketches "
     "every 10 steps, global gradient norm every step; mean over one whole 10-step period"),
    ("trainhist cadence every=25, sketch_every=50", "5 streams, every module and parameter; spine every 25 steps, "
     "sketches every 50, global gradient norm every step; mean over one whole 50-step period"),
    ("trainhist params+grads sketches, every step",
     "param + param_grad only (the peers' coverage), spine + sketch every step"),
    ("wandb.watch(log='all', log_freq=1)", "offline mode; histograms of every parameter and gradient every step"),
    ("TensorBoard add_histogram", "every parameter and gradient every step"),
]


#: the package each peer needs (a peer whose package is missing is left out of the table, and the text says so)
PEER_PACKAGES = {"wandb": "wandb", "TensorBoard": "tensorboard"}


def is_peer(name: str) -> bool:
    """Whether configuration ``name`` is a peer's (wandb, TensorBoard), not trainhist's or a baseline."""
    return any(name.startswith(peer) for peer in PEER_PACKAGES)


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, n_positions=args.seq, vocab_size=args.vocab,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def batches(args: argparse.Namespace, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(n)]


@contextlib.contextmanager
def instrument(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, tmp: Path,
               sample: torch.Tensor) -> Iterator[tuple[Callable, Callable, Callable]]:
    """Yield ``(wrap, log, settle)``: ``wrap(step)`` a context manager around one training step of ``name``,
    ``log(step, loss)`` after it, ``settle()`` after the warm-up steps (trainhist commits their rows then)."""
    nullstep = lambda step: contextlib.nullcontext()  # noqa: E731
    nothing = lambda: None  # noqa: E731
    if name.startswith("baseline"):
        yield nullstep, lambda step, loss: None, nothing
        return
    if name.startswith("trainhist"):
        from trainhist.torch import Collector

        kw: dict = {}
        if name in CADENCE and name != "trainhist default":
            kw = dict(zip(("every", "sketch_every"), CADENCE[name]))
        elif "spine" in name:
            kw = dict(every=1, sketch_every=0)
        elif "params+grads" in name:
            kw = dict(streams=("param", "param_grad"), every=1, sketch_every=1)
        elif "sketches" in name:
            kw = dict(every=1, sketch_every=1)
        col = Collector(model, tmp / f"{abs(hash(name))}.thist", mode="w", **kw)  # (each repetition: a new file)
        col.discover({"input_ids": sample, "labels": sample})
        col.attach(optimizer=opt)
        try:
            yield (lambda step: col.step(step)), (lambda step, loss: col.scalars(step, loss=loss)), col.commit
        finally:
            col.close()
        return
    if name.startswith("wandb"):
        os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_SILENT"] = "true"
        import wandb

        run = wandb.init(project="trainhist-bench", dir=str(tmp), mode="offline", reinit="finish_previous")
        wandb.watch(model, log="all", log_freq=1)
        try:
            yield nullstep, lambda step, loss: wandb.log({"loss": loss}, step=step), nothing
        finally:
            wandb.unwatch(model)
            run.finish()
        return
    if name.startswith("TensorBoard"):
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(log_dir=str(tmp / "tb"))

        def log(step: int, loss: float) -> None:
            tb.add_scalar("loss", loss, step)
            for n, p in model.named_parameters():
                tb.add_histogram(n, p, step)
                if p.grad is not None:
                    tb.add_histogram(n + ".grad", p.grad, step)

        try:
            yield nullstep, log, nothing
        finally:
            tb.close()
        return
    raise ValueError(name)


def _cpu_method(device: str) -> str:
    """Where and how the collector reduces, in words (with the numba version for the compiled CPU kernel)."""
    from trainhist.torch import reduce

    if device != "cpu":
        probe = torch.zeros(1, device=device)
        if reduce.device_method(probe) == "triton":
            import triton

            return f"the fused Triton kernel on the device ({device}; method `triton`, Triton {triton.__version__})"
        return f"torch operations on the device ({device}; method `index_add`)"
    if reduce.CPU_METHOD != "fused":
        return f"torch operations on the CPU (method `{reduce.CPU_METHOD}`)"
    import numba

    return f"the fused CPU kernel (method `fused`, numba {numba.__version__})"


def _cpu_info() -> str:
    """The CPU model and the widest vector instruction set torch's CPU kernels use on it (AVX2, AVX512, ...): the
    ratios depend on both (torch's matrix products speed up with wider vectors more than a memory-bound reduction)."""
    model = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


@contextlib.contextmanager
def kernel_timer() -> Iterator[dict[str, float]]:
    """Time the collector's calls into the compiled CPU kernels (outputs and gradients one by one, parameters in
    batches, the update's gathers) while the block runs: seconds and elements, summed."""
    from trainhist.torch import collector

    acc = {"s": 0.0, "elements": 0.0, "calls": 0.0}
    one, many, gather = collector.fused_at, collector.fused_many_at, collector._DeltaBatch.gather

    def timed_one(address: int, n: int, *rest: object) -> None:
        t = time.perf_counter()
        one(address, n, *rest)
        acc["s"] += time.perf_counter() - t
        acc["elements"] += n
        acc["calls"] += 1

    def timed_many(ats: list, *rest: object) -> list:
        t = time.perf_counter()
        out = many(ats, *rest)
        acc["s"] += time.perf_counter() - t
        acc["elements"] += sum(a[1] for a in ats if a is not None)
        acc["calls"] += 1
        return out

    def timed_gather(self: object, *rest: object) -> None:
        t = time.perf_counter()
        gather(self, *rest)
        acc["s"] += time.perf_counter() - t
        acc["calls"] += 1

    collector.fused_at, collector.fused_many_at, collector._DeltaBatch.gather = timed_one, timed_many, timed_gather
    try:
        yield acc
    finally:
        collector.fused_at, collector.fused_many_at, collector._DeltaBatch.gather = one, many, gather


def _default_cadence() -> tuple[int, int]:
    from trainhist.torch.collector import DEFAULT_EVERY, DEFAULT_SKETCH_EVERY

    return DEFAULT_EVERY, DEFAULT_SKETCH_EVERY


#: configurations that record at a cadence: (spine every, sketch every)
CADENCE = {"trainhist default": _default_cadence(), "trainhist cadence every=25, sketch_every=50": (25, 50)}


def period(name: str) -> int:
    """Timed steps a configuration needs: one whole cadence period where it records at a cadence (0: ``--steps``)."""
    return math.lcm(*CADENCE[name]) if name in CADENCE else 0


class Runner:
    """One configuration's training run, a step at a time: the model from ``init_state``, AdamW, the
    configuration's instrumentation around each step (``--lockstep`` runs several side by side)."""

    def __init__(self, name: str, init_state: dict, args: argparse.Namespace, data: list[torch.Tensor],
                 tmp: Path) -> None:
        self.model = make_model(args)
        self.model.load_state_dict(init_state)
        self.model.to(args.device)
        self.data = [x.to(args.device) for x in data]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self._stack = contextlib.ExitStack()
        self.wrap, self.log, self.settle = self._stack.enter_context(
            instrument(name, self.model, self.opt, tmp, self.data[0]))

    def step(self, step: int) -> tuple[float, float]:
        """Train one step; its wall-clock and process-CPU seconds."""
        x = self.data[step % len(self.data)]
        t0, c0 = time.perf_counter(), time.process_time()
        with self.wrap(step):
            out = self.model(input_ids=x, labels=x)
            out.loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.log(step, float(out.loss.detach()))  # the loop's own loss read (a sync on CUDA, in every configuration)
        return time.perf_counter() - t0, time.process_time() - c0

    def close(self) -> tuple[float, float]:
        """End the instrumentation (trainhist writes the rows it still holds and closes the file); its seconds."""
        t0, c0 = time.perf_counter(), time.process_time()
        self._stack.close()
        return time.perf_counter() - t0, time.process_time() - c0


def run_config(name: str, init_state: dict, args: argparse.Namespace, data: list[torch.Tensor],
               tmp: Path, kernels: dict[str, float] | None = None) -> dict[str, tuple[float, float]]:
    """Wall-clock and process-CPU seconds per step of ``name`` after the warm-up steps, as median and mean: the
    timed steps are ``--steps`` steps, or one whole cadence period for a configuration that records at a cadence
    (whose cost is the average over the period: a median would miss the recording steps).

    trainhist buffers a step's rows and writes them at a commit (every 30 s by default, inside a step of a long
    run); these runs are shorter: the warm-up steps' rows are committed before the timed steps, and the timed
    steps' rows by ``close()``. Its time, spread over the timed steps, is added to each of them (``"deferred"``:
    seconds per step). ``kernels``: a :func:`kernel_timer` dict, reset when the timed steps start (``"steps"``: how
    many)."""
    per = period(name)
    n = args.warmup + (per or args.steps)
    run = Runner(name, init_state, args, [data[i % len(data)] for i in range(n)], tmp)
    times, cpu = [], []
    for step in range(n):
        if step == args.warmup:
            run.settle()
            if kernels is not None:
                kernels.update(s=0.0, elements=0.0, calls=0.0, steps=float(n - args.warmup))
        dt, dc = run.step(step)
        if step >= args.warmup:
            times.append(dt)
            cpu.append(dc)
    dw, dc = run.close()
    dw, dc = (dw / len(times), dc / len(times)) if name.startswith("trainhist") else (0.0, 0.0)
    return {"median": (statistics.median(times) + dw, statistics.median(cpu) + dc),
            "mean": (statistics.fmean(times) + dw, statistics.fmean(cpu) + dc), "deferred": (dw, dc)}


SPINE = "trainhist spine, all sites, every step"


def _provenance(args: argparse.Namespace, argv: list[str] | None, load_before: tuple, loads: list[float]) -> str:
    """The 'Generated by' sentence: the command, the machine, torch, the load average around the run, the kernel."""
    load_after = os.getloadavg()
    return (f"Generated by `python tools/bench_overhead.py {' '.join(sys.argv[1:] if argv is None else argv)}` "
            f"on {platform.machine()} ({os.cpu_count()} CPUs), torch {torch.__version__} with {args.threads} "
            f"intra-op thread(s), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Load average (1/5/15 min) "
            f"before the run {'/'.join(f'{v:.2f}' for v in load_before)}, after "
            f"{'/'.join(f'{v:.2f}' for v in load_after)} (the measurement itself keeps one CPU busy: a load above 1 "
            f"means other work shared the machine); 1-minute load sampled during the run: "
            f"{min(loads):.2f} to {max(loads):.2f}, median {statistics.median(loads):.2f}. CPU: {_cpu_info()}. "
            f"trainhist reduces with {_cpu_method(args.device)}.")


def sweep(args: argparse.Namespace, argv: list[str] | None) -> str:
    """The spine configuration against the baseline and its A/A run, taking turns step by step, at each of
    ``args.widths``: what the cost is made of (elements read a step, the kernels' time) and how the ratio follows
    the model's size. ``--reps`` blocks of ``--steps`` / ``--reps`` rounds each."""
    names = ["baseline", "baseline (A/A)", SPINE]
    block = max(1, args.steps // args.reps)
    load_before, loads = os.getloadavg(), [os.getloadavg()[0]]
    rows = []
    for width in args.widths:
        a = copy.copy(args)
        a.width = width
        model = make_model(a)
        n_params = sum(p.numel() for p in model.parameters())
        init_state = copy.deepcopy(model.state_dict())
        wall, _, closing = _take_turns(a, names, init_state, block * args.reps, block, loads)
        with tempfile.TemporaryDirectory() as d, kernel_timer() as acc:
            run_config(SPINE, init_state, a, batches(a, a.warmup + a.steps), Path(d), kernels=acc)
        base_ms = statistics.fmean(wall["baseline"]) * 1e3
        k_ms = acc["s"] / acc["steps"] * 1e3
        r = _block_ratios(wall, closing[SPINE][0], SPINE, block)
        aa = _block_ratios(wall, 0.0, "baseline (A/A)", block)
        elements = acc["elements"] / acc["steps"] / 1e6
        rows.append(f"| {width} | {n_params / 1e6:.1f} M | {base_ms:.1f} | {elements:.1f}"
                    f" | {k_ms:.1f} ({k_ms / base_ms * 100:.1f}%) | {_spread(r)} | {min(aa):.3f} to {max(aa):.3f} |")
    return _section("## How the spine's cost follows the model's width", [
        _provenance(args, argv, load_before, loads),
        f"Model: transformers GPT-2, {args.layers} layers, sequence {args.seq}, batch {args.batch}, vocabulary "
        f"{args.vocab}, random init, AdamW; device {args.device}; the width varies. At each width the baseline, its "
        "A/A run and the spine configuration (5 streams, every module and parameter, spine every step, no sketches) "
        "each train their own copy of the model in one process, taking turns step by step in an order rotated every "
        f"round ({args.warmup} warm-up rounds, then {args.reps} blocks of {block} timed rounds); ratio = the spine's "
        "time over a block (its close() spread over the timed rounds) / the baseline's over the same block, shown as "
        "median [min, max] over the blocks. The kernels' time is from one more run of the spine configuration, its "
        "calls into the compiled kernels timed. The elements a step reads grow with the width, the training's "
        "arithmetic faster (its matrix products with the width's square): the kernels' share of the step falls as "
        "the model grows."],
        ["width", "parameters", "baseline ms/step (mean over the timed rounds)", "elements reduced per step (M)",
         "kernels ms/step (share of the baseline step)", "spine ratio to baseline (wall)", "noise band (A/A)"],
        rows, [])


def _take_turns(args: argparse.Namespace, names: list[str], init_state: dict, timed: int, block: int,
                loads: list[float]
                ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, tuple[float, float]]]:
    """Train every configuration of ``names`` on its own copy of the model from ``init_state``, one step each per
    round in an order rotated every round (``args.warmup`` rounds, then ``timed``): the timed steps' wall-clock and
    CPU seconds per configuration, and a trainhist configuration's close() time (the rows it still held) spread
    over the timed rounds, per step (0 for the others). ``loads`` gets the load average after every ``block``
    rounds."""
    data = batches(args, args.warmup + timed)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as d:
        runners = {n: Runner(n, init_state, args, data, Path(d)) for n in names}
        for r in range(args.warmup + timed):
            if r == args.warmup:
                for run in runners.values():
                    run.settle()
            for n in names[r % len(names):] + names[: r % len(names)]:
                dw, dc = runners[n].step(r)
                if r >= args.warmup:
                    wall[n].append(dw)
                    cpu[n].append(dc)
            if r % block == block - 1:
                loads.append(os.getloadavg()[0])
                print(f"width {args.width} round {r}: " + ", ".join(f"{n.split(',')[0]} {wall[n][-1] * 1e3:.0f}"
                                                                    for n in names)
                      if wall[names[0]] else f"round {r} (warm-up)", flush=True)
        closing = {n: runners[n].close() for n in names}
    per_step = {n: (w / timed, c / timed) if n.startswith("trainhist") else (0.0, 0.0) for n, (w, c) in closing.items()}
    return wall, cpu, per_step


def _section(title: str, paragraphs: list[str], columns: list[str], rows: list[str], after: list[str]) -> str:
    """A section of the published file: its title, its paragraphs, a table of ``columns`` and ``rows``, then the
    lines ``after`` it."""
    head = [title, ""] + [line for p in paragraphs for line in (p, "")]
    return "\n".join([*head, "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows, *after]) + "\n"


def _spread(xs: list[float]) -> str:
    """Ratios as the tables show them: median [min, max]."""
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def _block_ratios(times: dict[str, list[float]], closing: float, n: str, block: int) -> list[float]:
    """Per block of rounds: ``n``'s time over the block (``closing`` added to each step: its close() time per
    step) / the baseline's over the same rounds."""
    return [(sum(times[n][i:i + block]) + closing * block) / sum(times["baseline"][i:i + block])
            for i in range(0, len(times[n]), block)]


def lockstep(args: argparse.Namespace, argv: list[str] | None, configs: list[tuple[str, str]]) -> str:
    """Every configuration trains its own copy of the model in this process, one step each per round in an order
    rotated every round: a slow spell of the machine falls on all of them alike. Ratios per block of rounds (one
    whole period of every selected cadence), median [min, max] over the blocks."""
    names = [c[0] for c in configs]
    block = math.lcm(*(period(n) or 1 for n in names))
    timed = -(-args.steps // block) * block
    load_before, loads = os.getloadavg(), [os.getloadavg()[0]]
    wall, cpu, closing = _take_turns(args, names, copy.deepcopy(make_model(args).state_dict()), timed, block, loads)

    rows = []
    for n, cov in configs:
        r, c = _block_ratios(wall, closing[n][0], n, block), _block_ratios(cpu, closing[n][1], n, block)
        close_ms = closing[n][0] * 1e3
        rows.append(f"| {n} | {cov} | {statistics.fmean(wall[n]) * 1e3 + close_ms:.1f} | {close_ms:.1f} | "
                    f"{_spread(r)} | {_spread(c)} |")
    aa, aac = _block_ratios(wall, 0.0, "baseline (A/A)", block), _block_ratios(cpu, 0.0, "baseline (A/A)", block)
    return _section("## Step by step, side by side", [
        _provenance(args, argv, load_before, loads),
        f"Model: transformers GPT-2, {args.layers} layers, width {args.width}, sequence {args.seq}, batch "
        f"{args.batch}, vocabulary {args.vocab}, random init, AdamW; device {args.device}. Every configuration "
        "trains its own copy of the model (the same initial weights, the same tokens) in this one process, and they "
        "take turns step by step: each round runs one step of every configuration, in an order rotated every round "
        f"({args.warmup} warm-up rounds, then {timed} timed rounds). A slow spell of the machine falls on every "
        "configuration alike, where the table above compares whole runs made tens of seconds apart. The timed rounds "
        f"are cut into {timed // block} blocks of {block} round(s) (one whole period of every cadence here: each "
        "block holds the same recording steps); ratio = a configuration's time over a block / the baseline's over "
        "the same block, shown as median [min, max] over the blocks. trainhist commits its rows every 30 s, inside "
        "some step, as in a long run; `close()` writes the rest: its time, spread over the timed rounds, is added "
        "(its own column). The peers are not in this table: their threads and processes would run during the "
        "other configurations' steps."],
        ["configuration", "coverage", "ms/step (wall, mean over the timed rounds)", "of which close()",
         "ratio to baseline (wall)", "ratio (CPU time)"],
        rows, ["", f"Noise band (A/A, over the blocks): wall {min(aa):.3f} to {max(aa):.3f}, CPU time {min(aac):.3f} "
               f"to {max(aac):.3f}."])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per configuration and repetition")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared 2-CPU machine every parallel op of a "
                    "two-thread run waits for a descheduled sibling, which swamps the comparison)")
    ap.add_argument("--only", nargs="*", help="substrings of configuration names to run (baselines always run)")
    ap.add_argument("--quick", action="store_true", help="skip the peers (wandb, TensorBoard)")
    ap.add_argument("--out", help="write the markdown table here")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--lockstep", action="store_true",
                    help="instead of whole runs in turn: every configuration trains its own model in this process and "
                    "they take turns step by step (--steps timed rounds; not the peers, whose background threads and "
                    "processes would run during the others' steps)")
    ap.add_argument("--append", action="store_true", help="append the table to --out as a section")
    mode.add_argument("--widths", type=int, nargs="+",
                    help="instead of the configurations' table: the spine configuration against the baseline at each "
                    "of these model widths (--width is ignored)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.widths:
        torch.set_num_threads(args.threads)
        return _emit(sweep(args, argv), args)
    configs = [c for c in CONFIGS if not (args.quick and is_peer(c[0]))]
    missing = [c[0] for c in configs if any(c[0].startswith(peer) and importlib.util.find_spec(pkg) is None
                                            for peer, pkg in PEER_PACKAGES.items())]
    configs = [c for c in configs if c[0] not in missing]
    if args.only:
        configs = [c for c in configs if c[0].startswith("baseline") or any(s in c[0] for s in args.only)]
    names = [c[0] for c in configs]
    torch.set_num_threads(args.threads)
    if args.lockstep:
        return _emit(lockstep(args, argv, [c for c in configs if not is_peer(c[0])]), args)
    load_before = os.getloadavg()
    loads: list[float] = []
    init_state = copy.deepcopy(make_model(args).state_dict())
    data = batches(args, args.warmup + args.steps)
    ratios: dict[str, list[float]] = {n: [] for n in names}
    cpu_ratios: dict[str, list[float]] = {n: [] for n in names}
    step_s: dict[str, list[float]] = {n: [] for n in names}
    deferred: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[: rep % len(names)]
            got, gotc, runs = {}, {}, {}
            loads.append(os.getloadavg()[0])
            for name in order:
                r = run_config(name, init_state, args, data, Path(d))
                runs[name] = r
                got[name], gotc[name] = r["mean" if period(name) else "median"]
                loads.append(os.getloadavg()[0])
                print(f"rep {rep} {name:48s} {got[name] * 1e3:8.1f} ms/step  {gotc[name] * 1e3:8.1f} ms cpu  "
                      f"load {loads[-1]:.2f}", flush=True)
            for name in names:
                base = runs["baseline"]["mean" if period(name) else "median"]  # like with like
                step_s[name].append(got[name])
                deferred[name].append(runs[name]["deferred"][0])
                ratios[name].append(got[name] / base[0])
                cpu_ratios[name].append(gotc[name] / base[1])
        breakdown = None
        if SPINE in names and args.device == "cpu" and _cpu_method("cpu").startswith("the fused CPU kernel"):
            with kernel_timer() as acc:  # one more run of the spine configuration, its kernel calls timed
                run_config(SPINE, init_state, args, data, Path(d), kernels=acc)
            breakdown = dict(acc)
    intro = [
        _provenance(args, argv, load_before, loads)
        + (f" Not run: {', '.join(missing)} (the package is not installed here)." if missing else ""),
        f"Model: transformers GPT-2, {args.layers} layers, width {args.width}, sequence {args.seq}, "
        f"batch {args.batch}, vocabulary {args.vocab}, random init, AdamW; device {args.device}. "
        f"{args.reps} repetitions, each running every "
        f"configuration once in rotated order ({args.warmup} warm-up + {args.steps} timed steps, or one whole "
        "cadence period where a configuration records at a cadence, each). Ratio = a configuration's step time / "
        "the baseline's in the same repetition (median over the timed steps; for the configurations that record at "
        "a cadence, the mean over one whole cadence period, recording steps included, divided by the baseline's "
        "mean); shown as median [min, max] over repetitions. trainhist writes the rows it buffers at a commit: every "
        "30 s by default, so inside some step of a long run; here the warm-up steps' rows are committed before the "
        "timed steps, and the timed steps' rows by `close()`, whose time, divided by the timed steps, is added to each "
        "step of a trainhist configuration (a long run commits about 30 steps at a time here, these runs 10 to 12: "
        "the fixed cost of a commit and of closing the file weighs more; the 'written at close' column). The peers "
        "write from their own threads and processes during the steps; their shutdown is not counted. The CPU-time "
        "ratio uses the process CPU time of each step instead of wall-clock time: "
        "less sensitive to other jobs taking the CPUs, it is the cost of the work itself.",
    ]
    rows, after = [], []
    for name, cov in configs:
        r, c = ratios[name], cpu_ratios[name]
        rows.append(f"| {name} | {cov} | {statistics.median(step_s[name]) * 1e3:.1f} | "
                     f"{statistics.median(deferred[name]) * 1e3:.1f} | "
                     f"{_spread(r)} | {_spread(c)} |")
    if breakdown is not None:
        per = breakdown["steps"]
        k_ms = breakdown["s"] / per * 1e3
        extra = [(a - b) * 1e3 for a, b in zip(step_s[SPINE], step_s["baseline"])]
        after += ["", f"Where the spine configuration's time goes (one more run of it, its calls into the compiled "
                  f"kernels timed): {breakdown['calls'] / per:.0f} kernel calls a step read "
                  f"{breakdown['elements'] / per / 1e6:.1f} M elements in {k_ms:.1f} ms "
                  f"({breakdown['s'] / max(breakdown['elements'], 1) * 1e9:.3f} ns per element, the parameter updates' "
                  f"gathers included); its step took {statistics.median(extra):.1f} ms longer than the baseline's "
                  "(median over the repetitions, the time written at close included): what the kernels do not "
                  "account for is the Python of the hooks, decoding the rows and writing them."]
    aa, aac = ratios["baseline (A/A)"], cpu_ratios["baseline (A/A)"]
    after += ["", f"Noise band (A/A): wall {min(aa):.3f} to {max(aa):.3f}, CPU time {min(aac):.3f} to {max(aac):.3f}; "
              "a ratio inside it is not distinguishable from no overhead on this machine."]
    return _emit(_section("# Overhead of recording a training loop", intro,
                          ["configuration", "coverage", "ms/step (wall, median over reps)", "of which written at close",
                           "ratio to baseline (wall)", "ratio (CPU time)"], rows, after), args)


def _emit(text: str, args: argparse.Namespace) -> int:
    """Print ``text`` and write it to ``--out`` (appended as a section with ``--append``)."""
    print(text)
    if args.out:
        if args.append:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write("\n" + text)
        else:
            Path(args.out).write_text(text, "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
