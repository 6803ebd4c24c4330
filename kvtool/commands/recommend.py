"""``kvtool recommend``: a compression plan per layer / KV head for a byte budget, checked on the model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.core.errors import UsageError
from kvtool.core.sample import resolve_sample
from kvtool.commands._command import Outcome, add_commands, declare
from kvtool.commands._common import (
    DevicesOpt,
    graded,
    ModelOpt,
    NoModelOpt,
    model_choice,
    console,
    example_epilog,
    make_table,
)
from kvtool.commands.eval import NLL_NOTE, fmt_nll
from kvtool.commands.verify import THRESHOLD_HELP
from kvtool.core.progress import Progress

ORDER = 52
SHORT_HELP = "A compression plan per layer / KV head for a byte budget"


def parse_nll_gate(text: str | None) -> tuple[float, bool] | None:
    """``1%`` -> (0.01, relative); ``0.05`` -> (0.05, nats/token)."""
    if text is None:
        return None
    t = text.strip()
    rel = t.endswith("%")
    try:
        value = float(t[:-1] if rel else t)
    except ValueError:
        raise UsageError(f"--max-nll-increase must be a number (nats/token) or a share like 1%, got {text!r}") from None
    return (value / 100 if rel else value), rel


def plan_paths(output: Path, budgets: list[dict[str, Any]]) -> list[Path]:
    if len(budgets) == 1:
        return [output]
    return [output.with_name(f"{output.stem}-{100 * b['fraction']:.0f}{output.suffix or '.json'}") for b in budgets]


def _ci(iv: dict[str, Any]) -> str:
    """``mean [lo, hi]`` with 4 decimals (signed for NLL increases, ``*`` on a negative mean)."""
    if not iv or iv.get("mean") is None:
        return "-"
    signed = iv["mean"] < 0 or (iv.get("lo") is not None and iv["lo"] < 0)
    f = (lambda v: f"{v:+.4f}") if signed else (lambda v: f"{v:.4f}")
    star = "*" if iv["mean"] < 0 else ""
    if iv["n"] < 2:
        return f(iv["mean"]) + star
    return f"{f(iv['mean'])}{star} [{f(iv['lo'])}, {f(iv['hi'])}]"


def gate(result: dict[str, Any], limit: tuple[float, bool] | None) -> list[str]:
    """Lines for each budget whose plan misses ``--max-nll-increase`` (mean over the cases)."""
    if limit is None:
        return []
    value, rel = limit
    missed = []
    for b in result["budgets"]:
        check = (b.get("check") or {}).get(b.get("plan_label"))
        if check is None:
            continue
        got = check["relative_nll_increase" if rel else "nll_increase"]["mean"]
        if not got <= value:
            unit = f"{100 * got:.2f}% > {100 * value:g}%" if rel else f"{got:.4g} > {value:g} nats/token"
            missed.append(f"budget {b['budget']}: plan's NLL increase {unit} (--max-nll-increase)")
    return missed


def print_tasks_result(result: dict[str, Any], paths: list[Path]) -> None:
    cal = result["calibration"]
    console.print(f"[bold]--objective tasks[/bold]: {result['model']}, {len(result['menu'])} candidates x {result['sensitivity']['groups']} "
                  f"{'KV heads' if result['per_head'] else 'layers'}, calibrated on {cal['samples']} sample(s) per task and length "
                  f"(seed {cal['seed']}): {', '.join(cal['tasks'])} at {', '.join(map(str, cal['lengths']))} tokens ({result['sensitivity']['seconds']} s)")
    for b, path in zip(result["budgets"], paths):
        console.print(f"\n[bold]budget {b['budget']}[/bold] = {100 * b['fraction']:.2f}% of the float16 bytes"
                      + (" (servable: one token budget per layer)" if result.get("servable") else ""))
        console.print(f"plan: {100 * b['predicted']['exact_storage_ratio']:.2f}% of the float16 bytes, predicted loss {b['predicted']['loss']:.4g}")
        check = b.get("task_check")
        if check:
            rows = []
            for r in sorted(check["by_setting"], key=lambda r: -(r["accuracy"] or 0)):
                rows.append([r["setting"], f"{100 * r['storage_ratio']:.1f}", f"{100 * r['accuracy']:.0f}% [{100 * r['lo']:.0f}, {100 * r['hi']:.0f}]", r["n"],
                             "-" if r["kept_of_dense"] is None else f"{100 * r['kept_of_dense']:.0f}%"])
            console.print(make_table("task check (other seed than the calibration): plan, dense and every budget-filling uniform family",
                                     ["setting", "stored %", "accuracy [95%]", "samples", "of dense"], rows))
        console.print(f"wrote {path}   (apply: kvtool compress CAPTURE --plan {path} -o out.safetensors, or kvtool tasks --methods plan:{path})")
    console.print(f"{result['seconds']} s in all")


def print_result(result: dict[str, Any], paths: list[Path]) -> None:
    s = result["sensitivity"]
    console.print(
        f"[bold]{Path(result['capture']).name}[/bold]: {result['model_facts']['name']}, {len(result['menu'])} candidates x "
        f"{s['groups']} {'KV heads' if result['per_head'] else 'layers'}, sensitivity on {result['heldout']} held-out queries "
        f"over {s['prefix_tokens']} prefix tokens, calibrated on the {'prompt' if result['calibrate'] == 'prefix' else 'held-out'} queries ({s['seconds']} s)"
    )
    for b, path in zip(result["budgets"], paths):
        console.print(f"\n[bold]budget {b['budget']}[/bold] = {100 * b['fraction']:.2f}% of the dense bytes ({b['how']})")
        plan = b["plan"]
        counts: dict[str, int] = {}
        for i, specs in plan.layers.items():
            for sp in specs * (result["model_facts"]["num_kv_heads"] if len(specs) == 1 else 1):
                counts[sp] = counts.get(sp, 0) + 1
        rows = [(sp, n, ", ".join(str(i) for i, specs in sorted(plan.layers.items()) if sp in specs)) for sp, n in sorted(counts.items(), key=lambda kv: -kv[1])]
        console.print(make_table(f"plan: {100 * b['predicted']['exact_storage_ratio']:.2f}% of the dense bytes, predicted loss {b['predicted']['loss']:.4g}",
                                 ["format", "KV heads", "layers"], rows))
        check = b.get("check")
        if check:
            cases = result["cases"]
            cols = ["format", "stored %", f"NLL + ({cases[0]}, nats/token)", f"top-1 ({cases[0]})", f"KL ({cases[0]}, nats)"]
            if len(cases) > 1:
                cols += [f"NLL + mean [95%] over {len(cases)} cases", "top-1 mean [95%]", "KL mean [95%]"]
            table_rows = []
            negative = False
            for label, sc in check.items():
                c0 = sc["cases"][0]
                family = next((f for f, sp in (b.get("uniform_fills") or {}).items() if sp == label), None)
                name = label if label == b["plan_label"] else f"uniform {family + ': ' if family else ''}{label}" + (" (best that fills the budget)" if label == b["best_uniform"] else "")
                row = [name, f"{100 * c0['storage_ratio']:.2f}", graded("nll_increase", c0["nll_increase"], fmt_nll(c0["nll_increase"])),
                       graded("agreement", c0["agreement"]), graded("kl", c0["kl"])]
                negative |= c0["nll_increase"] < 0
                if len(cases) > 1:
                    if len(sc["cases"]) > 1:
                        iv = sc["nll_increase"]
                        negative |= iv["mean"] < 0
                        row += [graded("nll_increase", iv["mean"], _ci(iv)), graded("agreement", sc["agreement"]["mean"], _ci(sc["agreement"])),
                                graded("kl", sc["kl"]["mean"], _ci(sc["kl"]))]
                    else:
                        row += ["-", "-", "-"]
                table_rows.append(row)
            st = result.get("score_tokens") or {}
            console.print(make_table(f"model check on {result['model']} (the capture's continuation of {result['heldout']} tokens; "
                                     f"{st.get('texts', result['heldout'])} tokens of each text)", cols, table_rows))
            if negative:
                console.print(NLL_NOTE, markup=False)
        else:
            fit = sorted(b["uniform"], key=lambda r: r["loss"])[:3]
            if fit:
                console.print(make_table("best uniform settings that fit (predicted)", ["setting", "stored %", "loss"],
                                         [(r["spec"], f"{100 * r['storage_ratio']:.2f}", r["loss"]) for r in fit]))
        console.print(f"wrote {path}   (apply: kvtool compress {result['capture']} --plan {path} -o out.safetensors)")
    if result.get("model_skipped"):
        console.print(f"model check skipped: {result['model_skipped']}")
    if result.get("dropped"):
        console.print("candidates dropped: " + "; ".join(f"{k} ({v})" for k, v in result["dropped"].items()))
    console.print(f"{result['seconds']} s in all")


def _check_json(check: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """A budget's model check as a list of ``{"setting", ...}`` (the settings are specs, not keys)."""
    if check is None:
        return None
    return [{"setting": label, **scores} for label, scores in check.items()]


