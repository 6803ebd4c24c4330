"""One compressed layer as stored: :class:`Encoded` (named tensors and a JSON-safe meta dict).

It sits below :mod:`kvtool.formats.base` (formats, registry, compressed caches) and
:mod:`kvtool.formats._live` (live layers), which both use it; :mod:`kvtool.formats.base`
re-exports it, where the rest of kvtool imports it from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Encoded:
    """One compressed layer: named tensors and a small JSON-safe ``meta`` dict (shapes, dtype,
    anything the decoder needs that is not a tensor). Tensor names are the format's own; a name's
    first dotted part is its *part* in byte reports (``keys.bitmap`` -> ``keys``... as the format
    chooses in ``nbytes``)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    def tensor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
