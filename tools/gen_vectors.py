"""Generate the conformance vectors (conformance/vectors) deterministically.

    python tools/gen_vectors.py            # (re)write conformance/vectors
    python tools/gen_vectors.py --check    # regenerate into a temporary directory; exit 1 on any difference
    python tools/gen_vectors.py --out DIR  # write somewhere else

Everything is fixed: salts, run and writer ids, timestamps, pids, and the deflate streams (made by the tiny
deterministic encoder below, not by the zlib library, whose output differs between versions). Valid files are
written by the reference writer from writer-ops documents (the same input `IMPL write` takes); invalid, truncated
and forward-compat files are hand-built from them record by record. Every case's expectation is cross-checked
against the reference reader while generating, so a vector that does not test what it says fails here, and the
offset of every refused read against the rule of spec 8 ("Offsets": :func:`check_offset_rule`).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import math
import re
import shutil
import struct
import sys
import tempfile
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import msgpack

from trainhist.conformance_impl import run_ops
from trainhist.dump import dumps, tag_f
from trainhist.errors import TrainhistError
from trainhist.framing import FILE_HEADER_SIZE, FileHeader, RecordHeader, RecordType, crc32c, pad8
from trainhist.reader import open_history

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "conformance" / "vectors"
SALT = 0x7665637468697374  # b"tsihtcev" little-endian: any fixed value will do
RUN_ID = "0" * 31 + "1"
WRITER_ID = "0" * 31 + "2"
WRITER_ID_2 = "0" * 31 + "3"
CREATED = "2026-01-01T00:00:00+00:00"
NO_ID = 0xFFFFFFFF
_ENTRY = struct.Struct("<QHHIIIqq")


# -- tagged values -------------------------------------------------------------------------------------------
def F(x: float) -> str:
    return tag_f(x)


def FB(bits: int) -> str:
    return "f:%016x" % bits


def I(n: int) -> str:  # noqa: E743
    return f"i:{n}"


def U(n: int) -> str:
    return f"u:{n}"


# -- a deterministic deflate encoder (RFC 1951 fixed-Huffman or stored blocks, in a zlib wrapper) --------------
_LEN_BASE = [3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195,
             227, 258]
_LEN_EXTRA = [0] * 8 + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [5] * 4 + [0]
_DIST_BASE = [1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537, 2049, 3073,
              4097, 6145, 8193, 12289, 16385, 24577]
_DIST_EXTRA = [0, 0, 0, 0] + [k // 2 for k in range(2, 28)]


class _Bits:
    def __init__(self) -> None:
        self.out = bytearray()
        self.acc = 0
        self.n = 0

    def put(self, value: int, nbits: int) -> None:  # LSB first
        self.acc |= value << self.n
        self.n += nbits
        while self.n >= 8:
            self.out.append(self.acc & 0xFF)
            self.acc >>= 8
            self.n -= 8

    def huff(self, code: int, nbits: int) -> None:  # Huffman codes go MSB first
        self.put(int(format(code, f"0{nbits}b")[::-1], 2), nbits)

    def flush(self) -> bytes:
        if self.n:
            self.out.append(self.acc & 0xFF)
            self.acc = self.n = 0
        return bytes(self.out)


def _litlen(b: _Bits, v: int) -> None:
    if v < 144:
        b.huff(0x30 + v, 8)
    elif v < 256:
        b.huff(0x190 + v - 144, 9)
    elif v < 280:
        b.huff(v - 256, 7)
    else:
        b.huff(0xC0 + v - 280, 8)


def deflate(data: bytes, *, stored: bool = False) -> bytes:
    """A zlib stream of ``data``: one fixed-Huffman block with greedy LZ77 matches, or stored blocks."""
    b = _Bits()
    if stored:
        chunks = [data[i : i + 65535] for i in range(0, len(data), 65535)] or [b""]
        for k, c in enumerate(chunks):
            b.put(1 if k == len(chunks) - 1 else 0, 1)
            b.put(0, 2)
            b.flush()
            b.out += struct.pack("<HH", len(c), len(c) ^ 0xFFFF) + c
    else:
        b.put(1, 1)
        b.put(1, 2)
        last: dict[bytes, int] = {}
        i, n = 0, len(data)
        while i < n:
            best_len = best_dist = 0
            key = data[i : i + 3]
            j = last.get(key) if len(key) == 3 else None
            if j is not None and i - j <= 32768:
                ln = 0
                while ln < 258 and i + ln < n and data[j + ln] == data[i + ln]:
                    ln += 1
                if ln >= 3:
                    best_len, best_dist = ln, i - j
            if best_len:
                code = max(k for k in range(29) if _LEN_BASE[k] <= best_len)
                _litlen(b, 257 + code)
                b.put(best_len - _LEN_BASE[code], _LEN_EXTRA[code])
                dcode = max(k for k in range(30) if _DIST_BASE[k] <= best_dist)
                b.huff(dcode, 5)
                b.put(best_dist - _DIST_BASE[dcode], _DIST_EXTRA[dcode])
                for k in range(i, i + best_len):
                    if k + 3 <= n:
                        last[data[k : k + 3]] = k
                i += best_len
            else:
                _litlen(b, data[i])
                if i + 3 <= n:
                    last[data[i : i + 3]] = i
                i += 1
        _litlen(b, 256)
    out = b"\x78\x01" + b.flush() + struct.pack(">I", zlib.adler32(data))
    assert zlib.decompress(out) == data
    return out


def shuffle(raw: bytes, itemsize: int) -> bytes:
    n = len(raw) // itemsize
    return bytes(raw[j * itemsize + k] for k in range(itemsize) for j in range(n))


# -- records ---------------------------------------------------------------------------------------------------
@dataclass
class Rec:
    """A record to lay out; a commit with ``payload=None`` gets its entries computed by :func:`build`."""

    type: int
    payload: bytes | None
    flags: int = 0
    site: int = NO_ID
    segment: int = NO_ID
    rows: int = 0
    lo: int = 0
    hi: int = 0

    @property
    def is_commit(self) -> bool:
        return self.type == RecordType.COMMIT


def commit() -> Rec:
    return Rec(RecordType.COMMIT, None)


def parse(data: bytes) -> list[Rec]:
    """The records of a (valid, reference-written) file; commits become ``commit()`` markers."""
    recs: list[Rec] = []
    group: list[Rec] = []
    pos = FILE_HEADER_SIZE
    while pos < len(data):
        h = RecordHeader.parse(data, pos)
        assert h is not None
        payload = data[pos + 32 : pos + 32 + h.length]
        if h.type == RecordType.COMMIT:
            _, n = struct.unpack_from("<QQ", payload)
            for k, r in enumerate(group):
                _off, _t, _res, r.site, r.segment, r.rows, r.lo, r.hi = _ENTRY.unpack_from(payload, 16 + 40 * k)
            recs.append(commit())
            group = []
        else:
            r = Rec(h.type, payload, h.flags)
            recs.append(r)
            group.append(r)
        pos += 32 + h.padded_length
    return recs


def header(*, rv: int = 1, wv: int = 1, req: int = 0, opt: int = 0, salt: int = SALT) -> bytes:
    return FileHeader(rv, wv, req, opt, salt).pack()


def build(recs: list[Rec], hdr: bytes | None = None, *, commit_hook: Callable[[int, bytearray], None] | None = None
          ) -> tuple[bytes, list[int]]:
    """Lay records out after ``hdr``; returns the bytes and every record's offset. ``commit_hook(k, payload)``
    may edit the payload of the k-th commit before it is framed."""
    out = bytearray(hdr if hdr is not None else header())
    salt = struct.unpack_from("<Q", out, 20)[0]
    offsets = []
    group: list[tuple[int, Rec]] = []
    ncommit = 0
    for seq, r in enumerate(recs):
        offsets.append(len(out))
        payload = r.payload
        if r.is_commit and payload is None:
            body = bytearray(struct.pack("<QQ", seq, len(group)))
            for off, g in group:
                body += _ENTRY.pack(off, g.type, 0, g.site, g.segment, g.rows, g.lo, g.hi)
            if commit_hook is not None:
                commit_hook(ncommit, body)
            payload = bytes(body)
        if r.is_commit:
            group = []
            ncommit += 1
        else:
            group.append((len(out), r))
        out += RecordHeader(r.type, r.flags, len(payload), seq, salt, crc32c(payload)).pack()
        out += payload + b"\0" * pad8(len(payload))
    return bytes(out), offsets


def patch_header(data: bytes, offset: int, *, fix_crc: bool = True, **fields: int) -> bytes:
    """Rewrite fields of the record header at ``offset`` (type, flags, length, seq, salt, payload_crc)."""
    h = RecordHeader.parse(data, offset)
    assert h is not None
    new = replace(h, **fields).pack()
    if not fix_crc:
        new = new[:28] + data[offset + 28 : offset + 32]
    return data[:offset] + new + data[offset + 32 :]


def no_owner(data: bytes) -> bytes:
    """``data`` without its run and writer manifests (spec 4.4: a reader reads it, merge refuses it)."""
    return build([r for r in parse(data) if r.type != RecordType.MANIFEST
                  or json.loads(r.payload)["kind"] not in ("run", "writer")])[0]


def first(recs: list[Rec], rtype: int, kind: str | None = None) -> Rec:
    for r in recs:
        if r.type == rtype and (kind is None or json.loads(r.payload)["kind"] == kind):
            return r
    raise KeyError(rtype)


def manifest(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


# -- chunks ----------------------------------------------------------------------------------------------------
@dataclass
class Col:
    name: str
    dt: str
    codec: int
    block: bytes
    raw: int


def parse_chunk(payload: bytes) -> tuple[dict, list[Col]]:
    (mlen,) = struct.unpack_from("<I", payload)
    meta = msgpack.unpackb(payload[4 : 4 + mlen], raw=False)
    cols = [Col(n, dt, c, payload[off : off + slen], rlen) for n, dt, c, off, slen, rlen in meta.pop("cols")]
    return meta, cols


def pack_chunk(meta: dict, cols: list[Col], *, override: dict[str, dict[int, Any]] | None = None,
               col_pad: bytes = b"", trailing: bytes = b"", dir_extra: bytes = b"", dir_pad: bytes = b"",
               pack: Callable[[dict], bytes] | None = None) -> bytes:
    """A chunk payload laid out as spec 7.1; ``override`` replaces entry fields (by position) in the directory
    only; ``col_pad`` replaces the first padding bytes after the first column whose block needs padding, ``dir_pad``
    those after the directory (which must have as many); ``dir_extra`` is counted in the directory length after the
    map; ``pack`` replaces the MessagePack packer."""
    override = override or {}
    pk = pack or (lambda d: msgpack.packb(d, use_bin_type=True))
    entries = [[c.name, c.dt, c.codec, 0, len(c.block), c.raw] for c in cols]
    packed = b""
    for _ in range(4):
        d = dict(meta, cols=entries)
        packed = pk(d) + dir_extra
        pos = 4 + len(packed) + pad8(4 + len(packed))
        for e, c in zip(entries, cols):
            e[3] = pos
            pos += len(c.block) + pad8(len(c.block))
    shown = [list(e) for e in entries]
    for e in shown:
        for k, v in override.get(e[0], {}).items():
            e[k] = v(e[k]) if callable(v) else v
    packed = pk(dict(meta, cols=shown)) + dir_extra
    out = bytearray(struct.pack("<I", len(packed)) + packed)
    assert len(dir_pad) <= pad8(len(out)), "the directory is followed by fewer padding bytes than dir_pad"
    out += dir_pad + b"\0" * (pad8(len(out)) - len(dir_pad))
    padded = False
    for c in cols:
        out += c.block
        pad = bytearray(pad8(len(c.block)))
        if col_pad and pad and not padded:
            pad[: len(col_pad)] = col_pad
            padded = True
        out += pad
    return bytes(out + trailing)


def pack_long_ints(obj: Any) -> bytes:
    """MessagePack of a directory with every integer as a 9-byte int64 (0xd3): valid, but not the shortest form."""
    if isinstance(obj, dict):
        assert len(obj) < 16
        return bytes([0x80 | len(obj)]) + b"".join(pack_long_ints(k) + pack_long_ints(v) for k, v in obj.items())
    if isinstance(obj, list):
        head = bytes([0x90 | len(obj)]) if len(obj) < 16 else b"\xdc" + struct.pack(">H", len(obj))
        return head + b"".join(pack_long_ints(v) for v in obj)
    if isinstance(obj, str):
        b = obj.encode()
        assert len(b) < 32
        return bytes([0xA0 | len(b)]) + b
    assert isinstance(obj, int)
    return b"\xd3" + struct.pack(">q", obj)


def edit_chunk(rec: Rec, fn: Callable[[dict, list[Col]], tuple[dict, list[Col]] | None], **kw: Any) -> None:
    meta, cols = parse_chunk(rec.payload)
    res = fn(meta, cols)
    if res is not None:
        meta, cols = res
    rec.payload = pack_chunk(meta, cols, **kw)


def col(cols: list[Col], name: str) -> Col:
    return next(c for c in cols if c.name == name)


def recode(cols: list[Col], codec: int, *, stored: bool = False, only: set[str] | None = None) -> None:
    """Re-encode raw columns with codec 1 (deflate) or 2 (shuffle-deflate) using the deterministic encoder."""
    from trainhist.chunk import DTYPES

    for c in cols:
        if only is not None and c.name not in only:
            continue
        assert c.codec == 0
        data = c.block
        if codec == 2:
            data = shuffle(data, DTYPES[c.dt].itemsize)
        c.block, c.codec = deflate(data, stored=stored), codec


# -- the reference outcome of a file -----------------------------------------------------------------------------
def _reference(data: bytes) -> tuple[int, str, int | None]:
    """(exit, canonical JSON or error code, the error's offset) of the reference reader on ``data``."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "f.thist"
        p.write_bytes(data)
        try:
            with open_history(p) as h:
                h.verify()
                text = dumps(h)
                return (3 if h.recovery.status == "torn" else 0), text, None
        except TrainhistError as e:
            return 1, e.code, e.offset


def outcome(data: bytes) -> tuple[int, str]:
    """(exit, canonical JSON or error code) of the reference reader on ``data``."""
    return _reference(data)[:2]


def refusal(data: bytes) -> tuple[str, int | None]:
    """(code, offset) of the reference reader's error on ``data``, which it must refuse."""
    status, code, offset = _reference(data)
    if status != 1:
        raise AssertionError("the reference reader accepts the file")
    return code, offset


#: the classes of errors of spec 8 ("Offsets") other than those of the file header, and the record types each names
FILE_HEADER_ERRORS = frozenset({"bad_magic", "bad_file_header_crc", "unsupported_read_version", "unsupported_feature"})
FRAMING_ERRORS = frozenset({"bad_record_header", "salt_mismatch", "bad_record_flags", "record_too_large",
                            "bad_sequence", "bad_payload_crc", "bad_padding"})
MANIFEST_ERRORS = frozenset({"bad_manifest_json", "unknown_manifest_kind", "bad_manifest", "bad_site_id",
                             "duplicate_site", "duplicate_segment", "bad_segment_order"})


def check_offset_rule(data: bytes, code: str, offset: int | None) -> None:
    """Assert that ``offset`` is the one spec 8 ("Offsets") names for an error ``code`` in ``data``: 0 for the file
    header; else the start of a record header (found by walking the lengths from byte 32) of the right type."""
    assert offset is not None, f"[{code}] names no offset"
    if code in FILE_HEADER_ERRORS:
        assert offset == 0, f"[{code}] at {offset}: file header errors name offset 0"
        return
    pos = FILE_HEADER_SIZE
    while pos < offset and pos + 32 <= len(data):
        (length,) = struct.unpack_from("<I", data, pos + 4)
        pos += 32 + length + pad8(length)
    assert pos == offset, f"[{code}] at {offset}: not the start of a record header"
    if code in FRAMING_ERRORS:
        return
    (rtype,) = struct.unpack_from("<H", data, offset)
    if code == "bad_commit":
        assert rtype == RecordType.COMMIT, f"[{code}] at {offset} names a record of type {rtype}, not the commit"
    elif code in MANIFEST_ERRORS:
        assert rtype == RecordType.MANIFEST, f"[{code}] at {offset} names a record of type {rtype}, not a manifest"
    elif code == "unknown_record_type":
        assert rtype not in RecordType.NAMES, f"[{code}] at {offset} names a record of known type {rtype}"
    else:  # every other code of a read is a chunk's
        assert rtype in (RecordType.OBS, RecordType.STEPS), f"[{code}] at {offset}: type {rtype} is no chunk"


def same_content(a: bytes, b: bytes) -> bool:
    """True when two files have the same canonical JSON apart from their sizes (recovery)."""
    da, db = json.loads(outcome(a)[1]), json.loads(outcome(b)[1])
    da.pop("recovery"), db.pop("recovery")
    return da == db


def write_ops(doc: dict) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "w.thist"
        run_ops(doc, str(p))
        return p.read_bytes()


# -- writer-ops documents ---------------------------------------------------------------------------------------
def ops_doc(ops: list[dict], *, codec: str = "raw", name: str = "vector", config: dict | None = None,
            settings: dict | None = None, writer_id: str = WRITER_ID, rank: int = 0, world_size: int = 1) -> dict:
    return {
        "format": "trainhist-writer-ops/1",
        "codec": codec,
        "salt": U(SALT),
        "created": CREATED,
        "run": {"run_id": RUN_ID, "name": name, "config": config or {}},
        "writer": {"writer_id": writer_id, "rank": rank, "world_size": world_size, "host": "vector-host",
                   "pid": 4242, "software": {"gen_vectors": "1"}},
        "settings": settings,
        "ops": ops,
    }


def site(path: str, stream: str = "activation", **kw: Any) -> dict:
    d = {"op": "site", "path": path, "stream": stream, "facet": None, "shape": None, "dtype": None,
         "sharing": "shard", "cadence": {"spine": 1, "sketch": 1}, "sample": None}
    d.update(kw)
    return d


def obs(site_id: int, step: int, values: list[float | str], **kw: Any) -> dict:
    d = {"op": "observe", "site": site_id, "step": I(step),
         "values": [v if isinstance(v, str) else F(v) for v in values]}
    d.update(kw)
    return d


def truth(step: int, **kw: Any) -> dict:
    d = {"op": "step_truth", "step": I(step), "applied": None, "grad_basis": None, "clipped": None,
         "loss_scale": None, "clip_threshold": None, "micro_batches": None, "tokens": None, "samples": None}
    d.update(kw)
    return d


COMMIT = {"op": "commit"}

BASIC_OPS = [
    site("fc", shape=[4], dtype="float32"),
    obs(0, 0, [1.0, -2.5, 0.0, 3.0]),
    truth(0, applied="applied", grad_basis="unscaled", clipped="not_clipped", micro_batches=U(1)),
    COMMIT,
]
NOSKETCH_OPS = [site("fc", cadence={"spine": 1, "sketch": 0}), obs(0, 0, [1.0, -2.5, 0.0], sketch=False), COMMIT]
TWO_GROUPS_OPS = [
    site("fc", shape=[3], dtype="float64"),
    obs(0, 0, [1.0, 2.0, -0.5]),
    COMMIT,
    obs(0, 1, [1.5, 2.5, -0.75]),
    truth(1, applied="applied"),
    COMMIT,
]
SPECIALS = [
    FB(0x7FF8000000000000), FB(0xFFF0000000000001),  # quiet NaN, negative signalling NaN: both count as nan
    F(math.inf), F(-math.inf), F(-0.0), F(0.0),
    FB(0x0000000000000001),  # smallest subnormal: underflow band
    F(2.0**-48), FB(0x3CF0000000000001),  # 2**-48 is the last underflow value; the next float is in bin -192
    F(2.0**16), FB(0x40F0000000000001),  # 2**16 is in the top bin 63; the next float overflows
    F(-1e300), F(1.0), F(2.0), F(-3.0), F(0.1),
]


def exact_ops(sid: int) -> list[dict]:
    return [
        site("exact", cadence={"spine": 1, "sketch": 0}),
        obs(sid, 0, [1.0, 2.0**-80], sketch=False),  # sum and sumsq are not binary64 values
        obs(sid, 1, [1e200, 1e200, -1e-200], sketch=False),  # sumsq beyond binary64: inf column, exact bytes
        obs(sid, 2, [2.0**1023, 2.0**1023], sketch=False),  # the sum overflows binary64 too
        obs(sid, 3, [0.5, 0.25], sketch=False),  # exact in binary64: no exact bytes for this row
    ]


EXACT_OPS = exact_ops(0) + [COMMIT]
BIG_SUMMARY = {
    "count": U(2**64 - 1), "nan": U(2**63), "pinf": U(0), "ninf": U(0), "zero": U(2**62),
    "min": F(1.0), "max": F(1.0), "sum": f"d:{2**62 - 1}p0", "sumsq": f"d:{2**62 - 1}p0", "method": "exact",
    "sketch": {"scale": 2, "pos": {"-1": U(2**62 - 1)}, "neg": {}, "under_pos": U(0), "under_neg": U(0),
               "over_pos": U(0), "over_neg": U(0)},
}
HUGE_SUM_SUMMARY = {  # one value whose exact sum has the largest exponent the i32 of spec 5.3 holds
    "count": U(1), "nan": U(0), "pinf": U(0), "ninf": U(0), "zero": U(0),
    "min": F(1.0), "max": F(1.0), "sum": f"d:1p{2**31 - 1}", "sumsq": "d:1p0", "method": "exact",
}
def one_sum(sum: str, **kw: Any) -> dict:
    """One value's row (1.0) whose stored sum is the dyadic ``sum`` (spec 5.3 and 5.5 do not tie it to min/max)."""
    return {"count": U(1), "nan": U(0), "pinf": U(0), "ninf": U(0), "zero": U(0), "min": F(1.0), "max": F(1.0),
            "sum": sum, "sumsq": "d:1p0", "method": "exact", **kw}


WIDEST_M = 2**8190 + 1  #: a mantissa of 8,191 bits: the widest an exact form holds (spec 5.3), in 1024 bytes
UNKNOWN_SUMS_SUMMARY = {  # float64 values near 1e200: the float64 sum of squares overflowed, the sums are unknown
    "count": U(3), "nan": U(0), "pinf": U(0), "ninf": U(0), "zero": U(0),
    "min": F(2.0), "max": F(3e200), "sum": None, "sumsq": None, "method": "unknown",
}


def exact_summary(values: list[float]) -> dict:
    """The spine of ``values`` (float64, finite, integers) with its exact sums (``method`` exact, no sketch)."""
    ints = [int(v) for v in values]
    total, squares = sum(ints), sum(v * v for v in ints)

    def dyadic(n: int) -> str:
        if n == 0:
            return "d:0p0"
        e = (n & -n).bit_length() - 1
        return f"d:{n >> e}p{e}"

    return {"count": U(len(ints)), "nan": U(0), "pinf": U(0), "ninf": U(0), "zero": U(ints.count(0)),
            "min": F(float(min(values))), "max": F(float(max(values))), "sum": dyadic(total),
            "sumsq": dyadic(squares), "method": "exact"}


SCALE1_SUMMARY = {
    "count": U(5), "nan": U(0), "pinf": U(0), "ninf": U(0), "zero": U(0),
    "min": F(-4.0), "max": F(100000.0), "sum": "d:50001p1", "sumsq": "d:5000000017p1",
    "method": "f64_accumulate",
    "sketch": {"scale": 1, "pos": {"-1": U(2), "3": U(1)}, "neg": {"3": U(1)}, "under_pos": U(0),
               "under_neg": U(0), "over_pos": U(1), "over_neg": U(0)},
}
FULL_OPS = [
    site("h.0.mlp", shape=[2, 3], dtype="bfloat16"),
    site("h.0.mlp", "activation_grad", facet="0", cadence={"spine": 1, "sketch": 2}),
    site("h.0.mlp.weight", "param_grad", sharing="replica", dtype="float32", shape=[3, 3],
         sample={"elements": 4, "of": 9, "seed": 7}),
    obs(0, 0, [0.5, -0.5, 1.25, 0.0, -0.0, 7.0]),
    obs(1, 0, [1e-3, -2e-3], micro=U(0)),
    obs(1, 0, [3e-3, 4e-3], micro=U(1)),
    obs(1, 0, [1e-3, -2e-3, 3e-3, 4e-3], sketch=False),
    obs(2, 0, [0.1, 0.2, 0.3, 0.4], phase="pre_clip"),
    obs(2, 0, [0.05, 0.1, 0.15, 0.2], phase="post_clip"),
    {"op": "scalar", "name": "loss", "step": I(0), "value": F(2.75)},
    {"op": "scalar", "name": "loss_scale", "step": I(0), "value": F(65536.0)},
    truth(0, applied="applied", grad_basis="scaled", clipped="clipped", loss_scale=F(65536.0),
          clip_threshold=F(1.0), micro_batches=U(2), tokens=U(4096), samples=U(8)),
    COMMIT,
    {"op": "mark", "site": 0, "step": I(1), "presence": "absent"},
    {"op": "mark", "site": 1, "step": I(1), "presence": "not_scheduled"},
    {"op": "mark", "site": 2, "step": I(1), "presence": "skipped", "phase": "pre_clip"},
    {"op": "scalar", "name": "loss", "step": I(1), "value": FB(0x7FF8000000000000)},
    truth(1, applied="skipped", grad_basis="scaled", loss_scale=F(32768.0), micro_batches=U(2)),
    COMMIT,
    {"op": "new_segment", "first_step": I(10), "reason": "manual"},
    obs(0, 10, [2.0, 4.0, 8.0]),
    {"op": "mark", "site": 1, "step": I(10), "presence": "failed"},
    {"op": "mark", "site": 1, "step": I(10), "presence": "unknown", "micro": U(3)},
    site("h.1.mlp.weight", "param_delta", cadence={"spine": 1, "sketch": 1}),
    {"op": "observe", "site": 5, "step": I(10), "summary": SCALE1_SUMMARY},  # sites 3, 4: the scalars
    {"op": "observe", "site": 5, "step": I(11), "summary": SCALE1_SUMMARY},
    {"op": "scalar", "name": "loss", "step": I(10), "value": F(-0.0)},
    truth(10),
    truth(11, tokens=U(2**64 - 2), samples=U(0)),
    {"op": "observe", "site": 0, "step": I(-5), "values": [F(1.0)]},
]


def no_finite_row0(cs: list[Col], exact: bytes, *, absent: bool = False) -> None:
    """Row 0 of a chunk of the `exact` file made a row without finite values (every element NaN; with ``absent``, an
    absent row without counts): min and max NaN, f64 sums +0.0, and both exact forms (sum_x, sumsq_x) ``exact``."""
    import numpy as np

    def row0(name: str, dt: str, value: Any) -> None:
        v = np.frombuffer(col(cs, name).block, dt).copy()
        v[0] = value
        col(cs, name).block = v.tobytes()

    if absent:  # row 0 becomes an absent row: no counts
        for name in ("count", "nan", "pinf", "ninf"):
            row0(name, "<u8", 0)
        row0("presence", "<u1", 2)
    else:
        row0("nan", "<u8", np.frombuffer(col(cs, "count").block, "<u8")[0])
    row0("zero", "<u8", 0)
    row0("min", "<f8", math.nan)
    row0("max", "<f8", math.nan)
    for name in ("sum", "sumsq"):
        row0(name, "<f8", 0.0)
        n, b = col(cs, name + "_xn"), col(cs, name + "_x")
        lens = np.frombuffer(n.block, "<u4").copy()
        b.block = exact + b.block[int(lens[0]) :]
        b.raw = len(b.block)
        lens[0] = len(exact)
        n.block = lens.tobytes()


def exact_row(cs: list[Col], k: int, enc: bytes, f64: float | None = None) -> None:
    """Row ``k``'s exact sum (``sum_x``) becomes the bytes ``enc`` (its ``sum_xn`` their length) and, with ``f64``, its
    f64 ``sum`` that value (a chunk with the exact columns ``sum_xn``, ``sum_x``)."""
    import numpy as np

    n, b = col(cs, "sum_xn"), col(cs, "sum_x")
    lens = np.frombuffer(n.block, "<u4").copy()
    at = int(lens[:k].sum())
    b.block = b.block[:at] + enc + b.block[at + int(lens[k]) :]
    b.raw = len(b.block)
    lens[k] = len(enc)
    n.block = lens.tobytes()
    if f64 is not None:
        v = np.frombuffer(col(cs, "sum").block, "<f8").copy()
        v[k] = f64
        col(cs, "sum").block = v.tobytes()


# -- the suite -----------------------------------------------------------------------------------------------------
class Suite:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.counts: dict[str, int] = {}

    def _case(self, category: str, name: str, doc: dict, files: dict[str, bytes]) -> None:
        d = self.out / category / name
        assert not d.exists(), f"duplicate case {category}/{name}"
        d.mkdir(parents=True)
        doc = {"category": category, **doc}
        (d / "case.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", "utf-8")
        for fname, data in files.items():
            (d / fname).write_bytes(data)
        self.counts[category] = self.counts.get(category, 0) + 1

    def read(self, category: str, name: str, description: str, spec: list[str], data: bytes, *,
             error: str | None = None, exit: int | None = None) -> str | None:
        """A read case; the expectation is what the reference reader does, asserted against ``error``/``exit``."""
        rc, res = outcome(data)
        if error is not None:
            assert (rc, res) == (1, error), f"{category}/{name}: expected [{error}], reference gives {rc} {res[:200]}"
            code, offset = refusal(data)
            check_offset_rule(data, code, offset)
            expect: dict[str, Any] = {"exit": 1, "error": error, "offset": offset}
            files = {"input.thist": data}
        else:
            want = exit if exit is not None else {"truncated": 3}.get(category, 0)
            assert rc == want, f"{category}/{name}: expected exit {want}, reference gives {rc} {res[:200]}"
            expect = {"exit": rc, "dump": "expected.json"}
            if category == "truncated":
                rec = json.loads(res)["recovery"]
                expect["recovery"] = {k: int(rec[k][2:]) for k in ("committed_bytes", "dropped_bytes")}
            files = {"input.thist": data, "expected.json": res.encode()}
        self._case(category, name, {"description": description, "spec": spec, "command": "read",
                                    "args": {"file": "input.thist"}, "expect": expect}, files)
        return None if error is not None else res

    def writer(self, name: str, description: str, spec: list[str], doc: dict, *, error: str | None = None
               ) -> bytes | None:
        """A write case; with ``error``, one whose document the reference refuses with that code (exit 1)."""
        ops = json.dumps(doc, indent=1, sort_keys=True) + "\n"
        if error is not None:
            try:
                write_ops(doc)
            except TrainhistError as e:
                assert e.code == error, f"writer/{name}: expected [{error}], reference gives [{e.code}] {e}"
            else:
                raise AssertionError(f"writer/{name}: the reference writes the document")
            self._case("writer", name, {"description": description, "spec": spec, "command": "write",
                                        "args": {"ops": "ops.json"}, "expect": {"exit": 1, "error": error}},
                       {"ops.json": ops.encode()})
            return None
        data = write_ops(doc)
        rc, res = outcome(data)
        assert rc == 0, (name, res)
        self._case("writer", name, {"description": description, "spec": spec, "command": "write",
                                    "args": {"ops": "ops.json"},
                                    "expect": {"exit": 0, "dump": "expected.json", "output": "expected.thist"}},
                   {"ops.json": ops.encode(), "expected.thist": data, "expected.json": res.encode()})
        return data


def derive(command: str, inputs: dict[str, bytes], args: dict) -> tuple[int, str, bytes | None]:
    """(exit, canonical JSON or error code, output bytes) of the reference merge/coarsen (raw codec)."""
    import trainhist

    with tempfile.TemporaryDirectory() as d:
        for name, data in inputs.items():
            (Path(d) / name).write_bytes(data)
        out = Path(d) / "out.thist"
        try:
            if command == "merge":
                trainhist.merge([Path(d) / f for f in args["inputs"]], out, across_runs=args.get("across_runs", False),
                                codec="raw")
            else:
                trainhist.coarsen(Path(d) / args["input"], out, steps=args["steps"],
                                  bins_per_octave=args["bins_per_octave"], codec="raw")
        except TrainhistError as e:
            return 1, e.code, None
        data = out.read_bytes()
    rc, res = outcome(data)
    assert rc == 0, (command, res)
    return 0, res, data


def _derived_case(s: "Suite", category: str, name: str, description: str, spec: list[str], inputs: dict[str, bytes],
                  args: dict, error: str | None = None) -> bytes | None:
    rc, res, data = derive(category, inputs, args)
    if error is not None:
        assert (rc, res) == (1, error), f"{category}/{name}: expected [{error}], reference gives {rc} {res[:200]}"
        expect: dict[str, Any] = {"exit": 1, "error": error}
        files = dict(inputs)
    else:
        assert rc == 0, f"{category}/{name}: reference gives [{res}]"
        expect = {"exit": 0, "dump": "expected.json", "output": "expected.thist"}
        files = {**inputs, "expected.json": res.encode(), "expected.thist": data}
    s._case(category, name, {"description": description, "spec": spec, "command": category, "args": args,
                             "expect": expect}, files)
    return data


def gen_valid(s: Suite) -> dict[str, bytes]:
    base: dict[str, bytes] = {}
    v = "valid"
    s.read(v, "header_only", "a file of just its 32-byte header: clean, with nothing in it", ["3", "8"], header())
    base["basic"] = write_ops(ops_doc(BASIC_OPS))
    assert build(parse(base["basic"]))[0] == base["basic"]
    s.read(v, "basic", "one site, one observation with a sketch, one step-truth row, one commit (raw codec)",
           ["2", "5", "6", "7", "10"], base["basic"])
    base["nosketch"] = write_ops(ops_doc(NOSKETCH_OPS))
    s.read(v, "no_sketch", "an obs chunk without sketch columns (no `scale` in the directory)", ["7.2", "7.5"],
           base["nosketch"])
    s.read(v, "specials", "NaN payloads, infinities, signed zeros, a subnormal, the window edges 2^-48 and 2^16 "
           "and their neighbours, and a row with no finite value (min/max null)", ["5.1", "6.1", "6.2", "10"],
           write_ops(ops_doc([site("x"), obs(0, 0, SPECIALS), obs(0, 1, [FB(0x7FF8000000000000), F(math.inf)]),
                              COMMIT])))
    base["exact"] = write_ops(ops_doc(EXACT_OPS))
    base["exact_small"] = write_ops(ops_doc([site("e", cadence={"spine": 1, "sketch": 0}),
                                             obs(0, 0, [1.0, 2.0**-80], sketch=False),
                                             obs(0, 1, [0.5, 0.25], sketch=False),
                                             obs(0, 2, [1.0, -1.0], sketch=False), COMMIT]))
    s.read(v, "exact_sums", "sums that are not binary64 values: the sum_x/sumsq_x columns, overflow to inf in the "
           "f64 column with the exact value kept", ["5.3", "7.5", "10"], base["exact"])
    s.read(v, "big_counts", "u64 counts above 2^53 (up to 2^64-1) in the spine and the sketch", ["5.1", "10"],
           write_ops(ops_doc([site("big"), {"op": "observe", "site": 0, "step": I(0), "summary": BIG_SUMMARY},
                              COMMIT])))
    base["full"] = write_ops(ops_doc(FULL_OPS, settings={"cadence": 1, "sites": ["h.0.mlp"]},
                                     config={"lr": "3e-4", "layers": 2, "name": "caf\u00e9"}))
    s.read(v, "full", "several streams, facets, a replica and a sampled site, micro-batches, pre/post-clip "
           "phases, scalars, every presence, step truth with known and unknown fields, a manual segment, "
           "a scale-1 sketch, a settings manifest, non-ASCII text", ["2", "5.4", "6.3", "7.6", "9", "10"],
           base["full"])
    base["two_groups"] = write_ops(ops_doc(TWO_GROUPS_OPS))
    s.read(v, "two_commits", "two commits; the site's rows come from two chunks", ["4.3", "8"], base["two_groups"])
    # resume: a second writer session appends a new segment to the same file
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "r.thist"
        run_ops(ops_doc(TWO_GROUPS_OPS[:3]), str(p))
        with open(p, "ab") as f:  # a torn tail the resuming writer must drop
            f.write(b"\x02\x00\x00\x00" + b"\xab" * 20)
        from trainhist.writer import HistoryWriter

        with HistoryWriter(p, mode="a", codec="raw", fsync="never", rank=0, world_size=1, host="vector-host",
                           writer_id=WRITER_ID_2, created=CREATED, pid=4243, software={"gen_vectors": "1"},
                           commit_every=1 << 62, commit_seconds=math.inf) as w:
            fc = w.site("fc", "activation")
            w.observe(fc, 5, values=__import__("numpy").array([9.0, -9.0]))
            w.step_truth(5, applied=True)
        s.read(v, "resumed", "a file appended by a second writer session: two writer manifests, a `resume` "
               "segment whose `previous` is 0", ["2.4", "8"], p.read_bytes())
    # codecs: the same content with deflate, shuffle-deflate, and one codec per column
    recs = parse(base["basic"])
    for r in recs:
        if r.type in (RecordType.OBS, RecordType.STEPS):
            edit_chunk(r, lambda m, c: recode(c, 1))
    s.read(v, "codec_deflate", "every column deflated (codec 1, fixed-Huffman blocks)", ["7.3"], build(recs)[0])
    recs = parse(base["basic"])
    for r in recs:
        if r.type in (RecordType.OBS, RecordType.STEPS):
            edit_chunk(r, lambda m, c: recode(c, 2))
    s.read(v, "codec_shuffle", "every column shuffle-deflated (codec 2), 1-byte columns included", ["7.3"],
           build(recs)[0])
    recs = parse(base["basic"])

    def mixed(m: dict, c: list[Col]) -> None:
        recode(c, 1, only={"count", "min", "sk_counts"})
        recode(c, 1, stored=True, only={"max"})
        recode(c, 2, only={"sum", "sk_up"})

    edit_chunk(first(recs, RecordType.OBS), mixed)
    s.read(v, "codec_mixed", "raw, deflate (fixed-Huffman and stored blocks) and shuffle-deflate columns in one chunk",
           ["7.3"], build(recs)[0])
    # the lightweight codecs (7.3): the full file with every column the reference writer's "packed" choice, and
    # the basic file with each codec forced where it applies (constant and wide frames of reference, patched
    # exceptions, binary32 with the canonical NaN)
    from trainhist.chunk import _encode_f32, _encode_for, _encode_patched, _pack_column
    import numpy as _np
    from trainhist.chunk import DTYPES as _DT

    def packed(m: dict, cs: list[Col]) -> None:
        for x in cs:
            if x.codec == 0 and x.dt != "bytes":
                x.codec, x.block = _pack_column(x.dt, _np.frombuffer(x.block, _DT[x.dt]), x.block)

    recs = parse(base["full"])
    for r in recs:
        if r.type in (RecordType.OBS, RecordType.STEPS):
            edit_chunk(r, packed)
    s.read(v, "codec_packed", "the `full` file with each column stored by the writer's packed choice: frame of "
           "reference (3), binary32 (4), patched bytes (5) or raw", ["7.3"], build(recs)[0])

    def forced(m: dict, cs: list[Col]) -> None:
        for x in cs:
            a = _np.frombuffer(x.block, _DT[x.dt])
            if x.name == "sk_counts":
                x.codec, x.block = 5, _encode_patched(a, x.dt)
            elif x.name in ("step", "micro", "count", "sk_up"):
                x.codec, x.block = 3, _encode_for(a, x.dt)
            elif x.name == "span":  # a frame of reference at w = 4 (wider than needed): base 0, offsets = spans
                x.codec, x.block = 3, struct.pack("<Q", 0) + a.astype("<u4").tobytes()
            elif x.dt == "f8" and _encode_f32(a) is not None:
                x.codec, x.block = 4, _encode_f32(a)

    recs = parse(base["full"])
    for r in recs:
        if r.type in (RecordType.OBS, RecordType.STEPS):
            edit_chunk(r, forced)
    s.read(v, "codec_lightweight", "the `full` file with codecs 3-5 forced where they apply: constant frames of "
           "reference (w = 0, e.g. micro = 0xFFFFFFFF), a w = 4 frame, patched sketch counts, binary32 min/max with "
           "the canonical NaN", ["7.3"], build(recs)[0])
    # sketch ranges wider than the non-zero bins: readers accept any range
    recs = parse(base["basic"])

    def widen(m: dict, c: list[Col]) -> None:
        import numpy as np

        plo, pn = col(c, "sk_plo"), col(c, "sk_pn")
        nlo, nn = col(c, "sk_nlo"), col(c, "sk_nn")
        counts = np.frombuffer(col(c, "sk_counts").block, "<u8")
        lo_p, n_p = int(np.frombuffer(plo.block, "<u2")[0]), int(np.frombuffer(pn.block, "<u2")[0])
        lo_n, n_n = int(np.frombuffer(nlo.block, "<u2")[0]), int(np.frombuffer(nn.block, "<u2")[0])
        pos = np.zeros(256, np.uint64)
        pos[lo_p : lo_p + n_p] = counts[:n_p]
        neg = np.zeros(256, np.uint64)
        neg[lo_n : lo_n + n_n] = counts[n_p:]
        new_neg = neg[lo_n - 3 : lo_n + n_n + 5]
        plo.block, pn.block = struct.pack("<H", 0), struct.pack("<H", 256)
        nlo.block, nn.block = struct.pack("<H", lo_n - 3), struct.pack("<H", n_n + 8)
        sk = col(c, "sk_counts")
        sk.block = pos.astype("<u8").tobytes() + new_neg.astype("<u8").tobytes()
        sk.raw = len(sk.block)

    edit_chunk(first(recs, RecordType.OBS), widen)
    data = build(recs)[0]
    s.read(v, "sketch_wide_ranges", "sketch ranges that include zero bins (the whole positive side; extra bins "
           "around the negative range): same canonical JSON as valid/basic", ["7.5"], data)
    assert same_content(data, base["basic"])
    # an empty commit (no entries) is valid
    recs = parse(base["basic"])
    recs.append(commit())
    s.read(v, "empty_commit", "a commit with zero entries after the last one", ["4.3"], build(recs)[0])
    gen_valid_edges(s, base)
    return base


def gen_valid_edges(s: Suite, base: dict[str, bytes]) -> None:
    """Files at the edges of what a reader accepts (spec 5.5, 7.2, 7.3, 9, 10)."""
    v = "valid"
    recs = parse(base["basic"])
    for r in recs:
        if r.type in (RecordType.OBS, RecordType.STEPS):
            edit_chunk(r, lambda m, c: None, pack=pack_long_ints)
    data = build(recs)[0]
    s.read(v, "directory_long_ints", "chunk directories with every integer as a 9-byte int64: not the shortest "
           "MessagePack form writers use, read all the same", ["7.2"], data)
    assert same_content(data, base["basic"])
    recs = parse(base["exact"])
    for r in recs:
        if r.type in (RecordType.OBS, RecordType.STEPS):
            edit_chunk(r, lambda m, c: recode(c, 2))
    s.read(v, "codec_shuffle_bytes", "the exact-sum file with every column shuffle-deflated: the `bytes` columns "
           "sum_x and sumsq_x have item size 1", ["7.3", "7.5"], build(recs)[0])

    def one_row(name: str, desc: str, spec: list[str], fn: Callable[[dict, list[Col]], Any], src: str = "nosketch",
                rtype: int = RecordType.OBS, entry: Callable[[Rec], None] | None = None) -> bytes:
        recs = parse(base[src])
        r = first(recs, rtype)
        edit_chunk(r, fn)
        if entry is not None:
            entry(r)
        data = build(recs)[0]
        s.read(v, name, desc, spec, data)
        return data

    nan = struct.pack("<Q", 0x7FF8000000000000)

    def loose(m: dict, cs: list[Col]) -> None:
        for name in ("count", "nan", "pinf", "ninf", "zero", "sumsq"):
            col(cs, name).block = b"\0" * 8
        col(cs, "sum").block = struct.pack("<d", -0.0)
        col(cs, "min").block = struct.pack("<Q", 0xFFF0000000000001)
        col(cs, "max").block = nan
        col(cs, "presence").block = b"\x02"
        col(cs, "method").block = b"\x07"

    base["row_not_observed_loose"] = one_row(
        "row_not_observed_loose", "an absent row with method 7, a negative signalling NaN as min and -0.0 as sum: the "
        "rules of 5.5 refuse none of them", ["5.5", "2.6"], loose)

    def unknown_method(m: dict, cs: list[Col]) -> None:  # rows 0 and 1 (of 4) state that their sums are unknown
        col(cs, "method").block = b"\xff\xff" + col(cs, "method").block[2:]

    base["unknown_sums_stored"] = one_row(
        "unknown_sums_stored", "observed rows whose method is unknown (255) but whose stored sums are not zero (row "
        "1's sumsq beyond binary64: inf in the f64 column, the exact form kept): read, the sums checked as in any "
        "row (5.3) but dumped as null, being unknown", ["5.4", "5.2", "10"], unknown_method, src="exact")
    one_row("sketch_total_exceeds", "a sketch whose bands hold 1000 values, more than the row's finite - zero",
            ["5.5", "7.5"], lambda m, cs: setattr(col(cs, "sk_up"), "block", struct.pack("<Q", 1000)), src="basic")
    top = 2**63 - 1

    def last_step(m: dict, cs: list[Col]) -> None:
        col(cs, "step").block = struct.pack("<q", top)
        col(cs, "span").block = struct.pack("<I", 5)

    one_row("step_span_past_i64", "a row at the largest i64 step with span 5: its end passes the i64 range",
            ["2.3", "5.5"], last_step, entry=lambda r: setattr(r, "lo", top) or setattr(r, "hi", top))
    base["steps_loss_scale_nan"] = one_row(
        "steps_loss_scale_nan", "a step-truth loss_scale holding a signalling NaN: unknown (null), as the canonical "
        "NaN", ["2.7", "10"],
        lambda m, cs: setattr(col(cs, "loss_scale"), "block", struct.pack("<Q", 0x7FF0000000000001)), src="basic",
        rtype=RecordType.STEPS)

    def with_manifest(kind: str, edit: Callable[[bytes], bytes]) -> bytes:
        recs = parse(base["nosketch"])
        r = first(recs, RecordType.MANIFEST, kind)
        r.payload = edit(r.payload)
        return build(recs)[0]

    one_row("exact_zero_no_finite", "an observed row without finite values whose f64 sums are +0.0 and whose exact "
            "forms (sum_x, sumsq_x) hold the zero d:0p0 (e = 0, m = 0): its sums are zero by value, so rule 3 holds",
            ["5.5", "5.3"], lambda m, cs: no_finite_row0(cs, struct.pack("<i", 0) + b"\x00"), src="exact")

    def binary64_exact(m: dict, cs: list[Col]) -> None:
        exact_row(cs, 1, struct.pack("<i", -2) + b"\x03")  # 0.75
        exact_row(cs, 2, struct.pack("<i", 0) + b"\x00", -0.0)  # 0

    def tiny(m: dict, cs: list[Col]) -> None:
        exact_row(cs, 0, struct.pack("<i", -1100) + b"\x01", 0.0)  # 2^-1100
        exact_row(cs, 1, struct.pack("<i", -1100) + b"\xff", -0.0)  # -2^-1100

    one_row("exact_tiny_signed_zeros", "non-zero sums too small for binary64: row 0's 2^-1100 with the f64 sum +0.0, "
            "row 1's -2^-1100 with -0.0, the zero of each one's sign", ["5.3"], tiny, src="exact_small")
    base["exact_widest"] = write_ops(ops_doc([
        site("w", cadence={"spine": 1, "sketch": 0}),
        {"op": "observe", "site": 0, "step": I(0), "summary": one_sum(f"d:{WIDEST_M}p0")},
        {"op": "observe", "site": 0, "step": I(1), "summary": one_sum(f"d:{-(2**8191 - 1)}p-9000")},
        {"op": "observe", "site": 0, "step": I(2), "summary": one_sum(f"d:1p{2**31 - 1}")},
        {"op": "observe", "site": 0, "step": I(3), "summary": one_sum(f"d:-1p{-2**31}")},
        COMMIT]))
    s.read(v, "exact_widest", "exact forms at the width bound of spec 5.3 (|m| < 2^8191: 1024 bytes of m, 1028 "
           "with e): 2^8190 + 1 (f64 +inf) and -(2^8191 - 1) * 2^-9000 (a finite f64 near -2^-809); and exponents at "
           "the ends of the i32: 2^(2^31 - 1) (+inf) and -2^(-2^31) (-0.0), rounded without building 2^|e|",
           ["5.3", "12"], base["exact_widest"])
    one_row("exact_form_of_binary64", "sums that are binary64 values also stored as exact forms (a writer should "
            "not, a reader accepts them: the same numbers): row 1's 0.75 as d:3p-2, and row 2's 0 (values 1, -1) as "
            "the zero d:0p0 (m = 0, e = 0) with the f64 sum -0.0, which names 0 as +0.0 does", ["5.3", "5.5"],
            binary64_exact, src="exact_small")
    s.read(v, "manifest_duplicate_member", "a run manifest with `name` twice: the last value counts", ["9"],
           with_manifest("run", lambda b: b.replace(b'"name":"vector"', b'"name":"first","name":"vector2"')))
    s.read(v, "manifest_number_edges", "a run config holding the largest number whose binary64 is finite "
           "(1.7976931348623158e308, read as the largest binary64) and numbers too small for binary64 (1e-400, "
           "-1e-400: read as +0.0 and -0.0, their nearest binary64)", ["9", "10"],
           with_manifest("run", lambda b: b.replace(b'"config":{}', b'"config":{"big":1.7976931348623158e308,'
                                                    b'"tiny":1e-400,"neg_tiny":-1e-400}')))
    s.read(v, "manifest_number_long_exponents", "a run config holding numbers whose exponents have 19 digits or "
           "more, read by their values: -1e-1000000000000000000 (too small for binary64: -0.0), 0e1000000000000000000 "
           "(0.0) and 1e0000000000000000000005 (leading zeros do not count: 100000.0)", ["9", "10"],
           with_manifest("run", lambda b: b.replace(b'"config":{}', b'"config":{"tiny":-1e-1000000000000000000,'
                                                    b'"zero":0e1000000000000000000,"padded":1e0000000000000000000005}')))
    site_text = first(parse(base["nosketch"]), RecordType.MANIFEST, "site").payload
    assert len(re.findall(rb'"path":"[^"]*"', site_text)) == 1
    dumped = s.read(v, "manifest_surrogate_pair", "a site path written as the JSON escapes \\ud83d\\ude00: a "
                    "surrogate pair, the one character U+1F600", ["9", "10"],
                    with_manifest("site", lambda b: re.sub(rb'"path":"[^"]*"', rb'"path":"p.\\ud83d\\ude00"', b)))
    assert dumped is not None and json.loads(dumped)["sites"][0]["path"] == "p.\U0001f600"
    s.read(v, "manifest_integral_float", "a site's cadence written as 1.0 and 0e0: integers in JSON Schema "
           "2020-12, dumped as the integers 1 and 0", ["9", "10"],
           with_manifest("site", lambda b: b.replace(b'"spine":1', b'"spine":1.0').replace(b'"sketch":0',
                                                                                            b'"sketch":0e0')))
    seg = first(parse(base["nosketch"]), RecordType.MANIFEST, "segment").payload
    assert seg.count(b'"first_step":0,') == 1
    dumped = s.read(v, "manifest_integer_1e400", "a segment first_step of 1e400: the integer 10^400, beyond every "
                    "fixed-width type, read and dumped with all 401 digits", ["9", "10"],
                    with_manifest("segment", lambda b: b.replace(b'"first_step":0,', b'"first_step":1e400,')))
    assert dumped is not None and '"first_step":1' + "0" * 400 + "," in dumped
    dumped = s.read(v, "manifest_zero_long_exponent", "a segment first_step of 0e5000: the integer 0, of one digit "
                    "(a reader may refuse integers of more than 4300 digits, not this one), dumped 0", ["9", "10"],
                    with_manifest("segment", lambda b: b.replace(b'"first_step":0,', b'"first_step":0e5000,')))
    assert dumped is not None and '"first_step":0,' in dumped
    # every member the schemas type as integer, written as an integral float: read (and dumped) as the integer
    plain = write_ops(ops_doc([site("fc", shape=[4], dtype="float32", sample={"elements": 2, "of": 4, "seed": 7},
                                    cadence={"spine": 1, "sketch": 0}, order=3),
                               obs(0, 0, [1.0, -2.0], sketch=False), COMMIT,
                               {"op": "new_segment", "first_step": I(2**53 + 1), "reason": "manual"},
                               obs(0, 5, [3.0, 4.0], sketch=False), COMMIT]))
    recs = parse(plain)
    as_floats = {
        "writer": [(b'"pid":4242', b'"pid":4242.0'), (b'"rank":0', b'"rank":0.0'),
                   (b'"world_size":1', b'"world_size":1e0')],
        "site": [(b'"sketch":0', b'"sketch":0.0'), (b'"spine":1', b'"spine":10e-1'), (b'"id":0', b'"id":-0.0'),
                 (b'"elements":2', b'"elements":2.0'), (b'"of":4', b'"of":4E+0'), (b'"seed":7', b'"seed":7.00'),
                 (b'"order":3', b'"order":3.0'), (b'"shape":[4]', b'"shape":[4.0]')],
        "segment": [(b'"first_step":0', b'"first_step":0.0'), (b'"id":1', b'"id":1.0'),
                    (b'"previous":0', b'"previous":0e5'),
                    (b'"first_step":%d' % (2**53 + 1), b'"first_step":%d.0' % (2**53 + 1))],
    }
    done = set()
    for r in recs:
        kind = json.loads(r.payload)["kind"] if r.type == RecordType.MANIFEST else None
        for old, new in as_floats.get(kind, []):
            if old in r.payload:
                r.payload = r.payload.replace(old, new)
                done.add(old)
    assert len(done) == sum(map(len, as_floats.values()))
    data = build(recs)[0]
    s.read(v, "manifest_integral_floats", "every member the schemas type as integer written as an integral float "
           "(rank, world_size, pid; site id, shape, cadence, sample, order; segment id, first_step, previous; "
           "forms 2.0, 1e0, 10e-1, -0.0, 4E+0, 7.00; a first_step of 2^53 + 1 as 9007199254740993.0): each read as "
           "its integer, by its exact decimal value, and dumped as one", ["9", "10"], data)
    assert same_content(data, plain)  # (the dump of the file written with integers)
    # manifest integers beyond 2^53 (a binary64 JSON parser would round them): kept and dumped exactly
    big = ops_doc([site("fc", shape=[2**62 + 1], sample={"elements": 1, "of": 2**62 + 1, "seed": -(2**64) - 1},
                        cadence={"spine": 1, "sketch": 0}),
                   obs(0, 2**60 + 1, [1.0], sketch=False), COMMIT,
                   {"op": "new_segment", "first_step": I(2**63 - 1), "reason": "manual"},
                   obs(0, 2**63 - 1, [2.0], sketch=False), COMMIT])
    big["writer"]["pid"] = 2**53 + 1
    data = write_ops(big)
    s.read(v, "manifest_big_integers", "manifest integers a binary64 cannot hold: a segment first_step of 2^60 + 1 "
           "(then one of 2^63 - 1), a pid of 2^53 + 1, a site shape and sample.of of 2^62 + 1, a sample seed of "
           "-(2^64 + 1): read and dumped with every digit", ["9", "10"], data)
    dumped = outcome(data)[1]
    for n in (2**60 + 1, 2**63 - 1, 2**53 + 1, 2**62 + 1, -(2**64) - 1):
        assert f":{n}" in dumped, n
    s.read(v, "no_run_writer_manifests", "a file without run and writer manifests (its writer broke spec 4.4's "
           "MUST): read as any other, with empty runs and writers and a segment whose writer_id no manifest "
           "describes (merge and coarsen refuse it: merge/unknown_writer, coarsen/unknown_writer)", ["4.4", "11.3"],
           no_owner(base["nosketch"]))
    s.read(v, "site_optional_absent", "a site manifest without shape, dtype and sample: null in the dump",
           ["9", "10"], with_manifest("site", lambda b: manifest({k: x for k, x in json.loads(b).items()
                                                                   if k not in ("shape", "dtype", "sample")})))
    s.read(v, "facet_null_and_empty", "two sites of one path and stream, facet \"\" declared before facet null: "
           "the dump puts null first", ["10", "2.2"],
           write_ops(ops_doc([site("a", facet="", cadence={"spine": 1, "sketch": 0}),
                              site("a", cadence={"spine": 1, "sketch": 0}), obs(0, 0, [1.0], sketch=False),
                              obs(1, 0, [2.0], sketch=False), COMMIT])))

    def reserved_method(m: dict, cs: list[Col]) -> None:
        x = col(cs, "method")
        x.block = b"\x07" + x.block[1:]

    data = one_row("method_reserved_code", "an observed row of sum method 7, reserved for newer writers: accepted, its "
                   "bound unknown, dumped as code-7 with its sums", ["5.4", "10"], reserved_method)
    assert '"method":"code-7"' in outcome(data)[1]

    # ties the dump orders by content (spec 10): runs by run_id, writers by writer_id (file order on ties), settings
    # by canonical text, rows and step-truth rows of one key by canonical text; each written in the other order
    ties = write_ops(ops_doc([site("x", cadence={"spine": 1, "sketch": 0}), obs(0, 5, [1.0, 2.0], sketch=False),
                              obs(0, 6, [1.0], sketch=False), obs(0, 5, [3.0], sketch=False),
                              truth(0, tokens=U(9)), truth(1), truth(0, tokens=U(1)), COMMIT]))
    recs = parse(ties)
    run_doc = json.loads(first(recs, RecordType.MANIFEST, "run").payload)
    writer_doc = json.loads(first(recs, RecordType.MANIFEST, "writer").payload)
    extra = [dict(run_doc, run_id="0" * 31 + "0", name="second, sorted first"),
             dict(run_doc, run_id="0" * 31 + "0", name="third, same id: after the second"),
             dict(writer_doc, writer_id="0" * 31 + "0", rank=1),
             {"kind": "settings", "writer_id": writer_doc["writer_id"], "settings": {"b": 1}},
             {"kind": "settings", "writer_id": writer_doc["writer_id"], "settings": {"a": 2}},
             {"kind": "settings", "writer_id": writer_doc["writer_id"], "settings": {"b": 1}}]
    at = recs.index(first(recs, RecordType.MANIFEST, "writer")) + 1
    recs[at:at] = [Rec(RecordType.MANIFEST, manifest(d)) for d in extra]
    data = build(recs)[0]
    s.read(v, "dump_order_ties", "what the dump orders by content, written in the other order: a second and third "
           "run manifest of a smaller run_id (one id twice: file order), a second writer of a smaller writer_id, "
           "settings {b}, {a}, {b}; rows of one key (step 5, count 2 before count 1) and step-truth rows of one key "
           "(step 0, tokens 9 before tokens 1): sorted by their canonical text", ["10", "2.8"], data)
    dumped = json.loads(outcome(data)[1])
    assert [r["name"] for r in dumped["runs"]][:2] == ["second, sorted first", "third, same id: after the second"]
    assert [x["settings"] for x in dumped["settings"]] == [{"a": 2}, {"b": 1}, {"b": 1}]
    assert [r["count"] for r in dumped["sites"][0]["rows"]][:2] == ["u:1", "u:2"]
    assert [r["tokens"] for r in dumped["steps"]][:2] == ["u:1", "u:9"]

    data = write_ops(ops_doc([site("\U0001f600", cadence={"spine": 1, "sketch": 0}),
                              site("\ue000", cadence={"spine": 1, "sketch": 0}),
                              site("c\x01\b\t\n\x0c\r\x1f\x7f\"\\/\u00e9", cadence={"spine": 1, "sketch": 0}),
                              obs(0, 0, [1.0], sketch=False), obs(1, 0, [2.0], sketch=False),
                              obs(2, 0, [3.0], sketch=False), COMMIT], name="tab\there, del\x7f"))
    s.read(v, "strings_escaped", "strings the dump escapes (spec 10): control characters (\\b \\t \\n \\f \\r, the "
           "others and U+007F as \\u00XX), quote and backslash, / not escaped, U+00E9; and sites sorted by code "
           "point: U+E000 before U+1F600 (UTF-16 code units would order them the other way)", ["10"], data)
    text = outcome(data)[1]
    assert '"path":"c\\u0001\\b\\t\\n\\f\\r\\u001f\\u007f\\"\\\\/\\u00e9"' in text, text
    assert text.index('"path":"\\ue000"') < text.index('"path":"\\ud83d\\ude00"')


def gen_invalid(s: Suite, base: dict[str, bytes]) -> None:
    c = "invalid"
    basic = base["nosketch"]  # the smallest complete file, for damage outside chunks
    s.read(c, "bad_magic", "first 8 bytes are not the magic", ["3"], b"\x89THUST\r\n" + basic[8:],
           error="bad_magic")
    s.read(c, "bad_magic_short", "a 20-byte file that is not a prefix of the magic", ["8"], b"not a history file\n!",
           error="bad_magic")
    s.read(c, "bad_magic_crlf", "the magic after a newline translation (\\r\\n became \\n)", ["3"],
           basic[:6] + b"\n" + basic[8:], error="bad_magic")
    d = bytearray(basic)
    d[20] ^= 0x01
    s.read(c, "bad_file_header_crc", "a bit of the salt flipped: the file header CRC fails", ["3", "A"], bytes(d),
           error="bad_file_header_crc")
    s.read(c, "unsupported_feature", "required_features has bit 0 set (unknown to version 1 readers)", ["3"],
           header(req=1) + basic[32:], error="unsupported_feature")
    _, offs = build(parse(basic))
    d = bytearray(basic)
    d[offs[1] + 5] ^= 0x10
    s.read(c, "bad_record_header", "a bit of a committed record's length flipped: its header CRC fails and the "
           "length is not trusted", ["4.1", "8"], bytes(d), error="bad_record_header")
    s.read(c, "salt_mismatch", "a record header with another file's salt (header CRC valid)", ["4.1", "8"],
           patch_header(basic, offs[2], salt=SALT ^ 0xFF), error="salt_mismatch")
    s.read(c, "bad_sequence", "record 2 carries seq 3", ["4.1", "8"], patch_header(basic, offs[2], seq=3),
           error="bad_sequence")
    recs = parse(basic)
    dup = recs[:2] + [recs[1]] + recs[2:]
    data = bytearray(build(dup)[0])
    o = build(dup)[1][2]
    data[o + 8 : o + 16] = struct.pack("<Q", 1)
    data[o + 28 : o + 32] = struct.pack("<I", crc32c(bytes(data[o : o + 28])))
    s.read(c, "bad_sequence_replayed", "a record repeated with its old seq (spliced bytes)", ["4.1", "8"],
           bytes(data), error="bad_sequence")
    s.read(c, "bad_record_flags", "a record sets reserved flag bit 1", ["4.1"],
           patch_header(basic, offs[0], flags=0x0002), error="bad_record_flags")
    s.read(c, "record_too_large", "a manifest record declares 1 MiB + 1 payload bytes", ["12", "8"],
           patch_header(basic, offs[0], length=1024 * 1024 + 1), error="record_too_large")
    d = bytearray(basic)
    d[offs[2] + 32 + 10] ^= 0x01
    s.read(c, "bad_payload_crc_manifest", "a byte of a committed site manifest changed", ["4.1", "8"], bytes(d),
           error="bad_payload_crc")
    recs = parse(basic)
    obs_i = next(k for k, r in enumerate(recs) if r.type == RecordType.OBS)
    d = bytearray(basic)
    d[offs[obs_i] + 32 + len(recs[obs_i].payload) - 9] ^= 0x40
    s.read(c, "bad_payload_crc_chunk", "a byte of a committed obs chunk changed: found when the chunk is decoded",
           ["8"], bytes(d), error="bad_payload_crc")
    pad_i = next(k for k, r in enumerate(recs) if r.type == RecordType.MANIFEST and len(r.payload) % 8)
    d = bytearray(basic)
    d[offs[pad_i] + 32 + len(recs[pad_i].payload)] = 0x20
    s.read(c, "bad_padding", "a padding byte after a manifest payload is not zero", ["4.1"], bytes(d),
           error="bad_padding")
    d = bytearray(basic)
    d += b"\x01" + b"\0" * 63
    s.read(c, "garbage_tail", "non-zero bytes after the last commit that are no record header: corruption, not a "
           "torn tail", ["8"], bytes(d), error="bad_record_header")

    def hook(fn: Callable[[bytearray], None]) -> Callable[[int, bytearray], None]:
        return lambda k, body: fn(body)

    def e_off(b: bytearray) -> None:
        b[16:24] = struct.pack("<Q", struct.unpack_from("<Q", b, 16)[0] + 8)

    def e_count(b: bytearray) -> None:
        b[8:16] = struct.pack("<Q", struct.unpack_from("<Q", b, 8)[0] - 1)

    def e_type(b: bytearray) -> None:
        b[24:26] = struct.pack("<H", RecordType.STEPS)

    def e_seq(b: bytearray) -> None:
        b[0:8] = struct.pack("<Q", 0)

    def e_obs(at: int, value: bytes) -> Callable[[bytearray], None]:
        def fn(b: bytearray) -> None:  # the obs entry's field at byte ``at`` of the entry becomes ``value``
            for k in range(struct.unpack_from("<Q", b, 8)[0]):
                if struct.unpack_from("<H", b, 16 + 40 * k + 8)[0] == RecordType.OBS:
                    b[16 + 40 * k + at : 16 + 40 * k + at + len(value)] = value
        return fn

    def e_short(b: bytearray) -> None:
        del b[12:]

    for name, fn, desc in (
        ("bad_commit_offset", e_off, "commit entry 0 names offset +8"),
        ("bad_commit_count", e_count, "the commit lists one entry fewer than the records before it"),
        ("bad_commit_type", e_type, "commit entry 0 names the wrong record type"),
        ("bad_commit_seq", e_seq, "the commit payload's seq is not its own"),
        ("bad_commit_site", e_obs(12, struct.pack("<I", 7)), "an obs entry names site 7, never declared"),
        ("bad_commit_segment", e_obs(16, struct.pack("<I", 7)), "an obs entry names segment 7, never declared"),
        ("bad_commit_rows_zero", e_obs(20, struct.pack("<I", 0)), "an obs entry with rows = 0 (its chunk has 1)"),
        ("bad_commit_short", e_short, "a commit payload of 12 bytes, shorter than its 16-byte head (seq, n)"),
    ):
        s.read(c, name, desc, ["4.3"], build(parse(basic), commit_hook=hook(fn))[0], error="bad_commit")
    changed = []

    def e_steps_segment(k: int, b: bytearray) -> None:  # the steps entry's segment becomes 7
        for i in range(struct.unpack_from("<Q", b, 8)[0]):
            if struct.unpack_from("<H", b, 16 + 40 * i + 8)[0] == RecordType.STEPS:
                b[16 + 40 * i + 16 : 16 + 40 * i + 20] = struct.pack("<I", 7)
                changed.append(i)

    data = build(parse(base["basic"]), commit_hook=e_steps_segment)[0]  # (nosketch has no steps chunk)
    assert changed
    s.read(c, "bad_commit_steps_segment", "a steps entry names segment 7, never declared", ["4.3"], data,
           error="bad_commit")
    recs = parse(basic)
    seg_i, obs_i = recs.index(first(recs, RecordType.MANIFEST, "segment")), recs.index(first(recs, RecordType.OBS))
    assert seg_i + 1 == obs_i
    recs[seg_i], recs[obs_i] = recs[obs_i], recs[seg_i]
    s.read(c, "commit_chunk_before_segment", "one commit holds an obs chunk and, after it, its segment manifest: "
           "entries are checked and applied in order, so the chunk's entry names a segment not declared yet (the "
           "manifests of earlier entries of a commit declare, as in every valid file)", ["4.3", "4.4", "8"],
           build(recs)[0], error="bad_commit")

    def with_manifest(kind: str, payload: bytes) -> bytes:
        recs = parse(basic)
        first(recs, RecordType.MANIFEST, kind).payload = payload
        return build(recs)[0]

    s.read(c, "bad_manifest_json", "a committed site manifest that is not JSON", ["9"],
           with_manifest("site", b'{"kind":"site",'), error="bad_manifest_json")
    s.read(c, "bad_manifest_utf8", "a committed manifest that is not UTF-8", ["9"],
           with_manifest("run", b'{"kind":"run","name":"\xff\xfe"}'), error="bad_manifest_json")
    run_doc = json.loads(first(parse(basic), RecordType.MANIFEST, "run").payload)
    s.read(c, "manifest_bom", "a run manifest that starts with a UTF-8 byte order mark", ["9"],
           with_manifest("run", b"\xef\xbb\xbf" + manifest(run_doc)), error="bad_manifest_json")
    s.read(c, "manifest_nan", "a run manifest whose config holds the bare word NaN (not JSON)", ["9"],
           with_manifest("run", manifest(dict(run_doc, config={"lr": 0.5})).replace(b'"lr":0.5', b'"lr":NaN')),
           error="bad_manifest_json")
    s.read(c, "manifest_number_beyond_binary64", "a run manifest whose config holds the number 1e400, beyond "
           "binary64's range (it would be read as inf, and dumped as Infinity, which is not JSON)", ["9"],
           with_manifest("run", manifest(dict(run_doc, config={"lr": 0.5})).replace(b'"lr":0.5', b'"lr":1e400')),
           error="bad_manifest_json")
    s.read(c, "manifest_number_huge_exponent", "a run manifest whose config holds 1e1000000000000000000: an exponent "
           "of 19 digits, beyond binary64's range as 1e400 is", ["9"],
           with_manifest("run", manifest(dict(run_doc, config={"lr": 0.5})).replace(
               b'"lr":0.5', b'"lr":1e1000000000000000000')), error="bad_manifest_json")
    s.read(c, "manifest_lone_surrogate", "a site manifest whose path is the JSON string \"\\ud800\": a lone "
           "surrogate escape, no Unicode character", ["9"],
           with_manifest("site", re.sub(rb'"path":"[^"]*"', rb'"path":"\\ud800"',
                                        first(parse(basic), RecordType.MANIFEST, "site").payload)),
           error="bad_manifest_json")
    s.read(c, "manifest_not_object", "a committed manifest that is the JSON array [1]", ["9"],
           with_manifest("run", b"[1]"), error="unknown_manifest_kind")
    s.read(c, "manifest_no_kind", "a manifest object without `kind`", ["9"],
           with_manifest("run", manifest({k: v for k, v in run_doc.items() if k != "kind"})),
           error="unknown_manifest_kind")
    site_doc = json.loads(first(parse(basic), RecordType.MANIFEST, "site").payload)
    s.read(c, "sample_exceeds_whole", "a site manifest whose sample has more elements than the tensor", ["9", "2.2"],
           with_manifest("site", manifest(dict(site_doc, sample={"elements": 5, "of": 4, "seed": 0}))),
           error="bad_manifest")
    s.read(c, "bad_manifest_schema", "a site manifest whose stream is not in the registry", ["9", "2.2"],
           with_manifest("site", manifest(dict(site_doc, stream="weights"))), error="bad_manifest")
    s.read(c, "bad_manifest_extra", "a site manifest with a member its schema does not allow", ["9"],
           with_manifest("site", manifest(dict(site_doc, colour="blue"))), error="bad_manifest")
    s.read(c, "bad_site_order", "a site manifest whose `order` is negative", ["9", "2.2"],
           with_manifest("site", manifest(dict(site_doc, order=-1))), error="bad_manifest")
    s.read(c, "unknown_manifest_kind", "a manifest of kind `plugin`", ["9"],
           with_manifest("run", manifest({"kind": "plugin"})), error="unknown_manifest_kind")
    s.read(c, "bad_site_id", "the first site is declared with id 1", ["9", "2.2"],
           with_manifest("site", manifest(dict(site_doc, id=1))), error="bad_site_id")
    recs = parse(basic)
    k = recs.index(first(recs, RecordType.MANIFEST, "site"))
    recs.insert(k + 1, Rec(RecordType.MANIFEST, manifest(dict(site_doc, id=1))))
    s.read(c, "duplicate_site", "two sites with the same (path, stream, facet)", ["9", "2.2"], build(recs)[0],
           error="duplicate_site")
    recs = parse(basic)
    seg = first(recs, RecordType.MANIFEST, "segment")
    recs.insert(recs.index(seg) + 1, Rec(RecordType.MANIFEST, seg.payload))
    s.read(c, "duplicate_segment", "segment 0 declared twice", ["9", "2.4"], build(recs)[0],
           error="duplicate_segment")
    seg_doc = json.loads(seg.payload)
    for name, desc, doc in (
            ("segment_id_decreasing", "segment 3, then segment 2 declared after it", [dict(seg_doc, id=3),
                                                                                         dict(seg_doc, id=2)]),
            ("segment_previous_unknown", "a segment whose previous names a segment the file has not declared",
             [dict(seg_doc, id=1, reason="resume", previous=5)])):
        recs = parse(basic)
        seg = first(recs, RecordType.MANIFEST, "segment")
        at = recs.index(seg) + 1
        for k, d in enumerate(doc):
            recs.insert(at + k, Rec(RecordType.MANIFEST, manifest(d)))
        s.read(c, name, desc, ["9", "2.4"], build(recs)[0], error="bad_segment_order")

    recs = parse(basic)
    recs += [Rec(RecordType.MANIFEST, manifest(dict(seg_doc, id=2**32 - 1, reason="manual", previous=0,
                                                    first_step=None))), commit()]
    s.read(c, "segment_id_all_ones", "a segment manifest (holding no chunk) whose id is 4294967295, 0xFFFFFFFF: a "
           "commit entry's 'no segment', above the schema's maximum 2^32 - 2", ["9", "2.4"], build(recs)[0],
           error="bad_manifest")
    writer_doc = json.loads(first(parse(basic), RecordType.MANIFEST, "writer").payload)
    s.read(c, "manifest_integer_fraction", "a writer manifest whose rank is 2.5: not an integer", ["9"],
           with_manifest("writer", manifest(dict(writer_doc, rank=2.5))), error="bad_manifest")
    seg_text = first(parse(basic), RecordType.MANIFEST, "segment").payload
    assert seg_text.count(b'"first_step":0,') == 1
    s.read(c, "manifest_integer_fraction_big", "a segment first_step of 9007199254740993.5: not an integer (through "
           "binary64 it would be the integer 2^53 + 2)", ["9"],
           with_manifest("segment", seg_text.replace(b'"first_step":0,', b'"first_step":9007199254740993.5,')),
           error="bad_manifest")

    # chunk-level damage (each chunk re-framed with valid CRCs and commit entries)
    def chunk_case(name: str, desc: str, spec: list[str], error: str, fn: Callable, src: str = "basic",
                   rtype: int = RecordType.OBS, **kw: Any) -> None:
        recs = parse(base[src])
        r = first(recs, rtype)
        if kw.pop("record", False):
            fn(r)
        else:
            edit_chunk(r, fn, **kw)
        data = build(recs)[0]
        s.read(c, name, desc, spec, data, error=error)
        base[f"invalid/{name}"] = data  # (for the merge cases that refuse what a reader refuses)

    import numpy as np

    def add_col(name: str, dt: str, block: bytes) -> Callable:
        return lambda m, cs: cs.append(Col(name, dt, 0, block, len(block))) or None

    chunk_case("unknown_column", "an obs chunk with a column `extra` that is not in the registry and does not "
               "start with x-", ["7.4"], "unknown_column", add_col("extra", "u1", b"\x01"))
    chunk_case("missing_column", "an obs chunk without its `zero` column", ["7.4", "7.5"], "missing_column",
               lambda m, cs: (m, [x for x in cs if x.name != "zero"]))
    chunk_case("missing_exact_pair", "an obs chunk with `sum_x` but without `sum_xn` (the exact-sum columns come in "
               "pairs)", ["7.5"], "missing_column", lambda m, cs: (m, [x for x in cs if x.name != "sum_xn"]),
               src="exact_small")
    chunk_case("missing_steps_column", "a steps chunk without its `tokens` column", ["7.4", "7.6"], "missing_column",
               lambda m, cs: (m, [x for x in cs if x.name != "tokens"]), rtype=RecordType.STEPS)

    def longer(m: dict, cs: list[Col]) -> None:
        x = col(cs, "count")
        x.block += b"\0" * 8
        x.raw += 8

    chunk_case("column_raw_not_rows", "the `count` column holds 2 values in a 1-row chunk", ["7.4"], "bad_chunk",
               longer)

    def xn(m: dict, cs: list[Col]) -> None:
        x = col(cs, "sum_xn")
        v = np.frombuffer(x.block, "<u4").copy()
        v[0] -= 1
        x.block = v.tobytes()

    chunk_case("bad_column_length", "sum_xn adds up to one byte less than sum_x holds", ["7.5", "5.3"],
               "bad_column_length", xn, src="exact")
    chunk_case("bad_column_offset", "the directory places column `span` 8 bytes after its block", ["7.4"],
               "bad_chunk", lambda m, cs: None, override={"span": {3: lambda off: off + 8}})
    chunk_case("bad_column_padding", "a padding byte after the `span` column block is not zero", ["7.4", "7.1"],
               "bad_chunk", lambda m, cs: None, col_pad=b"\x00\x07")
    chunk_case("directory_padding", "a padding byte after the chunk directory is not zero", ["7.4", "7.1"],
               "bad_chunk", lambda m, cs: None, dir_pad=b"\x07")
    chunk_case("chunk_trailing_bytes", "8 bytes after the last column block", ["7.1"], "bad_chunk",
               lambda m, cs: None, trailing=b"\0" * 8)

    def bad_dir(r: Rec) -> None:
        r.payload = struct.pack("<I", 4) + b"\xc1\xc1\xc1\xc1"

    chunk_case("bad_chunk_directory", "the chunk directory is not MessagePack (0xc1 is never used)", ["7.2"],
               "bad_chunk", bad_dir, record=True)
    chunk_case("chunk_disagrees_with_commit", "the chunk directory names segment 3; its commit entry segment 0",
               ["7.2", "4.3"], "bad_chunk", lambda m, cs: (dict(m, segment=3), cs))

    def bomb(m: dict, cs: list[Col]) -> None:
        x = col(cs, "count")
        x.block, x.codec = deflate(b"\0" * 65536), 1  # declares raw = 8 bytes
    chunk_case("deflate_bomb", "a deflated column that would inflate to 64 KiB but declares 8 raw bytes",
               ["7.3", "13"], "bad_column_data", bomb)

    def short(m: dict, cs: list[Col]) -> None:
        x = col(cs, "count")
        x.block, x.codec = deflate(x.block[:4]), 1

    chunk_case("deflate_short", "a deflated column that inflates to 4 bytes, declaring 8", ["7.3"],
               "bad_column_data", short)

    def trailing(m: dict, cs: list[Col]) -> None:
        x = col(cs, "count")
        x.block, x.codec = deflate(x.block) + b"\x00\x01", 1

    chunk_case("deflate_trailing_data", "a deflated column with 2 bytes after the end of its zlib stream",
               ["7.3"], "bad_column_data", trailing)

    def bad_adler(m: dict, cs: list[Col]) -> None:
        x = col(cs, "count")
        z = bytearray(deflate(x.block))
        z[-1] ^= 0xFF
        x.block, x.codec = bytes(z), 1

    chunk_case("deflate_bad_checksum", "a deflated column whose zlib Adler-32 is wrong", ["7.3"], "bad_column_data",
               bad_adler)
    chunk_case("too_many_rows", "a chunk declaring 2^20 + 1 rows (its commit entry agrees)", ["12"], "too_many_rows",
               lambda r: setattr(r, "rows", 2**20 + 1) or edit_chunk(r, lambda m, cs: (dict(m, rows=2**20 + 1), cs)),
               record=True)
    chunk_case("too_many_columns", "a chunk declaring 65 columns", ["12"], "too_many_columns",
               lambda m, cs: (m, cs + [Col(f"x-{k}", "u1", 0, b"\0", 1) for k in range(65 - len(cs))]))
    chunk_case("unknown_dtype", "an ignorable `x-` column (`x-f`) of dtype f4 (not in the registry): dtype and "
               "codec are checked whatever the name", ["7.2", "7.4"], "unknown_dtype",
               add_col("x-f", "f4", b"\0\0\0\0"))
    chunk_case("x_column_unknown_codec", "an ignorable `x-` column with codec 9: refused like any column",
               ["7.3", "7.4"], "unknown_codec", lambda m, cs: cs.append(Col("x-c", "u1", 9, b"\x01", 1)))
    chunk_case("x_column_codec_mismatch", "an ignorable `x-` f8 column stored by frame of reference (integer "
               "dtypes only)", ["7.3", "7.4"], "bad_column_data",
               lambda m, cs: cs.append(Col("x-c", "f8", 3, struct.pack("<Q", 0), 8)))
    chunk_case("negative_codec", "a column with codec -1", ["7.3"], "unknown_codec",
               lambda m, cs: setattr(col(cs, "count"), "codec", -1))
    chunk_case("unknown_codec", "a column with codec 6", ["7.3", "7.4"], "unknown_codec",
               lambda m, cs: setattr(col(cs, "count"), "codec", 6))

    # the lightweight codecs 3-5 (spec 7.3): each broken rule on the 1-row `count` (u8) or `min` (f8) column
    def block(name: str, codec: int, data: bytes) -> Callable:
        def fn(m: dict, cs: list[Col]) -> None:
            x = col(cs, name)
            x.block, x.codec = data, codec
        return fn

    for vname, desc, name, codec, data in [
        ("for_bad_width", "frame of reference: 8 + 3 bytes for 1 value (w = 3 is not 0, 1, 2, 4 or 8)", "count", 3,
         struct.pack("<Q", 0) + b"\1\0\0"),
        ("for_short", "frame of reference: a 4-byte block (no room for the 8-byte base)", "count", 3, b"\0" * 4),
        ("for_wraps", "frame of reference: base 2^64-1 plus offset 1 (wraps modulo 2^64; must be refused)", "count",
         3, struct.pack("<QB", 2**64 - 1, 1)),
        ("for_u1_out_of_range", "frame of reference on the u1 `presence` column: base 256 (w = 0)", "presence", 3,
         struct.pack("<Q", 256)),
        ("for_on_f8", "frame of reference on the f8 `min` column (applies to integer dtypes only)", "min", 3,
         struct.pack("<Q", 0)),
        ("f32_nan_payload", "binary32 `min` column holding the NaN 0x7FC00001 (only 0x7FC00000 is allowed)", "min", 4,
         struct.pack("<I", 0x7FC00001)),
        ("f32_size", "binary32 `min` column of 8 bytes for 1 value", "min", 4, b"\0" * 8),
        ("f32_on_u8", "binary32 on the u8 `count` column (applies to f8 only)", "count", 4, b"\0" * 4),
        ("patched_missing_exception", "patched `count`: the code 255 with no exception stored", "count", 5,
         b"\xff"),
        ("patched_extra_exception", "patched `count`: one exception (300) but no code 255", "count", 5,
         struct.pack("<QB", 300, 2)),
        ("patched_small_exception", "patched `count`: an exception of 2 (exceptions must be >= 255)", "count", 5,
         struct.pack("<QB", 2, 255)),
        ("patched_ragged", "patched `count`: 4 bytes of exceptions (not a multiple of the item size 8)", "count", 5,
         b"\0" * 4 + b"\2"),
        ("patched_on_u1", "patched bytes on the u1 `presence` column (applies to u2, u4, u8 only)", "presence", 5,
         b"\1"),
    ]:
        chunk_case(vname, desc, ["7.3", "7.4"], "bad_column_data", block(name, codec, data))
    chunk_case("wrong_dtype", "the `count` column stored as i8 instead of u8", ["7.4"], "bad_chunk",
               lambda m, cs: setattr(col(cs, "count"), "dt", "i8"))

    def inexact(m: dict, cs: list[Col]) -> None:
        x = col(cs, "sum")
        v = np.frombuffer(x.block, "<f8").copy()
        v[0] = np.nextafter(v[0], np.inf)
        x.block = v.tobytes()

    chunk_case("bad_exact_value", "the f64 sum is one ulp away from the correctly rounded exact sum",
               ["5.3"], "bad_exact_value", inexact, src="exact")

    def noncanonical(m: dict, cs: list[Col]) -> None:
        n, b = col(cs, "sum_xn"), col(cs, "sum_x")
        lens = np.frombuffer(n.block, "<u4").copy()
        first_len = int(lens[0])
        e = struct.unpack_from("<i", b.block)[0]
        mant = int.from_bytes(b.block[4:first_len], "little", signed=True)
        even = mant * 2  # (in its fewest bytes: the one defect is the even mantissa, spec 5.3)
        width = ((~even).bit_length() if even < 0 else even.bit_length()) // 8 + 1
        enc = struct.pack("<i", e - 1) + even.to_bytes(width, "little", signed=True)
        b.block = enc + b.block[first_len:]
        b.raw = len(b.block)
        lens[0] = len(enc)
        n.block = lens.tobytes()

    chunk_case("bad_exact_noncanonical", "an exact sum stored with an even mantissa (m*2, e-1): same value, "
               "not canonical", ["5.3"], "bad_exact_value", noncanonical, src="exact")

    def u2(cs: list[Col], name: str, v: int) -> None:
        col(cs, name).block = struct.pack("<H", v)

    chunk_case("bad_sketch_range", "a sketch range running past the 256 bins of scale 2", ["7.5"], "bad_sketch",
               lambda m, cs: u2(cs, "sk_plo", 255))

    def extra_counts(m: dict, cs: list[Col]) -> None:
        x = col(cs, "sk_counts")
        x.block += struct.pack("<Q", 1)
        x.raw += 8

    chunk_case("bad_sketch_counts", "sk_counts holds one value more than the ranges use", ["7.5"], "bad_sketch",
               extra_counts)
    chunk_case("bad_sketch_flag", "the sk column holds 2", ["7.5"], "bad_sketch",
               lambda m, cs: setattr(col(cs, "sk"), "block", b"\x02"))
    chunk_case("bad_scale", "a sketch chunk declaring scale 3", ["7.2", "6.1"], "bad_scale",
               lambda m, cs: (dict(m, scale=3), cs))
    chunk_case("unknown_presence_code", "a row with presence code 9 (reserved)", ["2.6"], "unknown_code",
               lambda m, cs: setattr(col(cs, "presence"), "block", b"\x09"))
    chunk_case("unknown_phase_code", "a row with phase code 3 (reserved: a newer writer's phase)", ["2.5"],
               "unknown_code", lambda m, cs: setattr(col(cs, "phase"), "block", b"\x03"))
    chunk_case("missing_sketch_column", "an obs chunk with sketch columns but without `sk_on` (they come all "
               "together)", ["7.5"], "missing_column", lambda m, cs: (m, [x for x in cs if x.name != "sk_on"]))

    def no_sketch_with_range(m: dict, cs: list[Col]) -> None:  # (sk_counts empty: the ranges of sk = 0 rows alone)
        col(cs, "sk").block = b"\x00"
        assert struct.unpack("<H", col(cs, "sk_pn").block)[0] > 0
        col(cs, "sk_nn").block = struct.pack("<H", 0)
        x = col(cs, "sk_counts")
        x.block, x.raw = b"", 0

    chunk_case("sketch_flag_zero_with_range", "a row without a sketch (sk = 0) whose positive range holds bins "
               "(sk_pn > 0; sk_counts empty)", ["7.5"], "bad_sketch", no_sketch_with_range)

    def raw_stored_differs(m: dict, cs: list[Col]) -> None:
        x = col(cs, "count")
        assert x.codec == 0
        x.block += b"\0" * 8  # (stored 16, raw 8 = rows * 8)

    chunk_case("raw_stored_differs", "a raw (codec 0) `count` column whose stored length (16) is not its raw "
               "length (8)", ["7.4"], "bad_chunk", raw_stored_differs)
    chunk_case("rows_not_integer", "a chunk directory whose rows is the float 1.0, not an integer", ["7.2"],
               "bad_chunk", lambda m, cs: (dict(m, rows=1.0), cs))

    def exact_zero_f64_nonzero(m: dict, cs: list[Col]) -> None:
        n, b = col(cs, "sum_xn"), col(cs, "sum_x")
        lens = np.frombuffer(n.block, "<u4").copy()
        assert lens[0] > 0 and struct.unpack_from("<d", col(cs, "sum").block, 0)[0] != 0
        b.block = b"\0" * 5 + b.block[int(lens[0]):]
        b.raw = len(b.block)
        lens[0] = 5
        n.block = lens.tobytes()

    chunk_case("exact_zero_f64_nonzero", "an exact sum_x entry holding the zero (m = 0, e = 0) in a row whose f64 sum "
               "is not zero", ["5.3"], "bad_exact_value", exact_zero_f64_nonzero, src="exact")
    chunk_case("unknown_steps_code", "a step-truth row with applied code 7 (reserved)", ["2.7", "7.6"],
               "unknown_code", lambda m, cs: setattr(col(cs, "applied"), "block", b"\x07"), rtype=RecordType.STEPS)
    chunk_case("span_zero", "an obs row with span 0 (a row covers at least one step)", ["2.3", "7.5"], "bad_span",
               lambda m, cs: setattr(col(cs, "span"), "block", struct.pack("<I", 0)))
    chunk_case("steps_span_zero", "a step-truth row with span 0 (the optional `span` column)", ["7.6"], "bad_span",
               add_col("span", "u4", struct.pack("<I", 0)), rtype=RecordType.STEPS)
    chunk_case("steps_n_rows_zero", "a step-truth row with n_rows 0 (a row combines at least one writer's row)",
               ["7.6", "11.6"], "bad_tally", add_col("n_rows", "u8", struct.pack("<Q", 0)), rtype=RecordType.STEPS)
    chunk_case("sum_not_finite", "an observed row whose f64 sum is +inf with no exact sum_x value", ["5.3"],
               "bad_exact_value", lambda m, cs: setattr(col(cs, "sum"), "block", struct.pack("<d", math.inf)))
    def unknown_sums(name: str, value: float) -> Callable:
        def fn(m: dict, cs: list[Col]) -> None:
            col(cs, "method").block = b"\xff"
            col(cs, name).block = struct.pack("<d", value)
        return fn

    for vname, name, value, what in (("unknown_sums_inf", "sum", math.inf, "sum is +inf"),
                                     ("unknown_sums_nan", "sumsq", math.nan, "sumsq is NaN")):
        chunk_case(vname, f"an observed row with finite values whose method is unknown (its sums unknown) and whose "
                   f"f64 {what} with no exact form: it holds no sum at all, refused as in any row whatever the method",
                   ["5.3", "5.4"], "bad_exact_value", unknown_sums(name, value), src="nosketch")
    chunk_case("dtype_not_string", "a column entry whose dtype is the array [1, 2], not a string", ["7.4"],
               "bad_chunk", lambda m, cs: setattr(col(cs, "span"), "dt", [1, 2]))
    chunk_case("bad_row_counts", "nan + pinf + ninf + zero exceed count (nan = 2^64 - 1)", ["5.5", "5.1"], "bad_row",
               lambda m, cs: setattr(col(cs, "nan"), "block", struct.pack("<Q", 2**64 - 1)))
    chunk_case("bad_row_min_max", "an observed row with finite values whose min (1e300) exceeds its max", ["5.5"],
               "bad_row", lambda m, cs: setattr(col(cs, "min"), "block", struct.pack("<d", 1e300)))

    def all_nan(m: dict, cs: list[Col]) -> None:
        col(cs, "nan").block = col(cs, "count").block
        col(cs, "zero").block = struct.pack("<Q", 0)

    chunk_case("bad_row_no_finite", "every element NaN (nan = count), yet min and max are numbers", ["5.5"],
               "bad_row", all_nan)

    def no_finite_sums(m: dict, cs: list[Col]) -> None:
        all_nan(m, cs)
        col(cs, "min").block = col(cs, "max").block = struct.pack("<Q", 0x7FF8000000000000)

    chunk_case("bad_row_no_finite_sums", "an observed row whose every element is NaN (min and max NaN) but whose "
               "sums are not zero: no tensor gives it", ["5.5"], "bad_row", no_finite_sums, src="nosketch")

    def unknown_no_finite(m: dict, cs: list[Col]) -> None:
        no_finite_sums(m, cs)
        col(cs, "method").block = b"\xff"

    chunk_case("bad_row_unknown_sums_no_finite", "an observed row without finite values (every element NaN) whose "
               "method is unknown and whose sums (-1.5, 7.25) are not zero: the sums of no value are 0, whatever the "
               "method", ["5.5", "5.4"], "bad_row", unknown_no_finite, src="nosketch")

    def no_finite_exact(m: dict, cs: list[Col], absent: bool = False) -> None:  # row 0 (of 4) becomes all NaN
        no_finite_row0(cs, struct.pack("<i", -1100) + b"\x01", absent=absent)  # 2^-1100: the f64 sum rounds it to +0.0

    chunk_case("bad_row_no_finite_exact_sums", "an observed row whose every element is NaN, with f64 sums +0.0 "
               "but exact forms (sum_x, sumsq_x) holding 2^-1100: its sums are not zero", ["5.5", "5.3"],
               "bad_row", no_finite_exact, src="exact")
    chunk_case("bad_row_not_observed_exact_sums", "an absent row with f64 sums +0.0 but exact forms (sum_x, "
               "sumsq_x) holding 2^-1100: it carries numbers", ["5.5", "5.3", "2.6"], "bad_row",
               lambda m, cs: no_finite_exact(m, cs, absent=True), src="exact")
    chunk_case("bad_row_not_observed", "a row marked absent that carries counts, sums and a sketch", ["5.5", "2.6"],
               "bad_row", lambda m, cs: setattr(col(cs, "presence"), "block", b"\x02"))

    def step_off(m: dict, cs: list[Col]) -> None:
        col(cs, "step").block = struct.pack("<q", 1)

    chunk_case("chunk_steps_disagree", "the chunk's step is 1; its commit entry says 0..0", ["4.3", "7.5"],
               "bad_chunk", step_off)
    chunk_case("steps_chunk_steps_disagree", "a steps chunk whose step is 0; its commit entry says 3..3",
               ["4.3", "7.2"], "bad_chunk", lambda r: setattr(r, "lo", 3) or setattr(r, "hi", 3),
               rtype=RecordType.STEPS, record=True)
    chunk_case("steps_entry_empty", "a steps commit entry with 0 rows (its chunk has 1): checked against the "
               "chunk, not by the commit", ["4.3", "7.2"], "bad_chunk", lambda r: setattr(r, "rows", 0),
               rtype=RecordType.STEPS, record=True)

    def no_rows(r: Rec) -> None:
        r.rows = 0
        edit_chunk(r, lambda m, cs: (dict(m, rows=0), [replace(x, block=b"", raw=0) for x in cs]))

    chunk_case("steps_rows_zero", "a steps chunk declaring 0 rows (its commit entry agrees, its columns are empty)",
               ["7.2", "12"], "too_many_rows", no_rows, rtype=RecordType.STEPS, record=True)
    chunk_case("steps_site_key", "a steps chunk directory with a `site` key", ["7.2", "7.6"], "bad_chunk",
               lambda m, cs: (dict(m, site=0), cs), rtype=RecordType.STEPS)
    chunk_case("missing_scale", "an obs chunk with sketch columns but no `scale` in its directory", ["7.2", "7.5"],
               "bad_scale", lambda m, cs: ({k: v for k, v in m.items() if k != "scale"}, cs))
    tiny = [2.0**-40, -(2.0**-40), 3 * 2.0**-40]  # bins that lie inside the window at scale 1 as at scale 2
    recs = parse(write_ops(ops_doc([site("fc"), obs(0, 0, tiny), {"op": "commit"}, obs(0, 1, tiny),
                                    {"op": "commit"}, obs(0, 2, tiny)])))
    edit_chunk([r for r in recs if r.type == RecordType.OBS][1], lambda m, cs: (dict(m, scale=1), cs))
    s.read(c, "mixed_scale", "the second of three obs chunks of one site at scale 1, the others at 2: the error "
           "names the second", ["7.5", "8"], build(recs)[0], error="mixed_scale")
    base["invalid/mixed_scale"] = build(recs)[0]

    def dir_tail(r: Rec) -> None:  # the directory length L counts one byte (nil) after the map
        meta, cols = parse_chunk(r.payload)
        r.payload = pack_chunk(meta, cols, dir_extra=b"\xc0")

    chunk_case("directory_trailing_bytes", "the directory length counts one byte after the MessagePack map",
               ["7.2"], "bad_chunk", dir_tail, record=True)

    def not_itemsize(m: dict, cs: list[Col]) -> None:
        x = col(cs, "count")
        x.block += b"\0\0\0"
        x.raw += 3

    chunk_case("column_raw_not_itemsize", "the u8 `count` column declares 11 raw bytes (not a multiple of 8)",
               ["7.4"], "bad_chunk", not_itemsize)

    def short_exact(m: dict, cs: list[Col]) -> None:
        n, b = col(cs, "sum_xn"), col(cs, "sum_x")
        lens = np.frombuffer(n.block, "<u4").copy()
        b.block = b.block[:3] + b.block[int(lens[0]) :]
        b.raw = len(b.block)
        lens[0] = 3
        n.block = lens.tobytes()

    chunk_case("exact_too_short", "an exact sum entry of 3 bytes (shorter than the 4-byte exponent and one byte)",
               ["5.3", "7.5"], "bad_exact_value", short_exact, src="exact")

    def tally_zero(m: dict, cs: list[Col]) -> None:
        cs.extend(Col(f"n_{p}", "u8", 0, b"\0" * 8, 8)
                  for p in ("unknown", "observed", "absent", "not_scheduled", "failed", "skipped"))

    chunk_case("tally_all_zero", "a row whose six tally columns are all 0 (no state for its presence)",
               ["11.4", "5.5"], "bad_tally", tally_zero)

    def tally(**counts: int) -> Callable:
        return lambda m, cs: cs.extend(Col(f"n_{p}", "u8", 0, struct.pack("<Q", counts.get(p, 0)), 8)
                                       for p in ("unknown", "observed", "absent", "not_scheduled", "failed", "skipped"))

    chunk_case("tally_disagrees", "an observed row whose tally holds one absent row and nothing else (its presence "
               "would be absent)", ["11.4"], "bad_tally", tally(absent=1), src="nosketch")
    chunk_case("tally_incomplete", "a chunk with the tally column n_observed alone (the six come all or none)",
               ["7.5", "11.4"], "bad_tally", add_col("n_observed", "u8", struct.pack("<Q", 1)), src="nosketch")
    chunk_case("duplicate_column", "an obs chunk with two columns named `count`", ["7.4"], "bad_chunk",
               add_col("count", "u8", b"\0" * 8), src="nosketch")
    chunk_case("x_column_raw_not_rows", "an ignorable `x-` u8 column of 16 raw bytes in a 1-row chunk: an unknown "
               "column is fixed-width, its raw rows times its item size", ["7.4"], "bad_chunk",
               add_col("x-wide", "u8", b"\0" * 16), src="nosketch")
    chunk_case("bad_row_min_not_finite", "an observed row with finite values whose min is -inf (min and max are "
               "the least and greatest finite element)", ["5.5", "5.1"], "bad_row",
               lambda m, cs: setattr(col(cs, "min"), "block", struct.pack("<d", -math.inf)), src="nosketch")
    chunk_case("exact_mantissa_not_shortest", "row 0's exact sum (m = 2^80 + 1, e = -80) with its 11-byte mantissa "
               "written in 12 bytes (a trailing zero byte): the same value, not canonical", ["5.3"],
               "bad_exact_value",
               lambda m, cs: exact_row(cs, 0, struct.pack("<i", -80) + (2**80 + 1).to_bytes(12, "little")),
               src="exact_small")
    chunk_case("exact_tiny_zero_sign", "row 0's exact sum 2^-1100 (too small for binary64) with the f64 sum -0.0: "
               "a non-zero value rounds to the zero of its sign, +0.0; the f64 column is compared bit for bit",
               ["5.3"], "bad_exact_value",
               lambda m, cs: exact_row(cs, 0, struct.pack("<i", -1100) + b"\x01", -0.0), src="exact_small")
    chunk_case("exact_too_wide", "row 0's exact sum 2^8191 + 1 (f64 +inf): canonical and correctly rounded, but its "
               "mantissa takes 1025 bytes, one more than the width bound of 5.3 allows (entry of 1029 bytes)",
               ["5.3", "7.5", "12"], "bad_exact_value",
               lambda m, cs: exact_row(cs, 0, struct.pack("<i", 0) + (2**8191 + 1).to_bytes(1025, "little")),
               src="exact_widest")
    chunk_case("exact_zero_exponent", "row 1's sum stored as the exact form m = 0, e = 5 with an f64 sum of +0.0: "
               "the zero is canonical only as m = 0, e = 0", ["5.3"], "bad_exact_value",
               lambda m, cs: exact_row(cs, 1, struct.pack("<i", 5) + b"\x00", 0.0), src="exact_small")
    recs = parse(basic)
    recs.insert(next(k for k, r in enumerate(recs) if r.type == RecordType.OBS), Rec(0, b"type zero", flags=0))
    s.read(c, "record_type_zero", "a committed record of type 0 (reserved) without the ignorable flag", ["4.2"],
           build(recs)[0], error="unknown_record_type")


def gen_truncated(s: Suite, base: dict[str, bytes]) -> None:
    t = "truncated"
    two = base["two_groups"]
    recs = parse(two)
    _, offs = build(recs)
    commits = [offs[k] for k, r in enumerate(recs) if r.is_commit]
    end1 = offs[next(k for k, r in enumerate(recs) if r.is_commit) + 1]  # the first commit's end
    s.read(t, "empty", "a zero-byte file (the writer was killed before the header)", ["8"], b"")
    s.read(t, "in_file_header", "13 bytes: the magic and part of the header", ["8", "3"], two[:13])
    s.read(t, "zero_filled_file", "64 zero bytes: a power loss before the first commit, the file system having "
           "allocated space it never wrote (header included)", ["8"], bytes(64))
    s.read(t, "zero_filled_short", "5 zero bytes (as zero_filled_file, shorter than a header)", ["8"], bytes(5))
    s.read(t, "before_first_commit", "cut inside the first commit record: nothing is committed",
           ["8", "4.3"], two[: commits[0] + 20])
    s.read(t, "in_record_header", "cut 20 bytes into the record header after the first commit", ["8"],
           two[: end1 + 20])
    s.read(t, "in_payload", "cut inside the payload of the first record after the first commit", ["8"],
           two[: end1 + 32 + 9])
    s.read(t, "uncommitted_records", "complete records after the last commit, but no commit for them", ["8", "4.3"],
           two[: commits[1]])
    s.read(t, "in_commit", "cut inside the last commit's payload", ["8", "4.3"], two[: commits[1] + 32 + 20])
    s.read(t, "zero_tail", "512 zero bytes after the last commit (allocated, never written)", ["8"],
           two + b"\0" * 512)
    s.read(t, "zeroed_group", "the records after the first commit were never written: zeros of the same length",
           ["8"], two[:end1] + b"\0" * (len(two) - end1))
    recs2 = parse(two)[:4] + [Rec(RecordType.MANIFEST, b'{"kind": "site", oops')]
    s.read(t, "uncommitted_bad_manifest", "a complete but uncommitted manifest that is not JSON is dropped, never "
           "parsed", ["8", "9"], build(recs2)[0])


def gen_forward(s: Suite, base: dict[str, bytes]) -> None:
    fc = "forward-compat"
    basic = base["basic"]
    s.read(fc, "newer_read_version", "read_version 2: a version 1 reader must refuse", ["3"],
           header(rv=2, wv=2) + basic[32:], error="unsupported_read_version")
    s.read(fc, "newer_write_version", "write_version 2, read_version 1: readable (the dump shows write_version 2); "
           "an implementation that appends must refuse to (read_only)", ["3"], header(wv=2) + basic[32:])
    s.read(fc, "optional_features", "every optional feature bit set: readers ignore bits they do not know", ["3"],
           header(opt=0xFFFFFFFF) + basic[32:])
    recs = parse(basic)
    k = next(i for i, r in enumerate(recs) if r.type == RecordType.OBS)
    recs.insert(k, Rec(1000, b"a record from the future", flags=1))
    data = build(recs)[0]
    s.read(fc, "unknown_ignorable_record", "a committed record of unknown type 1000 with the ignorable flag: skipped "
           "and listed in ignored_records", ["4.2", "10"], data)
    d = bytearray(data)
    d[build(recs)[1][k] + 32 + 5] ^= 0x01
    base["damaged_ignorable_record"] = bytes(d)
    s.read(fc, "damaged_ignorable_record", "forward-compat/unknown_ignorable_record with a byte of the ignorable "
           "record's payload changed: the file's data is readable, but a full check refuses it", ["4.2", "8"],
           bytes(d), error="bad_payload_crc")
    padded = list(recs)
    padded[k] = Rec(1000, b"a record of 21 bytes!", flags=1)
    data, offs = build(padded)
    d = bytearray(data)
    d[offs[k] + 32 + 21] = 0x01
    s.read(fc, "damaged_ignorable_record_padding", "an ignorable record of unknown type whose padding is not zero: "
           "the file's data is readable, but a full check refuses it", ["4.1", "4.2", "8"], bytes(d),
           error="bad_padding")
    recs[k] = Rec(1000, b"a record from the future", flags=0)
    s.read(fc, "unknown_required_record", "a committed record of unknown type 1000 without the ignorable flag",
           ["4.2"], build(recs)[0], error="unknown_record_type")
    recs = parse(basic)
    edit_chunk(first(recs, RecordType.OBS), lambda m, cs: cs.insert(3, Col("x-future", "u8", 0, b"\x07" * 8, 8)))
    edit_chunk(first(recs, RecordType.STEPS), lambda m, cs: cs.append(Col("x-note", "f8", 0, b"\x01" * 8, 8)))
    data = build(recs)[0]
    s.read(fc, "unknown_x_columns", "an obs chunk with an extra column `x-future` in the middle and a steps chunk "
           "with an extra last column `x-note`: ignored, same canonical JSON as valid/basic", ["7.4"], data)
    assert same_content(data, basic)
    recs = parse(basic)
    edit_chunk(first(recs, RecordType.OBS), lambda m, cs: (dict(m, **{"x-future": [1, 2]}), cs))
    edit_chunk(first(recs, RecordType.STEPS), lambda m, cs: (dict(m, note="newer"), cs))
    data = build(recs)[0]
    s.read(fc, "unknown_directory_keys", "chunk directories with keys a version 1 reader does not know: ignored, "
           "same canonical JSON as valid/basic", ["7.2"], data)
    assert same_content(data, basic)
    recs = parse(basic)
    recs.insert(next(k for k, r in enumerate(recs) if r.type == RecordType.OBS), Rec(0, b"type zero", flags=1))
    s.read(fc, "ignorable_record_type_zero", "a committed record of the reserved type 0 with the ignorable flag: "
           "skipped", ["4.2"], build(recs)[0])


def gen_writer(s: Suite) -> None:
    s.writer("basic", "one site, one observation with a sketch, one step-truth row", ["4.4", "7", "9"],
             ops_doc(BASIC_OPS))
    s.writer("specials_exact", "special values and sums that are not binary64 values (exact columns)",
             ["5.1", "5.3", "7.5"], ops_doc([site("x"), obs(0, 0, SPECIALS), *exact_ops(1), COMMIT]))
    s.writer("full", "every op: sites of every kind, micro-batches, phases, marks, scalars, step truth, a manual "
             "segment, precomputed summaries (u64 counts, a scale-1 sketch), settings, several commits, an implicit "
             "final commit", ["2", "4.3", "4.4", "7", "9"],
             ops_doc(FULL_OPS + [{"op": "observe", "site": 0, "step": I(12), "summary": BIG_SUMMARY}],
                     settings={"cadence": 1}, config={"layers": 2, "name": "caf\u00e9"}))
    s.writer("unknown_sums", "a precomputed row whose sums are unknown (method unknown, sums null: values near 1e200 "
             "whose float64 sum of squares overflowed) beside a known one: stored with zero sums in the f64 columns "
             "and no exact form, dumped as null", ["5.4", "5.2", "10"],
             ops_doc([site("x", cadence={"spine": 1, "sketch": 0}),
                      {"op": "observe", "site": 0, "step": I(0), "summary": UNKNOWN_SUMS_SUMMARY},
                      obs(0, 1, [1.0, 2.0**-80], sketch=False), COMMIT]))

    s.writer("segment_first_step", "a segment's first_step when no op gives one: segment 0's first commit holds a "
             "step-truth row alone, so its manifest, written with that chunk, has first_step null (the observe of "
             "step 1 comes later); a new_segment with first_step null takes the step of its first mark, observe or "
             "scalar op (5, not the least step 4)", ["2.4"],
             ops_doc([site("x", cadence={"spine": 1, "sketch": 0}), truth(0), COMMIT, obs(0, 1, [1.0], sketch=False),
                      COMMIT, {"op": "new_segment", "first_step": None, "reason": "manual"},
                      {"op": "mark", "site": 0, "step": I(5), "presence": "absent"}, obs(0, 4, [2.0], sketch=False),
                      COMMIT]))
    s.writer("summary_null_sums_known_method", "a precomputed row whose sums are null (unknown) but whose method is "
             "f64_accumulate: an invalid document, sums being null exactly when the method is unknown", ["5.4"],
             ops_doc([site("x", cadence={"spine": 1, "sketch": 0}),
                      {"op": "observe", "site": 0, "step": I(0),
                       "summary": dict(UNKNOWN_SUMS_SUMMARY, method="f64_accumulate")}, COMMIT]),
             error="bad_ops")


RUN_ID_B = "0" * 31 + "4"
WRITER_ID_B = "0" * 31 + "5"
WRITER_ID_4 = "0" * 31 + "6"
WRITER_ID_5 = "0" * 31 + "7"


def rank_ops(rank: int, *, replica_scale: float = 1.0, fc_sharing: str = "shard") -> list[dict]:
    """One rank of a 2-rank job: a shard activation (with micro-batches, gaps and a failure) and a replica
    parameter (no sketch), steps 0..2, two commits."""
    r = float(rank + 1)
    ops = [
        site("fc", shape=[3], dtype="float32", sharing=fc_sharing, order=0),
        site("fc.weight", "param", sharing="replica", shape=[2], dtype="float32", cadence={"spine": 1, "sketch": 0},
             order=0),
    ]
    for step in range(3):
        if rank == 1 and step == 2:
            ops.append({"op": "mark", "site": 0, "step": I(2), "presence": "absent"})
        else:
            ops.append(obs(0, step, [r * (step + 1), -0.5 * r, r / 8]))
        ops.append(obs(1, step, [0.25 * (step + 1) * replica_scale, -1.5], sketch=False))
        ops.append(truth(step, applied="applied", grad_basis="unscaled", micro_batches=U(2), tokens=U(100 + rank),
                         loss_scale=F(1024.0 * (1 + (step == 2 and rank == 1)))))
        if step == 1:
            ops.append(obs(0, 1, [r, -r], micro=U(0)))
            ops.append(COMMIT)
    if rank == 1:
        ops.append({"op": "mark", "site": 0, "step": I(2), "presence": "failed", "micro": U(7)})
    else:
        ops.append(obs(0, 2, [5.0], micro=U(7)))
    return ops


def rank_file(rank: int, **kw: Any) -> bytes:
    return write_ops(ops_doc(rank_ops(rank, **kw), writer_id=(WRITER_ID, WRITER_ID_2)[rank], rank=rank,
                             world_size=2, name="job"))


def gen_merge(s: Suite, base: dict[str, bytes]) -> dict[str, bytes]:
    m = "merge"
    r0, r1 = rank_file(0), rank_file(1)
    io = {"input-0.thist": r0, "input-1.thist": r1}
    two = ["input-0.thist", "input-1.thist"]
    merged = _derived_case(s, m, "two_ranks", "two ranks of one run: shard rows add exactly, replica rows are kept "
                           "once, micro-batches keep their index, presence tallies (observed + absent, failed), "
                           "step truth adds tokens and forgets a disagreeing loss scale", ["11.1", "11.2", "11.4",
                           "11.5", "11.6", "11.9"], io, {"inputs": two})
    recs = parse(r1)
    end1 = build(recs)[1][next(k for k, r in enumerate(recs) if r.is_commit) + 1]  # rank 1 torn after step 1
    torn = _derived_case(s, m, "torn_rank", "rank 1's file is torn after its first commit (steps 0 and 1): the "
                         "merge takes its committed prefix, so step 2's step truth is rank 0's alone, n_rows 1 of the "
                         "segment's 2 writers, where steps 0 and 1 add both ranks' rows (n_rows 2)",
                         ["11.6", "8", "10"], {"input-0.thist": r0, "input-1.thist": r1[:end1 + 20]},
                         {"inputs": two})
    _derived_case(s, "coarsen", "torn_rank_window", "the output of merge/torn_rank coarsened by 4: one window, its "
                  "n_rows the sum, 5 (rows of 3 steps and 2 writers, one missing)", ["11.6", "11.7"],
                  {"input.thist": torn}, {"input": "input.thist", "steps": 4, "bins_per_octave": 4})
    _derived_case(s, m, "single_input", "merge of one file is its canonical form (sites by key, one chunk per site "
                  "and segment, commits per 11.9)", ["11.8", "11.9"], {"input-0.thist": r0},
                  {"inputs": ["input-0.thist"]})
    canon = derive("merge", {"input-0.thist": r0}, {"inputs": ["input-0.thist"]})[2]
    assert _derived_case(s, m, "with_empty_history", "the empty history (header only) is the identity of merge",
                         ["11.8"], {"input-0.thist": header(), "input-1.thist": r0}, {"inputs": two}) == canon
    assert _derived_case(s, m, "canonical_idempotent", "merging a merged file alone gives the same bytes",
                         ["11.8", "11.9"], {"input-0.thist": merged}, {"inputs": ["input-0.thist"]}) == merged
    a = write_ops(ops_doc(TWO_GROUPS_OPS, name="run-a"))
    b_doc = ops_doc(TWO_GROUPS_OPS, name="run-b", writer_id=WRITER_ID_B)
    b_doc["run"]["run_id"] = RUN_ID_B
    b = write_ops(b_doc)
    runs = {"input-0.thist": a, "input-1.thist": b}
    _derived_case(s, m, "runs_apart", "two runs: their segments stay apart (identity (runs, number))", ["11.3"],
                  runs, {"inputs": two})
    _derived_case(s, m, "across_runs", "two runs with --across-runs: segment 0 of both combine", ["11.3"], runs,
                  {"inputs": two, "across_runs": True})
    unnamed = build([r for r in parse(r0) if r.type != RecordType.MANIFEST
                     or json.loads(r.payload)["kind"] != "writer"])[0]
    _derived_case(s, m, "overlapping_writers_unnamed", "the same file twice, a file whose segment names its writer "
                  "without a writer manifest (4.4): its leaf writers are its segments' writers too, so this would "
                  "count that writer twice", ["11.8"], {"input-0.thist": unnamed},
                  {"inputs": ["input-0.thist", "input-0.thist"]}, error="overlapping_writers")
    seg_a = write_ops(ops_doc([site("x", cadence={"spine": 1, "sketch": 0}), obs(0, 0, [1.0], sketch=False),
                               truth(0), {"op": "new_segment", "first_step": I(1), "reason": "resume"},
                               obs(0, 1, [2.0], sketch=False), truth(1), COMMIT], name="run-a"))
    seg_b_doc = ops_doc([site("x", cadence={"spine": 1, "sketch": 0}), obs(0, 0, [3.0], sketch=False), truth(0),
                         COMMIT], name="run-b", writer_id=WRITER_ID_B)
    seg_b_doc["run"]["run_id"] = RUN_ID_B
    pooled = derive("merge", {"input-0.thist": seg_a, "input-1.thist": write_ops(seg_b_doc)},
                    {"inputs": two, "across_runs": True})[2]
    assert _derived_case(s, m, "pooled_then_apart", "a merge with --across-runs of run a (segment 0, resumed in "
                         "segment 1) and run b (segment 0), merged again alone: its segments [a, b]/0 and [a]/1 keep "
                         "their order, by number first, so the resume's previous names a segment declared before "
                         "it (ordered by runs first, [a]/1 would come first and name a later one)", ["11.3", "9"],
                         {"input-0.thist": pooled}, {"inputs": ["input-0.thist"]}) == pooled
    recs = parse(derive("merge", {"input-0.thist": seg_a}, {"inputs": ["input-0.thist"]})[2])
    seg0 = first(recs, RecordType.MANIFEST, "segment")
    doc = json.loads(seg0.payload)
    assert doc["origin"]["segment"] == 0 and json.loads(first(recs[recs.index(seg0) + 1:], RecordType.MANIFEST,
                                                              "segment").payload)["previous"] == 0
    doc["origin"]["segment"] = 5
    seg0.payload = manifest(doc)
    forward = build(recs)[0]
    assert outcome(forward)[0] == 0
    _derived_case(s, m, "segment_order", "a derived input (a reader accepts it) whose segment 0 has origin number 5 "
                  "and whose segment 1, of number 1, continues it: ordered by number, the output's segment 1 would "
                  "come first and continue a later one, so the input is refused", ["11.3", "9"],
                  {"input-0.thist": forward}, {"inputs": ["input-0.thist"]}, error="segment_order")
    _derived_case(s, m, "unknown_writer", "an input without run and writer manifests (valid/no_run_writer_manifests, "
                  "which a reader reads): merge cannot place its segment", ["11.3", "4.4"],
                  {"input-0.thist": no_owner(write_ops(ops_doc(NOSKETCH_OPS)))}, {"inputs": ["input-0.thist"]},
                  error="unknown_writer")
    _derived_case(s, m, "overlapping_writers", "the same file twice would count its writer twice", ["11.8"],
                  {"input-0.thist": r0}, {"inputs": ["input-0.thist", "input-0.thist"]}, error="overlapping_writers")
    _derived_case(s, m, "replica_divergence", "a replica site whose rows differ between ranks", ["11.5"],
                  {"input-0.thist": r0, "input-1.thist": rank_file(1, replica_scale=2.0)}, {"inputs": two},
                  error="replica_divergence")
    _derived_case(s, m, "incompatible_sites", "one site is `shard` in one input and `replica` in the other",
                  ["11.5"], {"input-0.thist": r0, "input-1.thist": rank_file(1, fc_sharing="replica")},
                  {"inputs": two}, error="incompatible_sites")
    _, _, r1_coarse = derive("coarsen", {"in.thist": r1}, {"input": "in.thist", "steps": 1, "bins_per_octave": 2})
    _derived_case(s, m, "incompatible_grid", "sketches at 4 and at 2 bins per octave do not combine", ["11.2"],
                  {"input-0.thist": r0, "input-1.thist": r1_coarse}, {"inputs": two}, error="incompatible_grid")
    big = [site("big"), {"op": "observe", "site": 0, "step": I(0), "summary": BIG_SUMMARY}, COMMIT]
    _derived_case(s, m, "count_overflow", "two counts of 2^64 - 1 do not fit a u64", ["11.2"],
                  {"input-0.thist": write_ops(ops_doc(big)),
                   "input-1.thist": write_ops(ops_doc(big, writer_id=WRITER_ID_4, rank=1, world_size=2))},
                  {"inputs": two}, error="count_overflow")
    huge = [site("huge"), {"op": "observe", "site": 0, "step": I(0), "summary": HUGE_SUM_SUMMARY}, COMMIT]
    _derived_case(s, m, "sum_overflow", "two sums of 2^(2^31 - 1): their sum's exponent does not fit an i32",
                  ["11.2", "5.3"], {"input-0.thist": write_ops(ops_doc(huge)),
                                    "input-1.thist": write_ops(ops_doc(huge, writer_id=WRITER_ID_4, rank=1,
                                                                      world_size=2))},
                  {"inputs": two}, error="sum_overflow")
    # sums beyond binary64's precision: step 0's total 2^60 + 1 needs the exact columns (sum_x, sumsq_x) in the
    # output, step 1's inputs hold them and its total sum (1) is a binary64 again, so only sumsq_x remains
    ex = [[site("acc", cadence={"spine": 1, "sketch": 0}),
           {"op": "observe", "site": 0, "step": I(0), "summary": exact_summary(v0)},
           {"op": "observe", "site": 0, "step": I(1), "summary": exact_summary(v1)}, COMMIT]
          for v0, v1 in (([2.0**60], [-(2.0**60), 1.0]), ([1.0], [2.0**60]))]
    _derived_case(s, m, "exact_sums", "sums add exactly: a total that is not a binary64 gains its exact column, "
                  "one that is a binary64 again drops it", ["11.2", "5.3"],
                  {"input-0.thist": write_ops(ops_doc(ex[0])),
                   "input-1.thist": write_ops(ops_doc(ex[1], writer_id=WRITER_ID_4, rank=1, world_size=2))},
                  {"inputs": two})
    ordered = [[site("x", order=ox), site("y", order=3), obs(0, 0, [1.0]), obs(1, 0, [2.0]), COMMIT]
               for ox in (1, 2)]
    _derived_case(s, m, "order_disagrees", "a site whose inputs give different `order`s has none in the output; "
                  "one they agree on keeps it", ["11.5", "2.2"],
                  {"input-0.thist": write_ops(ops_doc(ordered[0])),
                   "input-1.thist": write_ops(ops_doc(ordered[1], writer_id=WRITER_ID_4, rank=1, world_size=2))},
                  {"inputs": two})
    recs = parse(r1)
    edit_chunk(first(recs, RecordType.STEPS), lambda m, cs: setattr(col(cs, "applied"), "block",
                                                                   b"\x07" + col(cs, "applied").block[1:]))
    _derived_case(s, m, "invalid_input", "an input with a reserved step-truth code is refused, not copied into the "
                  "output", ["11.8", "2.7"], {"input-0.thist": r0, "input-1.thist": build(recs)[0]}, {"inputs": two},
                  error="unknown_code")
    for name, what in (("bad_row_no_finite_exact_sums", "an observed row without finite values"),
                       ("bad_row_not_observed_exact_sums", "an absent row")):
        _derived_case(s, m, f"invalid_input_{name.removeprefix('bad_row_')}", f"an input a reader refuses "
                      f"(invalid/{name}: {what} whose exact sums hold 2^-1100 behind f64 columns of +0.0) is "
                      "refused with the reader's code, not merged into a file readers refuse", ["11", "5.5", "5.3"],
                      {"input-0.thist": base[f"invalid/{name}"]}, {"inputs": ["input-0.thist"]}, error="bad_row")
    _derived_case(s, m, "invalid_input_missing_exact_pair", "an input a reader refuses (invalid/missing_exact_pair: "
                  "`sum_x` without `sum_xn`) is refused with the reader's code, not merged without its exact sums",
                  ["11", "7.5"], {"input-0.thist": base["invalid/missing_exact_pair"]},
                  {"inputs": ["input-0.thist"]}, error="missing_column")
    _derived_case(s, "coarsen", "invalid_input_mixed_scale", "invalid/mixed_scale coarsened to 1 bin per octave, "
                  "which would bring its chunks to one scale: a damaged input is refused with the reader's code "
                  "(mixed_scale), not incompatible_grid and not coarsened", ["11", "7.5", "11.2"],
                  {"input.thist": base["invalid/mixed_scale"]}, {"input": "input.thist", "steps": 1,
                                                                 "bins_per_octave": 1}, error="mixed_scale")
    _derived_case(s, m, "invalid_input_ignorable_record", "an input whose committed ignorable record fails its "
                  "payload CRC (forward-compat/damaged_ignorable_record) is refused as a full check refuses it, "
                  "though merge copies nothing of that record", ["11", "4.2", "8"],
                  {"input-0.thist": base["damaged_ignorable_record"]}, {"inputs": ["input-0.thist"]},
                  error="bad_payload_crc")
    # spec 11, validation order: an input a full check refuses gets the reader's code before any rule of merge
    recs = parse(forward)  # (merge/segment_order's input, whose segment order merge refuses)
    edit_chunk([r for r in recs if r.type == RecordType.OBS][-1],
               lambda m, cs: setattr(col(cs, "presence"), "block", b"\x09"))
    _derived_case(s, m, "invalid_input_segment_order", "merge/segment_order's input (its segment order is one merge "
                  "refuses) with a reserved presence code in its last obs chunk: refused with the reader's code, "
                  "before any rule of merge", ["11", "11.3", "2.6"], {"input-0.thist": build(recs)[0]},
                  {"inputs": ["input-0.thist"]}, error="unknown_code")
    _derived_case(s, m, "invalid_input_given_twice", "invalid/bad_row_not_observed given twice (its writer would "
                  "be counted twice, overlapping_writers): refused with the reader's code, before any rule of merge",
                  ["11", "11.8", "5.5"], {"input-0.thist": base["invalid/bad_row_not_observed"]},
                  {"inputs": ["input-0.thist", "input-0.thist"]}, error="bad_row")
    recs = parse(write_ops(ops_doc([site("z"), site("a"), obs(0, 0, [1.0]), obs(1, 0, [2.0]), COMMIT])))
    z_chunk, a_chunk = [r for r in recs if r.type == RecordType.OBS]
    assert (z_chunk.site, a_chunk.site) == (0, 1)
    edit_chunk(z_chunk, lambda m, cs: setattr(col(cs, "presence"), "block", b"\x09"))
    edit_chunk(a_chunk, lambda m, cs: setattr(col(cs, "presence"), "block", b"\x02"))
    two_bad = build(recs)[0]
    assert refusal(two_bad)[0] == "unknown_code"
    _derived_case(s, m, "invalid_input_site_order", "an input whose site 0 (key z) holds a reserved presence code "
                  "and site 1 (key a) an absent row with numbers: refused with site 0's error (unknown_code), the one "
                  "a full check finds first (sites in id order, spec 8), not site a's (bad_row), though the output "
                  "orders sites by key", ["11", "8", "11.9"], {"input-0.thist": two_bad},
                  {"inputs": ["input-0.thist"]}, error="unknown_code")
    unknown = [[site("x", cadence={"spine": 1, "sketch": 0}), obs(0, 0, [1.0, 2.0**-80], sketch=False),
                obs(0, 1, [0.5], sketch=False), COMMIT],
               [site("x", cadence={"spine": 1, "sketch": 0}),
                {"op": "observe", "site": 0, "step": I(0), "summary": UNKNOWN_SUMS_SUMMARY},
                obs(0, 1, [0.25], sketch=False), COMMIT]]
    _derived_case(s, m, "unknown_sums", "a row whose sums are unknown combines with a known one of its identity: "
                  "the merged row's method is unknown and its sums zero (dumped null), not the known row's sums; "
                  "counts, min and max combine as always, and step 1 adds its known sums", ["11.2", "5.4"],
                  {"input-0.thist": write_ops(ops_doc(unknown[0])),
                   "input-1.thist": write_ops(ops_doc(unknown[1], writer_id=WRITER_ID_4, rank=1, world_size=2))},
                  {"inputs": two})
    _derived_case(s, m, "unknown_sums_stored", "the canonical form of valid/unknown_sums_stored: rows whose method "
                  "is unknown hold zero sums and no exact form (11.9), whatever the input stored", ["11.9", "5.4"],
                  {"input-0.thist": base["unknown_sums_stored"]}, {"inputs": ["input-0.thist"]})
    replicas = []
    for k, wid in enumerate((WRITER_ID, WRITER_ID_4)):
        recs = parse(write_ops(ops_doc([site("w", "param", sharing="replica", cadence={"spine": 1, "sketch": 0}),
                                        obs(0, 0, [1.0, 2.0], sketch=False), COMMIT],
                                       writer_id=wid, rank=k, world_size=2)))

        def unknown_stored(m: dict, cs: list[Col], k: int = k) -> None:
            col(cs, "method").block = b"\xff"
            if k:  # (the other rank stores other sums: 5 and 13 instead of 3 and 5)
                col(cs, "sum").block, col(cs, "sumsq").block = struct.pack("<d", 5.0), struct.pack("<d", 13.0)

        edit_chunk(first(recs, RecordType.OBS), unknown_stored)
        replicas.append(build(recs)[0])
    _derived_case(s, m, "replica_unknown_sums", "replica rows whose method is unknown and whose stored sums differ "
                  "(3, 5 and 5, 13): unknown sums are read as zero, so the rows are identical and kept once, not "
                  "refused as replica_divergence", ["11.5", "5.4"],
                  {"input-0.thist": replicas[0], "input-1.thist": replicas[1]}, {"inputs": two})
    cad = [[site("x", cadence={"spine": k, "sketch": k})] + [obs(0, st, [1.0]) for st in range(0, 12, k)]
           + [truth(st) for st in range(12)] + [COMMIT] for k in (2, 3)]
    gcd_merged = _derived_case(
                  s, m, "cadences_differ", "a site recorded every 2 steps on one rank and every 3 on the other: the "
                  "merged cadence is their gcd, 1, and no row is written for steps 1, 5, 7 and 11, which no input "
                  "planned (a reader reads them unknown)", ["11.5", "2.6"],
                  {"input-0.thist": write_ops(ops_doc(cad[0])),
                   "input-1.thist": write_ops(ops_doc(cad[1], writer_id=WRITER_ID_4, rank=1, world_size=2))},
                  {"inputs": two})
    s.read("valid", "derived_merged", "a merged file: tally columns, segment origin, no `created` in segments",
           ["11.4", "11.9", "2.6"], merged)
    _derived_case(s, m, "steps_nan_canonical", "the canonical form of valid/steps_loss_scale_nan: its unknown "
                  "loss_scale, a signalling NaN, is stored as the canonical NaN", ["11.9", "2.7"],
                  {"input-0.thist": base["steps_loss_scale_nan"]}, {"inputs": ["input-0.thist"]})
    _derived_case(s, m, "not_observed_method", "valid/row_not_observed_loose (an absent row of method 7) and an "
                  "observed row of that identity (method exact) from another writer: the combined row is observed, "
                  "its method exact (the absent row has none), its tally observed 1 and absent 1", ["11.2", "5.5",
                  "11.4"], {"input-0.thist": base["row_not_observed_loose"],
                            "input-1.thist": write_ops(ops_doc(NOSKETCH_OPS, writer_id=WRITER_ID_4, rank=1,
                                                               world_size=2))}, {"inputs": two})
    def sums(*values: str) -> dict[str, bytes]:  # one input per sum: rank k's one row at step 0
        return {f"input-{k}.thist": write_ops(ops_doc(
            [site("s", cadence={"spine": 1, "sketch": 0}), {"op": "observe", "site": 0, "step": I(0),
                                                             "summary": one_sum(v)}, COMMIT],
            writer_id=(WRITER_ID, WRITER_ID_4, WRITER_ID_5)[k], rank=k, world_size=len(values)))
            for k, v in enumerate(values)}

    far = sums(f"d:1p{2**30}", f"d:1p{-2**30}")
    _derived_case(s, m, "sum_too_wide", "sums 2^(2^30) (f64 +inf) and 2^-(2^30) (f64 +0.0), 9 bytes of exact form "
                  "each: their sum 2^(2^30) + 2^-(2^30) has an exponent that fits the i32 but a mantissa of 2^31 + 1 "
                  "bits, beyond the width bound of 5.3 (|m| < 2^8191): refused before it is built", ["11.2", "5.3"],
                  far, {"inputs": sorted(far)}, error="sum_overflow")
    edge = sums(f"d:1p{8191}", "d:1p0")
    _derived_case(s, m, "sum_one_bit_too_wide", "sums 2^8191 and 1: their sum's mantissa 2^8191 + 1 has 8,192 bits, "
                  "one more than 5.3 allows", ["11.2", "5.3"], edge, {"inputs": sorted(edge)}, error="sum_overflow")
    edge = sums(f"d:1p{8190}", "d:1p0")
    _derived_case(s, m, "sum_widest", "sums 2^8190 and 1: their sum 2^8190 + 1 has the widest mantissa 5.3 allows "
                  "(8,191 bits, a 1028-byte exact form)", ["11.2", "5.3"], edge, {"inputs": sorted(edge)})
    far = sums(f"d:1p{2**30}", "d:1p0", f"d:-1p{2**30}")
    _derived_case(s, m, "sum_wide_cancels", "sums 2^(2^30), 1 and -2^(2^30): the first two alone would be too wide "
                  "(merge/sum_too_wide), the three add to 1, which is stored: the width is decided on the combined "
                  "row, not on a partial sum", ["11.2", "5.3"], far, {"inputs": sorted(far)})
    huge3 = [write_ops(ops_doc([site("huge"), {"op": "observe", "site": 0, "step": I(0), "summary": summ}, COMMIT],
                               writer_id=wid, rank=k, world_size=3))
             for k, (wid, summ) in enumerate(((WRITER_ID, HUGE_SUM_SUMMARY), (WRITER_ID_4, HUGE_SUM_SUMMARY),
                                              (WRITER_ID_5, dict(HUGE_SUM_SUMMARY, min=F(-1.0), max=F(-1.0),
                                                                 sum=f"d:-3p{2**31 - 1}"))))]
    three = ["input-0.thist", "input-1.thist", "input-2.thist"]
    over = [write_ops(ops_doc([site("big"), site("huge")] + ([
        {"op": "observe", "site": 0, "step": I(0), "summary": BIG_SUMMARY},
        {"op": "observe", "site": 1, "step": I(0), "summary": HUGE_SUM_SUMMARY}] if k < 2 else [
        {"op": "mark", "site": 0, "step": I(0), "presence": "failed"},
        {"op": "mark", "site": 1, "step": I(0), "presence": "failed"}]) + [COMMIT],
                              writer_id=wid, rank=k, world_size=3))
            for k, wid in enumerate((WRITER_ID, WRITER_ID_4, WRITER_ID_5))]
    kept_none = _derived_case(
                  s, m, "overflow_not_kept", "counts of 2^64 - 1 (site big) and sums 2^(2^31 - 1) (site huge) in two "
                  "inputs, a failed row of each identity in a third: the combined rows are failed and keep no "
                  "numbers, so nothing overflows (merge/count_overflow and merge/sum_overflow are the same rows "
                  "without the failed one); the grouping merge(merge(input-0, input-2), input-1) gives these bytes",
                  ["11.2", "11.4"], dict(zip(three, over)), {"inputs": three})
    first_two = derive("merge", {"a.thist": over[0], "c.thist": over[2]}, {"inputs": ["a.thist", "c.thist"]})[2]
    assert kept_none == derive("merge", {"ac.thist": first_two, "b.thist": over[1]},
                               {"inputs": ["ac.thist", "b.thist"]})[2]
    _derived_case(s, m, "sum_cancels_overflow", "sums 2^(2^31 - 1) twice and -3 * 2^(2^31 - 1): the first two alone "
                  "overflow the i32 exponent (merge/sum_overflow), the three add to -2^(2^31 - 1), which fits: "
                  "overflow is decided on the combined row, not on a partial sum", ["11.2", "5.3"],
                  dict(zip(three, huge3)), {"inputs": three})

    def one_bin(wid: str, rank: int, n: int) -> bytes:  # one value 1.0, its sketch bin counting n (5.5 allows it)
        recs = parse(write_ops(ops_doc([site("s"), obs(0, 0, [1.0]), COMMIT], writer_id=wid, rank=rank,
                                       world_size=2)))
        edit_chunk(first(recs, RecordType.OBS), lambda m, cs: setattr(col(cs, "sk_counts"), "block",
                                                                     struct.pack("<Q", n)))
        return build(recs)[0]

    _derived_case(s, m, "sketch_count_overflow", "one sketch bin counting 2^63 in both inputs (a sketch may count more "
                  "than the spine, 5.5): the bin's sum, 2^64, does not fit a u64, though the counts do", ["11.2"],
                  {"input-0.thist": one_bin(WRITER_ID, 0, 2**63), "input-1.thist": one_bin(WRITER_ID_4, 1, 2**63)},
                  {"inputs": two}, error="count_overflow")
    tok = [write_ops(ops_doc([truth(0, tokens=U(n)), COMMIT], writer_id=wid, rank=k, world_size=2))
           for k, (wid, n) in enumerate(((WRITER_ID, 2**63), (WRITER_ID_4, 2**63 - 1)))]
    _derived_case(s, m, "tokens_overflow", "step-truth tokens 2^63 and 2^63 - 1: their sum, 2^64 - 1, is the unknown "
                  "value and is refused", ["11.6"], {"input-0.thist": tok[0], "input-1.thist": tok[1]},
                  {"inputs": two}, error="count_overflow")
    tok3 = [write_ops(ops_doc([truth(0, tokens=None if n is None else U(n)), COMMIT], writer_id=wid, rank=k,
                              world_size=3))
            for k, (wid, n) in enumerate(((WRITER_ID, 2**63), (WRITER_ID_4, 2**63), (WRITER_ID_5, None)))]
    unknown_tokens = _derived_case(
        s, m, "tokens_overflow_unknown", "step-truth tokens 2^63, 2^63 and unknown: the combined row's tokens are "
        "unknown, so their sum, 2^64, is not refused (it is with the unknown row left out); the grouping "
        "merge(merge(input-0, input-2), input-1) gives these bytes", ["11.6", "11.2"], dict(zip(three, tok3)),
        {"inputs": three})
    first_two = derive("merge", {"a.thist": tok3[0], "c.thist": tok3[2]}, {"inputs": ["a.thist", "c.thist"]})[2]
    assert unknown_tokens == derive("merge", {"ac.thist": first_two, "b.thist": tok3[1]},
                                    {"inputs": ["ac.thist", "b.thist"]})[2]
    assert gcd_merged is not None
    return {"merge/cadences_differ": gcd_merged}


def gen_coarsen(s: Suite) -> dict[str, bytes]:
    c = "coarsen"
    r0 = rank_file(0)
    one = {"input.thist": r0}
    c2 = _derived_case(s, c, "steps2", "windows of 2 steps: rows add into spans [0,2) and [2,4), step truth too",
                       ["11.7", "2.3"], one, {"input": "input.thist", "steps": 2, "bins_per_octave": 4})
    _derived_case(s, c, "bins2", "sketches to 2 bins per octave (scale 1), steps kept", ["11.7", "6.3"], one,
                  {"input": "input.thist", "steps": 1, "bins_per_octave": 2})
    _derived_case(s, c, "steps4_bins1", "one 4-step window and 1 bin per octave (scale 0)", ["11.7", "6.3"], one,
                  {"input": "input.thist", "steps": 4, "bins_per_octave": 1})
    c4 = _derived_case(s, c, "compose", "coarsening a 2-step file by 4 equals coarsening the original by 4",
                       ["11.7"], {"input.thist": c2}, {"input": "input.thist", "steps": 4, "bins_per_octave": 4})
    assert c4 == derive(c, one, {"input": "input.thist", "steps": 4, "bins_per_octave": 4})[2]
    _derived_case(s, c, "misaligned", "a 2-step file cannot be coarsened by 3: spans would straddle windows",
                  ["11.7"], {"input.thist": c2}, {"input": "input.thist", "steps": 3, "bins_per_octave": 4},
                  error="incompatible_span")
    _derived_case(s, c, "merged_input", "coarsening a merged file (tallies and replica rows add over the window)",
                  ["11.7", "11.4"], {"input.thist": derive("merge", {"a.thist": r0, "b.thist": rank_file(1)},
                                                          {"inputs": ["a.thist", "b.thist"]})[2]},
                  {"input": "input.thist", "steps": 2, "bins_per_octave": 2})
    _derived_case(s, c, "unknown_sums", "a window holding a row whose sums are unknown is unknown (zero sums, "
                  "dumped null); the next window adds its known sums", ["11.7", "11.2", "5.4"],
                  {"input.thist": write_ops(ops_doc([
                      site("x", cadence={"spine": 1, "sketch": 0}), obs(0, 0, [1.0, -3.0], sketch=False),
                      {"op": "observe", "site": 0, "step": I(1), "summary": UNKNOWN_SUMS_SUMMARY},
                      obs(0, 2, [0.5], sketch=False), obs(0, 3, [2.0**-80], sketch=False), COMMIT]))},
                  {"input": "input.thist", "steps": 2, "bins_per_octave": 4})
    _derived_case(s, c, "sum_too_wide", "steps 0 and 1 with sums 2^(2^30) and 2^-(2^30) in one 2-step window: the "
                  "window's sum needs a mantissa of 2^31 + 1 bits, beyond the width bound of 5.3", ["11.7", "11.2",
                  "5.3"], {"input.thist": write_ops(ops_doc([
                      site("x", cadence={"spine": 1, "sketch": 0}),
                      {"op": "observe", "site": 0, "step": I(0), "summary": one_sum(f"d:1p{2**30}")},
                      {"op": "observe", "site": 0, "step": I(1), "summary": one_sum(f"d:1p{-2**30}")}, COMMIT]))},
                  {"input": "input.thist", "steps": 2, "bins_per_octave": 4}, error="sum_overflow")
    def two_bins(mark_failed: bool) -> bytes:  # 1.1 and 1.2 in two quarter-octave bins of one half-octave, 2^63 each
        recs = parse(write_ops(ops_doc([site("x", cadence={"spine": 1, "sketch": 1}), obs(0, 0, [1.1, 1.2])]
                                       + ([{"op": "mark", "site": 0, "step": I(1), "presence": "failed"}]
                                          if mark_failed else []) + [COMMIT])))
        edit_chunk(first(recs, RecordType.OBS), lambda m, cs: setattr(col(cs, "sk_counts"), "block",
                                                                     struct.pack("<QQ", 2**63, 2**63)))
        return build(recs)[0]

    _derived_case(s, c, "bins_overflow", "a row of 1.1 and 1.2, whose two quarter-octave bins count 2^63 each (5.5 "
                  "allows a sketch to count more than its spine): at 2 bins per octave they add into one bin, 2^64, "
                  "which a u64 cannot hold", ["11.7", "11.2", "6.3"], {"input.thist": two_bins(False)},
                  {"input": "input.thist", "steps": 1, "bins_per_octave": 2}, error="count_overflow")
    _derived_case(s, c, "bins_overflow_not_kept", "the same row at step 0 and a failed row at step 1, in one 2-step "
                  "window at 2 bins per octave: the window is failed and keeps no numbers, so its bins do not "
                  "overflow (11.2: a refusal is decided only on what the combined row keeps)", ["11.7", "11.2"],
                  {"input.thist": two_bins(True)}, {"input": "input.thist", "steps": 2, "bins_per_octave": 2})
    kept = _derived_case(s, c, "cadence_kept", "a site recorded every 3 steps, coarsened by 2: it keeps cadence 3 (the "
                  "steps its writer planned), so window [4, 6), which holds no due step and has no row, reads "
                  "not_scheduled", ["11.7", "2.6"],
                  {"input.thist": write_ops(ops_doc([site("x", cadence={"spine": 3, "sketch": 3})]
                                                    + [obs(0, st, [1.0]) for st in (0, 3, 6, 9)]
                                                    + [truth(st) for st in range(12)] + [COMMIT]))},
                  {"input": "input.thist", "steps": 2, "bins_per_octave": 4})
    skipped_in = write_ops(ops_doc([site("w", "param_delta", cadence={"spine": 1, "sketch": 1}),
                                    obs(0, 0, [0.5, -0.25]),
                                    {"op": "mark", "site": 0, "step": I(1), "presence": "skipped"},
                                    obs(0, 2, [0.125]), obs(0, 3, [2.0])] + [truth(st) for st in range(4)] + [COMMIT]))
    _derived_case(s, c, "skipped_in_window", "a param_delta site whose update was skipped at step 1 of 4: the window "
                  "[0, 4) is observed with the three updates' numbers (observed + skipped = observed, tally "
                  "n_skipped 1), not skipped without numbers", ["11.7", "11.4"], {"input.thist": skipped_in},
                  {"input": "input.thist", "steps": 4, "bins_per_octave": 4})
    # the same window as trainhist wrote it before 2026-11-30, when skipped outranked observed: presence skipped,
    # no numbers (derived with that precedence in place, as the code of then did)
    import trainhist.model as model

    now = model.PRIORITY, model._BY_PRIORITY
    model.PRIORITY = (4, 2, 1, 0, 5, 3)
    model._BY_PRIORITY = sorted(range(6), key=lambda k: -model.PRIORITY[k])
    try:
        legacy = derive(c, {"input.thist": skipped_in}, {"input": "input.thist", "steps": 4, "bins_per_octave": 4})
    finally:
        model.PRIORITY, model._BY_PRIORITY = now
    legacy_file = legacy[2]
    s.read("valid", "legacy_skipped_window", "a window derived before 2026-11-30, when skipped outranked observed "
           "(11.4): presence skipped, no numbers, its tally observed 3 and skipped 1; a reader accepts it as written",
           ["11.4"], legacy_file)
    _derived_case(s, c, "legacy_precedence", "that window cannot be combined: it holds none of its observed inputs' "
                  "numbers (11.4)", ["11.4"], {"input.thist": legacy_file},
                  {"input": "input.thist", "steps": 8, "bins_per_octave": 4}, error="legacy_precedence")
    _derived_case(s, "merge", "legacy_precedence", "merging that window (valid/legacy_skipped_window) is refused as "
                  "coarsening it is", ["11.4"], {"input-0.thist": legacy_file}, {"inputs": ["input-0.thist"]},
                  error="legacy_precedence")
    _derived_case(s, c, "unknown_writer", "coarsening valid/no_run_writer_manifests: like merge "
                  "(merge/unknown_writer), coarsen cannot place its segment", ["11.3", "4.4"],
                  {"input.thist": no_owner(write_ops(ops_doc(NOSKETCH_OPS)))},
                  {"input": "input.thist", "steps": 2, "bins_per_octave": 4}, error="unknown_writer")
    truth2 = derive(c, {"input.thist": write_ops(ops_doc([truth(st) for st in range(4)] + [COMMIT]))},
                    {"input": "input.thist", "steps": 2, "bins_per_octave": 4})[2]
    _derived_case(s, c, "steps_misaligned", "a file of step truth alone coarsened by 2, then by 3: its step-truth "
                  "windows [2, 4) cross the windows of 3 steps and are refused as obs rows are (coarsen/misaligned)",
                  ["11.7"], {"input.thist": truth2}, {"input": "input.thist", "steps": 3, "bins_per_octave": 4},
                  error="incompatible_span")
    lowest = -(2**63)
    _derived_case(s, c, "step_overflow", "a row at step -2^63 coarsened by 3: its window would start at "
                  "floor(-2^63 / 3) * 3, below the least i64 (by 2 it would start at -2^63 itself)", ["11.7"],
                  {"input.thist": write_ops(ops_doc([site("x", cadence={"spine": 1, "sketch": 0}),
                                                     obs(0, lowest, [1.0], sketch=False), COMMIT]))},
                  {"input": "input.thist", "steps": 3, "bins_per_octave": 4}, error="step_overflow")
    _derived_case(s, c, "negative_steps", "a segment of first_step -3 with rows at steps -3, -2, -1 and 0, coarsened "
                  "by 2: windows by floor division, [-4, -2), [-2, 0), [0, 2) (not by truncation toward zero), and "
                  "first_step aligned down to -4", ["11.7", "11.3"],
                  {"input.thist": write_ops(ops_doc(
                      [{"op": "new_segment", "first_step": I(-3), "reason": "manual"},
                       site("x", cadence={"spine": 1, "sketch": 0})]
                      + [obs(0, st, [float(st)], sketch=False) for st in range(-3, 1)] + [COMMIT]))},
                  {"input": "input.thist", "steps": 2, "bins_per_octave": 4})
    s.read("valid", "derived_coarsened", "a coarsened file: spans of 2 steps, a steps chunk with a `span` column, "
           "scale-1 sketches", ["11.7", "2.3", "7.6"],
           derive(c, one, {"input": "input.thist", "steps": 2, "bins_per_octave": 2})[2])
    assert kept is not None
    gap = _derived_case(s, c, "window_due_without_row", "a site recorded every 3 steps whose row at step 6 "
                        "is missing, coarsened by 4: window [4, 8) holds due step 6 and has no row (none is made for "
                        "it)", ["11.7", "2.6"],
                        {"input.thist": write_ops(ops_doc([site("x", cadence={"spine": 3, "sketch": 3})]
                                                          + [obs(0, st, [1.0]) for st in (0, 3, 9)]
                                                          + [truth(st) for st in range(12)] + [COMMIT]))},
                        {"input": "input.thist", "steps": 4, "bins_per_octave": 4})
    assert gap is not None
    return {"coarsen/cadence_kept": kept, "coarsen/window_due_without_row": gap}


def query(path: str, steps: list[int], *, stream: str = "activation", facet: str | None = None,
          phase: str | None = None, segment: int | None = None) -> dict:
    return {"path": path, "stream": stream, "facet": facet, "phase": phase, "segment": segment,
            "steps": [I(st) for st in steps]}


def presence_case(s: Suite, name: str, description: str, spec: list[str], data: bytes,
                  queries: list[tuple[dict, dict[int, str]]], *, error: str | None = None) -> None:
    """A presence case: ``queries`` pairs a query with the answer spec 2.6 gives, stated here by hand and asserted
    against the reference's ``IMPL presence`` (a disagreement fails the generation, it is never written); with
    ``error``, the code of the refusal the spec gives instead (exit 1; the answers are then ignored)."""
    import contextlib
    import io
    import re

    from trainhist.conformance_impl import main as impl_main

    doc = {"format": "trainhist-presence-query/1", "queries": [q for q, _ in queries]}
    qtext = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "f.thist").write_bytes(data)
        (Path(d) / "q.json").write_text(qtext, "utf-8")
        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            rc = impl_main(["presence", str(Path(d) / "f.thist"), str(Path(d) / "q.json")])
    out = buf.getvalue()
    if error is not None:
        assert outcome(data)[0] == 0, f"presence/{name}: the file is not clean"
        code = re.search(r"\[([A-Za-z0-9_.-]+)\]", err.getvalue())
        assert rc == 1 and code is not None and code.group(1) == error, \
            f"presence/{name}: expected [{error}], the reference exits {rc}: {err.getvalue()[:200]}"
        s._case("presence", name, {"description": description, "spec": spec, "command": "presence",
                                   "args": {"file": "input.thist", "query": "query.json"},
                                   "expect": {"exit": 1, "error": error}},
                {"input.thist": data, "query.json": qtext.encode()})
        return
    assert rc == 0, f"presence/{name}: the reference exits {rc}"
    want = {"format": "trainhist-presence/1", "results": [{I(k): v for k, v in a.items()} for _, a in queries]}
    assert json.loads(out) == want, f"presence/{name}: spec 2.6 says {want}, the reference answers {out}"
    assert out == json.dumps(want, sort_keys=True, separators=(",", ":")) + "\n"
    s._case("presence", name, {"description": description, "spec": spec, "command": "presence",
                               "args": {"file": "input.thist", "query": "query.json"},
                               "expect": {"exit": 0, "dump": "expected.json"}},
            {"input.thist": data, "query.json": qtext.encode(), "expected.json": out.encode()})


