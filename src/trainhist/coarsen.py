"""``trainhist.coarsen``: fewer steps and fewer bins, exactly (spec section 11.7).

Steps: rows fall into aligned windows ``[k*N, (k+1)*N)``; each window's rows with the same micro-batch and phase
add into one row at ``step = k*N`` with ``span = N``. Bins: sketches at a finer scale than ``bins_per_octave``
asks halve their resolution (bin ``i`` -> ``i >> 1``) until they reach it; the window ``(2**-48, 2**16]`` maps
onto itself, so under- and overflow counts are unchanged. Both are absolute targets, so coarsening composes:
``coarsen(coarsen(x, steps=2), steps=6) == coarsen(x, steps=6)``, byte for byte.
"""

from __future__ import annotations

import os

from .errors import UsageError
from .merge import MergeReport, _Engine

__all__ = ["coarsen", "BINS_PER_OCTAVE"]

BINS_PER_OCTAVE = {4: 2, 2: 1, 1: 0}  #: bins per octave -> sketch scale


def coarsen(input: str | os.PathLike, output: str | os.PathLike, *, steps: int = 1, bins_per_octave: int = 4,
            replica_divergence: str = "error", codec: str = "packed", workers: int | None = None) -> MergeReport:
    """Write the canonical file of ``input`` with rows summed over ``steps``-step windows and sketches at no
    more than ``bins_per_octave`` (4, 2 or 1) bins per octave.

    ``steps`` is the window width in training steps; rows that already cover several steps (``span``) must fit
    inside one window. Sketches already at or below ``bins_per_octave`` are kept as they are. ``workers`` as for
    :func:`trainhist.merge`.
    """
    if bins_per_octave not in BINS_PER_OCTAVE:
        raise UsageError(f"bins_per_octave must be 4, 2 or 1, got {bins_per_octave!r}")
    return _Engine([input], output, steps=steps, scale=BINS_PER_OCTAVE[bins_per_octave], across_runs=False,
                   replica_divergence=replica_divergence, codec=codec, workers=workers).run()
