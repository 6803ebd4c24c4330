"""Statistics of a captured KV cache: where can it be cut?

Small functions, each one statistic, plain torch (float32 maths, float64 where sums are long).
Notation: B batch, H query heads, Hkv KV heads, G = H // Hkv, T tokens, D head_dim, N rows (tokens of
one head, over the batch), Q sampled query positions.

- magnitudes: mean and max of ``|x|``, percentiles of ``|x|``, excess kurtosis of ``x``;
- outlier channels: channels whose mean ``|x|`` over tokens is at least ``factor`` times the median
  channel's (the KIVI / MUSTAFAR observation: a few key channels are large);
- top-k mass share: the share of a token's squared L2 norm held by its ``round(f * D)`` largest
  elements (per-token magnitude pruning's headroom: pruning the rest leaves a relative error of
  ``sqrt(1 - share)``);
- signs: per-channel share of non-negative elements, and the entropy (bits, at most 4) of the 4-dim
  sign codes of Self-Indexing KVCache, on raw keys and after per-channel centring;
- attention (needs queries): causal softmax of sampled query positions over their visible keys; keys
  needed for 90% / 99% of each query's mass, share on the first (sink) tokens, per-head output norm
  ``||softmax(q K^T / sqrt(D)) V||`` (Polar Sparsity's head importance) and the heads needed per query to
  keep 90% / 99% of the summed output norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from kvtool.core.cache import KVCache, LayerKV, ModelFacts
from kvtool.core.errors import BadDataError
from kvtool.core.attention import default_scale

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
PERCENTILE_SAMPLE = 1 << 24  # larger inputs: percentiles from an evenly strided sample of this size


@dataclass(frozen=True)
class StatsSettings:
    """What ``kvtool stats`` computes.

    outlier_factor: a channel is an outlier when its mean |x| >= factor x the median channel's.
    mass_fractions: the top fractions of a token's elements whose L2-mass share is reported.
    attention_masses: the attention (and output-norm) shares for which the keys (heads) needed are counted.
    max_queries: query positions sampled per sequence, evenly spaced over the second half of the tokens.
    sink_tokens: how many first tokens count as attention sinks.
    """

    outlier_factor: float = 4.0
    mass_fractions: tuple[float, ...] = (0.3, 0.5)
    attention_masses: tuple[float, ...] = (0.9, 0.99)
    max_queries: int = 64
    sink_tokens: int = 4


# ----------------------------------------------------------------------------- element statistics


def head_rows(x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, Hh, T, D]`` -> ``[Hh, N, D]`` float32: each head's token rows over the batch.

    ``token_mask`` ``[B, T]`` (nonzero = real token) drops padding rows."""
    x = x.float()
    if token_mask is not None:
        keep = token_mask.bool()
        return torch.stack([x[:, h][keep] for h in range(x.shape[1])])
    b, hh, t, d = x.shape
    return x.transpose(0, 1).reshape(hh, b * t, d)


def abs_percentiles(parts: list[torch.Tensor], qs: tuple[float, ...] = PERCENTILES) -> dict[float, float]:
    """Percentiles (linear interpolation) of ``|x|`` over all elements of ``parts`` (any shapes).

    Exact up to :data:`PERCENTILE_SAMPLE` elements; beyond that, estimated from an evenly strided
    sample of about that many elements."""
    total = sum(p.numel() for p in parts)
    step = max(1, math.ceil(total / PERCENTILE_SAMPLE))
    flat = torch.cat([p.reshape(-1)[::step] for p in parts]).abs().float().numpy()
    values = np.percentile(flat, list(qs))
    return {q: float(v) for q, v in zip(qs, values)}


def moment_sums(x: torch.Tensor) -> np.ndarray:
    """``[count, sum x, sum x^2, sum x^3, sum x^4]`` (float64) of all elements of ``x``."""
    x = x.double().reshape(-1)
    x2 = x * x
    return np.array([x.numel(), x.sum().item(), x2.sum().item(), (x2 * x).sum().item(), (x2 * x2).sum().item()])


