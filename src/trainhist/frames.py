"""A history as pandas data frames, and as Parquet or CSV files (needs the ``export`` extra: pandas, pyarrow).

- :func:`spines`: one row per stored spine row (every site, phase, micro-batch, segment), the exact counts as
  nullable ``UInt64``, the floats as ``float64``; rows that are not ``observed`` carry ``<NA>`` counts and NaN
  floats: missing is never zero (spec 2.6).
- :func:`steps`: the step-truth table, unknown values ``<NA>`` (NaN in its float columns).
- :func:`scalars`: the run-level scalars (loss, learning rate, ...) as one value per row.
- :func:`quantiles`: quantiles of one site DERIVED from its sketches, with their relative bound (approximate).
- :func:`to_parquet`, :func:`to_csv`: the three tables as files, with the run, writer, segment and site manifests.

The metadata of the files: every Parquet file holds these keys in its schema's key-value metadata
(``pyarrow.parquet.read_schema(path).metadata``: bytes keys and values, UTF-8 text), beside pandas' ``pandas`` and
pyarrow's ``ARROW:schema``:

- plain text: ``trainhist.table`` (the file's table: ``spines``, ``steps`` or ``scalars``) and
  ``trainhist.version`` (the version of trainhist that exported it, not the file format's);
- JSON (``json.loads`` it): ``trainhist.source`` (a string: the history's path as it was opened);
  ``trainhist.runs``, ``trainhist.writers``, ``trainhist.segments``, ``trainhist.sites`` and
  ``trainhist.settings`` (lists of the history's manifests as the reader gives them: :attr:`History.runs`,
  ``History.writers``, each segment's and each site's ``manifest``, ``History.settings``; every site of the
  file, whatever the selection); ``trainhist.selection`` (``{"streams": ..., "sites": ..., "phases": ...}``: the
  names and patterns asked for, each a list, or null for all); ``trainhist.recovery`` (how the history was read:
  ``{"status": "clean" | "torn", "committed_bytes": the bytes read (the committed prefix), "dropped_bytes": the
  bytes of a torn tail left out (0 when clean), "reason": why they were (null when clean)}``); ``trainhist.columns``
  (:data:`COLUMN_NOTES`: per table, ``{"spines": {column: note}, "steps": ..., "scalars": ...}``, each note a text
  starting ``exact`` or ``approximate`` and saying how: ``sum`` and ``sumsq`` are rounded to float64, ``mean`` and
  ``rms`` derived from them; the frames of :func:`spines`, :func:`steps` and :func:`scalars` carry their table's
  as ``df.attrs["columns"]``).

:func:`to_csv`'s ``manifests.json`` is one JSON object of the same keys but ``trainhist.table``, their JSON
decoded (``trainhist.version`` is its text).

pandas and pyarrow are imported by the functions that use them, never by ``import trainhist`` or the reader; without
them the functions raise :class:`~trainhist.errors.UsageError` ``needs_export``.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

import numpy as np

from . import __version__
from .errors import TrainhistError, UsageError
from .model import STREAMS, TALLY_COLUMNS, U64_UNKNOWN, Applied, Clipped, GradBasis, Phase, Presence
from .reader import History, Site
from .summary import SumMethod

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["spines", "steps", "scalars", "quantiles", "to_parquet", "to_csv", "Exported", "SPINE_COLUMNS",
           "COLUMN_NOTES"]

#: the columns of :func:`spines`, in order
SPINE_COLUMNS = ("path", "stream", "facet", "phase", "segment", "step", "span", "micro", "presence", "count", "nan",
                 "pinf", "ninf", "zero", "min", "max", "sum", "sumsq", "method", "mean", "rms", "has_sketch",
                 *TALLY_COLUMNS)
_COUNTS = ("count", "nan", "pinf", "ninf", "zero")
_FLOATS = ("min", "max", "sum", "sumsq", "mean", "rms")
_INSTALL = "pip install 'trainhist[export]'"
#: the Parquet compressions :func:`to_parquet` takes (as pyarrow names them; case insensitive)
_COMPRESSIONS = ("zstd", "snappy", "gzip", "brotli", "lz4", "none")


_EXACT_COUNT = "exact: an integer count (UInt64, exact beyond 2**53); <NA> where the row is not observed"
_LABEL = "exact: a name"
#: what each column of each table is: ``exact ...`` or ``approximate ...`` (how), in ``df.attrs["columns"]`` and
#: the exports' ``trainhist.columns``
COLUMN_NOTES: dict[str, dict[str, str]] = {
    "spines": {
        "path": _LABEL, "stream": _LABEL, "facet": _LABEL, "phase": _LABEL,
        "segment": "exact", "step": "exact", "span": "exact", "micro": "exact",
        "presence": "exact: the row's state (spec 2.6); only observed rows carry numbers",
        **{n: _EXACT_COUNT for n in _COUNTS},
        "min": "exact: the least finite value; NaN where none or not observed",
        "max": "exact: the greatest finite value; NaN where none or not observed",
        "sum": "approximate: the stored sum rounded to float64 (SpineSeries.sum_exact has it exactly), which is "
               "the tensor's within the bound of method (spec 5.4: exact for method exact; no bound known for a "
               "newer writer's code-N); NaN where unknown or not observed",
        "sumsq": "approximate: the stored sum of squares rounded to float64, as sum",
        "method": "exact: how sum and sumsq relate to the tensor's (spec 5.4)",
        "mean": "approximate: derived, sum / finite values, rounded to float64 (within method's bound); NaN where "
                "undefined",
        "rms": "approximate: derived, sqrt(sumsq / finite values), rounded to float64 (within method's bound); "
               "NaN where undefined",
        "has_sketch": "exact",
        **{n: "exact: the rows in this state the row combines (spec 11.4)" for n in TALLY_COLUMNS},
    },
    "steps": {
        "segment": "exact", "step": "exact", "span": "exact",
        "applied": "exact: as recorded; <NA> unknown", "grad_basis": "exact: as recorded; <NA> unknown",
        "clipped": "exact: as recorded; <NA> unknown",
        "loss_scale": "exact: as recorded; NaN unknown", "clip_threshold": "exact: as recorded; NaN unknown",
        "micro_batches": "exact: as recorded; <NA> unknown", "tokens": "exact: as recorded; <NA> unknown",
        "samples": "exact: as recorded; <NA> unknown", "n_rows": "exact",
    },
    "scalars": {
        "name": _LABEL, "segment": "exact", "step": "exact", "span": "exact",
        "presence": "exact: the row's state (spec 2.6)",
        "value": "exact: the value as recorded where count is 1; NaN where missing (presence) or several",
        "count": _EXACT_COUNT,
        "mean": "approximate: derived from the row's sums, rounded to float64 (as spines' mean)",
        "min": "exact: the least finite value", "max": "exact: the greatest finite value",
    },
}


class _Notes(dict):
    """A table's :data:`COLUMN_NOTES` in ``df.attrs["columns"]``: a dict (JSON, Parquet's pandas metadata) that a
    copy leaves as it is. pandas deep-copies ``attrs`` into the result of every operation on a frame (a filter, a
    column, each group of a groupby), and copying some thirty texts each time made a loop over the sites of a frame
    twice as slow; the frames derived from one share its notes."""

    __slots__ = ()

    def __copy__(self) -> _Notes:
        return self

    def __deepcopy__(self, memo: dict) -> _Notes:
        return self


class Exported(NamedTuple):
    """One table written by :func:`to_parquet` or :func:`to_csv`."""

    table: str  #: spines, steps or scalars
    path: Path
    rows: int


def _pandas() -> Any:
    try:
        import pandas
    except ImportError as e:
        raise UsageError(f"data frames of a history need pandas: {_INSTALL} ({e})", code="needs_export") from None
    return pandas


def _parquet() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:
        raise UsageError(f"Parquet files need pyarrow: {_INSTALL} ({e})", code="needs_export") from None
    return pyarrow


def _compression(pa: Any, compression: object) -> str:
    """``compression`` as pyarrow takes it, or a :class:`UsageError` naming the choices (before anything is
    written: pyarrow would say so only once the output's folder exists)."""
    name = compression.lower() if isinstance(compression, str) else None
    if name not in _COMPRESSIONS:
        raise UsageError(f"compression {compression!r} is not one of {', '.join(_COMPRESSIONS)}", code="bad_argument")
    if name != "none" and not pa.Codec.is_available(name):
        raise UsageError(f"compression {name!r} is not available in this pyarrow build; choose another of "
                         f"{', '.join(_COMPRESSIONS)}", code="bad_argument")
    return name


def _history(h: object, fn: str) -> None:
    """Refuse anything but a :class:`History` as the first argument of ``fn`` (a path, None, a closed writer)."""
    if not isinstance(h, History):
        raise UsageError(f"frames.{fn}() takes an open History, not {type(h).__name__} {h!r:.60}: open the file "
                         f"first, e.g. `with trainhist.open(path) as h: frames.{fn}(h)`", code="bad_argument")


def _names(value: str | Iterable[str] | None, what: str) -> list[str] | None:
    """``value`` as a list of names (one string is one name, not its letters), or None for every name."""
    if value is None:
        return None
    if not isinstance(value, (str, Iterable)):
        raise UsageError(f"{what} must be a name (a string) or names (a list of strings), got "
                         f"{type(value).__name__} {value!r:.60}", code="bad_argument")
    names = [value] if isinstance(value, str) else list(value)
    bad = [v for v in names if not isinstance(v, str)]
    if bad:
        raise UsageError(f"{what} must be names (strings), got {bad[0]!r}", code="bad_argument")
    return names


def _sites(h: History, streams: str | Iterable[str] | None, sites: str | Iterable[str] | None, *,
           scalar_names: bool = False) -> list[Site]:
    """The sites of ``h`` in the ``streams`` whose path matches one of the ``sites`` patterns (fnmatch, case
    sensitive), in declaration order; a stream name that does not exist, or a pattern that matches none of those
    sites, is refused (a typo would give an empty frame). ``scalar_names``: the patterns are :func:`scalars`'
    ``names``, and the message says so."""
    stream_names = _names(streams, "streams")
    patterns = _names(sites, "names" if scalar_names else "sites")
    for s in stream_names or ():
        if s not in STREAMS:
            raise UsageError(f"stream {s!r} is not one of {', '.join(STREAMS)} (spec 2.2)", code="unknown_name")
    chosen = [s for s in h.sites if stream_names is None or s.stream in stream_names]
    if patterns is None:
        return chosen
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(s.path, p) for s in chosen)]
    if unmatched:
        paths = sorted({s.path for s in chosen})
        shown = ", ".join(paths[:8]) + (f" (+{len(paths) - 8} more)" if len(paths) > 8 else "")
        if scalar_names:
            raise UsageError(f"scalar name pattern {unmatched[0]!r} matches no scalar name in this file; its scalars: "
                             f"{shown or 'none'} (names are fnmatch patterns: 'loss', 'lr*'; case sensitive)",
                             code="no_match", path=h.path)
        raise UsageError(f"site pattern {unmatched[0]!r} matches no site path"
                         + (f" of the streams {', '.join(stream_names)}" if stream_names else "")
                         + f" in this file; its paths: {shown or 'none'} (patterns are fnmatch patterns on the path: "
                         "'encoder.*', '*.weight')", code="no_match", path=h.path)
    return [s for s in chosen if any(fnmatch.fnmatchcase(s.path, p) for p in patterns)]


