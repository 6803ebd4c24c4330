"""Plain-torch reference attention for one or more decode-style queries.

Conventions used by every format and kernel (B = batch, H = query heads, Hkv = KV heads,
G = H // Hkv the GQA group, Tq = query tokens, T = key tokens, D = head_dim):

- a query head h reads KV head ``h // G`` (the transformers ``repeat_kv`` order);
- the softmax scale defaults to ``1 / sqrt(D)``;
- a *partial* result is ``(out, lse)``: ``out`` ``[B, H, Tq, D]`` float32 is the softmax-weighted
  value sum over some set of keys, ``lse`` ``[B, H, Tq]`` float32 the log-sum-exp of the scaled scores
  over that set (``-inf`` when the set is empty). Partials over disjoint key sets merge exactly with
  :func:`merge_partials` (the flash-decoding combine).
"""

from __future__ import annotations

import math

import torch


def expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` -> ``[B, Hkv * group, T, D]`` (each KV head repeated for its query heads)."""
    if group == 1:
        return x
    b, hkv, t, d = x.shape
    return x[:, :, None].expand(b, hkv, group, t, d).reshape(b, hkv * group, t, d)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def attention_scores(q: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Scaled scores ``[B, H, Tq, T]`` float32 of q ``[B, H, Tq, D]`` against keys ``[B, Hkv, T, D]``."""
    group = q.shape[1] // keys.shape[1]
    scale = default_scale(q.shape[-1]) if scale is None else scale
    k = expand_kv(keys.float(), group)
    return torch.matmul(q.float(), k.transpose(-1, -2)) * scale


def attend_partial(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``[B, H, Tq, D]`` over keys/values ``[B, Hkv, T, D]`` as a partial (out, lse).

    ``mask``: optional bool, broadcastable to ``[B, H, Tq, T]``, True where a key may be attended.
    Rows with no allowed key give out = 0 and lse = -inf."""
    b, h, tq, d = q.shape
    if keys.shape[2] == 0:
        return q.new_zeros((b, h, tq, values.shape[-1]), dtype=torch.float32), torch.full((b, h, tq), float("-inf"), device=q.device)
    scores = attention_scores(q, keys, scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe[..., None])
    group = h // keys.shape[1]
    out = torch.matmul(probs, expand_kv(values.float(), group))
    return out, lse


def merge_partials(*parts: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partials over disjoint key sets into the partial over their union (exact)."""
    outs = torch.stack([p[0] for p in parts])  # [P, B, H, Tq, D]
    lses = torch.stack([p[1] for p in parts])  # [P, B, H, Tq]
    total = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    weights = torch.exp(lses - safe[None])
    weights = torch.where(torch.isfinite(lses), weights, torch.zeros_like(weights))
    return (weights[..., None] * outs).sum(0), total


def causal_tail_mask(tq: int, t: int, device=None) -> torch.Tensor:
    """Bool ``[Tq, T]`` with T == Tq: query i sees tail keys 0..i (the held-out tokens' own window)."""
    return torch.ones(tq, t, dtype=torch.bool, device=device).tril()


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """Full softmax attention output ``[B, H, Tq, D]`` float32. With ``causal`` the last Tq keys are
    the queries' own tokens: query i sees every earlier key and its own."""
    mask = None
    if causal:
        t, tq = keys.shape[2], q.shape[2]
        mask = torch.ones(tq, t, dtype=torch.bool, device=q.device).tril(diagonal=t - tq)
    return attend_partial(q, keys, values, scale, mask)[0]


def attention_probs(q: torch.Tensor, keys: torch.Tensor, scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """Softmax probabilities ``[B, H, Tq, T]`` float32 (``causal`` as in :func:`dense_attention`)."""
    scores = attention_scores(q, keys, scale)
    if causal:
        t, tq = keys.shape[2], q.shape[2]
        mask = torch.ones(tq, t, dtype=torch.bool, device=q.device).tril(diagonal=t - tq)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)
