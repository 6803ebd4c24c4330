"""Helpers shared by the selection formats ``signvq`` and ``pagestat``: token budgets and the
attention-mass recall of a selection measured on a capture's held-out queries."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from kvtool.core.attention import attention_probs
from kvtool.core.errors import UsageError

if TYPE_CHECKING:
    from kvtool.core.cache import KVCache
    from kvtool.formats.base import CompressedCache, Encoded, Format


def resolve_budget(budget: int | None, budget_ratio: float | None, tokens: int) -> int:
    """Token budget for ``tokens`` tokens: ``budget`` when given, else ``ceil(budget_ratio * tokens)``,
    capped at ``tokens``."""
    if budget is not None:
        if budget <= 0:
            raise UsageError(f"--budget must be positive, got {budget}")
        return min(int(budget), tokens)
    if budget_ratio is None:
        raise UsageError("give --budget or --budget-ratio")
    if not 0 < budget_ratio <= 1:
        raise UsageError(f"--budget-ratio must be in (0, 1], got {budget_ratio}")
    return min(tokens, max(1, math.ceil(budget_ratio * tokens)))


def recall_from_mask(selected: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per-query attention-mass recall ``[B, H, Tq]``: the share of the prefix's attention mass
    ``probs`` (``[B, H, Tq, T]``) that falls on the ``selected`` (bool, same shape) tokens; 1 where
    the prefix holds no mass."""
    p = probs.float()
    total = p.sum(-1)
    kept = (p * selected.to(p.dtype)).sum(-1)
    return torch.where(total > 0, kept / total.clamp_min(1e-30), torch.ones_like(total))


def heldout_queries(cc: "CompressedCache", source: "KVCache", layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The held-out queries ``[B, H, W, D]`` of ``layer`` and their dense causal attention
    probabilities over the compressed prefix ``[B, H, W, prefix]``; None when the source has no
    queries, no held-out tokens, or is not the capture ``cc`` was made from (token count differs)."""
    src = source.layers.get(layer)
    prefix = cc.prefix_tokens
    if src is None or src.queries is None or source.num_tokens != int(cc.info.get("total_tokens", -1)) or prefix >= source.num_tokens:
        return None
    q = src.queries[:, :, prefix:]
    probs = attention_probs(q, src.keys, causal=True)[..., :prefix]
    return q, probs


def selection_recall(fmt: "Format", cc: "CompressedCache", source: "KVCache | None", encs: dict[int, "Encoded"] | None = None) -> dict[str, Any] | None:
    """Attention-mass recall of ``fmt.selected_mask`` on the held-out queries, per layer and
    overall (query-weighted mean), plus the minimum per-query recall. ``encs`` replaces the stored
    layers (used to compare scorers at equal budget). None when no held-out queries are at hand."""
    if source is None:
        return None
    per: dict[str, float] = {}
    total, count, low = 0.0, 0, 1.0
    for i in cc.layer_indices:
        got = heldout_queries(cc, source, i)
        if got is None:
            return None
        q, probs = got
        enc = (encs or cc.layers)[i]
        rec = recall_from_mask(fmt.selected_mask(q, enc), probs)
        per[str(i)] = round(float(rec.mean()), 4)
        total += float(rec.sum())
        count += rec.numel()
        low = min(low, float(rec.min()))
    return {"overall": round(total / count, 4), "min": round(low, 4), "per_layer": per, "queries": count}


def oracle_recall(cc: "CompressedCache", source: "KVCache | None", budget: int) -> float | None:
    """Best attention-mass recall any per-KV-head selection of ``budget`` prefix tokens can reach on
    the held-out queries: per query token and KV head, the tokens with the largest sum over the
    group's query heads of (probability / that head's prefix mass), which maximises the mean
    recall exactly (an upper bound for the formats' recall). None without queries."""
    if source is None:
        return None
    total, count = 0.0, 0
    for i in cc.layer_indices:
        got = heldout_queries(cc, source, i)
        if got is None:
            return None
        _, probs = got
        b, h, tq, t = probs.shape
        hkv = source.layers[i].keys.shape[1]
        share = probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)
        grouped = share.reshape(b, hkv, h // hkv, tq, t).sum(2)
        top = torch.topk(grouped, min(budget, t), dim=-1).indices
        sel = torch.zeros_like(grouped, dtype=torch.bool).scatter_(-1, top, True)
        sel = sel[:, :, None].expand(b, hkv, h // hkv, tq, t).reshape(b, h, tq, t)
        rec = recall_from_mask(sel, probs)
        total += float(rec.sum())
        count += rec.numel()
    return round(total / count, 4)
