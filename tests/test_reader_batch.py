"""The reader's batched site decode (all chunks of a site at once) against the per-chunk path of spec 8: the same
rows, exact sums and sketches for files that mix codecs, frame-of-reference widths, sketch and exact columns
across chunks; the same typed error and record offset when a chunk is damaged; decode once for spine + sketch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from history_helpers import (
    COLUMN_DAMAGE,
    FAST,
    damage_column,
    obs_payload,
    rewrite,
    write_mixed,
    write_patched,
)

import trainhist
from trainhist.chunk import Codec
from trainhist.errors import CorruptError
from trainhist.framing import RECORD_HEADER_SIZE
from trainhist.writer import HistoryWriter


def build(p: Path) -> None:
    write_mixed(p, ("raw", "packed", "shuffle", "packed"), seed=3)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("batch") / "mixed.thist"
    build(p)
    return p


def test_batch_equals_per_chunk(mixed: Path) -> None:
    with trainhist.open(mixed) as h:
        codecs = {c[2] for es in h._obs.values() for e in es for c in h.chunk(e)._dir.values()}
        assert {Codec.RAW, Codec.DEFLATE, Codec.SHUFFLE_DEFLATE, Codec.FOR, Codec.F32, Codec.PATCHED} <= codecs
        together = h._batch(h.sites)  # every site in one batch, and each site alone
        for site in h.sites:
            for bc, bx, bs in (together[site.id], h._batch([site])[site.id]):
                check_same(h, site, bc, bx, bs)


def test_batch_equals_per_chunk_on_a_derived_file(mixed: Path, tmp_path: Path) -> None:
    """A merged file has tally columns (spec 11.4): read in one batch, checked on whole columns."""
    m = tmp_path / "m.thist"
    trainhist.coarsen(mixed, m, steps=3)
    with trainhist.open(m) as h:
        assert all(h.chunk(e).has("n_observed") for es in h._obs.values() for e in es)
        together = h._batch(h.sites)
        for site in h.sites:
            check_same(h, site, *together[site.id])


def check_same(h, site, bc, bx, bs) -> None:
    cc, cx, cs = h._site_chunks(site, True)
    assert bc.keys() == cc.keys()
    for k in cc:
        a, b = np.ascontiguousarray(bc[k]), np.ascontiguousarray(cc[k])
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), k
    for k in cx:
        assert np.array_equal(bx[k].n, cx[k].n) and np.array_equal(bx[k].off, cx[k].off)
        assert [bx[k].get(i) for i in range(len(bc["step"]))] == [cx[k].get(i) for i in range(len(cc["step"]))]
    assert bs.scale == cs.scale and np.array_equal(bs.bands, cs.bands)
    for side in (0, 1):
        assert np.array_equal(bs.dense(side), cs.dense(side))


def test_public_api_unchanged(mixed: Path) -> None:
    with trainhist.open(mixed) as h:
        sp = h.spine("a")
        sk = h.sketch("a")
        assert len(sk) == int((sp.sk_row >= 0).sum()) > 0
        for i in (0, len(sk) // 2, len(sk) - 1):
            one = sk.sketch(i)
            assert np.array_equal(one.pos, sk.pos[i]) and np.array_equal(one.neg, sk.neg[i])
            assert one.total() if hasattr(one, "total") else True
        assert sk.pos.shape == sk.neg.shape == (len(sk), 256) and sk.pos.dtype == np.uint64
        pre = h.sketch("g", "param_grad", phase="pre_clip")
        post = h.sketch("g", "param_grad", phase="post_clip")
        assert len(pre) + len(post) == len(h.sketch("g", "param_grad", phase="*"))
        with pytest.raises(ValueError):  # cached decoded columns are shared, so they are read-only
            sp.step[0] = 5


@pytest.mark.parametrize("damage", list(COLUMN_DAMAGE))
def test_damaged_middle_chunk_same_error_and_offset(tmp_path: Path, damage: str) -> None:

    p = tmp_path / "f.thist"
    write_patched(p, seed=0)
    data = bytearray(p.read_bytes())
    target, payload, cols = obs_payload(bytes(data), 2)
    damage_column(payload, cols, damage)
    rewrite(data, target, bytes(payload))
    p.write_bytes(bytes(data))
    want = COLUMN_DAMAGE[damage]
    if damage == "patched_exception":  # sketch columns are checked when sketches are read (spec 8: lazily)
        with trainhist.open(p) as h:
            assert len(h.spine("a")) == 50
    for fn in (lambda h: h.sketch("a"), lambda h: h.verify()) + (
            () if damage == "patched_exception" else (lambda h: h.spine("a"),)):
        with trainhist.open(p) as h:
            with pytest.raises(CorruptError) as ei:
                fn(h)
            assert (ei.value.code, ei.value.offset) == (want, target)


def test_nonzero_directory_padding_is_bad_chunk_on_every_path(tmp_path: Path) -> None:
    """Spec 7.4: the padding after a chunk's directory is zero. None of the three directory checks (the full one,
    the per-chunk fast path of a layout seen before, the batch layout of a site's chunks) looked at it: a file with
    a non-zero byte there read clean. Now each names it, at the chunk's offset."""
    import struct

    p = tmp_path / "f.thist"
    write_patched(p, seed=0)
    data = bytearray(p.read_bytes())
    target, payload, _ = obs_payload(bytes(data), 2)
    (mlen,) = struct.unpack_from("<I", payload)
    assert (4 + mlen) % 8, "this chunk's directory needs no padding: pick another"
    payload[4 + mlen] = 7
    rewrite(data, target, bytes(payload))
    p.write_bytes(bytes(data))
    for fn in (lambda h: h.spine("a"), lambda h: h.sketch("a"), lambda h: h.verify()):
        with trainhist.open(p) as h:
            with pytest.raises(CorruptError) as ei:
                fn(h)
            assert (ei.value.code, ei.value.offset) == ("bad_chunk", target)
            assert "directory" in str(ei.value)


