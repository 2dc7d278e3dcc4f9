"""The on-device kernel against the numpy reference reduction: counts, bins, min, max bit-equal."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_helpers import CPU_METHODS, Wrapper, bits, ref_summary

from trainhist.summary import SumMethod
from trainhist.torch.reduce import COL_MIN, ROW, Ledger, decode_row, merge_row, reduce_into

SPECIALS = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, -1e-45, 2.0**-48, -(2.0**-48), 2.0**16, 2.0**16 + 64,
            65504.0, -65504.0, 3e38, -1e-300, 1.0, -1.0, 2.0**0.25, 1.1892071]


def run(tensors: list[torch.Tensor], *, method: str | None = None, sketch: bool = True):
    """Reduce ``tensors`` into one ledger row (the spine-only kernel when ``sketch`` is false) and decode it."""
    led = Ledger("cpu")
    led.reset()
    for t in tensors:
        reduce_into(t, led.row("k"), method=method, sketch=sketch)
    p = led.transfer()
    return decode_row(p.row(p.wait(), "k"), sum(t.numel() for t in tensors), sketch=sketch)


def check(got, ref) -> None:
    for f in ("count", "nan", "pinf", "ninf", "zero"):
        assert getattr(got, f) == getattr(ref, f), f
    assert got.sketch == ref.sketch
    if ref.finite:
        assert bits(got.min) == bits(ref.min) and bits(got.max) == bits(ref.max), (got.min, ref.min, got.max, ref.max)
        n, m = ref.finite, max(abs(ref.min), abs(ref.max))
        if got.sum_method == SumMethod.UNKNOWN:  # float64 accumulation overflowed: labelled, stored as zero
            assert n * m * m > 1.7e308 and got.sum.m == 0 and got.sumsq.m == 0
            return
        assert got.sum_method == SumMethod.F64
        # (to_float of the exact sums rounds them once more: by half a unit in their last place)
        for p, got_sum, ref_sum in ((1, got.sum, ref.sum), (2, got.sumsq, ref.sumsq)):
            want = ref_sum.to_float()
            slack = math.ulp(want) / 2
            assert abs(got_sum.to_float() - want) <= SumMethod.bound(SumMethod.F64, n, m, p) + slack, (p, got_sum, want)
    else:
        assert math.isnan(got.min) and math.isnan(got.max)


@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("values", [[1e200, 3e200, 2.0], [4e200, -1e200], [1e308, 1e308]])
def test_float64_sums_that_overflow_are_unknown_both_and_read_as_nan(tmp_path, method, values):
    """A float64 tensor whose float64 sum of squares (or sum) overflows: the row states method unknown and stores
    both sums as zero (spec 5.4: one method covers both, so a finite sum, 3e200 or 4e200 here, is not kept alone);
    written and read back, the reader shows NaN sums, mean and rms (it showed 0.0: missing is never zero) and the
    dump null sums."""
    import json

    import trainhist
    from trainhist.dump import dumps

    x = torch.tensor(values, dtype=torch.float64)
    got = run([x], method=method)
    assert got.sum_method == SumMethod.UNKNOWN and got.sum.m == 0 and got.sumsq.m == 0
    assert (got.count, got.min, got.max) == (len(values), min(values), max(values))
    p = tmp_path / "u.thist"
    with trainhist.HistoryWriter(p, fsync="never") as w:
        w.observe(w.site("x", "activation"), 0, summary=got)
    h = trainhist.open(p)
    sp = h.spine("x")
    assert np.isnan(sp.sum[0]) and np.isnan(sp.sumsq[0]) and np.isnan(sp.mean[0]) and np.isnan(sp.rms[0])
    assert sp.min[0] == min(values) and not sp.sums_known[0]
    row = json.loads(dumps(h))["sites"][0]["rows"][0]
    assert (row["sum"], row["sumsq"], row["method"]) == (None, None, "unknown")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("sketch", [True, False])
def test_kernel_matches_reference(dtype, method, sketch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=g, dtype=torch.float64) * torch.exp(torch.empty(5000, dtype=torch.float64)
                                                                           .uniform_(-40, 14, generator=g))
    x = torch.cat([torch.tensor(SPECIALS, dtype=torch.float64), x]).to(dtype)
    ref = ref_summary([x])
    if sketch:
        check(run([x], method=method), ref)
    else:
        check_spine(run([x], method=method, sketch=False), ref)


@pytest.mark.parametrize("values", [[-0.0, 0.0], [0.0, -0.0], [-0.0], [0.0], [math.nan, math.inf], [-0.0, math.nan]])
def test_signed_zero_total_order_and_no_finite(values):
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor(values, dtype=dtype)
        check(run([x]), ref_summary([x]))


def test_integer_tensors_and_empty():
    x = torch.arange(-7, 9)
    check(run([x]), ref_summary([x]))
    s = run([torch.zeros(0)])
    assert s.count == 0 and math.isnan(s.min)


def test_micro_batches_merge_exactly():
    """Reducing several tensors (any widths) into one row equals reducing their concatenation."""
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(100, generator=g) * 1e-3, torch.tensor([-0.0, math.nan, 7.0]), torch.randn(50, generator=g)]
    check(run(parts), ref_summary([torch.cat(parts)]))
    wide = [parts[0], parts[1].double()]  # float32 and float64 reductions into the same row
    check(run(wide), ref_summary([torch.cat([parts[0].double(), parts[1].double()])]))
    neg_only = [torch.tensor([-3.0, -2.0]), torch.tensor([math.inf])]
    check(run(neg_only), ref_summary([torch.cat(neg_only)]))


def test_ledger_grows_mid_step_and_resets():
    led = Ledger("cpu")
    led.reset()
    reduce_into(torch.tensor([1.0, 2.0]), led.row("a"))
    for i in range(20):  # forces reallocations
        led.row(("b", i))
    led.scalar("s").copy_(torch.tensor([3.5]))
    p = led.transfer()
    data = p.wait()
    assert decode_row(p.row(data, "a"), 2, sketch=False).max == 2.0
    assert p.scalar(data, "s") == 3.5
    led.reset()
    p = led.transfer()
    data = p.wait()
    r = p.row(data, "a")
    assert math.isnan(p.scalar(data, "s")) and int(r[:COL_MIN].sum()) == 0
    assert led.transfers == 2


def test_spine_only_reduction_equals_the_full_one() -> None:
    """sketch=False skips the bin codes but must give the same spine, special values and signed zeros included."""
    import math

    import torch

    from trainhist.torch.reduce import Ledger, decode_row, reduce_into

    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(1000, generator=g), torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45]),
             torch.tensor([-0.0, -0.0]), torch.tensor([0.0]), torch.tensor([math.nan, math.inf])]
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for x in parts + [torch.cat(parts)]:
            x = x.to(dtype)
            ledger = Ledger(torch.device("cpu"))
            reduce_into(x, ledger.row("full"))
            reduce_into(x[: x.numel() // 2], ledger.row("spine"), sketch=False)  # two micro-batches
            reduce_into(x[x.numel() // 2 :], ledger.row("spine"), sketch=False)
            p = ledger.transfer()
            data = p.wait()
            full = decode_row(p.row(data, "full"), x.numel(), sketch=False)
            spine = decode_row(p.row(data, "spine"), x.numel(), sketch=False)
            for f in ("count", "nan", "pinf", "ninf", "zero", "sum_method"):
                assert getattr(spine, f) == getattr(full, f), (dtype, f)
            for f in ("min", "max"):
                a, b = getattr(spine, f), getattr(full, f)
                assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
            assert spine.sketch is None
            assert abs(spine.sum.to_float() - full.sum.to_float()) <= 1e-9 * max(1.0, abs(full.sum.to_float()))


def run_spine(tensors: list[torch.Tensor], method: str | None = None):
    return run(tensors, method=method, sketch=False)


def check_spine(got, ref) -> None:
    ref.sketch = None
    check(got, ref)


#: the two kernels: spine + sketch, and spine only (raw counts decoded on the host)
KERNELS = {"full": (run, check), "spine": (run_spine, check_spine)}


@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("kernel", list(KERNELS))
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64), st.integers(1, 3))
def test_any_float32_bit_pattern(kernel, method, words, chunks):
    """Arbitrary bits, over several micro-batches, equal the numpy reference."""
    reduce_, check_ = KERNELS[kernel]
    a = np.array(words, dtype=np.uint32).view(np.float32)
    parts = [torch.from_numpy(c.copy()) for c in np.array_split(a, chunks) if c.size]
    check_(reduce_(parts, method=method), ref_summary([torch.from_numpy(a)]))


@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("kernel", list(KERNELS))
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=64))
def test_any_float64_bit_pattern(kernel, method, words):
    reduce_, check_ = KERNELS[kernel]
    a = np.array(words, dtype=np.uint64).view(np.float64)
    check_(reduce_([torch.from_numpy(a)], method=method), ref_summary([torch.from_numpy(a)]))


@pytest.mark.parametrize("sketch", [True, False])
def test_fused_blocks_with_and_without_non_finite_values(sketch):
    """The fused kernel works in blocks of BLOCK elements and takes an unmasked path in blocks with no NaN or
    infinity: tensors spanning several blocks, with special values in some blocks only (at block edges too), give
    the same row as the torch-op reduction, bit for bit apart from the float64 sums."""
    from trainhist.torch.cpukernel import BLOCK

    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float64):
        x = (torch.randn(3 * BLOCK + 5, generator=g, dtype=torch.float64) * 10).to(dtype)
        x[BLOCK - 1], x[BLOCK], x[2 * BLOCK + 7], x[-1] = math.nan, -math.inf, -0.0, math.inf
        x[5] = 0.0
        rows = {}
        for method in CPU_METHODS if sketch else ("fused", "bincount", "index_add"):  # (triton: a sketch row always)
            led = Ledger("cpu")
            reduce_into(x, led.row("k"), method=method, sketch=sketch)
            reduce_into(x[:100], led.row("k"), method=method, sketch=sketch)  # a second micro-batch
            rows[method] = led.transfer().wait()[: COL_MIN + 2].copy()
        assert all(np.array_equal(r, rows["index_add"]) for r in rows.values()), rows
        ref = ref_summary([x, x[:100]])
        got = run([x, x[:100]], method="fused", sketch=sketch)
        (check if sketch else check_spine)(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_zero_counts_in_every_block_pattern(dtype):
    """The kernel counts zeros in its main loop only after a block that held some, and otherwise recounts a block
    whose least magnitude is zero: runs of blocks with and without zeros of either sign (one with NaN too) give
    the same counts as the torch-op reduction."""
    from trainhist.torch.cpukernel import BLOCK

    g = torch.Generator().manual_seed(12)
    x = (torch.rand(7 * BLOCK + 3, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    blocks = [x[i * BLOCK : (i + 1) * BLOCK] for i in range(7)]
    blocks[0][::3] = 0.0  # zeros then zeros: the counting loop
    blocks[1][1::7] = -0.0
    blocks[1][2] = 0.0
    # block 2 none: back to the least-magnitude loop
    blocks[3][-1] = -0.0  # a single zero at the block's end: recounted
    blocks[4][0] = 0.0  # after a zero block, with NaN: counted, then redone masked
    blocks[4][9] = math.nan
    x[-2] = -0.0  # the short last block
    for sketch in (False, True):
        rows = {}
        for method in ("fused", "index_add"):
            led = Ledger("cpu")
            reduce_into(x, led.row("k"), method=method, sketch=sketch)
            rows[method] = led.transfer().wait()[:COL_MIN].copy()  # the counts (a zero min's sign: at decode)
        assert np.array_equal(rows["fused"], rows["index_add"]), rows
        got = run([x], method="fused", sketch=sketch)
        (check if sketch else check_spine)(got, ref_summary([x]))
        assert (got.zero, got.nan, got.min) == (int((x == 0).sum()), 1, 0.0)
        assert math.copysign(1.0, got.min) == -1.0  # -0.0 < +0.0


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown reduction method"):
        reduce_into(torch.ones(3), Ledger("cpu").row("k"), method="magic")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32])
def test_chunked_and_strided_inputs(monkeypatch, dtype):
    """Tensors larger than CHUNK are reduced chunk by chunk, non-contiguous ones through the scratch copy."""
    import trainhist.torch.reduce as rd

    monkeypatch.setattr(rd, "CHUNK", 37)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, generator=g, dtype=torch.float64) * 100
    x[::17] = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-300] * 3)[: x[::17].numel()]
    x = x.to(dtype)
    for t in (x, x.view(20, 15).t(), x[:30]):
        for method in CPU_METHODS:  # the fused kernels take no chunks; strided inputs go through the scratch copy
            check(run([t], method=method), ref_summary([t.contiguous()]))
            check_spine(run_spine([t], method=method), ref_summary([t.contiguous()]))


@pytest.mark.parametrize("how", ["merge_row", "Ledger.merge_on_host"])
@pytest.mark.parametrize("sketch", [True, False])
def test_merge_row_equals_reducing_into_the_row(sketch, how):
    g = torch.Generator().manual_seed(9)
    a = torch.cat([torch.randn(100, generator=g), torch.tensor([-0.0, math.nan, math.inf])])
    b = torch.cat([torch.randn(50, generator=g) - 3, torch.tensor([0.0, -math.inf])])
    led = Ledger("cpu")
    reduce_into(a, led.row("a"), sketch=sketch)
    reduce_into(b, led.row("b"), sketch=sketch)
    if how == "merge_row":
        merge_row(led.row("b"), led.row("a"))
    else:  # the host-side merge of a CPU ledger
        led.merge_on_host("b", "a")
    p = led.transfer()
    got = decode_row(p.row(p.wait(), "b"), a.numel() + b.numel(), sketch=sketch)
    ref = ref_summary([torch.cat([a, b])])
    if not sketch:
        ref.sketch = None
    check(got, ref)


def test_decode_rows_equals_decode_row_and_isolates_bad_rows():
    """The batched decode of a step's rows gives each row's decode_row, and a bad row is its own error only."""
    from trainhist.torch.reduce import decode_rows

    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(50, generator=g), torch.tensor([0.0, -0.0, math.nan, math.inf, 2.0]), torch.zeros(0),
          torch.randn(7, generator=g).double()]
    led = Ledger("cpu")
    for i, x in enumerate(xs):
        reduce_into(x, led.row(("sk", i)), sketch=True)
        reduce_into(x, led.row(("sp", i)), sketch=False)
    p = led.transfer()
    data = p.wait()
    keys = [(kind, i) for i in range(len(xs)) for kind in ("sk", "sp")]
    counts = [xs[i].numel() for _, i in keys]
    counts[0] += 1  # a sketch row claimed for one element more than it holds: an error for that row alone
    got = decode_rows(data, [p.rows[k] for k in keys], counts, [k[0] == "sk" for k in keys])
    assert isinstance(got[0], RuntimeError)
    for j, (k, n) in enumerate(zip(keys, counts)):
        if j == 0:
            continue
        want = decode_row(p.row(data, k), n, sketch=k[0] == "sk")
        assert got[j] == want, k
    with pytest.raises(RuntimeError, match="spine-only"):
        decode_row(p.row(data, ("sp", 0)), counts[1], sketch=True)


@pytest.mark.parametrize("sketch", [False, True])
def test_a_row_whose_extremes_a_writer_would_refuse_is_not_decoded(sketch):
    """A row whose counts say it holds finite values but whose min and max were never written (a kernel that
    wrote nothing), or are out of order, fails its decode on both paths, naming the failure: the collector records
    that site 'failed' (not a SpineTable the writer refuses whole, losing every site's row of the step)."""
    from trainhist.torch.reduce import COL_MIN, decode_arrays, decode_rows

    led = Ledger("cpu")
    x = torch.tensor([1.0, -2.0, 0.0, 3.0])
    for k in ("good", "unwritten", "reversed"):
        led.row(k)
    for k in ("good", "reversed"):
        reduce_into(x, led.row(k), sketch=sketch)
    data = led.transfer().wait().copy()
    # "unwritten": an untouched row read as 4 values (its counts: four zeros); "reversed": min 3, max -2
    rev = data[led.rows["reversed"] + COL_MIN: led.rows["reversed"] + COL_MIN + 2].view(np.float64)
    rev[:] = [3.0, 2.0]  # (the row stores min and -max)
    keys = ["good", "unwritten", "reversed"]
    offsets = [led.rows[k] for k in keys]
    arrays = decode_arrays(data, offsets, [4, 4, 4], [sketch] * 3)
    assert arrays.ok.tolist() == [True, False, False]
    assert arrays.has.tolist() == [True, False, False]
    good, unwritten, reversed_ = decode_rows(data, offsets, [4, 4, 4], [sketch] * 3)
    assert (good.min, good.max, good.count) == (-2.0, 3.0, 4)
    # (an unwritten sketch row holds no key counts either: that is named first)
    said = "a sketch was asked of a spine-only ledger row" if sketch else "finite values but not their min <= max"
    assert isinstance(unwritten, RuntimeError) and said in str(unwritten), unwritten
    assert isinstance(reversed_, RuntimeError), reversed_
    assert "finite values but not their min <= max (min 3.0, max -2.0)" in str(reversed_)
    assert _per_row(data, offsets[1], 4, sketch)[0] == "error"
    assert _per_row(data, offsets[2], 4, sketch)[0] == "error"


def _strict(s: object) -> tuple:
    """A summary (or error) as a tuple in which -0.0 and 0.0 differ."""
    if isinstance(s, Exception):
        return ("error", str(s))
    sk = s.sketch
    return (s.count, s.nan, s.pinf, s.ninf, s.zero, repr(s.min), repr(s.max), s.sum, s.sumsq, s.sum_method,
            None if sk is None else (sk.pos.tolist(), sk.neg.tolist(), sk.under_pos, sk.under_neg, sk.over_pos,
                                     sk.over_neg))


def _per_row(data: np.ndarray, offset: int, count: int, sketch: bool) -> tuple:
    """The per-row decode (reduce._decode) of one row, as a strict tuple."""
    from trainhist.torch import reduce as rd

    row = data[offset : offset + ROW]
    try:
        return _strict(rd._decode(row, count, sketch, int(row[: rd.NCOUNT].sum()),
                                  row[rd.COL_NEGZERO : COL_MIN].tolist(), row[COL_MIN:].view(np.float64).tolist()))
    except RuntimeError as e:
        return _strict(e)


def _random_rows(rng: np.random.Generator) -> tuple[np.ndarray, list[int], list[int], list[bool]]:
    """A landed ledger of a few rows of every kind (spine and sketch, NaN, infinities, zeros of both signs,
    subnormals, float64 sums that overflow), some decoded with the wrong count or kind, and now and then one value
    of the buffer corrupted: ``(data, offsets, counts, sketches)``."""
    special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3e38, -2.5], dtype=np.float32)
    led = Ledger("cpu")
    keys = list(range(int(rng.integers(1, 7))))
    counts, sketches = [], []
    for k in keys:
        sketch, n = bool(rng.integers(0, 2)), 0
        led.row(k)
        for _ in range(int(rng.integers(0, 3))):
            m = int(rng.integers(1, 40))
            x = torch.from_numpy(rng.choice(special, m)) if rng.random() < 0.7 else torch.randn(m) * 1e30
            if rng.random() < 0.2:
                x = x.double() * 1e300  # float64 sums that overflow
            reduce_into(x, led.row(k), sketch=sketch)
            n += m
        counts.append(n + (int(rng.integers(-1, 2)) if rng.random() < 0.1 else 0))
        sketches.append(sketch if rng.random() < 0.9 else not sketch)
    data = led.transfer().wait().copy()
    if rng.random() < 0.15:  # a corrupted count or value anywhere in the buffer
        data[int(rng.integers(0, data.size))] += int(rng.integers(-3, 4))
    return data, [led.rows[k] for k in keys], counts, sketches


