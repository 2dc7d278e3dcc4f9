"""The spec's generated parts and tables agree with the implementation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema

from trainhist import grid
from trainhist.schemas import KINDS, schema

ROOT = Path(__file__).resolve().parent.parent
SPEC = (ROOT / "spec" / "format.md").read_text("utf-8")


def test_appendices_are_current() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "spec_appendix.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_threshold_table_matches_grid() -> None:
    for width, values in (("binary32", grid.THRESH_F32), ("binary64", grid.THRESH_F64)):
        row = next(line for line in SPEC.splitlines() if line.startswith(f"| {width} |"))
        numbers = [int(n) for n in re.findall(r"\| (\d+) \(0x", row)]
        assert numbers == list(values)
    # the spec's note: binary32 thresholds are the binary64 ones shifted right by 29
    assert [t >> 29 for t in grid.THRESH_F64] == list(grid.THRESH_F32)


def test_schemas_are_valid_2020_12_and_published_in_spec() -> None:
    for kind in KINDS:
        s = schema(kind)
        assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        jsonschema.Draft202012Validator.check_schema(s)
        published = json.loads((ROOT / "spec" / "schemas" / f"{kind}.schema.json").read_text("utf-8"))
        assert published == s


def test_crc_check_value_in_spec() -> None:
    from trainhist.framing import crc32c

    assert crc32c(b"123456789") == 0xE3069283
    assert "0xE3069283" in SPEC


def test_vectors_named_by_the_spec_exist() -> None:
    """Every vector the spec or the runner contract names (`invalid/bad_exact_noncanonical`, ...) is shipped."""
    cats = "valid|invalid|truncated|forward-compat|writer|merge|coarsen|presence"
    vectors = ROOT / "conformance" / "vectors"
    named = set()
    for doc in ("spec/format.md", "spec/crash-safety.md", "conformance/README.md"):
        named |= set(re.findall(rf"`((?:{cats})/[A-Za-z0-9_]+)`", (ROOT / doc).read_text("utf-8")))
    assert named
    assert sorted(n for n in named if not (vectors / n / "case.json").is_file()) == []


def _spec_table(heading: str, stop: str) -> dict[str, str]:
    """The (name, dtype) rows of the spec table under ``heading``, up to the line starting with ``stop``."""
    text = SPEC.split(heading, 1)[1].split(stop, 1)[0]
    out: dict[str, str] = {}
    for names, dtype in re.findall(r"^\| ((?:`\w+`,? ?)+) \| (\w+)", text, re.M):
        for name in re.findall(r"`(\w+)`", names):
            out[name] = dtype
    return out


def test_obs_and_sketch_column_tables_match_the_implementation_and_the_plans_row_bytes() -> None:
    """Spec 7.5's required obs columns and sketch columns are the implementation's (names, order, dtypes), and the
    collector's plan prices a spine row and a full sketch row from them (it said 120 bytes a spine row, not 91)."""
    import numpy as np

    from trainhist.model import OBS_COLUMNS, SKETCH_COLUMNS

    obs = _spec_table("### 7.5 Obs chunk columns", "Optional tally")
    sketch = _spec_table("Optional sketch columns", "All obs chunks")
    assert obs == dict(OBS_COLUMNS) and list(obs) == list(OBS_COLUMNS)
    assert sketch == {k: v for k, v in SKETCH_COLUMNS.items()}
    try:
        from trainhist.torch.plan import SKETCH_ROW_BYTES, SPINE_ROW_BYTES
    except ImportError:  # (no torch: the reader's tests run without it)
        return
    width = {name: np.dtype(dt).itemsize for name, dt in {**obs, **sketch}.items()}
    assert SPINE_ROW_BYTES == sum(width[n] for n in obs) == 91
    fixed = sum(width[n] for n in sketch if n != "sk_counts")
    assert SKETCH_ROW_BYTES == fixed + 8 * 2 * grid.nbins(grid.NATIVE_SCALE)
