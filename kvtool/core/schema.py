"""The JSON Schema of every command's ``--json`` object, and a checker for it.

The schema is a file in the package (:data:`SCHEMA_PATH`, JSON Schema draft 2020-12) so that other
programs can validate kvtool's output with any JSON Schema library; docs/cli.md describes the same
objects in prose. :func:`validate` checks an object against it with the keywords the file uses
(``type``, ``properties``, ``required``, ``additionalProperties``, ``propertyNames``, ``items``,
``enum``, ``const``, ``minimum``, ``maximum``, ``pattern``, ``$ref`` within the file, ``allOf``,
``anyOf``, ``if``/``then``/``else``), so kvtool's tests need no extra dependency; a keyword it does not know
is an error, so the file cannot quietly use more than is checked.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "data" / "output.schema.json"

KNOWN = {"$schema", "$id", "$defs", "title", "description", "type", "properties", "required", "additionalProperties",
         "propertyNames", "items", "enum", "const", "minimum", "maximum", "pattern", "$ref", "allOf", "anyOf", "if", "then",
         "else", "examples", "$comment"}
TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


@lru_cache(maxsize=1)
def output_schema() -> dict[str, Any]:
    """The schema of kvtool's ``--json`` objects (the package's data/output.schema.json)."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def validate(obj: Any, schema: dict[str, Any] | None = None) -> list[str]:
    """Every way ``obj`` breaks ``schema`` (default: :func:`output_schema`), as ``path: problem``
    lines; an empty list when it conforms."""
    root = output_schema() if schema is None else schema
    errors: list[str] = []
    _check(obj, root, root, "$", errors)
    return errors


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"only references inside the schema are supported, not {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _check(value: Any, schema: Any, root: dict[str, Any], where: str, errors: list[str]) -> None:
    if schema is True:
        return
    if schema is False:
        errors.append(f"{where}: not allowed here")
        return
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"schema at {where} uses keywords this checker does not know: {sorted(unknown)}")
    if "$ref" in schema:
        _check(value, _resolve(schema["$ref"], root), root, where, errors)
    for sub in schema.get("allOf", []):
        _check(value, sub, root, where, errors)
    if "anyOf" in schema:
        tries = []
        for sub in schema["anyOf"]:
            found: list[str] = []
            _check(value, sub, root, where, found)
            if not found:
                break
            tries.append(found)
        else:
            errors.append(f"{where}: matches none of the allowed forms ({'; '.join(t[0] for t in tries if t)})")
    if "if" in schema:
        probe: list[str] = []
        _check(value, schema["if"], root, where, probe)
        if not probe and "then" in schema:
            _check(value, schema["then"], root, where, errors)
        elif probe and "else" in schema:
            _check(value, schema["else"], root, where, errors)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(TYPES[t](value) for t in types):
            errors.append(f"{where}: {json.dumps(value)[:60]} is not {' or '.join(types)}")
            return
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: {json.dumps(value)[:60]} is not {json.dumps(schema['const'])}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {json.dumps(value)[:60]} is not one of {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where}: {value} is below {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where}: {value} is above {schema['maximum']}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{where}: lacks {key!r}")
        for key, item in value.items():
            if "propertyNames" in schema:
                _check(key, schema["propertyNames"], root, f"{where} key {key!r}", errors)
            if key in props:
                _check(item, props[key], root, f"{where}.{key}", errors)
            elif "additionalProperties" in schema:
                extra = schema["additionalProperties"]
                if extra is False:
                    errors.append(f"{where}: {key!r} is not a documented key")
                else:
                    _check(item, extra, root, f"{where}.{key}", errors)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], root, f"{where}[{i}]", errors)
