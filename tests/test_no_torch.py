"""The core works without torch: in a fresh interpreter where ``import torch`` fails, trainhist imports, writes a
file and reads it back, and torch never enters ``sys.modules``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import trainhist

SRC = str(Path(trainhist.__file__).resolve().parent.parent)

CHILD = textwrap.dedent(
    r'''
    import importlib, importlib.abc, json, pkgutil, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        """Refuse torch and every torch.* module, as on a machine where it is not installed."""
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by test_no_torch)", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        del sys.modules[name]
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("torch is still importable: the blocker does not work")

    import numpy as np
    import trainhist
    from trainhist.writer import HistoryWriter

    path = sys.argv[1]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)
    with HistoryWriter(path, run_name="no-torch", fsync="never", commit_every=2) as w:
        a = w.site("layer.0", "activation", shape=[1000], dtype="float32")
        p = w.site("layer.0.weight", "param")
        for step in range(5):
            w.observe(a, step, x * (step + 1))
            if step == 3:
                w.mark(p, step, "absent")
            else:
                w.observe(p, step, x[:10].astype(np.float64))
            w.scalar("loss", step, 1.0 / (step + 1))
            w.step_truth(step, applied=True, tokens=step * 128)
        w.new_segment(5)
        w.observe(a, 5, x)

    with trainhist.open(path) as h:
        report = h.verify()
        s = h.spine("layer.0")
        sk = h.sketch("layer.0")
        ok = (
            report["status"] == "clean"
            and len(s) == 6
            and s.summary(0).sum == trainhist.summarize(x).sum
            and sk.sketch(0) == trainhist.summarize(x).sketch
            and h.presence("layer.0.weight", "param")[3] == "absent"
            and h.spine("loss", "scalar").sum.tolist() == [1.0, 0.5, 1 / 3, 0.25, 0.2]
            and [r["tokens"] for r in h.step_truth_rows()] == [0, 128, 256, 384, 512]
            and [g.id for g in h.segments] == [0, 1]
        )

    # every core module (everything but the trainhist.torch subpackage) imports without torch
    failed = {}
    for m in pkgutil.iter_modules(trainhist.__path__, "trainhist."):
        if m.name == "trainhist.torch":
            continue
        try:
            importlib.import_module(m.name)
        except ImportError as e:
            if "torch" in str(e):
                failed[m.name] = str(e)
        except SystemExit:
            pass

    print(json.dumps({
        "ok": ok,
        "torch_loaded": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
        "needs_torch": failed,
    }))
    '''
)


def test_core_without_torch(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "no_torch.thist")],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"], result
    assert result["torch_loaded"] == [], result
    assert result["needs_torch"] == {}, result


def test_blocker_is_effective() -> None:
    """The child's blocker really makes torch unimportable (so the test above is not vacuous)."""
    code = CHILD.split("import numpy as np")[0] + "print('blocked')\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "blocked", proc.stderr
