"""A left-padded batch as live layers: one live layer of the format per row, over its real tokens.

A batch of prompts of different lengths is left-padded: row b's first ``pads[b]`` positions are pad
tokens that its attention mask hides. A format that encoded them with the others would quantise,
prune, score or evict them beside real tokens (a KIVI group or a bitmap block straddling the pads,
an eviction keeping pad tokens or ranking real ones against them), and its attention has no per-row
mask. :class:`RowsLive` drops them instead: row b's layer is the format's own live layer built from
the row's tokens ``pads[b]:`` alone, a batch of one, so it holds, encodes, grows and evicts exactly
what the same prompt generated on its own holds, and attends without a mask (the pads are not
there). One step splits the new queries / keys / values ``[B, *, Tq, D]`` by row, runs each row's
:meth:`~kvtool.formats._live.LiveLayer.step` and stacks the outputs: B steps of batch one per layer
(each row's kernel on CUDA), the price of exact rows.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvtool.core.cache import LayerKV
from kvtool.core.errors import UsageError
from kvtool.formats._live import LiveLayer


def _row(layer: LayerKV, b: int, pad: int) -> LayerKV:
    """Row ``b`` of ``layer`` without its first ``pad`` tokens, copied (the live layer may keep the
    tensors it is given; a view would keep the whole padded prompt alive)."""
    def cut(x: torch.Tensor | None, axis: int) -> torch.Tensor | None:
        return None if x is None else x[b:b + 1].narrow(axis, pad, x.shape[axis] - pad).clone()

    return LayerKV(cut(layer.keys, 2), cut(layer.values, 2), cut(layer.queries, 2), cut(layer.hidden, 1))  # type: ignore[arg-type]


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows' outputs ``[1, ...]`` -> ``[B, ...]`` (float32 where their dtypes differ)."""
    if len({p.dtype for p in parts}) > 1:
        parts = [p.float() for p in parts]
    return torch.cat(parts, dim=0)


class RowsLive(LiveLayer):
    """Per-row live layers of a left-padded batch (module docstring). ``rows[b]``: row b's live
    layer (batch 1) over its real tokens; ``pads[b]``: the pad tokens row b had before them."""

    def __init__(self, fmt: Any, rows: Sequence[LiveLayer], pads: Sequence[int]) -> None:
        if len(rows) != len(pads) or not rows:
            raise UsageError(f"{len(rows)} row layers for {len(pads)} rows of padding")
        self.fmt, self.rows, self.pads = fmt, list(rows), [int(p) for p in pads]

    @classmethod
    def from_dense(cls, fmt: Any, layer: LayerKV, params: Any, pads: Sequence[int]) -> "RowsLive":
        """Row b's live layer from its tokens ``pads[b]:`` of ``layer`` (keys / values ``[B, Hkv,
        T, D]``, queries ``[B, H, T, D]`` and hidden ``[B, T, hidden]`` when given): what
        ``fmt.live_from_dense`` makes of the row's prompt alone."""
        t = layer.keys.shape[2]
        if len(pads) != layer.keys.shape[0] or any(not 0 <= p < t for p in pads):
            raise UsageError(f"pad counts {list(pads)} do not fit a batch of {layer.keys.shape[0]} rows of {t} tokens (each row needs a real token)")
        return cls(fmt, [fmt.live_from_dense(_row(layer, b, p), params) for b, p in enumerate(pads)], pads)

    @property
    def tokens(self) -> int:
        """The most tokens a row holds (rows hold different counts)."""
        return max(r.tokens for r in self.rows)

    def row_tokens(self) -> list[int]:
        """Tokens each row holds."""
        return [r.tokens for r in self.rows]

    def reference_tensor(self) -> torch.Tensor:
        return self.rows[0].reference_tensor()

    def encoded_shape(self) -> tuple[int, int, int, int]:
        _, h, _, d = self.rows[0].encoded_shape()
        return len(self.rows), h, self.tokens, d

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        for b, row in enumerate(self.rows):
            row.append(keys[b:b + 1], values[b:b + 1])

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [row.partial(q[b:b + 1], scale) for b, row in enumerate(self.rows)]
        return _stack([p[0] for p in parts]), _stack([p[1] for p in parts])

    def attend_one(self, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        return _stack([row.attend_one(q[b:b + 1], scale) for b, row in enumerate(self.rows)])

    def step(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Each row's own step (its format's order of appending and attending) ``[B, H, Tq, D]``."""
        return _stack([row.step(q[b:b + 1], keys[b:b + 1], values[b:b + 1], scale) for b, row in enumerate(self.rows)])

    def prepare(self, query_tokens: int = 1) -> None:
        for row in self.rows:
            row.prepare(query_tokens)

    def room(self) -> int:
        return min(row.room() for row in self.rows)

    def reserve(self, steps: int) -> None:
        for row in self.rows:
            row.reserve(steps)

    def workspace_bytes(self, query_rows: int) -> int:
        """The largest row's (rows step one after another) and the stacked output."""
        per_row = max(1, query_rows // len(self.rows))
        return max(row.workspace_bytes(per_row) for row in self.rows) + 4 * query_rows * self.head_dim

    def join_bytes(self) -> int:
        return max(row.join_bytes() for row in self.rows)

    def stored_bytes(self) -> int:
        return sum(row.stored_bytes() for row in self.rows)

    def encoded(self) -> Any:
        raise UsageError("a left-padded batch's live layer holds one encoding per row (its .rows[b].encoded()), not one for the batch")