def excess_kurtosis_from_sums(sums: np.ndarray) -> float:
    """Excess kurtosis ``E[(x-mu)^4] / var^2 - 3`` (0 for a Gaussian) from :func:`moment_sums`."""
    n = sums[0]
    if n == 0:
        return float("nan")
    m1, m2, m3, m4 = sums[1] / n, sums[2] / n, sums[3] / n, sums[4] / n
    var = m2 - m1 * m1
    if var <= 0:
        return float("nan")
    c4 = m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1**4
    return float(c4 / (var * var) - 3.0)


def excess_kurtosis(x: torch.Tensor) -> float:
    """Excess kurtosis of all elements of ``x`` (any shape); 0 for a Gaussian, large with outliers."""
    return excess_kurtosis_from_sums(moment_sums(x))


class MagnitudeAccumulator:
    """Pools magnitude statistics over many tensors without keeping them: exact mean |x|, max |x|
    and excess kurtosis (from moment sums); |x| percentiles from every ``step``-th element of each
    added tensor (``step`` 1: exact)."""

    def __init__(self, step: int = 1) -> None:
        self.step = max(1, step)
        self.sums = np.zeros(5)
        self.abs_sum = 0.0
        self.max_abs = 0.0
        self.samples: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        """Pool the elements of ``x`` (any shape)."""
        self.sums = self.sums + moment_sums(x)
        self.abs_sum += x.double().abs().sum().item()
        self.max_abs = max(self.max_abs, x.abs().max().item())
        self.samples.append(x.reshape(-1)[:: self.step].float())

    def summary(self) -> dict[str, float]:
        """``mean_abs``, ``max_abs``, ``p50``, ``p90``, ``p99``, ``p99.9`` (of |x|), ``kurtosis``."""
        out = {"mean_abs": self.abs_sum / max(self.sums[0], 1), "max_abs": self.max_abs}
        for q, v in abs_percentiles(self.samples).items():
            out[f"p{q:g}"] = v
        out["kurtosis"] = excess_kurtosis_from_sums(self.sums)
        return out


def percentile_step(total_elements: int) -> int:
    """The stride that keeps about :data:`PERCENTILE_SAMPLE` of ``total_elements`` for percentiles."""
    return max(1, math.ceil(total_elements / PERCENTILE_SAMPLE))


def magnitude_summary(parts: list[torch.Tensor]) -> dict[str, float]:
    """mean |x|, max |x|, |x| percentiles (``p50``, ``p90``, ``p99``, ``p99.9``) and excess kurtosis of
    all elements of ``parts`` together (tensors of any shape); see :class:`MagnitudeAccumulator`."""
    acc = MagnitudeAccumulator(percentile_step(sum(p.numel() for p in parts)))
    for p in parts:
        acc.add(p)
    return acc.summary()


