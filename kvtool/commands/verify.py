"""``kvtool verify``: score a compressed file against the dense capture it came from."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from .. import io
from ..errors import BadDataError, UsageError
from ..fidelity import BACKENDS, attention_fidelity, check_model_facts, default_model_spec, dense_reference, find_source, model_fidelity
from ..formats.base import CompressedCache, load_compressed
from ..placement import DEVICE_HELP, resolve_device
from ..streaming import open_capture
from ._common import DebugOpt, JsonOpt, console, emit_json, example_epilog, kvtool_command, make_table, progress_bar

ORDER = 50

THRESHOLD_HELP = "Exit 1 when missed (for CI gates)."


def parse_threshold(text: str | None, option: str, lo: float | None = None, hi: float | None = None) -> float | None:
    """A threshold option's float value; UsageError (one line) when it is not a number or out of range."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{option} must be a number, got {text!r}") from None
    if math.isnan(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f" between {lo} and {hi}" if lo is not None and hi is not None else (f" at least {lo}" if lo is not None else "")
        raise UsageError(f"{option} must be a number{rng}, got {text!r}")
    return value


def load_model(spec: str, facts, device: Any = None) -> tuple[Any, str]:
    """Load a model for model-level fidelity and check it against the capture's facts. On a CUDA
    ``device`` it loads there in the capture's dtype; on the CPU (the default) as it is stored."""
    from .. import models

    if device is not None and torch.device(device).type == "cuda":
        model, _tok, source = models.load(spec, device=str(device), torch_dtype=facts.torch_dtype)
    else:
        model, _tok, source = models.load(spec)
    name = source.name if spec in (None, "", "embedded", "smollm2") else str(spec)
    check_model_facts(model, facts, name)
    return model, name


def verify_file(
    compressed: Path,
    capture: Path | None = None,
    heldout: int | None = None,
    backend: str = "auto",
    model: str | None = None,
    use_model: bool = True,
    generate: int = 16,
    quiet: bool = True,
    device: str | None = None,
) -> dict[str, Any]:
    """Attention-level and (with a model) model-level fidelity of a compressed file; see
    :mod:`kvtool.fidelity`. The capture's layers are read one at a time onto ``device`` (default:
    CUDA when present), where the references, the format and the model run. Returns the report
    dict that ``--json`` prints."""
    if generate < 0:
        raise UsageError(f"--generate must be 0 or more, got {generate}")
    dev = resolve_device(device)
    cc: CompressedCache = load_compressed(compressed)
    source_path = find_source(cc, compressed, capture)
    source = open_capture(source_path, layers=cc.layer_indices, parts=("keys", "values", "queries"), device=dev)
    report: dict[str, Any] = {"file": str(compressed), "capture": str(source_path), "model_facts": cc.facts.name}
    with progress_bar(quiet) as bar:
        task = bar.add_task("attention", total=len(cc.layer_indices))
        report["attention"] = attention_fidelity(cc, source, heldout, backend, progress=lambda i: bar.advance(task), device=dev)
    spec = default_model_spec(cc.facts, model) if use_model else None
    if spec is None:
        report["model"] = None
        report["model_skipped"] = "--no-model" if not use_model else (
            f"the capture came from {cc.facts.name} ({cc.facts.source}); pass --model to score the continuation"
        )
        return report
    try:
        mdl, name = load_model(spec, cc.facts, dev)
    except BadDataError as exc:
        if model:
            raise
        raise BadDataError(f"{exc} (or pass --no-model for attention-level fidelity only)") from None
    with progress_bar(quiet) as bar:
        task = bar.add_task("model", total=2)
        ref = dense_reference(mdl, cc.token_ids, cc.prefix_tokens, generate, source, name)
        bar.advance(task)
        model_backend = report["attention"]["backend"]
        report["model"] = model_fidelity(mdl, cc, ref, generate, backend=model_backend)
        bar.advance(task)
    report["model"]["name"] = name
    return report


def check_thresholds(report: dict[str, Any], max_nll_increase: float | None, min_agreement: float | None, max_error: float | None) -> list[str]:
    """Human-readable lines for every threshold missed."""
    missed = []
    model = report.get("model")
    if max_error is not None:
        err = report["attention"]["overall"]["rel_l2"]
        if not err <= max_error:
            missed.append(f"attention-output relative L2 error {err:.4g} > --max-error {max_error:g}")
    if model is not None and max_nll_increase is not None and not model["nll_increase"] <= max_nll_increase:
        missed.append(f"NLL increase {model['nll_increase']:.4g} > --max-nll-increase {max_nll_increase:g}")
    if model is not None and min_agreement is not None and not model["agreement"] >= min_agreement:
        missed.append(f"top-1 agreement {model['agreement']:.4g} < --min-agreement {min_agreement:g}")
    return missed


def print_report(report: dict[str, Any]) -> None:
    att = report["attention"]
    params = ", ".join(f"{k}={v}" for k, v in att["params"].items()) or "defaults"
    console.print(
        f"[bold]{att['format']}[/bold] ({params}) vs {report['capture']}: {att['heldout']} held-out queries, "
        f"{att['prefix_tokens']} compressed tokens, backend {att['backend']} on {att['device']}"
    )
    triton = att["backend"] == "triton"
    cols = ["layer", "rel L2", "cosine", "min cos", "max abs", "recall", "stored %", "traffic %"] + (["kernel vs torch"] if triton else [])
    rows = []
    for i, r in att["layers"].items():
        e = r["errors"]
        row = [str(i), e["rel_l2"], e["cosine"], e["min_cosine"], e["max_abs"], r["recall"]["recall"] if "recall" in r else None,
               100 * r["stored_bytes"] / r["dense_bytes"], 100 * r["traffic_bytes"] / r["dense_bytes"]]
        if triton:
            row.append(r["kernel_vs_torch"]["rel_l2"])
        rows.append(row)
    o = att["overall"]
    row = ["all", o["rel_l2"], o["cosine"], o["min_cosine"], o["max_abs"], att["recall"]["recall"] if att["recall"] else None,
           100 * att["storage_ratio"], 100 * att["traffic_ratio"]]
    if triton:
        row.append(att["kernel_vs_torch"]["rel_l2"])
    rows.append(row)
    console.print(make_table("attention output on held-out queries (vs dense attention)", cols, rows))
    model = report.get("model")
    if model is None:
        console.print(f"model-level fidelity skipped: {report.get('model_skipped')}")
        return
    mrows = [
        ("model", model["name"]),
        ("layers compressed", f"{len(model['layers_compressed'])} of {model['model_layers']}"),
        ("NLL dense (nats/token)", model["nll_dense"]),
        ("NLL lossy", model["nll_lossy"]),
        ("NLL increase", model["nll_increase"]),
        ("perplexity ratio", model["ppl_ratio"]),
        ("top-1 agreement", model["agreement"]),
        ("KL(dense || lossy) mean", model["kl"]),
        ("KL max", model["max_kl"]),
    ]
    if "first_divergence" in model:
        mrows.append(("greedy tokens until divergence", f"{model['first_divergence']} of {model['generate']}"))
    console.print(make_table(f"continuation of {model['positions']} tokens through the model", ["what", "value"], mrows))


def register(app: typer.Typer) -> None:
    @app.command(
        "verify",
        help="Score a compressed file against the dense capture it came from: attention-output error, cosine and "
        "attention-mass recall of the held-out queries per layer, and (with the model) NLL, perplexity ratio, "
        "top-1 agreement, KL and greedy divergence of the continuation run with the format inside attention.",
        epilog=example_epilog(
            "kvtool verify cap.bitmap.safetensors",
            "kvtool verify cap.signvq.safetensors --capture cap.safetensors --generate 32 --json",
            "kvtool verify cap.bitmap.safetensors --max-nll-increase 0.05 --min-agreement 0.95   # CI gate",
            "kvtool verify cap.bitmap.safetensors --device cuda --backend torch --no-model   # torch reference on the GPU",
        ),
    )
    @kvtool_command
    def verify(
        compressed: Annotated[Path, typer.Argument(help="A compressed file made by `kvtool compress`.", show_default=False)],
        capture: Annotated[Path | None, typer.Option("--capture", "-c", help="The source capture (default: found by the sha256 and path recorded in the file).", dir_okay=False)] = None,
        heldout: Annotated[int | None, typer.Option(help="Held-out queries to score (default: all the file keeps dense, 64 unless compressed otherwise).")] = None,
        backend: Annotated[str, typer.Option(help=f"Attention path for the compressed prefix: {'|'.join(BACKENDS)} (triton: the format's kernel, torch: its reference; auto: the kernel on a CUDA device).")] = "auto",
        model: Annotated[str | None, typer.Option("--model", "-m", help="Model for the continuation (default: the embedded one when the capture came from it).")] = None,
        no_model: Annotated[bool, typer.Option("--no-model", help="Skip model-level fidelity.")] = False,
        generate: Annotated[int, typer.Option(help="Greedy tokens generated after the continuation on both caches.")] = 16,
        max_nll_increase: Annotated[str | None, typer.Option(help=f"Largest allowed NLL increase in nats/token. {THRESHOLD_HELP}")] = None,
        min_agreement: Annotated[str | None, typer.Option(help=f"Smallest allowed top-1 agreement (0..1). {THRESHOLD_HELP}")] = None,
        max_error: Annotated[str | None, typer.Option(help=f"Largest allowed attention-output relative L2 error. {THRESHOLD_HELP}")] = None,
        device: Annotated[str | None, typer.Option("--device", help=DEVICE_HELP)] = None,
        json_out: JsonOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        nll_t = parse_threshold(max_nll_increase, "--max-nll-increase")
        agree_t = parse_threshold(min_agreement, "--min-agreement", 0.0, 1.0)
        err_t = parse_threshold(max_error, "--max-error", 0.0)
        if no_model and (nll_t is not None or agree_t is not None):
            raise UsageError("--max-nll-increase and --min-agreement need the model; drop --no-model")
        report = verify_file(compressed, capture, heldout, backend, model, not no_model, generate, quiet=json_out, device=device)
        if report["model"] is None and (nll_t is not None or agree_t is not None):
            raise UsageError(f"--max-nll-increase / --min-agreement need model-level fidelity, which was skipped: {report['model_skipped']}")
        missed = check_thresholds(report, nll_t, agree_t, err_t)
        report["thresholds"] = {"max_nll_increase": nll_t, "min_agreement": agree_t, "max_error": err_t, "missed": missed, "passed": not missed}
        if json_out:
            emit_json(report)
        else:
            print_report(report)
            for line in missed:
                console.print(f"[red]FAILED[/red]: {line}")
            if any(v is not None for v in (nll_t, agree_t, err_t)) and not missed:
                console.print("[green]passed[/green]: every threshold met")
        if missed:
            raise typer.Exit(1)
