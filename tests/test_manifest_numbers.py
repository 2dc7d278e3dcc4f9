"""Numbers in manifests (spec 9, "Integers"; spec 10): every member the schemas type as integer is read as the
integer its number names, whatever its form (``2.0``, ``20e-1``), exactly (not through binary64), and dumped as
that integer; numbers of free objects (a run's ``config``) keep their form."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from history_helpers import FAST, records, rewrite

import trainhist
from trainhist.dump import canonical, dumps
from trainhist.errors import TrainhistError
from trainhist.framing import RECORD_HEADER_SIZE, RecordType
from trainhist.schemas import KINDS, SCHEMA_KEYWORDS, loads_manifest, schema, validate_manifest

ROOT = Path(__file__).resolve().parents[1]


def _integer_members(sch: dict, where: str = "") -> list[str]:
    """The places (``cadence.spine``, ``shape[]``) of every member ``sch`` types as integer."""
    out = []
    t = sch.get("type")
    if t == "integer" or (isinstance(t, list) and "integer" in t):
        out.append(where)
    for k, sub in sch.get("properties", {}).items():
        out += _integer_members(sub, f"{where}.{k}" if where else k)
    if isinstance(sch.get("items"), dict):
        out += _integer_members(sch["items"], where + "[]")
    if isinstance(sch.get("additionalProperties"), dict):
        out += _integer_members(sch["additionalProperties"], where + ".*")
    return out


def _keywords(sch: dict) -> set[str]:
    found = set(sch)
    for sub in sch.get("properties", {}).values():
        found |= _keywords(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(sch.get(key), dict):
            found |= _keywords(sch[key])
    return found


def test_the_schemas_use_only_keywords_the_integer_rule_follows() -> None:
    """loads_manifest finds integer members through properties, items and additionalProperties only: a schema
    that hid one behind $ref or oneOf would leave it a float."""
    for kind in KINDS:
        assert _keywords(schema(kind)) <= SCHEMA_KEYWORDS, kind


def test_the_spec_names_every_integer_member() -> None:
    """Spec 9's list of the members the rule covers is the schemas' list."""
    text = " ".join((ROOT / "spec" / "format.md").read_text("utf-8").split())  # (wherever its lines break)
    rule = text[text.index("**Integers.**") :]
    rule = rule[: rule.index("fails the schema")]
    named = set(re.findall(r"`([a-z_.]+)`", rule))
    for kind in KINDS:
        for place in _integer_members(schema(kind)):
            last = place.replace("[]", "").split(".")
            assert place == "id" or last[-1] in named or ".".join(last[-2:]) in named, (kind, place)


def test_integral_numbers_are_integers_exactly_and_free_objects_keep_their_form() -> None:
    doc = loads_manifest('{"kind":"site","id":-0.0,"shape":[2.0,30e-1,4E+0],"cadence":{"spine":1.0,"sketch":0e9},'
                         '"sample":{"elements":1.00,"of":2e0,"seed":-7.0},"order":9007199254740993.0}')
    assert doc == {"kind": "site", "id": 0, "shape": [2, 3, 4], "cadence": {"spine": 1, "sketch": 0},
                   "sample": {"elements": 1, "of": 2, "seed": -7}, "order": 9007199254740993}
    assert all(type(v) is int for v in (doc["id"], *doc["shape"], doc["order"], *doc["sample"].values()))
    seg = loads_manifest('{"kind":"segment","first_step":1152921504606846977.0,"previous":3e0}')
    assert seg["first_step"] == 2**60 + 1 and seg["previous"] == 3
    run = loads_manifest('{"kind":"run","config":{"lr":1.0,"n":2,"xs":[0.5,1e0]}}')
    assert run["config"] == {"lr": 1.0, "n": 2, "xs": [0.5, 1.0]} and type(run["config"]["lr"]) is float
    assert json.dumps(run["config"], sort_keys=True) == '{"lr": 1.0, "n": 2, "xs": [0.5, 1.0]}'
    # dumped from their values, not their text (spec 9, 10): -0 is the integer 0, -0.0 and -0e0 the binary64 -0.0
    run = loads_manifest('{"kind":"run","config":{"a":-0,"b":-0.0,"c":-0e0,"d":1E2}}')
    assert json.dumps(run["config"], sort_keys=True) == '{"a": 0, "b": -0.0, "c": -0.0, "d": 100.0}'
    with pytest.raises(TrainhistError) as ei:
        validate_manifest(loads_manifest('{"kind":"writer","writer_id":"' + "a" * 32 + '","run_id":"' + "b" * 32
                                         + '","rank":2.5,"world_size":4,"host":null,"created":"t"}'))
    assert ei.value.code == "bad_manifest" and "rank" in str(ei.value)
    with pytest.raises(ValueError):  # (a billion-digit integer: refused, as an integer written out that long is)
        loads_manifest('{"kind":"segment","first_step":1e1000000000}')
    with pytest.raises(ValueError):  # (spec 9: a reader MAY refuse more than 4300 digits; the reference does)
        loads_manifest('{"kind":"segment","first_step":' + "1" * 4301 + "}")
    assert loads_manifest('{"kind":"segment","first_step":-' + "9" * 4300 + "}")["first_step"] == 1 - 10**4300
    # the limit counts the digits of the integer's value, not of its text: 0e5000 and -0.000e9999 are 0 (one
    # digit), 1e4299 has 4300 digits and 10e4299 4301
    for zero in ("0e5000", "-0.000e9999", "0E+4300"):
        assert loads_manifest('{"kind":"segment","first_step":' + zero + "}")["first_step"] == 0
    assert loads_manifest('{"kind":"segment","first_step":1e4299}')["first_step"] == 10**4299
    assert loads_manifest('{"kind":"segment","first_step":' + "9" * 4300 + ".000}")["first_step"] == 10**4300 - 1
    for big in ("10e4299", "1e4300", "1" + "0" * 4300 + ".0"):
        with pytest.raises(ValueError):
            loads_manifest('{"kind":"segment","first_step":' + big + "}")
    # a free object's number written without fraction or exponent is an integer too (spec 10), and as limited
    assert loads_manifest('{"kind":"run","config":{"n":' + "9" * 4300 + "}}")["config"]["n"] == 10**4300 - 1
    for kind, member in (("run", "config"), ("settings", "settings")):
        with pytest.raises(ValueError):
            loads_manifest('{"kind":"%s","%s":{"n":-%s}}' % (kind, member, "1" * 4301))


def _file(tmp_path: Path, shape: bytes) -> tuple[Path, int]:
    """A file whose site manifest's shape, written [400000], is ``shape`` (same length), and that manifest's
    offset."""
    p = tmp_path / "f.thist"
    with trainhist.HistoryWriter(p, **FAST) as w:
        w.observe(w.site("a", "activation", shape=(400000,)), 0, np.ones(3, np.float32))
    data = bytearray(p.read_bytes())
    for pos in records(bytes(data), RecordType.MANIFEST):
        length = int.from_bytes(data[pos + 4 : pos + 8], "little")
        payload = bytes(data[pos + RECORD_HEADER_SIZE : pos + RECORD_HEADER_SIZE + length])
        if b'"shape":[400000]' in payload:
            rewrite(data, pos, payload.replace(b'"shape":[400000]', b'"shape":' + shape.ljust(8)))
            site_at = pos
    p.write_bytes(bytes(data))
    return p, site_at


def test_a_shape_of_integral_floats_reads_and_dumps_as_integers(tmp_path: Path) -> None:
    p, _ = _file(tmp_path, b"[2.5e4]")
    with trainhist.open(p) as h:
        assert h.sites[0].shape == (25000,) and type(h.sites[0].shape[0]) is int
        assert canonical(h)["sites"][0]["shape"] == [25000] and '"shape":[25000]' in dumps(h)


@pytest.mark.parametrize("shape,code", [(b"[40.05]", "bad_manifest"), (b"[1e9999]", "bad_manifest_json")])
def test_a_shape_that_is_no_integer_is_refused_at_its_manifest(tmp_path: Path, shape: bytes, code: str) -> None:
    p, at = _file(tmp_path, shape)
    with pytest.raises(TrainhistError) as ei:
        trainhist.open(p)
    assert ei.value.code == code and ei.value.offset == at


def test_the_writer_writes_integral_floats_as_integers(tmp_path: Path) -> None:
    """Spec 9: writers write integers without fraction or exponent; it wrote rank=0.0 as 0.0."""
    p = tmp_path / "w.thist"
    with trainhist.HistoryWriter(p, rank=0.0, world_size=2.0, config={"lr": 1.0}, **FAST) as w:
        a = w.site("a", "activation", shape=(2.0,), sample={"elements": 1.0, "of": 2.0, "seed": 3.0}, order=1.0)
        w.observe(a, 0, np.ones(1))
    data = p.read_bytes()
    assert b'"rank":0,' in data and b'"world_size":2,' in data and b'"sample":{"elements":1,"of":2,"seed":3}' in data
    assert b'"config":{"lr":1.0}' in data  # (a free object keeps its numbers' form)


def test_a_deep_free_object_with_floats_reads(tmp_path: Path) -> None:
    """The numbers are resolved along the schemas only: a config nested as deep as JSON allows (here 900 levels)
    holding floats still reads, and its floats stay floats (a recursive walk of it raised RecursionError)."""
    text = '{"kind":"run","run_id":"' + "0" * 32 + '","name":null,"created":"t","config":' + '{"a":' * 900 + "1.5"
    doc = loads_manifest(text + "}" * 901)
    validate_manifest(doc)
    inner = doc["config"]
    for _ in range(900):
        inner = inner["a"]
    assert inner == 1.5 and type(inner) is float


@pytest.mark.parametrize("number", ["1e400", "-2e308", "1.7976931348623159e308", "0.5e309"])
@pytest.mark.parametrize("deep", [False, True])
def test_a_number_beyond_binary64_is_not_json_and_is_refused(number: str, deep: bool) -> None:
    """Spec 9: a number read as a binary64 whose rounding overflows (1e400) has no value; it was read as inf and the
    dump wrote ``Infinity``, which is not JSON. It is refused as NaN and Infinity are (bad_manifest_json), in a free
    object at any depth and in a member of another type; the largest finite one and a tiny one read."""
    inner = ('{"a":[' + number + "]}") if deep else number
    text = '{"kind":"run","run_id":"' + "0" * 32 + '","name":null,"created":"t","config":{"x":' + inner + "}}"
    with pytest.raises(ValueError, match="beyond binary64's range"):
        loads_manifest(text)
    with pytest.raises(ValueError, match="beyond binary64's range"):
        loads_manifest(text.replace('"name":null', '"name":' + number))
    edges = loads_manifest(text.replace(number, "[1.7976931348623158e308,-1e-400]"))["config"]["x"]
    edges = edges["a"][0] if deep else edges
    assert edges == [1.7976931348623157e308, 0.0] and str(edges[1]) == "-0.0"


def test_the_reader_refuses_a_config_number_beyond_binary64_at_its_manifest(tmp_path: Path) -> None:
    """The reader names the run manifest; a number of the same length within range reads."""
    p = tmp_path / "big.thist"
    with trainhist.HistoryWriter(p, config={"lr": 0.125}, **FAST) as w:
        w.observe(w.site("a", "activation"), 0, np.ones(1))
    clean = p.read_bytes()
    for number, ok in ((b"9e307", True), (b"9e308", False)):
        data = bytearray(clean)
        for pos in records(clean, RecordType.MANIFEST):
            length = int.from_bytes(data[pos + 4 : pos + 8], "little")
            payload = clean[pos + RECORD_HEADER_SIZE : pos + RECORD_HEADER_SIZE + length]
            if b'"lr":0.125' in payload:
                rewrite(data, pos, payload.replace(b"0.125", number))
                at = pos
        p.write_bytes(bytes(data))
        if ok:
            assert trainhist.open(p).runs[0]["config"] == {"lr": 9e307}
            continue
        with pytest.raises(TrainhistError) as ei:
            trainhist.open(p)
        assert ei.value.code == "bad_manifest_json" and ei.value.offset == at and "beyond binary64" in str(ei.value)


_RUN = '{"kind":"run","run_id":"' + "0" * 32 + '","name":null,"created":"t","config":{"x":%s}}'
_SEG = ('{"kind":"segment","id":0,"first_step":%s,"reason":"start","previous":null,"writer_id":"' + "0" * 32
        + '"}')
_HUGE = ("1e1000000000000000000", "-1E+18446744073709551616", "0.5e1000000000000000001",
         "1" + "0" * 99 + "e999999999999999999", "1e" + "9" * 5000, "-2.5E" + "1" * 300000)


@pytest.mark.parametrize("number", _HUGE)
@pytest.mark.parametrize("where", [_RUN, _SEG])
def test_a_number_with_a_huge_exponent_is_refused_by_its_value(number: str, where: str) -> None:
    """Spec 9: an exponent of 19 digits (beyond the decimal module's) or of thousands: ``1e1000000000000000000``
    raised decimal.InvalidOperation, which escaped open() and every command; it is beyond binary64's range (in an
    integer member, beyond 4300 digits), refused as 1e400 is (ValueError: bad_manifest_json)."""
    with pytest.raises(ValueError, match="beyond binary64's range") as ei:
        loads_manifest(where % number)
    assert len(str(ei.value)) < 400  # (the number abbreviated)


@pytest.mark.parametrize("number,value", [("-1e-1000000000000000000", "-0.0"), ("1e-1000000000000000001", "0.0"),
                                          ("3.5E-" + "7" * 5000, "0.0"), ("-1" + "0" * 99 + "e-1999999999999999999",
                                                                           "-0.0")])
def test_a_number_with_a_huge_negative_exponent_is_a_zero_or_no_integer(number: str, value: str) -> None:
    """Spec 9: a non-zero number below binary64's least is read as the zero of its sign in a free member, however long
    its exponent, and fails the schema where an integer belongs (bad_manifest), naming the number as written."""
    x = loads_manifest(_RUN % number)["config"]["x"]
    assert type(x) is float and repr(x) == value
    with pytest.raises(TrainhistError) as ei:
        validate_manifest(loads_manifest(_SEG % number))
    assert ei.value.code == "bad_manifest" and "first_step" in str(ei.value)
    assert number[:20].lower() in str(ei.value).lower()


@pytest.mark.parametrize("number,value", [("0e1000000000000000000", 0), ("-0.000E+" + "9" * 4000, 0),
                                          ("1e0000000000000000000000005", 10**5),
                                          ("25e-" + "0" * 5000 + "1", 25 / 10)])
def test_a_long_exponent_that_names_a_small_value_reads_as_that_value(number: str, value: object) -> None:
    """Zero whatever its exponent, and an exponent's leading zeros do not count (spec 9)."""
    x = loads_manifest(_RUN % number)["config"]["x"]
    assert type(x) is float and x == value
    if float(value).is_integer():
        n = loads_manifest(_SEG % number)["first_step"]
        assert type(n) is int and n == value


