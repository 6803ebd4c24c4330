"""Figures of ``kvtool bench`` results: time vs sequence length per provider, speedup vs sparsity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtool.core import io

LINE_STYLES = ("-", "--", ":", "-.")


def line_styles(labels: list[str], palette: list[Any]) -> dict[str, dict[str, Any]]:
    """Plot keywords per label ``"<kernel> <rest>"``: one colour per kernel (the first word, in
    sorted order, from ``palette``), one line style per distinct rest within a kernel, so that many
    series stay told apart instead of the default ten-colour cycle repeating."""
    kernels = sorted({label.partition(" ")[0] for label in labels})
    seen: dict[str, list[str]] = {}
    styles = {}
    for label in sorted(labels):
        kernel, _, rest = label.partition(" ")
        seen.setdefault(kernel, []).append(rest)
        styles[label] = dict(color=palette[kernels.index(kernel) % len(palette)],
                             linestyle=LINE_STYLES[(len(seen[kernel]) - 1) % len(LINE_STYLES)])
    return styles


def plot_records(doc: dict[str, Any], path: str | Path, force: bool = True) -> Path:
    """Left: median µs vs seq (log-log), one line per (kernel/provider, param) for the largest batch.
    Right: speedup over each baseline vs sparsity (or budget / k) at the largest seq and batch.
    Only records with a timing are drawn. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in doc["records"] if r["median_us"] is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    env = doc["env"]
    title = f"kvtool bench {doc['subcommand']} — {env['device']}"
    if not env.get("timing_valid", True):
        title += " (CPU interpreter: timings meaningless)"
    fig.suptitle(title, fontsize=10)
    palette = list(plt.get_cmap("tab10").colors)
    if recs:
        batch = max(r["batch"] for r in recs)
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in recs:
            if r["batch"] != batch:
                continue
            label = r["provider"] + "".join(f" {n}={r[n]}" for n in ("sparsity", "budget", "k") if r[n] is not None)
            lines.setdefault(label, []).append((r["seq"], r["median_us"]))
        styles = line_styles(list(lines), palette)
        for label, pts in sorted(lines.items()):
            pts.sort()
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, **styles[label])
        ax1.set_xscale("log", base=2)
        ax1.set_yscale("log")
        ax1.set_xlabel("sequence length (tokens)")
        ax1.set_ylabel("median time (µs)")
        ax1.set_title(f"time vs sequence length, batch {batch}", fontsize=9)
        ax1.legend(fontsize=7)
        ax1.grid(True, which="both", alpha=0.3)

        seq = max(r["seq"] for r in recs if r["batch"] == batch)
        param = next((n for n in ("sparsity", "budget", "k") if any(r[n] is not None for r in recs)), None)
        if param is not None:
            series: dict[str, list[tuple[float, float]]] = {}
            for r in recs:
                if r["batch"] != batch or r["seq"] != seq or r[param] is None:
                    continue
                primary = doc.get("primary_baselines") or list(r["speedup"])
                for base, val in r["speedup"].items():
                    if isinstance(val, float) and base in primary:
                        series.setdefault(f"{r['provider']} over {base}", []).append((r[param], val))
            styles2 = line_styles(list(series), palette)
            for label, pts in sorted(series.items()):
                pts.sort()
                ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, **styles2[label])
            ax2.axhline(1.0, color="grey", lw=0.8)
            ax2.set_xlabel(param)
            ax2.set_ylabel("speedup (baseline time / kernel time)")
            ax2.set_title(f"speedup vs {param}, batch {batch}, seq {seq}", fontsize=9)
            if series:
                ax2.legend(fontsize=7)
            ax2.grid(True, alpha=0.3)
        else:
            for label in sorted(lines):
                pts = sorted((r["seq"], r["bandwidth_fraction"]) for r in recs if r["batch"] == batch and r["bandwidth_fraction"] is not None
                             and r["provider"] + "".join(f" {n}={r[n]}" for n in ("sparsity", "budget", "k") if r[n] is not None) == label)
                if pts:
                    ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, **styles[label])
            ax2.axhline(1.0, color="grey", lw=0.8)
            ax2.set_xscale("log", base=2)
            ax2.set_xlabel("sequence length (tokens)")
            ax2.set_ylabel("bytes read / time / measured copy bandwidth")
            ax2.set_title(f"effective bandwidth vs copy, batch {batch}", fontsize=9)
            if ax2.get_lines()[1:]:
                ax2.legend(fontsize=7)
            ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    with io.atomic_path(path, force) as tmp:
        fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path


def plot_decode(doc: dict[str, Any], path: str | Path) -> Path:
    """``bench decode``: left, tokens/s per provider against the batch, one panel line per context
    length (budget rows as stars at their largest batch); right, peak GPU memory beside the weights
    against the bytes the cache holds, per provider at the largest batch and context. Written
    atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in doc["records"] if r["median_us"] is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    env = doc["env"]
    fig.suptitle(f"kvtool bench decode — {env['device']}" + ("" if env.get("timing_valid", True) else " (CPU: timings meaningless)"), fontsize=10)
    palette = list(plt.get_cmap("tab10").colors) + list(plt.get_cmap("Dark2").colors)
    providers = sorted({r["provider"] for r in recs})
    colour = {p: palette[i % len(palette)] for i, p in enumerate(providers)}
    seqs = sorted({r["seq"] for r in recs if r["kernel"] == "decode"})
    for p in providers:
        for k, seq in enumerate(seqs):
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in recs if r["provider"] == p and r["seq"] == seq and r["kernel"] == "decode")
            if pts:
                ax1.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=colour[p], linestyle=LINE_STYLES[k % len(LINE_STYLES)],
                         label=f"{p} {seq // 1024}k" if seq >= 1024 else f"{p} {seq}")
        for r in recs:
            if r["provider"] == p and r["kernel"] == "decode-budget":
                ax1.plot([r["batch"]], [r["tokens_per_s"]], marker="*", markersize=12, color=colour[p], linestyle="none")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("batch (stars: largest batch under the memory budget)")
    ax1.set_ylabel("tokens / s")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=6, ncol=2)
    main = [r for r in recs if r["kernel"] == "decode" and r.get("peak_bytes") is not None]
    if main:
        top = max((r["batch"], r["seq"]) for r in main)
        rows = [r for r in main if (r["batch"], r["seq"]) == top]
        xs = range(len(rows))
        ax2.bar([x - 0.2 for x in xs], [r["stored_bytes"] / 2**30 for r in rows], width=0.4, label="cache held (stored bytes)", color="#4c72b0")
        ax2.bar([x + 0.2 for x in xs], [r["peak_bytes"] / 2**30 for r in rows], width=0.4, label="peak beside the weights", color="#dd8452")
        ax2.set_xticks(list(xs))
        ax2.set_xticklabels([r["provider"] for r in rows], rotation=30, ha="right", fontsize=7)
        ax2.set_ylabel("GiB")
        ax2.set_title(f"memory at batch {top[0]} x {top[1]} tokens", fontsize=9)
        ax2.legend(fontsize=7)
        ax2.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    with io.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path
