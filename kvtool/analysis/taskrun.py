"""Running task accuracy over methods and budgets, resumable (the library of ``kvtool tasks``).

A *method* is how a context is compressed; with a byte budget (a share of the float16 bytes) it
becomes a *setting*, one row of the results:

| method | what runs |
|---|---|
| ``dense`` | the model's own cache: the ceiling |
| ``FAMILY`` (``kivi``, ``snapkv``, ``streaming``, ``snapkv+kivi4``, ``snapkv+kivi2``, ``bitmap``, ``bitmapq``, ``signvq``) | the family's uniform setting that fills the budget (:mod:`kvtool.analysis.fill`), the same on every layer and head |
| ``press:NAME`` / ``press:NAME+kivi4`` | a kvpress press (:mod:`kvtool.hf.presses`) keeping the share of tokens that fills the budget, stored in float16 (or as KIVI 4-bit) |
| ``plan:FILE`` | a plan (``kvtool recommend``), at the budget it was made for |
| ``spec:SPEC`` | a fixed kvtool spec (``spec:quant:bits=4``) |

Each sample is prefilled once (:func:`kvtool.analysis.taskeval.prepare`), then every setting not yet
in ``samples.jsonl`` compresses its context and answers (:func:`kvtool.analysis.taskeval.answer`);
a line is appended per (sample, setting), so an interrupted run resumes where it stopped. The
summary gives, per setting and (task, length), the accuracy with its 95% Wilson interval, the share
of the dense accuracy kept, and the bytes stored.
"""

from __future__ import annotations

import json
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
from kvtool.analysis import fill
from kvtool.analysis.taskeval import SCORING, answer, prepare, wilson
from kvtool.analysis.tasks import TaskSample, Tokens, generate_sample
from kvtool.hf import presses as hfpress

FAMILY_ALIASES = {"quant": "kivi"}  # the budget-filling family of the quant format is KIVI's
PRESS_STORAGE = {"": "dense", "kivi4": "quant:bits=4,group=32,residual=0,partial=true", "kivi2": "quant:bits=2,group=32,residual=0,partial=true"}


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
            suffix = next((k for k, v in PRESS_STORAGE.items() if v == self.storage and k), "")
            return f"press:{self.name}" + (f"+{suffix}" if suffix else "")
        return f"{self.kind}:{self.name}"

    @property
    def budgeted(self) -> bool:
        return self.kind in ("uniform", "press")


def parse_method(text: str) -> Method:
    """``dense``, a family (``quant`` is the ``kivi`` family: KIVI is quant's scheme), ``press:NAME[+kivi4|+kivi2]``,
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
        if store not in PRESS_STORAGE:
            raise UsageError(f"--methods {t}: a press's tokens are stored as float16, +kivi4 or +kivi2, not {store!r}")
        hfpress.parse_press(name, keep=0.5)  # the name and fields are checked now, the share per budget later
        return Method("press", name, PRESS_STORAGE[store])
    if t.startswith("plan:"):
        path = Path(t[len("plan:"):])
        return Method("plan", path.name, plan=load_plan(path))
    if t.startswith("spec:"):
        spec = t[len("spec:"):]
        resolve_spec(spec)
        return Method("spec", spec)
    if ":" in t or "+" in t or t in FORMAT_ALIASES:
        resolve_spec(t)  # a format spec given without spec: (an unknown name is refused here, with the closest known one)
        return Method("spec", t)
    known = ["dense", *fill.FAMILIES, *FAMILY_ALIASES, "press:", "plan:", "spec:"]
    raise UsageError(f"unknown method {t!r}{closest(t, known)}: give dense, a family ({', '.join(fill.FAMILIES)}), press:NAME, plan:FILE "
                     "or a format spec (spec:SPEC or SPEC: quant:bits=4, snapkv:budget=128+kivi4)")


def plan_budget(plan: Plan) -> float | None:
    b = plan.extra.get("budget")
    return float(b["fraction"]) if isinstance(b, dict) and "fraction" in b else None


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
               nominal: dict[tuple[str, int], int]) -> list[dict[str, Any]]:
    """Prefill one sample and score every setting in ``todo``; returns the result rows."""
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
    rows = []
    prefill_s = time.perf_counter() - start
    facts = prep.cache.facts
    for s in todo:
        t0 = time.perf_counter()
        row = {**base, "setting": s.label, "method": s.method.label, "budget": s.budget}
        if s.method.kind == "dense":
            res = answer(model, tokenizer, prep, None, scoring)
            row.update({"spec": "dense", "storage_ratio": 1.0})
        else:
            made = _compress(model, prep, s, facts, inputs)
            if made is None:
                row.update({"unavailable": f"{s.method.label} cannot store {100 * s.budget:g}% of the float16 bytes or less"})
                rows.append(row)
                continue
            cc, spec = made
            res = answer(model, tokenizer, prep, cc, scoring)
            row.update({"spec": spec, "storage_ratio": cc.byte_report()["storage_ratio"]})
        row.update({k: res[k] for k in ("correct", "part") if k in res})
        if "nll" in res:
            row["answer_nll"] = res["nll"]
        row["output"] = res.get("text", "")
        row["seconds"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
    if rows:
        rows[0]["prefill_seconds"] = round(prefill_s, 3)
    return rows


# ----------------------------------------------------------------------------- the run


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of ``samples.jsonl``, the first of each (sample, setting) (two processes working on
    one folder may both have scored a sample)."""
    rows = []
    seen: set[tuple[str, str]] = set()
    if not path.exists():
        return rows
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                break  # a line cut by an interrupted write: recomputed
            raise BadDataError(f"{path}: line {n} is not JSON; move the file away or pass --force") from None
        key = (row.get("sample"), row.get("setting"))
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return upgrade_keys(rows, str(path))  # rows of an earlier kvtool: old key names


