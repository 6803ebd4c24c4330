"""Markdown tables from ``kvtool bench --json`` documents (for docs/benchmarks.md): only measured
numbers, every cell from a record of the given documents."""

from __future__ import annotations

from typing import Any


def fmt(x: Any, nd: int = 2) -> str:
    """A cell: a number to ``nd`` decimals, a dash for none, text as it is."""
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    return f"{x:.{nd}f}"


def table(doc: dict[str, Any]) -> str:
    """One Markdown table of a bench document's records, with its primary baselines' speedups."""
    primary = doc.get("primary_baselines", [])
    recs = doc["records"]
    many = len({r["kernel"] for r in recs}) > 1
    head = (["kernel"] if many else []) + ["provider", "batch", "seq", "param", "median µs", "p10–p90 µs", "GB/s", "% of copy", "rel err"] + [f"× {b}" for b in primary]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in recs:
        if r["median_us"] is None and r["status"].startswith("skipped: single"):
            continue
        param = next((f"{n}={r[n]}" for n in ("sparsity", "budget", "k") if r[n] is not None), "")
        cells = ([r["kernel"]] if many else []) + [r["provider"], str(r["batch"]), str(r["seq"]), param]
        if r["median_us"] is None:
            cells += [r["status"], "", "", "", ""]
        else:
            cells += [f"{r['median_us']:.1f}", f"{r['p10_us']:.0f}–{r['p90_us']:.0f}", f"{r['bandwidth_gbps']:.0f}",
                      f"{100 * r['bandwidth_fraction']:.0f}%" if r["bandwidth_fraction"] is not None else "–",
                      f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "–"]
        for b in primary:
            v = r["speedup"].get(b)
            cells.append("" if v is None or b == r["provider"] else (f"{v:.2f}" if isinstance(v, float) else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# providers that time a dense baseline or a reference, not a kvtool kernel
BASELINES = {"cublas_qk", "cublas_pv", "cublas_qk+pv", "torch_dense", "sdpa", "flashinfer_single", "flashinfer_batch",
             "flashinfer_batch_tc", "heads_all", "bitmap_torch", "torch"}


def summary_table(doc: dict[str, Any]) -> str:
    """The kvtool kernels' rows only: median, byte floor (bytes at the measured copy bandwidth, where
    the run recorded it), share of the copy bandwidth and the speedup over each primary baseline
    measured in the same run (the JSON keeps every provider)."""
    if all(r["provider"] in BASELINES for r in doc["records"]):
        return baseline_table(doc)
    primary = list(doc.get("primary_baselines", []))
    measured = {n for r in doc["records"] if r["median_us"] is not None for n in [r["provider"]]}
    primary = [b for b in primary if b in measured or (b == "best_dense" and any(b in r["speedup"] for r in doc["records"]))] or primary
    if "sdpa" in measured and "sdpa" not in primary and not any(b.startswith("flashinfer") for b in primary):
        primary.append("sdpa")  # the stand-in when FlashInfer was not installed
    head = ["kernel", "batch", "seq", "param", "median µs", "floor µs", "% of copy"] + [f"× {b}" for b in primary]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in doc["records"]:
        if r["provider"] in BASELINES or r["median_us"] is None:
            continue
        param = next((f"{n}={r[n]}" for n in ("sparsity", "budget", "k") if r[n] is not None), "")
        name = r["provider"] if r["provider"] == r["kernel"] or r["kernel"] in r["provider"] else f"{r['provider']} ({r['kernel']})"
        floor = r.get("floor_us")
        frac = r["bandwidth_fraction"]
        cells = [name, str(r["batch"]), str(r["seq"]), param, f"{r['median_us']:.1f}", fmt(floor, 1), "–" if frac is None else f"{100 * frac:.0f}%"]
        for b in primary:
            v = r["speedup"].get(b)
            cell = f"{v:.2f}" if isinstance(v, float) else "–"
            if b == "best_dense" and isinstance(v, float):
                cell += f" ({r['speedup'].get('best_dense_is', '?')})"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def baseline_table(doc: dict[str, Any]) -> str:
    """Median µs of every provider (columns) per (batch, seq) configuration (rows): for suites that
    time baselines only."""
    providers = list(dict.fromkeys(r["provider"] for r in doc["records"]))
    configs = list(dict.fromkeys((r["batch"], r["seq"]) for r in doc["records"]))
    cell = {(r["batch"], r["seq"], r["provider"]): r["median_us"] for r in doc["records"]}
    lines = ["| batch | seq | " + " | ".join(f"{p} µs" for p in providers) + " |", "|" + "---|" * (len(providers) + 2)]
    for b, t in configs:
        lines.append(f"| {b} | {t} | " + " | ".join(fmt(cell.get((b, t, p)), 1) for p in providers) + " |")
    return "\n".join(lines)


def environment_line(doc: dict[str, Any]) -> str:
    """Device, copy bandwidth, versions, L2 setting and notes of a bench document, as one line."""
    env = doc["env"]
    v = env["versions"]
    return (f"{env['device']}; copy {env['copy_gbps'] or 0:.0f} GB/s, read-only {env.get('read_gbps') or 0:.0f} GB/s; torch {v['torch']}, "
            f"triton {v['triton']}, CUDA {v['cuda']}, FlashInfer {v['flashinfer']}; cold L2 {'on' if env['cold_l2'] else 'off'}; "
            f"{doc.get('date', 'undated')}, commit {doc.get('commit') or 'unknown'}" + ("; " + "; ".join(env["notes"]) if env.get("notes") else ""))


def markdown(doc: dict[str, Any], title: str | None = None, summary: bool = False) -> str:
    """A section for one bench document: heading, environment line and command, table (every
    provider, or with ``summary`` the kvtool kernels against the primary baselines)."""
    head = title or f"`kvtool bench {doc['subcommand']}`"
    command = f"\n\n`{doc['command']}`" if doc.get("command") else ""
    if doc.get("subcommand") == "decode":  # a model's decode steps, not kernels: its own columns
        from kvtool.bench.suites.decode import decode_table  # deferred: the suite imports the hf layer

        return f"### {head}\n\n{environment_line(doc)}{command}\n\n{decode_table(doc)}\n"
    return f"### {head}\n\n{environment_line(doc)}{command}\n\n{summary_table(doc) if summary else table(doc)}\n"
