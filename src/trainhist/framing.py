"""File header and record framing (spec sections 3 and 4): fixed little-endian structs, each with its own CRC32C."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c as _crc32c
import numpy as np

from .errors import CorruptError, FormatError, LimitError, UnsupportedError

__all__ = [
    "MAGIC",
    "READ_VERSION",
    "WRITE_VERSION",
    "FILE_HEADER_SIZE",
    "RECORD_HEADER_SIZE",
    "RecordType",
    "FLAG_IGNORABLE",
    "MAX_RECORD_PAYLOAD",
    "MAX_MANIFEST_PAYLOAD",
    "crc32c",
    "pad8",
    "FileHeader",
    "RecordHeader",
    "COMMIT_HEAD",
    "COMMIT_ENTRY",
    "COMMIT_ENTRY_DTYPE",
    "RECORD_HEADER",
    "pack_commit",
]

MAGIC = b"\x89THIST\r\n"
READ_VERSION = 1
WRITE_VERSION = 1
KNOWN_REQUIRED_FEATURES = 0
FILE_HEADER_SIZE = 32
RECORD_HEADER_SIZE = 32
FLAG_IGNORABLE = 0x0001
MAX_RECORD_PAYLOAD = 256 * 1024 * 1024
MAX_MANIFEST_PAYLOAD = 1024 * 1024

_FILE = struct.Struct("<8sHHIIQI")  # magic, read_version, write_version, required, optional, salt, header_crc
RECORD_HEADER = struct.Struct("<HHIQQII")  # type, flags, length, seq, salt, payload_crc, header_crc
COMMIT_HEAD = struct.Struct("<QQ")  # seq of the commit record, number of entries (spec 4.3)
COMMIT_ENTRY = struct.Struct("<QHHIIIqq")  # offset, type, reserved, site, segment, rows, step_min, step_max
#: COMMIT_ENTRY as a numpy record, for reading a commit's entries at once
COMMIT_ENTRY_DTYPE = np.dtype([("offset", "<u8"), ("type", "<u2"), ("reserved", "<u2"), ("site", "<u4"),
                               ("segment", "<u4"), ("rows", "<u4"), ("step_min", "<i8"), ("step_max", "<i8")])
assert COMMIT_ENTRY_DTYPE.itemsize == COMMIT_ENTRY.size


class RecordType:
    """Registry of record types (spec 4.2)."""

    MANIFEST = 1
    OBS = 2
    STEPS = 3
    COMMIT = 4
    NAMES = {MANIFEST: "manifest", OBS: "obs", STEPS: "steps", COMMIT: "commit"}


def crc32c(data: bytes | memoryview) -> int:
    """CRC-32C (Castagnoli), as in iSCSI; check value of b"123456789" is 0xE3069283."""
    return _crc32c.crc32c(data)


def pad8(n: int) -> int:
    """Number of zero bytes that bring ``n`` up to a multiple of 8."""
    return -n % 8


@dataclass(frozen=True)
class FileHeader:
    """The 32-byte header every file starts with."""

    read_version: int
    write_version: int
    required_features: int
    optional_features: int
    salt: int

    def pack(self) -> bytes:
        body = _FILE.pack(
            MAGIC, self.read_version, self.write_version, self.required_features, self.optional_features, self.salt, 0
        )[:-4]
        return body + struct.pack("<I", crc32c(body))

    @staticmethod
    def unpack(buf: bytes, path: str | None = None) -> "FileHeader":
        """Validate in the spec's order: magic, header CRC, read version, required features."""
        if bytes(buf[:8]) != MAGIC:
            raise FormatError(
                f"not a trainhist file: expected magic {MAGIC!r}, found {bytes(buf[:8])!r}",
                code="bad_magic",
                path=path,
                offset=0,
            )
        magic, rv, wv, req, opt, salt, crc = _FILE.unpack_from(buf, 0)
        if crc32c(buf[:28]) != crc:
            raise CorruptError(
                "file header CRC32C mismatch: the first 32 bytes were damaged", code="bad_file_header_crc",
                path=path, offset=0,
            )
        if rv > READ_VERSION:
            raise UnsupportedError(
                f"file needs read version {rv}, this reader supports up to {READ_VERSION}: upgrade trainhist",
                code="unsupported_read_version", path=path, offset=0,
            )
        if req & ~KNOWN_REQUIRED_FEATURES:
            raise UnsupportedError(
                f"file uses required features 0x{req:08x} unknown to this reader: upgrade trainhist",
                code="unsupported_feature", path=path, offset=0,
            )
        return FileHeader(rv, wv, req, opt, salt)


@dataclass(frozen=True)
class RecordHeader:
    """The 32-byte header in front of every record payload."""

    type: int
    flags: int
    length: int
    seq: int
    salt: int
    payload_crc: int

    @property
    def ignorable(self) -> bool:
        return bool(self.flags & FLAG_IGNORABLE)

    @property
    def padded_length(self) -> int:
        return self.length + pad8(self.length)

    def pack(self) -> bytes:
        body = RECORD_HEADER.pack(self.type, self.flags, self.length, self.seq, self.salt, self.payload_crc, 0)[:-4]
        return body + struct.pack("<I", crc32c(body))

    @staticmethod
    def parse(buf: bytes | memoryview, offset: int) -> "RecordHeader | None":
        """The header at ``offset`` if its CRC holds, else None (never trusts a length it cannot check)."""
        raw = buf[offset : offset + RECORD_HEADER_SIZE]
        if len(raw) < RECORD_HEADER_SIZE:
            return None
        t, flags, length, seq, salt, pcrc, hcrc = RECORD_HEADER.unpack_from(raw, 0)
        if crc32c(raw[:28]) != hcrc:
            return None
        return RecordHeader(t, flags, length, seq, salt, pcrc)

    def check_limits(self, offset: int, path: str | None) -> None:
        """Refuse reserved flag bits and over-limit lengths of a header whose CRC holds."""
        if self.flags & ~FLAG_IGNORABLE:
            raise CorruptError(
                f"record flags 0x{self.flags:04x} set reserved bits (only bit 0 is defined)",
                code="bad_record_flags", path=path, offset=offset,
            )
        limit = MAX_MANIFEST_PAYLOAD if self.type == RecordType.MANIFEST else MAX_RECORD_PAYLOAD
        if self.length > limit:
            raise LimitError(
                f"record payload of {self.length} bytes exceeds the limit of {limit} bytes for type {self.type}",
                code="record_too_large", path=path, offset=offset,
            )


def pack_commit(seq: int, entries: list[tuple[int, int, int, int, int, int, int]]) -> bytes:
    """Commit payload (spec 4.3) naming ``entries`` = (offset, type, site, segment, rows, step_min, step_max)."""
    return COMMIT_HEAD.pack(seq, len(entries)) + b"".join(
        COMMIT_ENTRY.pack(off, t, 0, site, seg, rows, lo, hi) for off, t, site, seg, rows, lo, hi in entries
    )
