"""``trainhist.open``: read a history file without torch, recovering the committed prefix after a crash.

The reader follows the normative algorithm of spec section 8: walk the record headers, trust nothing it cannot
check, and end in one of three outcomes — clean end, torn tail after the last commit (the prefix is recovered
and what was dropped is reported), or corruption before the last commit (a typed error naming the offset).

Rows are read in batches (``History._batch``, on the functions of ``trainhist.batchdecode``, which merge uses
too): the chunks of one site, or of the next sites when sites are read in order, have their directories read
together (``_directories_by_template``: one directory unpacked per structure, the integers of the others read
from their bytes at once) and checked on whole arrays (``batchdecode.layout``), and each column of all of them is
decoded with one set of numpy operations (``batchdecode.gather``).
Whenever a batch check fails, the site is read again chunk by chunk (``History._site_chunks``), which raises
the error spec 8 names, with the offset of the first damaged record.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from crc32c import crc32c as _crc  # the same function as framing.crc32c, without a Python call around it

from .batchdecode import (  # noqa: F401 - _directories_*, _int_positions: tests reach them through the reader
    OBS_KNOWN as _OBS_KNOWN,
    OBS_VARIABLE as _OBS_VARIABLE,
    STEPS_KNOWN as _STEPS_KNOWN,
    Fallback as _Fallback,
    _Col,
    _directories_by_template,
    _directories_unpacked,
    _int_positions,
    _Layout,
    _patched_checked,
    check_chunk,
    gather as _gather,
    join as _join,
    layout,
)
from .chunk import Chunk, Codec
from .dyadic import EXACT_BYTES, MANT_BITS, ZERO, Dyadic, quotient_float, same_float
from .errors import (CorruptError, FormatError, NotFoundError, UnsupportedError, UsageError, not_a_file, path_problem,
                     truncation_hint)
from .framing import (
    COMMIT_ENTRY,
    COMMIT_ENTRY_DTYPE,
    COMMIT_HEAD,
    FILE_HEADER_SIZE,
    FLAG_IGNORABLE,
    MAGIC,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    WRITE_VERSION,
    FileHeader,
    RecordHeader,
    RecordType,
    crc32c,
    pad8,
)
from .model import (
    OBS_COLUMNS,
    PRIORITY,
    tally_disagrees,
    row_problem,
    sketch_problem,
    unknown_steps_code,
    SKETCH_COLUMNS,
    STEPS_COLUMNS,
    TALLY_COLUMNS,
    U64_UNKNOWN,
    Applied,
    Clipped,
    GradBasis,
    Phase,
    Presence,
)
from .schemas import loads_manifest, validate_manifest
from .summary import Sketch, Summary, SumMethod

__all__ = ["open_history", "History", "Site", "Segment", "Recovery", "SpineSeries", "SketchSeries"]

NO_ID = 0xFFFFFFFF


@dataclass(frozen=True)
class Site:
    """A site as declared by its manifest."""

    id: int
    path: str
    stream: str
    facet: str | None
    shape: tuple[int, ...] | None
    dtype: str | None
    sharing: str
    cadence_spine: int
    cadence_sketch: int
    sample: dict | None
    manifest: dict = field(compare=False, repr=False)
    order: int | None = None  #: position in the order a step produces values (2.2); None when unknown

    @property
    def key(self) -> tuple[str, str, str | None]:
        """The stable identity of a site across files: (path, stream, facet)."""
        return (self.path, self.stream, self.facet)


@dataclass(frozen=True)
class Segment:
    """A contiguous stretch of one writer's history (a resume starts a new one)."""

    id: int
    first_step: int | None
    reason: str
    previous: int | None
    writer_id: str
    manifest: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class Recovery:
    """How reading ended: ``clean``, or ``torn`` with what was dropped after the last commit and why."""

    status: str
    committed_bytes: int
    dropped_bytes: int
    dropped_records: int
    reason: str | None
    offset: int | None

    def describe(self) -> str:
        if self.status == "clean":
            return f"clean: {self.committed_bytes} bytes committed"
        return (
            f"torn tail recovered: kept {self.committed_bytes} committed bytes, dropped {self.dropped_bytes} bytes "
            f"({self.dropped_records} uncommitted records) from offset {self.offset}: {self.reason}"
        )


class _Entry(NamedTuple):
    """One committed obs or steps record, as its commit entry names it (the file's index)."""

    offset: int  # record header offset
    type: int
    site: int
    segment: int
    rows: int
    step_min: int
    step_max: int
    length: int
    payload_crc: int


class _Exact:
    """The exact-sum column of a series (spec 5.3), decoded and checked only when a row's exact value is asked for."""

    def __init__(self, name: str, rounded: np.ndarray, off: np.ndarray, n: np.ndarray, blob: bytes,
                 where: np.ndarray, path: str) -> None:
        self.name, self.rounded, self.off, self.n, self.blob, self.where, self.path = (
            name, rounded, off, n, blob, where, path)

    def get(self, i: int) -> Dyadic | None:
        n = int(self.n[i])
        if n == 0:
            return None
        if n > EXACT_BYTES:
            raise _bad(f"{self.name}_x: a dyadic of {n} bytes, more than the {EXACT_BYTES} of spec 5.3 (a mantissa "
                       f"below 2**{MANT_BITS} in magnitude)", "bad_exact_value", self.path, int(self.where[i]))
        o = int(self.off[i])
        try:
            d = Dyadic.from_bytes(self.blob[o : o + n])
        except ValueError as err:
            raise _bad(f"{self.name}_x: {err}", "bad_exact_value", self.path, int(self.where[i])) from None
        if not same_float(d, float(self.rounded[i])):  # (bit for bit: a tiny value needs the zero of its sign)
            raise _bad(f"{self.name} is not the correctly rounded value of {self.name}_x", "bad_exact_value",
                       self.path, int(self.where[i]))
        return d

    def value(self, i: int) -> Dyadic:
        """The exact value of row ``i``: its ``_x`` dyadic, else the f64 column, which must then be finite."""
        d = self.get(i)
        if d is not None:
            return d
        f = float(self.rounded[i])
        if not math.isfinite(f):
            raise _bad(f"{self.name} is {f!r} without an exact {self.name}_x value (spec 5.3)", "bad_exact_value",
                       self.path, int(self.where[i]))
        return Dyadic.from_float(f)

    def take(self, keep: np.ndarray, rounded: np.ndarray) -> "_Exact":
        return _Exact(self.name, rounded, self.off[keep], self.n[keep], self.blob, self.where[keep], self.path)


def _zero_where_none(x: _Exact, i: int, c: dict[str, np.ndarray]) -> Dyadic:
    """The exact value of row ``i`` of ``x``, refused (``bad_row``) where it is not 0 though the row has no finite
    value or is not observed (spec 5.5, rules 3 and 4: the f64 column is then ±0.0, which the chunk's check took,
    but an exact form may hold a value too small for binary64)."""
    d = x.value(i)
    if d.m and x.rounded[i] == 0:
        finite = int(c["count"][i]) - int(c["nan"][i]) - int(c["pinf"][i]) - int(c["ninf"][i])
        if finite == 0 or c["presence"][i] != Presence.OBSERVED:
            raise _bad(f"row {i}: its exact {x.name} is {d.m}*2**{d.e}, not 0, in a row "
                       + ("that is not observed" if c["presence"][i] != Presence.OBSERVED else "without finite values"),
                       "bad_row", x.path, int(x.where[i]))
    return d