def test_huge_exponents_read_the_same_whatever_the_callers_decimal_context() -> None:
    """A caller's context that does not trap InvalidOperation made decimal give NaN for 1e1000000000000000000: it was
    read as a NaN in config (which JSON has no form for)."""
    import decimal

    with decimal.localcontext() as ctx:
        ctx.traps[decimal.InvalidOperation] = False
        ctx.prec, ctx.Emax, ctx.Emin = 3, 10, -10
        with pytest.raises(ValueError, match="beyond binary64's range"):
            loads_manifest(_RUN % "1e1000000000000000000")
        assert repr(loads_manifest(_RUN % "-1e-2000000000000000000")["config"]["x"]) == "-0.0"
        assert loads_manifest(_RUN % "1.25e0")["config"]["x"] == 1.25


def test_the_reader_and_every_command_refuse_a_huge_exponent_at_its_manifest(tmp_path: Path, capsys) -> None:
    """The reproducer: config {"lr": 1e1000000000000000000} is bad_manifest_json at the run manifest for open()
    and the command line (a traceback before); a huge negative exponent reads as 0.0."""
    from trainhist.cli import main

    p = tmp_path / "huge.thist"
    with trainhist.HistoryWriter(p, config={"lr": 1.2345678901234567e300}, **FAST) as w:
        w.observe(w.site("a", "activation"), 0, np.ones(1))
    clean = p.read_bytes()
    for number in (b"1e1000000000000000000", b"-1e-1000000000000000000"):  # (23 bytes with the blanks after it)
        data = bytearray(clean)
        for pos in records(clean, RecordType.MANIFEST):
            length = int.from_bytes(data[pos + 4 : pos + 8], "little")
            payload = clean[pos + RECORD_HEADER_SIZE : pos + RECORD_HEADER_SIZE + length]
            if b'"lr":1.2345678901234567e+300' in payload:
                rewrite(data, pos, payload.replace(b"1.2345678901234567e+300", number.ljust(23)))
                at = pos
        p.write_bytes(bytes(data))
        if number.startswith(b"-"):
            assert repr(trainhist.open(p).runs[0]["config"]["lr"]) == "-0.0"
            continue
        with pytest.raises(TrainhistError) as ei:
            trainhist.open(p)
        assert ei.value.code == "bad_manifest_json" and ei.value.offset == at and "beyond binary64" in str(ei.value)
        for command in ("info", "verify", "dump", "triage"):
            assert main([command, str(p)]) == 1
            err = capsys.readouterr().err
            assert "[bad_manifest_json]" in err and f"offset {at}" in err, (command, err)
