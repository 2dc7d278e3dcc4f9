"""Benchmark ``trainhist.merge``: throughput (MB/s of input) and peak memory of the merging process.

Generates ``--shards`` files of at least ``--mb`` MB each, one per rank of one run (``HistoryWriter(...,
rank=r, world_size=n)`` fed precomputed Summaries with sketches), merges them in a child process and reads its
peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss`` in that process). Writes ``benchmarks/merge.md`` (with ``--write``).

    .venv/bin/python tools/bench_merge.py --shards 8 --mb 100 --write
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

SITES = 256
CHILD = r"""
import json, resource, sys, time, trainhist
t = time.perf_counter()
rep = trainhist.merge(json.loads(sys.argv[1]), sys.argv[2], codec=sys.argv[3])
print(json.dumps({"seconds": time.perf_counter() - t, "rows_in": rep.rows_in, "rows_out": rep.rows_out,
                  "bytes_in": rep.bytes_in, "bytes_out": rep.bytes_out,
                  "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _summaries(seed: int, n: int = 64) -> list:
    from trainhist import summarize

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-4, 2)).astype(np.float32)
        if i % 7 == 0:
            x[:3] = [np.nan, np.inf, 0.0]
        out.append(summarize(x))
    return out


def _gen(args: tuple) -> tuple[str, int, int]:
    path, run_id, rank, world, target, codec, every = args
    import trainhist

    sums = _summaries(rank)
    rng = np.random.default_rng(100 + rank)
    with trainhist.HistoryWriter(path, run_id=run_id, rank=rank, world_size=world, fsync="never", codec=codec,
                                 commit_every=10**9, commit_seconds=1e9, host="bench") as w:
        sites = [w.site(f"layers.{i // 4}.{['attn', 'mlp', 'ln', 'out'][i % 4]}", "activation") for i in range(SITES)]
        step = 0
        rows = 0
        while True:
            picks = rng.integers(0, len(sums), SITES)
            for s, k in zip(sites, picks.tolist()):
                w.observe(s, step, summary=sums[k])
            w.step_truth(step, applied=True, tokens=4096, samples=8)
            rows += SITES
            step += 1
            if step % every == 0:
                w.commit()
                if os.path.getsize(path) >= target:
                    break
    return path, os.path.getsize(path), rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--mb", type=float, default=100.0, help="minimum size of each shard in MB (10**6 bytes)")
    ap.add_argument("--codec", default="shuffle", help="codec of the generated shards")
    ap.add_argument("--out-codec", default="shuffle", help="codec of the merged file")
    ap.add_argument("--commit-every", type=int, default=50, help="steps per commit (= rows per input chunk)")
    ap.add_argument("--dir", default=None, help="where to put the shards (default: a temporary directory)")
    ap.add_argument("--write", action="store_true", help="write benchmarks/merge.md")
    ap.add_argument("--append", action="store_true", help="append to benchmarks/merge.md instead of replacing it")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    d = tmp.name
    run_id = uuid.uuid4().hex
    jobs = [(os.path.join(d, f"rank{r}.th"), run_id, r, args.shards, int(args.mb * 1e6), args.codec,
             args.commit_every)
            for r in range(args.shards)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(min(args.shards, os.cpu_count() or 1)) as pool:
        made = pool.map(_gen, jobs)
    gen_s = time.perf_counter() - t0
    paths = [p for p, _, _ in made]
    total = sum(n for _, n, _ in made)
    out = os.path.join(d, "merged.th")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(paths), out, args.out_codec], capture_output=True,
                       text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        print(r.stderr, file=sys.stderr)
        return 1
    child = json.loads(r.stdout)
    # the merging process's own high-water mark (RUSAGE_CHILDREN would also count the generator processes)
    peak_mb = child["maxrss_kib"] / 1024  # Linux: KiB
    res = {
        "shards": args.shards, "shard_codec": args.codec, "out_codec": args.out_codec,
        "input_bytes": total, "rows_in": child["rows_in"], "rows_out": child["rows_out"],
        "output_bytes": child["bytes_out"], "merge_seconds": child["seconds"], "process_seconds": wall,
        "mb_per_s": total / 1e6 / child["seconds"], "mb_per_s_process": total / 1e6 / wall,
        "peak_rss_mb": peak_mb, "generate_seconds": gen_s, "commit_every": args.commit_every,
    }
    print(json.dumps(res, indent=1))
    if args.write:
        cmd = " ".join(["python", "tools/bench_merge.py"] + sys.argv[1:])
        ok_t = "met" if res["mb_per_s"] >= 100 else "MISSED"
        ok_m = "met" if peak_mb < 500 else "MISSED"
        text = f"""# Merge benchmark

Generated by `{cmd}` (`tools/bench_merge.py`); do not edit by hand.

Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__},
{platform.platform()}.

Input: {args.shards} shards of one run (ranks 0..{args.shards - 1}), written by `HistoryWriter` with codec
`{args.codec}`, {SITES} activation sites, every site observed at every step with a precomputed Summary of a
4096-element float32 tensor (spine + scale-2 sketch), a step-truth row per step, a commit every {args.commit_every} steps (so input chunks hold {args.commit_every}
rows).
The merge runs in a child process (`trainhist.merge(paths, out, codec="{args.out_codec}")`); peak memory is
that process's RSS high-water mark (`getrusage(RUSAGE_SELF).ru_maxrss` read by the child when the merge
returns), which includes the interpreter and numpy (about 40 MB).

| measure | value | target |
|---|---|---|
| input | {total / 1e6:.1f} MB in {args.shards} files ({total / 1e6 / args.shards:.1f} MB each) | ≥ 100 MB each |
| rows in → out | {child['rows_in']:,} → {child['rows_out']:,} | |
| output | {child['bytes_out'] / 1e6:.1f} MB | |
| merge time (inside the child) | {child['seconds']:.2f} s | |
| **throughput** | **{res['mb_per_s']:.1f} MB/s** of input ({res['mb_per_s_process']:.1f} MB/s counting interpreter start) | ≥ 100 MB/s: {ok_t} |
| **peak RSS** | **{peak_mb:.0f} MB** | < 500 MB: {ok_m} |
| shard generation (not part of the merge) | {gen_s:.1f} s | |
"""
        os.makedirs("benchmarks", exist_ok=True)
        with open(os.path.join("benchmarks", "merge.md"), "a" if args.append else "w") as f:
            f.write(text)
        extra = os.environ.get("BENCH_NOTES")
        if extra:
            with open(os.path.join("benchmarks", "merge.md"), "a") as f:
                f.write("\n" + open(extra).read())
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
