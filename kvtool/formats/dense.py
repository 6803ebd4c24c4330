"""The identity format: keys and values stored as they are. The reference every other format is
compared against (zero error, ratio 1.0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.core.cache import LayerKV
from kvtool.core.errors import BadDataError
from kvtool.formats.base import Encoded, Format, FormatParams, register
from kvtool.formats._live import DenseLive


@dataclass
class DenseParams(FormatParams):
    """The dense format takes no parameters."""


@register
class DenseFormat(Format):
    name = "dense"
    summary = "keys and values unchanged (the reference: ratio 100%, zero error)"
    Params = DenseParams

    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        """Stores ``keys``/``values`` ``[B, Hkv, T, D]`` as they are."""
        return Encoded({"keys": layer.keys.contiguous(), "values": layer.values.contiguous()})

    def decode(self, enc: Encoded) -> LayerKV:
        return LayerKV(keys=enc.tensors["keys"], values=enc.tensors["values"])

    live_grows = True

    def live_layer(self, enc: Encoded, like: torch.Tensor) -> DenseLive:
        """Dense keys / values in a preallocated buffer (:class:`~kvtool.formats._live.DenseLive`)."""
        return DenseLive(self, enc.tensors["keys"].to(like.device), enc.tensors["values"].to(like.device))

    def live_from_dense(self, layer: LayerKV, params: FormatParams) -> DenseLive:
        return DenseLive(self, layer.keys, layer.values)

    def validate(self, enc: Encoded) -> None:
        for name in ("keys", "values"):
            if name not in enc.tensors:
                raise BadDataError(f"tensor {name!r} is missing")
            if enc.tensors[name].ndim != 4:
                raise BadDataError(f"{name} should be [batch, kv_heads, tokens, head_dim]")
        if enc.tensors["keys"].shape != enc.tensors["values"].shape:
            raise BadDataError("keys and values have different shapes")
        if not enc.tensors["keys"].is_floating_point():
            raise BadDataError("keys are not floating point")