def _categorical(pd: Any, codes: np.ndarray, names: Iterable[str]) -> Any:
    return pd.Categorical.from_codes(codes.astype(np.int64), categories=list(names))


def _masked(pd: Any, values: np.ndarray, missing: np.ndarray, dtype: type) -> Any:
    """A nullable integer array: ``values`` (exact, as ``dtype``), ``<NA>`` where ``missing``."""
    v = np.array(values, dtype=dtype)  # (a copy, exact: never through a float)
    v[missing] = 0
    return pd.arrays.IntegerArray(v, missing.astype(bool))


def spines(h: History, *, streams: str | Iterable[str] | None = None, sites: str | Iterable[str] | None = None,
           phases: str | Iterable[str] | None = None) -> "pd.DataFrame":
    """Every stored spine row of the chosen sites as one data frame (:data:`SPINE_COLUMNS`), sites in declaration
    order, each site's rows in file order (every phase, micro-batch and segment; scalar sites included).

    ``streams``: stream names (default all); ``sites``: fnmatch patterns on the site path (default all);
    ``phases``: phase names (default all). A row says nothing of the steps it does not cover: a step with no row
    is not in the frame (:meth:`History.presence` answers ``not_scheduled`` or ``unknown`` for it).

    Columns: ``path`` and ``facet`` (categoricals whose categories are the chosen sites' paths, and facets, in
    declaration order, each once: ``pivot`` and plots keep the model's order; facet ``NaN`` where the site has
    none); ``stream``, ``phase``, ``presence`` and ``method`` (categoricals of the spec's names); ``segment``,
    ``step`` (int64), ``span`` (uint32: the steps a coarsened row covers, 1 otherwise) and ``micro`` (uint32, as
    stored: ``4294967295`` = ``trainhist.model.MICRO_ALL`` is a row of the whole step, others one micro-batch);
    then the values:

    - ``count``, ``nan``, ``pinf``, ``ninf``, ``zero``: exact ``UInt64`` (no rounding beyond 2**53), ``<NA>`` in
      rows that are not ``observed``;
    - ``min``, ``max``: exact float64 (the least and greatest finite value); NaN where the row has no finite value
      or is not observed;
    - ``sum``, ``sumsq``: the stored sums rounded to float64 (±inf where the exact sum is beyond binary64:
      :meth:`SpineSeries.sum_exact` has it exactly); NaN in rows that are not observed or whose sums are unknown
      (``method`` ``unknown``, spec 5.4); 0.0 in an observed row without finite values (the sum of no value);
    - ``method``: the sum method's name (``exact``, ``f64_accumulate``, ``f32_accumulate``, ``unknown``, or
      ``code-N`` of a newer writer), ``<NA>`` in rows that are not observed (their method means nothing);
    - ``mean``, ``rms``: the reader's derived values (:attr:`SpineSeries.mean`), NaN where undefined (no finite
      value, unknown sums, not observed), never 0;
    - ``has_sketch``: whether the row carries a sketch (:meth:`History.sketch`);
    - ``n_unknown``, ``n_observed``, ``n_absent``, ``n_not_scheduled``, ``n_failed``, ``n_skipped``: the row's
      tally (spec 11.4, ``UInt64``): how many written rows in each state a merged or coarsened row combines (1 in
      its own state for a row as written), e.g. the skipped steps an observed window holds (``n_skipped``).

    In float64 columns NaN is pandas' missing value (``isna()``): none of them holds a NaN that is a value.
    """
    _history(h, "spines")
    _pandas()
    return _spines(h, _sites(h, streams, sites), phases)


