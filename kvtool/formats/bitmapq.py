"""Joint Mustafar + KIVI: a pruning bitmap whose kept elements are stored as low-bit codes.

The layer is pruned with :func:`kvtool.methods.prune.prune_layer` (``method``, ``key_sparsity``,
``value_sparsity``, ``dense_window``), then, with ``R = min(residual, T)`` and ``P = T - R``:

- ``bitmap.keys`` / ``bitmap.values``: ``uint8 [B, Hkv, P, ceil(D/8)]``, the keep mask of the first P
  tokens, packed along channels (channel j in bit ``j % 8`` of byte ``j // 8``; unused high bits 0).
- ``codes.keys``: the kept key elements in ``(b, h, block of 64 tokens, channel, token)`` order (the
  bitmap format's key tiles: one channel of 64 tokens, quantised per channel as KIVI quantises keys),
  ``codes.values`` the kept value elements in ``(b, h, token, channel)`` order (per token); the same
  element order as the bitmap format's packed non-zeros. Each is a flat ``uint8`` stream of
  ``bits``-bit codes packed as :mod:`kvtool.methods.quantize` packs (``ceil(kept * bits / 8)`` bytes).
- ``scales.*`` / ``zeros.*``: one scale and zero point per group of ``group`` consecutive kept
  elements of a row (a key row is one key tile, a value row one token of one head over the D
  channels; the last group of a row shorter), flat in row order. The number of groups of a row,
  ``ceil(kept_in_row / group)``, follows from the bitmap, so no offsets are stored.
- ``residual.keys`` / ``residual.values``: ``[B, Hkv, R, D]`` the most recent tokens as the pruning
  left them (unpruned when ``dense_window >= residual``), capture dtype, not quantised.

Decoding puts ``q * scale + zero`` at the kept positions and 0 elsewhere: the pruned, then
quantised cache, exactly what ``prune`` followed by group quantisation of the kept elements gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvtool.core.cache import DTYPES, LayerKV, dtype_name
from kvtool.core.errors import BadDataError, UsageError
from kvtool.methods.quantize import (
    check_bits,
    dequantize_groups,
    masked_row_groups,
    pack_codes,
    packed_length,
    quantize_groups,
    scale_dtype_for,
    unpack_codes,
)
from kvtool.formats.base import Encoded, Format, FormatParams, register
from kvtool.methods.prune import check_sparsity, method_needs_queries
from kvtool.methods.prune import prune_layer


@dataclass
class BitmapQParams(FormatParams):
    """Pruning (``sparsity`` for both, ``key_sparsity``/``value_sparsity`` override, default 0.5;
    ``method`` as ``kvtool prune``; ``dense_window`` recent tokens not pruned, default = residual)
    and quantisation of the kept elements (``bits`` 2|4|8, ``group`` kept elements per scale and
    zero point, ``residual`` recent tokens in full precision)."""

    bits: int = 4
    group: int = 32
    residual: int = 32
    sparsity: float | None = None
    key_sparsity: float | None = None
    value_sparsity: float | None = None
    method: str = "per-token"
    dense_window: int | None = None

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if self.group < 1:
            raise UsageError(f"--group must be at least 1, got {self.group}")
        if self.residual < 0:
            raise UsageError(f"--residual must be at least 0, got {self.residual}")
        base = 0.5 if self.sparsity is None else self.sparsity
        self.key_sparsity = base if self.key_sparsity is None else self.key_sparsity
        self.value_sparsity = base if self.value_sparsity is None else self.value_sparsity
        self.dense_window = self.residual if self.dense_window is None else self.dense_window


def quantize_kept(x: torch.Tensor, mask: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Kept elements of rows ``x [rows, L]`` under bool ``mask [rows, L]``: packed codes ``uint8
    [ceil(kept*bits/8)]``, scales and zeros ``[groups]``, and the kept count."""
    gidx, per_row = masked_row_groups(mask, group)
    codes, scales, zeros = quantize_groups(x[mask], gidx, int(per_row.sum()), bits, scale_dtype)
    return pack_codes(codes, bits), scales, zeros, int(mask.sum())


