"""Sweeps of formats and parameters over captures (the library behind ``kvtool eval``).

A sweep spec is ``NAME[:key=v1,v2,...,key2=w1,...]``: every comma-separated item without ``=``
adds a value to the key before it, and the points are the Cartesian product
(``bitmap:sparsity=0.5,0.7,method=per-token`` -> two points). Each point compresses the capture in
memory (:func:`~kvtool.formats.base.compress_cache`) and is scored on the held-out queries
(:func:`~kvtool.analysis.fidelity.attention_fidelity`) and, with a model, on the continuation
(:func:`~kvtool.analysis.fidelity.model_fidelity`). Results are keyed (:func:`point_key`) so an interrupted
run resumes without recomputing finished points.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtool.core.documents import check_eval_points
from kvtool.core.errors import UsageError
from kvtool.core.limits import read_json_input
from kvtool.core.names import unalias
from kvtool.formats.base import FORMATS, get_format, make_params
from kvtool.formats import load_all
from kvtool.formats.pipeline import split_chain, step_kind

def paper_rows() -> list[tuple[str, str, str]]:
    """The papers' comparison rows every format declares (``Format.paper_rows``), each comparison's
    rows together, comparisons in the order they first appear (formats by name)."""
    rows = [row for name in sorted(load_all()) for row in FORMATS[name].paper_rows]
    order = {comp: i for i, (comp, _, _) in reversed(list(enumerate(rows)))}
    return sorted(rows, key=lambda r: order[r[0]])


def expand_spec(spec: str) -> list[tuple[str, dict[str, str]]]:
    """``"bitmap:sparsity=0.5,0.7,method=per-token"`` -> ``[("bitmap", {...0.5...}), ("bitmap", {...0.7...})]``.
    A chain or a lone eviction / pruning step (``snapkv:budget=128+kivi4``; read as ``kvtool compress
    --format`` reads it) is one ``pipeline`` point; ``kivi`` and the other aliases sweep the format they
    stand for (:data:`kvtool.core.names.FORMAT_ALIASES`)."""
    if "+" in spec or step_kind(spec) != "format":
        evict, prune, storage = split_chain(spec)
        steps = {"evict": evict, "prune": prune, "format": storage}
        return [("pipeline", {k: (v or "none").replace(",", ";") for k, v in steps.items()})]
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise UsageError(f"cannot read sweep {spec!r}: write NAME[:key=v1,v2,...]")
    grid: dict[str, list[str]] = {}
    key = None
    for item in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = item.partition("=")
        if eq:
            key = k.strip().replace("-", "_")
            if not key:
                raise UsageError(f"cannot read {item!r} in {spec!r}: write key=value")
            grid.setdefault(key, []).append(v.strip())
        elif key is None:
            raise UsageError(f"cannot read {item!r} in {spec!r}: write key=value first, then more values after commas")
        else:
            grid[key].append(item)
    keys = list(grid)
    combos = [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))] if keys else [{}]
    return [unalias(name, values, spec) for values in combos]


@dataclass
class Point:
    """One sweep point: format name, parameter strings as given, and its comparison row if any."""

    format: str
    values: dict[str, str]
    comparison: str | None = None
    label: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def spec(self) -> str:
        return self.format + (":" + ",".join(f"{k}={v}" for k, v in self.values.items()) if self.values else "")


def resolve_points(specs: list[str], paper: bool = False) -> list[Point]:
    """Points for the given specs (or the defaults of every registered format) and, with ``paper``,
    the paper comparison rows. Unknown formats in explicit specs are a UsageError; parameters a format
    does not take mark the point skipped with the reason."""
    load_all()
    explicit = bool(specs)
    if not specs:
        specs = [s for name in sorted(FORMATS) if FORMATS[name].swept_by_default for s in FORMATS[name].sweep_specs()]
    points: list[Point] = []
    for spec in specs:
        for name, values in expand_spec(spec):
            if explicit:
                get_format(name)
            points.append(Point(name, values))
    if paper:
        points += [Point(*expand_spec(spec)[0], comparison=comp, label=label) for comp, label, spec in paper_rows()]
    seen: set[tuple[str, str | None, str | None]] = set()
    unique: list[Point] = []
    for p in points:
        ident = (p.spec, p.comparison, p.label)
        if ident in seen:
            continue
        seen.add(ident)
        if p.format not in FORMATS:
            p.skipped = f"format {p.format} is not in this kvtool"
        else:
            try:
                p.params = make_params(FORMATS[p.format], p.values).to_dict()
            except UsageError as exc:
                p.skipped = str(exc)
        unique.append(p)
    return unique


def point_key(capture_sha: str, point: Point, heldout: int, model: str | None, generate: int, layers: list[int] | None = None) -> str:
    """A stable key for resuming: capture, format, resolved parameters, held-out count, model,
    generate, and the layers compressed."""
    return json.dumps([capture_sha[:16], point.format, point.params, heldout, model or "", generate, layers or []], sort_keys=True)


def upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """A point read from an eval.json of an earlier kvtool in today's names: ``per_layer_rel_l2``
    (a map by layer) becomes ``layers`` (a list of ``{"layer", "rel_l2"}``); the text
    ``layers_compressed`` ("4/30") becomes ``compressed_layers`` and ``model_layers``."""
    old = row.pop("per_layer_rel_l2", None)
    if isinstance(old, dict):
        row["layers"] = [{"layer": int(i), "rel_l2": v} for i, v in old.items()]
    text = row.pop("layers_compressed", None)
    if isinstance(text, str) and "/" in text:
        row["model_layers"] = int(text.split("/")[1])
        row.setdefault("compressed_layers", [e["layer"] for e in row.get("layers", [])])
    return row


def load_results(path: Path) -> dict[str, dict[str, Any]]:
    """Finished points from an earlier run's JSON (``{"points": [{"key": ..., ...}]}``), by key."""
    if not path.exists():
        return {}
    hint = f"{path} (pass --force to start afresh or use another --out-dir)"
    # eval's own state, rewritten by this run: read with the bounds, not recorded as an input
    data = read_json_input(path, hint, error=UsageError, record=False)
    return {p["key"]: upgrade_row(p) for p in check_eval_points(data, hint, UsageError) if isinstance(p.get("key"), str)}