def _spines(h: History, chosen: list[Site], phases: str | Iterable[str] | None) -> "pd.DataFrame":
    """:func:`spines` of the sites ``chosen``."""
    pd = _pandas()
    phase_names = _names(phases, "phases")
    phase_codes = None if phase_names is None else [Phase.code(p) for p in phase_names]
    parts: list[dict[str, np.ndarray]] = []
    for k, site in enumerate(chosen):
        s = h.spine(site.path, site.stream, site.facet, phase="*")
        keep = np.ones(len(s), bool) if phase_codes is None else np.isin(s.phase, phase_codes)
        observed = s.observed
        # (sums of an observed row whose method is unknown are no values, spec 5.4; the reader gives NaN there)
        sums = observed & (s.method != SumMethod.UNKNOWN)
        defined = sums & (s.finite > 0)
        part = {
            "site": np.full(len(s), k, np.int64), "phase": s.phase, "segment": s.segment, "step": s.step,
            "span": s.span, "micro": s.micro, "presence": s.presence, "method": s.method,
            "observed": observed, "has_sketch": s.sk_row >= 0,
            **{c: s.columns[c] for c in _COUNTS},
            "min": np.where(observed, s.min, np.nan), "max": np.where(observed, s.max, np.nan),
            "sum": np.where(sums, s.sum, np.nan), "sumsq": np.where(sums, s.sumsq, np.nan),
            "mean": np.where(defined, s.mean, np.nan), "rms": np.where(defined, s.rms, np.nan),
            **{n: s.columns[n] for n in TALLY_COLUMNS},
        }
        parts.append({n: v[keep] for n, v in part.items()})
    if parts:
        c = {n: np.concatenate([p[n] for p in parts]) for n in parts[0]}
    else:
        c = {n: np.zeros(0, t) for n, t in (("site", np.int64), ("phase", np.uint8), ("segment", np.uint32),
                                            ("step", np.int64), ("span", np.uint32), ("micro", np.uint32),
                                            ("presence", np.uint8), ("method", np.uint8), ("observed", bool),
                                            ("has_sketch", bool), *((x, np.uint64) for x in (*_COUNTS, *TALLY_COLUMNS)),
                                            *((x, np.float64) for x in _FLOATS))}
    # path and facet: categoricals whose categories are the chosen sites' names in declaration (site id) order,
    # each once: a pivot or a plot keeps the model's order, and a row costs a code, not a string
    paths = list(dict.fromkeys(s.path for s in chosen))
    facets = list(dict.fromkeys(s.facet for s in chosen if s.facet is not None))
    site_paths = np.array([paths.index(s.path) for s in chosen] or [-1], np.int64)
    site_facets = np.array([-1 if s.facet is None else facets.index(s.facet) for s in chosen] or [-1], np.int64)
    site_streams = np.array([STREAMS.index(s.stream) for s in chosen] or [0], np.int64)
    missing = ~c["observed"]
    method_names = dict(SumMethod.NAMES)
    for code in np.unique(c["method"][c["observed"]]).tolist():
        method_names.setdefault(code, f"code-{code}")  # (a newer writer's method: its bound is unknown, spec 5.4)
    method_cats = list(method_names.values())
    method_index = np.full(256, -1, np.int64)
    for j, code in enumerate(method_names):
        method_index[code] = j
    data = {
        "path": _categorical(pd, site_paths[c["site"]], paths),
        "stream": _categorical(pd, site_streams[c["site"]], STREAMS),
        "facet": _categorical(pd, site_facets[c["site"]], facets),
        "phase": _categorical(pd, c["phase"], Phase.NAMES),
        "segment": c["segment"].astype(np.int64),
        "step": c["step"].astype(np.int64),
        "span": c["span"].astype(np.uint32),
        "micro": c["micro"].astype(np.uint32),
        "presence": _categorical(pd, c["presence"], Presence.NAMES),
        **{n: _masked(pd, c[n], missing, np.uint64) for n in _COUNTS},
        "min": c["min"], "max": c["max"], "sum": c["sum"], "sumsq": c["sumsq"],
        "method": _categorical(pd, np.where(missing, -1, method_index[c["method"]]), method_cats),
        "mean": c["mean"], "rms": c["rms"],
        "has_sketch": c["has_sketch"].astype(bool),
        **{n: pd.array(c[n].astype(np.uint64), dtype="UInt64") for n in TALLY_COLUMNS},
    }
    df = pd.DataFrame(data, columns=list(SPINE_COLUMNS))
    df.attrs["columns"] = _Notes(COLUMN_NOTES["spines"])
    return df


