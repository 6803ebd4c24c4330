"""``kvtool eval``: sweep formats and parameters over captures; table, JSON, CSV and frontier plot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.names import FORMAT_ALIASES
from kvtool.core.sample import resolve_sample
from kvtool.commands._catalog import format_summaries
from kvtool.commands._complete import EVICT_POLICIES, complete_format
from kvtool.commands._command import Api, Outcome, add_commands, declare
from kvtool.commands._common import (
    DevicesOpt,
    graded,
    ModelOpt,
    NoModelOpt,
    model_choice,
    console,
    debug_enabled,
    deprecated,
    example_epilog,
    make_table,
    show,
)
from kvtool.core.progress import Progress

ORDER = 55
SHORT_HELP = "Sweep formats and parameters; fidelity vs bytes frontier"

# the library's kvtool.analysis.fidelity.BACKENDS and kvtool.analysis.sweep.METRICS, named here so
# that --help needs no torch (tests/test_cli.py checks they agree)
BACKEND_NAMES = ("auto", "torch", "triton")
METRIC_NAMES = ("rel_l2", "cosine", "recall", "agreement", "nll_increase", "kl", "task_accuracy")

def split_inputs(items: list[str], formats: list[str]) -> tuple[list[Path], list[str]]:
    """Positional arguments are captures; one that is not a file but names a registered format (the
    tail of ``--formats a b c``) is a sweep spec."""
    # formats in the formats folder, and any registered at run time (a plug-in, a test's format)
    runtime = getattr(sys.modules.get("kvtool.formats.base"), "FORMATS", {})
    known = set(format_summaries()) | set(runtime) | set(FORMAT_ALIASES) | set(EVICT_POLICIES)
    captures: list[Path] = []
    specs = list(formats)
    for item in items:
        name = item.partition(":")[0]
        if not Path(item).exists() and (name in known or ":" in item and "=" in item):
            specs.append(item)
        else:
            captures.append(Path(item))
    if not captures:
        raise UsageError("give at least one capture file")
    for c in captures:
        if not c.exists():
            raise UsageError(f"capture {c}: no such file")
    return captures, specs


def _pct(v: Any) -> Any:
    return None if v is None else f"{100.0 * v:.2f}"


def fmt_nll(v: float | None) -> str | None:
    """An NLL increase in nats/token, signed; a negative one (the lossy cache scored a little better on
    this text) is marked ``*``, which the footnote under the table explains as noise."""
    if v is None:
        return None
    return f"{v:+.4f}" + ("*" if v < 0 else "")


def fmt_fixed(v: float | None, digits: int = 4) -> str | None:
    return None if v is None else f"{v:.{digits}f}"


NLL_NOTE = ("* a negative NLL increase means the compressed cache predicted this continuation slightly better than the "
            "dense one; at this size it is noise from one text, not a gain")


BAND_NOTE = "colours: green good, yellow fair, red poor (bands: docs/fidelity.md, Reading the numbers)"


def _graded_cells(r: dict[str, Any]) -> list[Any]:
    """rel L2, cosine, recall, NLL increase and agreement of a row, each coloured by its band."""
    nll = r.get("nll_increase")
    return [graded("rel_l2", r.get("rel_l2"), fmt_fixed(r.get("rel_l2"))), graded("cosine", r.get("cosine"), fmt_fixed(r.get("cosine"))),
            graded("recall", r.get("recall"), fmt_fixed(r.get("recall"))), graded("nll_increase", nll, fmt_nll(nll)),
            graded("agreement", r.get("agreement"), fmt_fixed(r.get("agreement")))]


def print_results(result: dict[str, Any]) -> None:
    rows = result["rows"]
    multi = len({r["capture"] for r in rows}) > 1
    cols = (["capture"] if multi else []) + ["format", "parameters", "stored %", "traffic %", "rel L2", "cosine", "recall", "NLL + (nats/token)", "agreement"]

    def cells(r: dict[str, Any]) -> list[Any]:
        return ([Path(r["capture"]).name] if multi else []) + [
            r["format"], r["params_text"], _pct(r.get("storage_ratio")), _pct(r.get("traffic_ratio")), *_graded_cells(r),
        ]

    with_model = any(r.get("nll_increase") is not None or r.get("agreement") is not None for r in rows)
    title = "sweep (attention on held-out queries; model on the continuation)" if with_model else "sweep (attention on held-out queries; no model)"
    sweep = [r for r in rows if r.get("comparison") is None and not r.get("skipped")]
    n = max((len(r.get("cases", [])) for r in rows), default=0)
    if n > 1 and any(r.get("nll_increase_mean") is not None for r in rows):
        cols = cols + [f"NLL + mean [95%] over {n} cases (nats/token)", "top-1 mean [95%]"]
        plain = cells

        def cells(r: dict[str, Any]) -> list[Any]:  # noqa: F811
            if r.get("nll_increase_mean") is None:
                return plain(r) + [None, None]
            mean = r["nll_increase_mean"]
            return plain(r) + [graded("nll_increase", mean, f"{fmt_nll(mean)} [{r['nll_increase_lo']:+.4f}, {r['nll_increase_hi']:+.4f}]"),
                               graded("agreement", r["agreement_mean"], f"{r['agreement_mean']:.4f} [{r['agreement_lo']:.4f}, {r['agreement_hi']:.4f}]")]
    if sweep:
        console.print(make_table(title, cols, [cells(r) for r in sweep]))
    paper = [r for r in rows if r.get("comparison") is not None and not r.get("skipped")]
    pcols = (["capture"] if multi else []) + ["variant", "stored %", "rel L2", "cosine", "recall", "NLL + (nats/token)", "agreement"]
    for comparison in dict.fromkeys(r["comparison"] for r in paper):
        prow = [([Path(r["capture"]).name] if multi else []) + [r["label"], _pct(r.get("storage_ratio")), *_graded_cells(r)]
                for r in paper if r["comparison"] == comparison]
        console.print(make_table(comparison, pcols, prow))
    if any((r.get("nll_increase") or 0) < 0 or (r.get("nll_increase_mean") or 0) < 0 for r in sweep + paper):
        console.print(NLL_NOTE, markup=False)
    if sweep or paper:
        console.print(BAND_NOTE, markup=False)
    absent = sorted({r["format"] for r in rows if r.get("skipped", "").endswith("is not in this kvtool")})
    if absent:
        n = sum(1 for r in rows if r["format"] in absent)
        show("skipped {} points of formats not in this kvtool: {}", n, ", ".join(absent))
    skipped = [r for r in rows if r.get("skipped") and r["format"] not in absent]
    if skipped:
        console.print(make_table("skipped points", ["format", "parameters", "why"], [(r["format"], r["params_text"], r["skipped"]) for r in skipped]))
    if result["resumed"]:
        show("resumed: {} finished points were read from {}, not recomputed", result["resumed"], result["files"]["json"])
    if "," in result.get("device", "") or "," in result.get("model_device", "") or ";" in result.get("model_device", ""):
        show("layers ran on {}" + ("; the model on {}" if result.get("model_device") else ""), result["device"], result.get("model_device"))
    show("wrote {}", ", ".join(v for v in result["files"].values()))


@declare(
    "eval",
    help="Sweep formats and parameters over one or more captures: storage and traffic ratio, attention-output "
    "error and recall on held-out queries, and (with the model) NLL increase and next-token agreement. Writes "
    "eval.json, eval.csv and the compression-vs-fidelity frontier plot; a rerun resumes finished points. "
    "Sweeps: NAME:key=v1,v2,...; without --formats every registered format is swept with default values, "
    "plus the paper comparison rows.",
    epilog=example_epilog(
        "kvtool eval sample: --no-model --out-dir sample.eval",
        "kvtool eval cap.safetensors --formats 'bitmap:sparsity=0.5,0.7,0.9' 'signvq:bits=2,4' --no-paper",
        "kvtool eval cap.safetensors --formats 'pagestat:budget=128,512,score=unique,quest' --metric recall --x traffic --json",
        "kvtool eval cap70b.safetensors --formats 'bitmap:sparsity=0.5,0.7' --no-paper --no-model --device cuda:0,cuda:1   # layers over 2 GPUs",
    ),
    render=lambda outcome: print_results(outcome.view),
    api="evaluate",  # eval is a Python builtin
)
def eval_cmd(
    captures: Annotated[list[str], typer.Argument(help="Capture files (and, after --formats, more sweep specs).", show_default=False)],
    formats: Annotated[list[str] | None, typer.Option("--formats", "-F", help="Sweep spec NAME[:key=v1,v2,...]; repeatable, or several after one --formats.", autocompletion=complete_format), Api(positional=True)] = None,
    paper: Annotated[bool | None, typer.Option("--paper/--no-paper", help="Add the papers' comparison rows (default: on without --formats).")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out-dir", help="Folder for eval.json, eval.csv and the plot (default: CAPTURE.eval/).", file_okay=False), Api(positional=True)] = None,
    out_old: Annotated[Path | None, typer.Option("--out", "-o", hidden=True, help="Deprecated name of --out-dir.", file_okay=False)] = None,
    heldout: Annotated[int, typer.Option(help="Last tokens kept dense; their queries are scored.")] = 64,
    backend: Annotated[str, typer.Option(help=f"{'|'.join(BACKEND_NAMES)}: attention path for the compressed prefix.")] = "auto",
    model: ModelOpt = None,
    no_model: NoModelOpt = False,
    generate: Annotated[int, typer.Option(help="Greedy tokens to compare after the continuation.")] = 0,
    metric: Annotated[str | None, typer.Option(help=f"Frontier y axis: {'|'.join(METRIC_NAMES)} (default: agreement with a model, else rel_l2).")] = None,
    x: Annotated[str, typer.Option("--x", help="Frontier x axis: storage|traffic (% of dense bytes).")] = "storage",
    layers: Annotated[str | None, typer.Option("--layers", help="Compress only these layers, e.g. 0,7,15,23 (the model runs the others densely; default: all captured).")] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Recompute every point instead of resuming from eval.json.")] = False,
    device: DevicesOpt = "auto",
    threads: Annotated[int, typer.Option(help="Torch CPU threads (many small operations: 1 is fastest on a shared machine).", min=1)] = 1,
    texts: Annotated[list[str] | None, typer.Option("--texts", help="Also score the model on held-out texts: 'shipped' (kvtool's prose, code, dialogue) or your text files; rows gain mean and 95% interval over the capture and the texts (about 3 s more per point and text).")] = None,
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.analysis.evaluate import run_eval  # deferred: start-up time

    captures, specs = split_inputs([str(resolve_sample(i)) for i in captures], formats or [])
    use_paper = (not specs) if paper is None else paper
    if out_old is not None:
        deprecated("--out/-o", "--out-dir")
        out_dir = out_dir or out_old
    if out_dir is None:
        # next to the capture; for the bundled sample in the current folder (never inside the package)
        from kvtool.core.outputs import output_beside  # deferred: start-up time

        out_dir = output_beside(captures[0], f"{captures[0].stem}.eval")
    model, use_model = model_choice(model, no_model)
    result = run_eval(captures, specs, out_dir, use_paper, heldout, backend, model, use_model, generate, metric, x, force,
                      progress=progress, debug=debug_enabled(), layers=layers, device=device, threads=threads, texts=texts)
    skipped = [r for r in result["rows"] if r.get("skipped")]
    if result["rows"] and len(skipped) == len(result["rows"]):
        first = skipped[0]
        raise BadDataError(f"no point of the sweep could run: all {len(skipped)} were skipped (first, {first.get('spec')}: {first['skipped']})")
    data = {"files": result["files"], "resumed": result["resumed"], "metric": result["metric"], "x": result["x"], "device": result["device"],
            **({"model_device": result["model_device"]} if "model_device" in result else {}), "points": result["rows"]}
    return Outcome(data, inputs=captures, output=out_dir, view=result)


def register(app: typer.Typer) -> None:
    add_commands(app, eval_cmd)
