"""Running task accuracy over methods and budgets, resumable (the library of ``kvtool tasks``).

A *method* is how a context is compressed; with a byte budget (a share of the float16 bytes) it
becomes a *setting*, one row of the results:

| method | what runs |
|---|---|
| ``dense`` | the model's own cache: the ceiling |
| ``FAMILY`` (``kivi``, ``rkivi`` (KIVI after a Walsh-Hadamard rotation), ``snapkv``, ``streaming``, ``streaming+kivi4g128``, ..., ``bitmap``, ``bitmapq``, ``signvq``: :data:`kvtool.analysis.menu.FAMILIES`) | the family's uniform setting that fills the budget (:mod:`kvtool.analysis.fill`), the same on every layer and head |
| ``press:NAME`` / ``press:NAME+STORAGE`` | a kvpress press (:mod:`kvtool.hf.presses`) keeping the share of tokens that fills the budget, stored in float16 (or a storage of :data:`kvtool.analysis.menu.STORAGES`: ``+kivi4``, ``+kivi2g128``, ...) |
| ``families`` / ``presses`` / ``menu`` | every family; every press x every storage; both (the whole uniform menu) |
| ``plan:FILE`` | a plan (``kvtool recommend``), at the budget it was made for |
| ``spec:SPEC`` | a fixed kvtool spec (``spec:quant:bits=4``) |

Each sample is prefilled once (:func:`kvtool.analysis.taskeval.prepare`), then every setting not yet
in ``samples.jsonl`` compresses its context and answers (:func:`kvtool.analysis.taskeval.answer`);
a line is appended per (sample, setting), so an interrupted run resumes where it stopped. The
summary gives, per setting and (task, length), the accuracy with its 95% Wilson interval, the share
of the dense accuracy kept, and the bytes stored; and per setting the accuracy by the depth of the
needle asked for (first / middle / last third of the haystack, :func:`depth_profile`), which tells
recency evictions (that keep the end) from the rest.

With ``questions`` N > 1 (the four-needle tasks only) each setting compresses a sample's context
once and answers N questions about N different needles from copies of that compressed cache
(:func:`kvtool.analysis.taskeval.answer_questions`): a row per question (``question`` 1..N), cells
per question, and ``by_question`` (per setting and question index, over the tasks and lengths).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.names import FORMAT_ALIASES, closest, upgrade_keys
from kvtool.core.io import atomic_write_text
from kvtool.core.progress import Progress, or_silent
from kvtool.core.jsonio import to_json_text
from kvtool.formats.base import compress_cache
from kvtool.formats.mixed import resolve_spec
from kvtool.formats.plan import Plan, compress_kept, compress_plan, load_plan
from kvtool.analysis import fill, menu, taskfiles
from kvtool.analysis.taskeval import SCORING, answer, answer_questions, prepare, wilson
from kvtool.analysis.tasks import MULTI_QUESTION_TASKS, TaskSample, Tokens, each_needle, generate_sample
from kvtool.hf import presses as hfpress

FAMILY_ALIASES = {"quant": "kivi"}  # the budget-filling family of the quant format is KIVI's
PRESS_STORAGE = {suffix: st.spec or "dense" for suffix, st in menu.STORAGES.items()}  # press:NAME+SUFFIX -> storage spec


@dataclass
class Method:
    """One way to compress a context (module docstring). ``plan`` is set for ``plan`` methods."""

    kind: str
    name: str
    storage: str = "dense"
    plan: Plan | None = None

    @property
    def label(self) -> str:
        if self.kind == "dense":
            return "dense"
        if self.kind == "uniform":
            return self.name
        if self.kind == "press":
            return "press:" + menu.family_name(self.name, menu.press_suffix(self.storage))
        return f"{self.kind}:{self.name}"

    @property
    def budgeted(self) -> bool:
        return self.kind in ("uniform", "press")


def parse_method(text: str) -> Method:
    """``dense``, a family (``quant`` is the ``kivi`` family: KIVI is quant's scheme), ``press:NAME[+STORAGE]``,
    ``plan:FILE``, ``spec:SPEC`` or a spec without ``spec:`` (``quant:bits=4``, ``snapkv:budget=128+kivi4``;
    read as ``kvtool compress --format`` reads it)."""
    t = text.strip()
    if t == "dense":
        return Method("dense", "dense")
    t = FAMILY_ALIASES.get(t, t)
    if t in fill.FAMILIES:
        return Method("uniform", t)
    if t.startswith("press:"):
        name, _, store = t[len("press:"):].partition("+")
        try:
            storage = menu.press_storage_spec(store)
        except UsageError as exc:
            raise UsageError(f"--methods {t}: {exc}") from None
        hfpress.parse_press(name, keep=0.5)  # the name and fields are checked now, the share per budget later
        hfpress.check_installed()  # before the model loads, not after the first samples
        return Method("press", name, storage)
    if t.startswith("plan:"):
        path = Path(t[len("plan:"):])
        plan = load_plan(path)
        plan_budget(plan, str(path))  # checked now, before any work
        return Method("plan", path.name, plan=plan)
    if t.startswith("spec:"):
        spec = t[len("spec:"):]
        resolve_spec(spec)
        return Method("spec", spec)
    if ":" in t or "+" in t or t in FORMAT_ALIASES:
        resolve_spec(t)  # a format spec given without spec: (an unknown name is refused here, with the closest known one)
        return Method("spec", t)
    known = ["dense", *fill.FAMILIES, *FAMILY_ALIASES, *menu.ALIASES, "press:", "plan:", "spec:"]
    raise UsageError(f"unknown method {t!r}{closest(t, known)}: give dense, a family ({', '.join(fill.FAMILIES)}), press:NAME[+STORAGE], plan:FILE, "
                     f"{', '.join(menu.ALIASES)}, or a format spec (spec:SPEC or SPEC: quant:bits=4, snapkv:budget=128+kivi4)")


def parse_methods(names: list[str]) -> list[Method]:
    """Methods from ``--methods`` names, the aliases of :data:`kvtool.analysis.menu.ALIASES`
    (``families``, ``presses``, ``menu``) expanded, each method once in the order given."""
    expanded: list[str] = []
    for n in names:
        expanded += list(menu.ALIASES.get(n.strip(), (n,)))
    return [parse_method(n) for n in dict.fromkeys(expanded)]


def plan_budget(plan: Plan, name: str = "the plan") -> float | None:
    """The budget a plan says it was made for (its ``budget.fraction``, informational: a share of
    the float16 bytes), or None; BadDataError unless it is a finite number in (0, 1]."""
    b = plan.extra.get("budget")
    if not isinstance(b, dict) or "fraction" not in b:
        return None
    f = b["fraction"]
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0 < f <= 1:
        raise BadDataError(f"plan {name}: budget.fraction must be a number in (0, 1] (a share of the float16 bytes), got {str(f)[:40]!r}")
    return float(f)


@dataclass
class Setting:
    method: Method
    budget: float | None

    @property
    def label(self) -> str:
        return self.method.label if self.budget is None else f"{self.method.label} @ {100 * self.budget:g}%"


def settings_of(methods: list[Method], budgets: list[float]) -> list[Setting]:
    out: list[Setting] = []
    for m in methods:
        if m.budgeted:
            out += [Setting(m, b) for b in budgets]
        else:
            out.append(Setting(m, plan_budget(m.plan) if m.plan is not None else None))
    return out


# ----------------------------------------------------------------------------- one sample


def _compress(model: Any, prep, setting: Setting, facts, inputs) -> tuple[Any, str] | None:
    """The compressed context of one setting, and the spec it resolved to; None when the method
    cannot reach the budget."""
    m = setting.method
    cache = prep.cache
    t = cache.num_tokens
    if m.kind == "uniform":
        spec = fill.fill_spec(m.name, setting.budget, prep.extra.get("nominal_tokens", t), facts.num_kv_heads, facts.num_heads, facts.head_dim)
        if spec is None:
            return None
        fmt, params = resolve_spec(spec)
        return compress_cache(cache, fmt, params), spec
    if m.kind == "spec":
        fmt, params = resolve_spec(m.name)
        return compress_cache(cache, fmt, params), m.name
    if m.kind == "plan":
        return compress_plan(cache, m.plan), m.name
    if m.kind == "press":
        keep = fill.press_keep(setting.budget, prep.extra.get("nominal_tokens", t), facts.head_dim, m.storage)
        if keep is None:
            return None
        ps = hfpress.parse_press(m.name, keep=keep)
        pool = prep.extra.setdefault("presses", {})  # one press per name and sample: its scores are reused across budgets
        if m.name not in pool:
            pool[m.name] = hfpress.reuse_scores(hfpress.make_press(ps))
        press = pool[m.name]
        hfpress.set_keep(press, keep)
        kept = hfpress.press_kept(model, press, inputs)
        return compress_kept(cache, kept, m.storage, f"kvpress {ps.label}"), ps.label + ("" if m.storage == "dense" else f"+{m.storage}")
    raise UsageError(f"method {m.kind} has no compression")


def run_sample(model: Any, tokenizer: Any, sample: TaskSample, todo: list[Setting], question_aware: bool, scoring: str,
               nominal: dict[tuple[str, int], int], questions: int = 1) -> list[dict[str, Any]]:
    """Prefill one sample and score every setting in ``todo`` (each compressing the context once and
    answering ``questions`` questions about different needles); returns the result rows."""
    asks = each_needle(tokenizer, sample, questions) if questions > 1 else None
    needs_press = any(s.method.kind == "press" for s in todo)
    inputs = hfpress.AttentionInputs() if needs_press else None
    start = time.perf_counter()
    if needs_press:
        with hfpress.recording_inputs(model, inputs):
            prep = prepare(model, tokenizer, sample, question_aware=question_aware)
        for i, layer in prep.dense.items():
            inputs.keys[i], inputs.values[i] = layer.keys, layer.values
        inputs = inputs.trimmed(prep.prefix_tokens)
    else:
        prep = prepare(model, tokenizer, sample, question_aware=question_aware)
    prep.extra["nominal_tokens"] = nominal.setdefault((sample.task, sample.length), prep.prefix_tokens)
    base = {"sample": sample.key(), "task": sample.task, "length": sample.length, "seed": sample.seed, "index": sample.index,
            "prefix_tokens": prep.prefix_tokens}
    if sample.needle_depth is not None:
        base["depth"] = round(sample.needle_depth, 4)
    rows = []
    prefill_s = time.perf_counter() - start
    facts = prep.cache.facts
    for s in todo:
        t0 = time.perf_counter()
        row = {**base, "setting": s.label, "method": s.method.label, "budget": s.budget}
        cc = None
        if s.method.kind == "dense":
            row.update({"spec": "dense", "storage_ratio": 1.0})
        else:
            made = _compress(model, prep, s, facts, inputs)
            if made is None:
                row.update({"unavailable": f"{s.method.label} cannot store {100 * s.budget:g}% of the float16 bytes or less"})
                rows += [{**row, "question": j + 1} for j in range(len(asks))] if asks else [row]
                continue
            cc, spec = made
            row.update({"spec": spec, "storage_ratio": cc.byte_report()["storage_ratio"]})
        results = answer_questions(model, tokenizer, prep, cc, asks, scoring) if asks else [answer(model, tokenizer, prep, cc, scoring)]
        seconds = round((time.perf_counter() - t0) / len(results), 3)
        for j, res in enumerate(results):
            one = {**row, "question": j + 1} if asks else dict(row)
            one.update({k: res[k] for k in ("correct", "part") if k in res})
            if "nll" in res:
                one["answer_nll"] = res["nll"]
            one["output"] = res.get("text", "")
            one["seconds"] = seconds
            rows.append(one)
    if rows:
        rows[0]["prefill_seconds"] = round(prefill_s, 3)
    return rows


# ----------------------------------------------------------------------------- the run


def read_rows(path: Path, note: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """The rows of ``samples.jsonl``, the first of each (sample, setting, question)
    (:func:`kvtool.analysis.taskfiles.read_rows`), old key names read under the current ones."""
    return upgrade_keys(taskfiles.read_rows(path, note), str(path))  # rows of an earlier kvtool: old key names


def run_tasks(model: Any, tokenizer: Any, model_name: str, tasks: list[str], lengths: list[int], samples: int, seed: int,
              methods: list[Method], budgets: list[float], out_dir: Path, question_aware: bool = False, scoring: str = "forced",
              force: bool = False, start: int = 0, progress: Progress | None = None, questions: int = 1) -> dict[str, Any]:
    """Run (or resume) every setting on every sample; write ``samples.jsonl`` and ``tasks.json``
    into ``out_dir`` and return the summary (:func:`summarize`). ``progress`` gets a stage of one
    unit per sample and a note per sample scored. ``questions`` > 1: several questions per
    compressed context (module docstring)."""
    progress = or_silent(progress)
    if questions < 1:
        raise UsageError(f"--questions must be at least 1, got {questions}")
    if questions > 1:
        other = [t for t in tasks if t not in MULTI_QUESTION_TASKS]
        if other:
            raise UsageError(f"--questions {questions} asks about several needles of one context: tasks {', '.join(MULTI_QUESTION_TASKS)}, not {other[0]}")
        if question_aware:
            raise UsageError("--questions needs the question after compression: drop --question-aware")
        if questions > 4:
            raise UsageError(f"--questions must be 1 to 4 (the needles of a sample), got {questions}")
    if scoring not in SCORING:
        raise UsageError(f"--scoring must be one of {', '.join(SCORING)}, got {scoring!r}")
    if samples < 1:
        raise UsageError(f"--samples must be at least 1, got {samples}")
    taskfiles.check_folder(out_dir)
    run_path = out_dir / taskfiles.RUN
    identity: dict[str, Any] = {"model": model_name, "scoring": scoring, "question_aware": question_aware}
    if questions > 1:
        identity["questions"] = questions
    rows_path = out_dir / taskfiles.ROWS
    if force:
        moved = taskfiles.move_aside(rows_path)
        if moved is not None:
            progress.note(f"tasks: --force: the earlier rows of {rows_path} were moved to {moved}")
    else:
        old = taskfiles.read_run(run_path)
        if old is not None and old != identity:
            raise UsageError(f"{out_dir} holds a run with {old}; this one is {identity}: use another --out-dir or --force")
    taskfiles.write_run(run_path, identity)
    taskfiles.repair(rows_path, progress.note)
    done = {(r["sample"], r["setting"]) for r in read_rows(rows_path, progress.note)}
    todo_settings = settings_of(methods, budgets)
    tok = Tokens(tokenizer)
    # budgets are filled for one nominal length per task and length, sample 0's, whatever --start a
    # process was given: processes sharing a folder resolve each family to the same spec
    nominal: dict[tuple[str, int], int] = {}
    for task in tasks:
        for length in lengths:
            first = generate_sample(tokenizer, task, length, seed, 0, tok)
            nominal[(task, length)] = len(first.context) + (len(first.question) - 1 if question_aware else 0)
    started = time.perf_counter()
    total = len(tasks) * len(lengths) * samples
    n = 0
    grid: set[tuple[str, str]] = set()  # this run's (sample, setting) pairs: what its summary counts
    progress.note(f"tasks: {len(tasks)} tasks x {len(lengths)} lengths x {samples} samples, {len(todo_settings)} settings each; results go to {rows_path}")
    progress.stage("tasks", total)
    # index outermost: a run stopped early holds about as many samples of every task and length
    for i in range(start, start + samples):
        for task in tasks:
            for length in lengths:
                n += 1
                sample = generate_sample(tokenizer, task, length, seed, i, tok)
                grid.update((sample.key(), s.label) for s in todo_settings)
                todo = [s for s in todo_settings if (sample.key(), s.label) not in done]
                if not todo:
                    progress.advance()
                    continue
                t0 = time.perf_counter()
                rows = run_sample(model, tokenizer, sample, todo, question_aware, scoring, nominal, questions)
                taskfiles.append_rows(rows_path, rows, progress.note)  # whole lines under a lock: processes sharing the file never interleave
                ok = sum(1 for r in rows if r.get("correct"))
                progress.note(f"tasks: {task} {length} #{i} ({n}/{total}): {ok}/{len(rows)} settings right, {time.perf_counter() - t0:.0f} s "
                              f"({time.perf_counter() - started:.0f} s in all)")
                progress.advance()
    rows = read_rows(rows_path)
    mine = [r for r in rows if (r["sample"], r["setting"]) in grid]
    if len(mine) < len(rows):
        progress.note(f"tasks: {rows_path} also holds {len(rows) - len(mine)} rows of other samples or settings (another --seed, "
                      "--start, --samples, --methods or --budgets); the summary counts only this run's")
    return summarize(mine, identity)


def summarize(rows: list[dict[str, Any]], identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per setting and (task, length): accuracy with its Wilson interval, part credit, bytes; and
    the share of the dense accuracy kept. ``{"cells": [...], "settings": [...], "tasks": [...]}``.
    Rows with a ``question`` index give cells per question too, and ``by_question``."""
    cells: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        key = (r["setting"], r["task"], int(r["length"]), r.get("question"))
        c = cells.setdefault(key, {"setting": r["setting"], "method": r["method"], "budget": r.get("budget"), "task": r["task"],
                                   "length": int(r["length"]), "question": r.get("question"),
                                   "k": 0, "n": 0, "stored": [], "specs": set(), "unavailable": None, "part": []})
        if r.get("unavailable"):
            c["unavailable"] = r["unavailable"]
            continue
        c["n"] += 1
        c["k"] += int(bool(r.get("correct")))
        c["part"].append(float(r.get("part", 0.0)))
        c["stored"].append(float(r.get("storage_ratio", 1.0)))
        c["specs"].add(r.get("spec", ""))
    out = []
    dense = {(c["task"], c["length"], c["question"]): c for (s, _, _, _), c in cells.items() if s == "dense"}
    for key, c in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0], kv[0][3] or 0)):
        iv = wilson(c["k"], c["n"])
        d = dense.get((c["task"], c["length"], c["question"]))
        kept = None
        if d is not None and d["n"] and c["n"] and d["k"]:
            kept = (c["k"] / c["n"]) / (d["k"] / d["n"])
        out.append({"setting": c["setting"], "method": c["method"], "budget": c["budget"], "task": c["task"], "length": c["length"],
                    "accuracy": iv["mean"], "lo": iv["lo"], "hi": iv["hi"], "n": iv["n"], "correct": iv["k"],
                    "part": sum(c["part"]) / len(c["part"]) if c["part"] else None,
                    "storage_ratio": sum(c["stored"]) / len(c["stored"]) if c["stored"] else None,
                    "storage_ratio_max": max(c["stored"]) if c["stored"] else None,
                    "specs": sorted(c["specs"]), "kept_of_dense": kept, "unavailable": c["unavailable"] if not c["n"] else None})
        if c["question"] is not None:
            out[-1]["question"] = c["question"]
    settings = list(dict.fromkeys(c["setting"] for c in out))
    tasks = sorted({(c["task"], c["length"]) for c in out}, key=lambda x: (x[1], x[0]))
    summary = {"run": identity or {}, "cells": out, "settings": settings, "tasks": [{"task": t, "length": n} for t, n in tasks],
               "by_setting": _by_setting(out), "by_depth": depth_profile(rows)}
    if any("question" in c for c in out):
        summary["by_question"] = _by_question(out)
    return summary