@dataclass
class SpineSeries:
    """One site's rows (optionally one phase), as numpy columns; only ``observed`` rows carry numbers, and only
    those whose ``method`` is not ``unknown`` (255) carry sums: their ``sum`` and ``sumsq`` columns hold NaN, and
    ``mean`` and ``rms`` are NaN there (spec 5.2, 5.4; missing is never zero)."""

    site: Site
    columns: dict[str, np.ndarray]
    _x: dict[str, _Exact] = field(repr=False)

    def __post_init__(self) -> None:
        c = self.columns
        unknown = (c["method"] == SumMethod.UNKNOWN) & (c["presence"] == Presence.OBSERVED)
        if unknown.any():  # (the stored sums, zero from writers, are no values: spec 5.4)
            c = self.columns = dict(c)
            for k in ("sum", "sumsq"):
                c[k] = np.where(unknown, np.nan, c[k])
                c[k].flags.writeable = False

    @property
    def sums_known(self) -> np.ndarray:
        """Per row: whether it carries sums (an observed row whose method is not ``unknown``, spec 5.4)."""
        return self.observed & (self.columns["method"] != SumMethod.UNKNOWN)

    def __len__(self) -> int:
        return int(self.columns["step"].size)

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["columns"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def presence_names(self) -> list[str]:
        return [Presence.name(int(c)) for c in self.columns["presence"]]

    @property
    def observed(self) -> np.ndarray:
        return self.columns["presence"] == Presence.OBSERVED

    @property
    def finite(self) -> np.ndarray:
        c = self.columns
        return c["count"] - c["nan"] - c["pinf"] - c["ninf"]

    def _defined(self) -> np.ndarray:
        """Rows whose mean and rms are defined (spec 5.2): observed, with finite values and known sums."""
        return self.sums_known & (self.finite > 0)

    def _derived(self, values: np.ndarray) -> np.ndarray:
        out = np.full(len(self), np.nan)
        ok = self._defined()
        out[ok] = values[ok]
        return out

    @property
    def mean(self) -> np.ndarray:
        """Mean of the finite values (NaN where nothing finite was observed, or the sums are unknown); a derived
        float."""
        with np.errstate(all="ignore"):
            q = self.columns["sum"] / self.finite
            return self._from_exact(self._derived(q), q, "sum", False)

    @property
    def rms(self) -> np.ndarray:
        """Root mean square of the finite values (NaN where ``mean`` is); a derived float."""
        with np.errstate(all="ignore"):
            q = self.columns["sumsq"] / self.finite
            return self._from_exact(self._derived(np.sqrt(q)), q, "sumsq", True)

    def _from_exact(self, out: np.ndarray, q: np.ndarray, name: str, root: bool) -> np.ndarray:
        """``out`` with the rows whose sum is not a binary64 (it overflowed, or a sum of squares of tiny values
        underflowed) taken from the exact sum: 1e300 has an rms of 1e300, not inf; 5e-324 one of 5e-324, not 0."""
        x = self._x[name]
        # (only where the rounded quotient left the normal float range: almost every sum of squares of float32
        # data has an exact column, and the rounded one is then within an ulp)
        off = ~np.isfinite(q) | (np.abs(q) < np.finfo(np.float64).tiny)  # (``q``: the quotient, before any root)
        for i in np.flatnonzero((x.n > 0) & self._defined() & off).tolist():
            d = x.get(i)  # (correctly rounded by integer arithmetic, however wide d: no overflow on the way)
            out[i] = quotient_float(d.m, d.e, int(self.finite[i]), root)  # type: ignore[union-attr]
        return out

    @property
    def exact(self) -> dict[str, list[Dyadic | None]]:
        """Per row, the exact value stored beside the rounded f64 (None where the f64 is exact); all checked."""
        return {k: [x.get(i) for i in range(len(self))] for k, x in self._x.items()}

    def _row(self, i: int) -> int:
        """``i`` as the index of a row (negative from the end), or a :class:`UsageError` (``bad_index``)."""
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -n <= i < n:
            raise UsageError(f"row {i!r} does not exist: this series of {self.site.key} has {n} rows "
                             f"({f'0..{n - 1}' if n else 'none'}; negative indices count from the end)",
                             code="bad_index")
        return int(i) % n

    def _observed_row(self, i: int) -> int:
        """``i`` as a row index, refused for a row that carries no numbers (spec 2.6: missing is never zero)."""
        i = self._row(i)
        p = int(self.columns["presence"][i])
        if p != Presence.OBSERVED:
            raise UsageError(f"row {i} (step {int(self.columns['step'][i])}) is {Presence.name(p)}: it carries no "
                             "numbers (spec 2.6); check presence_names or observed first", code="not_observed")
        return i

    def _known_sums(self, i: int) -> int:
        """``i`` as a row index, refused for a row without sums: not observed (spec 2.6), or sums unknown (5.4)."""
        i = self._observed_row(i)
        if int(self.columns["method"][i]) == SumMethod.UNKNOWN:
            raise UsageError(f"row {i} (step {int(self.columns['step'][i])}) has unknown sums (method unknown, spec "
                             "5.4: the writer could not state them, e.g. its float accumulation overflowed): they "
                             "are no numbers; check sums_known first", code="sums_unknown")
        return i

    def sum_exact(self, i: int) -> Dyadic:
        """The exact stored sum of row ``i`` (an observed row whose sums are known: :attr:`sums_known`)."""
        i = self._known_sums(i)
        return _zero_where_none(self._x["sum"], i, self.columns)

    def sumsq_exact(self, i: int) -> Dyadic:
        """The exact stored sum of squares of row ``i`` (as :meth:`sum_exact`)."""
        i = self._known_sums(i)
        return _zero_where_none(self._x["sumsq"], i, self.columns)

    def summary(self, i: int, sketch: Sketch | None = None) -> Summary:
        """Row ``i`` (an observed row) as a :class:`Summary` (for merging and re-writing); a row whose sums are
        unknown has method ``unknown`` and zero sums, as a writer stores it (spec 5.4)."""
        c = self.columns
        i = self._observed_row(i)
        known = int(c["method"][i]) != SumMethod.UNKNOWN
        return Summary(
            count=int(c["count"][i]), nan=int(c["nan"][i]), pinf=int(c["pinf"][i]), ninf=int(c["ninf"][i]),
            zero=int(c["zero"][i]), min=float(c["min"][i]), max=float(c["max"][i]),
            sum=self.sum_exact(i) if known else ZERO, sumsq=self.sumsq_exact(i) if known else ZERO,
            sum_method=int(c["method"][i]), sketch=sketch,
        )


class _Patched:
    """Sketch counts as stored by the patched-bytes codec (spec 7.3), already checked: the code bytes of each block
    (ranges of the file) and the exceptions; widened to u64 on first use, so a scan that does not look at the bins
    never copies or widens them."""

    def __init__(self, view: memoryview, start: list[int], end: list[int], exc: np.ndarray) -> None:
        self.view, self.start, self.end, self.exc = view, start, end, exc
        self.size = sum(end) - sum(start)
        self._wide: np.ndarray | None = None

    def widen(self) -> np.ndarray:
        if self._wide is None:
            codes = np.frombuffer(_join(self.view, self.start, self.end), np.uint8) if self.start else \
                np.zeros(0, np.uint8)
            out = codes.astype(np.uint64)
            if self.exc.size:
                out[np.flatnonzero(codes == 255)] = self.exc
            self._wide = out
        return self._wide


class _Sparse(NamedTuple):
    """Sketch rows as stored: per row the positive range ``(plo, pn)`` and the negative range ``(nlo, nn)`` of bin
    counts, which begin at ``start`` in ``counts`` (positive first); the bands per row."""

    scale: int
    counts: "np.ndarray | _Patched"  # u64 values, or their stored bytes widened on demand (:meth:`values`)
    start: np.ndarray  # i64 per row
    plo: np.ndarray  # i64 per row
    pn: np.ndarray
    nlo: np.ndarray
    nn: np.ndarray
    bands: tuple[np.ndarray, ...]  # under_pos, under_neg, over_pos, over_neg: u64 per row

    def values(self) -> np.ndarray:
        c = self.counts
        return c.widen() if isinstance(c, _Patched) else c

    def take(self, sel: np.ndarray) -> "_Sparse":
        return _Sparse(self.scale, self.counts, self.start[sel], self.plo[sel], self.pn[sel], self.nlo[sel],
                       self.nn[sel], tuple(b[sel] for b in self.bands))

    @staticmethod
    def empty(scale: int = 2) -> "_Sparse":
        z = np.zeros(0, np.int64)
        return _Sparse(scale, np.zeros(0, np.uint64), z, z, z, z, z, (np.zeros(0, np.uint64),) * 4)

    @staticmethod
    def concat(parts: list["_Sparse"]) -> "_Sparse":
        if not parts:
            return _Sparse.empty()
        if len(parts) == 1:
            return parts[0]
        shift = np.cumsum([0] + [p.counts.size for p in parts[:-1]])
        return _Sparse(
            parts[0].scale, np.concatenate([p.values() for p in parts]),
            np.concatenate([p.start + k for p, k in zip(parts, shift.tolist())]),
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("plo", "pn", "nlo", "nn")),
            tuple(np.concatenate([p.bands[j] for p in parts]) for j in range(4)),
        )

    def dense(self, side: int) -> np.ndarray:
        """(rows, bins) u64 counts of the positive (0) or negative (1) side."""
        from .grid import nbins

        nb = nbins(self.scale)
        rows = self.start.size
        out = np.zeros((rows, nb), np.uint64)
        lo, n = (self.plo, self.pn) if side == 0 else (self.nlo, self.nn)
        first = self.start if side == 0 else self.start + self.pn
        total = int(n.sum())
        if total:
            k = np.arange(total, dtype=np.int64)
            before = np.cumsum(n) - n  # values of earlier rows on this side
            base = np.arange(rows, dtype=np.int64) * nb
            out.reshape(-1)[np.repeat(base + lo - before, n) + k] = self.values()[np.repeat(first - before, n) + k]
        return out