def test_decode_rows_vectorized_path_equals_the_per_row_path():
    """decode_rows decodes spine and sketch rows with array operations and leaves rows that fail a check to the
    per-row decode: on rows of every kind, some corrupted, both give the same summary or the same error."""
    from trainhist.torch import reduce as rd

    rng = np.random.default_rng(7)
    errors = 0
    for trial in range(150):
        data, offsets, counts, sketches = _random_rows(rng)
        got = [_strict(s) for s in rd.decode_rows(data, offsets, counts, sketches)]
        want = [_per_row(data, o, n, sk) for o, n, sk in zip(offsets, counts, sketches)]
        assert got == want, trial
        errors += sum(w[0] == "error" for w in want)
    assert errors > 10  # the corrupted rows were exercised


def test_spine_tables_hold_the_summaries_of_decode_rows():
    """The collector writes the rows that pass every check as tables (DecodedRows.spine_table, spine rows and
    sketch rows apart): each table row is the summary decode_rows makes of it, sketch included."""
    from trainhist.torch import reduce as rd

    rng = np.random.default_rng(8)
    seen = set()
    for trial in range(150):
        data, offsets, counts, sketches = _random_rows(rng)
        d = rd.decode_arrays(data, offsets, counts, sketches)
        want = rd.decode_rows(data, offsets, counts, sketches)
        for sketch in (False, True):
            rows = np.array([i for i, ok in enumerate(d.ok.tolist()) if ok and sketches[i] == sketch], np.int64)
            table = d.spine_table(rows, sketch)
            assert (table.sketch is not None) == sketch and len(table) == rows.size
            for j, i in enumerate(rows.tolist()):
                assert _strict(table.row(j)) == _strict(want[i]), (trial, i)
                seen.add((sketch, want[i].count > 0))
    assert seen == {(False, False), (False, True), (True, False), (True, True)}


