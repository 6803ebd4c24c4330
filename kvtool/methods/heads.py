"""Attention-head selection (Polar Sparsity): head importance, oracle top-k, routers.

Shapes (B batch, H query heads, Hkv KV heads, G = H // Hkv, T tokens, D head_dim, E hidden size):
queries ``[B, H, T, D]``, keys/values ``[B, Hkv, T, D]``, hidden ``[B, T, E]``.

- :func:`head_outputs`: every query token's causal attention output per head, float32 ``[B, H, T, D]``.
- A head's importance for a token is the L2 norm of its output (Polar Sparsity's criterion). Keeping
  only a set S of heads (the others output zero) leaves the relative error of the concatenated
  per-head outputs (the input of the output projection)
  ``sqrt(sum_{h not in S} |o_h|^2 / sum_h |o_h|^2)``; the oracle top-k by norm minimises it.
- A router is one linear layer per model layer (standardised hidden state -> H logits), trained with
  binary cross-entropy to mark each token's oracle top-k heads (the paper's per-layer classifier).
- Traffic: a decode step with k of H heads reads the KV of every KV head that has at least one chosen
  query head; the KV traffic ratio is (distinct KV heads read) / Hkv, k / H being the head density.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kvtool.core.attention import dense_attention
from kvtool.core.cache import KVCache, LayerKV
from kvtool.core.errors import UsageError
from kvtool.core import io
from kvtool._version import __version__
from kvtool.core.errors import BadDataError


def head_outputs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention output of every token and head, float32 ``[B, H, T, D]`` (token t sees 0..t)."""
    return dense_attention(q, keys, values, scale, causal=True)


def head_norms(out: torch.Tensor) -> torch.Tensor:
    """L2 norm per head and token: ``[B, H, T, D]`` -> ``[B, T, H]`` float32."""
    return out.float().norm(dim=-1).transpose(1, 2)


def check_k(k: int, heads: int, what: str = "--k") -> None:
    if not 1 <= k <= heads:
        raise UsageError(f"{what} {k} is out of range: the model has {heads} heads, so k must be 1..{heads}")


def oracle_topk(norms: torch.Tensor, k: int) -> torch.Tensor:
    """Indices int64 ``[..., k]`` of the k largest norms along the last axis (head axis)."""
    check_k(k, norms.shape[-1])
    return torch.topk(norms, k, dim=-1).indices


def selection_mask(heads: torch.Tensor, num_heads: int) -> torch.Tensor:
    """bool ``[..., H]`` from head indices ``[..., k]``."""
    return torch.zeros(*heads.shape[:-1], num_heads, dtype=torch.bool, device=heads.device).scatter_(-1, heads, True)


def selection_error(norms: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of the concatenated head outputs when only ``selected`` heads (bool
    ``[..., H]``) are computed; norms ``[..., H]``; returns ``[...]`` float32."""
    sq = norms.float() ** 2
    total = sq.sum(-1).clamp_min(1e-30)
    return ((sq * (~selected)).sum(-1) / total).sqrt()


def kv_traffic(selected: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Share of KV heads read per token ``[...]`` for a head selection bool ``[..., H]``."""
    h = selected.shape[-1]
    return selected.view(*selected.shape[:-1], kv_heads, h // kv_heads).any(-1).float().mean(-1)


def recall(chosen: torch.Tensor, oracle: torch.Tensor) -> torch.Tensor:
    """|chosen ∩ oracle| / |oracle| per token, both bool ``[..., H]``."""
    return (chosen & oracle).sum(-1).float() / oracle.sum(-1).clamp_min(1).float()


def error_curve(norms: torch.Tensor, kv_heads: int) -> list[dict[str, float]]:
    """Oracle curve over k = 1..H: head density k/H, mean error, mean KV traffic ratio; norms ``[N, H]``."""
    h = norms.shape[-1]
    order = torch.argsort(norms, dim=-1, descending=True)
    rows = []
    for k in range(1, h + 1):
        sel = selection_mask(order[..., :k], h)
        rows.append({"k": k, "density": k / h, "rel_l2": float(selection_error(norms, sel).mean()), "traffic_ratio": float(kv_traffic(sel, kv_heads).mean())})
    return rows


def group_error_curve(norms: torch.Tensor, kv_heads: int) -> list[dict[str, float]]:
    """Select whole GQA groups (Polar Sparsity's group attention): for g = 1..Hkv keep the g groups
    with the largest summed squared norm; KV traffic g/Hkv. norms ``[N, H]``."""
    n, h = norms.shape
    g = h // kv_heads
    group_sq = (norms.float() ** 2).view(n, kv_heads, g).sum(-1)
    order = torch.argsort(group_sq, dim=-1, descending=True)
    rows = []
    for m in range(1, kv_heads + 1):
        groups = selection_mask(order[:, :m], kv_heads)
        sel = groups[:, :, None].expand(n, kv_heads, g).reshape(n, h)
        rows.append({"groups": m, "traffic_ratio": m / kv_heads, "density": m / kv_heads, "rel_l2": float(selection_error(norms, sel).mean())})
    return rows


# ----------------------------------------------------------------------------- router


@dataclass
class Router:
    """One layer's router: logits = ((hidden - mean) / std) @ weight.T + bias.

    weight float32 ``[H, E]``, bias ``[H]``, mean/std ``[E]``."""

    weight: torch.Tensor
    bias: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, E]`` -> ``[N, H]`` float32."""
        return ((hidden.float() - self.mean) / self.std) @ self.weight.T + self.bias

    def topk(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """The router's k heads per token, int64 ``[N, k]``."""
        return torch.topk(self.logits(hidden), k, dim=-1).indices


def train_router(hidden: torch.Tensor, target: torch.Tensor, steps: int = 300, lr: float = 1e-2, weight_decay: float = 1e-2, seed: int = 0,
                 tick: Callable[[], None] | None = None) -> Router:
    """Fit a linear router on hidden ``[N, E]`` to multi-hot targets bool ``[N, H]`` (the oracle top-k),
    full-batch Adam on binary cross-entropy. Plain torch on the hidden states' device, deterministic
    for a seed (the initial weights come from a CPU generator, the same on every device). ``tick`` is
    called after every step (progress)."""
    x = hidden.float()
    mean = x.mean(0)
    std = x.std(0).clamp_min(1e-3)
    x = (x - mean) / std
    gen = torch.Generator().manual_seed(seed)
    h, e = target.shape[1], x.shape[1]
    weight = (torch.randn(h, e, generator=gen) * (1.0 / math.sqrt(e))).to(x.device).requires_grad_(True)
    bias = torch.zeros(h, device=x.device, requires_grad=True)
    opt = torch.optim.Adam([weight, bias], lr=lr, weight_decay=weight_decay)
    y = target.float()
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ weight.T + bias, y)
            loss.backward()
            opt.step()
            if tick is not None:
                tick()
    return Router(weight.detach(), bias.detach(), mean, std)


