#!/usr/bin/env python
"""Format benchmark: writer throughput, full-scan read throughput, one series from a >= 500 MB file, bytes on disk.

    python tools/bench_format.py [--out benchmarks/format.md] [--reps 3] [--big-mb 500] [--quick]

What it measures (every timing is repeated ``--reps`` times, interleaved across configurations, and reported as
median with min..max):

1. **writer** observations/s through ``HistoryWriter.observe(site, step, summary=...)`` (precomputed summaries:
   the cost of the format itself) and through ``observe(site, step, values)`` (with the numpy reference reduction
   of a 4096-element float32 tensor);
2. **bytes per observation** on disk: the same rows written with sketches on and off; the spine costs
   ``size_off / rows``, the sketch ``(size_on - size_off) / rows``; plus a per-column breakdown;
3. **full-scan read** MB/s of file bytes: ``trainhist.open`` + ``spine`` and ``sketch`` of every site, in site
   order, through the public API; the target is judged on the big file (item 4: a realistic size, where fixed
   costs such as opening and validating 200 site manifests do not dominate), and reported for the small file too;
4. **one series from a big file**: a file of at least ``--big-mb`` MB (200 sites x N steps of float32 tensors with
   N(0, sigma) values of 2048-6144 elements, sketches on, the writer's default commit cadence) is generated once in
   a temp directory; then ``open`` + ``spine`` + ``sketch`` of one site (first, middle, last site in turn), and
   full scans of it. The file was just written, so it is in the page cache (no root to drop caches): these are
   warm-cache numbers.

Every file is written with the writer's default codec (``packed``: frame of reference, binary32, patched bytes,
or raw per column; spec 7.3).

Precomputed summaries come from a pool of 64 distinct tensors x 12 power-of-two scales (sigma = 2**-10 .. 2**1),
so consecutive rows of a site differ (as real steps do) while generation stays fast. Where a target is missed,
a cProfile summary shows where the time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime as dt
import inspect
import io
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import trainhist  # noqa: E402
from trainhist import Summary, SumMethod, summarize  # noqa: E402
from trainhist.dyadic import Dyadic  # noqa: E402
from trainhist.framing import RECORD_HEADER_SIZE  # noqa: E402
from trainhist.writer import HistoryWriter  # noqa: E402

TARGETS = {"scan_mb_s": 200.0, "series_s": 1.0, "spine_b": 32.0, "sketch_b": 200.0}
SCALES = list(range(-10, 2))
# More distinct tensors than rows in a chunk (the writer commits every 200 steps): within one chunk no summary
# repeats, so deflate cannot shrink the file by finding the same sketch twice (real tensors never repeat).
POOL = 257


# -- data ------------------------------------------------------------------------------------------------------------
def make_pool(seed: int = 0) -> dict[int, list[Summary]]:
    """Summaries of POOL distinct N(0, 1) float32 tensors (2048..6144 elements) at each power-of-two scale."""
    rng = np.random.default_rng(seed)
    base = [rng.standard_normal(int(rng.choice([2048, 4096, 6144]))).astype(np.float32) for _ in range(POOL)]
    return {k: [summarize(b * np.float32(2.0**k)) for b in base] for k in SCALES}


def strip(s: Summary) -> Summary:
    return dataclasses.replace(s, sketch=None)


def as_f64(s: Summary) -> Summary:
    """The spine as the torch collector writes it: float64 device sums (method f64_accumulate), no sketch."""
    return dataclasses.replace(s, sketch=None, sum=Dyadic.from_float(s.sum.to_float()),
                               sumsq=Dyadic.from_float(s.sumsq.to_float()), sum_method=SumMethod.F64)


COMMIT_EVERY = inspect.signature(HistoryWriter).parameters["commit_every"].default


def write_file(path: Path, pool: dict[int, list[Summary]], sites: int, steps: int, *, sketch: bool = True,
               target_bytes: int | None = None, f64_sums: bool = False) -> tuple[float, int, int]:
    """Write ``sites`` x ``steps`` observations (or until ``target_bytes``); returns seconds, rows, bytes."""
    if f64_sums:
        spool = {k: [as_f64(s) for s in v] for k, v in pool.items()}
    else:
        spool = pool if sketch else {k: [strip(s) for s in v] for k, v in pool.items()}
    t0 = time.perf_counter()
    rows = 0
    with HistoryWriter(path, run_name="bench", fsync="never", commit_every=COMMIT_EVERY, commit_seconds=1e18) as w:
        handles = [w.site(f"model.layers.{i // 4}.{('attn', 'mlp', 'norm', 'out')[i % 4]}", "activation",
                          shape=[4096], dtype="float32") for i in range(sites)]
        scale = [SCALES[(i * 5) % len(SCALES)] for i in range(sites)]
        step = 0
        while True:
            for i, h in enumerate(handles):
                w.observe(h, step, summary=spool[scale[i]][(step * 7 + i * 13) % POOL])
            rows += sites
            step += 1
            if target_bytes is None:
                if step >= steps:
                    break
            elif step % COMMIT_EVERY == 0 and os.path.getsize(path) >= target_bytes:
                break
    return time.perf_counter() - t0, rows, os.path.getsize(path)


def write_values(path: Path, sites: int, steps: int) -> tuple[float, int]:
    """observe() with numpy values: the reference reduction (exact sums, sketch) of 4096-element float32 tensors."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(4096).astype(np.float32) * np.float32(0.02) for _ in range(16)]
    t0 = time.perf_counter()
    with HistoryWriter(path, fsync="never", commit_every=COMMIT_EVERY, commit_seconds=1e18) as w:
        handles = [w.site(f"l{i}", "activation") for i in range(sites)]
        for step in range(steps):
            for i, h in enumerate(handles):
                w.observe(h, step, xs[(step + i) % 16])
    return time.perf_counter() - t0, sites * steps


