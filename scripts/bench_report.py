"""Markdown tables (and, with --plot-dir, the figures) from `kvtool bench --json` files, for
docs/benchmarks.md. Only measured numbers: every cell comes from a record of the given files.

    python scripts/bench_report.py docs/benchmarks/*.json [--plot-dir docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.bench_plots import plot_records  # noqa: E402

SHOWN = {
    "dense": ["cublas_qk", "cublas_pv", "cublas_qk+pv", "torch_dense", "sdpa", "flashinfer_single", "flashinfer_batch", "flashinfer_batch_tc"],
}


def fmt(x, nd=2):
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    return f"{x:.{nd}f}"


def table(doc: dict) -> str:
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
                      f"{100 * r['bandwidth_fraction']:.0f}%", f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "–"]
        for b in primary:
            v = r["speedup"].get(b)
            cells.append("" if v is None or b == r["provider"] else (f"{v:.2f}" if isinstance(v, float) else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--plot-dir")
    args = ap.parse_args()
    for f in args.files:
        doc = json.loads(Path(f).read_text())
        env = doc["env"]
        v = env["versions"]
        print(f"### `kvtool bench {doc['subcommand']}` — {Path(f).name}\n")
        print(f"{env['device']}; copy {env['copy_gbps']:.0f} GB/s, read-only {env.get('read_gbps') or 0:.0f} GB/s; torch {v['torch']}, "
              f"triton {v['triton']}, CUDA {v['cuda']}, FlashInfer {v['flashinfer']}; cold L2 {'on' if env['cold_l2'] else 'off'}; "
              f"{'; '.join(env.get('notes', []))}\n")
        print(table(doc) + "\n")
        if args.plot_dir:
            plot_records(doc, Path(args.plot_dir) / (Path(f).stem + ".png"))


if __name__ == "__main__":
    main()
