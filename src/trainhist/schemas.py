"""Validation of JSON manifests against the published schemas (spec/schemas, JSON Schema 2020-12)."""

from __future__ import annotations

import decimal
import hashlib
import json
import math
from decimal import Decimal
from functools import lru_cache
from importlib import resources
from typing import Any

import jsonschema

from .errors import SchemaError

__all__ = ["KINDS", "integers", "loads_manifest", "lone_surrogate", "validate_manifest", "schema"]

KINDS = ("run", "writer", "site", "segment", "settings")


@lru_cache(maxsize=None)
def schema(kind: str) -> dict:
    """The published schema of one manifest kind."""
    text = resources.files("trainhist").joinpath("schemas", f"{kind}.schema.json").read_text("utf-8")
    return json.loads(text)


#: the keywords the manifest schemas may use: :func:`_numbers` follows ``properties``, ``additionalProperties`` and
#: ``items`` to find the members typed ``integer``, and would miss one behind any other (``$ref``, ``oneOf``, ...)
SCHEMA_KEYWORDS = frozenset({"$schema", "$id", "title", "description", "type", "properties", "required",
                             "additionalProperties", "items", "enum", "const", "pattern", "minimum", "maximum",
                             "minLength", "maxLength", "minItems", "maxItems", "uniqueItems"})
_MAX_DIGITS = 4300  #: the longest integer (in decimal digits) Python converts from text: json.loads's own limit


def _no_constant(name: str) -> None:
    """``json.loads``'s hook for ``NaN`` and ``Infinity``, which Python accepts and RFC 8259 does not (spec 9)."""
    raise ValueError(f"{name} is not JSON (RFC 8259)")


def loads_manifest(text: str) -> Any:
    """A manifest's JSON text parsed as spec 9 reads it (``ValueError`` where it is not JSON: ``NaN``,
    ``Infinity``, a number read as a binary64 that is beyond its range, ``1e400``, or a string holding a lone
    surrogate escape, ``"\\ud800"``): a number with a fraction or an exponent is, where the schema of the manifest's
    kind types the member as ``integer``, the integer its exact decimal value names (``2.0``, ``20e-1``: 2; not
    through binary64), and elsewhere (``config``, ``settings``) its correctly rounded binary64, as ``json.loads``
    gives it, whatever the length of its exponent (:func:`_number`). Such a number whose value is not an integer stays
    a :class:`~decimal.Decimal` where an integer belongs, which :func:`validate_manifest` refuses."""
    floats = False

    def number(t: str) -> Decimal:
        nonlocal floats
        floats = True
        return _number(t)

    doc = json.loads(text, parse_constant=_no_constant, parse_float=number)
    if "\\u" in text:  # (without a \u escape no string can hold a surrogate: UTF-8 has no form for one)
        where = lone_surrogate(doc)
        if where is not None:
            raise ValueError(f"{where} holds a lone UTF-16 surrogate escape, which names no Unicode character (spec "
                             "9: a manifest's strings are Unicode text; a surrogate escape is half of a pair, "
                             "\\ud83d\\ude00): write the character itself, or the pair that names it")
    if not floats:  # (the usual manifest has integers only: nothing to resolve)
        return doc
    kind = doc.get("kind") if isinstance(doc, dict) else None
    return _numbers(doc, schema(kind) if isinstance(kind, str) and kind in KINDS else {}, _floats)


class _Tiny(Decimal):
    """A non-zero number whose exponent is below the least the decimal module holds (``1e-1000000000000000000``),
    standing as ±1E-1999999999999999997, the least magnitude it holds: of the same sign, no integer, and 0.0 as a
    binary64, as the number is; shown (in a schema error) as the text it was read from."""

    text: str

    def __repr__(self) -> str:
        return _short(self.text)


