"""JSON text of kvtool results: NaN/inf become null, tensors and paths plain values."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvtool._version import __version__


def jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        return jsonable(obj.item())
    return obj


def to_json_text(data: Any) -> str:
    """``data`` as indented JSON text with a final newline (see :func:`jsonable`)."""
    return json.dumps(jsonable(data), indent=2) + "\n"


def envelope(command: str | None, data: dict[str, Any], *, input: Any = None, inputs: Any = None, output: Any = None) -> dict[str, Any]:
    """A result as the JSON contract (docs/cli.md) has it: ``kvtool_version``, ``command``, ``input``
    or ``inputs``, ``output`` when something was written, then ``data``'s own keys. The CLI's
    ``--json`` and the Python API's ``to_dict()`` both build their objects here."""
    data = per_layer_as_lists(command, data)
    head: dict[str, Any] = {"kvtool_version": __version__, "command": command}
    if inputs is not None:
        head["inputs"] = [str(p) for p in inputs]
    elif input is not None:
        head["input"] = str(input)
    if output is not None:
        head["output"] = str(output)
    return {**head, **{k: v for k, v in data.items() if k not in head}}


def layer_list(per_layer: dict[Any, Any]) -> list[dict[str, Any]]:
    """``{layer: {...}}`` -> ``[{"layer": layer, ...}, ...]`` in layer order: per-layer results in the
    JSON contract are lists (JSON object keys would turn the layer numbers into strings)."""
    out = []
    for key, value in per_layer.items():
        layer = int(key) if isinstance(key, int) or str(key).lstrip("-").isdigit() else key
        out.append({"layer": layer, **(value if isinstance(value, dict) else {"value": value})})
    return out


def _layer_keyed(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(k, int) or str(k).lstrip("-").isdigit() for k in value)


def per_layer_as_lists(command: str | None, data: Any, key: str = "") -> Any:
    """A copy of ``data`` where every ``{layer: result}`` map (a key naming layers, e.g. ``layers``,
    ``per_layer``, ``recall_per_layer``, holding a mapping keyed by layer numbers) is a list of
    ``{"layer": n, ...}`` (see :func:`layer_list`)."""
    if isinstance(data, dict):
        if "layer" in key and _layer_keyed(data):
            return layer_list({k: per_layer_as_lists(command, v) for k, v in data.items()})
        return {k: per_layer_as_lists(command, v, str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [per_layer_as_lists(command, v, key) for v in data]
    return data
