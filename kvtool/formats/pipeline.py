"""The ``pipeline`` format: a composed file (eviction -> pruning -> storage format), see
:mod:`kvtool.pipeline` for the syntax and which steps compose.

Per layer it stores the storage format's own tensors under their own names, plus, when eviction ran,
``pipeline.kept``: int16 (int32 when T > 32767) ``[B, Hkv, K]``, the original positions (ascending)
of the K tokens each KV head kept. The layer metadata holds ``tokens`` (T before eviction),
``storage`` (the format holding the tensors), ``storage_params`` and ``storage_meta`` (that
format's own per-layer metadata). ``decode`` gives ``[B, Hkv, K, D]``; ``attend`` is the storage
format's attention over the kept tokens; ``selected_mask`` maps the kept tokens back to their
positions, so attention-mass recall counts what eviction dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..cache import LayerKV
from ..errors import BadDataError
from .base import CompressedCache, Encoded, Format, FormatParams, get_format, register

KEPT = "pipeline.kept"


@dataclass
class PipelineParams(FormatParams):
    """``evict``: eviction spec (``snapkv:budget=N``...) or None; ``prune``: pruning spec
    (``per-token:k=0.5,v=0.7``) or None; ``format``: the storage format spec (``quant:bits=4``)."""

    evict: str | None = "snapkv:budget=128"
    prune: str | None = "per-token:k=0.5,v=0.7"
    format: str = "quant:bits=4"


def storage_of(enc: Encoded) -> tuple[Format, Encoded]:
    """The storage format of a pipeline layer and its own Encoded (tensors without ``pipeline.*``)."""
    name = enc.meta.get("storage")
    if not isinstance(name, str) or name == "pipeline":
        raise BadDataError(f"pipeline layer names no storage format (got {name!r})")
    try:
        fmt = get_format(name)
    except Exception:
        raise BadDataError(f"storage format {name!r} is not known to this kvtool") from None
    own = {n: t for n, t in enc.tensors.items() if not n.startswith("pipeline.")}
    return fmt, Encoded(own, enc.meta.get("storage_meta", {}))


@register
class PipelineFormat(Format):
    name = "pipeline"
    summary = "composed: --evict then --prune then a storage format (prune + quant stores as bitmapq)"
    Params = PipelineParams
    # A pipeline may store into a selecting format (signvq, pagestat); ``selects`` is per format, not
    # per file, so it is set conservatively: tools never stand a dense decode in for a pipeline file
    # (export/continuation go through ``attend``, which is right for every storage format).
    selects = True

    def check(self, layer: LayerKV, params: FormatParams) -> None:
        from ..pipeline import plan

        plan(params.evict, params.prune, params.format)

    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        """Run the steps on ``layer`` (keys/values ``[B, Hkv, T, D]``, queries for SnapKV and
        query-aware pruning) and store the result with the storage format."""
        from ..evict import evict_with
        from ..pipeline import plan
        from ..prune import prune_layer

        pl = plan(params.evict, params.prune, params.format)
        t = layer.num_tokens
        x = layer
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {"tokens": t}
        if pl.evict is not None:
            x, kept = evict_with(layer, pl.evict)
            tensors[KEPT] = kept.to(torch.int16 if t <= 32767 else torch.int32).contiguous()
        if pl.prune is not None:
            res = prune_layer(x, pl.prune.key_sparsity, pl.prune.value_sparsity, pl.prune.method, pl.prune.dense_window)
            x = LayerKV(res.keys, res.values, x.queries, x.hidden)
            meta["achieved_key_sparsity"] = res.stats["achieved_key_sparsity"]
            meta["achieved_value_sparsity"] = res.stats["achieved_value_sparsity"]
        pl.storage.check(x, pl.storage_params)
        inner = pl.storage.encode(x, pl.storage_params)
        clash = [n for n in inner.tensors if n.startswith("pipeline.")]
        if clash:
            raise BadDataError(f"format {pl.storage.name} stores a tensor named {clash[0]!r}, which pipeline reserves")
        tensors.update(inner.tensors)
        meta.update({"storage": pl.storage.name, "storage_params": pl.storage_params.to_dict(), "storage_meta": inner.meta, "label": pl.label})
        return Encoded(tensors, meta)

    def decode(self, enc: Encoded) -> LayerKV:
        fmt, inner = storage_of(enc)
        return fmt.decode(inner)

    def nbytes(self, enc: Encoded) -> dict[str, int]:
        fmt, inner = storage_of(enc)
        parts = dict(fmt.nbytes(inner))
        if KEPT in enc.tensors:
            t = enc.tensors[KEPT]
            parts["positions"] = parts.get("positions", 0) + t.numel() * t.element_size()
        return parts

    def attend(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        fmt, inner = storage_of(enc)
        return fmt.attend(q, inner, scale)

    def traffic_bytes(self, enc: Encoded, q: torch.Tensor | None = None) -> int:
        """What the storage format reads per decode step (kept positions are not read by attention)."""
        fmt, inner = storage_of(enc)
        return fmt.traffic_bytes(inner, q)

    def selected_mask(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor | None:
        """Bool ``[B, H, Tq, T]`` in original positions: kept by eviction (and selected by the storage
        format, if it selects). None without eviction when the storage format keeps every token."""
        fmt, inner = storage_of(enc)
        sel = fmt.selected_mask(q, inner)
        if KEPT not in enc.tensors:
            return sel
        kept = enc.tensors[KEPT].to(torch.int64)
        b, hkv, k = kept.shape
        h, tq = q.shape[1], q.shape[2]
        pos = kept.repeat_interleave(h // hkv, dim=1)[:, :, None, :].expand(b, h, tq, k)
        src = torch.ones(b, h, tq, k, dtype=torch.bool, device=kept.device) if sel is None else sel.to(torch.bool)
        mask = torch.zeros(b, h, tq, int(enc.meta["tokens"]), dtype=torch.bool, device=kept.device)
        return mask.scatter(3, pos, src)

    def validate(self, enc: Encoded) -> None:
        fmt, inner = storage_of(enc)
        t = enc.meta.get("tokens")
        if not isinstance(t, int) or t < 0:
            raise BadDataError("pipeline layer metadata lacks the token count")
        try:
            fmt.validate(inner)
        except BadDataError as exc:
            raise BadDataError(f"{fmt.name} storage: {exc}") from None
        if KEPT in enc.tensors:
            kept = enc.tensors[KEPT]
            if kept.dtype not in (torch.int16, torch.int32) or kept.ndim != 3:
                raise BadDataError(f"{KEPT} should be int16/int32 [batch, kv_heads, kept]")
            k = kept.to(torch.int64)
            if k.numel() and (int(k.min()) < 0 or int(k.max()) >= t):
                raise BadDataError(f"{KEPT} holds positions outside 0..{t - 1}")
            if k.shape[-1] > 1 and not bool((k[..., 1:] > k[..., :-1]).all()):
                raise BadDataError(f"{KEPT} positions are not strictly ascending")
            shape = inner.meta.get("shape")
            if isinstance(shape, list) and len(shape) == 4 and shape[2] != k.shape[-1]:
                raise BadDataError(f"{KEPT} lists {k.shape[-1]} tokens but the storage holds {shape[2]}")

    def report(self, cc: CompressedCache, source=None) -> dict[str, Any]:
        encs = cc.layers
        first = next(iter(encs.values())) if encs else None
        out: dict[str, Any] = {"pipeline": first.meta.get("label") if first else None, "storage": first.meta.get("storage") if first else None}
        if first is None:
            return out
        fmt, _ = storage_of(first)
        inner = CompressedCache(cc.facts, fmt.name, first.meta.get("storage_params", {}), {i: storage_of(e)[1] for i, e in encs.items()}, cc.tails, cc.token_ids, cc.info)
        for key, value in fmt.report(inner, None).items():
            out.setdefault(key, value)
        if KEPT in first.tensors:
            kept = sum(e.tensors[KEPT].shape[-1] for e in encs.values())
            out["kept_tokens_per_head"] = kept / len(encs)
            out["kept_share"] = kept / sum(e.meta["tokens"] for e in encs.values())
        if "achieved_key_sparsity" in first.meta:
            out["achieved_key_sparsity"] = sum(e.meta["achieved_key_sparsity"] for e in encs.values()) / len(encs)
            out["achieved_value_sparsity"] = sum(e.meta["achieved_value_sparsity"] for e in encs.values()) / len(encs)
        # over the original tokens (a storage format's own figure would count only the kept ones)
        stored = sum(sum(self.nbytes(e).values()) for e in encs.values())
        b, hkv, d = cc.token_ids.shape[0], cc.facts.num_kv_heads, cc.facts.head_dim
        elements = sum(2 * b * hkv * e.meta["tokens"] * d for e in encs.values())
        out["bits_per_element"] = 8.0 * stored / elements if elements else float("nan")
        return out