def run_tasks(model: Any, tokenizer: Any, model_name: str, tasks: list[str], lengths: list[int], samples: int, seed: int,
              methods: list[Method], budgets: list[float], out_dir: Path, question_aware: bool = False, scoring: str = "forced",
              force: bool = False, start: int = 0, progress: Progress | None = None) -> dict[str, Any]:
    """Run (or resume) every setting on every sample; write ``samples.jsonl`` and ``tasks.json``
    into ``out_dir`` and return the summary (:func:`summarize`). ``progress`` gets a stage of one
    unit per sample and a note per sample scored."""
    progress = or_silent(progress)
    if scoring not in SCORING:
        raise UsageError(f"--scoring must be one of {', '.join(SCORING)}, got {scoring!r}")
    if samples < 1:
        raise UsageError(f"--samples must be at least 1, got {samples}")
    out_dir.mkdir(parents=True, exist_ok=True)
    run_path = out_dir / "run.json"
    identity = {"model": model_name, "scoring": scoring, "question_aware": question_aware}
    rows_path = out_dir / "samples.jsonl"
    if force:
        for p in (rows_path, run_path):
            if p.exists():
                p.unlink()
    if run_path.exists():
        old = json.loads(run_path.read_text(encoding="utf-8"))
        if old != identity:
            raise UsageError(f"{out_dir} holds a run with {old}; this one is {identity}: use another --out-dir or --force")
    run_path.write_text(json.dumps(identity) + "\n", encoding="utf-8")
    done = {(r["sample"], r["setting"]) for r in read_rows(rows_path)}
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
    progress.note(f"tasks: {len(tasks)} tasks x {len(lengths)} lengths x {samples} samples, {len(todo_settings)} settings each; results go to {rows_path}")
    progress.stage("tasks", total)
    # index outermost: a run stopped early holds about as many samples of every task and length
    for i in range(start, start + samples):
        for task in tasks:
            for length in lengths:
                n += 1
                sample = generate_sample(tokenizer, task, length, seed, i, tok)
                todo = [s for s in todo_settings if (sample.key(), s.label) not in done]
                if not todo:
                    progress.advance()
                    continue
                t0 = time.perf_counter()
                rows = run_sample(model, tokenizer, sample, todo, question_aware, scoring, nominal)
                with open(rows_path, "a", encoding="utf-8") as fh:
                    fh.write("".join(json.dumps(r) + "\n" for r in rows))  # one write: processes sharing the file never interleave lines
                ok = sum(1 for r in rows if r.get("correct"))
                progress.note(f"tasks: {task} {length} #{i} ({n}/{total}): {ok}/{len(rows)} settings right, {time.perf_counter() - t0:.0f} s "
                              f"({time.perf_counter() - started:.0f} s in all)")
                progress.advance()
    return summarize(read_rows(rows_path), identity)


def summarize(rows: list[dict[str, Any]], identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per setting and (task, length): accuracy with its Wilson interval, part credit, bytes; and
    the share of the dense accuracy kept. ``{"cells": [...], "settings": [...], "tasks": [...]}``."""
    cells: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["setting"], r["task"], int(r["length"]))
        c = cells.setdefault(key, {"setting": r["setting"], "method": r["method"], "budget": r.get("budget"), "task": r["task"],
                                   "length": int(r["length"]), "k": 0, "n": 0, "stored": [], "specs": set(), "unavailable": None, "part": []})
        if r.get("unavailable"):
            c["unavailable"] = r["unavailable"]
            continue
        c["n"] += 1
        c["k"] += int(bool(r.get("correct")))
        c["part"].append(float(r.get("part", 0.0)))
        c["stored"].append(float(r.get("storage_ratio", 1.0)))
        c["specs"].add(r.get("spec", ""))
    out = []
    dense = {(c["task"], c["length"]): c for (s, _, _), c in cells.items() if s == "dense"}
    for key, c in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        iv = wilson(c["k"], c["n"])
        d = dense.get((c["task"], c["length"]))
        kept = None
        if d is not None and d["n"] and c["n"] and d["k"]:
            kept = (c["k"] / c["n"]) / (d["k"] / d["n"])
        out.append({"setting": c["setting"], "method": c["method"], "budget": c["budget"], "task": c["task"], "length": c["length"],
                    "accuracy": iv["mean"], "lo": iv["lo"], "hi": iv["hi"], "n": iv["n"], "correct": iv["k"],
                    "part": sum(c["part"]) / len(c["part"]) if c["part"] else None,
                    "storage_ratio": sum(c["stored"]) / len(c["stored"]) if c["stored"] else None,
                    "storage_ratio_max": max(c["stored"]) if c["stored"] else None,
                    "specs": sorted(c["specs"]), "kept_of_dense": kept, "unavailable": c["unavailable"] if not c["n"] else None})
    settings = list(dict.fromkeys(c["setting"] for c in out))
    tasks = sorted({(c["task"], c["length"]) for c in out}, key=lambda x: (x[1], x[0]))
    return {"run": identity or {}, "cells": out, "settings": settings, "tasks": [{"task": t, "length": n} for t, n in tasks],
            "by_setting": _by_setting(out)}


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
    w = csv.DictWriter(buf, fieldnames=list(CSV_FIELDS), lineterminator="\n", extrasaction="ignore")
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
