"""The ``mixed`` format: each layer, and within a layer each group of KV heads, stored by another
registered format (what a compression plan, :mod:`kvtool.formats.plan`, produces).

Per layer the encoded tensors are the inner formats' own tensors under ``g{j}.`` (group j), and the
layer metadata holds ``shape`` ``[B, Hkv, T, D]`` and ``groups``: a list of ``{"heads": [kv head
indices], "spec": the plan's spec text, "format": inner format name, "params": its parameters,
"meta": its own per-layer metadata}``. The groups' heads partition ``0..Hkv-1``. A group's tensors
hold only its heads (``[B, len(heads), ...]``), and its queries are the query heads that read
those KV heads (query head h reads KV head ``h // (H / Hkv)``).

Every byte counts: ``nbytes`` is the sum of the groups' own ``nbytes`` (parts keep the inner
formats' names). ``attend`` runs each group's attention on its query heads and places the partials
back by head; ``decode`` concatenates the groups' dense heads when every group keeps the same
number of tokens (eviction with different budgets per head cannot be written densely).

Named directly (``--format mixed:heads=quant:bits=2|dense|quant:bits=4``) the same per-head list
applies to every layer; ``kvtool compress --plan plan.json`` gives each layer its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtool.core.cache import LayerKV
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats.base import CompressedCache, Encoded, Format, FormatParams, check_geometry, register
from kvtool.formats.pipeline import encode_kept, resolve
from kvtool.formats._live import LiveLayer
from kvtool.formats.base import get_format


@dataclass
class MixedParams(FormatParams):
    """``heads``: one spec for the whole layer, or ``|``-separated specs, one per KV head, each a
    ``kvtool compress --format`` spec (chains with ``+`` make pipelines)."""

    heads: str = "dense"


def head_groups(specs: list[str]) -> list[tuple[str, list[int]]]:
    """``["quant:bits=2", "dense", "quant:bits=2"]`` (one spec per KV head) ->
    ``[("quant:bits=2", [0, 2]), ("dense", [1])]``: heads with the same spec share a group."""
    groups: dict[str, list[int]] = {}
    for h, spec in enumerate(specs):
        groups.setdefault(spec.strip(), []).append(h)
    return list(groups.items())


def resolve_spec(spec: str) -> tuple[Format, FormatParams]:
    """The format and parameters of one spec (``quant:bits=4``, ``snapkv:budget=256+quant:bits=4``)."""
    fmt, params, _ = resolve(spec)
    if fmt.name == "mixed":
        raise UsageError("a mixed layer cannot hold another mixed format")
    return fmt, params


def _q_heads(kv_heads: list[int], group: int) -> list[int]:
    return [h * group + j for h in kv_heads for j in range(group)]


def slice_heads(layer: LayerKV, kv_heads: list[int]) -> LayerKV:
    """The KV heads ``kv_heads`` of ``layer`` and the query heads that read them."""
    idx = torch.tensor(kv_heads, dtype=torch.int64, device=layer.keys.device)
    q = None
    if layer.queries is not None:
        group = layer.queries.shape[1] // layer.keys.shape[1]
        q = layer.queries.index_select(1, torch.tensor(_q_heads(kv_heads, group), dtype=torch.int64, device=layer.queries.device)).contiguous()
    return LayerKV(layer.keys.index_select(1, idx).contiguous(), layer.values.index_select(1, idx).contiguous(), q, layer.hidden)


def encode_groups(layer: LayerKV, specs: list[str]) -> Encoded:
    """Encode ``layer`` (keys/values ``[B, Hkv, T, D]``) with one spec, or one spec per KV head."""
    hkv = layer.keys.shape[1]
    if len(specs) == 1:
        specs = specs * hkv
    if len(specs) != hkv:
        raise UsageError(f"the plan gives {len(specs)} head specs for a layer of {hkv} KV heads")
    tensors: dict[str, torch.Tensor] = {}
    groups: list[dict[str, Any]] = []
    for j, (spec, heads) in enumerate(head_groups(specs)):
        fmt, params = resolve_spec(spec)
        part = layer if len(heads) == hkv else slice_heads(layer, heads)
        fmt.check(part, params)
        inner = fmt.encode(part, params)
        tensors.update({f"g{j}.{n}": t for n, t in inner.tensors.items()})
        groups.append({"heads": heads, "spec": spec, "format": fmt.name, "params": params.to_dict(), "meta": inner.meta})
    b, _, t, d = layer.keys.shape
    return Encoded(tensors, {"shape": [b, hkv, t, d], "groups": groups})


def encode_kept_heads(layer: LayerKV, kept: list[torch.Tensor], storage_spec: str = "dense", label: str = "kept tokens") -> Encoded:
    """A mixed layer holding, per KV head h, the tokens at ``kept[h]`` (int ``[B, K_h]``, ascending
    original positions; heads may keep different counts, as head-wise selectors such as AdaKV
    choose) stored with ``storage_spec``. Heads keeping the same count share one group, a pipeline
    layer (:func:`kvtool.formats.pipeline.encode_kept`) whose spec text is ``label + storage``."""
    hkv = layer.keys.shape[1]
    if len(kept) != hkv:
        raise UsageError(f"give kept positions for each of the {hkv} KV heads, not {len(kept)}")
    by_count: dict[int, list[int]] = {}
    for h, k in enumerate(kept):
        by_count.setdefault(int(k.shape[-1]), []).append(h)
    spec = label if storage_spec in ("", "dense") else f"{label}+{storage_spec}"
    tensors: dict[str, torch.Tensor] = {}
    groups: list[dict[str, Any]] = []
    for j, (count, heads) in enumerate(sorted(by_count.items(), key=lambda kv: kv[1][0])):
        part = layer if len(heads) == hkv else slice_heads(layer, heads)
        positions = torch.stack([kept[h].to(torch.int64) for h in heads], dim=1)  # [B, heads, K]
        inner = encode_kept(part, positions, storage_spec, label)
        tensors.update({f"g{j}.{n}": t for n, t in inner.tensors.items()})
        groups.append({"heads": heads, "spec": spec, "format": "pipeline",
                       "params": {"evict": label, "prune": None, "format": storage_spec or "dense"}, "meta": inner.meta})
    b, _, t, d = layer.keys.shape
    return Encoded(tensors, {"shape": [b, hkv, t, d], "groups": groups})


def groups_of(enc: Encoded) -> list[tuple[list[int], Format, Encoded]]:
    """Each group's KV heads, inner format and inner Encoded (tensors without the ``g{j}.`` prefix)."""
    groups = enc.meta.get("groups")
    if not isinstance(groups, list) or not groups:
        raise BadDataError("mixed layer metadata lists no head groups")
    out = []
    for j, g in enumerate(groups):
        name = g.get("format") if isinstance(g, dict) else None
        if not isinstance(name, str) or name == "mixed":
            raise BadDataError(f"mixed group {j} names no inner format (got {name!r})")
        try:
            fmt = get_format(name)
        except UsageError:
            raise BadDataError(f"mixed group {j}: format {name!r} is not known to this kvtool") from None
        prefix = f"g{j}."
        own = {n[len(prefix):]: t for n, t in enc.tensors.items() if n.startswith(prefix)}
        out.append((list(g.get("heads", [])), fmt, Encoded(own, g.get("meta", {}))))
    return out