def gen_presence(s: Suite, derived: dict[str, bytes]) -> None:
    """Presence of a (site, step) as a reader answers it (spec 2.6): rows, cadence, recorded steps, precedence."""
    # site x every 2 steps: rows at 0 and 2, none at 4 (due); step truth for 0 ... 5
    cad = write_ops(ops_doc([site("x", cadence={"spine": 2, "sketch": 2}), obs(0, 0, [1.0]), obs(0, 2, [2.0])]
                            + [truth(st) for st in range(6)] + [COMMIT]))
    presence_case(s, "not_scheduled", "a recorded step (a step-truth row) that the site's cadence 2 does not "
                  "make due, without a row, is not_scheduled; the rows' own steps are observed", ["2.6", "2.2"],
                  cad, [(query("x", [0, 1, 2, 3, 5]), {0: "observed", 1: "not_scheduled", 2: "observed",
                                                       3: "not_scheduled", 5: "not_scheduled"})])
    presence_case(s, "due_without_row", "a recorded step that the cadence makes due but that has no row is "
                  "unknown, never not_scheduled nor a number", ["2.6"], cad,
                  [(query("x", [4]), {4: "unknown"})])
    presence_case(s, "not_recorded", "steps the step-truth table does not hold are unknown, due or not (7, 8, "
                  "-1, -2: past the run's end and before its start)", ["2.6", "2.7"], cad,
                  [(query("x", [-2, -1, 7, 8]), {-2: "unknown", -1: "unknown", 7: "unknown", 8: "unknown"})])
    marks = write_ops(ops_doc([site("x", cadence={"spine": 1, "sketch": 0}), obs(0, 0, [1.0], sketch=False)]
                              + [{"op": "mark", "site": 0, "step": I(st), "presence": name}
                                 for st, name in ((1, "absent"), (2, "failed"), (3, "skipped"), (4, "unknown"),
                                                  (5, "not_scheduled"))]
                              + [truth(st) for st in range(6)] + [COMMIT]))
    presence_case(s, "marks", "a row's own presence is the answer: absent, failed, skipped, unknown and "
                  "not_scheduled marks (the last at a step the cadence makes due)", ["2.6"], marks,
                  [(query("x", list(range(6))), {0: "observed", 1: "absent", 2: "failed", 3: "skipped",
                                                 4: "unknown", 5: "not_scheduled"})])
    pairs = [("observed", "failed"), ("observed", "unknown"), ("skipped", "observed"), ("absent", "skipped"),
             ("not_scheduled", "absent"), ("unknown", "failed")]
    ops: list[dict] = [site("x", cadence={"spine": 1, "sketch": 0})]
    for st, pair in enumerate(pairs):
        for mb, name in enumerate(pair):
            ops.append(obs(0, st, [float(st + mb)], sketch=False, micro=U(mb)) if name == "observed" else
                       {"op": "mark", "site": 0, "step": I(st), "presence": name, "micro": U(mb)})
    ops += [truth(st, micro_batches=U(2)) for st in range(len(pairs))] + [COMMIT]
    presence_case(s, "micro_batch_precedence", "two micro-batch rows of different presence at one step: the "
                  "step's presence is the one of highest precedence, failed > unknown > observed > skipped > "
                  "absent > not_scheduled", ["2.6", "11.4"], write_ops(ops_doc(ops)),
                  [(query("x", list(range(len(pairs)))), {0: "failed", 1: "unknown", 2: "observed", 3: "skipped",
                                                          4: "absent", 5: "failed"})])
    big = 1 << 53
    extreme = write_ops(ops_doc([site("x", cadence={"spine": 2, "sketch": 0}), obs(0, big, [1.0], sketch=False)]
                                + [truth(st) for st in (-3, big, big + 1, big + 2)] + [COMMIT]))
    presence_case(s, "steps_beyond_2_53", "steps past 2^53 (exact integers: 2^53 + 1 read as a binary64 is "
                  "2^53, which has a row) and a negative recorded step: 2^53 observed, 2^53 + 1 and -3 recorded and "
                  "not due (not_scheduled), 2^53 + 2 due without a row and 2^53 + 3 not recorded (unknown)",
                  ["2.6", "10"], extreme,
                  [(query("x", [-3, big, big + 1, big + 2, big + 3]),
                    {-3: "not_scheduled", big: "observed", big + 1: "not_scheduled", big + 2: "unknown",
                     big + 3: "unknown"})])
    presence_case(s, "coarsened_cadence_kept", "the output of coarsen/cadence_kept (cadence 3 kept, windows of "
                  "2): a window row answers for every step of its span (0, 1, 2); window [4, 6) has no row and no "
                  "due step, so 4 and 5 are not_scheduled, as in the input; so are 10 and 11, the window of the "
                  "run's last steps; 12 is not recorded (unknown)", ["2.6", "2.3", "11.7"],
                  derived["coarsen/cadence_kept"],
                  [(query("x", [0, 1, 2, 4, 5, 10, 11, 12]),
                    {0: "observed", 1: "observed", 2: "observed", 4: "not_scheduled", 5: "not_scheduled",
                     10: "not_scheduled", 11: "not_scheduled", 12: "unknown"})])
    gap = derived["coarsen/window_due_without_row"]
    presence_case(s, "coarsened_window_due_without_row", "the output of coarsen/window_due_without_row (cadence 3 "
                  "kept, windows of 4): window [4, 8) has no row and reads step by step as the input read those "
                  "steps: 6, due, is unknown; 4, 5 and 7, recorded and not due, are not_scheduled; the window rows "
                  "[0, 4) and [8, 12) answer observed for each of their steps", ["2.6", "11.7"], gap,
                  [(query("x", list(range(12))), {0: "observed", 1: "observed", 2: "observed", 3: "observed",
                                                  4: "not_scheduled", 5: "not_scheduled", 6: "unknown",
                                                  7: "not_scheduled", 8: "observed", 9: "observed", 10: "observed",
                                                  11: "observed"})])
    phases = write_ops(ops_doc([site("g", "param_grad", cadence={"spine": 1, "sketch": 0}),
                                obs(0, 0, [1.0], sketch=False, phase="pre_clip"),
                                obs(0, 0, [0.5], sketch=False, phase="post_clip"), truth(0), COMMIT]))
    presence_case(s, "phase_ambiguous", "a site with rows in two phases (pre_clip and post_clip) asked with phase "
                  "null: the reader refuses the query (spec 2.5, phase_ambiguous), it answers for neither phase",
                  ["2.5", "2.6"], phases, [(query("g", [0], stream="param_grad"), {})], error="phase_ambiguous")
    presence_case(s, "phase_named", "the file of presence/phase_ambiguous asked for each phase by name: observed at "
                  "step 0 in pre_clip and in post_clip, and unknown in default, where the site has no row",
                  ["2.5", "2.6"], phases, [(query("g", [0], stream="param_grad", phase=ph), {0: ans})
                                           for ph, ans in (("pre_clip", "observed"), ("post_clip", "observed"),
                                                           ("default", "unknown"))])
    presence_case(s, "merged_cadence_gcd", "the output of merge/cadences_differ (cadences 2 and 3, merged cadence "
                  "1): steps 1, 5, 7 and 11, which no input planned, are due and without a row: unknown", ["2.6",
                  "11.5"], derived["merge/cadences_differ"],
                  [(query("x", [0, 1, 2, 3, 5, 7, 11]), {0: "observed", 1: "unknown", 2: "observed",
                                                          3: "observed", 5: "unknown", 7: "unknown",
                                                          11: "unknown"})])
    seg = write_ops(ops_doc([site("x", cadence={"spine": 1, "sketch": 0})]
                            + [obs(0, st, [1.0], sketch=False) for st in range(3)] + [truth(st) for st in range(3)]
                            + [{"op": "new_segment", "first_step": I(1), "reason": "manual"},
                               {"op": "mark", "site": 0, "step": I(1), "presence": "failed"}, truth(1), truth(2),
                               COMMIT]))
    presence_case(s, "segments", "a resumed run that recorded steps 1 and 2 again in segment 1: each segment "
                  "answers alone (spec 2.4: two segments are never one history); in segment 1, step 1 is failed, "
                  "step 2 due without a row (unknown) and step 0 not recorded (unknown)", ["2.6", "2.4"], seg,
                  [(query("x", [0, 1, 2], segment=0), {0: "observed", 1: "observed", 2: "observed"}),
                   (query("x", [0, 1, 2], segment=1), {0: "unknown", 1: "failed", 2: "unknown"})])
    alone = write_ops(ops_doc([site("x", cadence={"spine": 2, "sketch": 0}),
                               site("z", cadence={"spine": 0, "sketch": 0}),
                               obs(0, 0, [1.0], sketch=False), truth(0), truth(1),
                               {"op": "new_segment", "first_step": I(2), "reason": "manual"},
                               obs(0, 2, [2.0], sketch=False), truth(2), truth(3), COMMIT]))
    presence_case(s, "segment_step_truth_alone", "a segment's step truth alone records its steps: x (cadence 2) asked "
                  "in segment 1 reads step 1, recorded only in segment 0, as unknown and step 3 as not_scheduled, and "
                  "in segment 0 the other way round; z, of spine cadence 0 (never due) and without rows, reads every "
                  "recorded step as not_scheduled and step 4, not recorded, as unknown", ["2.6", "2.4", "2.2"], alone,
                  [(query("x", [1, 3], segment=1), {1: "unknown", 3: "not_scheduled"}),
                   (query("x", [1, 3], segment=0), {1: "not_scheduled", 3: "unknown"}),
                   (query("z", [0, 1, 2, 3, 4]), {0: "not_scheduled", 1: "not_scheduled", 2: "not_scheduled",
                                                  3: "not_scheduled", 4: "unknown"})])
    g = write_ops(ops_doc([site("x", cadence={"spine": 1, "sketch": 0}), site("y", cadence={"spine": 4, "sketch": 0})]
                          + [obs(0, st, [1.0], sketch=False) for st in range(4)] + [obs(1, 0, [2.0], sketch=False),
                                                                                  COMMIT]))
    windows = derive("coarsen", {"input.thist": g}, {"input": "input.thist", "steps": 2, "bins_per_octave": 4})[2]
    assert windows is not None
    presence_case(s, "window_rows_record_nothing", "a file without step truth, coarsened by 2: site x has window rows "
                  "[0, 2) and [2, 4), site y (cadence 4) the window [0, 2) alone; y's steps 2 and 3 are not recorded "
                  "(only step-truth rows record steps, x's windows do not), so they read unknown, not not_scheduled",
                  ["2.6", "11.7"], windows,
                  [(query("y", [0, 1, 2, 3, 4]), {0: "observed", 1: "observed", 2: "unknown", 3: "unknown",
                                                  4: "unknown"}),
                   (query("x", [2, 3, 4]), {2: "observed", 3: "observed", 4: "unknown"})])