def test_decode_rows_vectorized_path_never_wraps_int64():
    """Corrupted rows whose counts would wrap int64, or whose zero counts are negative, decode as the per-row path
    (Python integers) decodes them: with the same zero signs, the same error, no finite values where it has none."""
    from trainhist import grid
    from trainhist.torch import reduce as rd

    def row(mn: float, mx: float) -> np.ndarray:
        r = np.zeros(ROW, np.int64)
        r[COL_MIN:] = np.array([mn, -mx, 1.0, 1.0]).view(np.int64)
        return r

    big = (1 << 62) + 1
    a = row(0.0, 0.0)  # sketch row: -0.0 count -1, minimum 0
    a[grid.KEY_ZERO], a[rd.COL_NEGZERO] = 4, -1
    b = row(-1.0, 0.0)  # sketch row: +0 key -1, maximum 0
    b[grid.KEY_ZERO], b[rd.COL_NEGZERO], b[5] = -1, 2, 2
    c = row(1.0, 2.0)  # spine row whose raw counts wrap
    c[rd.COL_SPINE : rd.COL_SPINE + 5] = [big, -big, 0, -big, -big]
    d = row(1.0, 2.0)  # sketch row: NaN, +inf and -inf counts that sum past 2**64
    d[[grid.KEY_NAN, grid.KEY_PINF, grid.KEY_NINF]] = 1 << 62
    d[100] = (1 << 62) + 10
    for r, n, sketch in ((a, 3, True), (b, 3, True), (c, 10, False), (d, 10, True)):
        assert _strict(rd.decode_rows(r, [0], [n], [sketch])[0]) == _per_row(r, 0, n, sketch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["negative", "positive", "mixed", "zeros", "negative zeros", "tiny"])
