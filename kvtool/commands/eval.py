"""``kvtool eval``: sweep formats and parameters over captures; table, JSON, CSV and frontier plot."""

from __future__ import annotations

import contextlib
import csv
import io as _io
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from .. import io
from ..cache import parse_indices
from ..errors import KvtoolError, UsageError
from ..fidelity import BACKENDS, attention_fidelity, check_model_facts, default_model_spec, dense_reference, model_fidelity
from ..formats.base import FORMATS, compress_cache, make_params
from ..sweep import METRICS, Point, load_results, point_key, resolve_points, summarize
from ._common import DebugOpt, JsonOpt, console, debug_enabled, emit_json, example_epilog, kvtool_command, make_table, progress_bar, to_json_text

ORDER = 55

CSV_FIELDS = [
    "capture", "comparison", "label", "format", "params_text", "storage_ratio", "traffic_ratio", "rel_l2", "cosine",
    "max_abs", "recall", "nll_increase", "ppl_ratio", "agreement", "kl", "first_divergence",
    "relative_nll_increase_mean", "relative_nll_increase_lo", "relative_nll_increase_hi", "agreement_mean", "agreement_lo", "agreement_hi",
    "seconds", "skipped",
]


def split_inputs(items: list[str], formats: list[str]) -> tuple[list[Path], list[str]]:
    """Positional arguments are captures; one that is not a file but names a registered format (the
    tail of ``--formats a b c``) is a sweep spec."""
    from ..formats import load_all

    load_all()
    captures: list[Path] = []
    specs = list(formats)
    for item in items:
        name = item.partition(":")[0]
        if not Path(item).exists() and (name in FORMATS or ":" in item and "=" in item):
            specs.append(item)
        else:
            captures.append(Path(item))
    if not captures:
        raise UsageError("give at least one capture file")
    for c in captures:
        if not c.exists():
            raise UsageError(f"capture {c}: no such file")
    return captures, specs


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
    quiet: bool = True,
    debug: bool = False,
    layers: str | None = None,
    threads: int | None = 1,
    texts: list[str] | None = None,
) -> dict[str, Any]:
    """Run (or resume) a sweep; write ``eval.json``, ``eval.csv`` and the frontier plot(s) into
    ``out_dir``; return ``{"rows", "files", "resumed"}``. ``texts`` (file paths, or ``shipped`` for
    kvtool's held-out texts) adds their continuations to the model-level metrics: each point's row
    then holds ``<metric>_mean``/``_lo``/``_hi`` (95% interval) over the capture and the texts. Unless ``quiet``, one progress line per
    point goes to stderr. ``threads``: torch CPU threads while it runs (1: the work is many small
    operations, which a second thread slows down on a shared machine)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run_eval(captures, specs, out_dir, paper, heldout, backend, model, use_model, generate, metric, x_axis, force, quiet, debug, layers, texts)
    finally:
        torch.set_num_threads(before)


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _text_list(texts: list[str] | None) -> list[tuple[str, str]]:
    from .. import texts as shipped

    if not texts:
        return []
    if texts == ["shipped"]:
        return shipped.shipped()
    return shipped.read_files([Path(t) for t in texts])


def _run_eval(captures, specs, out_dir, paper, heldout, backend, model, use_model, generate, metric, x_axis, force, quiet, debug, layers, texts=None) -> dict[str, Any]:
    if heldout < 1:
        raise UsageError(f"--heldout must be at least 1, got {heldout}")
    if generate < 0:
        raise UsageError(f"--generate must be 0 or more, got {generate}")
    if x_axis not in ("storage", "traffic"):
        raise UsageError(f"--x must be storage or traffic, got {x_axis!r}")
    if metric is not None and metric not in METRICS:
        raise UsageError(f"--metric must be one of {', '.join(METRICS)}, got {metric!r}")
    points = resolve_points(specs, paper=paper)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out {out_dir} is a file, not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "eval.json"
    done = {} if force else load_results(json_path)
    resumed = 0
    finished: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    models_loaded: dict[str, tuple[Any, str]] = {}
    total = len(captures) * len(points)
    n_paper = sum(1 for p in points if p.comparison)
    _say(quiet, f"eval: {len(points) - n_paper} sweep points" + (f" + {n_paper} paper comparison rows (--paper)" if n_paper else "")
         + f" x {len(captures)} capture(s) = {total} runs; results go to {out_dir}")
    started = time.perf_counter()
    done_count = [0]
    with contextlib.nullcontext():
        for cap_path in captures:
            cache = _load_capture(cap_path, layers)
            if cache.num_tokens <= heldout:
                raise UsageError(f"capture {cap_path} has {cache.num_tokens} tokens, too short for --heldout {heldout} (lower --heldout or capture a longer prompt)")
            if not cache.has_queries:
                raise UsageError(f"capture {cap_path} has no queries, which eval scores; recapture without --no-queries")
            if cache.attention_mask is not None and bool((cache.attention_mask == 0).any()):
                raise UsageError(f"capture {cap_path} holds a left-padded batch; eval needs equal-length prompts (recapture with --align truncate)")
            sha = io.sha256_file(cap_path)
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
                            models_loaded[spec] = _load_model(spec, cache.facts)
                            if texts:
                                from .. import models as _models

                                models_loaded[spec + ":tok"] = _models.load(spec if spec != "embedded" else None)[1]
                        mdl, name = models_loaded[spec]
                        check_model_facts(mdl, cache.facts, name)
                        _say(quiet, f"eval: dense reference of {cap_path.name} on {name} ({time.perf_counter() - started:.0f} s)")
                        reference = dense_reference(mdl, cache.token_ids, cache.num_tokens - heldout, generate, cache, name)
                        if texts:
                            from ..modelcheck import text_cases

                            cases = text_cases(mdl, models_loaded[spec + ":tok"], _text_list(texts), cache.num_tokens, heldout, cache.layer_indices)
                            _say(quiet, f"eval: {len(cases)} held-out texts prefilled ({time.perf_counter() - started:.0f} s)")
                    row.update(_run_point(cache, sha, cap_path, p, heldout, backend, models_loaded.get(spec), reference, generate, debug, cases))
                    if not row.get("skipped"):
                        finished[key] = row
                rows.append(row)
                _write_json(json_path, rows, done)
                done_count[0] += 1
                _say(quiet, f"eval [{done_count[0]}/{total}] {(p.label + ': ') if p.label else ''}{p.spec}: " + _brief(row) + f" ({time.perf_counter() - started:.0f} s)")
    files = {"json": str(json_path), "csv": str(out_dir / "eval.csv")}
    io.atomic_write_text(out_dir / "eval.csv", to_csv(rows), force=True)
    have_model = any(r.get("agreement") is not None for r in rows)
    metric = metric or ("agreement" if have_model else "rel_l2")
    x_key = "storage_ratio" if x_axis == "storage" else "traffic_ratio"
    from ..frontier_plot import plot_frontier

    for cap_path in captures:
        own = [r for r in rows if r["capture"] == str(cap_path) and not r.get("skipped")]
        # a paper row that repeats a sweep point (same format and parameters) is drawn once
        seen: set[str] = set()
        own = [r for r in sorted(own, key=lambda r: r.get("comparison") is not None) if not (json.dumps([r["format"], r["params"]], sort_keys=True) in seen or seen.add(json.dumps([r["format"], r["params"]], sort_keys=True)))]
        name = "frontier.png" if len(captures) == 1 else f"frontier-{cap_path.stem}.png"
        plot_frontier(own, out_dir / name, metric, x_key, title=f"{cap_path.name}: {METRICS[metric][0]} vs bytes, {heldout} held-out queries")
        files[f"plot:{cap_path.name}"] = str(out_dir / name)
    return {"rows": rows, "files": files, "resumed": resumed, "metric": metric, "x": x_key}


def _load_capture(path: Path, layers: str | None):
    """The capture (keys, values, queries), optionally only the ``--layers`` selection (the model
    runs the other layers densely)."""
    parts = ("keys", "values", "queries")
    if layers is None:
        return io.load(path, parts=parts)
    meta, _ = io.read_header(path)
    io.check_schema(path, meta, io.CAPTURE_SCHEMA)
    facts = io.facts_from_meta(path, meta)
    return io.load(path, layers=parse_indices(layers, facts.num_layers), parts=parts)


def _load_model(spec: str, facts) -> tuple[Any, str]:
    from .verify import load_model

    return load_model(spec, facts)


def _run_point(cache, sha, cap_path, p: Point, heldout, backend, model_pair, reference, generate, debug, cases=()) -> dict[str, Any]:
    start = time.perf_counter()
    fmt = FORMATS[p.format]
    try:
        cc = compress_cache(cache, fmt, make_params(fmt, p.values), heldout=heldout)
        cc.info["source_sha256"] = sha
        cc.info["source_path"] = str(cap_path)
        att = attention_fidelity(cc, cache, heldout, backend)
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
        from ..modelcheck import metric_interval, score_format_on_cases

        extra = score_format_on_cases(model_pair[0], list(cases), fmt, make_params(fmt, p.values))
        own = {"case": "capture", "nll_increase": mod["nll_increase"], "relative_nll_increase": mod["nll_increase"] / mod["nll_dense"],
               "agreement": mod["agreement"], "kl": mod["kl"]}
        row["cases"] = [own] + extra
        for m in ("nll_increase", "relative_nll_increase", "agreement", "kl"):
            iv = metric_interval(m, [c[m] for c in row["cases"]])
            row[f"{m}_mean"], row[f"{m}_lo"], row[f"{m}_hi"] = iv["mean"], iv["lo"], iv["hi"]
    row["backend"] = att["backend"]
    row["seconds"] = round(time.perf_counter() - start, 3)
    row["per_layer_rel_l2"] = {str(i): r["errors"]["rel_l2"] for i, r in att["layers"].items()}
    if mod is not None:
        row["layers_compressed"] = f"{len(mod['layers_compressed'])}/{mod['model_layers']}"
    return row


def _brief(row: dict[str, Any]) -> str:
    if row.get("skipped"):
        return f"skipped ({row['skipped'][:80]})"
    parts = [f"{100 * row['storage_ratio']:.1f}% stored", f"rel L2 {row['rel_l2']:.3g}"]
    if row.get("nll_increase") is not None:
        parts.append(f"NLL {row['nll_increase']:+.4f}, top-1 {row['agreement']:.3f}")
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


def _pct(v: Any) -> Any:
    return None if v is None else 100.0 * v


def print_results(result: dict[str, Any]) -> None:
    rows = result["rows"]
    multi = len({r["capture"] for r in rows}) > 1
    cols = (["capture"] if multi else []) + ["format", "parameters", "stored %", "traffic %", "rel L2", "cosine", "recall", "NLL +", "agreement"]

    def cells(r: dict[str, Any]) -> list[Any]:
        return ([Path(r["capture"]).name] if multi else []) + [
            r["format"], r["params_text"], _pct(r.get("storage_ratio")), _pct(r.get("traffic_ratio")), r.get("rel_l2"),
            r.get("cosine"), r.get("recall"), r.get("nll_increase"), r.get("agreement"),
        ]

    sweep = [r for r in rows if r.get("comparison") is None and not r.get("skipped")]
    if any(r.get("relative_nll_increase_mean") is not None for r in rows):
        n = max(len(r.get("cases", [])) for r in rows)
        cols = cols + [f"NLL + mean [95%], {n} texts", "top-1 mean [95%]"]
        plain = cells

        def cells(r: dict[str, Any]) -> list[Any]:  # noqa: F811
            if r.get("relative_nll_increase_mean") is None:
                return plain(r) + [None, None]
            return plain(r) + [f"{100 * r['relative_nll_increase_mean']:+.2f}% [{100 * r['relative_nll_increase_lo']:+.2f}, {100 * r['relative_nll_increase_hi']:+.2f}]",
                               f"{r['agreement_mean']:.3f} [{r['agreement_lo']:.3f}, {r['agreement_hi']:.3f}]"]
    if sweep:
        console.print(make_table("sweep (attention on held-out queries; model on the continuation)", cols, [cells(r) for r in sweep]))
    paper = [r for r in rows if r.get("comparison") is not None and not r.get("skipped")]
    pcols = (["capture"] if multi else []) + ["variant", "stored %", "rel L2", "cosine", "recall", "NLL +", "agreement"]
    for comparison in dict.fromkeys(r["comparison"] for r in paper):
        prow = [([Path(r["capture"]).name] if multi else []) + [r["label"], _pct(r.get("storage_ratio")), r.get("rel_l2"), r.get("cosine"), r.get("recall"), r.get("nll_increase"), r.get("agreement")]
                for r in paper if r["comparison"] == comparison]
        console.print(make_table(comparison, pcols, prow))
    absent = sorted({r["format"] for r in rows if r.get("skipped", "").endswith("is not in this kvtool")})
    if absent:
        n = sum(1 for r in rows if r["format"] in absent)
        console.print(f"skipped {n} points of formats not in this kvtool: {', '.join(absent)}")
    skipped = [r for r in rows if r.get("skipped") and r["format"] not in absent]
    if skipped:
        console.print(make_table("skipped points", ["format", "parameters", "why"], [(r["format"], r["params_text"], r["skipped"]) for r in skipped]))
    if result["resumed"]:
        console.print(f"resumed: {result['resumed']} finished points were read from {result['files']['json']}, not recomputed")
    console.print("wrote " + ", ".join(v for v in result["files"].values()))


def register(app: typer.Typer) -> None:
    @app.command(
        "eval",
        help="Sweep formats and parameters over one or more captures: storage and traffic ratio, attention-output "
        "error and recall on held-out queries, and (with the model) NLL increase and next-token agreement. Writes "
        "eval.json, eval.csv and the compression-vs-fidelity frontier plot; a rerun resumes finished points. "
        "Sweeps: NAME:key=v1,v2,...; without --formats every registered format is swept with default values, "
        "plus the paper comparison rows.",
        epilog=example_epilog(
            "kvtool eval cap.safetensors",
            "kvtool eval cap.safetensors --formats 'bitmap:sparsity=0.5,0.7,0.9' 'signvq:bits=2,4' --no-paper",
            "kvtool eval cap.safetensors --formats 'pagestat:budget=128,512,score=unique,quest' --metric recall --x traffic --json",
        ),
    )
    @kvtool_command
    def eval_cmd(
        inputs: Annotated[list[str], typer.Argument(help="Capture files (and, after --formats, more sweep specs).", show_default=False)],
        formats: Annotated[list[str] | None, typer.Option("--formats", "-F", help="Sweep spec NAME[:key=v1,v2,...]; repeatable, or several after one --formats.")] = None,
        paper: Annotated[bool | None, typer.Option("--paper/--no-paper", help="Add the papers' comparison rows (default: on without --formats).")] = None,
        out: Annotated[Path | None, typer.Option("--out", "-o", help="Folder for eval.json, eval.csv and the plot (default: CAPTURE.eval/).", file_okay=False)] = None,
        heldout: Annotated[int, typer.Option(help="Last tokens kept dense; their queries are scored.")] = 64,
        backend: Annotated[str, typer.Option(help=f"{'|'.join(BACKENDS)}: attention path for the compressed prefix.")] = "auto",
        model: Annotated[str | None, typer.Option("--model", "-m", help="Model for the continuation (default: the embedded one when the capture came from it).")] = None,
        no_model: Annotated[bool, typer.Option("--no-model", help="Attention-level metrics only (faster).")] = False,
        generate: Annotated[int, typer.Option(help="Greedy tokens to compare after the continuation.")] = 0,
        metric: Annotated[str | None, typer.Option(help=f"Frontier y axis: {'|'.join(METRICS)} (default: agreement with a model, else rel_l2).")] = None,
        x: Annotated[str, typer.Option("--x", help="Frontier x axis: storage|traffic (% of dense bytes).")] = "storage",
        layers: Annotated[str | None, typer.Option("--layers", help="Compress only these layers, e.g. 0,7,15,23 (the model runs the others densely; default: all captured).")] = None,
        force: Annotated[bool, typer.Option("--force", "-f", help="Recompute every point instead of resuming from eval.json.")] = False,
        threads: Annotated[int, typer.Option(help="Torch CPU threads (many small operations: 1 is fastest on a shared machine).", min=1)] = 1,
        texts: Annotated[list[str] | None, typer.Option("--texts", help="Also score the model on held-out texts: 'shipped' (kvtool's prose, code, dialogue) or your text files; rows gain mean and 95% interval over the capture and the texts (about 3 s more per point and text).")] = None,
        json_out: JsonOpt = False,
        debug: DebugOpt = False,
    ) -> None:
        captures, specs = split_inputs(inputs, formats or [])
        use_paper = (not specs) if paper is None else paper
        out_dir = out or captures[0].with_name(f"{captures[0].stem}.eval")
        result = run_eval(captures, specs, out_dir, use_paper, heldout, backend, model, not no_model, generate, metric, x, force, quiet=json_out, debug=debug_enabled(debug), layers=layers, threads=threads, texts=texts)
        if json_out:
            emit_json({"files": result["files"], "resumed": result["resumed"], "metric": result["metric"], "x": result["x"], "points": result["rows"]})
        else:
            print_results(result)