def _dirs(h, entries):
    out = []
    for e in entries:
        p = h._view[e.offset + RECORD_HEADER_SIZE : e.offset + RECORD_HEADER_SIZE + e.length]
        out.append(p[4 : 4 + int.from_bytes(p[:4], "little")])
    return out


def _same_directories(h, entries) -> bool:
    from trainhist.reader import _directories_by_template, _directories_unpacked

    d = _dirs(h, entries)
    a, b = _directories_by_template(d, entries), _directories_unpacked(d, entries)
    if a is None:
        return False
    assert a[0] == b[0] and a[1] == b[1] and a[4] == b[4]
    assert np.array_equal(a[2], b[2]) and np.array_equal(a[3], b[3])
    return True


def test_directory_templates(mixed: Path, tmp_path: Path) -> None:
    with trainhist.open(mixed) as h:
        for site in h.sites:
            _same_directories(h, h._obs[site.id])
        _same_directories(h, [e for s in h.sites for e in h._obs[s.id]])
    # 130 sites: ids from 128 on take two bytes (another directory length, another template)
    p = tmp_path / "many.thist"
    with HistoryWriter(p, commit_every=4, **{k: v for k, v in FAST.items() if k != "commit_every"}) as w:
        sites = [w.site(f"s{i}", "activation") for i in range(130)]
        for step in range(9):
            for s in sites:
                w.observe(s, step, np.arange(5.0) * step)
    with trainhist.open(p) as h:
        entries = [e for s in h.sites for e in h._obs[s.id]]
        assert _same_directories(h, entries)
        assert len({len(d) for d in _dirs(h, entries)}) > 1
        assert len(h.spine("s129")) == 9


def test_directory_template_refuses_other_types() -> None:
    import msgpack

    from trainhist.reader import _directories_by_template, _Entry, _int_positions

    def d(rows, codec, cols=None):
        cols = cols or [["step", "i8", codec, 40, 8 + rows, 8 * rows]]
        return msgpack.packb({"site": 0, "segment": 0, "rows": rows, "cols": cols})

    good = d(3, 3)
    e = _Entry(0, 2, 0, 0, 3, 0, 2, 0, 0)
    assert _directories_by_template([good, d(3, 0)], [e, e]) is not None
    # a boolean, a float, a negative integer or nil where the template has a positive fixint: no template match
    for bad in (good.replace(b"\x03\x28", b"\xc3\x28"), good.replace(b"\x03\x28", b"\xe3\x28")):
        assert len(bad) == len(good)
        assert _directories_by_template([good, bad], [e, e]) is None
    assert _int_positions(msgpack.packb({"a": 1.5})) is None
    assert _int_positions(msgpack.packb({"a": None})) is None
    assert _int_positions(msgpack.packb([1, 2]) + b"\x00") is None  # trailing bytes


def test_deflate_chunks_of_a_batch_are_decoded_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deflate columns go through Chunk.column: each chunk is CRC-checked and decoded once, not once per column."""
    import trainhist.reader as reader_mod

    p = tmp_path / "s.thist"
    opts = {k: v for k, v in FAST.items() if k != "commit_every"}
    with HistoryWriter(p, codec="shuffle", commit_every=5, **opts) as w:
        s = w.site("a", "activation")
        for step in range(40):
            w.observe(s, step, np.random.default_rng(step).standard_normal(300).astype(np.float32))
    calls = []
    orig = reader_mod.History.chunk
    monkeypatch.setattr(reader_mod.History, "chunk", lambda self, e: calls.append(e.offset) or orig(self, e))
    with trainhist.open(p) as h:
        assert len(h.spine("a")) == 40
        n_chunks = len(h._obs[h.site("a").id])
    assert n_chunks == 8 and len(calls) - len(set(calls)) <= 1  # the layout check decodes one chunk twice at most


def test_presence_disagreeing_with_the_tally_is_bad_tally(mixed: Path, tmp_path: Path) -> None:
    m = tmp_path / "m.thist"
    trainhist.coarsen(mixed, m, steps=3)
    data = bytearray(m.read_bytes())
    target, payload, cols = obs_payload(bytes(data), 0)
    _, _, codec, off, _, _ = cols["presence"]
    assert codec in (Codec.RAW, Codec.FOR)
    payload[off] ^= 1  # the first presence code, or the frame's base: now another state than the tally implies
    rewrite(data, target, bytes(payload))
    m.write_bytes(bytes(data))
    with trainhist.open(m) as h, pytest.raises(CorruptError) as ei:
        for site in h.sites:
            h.spine(site.path, site.stream, site.facet, phase="*")
    assert (ei.value.code, ei.value.offset) == ("bad_tally", target)
