"""Token eviction: SnapKV selection and the StreamingLLM baseline, as a reusable step.

Shapes (B batch, H query heads, Hkv KV heads, G = H // Hkv, T tokens, D head_dim):
keys/values ``[B, Hkv, T, D]``, queries ``[B, H, T, D]`` (RoPE applied, as captured).

A token budget keeps three parts of the T tokens, per KV head:

- the first ``sinks`` tokens (attention sinks, never eviction candidates);
- the last ``recent`` tokens (the StreamingLLM window);
- ``K = budget - sinks - recent`` of the *candidates* (positions ``sinks .. T-recent-1``), chosen by
  ``policy``:

  - ``snapkv``: the softmax attention of the last ``window`` queries onto the candidates (softmax over
    the candidates only, SnapStream Eq. 3; a window query at position t sees candidates at positions
    <= t), summed over the window (Eq. 1), average-pooled along tokens with kernel ``pool`` (stride 1,
    zero padding ``pool // 2`` counted in the average, SnapKV's pooling), summed over the G query heads
    of each KV head, top-K per KV head (Eq. 2);
  - ``streaming``: the K candidates nearest the recent part, so the kept set is sinks + the last
    ``budget - sinks`` tokens (StreamingLLM at the same budget).

The stable entry point for other formats is :func:`evict_layer` (``--evict snapkv:budget=N``):

>>> kept = evict_layer(layer, budget=256)          # int64 [B, Hkv, min(256, T)], ascending positions
>>> small = gather_tokens(layer, kept)             # LayerKV with keys/values [B, Hkv, K', D]

A budget can also be a share of the tokens (``snapkv:share=0.25``, :meth:`EvictParams.budget_for`),
so a spec or plan written for one capture keeps the same share of any other's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from kvtool.core.attention import attention_scores, expand_kv
from kvtool.core.cache import LayerKV
from kvtool.core.errors import UsageError
from kvtool.core.spec import parse_spec

POLICIES = ("snapkv", "streaming")
Policy = Literal["snapkv", "streaming"]


@dataclass
class EvictParams:
    """Parameters of one eviction step (names match the ``kvtool compress`` options)."""

    budget: int = 128
    sinks: int = 4
    recent: int = 32
    window: int = 32
    pool: int = 7
    policy: Policy = "snapkv"
    share: float | None = None

    def budget_for(self, tokens: int) -> int:
        """The token budget for a layer of ``tokens`` tokens: ``budget``, or with ``share`` that
        share of the tokens (rounded, at least ``sinks + recent``), so one spec fits any length."""
        return budget_for(self.budget, self.share, tokens, self.sinks, self.recent)


def budget_for(budget: int, share: float | None, tokens: int, sinks: int, recent: int) -> int:
    """``budget``, or ``round(share * tokens)`` raised to ``sinks + recent`` when ``share`` is given."""
    if share is None:
        return budget
    check_share(share)
    return max(sinks + recent, int(round(share * tokens)))


def check_share(share: float) -> None:
    if not 0 < share <= 1:
        raise UsageError(f"share must be in (0, 1] (the kept share of the tokens), got {share}")


def check_evict(tokens: int, budget: int, sinks: int, recent: int, window: int, pool: int, policy: str, queries: torch.Tensor | None) -> None:
    """Raise UsageError (one line naming the option) if the parameters cannot apply to ``tokens`` tokens.

    The window and the queries are checked only for ``snapkv``; the window only when there is
    something to evict (tokens > budget)."""
    if policy not in POLICIES:
        raise UsageError(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if sinks < 0 or recent < 0:
        raise UsageError(f"--sinks ({sinks}) and --recent ({recent}) must be at least 0")
    if budget < sinks + recent:
        raise UsageError(f"--budget {budget} is below --sinks {sinks} + --recent {recent}; raise the budget or lower sinks/recent")
    if budget < 1:
        raise UsageError(f"--budget must be at least 1, got {budget}")
    if policy == "snapkv":
        if pool < 1 or pool % 2 == 0:
            raise UsageError(f"--pool must be an odd number >= 1 (1 = no pooling), got {pool}")
        if window < 1:
            raise UsageError(f"--window must be at least 1, got {window}")
        if window > tokens and tokens > budget:  # only a selection needs the observation window
            raise UsageError(f"--window {window} is longer than the {tokens} tokens being compressed; lower --window")
        if queries is None:
            raise UsageError("SnapKV selection needs the captured queries; recapture without --no-queries (or use policy streaming)")


def snapkv_scores(queries: torch.Tensor, keys: torch.Tensor, sinks: int, recent: int, window: int, pool: int, scale: float | None = None) -> torch.Tensor:
    """SnapKV scores of the eviction candidates, float32 ``[B, Hkv, C]`` with C = T - sinks - recent.

    queries ``[B, H, T, D]``, keys ``[B, Hkv, T, D]``; score j belongs to position ``sinks + j``.
    See the module docstring for the maths."""
    b, h, t, _ = queries.shape
    hkv = keys.shape[1]
    c = max(t - sinks - recent, 0)
    if c == 0:
        return torch.zeros(b, hkv, 0, device=keys.device)
    q_obs = queries[:, :, t - window:]
    cand = keys[:, :, sinks:sinks + c]
    scores = attention_scores(q_obs, cand, scale)  # [B, H, W, C]
    q_pos = torch.arange(t - window, t, device=keys.device)[:, None]
    k_pos = torch.arange(sinks, sinks + c, device=keys.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees no candidate adds nothing
    summed = probs.sum(dim=2)  # [B, H, C]
    grouped = summed.view(b, hkv, h // hkv, c).sum(dim=2)  # [B, Hkv, C]
    if pool > 1:
        grouped = F.avg_pool1d(grouped.reshape(b * hkv, 1, c), kernel_size=pool, stride=1, padding=pool // 2).view(b, hkv, c)
    return grouped


def topk_positions(scores: torch.Tensor, k: int, offset: int) -> torch.Tensor:
    """Top-``k`` of ``scores`` ``[B, Hkv, C]`` per KV head as positions ``offset + j``, int64
    ``[B, Hkv, min(k, C)]`` sorted ascending."""
    k = min(k, scores.shape[-1])
    idx = torch.topk(scores, k, dim=-1).indices if k > 0 else scores.new_zeros(scores.shape[:-1] + (0,), dtype=torch.int64)
    return idx.sort(dim=-1).values + offset


def candidate_positions(layer: LayerKV, budget: int, sinks: int = 4, recent: int = 32, window: int = 32, pool: int = 7, policy: str = "snapkv", scale: float | None = None) -> torch.Tensor:
    """The chosen middle tokens only: int64 ``[B, Hkv, min(K, C)]`` ascending positions, K = budget -
    sinks - recent, C = number of candidates. Parameters as in :func:`evict_layer`."""
    b, hkv, t, _ = layer.keys.shape
    check_evict(t, budget, sinks, recent, window, pool, policy, layer.queries)
    c = max(t - sinks - recent, 0)
    k = min(budget - sinks - recent, c)
    if policy == "streaming" or k == c:  # StreamingLLM, or every candidate fits: nothing to score
        start = sinks + c - k
        return torch.arange(start, start + k, device=layer.keys.device).expand(b, hkv, k).clone()
    scores = snapkv_scores(layer.queries, layer.keys, sinks, recent, window, pool, scale)
    return topk_positions(scores, k, sinks)


def evict_layer(layer: LayerKV, budget: int, sinks: int = 4, recent: int = 32, window: int = 32, pool: int = 7, policy: str = "snapkv", scale: float | None = None) -> torch.Tensor:
    """The tokens one layer keeps under a token budget: int64 ``[B, Hkv, K']`` of original positions,
    ascending, K' = min(budget, T).

    layer: keys/values ``[B, Hkv, T, D]``; queries ``[B, H, T, D]`` (needed for ``policy="snapkv"``).
    Keeps positions ``0..sinks-1``, ``T-recent..T-1`` and ``budget - sinks - recent`` candidates chosen
    by ``policy`` (module docstring). When T <= budget every token is kept. ``scale`` is the softmax
    scale (default 1/sqrt(D)). Raises UsageError for budget < sinks + recent, window > T, an even
    pool, or snapkv without queries. This signature is stable: other formats call it for
    ``--evict snapkv:budget=N``."""
    b, hkv, t, _ = layer.keys.shape
    check_evict(t, budget, sinks, recent, window, pool, policy, layer.queries)
    device = layer.keys.device
    if t <= budget:
        return torch.arange(t, device=device).expand(b, hkv, t).clone()
    middle = candidate_positions(layer, budget, sinks, recent, window, pool, policy, scale)
    head = torch.arange(sinks, device=device).expand(b, hkv, sinks)
    tail = torch.arange(t - recent, t, device=device).expand(b, hkv, recent)
    return torch.cat([head, middle, tail], dim=-1)


def gather_tokens(layer: LayerKV, kept: torch.Tensor) -> LayerKV:
    """Keys/values of the ``kept`` positions (int ``[B, Hkv, K]``): LayerKV with ``[B, Hkv, K, D]``
    tensors in the order of ``kept`` (queries and hidden states are not per-KV-head and are dropped)."""
    idx = kept.to(torch.int64)[..., None].expand(*kept.shape, layer.keys.shape[-1])
    return LayerKV(keys=torch.gather(layer.keys, 2, idx), values=torch.gather(layer.values, 2, idx.expand(*kept.shape, layer.values.shape[-1])))


def parse_evict(spec: str) -> EvictParams:
    """``"snapkv:budget=2048,window=16"`` or ``"streaming:budget=512"`` -> EvictParams (UsageError if bad)."""
    name, values = parse_spec(spec)
    if name not in POLICIES:
        raise UsageError(f"--evict {spec!r}: the policy must be one of {', '.join(POLICIES)}")
    fields = {"budget", "share", "sinks", "recent", "window", "pool"}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in fields:
            raise UsageError(f"--evict {spec!r}: unknown parameter {key!r}; it takes {', '.join(sorted(fields))}")
        try:
            kwargs[key] = float(value) if key == "share" else int(value)
        except ValueError:
            raise UsageError(f"--evict {spec!r}: {key} must be {'a number' if key == 'share' else 'an integer'}, got {value!r}") from None
    if "budget" not in kwargs and "share" not in kwargs:
        raise UsageError(f"--evict {spec!r}: give a budget (tokens) or a share of the tokens, e.g. {name}:budget=2048 or {name}:share=0.25")
    if "budget" in kwargs and "share" in kwargs:
        raise UsageError(f"--evict {spec!r}: give budget (tokens) or share, not both")
    if "share" in kwargs:
        check_share(kwargs["share"])
    return EvictParams(policy=name, **kwargs)  # type: ignore[arg-type]


def evict_with(layer: LayerKV, params: EvictParams, scale: float | None = None) -> tuple[LayerKV, torch.Tensor]:
    """Run :func:`evict_layer` with ``params`` (a ``share`` resolved against the layer's tokens);
    returns (kept keys/values, kept positions int64 [B, Hkv, K'])."""
    kept = evict_layer(layer, params.budget_for(layer.num_tokens), params.sinks, params.recent, params.window, params.pool, params.policy, scale)
    return gather_tokens(layer, kept), kept


def attention_mass_recall(q: torch.Tensor, keys: torch.Tensor, kept: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Share of each query's attention mass over the T prefix tokens that falls on the kept ones.

    q ``[B, H, Tq, D]``, keys ``[B, Hkv, T, D]``, kept: bool ``[B, Hkv, T]`` or int positions
    ``[B, Hkv, K]`` (-1 entries ignored). Returns float32 ``[B, H, Tq]`` in [0, 1] (the softmax is
    over the prefix; the ratio does not depend on what else the query attends)."""
    b, hkv, t, _ = keys.shape
    if kept.dtype != torch.bool:
        mask = torch.zeros(b, hkv, t + 1, dtype=torch.bool, device=keys.device)
        idx = torch.where(kept >= 0, kept.to(torch.int64), torch.full_like(kept, t, dtype=torch.int64))
        mask.scatter_(2, idx, True)
        kept = mask[..., :t]
    probs = torch.softmax(attention_scores(q, keys, scale), dim=-1)
    keep = expand_kv(kept[..., None].float(), q.shape[1] // hkv)[..., 0]  # [B, H, T]
    return (probs * keep[:, :, None, :]).sum(-1)
