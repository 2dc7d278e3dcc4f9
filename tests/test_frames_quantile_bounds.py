"""The derived quantiles keep their stated bound against numpy's own quantile of the data: many kinds of data
(normal, heavy-tailed, zeros, one value, subnormals, huge, NaN/inf mixes, exact bin edges), as written, rebinned
to 2 and 1 bins per octave, and coarsened into windows (some sketched in part: no bound stated, none checked)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import trainhist
from trainhist import frames

pytest.importorskip("pandas")

QS = (0.0, 0.01, 0.05, 0.25, 1 / 3, 0.5, 0.75, 0.95, 0.99, 1.0)
WINDOW = (2.0**-48, 2.0**16)


def _data(rng: np.random.Generator, kind: int) -> np.ndarray:
    n = int(rng.choice([1, 2, 3, 10, 257, 2000]))
    dt = (np.float16, np.float32, np.float64)[int(rng.integers(3))]
    x = {
        0: lambda: rng.standard_normal(n),
        1: lambda: rng.standard_cauchy(n),
        2: lambda: np.zeros(n),
        3: lambda: np.full(n, rng.standard_normal() * 10.0 ** int(rng.integers(-12, 12))),
        4: lambda: rng.standard_normal(n) * (1e-300 if dt == np.float64 else 1e-40),
        5: lambda: rng.standard_normal(n) * 1e30,
        6: lambda: np.where(rng.random(n) < 0.2, rng.choice([np.nan, np.inf, -np.inf], n), rng.standard_normal(n)),
        7: lambda: np.where(rng.random(n) < 0.7, 0.0, rng.standard_normal(n)),
        8: lambda: np.exp(rng.standard_normal(n) * 20),
        9: lambda: 2.0 ** rng.integers(-60, 20, n) * rng.choice([-1.0, 1.0], n),
        10: lambda: np.full(n, np.nan),
    }[kind]()
    with np.errstate(over="ignore", under="ignore"):
        return x.astype(dt)


def _check(path, truth: list[np.ndarray]) -> tuple[int, int]:
    """(quantiles checked against their bound, quantiles not placed): asserts each bound."""
    checked = unplaced = 0
    with trainhist.open(path) as h:
        df = frames.quantiles(h, "a", q=QS)
    for r in df.to_dict("records"):
        step, span = int(r["step"]), int(r["span"])
        x = np.concatenate(truth[step : step + span]).astype(np.float64)
        fin = x[np.isfinite(x)]
        bound = r["rel_bound"]
        for q in QS:
            approx = r[f"approx_q{q:g}"]
            if not fin.size:
                assert math.isnan(approx)
                continue
            true = float(np.quantile(fin, q, method="inverted_cdf"))
            if math.isnan(approx):  # (only where no bin places it: outside the window, or a part-sketched row)
                assert math.isnan(bound) or (true != 0 and not WINDOW[0] < abs(true) <= WINDOW[1]), (step, q, true)
                unplaced += 1
            elif not math.isnan(bound):
                assert abs(approx - true) <= bound * abs(true), (path, step, span, q, approx, true, bound)
                checked += 1
    return checked, unplaced


@pytest.mark.parametrize("seed", [0, 1])
def test_derived_quantiles_keep_their_bound(tmp_path, seed) -> None:
    rng = np.random.default_rng(seed)
    truth = [_data(rng, k % 11) for k in range(66)]
    p = tmp_path / "q.thist"
    with trainhist.HistoryWriter(p, fsync="never") as w:
        a = w.site("a", "activation")
        for step, x in enumerate(truth):
            w.observe(a, step, x, sketch=seed == 0 or step % 3 != 1)
    total = [0, 0]
    for name, options in (("w", {}), ("b2", {"bins_per_octave": 2}), ("b1", {"bins_per_octave": 1}),
                          ("win", {"steps": 5})):
        out = tmp_path / f"{name}.thist"
        if options:
            trainhist.coarsen(p, out, **options)
        else:
            out = p
        checked, unplaced = _check(out, truth)
        total[0] += checked
        total[1] += unplaced
    assert total[0] > 500 and total[1] > 0  # (the bound was checked, and quantiles outside the window met)