def test_fused_min_max_from_bit_pattern_extremes(dtype, case):
    """The fused kernel takes min and max from the extreme unsigned and signed bit patterns of each block; every
    sign combination (and a NaN in a later block, which that block excludes) gives the reference values."""
    from trainhist.torch.cpukernel import BLOCK

    g = torch.Generator().manual_seed(12)
    base = torch.rand(BLOCK + 10, generator=g, dtype=torch.float64) + 0.5
    x = {"negative": -base, "positive": base, "mixed": base - 1.0, "zeros": torch.zeros_like(base),
         "negative zeros": -torch.zeros_like(base), "tiny": base * 1e-310}[case].to(dtype)
    for t in (x, torch.cat([x, torch.tensor([math.nan, -3.0], dtype=dtype)])):
        for sketch in (False, True):
            got = run([t], method="fused", sketch=sketch)
            (check if sketch else check_spine)(got, ref_summary([t]))


def test_fused_refuses_what_it_cannot_read_by_address():
    """The fused kernel reads memory by address, so anything that is not a CPU tensor with storage is refused with
    an error (the collector records the site as failed), never read."""
    row = Ledger("cpu").row("k")
    with pytest.raises(ValueError, match="CPU tensor"):
        reduce_into(torch.ones(3, device="meta"), row, method="fused")
    with pytest.raises(ValueError, match="int64 CPU row"):
        reduce_into(torch.ones(3), torch.zeros(3, dtype=torch.int64), method="fused")
    with pytest.raises(TypeError, match="complex"):
        reduce_into(torch.ones(3, dtype=torch.complex64), row, method="fused")
    neg = torch._neg_view(torch.tensor([1.0, -2.0, 3.0]))  # a lazily negated view: its memory holds the opposite
    for method in CPU_METHODS:
        check(run([neg], method=method), ref_summary([neg.resolve_neg()]))


