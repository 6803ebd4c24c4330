"""Fidelity metrics: attention-output error, attention-mass recall, and model-level comparisons.

Attention level (shapes: B batch, H query heads, Tq queries, T keys, D head_dim):

- :func:`output_errors` compares an attention output ``[B, H, Tq, D]`` with the dense reference:
  relative L2 error ``||out - ref|| / ||ref||`` over the whole tensor, mean cosine similarity over
  the ``B*H*Tq`` output vectors (and the worst one), and max abs error.
- :func:`mass_recall` is the share of the dense attention probability mass over the compressed
  prefix that falls on the tokens a selection format attends (1.0 = nothing of weight missed).

Model level (logits ``[B, N, V]`` of N continuation positions, token ids ``[B, N]``):

- :func:`nll` teacher-forced negative log-likelihood (mean, nats per token);
- :func:`compare_logits` NLL of both runs, their difference, perplexity ratio ``exp(ΔNLL)``, top-1
  next-token agreement and the mean KL divergence ``KL(dense || lossy)`` of next-token distributions;
- :func:`first_divergence` the number of greedy tokens two runs share before they first differ.

Every function works in float32 and returns Python floats (or float tensors per layer).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def output_errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Errors of ``out`` against ``ref`` (same shape ``[B, H, Tq, D]``, any float dtype).

    Returns ``rel_l2``, ``cosine`` (mean over vectors), ``min_cosine``, ``max_abs`` and ``count``
    (the number of output vectors, for weighting when layers are pooled)."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from the reference {tuple(ref.shape)}")
    o = out.float().reshape(-1, out.shape[-1])
    r = ref.float().reshape(-1, ref.shape[-1])
    diff = o - r
    ref_norm = float(r.norm())
    err_norm = float(diff.norm())
    rel = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
    cos = torch.nn.functional.cosine_similarity(o, r, dim=-1, eps=1e-12)
    both_zero = (o.norm(dim=-1) == 0) & (r.norm(dim=-1) == 0)
    cos = torch.where(both_zero, torch.ones_like(cos), cos)
    return {
        "rel_l2": rel,
        "cosine": float(cos.mean()),
        "min_cosine": float(cos.min()),
        "max_abs": float(diff.abs().max()) if diff.numel() else 0.0,
        "count": int(o.shape[0]),
        "sq_err": err_norm**2,
        "sq_ref": ref_norm**2,
    }


def pool_errors(per_layer: list[dict[str, float]]) -> dict[str, float]:
    """Overall errors from per-layer :func:`output_errors` results: relative L2 over all outputs
    together, cosine averaged over all vectors, the worst cosine and max abs error of any layer."""
    if not per_layer:
        return {"rel_l2": math.nan, "cosine": math.nan, "min_cosine": math.nan, "max_abs": math.nan, "count": 0}
    sq_err = sum(e["sq_err"] for e in per_layer)
    sq_ref = sum(e["sq_ref"] for e in per_layer)
    count = sum(e["count"] for e in per_layer)
    return {
        "rel_l2": math.sqrt(sq_err / sq_ref) if sq_ref > 0 else (0.0 if sq_err == 0 else math.inf),
        "cosine": sum(e["cosine"] * e["count"] for e in per_layer) / count,
        "min_cosine": min(e["min_cosine"] for e in per_layer),
        "max_abs": max(e["max_abs"] for e in per_layer),
        "count": count,
    }


def mass_recall(selected: torch.Tensor, probs: torch.Tensor) -> dict[str, float]:
    """Attention-mass recall of a selection.

    selected: bool ``[B, H, Tq, T]`` (True where a query attends a prefix token);
    probs: float ``[B, H, Tq, T]``, the dense attention probabilities of the same queries restricted
    to the prefix tokens (they need not sum to 1: the rest of the mass is on the dense window).

    Returns ``recall`` (mean over queries of selected mass / prefix mass), ``min_recall`` and
    ``selected_fraction`` (mean share of prefix tokens attended)."""
    if selected.shape != probs.shape:
        raise ValueError(f"selection shape {tuple(selected.shape)} differs from the probabilities {tuple(probs.shape)}")
    p = probs.float()
    total = p.sum(-1)
    kept = (p * selected.to(p.dtype)).sum(-1)
    per_query = torch.where(total > 0, kept / total.clamp_min(1e-30), torch.ones_like(total))
    return {
        "recall": float(per_query.mean()),
        "min_recall": float(per_query.min()),
        "selected_fraction": float(selected.float().mean()),
        "count": int(per_query.numel()),
    }


def pool_recall(per_layer: list[dict[str, float]]) -> dict[str, float] | None:
    """Overall recall from per-layer :func:`mass_recall` results (query-weighted)."""
    if not per_layer:
        return None
    count = sum(r["count"] for r in per_layer)
    return {
        "recall": sum(r["recall"] * r["count"] for r in per_layer) / count,
        "min_recall": min(r["min_recall"] for r in per_layer),
        "selected_fraction": sum(r["selected_fraction"] * r["count"] for r in per_layer) / count,
        "count": count,
    }


# ----------------------------------------------------------------------------- model level


def nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats/token) of ``targets`` ``[B, N]`` under ``logits`` ``[B, N, V]``."""
    lp = torch.log_softmax(logits.detach().float(), dim=-1)
    return float(-lp.gather(-1, targets[..., None].long()).mean())


