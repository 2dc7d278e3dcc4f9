"""trainhist: the distribution history of a training run, as a crash-readable, exactly mergeable file.

The core (this package, minus :mod:`trainhist.torch`) needs only numpy, msgpack, crc32c and jsonschema.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    CorruptError,
    DirectoryError,
    FormatError,
    LimitError,
    MergeError,
    NotAFileError,
    NotFoundError,
    PermissionDeniedError,
    ReadOnlyError,
    SchemaError,
    TrainhistError,
    UnsupportedError,
    UsageError,
)
from .reader import History, open_history  # noqa: E402
from .summary import Sketch, Summary, SumMethod, summarize  # noqa: E402
from .writer import HistoryWriter, SiteHandle  # noqa: E402
from .merge import MergeReport, canonicalize, merge  # noqa: E402
from .coarsen import coarsen  # noqa: E402

open = open_history  # noqa: A001  -- trainhist.open(path), like the builtin but for histories

__all__ = [
    "__version__",
    "open",
    "open_history",
    "History",
    "HistoryWriter",
    "SiteHandle",
    "Summary",
    "Sketch",
    "SumMethod",
    "summarize",
    "merge",
    "coarsen",
    "canonicalize",
    "MergeReport",
    "TrainhistError",
    "FormatError",
    "CorruptError",
    "UnsupportedError",
    "LimitError",
    "SchemaError",
    "MergeError",
    "UsageError",
    "ReadOnlyError",
    "NotFoundError",
    "NotAFileError",
    "DirectoryError",
    "PermissionDeniedError",
]
