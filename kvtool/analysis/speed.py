"""Predicted decode speed of a plan against dense, on a named card (``recommend --card / --bench``).

The inputs are measured kernel speeds: ``kernel_speedup[storage]`` = dense SDPA attention time /
that storage's attention time over the same tokens on one card, and the dense decode step's
``attention_share`` a on that card. They come from the cost model shipped in the package
(``kvtool/data/decode_speed.json``: one entry per card, each storage's number with the command and
commit that measured it; ``null`` = not measured) or from a ``kvtool bench decode / kivi /
attention -o FILE`` document (:func:`from_bench`), whose entries replace the shipped ones.

A setting (a candidate spec) keeps a share s of the tokens (its eviction share, 1 without eviction)
in a storage (its last stage; ``dense`` for eviction alone). Its attention runs at
``setting_speedup = kernel_speedup[storage] / s`` times dense. For a plan, attention time relative
to dense is the mean over every layer and KV head of ``s / kernel_speedup[storage]`` (each KV head
reads the same number of query heads), and the predicted decode speedup (tokens/s against dense)
is ``1 / ((1 - a) + a * attention_time)``. It assumes the step's time outside attention is
unchanged, attention time scales with the tokens read, and growth (encoding new blocks) is not
counted (``bench decode --generate`` measures it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvtool.core.errors import BadDataError, UsageError

SCHEMA = "kvtool.decode_speed"
ASSUMES = ("the step outside attention is unchanged; attention time = mean over layers and KV heads of kept token share / "
           "kernel_speedup of the head's storage; encoding new blocks (growth) is not counted")
EVICTING = ("snapkv", "snapstream", "streaming", "h2o", "evict")


def card_key(name: str) -> str:
    """``h100`` / ``h200`` from a card name (``NVIDIA H100 80GB HBM3``, ``H200``, ``h100``)."""
    m = re.search(r"h[12]00", name.lower())
    if not m:
        raise UsageError(f"--card {name!r}: name an H100 or an H200 (the cards kvtool has measured)")
    return m.group(0)


def parse_stage(stage: str) -> tuple[str, dict[str, str]]:
    """``quant:bits=4,group=32`` -> (``quant``, {bits: 4, group: 32}) as strings."""
    name, _, rest = stage.strip().partition(":")
    params = dict(p.split("=", 1) for p in rest.split(",") if "=" in p)
    return name.strip(), {k.strip().replace("-", "_"): v.strip() for k, v in params.items()}


def _same(a: Any, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-9
    except (TypeError, ValueError):
        return str(a).lower() == str(b).lower()


def split_setting(spec: str, context: int | None = None) -> tuple[str, float]:
    """(storage stage, kept token share) of a candidate spec: the last stage of a chain, ``dense``
    for eviction alone; the share from ``share=`` or, with ``context``, ``budget=`` tokens."""
    stages = [s for s in spec.split("+") if s.strip()]
    share = 1.0
    for st in stages:
        name, params = parse_stage(st)
        if "share" in params:
            share = float(params["share"])
        elif "budget" in params and name.startswith(EVICTING):
            if context is None:
                raise UsageError(f"setting {spec!r} keeps {params['budget']} tokens: its share needs the context length")
            share = min(1.0, float(params["budget"]) / context)
    last = stages[-1] if stages else "dense"
    if parse_stage(last)[0].startswith(EVICTING):
        last = "dense"
    return last, share


@dataclass
class CardSpeed:
    """One card's measured kernel speeds (module docstring)."""

    card: str
    device: str
    attention_share: float | None
    attention_share_source: str
    kernels: list[dict[str, Any]] = field(default_factory=list)
    source: str = "kvtool/data/decode_speed.json"

    def kernel_speedup(self, storage: str) -> tuple[float | None, str]:
        """(dense time / this storage's kernel time, where the number comes from); None when no
        measured entry matches (entries match on the format and every parameter they name; a
        storage's other parameters, like the format's defaults, are filled in by the format)."""
        name, params = parse_stage(storage)
        if name == "dense":
            return 1.0, "the baseline"
        full = _resolved(storage)
        for e in self.kernels:
            ename, eparams = parse_stage(e["storage"])
            if ename != name:
                continue
            if all(_same(full.get(k, params.get(k)), v) for k, v in eparams.items()):
                if e.get("kernel_speedup") is None:
                    return None, e.get("source", "not measured")
                return float(e["kernel_speedup"]), e.get("source", self.source)
        return None, f"no kernel speed measured for {storage} on the {self.card}"

    def setting_speedup(self, spec: str, context: int | None = None) -> tuple[float | None, str]:
        """Attention of one KV head in ``spec`` against dense: kernel_speedup / kept share."""
        storage, share = split_setting(spec, context)
        r, why = self.kernel_speedup(storage)
        if r is None:
            return None, why
        return r / max(share, 1e-9), why

    def keep(self, specs: list[str], min_speedup: float, context: int | None = None) -> tuple[list[str], dict[str, str]]:
        """The settings whose attention runs at least ``min_speedup`` x dense on this card (dense
        itself always stays: the plans' fallback, 1.0x), and why each other one was dropped."""
        kept, dropped = [], {}
        for s in specs:
            if s == "dense":
                kept.append(s)
                continue
            sp, why = self.setting_speedup(s, context)
            if sp is None:
                dropped[s] = f"{why} (--min-speedup {min_speedup:g} needs a measured speed)"
            elif sp < min_speedup - 1e-12:
                dropped[s] = f"attention {sp:.2f}x dense on the {self.card} < --min-speedup {min_speedup:g}"
            else:
                kept.append(s)
        return kept, dropped

    def predict(self, layers: dict[int, list[str]], num_layers: int, kv_heads: int, default: str = "dense",
                context: int | None = None) -> dict[str, Any]:
        """The predicted decode speed of a plan (``layers[i]``: one spec or one per KV head; other
        layers ``default``) against dense on this card (module docstring)."""
        out: dict[str, Any] = {"card": self.card, "device": self.device, "attention_share": self.attention_share,
                               "attention_share_source": self.attention_share_source, "source": self.source, "assumes": ASSUMES}
        total, unknown = 0.0, {}
        for i in range(num_layers):
            specs = layers.get(i, [default])
            per_head = specs if len(specs) == kv_heads else specs[:1] * kv_heads
            for spec in per_head:
                sp, why = self.setting_speedup(spec, context)
                if sp is None:
                    unknown[spec] = why
                else:
                    total += 1.0 / sp
        if unknown:
            return {**out, "predicted_decode_speedup": None, "predicted_attention_speedup": None, "unmeasured": unknown}
        att = total / (num_layers * kv_heads)
        out["predicted_attention_speedup"] = 1.0 / att
        a = self.attention_share
        out["predicted_decode_speedup"] = None if a is None else 1.0 / ((1.0 - a) + a * att)
        return out


