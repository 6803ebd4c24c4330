"""``pagestat``: page statistics for top-k page selection (UNIQUE, with Quest and mean-only as
alternative scorers). Keys and values stay dense; the format adds per-page statistics.

Pages are P contiguous tokens per KV head (the last page may be shorter). Per page:
- ``unique``: the key mean ``mu`` ``[D]`` and ``sigma`` = L2 norm of the per-dimension population
  standard deviation; score = q.mu + lam * ||q|| * sigma;
- ``quest``: the per-dimension key min and max; score = sum_i max(q_i*max_i, q_i*min_i), an upper
  bound of q.k over the page's keys;
- ``mean``: the key mean only; score = q.mu (UNIQUE without its offset).
GQA: a page's score is the max over the query heads of its group. A decode step attends the first
page, every page that touches the last ``dense_window`` tokens, and the best-scoring other pages
while their tokens fit the token budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvtool.core.attention import attend_partial, expand_kv
from kvtool.core.cache import KVCache, LayerKV
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats._retrieval import oracle_recall, resolve_budget, selection_recall
from kvtool.formats.base import CompressedCache, Encoded, Format, FormatParams, register
from kvtool.formats._live import ChunkedLive, nbytes as tensor_nbytes, on_gpu
from kvtool.kernels.common import random_decode_inputs
from kvtool.kernels.pages import (
    SCORE_ID,
    forced_index,
    page_criticality,
    page_scores,
    paged_attention,
    paged_attention_reference,
    pages_to_token_mask,
    select_pages,
    select_pages_triton,
)

SCORES = tuple(SCORE_ID)


@dataclass
class PageStatParams(FormatParams):
    page_size: int = 16
    score: Literal["unique", "quest", "mean"] = "unique"
    lam: float = 1.0
    budget: int | None = None
    budget_ratio: float | None = 0.25
    dense_window: int = 16

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"--page-size must be positive, got {self.page_size}")
        if self.score not in SCORES:
            raise ValueError(f"--score must be one of {', '.join(SCORES)}, got {self.score!r}")
        if self.dense_window < 0:
            raise ValueError(f"--dense-window must be >= 0, got {self.dense_window}")


# ----------------------------------------------------------------------------- reference maths


def page_stats(keys: torch.Tensor, page_size: int, score: str) -> dict[str, torch.Tensor]:
    """Statistics of keys ``[B, Hkv, T, D]`` per page of ``page_size`` tokens (float32):
    ``mean`` ``[B, Hkv, NP, D]`` and ``sigma`` ``[B, Hkv, NP]`` (unique), ``mean`` (mean),
    ``min``/``max`` ``[B, Hkv, NP, D]`` (quest). A short last page uses its own tokens."""
    b, h, t, d = keys.shape
    n = -(-t // page_size)
    pad = n * page_size - t
    k = keys.float()
    valid = torch.ones(t, dtype=torch.bool, device=keys.device)
    if pad:
        k = torch.cat([k, k.new_zeros(b, h, pad, d)], 2)
        valid = torch.cat([valid, valid.new_zeros(pad)])
    kp = k.reshape(b, h, n, page_size, d)
    vp = valid.reshape(n, page_size)[None, None, :, :, None]
    count = vp.sum(3).float()  # [1,1,NP,1]
    out: dict[str, torch.Tensor] = {}
    if score in ("unique", "mean"):
        mean = kp.sum(3) / count
        out["mean"] = mean
        if score == "unique":
            var = (((kp - mean[:, :, :, None]) ** 2) * vp).sum(3) / count
            out["sigma"] = var.sum(-1).sqrt()
    else:
        out["max"] = kp.masked_fill(~vp, float("-inf")).amax(3)
        out["min"] = kp.masked_fill(~vp, float("inf")).amin(3)
    return out


def forced_pages(tokens: int, page_size: int, window: int) -> list[int]:
    """Pages always attended: the first page and every page touching the last ``window`` tokens."""
    n = -(-tokens // page_size)
    first_window_page = (tokens - window) // page_size if window else n
    return sorted({0, *range(first_window_page, n)})


def pages_to_select(tokens: int, page_size: int, window: int, budget: int) -> int:
    """How many pages beyond the forced ones fit in ``budget`` tokens (every such page is full)."""
    forced = forced_pages(tokens, page_size, window)
    forced_tokens = sum(min(page_size, tokens - p * page_size) for p in forced)
    n = -(-tokens // page_size)
    return max(0, min(n - len(forced), (budget - forced_tokens) // page_size))


# ----------------------------------------------------------------------------- the format


@register
class PageStatFormat(Format):
    name = "pagestat"
    summary = "dense paged keys/values + per-page statistics for top-k page selection (UNIQUE / Quest)"
    Params = PageStatParams
    default_sweep = (
        'pagestat:budget=64,128,256',
    )
    paper_rows = (
        ('page scoring at budget 128 (UNIQUE vs Quest)', 'UNIQUE', 'pagestat:budget=128,score=unique'),
        ('page scoring at budget 128 (UNIQUE vs Quest)', 'Quest', 'pagestat:budget=128,score=quest'),
    )
    selects = True
    has_kernel = True
    live_grows = True

    def live_layer(self, enc: Encoded, like: torch.Tensor) -> "PageStatLive":
        """The layer as a live cache layer (:class:`PageStatLive`) on ``like``'s device."""
        return PageStatLive(self, Encoded({n: t.to(like.device) for n, t in enc.tensors.items()}, dict(enc.meta)))

    def check(self, layer: LayerKV, params: FormatParams) -> None:
        p: PageStatParams = params  # type: ignore[assignment]
        t = layer.keys.shape[2]
        if p.page_size > t:
            raise UsageError(f"--page-size {p.page_size} is larger than the {t} tokens to compress")
        budget = resolve_budget(p.budget, p.budget_ratio, t)
        need = p.page_size + p.dense_window
        if budget < min(need, t):
            raise UsageError(f"token budget {budget} is smaller than the first page ({p.page_size}) + --dense-window {p.dense_window}")

    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        """keys/values ``[B, Hkv, T, D]`` -> dense ``keys``/``values`` plus ``stats.*`` (see
        docs/formats.md ``### pagestat``)."""
        p: PageStatParams = params  # type: ignore[assignment]
        self.check(layer, p)
        k, v = layer.keys, layer.values
        t = k.shape[2]
        stats = page_stats(k, p.page_size, p.score)
        tensors = {"keys": k.contiguous(), "values": v.contiguous()}
        tensors.update({f"stats.{n}": s.to(k.dtype).contiguous() for n, s in stats.items()})
        budget = resolve_budget(p.budget, p.budget_ratio, t)
        forced = forced_pages(t, p.page_size, min(p.dense_window, t))
        meta = {
            "tokens": t, "page_size": p.page_size, "pages": -(-t // p.page_size), "score": p.score, "lam": p.lam,
            "dense_window": min(p.dense_window, t), "budget": budget, "forced_pages": forced,
            "select": pages_to_select(t, p.page_size, min(p.dense_window, t), budget),
            "dtype": str(k.dtype).removeprefix("torch."),
        }
        return Encoded(tensors, meta)

    def decode(self, enc: Encoded) -> LayerKV:
        return LayerKV(keys=enc.tensors["keys"], values=enc.tensors["values"])

    def stats(self, enc: Encoded) -> dict[str, torch.Tensor]:
        return {n.split(".", 1)[1]: x for n, x in enc.tensors.items() if n.startswith("stats.")}

    def select(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """Page indices int64 ``[B, Hkv, Tq, forced + select]`` for q ``[B, H, Tq, D]``."""
        m = enc.meta
        scores = page_scores(q, self.stats(enc), m["score"], m["lam"])
        return select_pages(scores, m["forced_pages"], m["select"])

    def selected_mask(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        m = enc.meta
        mask = pages_to_token_mask(self.select(q, enc), m["page_size"], m["tokens"])
        return expand_kv(mask, q.shape[1] // mask.shape[1])

    def attend(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial over the tokens of the selected pages; q ``[B, H, Tq, D]``."""
        return attend_partial(q, enc.tensors["keys"], enc.tensors["values"], scale, self.selected_mask(q, enc))

    def attend_kernel(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return pagestat_decode(q, enc, scale)

    def nbytes(self, enc: Encoded) -> dict[str, int]:
        parts = {"keys": 0, "values": 0, "stats": 0}
        for name, t in enc.tensors.items():
            parts[name.split(".")[0]] += t.numel() * t.element_size()
        return parts

    def traffic_bytes(self, enc: Encoded, q: torch.Tensor | None = None) -> int:
        """One decode step: every page statistic, then the keys/values of the attended pages."""
        m = enc.meta
        k = enc.tensors["keys"]
        stats = sum(x.numel() * x.element_size() for n, x in enc.tensors.items() if n.startswith("stats."))
        ps, t = m["page_size"], m["tokens"]
        tokens = sum(min(ps, t - p * ps) for p in m["forced_pages"]) + m["select"] * ps
        per_token = 2 * k.shape[0] * k.shape[1] * k.shape[3] * k.element_size()
        return int(stats + tokens * per_token)

    def validate(self, enc: Encoded) -> None:
        t, m = enc.tensors, enc.meta
        for key in ("tokens", "page_size", "pages", "score", "lam", "dense_window", "budget", "forced_pages", "select", "dtype"):
            if key not in m:
                raise BadDataError(f"layer metadata lacks {key!r}")
        if m["score"] not in SCORES:
            raise BadDataError(f"unknown score {m['score']!r}")
        names = {"unique": ("mean", "sigma"), "mean": ("mean",), "quest": ("min", "max")}[m["score"]]
        need = ("keys", "values", *(f"stats.{n}" for n in names))
        for name in need:
            if name not in t:
                raise BadDataError(f"tensor {name!r} is missing")
        extra = sorted(set(t) - set(need))
        if extra:
            raise BadDataError(f"unexpected tensor {extra[0]!r}")
        k = t["keys"]
        if k.ndim != 4 or t["values"].shape != k.shape or not k.is_floating_point():
            raise BadDataError("keys/values must be floating point [batch, kv_heads, tokens, head_dim] of one shape")
        b, h, tokens, d = k.shape
        ps, n = m["page_size"], m["pages"]
        if tokens != m["tokens"] or ps <= 0 or ps > tokens or n != -(-tokens // ps):
            raise BadDataError(f"metadata (tokens {m['tokens']}, page size {ps}, pages {n}) disagrees with keys of {tokens} tokens")
        if m["forced_pages"] != forced_pages(tokens, ps, m["dense_window"]) or not 0 <= m["select"] <= n - len(m["forced_pages"]):
            raise BadDataError("forced pages or selection count disagree with the page layout")
        for name in names:
            x = t[f"stats.{name}"]
            shape = (b, h, n) if name == "sigma" else (b, h, n, d)
            if tuple(x.shape) != shape or x.dtype != k.dtype:
                raise BadDataError(f"stats.{name} is {tuple(x.shape)} {x.dtype}, expected {shape} {k.dtype}")
            if not torch.isfinite(x).all():
                raise BadDataError(f"stats.{name} holds NaN or infinite values")
        if "sigma" in names and (t["stats.sigma"] < 0).any():
            raise BadDataError("stats.sigma holds negative values")
        if m["score"] == "quest" and (t["stats.min"] > t["stats.max"]).any():
            raise BadDataError("stats.min exceeds stats.max")

    def report(self, cc: CompressedCache, source: KVCache | None = None) -> dict[str, Any]:
        dense = stats = traffic = 0
        for enc in cc.layers.values():
            parts = self.nbytes(enc)
            dense += parts["keys"] + parts["values"]
            stats += parts["stats"]
            traffic += self.traffic_bytes(enc)
        first = cc.layers[cc.layer_indices[0]].meta
        out: dict[str, Any] = {
            "storage_overhead": round(stats / dense, 4),
            "traffic_ratio": round(traffic / dense, 4),
            "pages": first["pages"],
            "budget_tokens": first["budget"],
            "pages_attended": len(first["forced_pages"]) + first["select"],
        }
        recall = selection_recall(self, cc, source)
        if recall is not None:
            out["recall"] = recall["overall"]
            out["recall_min"] = recall["min"]
            out["recall_per_layer"] = recall["per_layer"]
            out["recall_oracle_same_budget"] = oracle_recall(cc, source, first["budget"])
            out["recall_by_score"] = self.compare_scores(cc, source)
        return out

    def compare_scores(self, cc: CompressedCache, source: KVCache) -> dict[str, float]:
        """Overall held-out recall of every scorer at this file's page size, window and budget."""
        out: dict[str, float] = {}
        params = PageStatParams(**{**cc.params})
        for score in SCORES:
            p = PageStatParams(**{**params.to_dict(), "score": score})
            encs = {i: self.encode(source.layers[i].slice_tokens(0, cc.prefix_tokens), p) for i in cc.layer_indices}
            got = selection_recall(self, cc, source, encs)
            if got is not None:
                out[score] = got["overall"]
        return out


def pagestat_decode(q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pagestat`` attention through the kernels: criticality, Triton page selection
    (:func:`select_pages_triton`), paged attention with the Triton split merge. Same contract as
    ``PageStatFormat.attend``. No host copies or syncs, so the step can be captured in a CUDA graph."""
    m = enc.meta
    stats = {n.split(".", 1)[1]: x for n, x in enc.tensors.items() if n.startswith("stats.")}
    crit = page_criticality(q, stats, m["score"], m["lam"])
    pages = select_pages_triton(crit, forced_index(m["forced_pages"], q.device), m["select"])
    # selected page lists are distinct and in range: skip the checks (and their device-to-host syncs)
    return paged_attention(q, enc.tensors["keys"], enc.tensors["values"], pages, m["page_size"], scale, check=False)


def pagestat_decode_reference(q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path (``PageStatFormat.attend``) with the scores of :func:`page_scores`."""
    m = enc.meta
    stats = {n.split(".", 1)[1]: x for n, x in enc.tensors.items() if n.startswith("stats.")}
    pages = select_pages(page_scores(q, stats, m["score"], m["lam"]), m["forced_pages"], m["select"])
    return paged_attention_reference(q, enc.tensors["keys"], enc.tensors["values"], pages, m["page_size"], scale)


def make_pagestat_inputs(
    batch: int = 1, heads: int = 32, kv_heads: int = 8, tokens: int = 4096, head_dim: int = 128,
    dtype: torch.dtype = torch.float16, device: str | torch.device = "cuda", page_size: int = 16,
    budget: int = 512, score: str = "unique", dense_window: int = 16, seed: int = 0,
) -> tuple[torch.Tensor, Encoded]:
    """Random keys/values (one planted outlier channel) encoded as ``pagestat`` on ``device`` and a
    decode query ``[batch, heads, 1, head_dim]``: ``pagestat_decode(q, enc)`` runs on them."""
    q, lay = random_decode_inputs(batch, heads, kv_heads, tokens, head_dim, dtype, device, seed)
    enc = PageStatFormat().encode(lay, PageStatParams(page_size=page_size, score=score, budget=budget, budget_ratio=None, dense_window=dense_window))
    return q, enc


# ----------------------------------------------------------------------------- live cache


class PageStatLive(ChunkedLive):
    """A live ``pagestat`` layer: dense keys / values of the stored pages in a preallocated buffer
    (room for 64 more pages or 1/32 more tokens; grown by a quarter when full), their statistics, and a dense tail of the ``dense_window`` most recent
    new tokens plus the page being filled. When the tail holds ``dense_window + page_size`` tokens
    its oldest ones complete the stored layer's last page (or make a new page) and the page's
    statistics are computed. A step selects pages as the stored layer does (its forced pages and
    page count) until the first page joins; from then on the first page and the best-scoring other
    pages up to the layer's token budget, counting the tail against it. Selection and paged
    attention run through the page kernels on CUDA (:func:`pagestat_decode`) or the torch reference;
    the tail is attended densely and the two partials merge."""

    def __init__(self, fmt: "PageStatFormat", enc: Encoded) -> None:
        m, ts = enc.meta, enc.tensors
        self.page_size, self.score, self.lam = int(m["page_size"]), m["score"], float(m["lam"])
        self.budget = int(m["budget"])
        self.first_meta = {"forced_pages": list(m["forced_pages"]), "select": int(m["select"])}
        t = int(m["tokens"])
        keys, values = ts["keys"], ts["values"]
        b, h, _, d = keys.shape
        cap = t + max(64 * self.page_size, t // 32)  # room for a few thousand new tokens; grows by a quarter when full
        self.kbuf = keys.new_zeros((b, h, cap, d))
        self.vbuf = values.new_zeros((b, h, cap, d))
        self.kbuf[:, :, :t] = keys
        self.vbuf[:, :, :t] = values
        self.t = t
        self.stats = {n.split(".", 1)[1]: x.contiguous() for n, x in ts.items() if n.startswith("stats.")}
        like = keys.new_zeros((b, h, 0, d))
        super().__init__(fmt, like, int(m["dense_window"]), self.page_size)

    @property
    def encoded_tokens(self) -> int:
        return self.t

    @property
    def pages(self) -> int:
        return -(-self.t // self.page_size)

    def next_chunk(self) -> int:
        return self.page_size - self.t % self.page_size

    def select_count(self) -> int:
        """Pages chosen besides the first once pages have joined: what the token budget leaves after
        the first page and the dense window, in whole pages, at most the other pages there are."""
        return max(0, min(self.pages - 1, (self.budget - self.page_size - self.window) // self.page_size))

    def absorb(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        t, n = self.t, keys.shape[2]
        if t + n > self.kbuf.shape[2]:
            cap = self.kbuf.shape[2] + self.kbuf.shape[2] // 4 + self.page_size
            for name in ("kbuf", "vbuf"):
                old = getattr(self, name)
                new = old.new_zeros((old.shape[0], old.shape[1], cap, old.shape[3]))
                new[:, :, :t] = old[:, :, :t]
                setattr(self, name, new)
        self.kbuf[:, :, t:t + n] = keys
        self.vbuf[:, :, t:t + n] = values
        first = t // self.page_size
        self.t = t + n
        page = page_stats(self.kbuf[:, :, first * self.page_size:self.t], self.page_size, self.score)
        for name, x in page.items():
            self.stats[name] = torch.cat([self.stats[name][:, :, :first], x.to(self.stats[name].dtype)], dim=2)
        self.first_meta = None

    def _enc(self) -> Encoded:
        t = self.t
        tensors = {"keys": self.kbuf[:, :, :t], "values": self.vbuf[:, :, :t]}
        tensors.update({f"stats.{n}": x for n, x in self.stats.items()})
        chosen = self.first_meta or {"forced_pages": [0], "select": self.select_count()}
        meta = {"tokens": t, "page_size": self.page_size, "pages": self.pages, "score": self.score, "lam": self.lam, "dense_window": 0,
                "budget": self.budget, "dtype": str(self.kbuf.dtype).removeprefix("torch."), **chosen}
        return Encoded(tensors, meta)

    def encoded_partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self._enc()
        if on_gpu(q):
            return pagestat_decode(q, enc, scale)
        return PageStatFormat.attend(self.fmt, q, enc, scale)

    def prepare(self, query_tokens: int = 1) -> None:
        if self.t and self.kbuf.is_cuda:
            forced_index(self._enc().meta["forced_pages"], self.kbuf.device)

    def encoded_bytes(self) -> int:
        return tensor_nbytes(self.kbuf, self.vbuf, *self.stats.values())

    def workspace_bytes(self, query_rows: int) -> int:
        """A step: page scores (float32 per page and query row), page lists, split partials (up to
        64 per row) and the tail's partial."""
        rows = max(1, query_rows)
        return 4 * rows * (self.pages + 64 * (self.head_dim + 2) + 2 * (self.head_dim + 2))

    def join_bytes(self) -> int:
        """A page's join: the statistics once more, and when the buffer is full a grown pair
        (1.25x the keys / values held)."""
        return tensor_nbytes(*self.stats.values()) + tensor_nbytes(self.kbuf, self.vbuf) * 5 // 4

    def encoded(self) -> Encoded:
        t = self.tokens
        wk, wv = self.tail.view()
        keys = torch.cat([self.kbuf[:, :, :self.t], wk], dim=2)
        values = torch.cat([self.vbuf[:, :, :self.t], wv], dim=2)
        stats = page_stats(keys, self.page_size, self.score)
        tensors = {"keys": keys, "values": values}
        tensors.update({f"stats.{n}": x.to(keys.dtype) for n, x in stats.items()})
        window = min(self.window, t)
        meta = {"tokens": t, "page_size": self.page_size, "pages": -(-t // self.page_size), "score": self.score, "lam": self.lam,
                "dense_window": window, "budget": self.budget, "forced_pages": forced_pages(t, self.page_size, window),
                "select": pages_to_select(t, self.page_size, window, self.budget), "dtype": str(keys.dtype).removeprefix("torch.")}
        return Encoded(tensors, meta)
