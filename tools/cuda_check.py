"""The CUDA checks of the torch collector, as one prepared script for a machine with a GPU.

    python tools/cuda_check.py --out benchmarks/cuda.md                  # on a GPU machine
    TRITON_INTERPRET=1 python tools/cuda_check.py --device cpu --quick   # rehearsal of the same code on the CPU

On a machine with torch but without this project installed, ``PYTHONPATH=src`` and the reader's dependencies
(crc32c, jsonschema and its own: jsonschema-specifications, referencing, rpds-py; numpy and msgpack) suffice;
transformers is needed for checks 2 and 3. A run takes about two minutes on one H200.

1. Bit-exactness: the on-device reductions (``reduce_into`` + one transfer + ``decode_row``; the fused Triton kernel,
   the default on CUDA, and the torch ops with and without the sketch; each whole and in two parts merged in one
   row) against the numpy reference ``trainhist.summarize`` on the same tensors — counts, every bin, min and max
   must be equal bit for bit (float16, bfloat16, float32, float64; special values, subnormals, bin edges, sizes
   from 0 to 4M). 1b: the collector's rows on the device (``batch_outputs=True``) against the reference of clones
   of the tensors its hooks saw. 1c: every family at once through the batched kernel (``triton_many``).
2. No hidden host sync: real training steps (a HF GPT-2 and an MLP; fp32, and fp16 autocast with a GradScaler) run
   under ``torch.cuda.set_sync_debug_mode("warn")`` with and without the collector, counting synchronising calls
   and where they happen; the collector may add none. Then ``set_sync_debug_mode("error")`` around whole steps of
   the MLP (whose own loop makes none) with the collector: no error. Its one deliberate transfer per step is a
   non-blocking copy into pinned memory, awaited through an event.
3. Overhead on the GPU: ``tools/bench_overhead.py --device cuda`` (interleaved A/B with an A/A noise band).

Exit status 0 when checks 1 (with 1b and 1c) and 2 pass; the report is rewritten to ``--out`` after each check.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainhist import summarize  # noqa: E402
from trainhist.grid import THRESH_F32  # noqa: E402
from trainhist.torch.reduce import Ledger, decode_row, reduce_into, triton_many  # noqa: E402


def cases(quick: bool) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    n = 100_000 if quick else 4_000_000
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        out.append((f"normal {dt}", (torch.randn(n, generator=g) * 0.02).to(dt)))
        out.append((f"wide {dt}", (torch.randn(n // 10, generator=g) * 2.0 ** torch.randint(-60, 40, (n // 10,),
                                                                                            generator=g)).to(dt)))
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 2.0**-48, 2.0**16, 1e-45, -1e-45,
                            3.4e38, -3.4e38, 1.0, -1.0], dtype=torch.float32)
    out.append(("special float32", special))
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    out.append(("every float16 bit pattern", bits.view(torch.float16)))
    out.append(("every bfloat16 bit pattern", bits.view(torch.bfloat16)))
    edges = []
    for e in range(-50, 17):
        for t in THRESH_F32:
            for d in (-1, 0, 1):
                edges.append(((e + 127) << 23) | (t + d))
    edge = torch.tensor(edges, dtype=torch.int32).view(torch.float32)
    out.append(("bin-edge mantissas float32 (T-1, T, T+1)", torch.cat([edge, -edge])))
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0xFFC00001 - (1 << 32), 0x7FFFFFFF], dtype=torch.int32)
    out.append(("NaN payloads float32", nans.view(torch.float32)))
    out.append(("empty", torch.zeros(0)))
    return out


def reference(t: torch.Tensor, times: int = 1):
    """The numpy reference summary of ``t`` (repeated ``times`` times)."""
    if t.dtype == torch.bfloat16:
        return summarize(np.tile(t.view(torch.int16).numpy().view(np.uint16), times), dtype="bfloat16")
    return summarize(np.tile(t.numpy(), times))


def differences(got, ref) -> list[str]:
    """The fields in which ``got`` differs from the reference ``ref`` (empty: equal bit for bit)."""
    out = [f"{k} {getattr(got, k)} != {getattr(ref, k)}" for k in ("count", "nan", "pinf", "ninf", "zero")
           if getattr(got, k) != getattr(ref, k)]
    for k in ("min", "max"):
        a, b = np.float64(getattr(got, k)), np.float64(getattr(ref, k))
        if a.tobytes() != b.tobytes():
            out.append(f"{k} {a!r} != {b!r}")
    if (got.sketch is None) != (ref.sketch is None):
        out.append("sketch present/absent")
    elif got.sketch is not None and got.sketch != ref.sketch:
        g, r = got.sketch, ref.sketch
        nb = int(np.sum(g.pos != r.pos)) + int(np.sum(g.neg != r.neg)) if g.pos.shape == r.pos.shape else -1
        out.append(f"sketch: {nb} bins differ, scale {g.scale}/{r.scale}, under/over "
                   f"{(g.under_pos, g.under_neg, g.over_pos, g.over_neg)} != "
                   f"{(r.under_pos, r.under_neg, r.over_pos, r.over_neg)}")
    return out


def methods(device: str) -> list[str]:
    """The device reductions checked: the fused Triton kernel (the default on CUDA; on a CPU rehearsal only under
    ``TRITON_INTERPRET=1``) and the torch ops (``index_add``, with and without the sketch)."""
    triton = device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return (["triton"] if triton else []) + ["index_add", "index_add spine-only"]


def check_exact(device: str, quick: bool) -> tuple[int, list[str]]:
    """Every tensor family through each device reduction, one transfer, and the decoder, against the reference;
    each also reduced in two halves into one row (the merge a micro-batch makes)."""
    failures = []
    ms = methods(device)
    for name, t in cases(quick):
        ledger = Ledger(torch.device(device))
        x = t.to(device)
        diff, ok = [], []
        for m in ms:
            try:
                for part in ((x,), (x[: x.numel() // 3], x[x.numel() // 3:])):
                    for y in part:
                        reduce_into(y, ledger.row((m, len(part))), method=m.split()[0], sketch="spine" not in m)
                ok.append(m)
            except Exception:  # noqa: BLE001 -- a failing method is a finding: report it, check the others
                diff.append(f"{m} raised: {traceback.format_exc(limit=-3)}")
        pending = ledger.transfer()
        data = pending.wait()
        ref = reference(t)
        for m in ok:
            for k in (1, 2):
                got = decode_row(pending.row(data, (m, k)), t.numel(), sketch="spine" not in m)
                diff += [f"{m}{' in two parts' if k == 2 else ''}: {d}" for d in differences(got, ref)
                         if "spine" not in m or "sketch" not in d]
        if diff:
            failures.append(f"{name} ({'; '.join(diff)})")
        print(f"  {'ok  ' if not diff else 'FAIL'} {name} {'; '.join(diff)}", flush=True)
    return len(cases(quick)), failures


def check_batched(device: str, quick: bool) -> tuple[int, list[str]]:
    """Every tensor family at once through the batched Triton kernel (``triton_many``: one launch per dtype, the
    collector's path for parameters, gradients, updates and held outputs), twice into the same rows."""
    fams = [(name, t.to(device)) for name, t in cases(quick) if t.numel()]
    ledger = Ledger(torch.device(device))
    offsets = ledger.offsets([name for name, _ in fams])
    done = set()
    for _ in range(2):
        done = set(triton_many([t for _, t in fams], offsets, ledger))
    pending = ledger.transfer()
    data = pending.wait()
    failures = []
    for i, (name, t) in enumerate(fams):
        if i not in done:
            failures.append(f"{name} (not reduced by the batched kernel)")
            continue
        diff = differences(decode_row(pending.row(data, name), 2 * t.numel(), sketch=True), reference(t.cpu(), 2))
        if diff:
            failures.append(f"{name} ({'; '.join(diff)})")
        print(f"  {'ok  ' if not diff else 'FAIL'} {name} {'; '.join(diff)}", flush=True)
    return len(fams), failures


def check_collector(device: str) -> tuple[int, list[str]]:
    """The collector's rows on the device (``batch_outputs=True``: outputs held and reduced in batches of 3, so
    that batches fill up mid-forward and mid-backward; an in-place ReLU after a Linear; two micro-batches per
    step) against the numpy reference of clones of the very tensors its hooks saw: every activation and
    activation-gradient row."""
    import trainhist
    from trainhist.torch import Collector
    from trainhist.torch import collector as cm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(inplace=True), torch.nn.Linear(256, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device)
    caps: dict[tuple, list[torch.Tensor]] = {}
    step = [0]

    def capture(name: str, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        caps.setdefault((step[0], "activation", name), []).append(out.detach().clone())
        if out.requires_grad:
            out.register_hook(lambda g: caps.setdefault((step[0], "activation_grad", name), []).append(g.clone()))

    for name, m in model.named_modules():
        if name:
            m.register_forward_hook(lambda mod, a, o, name=name: capture(name, mod, a, o))
    saved = cm.DEFER_TENSORS
    cm.DEFER_TENSORS = 3
    try:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "c.thist"
            col = Collector(model, path, streams=("activation", "activation_grad"), every=1, sketch_every=1,
                            batch_outputs=True)
            col.discover(torch.randn(4, 64, device=device))
            caps.clear()  # (what discover's forward produced is not recorded)
            g = torch.Generator().manual_seed(1)
            for step[0] in range(3):
                with col.step(step[0]):
                    for _ in range(2):
                        x = (torch.randn(32, 64, generator=g) * 2.0 ** (8 * step[0])).to(device)
                        x[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
                        model(x).square().mean().backward()
            col.close()
            h = trainhist.open(path)
            failures = []
            for (st, stream, name), ts in sorted(caps.items()):
                sp = h.spine(name, stream)
                (i,) = np.flatnonzero(sp.step == st)
                ref = summarize(np.concatenate([t.reshape(-1).cpu().numpy() for t in ts]))
                counts = ("count", "nan", "pinf", "ninf", "zero")
                got = [sp.presence_names[i]] + [int(getattr(sp, f)[i]) for f in counts]
                want = ["observed"] + [getattr(ref, f) for f in counts]
                same = got == want and all(np.float64(getattr(sp, f)[i]).tobytes()
                                           == np.float64(getattr(ref, f)).tobytes() for f in ("min", "max"))
                if not same:
                    failures.append(f"{name} {stream} step {st}: {got} min/max {sp.min[i]!r}/{sp.max[i]!r}, want "
                                    f"{want} {ref.min!r}/{ref.max!r}")
            print(f"  collector rows: {len(caps) - len(failures)} of {len(caps)} equal", flush=True)
            return len(caps), failures
    finally:
        cm.DEFER_TENSORS = saved


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.GELU(),
                               torch.nn.ReLU(inplace=True), torch.nn.Linear(256, 64))


def _syncs(device: str, model_name: str, instrumented: bool, amp: bool, mode: str) -> tuple[int, dict[str, int], str]:
    """Synchronising calls over 5 training steps (after 3 warm-up steps) under ``set_sync_debug_mode(mode)``:
    (count, {location: count}, error text or '')."""
    from trainhist.torch import Collector

    torch.manual_seed(0)
    if model_name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=512))
        x = torch.randint(0, 512, (4, 64))
        batch = {"input_ids": x.to(device), "labels": x.to(device)}
        loss_of = lambda m: m(**batch).loss  # noqa: E731
    else:
        model = _mlp()
        x = torch.randn(32, 64).to(device)
        batch = x
        loss_of = lambda m: m(x).pow(2).mean()  # noqa: E731
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, enabled=amp)
    col = None
    with tempfile.TemporaryDirectory() as d:
        if instrumented:
            col = Collector(model, Path(d) / "s.thist", every=1, sketch_every=1)
            col.discover(batch)
            col.attach(optimizer=opt, scaler=scaler if amp else None)

        def step(i: int) -> None:
            ctx = col.step(i) if col is not None else contextlib.nullcontext()
            with ctx:
                with torch.autocast(device, dtype=torch.float16, enabled=amp):
                    loss = loss_of(model)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)

        for i in range(3):  # warm-up: allocations, lazy inits, pinned buffers
            step(i)
        if device == "cuda":
            torch.cuda.synchronize()
        err = ""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(mode)
            try:
                for i in range(3, 8):
                    step(i)
            except RuntimeError as e:
                err = str(e).splitlines()[0]
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        if col is not None:
            col.close()
    where: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            key = f"{Path(w.filename).name}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
    return sum(where.values()), where, err