def _resolved(storage: str) -> dict[str, Any]:
    """The storage's parameters as the format fills them (defaults included); {} if it cannot."""
    try:
        from kvtool.formats.pipeline import resolve  # deferred: the formats load only when a storage is matched

        _, params, _ = resolve(storage)
        return dict(vars(params))
    except Exception:
        return {}


def load_cost_model(path: Path | None = None) -> dict[str, Any]:
    """The shipped cost model (or ``path``), checked."""
    try:
        text = Path(path).read_text() if path else resources.files("kvtool").joinpath("data/decode_speed.json").read_text()
        doc = json.loads(text)
    except (OSError, ValueError) as exc:
        raise BadDataError(f"decode speed model {path or 'kvtool/data/decode_speed.json'}: {exc}") from None
    if doc.get("schema") != SCHEMA or not isinstance(doc.get("cards"), dict):
        raise BadDataError(f"decode speed model {path or 'kvtool/data/decode_speed.json'}: not a {SCHEMA} document")
    return doc


def from_package(card: str, doc: dict[str, Any] | None = None) -> CardSpeed:
    """One card of the shipped cost model."""
    doc = doc or load_cost_model()
    key = card_key(card)
    c = doc["cards"].get(key)
    if c is None:
        raise UsageError(f"--card {card}: the shipped speed model has {', '.join(doc['cards'])}")
    return CardSpeed(key, c.get("device", key), c.get("attention_share"), c.get("attention_share_source", ""), list(c.get("kernels", [])))


def _config(recs: list[dict[str, Any]]) -> tuple[int, int]:
    """The batch x context of a bench document to read: 8 x 32k when present, else the largest."""
    configs = {(r["batch"], r["seq"]) for r in recs if r.get("median_us")}
    if not configs:
        raise BadDataError("the bench document has no timed record")
    return (8, 32768) if (8, 32768) in configs else max(configs, key=lambda c: c[0] * c[1])


KIVI_PROVIDERS = {"kivi2": "quant:bits=2,group=32", "kivi4": "quant:bits=4,group=32", "kivi4_g128": "quant:bits=4,group=128"}