# ----------------------------------------------------------------------------- analysis


def analyse_layer(layer: LayerKV, kv_heads: int, k: int, heldout: int, router: bool = True, steps: int = 300, seed: int = 0,
                  tick: Callable[[], None] | None = None) -> tuple[dict[str, Any], Router | None]:
    """The oracle curve on every token, and at ``k``: oracle, router, static and random heads on the
    last ``heldout`` tokens (the router trains on the tokens before them). Returns (report, router)."""
    if layer.queries is None:
        raise UsageError("kvtool heads needs the captured queries; recapture without --no-queries")
    b, h, t, _ = layer.queries.shape
    check_k(k, h)
    if not 1 <= heldout < t:
        raise UsageError(f"--heldout {heldout} must be 1..{t - 1} (the capture has {t} tokens)")
    norms = head_norms(head_outputs(layer.queries, layer.keys, layer.values))  # [B, T, H]
    flat = norms.reshape(b * t, h)
    rep: dict[str, Any] = {"curve": error_curve(flat, kv_heads), "group_curve": group_error_curve(flat, kv_heads)}
    train, test = norms[:, : t - heldout].reshape(-1, h), norms[:, t - heldout :].reshape(-1, h)
    oracle = selection_mask(oracle_topk(test, k), h)
    static_heads = torch.topk((train**2).mean(0), k).indices
    static = selection_mask(static_heads.expand(test.shape[0], k), h)
    gen = torch.Generator().manual_seed(seed + 1)
    rand = selection_mask(torch.rand(test.shape, generator=gen).argsort(-1)[:, :k].to(test.device), h)
    at_k: dict[str, Any] = {
        "k": k,
        "density": k / h,
        "oracle": {"rel_l2": float(selection_error(test, oracle).mean()), "traffic_ratio": float(kv_traffic(oracle, kv_heads).mean())},
        "static": {"recall": float(recall(static, oracle).mean()), "rel_l2": float(selection_error(test, static).mean()), "traffic_ratio": float(kv_traffic(static, kv_heads).mean()), "heads": static_heads.tolist()},
        "random": {"recall": float(recall(rand, oracle).mean()), "expected_recall": k / h, "rel_l2": float(selection_error(test, rand).mean()), "traffic_ratio": float(kv_traffic(rand, kv_heads).mean())},
    }
    fitted = None
    if router and layer.hidden is not None:
        hid = layer.hidden
        target = selection_mask(oracle_topk(train, k), h).to(hid.device)
        fitted = train_router(hid[:, : t - heldout].reshape(-1, hid.shape[-1]), target, steps=steps, seed=seed, tick=tick)
        chosen = selection_mask(fitted.topk(hid[:, t - heldout :].reshape(-1, hid.shape[-1]), k), h)
        at_k["router"] = {"recall": float(recall(chosen, oracle).mean()), "rel_l2": float(selection_error(test, chosen).mean()), "traffic_ratio": float(kv_traffic(chosen, kv_heads).mean())}
    rep["at_k"] = at_k
    return rep, fitted


