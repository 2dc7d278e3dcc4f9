"""Generate appendices A and B of spec/format.md (CRC32C check values; a tiny file explained byte by byte).

    python tools/spec_appendix.py            # print both appendices
    python tools/spec_appendix.py --write    # replace them in spec/format.md
    python tools/spec_appendix.py --check    # exit 1 if spec/format.md differs from what this script makes
    python tools/spec_appendix.py --file F   # also write the tiny file to F
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import msgpack
import numpy as np

from trainhist.chunk import Codec
from trainhist.framing import (
    READ_VERSION,
    WRITE_VERSION,
    FileHeader,
    RecordHeader,
    RecordType,
    crc32c,
    pad8,
)
from trainhist.summary import summarize
from trainhist.writer import encode_obs_rows

SPEC = Path(__file__).resolve().parent.parent / "spec" / "format.md"
SALT = 0x0123456789ABCDEF
RUN_ID = "0" * 31 + "1"
WRITER_ID = "0" * 31 + "2"
CREATED = "2026-01-01T00:00:00+00:00"


def appendix_a() -> str:
    rows = [
        ("empty input", b""),
        ("ASCII `123456789`", b"123456789"),
        ("32 zero bytes", b"\0" * 32),
        ("32 bytes 0xFF", b"\xff" * 32),
        ("bytes 0x00 … 0x1F ascending", bytes(range(32))),
    ]
    out = ["| input | CRC32C |", "|---|---|"]
    out += [f"| {name} | `0x{crc32c(data):08X}` |" for name, data in rows]
    return "\n".join(out)


def tiny_file() -> tuple[bytes, list[tuple[int, int, str]]]:
    """The file and its regions (start, end, explanation)."""
    regions: list[tuple[int, int, str]] = []
    out = bytearray(FileHeader(READ_VERSION, WRITE_VERSION, 0, 0, SALT).pack())
    regions += [
        (0, 8, "magic `\\x89THIST\\r\\n`"),
        (8, 10, "read_version = 1"),
        (10, 12, "write_version = 1"),
        (12, 16, "required_features = 0"),
        (16, 20, "optional_features = 0"),
        (20, 28, f"salt = 0x{SALT:016X}"),
        (28, 32, "header_crc = CRC32C(bytes 0..27)"),
    ]
    entries = []
    seq = 0

    def record(rtype: int, payload: bytes, what: str, parts: list[tuple[int, str]] | None = None,
               entry: tuple = (0xFFFFFFFF, 0xFFFFFFFF, 0, 0, 0)) -> None:
        nonlocal seq
        pos = len(out)
        hdr = RecordHeader(rtype, 0, len(payload), seq, SALT, crc32c(payload)).pack()
        out.extend(hdr + payload + b"\0" * pad8(len(payload)))
        name = RecordType.NAMES[rtype]
        regions.extend([
            (pos, pos + 2, f"record {seq} ({what}): type = {rtype} ({name})"),
            (pos + 2, pos + 4, "flags = 0"),
            (pos + 4, pos + 8, f"length = {len(payload)}"),
            (pos + 8, pos + 16, f"seq = {seq}"),
            (pos + 16, pos + 24, "salt (as in the file header)"),
            (pos + 24, pos + 28, "payload_crc"),
            (pos + 28, pos + 32, "header_crc"),
        ])
        start = pos + 32
        for length, text in parts or [(len(payload), "payload")]:
            regions.append((start, start + length, text))
            start += length
        if pad8(len(payload)):
            regions.append((start, start + pad8(len(payload)), "padding to 8"))
        if rtype != RecordType.COMMIT:
            entries.append((pos, rtype) + entry)
        seq += 1

    def manifest(doc: dict) -> None:
        text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        record(RecordType.MANIFEST, text, f"{doc['kind']} manifest", [(len(text), "JSON: " + text.decode())])

    manifest({"kind": "run", "run_id": RUN_ID, "name": "tiny", "created": CREATED, "config": {}})
    manifest({"kind": "writer", "writer_id": WRITER_ID, "run_id": RUN_ID, "rank": 0, "world_size": 1,
              "host": "h", "pid": None, "created": CREATED, "software": {}})
    manifest({"kind": "site", "id": 0, "path": "fc", "stream": "activation", "facet": None, "shape": [2],
              "dtype": "float32", "sharing": "shard", "cadence": {"spine": 1, "sketch": 0}, "sample": None})
    manifest({"kind": "segment", "id": 0, "first_step": 7, "reason": "start", "previous": None,
              "writer_id": WRITER_ID, "created": CREATED})
    summ = summarize(np.array([1.0, -0.0], np.float32), sketch=False)
    payload, lo, hi = encode_obs_rows([(7, 1, 0xFFFFFFFF, 0, 1, summ)], 0, 0, Codec.RAW)
    (mlen,) = struct.unpack_from("<I", payload)
    meta = msgpack.unpackb(payload[4 : 4 + mlen])
    parts = [(4, f"directory length L = {mlen}"), (mlen, "directory (MessagePack): " + json.dumps(meta))]
    if pad8(4 + mlen):
        parts.append((pad8(4 + mlen), "padding to 8"))
    explain = {
        "step": "step = 7", "span": "span = 1", "micro": "micro = 0xFFFFFFFF (whole step)",
        "phase": "phase = 0 (default)", "presence": "presence = 1 (observed)", "method": "method = 0 (exact)",
        "count": "count = 2", "nan": "nan = 0", "pinf": "pinf = 0", "ninf": "ninf = 0", "zero": "zero = 1",
        "min": "min = -0.0", "max": "max = 1.0", "sum": "sum = 1.0", "sumsq": "sumsq = 1.0",
    }
    for name, dt, codec, off, stored, raw in meta["cols"]:
        parts.append((stored, f"column `{name}` ({dt}, raw): {explain[name]}"))
        if pad8(stored):
            parts.append((pad8(stored), "padding to 8"))
    record(RecordType.OBS, payload, "obs chunk of site 0", parts, (0, 0, 1, lo, hi))
    body = struct.pack("<QQ", seq, len(entries))
    cparts = [(8, f"seq of this commit = {seq}"), (8, f"n = {len(entries)} entries")]
    for off, t, site, segment, rows, slo, shi in entries:
        body += struct.pack("<QHHIIIqq", off, t, 0, site, segment, rows, slo, shi)
        cparts.append((40, f"entry: offset {off}, type {t}, site {site:#x}, segment {segment:#x}, rows {rows}, "
                           f"steps {slo}..{shi}"))
    record(RecordType.COMMIT, body, "commit", cparts)
    return bytes(out), regions


def appendix_b() -> str:
    data, regions = tiny_file()
    lines = [f"Total: {len(data)} bytes. Each line: offset, bytes (hex), meaning.", "", "```"]
    for start, end, text in regions:
        chunk = data[start:end]
        for k in range(0, max(len(chunk), 1), 16):
            hexes = " ".join(f"{b:02x}" for b in chunk[k : k + 16])
            lines.append(f"{start + k:5d}  {hexes:<47}  {text if k == 0 else '…'}")
    lines.append("```")
    assert regions[-1][1] == len(data)
    return "\n".join(lines)


def render(text: str) -> str:
    for name, body in (("A", appendix_a()), ("B", appendix_b())):
        begin, end = f"<!-- appendix {name} begin -->", f"<!-- appendix {name} end -->"
        block = f"{begin}\n{body}\n{end}"
        if begin in text:
            text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
        else:
            text = text.replace(f"APPENDIX_{name}", block)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--file")
    a = ap.parse_args()
    if a.file:
        Path(a.file).write_bytes(tiny_file()[0])
    current = SPEC.read_text("utf-8")
    new = render(current)
    if a.check:
        if new != current:
            print("spec/format.md appendices are stale: run python tools/spec_appendix.py --write", file=sys.stderr)
            return 1
        return 0
    if a.write:
        SPEC.write_text(new, "utf-8")
        return 0
    print(appendix_a() + "\n\n" + appendix_b())
    return 0


if __name__ == "__main__":
    sys.exit(main())