def test_without_numba_the_cpu_uses_torch_ops_and_says_so(tmp_path):
    """numba is optional at run time: without it (missing, or not yet built for a new Python) importing the collector
    warns once, the CPU falls back to the torch operations, and a whole training step is still recorded."""
    import subprocess
    import sys

    code = (
        "import sys, warnings\n"
        "sys.modules['numba'] = None  # as if numba were not installed\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import torch\n"
        "    from trainhist.torch import Collector, reduce\n"
        "assert reduce.CPU_METHOD == 'bincount', reduce.CPU_METHOD\n"
        "assert any('fused CPU reduction is unavailable' in str(x.message) for x in w), [str(x.message) for x in w]\n"
        "import trainhist\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        "path = sys.argv[1]\n"
        "col = Collector(model, path, every=1, sketch_every=1)\n"
        "with col.step(0):\n"
        "    model(torch.randn(2, 4)).sum().backward()\n"
        "col.close()\n"
        "assert len(trainhist.open(path).spine('0', 'activation')) == 1\n"
        "try:\n"
        "    reduce.reduce_into(torch.ones(2), reduce.Ledger('cpu').row('k'), method='fused')\n"
        "except ValueError as e:\n"
        "    assert 'numba' in str(e)\n"
        "else:\n"
        "    raise AssertionError('fused without numba')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "h.thist")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_fused_never_reads_memory_that_does_not_hold_the_values(monkeypatch):
    """Strided and expanded views above CHUNK elements (the gradient of ``out.sum()`` is an expanded view), and
    tensor subclasses with no storage, were read wrongly or past their end by address: every method now gives the
    reference, the default falls back to the torch ops for a subclass, and an explicit ``fused`` refuses it."""
    import trainhist.torch.reduce as rd

    monkeypatch.setattr(rd, "CHUNK", 37)
    g = torch.Generator().manual_seed(13)
    base = torch.randn(200, generator=g)
    base[1::2] = -1.0  # what a contiguous read of base[::2] would wrongly see
    for t in (base[::2], torch.full((1,), 2.5).expand(150), base.view(20, 10)[:, 3]):
        for method in CPU_METHODS:
            check(run([t], method=method), ref_summary([t.contiguous()]))
    w = Wrapper(torch.tensor([1.0, -2.0, 4.0]))
    check(run([w]), ref_summary([w.inner]))  # default method: the torch ops read it through dispatch
    with pytest.raises(ValueError, match="plain strided CPU tensor"):
        reduce_into(w, Ledger("cpu").row("k"), method="fused")
    with pytest.raises(ValueError, match="contiguous int64 CPU row"):
        reduce_into(torch.ones(3), torch.zeros(ROW, 2, dtype=torch.int64)[:, 0], method="fused")


def test_merge_on_host_allocating_both_rows_keeps_addresses_valid():
    """Merging rows that do not exist yet allocates both before taking either address (an allocation moves the
    buffer): the rows merge as empty rows, and earlier rows keep their values."""
    led = Ledger("cpu")
    reduce_into(torch.tensor([1.0, 2.0]), led.row("a"))
    led.row("b"), led.row("c")
    led.merge_on_host("d", "e")
    led.merge_on_host("a", "f")
    p = led.transfer()
    data = p.wait()
    assert decode_row(p.row(data, "d"), 0, sketch=True).count == 0
    check(decode_row(p.row(data, "a"), 2, sketch=True), ref_summary([torch.tensor([1.0, 2.0])]))


def test_ledger_growth_keeps_every_new_slot_initialised():
    """A row allocated when the buffer grows may start inside the old buffer's unused tail (scalars make offsets
    that are not multiples of ROW): the grown buffer must keep the row's initial min and -max (+inf), and the
    earlier rows' values of this step."""
    led = Ledger("cpu")
    inf = np.array([math.inf, math.inf]).view(np.int64)
    reduce_into(torch.tensor([1.0, -2.0]), led.row("first"), method="fused")
    for i in range(60):
        if i % 3 == 0:
            led.scalar(("s", i))
        led.row(("k", i))
        buf = led.buf.numpy()
        for k in range(i + 1):
            off = led.rows[("k", k)]
            assert buf[off + COL_MIN : off + COL_MIN + 2].tolist() == inf.tolist(), (i, k)
    got = decode_row(led.transfer().wait()[led.rows["first"] :][:ROW], 2, sketch=True)
    assert (got.min, got.max) == (-2.0, 1.0)


@pytest.mark.skipif("triton" not in CPU_METHODS, reason="Triton is not installed")
def test_triton_refuses_what_it_cannot_read_by_address():
    """The Triton kernel reads memory by address too: a tensor subclass, a row that is not a contiguous int64 row
    of ROW entries, or a row on another device is refused, never read."""
    row = Ledger("cpu").row("k")
    with pytest.raises(ValueError, match="plain strided"):
        reduce_into(Wrapper(torch.tensor([1.0, 2.0])), row, method="triton")
    with pytest.raises(ValueError, match="contiguous int64 row"):
        reduce_into(torch.ones(3), torch.zeros(ROW, 2, dtype=torch.int64)[:, 0], method="triton")
    with pytest.raises(ValueError, match="on its device"):
        reduce_into(torch.ones(3), torch.zeros(ROW, dtype=torch.int64, device="meta"), method="triton")


@pytest.mark.parametrize("sketch", [True, False])
def test_triton_rows_hold_key_counts_and_decode_either_way(sketch):
    """The Triton kernel always writes the key counts (on a GPU they cost no extra pass): such a row decodes to
    the reference spine when no sketch is due and to the reference sketch when one is, over micro-batches."""
    if "triton" not in CPU_METHODS:
        pytest.skip("Triton is not installed")
    g = torch.Generator().manual_seed(21)
    parts = [torch.randn(3000, generator=g, dtype=torch.float64).to(torch.bfloat16),
             torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-40], dtype=torch.bfloat16)]
    got = run(parts, method="triton", sketch=sketch)
    (check if sketch else check_spine)(got, ref_summary([torch.cat(parts)]))