def recommend_json(result: dict[str, Any], paths: list[Path], missed: list[str]) -> dict[str, Any]:
    """The ``--json`` object of recommend (docs/cli.md): the capture is the envelope's ``input``;
    each budget with its plan (the plan file's content, docs/formats.md) and ``plan_file``."""
    budgets = []
    for b, path in zip(result["budgets"], paths):
        entry = {("budget_spec" if k == "budget" else k): v for k, v in b.items() if k not in ("plan", "predicted", "uniform", "check", "task_check")}
        if b.get("task_check") is not None:  # --objective tasks: the plan and the uniform families on task samples
            tc = b["task_check"]
            entry["task_check"] = {"cells": tc["cells"], "by_setting": tc["by_setting"]}
        entry.update(predicted=b["predicted"], uniform=b["uniform"], check=_check_json(b.get("check")),
                     plan=b["plan"].to_dict(), plan_file=str(path))
        budgets.append(entry)
    out = {**{k: v for k, v in result.items() if k != "capture"}, "budgets": budgets,
           "gate": {"missed": missed, "passed": not missed}}
    if "layer_weights" in result:
        out["layer_weights"] = [{"layer": int(i), "weight": w} for i, w in sorted(result["layer_weights"].items())]
    return out


def print_decode_speed(result: dict[str, Any]) -> None:
    from kvtool.analysis.speed import describe  # deferred: start-up time

    ds = result.get("decode_speed") or {}
    if ds.get("min_speedup"):
        console.print(f"settings kept: attention at least {ds['min_speedup']:g}x dense on the {ds['card']} ({ds['source']}); "
                      f"{len(ds['dropped'])} dropped")
    for b in result["budgets"]:
        preds = b.get("predicted_decode") or []
        if preds:
            console.print(f"budget {b['budget']}, predicted decode: " + "; ".join(describe(p) for p in preds))


