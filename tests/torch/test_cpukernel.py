"""The fused CPU kernel's grid keys (integer arithmetic on the bits, :mod:`trainhist.torch.cpukernel`) against the
torch-op reduction with its fold table (``method="bincount"``) and against :func:`trainhist.grid.bin_keys`: every
exponent of both widths with the fractions at and around the quarter-octave thresholds, zeros, subnormals, NaN
payloads and infinities of both signs, at sizes and offsets that take the kernel's whole groups of keys and its
element-by-element tail."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainhist import grid
from trainhist.torch import cpukernel
from trainhist.torch.cpukernel import BLOCK, GROUP
from trainhist.torch.reduce import (COL_MAX, COL_MIN, COL_NEGZERO, NCOUNT, ROW, Ledger, fusable_at, fused_into,
                                    fused_many_at, reduce_into)

WIDTHS = {32: (np.uint32, np.float32, 23, 8, grid.THRESH_F32), 64: (np.uint64, np.float64, 52, 11, grid.THRESH_F64)}


def patterns(bits: int) -> np.ndarray:
    """Every exponent (all ones included: infinities and NaN payloads) of both signs, with the fractions 0, 1, 2,
    half, all ones and each threshold and its neighbours."""
    _, _, mbits, ebits, thresh = WIDTHS[bits]
    fracs = {0, 1, 2, 1 << (mbits - 1), (1 << mbits) - 2, (1 << mbits) - 1}
    fracs |= {t + d for t in thresh for d in (-1, 0, 1)}
    return np.array([(s << (bits - 1)) | (e << mbits) | f
                     for s, e, f in itertools.product((0, 1), range(1 << ebits), sorted(fracs))], dtype=object)


def tensor(words: np.ndarray, bits: int) -> torch.Tensor:
    ut, ft = WIDTHS[bits][:2]
    return torch.from_numpy(np.asarray(words, dtype=object).astype(ut).view(ft).copy())


def row_of(xs: list[torch.Tensor], method: str) -> np.ndarray:
    """The ledger row of the sketch reductions of ``xs`` into one row (micro-batches)."""
    led = Ledger("cpu")
    for x in xs:
        reduce_into(x, led.row("k"), method=method, sketch=True)
    p = led.transfer()
    return p.row(p.wait(), "k").copy()


def key_reference(xs: list[torch.Tensor]) -> np.ndarray:
    """The row's key columns by :func:`grid.bin_keys`: its zero key counts +0.0 only, -0.0 has its own column."""
    a = np.concatenate([x.numpy() for x in xs])
    want = np.bincount(grid.bin_keys(a), minlength=NCOUNT)
    negzero = int(np.count_nonzero((a == 0) & np.signbit(a)))
    want[grid.KEY_ZERO] -= negzero
    want[COL_NEGZERO] = negzero
    return want


def check(xs: list[torch.Tensor]) -> None:
    """The fused row's counts equal the bincount reduction's and the grid reference's; min and max are equal
    values (the sign of a zero one is settled at decode time, from the counts)."""
    got, ref = row_of(xs, "fused"), row_of(xs, "bincount")
    assert np.array_equal(got[:COL_MIN], ref[:COL_MIN]), np.flatnonzero(got[:COL_MIN] != ref[:COL_MIN])
    assert np.array_equal(got[:NCOUNT], key_reference(xs))
    f, g = got[COL_MIN : COL_MAX + 1].view(np.float64), ref[COL_MIN : COL_MAX + 1].view(np.float64)
    assert np.array_equal(f, g), (f, g)


@pytest.mark.parametrize("bits", [32, 64])
def test_every_exponent_and_threshold(bits):
    """All the patterns in one tensor, in order (neighbours share their exponent and sign) and shuffled."""
    x = tensor(patterns(bits), bits)
    check([x])
    check([x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(bits))]])


