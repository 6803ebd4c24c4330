"""``kvtool generate``: continue from a saved cache with the model the file names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.commands._common import (
    DebugOpt,
    JsonOpt,
    QuietOpt,
    console,
    emit_json,
    err_console,
    example_epilog,
    kvtool_command,
    quiet_enabled,
    show,
)

ORDER = 65
SHORT_HELP = "Continue generation from a saved or compressed cache"


def register(app: typer.Typer) -> None:
    @app.command(
        "generate",
        help="Continue generation (greedy) from a saved capture, compressed file or `export --to hf` file: the "
        "file's cached tokens, then --prompt, then new tokens, with the model the file names (--model to "
        "override; its shapes must match the file's model facts). Prints the new text.",
        epilog=example_epilog(
            "kvtool generate cap.safetensors --prompt ' In short,' --max-new-tokens 24",
            "kvtool generate cap.pagestat.safetensors --prompt ' In short,' --json",
        ),
    )
    @kvtool_command
    def generate(
        source: Annotated[Path, typer.Argument(help="A capture, compressed or hf-export file.", show_default=False)],
        prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text appended after the cached tokens (empty: continue the cached text).")] = "",
        model: Annotated[str | None, typer.Option("--model", "-m", help="Model: 'embedded', a local HF folder or a .gguf file (default: the file's).")] = None,
        max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate.")] = 32,
        mode: Annotated[str, typer.Option("--mode", help="auto | dense | attend | ring: how a compressed file enters the model (auto picks).")] = "auto",
        device: Annotated[str, typer.Option("--device", help="torch device for the model.")] = "cpu",
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        from kvtool.hf.cache import generate as generate_from  # deferred: start-up time

        if not json_out and not quiet_enabled(quiet):
            err_console.print(f"loading the model for {source} ...", markup=False)
        result = generate_from(source, prompt=prompt, model=model, max_new_tokens=max_new_tokens, device=device, mode=mode)
        if json_out:
            emit_json(result, input=source)
            return
        show("[dim]{}; {} cached tokens ({}, {} cache) + {} prompt tokens[/dim]", result["model"], result["cached_tokens"], result["format"],
             result["mode"], result["prompt_tokens"])
        for text in result["text"]:
            show("[bold]{}[/bold]{}", result["prompt"], text)
