"""Compression plans: which format stores each layer (and each KV head) of a capture.

A plan file (JSON, schema ``kvtool.formats.plan``, written by ``kvtool recommend`` or by hand)::

    {
      "schema": "kvtool.plan", "version": 1,
      "model": {"name": "SmolLM2-135M-Instruct", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64},
      "default": "dense",
      "layers": {"0": "quant:bits=4", "1": ["quant:bits=2", "dense", "quant:bits=2"], ...},
      "budget": {...}, "predicted": {...}
    }

``layers`` maps a model layer index to one spec (the whole layer) or a list of ``num_kv_heads``
specs (one per KV head); a spec is anything ``kvtool compress --format`` takes, chains included
(``snapkv:budget=256+quant:bits=4``). Layers not listed use ``default``. ``model`` (optional) is
checked against the capture. Other keys (``budget``, ``predicted``, ``chosen_layers`` where
``recommend`` saw a capture of some layers only, ...) are informational; layers a plan does not list
are named on stderr when it is applied (and in ``compress --json`` as ``plan_default_layers``).

:func:`compress_plan` applies a plan to a capture: the result is a ``mixed`` compressed file
(:mod:`kvtool.formats.mixed`).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtool.core.cache import KVCache, LayerKV, ModelFacts
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.limits import read_json_input
from kvtool.formats.mixed import resolve_spec
from kvtool.core.io import atomic_write_text
from kvtool.formats.base import CompressedCache, get_format
from kvtool.formats.mixed import encode_groups, encode_kept_heads

PLAN_SCHEMA = "kvtool.plan"
PLAN_VERSION = 1


@dataclass
class Plan:
    """Per-layer specs: ``layers[i]`` is a list of one spec (whole layer) or ``num_kv_heads`` specs."""

    layers: dict[int, list[str]]
    default: str = "dense"
    model: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def specs_for(self, layer: int) -> list[str]:
        return self.layers.get(layer, [self.default])

    def to_dict(self) -> dict[str, Any]:
        layers = {str(i): (s[0] if len(s) == 1 else list(s)) for i, s in sorted(self.layers.items())}
        return {"schema": PLAN_SCHEMA, "version": PLAN_VERSION, "model": self.model, "default": self.default, "layers": layers, **self.extra}

    def check(self, facts: ModelFacts, layer_indices: list[int]) -> None:
        """UsageError when the plan names a layer the capture lacks, gives a wrong number of head
        specs, was made for another model shape, or holds a spec kvtool cannot read."""
        for key in ("num_layers", "num_kv_heads", "head_dim"):
            want = self.model.get(key)
            if want is not None and want != getattr(facts, key):
                raise UsageError(f"the plan was made for a model with {key.replace('_', ' ')} {want}; the capture's model has {getattr(facts, key)}")
        extra = sorted(set(self.layers) - set(layer_indices))
        if extra:
            raise UsageError(f"the plan gives layer {extra[0]}, which the capture does not hold")
        for i, specs in self.layers.items():
            if len(specs) not in (1, facts.num_kv_heads):
                raise UsageError(f"plan layer {i}: give one spec or {facts.num_kv_heads} (one per KV head), not {len(specs)}")
        for spec in {s for specs in self.layers.values() for s in specs} | {self.default}:
            try:
                resolve_spec(spec)
            except UsageError as exc:
                raise UsageError(f"plan spec {spec!r}: {exc}") from None


_LAYER_KEY = re.compile(r"0|[1-9][0-9]{0,8}")


def default_layers(plan: Plan, layer_indices: list[int]) -> list[int]:
    """The layers of ``layer_indices`` the plan does not list: they use its ``default``."""
    return [i for i in layer_indices if i not in plan.layers]


def note_default_layers(plan: Plan, layer_indices: list[int], where: str = "the plan") -> list[int]:
    """Say on stderr which layers a plan covers with its ``default`` (a plan made on a capture of
    fewer layers, say); returns them."""
    rest = default_layers(plan, layer_indices)
    if rest and plan.layers:
        shown = ", ".join(str(i) for i in rest[:12]) + (" ..." if len(rest) > 12 else "")
        print(f"note: {where} does not list {len(rest)} of {len(layer_indices)} layers ({shown}); they use its default {plan.default!r}", file=sys.stderr)
    return rest


def plan_from_dict(data: Any, where: str = "the plan") -> Plan:
    """Parse a plan dict (see the module docstring); UsageError naming what is wrong."""
    if not isinstance(data, dict) or data.get("schema") != PLAN_SCHEMA:
        raise UsageError(f"{where} is not a kvtool plan (expected \"schema\": \"{PLAN_SCHEMA}\")")
    version = data.get("version", PLAN_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise UsageError(f"{where}: \"version\" must be a plan version number (1), got {json.dumps(version)[:40]}")
    if version > PLAN_VERSION:
        raise UsageError(f"{where} has plan version {version}; this kvtool reads up to {PLAN_VERSION}")
    model = data.get("model") or {}
    if not isinstance(model, dict):
        raise UsageError(f"{where}: \"model\" must be an object (name, num_layers, num_kv_heads, head_dim), got {json.dumps(model)[:40]}")
    for key in ("num_layers", "num_kv_heads", "head_dim"):
        value = model.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise UsageError(f"{where}: \"model\".{key} must be an integer, got {json.dumps(value)[:40]}")
    raw = data.get("layers")
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: \"layers\" must map layer indices to specs")
    layers: dict[int, list[str]] = {}
    for key, value in raw.items():
        # one spelling per layer: "0" and "00" (or " 0", "+0") would both be layer 0, and one would silently win
        if not (isinstance(key, str) and _LAYER_KEY.fullmatch(key)):
            raise UsageError(f"{where}: layer key {str(key)[:24]!r} is not a layer index written plainly (0, 1, 12: digits, no sign, spaces or leading zeros)")
        i = int(key)
        specs = [value] if isinstance(value, str) else value
        if not isinstance(specs, list) or not specs or not all(isinstance(s, str) and s.strip() for s in specs):
            raise UsageError(f"{where}: layer {i} must be a spec or a list of specs, got {value!r}")
        layers[i] = [s.strip() for s in specs]
    default = data.get("default", "dense")
    if not isinstance(default, str):
        raise UsageError(f"{where}: \"default\" must be a spec")
    known = {"schema", "version", "model", "default", "layers"}
    return Plan(layers, default, dict(model), {k: v for k, v in data.items() if k not in known})


def load_plan(path: str | Path) -> Plan:
    """A plan file: a regular UTF-8 file of bounded size and nesting (:mod:`kvtool.core.limits`)
    holding a plan (:func:`plan_from_dict`); UsageError naming the file otherwise."""
    path = Path(path)
    return plan_from_dict(read_json_input(path, f"--plan {path}", error=UsageError), str(path))


def save_plan(plan: Plan, path: str | Path, force: bool = True) -> Path:
    return atomic_write_text(path, json.dumps(plan.to_dict(), indent=2) + "\n", force=force)


def model_shape(facts: ModelFacts) -> dict[str, Any]:
    return {"name": facts.name, "num_layers": facts.num_layers, "num_kv_heads": facts.num_kv_heads, "head_dim": facts.head_dim}


def plan_summary(plan: Plan, layer_indices: list[int], num_kv_heads: int) -> str:
    """One line: each spec and how many KV heads it stores, most first (``quant:bits=2 x61, dense x29``)."""
    counts: dict[str, int] = {}
    for i in layer_indices:
        specs = plan.specs_for(i)
        for s in specs * (num_kv_heads if len(specs) == 1 else 1):
            counts[s] = counts.get(s, 0) + 1
    return ", ".join(f"{s} x{n}" for s, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) + " (KV heads)"


def compress_plan(cache: KVCache, plan: Plan, heldout: int = 0, progress=None):
    """Encode the first ``T - heldout`` tokens of every layer of ``cache`` as the plan says; the last
    ``heldout`` stay dense (as :func:`~kvtool.formats.base.compress_cache`). Returns a ``mixed``
    :class:`~kvtool.formats.base.CompressedCache` whose params record the plan."""
    get_format("mixed")
    plan.check(cache.facts, cache.layer_indices)
    defaulted = note_default_layers(plan, cache.layer_indices)
    t = cache.num_tokens
    if not 0 <= heldout < t:
        raise UsageError(f"--heldout {heldout} must be at least 0 and below the capture's {t} tokens")
    prefix = t - heldout
    layers, tails = {}, {}
    for i in cache.layer_indices:
        full = cache.layers[i]
        specs = plan.specs_for(i)
        head = full.slice_tokens(0, prefix)
        try:
            layers[i] = encode_groups(head, specs)
        except BadDataError as exc:
            raise BadDataError(f"layer {i}: {exc}") from None
        tail = full.slice_tokens(prefix, None)
        tails[i] = LayerKV(keys=tail.keys.contiguous(), values=tail.values.contiguous())
        if progress is not None:
            progress(i)
    info = {"prefix_tokens": prefix, "heldout": heldout, "total_tokens": t, "source_info": cache.info, "plan_default_layers": defaulted}
    params = {"plan": plan_summary(plan, cache.layer_indices, cache.facts.num_kv_heads)}
    return CompressedCache(cache.facts, "mixed", params, layers, tails, cache.token_ids, info)


def compress_kept(cache: KVCache, kept: dict[int, list], storage: str = "dense", label: str = "kept tokens", heldout: int = 0):
    """A ``mixed`` compressed cache holding, in every layer of ``cache``, the tokens a selector kept:
    ``kept[i][h]`` int ``[B, K]`` ascending positions of KV head h among the first ``T - heldout``
    tokens (heads may keep different counts), stored with ``storage`` (``dense``,
    ``quant:bits=4``, ...); the last ``heldout`` tokens stay dense. ``label`` names the selector
    (a kvpress press, say) in the file's head groups."""
    get_format("mixed")
    t = cache.num_tokens
    if not 0 <= heldout < t:
        raise UsageError(f"--heldout {heldout} must be at least 0 and below the capture's {t} tokens")
    missing = [i for i in cache.layer_indices if i not in kept]
    if missing:
        raise UsageError(f"no kept positions for layer {missing[0]}")
    prefix = t - heldout
    layers, tails = {}, {}
    for i in cache.layer_indices:
        full = cache.layers[i]
        layers[i] = encode_kept_heads(full.slice_tokens(0, prefix), [k.to(full.keys.device) for k in kept[i]], storage, label)
        tail = full.slice_tokens(prefix, None)
        tails[i] = LayerKV(keys=tail.keys.contiguous(), values=tail.values.contiguous())
    info = {"prefix_tokens": prefix, "heldout": heldout, "total_tokens": t, "source_info": cache.info, "selector": label}
    return CompressedCache(cache.facts, "mixed", {"plan": f"{label} ({storage})"}, layers, tails, cache.token_ids, info)