class SketchSeries:
    """Sketches of one site: ``pos``/``neg`` are (rows, bins) uint64 counts (built on first use from the stored
    ranges), ``bands`` (rows, 4); ``columns`` holds ``step`` etc. per row. :meth:`sketch` builds one row."""

    def __init__(self, site: Site, columns: dict[str, np.ndarray], sparse: _Sparse) -> None:
        self.site = site
        self.scale = sparse.scale
        self.columns = columns
        self._sparse = sparse
        self._dense: dict[int, np.ndarray] = {}

    def __repr__(self) -> str:
        return f"SketchSeries(site={self.site.key}, scale={self.scale}, rows={len(self)})"

    def __len__(self) -> int:
        return int(self._sparse.start.size)

    @property
    def bands(self) -> np.ndarray:
        """(rows, 4) u64: under_pos, under_neg, over_pos, over_neg."""
        if 2 not in self._dense:
            self._dense[2] = np.stack(self._sparse.bands, axis=1)
        return self._dense[2]

    @property
    def pos(self) -> np.ndarray:
        if 0 not in self._dense:
            self._dense[0] = self._sparse.dense(0)
        return self._dense[0]

    @property
    def neg(self) -> np.ndarray:
        if 1 not in self._dense:
            self._dense[1] = self._sparse.dense(1)
        return self._dense[1]

    @property
    def stored_values(self) -> int:
        """Number of bin counts stored for these rows (the ranges' total length)."""
        return int(self._sparse.pn.sum() + self._sparse.nn.sum())

    def sketch(self, i: int) -> Sketch:
        from .grid import nbins

        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -len(self) <= i < len(self):
            raise UsageError(f"sketch row {i!r} does not exist: this series has {len(self)} rows "
                             f"({f'0..{len(self) - 1}' if len(self) else 'none'})",
                             code="bad_index")
        i = int(i) % len(self)
        sp = self._sparse
        b = [int(c[i]) for c in sp.bands]
        nb = nbins(self.scale)
        st, plo, pn, nlo, nn = (int(sp.start[i]), int(sp.plo[i]), int(sp.pn[i]), int(sp.nlo[i]), int(sp.nn[i]))
        pos, neg = np.zeros(nb, np.uint64), np.zeros(nb, np.uint64)
        counts = sp.values()
        pos[plo : plo + pn] = counts[st : st + pn]
        neg[nlo : nlo + nn] = counts[st + pn : st + pn + nn]
        return Sketch(self.scale, pos, neg, int(b[0]), int(b[1]), int(b[2]), int(b[3]))



_TALLY_SET = frozenset(TALLY_COLUMNS)
#: reading sites in id order decodes the next ones with the current one, up to this many bytes of chunks or sites
_READAHEAD_BYTES = 32 << 20
_READAHEAD_SITES = 64
#: how many times a file that changed while it was scanned is scanned again (see History.__init__)
_SCAN_ATTEMPTS = 3



def _open_regular(path: str) -> Any:
    """``path`` opened for reading, refused unless it is a regular file: opened without blocking (a FIFO would wait
    for a writer forever) and checked before a byte is read."""
    import stat

    nonblock = getattr(os, "O_NONBLOCK", 0)  # (none on Windows, where opening a pipe does not wait)
    try:
        fd = os.open(path, os.O_RDONLY | nonblock | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        where = os.path.dirname(os.path.abspath(path))
        hint = "check the path" if os.path.isdir(where) else f"the folder {where} does not exist either"
        raise NotFoundError(f"no such file: expected a trainhist history (.thist) here; {hint}",
                            path=path) from None
    except IsADirectoryError:  # (Windows: a directory cannot be opened)
        raise not_a_file("a directory: a history is read from a regular file; name a .thist file in it", path=path,
                         directory=True) from None
    except (OSError, ValueError) as e:
        problem = path_problem(path, e, "read the history")
        if problem is None:
            raise
        raise problem from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory: a history is read from a regular file; name a .thist file in it" if stat.S_ISDIR(mode)
                    else "not a regular file (a pipe, socket or device): a history is read from a regular file; copy "
                    "what it holds to one and read that")
            raise not_a_file(kind, path=path, directory=stat.S_ISDIR(mode))
        if nonblock:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def payload_problem(data: bytes | memoryview, length: int, payload_crc: int, rtype: int,
                    pos: int) -> tuple[str, str] | None:
    """(code, message) if ``data`` (a record's payload and its padding; the record at offset ``pos``) fails its CRC
    or holds non-zero padding, else None."""
    if crc32c(data[:length]) != payload_crc:
        return ("bad_payload_crc", f"payload CRC32C mismatch in {RecordType.NAMES.get(rtype, rtype)} record"
                + truncation_hint(pos))
    if any(data[length:]):
        return ("bad_padding", "record padding bytes are not zero")
    return None


def _bad(msg: str, code: str, path: str, offset: int) -> CorruptError:
    return CorruptError(msg, code=code, path=path, offset=offset)


