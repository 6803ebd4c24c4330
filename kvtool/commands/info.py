"""``kvtool info``: what a kvtool file holds."""

from __future__ import annotations

import re
from typing import Any

import typer

from kvtool.commands._command import Outcome, add_commands, declare
from kvtool.commands._common import (
    InputArg,
    console,
    example_epilog,
    fmt_bytes,
    make_table,
    params_text,
    show,
)
from kvtool.commands.compress import print_report
from kvtool.core.progress import Progress

ORDER = 20
SHORT_HELP = "Show what a kvtool file holds: schema, model facts, tensors, bytes"


def readable(value: Any) -> str:
    """A metadata value for a person: lists and mappings as ``a, b`` / ``key=value, ...``, long text
    cut to its first line (the full value is in --json)."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={readable(v)}" for k, v in value.items() if v is not None) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(readable(v) for v in value) or "-"
    if isinstance(value, str):
        first = value.splitlines()[0] if value else ""
        return first if first == value else f"{first} ..."
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def held_layers(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The model layers a file holds, each with the parts stored for it (``keys``, ``values``,
    ``queries``, ``hidden`` of a capture; ``keys``, ``values``, ``window`` of a compressed layer; ``tails``:
    the dense held-out tokens), from its tensor names ``layers.<i>.<part>...`` and ``tails.<i>.<part>``."""
    parts: dict[int, list[str]] = {}
    for t in data["tensors"]:
        m = re.match(r"(layers|tails)\.(\d+)\.(\w+)", t["name"])
        if m:
            part = "tails" if m.group(1) == "tails" else m.group(3)
            have = parts.setdefault(int(m.group(2)), [])
            if part not in have:
                have.append(part)
    order = ("keys", "values", "queries", "hidden", "window", "tails")
    rank = lambda part: order.index(part) if part in order else len(order)  # noqa: E731
    return [{"layer": i, "parts": sorted(p, key=rank)} for i, p in sorted(parts.items())]


def print_info(outcome: Outcome) -> None:
    from kvtool.core.cache import format_indices  # deferred: start-up time

    data = outcome.data
    meta = data["metadata"]
    model = meta.get("kvtool.model", {})
    show("[bold]{}[/bold]: {} v{} (kvtool {})", outcome.input, data["schema"], data["schema_version"], meta.get("kvtool.version", "?"))
    show("model {} ({}): {} layers, {} heads, {} KV heads, head_dim {}, dtype {}, RoPE applied: {}", model.get("name"), model.get("architecture"),
         model.get("num_layers"), model.get("num_heads"), model.get("num_kv_heads"), model.get("head_dim"), model.get("dtype"),
         readable(model.get("rope_applied")))
    held = data["layers"]
    if held:
        kinds = sorted({tuple(e["parts"]) for e in held})
        what = "; ".join(", ".join(k) for k in kinds) if len(kinds) > 1 else ", ".join(kinds[0])
        show("[bold]holds {} of the model's {} layers: {}[/bold] ({})", len(held), model.get("num_layers"), format_indices([e["layer"] for e in held]), what)
    rows = []
    if "kvtool.format" in meta:
        rows.append(("format", readable(meta["kvtool.format"])))
    if "kvtool.params" in meta:
        params = meta["kvtool.params"]
        rows.append(("parameters", params_text(params) if isinstance(params, dict) else readable(params)))
    for key, value in (meta.get("kvtool.info") or {}).items():
        if key != "source_info":
            rows.append((key.replace("_", " "), readable(value)))
    if rows:
        console.print(make_table("file facts", ["what", "value"], rows))
    rows = [(t["name"], t["dtype"], "x".join(map(str, t["shape"])), fmt_bytes(t["bytes"])) for t in data["tensors"]]
    if len(rows) > 40:
        rows = rows[:20] + [("...", f"{len(rows) - 40} more", "", "")] + rows[-20:]
    console.print(make_table("tensors", ["tensor", "dtype", "shape", "bytes"], rows))
    console.print(f"{len(data['tensors'])} tensors, {fmt_bytes(data['tensor_bytes'])} of tensor data, file {fmt_bytes(data['file_bytes'])}")
    if "compression" in data:
        print_report(data["compression"])


@declare(
    "info",
    help="Show a kvtool file's schema, model facts, tensors (names, shapes, dtypes, bytes) and totals.",
    epilog=example_epilog("kvtool info sample:", "kvtool info cap.bitmap.safetensors --json"),
    render=print_info,
)
def info(path: InputArg, *, progress: Progress) -> Outcome:
    from kvtool.core import io  # deferred: start-up time

    data = io.inspect_file(path)  # header and payload checks without torch
    if data["schema"] == io.COMPRESSED_SCHEMA:
        from kvtool.formats.files import file_info  # deferred: the format's checks and byte report need torch

        data = file_info(path)
    data.pop("path", None)  # the envelope's input
    version = data.get("schema_version")
    return Outcome({**data, "schema_version": int(version) if str(version).isdigit() else version, "layers": held_layers(data)}, input=path)


def register(app: typer.Typer) -> None:
    add_commands(app, info)
