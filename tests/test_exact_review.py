"""An adversarial review of the exact arithmetic (spec 5.3, 6.2, 11.2, 11.9): exact sums against
``fractions.Fraction``, the canonical form of exact zeros and merges in every grouping. Each test names the defect
it pins down."""

from __future__ import annotations

import struct
from fractions import Fraction
from pathlib import Path

import numpy as np
from history_helpers import obs_payload, rewrite
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainhist
from trainhist.dyadic import Dyadic, sum_within
from trainhist.errors import TrainhistError
from trainhist.summary import Summary, SumMethod

VECTORS = Path(__file__).resolve().parent.parent / "conformance" / "vectors"


def test_an_exact_zero_stored_with_negative_zero_is_written_as_positive_zero(tmp_path):
    """Spec 5.3: the exact zero (m = 0, e = 0) may come with an f64 of -0.0, but a derived file stores the value 0
    as +0.0. Merge passed the -0.0 of a row that combined with nothing through, so ``merge([a])`` held -0.0 and was
    not the canonical form: merging it again (where the -0.0 no longer has an exact form) gave other bytes."""
    src = VECTORS / "valid" / "exact_form_of_binary64" / "input.thist"
    once, twice, coarse = tmp_path / "m1.thist", tmp_path / "m2.thist", tmp_path / "c.thist"
    trainhist.merge([src], once, workers=1)
    trainhist.merge([once], twice, workers=1)
    trainhist.coarsen(src, coarse, steps=1, workers=1)
    for p in (once, coarse):
        s = trainhist.open(p).spine("e").columns["sum"]
        assert s[2] == 0.0 and not np.signbit(s[2]), p
    assert once.read_bytes() == twice.read_bytes() == coarse.read_bytes()


def test_an_empty_sketch_range_is_written_from_bin_zero(tmp_path):
    """Spec 7.5, 11.9: a reader accepts any range, so an empty side may start anywhere (``sk_pn = 0`` with
    ``sk_plo = 7``), but a canonical chunk stores an empty side as ``lo = n = 0``. A row that combined with nothing
    kept its stored ``lo``, so two files with the same content merged to different bytes."""
    p = tmp_path / "neg.thist"
    with trainhist.HistoryWriter(p, codec="raw", fsync="never") as w:
        a = w.site("a", "activation")
        w.observe(a, 0, np.array([-1.0, -2.0]))  # no positive value: the positive side is empty
    data = bytearray(p.read_bytes())
    pos, payload, cols = obs_payload(bytes(data), 0)
    _, _, codec, off, _, _ = cols["sk_plo"]
    assert codec == 0 and struct.unpack_from("<H", payload, off) == (0,)
    struct.pack_into("<H", payload, off, 7)
    rewrite(data, pos, bytes(payload))
    q = tmp_path / "neg7.thist"
    q.write_bytes(bytes(data))
    assert trainhist.open(q).verify()["rows"] == 1
    trainhist.merge([p], tmp_path / "m.thist", workers=1, codec="raw")
    trainhist.merge([q], tmp_path / "m7.thist", workers=1, codec="raw")
    out = (tmp_path / "m7.thist").read_bytes()
    _, payload, cols = obs_payload(out, 0)
    _, _, codec, off, _, _ = cols["sk_plo"]
    assert codec == 0 and struct.unpack_from("<H", payload, off) == (0,)
    assert out == (tmp_path / "m.thist").read_bytes()


# -- exact sums far apart, tiny, huge, cancelling, merged in every grouping ------------------------------------
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_mant = st.one_of(st.sampled_from([1, -1, 3, (1 << 53) - 1, (1 << 53) + 1, -(1 << 64) - 1, (1 << 255) + 1,
                                   -((1 << 300) + 1)]), st.integers(-(1 << 70), 1 << 70))
_expo = st.one_of(st.sampled_from([-1074, -1075, -1200, 970, 971, 1023, 1024, 2000, -(2**31), 2**31 - 200]),
                  st.integers(-60, 60), st.integers(-1300, 1100))
