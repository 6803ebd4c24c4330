"""``kvtool stats``: where a capture's cache can be cut, in numbers (see :mod:`kvtool.analysis.stats`)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvtool.commands._command import Outcome, add_commands, declare
from kvtool.commands._common import (
    DeviceOpt,
    CaptureArg,
    HeadsOpt,
    LayersOpt,
    console,
    example_epilog,
    make_table,
    show,
)
from kvtool.core.progress import Progress

ORDER = 30
SHORT_HELP = "Magnitudes, outlier channels, sign entropy, attention concentration"




def _channels(chans: list[int], limit: int = 6) -> str:
    text = ",".join(map(str, chans[:limit]))
    return text + (f",+{len(chans) - limit}" if len(chans) > limit else "")


def print_stats(result: dict[str, Any], path: Any) -> None:
    """The rich tables of :func:`kvtool.analysis.file_drivers.stats_file`'s result."""
    from kvtool.core.cache import format_indices  # deferred: start-up time

    m = result["model_facts"]
    s = result["settings"]
    show("[bold]{}[/bold]: {}, {} x {} tokens, layers {}, KV heads {} (head_dim {}, {} query heads, GQA group {})", path, m["name"],
         result["batch"], result["tokens"], format_indices(result["selection"]["selected_layers"]), format_indices(result["selection"]["selected_kv_heads"]),
         m["head_dim"], m["num_heads"], m["num_heads"] // m["num_kv_heads"])
    index = {(e["layer"], h["kv_head"]): h for e in result["layers"] for h in e["heads"]}
    order = [(r["layer"], r["head"]) for r in result["rows"]]
    kept = " and ".join(str(k) for k in s["kept_elements"].values())
    mag_rows, shape_rows = [], []
    for li, h in order:
        for part, tag in (("keys", "K"), ("values", "V")):
            st = index[(li, h)][part]
            mag_rows.append((li, h, tag, st["mean_abs"], st["max_abs"], st["p50"], st["p90"], st["p99"], st["p99.9"], st["kurtosis"]))
            shape_rows.append(
                (li, h, tag, st["outliers"], _channels(st["outlier_channels"]) or "-", _times(st["max_ratio"]), _pct(st.get("top30_share")), _pct(st.get("top50_share")),
                 st["code_entropy_raw"], st["code_entropy_mean"], st["code_entropy_median"])
            )
    console.print(make_table("magnitudes |x| per KV head (K keys, V values; mean, max and percentiles of |x|; kurt = excess kurtosis)", ["layer", "head", "part", "mean", "max", "p50", "p90", "p99", "p99.9", "kurt"], mag_rows))
    console.print(
        make_table(
            f"outlier channels (mean |x| >= {s['outlier_factor']:g} x median channel; max/med: largest ratio), "
            f"share of a token's L2 mass in its top 30% / 50% elements ({kept} of {m['head_dim']}), "
            "4-dim sign-code entropy in bits (of 4): raw, mean-centred, median-centred",
            ["layer", "head", "part", "outliers", "channels", "max/med", "top30 %", "top50 %", "H raw", "H mean", "H med"],
            shape_rows,
        )
    )
    if result["selection"]["attention"]:
        rows = []
        for li, h in order:
            a = index[(li, h)]["attention"]
            rows.append((li, h, ",".join(map(str, a["query_heads"])), _count(a["keys90"]), _pct(a["keys90_frac"]), _count(a["keys99"]), _pct(a["keys99_frac"]),
                         _pct(a["sink_share"]), a["out_norm"], _pct(a["out_norm_share"])))
        console.print(
            make_table(
                f"attention of up to {s['max_queries']} sampled queries per sequence (second half, causal), means over each KV head's query heads: "
                "keys a query needs for 90% / 99% of its attention mass (a count, and % of the keys it sees), mass on the first "
                f"{s['sink_tokens']} tokens, output norm and its share of the layer's",
                ["layer", "head", "q heads", "keys for 90%", "% of seen", "keys for 99%", "% of seen", "sink %", "out norm", "norm share %"],
                rows,
            )
        )
    else:
        console.print("no attention statistics: the capture has no queries (recapture without --no-queries) or --no-attention was given")
    _print_layer_table(result)
    _print_consistency(result)


def _pct(x: float | None) -> str | None:
    """A fraction as a percentage with 2 decimals (the column header carries the %)."""
    return None if x is None else f"{100 * x:.2f}"


def _count(x: float | None) -> str | None:
    """A mean count (keys, tokens) with 1 decimal."""
    return None if x is None else f"{x:.1f}"


def _times(x: float | None) -> str | None:
    """A ratio to the median as ``9.78x``."""
    return None if x is None else f"{x:.2f}x"


def _print_layer_table(result: dict[str, Any]) -> None:
    from kvtool.analysis.stats import mass_tag  # deferred: start-up time

    ms = result["model_summary"]
    entries = [(str(e["layer"]), e["keys"], e["values"], e.get("attention", {}).get("all_heads")) for e in result["layers"]]
    entries.append(("all", ms["keys"], ms["values"], ms.get("attention")))
    rows = [
        (name, k["outliers"], _times(k["max_ratio"]), v["outliers"], _times(v["max_ratio"]), _pct(k.get("top30_share")), _pct(v.get("top30_share")),
         k["code_entropy_raw"], k["code_entropy_mean"], v["code_entropy_raw"], v["code_entropy_mean"])
        for name, k, v, _ in entries
    ]
    console.print(
        make_table(
            "per layer over the selected KV heads (outliers summed; H: sign-code entropy raw / mean-centred)",
            ["layer", "K outliers", "K max/med", "V outliers", "V max/med", "K top30 %", "V top30 %", "K H raw", "K H mean", "V H raw", "V H mean"],
            rows,
        )
    )
    if not result["selection"]["attention"]:
        return
    masses = [mass_tag(x) for x in result["settings"]["attention_masses"]]
    h = result["model_facts"]["num_heads"]
    rows = [
        [name, _count(a["mean_visible"])] + [_pct(a[f"keys{t}_frac"]) for t in masses] + [_pct(a["sink_share"])] + [f"{a[f'heads{t}']:.2f} of {h}" for t in masses]
        for name, _, _, a in entries
    ]
    console.print(
        make_table(
            "attention per layer: % of the keys a query sees that hold 90% / 99% of its mass; query heads needed per query for 90% / 99% of the summed output norm",
            ["layer", "keys seen"] + [f"% of keys for {t}%" for t in masses] + ["sink %"] + [f"heads for {t}%" for t in masses],
            rows,
        )
    )


def _print_consistency(result: dict[str, Any]) -> None:
    for part in ("keys", "values"):
        c = result["outlier_consistency"][part]
        rec = [(e["channel"], e["pairs"]) for e in c["by_channel"] if e["pairs"] >= 2]
        pairs = c["layer_head_pairs"]
        if not c["by_channel"]:
            console.print(f"{part}: no outlier channels in the selection")
            continue
        text = ", ".join(f"ch {ch} in {n}/{pairs}" for ch, n in rec[:8]) or "none repeats"
        persistent = {v["kv_head"]: v["persistent"] for v in c["per_kv_head"] if v["persistent"]}
        extra = "; outliers in every selected layer: " + "; ".join(f"KV head {h}: {_channels(p)}" for h, p in persistent.items()) if persistent else ""
        show("{} outlier channels over (layer, KV head) pairs: {}{}", part, text, extra)


@declare(
    "stats",
    help="Statistics of a capture per layer and KV head: magnitudes, outlier channels, top-k L2-mass shares, "
    "sign balance and sign-code entropy, and (from queries) attention concentration, sink share and head importance.",
    epilog=example_epilog(
        "kvtool stats sample:",
        "kvtool stats cap.safetensors --layers 10-20 --sort k_outliers --top 10",
        "kvtool stats cap.safetensors --outlier-factor 6 --json > stats.json",
    ),
    render=lambda outcome: print_stats(outcome.data, outcome.input),
)
def stats(
    capture: CaptureArg,
    layers: LayersOpt = None,
    heads: HeadsOpt = None,
    sort: Annotated[str | None, typer.Option("--sort", help="Order the per-head rows by a column key, e.g. k_outliers, k_kurtosis, v_top30, keys90_frac, sink_share (largest first).")] = None,
    top: Annotated[int | None, typer.Option("--top", min=1, help="Show only the first N per-head rows (after --sort).")] = None,
    outlier_factor: Annotated[float, typer.Option("--outlier-factor", min=1.0, help="A channel is an outlier when its mean |x| is at least this many times the median channel's.")] = 4.0,
    queries: Annotated[int, typer.Option("--queries", min=1, help="Query positions sampled per sequence for attention statistics.")] = 64,
    sink: Annotated[int, typer.Option("--sink", min=1, help="First tokens counted as attention sinks.")] = 4,
    attention: Annotated[bool | None, typer.Option("--attention/--no-attention", help="Attention statistics from the captured queries (default: when the capture has queries).")] = None,
    device: DeviceOpt = "auto",
    *,
    progress: Progress,
) -> Outcome:
    from kvtool.analysis.file_drivers import stats_file  # deferred: start-up time
    from kvtool.analysis.stats import StatsSettings  # deferred: start-up time

    settings = StatsSettings(outlier_factor=outlier_factor, max_queries=queries, sink_tokens=sink)
    result = stats_file(capture, layers, heads, settings, attention, sort, top, progress=progress, device=device)
    return Outcome(result, input=capture)


def register(app: typer.Typer) -> None:
    add_commands(app, stats)
