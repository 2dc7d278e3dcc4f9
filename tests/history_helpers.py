"""Shared test data: a history that mixes codecs, phases, micro-batches, presence states, NaNs and huge values."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainhist.writer import HistoryWriter

#: writer options for test files: no fsync, one commit per explicit commit() or close
FAST = dict(fsync="never", commit_every=10**9, commit_seconds=1e18)


def write_mixed(p: Path, codecs: tuple[str, ...], seed: int, **writer_options: object) -> None:
    """Append one 40-step segment of writes per codec in ``codecs`` to ``p`` (sites ``a``, ``g``, ``s``)."""
    rng = np.random.default_rng(seed)
    for k, codec in enumerate(codecs):
        with HistoryWriter(p, mode="a", codec=codec, **writer_options, **FAST) as w:
            a = w.site("a", "activation")
            g = w.site("g", "param_grad")
            s = w.site("s", "activation", cadence_sketch=0)
            for step in range(k * 40, k * 40 + 40):
                x = (rng.standard_normal(64 + step) * 2.0 ** (step % 9 - 4)).astype(np.float32)
                if step % 7 == 3:
                    x[0] = np.nan
                w.observe(a, step, x, sketch=step % 3 != 0)
                if step % 5 == 0:
                    w.mark(g, step, "absent")
                else:
                    w.observe(g, step, x.astype(np.float64) * 1e300 if step % 11 == 0 else x, phase="pre_clip")
                    w.observe(g, step, x[:10], phase="post_clip", micro=step % 2)
                w.observe(s, step, x, sketch=False)
                if step % 13 == 12:
                    w.commit()