def steps(h: History) -> "pd.DataFrame":
    """The step-truth table (spec 2.7), one row per stored row in file order: ``segment``, ``step`` (int64),
    ``span`` (uint32: the steps a coarsened row covers), ``applied`` / ``grad_basis`` / ``clipped`` (categoricals
    of their names; ``<NA>`` where unknown), ``loss_scale`` and ``clip_threshold`` (float64, NaN where unknown),
    ``micro_batches`` (``UInt32``), ``tokens`` and ``samples`` (``UInt64``), ``<NA>`` where unknown: an unknown
    value is never 0; ``n_rows`` (uint64): the writers' rows a merged or coarsened row combines (spec 11.6), so a
    merged step whose ``n_rows`` is below its segment's writer count holds some writers' tokens only."""
    _history(h, "steps")
    pd = _pandas()
    t = h.steps

    def state(name: str, enum: type) -> Any:  # (code 0 is unknown: NA, the others their names)
        return _categorical(pd, t[name].astype(np.int64) - 1, enum.NAMES[1:])  # type: ignore[attr-defined]

    df = pd.DataFrame({
        "segment": t["segment"].astype(np.int64), "step": t["step"].astype(np.int64),
        "span": t["span"].astype(np.uint32),
        "applied": state("applied", Applied), "grad_basis": state("grad_basis", GradBasis),
        "clipped": state("clipped", Clipped),
        "loss_scale": t["loss_scale"].astype(np.float64), "clip_threshold": t["clip_threshold"].astype(np.float64),
        "micro_batches": _masked(pd, t["micro_batches"], t["micro_batches"] == 0, np.uint32),
        "tokens": _masked(pd, t["tokens"], t["tokens"] == U64_UNKNOWN, np.uint64),
        "samples": _masked(pd, t["samples"], t["samples"] == U64_UNKNOWN, np.uint64),
        "n_rows": t["n_rows"].astype(np.uint64),
    })
    df.attrs["columns"] = _Notes(COLUMN_NOTES["steps"])
    return df