def generate(out: Path) -> dict[str, int]:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    s = Suite(out)
    base = gen_valid(s)
    gen_invalid(s, base)
    gen_truncated(s, base)
    gen_forward(s, base)
    gen_writer(s)
    derived = gen_merge(s, base)
    derived.update(gen_coarsen(s))
    gen_presence(s, derived)
    return s.counts


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="regenerate into a temporary directory and compare")
    ap.add_argument("--out", type=Path, default=VECTORS)
    a = ap.parse_args(argv)
    if not a.check:
        counts = generate(a.out)
        total = sum(f.stat().st_size for f in a.out.rglob("*") if f.is_file())
        print(f"wrote {sum(counts.values())} cases to {a.out} ({total} bytes): "
              + ", ".join(f"{k} {v}" for k, v in counts.items()))
        return 0
    with tempfile.TemporaryDirectory() as d:
        fresh = Path(d) / "vectors"
        generate(fresh)
        have, want = _tree(a.out) if a.out.is_dir() else [], _tree(fresh)
        problems = [f"missing: {p}" for p in sorted(set(want) - set(have))]
        problems += [f"unexpected: {p}" for p in sorted(set(have) - set(want))]
        problems += [f"differs: {p}" for p in sorted(set(want) & set(have))
                     if not filecmp.cmp(a.out / p, fresh / p, shallow=False)]
        if problems:
            print(f"{a.out} is out of date ({len(problems)} problems); run python tools/gen_vectors.py:",
                  file=sys.stderr)
            for p in problems[:50]:
                print("  " + p, file=sys.stderr)
            return 1
        print(f"{a.out}: {len(want)} files up to date")
        return 0


if __name__ == "__main__":
    sys.exit(main())