def compare_logits(dense: torch.Tensor, lossy: torch.Tensor, targets: torch.Tensor | None = None) -> dict[str, Any]:
    """Compare next-token distributions of a dense and a lossy run on the same inputs.

    dense, lossy: logits ``[B, N, V]``; targets: ``[B, N']`` the true next tokens of the first N'
    positions (N' <= N; teacher forcing), or None to skip NLL.

    Returns ``agreement`` (share of positions whose argmax agrees), ``kl`` (mean KL(dense||lossy) in
    nats), ``max_kl``, and with targets ``nll_dense``, ``nll_lossy``, ``nll_increase`` and
    ``ppl_ratio`` = exp(nll_lossy - nll_dense)."""
    if dense.shape != lossy.shape:
        raise ValueError(f"logits shapes differ: {tuple(dense.shape)} vs {tuple(lossy.shape)}")
    dense, lossy = dense.detach(), lossy.detach()
    lp_d = torch.log_softmax(dense.float(), dim=-1)
    lp_l = torch.log_softmax(lossy.float(), dim=-1)
    kl = (lp_d.exp() * (lp_d - lp_l)).sum(-1).clamp_min(0.0)
    result: dict[str, Any] = {
        "positions": int(kl.numel()),
        "agreement": float((dense.argmax(-1) == lossy.argmax(-1)).float().mean()),
        "kl": float(kl.mean()),
        "max_kl": float(kl.max()),
    }
    if targets is not None and targets.shape[1] > 0:
        n = targets.shape[1]
        nd = nll(dense[:, :n], targets)
        nl = nll(lossy[:, :n], targets)
        result.update({"nll_dense": nd, "nll_lossy": nl, "nll_increase": nl - nd, "ppl_ratio": math.exp(nl - nd), "nll_tokens": int(targets.numel())})
    return result


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int:
    """Tokens two generations ``[B, N]`` (or ``[N]``) share before the first difference; the minimum
    over the batch. Equal sequences give N."""
    a2 = a.reshape(-1, a.shape[-1]) if a.ndim > 1 else a[None]
    b2 = b.reshape(-1, b.shape[-1]) if b.ndim > 1 else b[None]
    if a2.shape != b2.shape:
        raise ValueError(f"generation shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    n = a2.shape[-1]
    diff = a2 != b2
    firsts = [int(row.nonzero()[0]) if bool(row.any()) else n for row in diff]
    return min(firsts) if firsts else n
