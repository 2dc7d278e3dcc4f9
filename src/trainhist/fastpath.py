"""Whether merge uses its optional compiled kernels (:mod:`trainhist.mergekernel`, which needs numba).

Merge's per-count loops (decoding integer columns and exact values, the sparse sketch union and scatter-add,
exact group sums) have two implementations that give the same bytes: whole-array numpy code, always present, and
numba kernels, used when numba is installed (``pip install trainhist[fast]``) unless the environment sets
``TRAINHIST_NO_NUMBA=1`` or :data:`ENABLED` is set to False (the tests compare the two). numba is imported on the
first merge that needs it (in each worker process), not with ``trainhist``.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["ENABLED", "kernels"]

#: False: always the numpy code (``TRAINHIST_NO_NUMBA`` set to 1, true, yes or on when imported)
ENABLED: bool = os.environ.get("TRAINHIST_NO_NUMBA", "").strip().lower() not in ("1", "true", "yes", "on")
_loaded: ModuleType | None = None
_tried = False


def kernels() -> ModuleType | None:
    """:mod:`trainhist.mergekernel` when :data:`ENABLED` and numba imports, else None (the numpy code serves)."""
    global _loaded, _tried
    if not ENABLED:
        return None
    if not _tried:
        _tried = True
        try:
            from . import mergekernel
        except ImportError:  # numba missing, or not yet released for this Python
            mergekernel = None  # type: ignore[assignment]
        _loaded = mergekernel
    return _loaded