def _by_question(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting and question index: accuracy over the (task, length) cells of that question, and
    its share of the dense accuracy on the same question."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for c in cells:
        if c["n"] and c.get("question") is not None:
            groups.setdefault((c["setting"], c["question"]), []).append(c)
    dense = {q: sum(c["correct"] for c in cs) / sum(c["n"] for c in cs) for (s, q), cs in groups.items() if s == "dense"}
    out = []
    for (s, q), cs in groups.items():
        iv = wilson(sum(c["correct"] for c in cs), sum(c["n"] for c in cs))
        d = dense.get(q)
        out.append({"setting": s, "method": cs[0]["method"], "budget": cs[0]["budget"], "question": q, "accuracy": iv["mean"],
                    "lo": iv["lo"], "hi": iv["hi"], "n": iv["n"], "correct": iv["k"], "kept_of_dense": iv["mean"] / d if d else None})
    return sorted(out, key=lambda r: (r["setting"], r["question"]))


THIRDS = ("first", "middle", "last")


def third_of(depth: float) -> str:
    """The third of the haystack a depth in [0, 1] falls in."""
    return THIRDS[min(2, max(0, int(depth * 3)))]


def depth_profile(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting and third of the haystack (``first`` / ``middle`` / ``last``) where the needle
    the answer needs sits (the row's ``depth``, :attr:`kvtool.analysis.tasks.TaskSample.needle_depth`):
    accuracy with its 95% Wilson interval, over every task and length. Rows without a depth (``cwe``,
    or written before depths were recorded) are left out."""
    counts: dict[tuple[str, str], list[int]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("unavailable") or r.get("depth") is None:
            continue
        c = counts.setdefault((r["setting"], third_of(float(r["depth"]))), [0, 0])
        c[0] += int(bool(r.get("correct")))
        c[1] += 1
        meta.setdefault(r["setting"], {"method": r["method"], "budget": r.get("budget")})
    out = []
    for setting in dict.fromkeys(s for s, _ in counts):
        for third in THIRDS:
            if (setting, third) in counts:
                k, n = counts[(setting, third)]
                iv = wilson(k, n)
                out.append({"setting": setting, **meta[setting], "third": third, "accuracy": iv["mean"], "lo": iv["lo"], "hi": iv["hi"],
                            "n": n, "correct": k})
    return out


def _by_setting(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting: mean accuracy over its (task, length) cells, their mean share of dense kept,
    and mean bytes."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in cells:
        if c["n"]:
            groups.setdefault(c["setting"], []).append(c)
    out = []
    for s, cs in groups.items():
        kept = [c["kept_of_dense"] for c in cs if c["kept_of_dense"] is not None]
        k = sum(c["correct"] for c in cs)
        n = sum(c["n"] for c in cs)
        iv = wilson(k, n)
        out.append({"setting": s, "method": cs[0]["method"], "budget": cs[0]["budget"], "accuracy": iv["mean"], "lo": iv["lo"], "hi": iv["hi"],
                    "n": n, "kept_of_dense": sum(kept) / len(kept) if kept else None,
                    "storage_ratio": sum(c["storage_ratio"] for c in cs) / len(cs)})
    return out


def with_threads(threads: int | None, fn: Callable[[], Any]) -> Any:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


CSV_FIELDS = ("setting", "method", "budget", "task", "length", "accuracy", "lo", "hi", "n", "correct", "part", "storage_ratio", "storage_ratio_max",
              "kept_of_dense", "specs", "unavailable")


def write_outputs(summary: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """``tasks.json`` (the summary), ``tasks.csv`` (one row per setting and task) and
    ``frontier.png`` (x: % of float16 bytes stored, y: accuracy averaged over the tasks, one colour
    per method). Returns the paths written."""
    import csv
    import io as _io

    from kvtool.analysis.frontier import plot_frontier  # deferred: matplotlib, only when the outputs are written

    files = {"json": str(out_dir / "tasks.json"), "csv": str(out_dir / "tasks.csv")}
    atomic_write_text(out_dir / "tasks.json", to_json_text(summary), force=True)
    buf = _io.StringIO()
    fields = list(CSV_FIELDS) + (["question"] if summary.get("by_question") else [])
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for c in summary["cells"]:
        w.writerow({**c, "specs": ";".join(c.get("specs") or [])})
    atomic_write_text(out_dir / "tasks.csv", buf.getvalue(), force=True)
    points = [{"format": r["method"], "params_text": "" if r["budget"] is None else f"{100 * r['budget']:g}%",
               "storage_ratio": r["storage_ratio"], "task_accuracy": r["accuracy"]} for r in summary["by_setting"] if r["accuracy"] is not None]
    if points:
        tasks = ", ".join(f"{t['task']} {t['length']}" for t in summary["tasks"])
        plot_frontier(points, out_dir / "frontier.png", "task_accuracy", title=f"task accuracy, mean over {tasks}")
        files["plot"] = str(out_dir / "frontier.png")
    return files
