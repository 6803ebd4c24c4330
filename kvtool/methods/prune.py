"""Pruning masks for keys and values (Mustafar and its baselines).

Shapes: keys/values ``[B, Hkv, T, D]``, queries ``[B, H, T, D]`` (H = G * Hkv, query head h reads KV
head ``h // G``). Every mask is a bool tensor of the same shape as the tensor it prunes,
``[B, Hkv, T, D]``, True where an element is kept. The last ``dense_window`` tokens are never
pruned (their mask rows are all True); the *pruned region* is the tokens ``0 .. T - window - 1``.

Methods (one name for keys and values, or ``KEYS/VALUES`` such as ``output-aware/per-token``):

- ``per-token`` (default): per token, keep the largest |x| along head_dim;
- ``per-channel``: per channel, over groups of 32 consecutive tokens of the pruned region, keep the
  largest |x| of the group;
- ``output-aware``: keys per token by ``|K| * sum |Q|`` over the next 32 queries (the token's own and
  the 31 after it) of the G query heads of the KV head; values per channel (groups of 32 tokens) by
  ``|V| * a`` where ``a[t]`` is the attention weight token t receives from those same 32 queries,
  summed over the group (causal softmax over the unpruned keys);
- ``think``: structured channel pruning as ThinK does: whole channels of a KV head are dropped by the
  query-aware score ``||Q_w[:, c]|| * ||K[:, c]||`` (Q_w: the last 32 queries of the group); for
  values the score is ``||A_w V[:, c]||`` (A_w: those queries' attention weights);
- ``2:4``: keep 2 of every 4 consecutive elements of a token along head_dim (sparsity fixed at 0.5).

Sparsity is exact: a unit of n elements (a token's D elements, a channel's group of tokens, a KV
head's D channels) keeps ``round_half_up((1 - s) * n)``. Ties are broken deterministically: among
equal scores the lower index (channel for per-token, token for per-channel) is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtool.core import io
from kvtool.core.cache import KVCache, LayerKV, parse_indices
from kvtool.core.errors import UsageError
from kvtool.core.progress import Progress, or_silent
from kvtool.core.selection import keep_count, topk_mask
from kvtool.core.attention import default_scale, expand_kv

METHODS = ("per-token", "per-channel", "output-aware", "think", "2:4")
QUERY_METHODS = ("output-aware", "think")
GROUP_TOKENS = 32  # per-channel groups, output-aware horizon, ThinK observation window
DEFAULT_WINDOW = 32


def check_sparsity(value: float, what: str = "--sparsity") -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value < 1.0):
        raise UsageError(f"{what} must be at least 0 and below 1, got {value}")
    return float(value)


def parse_method(spec: str) -> tuple[str, str]:
    """``"per-token"`` -> (per-token, per-token); ``"output-aware/per-token"`` -> (keys, values)."""
    parts = [p.strip() for p in str(spec).split("/")]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        raise UsageError(f"--method {spec!r}: give one method or KEYS/VALUES, e.g. output-aware/per-token")
    for p in parts:
        if p not in METHODS:
            raise UsageError(f"unknown pruning method {p!r}; known methods: {', '.join(METHODS)}")
    return parts[0], parts[1]


def method_needs_queries(spec: str) -> bool:
    return any(m in QUERY_METHODS for m in parse_method(spec))


# ----------------------------------------------------------------------------- building blocks


def per_token_mask(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    """``score`` ``[..., T, D]``: keep ``keep_count(D, s)`` per token (along the last axis)."""
    return topk_mask(score, keep_count(score.shape[-1], sparsity), dim=-1)


def per_channel_mask(score: torch.Tensor, sparsity: float, group: int = GROUP_TOKENS) -> torch.Tensor:
    """``score`` ``[..., T, D]``: per channel, in consecutive groups of ``group`` tokens (the last
    group may be shorter), keep ``keep_count(len(group), s)`` tokens."""
    t = score.shape[-2]
    parts = []
    for start in range(0, t, group):
        chunk = score[..., start : start + group, :]
        parts.append(topk_mask(chunk, keep_count(chunk.shape[-2], sparsity), dim=-2))
    if not parts:
        return torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    return torch.cat(parts, dim=-2)


def two_four_mask(score: torch.Tensor) -> torch.Tensor:
    """``score`` ``[..., D]``: keep 2 of every 4 consecutive elements (a last group of n < 4 keeps
    ``keep_count(n, 0.5)``)."""
    d = score.shape[-1]
    full = d - d % 4
    parts = []
    if full:
        grouped = score[..., :full].reshape(*score.shape[:-1], full // 4, 4)
        parts.append(topk_mask(grouped, 2, dim=-1).reshape(*score.shape[:-1], full))
    if d % 4:
        rest = score[..., full:]
        parts.append(topk_mask(rest, keep_count(d % 4, 0.5), dim=-1))
    return torch.cat(parts, dim=-1)


def group_query_abs_sum(queries: torch.Tensor, num_kv_heads: int, horizon: int = GROUP_TOKENS) -> torch.Tensor:
    """``sum |Q|`` over the next ``horizon`` queries (positions t .. t+horizon-1, clipped at T) and
    the G query heads of each KV head: ``[B, H, T, D]`` -> ``[B, Hkv, T, D]`` float32."""
    b, h, t, d = queries.shape
    a = queries.float().abs().reshape(b, num_kv_heads, h // num_kv_heads, t, d).sum(2)
    csum = torch.cat([a.new_zeros(b, num_kv_heads, 1, d), a.cumsum(2)], dim=2)
    idx = torch.arange(t, device=queries.device)
    hi = (idx + horizon).clamp(max=t)
    return csum[:, :, hi] - csum[:, :, idx]


def accumulated_attention(keys: torch.Tensor, queries: torch.Tensor, horizon: int = GROUP_TOKENS, scale: float | None = None, chunk: int = 256) -> torch.Tensor:
    """Attention weight each token receives from the next ``horizon`` queries (its own and the
    following ones, causal softmax over the unpruned keys), summed over the GQA group:
    ``[B, Hkv, T]`` float32."""
    b, h, t, d = queries.shape
    hkv = keys.shape[1]
    scale = default_scale(d) if scale is None else scale
    k = expand_kv(keys.float(), h // hkv)
    acc = torch.zeros(b, h, t, dtype=torch.float32, device=keys.device)
    kidx = torch.arange(t, device=keys.device)
    for start in range(0, t, chunk):
        qi = torch.arange(start, min(t, start + chunk), device=keys.device)
        scores = torch.matmul(queries[:, :, qi].float(), k.transpose(-1, -2)) * scale
        lag = qi[:, None] - kidx[None, :]  # query position - key position
        scores = scores.masked_fill(lag < 0, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        acc += (probs * ((lag >= 0) & (lag < horizon))).sum(2)
    return acc.reshape(b, hkv, h // hkv, t).sum(2)


def think_key_channel_score(keys: torch.Tensor, queries: torch.Tensor, window: int = GROUP_TOKENS) -> torch.Tensor:
    """ThinK's channel score ``||Q_w[:, c] K[:, c]^T||_F = ||Q_w[:, c]|| * ||K[:, c]||`` per KV head,
    Q_w the last ``window`` queries of the G query heads: ``[B, Hkv, D]`` float32.
    ``keys`` are the tokens being pruned, ``queries`` ``[B, H, T, D]`` all positions."""
    b, h, _, d = queries.shape
    hkv = keys.shape[1]
    qw = queries[:, :, -window:].float().reshape(b, hkv, h // hkv, -1, d)
    qnorm = qw.pow(2).sum(dim=(2, 3)).sqrt()
    knorm = keys.float().pow(2).sum(dim=2).sqrt()
    return qnorm * knorm


def think_value_channel_score(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, pruned: int, window: int = GROUP_TOKENS, scale: float | None = None) -> torch.Tensor:
    """ThinK-like value channel score ``||A_w V[:, c]||`` over the first ``pruned`` tokens, A_w the
    attention weights (causal softmax over all keys) of the last ``window`` queries of the group:
    ``[B, Hkv, D]`` float32."""
    b, h, t, d = queries.shape
    hkv = keys.shape[1]
    scale = default_scale(d) if scale is None else scale
    qw = queries[:, :, -window:].float()
    tw = qw.shape[2]
    scores = torch.matmul(qw, expand_kv(keys.float(), h // hkv).transpose(-1, -2)) * scale
    qpos = torch.arange(t - tw, t, device=keys.device)
    scores = scores.masked_fill(qpos[:, None] < torch.arange(t, device=keys.device)[None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)[..., :pruned]  # [B, H, Tw, P]
    contrib = torch.matmul(probs, expand_kv(values[:, :, :pruned].float(), h // hkv))  # [B, H, Tw, D]
    return contrib.reshape(b, hkv, h // hkv * tw, d).pow(2).sum(2).sqrt()


# ----------------------------------------------------------------------------- one layer


@dataclass
class PruneResult:
    """A pruned layer: ``keys``/``values`` ``[B, Hkv, T, D]`` (pruned elements set to +0.0, same
    dtype), the bool masks of the same shape, and the achieved numbers."""

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor
    value_mask: torch.Tensor
    window: int
    stats: dict[str, Any] = field(default_factory=dict)


def _mask_for(kind: str, method: str, layer: LayerKV, pruned: int, sparsity: float) -> torch.Tensor:
    x = layer.keys if kind == "keys" else layer.values
    region = x[:, :, :pruned]
    score = region.float().abs()
    if method == "per-token":
        return per_token_mask(score, sparsity)
    if method == "per-channel":
        return per_channel_mask(score, sparsity)
    if method == "2:4":
        return two_four_mask(score)
    q = layer.queries
    hkv = x.shape[1]
    if method == "output-aware":
        if kind == "keys":
            return per_token_mask(score * group_query_abs_sum(q, hkv)[:, :, :pruned], sparsity)
        weight = accumulated_attention(layer.keys, q)[:, :, :pruned]
        return per_channel_mask(score * weight[..., None], sparsity)
    # think: whole channels per (batch, KV head)
    if kind == "keys":
        channel = think_key_channel_score(region, q)
    else:
        channel = think_value_channel_score(layer.keys, layer.values, q, pruned)
    keep = topk_mask(channel, keep_count(x.shape[-1], sparsity), dim=-1)  # [B, Hkv, D]
    return keep[:, :, None, :].expand_as(region).clone()


def prune_layer(layer: LayerKV, key_sparsity: float, value_sparsity: float, method: str = "per-token", dense_window: int = DEFAULT_WINDOW) -> PruneResult:
    """Prune one layer's keys and values (see the module docstring). ``layer.queries`` is needed
    by ``output-aware`` and ``think``."""
    check_sparsity(key_sparsity, "--key-sparsity")
    check_sparsity(value_sparsity, "--value-sparsity")
    kmethod, vmethod = parse_method(method)
    if dense_window < 0:
        raise UsageError(f"--dense-window must be at least 0, got {dense_window}")
    for kind, m, s in (("keys", kmethod, key_sparsity), ("values", vmethod, value_sparsity)):
        if m == "2:4" and s not in (0.0, 0.5):
            raise UsageError(f"method 2:4 prunes exactly half of each group of 4; set the {kind} sparsity to 0.5 (got {s})")
    if (kmethod in QUERY_METHODS or vmethod in QUERY_METHODS) and layer.queries is None:
        raise UsageError(f"method {method!r} needs the captured queries; this capture has none (recapture without --no-queries)")
    t = layer.num_tokens
    window = min(dense_window, t)
    pruned = t - window
    masks = {}
    for kind, m, s in (("keys", kmethod, key_sparsity), ("values", vmethod, value_sparsity)):
        x = getattr(layer, kind)
        mask = torch.ones(x.shape, dtype=torch.bool, device=x.device)
        if pruned and s > 0:
            mask[:, :, :pruned] = _mask_for(kind, m, layer, pruned, s)
        masks[kind] = mask
    keys = layer.keys.masked_fill(~masks["keys"], 0)
    values = layer.values.masked_fill(~masks["values"], 0)
    stats = {
        "method": f"{kmethod}/{vmethod}" if kmethod != vmethod else kmethod,
        "tokens": t,
        "window": window,
        "pruned_tokens": pruned,
        "key_sparsity": key_sparsity,
        "value_sparsity": value_sparsity,
        "achieved_key_sparsity": achieved(masks["keys"], pruned),
        "achieved_value_sparsity": achieved(masks["values"], pruned),
    }
    return PruneResult(keys, values, masks["keys"], masks["values"], window, stats)


def achieved(mask: torch.Tensor, pruned: int) -> float:
    """Fraction of elements dropped in the pruned region (the first ``pruned`` tokens) of a mask
    ``[B, Hkv, T, D]``; 0.0 when nothing was eligible."""
    region = mask[:, :, :pruned]
    return float(1.0 - region.float().mean()) if region.numel() else 0.0


def prune_cache(cache: KVCache, key_sparsity: float, value_sparsity: float, method: str = "per-token", dense_window: int = DEFAULT_WINDOW, progress=None) -> tuple[KVCache, dict[str, Any]]:
    """Prune every layer of ``cache``; returns the pruned capture (queries/hidden kept as they are)
    and a report with the achieved sparsity per layer and overall (over the pruned region)."""
    if method_needs_queries(method) and not cache.has_queries:
        raise UsageError(f"method {method!r} needs the captured queries; this capture has none (recapture without --no-queries)")
    layers: dict[int, LayerKV] = {}
    per_layer: dict[str, Any] = {}
    kept = {"keys": 0.0, "values": 0.0}
    total = 0
    for i in cache.layer_indices:
        layer = cache.layers[i]
        res = prune_layer(layer, key_sparsity, value_sparsity, method, dense_window)
        layers[i] = LayerKV(res.keys.contiguous(), res.values.contiguous(), layer.queries, layer.hidden)
        per_layer[str(i)] = {"achieved_key_sparsity": res.stats["achieved_key_sparsity"], "achieved_value_sparsity": res.stats["achieved_value_sparsity"]}
        n = res.key_mask[:, :, : res.stats["pruned_tokens"]].numel()
        kept["keys"] += res.stats["achieved_key_sparsity"] * n
        kept["values"] += res.stats["achieved_value_sparsity"] * n
        total += n
        if progress is not None:
            progress(i)
    k, v = parse_method(method)
    report = {
        "method": method,
        "key_method": k,
        "value_method": v,
        "key_sparsity": key_sparsity,
        "value_sparsity": value_sparsity,
        "dense_window": dense_window,
        "achieved_key_sparsity": kept["keys"] / total if total else 0.0,
        "achieved_value_sparsity": kept["values"] / total if total else 0.0,
        "per_layer": per_layer,
    }
    out = KVCache(cache.facts, layers, cache.token_ids, dict(cache.info), cache.attention_mask)
    return out, report


def prune_file(
    capture: Path,
    output: Path | None = None,
    sparsity: float = 0.7,
    key_sparsity: float | None = None,
    value_sparsity: float | None = None,
    method: str = "per-token",
    dense_window: int = DEFAULT_WINDOW,
    layers: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Prune ``capture`` and write the pruned capture; returns the report (achieved sparsity overall
    and per layer in ``layers``, a list of ``{"layer": i, ...}``, and the output path)."""
    ks = check_sparsity(sparsity if key_sparsity is None else key_sparsity, "--key-sparsity" if key_sparsity is not None else "--sparsity")
    vs = check_sparsity(sparsity if value_sparsity is None else value_sparsity, "--value-sparsity" if value_sparsity is not None else "--sparsity")
    parse_method(method)
    if dense_window < 0:
        raise UsageError(f"--dense-window must be at least 0, got {dense_window}")
    output = output or io.output_beside(capture, f"{capture.stem}.pruned.safetensors")
    io.check_output(output, force, inputs=(capture,))
    meta, _ = io.read_header(capture)
    io.check_schema(capture, meta, io.CAPTURE_SCHEMA)
    facts = io.facts_from_meta(capture, meta)
    selected = parse_indices(layers, facts.num_layers) if layers else None
    parts = ("keys", "values", "queries", "hidden")
    cache = io.load(capture, layers=selected, parts=parts)
    if method_needs_queries(method) and not cache.has_queries:
        raise UsageError(f"--method {method} needs queries but {capture} has none; recapture without --no-queries")
    progress = or_silent(progress)
    progress.stage("pruning", len(cache.layers))
    pruned, report = prune_cache(cache, ks, vs, method, dense_window, progress=lambda i: progress.advance())
    pruned.info = {**cache.info, "pruned": {k: v for k, v in report.items() if k != "per_layer"}, "pruned_from": str(capture), "pruned_from_sha256": io.source_sha256(capture)}
    path = io.save(pruned, output, force=force)
    report["output"] = str(path)
    report["layers"] = [{"layer": int(i), **v} for i, v in report.pop("per_layer").items()]
    report["tokens"] = pruned.num_tokens
    return report