def test_a_failing_triton_launch_falls_back_to_torch_ops_with_key_rows(monkeypatch):
    """Where the Triton kernel fails (an untested GPU, say), the reduction warns once and the torch ops take over
    for the rest of the run, writing key counts even where only the spine is due: rows the kernel began this step,
    in any ledger alive (two collectors, say), hold key counts, and one row must not mix the two layouts; a tensor
    subclass (never the kernel's) writes key counts on that device too, before the failure and after it."""
    import types

    import trainhist.torch.reduce as rd

    calls = {"n": 0}

    def flaky(x, row, ncount, f_cols, fold, width):  # works twice, then fails
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("no kernel image is available for execution on the device")
        rd.reduce_into(x, row, method="index_add", sketch=True)  # (what the kernel writes: key counts)

    monkeypatch.setattr(rd, "CPU_METHOD", "triton")
    monkeypatch.setitem(rd._TRITON, "module", types.SimpleNamespace(reduce_row=flaky))
    monkeypatch.setitem(rd._TRITON, "loaded", True)
    monkeypatch.setitem(rd._TRITON, "failed", False)
    g = torch.Generator().manual_seed(22)
    x = torch.cat([torch.randn(500, generator=g), torch.tensor([-0.0, math.nan])])
    w = Wrapper(x.clone())
    one, two = Ledger("cpu"), Ledger("cpu")
    reduce_into(x, one.row("a"), sketch=False)  # by the kernel
    reduce_into(x, two.row("a"), sketch=False)  # by the kernel, in another ledger
    reduce_into(w, two.row("w"), sketch=False)  # a subclass: the torch ops
    with pytest.warns(RuntimeWarning, match="fused GPU reduction failed") as caught:
        reduce_into(x, one.row("b"), sketch=False)  # the launch fails: the torch ops
        reduce_into(x, two.row("a"), sketch=False)  # the torch ops, into a row the kernel began
        for _ in range(20):  # (rows enough to grow the buffer)
            two.row(("more", _))
        reduce_into(w, two.row("w"), sketch=False)
    assert len([m for m in caught if "GPU reduction" in str(m.message)]) == 1
    assert rd.device_method(x) == "index_add"
    for led, keys in ((one, {"a": 1, "b": 1}), (two, {"a": 2, "w": 2})):
        p = led.transfer()
        data = p.wait()
        for key, times in keys.items():
            ref = ref_summary([x] * times)
            check(decode_row(p.row(data, key), x.numel() * times, sketch=True), ref)
            check_spine(decode_row(p.row(data, key), x.numel() * times, sketch=False), ref_summary([x] * times))
    one.reset()
    reduce_into(x, one.row("a"), sketch=False)  # next step: still key counts (the cost of a failed kernel)
    p = one.transfer()
    check(decode_row(p.row(p.wait(), "a"), x.numel(), sketch=True), ref_summary([x]))


