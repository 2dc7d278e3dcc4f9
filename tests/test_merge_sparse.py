"""Sketches kept sparse through merge and coarsen (``canonical.Sparse``: union ranges per group, taken and encoded
without a dense copy) against the dense path (``Rows.densify`` before combining): the same output bytes; and
``Sparse.take``/``Sparse.canonical`` against the dense arrays they stand for."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
from history_helpers import write_mixed

import trainhist
from trainhist import canonical
from trainhist.canonical import Sparse

merge_mod = importlib.import_module("trainhist.merge")  # the package exports the function as ``merge``


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("sparse")
    out = []
    for r, codecs in enumerate((("packed", "raw"), ("packed",), ("shuffle", "packed"))):
        p = d / f"r{r}.thist"
        write_mixed(p, codecs, seed=10 + r, run_id="89abcdef0123456789abcdef01234567", rank=r, world_size=3)
        out.append(p)
    return out


def _dense_only(m: pytest.MonkeyPatch) -> None:
    """Every decoded batch densified: merge combines and encodes dense sketches (the path before sparse sums)."""
    decode = canonical.decode_obs_columns

    def dense(*a: object, **k: object) -> canonical.Rows:
        return decode(*a, **k).densify()

    m.setattr(canonical, "decode_obs_columns", dense)
    m.setattr(merge_mod, "decode_obs_columns", dense)


def _same(monkeypatch: pytest.MonkeyPatch, fn, out: Path) -> None:
    fn(out.with_suffix(".sparse"))
    with monkeypatch.context() as m:
        _dense_only(m)
        fn(out.with_suffix(".dense"))
    assert out.with_suffix(".sparse").read_bytes() == out.with_suffix(".dense").read_bytes()


def test_sparse_sums_equal_dense(shards: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for codec in ("packed", "raw"):
        _same(monkeypatch, lambda o, c=codec: trainhist.merge(shards, o, codec=c, workers=1), tmp_path / codec)
    a = tmp_path / "a.th"
    trainhist.merge(shards[:2], a, workers=1)
    _same(monkeypatch, lambda o: trainhist.merge([a, shards[2]], o, workers=1), tmp_path / "mm")
    for steps, bpo in ((1, 4), (3, 4), (4, 2), (5, 1)):
        _same(monkeypatch, lambda o, n=steps, b=bpo: trainhist.coarsen(a, o, steps=n, bins_per_octave=b, workers=1),
              tmp_path / f"c{steps}{bpo}")


def _random_sparse(rng: np.random.Generator, rows: int, nb: int) -> Sparse:
    """Ranges of any width, counts with zeros anywhere (at the ends of a range too) and all-zero ranges."""
    n = rng.integers(0, 6, (rows, 2)) * (rng.random((rows, 2)) < 0.8)
    lo = rng.integers(0, nb - 5, (rows, 2)) * (n > 0)
    counts = rng.integers(0, 3, int(n.sum())).astype(np.uint64) * rng.integers(1, 1 << 40, int(n.sum()), np.uint64)
    return Sparse(lo.astype(np.int64), n.astype(np.int64), counts, int(counts.max()) if counts.size else 0)


@pytest.mark.parametrize("seed", range(20))
def test_sparse_take_and_canonical_equal_dense(seed: int) -> None:
    rng = np.random.default_rng(seed)
    nb = 64
    rows = int(rng.integers(1, 40))
    sp = _random_sparse(rng, rows, nb)
    pos, neg = sp.dense(nb)
    idx = rng.integers(0, rows, int(rng.integers(0, 2 * rows)))
    a, b = sorted(rng.integers(0, rows + 1, 2).tolist())
    for sel in (idx, slice(a, b), np.arange(rows)):
        p, q = sp.take(sel).dense(nb)
        assert np.array_equal(p, pos[sel]) and np.array_equal(q, neg[sel])
    c = sp.canonical()
    p, q = c.dense(nb)
    assert np.array_equal(p, pos) and np.array_equal(q, neg)
    nf = c.n.ravel()
    first = np.cumsum(nf) - nf
    some = nf > 0
    assert (c.counts[first[some]] != 0).all() and (c.counts[(first + nf - 1)[some]] != 0).all()
    assert (c.lo.ravel()[~some] == 0).all()
    # the encoder's dense path finds the same ranges
    dense = np.stack([pos, neg], axis=1) != 0
    anynz = dense.any(axis=2)
    assert np.array_equal(c.lo, np.where(anynz, dense.argmax(axis=2), 0))
    assert np.array_equal(c.n, np.where(anynz, nb - dense[:, :, ::-1].argmax(axis=2) - dense.argmax(axis=2), 0))


def test_sparse_canonical_of_all_zero_counts() -> None:
    """Ranges whose counts are all zero (rows blanked, or counts that cancel nothing but are stored as zeros)
    become empty ranges at bin 0."""
    lo = np.array([[3, 0], [5, 7]], np.int64)
    n = np.array([[2, 0], [1, 3]], np.int64)
    c = Sparse(lo, n, np.zeros(6, np.uint64), 0).canonical()
    assert not c.lo.any() and not c.n.any() and c.counts.size == 0