def _scalar_view(pd: Any, sp: "pd.DataFrame", chosen: list[Site]) -> "pd.DataFrame":
    """The scalar sites' rows of a :func:`spines` frame of the sites ``chosen``, as :func:`scalars` gives them (the
    categories of ``name``: the scalar sites' paths, in declaration order)."""
    sp = sp[sp["stream"] == "scalar"]
    names = list(dict.fromkeys(s.path for s in chosen if s.stream == "scalar"))
    one = (sp["presence"] == "observed").to_numpy() & (sp["count"] == 1).fillna(False).to_numpy(bool)
    nan, pinf, ninf = ((sp[n] == 1).fillna(False).to_numpy(bool) for n in ("nan", "pinf", "ninf"))
    value = np.where(one, sp["min"].to_numpy(np.float64), np.nan)
    value = np.where(one & pinf, math.inf, np.where(one & ninf, -math.inf, np.where(one & nan, np.nan, value)))
    df = pd.DataFrame({
        "name": sp["path"].cat.set_categories(names).array, "segment": sp["segment"].to_numpy(),
        "step": sp["step"].to_numpy(),
        "span": sp["span"].to_numpy(), "presence": sp["presence"].array, "value": value,
        "count": sp["count"].array, "mean": sp["mean"].to_numpy(), "min": sp["min"].to_numpy(),
        "max": sp["max"].to_numpy(),
    })
    df.attrs["columns"] = _Notes(COLUMN_NOTES["scalars"])
    return df


def scalars(h: History, *, names: str | Iterable[str] | None = None) -> "pd.DataFrame":
    """The run-level scalars (``HistoryWriter.scalar``: loss, learning rate, gradient norm), one row per stored row
    of a scalar site: ``name`` (a categorical of the chosen scalars' names in declaration order, as ``path`` in
    :func:`spines`), ``segment``, ``step``, ``span``, ``presence``, ``value``, ``count``, ``mean``, ``min``,
    ``max``. ``names``: fnmatch patterns (default all).

    ``value`` is the scalar where the row holds one value (``count`` 1: as recorded, NaN and ±inf included); NaN
    where it holds none (``presence`` not ``observed``) or several (a merged or coarsened row: ``count``, ``mean``,
    ``min`` and ``max`` describe them). A recorded NaN and a missing value are told apart by ``presence``. The same
    rows are in :func:`spines` (stream ``scalar``) with every spine column."""
    _history(h, "scalars")
    pd = _pandas()
    chosen = _sites(h, "scalar", names, scalar_names=True)
    return _scalar_view(pd, _spines(h, chosen, None), chosen)