def _short(text: str, at: int = 0, room: int = 40) -> str:
    """``text`` as a message shows it: at most about ``room`` characters around ``text[at]``, a surrogate written
    as its escape (``\\ud800``), so that the message can be printed."""
    lo = max(0, min(at - room // 2, len(text) - room))
    part = text[lo : lo + room].encode("utf-8", "backslashreplace").decode("utf-8")
    return ("..." if lo else "") + part + ("..." if lo + room < len(text) else "")


def _number(t: str) -> Decimal:
    """The exact value of ``t``, the text of a JSON number with a fraction or an exponent, however long its exponent
    (spec 9): the decimal module holds exponents up to about ±10**18 (``decimal.MAX_EMAX``) and refuses a longer one
    (InvalidOperation, or NaN where the caller's context does not trap it). Beyond it the value is decided from the
    text, in time linear in its length: 0 (no non-zero digit: ``0e1000000000000000000``), beyond any binary64 and any
    integer of 4300 digits (a positive exponent: ``ValueError``; the mantissa's digits, fewer than a manifest's
    1 MiB, cannot bring it back), or a non-zero too small for any binary64 (a negative exponent: :class:`_Tiny`)."""
    try:
        value = Decimal(t)
    except decimal.InvalidOperation:
        value = None
    if value is not None and not value.is_nan():  # (JSON has no NaN: a NaN is a refused conversion)
        return value
    mantissa, _, exponent = t.replace("E", "e").partition("e")
    sign = "-" if mantissa.startswith("-") else ""
    if not mantissa.strip("-0."):
        return Decimal(sign + "0")
    if not exponent.startswith("-"):
        raise ValueError(f"the number {_short(t)} is beyond binary64's range (|x| < 2**1024 - 2**970, about 1.8e308) "
                         f"and, as an integer, has more than {_MAX_DIGITS} digits: write it as a string")
    tiny = _Tiny(f"{sign}1E{decimal.MIN_ETINY}")
    tiny.text = t
    return tiny


def integers(doc: Any) -> Any:
    """A manifest (a dict whose ``kind`` is known; anything else is returned as it is) with every member its
    schema types as integer that holds an integral float as that int (spec 9): what a writer writes (``rank=2.0`` is
    written ``2``). Members no schema types (``config``, ``settings``) are left as they are."""
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if not isinstance(kind, str) or kind not in KINDS:
        return doc
    return _numbers(doc, schema(kind), lambda v: v)


def _numbers(value: Any, sch: dict, free: Any) -> Any:
    """``value`` with its floats and Decimals resolved by ``sch``, the schema of its place; ``free(v)`` for a
    container whose schema says nothing of its contents (a ``config``, or a value of the wrong type), which can hold
    no integer member. Recursion follows the schemas only, a few levels: a free value may nest as deep as JSON lets
    it."""
    t = sch.get("type")
    integer = t == "integer" or (isinstance(t, list) and "integer" in t)
    if type(value) is float:
        return int(value) if integer and value.is_integer() else value
    if isinstance(value, Decimal):
        if not integer:
            return _binary64(value)
        if not value.is_finite() or value != value.to_integral_value():
            return value
        # the digits of the integer's value: adjusted() + 1 for any other integer, but 1 for zero, whose adjusted()
        # is its exponent (0e5000 is 0); 1e1000000000 is refused as a longer integer written out is
        if value and value.adjusted() >= _MAX_DIGITS:
            raise ValueError(f"an integer of more than {_MAX_DIGITS} digits")
        return int(value)
    more = sch.get("additionalProperties")
    if isinstance(value, dict) and ("properties" in sch or isinstance(more, dict)):
        props, rest = sch.get("properties", {}), more if isinstance(more, dict) else {}
        return {k: _numbers(v, props.get(k, rest), free) for k, v in value.items()}
    if isinstance(value, list) and isinstance(sch.get("items"), dict):
        return [_numbers(v, sch["items"], free) for v in value]
    return free(value) if isinstance(value, (dict, list)) else value


def _binary64(value: Decimal) -> float:
    """The binary64 value nearest ``value`` (a JSON number with a fraction or an exponent, read where no schema types
    an integer), correctly rounded; ``ValueError`` where that is ±inf (spec 9: ``1e400`` is beyond binary64's range:
    it has no value, and the dump would have to write ``Infinity``, which is not JSON). One too small is a zero."""
    f = float(value)
    if math.isinf(f):
        text = str(value) if len(str(value)) <= 40 else str(value)[:37] + "..."
        raise ValueError(f"the number {text} is beyond binary64's range (|x| < 2**1024 - 2**970, about "
                         "1.8e308): write it as a string")
    return f


def _floats(value: Any) -> Any:
    """``value`` (parsed with Decimal floats) with every Decimal the float ``json.loads`` would give, in place and
    without recursion."""
    stack = [value]
    while stack:
        node = stack.pop()
        for k, v in list(node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(v, Decimal):
                node[k] = _binary64(v)
            elif isinstance(v, (dict, list)):
                stack.append(v)
    return value


def lone_surrogate(doc: Any) -> str | None:
    """Where ``doc`` (parsed JSON: dicts, lists, strings, numbers) holds a string, a member name or a value at any
    depth, with a lone UTF-16 surrogate (U+D800 … U+DFFF: ``json.loads`` makes one of a ``\\ud800`` escape that is
    not half of a pair; spec 9 refuses it), as a message names it (``the string at path: "enc\\ud800"``); None
    where it holds none. Visits each node once, without recursion."""
    stack: list[tuple[Any, tuple | None]] = [(doc, None)]  # (node, its place: (the parent's place, key) or None)
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            at = _surrogate(node)
            if at is not None:
                return f'the string at {_place(where)}, "{_short(node, at)}",'
        elif isinstance(node, dict):
            for k, v in node.items():
                at = _surrogate(k) if isinstance(k, str) else None
                if at is not None:
                    return f'the member name "{_short(k, at)}" at {_place(where)}'
                if isinstance(v, (str, dict, list, tuple)):
                    stack.append((v, (where, k)))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, (where, i)) for i, v in enumerate(node) if isinstance(v, (str, dict, list, tuple)))
    return None


def _place(where: tuple | None) -> str:
    """A place of :func:`lone_surrogate` as a path of member names and list indexes (``config/layers/3``)."""
    keys = []
    while where is not None:
        where, key = where
        keys.append(_short(str(key), room=24))
    text = "/".join(reversed(keys))
    return _short(text, len(text), 120) if text else "(top level)"


def _surrogate(s: str) -> int | None:
    """The index of the first surrogate code point of ``s`` (which UTF-8 cannot encode), or None."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


@lru_cache(maxsize=None)
def _validator(kind: str) -> jsonschema.protocols.Validator:
    s = schema(kind)
    cls = jsonschema.validators.validator_for(s)
    cls.check_schema(s)
    return cls(s)


_VALID_CAP = 8192  #: manifests remembered as valid (by a digest of their bytes); forgotten all at once beyond it
_valid: set[bytes] = set()


def validate_manifest(doc: Any, *, path: str | None = None, offset: int | None = None,
                      raw: bytes | None = None) -> dict:
    """Return ``doc`` if it is a manifest object of a known kind that validates, else raise SchemaError.

    ``raw``: the bytes ``doc`` was parsed from. The schema check runs once per distinct ``raw``: bytes that
    validated before (the same site manifest in every shard of a run) are not checked again."""
    key = None if raw is None else hashlib.blake2b(raw, digest_size=16).digest()  # 16 bytes, not up to a MiB
    if key is not None and key in _valid:
        return doc
    _check(doc, path, offset)
    if key is not None:
        if len(_valid) >= _VALID_CAP:
            _valid.clear()
        _valid.add(key)
    return doc


def _check(doc: Any, path: str | None, offset: int | None) -> None:
    if not isinstance(doc, dict) or doc.get("kind") not in KINDS:
        kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise SchemaError(
            f"manifest must be an object whose 'kind' is one of {', '.join(KINDS)}; found {kind!r}",
            code="unknown_manifest_kind", path=path, offset=offset,
        )
    validator = _validator(doc["kind"])
    if validator.is_valid(doc):
        sample = doc.get("sample") if doc["kind"] == "site" else None
        if sample is not None and sample["elements"] > sample["of"]:  # (what JSON Schema cannot say: spec 2.2)
            raise SchemaError(f"site manifest invalid at sample: a subset of {sample['elements']} of "
                              f"{sample['of']} elements (elements must not exceed of)", code="bad_manifest",
                              path=path, offset=offset)
        return
    err = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise SchemaError(
            f"{doc['kind']} manifest invalid at {where}: {err.message}", code="bad_manifest", path=path,
            offset=offset,
        )
