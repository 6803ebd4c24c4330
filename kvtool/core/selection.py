"""How many elements a sparsity keeps, and which: the one rule every pruning path shares
(:mod:`kvtool.methods.prune`, the fused prune + encode kernel of
:mod:`kvtool.kernels.bitmap_prune_encode`, the benchmarks)."""

from __future__ import annotations

import math

import torch


def keep_count(n: int, sparsity: float) -> int:
    """Elements kept of ``n`` at ``sparsity``: ``round((1 - s) * n)``, halves rounded up."""
    return min(n, max(0, math.floor((1.0 - sparsity) * n + 0.5 + 1e-9)))


def topk_mask(score: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """Bool mask of ``score``'s shape, True at the ``k`` largest entries along ``dim``; among equal
    scores the lower index wins (a stable descending sort)."""
    mask = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    n = score.shape[dim]
    if k <= 0 or n == 0:
        return mask
    if k >= n:
        return torch.ones_like(mask)
    order = torch.sort(score.float(), dim=dim, descending=True, stable=True).indices
    return mask.scatter(dim, order.narrow(dim, 0, k), True)


def magnitude_keep(x: torch.Tensor, keep: int) -> torch.Tensor:
    """Bool ``x.shape``: True at each row's ``keep`` largest ``|x|`` along the last axis (ties:
    lower index) — per-token magnitude pruning of keys or values ``[..., T, D]``."""
    return topk_mask(x.float().abs(), keep, dim=-1)
