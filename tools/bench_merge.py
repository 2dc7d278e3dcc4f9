"""Benchmark ``trainhist.merge``: throughput (MB/s of input) and peak memory of the merging process.

Generates ``--shards`` files of at least ``--mb`` MB each, one per rank of one run (``HistoryWriter(...,
rank=r, world_size=n)`` fed precomputed Summaries with sketches), then merges them ``--reps`` times per output
codec, each time in a fresh child process whose peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) it reads, and
once more under cProfile for the split of the time. The load average is read before every timed merge (other
work on the machine slows it down). Writes (``--write``) or appends (``--append``) a section of
``benchmarks/merge.md``.

    .venv/bin/python tools/bench_merge.py --shards 8 --mb 100 --codec raw --commit-every 200 --write
    .venv/bin/python tools/bench_merge.py --shards 8 --mb 100 --append     # the writer's defaults

Without ``--codec`` and ``--commit-every`` the shards are written with the writer's defaults: neither the codec
nor the commit cadence is passed to ``HistoryWriter`` (so ``packed``, and a commit every 200 steps or 30 s,
whichever comes first); only ``fsync="never"`` is set, which changes how long generation takes, not the bytes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

SITES = 256
CHILD = r"""
import json, resource, sys, time, trainhist
def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
workers = None if sys.argv[4] == "auto" else int(sys.argv[4])
c0, t = cpu(), time.perf_counter()
rep = trainhist.merge(json.loads(sys.argv[1]), sys.argv[2], codec=sys.argv[3], workers=workers)
secs, c1 = time.perf_counter() - t, cpu()
print(json.dumps({"seconds": secs, "cpu": c1 - c0, "rows_in": rep.rows_in, "rows_out": rep.rows_out,
                  "bytes_in": rep.bytes_in, "bytes_out": rep.bytes_out, "workers": rep.workers,
                  "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "worker_maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""
PROFILE = r"""
import cProfile, json, pstats, sys, trainhist
pr = cProfile.Profile()
pr.enable()
trainhist.merge(json.loads(sys.argv[1]), sys.argv[2], codec=sys.argv[3], workers=1)
pr.disable()
st = pstats.Stats(pr)
out = {"total": st.total_tt, "cum": {}}
for (file, line, fn), (cc, nc, tt, ct, callers) in st.stats.items():
    out["cum"].setdefault(f"{file.rsplit('/', 1)[-1]}:{fn}", 0.0)
    out["cum"][f"{file.rsplit('/', 1)[-1]}:{fn}"] += ct
print(json.dumps(out))
"""
def _kernels() -> str:
    """Whether the merges use trainhist's compiled kernels (numba; TRAINHIST_NO_NUMBA=1 turns them off)."""
    from trainhist import fastpath

    k = fastpath.kernels()
    if k is None:
        return "merge's compiled kernels off (the numpy code)"
    import numba

    return f"numba {numba.__version__} (merge's compiled kernels on)"


# (label, functions whose cumulative time it is); the stages do not overlap
STAGES = [
    ("open the inputs (manifests, commit entries; reader)", ["merge.py:_scan"]),
    ("read and CRC-check chunk payloads (pread)", ["merge.py:_read_payloads", "merge.py:_payload"]),
    ("decode chunk directories and columns (batched: `merge._batch_columns` on `batchdecode`; per chunk: "
     "`read_obs`)", ["merge.py:_batch_columns", "canonical.py:read_obs"]),
    ("check and decode a batch (`decode_obs_columns`: exact sums, sketch ranges)",
     ["canonical.py:decode_obs_columns"]),
    ("combine rows (`_combine`: exact group sums, sketch scatter-add, counts)", ["merge.py:_combine"]),
    ("encode output chunks (`encode_obs`, codec)", ["canonical.py:encode_obs"]),
    ("step truth (decode, combine, encode)", ["canonical.py:decode_steps", "merge.py:_combine_steps",
                                              "canonical.py:encode_steps"]),
    ("write records", ["canonical.py:_record"]),
]


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


def _gen(args: tuple) -> tuple[str, int, int, list[int]]:
    """Write one shard; (path, bytes, obs rows, rows of every obs chunk)."""
    path, run_id, rank, world, target, codec, every = args
    import trainhist

    sums = _summaries(rank)
    rng = np.random.default_rng(100 + rank)
    kw = {} if codec == "default" else {"codec": codec}
    if every is not None:  # explicit cadence: commits only where this loop asks
        kw.update(commit_every=10**9, commit_seconds=1e9)
    with trainhist.HistoryWriter(path, run_id=run_id, rank=rank, world_size=world, fsync="never", host="bench",
                                 **kw) as w:
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
            if every is None:  # the writer commits by itself; the file grows at each commit
                if step % 8 == 0 and os.path.getsize(path) >= target:
                    break
            elif step % every == 0:
                w.commit()
                if os.path.getsize(path) >= target:
                    break
    with trainhist.open(path) as h:
        chunk_rows = [e.rows for es in h._obs.values() for e in es]
    return path, os.path.getsize(path), rows, chunk_rows


def _shards(args: argparse.Namespace, tmp: str) -> tuple[list, float, bool]:
    """The shards (as :func:`_gen` describes them), the seconds their generation took, and whether they were
    reused: with ``--dir`` they are kept in a folder of it named by the generation parameters and reused when its
    record of them matches the files; else they are written to ``tmp``, removed at the end."""
    key = f"shards-{args.shards}x{args.mb:g}MB-{args.codec}-{args.commit_every or 'default'}-{SITES}sites"
    d = tmp if args.dir is None else os.path.join(args.dir, key)
    record = os.path.join(d, "shards.json")
    if args.dir is not None and os.path.exists(record):
        with open(record) as f:
            kept = json.load(f)
        if all(os.path.exists(p) and os.path.getsize(p) == n for p, n, _, _ in kept["made"]):
            return kept["made"], kept["seconds"], True
    os.makedirs(d, exist_ok=True)
    run_id = uuid.uuid4().hex
    jobs = [(os.path.join(d, f"rank{r}.th"), run_id, r, args.shards, int(args.mb * 1e6), args.codec,
             args.commit_every)
            for r in range(args.shards)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(min(args.shards, os.cpu_count() or 1)) as pool:
        made = pool.map(_gen, jobs)
    gen_s = time.perf_counter() - t0
    if args.dir is not None:
        with open(record, "w") as f:
            json.dump({"made": made, "seconds": gen_s}, f)
    return made, gen_s, False


def _writer_default(name: str):
    import trainhist

    return inspect.signature(trainhist.HistoryWriter.__init__).parameters[name].default


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--mb", type=float, default=100.0, help="minimum size of each shard in MB (10**6 bytes)")
    ap.add_argument("--codec", default="default", help="codec of the generated shards ('default': the writer's)")
    ap.add_argument("--out-codec", default="packed,shuffle", help="codecs of the merged file, comma-separated")
    ap.add_argument("--commit-every", type=int, default=None, help="steps per commit (= rows per input chunk); "
                    "default: not passed, the writer's own cadence")
    ap.add_argument("--workers", default="1,auto", help="worker processes of the merge, comma-separated "
                    "('auto': the library default)")
    ap.add_argument("--reps", type=int, default=2, help="timed merges per output codec and workers")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled merge")
    ap.add_argument("--dir", default=None, help="keep the shards in a folder of this directory named by the "
                    "generation parameters and reuse them on later runs (default: a temporary directory, removed)")
    ap.add_argument("--write", action="store_true", help="write benchmarks/merge.md (header and this section)")
    ap.add_argument("--append", action="store_true", help="append this section to benchmarks/merge.md")
    args = ap.parse_args()
    shard_codec = _writer_default("codec") if args.codec == "default" else args.codec
    out_codecs = args.out_codec.split(",")
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    d = tmp.name
    made, gen_s, reused = _shards(args, d)
    paths = [p for p, _, _, _ in made]
    total = sum(n for _, n, _, _ in made)
    chunk_rows = [r for _, _, _, rs in made for r in rs]
    n_chunks = len(chunk_rows)
    typical = statistics.median(chunk_rows)
    writer_defaults = args.codec == "default" and args.commit_every is None
    if args.commit_every is None:
        cadence = (f"the writer's default commit cadence (`commit_every={_writer_default('commit_every')}`, "
                   f"`commit_seconds={_writer_default('commit_seconds'):g}`)")
    else:
        cadence = f"a commit every {args.commit_every} steps"
    out = os.path.join(d, "merged.th")
    results: dict[tuple[str, str], list[dict]] = {}
    for oc, wk in [(oc, wk) for oc in out_codecs for wk in args.workers.split(",")]:
        for _ in range(args.reps):
            load = os.getloadavg()
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(paths), out, oc, wk], capture_output=True,
                               text=True)
            wall = time.perf_counter() - t0
            if r.returncode:
                print(r.stderr, file=sys.stderr)
                return 1
            child = json.loads(r.stdout)
            w = child["workers"]
            # the merging process plus, with workers, each worker's high-water mark (the largest one, times n)
            peak = child["maxrss_kib"] / 1024 + (w * child["worker_maxrss_kib"] / 1024 if w > 1 else 0)
            child.update(wall=wall, load=load, peak_mb=peak, mb_per_s=total / 1e6 / child["seconds"])
            results.setdefault((oc, wk), []).append(child)
            print(oc, wk, json.dumps(child), flush=True)
    load = os.getloadavg()
    prof = None
    if not args.no_profile:
        r = subprocess.run([sys.executable, "-c", PROFILE, json.dumps(paths), out, out_codecs[0]],
                           capture_output=True, text=True)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        prof = json.loads(r.stdout)
    tmp.cleanup()
    first = next(iter(results.values()))[0]
    rows_in = first["rows_in"]
    lines = []
    if args.write:
        lines.append(f"""# Merge benchmark

Generated by `tools/bench_merge.py` (the command is given for each section); do not edit by hand.

Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__},
{_kernels()},
{platform.platform()}. Other work ran on the machine at the same time: the load average (1, 5, 15 minutes) is
shown for every run; with 2 CPUs a load above ~1 means the merge shared its CPU.

Every merge runs in a fresh child process (`trainhist.merge(paths, out, codec=..., workers=...)`), which reports its own time
and peak RSS (`getrusage(RUSAGE_SELF).ru_maxrss` when the merge returns, including the interpreter and numpy,
about 40 MB, and numba with the compiled code, about 40 MB more).
Throughput is MB (10^6 bytes) of *input* per second of merge time. Targets (issue 3): at least
100 MB/s of input and peak memory under 500 MB, for 8 shards of at least 100 MB each.
""")
    cmd = " ".join(["python", "tools/bench_merge.py"] + [a for a in sys.argv[1:] if a not in ("--write", "--append")])
    lines.append(f"""
## Shards with codec `{shard_codec}`, {f"{args.commit_every}-row chunks" if args.commit_every else
                                         f"the writer's default cadence ({typical:g}-row chunks)"}{
                                         " (the writer's defaults)" if writer_defaults else ""}

Command: `{cmd}`.

Input: {args.shards} shards of one run (ranks 0..{args.shards - 1}), written by `HistoryWriter` with codec
`{shard_codec}`{' (the writer default: not passed)' if args.codec == 'default' else ''}, {SITES} activation sites,
every site observed at every step with a precomputed Summary of a 4096-element float32 tensor (spine + scale-2
sketch, exact `sumsq` of ~60-100 bits), a step-truth row per step, {cadence} (so {n_chunks:,} input obs chunks,
{min(chunk_rows)}-{max(chunk_rows)} rows, median {typical:g}). {total / 1e6:.1f} MB in {args.shards} files
({min(n for _, n, _, _ in made) / 1e6:.1f} MB the smallest); {rows_in:,} obs rows in, {first['rows_out']:,} out.
Shard generation (not part of the merge): {gen_s:.1f} s{" (shards reused from an earlier run of the script)" if reused else ""}.

`CPU` is the merge's CPU time (user + system, workers included): on a machine shared with other work it shows
what the merge itself cost, and `input MB / CPU s` is the throughput one idle core would give (single process).
Peak RSS is that of the merging process, plus n times the largest worker's when it used n workers.

| output codec | workers | run | load avg before | merge time | **throughput** | rows in/s | CPU | MB / CPU s | peak RSS | output |
|---|---|---|---|---|---|---|---|---|---|---|
""")
    verdicts = []
    for (oc, wk), rs in results.items():
        for i, c in enumerate(rs):
            lines.append(f"| `{oc}` | {wk} ({c['workers']}) | {i + 1} | {c['load'][0]:.2f}, {c['load'][1]:.2f}, "
                         f"{c['load'][2]:.2f} | {c['seconds']:.2f} s | **{c['mb_per_s']:.1f} MB/s** | "
                         f"{c['rows_in'] / c['seconds']:,.0f} | {c['cpu']:.2f} s | {total / 1e6 / c['cpu']:.1f} | "
                         f"{c['peak_mb']:.0f} MB | {c['bytes_out'] / 1e6:.1f} MB |\n")
        med = statistics.median(c["mb_per_s"] for c in rs)
        best = max(c["mb_per_s"] for c in rs)
        peak = max(c["peak_mb"] for c in rs)
        verdicts.append(f"- output `{oc}`, workers {wk}: median **{med:.1f} MB/s** (best {best:.1f}) of input: "
                        f"{'met' if med >= 100 else 'MISSED'} (≥ 100 MB/s); peak RSS {peak:.0f} MB: "
                        f"{'met' if peak < 500 else 'MISSED'} (< 500 MB).\n")
    lines.append("\n" + "".join(verdicts))
    if prof is not None:
        stage_t = [(label, sum(prof["cum"].get(f, 0.0) for f in fns)) for label, fns in STAGES]
        rest = prof["total"] - sum(t for _, t in stage_t)
        lines.append(f"""
Where the time goes: one more merge to `{out_codecs[0]}` in one process under cProfile (load average before it
{load[0]:.2f}; cProfile adds per-call overhead, so Python-heavy stages look larger than they are),
{prof['total']:.1f} s in all:

| stage | time | share |
|---|---|---|
""")
        for label, t in stage_t + [("other (planning, manifests, sweep, commit)", rest)]:
            lines.append(f"| {label} | {t:.2f} s | {100 * t / prof['total']:.0f} % |\n")
    text = "".join(lines)
    print(text)
    if args.write or args.append:
        os.makedirs("benchmarks", exist_ok=True)
        with open(os.path.join("benchmarks", "merge.md"), "w" if args.write else "a") as f:
            f.write(text)
        extra = os.environ.get("BENCH_NOTES")
        if extra:
            with open(os.path.join("benchmarks", "merge.md"), "a") as f:
                f.write("\n" + open(extra).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