_floats = st.sampled_from([0.0, 5e-324, -5e-324, 1.7976931348623157e308, -1.7976931348623157e308, 0.1])
hostile = st.one_of(st.builds(Dyadic.make, _mant, _expo), _floats.map(Dyadic.from_float))
#: per shard, per step 0..2: None (no row) or (sum, sumsq, method)
shard_rows = st.lists(st.one_of(st.none(), st.tuples(hostile, hostile, st.sampled_from([0, 0, 1, 255]))),
                      min_size=3, max_size=3)


def _fraction(d: Dyadic) -> Fraction:
    return Fraction(d.m) * Fraction(2) ** d.e


def _shard(path: Path, rank: int, world: int, rows: list) -> Path:
    with trainhist.HistoryWriter(path, codec="raw", fsync="never", run_id="1" * 32, writer_id=f"{rank + 1:032x}",
                                 rank=rank, world_size=world) as w:
        a = w.site("a", "activation", cadence_sketch=0)
        for step, row in enumerate(rows):
            if row is not None:
                s, q, method = row
                known = method != SumMethod.UNKNOWN
                w.observe(a, step, summary=Summary(count=1, min=1.0, max=1.0, sum=s if known else Dyadic(0, 0),
                                                   sumsq=Dyadic(abs(q.m), q.e) if known else Dyadic(0, 0),
                                                   sum_method=method, sketch=None))
    return path


def _merged(paths: list[Path], out: Path, **kw) -> bytes | str:
    try:
        trainhist.merge(paths, out, workers=1, **kw)
    except TrainhistError as e:
        return e.code
    return out.read_bytes()


@settings(max_examples=150, **SETTINGS)
@given(shards=st.lists(shard_rows, min_size=2, max_size=3), perm=st.permutations(range(3)))
def test_hostile_exact_sums_merge_in_any_grouping_to_their_exact_sum(tmp_path_factory, shards, perm):
    """Spec 11.2: every order and grouping gives the same bytes (a grouping may be refused, sum_overflow, where the
    merge of all at once is not), the merged sums are the exact sums (Fraction), rounded bit for bit, and coarsening
    commutes with the merge (11.7)."""
    d = tmp_path_factory.mktemp("h")
    paths = [_shard(d / f"s{k}.thist", k, len(shards), rows) for k, rows in enumerate(shards)]
    order = [paths[i] for i in perm if i < len(paths)]
    whole = _merged(paths, d / "all.thist")
    assert _merged(order, d / "perm.thist") == whole
    if isinstance(whole, str):
        assert whole == "sum_overflow"
        return
    left = _merged(order[:2], d / "l.thist")
    if isinstance(left, bytes):
        folded = _merged([d / "l.thist", *order[2:]], d / "fold.thist")
        assert folded == whole or folded == "sum_overflow"
    spine = trainhist.open(d / "all.thist").spine("a")
    for i, step in enumerate(spine.columns["step"].tolist()):
        rows = [rs[step] for rs in shards if rs[step] is not None]
        if max(m for _, _, m in rows) == SumMethod.UNKNOWN:
            assert spine.columns["method"][i] == SumMethod.UNKNOWN and not spine.sums_known[i]
            continue
        got = spine.sum_exact(i)
        if all(abs(s.e) < 5000 for s, _, _ in rows):  # (else a Fraction would take 2**31 bits: the bounded sum)
            assert _fraction(got) == sum((_fraction(s) for s, _, _ in rows), Fraction(0))
        else:
            assert got == sum_within([s for s, _, _ in rows])
        assert struct.pack("<d", spine.columns["sum"][i]) == struct.pack("<d", got.to_float())
    try:  # (a window of one shard may be too wide to store, where the merge of the steps was not)
        coarse = [_coarsened(p, d / f"c{k}.thist") for k, p in enumerate(paths)]
        want = _coarsened(d / "all.thist", d / "all.c.thist").read_bytes()
    except TrainhistError as e:
        assert e.code == "sum_overflow"
        return
    assert _merged(coarse, d / "c.thist") in (want, "sum_overflow")


def _coarsened(p: Path, out: Path) -> Path:
    trainhist.coarsen(p, out, steps=3, workers=1)
    return out
