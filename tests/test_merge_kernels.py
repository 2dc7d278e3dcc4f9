"""Merge's optional compiled kernels (``trainhist.mergekernel``, numba) against its numpy code: the same output
bytes, the same values and the same errors, for random shard sets (the strategies of ``test_merge_props``), exact
values of every kind (those of ``test_merge_exact``), sparse sketches with empty and all-zero ranges, and counts
near 2**63. ``trainhist.fastpath.ENABLED`` picks the path; without numba only the numpy one runs here.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
from typing import Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_merge_exact import SETTINGS, bad_exact_encodings, column, value
from test_merge_props import Dir, _two, read, replica_steps, shards, write_shards

import trainhist
from trainhist import exactvec as xv
from trainhist import fastpath
from trainhist.canonical import Sparse
from trainhist.dyadic import Dyadic
from trainhist.errors import TrainhistError
from trainhist.summary import Sketch, Summary

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
              pytest.mark.skipif(fastpath.kernels() is None, reason="numba is not installed")]
merge_mod = sys.modules["trainhist.merge"]


@contextlib.contextmanager
def numpy_path() -> Iterator[None]:
    """Merge without the compiled kernels."""
    fastpath.ENABLED = False
    try:
        yield
    finally:
        fastpath.ENABLED = True


def both(fn: Callable[[str], object], d: Dir) -> tuple[bytes | tuple, bytes | tuple]:
    """``fn(output)`` with the kernels and with numpy: each output's bytes, or the error's type, code and message."""
    res = []
    for fast in (True, False):
        o = d.out()
        with contextlib.nullcontext() if fast else numpy_path():
            try:
                fn(o)
                res.append(read(o))
            except TrainhistError as e:
                res.append((type(e).__name__, e.code, str(e)))
    return res[0], res[1]


@settings(max_examples=40, **SETTINGS)
@given(spec=shards, rep=replica_steps, steps=st.sampled_from([1, 3]), bpo=st.sampled_from([1, 4]))
def test_kernels_give_the_bytes_of_numpy(spec, rep, steps, bpo):
    with Dir() as d:
        paths = write_shards(d.path, spec, rep, "0123456789abcdef0123456789abcdef")
        a, b = both(lambda o: trainhist.merge(paths, o, replica_divergence="report"), d)
        assert a == b
        if isinstance(a, bytes):
            m = d.merge(paths, replica_divergence="report")
            a, b = both(lambda o: trainhist.coarsen(m, o, steps=steps, bins_per_octave=bpo), d)
            assert a == b


def _exact(groups: list[list[Dyadic]], reverse: bool) -> tuple:
    """group_sum of these groups (stored in reverse and taken in order, when ``reverse``): f64 bits, values,
    encoding."""
    vals = [v for g in groups for v in g]
    f, lens, blob = column(vals[::-1] if reverse else vals)
    x = xv.decode_exact("sum", f, lens, blob, np.ones(len(vals), bool), lambda i: ("f", 0, i))
    sizes = np.array([len(g) for g in groups])
    order = np.arange(len(vals))[::-1].copy() if reverse else None
    fo, xo = xv.group_sum(f, x, np.cumsum(sizes) - sizes, sizes, order)
    return fo.view(np.uint64).tolist(), [xo.get(k) for k in range(len(groups))], xv.encode_exact(xo)


@settings(max_examples=300, **SETTINGS)
@given(groups=st.lists(st.lists(value, min_size=1, max_size=6), min_size=1, max_size=8), reverse=st.booleans())
def test_exact_sums_equal_numpy(groups, reverse):
    got = _exact(groups, reverse)
    with numpy_path():
        want = _exact(groups, reverse)
    assert got[:2] == want[:2]
    assert (got[2] is None) == (want[2] is None)
    if got[2] is not None:
        assert got[2][0].tolist() == want[2][0].tolist() and got[2][1] == want[2][1]


def test_decode_errors_equal_numpy():
    cases = bad_exact_encodings() + [
        (Dyadic(3, -1076).to_bytes(), 5e-324),  # subnormal, wrongly rounded (the Python check)
        (Dyadic(-1, 1024).to_bytes(), -1.0),  # -2**1024 rounds to -inf
        (struct.pack("<i", -3) + b"\xff", -0.375),  # -1: fine
        (Dyadic(3, -1076).to_bytes(), 1e-323),  # subnormal, fine
    ]
    for b, f in cases:
        res = []
        for ctx in (contextlib.nullcontext(), numpy_path()):
            with ctx:
                try:
                    x = xv.decode_exact("sum", np.array([1.0, 2.0, f]), np.array([0, len(b), len(b)], np.uint32),
                                        np.frombuffer(b + b, np.uint8), np.ones(3, bool), lambda i: ("p", 7, i))
                    res.append((x.get(1), x.get(2)))
                except TrainhistError as e:
                    res.append((e.code, str(e)))
        assert res[0] == res[1]


def _random_sparse(rng: np.random.Generator, rows: int, nb: int, zero: float) -> Sparse:
    """Random ranges (some empty), with counts that are zero with probability ``zero``."""
    lo = rng.integers(0, nb, (rows, 2))
    n = np.where(rng.random((rows, 2)) < 0.3, 0, rng.integers(0, nb + 1, (rows, 2)))
    n = np.minimum(n, nb - lo)
    c = rng.integers(1, 2**40, int(n.sum())).astype(np.uint64)
    c[rng.random(c.size) < zero] = 0
    return Sparse(lo.astype(np.int64), n.astype(np.int64), c, int(c.max()) if c.size else 0)


@pytest.mark.parametrize("seed", range(12))
def test_union_add_equals_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, nb = int(rng.integers(0, 60)), 64
    sp = _random_sparse(rng, rows, nb, [0.0, 0.5, 1.0][seed % 3])  # all zero: a past canonical() IndexError
    sizes = rng.integers(1, 5, rows)
    sizes = sizes[: np.searchsorted(np.cumsum(sizes), rows, side="right")]
    if sizes.sum() < rows:
        sizes = np.append(sizes, rows - sizes.sum())
    starts = np.cumsum(sizes) - sizes
    order = rng.permutation(rows)
    got = fastpath.kernels().union_add(order, starts, sizes, sp.lo, sp.n, sp.counts, nb)
    want = merge_mod._union_add(order, starts, sizes, sp, nb)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.tolist() == w.tolist()
    Sparse(*got, sp.cmax).canonical()


def test_counts_near_2_63_and_overflow_refusals_equal_numpy():
    """Spine counts and sketch bins whose sums reach 2**64 - 1 or overflow: the same bytes, or the same refusal
    naming the same files, on both paths."""
    def big(c: int, bins: dict[int, int]) -> Callable:
        def fn(w):
            sk = Sketch.empty()
            for k, v in bins.items():
                sk.pos[k] = v
            w.observe(w.site("a", "activation"), 0, summary=Summary(count=c, zero=c, min=0.0, max=0.0, sketch=sk))
            w.observe(w.site("a", "activation"), 1, summary=Summary(count=1, min=1.0, max=1.0, sketch=Sketch.empty()))
        return fn

    with Dir() as d:
        for (c0, b0), (c1, b1) in [((2**63, {}), (2**63, {})), ((2**63, {}), (2**63 - 1, {})),
                                   ((5, {10: 2**63}), (5, {10: 2**63})), ((5, {10: 2**63, 3: 0}), (5, {10: 2**63 - 1})),
                                   ((2**62, {10: 2**63, 11: 5}), (2**62, {10: 2**63, 12: 7}))]:
            paths = _two(d, big(c0, b0), big(c1, b1))
            a, b = both(lambda o: trainhist.merge(paths, o), d)
            assert a == b
            if isinstance(a, tuple):
                assert a[1] == "count_overflow" and all(p in a[2] for p in paths)


def test_environment_turns_the_kernels_off(tmp_path):
    code = "import trainhist.fastpath as f; print(f.kernels() is None)"
    env = {**os.environ, "TRAINHIST_NO_NUMBA": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def _blocks(blocks: list[bytes]) -> tuple[memoryview, list[int], list[int]]:
    data, start, slen = b"", [], []
    for b in blocks:
        start.append(len(data))
        slen.append(len(b))
        data += b + bytes(-len(b) % 8)
    return memoryview(data), start, slen


def _unpack_both(blocks: list[tuple[int, bytes, int]], dt: str) -> tuple:
    """A column of these (codec, bytes, values) blocks through merge's ``_gather`` with the kernels and through
    ``batchdecode.gather`` (with ``upper_bound`` for u8): (values, bound) or None where it is refused."""
    from trainhist.batchdecode import Fallback, _Col, gather, upper_bound
    from trainhist.chunk import DTYPES

    view, start, slen = _blocks([b for _, b, _ in blocks])
    ns = [n for _, _, n in blocks]
    col = _Col(None, "c", [c for c, _, _ in blocks], start, slen, [DTYPES[dt].itemsize * n for n in ns],
               list(range(len(ns))))
    res = []
    for fast in (True, False):
        try:
            if fast:
                v, b = merge_mod._gather(view, col, dt, ns, bound=True)
            else:
                v, b = gather(view, col, dt, ns), upper_bound(view, col, ns) if dt == "u8" else None
            res.append((v.dtype, v.tolist(), b if dt == "u8" else None))
        except Fallback:
            res.append(None)
    return res[0], res[1]


@pytest.mark.parametrize("dt", ["u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8"])
def test_unpack_equals_numpy_and_refuses_what_it_refuses(dt: str) -> None:
    from trainhist.chunk import _RANGE, DTYPES, Codec, _encode_for, _encode_patched

    lo, hi = _RANGE[dt]
    size = DTYPES[dt].itemsize
    patched = dt in ("u2", "u4", "u8")
    rng = np.random.default_rng(size)
    q = struct.Struct("<q" if dt[0] == "i" else "<Q")
    arrays = [[lo, hi], [hi], [lo], [0, 1, 2], [], [5] * 3, rng.integers(lo, hi, 9, DTYPES[dt], endpoint=True).tolist()]
    if dt[0] == "u":
        arrays.append([254, 255, min(256, hi), hi, 0])
    good = []
    for v in arrays:
        a = np.array(v, DTYPES[dt])
        good.append([(Codec.RAW, a.tobytes(), a.size)])
        if v:
            for w in (0, 1, 2, 4, 8):
                if int(a.max()) - int(a.min()) < 1 << (8 * w):
                    good.append([(Codec.FOR, _encode_for(a, dt, int(a.min()), w), a.size)])
            if patched:
                good.append([(Codec.PATCHED, _encode_patched(a, dt), a.size)])
    good += [good[i] + good[i + 1] + [(-1, b"", 2)] for i in range(len(good) - 1)]  # mixed, and a column absent
    bad = [[(Codec.FOR, q.pack(hi) + b"\x01", 1)],  # a value past the top
           [(Codec.FOR, q.pack(0) + b"\x01\x02\x03", 1)],  # 3 bytes for 1 value: no width
           [(Codec.FOR, q.pack(0), 0)]]  # no values
    if size < 8:
        bad += [[(Codec.FOR, struct.pack("<q", hi + 1), 1)], [(Codec.FOR, struct.pack("<q", lo - 1), 1)]]  # bases
    if patched:
        e = _encode_patched(np.array([1, 300, 7], DTYPES[dt]), dt)
        bad += [[(Codec.PATCHED, e[size:], 3)],  # an escape without its exception
                [(Codec.PATCHED, bytes(size) + b"\x01", 1)],  # an exception without an escape
                [(Codec.PATCHED, struct.pack("<Q", 254)[:size] + b"\xff", 1)],  # an exception below 255
                [(Codec.PATCHED, b"\x01" * (size + 3), 2)]]  # sizes that do not add up
    for blocks in good + bad:
        got, want = _unpack_both(blocks, dt)
        assert got == want
        assert (want is None) == (blocks in bad)
