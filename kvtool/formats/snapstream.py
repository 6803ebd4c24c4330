"""SnapStream: SnapKV selection at prefill, a StreamingLLM ring buffer for decoding, static shape.

Every layer is stored as ``budget`` slots per KV head (S = sinks, R = recent, K = budget - S - R)::

    slots [0, S)        sinks: position i in slot i
    slots [S, S + R)    ring buffer: position p (p >= S) in slot S + (p - S) mod R
    slots [S + R, budget)  top-K: the chosen candidates, ascending positions, then padding

An empty slot has position -1 and zero keys/values; attention masks it out. The slot of a new
token at position p is SnapStream's ring-buffer index (Listing 5; Eq. 4's modulus term):
``p`` while p < S, else ``S + (p - S) mod R``, so appending overwrites the oldest recent token and
never touches sinks or top-K. :func:`append_token` does it; :func:`naive_append` is the
slice-and-concatenate reference it is tested against.

Tensors per layer (``layers.{i}.`` in a compressed file):
``keys``/``values`` ``[B, Hkv, budget, D]`` capture dtype; ``positions`` int32 ``[B, Hkv, budget]``;
``topk_pad`` int32 ``[B]`` (padding slots in the top-K part). Meta: sinks, recent, topk, budget,
prefix_tokens (the T tokens encoded), length (tokens seen so far = next position), policy. A
``--budget`` above S + R + the T - S - R candidates is clamped to that (the extra top-K slots would
stay empty forever): meta ``budget`` is the clamped value, ``budget_clamped_from`` the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvtool.core.attention import attend_partial, expand_kv
from kvtool.core.cache import KVCache, LayerKV
from kvtool.core.errors import BadDataError, UsageError
from kvtool.methods.evict import POLICIES, attention_mass_recall, budget_for, candidate_positions, check_evict
from kvtool.formats.base import CompressedCache, Encoded, Format, FormatParams, register
from kvtool.formats._live import LiveLayer, dense_attention_out, nbytes as tensor_nbytes, on_gpu


@dataclass
class SnapStreamParams(FormatParams):
    """budget = sinks + top-K + recent slots per KV head; share: the budget as a share of the tokens
    encoded instead (``share=0.25``: a quarter of any prefix, at least sinks + recent), so one spec
    fits captures of any length; window/pool: SnapKV's observation window and pooling kernel;
    policy: snapkv (SnapStream) or streaming (StreamingLLM baseline at equal budget)."""

    budget: int = 128
    sinks: int = 4
    recent: int = 32
    window: int = 32
    pool: int = 7
    policy: Literal["snapkv", "streaming"] = "snapkv"
    share: float | None = None


def ring_slot(position: int, sinks: int, recent: int) -> int:
    """Slot of the token at ``position``: SnapStream's ring-buffer index."""
    if position < sinks:
        return position
    return sinks + (position - sinks) % recent


def layout_positions(tokens: int, chosen: torch.Tensor, sinks: int, recent: int, topk: int) -> torch.Tensor:
    """Positions int64 ``[B, Hkv, sinks + recent + topk]`` (-1 = empty) for a prefix of ``tokens``
    tokens; ``chosen`` int64 ``[B, Hkv, k]`` (k <= topk) are the top-K candidate positions."""
    b, hkv, k = chosen.shape
    pos = torch.full((b, hkv, sinks + recent + topk), -1, dtype=torch.int64, device=chosen.device)
    for p in range(min(sinks, tokens)):
        pos[:, :, p] = p
    for p in range(max(sinks, tokens - recent), tokens):
        pos[:, :, ring_slot(p, sinks, recent)] = p
    pos[:, :, sinks + recent:sinks + recent + k] = chosen
    return pos


