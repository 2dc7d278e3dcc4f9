"""The data model's enumerations and column registries (spec section 2, 5, 7): names and their stored codes."""

from __future__ import annotations

import math

import numpy as np

from .errors import UsageError

__all__ = [
    "CANONICAL_NAN",
    "CANONICAL_NAN_BITS",
    "STREAMS",
    "SHARING",
    "Presence",
    "Phase",
    "Applied",
    "GradBasis",
    "Clipped",
    "MICRO_ALL",
    "U64_UNKNOWN",
    "OBS_COLUMNS",
    "SKETCH_COLUMNS",
    "EXACT_COLUMNS",
    "STEPS_COLUMNS",
    "TALLY_COLUMNS",
    "STEPS_OPTIONAL_COLUMNS",
    "PRIORITY",
    "derive_presence",
    "legacy_skipped",
    "tally_disagrees",
    "row_problem",
    "sketch_problem",
    "unknown_steps_code",
]

STREAMS = ("activation", "activation_grad", "param", "param_grad", "param_delta", "scalar")
SHARING = ("shard", "replica")

CANONICAL_NAN_BITS = 0x7FF8000000000000  #: the one NaN a file stores (spec 1): "no finite value", "unknown"
CANONICAL_NAN = float(np.frombuffer(np.uint64(CANONICAL_NAN_BITS).tobytes(), "<f8")[0])
MICRO_ALL = 0xFFFFFFFF  #: micro column value meaning "the whole step" (all micro-batches combined)
U64_UNKNOWN = 0xFFFFFFFFFFFFFFFF  #: unsigned count meaning "unknown" in the steps table


class _Enum:
    """A closed set of names with stable one-byte codes."""

    NAMES: tuple[str, ...] = ()
    WHAT = "name"  #: what a name of the set names, for messages (the argument or field it is given as)
    SPEC = ""  #: the section of spec/format.md that defines the set

    @classmethod
    def code(cls, name: str) -> int:
        try:
            return cls.NAMES.index(name)
        except ValueError:
            raise UsageError(f"{cls.WHAT} {name!r} is not one of {', '.join(cls.NAMES)} (the {cls.WHAT} names of "
                             f"spec {cls.SPEC})", code="unknown_name") from None

    @classmethod
    def name(cls, code: int) -> str:
        return cls.NAMES[code]


class Presence(_Enum):
    """What a row says about a (site, step): only ``observed`` rows carry numbers (spec 2.6)."""

    WHAT, SPEC = "presence", "2.6"
    NAMES = ("unknown", "observed", "absent", "not_scheduled", "failed", "skipped")
    UNKNOWN, OBSERVED, ABSENT, NOT_SCHEDULED, FAILED, SKIPPED = range(6)


class Phase(_Enum):
    """Where in the step an observation was taken (spec 2.5)."""

    WHAT, SPEC = "phase", "2.5"
    NAMES = ("default", "pre_clip", "post_clip")


class Applied(_Enum):
    """Whether the optimizer step was applied."""

    WHAT, SPEC = "applied", "2.7"
    NAMES = ("unknown", "applied", "skipped")


class GradBasis(_Enum):
    """Whether gradients were observed multiplied by the loss scale."""

    WHAT, SPEC = "grad_basis", "2.7"
    NAMES = ("unknown", "unscaled", "scaled")


class Clipped(_Enum):
    """Whether gradient clipping changed the gradients."""

    WHAT, SPEC = "clipped", "2.7"
    NAMES = ("unknown", "clipped", "not_clipped")