@register
class MixedFormat(Format):
    name = "mixed"
    summary = "a plan: each layer (or group of KV heads) in its own format (kvtool recommend writes plans)"
    Params = MixedParams
    swept_by_default = False  # plans come from `kvtool recommend`; a fixed head list fits one model shape only
    # Groups may select tokens (pagestat, signvq, eviction), so tools never stand a dense decode in for
    # a mixed file without checking; continuation and export go through ``attend``.
    selects = True
    needs_queries = False
    live_grows = True  # each group as its own format grows

    def live_layer(self, enc: Encoded, like: torch.Tensor) -> "MixedLive":
        """Each head group's own live layer (:class:`MixedLive`)."""
        b, hkv, _, d = enc.meta["shape"]
        groups = []
        for heads, fmt, inner in groups_of(enc):
            sub = like.new_empty((b, len(heads), 0, d))
            groups.append((heads, fmt.live_layer(inner, sub)))
        return MixedLive(self, groups, hkv, enc.meta)

    def live_from_dense(self, layer: LayerKV, params: FormatParams) -> "MixedLive":
        """Each head group encoded by its spec and made live."""
        specs = params.heads.split("|")
        hkv = layer.keys.shape[1]
        if len(specs) == 1:
            specs = specs * hkv
        if len(specs) != hkv:
            raise UsageError(f"the plan gives {len(specs)} head specs for a layer of {hkv} KV heads")
        groups = []
        for spec, heads in head_groups(specs):
            fmt, p = resolve_spec(spec)
            part = layer if len(heads) == hkv else slice_heads(layer, heads)
            groups.append((heads, fmt.live_from_dense(LayerKV(part.keys.to(layer.keys.device), part.values.to(layer.keys.device), None if part.queries is None else part.queries.to(layer.keys.device)), p)))
        b, _, t, d = layer.keys.shape
        return MixedLive(self, groups, hkv, {"shape": [b, hkv, t, d], "groups": [{"heads": h, "spec": s} for s, h in head_groups(specs)]})

    def check(self, layer: LayerKV, params: FormatParams) -> None:
        for spec in params.heads.split("|"):
            resolve_spec(spec)

    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        return encode_groups(layer, params.heads.split("|"))

    def decode(self, enc: Encoded) -> LayerKV:
        b, hkv, _, d = enc.meta["shape"]
        parts = [(heads, fmt.decode(inner)) for heads, fmt, inner in groups_of(enc)]
        lengths = {p.keys.shape[2] for _, p in parts}
        if len(lengths) != 1:
            raise UsageError(f"the head groups of this mixed layer keep different token counts ({sorted(lengths)}); it has no dense form (use attention, e.g. `kvtool export --to hf`)")
        t = lengths.pop()
        first = parts[0][1]
        keys = first.keys.new_zeros((b, hkv, t, d))
        values = first.values.new_zeros((b, hkv, t, first.values.shape[-1]))
        for heads, p in parts:
            idx = torch.tensor(heads, dtype=torch.int64, device=keys.device)
            keys.index_copy_(1, idx, p.keys.to(keys.dtype))
            values.index_copy_(1, idx, p.values.to(values.dtype))
        return LayerKV(keys, values)

    def nbytes(self, enc: Encoded) -> dict[str, int]:
        parts: dict[str, int] = {}
        for _, fmt, inner in groups_of(enc):
            for part, n in fmt.nbytes(inner).items():
                parts[part] = parts.get(part, 0) + n
        return parts

    def traffic_bytes(self, enc: Encoded, q: torch.Tensor | None = None) -> int:
        total = 0
        for heads, fmt, inner in groups_of(enc):
            total += fmt.traffic_bytes(inner, None if q is None else self._q(q, enc, heads))
        return total

    @staticmethod
    def _q(q: torch.Tensor, enc: Encoded, heads: list[int]) -> torch.Tensor:
        hkv = enc.meta["shape"][1]
        if len(heads) == hkv:
            return q
        idx = torch.tensor(_q_heads(heads, q.shape[1] // hkv), dtype=torch.int64, device=q.device)
        return q.index_select(1, idx)

    def attend(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial ``(out [B, H, Tq, Dv] float32, lse [B, H, Tq])`` of q ``[B, H, Tq, D]``: each
        group's own attention on the query heads of its KV heads."""
        hkv = enc.meta["shape"][1]
        b, h, tq, _ = q.shape
        out = lse = None
        for heads, fmt, inner in groups_of(enc):
            o, l = fmt.attend(self._q(q, enc, heads), inner, scale)
            if len(heads) == hkv:
                return o.float(), l.float()
            if out is None:
                out = q.new_zeros((b, h, tq, o.shape[-1]), dtype=torch.float32)
                lse = q.new_zeros((b, h, tq), dtype=torch.float32)
            idx = torch.tensor(_q_heads(heads, h // hkv), dtype=torch.int64, device=q.device)
            out.index_copy_(1, idx, o.float())
            lse.index_copy_(1, idx, l.float())
        return out, lse

    def selected_mask(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor | None:
        hkv, t = enc.meta["shape"][1], enc.meta["shape"][2]
        sels = [(heads, fmt.selected_mask(self._q(q, enc, heads), inner)) for heads, fmt, inner in groups_of(enc)]
        if all(s is None for _, s in sels):
            return None
        b, h, tq, _ = q.shape
        mask = torch.ones(b, h, tq, t, dtype=torch.bool, device=q.device)
        for heads, s in sels:
            if s is not None:
                idx = torch.tensor(_q_heads(heads, h // hkv), dtype=torch.int64, device=q.device)
                mask.index_copy_(1, idx, s.to(torch.bool))
        return mask

    def validate(self, enc: Encoded) -> None:
        shape = enc.meta.get("shape")
        if not isinstance(shape, list) or len(shape) != 4:
            raise BadDataError("mixed layer metadata lacks its shape [batch, kv_heads, tokens, head_dim]")
        groups = groups_of(enc)
        heads = sorted(h for g, _, _ in groups for h in g)
        if heads != list(range(shape[1])):
            raise BadDataError(f"mixed head groups cover KV heads {heads}, not each of 0..{shape[1] - 1} once")
        named = {n.split(".", 1)[0] for n in enc.tensors}
        extra = named - {f"g{j}" for j in range(len(groups))}
        if extra:
            raise BadDataError(f"mixed layer holds tensors of group {sorted(extra)[0]!r}, which its metadata does not list")
        for j, (group_heads, fmt, inner) in enumerate(groups):
            try:
                fmt.validate(inner)
                check_geometry(inner.meta, shape[0], len(group_heads), shape[2], shape[3])
            except BadDataError as exc:
                raise BadDataError(f"group {j} ({fmt.name}): {exc}") from None

    def report(self, cc: CompressedCache, source=None) -> dict[str, Any]:
        """How many KV heads each spec holds over the file, and each layer's spec(s)."""
        heads_by_spec: dict[str, int] = {}
        per_layer: dict[str, str] = {}
        for i, enc in sorted(cc.layers.items()):
            specs = []
            for g in enc.meta.get("groups", []):
                heads_by_spec[g["spec"]] = heads_by_spec.get(g["spec"], 0) + len(g["heads"])
                specs.append(g["spec"] if len(enc.meta.get("groups", [])) == 1 else f"{g['spec']} (heads {','.join(map(str, g['heads']))})")
            per_layer[str(i)] = "; ".join(specs)
        return {"kv_heads_by_spec": heads_by_spec, "layer_specs": per_layer, "distinct_specs": len(heads_by_spec)}


class MixedLive(LiveLayer):
    """A live ``mixed`` layer: one live layer per head group, each fed its KV heads' new tokens and
    its query heads' queries; the outputs are placed back by head. Groups whose heads are one
    contiguous range are sliced without copies."""

    def __init__(self, fmt: Format, groups: list[tuple[list[int], LiveLayer]], kv_heads: int, meta: dict[str, Any]) -> None:
        self.fmt, self.groups, self.kv_heads, self.meta = fmt, groups, kv_heads, meta
        self._index: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor] | None] = {}

    def _heads(self, j: int, group: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(KV head index, query head index) tensors of group ``j`` for ``group`` query heads per KV
        head, or None when its heads are one range (cached per group size: an append asks with 1)."""
        key = (j, group, str(device))
        if key not in self._index:
            heads = self.groups[j][0]
            if heads == list(range(heads[0], heads[0] + len(heads))):
                self._index[key] = None
            else:
                self._index[key] = (torch.tensor(heads, dtype=torch.int64, device=device), torch.tensor(_q_heads(heads, group), dtype=torch.int64, device=device))
        return self._index[key]

    def _split(self, x: torch.Tensor, j: int, group: int, query: bool) -> torch.Tensor:
        heads = self.groups[j][0]
        idx = self._heads(j, group, x.device)
        if len(heads) == self.kv_heads:
            return x
        if idx is None:
            width = group if query else 1
            return x.narrow(1, heads[0] * width, len(heads) * width)
        return x.index_select(1, idx[1] if query else idx[0])

    @property
    def tokens(self) -> int:
        return max(layer.tokens for _, layer in self.groups)

    def reference_tensor(self) -> torch.Tensor:
        return self.groups[0][1].reference_tensor()

    def encoded_shape(self) -> tuple[int, int, int, int]:
        b, _, _, d = self.meta["shape"]
        return b, self.kv_heads, self.tokens, d

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        for j, (_, layer) in enumerate(self.groups):
            layer.append(self._split(keys, j, 1, False), self._split(values, j, 1, False))

    def _place(self, parts: list[torch.Tensor], q: torch.Tensor, group: int) -> torch.Tensor:
        if len(parts) == 1:
            return parts[0]
        out = torch.empty((*q.shape[:3], parts[0].shape[-1]) if parts[0].ndim == 4 else q.shape[:3], dtype=parts[0].dtype, device=q.device)
        for j, part in enumerate(parts):
            heads = self.groups[j][0]
            idx = self._heads(j, group, q.device)
            if idx is None:
                out.narrow(1, heads[0] * group, len(heads) * group).copy_(part.to(out.dtype))
            else:
                out.index_copy_(1, idx[1], part.to(out.dtype))
        return out

    def step(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None) -> torch.Tensor:
        group = q.shape[1] // self.kv_heads
        outs = [layer.step(self._split(q, j, group, True), self._split(keys, j, 1, False), self._split(values, j, 1, False), scale).float()
                for j, (_, layer) in enumerate(self.groups)]
        return self._place(outs, q, group)

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        group = q.shape[1] // self.kv_heads
        parts = [layer.partial(self._split(q, j, group, True), scale) for j, (_, layer) in enumerate(self.groups)]
        return self._place([p[0].float() for p in parts], q, group), self._place([p[1].float() for p in parts], q, group)

    def prepare(self, query_tokens: int = 1) -> None:
        for _, layer in self.groups:
            layer.prepare(query_tokens)

    def room(self) -> int:
        return min(layer.room() for _, layer in self.groups)

    def reserve(self, steps: int) -> None:
        for _, layer in self.groups:
            layer.reserve(steps)

    def stored_bytes(self) -> int:
        return sum(layer.stored_bytes() for _, layer in self.groups)

    def workspace_bytes(self, query_rows: int) -> int:
        return max(layer.workspace_bytes(query_rows * len(heads) // self.kv_heads) for heads, layer in self.groups) + 4 * query_rows * (self.encoded_shape()[3] + 1)

    def join_bytes(self) -> int:
        return max(layer.join_bytes() for _, layer in self.groups)

    def encoded(self) -> Encoded:
        tensors: dict[str, torch.Tensor] = {}
        groups = []
        for j, (heads, layer) in enumerate(self.groups):
            inner = layer.encoded()
            tensors.update({f"g{j}.{n}": t for n, t in inner.tensors.items()})
            spec = self.meta.get("groups", [{}] * len(self.groups))[j].get("spec", layer.fmt.name)
            groups.append({"heads": heads, "spec": spec, "format": layer.fmt.name, "params": {}, "meta": inner.meta})
        b, _, _, d = self.meta["shape"]
        return Encoded(tensors, {"shape": [b, self.kv_heads, self.tokens, d], "groups": groups})
