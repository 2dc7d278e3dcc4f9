"""``HistoryWriter``: append observations from numpy (or precomputed summaries) to a trainhist file.

The writer buffers rows per site and writes them as one chunk per site at each commit, followed by a commit
record; a crash loses at most what was not yet committed. Any framework can record through it.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import __version__
from .chunk import MAX_ROWS, Codec, encode_chunk
from .dyadic import Dyadic
from .errors import ReadOnlyError, UsageError
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
from .model import (
    CANONICAL_NAN,
    MICRO_ALL,
    SHARING,
    STREAMS,
    U64_UNKNOWN,
    GradBasis,
    Phase,
    Presence,
)
from .schemas import validate_manifest
from .summary import Summary, summarize

__all__ = ["HistoryWriter", "SiteHandle"]

NO_ID = 0xFFFFFFFF


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class SiteHandle:
    """A site of this file: pass it to :meth:`HistoryWriter.observe`."""

    id: int
    path: str
    stream: str
    facet: str | None


def encode_obs_rows(rows: list[tuple], site: int, segment: int, codec: int) -> tuple[bytes, int, int]:
    """Chunk payload of obs rows ``(step, span, micro, phase, presence, Summary|None)``; returns payload, steps."""
    n = len(rows)
    step = np.fromiter((r[0] for r in rows), np.int64, n)
    cols: dict[str, tuple[str, Any]] = {
        "step": ("i8", step),
        "span": ("u4", np.fromiter((r[1] for r in rows), np.uint32, n)),
        "micro": ("u4", np.fromiter((r[2] for r in rows), np.uint32, n)),
        "phase": ("u1", np.fromiter((r[3] for r in rows), np.uint8, n)),
        "presence": ("u1", np.fromiter((r[4] for r in rows), np.uint8, n)),
    }
    sums = [r[5] if r[5] is not None else Summary(count=0) for r in rows]
    cols["method"] = ("u1", np.fromiter((s.sum_method for s in sums), np.uint8, n))
    for name in ("count", "nan", "pinf", "ninf", "zero"):
        cols[name] = ("u8", np.array([getattr(s, name) for s in sums], np.uint64))
    for name in ("min", "max"):
        col = np.array([getattr(s, name) for s in sums], np.float64)
        col[np.isnan(col)] = CANONICAL_NAN
        cols[name] = ("f8", col)
    exact: dict[str, tuple[str, Any]] = {}
    for name in ("sum", "sumsq"):
        vals = [getattr(s, name) for s in sums]
        cols[name] = ("f8", np.array([v.to_float() for v in vals], np.float64))
        blobs = [b"" if v.is_float() else v.to_bytes() for v in vals]
        if any(blobs):
            exact[name + "_xn"] = ("u4", np.array([len(b) for b in blobs], np.uint32))
            exact[name + "_x"] = ("bytes", b"".join(blobs))
    cols.update(exact)
    sketches = [s.sketch for s in sums]
    scale = None
    if any(sk is not None for sk in sketches):
        scales = {sk.scale for sk in sketches if sk is not None}
        if len(scales) != 1:
            raise UsageError(f"one chunk cannot mix sketch scales {sorted(scales)}")
        scale = scales.pop()
        has = np.zeros(n, np.uint8)
        lo = np.zeros((2, n), np.uint16)
        cnt = np.zeros((2, n), np.uint16)
        bands = np.zeros((4, n), np.uint64)
        parts = []
        for i, sk in enumerate(sketches):
            if sk is None:
                continue
            has[i] = 1
            for side, arr in enumerate((sk.pos, sk.neg)):
                nz = np.flatnonzero(arr)
                if nz.size:
                    lo[side, i] = nz[0]
                    cnt[side, i] = nz[-1] - nz[0] + 1
                    parts.append(arr[nz[0] : nz[-1] + 1])
            bands[:, i] = (sk.under_pos, sk.under_neg, sk.over_pos, sk.over_neg)
        cols["sk"] = ("u1", has)
        cols["sk_plo"], cols["sk_pn"] = ("u2", lo[0]), ("u2", cnt[0])
        cols["sk_nlo"], cols["sk_nn"] = ("u2", lo[1]), ("u2", cnt[1])
        for j, name in enumerate(("sk_up", "sk_un", "sk_op", "sk_on")):
            cols[name] = ("u8", bands[j])
        counts = np.concatenate(parts).astype(np.uint64) if parts else np.zeros(0, np.uint64)
        cols["sk_counts"] = ("u8", counts)
    meta: dict[str, Any] = {"site": site, "segment": segment, "rows": n}
    if scale is not None:
        meta["scale"] = scale
    return encode_chunk(meta, cols, codec), int(step.min()), int(step.max())


class HistoryWriter:
    """Write a trainhist file: sites, observations, step truth, segments, commits.

    ``fsync``: ``"commit"`` (default) makes every commit durable before :meth:`commit` returns; ``"close"``
    syncs only on close; ``"never"`` leaves it to the OS. A commit happens on :meth:`commit`, on close, and
    automatically at a step boundary once ``commit_every`` steps or ``commit_seconds`` have passed.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        run_name: str | None = None,
        run_id: str | None = None,
        config: dict | None = None,
        rank: int = 0,
        world_size: int = 1,
        host: str | None = None,
        codec: str = "packed",
        fsync: str = "commit",
        mode: str = "w",
        commit_every: int = 200,
        commit_seconds: float = 30.0,
        settings: dict | None = None,
        salt: int | None = None,
        writer_id: str | None = None,
        created: str | None = None,
        pid: int | None = None,
        software: dict[str, str] | None = None,
    ) -> None:
        """``salt``, ``writer_id``, ``created`` (every manifest's timestamp), ``pid`` and ``software`` fix what is
        otherwise random or taken from the environment, for byte-reproducible files (conformance vectors);
        ``salt`` applies only to a new file (an appended file keeps its own)."""
        if codec not in Codec.BY_NAME:
            raise UsageError(f"codec must be one of {', '.join(Codec.BY_NAME)}, got {codec!r}")
        if fsync not in ("commit", "close", "never"):
            raise UsageError(f"fsync must be 'commit', 'close' or 'never', got {fsync!r}")
        if mode not in ("w", "a"):
            raise UsageError(f"mode must be 'w' (create or truncate) or 'a' (append, resume), got {mode!r}")
        self.path = os.fspath(path)
        self._codec = Codec.BY_NAME[codec]
        self._fsync = fsync
        self._commit_every = commit_every
        self._commit_seconds = commit_seconds
        self._sites: dict[tuple[str, str, str | None], SiteHandle] = {}
        self._site_meta: dict[int, dict] = {}
        self._buffers: dict[tuple[int, int], list[tuple]] = {}  # rows per (site, segment)
        self._steps: dict[int, list[tuple]] = {}
        self._entries: list[tuple] = []
        self._closed = False
        self._last_step: int | None = None
        self._steps_since_commit = 0
        self._last_commit_time = time.monotonic()
        self.writer_id = writer_id or uuid.uuid4().hex
        self._created = created
        self._segment_manifest: dict | None = None
        resumed = mode == "a" and os.path.exists(self.path) and os.path.getsize(self.path) > 0
        if resumed:
            resumed = self._open_append()  # False: nothing was ever committed, so the file starts afresh
        if not resumed:
            self.run_id = run_id or uuid.uuid4().hex
            self._salt = int.from_bytes(os.urandom(8), "little") if salt is None else int(salt)
            self._f = open(self.path, "wb")
            self._seq = 0
            self._f.write(FileHeader(READ_VERSION, WRITE_VERSION, 0, 0, self._salt).pack())
            self._offset = FILE_HEADER_SIZE
            self._manifest({"kind": "run", "run_id": self.run_id, "name": run_name, "created": self._now(),
                            "config": config or {}})
            self._next_segment = 0
            self._previous_segment = None
        self._manifest({
            "kind": "writer", "writer_id": self.writer_id, "run_id": self.run_id, "rank": rank,
            "world_size": world_size, "host": host if host is not None else socket.gethostname(),
            "pid": os.getpid() if pid is None else pid, "created": self._now(),
            "software": {"trainhist": __version__} if software is None else dict(software),
        })
        if settings:
            self._manifest({"kind": "settings", "writer_id": self.writer_id, "settings": settings})
        self.segment = -1
        self.new_segment(None, reason="resume" if resumed else "start")

    def _now(self) -> str:
        return self._created if self._created is not None else _now()

    # -- opening an existing file ------------------------------------------------------------------------
    def _open_append(self) -> bool:
        from .reader import open_history

        h = open_history(self.path)
        if h.header is None or (h.committed_records == 0 and h.header.write_version <= WRITE_VERSION):
            h.close()  # crashed before its first commit: nothing to resume, the file starts afresh
            return False
        if h.header.write_version > WRITE_VERSION:
            raise ReadOnlyError(
                f"file was written by write version {h.header.write_version}; this writer is version "
                f"{WRITE_VERSION} and may only read it", path=self.path,
            )
        self.run_id = h.runs[0]["run_id"]
        self._salt = h.header.salt
        self._seq = h.committed_records
        for s in h.sites:
            handle = SiteHandle(s.id, s.path, s.stream, s.facet)
            self._sites[(s.path, s.stream, s.facet)] = handle
            self._site_meta[s.id] = s.manifest
        self._next_segment = max((g.id for g in h.segments), default=-1) + 1
        self._previous_segment = h.segments[-1].id if h.segments else None
        h.close()
        self._f = open(self.path, "r+b")
        self._f.truncate(h.committed_bytes)  # drop a torn or uncommitted tail before appending
        self._f.seek(h.committed_bytes)
        self._offset = h.committed_bytes
        return True

    # -- records -----------------------------------------------------------------------------------------
    def _record(self, rtype: int, payload: bytes, *, site: int = NO_ID, segment: int = NO_ID, rows: int = 0,
                steps: tuple[int, int] = (0, 0)) -> None:
        hdr = RecordHeader(rtype, 0, len(payload), self._seq, self._salt, crc32c(payload)).pack()
        self._f.write(hdr + payload + b"\0" * pad8(len(payload)))
        if rtype != RecordType.COMMIT:
            self._entries.append((self._offset, rtype, site, segment, rows, steps[0], steps[1]))
        self._offset += len(hdr) + len(payload) + pad8(len(payload))
        self._seq += 1

    def _manifest(self, doc: dict) -> None:
        validate_manifest(doc)
        self._record(RecordType.MANIFEST, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("the writer is closed", code="writer_closed", path=self.path)

    # -- public API --------------------------------------------------------------------------------------
    def site(
        self,
        path: str,
        stream: str,
        *,
        facet: str | None = None,
        shape: tuple[int, ...] | list[int] | None = None,
        dtype: str | None = None,
        sharing: str = "shard",
        cadence_spine: int = 1,
        cadence_sketch: int = 1,
        sample: dict | None = None,
    ) -> SiteHandle:
        """Declare (or look up) the site ``(path, stream, facet)``; its manifest is written once."""
        self._check_open()
        key = (path, stream, facet)
        if key in self._sites:
            return self._sites[key]
        if stream not in STREAMS:
            raise UsageError(f"stream must be one of {', '.join(STREAMS)}, got {stream!r}")
        if sharing not in SHARING:
            raise UsageError(f"sharing must be 'shard' or 'replica', got {sharing!r}")
        sid = len(self._site_meta)
        doc = {
            "kind": "site", "id": sid, "path": path, "stream": stream, "facet": facet,
            "shape": None if shape is None else [int(d) for d in shape], "dtype": dtype, "sharing": sharing,
            "cadence": {"spine": int(cadence_spine), "sketch": int(cadence_sketch)}, "sample": sample,
        }
        self._manifest(doc)
        handle = SiteHandle(sid, path, stream, facet)
        self._sites[key] = handle
        self._site_meta[sid] = doc
        return handle

    def _at_step(self, step: int) -> None:
        if self._last_step is not None and step != self._last_step:
            self._steps_since_commit += 1
            if (
                self._steps_since_commit >= self._commit_every
                or time.monotonic() - self._last_commit_time >= self._commit_seconds
            ):
                self.commit()
        self._last_step = step

    def _add(self, site: SiteHandle, step: int, phase: str, micro: int | None, presence: int,
             summary: Summary | None) -> None:
        self._check_open()
        if not isinstance(site, SiteHandle) or self._sites.get((site.path, site.stream, site.facet)) != site:
            raise UsageError(f"{site!r} is not a site of this writer: get one from HistoryWriter.site()")
        self._at_step(int(step))
        if self._segment_manifest is not None and self._segment_manifest["first_step"] is None:
            self._segment_manifest["first_step"] = int(step)
        row = (int(step), 1, MICRO_ALL if micro is None else int(micro), Phase.code(phase), presence, summary)
        buf = self._buffers.setdefault((site.id, self.segment), [])
        buf.append(row)
        if len(buf) >= MAX_ROWS // 16:
            self._flush_site(site.id, self.segment)

    def observe(
        self,
        site: SiteHandle,
        step: int,
        values: np.ndarray | None = None,
        *,
        summary: Summary | None = None,
        phase: str = "default",
        micro: int | None = None,
        sketch: bool = True,
        dtype: str | None = None,
    ) -> None:
        """Record one observation: give ``values`` (reduced here, exactly) or a precomputed ``summary``."""
        if (values is None) == (summary is None):
            raise UsageError("observe() takes exactly one of values= or summary=")
        if summary is None:
            summary = summarize(values, dtype=dtype, sketch=sketch)
        self._add(site, step, phase, micro, Presence.OBSERVED, summary)

    def mark(self, site: SiteHandle, step: int, presence: str, *, phase: str = "default",
             micro: int | None = None) -> None:
        """Record that ``site`` has no numbers at ``step``, and why (absent, not_scheduled, failed, ...)."""
        code = Presence.code(presence)
        if code == Presence.OBSERVED:
            raise UsageError("mark() records missing observations; use observe() for data")
        self._add(site, step, phase, micro, code, None)

    def scalar(self, name: str, step: int, value: float) -> None:
        """Record a run-level number (loss, lr, grad norm, ...) as a one-element observation of a scalar site."""
        s = self.site(name, "scalar", cadence_sketch=0)
        v = float(value)
        if math.isfinite(v):
            d = Dyadic.from_float(v)
            summ = Summary(count=1, zero=int(v == 0), min=v, max=v, sum=d, sumsq=Dyadic.make(d.m * d.m, 2 * d.e))
        else:
            summ = Summary(count=1, nan=int(math.isnan(v)), pinf=int(v == math.inf), ninf=int(v == -math.inf))
        self._add(s, step, "default", None, Presence.OBSERVED, summ)

    def step_truth(
        self,
        step: int,
        *,
        applied: bool | None = None,
        loss_scale: float | None = None,
        grad_basis: str | None = None,
        clipped: bool | None = None,
        clip_threshold: float | None = None,
        micro_batches: int | None = None,
        tokens: int | None = None,
        samples: int | None = None,
    ) -> None:
        """Record what the loop can attest about ``step``; every ``None`` is stored as unknown."""
        self._check_open()
        self._at_step(int(step))
        row = (
            int(step),
            0 if applied is None else (1 if applied else 2),
            GradBasis.code(grad_basis or "unknown"),
            0 if clipped is None else (1 if clipped else 2),
            CANONICAL_NAN if loss_scale is None else float(loss_scale),
            CANONICAL_NAN if clip_threshold is None else float(clip_threshold),
            0 if micro_batches is None else int(micro_batches),
            U64_UNKNOWN if tokens is None else int(tokens),
            U64_UNKNOWN if samples is None else int(samples),
        )
        self._steps.setdefault(self.segment, []).append(row)

    def new_segment(self, first_step: int | None, reason: str = "manual") -> int:
        """Start a new segment (a resume): rows after this belong to it; boundaries are never merged away."""
        self._check_open()
        if self.segment >= 0:
            self.commit()
        if self._segment_manifest is not None:  # the current segment recorded nothing: replace it
            seg, self._previous_segment = self.segment, self._segment_manifest["previous"]
        else:
            seg = self._next_segment
            self._next_segment += 1
        self._segment_manifest = {
            "kind": "segment", "id": seg, "first_step": first_step, "reason": reason,
            "previous": self._previous_segment, "writer_id": self.writer_id, "created": self._now(),
        }
        self._previous_segment = seg
        self.segment = seg
        return seg

    def _flush_site(self, sid: int, segment: int) -> None:
        buf = self._buffers.pop((sid, segment), None)
        if not buf:
            return
        self._write_segment_manifest()
        payload, lo, hi = encode_obs_rows(buf, sid, segment, self._codec)
        self._record(RecordType.OBS, payload, site=sid, segment=segment, rows=len(buf), steps=(lo, hi))

    def _write_segment_manifest(self) -> None:
        if self._segment_manifest is not None:
            doc, self._segment_manifest = self._segment_manifest, None
            self._manifest(doc)

    def commit(self) -> None:
        """Write every buffered row and a commit record; after it returns, a reader sees all of it."""
        self._check_open()
        for sid, segment in sorted(self._buffers):
            self._flush_site(sid, segment)
        for segment, rows in sorted(self._steps.items()):
            self._write_segment_manifest()
            step = np.array([r[0] for r in rows], np.int64)
            cols = {
                name: (dt, np.array([r[i] for r in rows], dt))
                for i, (name, dt) in enumerate(
                    (("step", "i8"), ("applied", "u1"), ("grad_basis", "u1"), ("clipped", "u1"),
                     ("loss_scale", "f8"), ("clip_threshold", "f8"), ("micro_batches", "u4"), ("tokens", "u8"),
                     ("samples", "u8"))
                )
            }
            payload = encode_chunk({"segment": segment, "rows": len(rows)}, cols, self._codec)
            self._record(RecordType.STEPS, payload, segment=segment, rows=len(rows),
                         steps=(int(step.min()), int(step.max())))
        self._steps.clear()
        if self._entries:
            body = pack_commit(self._seq, self._entries)
            self._entries = []
            self._record(RecordType.COMMIT, body)
            self._f.flush()
            if self._fsync == "commit":
                os.fsync(self._f.fileno())
        self._steps_since_commit = 0
        self._last_commit_time = time.monotonic()

    def close(self) -> None:
        """Commit what is buffered, sync, and close the file. Idempotent."""
        if self._closed:
            return
        try:
            self.commit()
            self._f.flush()
            if self._fsync != "never":
                os.fsync(self._f.fileno())
        finally:
            self._closed = True
            self._f.close()

    def __enter__(self) -> "HistoryWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