@pytest.mark.parametrize("bits", [32, 64])
def test_sizes_offsets_and_micro_batches(bits):
    """Slices of every length around the kernel's group and block sizes, at offsets that are not multiples of them,
    and several of them into one row (the zeros and non-finite values are moved out of the overflow keys at the
    end of each call, so each call's row must be exact, not only the last)."""
    x = tensor(patterns(bits), bits)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(7))]
    sizes = sorted({*range(1, 2 * GROUP + 2), 4 * GROUP - 1, BLOCK - 1, BLOCK, BLOCK + 1, BLOCK + GROUP + 3})
    for i, n in enumerate(sizes):
        off = (5 * i) % 67
        check([x[off : off + n]])
    check([x[3 : 3 + BLOCK + 5], x[:1], x[BLOCK : 3 * BLOCK + 17], x[7:40]])


@st.composite
def words(draw, bits: int) -> list[int]:
    """Bit patterns of one width: mostly the special ones (runs of them too), some arbitrary."""
    special = st.sampled_from(patterns(bits).tolist())
    anything = st.integers(0, (1 << bits) - 1)
    items = draw(st.lists(st.one_of(special, anything, st.lists(special, min_size=1, max_size=9).map(tuple)),
                          min_size=1, max_size=120))
    out: list[int] = []
    for it in items:
        out.extend(it if isinstance(it, tuple) else (it,))
    return out


@settings(max_examples=150, deadline=None)
@given(words(32), st.integers(1, 3))
def test_any_float32_patterns(ws, parts):
    x = tensor(np.array(ws, dtype=object), 32)
    check([c for c in torch.tensor_split(x, parts) if c.numel()])


@settings(max_examples=100, deadline=None)
@given(words(64), st.integers(1, 3))
def test_any_float64_patterns(ws, parts):
    x = tensor(np.array(ws, dtype=object), 64)
    check([c for c in torch.tensor_split(x, parts) if c.numel()])


def test_many_equals_one_by_one():
    """The batched entry point runs the same kernel: its rows equal one fused_into per tensor."""
    g = torch.Generator().manual_seed(3)
    xs = [tensor(patterns(32), 32)[: 5000 + 7 * i] for i in range(3)] + [
        torch.randn(n, generator=g, dtype=torch.float64) for n in (1, 33, BLOCK + 9)]
    xs.append(torch.relu(torch.randn(70, generator=g)))
    one = torch.zeros(len(xs), ROW, dtype=torch.int64)
    many = torch.zeros(len(xs), ROW, dtype=torch.int64)
    for r in (one, many):
        r[:, COL_MIN : COL_MAX + 1] = torch.from_numpy(np.array([np.inf, np.inf]).view(np.int64))
    for i, x in enumerate(xs):
        fused_into(x, one[i].data_ptr(), True)
    assert sorted(fused_many_at([fusable_at(x) for x in xs], [many[i].data_ptr() for i in range(len(xs))],
                                True)) == list(range(len(xs)))
    assert torch.equal(one, many)


def test_make_refuses_a_key_layout_the_kernel_cannot_index():
    """The kernel indexes its histograms unchecked, so key columns that do not fit are refused when it is made."""
    mbits, ebits, thresh = 23, 8, grid.THRESH_F32
    cols = (0, 257, 258, 516, 517, 518, 519, 520)
    with pytest.raises(ValueError, match="do not fit"):
        cpukernel.make(32, mbits, ebits, thresh, 316, (0, 258, 258) + cols[3:], 522, 522, 529, 533)
    with pytest.raises(ValueError, match="do not fit"):
        cpukernel.make(32, mbits, ebits, thresh, 316, cols, 522, 515, 529, 533)
    ok = (32, mbits, ebits, thresh, 316, cols, 522, 522, 527, 531)  # the collector's float32 layout
    cpukernel.make(*ok)
    bad_layouts = [
        ((5, cols[:3] + (600, 601, 602, 603, 604)), "do not fit"),  # zero/NaN/inf/-0 columns past the histogram
        ((7, 530), "do not fit"),  # histogram over the spine counts
        ((8, 525), "do not fit"),  # spine counts over the floats
        ((9, 530), "do not fit"),  # floats past the row
        ((4, 70000), "grid offset"),  # uint16 keys would wrap: an index far outside the histogram
        ((4, 0), "grid offset"),  # keys below 0
        ((4, 2), "grid offset"),  # subnormals above the underflow key
        ((4, 800), "grid offset"),  # infinities below the overflow key
    ]
    for (i, value), match in bad_layouts:
        args = list(ok)
        args[i] = value
        with pytest.raises(ValueError, match=match):
            cpukernel.make(*args)
