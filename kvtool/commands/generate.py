"""``kvtool generate``: continue from a saved cache with the model the file names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtool.commands._command import Outcome, add_commands, declare
from kvtool.commands._complete import complete_model
from kvtool.commands._common import (
    DevicesOpt,
    example_epilog,
    show,
)
from kvtool.core.progress import Progress

ORDER = 65
SHORT_HELP = "Continue generation from a saved or compressed cache"


def print_generated(outcome: Outcome) -> None:
    result = outcome.data
    show("[dim]{}; {} cached tokens ({}, {} cache) + {} prompt tokens[/dim]", result["model"], result["cached_tokens"], result["format"],
         result["mode"], result["prompt_tokens"])
    for text, ids in zip(result["text"], result["new_token_ids"]):
        if text or not ids:
            show("[bold]{}[/bold]{}", result["prompt"], text)
        else:  # a model without a tokenizer: the ids
            show("token ids {}", " ".join(str(i) for i in ids))
    show("[dim]{} new tokens in {} s on {}[/dim]", sum(len(ids) for ids in result["new_token_ids"]), f"{result['seconds']:.2f}", result["model_device"])


@declare(
    "generate",
    help="Continue generation (greedy) from a saved capture, compressed file or `export --to hf` file: the "
    "file's cached tokens, then --prompt, then new tokens, with the model the file names (--model to "
    "override; its shapes must match the file's model facts). Prints the new text.",
    epilog=example_epilog(
        "kvtool generate cap.safetensors --prompt ' In short,' --max-new-tokens 24",
        "kvtool generate cap.pagestat.safetensors --prompt ' In short,' --json",
        "kvtool generate cap70b.bitmap.safetensors --model random:llama3-70b --device auto   # a 70B spread over the GPUs",
    ),
    render=print_generated,
)
def generate(
    source: Annotated[Path, typer.Argument(help="A capture, compressed or hf-export file.", show_default=False)],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text appended after the cached tokens (empty: continue the cached text).")] = "",
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model: 'embedded', a local HF folder or a .gguf file (default: the file's).", autocompletion=complete_model)] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate.")] = 32,
    mode: Annotated[str, typer.Option("--mode", help="auto | live | dense | attend | ring: how a compressed file enters the model (auto: live for compressed files, dense for captures).")] = "auto",
    device: DevicesOpt = "auto",
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.hf.cache import generate as generate_from  # deferred: start-up time

    progress.stage(f"loading the model for {source.name} and generating {max_new_tokens} tokens")
    result = generate_from(source, prompt=prompt, model=model, max_new_tokens=max_new_tokens, device=device, mode=mode)
    result.pop("file", None)  # the envelope's input
    return Outcome(result, input=source)

def register(app: typer.Typer) -> None:
    add_commands(app, generate)
