"""``kvtool tasks``: long-context task accuracy with the question after compression."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.core.errors import UsageError
from kvtool.commands._command import Outcome, add_commands, declare
from kvtool.commands._common import DeviceOpt, console, example_epilog, make_table, show
from kvtool.core.progress import Progress
from kvtool.analysis.menu import ALIASES, FAMILIES, STORAGES

ORDER = 56
SHORT_HELP = "Long-context task accuracy, the question asked after compression"

# the library's kvtool.analysis.tasks.TASKS, named here so that --help needs no torch
# (tests/test_tasks.py checks they agree); the families come from the torch-free menu module
TASK_NAMES = ("niah_single", "niah_essay", "niah_multikey", "niah_multikey_essay", "niah_multivalue", "niah_multiquery", "vt", "cwe", "qa")
MULTI_QUESTION_TASKS = ("niah_multikey", "niah_multikey_essay")
DEFAULT_TASKS = "niah_single,niah_essay,niah_multikey,niah_multikey_essay"
FAMILY_NAMES = FAMILIES
STORAGE_SUFFIXES = ", ".join("+" + s for s in STORAGES if s)


def parse_budgets(items: list[str] | None) -> list[float]:
    """``["10%,15%", "0.25"]`` -> [0.10, 0.15, 0.25]."""
    out: list[float] = []
    for item in items or ["15%"]:
        for part in item.split(","):
            p = part.strip()
            if not p:
                continue
            try:
                v = float(p[:-1]) / 100 if p.endswith("%") else float(p)
            except ValueError:
                raise UsageError(f"--budgets must be shares like 15% or 0.15, got {part!r}") from None
            if not 0 < v < 1:
                raise UsageError(f"--budgets {part}: a budget is a share of the float16 bytes between 0 and 100%")
            out.append(v)
    return list(dict.fromkeys(out))


def split_methods(items: list[str] | None) -> list[str]:
    """``["dense,kivi", "spec:quant:bits=4,group=128", "snapkv:budget=128"]`` -> each method once; commas
    separate methods except inside a spec with parameters (``spec:...`` or ``NAME:key=value,...``, whose
    parameters hold commas: give it as its own value)."""
    out: list[str] = []
    for item in items or ["dense"]:
        item = item.strip()
        out += [item] if item.startswith("spec:") or "=" in item else [m.strip() for m in item.split(",") if m.strip()]
    return list(dict.fromkeys(out))


def cell_text(c: dict[str, Any]) -> str:
    if c.get("unavailable") and not c["n"]:
        return "n/a"
    return f"{100 * c['accuracy']:.0f}% [{100 * c['lo']:.0f}, {100 * c['hi']:.0f}]"


def print_questions(summary: dict[str, Any]) -> None:
    """One row per setting, one column per question index (over the tasks and lengths)."""
    by = {(r["setting"], r["question"]): r for r in summary["by_question"]}
    qs = sorted({q for _, q in by})
    rows = [[s] + [cell_text(by[(s, q)]) if (s, q) in by else "-" for q in qs] for s in summary["settings"]]
    n = max((r["n"] for r in summary["by_question"]), default=0)
    tasks = ", ".join(f"{t['task']} {t['length']}" for t in summary["tasks"])
    console.print(make_table(f"one compressed context, {len(qs)} questions about different needles ({tasks}; {n} per cell, 95% Wilson interval)",
                             ["setting"] + [f"question {q}" for q in qs], rows))


def print_summary(summary: dict[str, Any]) -> None:
    if summary.get("by_question"):
        print_questions(summary)
        return
    tasks = [(t["task"], t["length"]) for t in summary["tasks"]]
    cells = {(c["setting"], c["task"], c["length"]): c for c in summary["cells"]}
    by = {r["setting"]: r for r in summary["by_setting"]}
    cols = ["setting", "stored %"] + [f"{t} {n}" for t, n in tasks] + ["of dense"]
    rows = []
    for s in summary["settings"]:
        first = next((cells[(s, t, n)] for t, n in tasks if (s, t, n) in cells), None)
        stored = by.get(s, {}).get("storage_ratio")
        kept = by.get(s, {}).get("kept_of_dense")
        rows.append([s, "-" if stored is None else f"{100 * stored:.1f}"] + [cell_text(cells[(s, t, n)]) if (s, t, n) in cells else "-" for t, n in tasks]
                    + ["-" if kept is None else f"{100 * kept:.0f}%"])
        del first
    n = max((c["n"] for c in summary["cells"]), default=0)
    console.print(make_table(f"task accuracy through the compressed context ({n} samples per cell, 95% Wilson interval)", cols, rows))
    na = sorted({c["setting"] for c in summary["cells"] if c.get("unavailable") and not c["n"]})
    if na:
        show("n/a: the family cannot store that little ({})", ", ".join(na))
    depth = summary.get("by_depth") or []
    if depth:
        by = {(r["setting"], r["third"]): r for r in depth}
        rows = [[s] + [cell_text(by[(s, t)]) + f" n={by[(s, t)]['n']}" if (s, t) in by else "-" for t in ("first", "middle", "last")]
                for s in dict.fromkeys(r["setting"] for r in depth)]
        console.print(make_table("accuracy by where the needle asked for sits in the haystack (every task with one; 95% Wilson interval)",
                                 ["setting", "first third", "middle third", "last third"], rows))


def print_tasks(outcome: Outcome) -> None:
    print_summary(outcome.view["summary"])
    show("wrote {}", ", ".join(outcome.view["files"].values()))


@declare(
    "tasks",
    help="Long-context tasks (RULER-style needles, variable tracking, common words, recall over the shipped texts), "
    "generated offline from a seed: each sample's context is captured and compressed before the question is seen, "
    "then the question and answer run through the compressed context. Methods: dense (the ceiling), kvtool's "
    "format families filling each byte budget (each eviction x each storage, and the storages alone), kvpress presses "
    "(press:NAME[+STORAGE], needs kvpress), plans (plan:FILE) and fixed specs (spec:SPEC); 'menu' is every family and "
    "every press x storage. Accuracy per task and length with 95% Wilson intervals, and by the depth of the needle asked "
    "for (first / middle / last third); writes samples.jsonl (a rerun resumes), tasks.json, tasks.csv and frontier.png "
    "into --out-dir.",
    epilog=example_epilog(
        "kvtool tasks --tasks niah_single --lengths 1k --samples 10 --methods dense,kivi,snapkv --budgets 25%",
        "kvtool tasks --lengths 1k --samples 50 --methods dense,kivi,streaming+kivi4g128,press:snapkv+kivi4g128,plan:plan15.json --budgets 10%,15%,25%,50%",
        "kvtool tasks --lengths 1k --samples 50 --methods dense,menu,plan:plan15.json --budgets 10%,15%,25%,50%   # the whole uniform menu",
        "kvtool tasks --tasks niah_multikey --lengths 1k,2k,4k,8k --samples 20 --methods dense --json",
        "kvtool tasks --tasks niah_multikey --questions 4 --lengths 1k --samples 50 --methods dense,plan:plan10.json,rkivi --budgets 15%",
    ),
    render=print_tasks,
)
def tasks_cmd(
    methods: Annotated[list[str] | None, typer.Option("--methods", "-M", help="Methods, comma- or space-separated: dense, a family (" + ", ".join(FAMILY_NAMES) + "; quant is kivi), press:NAME[+STORAGE] (storages: " + STORAGE_SUFFIXES + "), plan:FILE, " + ", ".join(ALIASES) + " (every family / every press x storage / both), or a format spec as --format takes it (quant:bits=4, snapkv:budget=128+kivi4; one with parameters as a value of its own). Several after one --methods, or repeated; default: dense.")] = None,
    tasks: Annotated[str, typer.Option("--tasks", "-t", help="Tasks, comma-separated, or all: " + ", ".join(TASK_NAMES) + " (with --questions: " + ", ".join(MULTI_QUESTION_TASKS) + ").")] = DEFAULT_TASKS,
    lengths: Annotated[str, typer.Option("--lengths", "-l", help="Prompt lengths in tokens, comma-separated (1k = 1024).")] = "1k",
    samples: Annotated[int, typer.Option("--samples", "-n", help="Samples per task and length.", min=1)] = 50,
    seed: Annotated[int, typer.Option(help="Seed of the samples (recommend --objective tasks calibrates on another).")] = 0,
    start: Annotated[int, typer.Option(help="Index of the first sample (--start 25 --samples 25: samples 25..49, e.g. a second process on the same --out-dir).", min=0)] = 0,
    budgets: Annotated[list[str] | None, typer.Option("--budgets", "-b", help="Byte budgets of the families and presses, shares of the float16 bytes: 10%,15%,25%,50%.")] = None,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Folder for samples.jsonl, tasks.json, tasks.csv and frontier.png.", file_okay=False)] = Path("tasks.out"),
    question_aware: Annotated[bool, typer.Option("--question-aware", help="Compress the context with the question (as kvpress's query-aware runs); default: the question comes after compression.")] = False,
    questions: Annotated[int, typer.Option("--questions", help="Questions per compressed context (1-4; tasks niah_multikey, niah_multikey_essay): each context is compressed once and asked about that many different needles, each from a copy of the compressed cache; scored per question.", min=1, max=4)] = 1,
    scoring: Annotated[str, typer.Option(help="forced: every answer token the top-1 given the ones before (one pass); greedy: greedy decoding and string match.")] = "forced",
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model: 'embedded', a local HF folder or a .gguf file (default: the embedded SmolLM2-135M).")] = None,
    threads: Annotated[int, typer.Option(help="Torch CPU threads.", min=1)] = 1,
    device: DeviceOpt = "auto",
    force: Annotated[bool, typer.Option("--force", "-f", help="Start over instead of resuming from samples.jsonl.")] = False,
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.analysis import taskrun  # deferred: start-up time
    from kvtool.analysis.tasks import parse_lengths, parse_tasks  # deferred: start-up time
    from kvtool.hf import models  # deferred: start-up time

    if questions > 1 and tasks == DEFAULT_TASKS:
        tasks = ",".join(MULTI_QUESTION_TASKS)
    task_list = parse_tasks(tasks)
    length_list = parse_lengths(lengths)
    budget_list = parse_budgets(budgets)
    method_list = taskrun.parse_methods(split_methods(methods))
    from kvtool.analysis import taskfiles  # deferred: start-up time

    taskfiles.check_folder(out_dir)  # before the model loads: no output is an input (a plan), no FIFO, a writable folder
    progress.stage("load model", 1)
    from kvtool.core.placement import resolve_device  # deferred: needs torch

    mdl, tok, source = models.load(None if model in (None, "embedded") else model, device=str(resolve_device(device)))
    progress.advance()
    models.check_positions(mdl, max(length_list), source.name, f"--lengths {max(length_list)}")
    summary = taskrun.with_threads(threads, lambda: taskrun.run_tasks(
        mdl, tok, source.name, task_list, length_list, samples, seed, method_list, budget_list, out_dir,
        question_aware=question_aware, scoring=scoring, force=force, start=start, progress=progress, questions=questions))
    files = taskrun.write_outputs(summary, out_dir)
    data = {"run": summary["run"], "files": files, "cells": summary["cells"], "by_setting": summary["by_setting"], "by_depth": summary["by_depth"]}
    if summary.get("by_question"):
        data["by_question"] = summary["by_question"]
    return Outcome(data, output=out_dir, view={"summary": summary, "files": files})


def register(app: typer.Typer) -> None:
    add_commands(app, tasks_cmd)