def quantiles(h: History, path: str, stream: str = "activation", facet: str | None = None, *,
              q: Iterable[float] = (0.05, 0.5, 0.95), phase: str | None = None) -> "pd.DataFrame":
    """APPROXIMATE quantiles of one site, derived from its sketches (one row per sketched row): ``phase`` (a
    categorical, as in :func:`spines`), ``segment``, ``step``, ``span``, ``micro``, then ``approx_q<q>`` per asked
    quantile (``approx_q0.05``, ...), ``rel_bound``, ``sketch_share`` and ``zeros_estimated``.

    Which quantile: the lower one, of the inverted CDF, with no interpolation. Of the row's ``n`` finite values
    (zeros included; NaN and ±inf are not values here: :func:`spines` counts them in ``nan``, ``pinf``, ``ninf``),
    ``approx_q<q>`` stands for the value ``x`` of rank ``max(1, ceil(q * n))`` in ascending order (``q * n`` in
    float64, never above ``n``; the sketch's counts are added exactly), which is
    ``numpy.quantile(x[numpy.isfinite(x)], q, method="inverted_cdf")``: ``q = 0`` is the least finite value, ``q = 1``
    the greatest (the exact ones are ``min`` and ``max`` in :func:`spines`). numpy's and
    pandas' default quantile (``linear``) interpolates between two values instead: of [1, 100] at ``q = 0.5`` it is
    50.5, in neither value's bin; this one is 1 (given as 0.917, its bin's middle).

    The answer is the geometric middle of the sketch bin that holds ``x`` (0 for a zero;
    :func:`trainhist.figures.quantiles_from_sketch`, as the site figure draws them). ``rel_bound`` bounds its
    error relative to ``x``, ``|approx - x| <= rel_bound * |x|``: one bin width, ``2**(1/bins_per_octave) - 1``
    (0.189 at 4 bins per octave). NaN where the row holds no finite value, or where ``x`` is in an under- or
    overflow band (magnitudes outside the grid's window (2**-48, 2**16]: no bin places it). ``sketch_share``: the
    share of the row's non-zero finite values its sketch holds, 1.0 but where the sketch covers only part of the
    row (a coarsened window with sketches at a sparser cadence; a merged row whose inputs did not all have one,
    spec 11.2). The quantiles of such a row are those of the values its sketch holds, a sample of the row's: no
    bound holds for the row's own quantiles, so ``rel_bound`` is NaN there. ``zeros_estimated``: such a row's
    zeros among the sketched values are estimated in proportion, rounded to a whole count
    (``sketch_share < 1``).

    ``q``: quantiles in [0, 1]; ``phase`` as :meth:`History.spine` (``"*"``: the rows of every phase, in file order,
    told apart by the ``phase`` column)."""
    _history(h, "quantiles")
    pd = _pandas()
    from .figures import _sketch_coverage, quantile_bound, sketch_row_quantiles

    qs = tuple(q) if isinstance(q, Iterable) and not isinstance(q, (str, bytes)) else ()
    if not qs or any(isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer))
                     or not 0 <= x <= 1 for x in qs):
        raise UsageError(f"q must be quantiles in [0, 1], got {q!r}", code="bad_argument")
    names = [f"approx_q{float(x):g}" for x in qs]
    if len(set(names)) != len(names):
        raise UsageError(f"q names a quantile twice: {list(qs)}", code="bad_argument")
    s = h.spine(path, stream, facet, phase=phase)
    sk = h.sketch(path, stream, facet, phase=phase)
    at, values, partial = sketch_row_quantiles(s, sk, qs)
    covered, nonzero = _sketch_coverage(s, sk, at)
    df = pd.DataFrame({
        "phase": _categorical(pd, s.phase[at], Phase.NAMES),  # (as in spines: phase="*" gives every phase's rows)
        "segment": s.segment[at].astype(np.int64), "step": s.step[at].astype(np.int64),
        "span": s.span[at].astype(np.uint32), "micro": s.micro[at].astype(np.uint32),
        **{n: values[:, j] for j, n in enumerate(names)},
        "rel_bound": np.where(partial, np.nan, quantile_bound(sk.scale)),
        "sketch_share": np.where(partial, covered / np.maximum(nonzero, 1.0), 1.0),
        "zeros_estimated": partial.astype(bool),
    })
    df.attrs["approximate"] = (f"quantiles derived from the sketch at {2**sk.scale} bins per octave: each within "
                               f"{quantile_bound(sk.scale):.4f} relative of the true one (rel_bound), except in "
                               f"{int(partial.sum())} of {len(at)} rows whose sketch holds only part of the row's "
                               "values (sketch_share < 1): no bound, rel_bound NaN")
    return df


def _manifests(h: History, selection: dict) -> dict[str, str]:
    """The file's manifests and the export's selection, as JSON texts under ``trainhist.*`` keys."""
    def js(x: object) -> str:
        return json.dumps(x, sort_keys=True, default=str)

    r = h.recovery
    return {
        "trainhist.version": __version__, "trainhist.source": js(h.path),
        "trainhist.recovery": js({"status": r.status, "committed_bytes": r.committed_bytes,
                                  "dropped_bytes": r.dropped_bytes, "reason": r.reason}),
        "trainhist.runs": js(h.runs), "trainhist.writers": js(h.writers),
        "trainhist.segments": js([g.manifest for g in h.segments]), "trainhist.settings": js(h.settings),
        "trainhist.sites": js([s.manifest for s in h.sites]), "trainhist.selection": js(selection),
        "trainhist.columns": js(COLUMN_NOTES),
    }


def _selection(streams: str | Iterable[str] | None, sites: str | Iterable[str] | None,
               phases: str | Iterable[str] | None) -> dict[str, list[str] | None]:
    """The export's selection as lists (or None for all), each argument read once: a generator given as
    ``sites=`` is used up by the first reading, and the tables and the recorded selection must see the same
    names."""
    return {"streams": _names(streams, "streams"), "sites": _names(sites, "sites"), "phases": _names(phases, "phases")}


