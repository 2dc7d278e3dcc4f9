"""Validation of JSON manifests against the published schemas (spec/schemas, JSON Schema 2020-12)."""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from importlib import resources
from typing import Any

import jsonschema

from .errors import SchemaError

__all__ = ["KINDS", "validate_manifest", "schema"]

KINDS = ("run", "writer", "site", "segment", "settings")


@lru_cache(maxsize=None)
def schema(kind: str) -> dict:
    """The published schema of one manifest kind."""
    text = resources.files("trainhist").joinpath("schemas", f"{kind}.schema.json").read_text("utf-8")
    return json.loads(text)


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