def summarize(att: dict[str, Any], model: dict[str, Any] | None) -> dict[str, Any]:
    """The flat row of one point: ratios, errors, recall, model metrics (None where not measured)."""
    return {
        "storage_ratio": att["storage_ratio"],
        "traffic_ratio": att["traffic_ratio"],
        "rel_l2": att["overall"]["rel_l2"],
        "cosine": att["overall"]["cosine"],
        "max_abs": att["overall"]["max_abs"],
        "recall": att["recall"]["recall"] if att.get("recall") else None,
        "nll_increase": model["nll_increase"] if model else None,
        "ppl_ratio": model["ppl_ratio"] if model else None,
        "agreement": model["agreement"] if model else None,
        "kl": model["kl"] if model else None,
        "first_divergence": model.get("first_divergence") if model else None,
    }


METRICS: dict[str, tuple[str, bool]] = {
    # name: (axis label, higher is better)
    "rel_l2": ("attention-output relative L2 error", False),
    "cosine": ("attention-output cosine", True),
    "recall": ("attention-mass recall", True),
    "agreement": ("top-1 next-token agreement", True),
    "nll_increase": ("NLL increase (nats/token)", False),
    "kl": ("KL(dense || lossy)", False),
    # `kvtool tasks`: share of long-context task samples answered right through the compressed context
    "task_accuracy": ("task accuracy (question after compression)", True),
}


def pareto_front(xs: list[float], ys: list[float], higher_is_better: bool) -> list[int]:
    """Indices of the points no other point beats in both fewer bytes (x) and better fidelity (y),
    ordered by x."""
    pts = [(x, y, i) for i, (x, y) in enumerate(zip(xs, ys)) if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]
    pts.sort(key=lambda p: (p[0], -p[1] if higher_is_better else p[1]))
    front: list[int] = []
    best = None
    for x, y, i in pts:
        if best is None or (y > best if higher_is_better else y < best):
            front.append(i)
            best = y
    return front