def print_recommended(outcome: Outcome) -> None:
    if outcome.view["result"].get("objective") == "tasks":
        print_tasks_result(outcome.view["result"], outcome.view["paths"])
        print_decode_speed(outcome.view["result"])
        return
    print_result(outcome.view["result"], outcome.view["paths"])
    print_decode_speed(outcome.view["result"])
    for line in outcome.view["missed"]:
        console.print(f"[red]missed:[/red] {line}")


@declare(
    "recommend",
    help="Choose a compression plan per layer and KV head for a byte budget: every candidate setting of every "
    "format (KIVI bits, bitmap sparsities, bitmapq, sign-VQ, page selection, SnapKV eviction, eviction + "
    "quantisation) is scored on each layer and KV head with queries it never saw (the prompt's last tokens), each "
    "layer weighted by its measured cost on the model; a knapsack picks the least loss that fits the "
    "budget, and the plan is checked on the model (NLL, top-1 agreement, KL) against the best uniform setting "
    "that fits, on the capture's continuation and the shipped held-out texts (mean and 95% interval). Writes "
    "plan.json for `kvtool compress --plan`.",
    epilog=example_epilog(
        "kvtool recommend cap.safetensors --budget 15%",
        "kvtool recommend cap.safetensors --budget 2GiB --batch 16 --context 32k -o plan.json",
        "kvtool recommend cap.safetensors --budget 15% --budget 25% --max-nll-increase 1% --json   # CI gate",
        "kvtool recommend cap.safetensors --budget 15% --card h100   # only settings whose kernels beat dense on an H100",
        "kvtool recommend cap.safetensors --budget 15% --bench decode.json --min-speedup 1.2",
    ),
    render=print_recommended,
)
def recommend(
    capture: Annotated[Path | None, typer.Argument(help="A capture file made by `kvtool capture`, or 'sample:' (not with --objective tasks, which makes its own task samples).", show_default=False)] = None,
    budget: Annotated[list[str] | None, typer.Option("--budget", "-b", help="Share of the float16 KV bytes (15%, 0.15) or a size (2GiB) with --batch/--context; repeatable.")] = None,
    batch: Annotated[int | None, typer.Option(help="Sequences served at once (for a size budget).", min=1)] = None,
    context: Annotated[str | None, typer.Option(help="Tokens per sequence, e.g. 32k (for a size budget).")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="Plan file (several budgets: NAME-15.json, ...).", dir_okay=False)] = Path("plan.json"),
    heldout: Annotated[int, typer.Option(help="Last tokens kept dense; their queries score the candidates and the model scores their continuation.")] = 64,
    per_head: Annotated[bool, typer.Option("--per-head/--per-layer", help="Choose per KV head (default) or one setting per layer.")] = True,
    menu_opt: Annotated[str | None, typer.Option("--menu", help="Candidate families, comma-separated: dense,quant,bitmap,bitmapq,signvq,pagestat,evict,pipeline (default: all).")] = None,
    model: ModelOpt = None,
    no_model: NoModelOpt = False,
    texts: Annotated[list[Path] | None, typer.Option("--texts", help="Your own held-out text files for the model check (default: kvtool's shipped prose, code and dialogue).")] = None,
    no_texts: Annotated[bool, typer.Option("--no-texts", help="Check on the capture's own continuation only.")] = False,
    calibrate: Annotated[str, typer.Option(help="Queries that score the candidates: prefix (the prompt's last --heldout queries, so the continuation judges the plan unseen) or heldout (the held-out queries themselves).")] = "prefix",
    no_weights: Annotated[bool, typer.Option("--no-weights", help="Do not weight layers by their measured cost on the model (one probe per layer on the prompt's last tokens).")] = False,
    threads: Annotated[int, typer.Option(help="Torch CPU threads (many small operations: 1 is fastest on a shared machine).", min=1)] = 1,
    uniform_checks: Annotated[int | None, typer.Option(help="Budget-filling uniform families checked on the model (those with the lowest predicted loss; default: every family of the menu, and every kvpress press x storage where kvpress is installed, so the best uniform is the best of them all).", min=1)] = None,
    objective: Annotated[str, typer.Option(help="nll: calibrate on the capture's prompt, check NLL/top-1/KL on its continuation and texts; tasks: calibrate on long-context task samples (question after compression), check task accuracy.")] = "nll",
    servable: Annotated[str | None, typer.Option(help="paged: one token budget per layer across its KV heads (KIVI / eviction only), so `kvtool export --to paged` takes the plan.")] = None,
    score_tokens: Annotated[int, typer.Option(help="Continuation tokens scored on each held-out text (NLL, top-1, KL).", min=1)] = 256,
    tasks: Annotated[str, typer.Option("--tasks", help="--objective tasks: tasks to calibrate and check on.")] = "niah_single,niah_essay,niah_multikey,niah_multikey_essay",
    lengths: Annotated[str, typer.Option("--lengths", help="--objective tasks: prompt lengths (1k = 1024 tokens).")] = "1k",
    calib_samples: Annotated[int, typer.Option(help="--objective tasks: calibration samples per task and length.", min=1)] = 2,
    calib_seed: Annotated[int, typer.Option(help="--objective tasks: seed of the calibration samples.")] = 1,
    check_samples: Annotated[int, typer.Option(help="--objective tasks: samples per task and length that check the plan (0: none).", min=0)] = 5,
    check_seed: Annotated[int, typer.Option(help="--objective tasks: seed of the check samples (not the calibration seed).")] = 0,
    max_nll_increase: Annotated[str | None, typer.Option(help=f"Largest allowed mean NLL increase of the plan: nats/token, or relative with % (1%). {THRESHOLD_HELP}")] = None,
    card: Annotated[str | None, typer.Option("--card", help="The GPU the plan decodes on (h100, h200): each plan's predicted decode tokens/s against dense from kvtool's measured kernel speeds (default: every measured card), and --min-speedup 1.0.")] = None,
    bench: Annotated[Path | None, typer.Option("--bench", help="Kernel speeds from your own `kvtool bench decode / kivi / attention -o FILE` (its card is named by the file).", dir_okay=False)] = None,
    min_speedup: Annotated[float | None, typer.Option("--min-speedup", help="Keep only settings whose attention runs at least X times dense on the card (kept share / kernel speed; unmeasured settings are dropped). Default: 1.0 with --card or --bench, else off.")] = None,
    device: DevicesOpt = "auto",
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite the plan file.")] = False,
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.analysis import speed  # deferred: start-up time
    from kvtool.analysis.recommendation import recommend_capture  # deferred: start-up time
    from kvtool.formats.plan import save_plan  # deferred: start-up time
    from kvtool.core import io  # deferred: start-up time

    cards, chosen, min_sp = speed.choose(card, bench, min_speedup)
    dropped: dict[str, str] = {}

    def keep_fast(specs: list[str]) -> list[str]:
        kept, why = chosen.keep(specs, min_sp)
        dropped.update(why)
        return kept

    menu_filter = keep_fast if chosen is not None and min_sp else None

    model, use_model = model_choice(model, no_model)
    limit = parse_nll_gate(max_nll_increase)
    if limit is not None and not use_model:
        raise UsageError("--max-nll-increase needs the model check; drop --no-model")
    families = [f.strip() for f in menu_opt.split(",") if f.strip()] if menu_opt else None
    if not budget:
        raise UsageError("give --budget, e.g. --budget 15%")
    if objective not in ("nll", "tasks"):
        raise UsageError(f"--objective must be nll or tasks, got {objective!r}")
    if len(budget) == 1:
        io.check_output(output, force)
    if objective == "tasks":
        from kvtool.analysis.recommendation import recommend_tasks  # deferred: start-up time
        from kvtool.analysis.tasks import parse_lengths, parse_tasks  # deferred: start-up time

        if capture is not None:
            raise UsageError("--objective tasks calibrates on generated task samples; drop the capture argument")
        if not use_model or limit is not None:
            raise UsageError("--objective tasks runs the model and checks task accuracy; drop --no-model and --max-nll-increase")
        result = recommend_tasks(budget, parse_tasks(tasks), parse_lengths(lengths), calib_samples, calib_seed, check_samples, check_seed,
                                 per_head, families, model, not no_weights, servable=servable, progress=progress, threads=threads,
                                 menu_filter=menu_filter)
        speed.annotate(result, cards, chosen, min_sp, dropped)
        paths = plan_paths(output, result["budgets"])
        for b, path in zip(result["budgets"], paths):
            if len(paths) > 1:
                io.check_output(path, force)
            save_plan(b["plan"], path, force=True)
        data = recommend_json(result, paths, [])
        return Outcome(data, output=paths[0] if len(paths) == 1 else None, view={"result": result, "paths": paths, "missed": []})
    if capture is None:
        raise UsageError("give a capture file (or --objective tasks)")
    capture = Path(resolve_sample(str(capture)))
    if not capture.exists():
        raise UsageError(f"capture {capture}: no such file")
    result = recommend_capture(capture, budget, batch, context, heldout, per_head, families, model, use_model,
                               texts, not no_texts, uniform_checks, progress=progress, calibrate=calibrate, weights=not no_weights, threads=threads,
                               device=device, servable=servable, score_tokens=score_tokens, menu_filter=menu_filter)
    speed.annotate(result, cards, chosen, min_sp, dropped)
    if limit is not None and result["model"] is None:
        raise UsageError(f"--max-nll-increase needs the model check, which was skipped: {result.get('model_skipped')}")
    paths = plan_paths(output, result["budgets"])
    for b, path in zip(result["budgets"], paths):
        if len(paths) > 1:
            io.check_output(path, force)
        save_plan(b["plan"], path, force=True)
    missed = gate(result, limit)
    data = recommend_json(result, paths, missed)
    return Outcome(data, input=capture, output=paths[0] if len(paths) == 1 else None, view={"result": result, "paths": paths, "missed": missed},
                   exit_code=1 if missed else 0)

def register(app: typer.Typer) -> None:
    add_commands(app, recommend)