def analyse_heads(cache: KVCache, k: int | None = None, heldout: int = 128, router: bool = True, steps: int = 300, seed: int = 0,
                  progress: Callable[[int], None] | None = None, tick: Callable[[], None] | None = None) -> tuple[dict[str, Any], dict[int, Router]]:
    """Run :func:`analyse_layer` on every layer of ``cache``; k defaults to ceil(H/2). ``progress(i)``
    is called after layer ``i``, ``tick()`` after every router training step.

    Returns the report (per layer, curves averaged over layers, router availability) and the routers."""
    f = cache.facts
    if not cache.has_queries:
        raise UsageError("kvtool heads needs the captured queries; recapture without --no-queries")
    k = math.ceil(f.num_heads / 2) if k is None else k
    check_k(k, f.num_heads)
    want_router = router and cache.has_hidden
    layers: dict[str, Any] = {}
    routers: dict[int, Router] = {}
    for i in cache.layer_indices:
        rep, fitted = analyse_layer(cache.layers[i], f.num_kv_heads, k, heldout, want_router, steps, seed, tick=tick)
        layers[str(i)] = rep
        if fitted is not None:
            routers[i] = fitted
        if progress is not None:
            progress(i)
    n = len(layers)
    curve = [
        {key: (row[key] if key == "k" else sum(layers[l]["curve"][j][key] for l in layers) / n) for key in row}
        for j, row in enumerate(next(iter(layers.values()))["curve"])
    ]
    group_curve = [
        {key: (row[key] if key == "groups" else sum(layers[l]["group_curve"][j][key] for l in layers) / n) for key in row}
        for j, row in enumerate(next(iter(layers.values()))["group_curve"])
    ]
    summary: dict[str, Any] = {}
    for who in ("oracle", "router", "static", "random"):
        rows = [layers[l]["at_k"][who] for l in layers if who in layers[l]["at_k"]]
        if rows:
            summary[who] = {m: sum(r[m] for r in rows) / len(rows) for m in ("recall", "rel_l2", "traffic_ratio") if m in rows[0]}
    report = {
        "model": f.name,
        "num_heads": f.num_heads,
        "num_kv_heads": f.num_kv_heads,
        "tokens": cache.num_tokens,
        "heldout": heldout,
        "k": k,
        "density": k / f.num_heads,
        "layers": layers,
        "curve": curve,
        "group_curve": group_curve,
        "at_k": summary,
        "router": None if not want_router else {"steps": steps, "seed": seed, "train_tokens": cache.num_tokens - heldout},
    }
    if router and not cache.has_hidden:
        report["router_skipped"] = "the capture has no hidden states; recapture with --hidden to train the router"
    return report, routers


ROUTER_SCHEMA = "kvtool.router"


def save_routers(path: str | Path, routers: dict[int, Router], cache: KVCache, k: int, force: bool = False) -> Path:
    """Write routers atomically as safetensors: ``layers.{i}.weight`` float32 [H, E], ``.bias`` [H],
    ``.mean`` / ``.std`` [E]; metadata kvtool.schema = kvtool.router, model facts, layers, k."""
    import json

    tensors: dict[str, torch.Tensor] = {}
    for i, r in routers.items():
        for name in ("weight", "bias", "mean", "std"):
            tensors[f"layers.{i}.{name}"] = getattr(r, name).float().contiguous()
    meta = {
        "kvtool.schema": ROUTER_SCHEMA,
        "kvtool.schema_version": io.SCHEMA_VERSION,
        "kvtool.version": __version__,
        "kvtool.model": json.dumps(cache.facts.to_dict()),
        "kvtool.layers": json.dumps(sorted(routers)),
        "kvtool.router_k": str(k),
    }
    return io.write_safetensors(path, tensors, meta, force=force)


def load_routers(path: str | Path) -> tuple[dict[int, Router], int]:
    """Read a router file written by :func:`save_routers`: (routers by layer, k)."""
    path = Path(path)
    meta, entries = io.read_header(path)
    io.check_schema(path, meta, ROUTER_SCHEMA)
    layers = io.parse_json_meta(path, meta, "kvtool.layers")
    tensors = io.read_tensors(path)
    out: dict[int, Router] = {}
    for i in layers:
        try:
            out[i] = Router(*(tensors[f"layers.{i}.{n}"] for n in ("weight", "bias", "mean", "std")))
        except KeyError as exc:
            raise BadDataError(f"{path}: tensor {exc.args[0]!r} is missing") from None
    return out, int(meta.get("kvtool.router_k", "0"))


