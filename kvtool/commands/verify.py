"""``kvtool verify``: score a compressed file against the dense capture it came from."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.core.errors import UsageError
from kvtool.commands._command import Outcome, add_commands, declare
from kvtool.commands._common import (
    DevicesOpt,
    graded,
    verdict,
    ModelOpt,
    NoModelOpt,
    model_choice,
    NUMBER,
    console,
    example_epilog,
    make_table,
    params_text,
    show,
)
from kvtool.commands.eval import BACKEND_NAMES, NLL_NOTE, fmt_nll
from kvtool.core.progress import Progress

ORDER = 50
SHORT_HELP = "Fidelity of a compressed file: attention error, recall, model NLL"

THRESHOLD_HELP = "Exit 1 when missed (for CI gates)."


def parse_threshold(value: float | None, option: str, lo: float | None = None, hi: float | None = None) -> float | None:
    """A threshold option's value, checked: UsageError (one line) when it is NaN or out of range."""
    if value is None:
        return None
    if math.isnan(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f" between {lo} and {hi}" if lo is not None and hi is not None else (f" at least {lo}" if lo is not None else "")
        raise UsageError(f"{option} must be a number{rng}, got {value!r}")
    return value


def headline(report: dict[str, Any]) -> dict[str, float | None]:
    """The numbers a reading of the result starts from: overall attention error, cosine, worst
    cosine and recall, and with the model NLL increase, agreement and KL."""
    att, model = report["attention"], report.get("model_fidelity") or {}
    o = att["overall"]
    return {"rel_l2": o["rel_l2"], "cosine": o["cosine"], "min_cosine": o.get("min_cosine"), "recall": (att.get("recall") or {}).get("recall"),
            "nll_increase": model.get("nll_increase"), "agreement": model.get("agreement"), "kl": model.get("kl")}


def print_report(report: dict[str, Any]) -> None:
    att = report["attention"]
    params = params_text(att["params"])
    show("[bold]{}[/bold] ({}) vs {}: {} held-out queries, {} compressed tokens, backend {} on {}", att["format"], params,
         report["capture"], att["heldout"], att["prefix_tokens"], att["backend"], att["device"])
    triton = att["backend"] == "triton"
    cols = ["layer", "rel L2", "cosine", "min cos", "max abs", "recall", "stored %", "traffic %"] + (["kernel vs torch"] if triton else [])

    def cells(name: str, e: dict[str, Any], recall: float | None, stored: float, traffic: float, kernel: dict[str, Any] | None) -> list[Any]:
        row = [name, graded("rel_l2", e["rel_l2"]), graded("cosine", e["cosine"]), graded("min_cosine", e["min_cosine"]), e["max_abs"],
               graded("recall", recall), f"{100 * stored:.2f}", f"{100 * traffic:.2f}"]
        return row + ([kernel["rel_l2"]] if triton and kernel else [])

    layers = att["layers"].items() if isinstance(att["layers"], dict) else ((r["layer"], r) for r in att["layers"])
    rows = [cells(str(i), r["errors"], r["recall"]["recall"] if "recall" in r else None, r["stored_bytes"] / r["dense_bytes"],
                  r["traffic_bytes"] / r["dense_bytes"], r.get("kernel_vs_torch")) for i, r in layers]
    rows.append(cells("all", att["overall"], att["recall"]["recall"] if att["recall"] else None, att["storage_ratio"], att["traffic_ratio"],
                      att.get("kernel_vs_torch")))
    console.print(make_table("attention output on held-out queries (vs dense attention)", cols, rows))
    model = report.get("model_fidelity")
    if model is None:
        show("model-level fidelity skipped: {}", report.get("model_skipped"))
    else:
        mrows = [
            ("model", model["model"]),
            ("layers compressed", f"{len(model['compressed_layers'])} of {model['model_layers']}"),
            ("NLL dense (nats/token)", model["nll_dense"]),
            ("NLL lossy (nats/token)", model["nll_lossy"]),
            ("NLL increase (nats/token)", graded("nll_increase", model["nll_increase"], fmt_nll(model["nll_increase"]))),
            ("perplexity ratio", model["ppl_ratio"]),
            ("top-1 agreement", graded("agreement", model["agreement"])),
            ("KL(dense || lossy) mean (nats)", graded("kl", model["kl"])),
            ("KL max (nats)", model["max_kl"]),
        ]
        if "first_divergence" in model:
            mrows.append(("greedy tokens until divergence", f"{model['first_divergence']} of {model['generate']}"))
        console.print(make_table(f"continuation of {model['positions']} tokens through the model", ["what", "value"], mrows))
        if model["nll_increase"] is not None and model["nll_increase"] < 0:
            console.print(NLL_NOTE, markup=False)
    line = verdict(headline(report))
    if line:
        console.print(line + " (bands: docs/fidelity.md, Reading the numbers)", markup=False)


def print_verified(outcome: Outcome) -> None:
    report = outcome.data
    print_report(report)
    t = report["thresholds"]
    for line in t["missed"]:
        show("[red]FAILED[/red]: {}", line)
    if any(t[k] is not None for k in ("max_nll_increase", "min_agreement", "max_error")) and not t["missed"]:
        console.print("[green]passed[/green]: every threshold met")


@declare(
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
    render=print_verified,
)
def verify(
    compressed: Annotated[Path, typer.Argument(help="A compressed file made by `kvtool compress`.", show_default=False)],
    capture: Annotated[Path | None, typer.Option("--capture", "-c", help="The source capture (default: found by the sha256 and path recorded in the file).", dir_okay=False)] = None,
    heldout: Annotated[int | None, typer.Option(help="Held-out queries to score (default: all the file keeps dense, 64 unless compressed otherwise).")] = None,
    backend: Annotated[str, typer.Option(help=f"Attention path for the compressed prefix: {'|'.join(BACKEND_NAMES)} (triton: the format's kernel, torch: its reference; auto: the kernel on a CUDA device).")] = "auto",
    model: ModelOpt = None,
    no_model: NoModelOpt = False,
    generate: Annotated[int, typer.Option(help="Greedy tokens generated after the continuation on both caches.")] = 16,
    max_nll_increase: Annotated[float | None, typer.Option(click_type=NUMBER, help=f"Largest allowed NLL increase in nats/token. {THRESHOLD_HELP}")] = None,
    min_agreement: Annotated[float | None, typer.Option(click_type=NUMBER, help=f"Smallest allowed top-1 agreement (0..1). {THRESHOLD_HELP}")] = None,
    max_error: Annotated[float | None, typer.Option(click_type=NUMBER, help=f"Largest allowed attention-output relative L2 error. {THRESHOLD_HELP}")] = None,
    device: DevicesOpt = "auto",
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.analysis.verify import check_thresholds, verify_file  # deferred: start-up time

    model, use_model = model_choice(model, no_model)
    nll_t = parse_threshold(max_nll_increase, "--max-nll-increase")
    agree_t = parse_threshold(min_agreement, "--min-agreement", 0.0, 1.0)
    err_t = parse_threshold(max_error, "--max-error", 0.0)
    if not use_model and (nll_t is not None or agree_t is not None):
        raise UsageError("--max-nll-increase and --min-agreement need the model; drop --no-model")
    report = verify_file(compressed, capture, heldout, backend, model, use_model, generate, progress=progress, device=device)
    if report["model_fidelity"] is None and (nll_t is not None or agree_t is not None):
        raise UsageError(f"--max-nll-increase / --min-agreement need model-level fidelity, which was skipped: {report['model_skipped']}")
    missed = check_thresholds(report, nll_t, agree_t, err_t)
    report["thresholds"] = {"max_nll_increase": nll_t, "min_agreement": agree_t, "max_error": err_t, "missed": missed, "passed": not missed}
    from kvtool.analysis.bands import grades  # deferred: start-up time

    report["grades"] = grades(headline(report))
    return Outcome(report, input=compressed, exit_code=1 if missed else 0)

def register(app: typer.Typer) -> None:
    add_commands(app, verify)
