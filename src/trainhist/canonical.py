"""Canonical low-level I/O for derived files (spec section 11): row batches as numpy columns, their decoding
from a source chunk and their encoding into a canonical chunk, and a writer that lays records out canonically.

A :class:`Rows` batch holds every field of an obs row, with the sketch as dense ``(rows, bins)`` count arrays and
the per-presence tally of leaf rows (``TALLY_COLUMNS``). Rows whose tally has no ``observed`` leaf carry no
numbers: they are zeroed on decode, so every numeric field combines with them as with an identity.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from .chunk import Codec, decode_chunk, encode_chunk
from .dyadic import Dyadic
from .errors import CorruptError, UnsupportedError
from .framing import (
    FILE_HEADER_SIZE,
    READ_VERSION,
    WRITE_VERSION,
    FileHeader,
    RecordHeader,
    RecordType,
    crc32c,
    pack_commit,
    pad8,
)
from .grid import nbins
from .model import (
    CANONICAL_NAN,
    PRIORITY,
    derive_presence,
    EXACT_COLUMNS,
    OBS_COLUMNS,
    SKETCH_COLUMNS,
    STEPS_COLUMNS,
    STEPS_OPTIONAL_COLUMNS,
    TALLY_COLUMNS,
    Phase,
    Presence,
)

__all__ = [
    "CHUNK_ROWS",
    "PRIORITY",
    "Rows",
    "StepRows",
    "decode_obs",
    "decode_steps",
    "encode_obs",
    "encode_steps",
    "derive_presence",
    "blank",
    "canonical_salt",
    "CanonicalWriter",
]

CHUNK_ROWS = 4096  #: rows per obs/steps chunk of a canonical file (the last chunk of a site-segment may be shorter)
NO_ID = 0xFFFFFFFF
_OBS_KNOWN = {**OBS_COLUMNS, **EXACT_COLUMNS, **SKETCH_COLUMNS, **TALLY_COLUMNS}
_OBS_VARIABLE = frozenset({"sum_x", "sumsq_x", "sk_counts"})
_STEPS_KNOWN = {**STEPS_COLUMNS, **STEPS_OPTIONAL_COLUMNS}
_TALLY_NAMES = list(TALLY_COLUMNS)
_COUNT_NAMES = ("count", "nan", "pinf", "ninf", "zero")

@dataclass
class Rows:
    """A batch of obs rows of one site as columns (see the module docstring)."""

    cols: dict[str, np.ndarray]  # OBS_COLUMNS names (presence derived from tally), plus "src" (int32 input index)
    sum_x: np.ndarray  # object: Dyadic where the f8 "sum" column is not exact, else None
    sumsq_x: np.ndarray
    tally: np.ndarray  # (rows, 6) uint64
    has_sk: np.ndarray  # bool
    pos: np.ndarray | None  # (rows, nbins) uint64, None when no row has a sketch
    neg: np.ndarray | None
    bands: np.ndarray | None  # (rows, 4): under_pos, under_neg, over_pos, over_neg
    scale: int | None

    def __len__(self) -> int:
        return int(self.cols["step"].size)

    def take(self, idx: np.ndarray | slice) -> "Rows":
        return Rows(
            {k: v[idx] for k, v in self.cols.items()}, self.sum_x[idx], self.sumsq_x[idx], self.tally[idx],
            self.has_sk[idx], None if self.pos is None else self.pos[idx],
            None if self.neg is None else self.neg[idx], None if self.bands is None else self.bands[idx],
            self.scale,
        )

    @staticmethod
    def concat(parts: list["Rows"]) -> "Rows":
        parts = [p for p in parts if len(p)]
        if len(parts) == 1:
            return parts[0]
        scales = {p.scale for p in parts if p.pos is not None}
        scale = scales.pop() if scales else None
        assert not scales, "callers check the sketch scale before concatenating"
        cols = {k: np.concatenate([p.cols[k] for p in parts]) for k in parts[0].cols}
        if scale is None:
            pos = neg = bands = None
        else:
            nb = nbins(scale)

            def dense(p: Rows, a: np.ndarray | None) -> np.ndarray:
                return a if a is not None else np.zeros((len(p), nb), np.uint64)

            pos = np.concatenate([dense(p, p.pos) for p in parts])
            neg = np.concatenate([dense(p, p.neg) for p in parts])
            bands = np.concatenate([p.bands if p.bands is not None else np.zeros((len(p), 4), np.uint64)
                                    for p in parts])
        return Rows(
            cols, np.concatenate([p.sum_x for p in parts]), np.concatenate([p.sumsq_x for p in parts]),
            np.concatenate([p.tally for p in parts]), np.concatenate([p.has_sk for p in parts]), pos, neg, bands,
            scale,
        )


@dataclass
class StepRows:
    """A batch of step-truth rows as columns (STEPS_COLUMNS plus ``span``)."""

    cols: dict[str, np.ndarray]

    def __len__(self) -> int:
        return int(self.cols["step"].size)

    def take(self, idx: np.ndarray | slice) -> "StepRows":
        return StepRows({k: v[idx] for k, v in self.cols.items()})

    @staticmethod
    def concat(parts: list["StepRows"]) -> "StepRows":
        parts = [p for p in parts if len(p)]
        if len(parts) == 1:
            return parts[0]
        return StepRows({k: np.concatenate([p.cols[k] for p in parts]) for k in parts[0].cols})


# -- decoding ------------------------------------------------------------------------------------------------
def _bad(msg: str, path: str, offset: int, code: str = "bad_chunk") -> CorruptError:
    return CorruptError(msg, code=code, path=path, offset=offset)


def check_payload(payload: bytes, crc: int, path: str, offset: int) -> memoryview:
    if crc32c(payload) != crc:
        raise _bad("payload CRC32C mismatch in a committed chunk", path, offset, "bad_payload_crc")
    return memoryview(payload)


def dyadic_float(m: int, e: int) -> float:
    """Correctly rounded float64 of ``m * 2**e`` (+-inf beyond the range), as ``Dyadic.to_float``."""
    try:
        return m / (1 << -e) if e < 0 else float(m << e)
    except OverflowError:
        return math.inf if m > 0 else -math.inf


def dyadic_is_float(m: int, e: int) -> bool:
    """Whether canonical ``m * 2**e`` (m odd or zero) is exactly a finite float64."""
    if m == 0:
        return True
    n = (m if m > 0 else -m).bit_length()
    return n <= 53 and e >= -1074 and e + n <= 1024


def _exact(ch, name: str, rows: int, f: np.ndarray, path: str, offset: int) -> np.ndarray:
    out = np.full(rows, None, dtype=object)
    if not ch.has(name + "_xn"):
        return out
    lens = ch.column(name + "_xn", rows)
    blob = bytes(ch.column(name + "_x"))
    if int(lens.sum(dtype=np.uint64)) != len(blob):
        raise _bad(f"{name}_x holds {len(blob)} bytes, {name}_xn sums to {int(lens.sum())}", path, offset,
                   "bad_column_length")
    fl = f.tolist()
    pos = 0
    from_bytes = int.from_bytes
    for i, n in enumerate(lens.tolist()):
        if not n:
            continue
        if n < 5:
            raise _bad(f"{name}_x row {i}: a dyadic needs at least 5 bytes", path, offset, "bad_exact_value")
        e = from_bytes(blob[pos : pos + 4], "little", signed=True)
        m = from_bytes(blob[pos + 4 : pos + n], "little", signed=True)
        pos += n
        if (m == 0 and e != 0) or (m != 0 and not m & 1) or n - 4 != (m if m >= 0 else ~m).bit_length() // 8 + 1:
            raise _bad(f"{name}_x row {i}: dyadic encoding is not canonical (mantissa must be odd and "
                       "minimal-length)", path, offset, "bad_exact_value")
        if dyadic_float(m, e) != fl[i]:
            raise _bad(f"{name} row {i} is not the correctly rounded value of {name}_x", path, offset,
                       "bad_exact_value")
        if not dyadic_is_float(m, e):
            out[i] = Dyadic(m, e)
    return out


def blank(r: Rows, mask: np.ndarray) -> None:
    """Clear the numbers of the rows in ``mask`` (rows that are not observed carry none, spec 2.6)."""
    if not mask.any():
        return
    cols = r.cols
    for k in _COUNT_NAMES:
        cols[k][mask] = 0
    for k in ("min", "max"):
        cols[k][mask] = CANONICAL_NAN
    for k in ("sum", "sumsq"):
        cols[k][mask] = 0.0
    cols["method"][mask] = 0
    r.sum_x[mask] = None
    r.sumsq_x[mask] = None
    r.has_sk[mask] = False
    if r.pos is not None:
        r.pos[mask] = 0
        r.neg[mask] = 0
        r.bands[mask] = 0


def decode_obs(payload: memoryview, *, path: str, offset: int, site: int, segment: int, rows: int, step_min: int,
               step_max: int, src: int) -> Rows:
    """Validate and decode one committed obs chunk (``offset``: file offset of its record header)."""
    ch = decode_chunk(payload, offset, path, _OBS_KNOWN, _OBS_VARIABLE)
    m = ch.meta
    if m.get("rows") != rows or m.get("segment") != segment or m.get("site") != site:
        raise _bad(f"chunk directory (site {m.get('site')}, segment {m.get('segment')}, rows {m.get('rows')}) "
                   "disagrees with its commit entry", path, offset)
    missing = [c for c in OBS_COLUMNS if not ch.has(c)]
    if missing:
        raise _bad(f"chunk lacks required columns {missing}", path, offset, "missing_column")
    cols = {name: ch.column(name, rows) for name in OBS_COLUMNS}
    if int(cols["step"].min()) != step_min or int(cols["step"].max()) != step_max:
        raise _bad("chunk steps disagree with the commit entry's step range", path, offset)
    if (cols["phase"] >= len(Phase.NAMES)).any() or (cols["presence"] >= len(Presence.NAMES)).any():
        raise UnsupportedError("chunk uses phase or presence codes unknown to this reader", code="unknown_code",
                               path=path, offset=offset)
    tnames = [n for n in _TALLY_NAMES if ch.has(n)]
    if tnames:
        if len(tnames) != len(_TALLY_NAMES):
            raise _bad(f"chunk has tally columns {tnames} but not all of {_TALLY_NAMES}", path, offset,
                       "bad_tally")
        tally = np.stack([ch.column(n, rows) for n in _TALLY_NAMES], axis=1).astype(np.uint64)
        if (derive_presence(tally) != cols["presence"]).any():
            raise _bad("presence column disagrees with the presence the tally columns imply", path, offset,
                       "bad_tally")
    else:
        tally = np.zeros((rows, len(_TALLY_NAMES)), np.uint64)
        tally[np.arange(rows), cols["presence"].astype(np.intp)] = 1
    cols = {k: v.copy() for k, v in cols.items()}
    sum_x = _exact(ch, "sum", rows, cols["sum"], path, offset)
    sumsq_x = _exact(ch, "sumsq", rows, cols["sumsq"], path, offset)
    has = np.zeros(rows, bool)
    pos = neg = bands = None
    scale = None
    if ch.has("sk"):
        scale = m.get("scale")
        if not isinstance(scale, int) or isinstance(scale, bool) or scale not in (0, 1, 2):
            raise _bad(f"chunk with sketches declares scale {scale!r}; expected 0, 1 or 2", path, offset,
                       "bad_scale")
        nb = nbins(scale)
        sk = {k: ch.column(k, rows) for k in SKETCH_COLUMNS if k != "sk_counts"}
        counts = ch.column("sk_counts")
        if (sk["sk"] > 1).any():
            raise _bad("sk column holds values other than 0 and 1", path, offset, "bad_sketch")
        has = sk["sk"] == 1
        if (~has & ((sk["sk_pn"] > 0) | (sk["sk_nn"] > 0))).any():
            raise _bad("a row without a sketch declares sketch bins", path, offset, "bad_sketch")
        lo = np.stack([sk["sk_plo"], sk["sk_nlo"]], axis=1).astype(np.int64).ravel()  # row-major: pos, neg
        n = np.stack([sk["sk_pn"], sk["sk_nn"]], axis=1).astype(np.int64).ravel()
        if (lo + n > nb).any() or int(n.sum()) != counts.size:
            raise _bad(f"sketch ranges exceed {nb} bins or disagree with the {counts.size} values of sk_counts",
                       path, offset, "bad_sketch")
        dense = np.zeros((2 * rows, nb), np.uint64)
        if counts.size:
            seg = np.repeat(np.arange(2 * rows), n)
            within = np.arange(counts.size) - np.repeat(np.cumsum(n) - n, n)
            dense[seg, np.repeat(lo, n) + within] = counts
        dense = dense.reshape(rows, 2, nb)
        pos, neg = dense[:, 0, :], dense[:, 1, :]
        bands = np.stack([sk[k] for k in ("sk_up", "sk_un", "sk_op", "sk_on")], axis=1).astype(np.uint64)
    presence = derive_presence(tally)
    r = Rows(cols, sum_x, sumsq_x, tally, has, pos, neg, bands, scale)
    blank(r, presence != Presence.OBSERVED)  # spec 2.6: only observed rows carry numbers
    if r.pos is not None and not r.has_sk.any():
        r.pos = r.neg = r.bands = None
        r.scale = None
    for k in ("min", "max"):  # every NaN is "no finite value": canonical bits
        c = cols[k]
        c[np.isnan(c)] = CANONICAL_NAN
    cols["presence"] = presence
    cols["src"] = np.full(rows, src, np.int32)
    return r


def decode_steps(payload: memoryview, *, path: str, offset: int, segment: int, rows: int, step_min: int,
                 step_max: int) -> StepRows:
    """Validate and decode one committed steps chunk."""
    ch = decode_chunk(payload, offset, path, _STEPS_KNOWN)
    m = ch.meta
    if m.get("rows") != rows or m.get("segment") != segment or m.get("site") is not None:
        raise _bad("steps chunk directory disagrees with its commit entry", path, offset)
    missing = [c for c in STEPS_COLUMNS if not ch.has(c)]
    if missing:
        raise _bad(f"chunk lacks required columns {missing}", path, offset, "missing_column")
    cols = {name: ch.column(name, rows).copy() for name in STEPS_COLUMNS}
    cols["span"] = ch.column("span", rows).copy() if ch.has("span") else np.ones(rows, np.uint32)
    if rows and (int(cols["step"].min()) != step_min or int(cols["step"].max()) != step_max):
        raise _bad("steps chunk steps disagree with the commit entry's step range", path, offset)
    for k in ("loss_scale", "clip_threshold"):
        c = cols[k]
        c[np.isnan(c)] = CANONICAL_NAN
    return StepRows(cols)


# -- encoding ------------------------------------------------------------------------------------------------
def _exact_blobs(f: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, bytes] | None:
    idx = [i for i, d in enumerate(x.tolist()) if d is not None]
    if not idx:
        return None
    lens = np.zeros(f.size, np.uint32)
    blobs = []
    pack = struct.Struct("<i").pack
    for i in idx:
        m, e = x[i]
        b = pack(e) + m.to_bytes((m if m >= 0 else ~m).bit_length() // 8 + 1, "little", signed=True)
        lens[i] = len(b)
        blobs.append(b)
    return lens, b"".join(blobs)


def encode_obs(r: Rows, site: int, segment: int, codec: int) -> tuple[bytes, int, int]:
    """Canonical chunk payload of a sorted batch of combined rows; returns payload, first and last step."""
    n = len(r)
    c = r.cols
    cols: dict[str, tuple[str, np.ndarray | bytes]] = {name: (dt, c[name]) for name, dt in OBS_COLUMNS.items()}
    for name, x in (("sum", r.sum_x), ("sumsq", r.sumsq_x)):
        e = _exact_blobs(c[name], x)
        if e is not None:
            cols[name + "_xn"] = ("u4", e[0])
            cols[name + "_x"] = ("bytes", e[1])
    meta: dict = {"site": site, "segment": segment, "rows": n}
    if r.pos is not None and r.has_sk.any():
        nb = r.pos.shape[1]
        dense = np.stack([r.pos, r.neg], axis=1)  # (rows, 2, nb)
        nz = dense != 0
        anynz = nz.any(axis=2)
        first = np.where(anynz, nz.argmax(axis=2), 0)
        last = np.where(anynz, nb - 1 - nz[:, :, ::-1].argmax(axis=2), -1)
        cnt = np.where(anynz, last - first + 1, 0)
        j = np.arange(nb)
        keep = (j >= first[:, :, None]) & (j <= last[:, :, None])
        cols["sk"] = ("u1", r.has_sk.astype(np.uint8))
        cols["sk_plo"], cols["sk_pn"] = ("u2", first[:, 0]), ("u2", cnt[:, 0])
        cols["sk_nlo"], cols["sk_nn"] = ("u2", first[:, 1]), ("u2", cnt[:, 1])
        for k, name in enumerate(("sk_up", "sk_un", "sk_op", "sk_on")):
            cols[name] = ("u8", r.bands[:, k])
        cols["sk_counts"] = ("u8", dense[keep])
        meta["scale"] = r.scale
    implicit = np.zeros_like(r.tally)
    implicit[np.arange(n), c["presence"].astype(np.intp)] = 1
    if (r.tally != implicit).any():
        for k, name in enumerate(_TALLY_NAMES):
            cols[name] = ("u8", r.tally[:, k])
    step = c["step"]
    return encode_chunk(meta, cols, codec), int(step[0]), int(step[-1])


def encode_steps(r: StepRows, segment: int, codec: int) -> tuple[bytes, int, int]:
    cols = {name: (dt, r.cols[name]) for name, dt in STEPS_COLUMNS.items()}
    if (r.cols["span"] != 1).any():
        cols["span"] = ("u4", r.cols["span"])
    step = r.cols["step"]
    return encode_chunk({"segment": segment, "rows": len(r)}, cols, codec), int(step[0]), int(step[-1])


# -- the file ------------------------------------------------------------------------------------------------
def canonical_salt(leaf_writers: list[str] | set[str]) -> int:
    """File salt of a canonical file: the first 8 bytes (little-endian) of SHA-256 over the sorted leaf writer ids."""
    text = "trainhist-canonical-salt/1\n" + "".join(w + "\n" for w in sorted(leaf_writers))
    return int.from_bytes(hashlib.sha256(text.encode("ascii")).digest()[:8], "little")


def manifest_bytes(doc: dict) -> bytes:
    """The one JSON serialisation of a manifest: sorted keys, no white space, ASCII."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