@pytest.mark.skipif("triton" not in CPU_METHODS, reason="Triton is not installed")
def test_a_bad_input_or_a_lack_of_memory_does_not_turn_the_triton_kernel_off(monkeypatch):
    """An input no method can reduce (a complex tensor) is an error of that input, and out of memory a lack of
    memory, not a failed launch: both reach the caller (the collector records the site as failed) and the kernel
    stays on for everything else."""
    import trainhist.torch.reduce as rd

    monkeypatch.setattr(rd, "CPU_METHOD", "triton")
    monkeypatch.setitem(rd._TRITON, "failed", False)
    led = Ledger("cpu")
    with pytest.raises(TypeError, match="complex"):
        reduce_into(torch.ones(3, dtype=torch.complex64), led.row("c"))
    assert not rd._TRITON["failed"] and rd.device_method(torch.ones(2)) == "triton"
    import trainhist.torch.tritonkernel as tk

    def oom(*a, **k):
        raise rd._OOM("CUDA out of memory")

    monkeypatch.setattr(tk, "reduce_row", oom)
    monkeypatch.setattr(tk, "reduce_many", oom)
    with pytest.raises(rd._OOM):
        reduce_into(torch.ones(3), led.row("d"))
    with pytest.raises(rd._OOM):
        rd.triton_many([torch.ones(3)], led.offsets(["e"]), led)
    assert not rd._TRITON["failed"] and rd.device_method(torch.ones(2)) == "triton"