def channel_mean_abs(x: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` -> ``[D]`` float32: mean |x| of each channel over the tokens."""
    return x.float().abs().mean(0)


def median(values: torch.Tensor) -> float:
    """The median of a 1-D tensor (mean of the two middle values for an even count)."""
    return float(np.median(values.double().numpy()))


def outlier_ratios(channel_means: torch.Tensor) -> torch.Tensor:
    """``[D]`` -> ``[D]``: each channel's mean |x| divided by the median channel's."""
    med = median(channel_means)
    if med <= 0:
        return torch.where(channel_means > 0, torch.full_like(channel_means, float("inf")), torch.zeros_like(channel_means))
    return channel_means / med


def outlier_channels(channel_means: torch.Tensor, factor: float = 4.0) -> list[int]:
    """Indices of the channels (``[D]`` mean |x|) at least ``factor`` x the median channel."""
    return [int(i) for i in torch.nonzero(outlier_ratios(channel_means) >= factor).flatten()]


def kept_elements(dim: int, fraction: float) -> int:
    """How many of ``dim`` elements the top ``fraction`` is: ``round(fraction * dim)``, at least 1."""
    return max(1, min(dim, int(round(fraction * dim))))


def top_mass_share(x: torch.Tensor, fraction: float) -> torch.Tensor:
    """``[N, D]`` -> ``[N]`` float32: share of each row's squared L2 norm held by its
    ``kept_elements(D, fraction)`` largest-magnitude elements (1 for an all-zero row)."""
    sq = x.float().square()
    k = kept_elements(x.shape[-1], fraction)
    top = sq.topk(k, dim=-1).values.sum(-1)
    total = sq.sum(-1)
    return torch.where(total > 0, top / total.clamp_min(1e-30), torch.ones_like(total))


def sign_balance(x: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` -> ``[D]``: share of each channel's elements that are >= 0 (0.5 = balanced)."""
    return (x >= 0).float().mean(0)


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    """Entropy in bits of a coin with P(heads) = ``p`` (elementwise; 0 at p = 0 or 1)."""
    p = p.double()
    terms = [torch.where(r > 0, -r * torch.log2(r), torch.zeros_like(r)) for r in (p, 1 - p)]
    return (terms[0] + terms[1]).float()


def sign_codes(x: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` -> ``[N, D // 4]`` int64 in 0..15: the sign code of each 4-dim group.

    Bit j of group g's code is 1 where element ``4g + j`` is >= 0 (sign +1 -> 1, -1 -> 0). A trailing
    ``D % 4`` channels are left out."""
    n, d = x.shape
    groups = d // 4
    bits = (x[:, : groups * 4] >= 0).long().reshape(n, groups, 4)
    return (bits * torch.tensor([1, 2, 4, 8])).sum(-1)


def code_entropy(codes: torch.Tensor, num_codes: int = 16) -> torch.Tensor:
    """``[N, G]`` codes in ``0..num_codes-1`` -> ``[G]`` float32: entropy in bits of each group's code
    histogram over the N rows (at most log2(num_codes))."""
    n, g = codes.shape
    hist = torch.zeros(g, num_codes, dtype=torch.float64)
    hist.scatter_add_(1, codes.T.contiguous(), torch.ones(g, n, dtype=torch.float64))
    p = hist / max(n, 1)
    return torch.where(p > 0, -p * torch.log2(p), torch.zeros_like(p)).sum(-1).float()


def channel_median(x: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` -> ``[D]``: each channel's median over the rows (mean of the two middle values for
    even N, unlike ``torch.median`` which takes the lower one)."""
    ordered = x.sort(0).values
    n = x.shape[0]
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def center_channels(x: torch.Tensor, how: str) -> torch.Tensor:
    """``[N, D]`` minus each channel's ``mean`` or ``median`` over the N rows (``how``), or ``x``
    itself for ``raw``."""
    if how == "raw":
        return x
    if how == "mean":
        return x - x.mean(0, keepdim=True)
    if how == "median":
        return x - channel_median(x)[None]
    raise ValueError(f"unknown centring {how!r}: use raw, mean or median")


CENTRINGS = ("raw", "mean", "median")


def sign_summary(x: torch.Tensor) -> dict[str, float]:
    """For ``[N, D]`` rows, before and after per-channel centring (raw, mean, median):
    ``code_entropy_<c>``: mean over groups of the 4-dim sign-code entropy (bits, max 4);
    ``sign_imbalance_<c>``: mean over channels of |share >= 0 - 0.5| (0 balanced, 0.5 constant sign)."""
    out: dict[str, float] = {}
    for how in CENTRINGS:
        xc = center_channels(x, how)
        out[f"code_entropy_{how}"] = float(code_entropy(sign_codes(xc)).mean()) if x.shape[1] >= 4 else float("nan")
        out[f"sign_imbalance_{how}"] = float((sign_balance(xc) - 0.5).abs().mean())
    return out


def tensor_head_stats(x: torch.Tensor, settings: StatsSettings) -> dict[str, Any]:
    """Every element statistic of one head's rows ``[N, D]``: magnitudes, outlier channels (with their
    ratios to the median channel), top-fraction L2-mass shares (mean and minimum over tokens), signs.
    Per-channel lists (D values each): ``channel_mean_abs`` and ``sign_balance`` (share >= 0, raw)."""
    means = channel_mean_abs(x)
    ratios = outlier_ratios(means)
    channels = outlier_channels(means, settings.outlier_factor)
    out: dict[str, Any] = magnitude_summary([x])
    out.update(
        outliers=len(channels),
        outlier_channels=channels,
        outlier_ratios=[round(float(ratios[c]), 3) for c in channels],
        max_ratio=float(ratios.max()),
    )
    for f in settings.mass_fractions:
        share = top_mass_share(x, f)
        out[f"top{round(f * 100)}_share"] = float(share.mean())
        out[f"top{round(f * 100)}_share_min"] = float(share.min())
    out.update(sign_summary(x))
    out["channel_mean_abs"] = [round(float(v), 5) for v in means]
    out["sign_balance"] = [round(float(v), 4) for v in sign_balance(x)]
    return out


def combine_head_stats(magnitudes: dict[str, float], heads: list[dict[str, Any]]) -> dict[str, Any]:
    """Layer (or model) aggregate: ``magnitudes`` (a :func:`magnitude_summary` of all the elements)
    plus, from the per-head results, outlier counts summed, the largest ratio, shares and sign numbers
    averaged over heads (the minimum for ``*_min`` shares)."""
    out: dict[str, Any] = dict(magnitudes)
    out["outliers"] = sum(h["outliers"] for h in heads)
    out["max_ratio"] = max(h["max_ratio"] for h in heads)
    for key in heads[0]:
        if key.startswith(("top", "code_entropy_", "sign_imbalance_")):
            vals = [h[key] for h in heads]
            out[key] = float(min(vals)) if key.endswith("_min") else float(np.mean(vals))
    return out


# ----------------------------------------------------------------------------- attention statistics


def query_positions(num_tokens: int, max_queries: int) -> torch.Tensor:
    """``[Q]`` int64: up to ``max_queries`` evenly spaced positions in the second half of
    ``0..num_tokens-1`` (late queries see most of the cache, like decode steps), last one included."""
    start = num_tokens // 2
    count = min(max_queries, num_tokens - start)
    if count <= 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.linspace(start, num_tokens - 1, count).round().long().unique()


def causal_probs(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention probabilities at sampled positions for the query heads of one KV head.

    q ``[..., T, D]`` (the queries of one or more query heads), keys ``[T, D]`` (their KV head's keys),
    positions ``[Q]`` -> ``[..., Q, T]`` float32: the query at position p attends to keys ``0..p``
    (later keys get 0)."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    scores = (q[..., positions, :].float() @ keys.float().T) * scale
    allowed = torch.arange(keys.shape[0], device=keys.device)[None, :] <= positions.to(keys.device)[:, None]
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def sorted_cumsum(probs: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` -> ``[..., T]``: running sums of each row sorted largest first."""
    return probs.sort(dim=-1, descending=True).values.cumsum(-1)


