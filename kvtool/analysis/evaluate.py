"""Sweeps of formats and parameters over captures, run and resumed (the library of ``kvtool eval``)."""

from __future__ import annotations

import csv
import io as _io
import json
import time
from pathlib import Path
from typing import Any

import torch

from kvtool.analysis.fidelity import (
    attention_fidelity,
    check_model_facts,
    default_model_spec,
    dense_reference,
    model_fidelity,
)
from kvtool import texts as shipped_texts
from kvtool.analysis.frontier import plot_frontier
from kvtool.analysis.modelcheck import metric_interval, score_format_on_cases, text_cases
from kvtool.analysis.sweep import METRICS, Point, load_results, point_key, resolve_points, summarize
from kvtool.analysis.verify import load_model
from kvtool.core import io
from kvtool.core.cache import parse_indices
from kvtool.core.errors import KvtoolError, UsageError
from kvtool.core.jsonio import to_json_text
from kvtool.core.outputs import output_folder
from kvtool.core.placement import device_label, layer_placement, resolve_devices
from kvtool.core.progress import Progress, or_silent
from kvtool.core.streaming import open_capture
from kvtool.formats.base import FORMATS, compress_cache_over, make_params
from kvtool.hf import models
from kvtool.hf.devices import model_device_text

CSV_FIELDS = [
    "capture", "comparison", "label", "format", "params_text", "storage_ratio", "traffic_ratio", "rel_l2", "cosine",
    "max_abs", "recall", "nll_increase", "ppl_ratio", "agreement", "kl", "first_divergence",
    "nll_increase_mean", "nll_increase_lo", "nll_increase_hi", "relative_nll_increase_mean", "relative_nll_increase_lo", "relative_nll_increase_hi",
    "agreement_mean", "agreement_lo", "agreement_hi",
    "seconds", "skipped",
]