# name -> dtype code; the order is the canonical column order of an obs chunk.
OBS_COLUMNS = {
    "step": "i8",
    "span": "u4",
    "micro": "u4",
    "phase": "u1",
    "presence": "u1",
    "method": "u1",
    "count": "u8",
    "nan": "u8",
    "pinf": "u8",
    "ninf": "u8",
    "zero": "u8",
    "min": "f8",
    "max": "f8",
    "sum": "f8",
    "sumsq": "f8",
}
EXACT_COLUMNS = {"sum_xn": "u4", "sum_x": "bytes", "sumsq_xn": "u4", "sumsq_x": "bytes"}
SKETCH_COLUMNS = {
    "sk": "u1",
    "sk_plo": "u2",
    "sk_pn": "u2",
    "sk_nlo": "u2",
    "sk_nn": "u2",
    "sk_up": "u8",
    "sk_un": "u8",
    "sk_op": "u8",
    "sk_on": "u8",
    "sk_counts": "u8",
}
STEPS_COLUMNS = {
    "step": "i8",
    "applied": "u1",
    "grad_basis": "u1",
    "clipped": "u1",
    "loss_scale": "f8",
    "clip_threshold": "f8",
    "micro_batches": "u4",
    "tokens": "u8",
    "samples": "u8",
}
# Optional obs columns of derived (merged or coarsened) files, spec section 11: per row, how many leaf rows in
# each presence state were combined into it, indexed like Presence.NAMES. A chunk without them means one leaf row
# per row, in the row's own presence state.
TALLY_COLUMNS = {f"n_{name}": "u8" for name in Presence.NAMES}
# Optional steps column of coarsened files: the number of steps the row covers (absent: 1).
STEPS_OPTIONAL_COLUMNS = {"span": "u4", "n_rows": "u8"}


#: Presence precedence when rows combine (spec 2.6, 11.4): the state of highest precedence with a non-zero tally
#: wins. Indexed by presence code: unknown, observed, absent, not_scheduled, failed, skipped.
PRIORITY = (4, 3, 1, 0, 5, 2)  # failed > unknown > observed > skipped > absent > not_scheduled
_BY_PRIORITY = sorted(range(len(PRIORITY)), key=lambda c: -PRIORITY[c])


def tally_disagrees(tally: np.ndarray, presence: np.ndarray) -> np.ndarray:
    """Rows whose ``presence`` is not the one their tally implies (spec 11.4, ``bad_tally``), save rows derived
    under the precedence before 2026-11-30, which ranked ``skipped`` above ``observed``: ``skipped`` with observed
    and skipped inputs and neither failed nor unknown ones (:func:`legacy_skipped`), which read as written."""
    return (derive_presence(tally) != presence) & ~legacy_skipped(tally, presence)


def legacy_skipped(tally: np.ndarray, presence: np.ndarray) -> np.ndarray:
    """Rows derived under the old precedence that hold ``skipped`` where the tally now implies ``observed``: they
    carry no numbers for their observed inputs, so no merge or coarsening can combine them (spec 11.4)."""
    return ((presence == Presence.SKIPPED) & (tally[:, Presence.OBSERVED] > 0) & (tally[:, Presence.SKIPPED] > 0)
            & (tally[:, Presence.FAILED] == 0) & (tally[:, Presence.UNKNOWN] == 0))


def derive_presence(tally: np.ndarray) -> np.ndarray:
    """Presence code of each row of a ``(rows, 6)`` tally: the non-zero state of highest precedence."""
    out = np.full(tally.shape[0], 255, np.uint8)
    for code in reversed(_BY_PRIORITY):  # lowest precedence first; higher ones overwrite
        out[tally[:, code] > 0] = code
    return out


def extremes_ok(mn: np.ndarray, mx: np.ndarray) -> np.ndarray:
    """Per row, whether ``mn`` and ``mx`` are finite with ``mn <= mx`` in IEEE total order (-0.0 before +0.0): spec
    5.5's rule for the extremes of a row with finite values."""
    with np.errstate(invalid="ignore"):  # (NaN compares false: not ordered)
        ordered = (mn < mx) | ((mn == mx) & ~(~np.signbit(mn) & np.signbit(mx)))
    return np.isfinite(mn) & np.isfinite(mx) & ordered


def extreme_pair_ok(mn: float, mx: float) -> bool:
    """:func:`extremes_ok` of one row, in plain Python (numpy's per-call cost on one row is many times the test)."""
    return (math.isfinite(mn) and math.isfinite(mx)
            and (mn < mx or (mn == mx and not math.copysign(1, mn) > 0 > math.copysign(1, mx))))