def needed_from_cumsum(cum: torch.Tensor, mass: float) -> torch.Tensor:
    """:func:`keys_for_mass` from :func:`sorted_cumsum` rows ``[..., T]`` -> ``[...]`` int64."""
    need = (cum < mass * cum[..., -1:]).sum(-1) + 1
    return need.clamp_max(cum.shape[-1])


def keys_for_mass(probs: torch.Tensor, mass: float) -> torch.Tensor:
    """``[..., T]`` probabilities -> ``[...]`` int64: fewest keys (largest first) whose summed
    probability reaches ``mass`` of the row's total."""
    return needed_from_cumsum(sorted_cumsum(probs), mass)


def sink_share(probs: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """``[..., T]`` -> ``[...]``: attention mass on the first ``sink_tokens`` keys."""
    return probs[..., :sink_tokens].sum(-1)


def curve_from_cumsum(cum: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """:func:`mass_curve` from :func:`sorted_cumsum` rows ``[..., Q, T]`` -> ``[..., K]``."""
    idx = (kept.clamp(1, cum.shape[-1]) - 1).long()
    return cum[..., idx].mean(-2)


def mass_curve(probs: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``[..., Q, T]`` probabilities, ``kept`` ``[K]`` key counts -> ``[..., K]``: mean over the Q rows
    of the mass held by each row's ``kept`` largest probabilities."""
    return curve_from_cumsum(sorted_cumsum(probs), kept)


def curve_points(num_tokens: int, count: int = 48) -> torch.Tensor:
    """``[K]`` int64: about ``count`` log-spaced key counts from 1 to ``num_tokens`` (both included)."""
    pts = torch.logspace(0, math.log10(max(num_tokens, 1)), count).round().long()
    return torch.unique(torch.cat([pts, torch.tensor([1, num_tokens])])).clamp(1, num_tokens)


def heads_for_norm(norms: torch.Tensor, share: float) -> torch.Tensor:
    """``[H, Q]`` per-head output norms -> ``[Q]`` int64: fewest heads (largest norms first) whose
    norms sum to at least ``share`` of the sum over all heads, for each query."""
    return keys_for_mass(norms.T, share)


@dataclass
class LayerAttention:
    """Attention of one layer's sampled queries, per query head (every head of the layer).

    keys_needed: {mass: [H, Nq] int64}; visible: [Nq] int64 keys each query sees; sink: [H, Nq];
    out_norm: [H, Nq] float32 output norms; curve: [H, K] mean mass vs ``curve_kept`` [K] keys kept;
    Nq = sampled queries over the batch."""

    keys_needed: dict[float, torch.Tensor]
    visible: torch.Tensor
    sink: torch.Tensor
    out_norm: torch.Tensor
    curve: torch.Tensor
    curve_kept: torch.Tensor
    group: int
    positions: list[list[int]] = field(default_factory=list)

    def cpu(self) -> "LayerAttention":
        """The same statistics with every tensor on the CPU (after a layer ran on a GPU)."""
        return LayerAttention({m: t.cpu() for m, t in self.keys_needed.items()}, self.visible.cpu(), self.sink.cpu(),
                              self.out_norm.cpu(), self.curve.cpu(), self.curve_kept.cpu(), self.group, self.positions)


def layer_attention(layer: LayerKV, facts: ModelFacts, settings: StatsSettings, attention_mask: torch.Tensor | None = None) -> LayerAttention:
    """Causal attention statistics for one layer from its captured queries (every query head).

    One KV head's G query heads at a time, over ``Q`` sampled positions: memory ``O(G x Q x T)``,
    never ``T x T``.
    With a padding mask, each sequence's real (non-padding) tokens are used alone."""
    if layer.queries is None:
        raise BadDataError("this capture has no queries: attention statistics need them; recapture without --no-queries")
    g = facts.group_size
    b, h, t, _ = layer.queries.shape
    masses = settings.attention_masses
    kept = curve_points(t)
    needed: dict[float, list[torch.Tensor]] = {m: [] for m in masses}
    visible, sink, norms, curves, weights, positions_all = [], [], [], [], [], []
    for bi in range(b):
        start = 0 if attention_mask is None else int((attention_mask[bi] == 0).sum())
        q_all = layer.queries[bi, :, start:]
        k_all, v_all = layer.keys[bi, :, start:], layer.values[bi, :, start:]
        n = q_all.shape[1]
        pos = query_positions(n, settings.max_queries)
        if pos.numel() == 0:
            continue
        positions_all.append([int(p) + start for p in pos])
        visible.append(pos + 1)
        per_group = {m: [] for m in masses}
        sk, nm, cv = [], [], []
        for kv in range(h // g):  # the G query heads of one KV head together: [G, Q, T]
            probs = causal_probs(q_all[kv * g : (kv + 1) * g], k_all[kv], pos)
            cum = sorted_cumsum(probs)
            for m in masses:
                per_group[m].append(needed_from_cumsum(cum, m))
            sk.append(sink_share(probs, settings.sink_tokens))
            nm.append((probs @ v_all[kv].float()).norm(dim=-1))
            cv.append(curve_from_cumsum(cum, kept.clamp_max(n)))
        for m in masses:
            needed[m].append(torch.cat(per_group[m]))
        sink.append(torch.cat(sk))
        norms.append(torch.cat(nm))
        curves.append(torch.cat(cv))
        weights.append(pos.numel())
    if not weights:
        raise BadDataError("the capture has too few tokens for attention statistics")
    w = torch.tensor(weights, dtype=torch.float32, device=curves[0].device)
    curve = (torch.stack(curves) * w[:, None, None]).sum(0) / w.sum()
    return LayerAttention(
        keys_needed={m: torch.cat(needed[m], dim=1) for m in masses},
        visible=torch.cat(visible),
        sink=torch.cat(sink, dim=1),
        out_norm=torch.cat(norms, dim=1),
        curve=curve,
        curve_kept=kept,
        group=g,
        positions=positions_all,
    )


def attention_summary(att: LayerAttention, settings: StatsSettings) -> dict[str, Any]:
    """Numbers of :class:`LayerAttention`: per query head (mean keys needed and their share of the
    visible keys, sink share, mean output norm, output-norm share) and for the layer (means over heads;
    mean and fraction of heads needed per query to keep each output-norm share)."""
    h = att.out_norm.shape[0]
    vis = att.visible.float()
    norm_mean = att.out_norm.mean(1)
    heads = []
    for head in range(h):
        row: dict[str, Any] = {"head": head, "kv_head": head // att.group}
        for m in settings.attention_masses:
            tag = mass_tag(m)
            row[f"keys{tag}"] = float(att.keys_needed[m][head].float().mean())
            row[f"keys{tag}_frac"] = float((att.keys_needed[m][head].float() / vis).mean())
        row["sink_share"] = float(att.sink[head].mean())
        row["out_norm"] = float(norm_mean[head])
        row["out_norm_share"] = float(norm_mean[head] / norm_mean.sum())
        heads.append(row)
    layer: dict[str, Any] = {"queries": int(att.visible.numel()), "mean_visible": float(vis.mean())}
    for key in heads[0]:
        if key not in ("head", "kv_head", "out_norm_share"):
            layer[key] = float(np.mean([r[key] for r in heads]))
    for m in settings.attention_masses:
        need = heads_for_norm(att.out_norm, m).float()
        layer[f"heads{mass_tag(m)}"] = float(need.mean())
        layer[f"heads{mass_tag(m)}_frac"] = float(need.mean() / h)
    return {"all_heads": layer, "heads": heads}


def mass_tag(mass: float) -> str:
    """0.9 -> ``"90"``, 0.99 -> ``"99"``, 0.999 -> ``"99.9"`` (used in result keys)."""
    return f"{mass * 100:g}"


def kv_head_attention(summary: dict[str, Any], kv_head: int) -> dict[str, Any]:
    """Means over the query heads that read ``kv_head`` of :func:`attention_summary`'s per-head rows."""
    rows = [r for r in summary["heads"] if r["kv_head"] == kv_head]
    out: dict[str, Any] = {"query_heads": [r["head"] for r in rows]}
    for key in rows[0]:
        if key not in ("head", "kv_head"):
            out[key] = float(np.mean([r[key] for r in rows]))
    return out


# ----------------------------------------------------------------------------- cross-layer outliers


def outlier_consistency(outliers: dict[int, dict[int, list[int]]]) -> dict[str, Any]:
    """Whether outlier channels repeat across layers.

    ``outliers``: {layer: {kv_head: [channels]}}. Returns ``per_kv_head``, one entry per KV head index:
    the channels that are outliers in every layer (``persistent``), in two or more (``recurring``:
    ``{"channel", "layers"}``) and the mean Jaccard overlap of consecutive layers' sets; and over all
    (layer, head) pairs, how often each channel index is an outlier (``by_channel``: ``{"channel",
    "pairs"}``, most frequent first). Lists of objects, so that channel and head numbers stay numbers
    in JSON."""
    layers = sorted(outliers)
    heads = sorted({h for per in outliers.values() for h in per})
    per_head: list[dict[str, Any]] = []
    for h in heads:
        sets = [set(outliers[l].get(h, [])) for l in layers]
        counts: dict[int, list[int]] = {}
        for l, s in zip(layers, sets):
            for c in s:
                counts.setdefault(c, []).append(l)
        jac = [len(a & b) / len(a | b) for a, b in zip(sets, sets[1:]) if a | b]
        per_head.append({
            "kv_head": h,
            "persistent": sorted(set.intersection(*sets)) if sets else [],
            "recurring": [{"channel": c, "layers": ls} for c, ls in sorted(counts.items()) if len(ls) >= 2],
            "jaccard_consecutive": float(np.mean(jac)) if jac else None,
        })
    by_channel: dict[int, int] = {}
    for per in outliers.values():
        for chans in per.values():
            for c in chans:
                by_channel[c] = by_channel.get(c, 0) + 1
    ordered = [{"channel": c, "pairs": n} for c, n in sorted(by_channel.items(), key=lambda kv: (-kv[1], kv[0]))]
    pairs = sum(len(per) for per in outliers.values())
    return {"per_kv_head": per_head, "by_channel": ordered, "layer_head_pairs": pairs}


# ----------------------------------------------------------------------------- whole capture


def token_mask(cache: KVCache) -> torch.Tensor | None:
    """``[B, T]`` bool of real tokens, or None when the capture has no padding."""
    return None if cache.attention_mask is None else cache.attention_mask.bool()


def capture_stats(
    cache: KVCache,
    layers: list[int] | None = None,
    kv_heads: list[int] | None = None,
    settings: StatsSettings = StatsSettings(),
    attention: bool | None = None,
    progress: Callable[[int], None] | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """All statistics of ``cache`` as one JSON-ready dict.

    ``layers``/``kv_heads`` narrow the selection (default: all). ``attention``: True requires queries
    (BadDataError without them), None computes attention statistics when queries are there, False
    skips them. Result keys: ``model_facts``, ``settings``, ``selection``, ``layers`` (list of per-layer dicts
    with ``keys``/``values`` aggregates, ``heads`` per KV head, ``attention``), ``model_summary`` and
    ``outlier_consistency`` (for keys and values). The attention statistics (queries against every
    key) run on ``device``, one layer at a time; magnitudes are summed on the CPU."""
    facts = cache.facts
    device = torch.device(device)
    layers = cache.layer_indices if layers is None else layers
    kv_heads = list(range(facts.num_kv_heads)) if kv_heads is None else kv_heads
    if attention and not cache.has_queries:
        raise BadDataError("the capture has no queries: attention statistics need them; recapture without --no-queries")
    do_attention = cache.has_queries if attention is None else attention
    mask = token_mask(cache)
    result_layers = []
    rows_per_head = cache.batch_size * cache.num_tokens if mask is None else int(mask.sum())
    step = percentile_step(len(layers) * len(kv_heads) * rows_per_head * facts.head_dim)
    model_acc = {"keys": MagnitudeAccumulator(step), "values": MagnitudeAccumulator(step)}
    outl: dict[str, dict[int, dict[int, list[int]]]] = {"keys": {}, "values": {}}
    att_layers = []
    for li in layers:
        layer = cache.layer(li)
        entry: dict[str, Any] = {"layer": li, "heads": []}
        per_part_heads: dict[str, list[dict[str, Any]]] = {}
        for part in ("keys", "values"):
            rows = head_rows(getattr(layer, part), mask)
            picked = [rows[h] for h in kv_heads]
            head_stats = [tensor_head_stats(r, settings) for r in picked]
            per_part_heads[part] = head_stats
            entry[part] = combine_head_stats(magnitude_summary(picked), head_stats)
            for r in picked:
                model_acc[part].add(r)
            outl[part][li] = {h: s["outlier_channels"] for h, s in zip(kv_heads, head_stats)}
        att = None
        if do_attention:
            placed = layer if device.type == "cpu" else LayerKV(layer.keys.to(device), layer.values.to(device), layer.queries.to(device))
            att = attention_summary(layer_attention(placed, facts, settings, cache.attention_mask).cpu(), settings)
            del placed
        for i, h in enumerate(kv_heads):
            head_entry: dict[str, Any] = {"kv_head": h, "keys": per_part_heads["keys"][i], "values": per_part_heads["values"][i]}
            if att is not None:
                head_entry["attention"] = kv_head_attention(att, h)
            entry["heads"].append(head_entry)
        if att is not None:
            entry["attention"] = att
            att_layers.append(att["all_heads"])
        result_layers.append(entry)
        if progress is not None:
            progress(li)
    model_summary: dict[str, Any] = {}
    for part in ("keys", "values"):
        model_summary[part] = combine_head_stats(model_acc[part].summary(), [h[part] for e in result_layers for h in e["heads"]])
    if att_layers:
        model_summary["attention"] = {k: float(np.mean([a[k] for a in att_layers])) for k in att_layers[0] if k != "queries"}
    return {
        "model_facts": facts.to_dict(),
        "tokens": cache.num_tokens,
        "batch": cache.batch_size,
        "settings": {
            "outlier_factor": settings.outlier_factor,
            "mass_fractions": list(settings.mass_fractions),
            "kept_elements": {f"top{round(f * 100)}": kept_elements(facts.head_dim, f) for f in settings.mass_fractions},
            "attention_masses": list(settings.attention_masses),
            "max_queries": settings.max_queries,
            "sink_tokens": settings.sink_tokens,
        },
        "selection": {"selected_layers": layers, "selected_kv_heads": kv_heads, "attention": do_attention},
        "layers": result_layers,
        "model_summary": model_summary,
        "outlier_consistency": {part: outlier_consistency(outl[part]) for part in ("keys", "values")},
    }
