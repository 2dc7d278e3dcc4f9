"""``chunk._pack_column`` (the packed codec's choice per column, sizes first, only the winning block built)
against building every candidate block and keeping the smallest after padding, raw on ties (spec 7.3)."""

from __future__ import annotations

import numpy as np
import pytest

from trainhist.chunk import (
    DTYPES,
    Codec,
    _encode_f32,
    _encode_for,
    _encode_patched,
    _pack_column,
)
from trainhist.framing import pad8


def _every_block(dt: str, arr: np.ndarray) -> tuple[int, bytes]:
    a = np.ascontiguousarray(arr, DTYPES[dt])
    best, stored = Codec.RAW, a.tobytes()
    if dt == "bytes":
        return best, stored
    cands = [(Codec.F32, _encode_f32(a))] if dt == "f8" else [(Codec.FOR, _encode_for(a, dt))]
    if dt in ("u2", "u4", "u8"):
        cands.append((Codec.PATCHED, _encode_patched(a, dt)))
    for c, blk in cands:
        if blk is not None and len(blk) + pad8(len(blk)) < len(stored) + pad8(len(stored)):
            best, stored = c, blk
    return best, stored


@pytest.mark.parametrize("dt", ["u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "f8", "bytes"])
def test_pack_column_equals_building_every_block(dt: str) -> None:
    rng = np.random.default_rng(7)
    info = np.finfo(np.float64) if dt == "f8" else np.iinfo(DTYPES[dt])
    for n in (0, 1, 2, 3, 7, 8, 9, 40, 257):
        for spread in (0, 1, 254, 255, 256, 70000, 1 << 40, None):
            if dt == "f8":
                a = rng.standard_normal(n) * (1.0 if spread is None else float(spread))
                if spread == 1:
                    a = a.astype(np.float32).astype(np.float64)
            else:
                hi = int(info.max) if spread is None else min(int(info.max), int(info.min) + spread + 1, 1 << 62)
                lo = int(info.min) if spread is None else max(int(info.min), 0 if dt[0] == "u" else -spread)
                hi = max(hi, lo + 1)
                a = rng.integers(lo, hi, n, dtype=np.int64 if hi <= 1 << 62 and lo >= -(1 << 62) else DTYPES[dt],
                                 endpoint=False).astype(DTYPES[dt])
                if n > 2 and dt[0] == "u":
                    a[rng.integers(0, n, 2)] = 255 if spread == 255 else a[0]
            for arr in (a, a.astype(np.int64) if dt in ("u2", "u4", "i4") else a):
                assert _pack_column(dt, arr) == _every_block(dt, arr), (dt, n, spread)
    assert _pack_column("bytes", b"abc") == (Codec.RAW, b"abc")