def run_eval(
    captures: list[Path],
    specs: list[str],
    out_dir: Path,
    paper: bool = True,
    heldout: int = 64,
    backend: str = "auto",
    model: str | None = None,
    use_model: bool = True,
    generate: int = 0,
    metric: str | None = None,
    x_axis: str = "storage",
    force: bool = False,
    progress: Progress | None = None,
    debug: bool = False,
    layers: str | None = None,
    device: str | None = None,
    threads: int | None = 1,
    texts: list[str] | None = None,
) -> dict[str, Any]:
    """Run (or resume) a sweep; write ``eval.json``, ``eval.csv`` and the frontier plot(s) into
    ``out_dir``; return ``{"rows", "files", "resumed", "device"}``. Each point reads the capture's
    layers one at a time onto ``device`` (default ``auto``: every visible GPU, the layers spread over
    them in contiguous blocks and encoded and scored at once, one thread per GPU; else the CPU; or a
    list such as ``cuda:0,cuda:1``). The model runs on the first device, or spread over the devices
    when it does not fit there (:func:`kvtool.analysis.verify.load_model`).
    ``texts`` (file paths, or ``shipped`` for kvtool's held-out texts) adds their continuations to the
    model-level metrics: each point's row then holds ``<metric>_mean``/``_lo``/``_hi`` (95% interval)
    over the capture and the texts. ``progress`` gets a note per point. ``threads``: torch CPU threads
    while it runs (1: the work is many small operations, which a second thread slows down on a
    shared machine)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run_eval(captures, specs, out_dir, paper, heldout, backend, model, use_model, generate, metric, x_axis, force,
                         or_silent(progress), debug, layers, resolve_devices(device), texts)
    finally:
        torch.set_num_threads(before)


def _text_list(texts: list[str] | None) -> list[tuple[str, str]]:
    if not texts:
        return []
    if texts == ["shipped"]:
        return shipped_texts.shipped()
    return shipped_texts.read_files([Path(t) for t in texts])


def _run_eval(captures, specs, out_dir, paper, heldout, backend, model, use_model, generate, metric, x_axis, force,
              progress: Progress, debug, layers, devices, texts=None) -> dict[str, Any]:
    if heldout < 1:
        raise UsageError(f"--heldout must be at least 1, got {heldout}")
    if generate < 0:
        raise UsageError(f"--generate must be 0 or more, got {generate}")
    if x_axis not in ("storage", "traffic"):
        raise UsageError(f"--x must be storage or traffic, got {x_axis!r}")
    if metric is not None and metric not in METRICS:
        raise UsageError(f"--metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if metric == "task_accuracy":
        raise UsageError("--metric task_accuracy: task accuracy comes from `kvtool tasks` (its frontier.png plots it against the bytes); eval scores held-out queries and continuations")
    points = resolve_points(specs, paper=paper)
    output_folder(out_dir)  # a file in its place, a read-only mount: refused before any work
    json_path = out_dir / "eval.json"
    done = {} if force else load_results(json_path)
    resumed = 0
    finished: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    models_loaded: dict[str, tuple[Any, str]] = {}
    total = len(captures) * len(points)
    n_paper = sum(1 for p in points if p.comparison)
    progress.note(f"eval: {len(points) - n_paper} sweep points" + (f" + {n_paper} paper comparison rows (--paper)" if n_paper else "")
                  + f" x {len(captures)} capture(s) = {total} runs; results go to {out_dir}")
    started = time.perf_counter()
    done_count = 0
    progress.stage("eval", total)
    for cap_path in captures:
        cache = _load_capture(cap_path, layers, devices)
        if cache.num_tokens <= heldout:
            raise UsageError(f"capture {cap_path} has {cache.num_tokens} tokens, too short for --heldout {heldout} (lower --heldout or capture a longer prompt)")
        if not cache.has_queries:
            raise UsageError(f"capture {cap_path} has no queries, which eval scores; recapture without --no-queries")
        if cache.attention_mask is not None and bool((cache.attention_mask == 0).any()):
            raise UsageError(f"capture {cap_path} holds a left-padded batch; eval needs equal-length prompts (recapture with --align truncate)")
        sha = io.source_sha256(cap_path)
        spec = default_model_spec(cache.facts, model) if use_model else None
        reference = None
        cases: list = []
        for p in points:
            key = point_key(sha, p, heldout, (spec or "") + (f"|texts={','.join(texts)}" if texts else ""), generate, cache.layer_indices)
            row: dict[str, Any] = {"key": key, "capture": str(cap_path), "comparison": p.comparison, "label": p.label,
                                   "format": p.format, "params": p.params, "params_text": params_text(p), "spec": p.spec}
            if p.skipped:
                row["skipped"] = p.skipped
            elif key in finished:
                row.update({k: v for k, v in finished[key].items() if k not in row})
            elif key in done and not done[key].get("skipped"):
                row.update({k: v for k, v in done[key].items() if k not in row})
                finished[key] = row
                resumed += 1
            else:
                if spec is not None and reference is None:
                    if spec not in models_loaded:
                        models_loaded[spec] = load_model(spec, cache.facts, devices)
                        if texts:
                            models_loaded[spec + ":tok"] = models.load(spec if spec != "embedded" else None)[1]
                    mdl, name = models_loaded[spec]
                    check_model_facts(mdl, cache.facts, name)
                    progress.note(f"eval: dense reference of {cap_path.name} on {name} ({time.perf_counter() - started:.0f} s)")
                    reference = dense_reference(mdl, cache.token_ids, cache.num_tokens - heldout, generate, cache, name)
                    if texts:
                        cases = text_cases(mdl, models_loaded[spec + ":tok"], _text_list(texts), cache.num_tokens, heldout, cache.layer_indices, cache.facts.dtype)
                        progress.note(f"eval: {len(cases)} held-out texts prefilled ({time.perf_counter() - started:.0f} s)")
                row.update(_run_point(cache, sha, cap_path, p, heldout, backend, models_loaded.get(spec), reference, generate, debug, devices, cases))
                if not row.get("skipped"):
                    finished[key] = row
            rows.append(row)
            _write_json(json_path, rows, done)
            progress.advance()
            done_count += 1
            progress.note(f"eval [{done_count}/{total}] {(p.label + ': ') if p.label else ''}{p.spec}: " + _brief(row) + f" ({time.perf_counter() - started:.0f} s)")
    files = {"json": str(json_path), "csv": str(out_dir / "eval.csv")}
    io.atomic_write_text(out_dir / "eval.csv", to_csv(rows), force=True)
    have_model = any(r.get("agreement") is not None for r in rows)
    metric = metric or ("agreement" if have_model else "rel_l2")
    x_key = "storage_ratio" if x_axis == "storage" else "traffic_ratio"
    for cap_path in captures:
        own = [r for r in rows if r["capture"] == str(cap_path) and not r.get("skipped")]
        # a paper row that repeats a sweep point (same format and parameters) is drawn once
        seen: set[str] = set()
        own = [r for r in sorted(own, key=lambda r: r.get("comparison") is not None)
               if not (json.dumps([r["format"], r["params"]], sort_keys=True) in seen or seen.add(json.dumps([r["format"], r["params"]], sort_keys=True)))]
        name = "frontier.png" if len(captures) == 1 else f"frontier-{cap_path.stem}.png"
        plot_frontier(own, out_dir / name, metric, x_key, title=f"{cap_path.name}: {METRICS[metric][0]} vs bytes, {heldout} held-out queries")
        files[f"plot:{cap_path.name}"] = str(out_dir / name)
    where = {"device": device_label(devices)}
    loaded = [pair[0] for key, pair in models_loaded.items() if not key.endswith(":tok")]
    if loaded:
        where["model_device"] = model_device_text(loaded[0])
    return {"rows": rows, "files": files, "resumed": resumed, "metric": metric, "x": x_key, **where}


def _load_capture(path: Path, layers: str | None, devices: list[torch.device]):
    """The capture (keys, values, queries), optionally only the ``--layers`` selection (the model
    runs the other layers densely), read one layer at a time onto its device when used (the first
    of ``devices``, or its block's device when layers are spread over several)."""
    device = devices[0]
    parts = ("keys", "values", "queries")
    if layers is None:
        cache = open_capture(path, parts=parts, device=device)
    else:
        meta, _ = io.read_header(path)
        io.check_schema(path, meta, io.CAPTURE_SCHEMA)
        facts = io.facts_from_meta(path, meta)
        cache = open_capture(path, layers=parse_indices(layers, facts.num_layers), parts=parts, device=device)
    # every point compresses and scores the same layers: on a GPU with room for them, each layer is
    # read and checked once for the whole sweep, not twice per point
    cache.keep_on_device(placement=layer_placement(cache.layer_indices, devices) if len(devices) > 1 else None)
    return cache


def _run_point(cache, sha, cap_path, p: Point, heldout, backend, model_pair, reference, generate, debug, devices, cases=()) -> dict[str, Any]:
    start = time.perf_counter()
    fmt = FORMATS[p.format]
    try:
        # each layer encoded on the device that scores it next (one device: the layers in order, no threads)
        cc = compress_cache_over(cache, fmt, make_params(fmt, p.values), layer_placement(cache.layer_indices, devices), heldout=heldout)
        cc.info["source_sha256"] = sha
        cc.info["source_path"] = str(cap_path)
        att = attention_fidelity(cc, cache, heldout, backend, device=devices)
        mod = None
        if model_pair is not None and reference is not None:
            mod = model_fidelity(model_pair[0], cc, reference, generate, backend=att["backend"])
    except KvtoolError as exc:
        return {"skipped": str(exc)}
    except Exception as exc:  # a format's bug must not lose the rest of the sweep
        if debug:
            raise
        return {"skipped": f"failed: {type(exc).__name__}: {exc}"}
    row = summarize(att, mod)
    if mod is not None and cases:
        extra = score_format_on_cases(model_pair[0], list(cases), fmt, make_params(fmt, p.values))
        own = {"case": "capture", "nll_increase": mod["nll_increase"], "relative_nll_increase": mod["nll_increase"] / mod["nll_dense"],
               "agreement": mod["agreement"], "kl": mod["kl"]}
        row["cases"] = [own] + extra
        for m in ("nll_increase", "relative_nll_increase", "agreement", "kl"):
            iv = metric_interval(m, [c[m] for c in row["cases"]])
            row[f"{m}_mean"], row[f"{m}_lo"], row[f"{m}_hi"] = iv["mean"], iv["lo"], iv["hi"]
    row["backend"] = att["backend"]
    row["seconds"] = round(time.perf_counter() - start, 3)
    row["layers"] = [{"layer": int(i), "rel_l2": r["errors"]["rel_l2"]} for i, r in att["layers"].items()]
    if mod is not None:
        row["compressed_layers"], row["model_layers"] = list(mod["compressed_layers"]), mod["model_layers"]
    return row


def _brief(row: dict[str, Any]) -> str:
    """One point's result in a few words, for the progress notes."""
    if row.get("skipped"):
        return f"skipped ({row['skipped'][:80]})"
    def num(key: str, spec: str, scale: float = 1.0) -> str:
        value = row.get(key)
        return "-" if value is None else format(scale * value, spec)

    parts = [f"{num('storage_ratio', '.1f', 100)}% stored", f"rel L2 {num('rel_l2', '.3g')}"]
    if row.get("nll_increase") is not None:
        parts.append(f"NLL {num('nll_increase', '+.4f')}, top-1 {num('agreement', '.3f')}")
    return ", ".join(parts)


def params_text(p: Point) -> str:
    return ",".join(f"{k}={v}" for k, v in p.values.items()) or "defaults"


def _write_json(path: Path, rows: list[dict[str, Any]], done: dict[str, dict[str, Any]]) -> None:
    keys = {r["key"] for r in rows}
    kept = [v for k, v in done.items() if k not in keys]  # earlier points not in this run stay in the file
    io.atomic_write_text(path, to_json_text({"schema": "kvtool.eval", "points": kept + rows}), force=True)


def to_csv(rows: list[dict[str, Any]]) -> str:
    buf = _io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    return buf.getvalue()