def dequantize_kept(packed: torch.Tensor, mask: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Inverse of :func:`quantize_kept`: float32 ``[rows, L]``, zero where ``mask`` is False."""
    gidx, _ = masked_row_groups(mask, group)
    codes = unpack_codes(packed, bits, int(mask.sum()))
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out[mask] = dequantize_groups(codes, gidx, scales, zeros)
    return out


TILE = 64  # tokens per key tile (one channel of 64 consecutive tokens), as in the bitmap format


def _rows(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``[B, Hkv, P, D]`` -> rows. Keys: one row per key tile, ``[B*Hkv*NB*D, 64]`` in order (b, h,
    block of 64 tokens, channel), tokens past P padded with zeros (False in a mask); values: one row
    per token, ``[B*Hkv*P, D]``."""
    b, h, p, d = x.shape
    if kind == "values":
        return x.reshape(b * h * p, d)
    nb = -(-p // TILE)
    if nb * TILE > p:
        x = torch.cat([x, x.new_zeros(b, h, nb * TILE - p, d)], dim=2)
    return x.reshape(b, h, nb, TILE, d).transpose(-1, -2).reshape(b * h * nb * d, TILE)


def _unrows(rows: torch.Tensor, kind: str, shape: tuple[int, int, int, int]) -> torch.Tensor:
    b, h, p, d = shape
    if kind == "values":
        return rows.reshape(b, h, p, d)
    nb = -(-p // TILE)
    return rows.reshape(b, h, nb, d, TILE).transpose(-1, -2).reshape(b, h, nb * TILE, d)[:, :, :p]


def encode_masked(keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor, value_mask: torch.Tensor, bits: int, group: int, residual: int) -> Encoded:
    """Store already-pruned ``keys``/``values`` ``[B, Hkv, T, D]`` with their bool keep masks (same
    shape) in the layout of the module docstring. Elements outside a mask are not stored."""
    b, h, t, d = keys.shape
    r = min(residual, t)
    p = t - r
    sdt = scale_dtype_for(torch.cat([keys[:, :, :p].reshape(-1), values[:, :, :p].reshape(-1)]))
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"shape": [b, h, t, d], "dtype": dtype_name(keys.dtype), "bits": bits, "group": group, "residual_tokens": r, "scale_dtype": dtype_name(sdt)}
    for kind, x, m in (("keys", keys, key_mask), ("values", values, value_mask)):
        region, mreg = x[:, :, :p], m[:, :, :p]
        tensors[f"bitmap.{kind}"] = pack_codes(mreg.to(torch.uint8), 1)
        codes, scales, zeros, kept = quantize_kept(_rows(region, kind), _rows(mreg, kind), bits, group, sdt)
        tensors[f"codes.{kind}"] = codes
        tensors[f"scales.{kind}"] = scales
        tensors[f"zeros.{kind}"] = zeros
        tensors[f"residual.{kind}"] = x[:, :, p:].contiguous()
        meta[f"kept_{kind}"] = kept
    return Encoded(tensors, meta)


def layer_masks(enc: Encoded) -> dict[str, torch.Tensor]:
    """The stored keep masks, bool ``[B, Hkv, P, D]`` per kind."""
    b, h, t, d = enc.meta["shape"]
    return {kind: unpack_codes(enc.tensors[f"bitmap.{kind}"], 1, d).to(torch.bool) for kind in ("keys", "values")}


@register
class BitmapQFormat(Format):
    name = "bitmapq"
    summary = "pruning bitmap with the kept elements as 2/4/8-bit codes (Mustafar + KIVI), recent tokens in full precision"
    Params = BitmapQParams
    prunes_itself = True
    default_sweep = (
        'bitmapq:sparsity=0.5,0.7,bits=4',
    )
    paper_rows = (
        ('pruning with KIVI quantisation (Mustafar 4.2)', '50% per-token + KIVI 2-bit', 'bitmapq:sparsity=0.5,bits=2'),
        ('pruning with KIVI quantisation (Mustafar 4.2)', '50% per-token + KIVI 4-bit', 'bitmapq:sparsity=0.5,bits=4'),
    )

    def reads_queries(self, params: FormatParams) -> bool:
        """Only the output-aware pruning methods read queries."""
        return method_needs_queries(params.method)

    def check(self, layer: LayerKV, params: FormatParams) -> None:
        check_sparsity(params.key_sparsity, "--key-sparsity")
        check_sparsity(params.value_sparsity, "--value-sparsity")
        if method_needs_queries(params.method) and layer.queries is None:
            raise UsageError(f"pruning method {params.method!r} needs the captured queries (recapture without --no-queries, or prune per-token/per-channel)")

    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        """Prune ``layer`` (keys/values ``[B, Hkv, T, D]``), then store it as the module docstring says."""
        res = prune_layer(layer, params.key_sparsity, params.value_sparsity, params.method, params.dense_window)
        enc = encode_masked(res.keys, res.values, res.key_mask, res.value_mask, params.bits, params.group, params.residual)
        enc.meta["achieved_key_sparsity"] = res.stats["achieved_key_sparsity"]
        enc.meta["achieved_value_sparsity"] = res.stats["achieved_value_sparsity"]
        return enc

    def decode(self, enc: Encoded) -> LayerKV:
        m = enc.meta
        b, h, t, d = m["shape"]
        p = t - m["residual_tokens"]
        masks = layer_masks(enc)
        out = {}
        for kind in ("keys", "values"):
            ts = enc.tensors
            rows = dequantize_kept(ts[f"codes.{kind}"], _rows(masks[kind], kind), ts[f"scales.{kind}"], ts[f"zeros.{kind}"], m["bits"], m["group"])
            region = _unrows(rows, kind, (b, h, p, d))
            out[kind] = torch.cat([region, ts[f"residual.{kind}"].float()], dim=2).to(DTYPES[m["dtype"]])
        return LayerKV(keys=out["keys"], values=out["values"])

    def validate(self, enc: Encoded) -> None:
        m = enc.meta
        for key in ("shape", "dtype", "bits", "group", "residual_tokens", "scale_dtype", "kept_keys", "kept_values"):
            if key not in m:
                raise BadDataError(f"layer metadata lacks {key!r}")
        if m["bits"] not in (2, 4, 8) or not isinstance(m["group"], int) or m["group"] < 1:
            raise BadDataError(f"bad bits/group in layer metadata: bits {m['bits']}, group {m['group']}")
        if m["dtype"] not in DTYPES or m["scale_dtype"] not in DTYPES or len(m["shape"]) != 4:
            raise BadDataError("bad dtype or shape in layer metadata")
        b, h, t, d = m["shape"]
        r = m["residual_tokens"]
        if not 0 <= r <= t:
            raise BadDataError(f"residual_tokens {r} outside 0..{t}")
        p = t - r
        names = {f"{part}.{kind}" for part in ("bitmap", "codes", "scales", "zeros", "residual") for kind in ("keys", "values")}
        if set(enc.tensors) != names:
            bad = sorted(names ^ set(enc.tensors))
            raise BadDataError(f"tensor {bad[0]!r} is missing or unexpected")
        sdt, dt = DTYPES[m["scale_dtype"]], DTYPES[m["dtype"]]
        for kind in ("keys", "values"):
            ts = {part: enc.tensors[f"{part}.{kind}"] for part in ("bitmap", "codes", "scales", "zeros", "residual")}
            if tuple(ts["bitmap"].shape) != (b, h, p, math.ceil(d / 8)) or ts["bitmap"].dtype != torch.uint8:
                raise BadDataError(f"bitmap.{kind} should be uint8 {[b, h, p, math.ceil(d / 8)]}")
            if tuple(ts["residual"].shape) != (b, h, r, d) or ts["residual"].dtype != dt:
                raise BadDataError(f"residual.{kind} should be {m['dtype']} {[b, h, r, d]}")
            if d % 8 and bool((ts["bitmap"][..., -1] >> (d % 8)).any()):
                raise BadDataError(f"bitmap.{kind} has bits set past head_dim {d}")
            mask = unpack_codes(ts["bitmap"], 1, d).to(torch.bool)
            kept = int(mask.sum())
            if kept != m[f"kept_{kind}"]:
                raise BadDataError(f"bitmap.{kind} popcount {kept} disagrees with the stored count {m[f'kept_{kind}']}")
            if ts["codes"].dtype != torch.uint8 or ts["codes"].ndim != 1 or ts["codes"].numel() != packed_length(kept, m["bits"]):
                raise BadDataError(f"codes.{kind} should be {packed_length(kept, m['bits'])} uint8 bytes for {kept} kept elements")
            groups = int(masked_row_groups(_rows(mask, kind), m["group"])[1].sum())
            for part in ("scales", "zeros"):
                if tuple(ts[part].shape) != (groups,) or ts[part].dtype != sdt:
                    raise BadDataError(f"{part}.{kind} should be {m['scale_dtype']} [{groups}] (groups the bitmap implies)")
                if not bool(torch.isfinite(ts[part].float()).all()):
                    raise BadDataError(f"{part}.{kind} holds non-finite numbers")
            if bool((ts["scales"].float() < 0).any()):
                raise BadDataError(f"scales.{kind} holds negative scales")

    def report(self, cc, source=None) -> dict[str, Any]:
        encs = list(cc.layers.values())
        stored = sum(sum(self.nbytes(e).values()) for e in encs)
        elements = sum(2 * math.prod(e.meta["shape"]) for e in encs)
        region = sum(math.prod(e.meta["shape"][:2]) * (e.meta["shape"][2] - e.meta["residual_tokens"]) * e.meta["shape"][3] for e in encs)
        out: dict[str, Any] = {"bits": encs[0].meta["bits"] if encs else None, "bits_per_element": 8.0 * stored / elements if elements else float("nan")}
        for kind in ("keys", "values"):
            kept = sum(e.meta[f"kept_{kind}"] for e in encs)
            out[f"achieved_{kind[:-1]}_sparsity"] = 1.0 - kept / region if region else 0.0
        return out