def scan(path: Path) -> tuple[float, float, int]:
    """open + spine and sketch of every site; returns wall seconds, CPU seconds and rows read."""
    t0, c0 = time.perf_counter(), time.process_time()
    rows = 0
    with trainhist.open(path) as h:
        for s in h.sites:
            rows += len(h.spine(s.path, s.stream, s.facet))
            h.sketch(s.path, s.stream, s.facet)
    return time.perf_counter() - t0, time.process_time() - c0, rows


def one_series(path: Path, index: int) -> tuple[float, float, float, int]:
    """Wall seconds to open, wall seconds to read one site's spine + sketch, CPU seconds of both, its rows."""
    t0, c0 = time.perf_counter(), time.process_time()
    with trainhist.open(path) as h:
        t1 = time.perf_counter()
        s = h.sites[index]
        sp = h.spine(s.path, s.stream, s.facet)
        sk = h.sketch(s.path, s.stream, s.facet)
        t2, c2 = time.perf_counter(), time.process_time()
        assert len(sp) == len(sk) > 0
    return t1 - t0, t2 - t1, c2 - c0, len(sp)


# -- reporting -------------------------------------------------------------------------------------------------------
def stat(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def fmt(xs: list[float], unit: str = "", digits: int = 3) -> str:
    m, lo, hi = stat(xs)
    spread = (hi - lo) / m * 100 if m else 0.0
    return f"{m:.{digits}g}{unit} ({lo:.{digits}g}..{hi:.{digits}g}, spread {spread:.0f}%)"


def profile(fn, top: int = 12) -> str:
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    out = io.StringIO()
    st = pstats.Stats(pr, stream=out)
    st.sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    root = str(Path(__file__).resolve().parent.parent) + os.sep
    return "\n".join(ln.replace(root, "") for ln in [lines[start - 1]] + lines[start:])


def column_breakdown(path: Path) -> tuple[list[tuple[str, float]], dict[str, float]]:
    """Stored bytes per row of every obs column, and per-row overheads (directory, framing, commit entries)."""
    cols: dict[str, int] = {}
    rows = n = direc = payload = 0
    with trainhist.open(path) as h:
        size = h.size
        for entries in h._obs.values():
            for e in entries:
                ch = h.chunk(e)
                rows += e.rows
                n += 1
                payload += e.length
                first = min(c[3] for c in ch._dir.values())
                direc += first
                for name, c in ch._dir.items():
                    cols[name] = cols.get(name, 0) + c[4] + (-c[4] % 8)
        other = size - payload - n * (RECORD_HEADER_SIZE + 40)
    per = sorted(((k, v / rows) for k, v in cols.items()), key=lambda kv: -kv[1])
    return per, {"directory": direc / rows, "record header + commit entry": n * (RECORD_HEADER_SIZE + 40) / rows,
                 "manifests, steps, commit headers, file header": other / rows, "rows per chunk": rows / n}


def machine() -> str:
    cpu = "unknown"
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
                 .split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        rev = "?"
    import crc32c
    import msgpack

    return (f"{cpu}, {os.cpu_count()} logical CPUs{mem}; {platform.platform()}; Python {platform.python_version()}, "
            f"numpy {np.__version__}, msgpack {'.'.join(map(str, msgpack.version))}, "
            f"crc32c {getattr(crc32c, '__version__', '?')}, "
            f"zlib {zlib.ZLIB_RUNTIME_VERSION}; trainhist {trainhist.__version__} at git {rev or '?'}")


# -- main ------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the report (markdown) here as well as to stdout")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions of every timing (>= 3)")
    ap.add_argument("--sites", type=int, default=200)
    ap.add_argument("--steps", type=int, default=250, help="steps of the small files (writer, bytes, scan)")
    ap.add_argument("--big-mb", type=float, default=500.0, help="size of the big file for the one-series read")
    ap.add_argument("--tmp", type=Path, default=None, help="directory for the files (default: a new temp dir)")
    ap.add_argument("--quick", action="store_true", help="smoke run: small sizes, 3 reps, big file of 20 MB")
    a = ap.parse_args(argv)
    if a.quick:
        a.sites, a.steps, a.big_mb = 40, 50, 20.0
    reps = max(3, a.reps)
    tmp = Path(tempfile.mkdtemp(prefix="thbench-", dir=a.tmp))
    log = print
    started = time.time()
    try:
        log(f"# pool of {POOL} tensors x {len(SCALES)} scales ...", file=sys.stderr)
        pool = make_pool()
        n_small = a.sites * a.steps

        # 1-3: interleaved repetitions of write (sketch on / off), scan, and write with values
        w_on, w_off, w_val, sc_on, sc_off, sizes_on, sizes_off = [], [], [], [], [], [], []
        sc_cpu = []
        load0 = os.getloadavg()
        for r in range(reps):
            log(f"# rep {r + 1}/{reps}: write/scan sketch on+off, write values", file=sys.stderr)
            order = [("on", True), ("off", False)] if r % 2 == 0 else [("off", False), ("on", True)]
            for name, sk in order:
                p = tmp / f"small_{name}.thist"
                secs, rows, size = write_file(p, pool, a.sites, a.steps, sketch=sk)
                (w_on if sk else w_off).append(rows / secs)
                (sizes_on if sk else sizes_off).append(size)
                ssec, scpu, srows = scan(p)
                assert srows == rows
                (sc_on if sk else sc_off).append(size / ssec / 1e6)
                if sk:
                    sc_cpu.append(size / scpu / 1e6)
            secs, rows = write_values(tmp / "values.thist", max(1, a.sites // 10), a.steps)
            w_val.append(rows / secs)
        assert len(set(sizes_on)) == 1 and len(set(sizes_off)) == 1, "file sizes must be deterministic"
        size_on, size_off = sizes_on[0], sizes_off[0]
        spine_b = size_off / n_small
        write_file(tmp / "small_f64.thist", pool, a.sites, a.steps, sketch=False, f64_sums=True)
        spine_f64_b = os.path.getsize(tmp / "small_f64.thist") / n_small
        sketch_b = (size_on - size_off) / n_small
        breakdown, overhead = column_breakdown(tmp / "small_on.thist")

        # 4: the big file, once; then interleaved one-series reads (first / middle / last site)
        big = tmp / "big.thist"
        log(f"# generating a >= {a.big_mb:.0f} MB file ({a.sites} sites) ...", file=sys.stderr)
        gsec, grows, gsize = write_file(big, pool, a.sites, 0, sketch=True, target_bytes=int(a.big_mb * 1e6))
        big_steps = grows // a.sites
        t_open, t_series, t_total, t_cpu = [], [], [], []
        big_scan, big_scan_cpu, big_loads = [], [], []
        picks = [0, a.sites // 2, a.sites - 1]
        series_rows = 0
        for r in range(reps):
            for idx in picks[r % 3:] + picks[: r % 3]:
                log(f"# rep {r + 1}/{reps}: one series, site {idx}", file=sys.stderr)
                o, s, c, series_rows = one_series(big, idx)
                t_cpu.append(c)
                t_open.append(o)
                t_series.append(s)
                t_total.append(o + s)
            log(f"# rep {r + 1}/{reps}: full scan of the big file", file=sys.stderr)
            big_loads.append(os.getloadavg()[0])
            ssec, scpu, srows = scan(big)
            assert srows == grows
            big_scan.append(gsize / ssec / 1e6)
            big_scan_cpu.append(gsize / scpu / 1e6)

        # profiles (separate runs, not timed above)
        log("# profiling ...", file=sys.stderr)
        prof_series = profile(lambda: one_series(big, a.sites // 2))
        prof_scan = profile(lambda: scan(tmp / "small_on.thist"))
        prof_big_scan = profile(lambda: scan(big))
        prof_write = profile(lambda: write_file(tmp / "prof.thist", pool, a.sites, min(a.steps, 50)))
        load1 = os.getloadavg()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    scan_m = statistics.median(big_scan)
    total_m = statistics.median(t_total)
    cmd = "python " + " ".join([os.path.relpath(__file__, Path.cwd())] + (argv if argv is not None else sys.argv[1:]))
    rep = io.StringIO()
    p = rep.write
    p("# trainhist format benchmark\n\n")
    p(f"Generated by `tools/bench_format.py` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC "
      f"({time.time() - started:.0f} s).\n\n")
    p(f"- command: `{cmd}`\n- machine: {machine()}\n")
    p(f"- repetitions: {reps}, interleaved (write on/off alternate order per rep; one-series reads rotate over "
      f"sites {picks}); values are median (min..max, spread = (max-min)/median)\n")
    p(f"- load average (1/5/15 min) at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, at end "
      f"{load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f}: other processes may share the machine, so reads are also "
      f"given per CPU second of this process (less sensitive to sharing than wall time)\n\n")
    p("## Summary\n\n| metric | result | target | |\n|---|---|---|---|\n")
    p(f"| full-scan read (open + spine + sketch of every site) of the {gsize / 1e6:.0f} MB file, wall | "
      f"{fmt(big_scan, ' MB/s')} | >= {TARGETS['scan_mb_s']:.0f} MB/s | {verdict(scan_m >= TARGETS['scan_mb_s'])} |\n")
    p(f"| the same per CPU second of the reading process | {fmt(big_scan_cpu, ' MB/s')} | >= "
      f"{TARGETS['scan_mb_s']:.0f} MB/s | {verdict(statistics.median(big_scan_cpu) >= TARGETS['scan_mb_s'])} |\n")
    p(f"| one series (open + spine + sketch of 1 of {a.sites} sites, {series_rows} rows) from a "
      f"{gsize / 1e6:.0f} MB file | {fmt(t_total, ' s')} | < {TARGETS['series_s']:.0f} s | "
      f"{verdict(total_m < TARGETS['series_s'])} |\n")
    p(f"| spine bytes / observation, float64 device sums (what the torch collector writes) | {spine_f64_b:.1f} B | "
      f"<= {TARGETS['spine_b']:.0f} B | {verdict(spine_f64_b <= TARGETS['spine_b'])} |\n")
    p(f"| spine bytes / observation, exact sums (numpy writer: `sum_x`/`sumsq_x` blobs) | {spine_b:.1f} B | "
      f"<= {TARGETS['spine_b']:.0f} B | {verdict(spine_b <= TARGETS['spine_b'])} |\n")
    p(f"| sketch bytes / observation | {sketch_b:.1f} B | <= {TARGETS['sketch_b']:.0f} B | "
      f"{verdict(sketch_b <= TARGETS['sketch_b'])} |\n")
    p(f"| writer, precomputed summaries, sketch on | {fmt(w_on, ' obs/s')} | | |\n")
    p(f"| writer, precomputed summaries, sketch off | {fmt(w_off, ' obs/s')} | | |\n")
    p(f"| writer, numpy values (4096 x float32, reduced here) | {fmt(w_val, ' obs/s')} | | |\n\n")
    p("## Details\n\n")
    p(f"- small files: {a.sites} sites x {a.steps} steps = {n_small} observations, "
      f"commit every {COMMIT_EVERY} steps (the writer's default); "
      f"{size_on / 1e6:.2f} MB with sketches, {size_off / 1e6:.2f} MB without\n")
    p(f"- full scan of the big file: rows/s = {grows / (gsize / 1e6 / scan_m):.3g} (wall), "
      f"{grows / (gsize / 1e6 / statistics.median(big_scan_cpu)):.3g} (per CPU second); 1-minute load average "
      f"before each scan {', '.join(f'{x:.1f}' for x in big_loads)} (2 CPUs)\n")
    p(f"- full scan of the small file (fixed costs dominate: 200 site manifests, 2 chunks per site): with sketches "
      f"{fmt(sc_on, ' MB/s')} wall, {fmt(sc_cpu, ' MB/s')} per CPU second; without sketches {fmt(sc_off, ' MB/s')}\n")
    p(f"- big file: {gsize / 1e6:.1f} MB, {a.sites} sites x {big_steps} steps = {grows} observations, written in "
      f"{gsec:.0f} s ({grows / gsec:.3g} obs/s)\n")
    p(f"- one series, split: open {fmt(t_open, ' s')}; spine + sketch of the site {fmt(t_series, ' s')}; "
      f"CPU seconds of both {fmt(t_cpu, ' s')}\n\n")
    p("### Bytes per observation by column (sketch on, stored bytes incl. 8-byte padding)\n\n")
    p("| column | bytes/obs |\n|---|---|\n")
    for name, b in breakdown:
        if b >= 0.5:
            p(f"| `{name}` | {b:.2f} |\n")
    rest = sum(b for _, b in breakdown if b < 0.5)
    p(f"| {sum(1 for _, b in breakdown if b < 0.5)} other columns (< 0.5 each) | {rest:.2f} |\n")
    for k, v in overhead.items():
        p(f"| {k} | {v:.2f} |\n" if k != "rows per chunk" else f"| ({k}: {v:.0f}) | |\n")
    p("\n### Where the time goes (cProfile, sorted by own time)\n\n")
    p(f"One series from the big file:\n\n```\n{prof_series}\n```\n\n")
    p(f"Full scan of the big file:\n\n```\n{prof_big_scan}\n```\n\n")
    p(f"Full scan of the small file with sketches:\n\n```\n{prof_scan}\n```\n\n")
    p(f"Writer (precomputed summaries):\n\n```\n{prof_write}\n```\n")
    text = rep.getvalue()
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