def row_problem(cols: dict[str, np.ndarray]) -> tuple[int, str] | None:
    """The first row (index, and the message of spec 5.5's rule it breaks, with ``{row}`` for its place) of obs
    columns ``cols`` (with ``sk`` when the rows may have sketches) that no tensor could have given, or None."""
    count, presence = cols["count"].astype(np.uint64), cols["presence"]
    rest, over = count.copy(), np.zeros(count.size, bool)
    for name in ("nan", "pinf", "ninf", "zero"):  # (step by step: a sum of u64 could wrap)
        k = cols[name].astype(np.uint64)
        over |= k > rest
        rest = np.where(k > rest, np.uint64(0), rest - np.minimum(k, rest))
    observed = presence == Presence.OBSERVED
    finite = np.where(over, np.uint64(0), count - np.minimum(count, cols["nan"].astype(np.uint64)
                                                             + cols["pinf"].astype(np.uint64)
                                                             + cols["ninf"].astype(np.uint64)))
    mn, mx = cols["min"], cols["max"]
    extremes = extremes_ok(mn, mx)
    with np.errstate(invalid="ignore"):
        numbers = ((count != 0) | (cols["nan"] != 0) | (cols["pinf"] != 0) | (cols["ninf"] != 0)
                   | (cols["zero"] != 0) | (cols["sum"] != 0) | (cols["sumsq"] != 0) | ~np.isnan(mn) | ~np.isnan(mx))
    if "sk" in cols:
        numbers |= cols["sk"] != 0
    rules = (
        (over, "row {row}: nan + pinf + ninf + zero exceed count"),
        (observed & ~over & (finite > 0) & ~extremes,
         "row {row}: an observed row with finite values needs finite min <= max"),
        (observed & ~over & (finite == 0)
         & ~(np.isnan(mn) & np.isnan(mx) & (cols["sum"] == 0) & (cols["sumsq"] == 0)),
         "row {row}: an observed row without finite values has NaN min and max and zero sums"),
        (~observed & numbers, "row {row}: a row that is not observed carries numbers or a sketch"),
    )
    first = None
    for mask, msg in rules:
        hit = np.flatnonzero(mask)
        if hit.size and (first is None or hit[0] < first[0]):
            first = (int(hit[0]), msg)
    return first


def sketch_problem(scale: object, sk: dict[str, np.ndarray], declared: int) -> tuple[str, str] | None:
    """The first way one chunk's sketch columns break spec 7.5 (message, error code), or None: its ``scale`` must
    be 0, 1 or 2; ``sk`` 0 or 1; a row without a sketch stores no bins; every stored range lies inside the scale's
    bins; and the ranges use exactly the ``declared`` values of ``sk_counts`` (checked before that column is
    decoded: a lying directory costs no allocation). ``sk``: the chunk's sketch columns but ``sk_counts``."""
    from .grid import nbins

    if not isinstance(scale, int) or isinstance(scale, bool) or scale not in (0, 1, 2):
        return f"chunk with sketches declares scale {scale!r}; expected 0, 1 or 2", "bad_scale"
    if (sk["sk"] > 1).any():
        return "sk column holds values other than 0 and 1", "bad_sketch"
    has = sk["sk"] == 1
    if (~has & ((sk["sk_pn"] > 0) | (sk["sk_nn"] > 0))).any():
        return "a row without a sketch declares sketch bins", "bad_sketch"
    nb = nbins(scale)
    pn, nn = sk["sk_pn"][has].astype(np.int64), sk["sk_nn"][has].astype(np.int64)
    if (sk["sk_plo"][has].astype(np.int64) + pn > nb).any() or (sk["sk_nlo"][has].astype(np.int64) + nn > nb).any():
        return f"a sketch range exceeds the {nb} bins of scale {scale}", "bad_sketch"
    used = int(pn.sum() + nn.sum())
    if used != declared:
        return f"the sketch ranges use {used} values, sk_counts declares {declared}", "bad_sketch"
    return None


def unknown_steps_code(cols: dict[str, np.ndarray]) -> str | None:
    """The first step-truth column (applied, grad_basis, clipped) holding a code this reader does not know."""
    for name, enum in (("applied", Applied), ("grad_basis", GradBasis), ("clipped", Clipped)):
        if (cols[name] >= len(enum.NAMES)).any():
            return name
    return None
