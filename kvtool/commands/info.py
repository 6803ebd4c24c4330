"""``kvtool info``: what a kvtool file holds."""

from __future__ import annotations

import typer

from kvtool.formats.files import file_info
from kvtool.commands._common import (
    DebugOpt,
    InputArg,
    JsonOpt,
    console,
    emit_json,
    example_epilog,
    fmt_bytes,
    kvtool_command,
    make_table,
)
from kvtool.commands.compress import print_report

ORDER = 20
SHORT_HELP = "Show what a kvtool file holds: schema, model facts, tensors, bytes"


def register(app: typer.Typer) -> None:
    @app.command(
        "info",
        help="Show a kvtool file's schema, model facts, tensors (names, shapes, dtypes, bytes) and totals.",
        epilog=example_epilog("kvtool info samples/smollm2-sample.safetensors", "kvtool info cap.bitmap.safetensors --json"),
    )
    @kvtool_command
    def info(path: InputArg, json_out: JsonOpt = False, debug: DebugOpt = False) -> None:
        data = file_info(path)
        if json_out:
            emit_json(data)
            return
        meta = data["metadata"]
        model = meta.get("kvtool.model", {})
        console.print(f"[bold]{data['path']}[/bold]: {data['schema']} v{data['schema_version']} (kvtool {meta.get('kvtool.version', '?')})")
        console.print(
            f"model {model.get('name')} ({model.get('architecture')}): {model.get('num_layers')} layers, {model.get('num_heads')} heads, "
            f"{model.get('num_kv_heads')} KV heads, head_dim {model.get('head_dim')}, dtype {model.get('dtype')}, RoPE applied: {model.get('rope_applied')}"
        )
        for key in ("kvtool.format", "kvtool.params", "kvtool.info"):
            if key in meta:
                console.print(f"{key.removeprefix('kvtool.')}: {meta[key]}")
        rows = [(t["name"], t["dtype"], "x".join(map(str, t["shape"])), fmt_bytes(t["bytes"])) for t in data["tensors"]]
        if len(rows) > 40:
            rows = rows[:20] + [("...", f"{len(rows) - 40} more", "", "")] + rows[-20:]
        console.print(make_table("tensors", ["tensor", "dtype", "shape", "bytes"], rows))
        console.print(f"{len(data['tensors'])} tensors, {fmt_bytes(data['tensor_bytes'])} of tensor data, file {fmt_bytes(data['file_bytes'])}")
        if "compression" in data:
            print_report(data["compression"])