def _tables(h: History, streams: list[str] | None, sites: list[str] | None,
            phases: list[str] | None) -> dict[str, "pd.DataFrame"]:
    pd = _pandas()
    chosen = _sites(h, streams, sites)
    sp = _spines(h, chosen, phases)
    return {"spines": sp, "steps": steps(h), "scalars": _scalar_view(pd, sp, chosen)}


_TABLES = ("spines", "steps", "scalars")  #: the tables a directory gets, in this order


def _check_file(target: Path, h: History) -> None:
    """merge's check of an output file (:func:`trainhist.merge._check_output`: its folder exists, it is no
    directory, device or pipe, it is not the history read), with what to do when the folder is missing."""
    from .merge import _check_output

    try:
        _check_output(str(target), [h.path])
    except UsageError as e:
        if e.code == "bad_output" and not target.absolute().parent.is_dir():
            raise UsageError(f"{e.message}: create it first, or write elsewhere (export creates no parent folder; "
                             "only a directory OUT itself, when missing)", code=e.code, path=e.path) from None
        raise


def _targets(out: str | os.PathLike, ext: str, h: History) -> tuple[Path | None, Path | None]:
    """(single file, directory), checked before anything is written: a path ending in ``ext`` is one file of the
    spines; one ending in a path separator, or without a suffix, or naming an existing directory (not one ending in
    ``.parquet`` or ``.csv``) is a directory (created if missing; its parent folder must exist); any other suffix
    is refused (``run.pq``: a file name, but no format's)."""
    text = os.fspath(out) if isinstance(out, (str, bytes, os.PathLike)) else out
    if not isinstance(text, str) or not text:
        raise UsageError(f"output {text!r} is not a path: name a directory for the tables, or a file ending in {ext} "
                         "for the spines alone", code="bad_output")
    p = Path(text)
    other = {".parquet": ".csv", ".csv": ".parquet"}[ext]
    suffix = "" if text.endswith(("/", os.sep)) else p.suffix.lower()  # (ending in /: a directory, whatever its name)
    if suffix == other:  # (a typo of the format, not a directory's name)
        raise UsageError(f"{p} ends in {other}, but the tables are written as {ext[1:]}: name a {ext} file or a "
                         "directory, or choose the other format", code="bad_output")
    if suffix == ext:
        if p.is_dir():
            raise UsageError(f"{p} is a directory: name a new {ext} file, or end the path with / to write the tables "
                             "into that directory", code="bad_output")
        _check_file(p, h)
        return p, None
    if suffix and not p.is_dir():
        raise UsageError(f"{p} ends in {p.suffix}, which is neither {ext} (the spines alone) nor a directory: name "
                         f"a {ext} file, or a directory (end the path with / for a new directory whose name has a "
                         "dot)", code="bad_output")
    if p.exists() and not p.is_dir():
        raise UsageError(f"{p} is a file: pass a directory (created if needed) for the tables, or a path ending in "
                         f"{ext} for the spines alone", code="bad_output")
    if p.is_dir():  # (each file it gets: no directory, device or pipe of that name, not the history read)
        for name in _TABLES + (("manifests.json",) if ext == ".csv" else ()):
            _check_file(p / (name if name.endswith(".json") else f"{name}{ext}"), h)
    else:
        _check_file(p, h)  # (its folder exists)
    return None, p


def _unwritable(e: OSError, path: Path, directory: bool = False) -> TrainhistError:
    """``e``, raised while writing the file ``path`` (or its temporary file beside it) or creating the
    ``directory`` ``path``, in the output's terms: the temporary file's name is an implementation detail the user
    never named."""
    reason = os.strerror(e.errno) if isinstance(e.errno, int) and e.errno else (e.strerror or type(e).__name__)
    parent = path.absolute().parent
    if e.errno == errno.ENOENT and parent.is_dir():
        reason += f" (the folder {parent} exists but takes no new files, as a virtual file system such as /proc does)"
    what = ("cannot create the output directory" if directory else "cannot write the output (each file is written "
            "beside its name, then renamed over it; nothing was left there)")
    return TrainhistError(f"{what}: {reason}. Write to a folder with room that you may write to",
                          code="output_unwritable", path=str(path))


def _jobs(single: Path | None, folder: Path | None, tables: dict, ext: str) -> list[tuple[str, Path]]:
    """(table name, file) of each table to write (:func:`_targets`' answer); a missing folder is created (its
    parent exists: :func:`_targets` checked it)."""
    if single is not None:
        return [("spines", single)]
    assert folder is not None
    try:
        folder.mkdir(exist_ok=True)
    except OSError as e:
        raise _unwritable(e, folder, directory=True) from None
    return [(name, folder / f"{name}{ext}") for name in tables]


