"""The command line: what it says of a file, and how it names what went wrong (flags, not API parameters)."""

from __future__ import annotations

import numpy as np

import trainhist
from trainhist.cli import main
from trainhist.framing import RECORD_HEADER_SIZE


def _history(path, steps: int = 4):
    with trainhist.HistoryWriter(path, run_name="cli") as w:
        a = w.site("h.0", "activation")
        for st in range(steps):
            w.observe(a, st, np.arange(1.0, 9.0) * (st + 1))
            w.step_truth(st, applied=True)
    return path


def test_info_does_not_call_a_file_with_a_damaged_payload_clean(tmp_path, capsys) -> None:
    """info reads the framing and the commits, not the chunk payloads: on a file with a flipped payload byte
    (verify: bad_payload_crc, exit 1) it printed 'state clean' and exited 0. It still exits 0 (its exit codes are
    those of reading), but says that the payloads were not checked and what checks them."""
    p = _history(tmp_path / "f.thist")
    with trainhist.open(p) as h:
        e = next(e for es in h._obs.values() for e in es)
    data = bytearray(p.read_bytes())
    data[e.offset + RECORD_HEADER_SIZE + e.length - 1] ^= 0xFF  # (the chunk's last payload byte)
    p.write_bytes(bytes(data))
    assert main(["verify", str(p)]) == 1
    assert "[bad_payload_crc]" in capsys.readouterr().err
    assert main(["info", str(p)]) == 0
    state = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("state"))
    assert not state.split()[1].startswith("clean")
    assert "framing clean" in state and "payloads not checked" in state and "trainhist verify" in state


def test_info_of_an_empty_file_says_so(tmp_path, capsys) -> None:
    """A 0-byte file showed `run None (None)`."""
    p = tmp_path / "e.thist"
    p.write_bytes(b"")
    assert main(["info", str(p)]) == 3
    out = capsys.readouterr().out
    assert "None" not in out and "(0 bytes: an empty file)" in out and "no run manifest" in out
