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


KEY_CHUNK = 16384  # keys per step of attend_partial: bounded memory on long caches


def attend_partial(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    chunk: int = KEY_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``[B, H, Tq, D]`` over keys/values ``[B, Hkv, T, D]`` as a partial (out, lse).

    ``mask``: optional bool, broadcastable to ``[B, H, Tq, T]``, True where a key may be attended.
    Rows with no allowed key give out = 0 and lse = -inf. The keys are taken ``chunk`` at a time
    and the partials merged (:func:`merge_partials`), so the float32 scores never exceed
    ``B * H * Tq * chunk`` values; a query group shares its KV head's keys without copies."""
    b, h, tq, d = q.shape
    t = keys.shape[2]
    if t == 0:
        return q.new_zeros((b, h, tq, values.shape[-1]), dtype=torch.float32), torch.full((b, h, tq), float("-inf"), device=q.device)
    scale = default_scale(d) if scale is None else scale
    result = None
    step = max(int(chunk), 1)
    for start in range(0, t, step):
        stop = min(start + step, t)
        part_mask = None
        if mask is not None:
            part_mask = mask if mask.shape[-1] == 1 else mask[..., start:stop]
        part = _attend_keys(q, keys[:, :, start:stop], values[:, :, start:stop], scale, part_mask)
        result = part if result is None else merge_partials(result, part)
    return result


def _attend_keys(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_partial` over one chunk of keys, the G query heads of a KV head as one matmul."""
    b, h, tq, d = q.shape
    hkv, t = keys.shape[1], keys.shape[2]
    group = h // hkv
    qg = q.float().reshape(b, hkv, group * tq, d)
    scores = (torch.matmul(qg, keys.float().transpose(-1, -2)) * scale).reshape(b, h, tq, t)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe[..., None]).reshape(b, hkv, group * tq, t)
    del scores
    out = torch.matmul(probs, values.float()).reshape(b, h, tq, values.shape[-1])
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