def test_triton_many_equals_the_reference_and_leaves_what_it_cannot_batch(monkeypatch):
    """The batched GPU kernel (one launch per dtype, each tensor cut into chunks whose partials the last chunk
    folds) gives every row the reference, over two calls into the same rows (micro-batches); tensors it cannot
    read by address as they are (non-contiguous, empty, a subclass) are left to the per-tensor path; every ticket
    is re-armed."""
    if "triton" not in CPU_METHODS:
        pytest.skip("Triton is not installed")
    import trainhist.torch.reduce as rd
    import trainhist.torch.tritonkernel as tk

    monkeypatch.setattr(tk, "CHUNK_BLOCKS", 2)  # chunks of 2048 elements: several per tensor
    g = torch.Generator().manual_seed(23)
    xs = []
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for n in (1, 7, 2048, 2049, 6000):
            x = (torch.randn(n, generator=g, dtype=torch.float64) * 10).to(dt)
            if n > 10:
                x[3], x[5], x[2047 % n] = math.nan, -0.0, -math.inf
            xs.append(x)
    odd = [torch.randn(10, 10, generator=g).t(), torch.zeros(0), Wrapper(torch.tensor([1.0, 2.0]))]
    led = Ledger("cpu")
    keys = [("k", i) for i in range(len(xs) + len(odd))]
    offsets = led.offsets(keys)
    assert led.offsets(keys) == offsets  # allocated once
    for _ in range(2):
        done = rd.triton_many(xs + odd, offsets, led)
        assert sorted(done) == list(range(len(xs)))
    assert int(tk._SCRATCH[(torch.device("cpu"), 0)][1].abs().sum()) == 0
    p = led.transfer()
    data = p.wait()
    for i, x in enumerate(xs):
        check(decode_row(p.row(data, keys[i]), 2 * x.numel(), sketch=True), ref_summary([x, x]))