def check_sync(device: str) -> tuple[bool, str]:
    """Host synchronisations without and with the collector, in "warn" mode (counted, with where they happen) for
    GPT-2 in fp32 and under fp16 autocast with a GradScaler, then in "error" mode for an MLP whose own loop makes
    none: there the collector must run 5 whole steps without raising."""
    lines, ok = [], True
    lines.append("| model | precision | syncs per 5 steps, without the collector | with it | where (with it) |")
    lines.append("|---|---|---|---|---|")
    for model_name in ("gpt2", "mlp"):
        for amp in (False, True):
            base, wb, _ = _syncs(device, model_name, False, amp, "warn")
            inst, wi, _ = _syncs(device, model_name, True, amp, "warn")
            extra = {k: v for k, v in wi.items() if v > wb.get(k, 0)}
            ok &= inst <= base
            lines.append(f"| {model_name} | {'fp16 autocast + GradScaler' if amp else 'fp32'} | {base} | {inst} | "
                         f"{', '.join(f'{k} ×{v}' for k, v in sorted(wi.items())) or '–'}"
                         f"{' (collector adds: ' + ', '.join(sorted(extra)) + ')' if extra else ''} |")
            print("  " + lines[-1], flush=True)
    base_n, _, base_err = _syncs(device, "mlp", False, False, "error")
    n, _, err = _syncs(device, "mlp", True, False, "error")
    ok &= not err or bool(base_err)
    text = "\n".join(lines) + (
        f"\n\n`torch.cuda.set_sync_debug_mode('error')` around 5 whole fp32 steps of the MLP: without the collector "
        f"{'raised: ' + base_err if base_err else 'no error'}; with the collector "
        f"{'raised: ' + err if err else 'no error'}.\n")
    print("  error mode, MLP:", base_err or "no error", "/", err or "no error", flush=True)
    return ok, text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="123", help="which checks to run (default 123: all)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the overhead benchmark")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        from trainhist.torch import reduce as rd

        rd.CPU_METHOD = "triton"  # the rehearsal takes the GPU's path (the Triton kernels, in the interpreter)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a rehearsal", file=sys.stderr)
        return 2
    report: list[str] = []

    def emit(text: str) -> None:  # the report so far, rewritten after every section (a timeout keeps what ran)
        report.append(text)
        print(text, flush=True)
        if a.out:
            Path(a.out).write_text("".join(report), "utf-8")

    if a.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        dev = (f"{p.name} ({p.multi_processor_count} multiprocessors, {p.total_memory / 2**30:.0f} GiB), "
               f"CUDA {torch.version.cuda}")
    else:
        dev = platform.processor() or platform.machine()
    emit(f"# CUDA checks of the torch collector\n\nGenerated by `python tools/cuda_check.py {' '.join(sys.argv[1:])}` "
         f"on {dev}, torch {torch.__version__}, Python {platform.python_version()}, "
         f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n"
         + ("" if a.device == "cuda" else "**A CPU rehearsal of the script's code paths, not a CUDA result.**\n\n"))
    ok = True

    def guarded(section: str, fn):  # a section that raises is reported, and the next one still runs
        try:
            return fn()
        except Exception:  # noqa: BLE001
            emit(f"## {section}\n\nRaised:\n\n```\n{traceback.format_exc()}```\n\n")
            return None

    def counted(label: str, section: str, fn, text: str) -> None:  # a check that returns (how many, failures)
        nonlocal ok
        print(label, flush=True)
        got = guarded(section, fn)
        n, fails = got if got is not None else (0, ["raised"])
        ok &= not fails
        emit(text.format(good=n - len(fails), n=n) + (": failures " + "; ".join(fails) if fails else "") + ".\n\n")

    if "1" in a.sections:
        counted("1. bit-exactness against the numpy reference", "1. Bit-exactness",
                lambda: check_exact(a.device, a.quick),
                "## 1. Bit-exactness\n\n{good} of {n} tensor families equal the numpy reference "
                "`trainhist.summarize` bit for bit in counts (total, NaN, +inf, -inf, zero), every bin, min and max, "
                f"through each reduction ({', '.join(methods(a.device))}), whole and in two parts merged in one "
                "row, the one transfer and the decoder")
        counted("1b. the collector's rows", "1b. The collector's rows", lambda: check_collector(a.device),
                "The collector on the device: {good} of {n} activation and activation-gradient rows (an MLP with an "
                "in-place ReLU, two micro-batches a step, `batch_outputs=True` with batches of 3) equal the numpy "
                "reference of clones of the tensors its hooks saw (counts, min, max)")
        if "triton" in methods(a.device):
            counted("1c. the batched kernel", "1c. Bit-exactness of the batched kernel",
                    lambda: check_batched(a.device, a.quick),
                    "{good} of {n} non-empty tensor families, all reduced together by the batched kernel "
                    "(`triton_many`, one launch per dtype) twice into the same rows, equal the reference of the "
                    "family taken twice")
    if "2" in a.sections:
        print("2. host synchronisations", flush=True)
        sync_ok, text = guarded("2. Host synchronisation", lambda: check_sync(a.device)) or (False, "(raised)")
        ok &= sync_ok
        emit("## 2. Host synchronisation\n\nSynchronising calls reported by `torch.cuda.set_sync_debug_mode('warn')` "
             "over 5 training steps (after 3 warm-up steps), every site recorded with spine and sketch every step. "
             "The collector's one deliberate transfer per step is a non-blocking copy into pinned memory, "
             "awaited through a CUDA event one step later; neither is a synchronising call in this sense.\n\n"
             + text + "\n")
    if "3" in a.sections:
        import bench_overhead

        print("3. overhead", flush=True)
        args = ["--device", a.device, "--reps", "2" if a.quick else str(a.reps), "--steps", "3" if a.quick else "12",
                "--only", "spine", "sketches", "default"]
        if a.device == "cuda":
            args += ["--threads", "4", "--layers", "12", "--width", "768", "--seq", "256", "--batch", "8",
                     "--vocab", "50257"]
        with tempfile.NamedTemporaryFile("r", suffix=".md") as f:
            if guarded("3. Overhead", lambda: bench_overhead.main(args + ["--out", f.name])) is not None:
                emit("## 3. Overhead\n\n" + Path(f.name).read_text().split("\n", 1)[1].lstrip("\n") + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
