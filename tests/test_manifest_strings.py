"""Strings in manifests are Unicode text (spec 9, "Strings"): a ``\\ud800`` escape that is not half of a surrogate
pair names no character. The reader and verify accepted it and even the writer wrote it, and then every surface that
prints or tabulates the name (info, triage, export, frames, figures) failed with UnicodeEncodeError. The reader
refuses such a manifest (bad_manifest_json, at its record), the writer such a string (bad_manifest_value); a valid
pair (an emoji) reads, prints and tabulates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from history_helpers import FAST, records, rewrite

import trainhist
from trainhist.cli import main
from trainhist.errors import TrainhistError, UsageError
from trainhist.framing import RECORD_HEADER_SIZE, RecordType
from trainhist.schemas import lone_surrogate, loads_manifest

EMOJI = "\U0001f600"  # (the JSON escape pair \ud83d\ude00)


def _file(tmp_path: Path, placeholder: bytes, text: bytes) -> tuple[Path, int]:
    """A file whose one manifest holding the string ``placeholder`` (12 characters) holds the JSON string ``text``
    (12 bytes with its escapes, padded with ``_``) instead, and that manifest's offset. Placeholders: site path
    ``AAAAAAAAAAAA``, run name ``NNNNNNNNNNNN``, config ``{"CCCCCCCCCCCC": ["VVVVVVVVVVVV", {"KKKKKKKKKKKK": 1}]}``."""
    p = tmp_path / "s.thist"
    with trainhist.HistoryWriter(p, run_name="N" * 12, config={"C" * 12: ["V" * 12, {"K" * 12: 1}]}, **FAST) as w:
        a = w.site("A" * 12, "activation")
        w.observe(a, 0, np.array([1.0, 2.0], np.float32))
        w.observe(a, 1, np.array([np.nan, 2.0], np.float32))  # (a finding: triage names the site)
        w.step_truth(0, applied=True)
    data = bytearray(p.read_bytes())
    old, new = b'"' + placeholder + b'"', b'"' + text.ljust(12, b"_") + b'"'
    hits = []
    for pos in records(bytes(data), RecordType.MANIFEST):
        length = int.from_bytes(data[pos + 4 : pos + 8], "little")
        payload = bytes(data[pos + RECORD_HEADER_SIZE : pos + RECORD_HEADER_SIZE + length])
        if old in payload:
            rewrite(data, pos, payload.replace(old, new))
            hits.append(pos)
    assert len(hits) == 1 and len(old) == len(new)
    p.write_bytes(bytes(data))
    return p, hits[0]


LONE = [  # (placeholder, its replacement): lone surrogates, as values and member names, at every depth
    (b"A" * 12, b"\\ud800"),  # a site path: the reproducer
    (b"A" * 12, b"a\\uDFFF"),  # (upper-case hex digits; a low surrogate)
    (b"N" * 12, b"\\udc00"),  # the run's name
    (b"V" * 12, b"x\\ud83d"),  # a high surrogate at the end of a string in a list in config
    (b"V" * 12, b"\\ud83dx"),  # (a high surrogate followed by another character)
    (b"K" * 12, b"\\ude00"),  # a member name in an object in a list in config
    (b"C" * 12, b"\\ude00\\ud83d"),  # a member name of config: a pair in the wrong order, two lone ones
]


@pytest.mark.parametrize("placeholder,text", LONE)
def test_the_reader_refuses_a_lone_surrogate_anywhere_in_a_manifest(tmp_path: Path, capsys, placeholder: bytes,
                                                                   text: bytes) -> None:
    p, at = _file(tmp_path, placeholder, text)
    with pytest.raises(TrainhistError) as ei:
        trainhist.open(p)
    assert ei.value.code == "bad_manifest_json" and ei.value.offset == at
    assert "lone UTF-16 surrogate" in str(ei.value)
    str(ei.value).encode("utf-8")  # (the message itself can be printed: the surrogate written as its escape)
    for command in (["info", str(p), "--sites"], ["verify", str(p)], ["triage", str(p)], ["dump", str(p)],
                    ["export", str(p), "-o", str(tmp_path / "out"), "--format", "csv"]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert "[bad_manifest_json]" in err and f"offset {at}" in err, (command, err)


@pytest.mark.parametrize("text,where", [
    ('"\\ud800"', "(top level)"), ('{"a":{"b":["x","\\udbff\\u0041"]}}', "a/b/1"),
    ('{"a":"\\ud83d\\ude00","\\ude00\\ud83d":1}', "(top level)"), ('[[[{"\\ud800x":0}]]]', "0/0/0"),
])
def test_loads_manifest_names_where_the_lone_surrogate_is(text: str, where: str) -> None:
    with pytest.raises(ValueError, match="lone UTF-16 surrogate") as ei:
        loads_manifest(text)
    assert f"at {where}" in str(ei.value)


def test_a_deep_or_wide_manifest_is_checked_without_recursion() -> None:
    """A surrogate 900 objects deep is found (no RecursionError), and 100000 clean strings cost one pass."""
    deep = '{"kind":"run","config":' + '{"a":' * 900 + '"\\udfff"' + "}" * 901
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        loads_manifest(deep)
    wide = json.dumps({"kind": "run", "config": {"x": ["\u00e9\U0001f600"] * 100000}})
    assert "\\ud83d\\ude00" in wide and lone_surrogate(json.loads(wide)) is None
    assert loads_manifest(wide)["config"]["x"][-1] == "\u00e9\U0001f600"


@pytest.mark.parametrize("pair", [b"\\ud83d\\ude00", b"\\uD83D\\uDE00"])
def test_a_surrogate_pair_reads_prints_and_tabulates(tmp_path: Path, capsys, pair: bytes) -> None:
    """The escape pair \\ud83d\\ude00 (either case) is one character, U+1F600: read, printed by info and triage,
    kept by dump, frames and export."""
    pd = pytest.importorskip("pandas")
    from trainhist import frames

    p, _ = _file(tmp_path, b"A" * 12, pair)
    name = EMOJI
    with trainhist.open(p) as h:
        assert h.sites[0].path == name and h.verify()["status"] == "clean"
        assert list(frames.spines(h)["path"].astype(str).unique()) == [name]
    assert main(["info", str(p), "--sites"]) == 0 and name in capsys.readouterr().out
    assert main(["triage", str(p)]) == 0 and name in capsys.readouterr().out
    assert main(["dump", str(p)]) == 0 and json.loads(capsys.readouterr().out)["sites"][0]["path"] == name
    out = tmp_path / "csv"
    assert main(["export", str(p), "-o", str(out), "--format", "csv"]) == 0
    capsys.readouterr()
    assert list(pd.read_csv(out / "spines.csv")["path"].unique()) == [name]


def test_the_writer_refuses_a_lone_surrogate_before_the_file_changes(tmp_path: Path) -> None:
    """site(), run_name, config (names and values, nested), settings, host: UsageError bad_manifest_value (it wrote
    the escape); the file is left as it was and the writer goes on."""
    p = tmp_path / "w.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        w.observe(w.site("a", "activation"), 0, np.ones(2, np.float32))
    data = p.read_bytes()
    for kw in ({"run_name": "enc\ud800"}, {"config": {"layers": [{"name": "x\udc80"}]}}, {"config": {"\udfff": 1}},
               {"settings": {"s": ["\ud83d"]}}, {"host": "h\udcff"}):
        for mode in ("w", "a"):
            if mode == "a" and ("run_name" in kw or "config" in kw):
                continue  # (an appending writer keeps the file's run manifest)
            with pytest.raises(UsageError) as ei:
                trainhist.HistoryWriter(p, mode=mode, **kw, **FAST)
            assert ei.value.code == "bad_manifest_value" and "lone UTF-16 surrogate" in str(ei.value), kw
            str(ei.value).encode("utf-8")
            assert p.read_bytes() == data, (kw, mode)
    with trainhist.HistoryWriter(p, mode="a", **FAST) as w:
        for path, facet in (("enc\ud800", None), ("enc", "f\udc00")):
            with pytest.raises(UsageError) as ei:
                w.site(path, "activation", facet=facet)
            assert ei.value.code == "bad_manifest_value" and ("path" in str(ei.value) or "facet" in str(ei.value))
        ok = w.site(f"enc.{EMOJI}", "activation", facet="\u00e9")  # (a valid name: written, ids not skipped)
        w.observe(ok, 1, np.ones(2, np.float32))
    with trainhist.open(p) as h:
        assert [s.path for s in h.sites] == ["a", f"enc.{EMOJI}"] and [s.id for s in h.sites] == [0, 1]
        assert h.sites[1].facet == "\u00e9" and h.verify()["status"] == "clean"


def test_frames_parquet_and_figures_keep_a_non_ascii_site_name(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pytest.importorskip("matplotlib")
    from trainhist import frames
    from trainhist.figures import site_figure

    p = tmp_path / "e.thist"
    name = f"enc.{EMOJI}.\u00e9"
    with trainhist.HistoryWriter(p, run_name=EMOJI, config={EMOJI: [EMOJI]}, **FAST) as w:
        for step in range(2):
            w.observe(w.site(name, "activation"), step, np.arange(3.0))
    with trainhist.open(p) as h:
        assert h.run["name"] == EMOJI and h.run["config"] == {EMOJI: [EMOJI]}
        assert list(frames.spines(h)["path"].astype(str)) == [name] * 2
        frames.to_parquet(h, tmp_path / "pq")
        site_figure(h, name, out=tmp_path / "site.png")
    assert list(pd.read_parquet(tmp_path / "pq" / "spines.parquet")["path"].astype(str)) == [name] * 2
    assert (tmp_path / "site.png").stat().st_size > 1000
