"""The CUDA checks of the torch collector, as one prepared script for a machine with a GPU.

    python tools/cuda_check.py --out benchmarks/cuda.md            # on a GPU machine
    python tools/cuda_check.py --device cpu --quick                # rehearsal of the same code paths on the CPU

1. Bit-exactness: the on-device reduction (``reduce_into`` + one transfer + ``decode_row``; the sketch kernel and
   the spine-only kernel) against the numpy reference ``trainhist.summarize`` on the same tensors — counts, every
   bin, min and max must be equal bit for bit
   (float16, bfloat16, float32, float64; special values, subnormals, bin edges, sizes from 0 to 4M).
2. No hidden host sync: a real training step of a HF GPT-2 is run under ``torch.cuda.set_sync_debug_mode("warn")``
   with and without the collector; the collector may add no synchronising call (its one deliberate transfer is a
   non-blocking copy into pinned memory).
3. Overhead on the GPU: ``tools/bench_overhead.py --device cuda`` (interleaved A/B with an A/A noise band).

Exit status 0 when checks 1 and 2 pass; the report is written to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import platform
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainhist import summarize  # noqa: E402
from trainhist.grid import THRESH_F32  # noqa: E402
from trainhist.torch.reduce import Ledger, decode_row, reduce_into  # noqa: E402


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


def reference(t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        return summarize(t.view(torch.int16).numpy().view(np.uint16), dtype="bfloat16")
    return summarize(t.numpy())


def check_exact(device: str, quick: bool) -> tuple[int, list[str]]:
    failures = []
    for name, t in cases(quick):
        ledger = Ledger(torch.device(device))
        # on the CPU rehearsal, take the kernel path CUDA takes (index_add_, not bincount)
        reduce_into(t.to(device), ledger.row(name), method="index_add")
        reduce_into(t.to(device), ledger.row((name, "spine")), sketch=False)  # the spine-only kernel
        pending = ledger.transfer()
        data = pending.wait()
        got = decode_row(pending.row(data, name), t.numel(), sketch=True)
        spine = decode_row(pending.row(data, (name, "spine")), t.numel(), sketch=False)
        ref = reference(t)
        same = all(
            (g.count, g.nan, g.pinf, g.ninf, g.zero) == (ref.count, ref.nan, ref.pinf, ref.ninf, ref.zero)
            and np.float64(g.min).tobytes() == np.float64(ref.min).tobytes()
            and np.float64(g.max).tobytes() == np.float64(ref.max).tobytes()
            for g in (got, spine)
        ) and got.sketch == ref.sketch
        if not same:
            failures.append(name)
        print(f"  {'ok  ' if same else 'FAIL'} {name}", flush=True)
    return len(cases(quick)), failures


def check_sync(device: str) -> tuple[int, int]:
    """Synchronising calls reported per training step without and with the collector."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainhist.torch import Collector

    counts = []
    for instrumented in (False, True):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=512)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 512, (4, 64), device=device)
        col = None
        with tempfile.TemporaryDirectory() as d:
            if instrumented:
                col = Collector(model, Path(d) / "s.thist", every=1, sketch_every=1)
                col.discover({"input_ids": x, "labels": x})
                col.attach(optimizer=opt)

            def step(i: int) -> None:
                ctx = col.step(i) if col is not None else contextlib.nullcontext()
                with ctx:
                    loss = model(input_ids=x, labels=x).loss
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            for i in range(3):  # warm-up: allocations, lazy inits, pinned buffers
                step(i)
            if device == "cuda":
                torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    for i in range(3, 8):
                        step(i)
                finally:
                    if device == "cuda":
                        torch.cuda.set_sync_debug_mode("default")
            if col is not None:
                col.close()
        counts.append(sum("synchroniz" in str(w.message).lower() for w in caught))
    return counts[0], counts[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a rehearsal", file=sys.stderr)
        return 2
    rep = io.StringIO()
    dev = torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or platform.machine()
    rep.write(f"# CUDA checks of the torch collector\n\nGenerated by `python tools/cuda_check.py {' '.join(sys.argv[1:])}`"
              f" on {dev}, torch {torch.__version__}.\n\n")
    if a.device != "cuda":
        rep.write("**A CPU rehearsal of the script's code paths, not a CUDA result.**\n\n")
    print("1. bit-exactness against the numpy reference", flush=True)
    n, fails = check_exact(a.device, a.quick)
    rep.write(f"## 1. Bit-exactness\n\n{n - len(fails)} of {n} tensor families equal the numpy reference bit for bit "
              f"(counts, every bin, min, max){': failures ' + ', '.join(fails) if fails else ''}.\n\n")
    print("2. host synchronisations per 5 steps (without, with the collector)", flush=True)
    base, inst = check_sync(a.device)
    rep.write(f"## 2. Host synchronisation\n\nSynchronising calls reported by `torch.cuda.set_sync_debug_mode('warn')` "
              f"over 5 training steps: {base} without the collector, {inst} with it (the collector's own: "
              f"{inst - base}).\n\n")
    ok = not fails and inst <= base
    if not a.no_overhead:
        import bench_overhead

        out = io.StringIO()
        args = ["--device", a.device, "--reps", "2" if a.quick else "5", "--steps", "3" if a.quick else "20"]
        if a.device == "cuda":
            args += ["--layers", "12", "--width", "768", "--seq", "512", "--batch", "8", "--vocab", "50257"]
        with tempfile.NamedTemporaryFile("r", suffix=".md") as f:
            bench_overhead.main(args + ["--out", f.name])
            out.write(Path(f.name).read_text())
        rep.write("## 3. Overhead\n\n" + out.getvalue().split("\n", 1)[1] + "\n")
    text = rep.getvalue()
    print(text)
    if a.out:
        Path(a.out).write_text(text, "utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