def _replace(path: Path, write: Any) -> None:
    """``write(tmp)`` a temporary file beside ``path``, then rename it over ``path``: a reader of ``path`` sees the
    old file or the whole new one, never a part; the temporary file is removed if writing fails, and an error of
    the file system names ``path`` (``output_unwritable``), never the temporary file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise _unwritable(e, path) from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # (it was never created where nothing may be created)


def _text_dictionaries(pa: Any, table: Any) -> Any:
    """``table`` with each dictionary column of no values (a categorical without categories: every value missing,
    as ``facet`` where no site has one) typed as a dictionary of strings, which Parquet stores and pandas reads
    back as a categorical (a dictionary of nulls is stored as a null column, read back as ``object``). Every
    categorical of the frames holds text."""
    for i, field in enumerate(table.schema):
        if pa.types.is_dictionary(field.type) and pa.types.is_null(field.type.value_type):
            text = pa.dictionary(field.type.index_type, pa.string(), field.type.ordered)
            table = table.set_column(i, field.with_type(text), table.column(i).cast(text))
    return table


def to_parquet(h: History, out: str | os.PathLike, *, streams: str | Iterable[str] | None = None,
               sites: str | Iterable[str] | None = None, phases: str | Iterable[str] | None = None,
               compression: str = "zstd") -> list[Exported]:
    """Write the history as Parquet: a directory ``out`` gets ``spines.parquet``, ``steps.parquet`` and
    ``scalars.parquet`` (:func:`spines`, :func:`steps`, :func:`scalars`; the scalars of the chosen streams and
    sites); a path ending in ``.parquet`` gets the spines alone.

    ``out`` is a directory when it has no suffix, ends in ``/`` (whatever its name) or names an existing
    directory; it is created when missing, but no folder above it is: the folder that holds ``out`` (a directory
    or a file) must exist. Another suffix (``run.pq``, ``x.csv``), an empty path, a missing folder above ``out``,
    an existing directory named ``x.parquet`` (write ``x.parquet/`` to fill it), a file named as a directory, or an
    output file that is a directory, device or pipe or the history itself are refused before anything is written
    (:class:`UsageError` ``bad_output`` or ``output_is_input``, merge's check of its output); a file that cannot be
    written (a read-only folder, a full disk, /proc) raises :class:`TrainhistError` ``output_unwritable`` on its
    path. Each file is written beside its name, then renamed over it.

    Every file carries the history's manifests as key-value metadata (``trainhist.runs``, ``trainhist.writers``,
    ``trainhist.segments``, ``trainhist.settings``, ``trainhist.sites``, ``trainhist.recovery``,
    ``trainhist.source``, ``trainhist.selection``: JSON; ``trainhist.table``, ``trainhist.version``: plain text;
    the module's documentation says what each holds), and reads back with ``pandas.read_parquet`` as the frame it
    was written from (dtypes, NA and categories included; an empty table's categoricals come back without
    categories: Parquet keeps no dictionary without rows).
    ``compression``: ``zstd`` (default), ``snappy``, ``gzip``, ``brotli``,
    ``lz4`` or ``none``; another is refused (``bad_argument``) before anything is written."""
    _history(h, "to_parquet")
    pa = _parquet()
    import pyarrow.parquet as pq

    compression = _compression(pa, compression)
    selection = _selection(streams, sites, phases)  # (lists: a generator is read once, here)
    single, folder = _targets(out, ".parquet", h)
    tables = _tables(h, **selection)
    meta = _manifests(h, selection)
    jobs = _jobs(single, folder, tables, ".parquet")
    written = []
    for name, path in jobs:
        df = tables[name]
        table = _text_dictionaries(pa, pa.Table.from_pandas(df, preserve_index=False))
        extra = {k.encode(): v.encode() for k, v in {**meta, "trainhist.table": name}.items()}
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **extra})
        _replace(path, lambda tmp: pq.write_table(table, tmp, compression=compression))
        written.append(Exported(name, path, len(df)))
    return written


def to_csv(h: History, out: str | os.PathLike, *, streams: str | Iterable[str] | None = None,
           sites: str | Iterable[str] | None = None, phases: str | Iterable[str] | None = None) -> list[Exported]:
    """Write the history as CSV: a directory ``out`` gets ``spines.csv``, ``steps.csv``, ``scalars.csv`` and
    ``manifests.json`` (the metadata :func:`to_parquet` stores in its files); a path ending in ``.csv`` gets the
    spines alone; ``out`` as :func:`to_parquet` takes it (a directory is created when missing, never a folder above
    it). Each file is written beside its name, then renamed over it. A missing value is an empty field (never 0);
    floats are written in their shortest round-trip form and counts as exact integers. CSV keeps no dtypes: read
    the spines back with ``dtype={"count": "UInt64", ...}`` to keep counts beyond 2**53 exact."""
    _history(h, "to_csv")
    _pandas()
    selection = _selection(streams, sites, phases)  # (lists: a generator is read once, here)
    single, folder = _targets(out, ".csv", h)
    tables = _tables(h, **selection)
    jobs = _jobs(single, folder, tables, ".csv")
    written = []
    for name, path in jobs:
        _replace(path, lambda tmp: tables[name].to_csv(tmp, index=False))
        written.append(Exported(name, path, len(tables[name])))
    if folder is not None:
        meta = _manifests(h, selection)
        doc = {k: (v if k == "trainhist.version" else json.loads(v)) for k, v in meta.items()}
        path = folder / "manifests.json"
        _replace(path, lambda tmp: tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n"))
        written.append(Exported("manifests", path, 0))
    return written
