"""Shared test data: a history that mixes codecs, phases, micro-batches, presence states, NaNs and huge values."""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import numpy as np

from trainhist.chunk import Codec
from trainhist.framing import RECORD_HEADER_SIZE, RecordType, crc32c
from trainhist.writer import HistoryWriter

#: writer options for test files: no fsync, one commit per explicit commit() or close
FAST = dict(fsync="never", commit_every=10**9, commit_seconds=1e18)


def write_mixed(p: Path, codecs: tuple[str, ...], seed: int, **writer_options: object) -> None:
    """Append one 40-step segment of writes per codec in ``codecs`` to ``p`` (sites ``a``, ``g``, ``s``)."""
    rng = np.random.default_rng(seed)
    for k, codec in enumerate(codecs):
        with HistoryWriter(p, mode="a", codec=codec, **writer_options, **FAST) as w:
            a = w.site("a", "activation")
            g = w.site("g", "param_grad")
            s = w.site("s", "activation", cadence_sketch=0)
            for step in range(k * 40, k * 40 + 40):
                x = (rng.standard_normal(64 + step) * 2.0 ** (step % 9 - 4)).astype(np.float32)
                if step % 7 == 3:
                    x[0] = np.nan
                w.observe(a, step, x, sketch=step % 3 != 0)
                if step % 5 == 0:
                    w.mark(g, step, "absent")
                else:
                    w.observe(g, step, x.astype(np.float64) * 1e300 if step % 11 == 0 else x, phase="pre_clip")
                    w.observe(g, step, x[:10], phase="post_clip", micro=step % 2)
                w.observe(s, step, x, sketch=False)
                if step % 13 == 12:
                    w.commit()


def write_patched(p: Path, seed: int, **writer_options: object) -> None:
    """50 steps of one site ``a`` in 10-row chunks whose sketches need patched-byte exceptions (counts above 254)."""
    opts = {**FAST, "commit_every": 10, **writer_options}
    with HistoryWriter(p, **opts) as w:
        a = w.site("a", "activation")
        rng = np.random.default_rng(seed)
        for step in range(50):
            x = rng.standard_normal(5000 + step).astype(np.float32) * 1000
            x[:400] = 1.0  # one bin above 254: a patched exception per row
            w.observe(a, step, x)


def records(data: bytes, rtype: int) -> list[int]:
    """File offsets of the records of type ``rtype`` (walking the framing of spec 4.1)."""
    out, pos = [], 32
    while pos < len(data):
        t, _f, length = struct.unpack_from("<HHI", data, pos)
        if t == rtype:
            out.append(pos)
        pos += RECORD_HEADER_SIZE + length + (-length % 8)
    return out


def rewrite(data: bytearray, pos: int, payload: bytes) -> None:
    """Replace a record's payload (same length) and fix its payload and header CRCs."""
    length = struct.unpack_from("<I", data, pos + 4)[0]
    assert len(payload) == length
    data[pos + RECORD_HEADER_SIZE : pos + RECORD_HEADER_SIZE + length] = payload
    struct.pack_into("<I", data, pos + 24, crc32c(payload))
    struct.pack_into("<I", data, pos + 28, crc32c(bytes(data[pos : pos + 28])))


#: column damages of :func:`damage_column` and the error code each must give
COLUMN_DAMAGE = {"for_wrap": "bad_column_data", "patched_exception": "bad_column_data", "f32_nan": "bad_column_data",
                 "step_range": "bad_chunk", "step_overflow": "bad_column_data"}


def obs_payload(data: bytes, index: int) -> tuple[int, bytearray, dict]:
    """The file offset of the ``index``-th obs record, a copy of its payload and its column entries by name."""
    target = records(data, RecordType.OBS)[index]
    length = struct.unpack_from("<I", data, target + 4)[0]
    payload = bytearray(data[target + RECORD_HEADER_SIZE : target + RECORD_HEADER_SIZE + length])
    (mlen,) = struct.unpack_from("<I", payload)
    return target, payload, {c[0]: c for c in msgpack.unpackb(bytes(payload[4 : 4 + mlen]))["cols"]}


def damage_column(payload: bytearray, cols: dict, damage: str) -> None:
    """Break one packed column of a chunk written by :func:`write_patched` in the way ``damage`` names."""
    if damage == "for_wrap":  # a frame-of-reference value past 2**64 - 1
        _, _, codec, off, slen, _ = cols["count"]
        assert codec == Codec.FOR and slen > 8
        struct.pack_into("<Q", payload, off, 2**64 - 1)
    elif damage == "patched_exception":  # an exception value that fits the byte it replaces
        _, _, codec, off, slen, rlen = cols["sk_counts"]
        assert codec == Codec.PATCHED and slen - rlen // 8 >= 8
        struct.pack_into("<Q", payload, off, 7)
    elif damage == "f32_nan":  # binary32 narrowing may not hold a NaN
        _, _, codec, off, _, _ = cols["min"]
        assert codec == Codec.F32
        struct.pack_into("<I", payload, off, 0x7FC00001)
    elif damage == "step_overflow":  # i8 frame of reference: base + the largest offset passes 2**63 - 1
        _, _, codec, off, slen, _ = cols["step"]
        assert codec == Codec.FOR and slen > 8
        struct.pack_into("<q", payload, off, 2**63 - 2)
    elif damage == "step_range":  # steps that disagree with the commit entry
        _, _, codec, off, _, _ = cols["step"]
        assert codec == Codec.FOR
        struct.pack_into("<q", payload, off, struct.unpack_from("<q", payload, off)[0] + 1)
    else:
        raise ValueError(damage)


def coarsened_sparse(tmp_path: Path, path: str, name: str) -> Path:
    """A site ``path`` observed every 8 steps over 16 steps (step truth at every step), coarsened by 4 into
    ``name``: windows 4..7 and 12..15 hold no due step (they read not_scheduled)."""
    import trainhist

    q = tmp_path / f"{name}.raw.thist"
    with HistoryWriter(q) as w:
        s = w.site(path, "activation", cadence_spine=8)
        for st in range(16):
            if st % 8 == 0:
                w.observe(s, st, np.ones(2))
            w.step_truth(st, applied=True)
    out = tmp_path / name
    trainhist.coarsen(q, out, steps=4)
    return out


def two_runs(tmp_path: Path, nan_at: int | None = None) -> list[Path]:
    """Two runs' files ('runA', 20 steps; 'runB', 25 steps) of one site "x", step truth at every step; runB holds a
    NaN at step ``nan_at``."""
    paths = []
    for name, rid, n in (("runA", "a" * 32, 20), ("runB", "b" * 32, 25)):
        p = tmp_path / f"{name}.thist"
        with HistoryWriter(p, run_id=rid, run_name=name, fsync="never") as w:
            s = w.site("x", "activation")
            for st in range(n):
                w.observe(s, st, np.array([1.0, np.nan if (name, st) == ("runB", nan_at) else 2.0]))
                w.step_truth(st, applied=True)
        paths.append(p)
    return paths


def skipped_updates(path: Path, steps: int, skipped: tuple[int, ...]) -> Path:
    """A ``param_delta`` site "w" observed (two ones) at each of ``steps`` steps but ``skipped``, marked skipped."""
    with HistoryWriter(path) as w:
        s = w.site("w", "param_delta")
        for st in range(steps):
            if st in skipped:
                w.mark(s, st, "skipped")
            else:
                w.observe(s, st, np.ones(2))
    return path