class History:
    """A trainhist file opened for reading (committed content only). Use :func:`trainhist.open`."""

    def __init__(self, path: str | os.PathLike, *, in_memory: bool = False) -> None:
        _check_path(path)
        if not isinstance(in_memory, bool):
            raise UsageError(f"in_memory must be True or False, not {type(in_memory).__name__} {in_memory!r:.60}",
                             code="bad_value")
        self.path = os.fspath(path)
        self.in_memory = in_memory
        self._file = _open_regular(self.path)
        self._closed = False
        self._buf: Any = b""
        self._view = memoryview(self._buf)
        try:
            for attempt in range(_SCAN_ATTEMPTS):
                self._map()
                self._reset()
                try:
                    self._scan()
                    return
                except FormatError:
                    # a writer resuming the file cuts its torn tail and writes new records there: a scan that
                    # read those bytes meanwhile may have found half a record. The file's size then differs from
                    # the map's, and the file is read again; a file that stays as it was is refused
                    if attempt + 1 == _SCAN_ATTEMPTS or os.fstat(self._file.fileno()).st_size == self.size:
                        raise
                    self._unmap()
        except BaseException:
            self._unmap()
            self._file.close()
            raise

    def _map(self) -> None:
        """Map the file, or read it into memory (``in_memory``); its size is the map's or the copy's (a writer may
        cut or grow it at any time: only those bytes are read)."""
        self._buf = b""
        if self.in_memory:
            self._copy()
        elif os.fstat(self._file.fileno()).st_size:
            try:
                self._buf = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # (emptied since: "cannot mmap an empty file")
                pass
        self.size = len(self._buf)
        self._view = memoryview(self._buf)

    def _copy(self) -> None:
        """Read the file into memory, up to the size it has now (fewer bytes where it is cut meanwhile): queries
        then read this copy, which no writer can cut (spec/crash-safety.md)."""
        f = self._file
        buf = bytearray(os.fstat(f.fileno()).st_size)
        got = 0
        with memoryview(buf) as view:
            f.seek(0)
            while got < len(buf):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        del buf[got:]
        self._buf = memoryview(buf).toreadonly()  # (numpy arrays over it are read-only, as over a map)

    def _unmap(self) -> None:
        try:
            self._view.release()
        except BufferError:  # numpy arrays still view the map; it is released when they are
            pass
        if isinstance(self._buf, mmap.mmap):
            try:
                self._buf.close()
            except BufferError:
                pass

    def _reset(self) -> None:
        """The state of a file with no record read yet."""
        self.runs: list[dict] = []
        self.writers: list[dict] = []
        self.settings: list[dict] = []
        self.sites: list[Site] = []
        self.segments: list[Segment] = []
        self.ignored_records: list[tuple[int, int]] = []  # (offset, type) of unknown ignorable records
        self._site_by_key: dict[tuple[str, str, str | None], Site] = {}
        self._obs: dict[int, list[_Entry]] = {}
        self._steps: list[_Entry] = []
        self._steps_table: dict[str, np.ndarray] | None = None
        self._cache: dict[int, tuple] = {}  # site id -> decoded rows: the last site read and those read ahead
        self._last_site: int | None = None
        self.committed_records = 0
        self.read_only = False

    # -- the scan (spec 8) ---------------------------------------------------------------------------------
    def _scan(self) -> None:
        buf, size, path = self._view, self.size, self.path
        if size and buf[0] == 0 and self._zeros(0, size):  # (a power loss before the first commit: never written)
            self.header = None
            self.recovery = Recovery("torn", 0, size, 0, "zero-filled file (space the file system allocated but "
                                     "never wrote: nothing was committed)", 0)
            self.committed_bytes = 0
            return
        if size < FILE_HEADER_SIZE:
            if bytes(buf[:size]) != MAGIC[:size] and bytes(buf[:8]) != MAGIC:
                raise FormatError(f"not a trainhist file: {size} bytes that do not start with {MAGIC!r}",
                                  code="bad_magic", path=path, offset=0)
            self.header = None
            self.recovery = Recovery("torn", 0, size, 0, "file ends inside its 32-byte header", 0)
            self.committed_bytes = 0
            return
        self.header = FileHeader.unpack(buf[:FILE_HEADER_SIZE], path)
        self.read_only = self.header.write_version > WRITE_VERSION
        salt = self.header.salt
        pos = FILE_HEADER_SIZE
        seq = 0
        committed_end = pos
        pending: list[tuple[int, int, int, int, int]] = []  # (offset, type, length, payload_crc, flags)
        stop: tuple[int, str] | None = None
        unpack, raw = RECORD_HEADER.unpack_from, self._buf
        manifest_or_commit = (RecordType.MANIFEST, RecordType.COMMIT)
        while pos < size:
            if size - pos < RECORD_HEADER_SIZE:
                stop = (pos, "file ends inside a record header")
                break
            rtype, flags, length, rseq, rsalt, pcrc, hcrc = unpack(raw, pos)
            if _crc(buf[pos : pos + 28]) != hcrc or rsalt != salt:
                if self._zeros(pos, size):
                    stop = (pos, "zero-filled tail (space the file system allocated but never wrote)")
                    break
                hint = (f"; the history committed before it ({committed_end} bytes) reads correctly: if the bytes "
                        f"from here on are not records of this file (appended to it), truncating the file to "
                        f"{committed_end} bytes recovers it (e.g. truncate -s {committed_end} FILE on a copy)")
                if rsalt == salt or crc32c(buf[pos : pos + 28]) != hcrc:
                    raise _bad("record header CRC32C mismatch (the length cannot be trusted)" + hint,
                               "bad_record_header", path, pos)
                raise _bad(f"record salt {rsalt:016x} differs from the file's {salt:016x} (stale or spliced bytes)"
                           + hint, "salt_mismatch", path, pos)
            RecordHeader(rtype, flags, length, rseq, rsalt, pcrc).check_limits(pos, path)
            if rseq != seq:
                raise _bad(f"record sequence number {rseq}, expected {seq} (stale or spliced bytes)",
                           "bad_sequence", path, pos)
            end = pos + RECORD_HEADER_SIZE + length + (-length % 8)
            if end > size:
                stop = (pos, f"file ends inside a {length}-byte record payload")
                break
            if rtype in manifest_or_commit:
                problem = self._check_payload(pos, length, pcrc, rtype)
                if problem is not None:
                    start = pos + RECORD_HEADER_SIZE
                    if self._zeros(start, size):
                        # a machine crash persisted the header but not the payload (spec 8)
                        stop = (pos, "record header followed by a zero-filled tail")
                        break
                    raise _bad(problem[1], problem[0], path, pos)
            if rtype == RecordType.COMMIT:
                self._apply_commit(pos, length, seq, pending)
                self.committed_records = seq + 1
                pending = []
                committed_end = end
            else:
                pending.append((pos, rtype, length, pcrc, flags))
            pos = end
            seq += 1
        self.committed_bytes = committed_end
        if stop is None and not pending:
            self.recovery = Recovery("clean", committed_end, 0, 0, None, None)
        else:
            reason = stop[1] if stop else "the last records were never committed"
            if pending:
                reason = f"{len(pending)} complete but uncommitted record(s)" + (f", then: {reason}" if stop else "")
            self.recovery = Recovery("torn", committed_end, size - committed_end, len(pending) + (1 if stop else 0),
                                     reason, committed_end)

    def _zeros(self, start: int, end: int) -> bool:
        """Whether the bytes from ``start`` to ``end`` (a tail after the last commit) are all zero. Read with
        ``pread``, not through the map: a resuming writer may be cutting this very tail, and reading a page of the
        map past the file's new end would kill the process (SIGBUS); bytes cut meanwhile count as zero (they are
        gone, as a missing suffix is)."""
        pread = getattr(os, "pread", None)
        if pread is None or self.in_memory:  # (Windows: no pread, and a mapped file cannot be cut; or a copy)
            return not np.any(np.frombuffer(self._buf, np.uint8, end - start, start))
        fd = self._file.fileno()
        while start < end:
            block = pread(fd, min(end - start, 1 << 20), start)
            if not block:
                return True
            if np.any(np.frombuffer(block, np.uint8)):
                return False
            start += len(block)
        return True

    def _check_payload(self, pos: int, length: int, payload_crc: int, rtype: int) -> tuple[str, str] | None:
        """(code, message) if the payload CRC or padding of the record at ``pos`` is wrong."""
        start = pos + RECORD_HEADER_SIZE
        return payload_problem(self._view[start : start + length + pad8(length)], length, payload_crc, rtype, pos)

    def _apply_commit(self, pos: int, length: int, seq: int, pending: list[tuple[int, int, int, int, int]]) -> None:
        path = self.path
        p = self._view[pos + RECORD_HEADER_SIZE : pos + RECORD_HEADER_SIZE + length]
        if len(p) < COMMIT_HEAD.size:
            raise _bad(f"commit payload of {len(p)} bytes, shorter than its {COMMIT_HEAD.size}-byte head (sequence "
                       "number and entry count)", "bad_commit", path, pos)
        cseq, n = COMMIT_HEAD.unpack_from(p, 0)
        if cseq != seq or len(p) != COMMIT_HEAD.size + n * COMMIT_ENTRY.size or n != len(pending):
            raise _bad(
                f"commit lists {n} records (payload {len(p)} bytes, seq {cseq}); {len(pending)} records precede it "
                f"since the previous commit", "bad_commit", path, pos,
            )
        entries = np.frombuffer(p, COMMIT_ENTRY_DTYPE, n, COMMIT_HEAD.size).tolist()
        segments = {g.id for g in self.segments}
        for i, ((off, rtype, _res, site, seg, rows, lo, hi), (rpos, ptype, plen, pcrc, flags)) in enumerate(
            zip(entries, pending)
        ):
            if off != rpos or rtype != ptype:
                raise _bad(f"commit entry {i} names a type-{rtype} record at {off}; found type {ptype} at {rpos}",
                           "bad_commit", path, pos)
            e = _Entry(rpos, rtype, site, seg, rows, lo, hi, plen, pcrc)
            if rtype == RecordType.OBS:
                if site >= len(self.sites) or seg not in segments or rows == 0 or lo > hi:
                    raise _bad(f"commit entry {i}: obs chunk names site {site}, segment {seg}, {rows} rows, steps "
                               f"{lo}..{hi}: site/segment not declared before it, or empty", "bad_commit", path, pos)
                self._obs.setdefault(site, []).append(e)
            elif rtype == RecordType.MANIFEST:
                self._apply_manifest(e)
                segments = {g.id for g in self.segments}
            elif rtype == RecordType.STEPS:
                if seg not in segments:
                    raise _bad(f"steps chunk names undeclared segment {seg}", "bad_commit", path, pos)
                self._steps.append(e)
            elif flags & FLAG_IGNORABLE:
                self.ignored_records.append((rpos, rtype))
            else:
                raise UnsupportedError(
                    f"required record type {rtype} is unknown to this reader: upgrade trainhist",
                    code="unknown_record_type", path=path, offset=rpos,
                )

    def _apply_manifest(self, e: _Entry) -> None:
        raw = bytes(self._view[e.offset + RECORD_HEADER_SIZE : e.offset + RECORD_HEADER_SIZE + e.length])
        try:
            doc = loads_manifest(raw.decode("utf-8"))  # (integers as spec 9 reads them: 2.0 is 2, exactly)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError, ArithmeticError) as err:
            # (ArithmeticError: decimal's, for a number beyond what loads_manifest resolves; none is known)
            raise _bad(f"manifest is not UTF-8 JSON ({err})", "bad_manifest_json", self.path, e.offset) from None
        validate_manifest(doc, path=self.path, offset=e.offset, raw=raw)
        kind = doc["kind"]
        if kind == "run":
            self.runs.append(doc)
        elif kind == "writer":
            self.writers.append(doc)
        elif kind == "settings":
            self.settings.append(doc)
        elif kind == "site":
            if doc["id"] != len(self.sites):
                raise _bad(f"site id {doc['id']} out of order: expected {len(self.sites)}", "bad_site_id", self.path,
                           e.offset)
            site = Site(doc["id"], doc["path"], doc["stream"], doc["facet"],
                        None if doc.get("shape") is None else tuple(doc["shape"]), doc.get("dtype"), doc["sharing"],
                        doc["cadence"]["spine"], doc["cadence"]["sketch"], doc.get("sample"), doc, doc.get("order"))
            if site.key in self._site_by_key:
                raise _bad(f"site {site.key} declared twice", "duplicate_site", self.path, e.offset)
            self.sites.append(site)
            self._site_by_key[site.key] = site
        elif kind == "segment":
            ids = {g.id for g in self.segments}
            if doc["id"] in ids:
                raise _bad(f"segment {doc['id']} declared twice", "duplicate_segment", self.path, e.offset)
            if ids and doc["id"] < max(ids):
                raise _bad(f"segment {doc['id']} declared after segment {max(ids)}: a new segment's id is greater "
                           "than every id the file has (spec 2.4)", "bad_segment_order", self.path, e.offset)
            if doc["previous"] is not None and doc["previous"] not in ids:
                raise _bad(f"segment {doc['id']} continues segment {doc['previous']}, which the file has not "
                           "declared before it (spec 2.4)", "bad_segment_order", self.path, e.offset)
            self.segments.append(Segment(doc["id"], doc["first_step"], doc["reason"], doc["previous"],
                                         doc["writer_id"], doc))

    # -- public API -----------------------------------------------------------------------------------------
    @property
    def run(self) -> dict | None:
        """The (first) run manifest."""
        return self.runs[0] if self.runs else None

    def site(self, path: str, stream: str = "activation", facet: str | None = None) -> Site:
        """Look a site up by its stable key; the error lists close names."""
        s = self._site_by_key.get((path, stream, facet))
        if s is None:
            import difflib

            names = [f"{p} [{st}{'' if f is None else ':' + f}]" for p, st, f in self._site_by_key]
            close = difflib.get_close_matches(f"{path} [{stream}{'' if facet is None else ':' + facet}]", names, 5)
            raise UsageError(
                f"no site ({path!r}, {stream!r}, facet={facet!r}) in this file; closest: {close or names[:5]} "
                f"(of {len(names)}; h.sites lists them all, as (path, stream, facet) by Site.key)",
                code="unknown_site", path=self.path,
            )
        return s

    def chunk(self, e: _Entry) -> Chunk:
        """Decode (and CRC-check) one committed chunk."""
        self._check_open()
        return self._chunk(e)

    def _chunk(self, e: _Entry) -> Chunk:
        """:meth:`chunk` for a query that checked the file once (:meth:`_check_open`) before its first chunk: the
        check is an ``fstat`` and a read of the salt, not to be paid for each chunk."""
        payload = self._view[e.offset + RECORD_HEADER_SIZE : e.offset + RECORD_HEADER_SIZE + e.length]
        if crc32c(payload) != e.payload_crc:
            raise _bad("payload CRC32C mismatch in a committed chunk" + truncation_hint(e.offset), "bad_payload_crc",
                       self.path, e.offset)
        return check_chunk(payload, e, self.path)

    def _layout(self, entries: list[_Entry]) -> _Layout:
        """The directories of a site's obs chunks with every check of :meth:`chunk` (:func:`batchdecode.layout`);
        raises (anything) where :meth:`chunk` must name the problem."""
        return layout(self._view, entries, self._chunk)


    def _obs_columns(self, e: _Entry) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, bytes]], Chunk]:
        ch = self._chunk(e)
        cols = {name: ch.column(name, e.rows) for name in OBS_COLUMNS}
        cols["segment"] = np.full(e.rows, e.segment, np.uint32)
        path = self.path
        if (not np.array_equal(cols["step"].min(initial=np.iinfo(np.int64).max), e.step_min)
                or cols["step"].max() != e.step_max):
            raise _bad(f"chunk steps {cols['step'].min(initial=0)}..{cols['step'].max(initial=0)} ({e.rows} rows) "
                       f"disagree with the commit entry's step range {e.step_min}..{e.step_max}", "bad_chunk", path,
                       e.offset)
        new_phases = sorted(set(cols["phase"][cols["phase"] >= len(Phase.NAMES)].tolist()))
        new_presences = sorted(set(cols["presence"][cols["presence"] >= len(Presence.NAMES)].tolist()))
        if new_phases or new_presences:
            codes = " and ".join(w for w in (new_phases and f"phase codes {new_phases} (this reader knows 0.."
                                             f"{len(Phase.NAMES) - 1})",
                                             new_presences and f"presence codes {new_presences} (this reader knows "
                                             f"0..{len(Presence.NAMES) - 1})") if w)
            raise UnsupportedError(f"chunk uses {codes}: a newer writer wrote them; read the file with a newer "
                                   "trainhist", code="unknown_code", path=path, offset=e.offset)
        if (cols["span"] == 0).any():
            raise _bad("obs row with span 0 (a row covers at least one step)", "bad_span", path, e.offset)
        tnames = [n for n in TALLY_COLUMNS if ch.has(n)]
        if tnames:  # a derived file's per-presence count of combined leaf rows (spec 11.4)
            if len(tnames) != len(TALLY_COLUMNS):
                raise _bad(f"chunk has tally columns {tnames} but not all six", "bad_tally", path, e.offset)
            tally = np.stack([ch.column(n, e.rows) for n in TALLY_COLUMNS], axis=1).astype(np.uint64)
            if tally_disagrees(tally, cols["presence"]).any():
                row = int(np.flatnonzero(tally_disagrees(tally, cols["presence"]))[0])
                told = ", ".join(f"{n} {c}" for n, c in zip(TALLY_COLUMNS, tally[row].tolist()))
                raise _bad(f"row {row}: presence {Presence.name(int(cols['presence'][row]))} disagrees with the "
                           f"presence its tally ({told}) implies (spec 11.4)", "bad_tally", path, e.offset)
        else:
            tally = np.zeros((e.rows, len(TALLY_COLUMNS)), np.uint64)
            tally[np.arange(e.rows), cols["presence"].astype(np.intp)] = 1
        for j, n in enumerate(TALLY_COLUMNS):
            cols[n] = tally[:, j]
        problem = row_problem({**cols, "sk": ch.column("sk", e.rows)} if ch.has("sk") else cols)
        if problem is not None:
            raise _bad(problem[1].format(row=problem[0]), "bad_row", path, e.offset)
        exact: dict[str, tuple[np.ndarray, bytes]] = {}
        for name in ("sum", "sumsq"):
            if ch.has(name + "_xn"):
                lens = ch.column(name + "_xn", e.rows).astype(np.int64)
                size = ch.raw_size(name + "_x") if ch.has(name + "_x") else 0  # (checked before it is decoded)
                if int(lens.sum()) != size:
                    raise _bad(f"{name}_x holds {size} bytes, {name}_xn sums to {int(lens.sum())}",
                               "bad_column_length", path, e.offset)
                blob = ch.column(name + "_x")
                exact[name] = (lens, blob.tobytes())
            else:
                exact[name] = (np.zeros(e.rows, np.int64), b"")
        return cols, exact, ch

    def _sketch_part(self, e: _Entry, ch: Chunk) -> tuple[np.ndarray, _Sparse]:
        """Sketch rows of one chunk: (has mask, the rows' stored ranges), validated against the spec's layout."""
        s = ch.meta.get("scale")
        sk = {k: ch.column(k, e.rows) for k in SKETCH_COLUMNS if k != "sk_counts"}
        problem = sketch_problem(s, sk, ch.raw_size("sk_counts") // 8)
        if problem is not None:
            raise _bad(problem[0], problem[1], self.path, e.offset)
        has = sk["sk"] == 1
        pn, nn = sk["sk_pn"][has].astype(np.int64), sk["sk_nn"][has].astype(np.int64)
        plo, nlo = sk["sk_plo"][has].astype(np.int64), sk["sk_nlo"][has].astype(np.int64)
        counts = ch.column("sk_counts")
        start = np.cumsum(pn + nn) - (pn + nn)  # where each row's values begin in sk_counts
        bands = tuple(sk[k][has] for k in ("sk_up", "sk_un", "sk_op", "sk_on"))
        return has, _Sparse(s, counts, start, plo, pn, nlo, nn, bands)

    def _site_data(self, site: Site, phase: str | None, *, sketches: bool = True
                   ) -> tuple[dict[str, np.ndarray], dict[str, _Exact], _Sparse | None]:
        """All committed rows of a site (one phase, or every phase for ``"*"``), with ``sk_row`` indexing the
        site's sketch rows (-1: none).

        The site's chunks are decoded together, each column of all of them at once (:func:`_gather`), and kept
        for the next call on the same site (``spine`` then ``sketch`` decode once). Anything unusual — a check
        that fails, tally columns in only some chunks, mixed scales — sends the site through the per-chunk path,
        which names the first problem exactly as spec 8 asks (the record's offset).
        """
        self._check_open()
        data = self._cache.get(site.id)
        if data is None:
            group = [site]
            if self._last_site == site.id - 1 and self._obs.get(site.id):  # reading sites in order: read ahead
                budget = _READAHEAD_BYTES - sum(e.length for e in self._obs[site.id])
                for nxt in self.sites[site.id + 1 :]:
                    if budget <= 0 or len(group) >= _READAHEAD_SITES:
                        break
                    es = self._obs.get(nxt.id)
                    if es:
                        budget -= sum(e.length for e in es)
                        group.append(nxt)
            self._cache = {}
            for attempt in ([group, [site]] if len(group) > 1 else [group]):
                try:
                    if not self._obs.get(site.id):
                        raise _Fallback
                    self._cache = self._batch(attempt)
                    break
                except Exception:  # noqa: BLE001 - the per-chunk path below decides, and names the error
                    continue
            data = self._cache.get(site.id)
        self._last_site = site.id
        if data is None:
            data = self._site_chunks(site, sketches)
        columns, exact, sparse = data
        columns = dict(columns)
        ph = columns["phase"]
        phases = np.unique(ph) if ph.size and ph.min() != ph.max() else ph[:1]
        if phase is None and phases.size > 1:
            raise UsageError(
                f"site {site.key} has rows in phases {[Phase.name(int(p)) for p in phases]}: name one with phase=",
                code="phase_ambiguous", path=self.path,
            )
        if phase is not None and phase != "*":
            try:
                code = Phase.code(phase)
            except UsageError as e:
                raise UsageError(f"{e.message}, or '*' for the rows of every phase", code=e.code) from None
            keep = columns["phase"] == code
            columns = {n: v[keep] for n, v in columns.items()}
            exact = {k: x.take(keep, columns[k]) for k, x in exact.items()}
        return columns, exact, sparse

    def _finish(self, columns: dict[str, np.ndarray], where: np.ndarray,
                xparts: dict[str, list[tuple[np.ndarray, bytes]]]) -> dict[str, _Exact]:
        exact: dict[str, _Exact] = {}
        for k, chunks in xparts.items():
            lens = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros(0, np.int64)
            off = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if lens.size else lens
            exact[k] = _Exact(k, columns[k], off, lens, b"".join(c[1] for c in chunks), where, self.path)
        return exact

    def _site_chunks(self, site: Site, sketches: bool
                     ) -> tuple[dict[str, np.ndarray], dict[str, _Exact], _Sparse | None]:
        """The per-chunk path: every check of spec 7 and 8 in record order, the first failure raised."""
        parts: list[dict[str, np.ndarray]] = []
        xparts: dict[str, list[tuple[np.ndarray, bytes]]] = {"sum": [], "sumsq": []}
        sparts: list[_Sparse] = []
        scale = None
        n_sk = 0
        for e in self._obs.get(site.id, []):
            cols, ex, ch = self._obs_columns(e)
            sk_row = np.full(e.rows, -1, np.int64)
            if ch.has("sk") and not sketches:  # row flags only; the sketch ranges are checked by sketch()
                has = ch.column("sk", e.rows) == 1
                sk_row[has] = n_sk + np.arange(int(has.sum()))
                n_sk += int(has.sum())
            elif ch.has("sk"):
                has, sp = self._sketch_part(e, ch)
                if scale is not None and sp.scale != scale:
                    raise _bad(f"site {site.key} mixes sketch scales {scale} and {sp.scale} (spec 7.5)",
                               "mixed_scale", self.path, e.offset)
                scale = sp.scale
                sk_row[has] = n_sk + np.arange(int(has.sum()))
                n_sk += int(has.sum())
                sparts.append(sp)
            cols["sk_row"] = sk_row
            cols["x_where"] = np.full(e.rows, e.offset, np.int64)
            parts.append(cols)
            for k in xparts:
                xparts[k].append(ex[k])
        names = list(OBS_COLUMNS) + list(TALLY_COLUMNS) + ["segment", "sk_row", "x_where"]
        if parts:
            columns = {n: np.concatenate([p[n] for p in parts]) for n in names}
        else:
            columns = {n: np.zeros(0, np.dtype({**OBS_COLUMNS, **TALLY_COLUMNS}.get(n, "i8"))) for n in names}
        where = columns.pop("x_where")
        exact = self._finish(columns, where, xparts)
        sparse = _Sparse.concat(sparts) if sparts else _Sparse.empty(2 if scale is None else scale)
        return columns, exact, sparse if sketches else None

    def _batch(self, group: list[Site]) -> dict[int, tuple[dict[str, np.ndarray], dict[str, _Exact], _Sparse]]:
        """Every chunk of the sites in ``group`` (each with rows) decoded together, the checks of the per-chunk
        path made on whole columns, then split per site; raises (anything) where the per-chunk path must decide."""
        from .grid import nbins

        per_site = [self._obs[s.id] for s in group]
        entries = [e for es in per_site for e in es]
        lay = self._layout(entries)
        view = self._view
        rows = [e.rows for e in entries]
        rows_a = np.array(rows, np.int64)
        starts = np.cumsum(rows_a) - rows_a
        cols = {name: _gather(view, lay.col(name), dt, rows) for name, dt in OBS_COLUMNS.items()}
        step = cols["step"]
        if (np.minimum.reduceat(step, starts).tolist() != [e.step_min for e in entries]
                or np.maximum.reduceat(step, starts).tolist() != [e.step_max for e in entries]):
            raise _Fallback
        if ((cols["phase"] >= len(Phase.NAMES)).any() or (cols["presence"] >= len(Presence.NAMES)).any()
                or (cols["span"] == 0).any() or row_problem(cols) is not None):
            raise _Fallback
        n = int(rows_a.sum())
        if lay.has_any(_TALLY_SET):  # a derived file (spec 11.4): every chunk has all six, implying its presence
            tcols = [lay.col(name) for name in TALLY_COLUMNS]
            if not all(all(c.present) for c in tcols):
                raise _Fallback  # some chunks without (or with part of) the tally: the per-chunk path decides
            tally = np.stack([_gather(view, c, dt, rows) for c, dt in zip(tcols, TALLY_COLUMNS.values())],
                             axis=1).astype(np.uint64)
            if tally_disagrees(tally, cols["presence"]).any():
                raise _Fallback
        else:
            tally = np.zeros((n, len(TALLY_COLUMNS)), np.uint64)
            tally[np.arange(n), cols["presence"].astype(np.intp)] = 1
        for j, name in enumerate(TALLY_COLUMNS):
            cols[name] = tally[:, j]
        cols["segment"] = np.repeat(np.array([e.segment for e in entries], np.uint32), rows_a)
        # site k holds rows [row_at[k], row_at[k + 1]) and chunks [chunk_at[k], chunk_at[k + 1])
        chunk_at = np.cumsum([0] + [len(es) for es in per_site]).tolist()
        row_at = np.concatenate([starts, [n]])[chunk_at].tolist()
        xcols: dict[str, tuple[np.ndarray, bytes, list[int]]] = {}
        for name in ("sum", "sumsq"):
            xn, x = lay.col(name + "_xn"), lay.col(name + "_x")
            if xn.present != x.present:
                raise _Fallback
            if not any(xn.present):
                xcols[name] = (np.zeros(n, np.int64), b"", [0] * len(row_at))
                continue
            lens = _gather(view, xn, "u4", rows).astype(np.int64)
            if np.add.reduceat(lens, starts).tolist() != x.rlen:
                raise _Fallback
            sub = x.subset()
            blob = bytes(_join(view, sub.start, [a + b for a, b in zip(sub.start, sub.slen)])) \
                if sub.uniform and sub.codec[0] == Codec.RAW else _gather(view, sub, "bytes", sub.rlen).tobytes()
            xcols[name] = (lens, blob, np.concatenate([[0], np.cumsum(lens)])[row_at].tolist())  # type: ignore
        skc = lay.col("sk")
        have = skc.present
        sk_row = np.full(n, -1, np.int64)
        sparse_of: list[_Sparse] = [_Sparse.empty()] * len(group)
        if any(have):
            scale_of = []  # per chunk: its sites' scale (2 for sites without sketches)
            for k, es in enumerate(per_site):
                a, b = chunk_at[k], chunk_at[k + 1]
                scales = {sc for sc, h in zip(lay.scales[a:b], have[a:b]) if h}
                sc = scales.pop() if scales else 2
                if scales or type(sc) is not int or sc not in (0, 1, 2):
                    raise _Fallback
                scale_of.append(sc)
            sk = {k: _gather(view, lay.col(k), dt, rows) for k, dt in SKETCH_COLUMNS.items() if k != "sk_counts"}
            if ((sk["sk"] != 0) & (cols["presence"] != Presence.OBSERVED)).any():
                raise _Fallback  # (a sketch on a row that is not observed: spec 5.5)
            cc = lay.col("sk_counts")
            if cc.present != have:
                raise _Fallback
            flag = sk["sk"]
            if (flag > 1).any():
                raise _Fallback
            hs = flag == 1
            pn_all, nn_all = sk["sk_pn"].astype(np.int64), sk["sk_nn"].astype(np.int64)
            if (~hs & ((pn_all > 0) | (nn_all > 0))).any():
                raise _Fallback
            per_chunk = [r // 8 for r in cc.rlen]
            if np.add.reduceat(pn_all + nn_all, starts).tolist() != per_chunk:
                raise _Fallback  # (before sk_counts is decoded: a lying directory costs no allocation)
            sub = cc.subset()
            ns = [r // 8 for r in sub.rlen]
            lazy = None
            if sub.uniform and sub.codec[0] == Codec.PATCHED:  # kept as stored; widened when bins are read
                lazy = _patched_checked(view, sub.start, sub.slen, ns)
                counts: np.ndarray = np.zeros(0, np.uint64)
            else:
                counts = _gather(view, sub, "u8", ns)
            nbs = {nbins(sc) for sc in scale_of}
            nb = nbs.pop() if len(nbs) == 1 else np.repeat(
                np.array([nbins(sc) for sc in scale_of], np.int64), np.diff(np.array(row_at, np.int64)))[hs]
            every = bool(hs.all())  # usual: every row has a sketch, so no row needs to be taken out
            pick = (lambda a: a) if every else (lambda a: a[hs])
            pn, nn = pick(pn_all), pick(nn_all)
            plo, nlo = pick(sk["sk_plo"]).astype(np.int64), pick(sk["sk_nlo"]).astype(np.int64)
            if (plo + pn > nb).any() or (nlo + nn > nb).any():
                raise _Fallback
            size_ = pn + nn
            start = np.cumsum(size_) - size_
            bands = tuple(pick(sk[k]) for k in ("sk_up", "sk_un", "sk_op", "sk_on"))
            sk_at = np.concatenate([[0], np.cumsum(hs)])[row_at].tolist()  # sketch rows of site k
            c_at = np.cumsum([0] + per_chunk)[chunk_at].tolist()  # its values in counts
            sub_at = np.cumsum([0] + [int(h) for h in have])[chunk_at].tolist()  # its chunks among those with sketches
            for k in range(len(group)):
                s0, s1, c0, c1 = sk_at[k], sk_at[k + 1], c_at[k], c_at[k + 1]
                if lazy is not None:
                    mid, end, exc, e_at = lazy
                    a, b = sub_at[k], sub_at[k + 1]
                    vals: np.ndarray | _Patched = _Patched(view, mid[a:b], end[a:b], exc[e_at[a] : e_at[b]])
                else:
                    vals = counts[c0:c1]
                sparse_of[k] = _Sparse(scale_of[k], vals, start[s0:s1] - c0, plo[s0:s1], pn[s0:s1], nlo[s0:s1],
                                       nn[s0:s1], tuple(b[s0:s1] for b in bands))
                sk_row[row_at[k] : row_at[k + 1]][hs[row_at[k] : row_at[k + 1]]] = np.arange(s1 - s0)
        cols["sk_row"] = sk_row
        for v in cols.values():
            v.flags.writeable = False
        where = np.repeat(np.array([e.offset for e in entries], np.int64), rows_a)
        out = {}
        for k, site in enumerate(group):
            r0, r1 = row_at[k], row_at[k + 1]
            c = {name: v[r0:r1] for name, v in cols.items()}
            xparts = {name: [(lens[r0:r1], blob[b[k] : b[k + 1]])] for name, (lens, blob, b) in xcols.items()}
            out[site.id] = (c, self._finish(c, where[r0:r1], xparts), sparse_of[k])
        return out

    def spine(self, path: str, stream: str = "activation", facet: str | None = None, *,
              phase: str | None = None) -> SpineSeries:
        """Every committed row of one site, in file order; ``phase`` must be named when the site has several.

        Column ``sk_row`` gives the row's index in :meth:`sketch` of the same site and phase (-1: no sketch).
        """
        site = self.site(path, stream, facet)
        columns, exact, _ = self._site_data(site, phase, sketches=False)
        if phase is not None:  # renumber sketch rows within the phase
            sk = columns["sk_row"]
            columns["sk_row"] = np.where(sk >= 0, np.cumsum(sk >= 0) - 1, -1)
        return SpineSeries(site, columns, exact)

    def sketch(self, path: str, stream: str = "activation", facet: str | None = None, *,
               phase: str | None = None) -> SketchSeries:
        """The rows of one site that carry a sketch; dense (rows, bins) count matrices are built on first use."""
        site = self.site(path, stream, facet)
        columns, _, sparse = self._site_data(site, phase)
        assert sparse is not None
        keep = columns["sk_row"] >= 0
        if keep.size == sparse.start.size and keep.all():  # every row has a sketch: the columns as they are
            return SketchSeries(site, {k: v for k, v in columns.items() if k != "sk_row"}, sparse)
        sel = columns["sk_row"][keep]
        if sel.size != sparse.start.size:  # one phase of several: take its rows (else every row is kept, in order)
            sparse = sparse.take(sel)
        return SketchSeries(site, {k: v[keep] for k, v in columns.items() if k != "sk_row"}, sparse)

    @property
    def steps(self) -> dict[str, np.ndarray]:
        """The step-truth table: numpy columns (codes; see :func:`step_truth_rows` for named values)."""
        self._check_open()
        if self._steps_table is None:
            parts = []
            for e in self._steps:
                ch = self._chunk(e)
                cols = {name: ch.column(name, e.rows) for name in STEPS_COLUMNS}
                cols["span"] = ch.column("span", e.rows) if ch.has("span") else np.ones(e.rows, np.uint32)
                cols["n_rows"] = ch.column("n_rows", e.rows) if ch.has("n_rows") else np.ones(e.rows, np.uint64)
                if int(cols["step"].min()) != e.step_min or int(cols["step"].max()) != e.step_max:
                    raise _bad(f"steps chunk steps {int(cols['step'].min())}..{int(cols['step'].max())} disagree "
                               f"with the commit entry's step range {e.step_min}..{e.step_max} (spec 7.2)",
                               "bad_chunk", self.path, e.offset)
                if (cols["span"] == 0).any():
                    raise _bad("steps row with span 0", "bad_span", self.path, e.offset)
                if (cols["n_rows"] == 0).any():
                    raise _bad("steps row with n_rows 0 (a row combines at least one writer's row)", "bad_tally",
                               self.path, e.offset)
                cols["segment"] = np.full(e.rows, e.segment, np.uint32)
                name = unknown_steps_code(cols)
                if name is not None:
                    raise UnsupportedError(f"steps column {name} holds codes unknown to this reader (a newer "
                                           "writer wrote them): read the file with a newer trainhist",
                                           code="unknown_code", path=self.path, offset=e.offset)
                parts.append(cols)
            names = list(STEPS_COLUMNS) + ["span", "n_rows", "segment"]
            if parts:
                self._steps_table = {n: np.concatenate([p[n] for p in parts]) for n in names}
            else:
                self._steps_table = {n: np.zeros(0, np.dtype({**STEPS_COLUMNS, "n_rows": "u8"}.get(n, "u4")))
                                     for n in names}
        return self._steps_table

    def step_truth_rows(self) -> list[dict]:
        """The step-truth table as dicts with named values: ``applied``, ``grad_basis`` and ``clipped`` give
        ``"unknown"`` when unknown, the numbers ``None``."""
        t = self.steps
        out = []
        for i in range(t["step"].size):
            def f(name: str) -> float | None:
                v = float(t[name][i])
                return None if np.isnan(v) else v

            def u(name: str) -> int | None:
                v = int(t[name][i])
                return None if v == U64_UNKNOWN else v

            out.append({
                "step": int(t["step"][i]), "span": int(t["span"][i]), "segment": int(t["segment"][i]),
                "applied": Applied.name(int(t["applied"][i])), "grad_basis": GradBasis.name(int(t["grad_basis"][i])),
                "clipped": Clipped.name(int(t["clipped"][i])), "loss_scale": f("loss_scale"),
                "clip_threshold": f("clip_threshold"),
                "micro_batches": None if int(t["micro_batches"][i]) == 0 else int(t["micro_batches"][i]),
                "tokens": u("tokens"), "samples": u("samples"), "n_rows": int(t["n_rows"][i]),
            })
        return out

    def presence(self, path: str, stream: str = "activation", facet: str | None = None, *,
                 steps: Iterable[int] | None = None, phase: str | None = None,
                 segment: int | None = None) -> dict[int, str]:
        """State of the site at each asked step (default: every step of the step table and the first step of each
        row; a row spanning several steps, made by coarsening, answers for all of them when they are asked for).

        A row gives its own presence; with no row, a step the writer recorded (a step-truth row, or a step inside
        a coarsened step-truth window) whose site cadence says "not due" is ``not_scheduled``, and anything else
        is ``unknown`` (spec 2.6). The rule goes step by step inside a coarsened window too: a coarsened file keeps
        the cadence its writers planned (spec 11.7), so a window without a row reads as its input read those steps;
        in a merged file the cadence is the gcd of the inputs' (spec 11.5), so a step it makes due that no input
        planned reads ``unknown``. A gap is never turned into a number. The work grows with the rows and the asked
        steps, never with a row's span. ``segment``: one segment's rows only; needed when a resumed run recorded some
        steps again in a later segment (spec 2.4: two segments are never one history), else ``segment_ambiguous``.
        """
        if (steps is not None and not isinstance(steps, (str, bytes, np.ndarray, list, tuple, range))
                and isinstance(steps, Iterable)):
            steps = list(steps)  # (once: a generator is read here, and not found empty below)
        # (a list, tuple or range is one-dimensional where its elements are integers: only an array's ndim is read)
        if steps is not None and (isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable)
                                  or (isinstance(steps, np.ndarray) and steps.ndim != 1) or not all(
                isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in steps)):
            raise UsageError(f"steps must be integers (a range, a list, an array), got {steps!r:.80}",
                             code="bad_steps")
        if segment is not None:
            ids = [g.id for g in self.segments]
            if isinstance(segment, bool) or not isinstance(segment, (int, np.integer)) or int(segment) not in ids:
                have = ", ".join(map(str, ids)) if ids else "none"
                raise UsageError(f"segment {segment!r} is not a segment of this file (its segments: {have}); "
                                 "pass one of them, or leave segment out", code="unknown_segment", path=self.path)
        s = self.spine(path, stream, facet, phase=phase)
        site = s.site
        t = self.steps
        seg_rows, seg_steps = s.segment, t["segment"]
        if segment is None:
            seen = {int(g) for g in np.unique(seg_rows)} | {int(g) for g in np.unique(seg_steps)}
            if len(seen) > 1:
                firsts = {}  # (a step recorded in two segments: ambiguous)
                for st, g in zip(np.concatenate([s.step, t["step"]]).tolist(),
                                 np.concatenate([seg_rows, seg_steps]).tolist()):
                    if firsts.setdefault(st, g) != g:
                        raise UsageError(f"{site.key}: step {st} was recorded in segments {firsts[st]} and {g} (a "
                                         "resumed run recorded it again): pass segment= to choose one",
                                         code="segment_ambiguous")
            keep_rows, keep_steps = slice(None), slice(None)
        else:
            keep_rows, keep_steps = seg_rows == segment, seg_steps == segment
        known_steps = set(t["step"][keep_steps].tolist())
        windows = [(a, a + n, 0) for a, n in zip(t["step"][keep_steps].tolist(), t["span"][keep_steps].tolist())
                   if n > 1]  # coarsened step-truth rows: every step of their window was recorded
        rows: dict[int, int] = {}  # one-step rows: step -> presence
        spans: list[tuple[int, int, int]] = []  # rows of several steps: (first step, end, presence)
        for st, pr, span in zip(s.step[keep_rows].tolist(), s.presence[keep_rows].tolist(),
                                s.span[keep_rows].tolist()):
            if span == 1:
                prev = rows.get(st)
                # several rows (micro-batches) at one step: the precedence of spec 2.6 and 11.4
                if prev is None or PRIORITY[pr] > PRIORITY[prev]:
                    rows[st] = pr
            else:
                spans.append((st, st + span, pr))
        if steps is None:
            asked = sorted(known_steps | set(rows) | {a for a, _, _ in spans})
        else:
            asked = [int(x) for x in steps]
        covered = _covering(spans, asked)
        in_window = _covering(windows, asked)
        out = {}
        for k in asked:
            pr, wide = rows.get(k), covered.get(k)
            if wide is not None and (pr is None or PRIORITY[wide] > PRIORITY[pr]):
                pr = wide
            if pr is not None:
                out[k] = Presence.name(pr)
            elif (k in known_steps or k in in_window) and (site.cadence_spine == 0 or k % site.cadence_spine != 0):
                out[k] = "not_scheduled"
            else:
                out[k] = "unknown"
        return out

    def verify(self) -> dict:
        """Decode and check every committed byte (chunks, exact sums, sketches, ignored records); raise on the first
        problem."""
        self._check_open()
        rows = 0
        for site in self.sites:
            columns, exact, _ = self._site_data(site, "*")
            observed = columns["presence"] == Presence.OBSERVED
            for x in exact.values():
                for i in np.flatnonzero(x.n).tolist():
                    _zero_where_none(x, i, columns)
                plain_bad = np.flatnonzero(observed & (x.n == 0) & ~np.isfinite(x.rounded))
                if plain_bad.size:
                    x.value(int(plain_bad[0]))  # (raises bad_exact_value)
            rows += int(columns["step"].size)
        for off, _type in self.ignored_records:
            length = struct.unpack_from("<I", self._view, off + 4)[0]
            pcrc = struct.unpack_from("<I", self._view, off + 24)[0]
            problem = self._check_payload(off, length, pcrc, _type)
            if problem is not None:
                raise _bad(problem[1], problem[0], self.path, off)
        _ = self.steps
        return {
            "status": self.recovery.status, "sites": len(self.sites), "rows": rows,
            "chunks": sum(len(v) for v in self._obs.values()) + len(self._steps),
            "committed_bytes": self.committed_bytes, "dropped_bytes": self.recovery.dropped_bytes,
            "ignored_records": len(self.ignored_records),
        }

    def _check_open(self) -> None:
        """Refuse a query of a closed history (its file map is released) with a typed error, not the memoryview's;
        and of a file cut short or started over since it was opened (see :meth:`_check_unchanged`)."""
        if self._closed:
            raise UsageError("this History is closed; query it inside `with trainhist.open(...) as h:` or before "
                             "h.close() (h.sites and the manifests stay readable)", code="closed", path=self.path)
        if self.committed_bytes and not self.in_memory:  # (a copy in memory stays as it was read)
            self._check_unchanged()

    def _check_unchanged(self) -> None:
        """Refuse to read rows from a file that no longer holds the committed bytes this History found: a writer
        that started it over (``mode="w"``) truncated it in place. The rows are read from a map of the file, and a
        page of the map past the file's end is no memory: touching it kills the process (SIGBUS) instead of raising.
        (A resumed writer only cuts the torn tail, past the committed bytes; a file that grew is read as found.)"""
        size = os.fstat(self._file.fileno()).st_size
        changed = size < self.committed_bytes
        if not changed and self.header is not None:  # (started over and grown again: another salt)
            changed = struct.unpack_from("<Q", self._view, 20)[0] != self.header.salt
        if changed:
            raise FormatError(
                f"the file changed since it was opened: it held {self.committed_bytes} committed bytes and now holds "
                f"{size} bytes{'' if size < self.committed_bytes else ' of another history (another salt)'}; a "
                "writer started it over (mode='w') while it was read. Open it again to read what it holds now",
                code="file_changed", path=self.path)

    def close(self) -> None:
        """Release the file map; later queries of rows raise :class:`~trainhist.errors.UsageError`."""
        self._closed = True
        self._unmap()
        self._file.close()

    def __enter__(self) -> "History":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _covering(spans: list[tuple[int, int, int]], asked: list[int]) -> dict[int, int]:
    """For each asked step inside some of the ``(first, end, presence)`` spans, the presence of highest precedence
    among them: one sweep over the sorted span ends and asked steps."""
    if not spans or not asked:
        return {}
    starts = sorted(spans)
    ends = sorted((end, pr) for _, end, pr in spans)
    active: dict[int, int] = {}  # presence -> spans open at the current step
    out: dict[int, int] = {}
    i = j = 0
    for k in sorted(set(asked)):
        while i < len(starts) and starts[i][0] <= k:
            active[starts[i][2]] = active.get(starts[i][2], 0) + 1
            i += 1
        while j < len(ends) and ends[j][0] <= k:
            active[ends[j][1]] -= 1
            j += 1
        best = max((pr for pr, n in active.items() if n > 0), key=PRIORITY.__getitem__, default=None)
        if best is not None:
            out[k] = best
    return out


def _check_path(path: object) -> None:
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise UsageError(f"open() takes a path (str or os.PathLike) of a history file, not {type(path).__name__} "
                         f"{path!r:.60}", code="bad_path")
    if not os.fspath(path):
        raise UsageError("open() takes the path of a history file, got an empty path ('')", code="bad_path")


def open_history(path: str | os.PathLike, *, in_memory: bool = False) -> History:
    """Open a history file for reading; see :class:`History`. The file is mapped; ``in_memory=True`` reads it into
    memory instead (memory: the file's size), so that a writer cutting or starting over the file while it is read
    cannot kill this process (SIGBUS) nor change what it reads (spec/crash-safety.md)."""
    _check_path(path)
    return History(path, in_memory=in_memory)