def _gather_slots(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x ``[B, Hkv, T, D]`` at ``pos`` ``[B, Hkv, S]`` (-1 -> zeros): ``[B, Hkv, S, D]``."""
    idx = pos.clamp(min=0)[..., None].expand(*pos.shape, x.shape[-1])
    return torch.gather(x, 2, idx) * (pos >= 0)[..., None].to(x.dtype)


def append_token(enc: Encoded, key: torch.Tensor, value: torch.Tensor, inplace: bool = False) -> Encoded:
    """Write the next token's key/value (``[B, Hkv, D]`` or ``[B, Hkv, 1, D]``) at its ring-buffer slot.

    Returns the updated Encoded (a copy unless ``inplace``); its ``length`` grows by one. The new
    token's position is the old ``length``."""
    meta = dict(enc.meta)
    sinks, recent, length = int(meta["sinks"]), int(meta["recent"]), int(meta["length"])
    keys, values, pos = enc.tensors["keys"], enc.tensors["values"], enc.tensors["positions"]
    if key.ndim == 4:
        key, value = key[:, :, 0], value[:, :, 0]
    want = (keys.shape[0], keys.shape[1], keys.shape[3])
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != want:
            raise UsageError(f"append_token: {name} should be [batch, kv_heads, head_dim] = {list(want)}, got {list(t.shape)}")
    if not inplace:
        keys, values, pos = keys.clone(), values.clone(), pos.clone()
    slot = ring_slot(length, sinks, recent)
    keys[:, :, slot] = key.to(keys.dtype)
    values[:, :, slot] = value.to(values.dtype)
    pos[:, :, slot] = length
    meta["length"] = length + 1
    tensors = dict(enc.tensors, keys=keys, values=values, positions=pos)
    if inplace:
        enc.tensors.update(tensors)
        enc.meta = meta
        return enc
    return Encoded(tensors, meta)


def naive_append(sinks_kv: list[torch.Tensor], recent_kv: list[torch.Tensor], topk_kv: list[torch.Tensor], new: torch.Tensor, sinks: int, recent: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Reference decode update by slicing and concatenation (SnapStream Listing 2): each list holds
    tensors ``[B, Hkv, n, F]`` (F = packed features, e.g. key|value|position). The new token joins
    the sinks while they are not full, else the recent window, dropping its oldest token when full."""
    s = torch.cat(sinks_kv, 2) if sinks_kv else new[:, :, :0]
    r = torch.cat(recent_kv, 2) if recent_kv else new[:, :, :0]
    if s.shape[2] < sinks:
        return [torch.cat([s, new], 2)], [r], topk_kv
    r = torch.cat([r, new], 2)
    if r.shape[2] > recent:
        r = r[:, :, 1:]
    return [s], [r], topk_kv


@register
class SnapStreamFormat(Format):
    name = "snapstream"
    summary = "SnapKV top-K + sinks + ring buffer of recent tokens, fixed budget (token eviction)"
    Params = SnapStreamParams
    paper_rows = (
        ('eviction at budget 128 (SnapStream)', 'SnapKV + sinks + recent', 'snapstream:budget=128,policy=snapkv'),
        ('eviction at budget 128 (SnapStream)', 'sinks + recent only (StreamingLLM)', 'snapstream:budget=128,policy=streaming'),
    )
    selects = True
    evicts = True
    appends_tokens = True
    live_grows = True
    default_sweep = ("snapstream:budget=64,128,256",)

    def live_layer(self, enc: Encoded, like: torch.Tensor) -> "RingLive":
        """The layer as a live cache layer: its slots on ``like``'s device, a ring (:class:`RingLive`)."""
        return RingLive(self, Encoded({n: t.to(like.device).clone() for n, t in enc.tensors.items()}, dict(enc.meta)))

    def append_token(self, enc: Encoded, key: torch.Tensor, value: torch.Tensor, inplace: bool = False) -> Encoded:
        """The ring-buffer update of :func:`append_token`."""
        return append_token(enc, key, value, inplace=inplace)

    def check(self, layer: LayerKV, params: FormatParams) -> None:
        assert isinstance(params, SnapStreamParams)
        check_evict(layer.num_tokens, budget_for(params.budget, params.share, layer.num_tokens, params.sinks, params.recent), params.sinks, params.recent, params.window, params.pool, params.policy, layer.queries)
        if params.recent < 1:
            raise UsageError("--recent must be at least 1: the ring buffer needs a slot for new tokens")

    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        """keys/values ``[B, Hkv, T, D]`` (+ queries ``[B, H, T, D]`` for snapkv) -> budget slots."""
        assert isinstance(params, SnapStreamParams)
        self.check(layer, params)
        t = layer.num_tokens
        s, r = params.sinks, params.recent
        asked = budget_for(params.budget, params.share, t, s, r)
        # a budget above the tokens would only add empty top-K slots (the ring buffer takes new
        # tokens): clamp it to sinks + recent + the candidates there are, and record the request
        topk = min(asked - s - r, max(t - s - r, 0))
        budget = s + r + topk
        chosen = candidate_positions(layer, budget, s, r, params.window, params.pool, params.policy)
        pos = layout_positions(t, chosen, s, r, topk)
        pad = topk - chosen.shape[-1]
        b = layer.keys.shape[0]
        tensors = {
            "keys": _gather_slots(layer.keys, pos).contiguous(),
            "values": _gather_slots(layer.values, pos).contiguous(),
            "positions": pos.to(torch.int32).contiguous(),
            "topk_pad": torch.full((b,), pad, dtype=torch.int32, device=layer.keys.device),
        }
        meta = {"sinks": s, "recent": r, "topk": topk, "budget": budget, "prefix_tokens": t, "length": t, "policy": params.policy}
        if params.share is not None:
            meta["share"] = params.share
        if budget != asked:
            meta["budget_clamped_from"] = asked
        return Encoded(tensors, meta)

    def decode(self, enc: Encoded) -> LayerKV:
        """The kept tokens, ``[B, Hkv, n, D]`` in ascending original position (n = filled slots,
        fewer than the prefix when tokens were evicted)."""
        pos = enc.tensors["positions"].to(torch.int64)
        n = int((pos[0, 0] >= 0).sum())
        order = torch.sort(torch.where(pos >= 0, pos, torch.iinfo(torch.int64).max), dim=-1).indices[..., :n]
        idx = order[..., None].expand(*order.shape, enc.tensors["keys"].shape[-1])
        return LayerKV(keys=torch.gather(enc.tensors["keys"], 2, idx), values=torch.gather(enc.tensors["values"], 2, idx))

    def kept_positions(self, enc: Encoded) -> torch.Tensor:
        """Original positions of the filled slots, int64 ``[B, Hkv, n]`` ascending."""
        pos = enc.tensors["positions"].to(torch.int64)
        n = int((pos[0, 0] >= 0).sum())
        return torch.sort(torch.where(pos >= 0, pos, torch.iinfo(torch.int64).max), dim=-1).values[..., :n]

    def attend(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of q ``[B, H, Tq, D]`` over all budget slots, empty slots masked."""
        valid = enc.tensors["positions"] >= 0  # [B, Hkv, S]
        mask = expand_kv(valid[..., None], q.shape[1] // valid.shape[1])[..., 0][:, :, None, :]
        return attend_partial(q, enc.tensors["keys"], enc.tensors["values"], scale, mask)

    def selected_mask(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """bool ``[B, H, Tq, T]`` (T = prefix tokens): True at the kept prefix positions."""
        t = int(enc.meta["prefix_tokens"])
        pos = enc.tensors["positions"].to(torch.int64)
        idx = torch.where((pos >= 0) & (pos < t), pos, torch.full_like(pos, t))
        keep = torch.zeros(*pos.shape[:2], t + 1, dtype=torch.bool, device=pos.device).scatter_(2, idx, True)[..., :t]
        full = expand_kv(keep[..., None], q.shape[1] // pos.shape[1])[..., 0]
        return full[:, :, None, :].expand(q.shape[0], q.shape[1], q.shape[2], t)

    def validate(self, enc: Encoded) -> None:
        for name in ("keys", "values", "positions", "topk_pad"):
            if name not in enc.tensors:
                raise BadDataError(f"tensor {name!r} is missing")
        m = enc.meta
        for key in ("sinks", "recent", "topk", "budget", "prefix_tokens", "length"):
            if not isinstance(m.get(key), int) or m[key] < 0:
                raise BadDataError(f"meta {key!r} is missing or not a non-negative integer")
        if m.get("policy") not in POLICIES:
            raise BadDataError(f"meta 'policy' must be one of {', '.join(POLICIES)}")
        s, r, k, budget = m["sinks"], m["recent"], m["topk"], m["budget"]
        if s + r + k != budget or r < 1:
            raise BadDataError(f"sinks {s} + recent {r} + topk {k} must equal budget {budget}, recent >= 1")
        keys, values, pos, pad = (enc.tensors[n] for n in ("keys", "values", "positions", "topk_pad"))
        if keys.ndim != 4 or keys.shape != values.shape or keys.shape[2] != budget or not keys.is_floating_point():
            raise BadDataError(f"keys/values should be floating [batch, kv_heads, {budget}, head_dim], got {list(keys.shape)} and {list(values.shape)}")
        if pos.dtype != torch.int32 or tuple(pos.shape) != tuple(keys.shape[:3]):
            raise BadDataError(f"positions should be int32 {list(keys.shape[:3])}, got {pos.dtype} {list(pos.shape)}")
        if pad.dtype != torch.int32 or tuple(pad.shape) != (keys.shape[0],):
            raise BadDataError(f"topk_pad should be int32 [{keys.shape[0]}], got {pad.dtype} {list(pad.shape)}")
        p = pos.to(torch.int64)
        if bool((p < -1).any()) or bool((p >= m["length"]).any()):
            raise BadDataError(f"positions out of range -1..{m['length'] - 1}")
        slots = torch.arange(budget, device=p.device)
        sink_ok = (p[..., :s] == slots[:s]) | (p[..., :s] == -1)
        ring = p[..., s:s + r]
        ring_ok = (ring == -1) | ((ring >= s) & ((ring - s) % r == slots[:r]))
        if not bool(sink_ok.all()) or not bool(ring_ok.all()):
            raise BadDataError("sink or ring-buffer slots hold positions that do not belong there")
        top = p[..., s + r:]
        if bool((((top >= 0) & (top < s)) | (top >= m["prefix_tokens"])).any()):
            raise BadDataError("top-K slots hold positions outside the eviction candidates")
        if not bool(((top == -1).sum(-1) == pad.to(torch.int64)[:, None]).all()):
            raise BadDataError("topk_pad disagrees with the empty top-K slots")
        filled = (p >= 0).sum(-1)
        if not bool((filled == filled.flatten()[0]).all()):
            raise BadDataError("KV heads hold different numbers of tokens")
        srt = torch.sort(torch.where(p >= 0, p, -1 - slots), dim=-1).values
        if bool((srt[..., 1:] == srt[..., :-1]).any()):
            raise BadDataError("a position is stored twice in one KV head")

    def report(self, cc: CompressedCache, source: KVCache | None = None) -> dict[str, Any]:
        """Budget, kept tokens per part, kept share of the prefix, and attention-mass recall of the
        held-out queries (with the StreamingLLM baseline at the same budget for comparison)."""
        any_enc = next(iter(cc.layers.values()))
        m = any_enc.meta
        pos = any_enc.tensors["positions"][0, 0].to(torch.int64)
        s, r = m["sinks"], m["recent"]
        kept = int((pos >= 0).sum())
        out: dict[str, Any] = {
            "budget": m["budget"],
            "budget_clamped_from": m.get("budget_clamped_from"),
            "policy": m["policy"],
            "kept_sinks": int((pos[:s] >= 0).sum()),
            "kept_recent": int((pos[s:s + r] >= 0).sum()),
            "kept_topk": int((pos[s + r:] >= 0).sum()),
            "topk_pad": int(any_enc.tensors["topk_pad"][0]),
            "kept_tokens": kept,
            "kept_fraction": kept / cc.prefix_tokens,
        }
        heldout = int(cc.info.get("heldout", 0))
        if source is None or heldout == 0 or not source.has_queries:
            return out
        prefix = cc.prefix_tokens
        per_layer: dict[str, dict[str, float]] = {}
        for i, enc in cc.layers.items():
            full = source.layers[i]
            q = full.queries[:, :, prefix:prefix + heldout]
            keys = full.keys[:, :, :prefix]
            own = float(attention_mass_recall(q, keys, self.kept_positions(enc)).mean())
            row = {"recall": own}
            p = cc.params
            other = "streaming" if m["policy"] == "snapkv" else "snapkv"
            head = full.slice_tokens(0, prefix)
            if other == "snapkv" and head.queries is None:
                per_layer[str(i)] = row
                continue
            # the budget the file holds (clamped to the tokens there are), not the one asked for
            chosen = candidate_positions(head, m["budget"], m["sinks"], m["recent"], p["window"], p["pool"], other)
            alt = layout_positions(prefix, chosen, m["sinks"], m["recent"], m["topk"])
            row[f"recall_{other}"] = float(attention_mass_recall(q, keys, alt).mean())
            per_layer[str(i)] = row
        out["recall"] = sum(v["recall"] for v in per_layer.values()) / len(per_layer)
        names = {k for v in per_layer.values() for k in v if k != "recall"}
        for name in sorted(names):
            vals = [v[name] for v in per_layer.values() if name in v]
            out[f"{name}_same_budget"] = sum(vals) / len(vals)
        out["recall_by_layer"] = per_layer
        return out


# ----------------------------------------------------------------------------- live cache


class RingLive(LiveLayer):
    """A live ``snapstream`` layer: the ``budget`` slots per KV head and nothing else. Each new token
    is written into its ring-buffer slot (:func:`append_token`, overwriting the oldest recent token)
    before its own query attends to the slots (``writes_first``), so the layer never grows. Empty
    slots are masked; while every slot is filled a step runs torch SDPA over the slots on CUDA."""

    writes_first = True

    def __init__(self, fmt: "SnapStreamFormat", enc: Encoded) -> None:
        self.fmt, self.enc = fmt, enc
        self.full = bool((enc.tensors["positions"] >= 0).all())

    @property
    def tokens(self) -> int:
        return int(self.enc.tensors["keys"].shape[2])

    def reference_tensor(self) -> torch.Tensor:
        return self.enc.tensors["keys"]

    @property
    def length(self) -> int:
        """Positions seen (the next token's position)."""
        return int(self.enc.meta["length"])

    def encoded_shape(self) -> tuple[int, int, int, int]:
        b, h, s, d = self.enc.tensors["keys"].shape
        return b, h, s, d

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        for j in range(keys.shape[2]):
            append_token(self.enc, keys[:, :, j], values[:, :, j], inplace=True)
        if not self.full and int(self.enc.meta["length"]) >= int(self.enc.meta["sinks"]) + int(self.enc.meta["recent"]):
            self.full = bool((self.enc.tensors["positions"] >= 0).all())

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fmt.attend(q, self.enc, scale)

    def attend_one(self, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        if self.full and on_gpu(q):
            return dense_attention_out(q, self.enc.tensors["keys"], self.enc.tensors["values"], scale)
        return self.partial(q, scale)[0]

    def stored_bytes(self) -> int:
        return tensor_nbytes(*self.enc.tensors.values())

    def encoded(self) -> Encoded:
        return self.enc