def from_bench(path: Path, card: str | None = None) -> CardSpeed:
    """Kernel speeds from a ``kvtool bench decode / kivi / attention`` JSON (module docstring) at
    batch 8 x 32k (else its largest configuration), over the shipped card's where both have one.
    ``decode``: a provider's attention time (every layer, captured) against dense/sdpa's, times its
    kept share; the attention share is dense/sdpa's. ``kivi`` / ``attention``: each kernel against
    the best dense kernel of the run."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--bench {path}: {exc}") from None
    if "records" not in doc or "env" not in doc:
        raise UsageError(f"--bench {path}: not a kvtool bench document (kvtool bench ... -o FILE)")
    device = doc["env"].get("device", "")
    key = card_key(card or device)
    if card and key != card_key(device):
        raise UsageError(f"--bench {path} was measured on {device}, not the --card {card}")
    try:
        base = from_package(key)
    except UsageError:
        base = CardSpeed(key, device, None, "")
    sub = doc.get("subcommand")
    recs = [r for r in doc["records"] if r.get("median_us")]
    b, t = _config(recs)
    at = [r for r in recs if (r["batch"], r["seq"]) == (b, t)]
    where = f"{path} ({device}, {doc.get('date', '?')}, commit {doc.get('commit', '?')}, batch {b} x {t})"
    found: list[dict[str, Any]] = []
    share, share_source = base.attention_share, base.attention_share_source
    if sub == "decode":
        dense = next((r for r in at if r["provider"] == "dense/sdpa" and r.get("attention_us")), None)
        if dense is None:
            raise UsageError(f"--bench {path}: no dense/sdpa record at batch {b} x {t} to compare with")
        share, share_source = dense["attention_share"], f"dense/sdpa in {where}"
        for r in at:
            p = r["provider"]
            if p.startswith("dense/") or p.endswith(".json") or not r.get("attention_us") or r.get("kernel") != "decode":
                continue
            storage, kept = split_setting(p, t)
            found.append({"storage": storage, "kernel_speedup": dense["attention_us"] / r["attention_us"] * kept, "source": f"{p} in {where}"})
    elif sub in ("kivi", "attention"):
        for r in at:
            sp = r["speedup"].get("best_dense")
            if not isinstance(sp, (int, float)):
                continue
            if r["provider"] in KIVI_PROVIDERS:
                storage = KIVI_PROVIDERS[r["provider"]]
            elif r["provider"] == "bitmap" and r.get("sparsity") is not None:
                storage = f"bitmap:sparsity={r['sparsity']:g}"
            else:
                continue
            found.append({"storage": storage, "kernel_speedup": float(sp), "source": f"{r['provider']} in {where}"})
    else:
        raise UsageError(f"--bench {path}: a `bench {sub}` document; give one of bench decode, kivi or attention")
    if not found:
        raise UsageError(f"--bench {path}: no kernel of a storage kvtool plans with at batch {b} x {t}")
    return CardSpeed(key, device, share, share_source, found + base.kernels, source=str(path))


def choose(card: str | None, bench: Path | None, min_speedup: float | None) -> tuple[list[CardSpeed], CardSpeed | None, float | None]:
    """``recommend``'s cards: the predictions' cards (the named one, else every shipped card), the
    card that filters the menu (named by ``card`` or ``bench``) and the filter's threshold
    (``min_speedup``; 1.0 when a card is named, else none)."""
    if min_speedup is not None and min_speedup <= 0:
        raise UsageError("--min-speedup must be above 0 (1.0: no setting slower than dense)")
    if bench is not None:
        chosen: CardSpeed | None = from_bench(bench, card)
    elif card is not None:
        chosen = from_package(card)
    else:
        if min_speedup is not None:
            raise UsageError("--min-speedup needs a card: --card h100 / h200, or --bench FILE")
        doc = load_cost_model()
        return [from_package(k, doc) for k in doc["cards"]], None, None
    return [chosen], chosen, 1.0 if min_speedup is None else min_speedup


def annotate(result: dict[str, Any], cards: list[CardSpeed], chosen: CardSpeed | None, min_speedup: float | None,
             dropped: dict[str, str]) -> None:
    """Each budget's plan (and its entry) gains ``predicted_decode`` (one prediction per card);
    the result gains ``decode_speed`` (the filtering card, threshold and dropped settings), whose
    dropped settings join ``dropped``."""
    facts = result.get("model_facts") or {}
    for b in result["budgets"]:
        plan = b["plan"]
        n = int(plan.model.get("num_layers") or facts.get("num_layers") or (max(plan.layers) + 1 if plan.layers else 0))
        h = int(plan.model.get("num_kv_heads") or facts.get("num_kv_heads") or 1)
        preds = [c.predict(plan.layers, n, h, plan.default) for c in cards]
        b["predicted_decode"] = preds
        plan.extra["predicted_decode"] = preds
    result["decode_speed"] = {"card": chosen.card if chosen else None, "device": chosen.device if chosen else None,
                              "min_speedup": min_speedup, "source": chosen.source if chosen else "kvtool/data/decode_speed.json",
                              "dropped": dict(dropped)}
    if dropped:
        result["dropped"] = {**(result.get("dropped") or {}), **dropped}


def describe(pred: dict[str, Any]) -> str:
    """One line: ``h100: 1.62x dense tokens/s (attention 2.40x; attention 59% of a dense step)``."""
    if pred.get("predicted_attention_speedup") is None:
        return f"{pred['card']}: not predicted (unmeasured: {', '.join(sorted(pred.get('unmeasured', {})))})"
    share = pred.get("attention_share")
    dec = pred.get("predicted_decode_speedup")
    return (f"{pred['card']}: {dec:.2f}x dense tokens/s" if dec is not None else f"{pred['card']}: -") + \
        f" (attention {pred['predicted_attention_speedup']:.2f}x" + (f"; attention {100 * share:.0f}% of a dense step)" if share is not None else ")")