class CanonicalWriter:
    """Append records in the order a canonical file needs; commit when told."""

    def __init__(self, path: str, salt: int) -> None:
        self.path = path
        self._f = open(path, "wb")
        self._salt = salt
        self._seq = 0
        self._entries: list[tuple] = []
        self._f.write(FileHeader(READ_VERSION, WRITE_VERSION, 0, 0, salt).pack())
        self._offset = FILE_HEADER_SIZE

    def _record(self, rtype: int, payload: bytes, site: int = NO_ID, segment: int = NO_ID, rows: int = 0,
                lo: int = 0, hi: int = 0) -> None:
        hdr = RecordHeader(rtype, 0, len(payload), self._seq, self._salt, crc32c(payload)).pack()
        self._f.write(hdr)
        self._f.write(payload)
        self._f.write(b"\0" * pad8(len(payload)))
        if rtype != RecordType.COMMIT:
            self._entries.append((self._offset, rtype, site, segment, rows, lo, hi))
        self._offset += len(hdr) + len(payload) + pad8(len(payload))
        self._seq += 1

    def manifest(self, doc: dict) -> None:
        self._record(RecordType.MANIFEST, manifest_bytes(doc))

    def obs(self, payload: bytes, site: int, segment: int, rows: int, lo: int, hi: int) -> None:
        self._record(RecordType.OBS, payload, site, segment, rows, lo, hi)

    def steps(self, payload: bytes, segment: int, rows: int, lo: int, hi: int) -> None:
        self._record(RecordType.STEPS, payload, NO_ID, segment, rows, lo, hi)

    def commit(self) -> None:
        if not self._entries:
            return
        body = pack_commit(self._seq, self._entries)
        self._entries = []
        self._record(RecordType.COMMIT, body)

    @property
    def bytes_written(self) -> int:
        return self._offset

    def close(self, *, sync: bool = True) -> None:
        self.commit()
        self._f.flush()
        if sync:
            os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()


CODECS = {"shuffle": Codec.SHUFFLE_DEFLATE, "raw": Codec.RAW}
