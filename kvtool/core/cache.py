"""The in-memory KV container shared by every command and by the Python API.

Shapes (B = batch, H = query heads, Hkv = KV heads, T = tokens, D = head_dim):

- keys, values: ``[B, Hkv, T, D]``, exactly as attention reads them (RoPE applied to keys, before the
  GQA expansion to H heads).
- queries: ``[B, H, T, D]``, RoPE applied (optional).
- hidden: ``[B, T, hidden_size]``, the layer's input hidden states (optional).
- token_ids: ``[B, T]`` int64.

All tensors of one capture share one floating dtype (``ModelFacts.dtype``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterator

from kvtool.core.errors import UsageError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "float16", "bfloat16")


class _Dtypes(Mapping):
    """``{"float32": torch.float32, "float16": ..., "bfloat16": ...}``; torch is imported on the first
    lookup of a value, so that reading a file's header (``kvtool info``) never loads it."""

    def __getitem__(self, name: str) -> Any:
        if name not in DTYPE_NAMES:
            raise KeyError(name)
        import torch

        return getattr(torch, name)

    def __contains__(self, name: object) -> bool:
        return name in DTYPE_NAMES

    def __iter__(self) -> Iterator[str]:
        return iter(DTYPE_NAMES)

    def __len__(self) -> int:
        return len(DTYPE_NAMES)


DTYPES: Mapping[str, Any] = _Dtypes()


# Every byte ratio kvtool reports (stored %, budgets, plans) is over float16 keys and values, whatever
# the dtype a capture stores: a float32 capture's 15% is the same number of bytes as a bfloat16 one's.
REFERENCE_BYTES = 2


def dense_reference_bytes(batch: int, kv_heads: int, tokens: int, head_dim: int, layers: int = 1) -> int:
    """Bytes of float16 keys and values: ``2 x layers x batch x kv_heads x tokens x head_dim x 2``,
    the denominator of every ratio kvtool reports."""
    return 2 * layers * batch * kv_heads * tokens * head_dim * REFERENCE_BYTES


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelFacts:
    """What a capture knows about the model it came from.

    ``name`` is the model's name or path; ``source`` is ``embedded``, ``hf-folder``, ``gguf`` or
    ``synthetic`` (tensors made without a model, e.g. in tests and benchmarks).
    """

    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    rope_theta: float | None
    dtype: str
    rope_applied: bool = True
    source: str = "synthetic"
    vocab_size: int | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA group)."""
        return self.num_heads // self.num_kv_heads

    @property
    def torch_dtype(self) -> Any:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelFacts":
        """Facts from their JSON form. KeyError naming missing fields; TypeError naming a field of
        the wrong type (a JSON object is required, ints must be ints, not bools)."""
        if not isinstance(data, dict):
            raise TypeError(f"is a JSON {type(data).__name__}, not an object")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING} - set(data)
        if missing:
            raise KeyError(", ".join(sorted(missing)))
        kinds = {"name": str, "architecture": str, "dtype": str, "source": str, "num_layers": int, "num_heads": int,
                 "num_kv_heads": int, "head_dim": int, "hidden_size": int, "rope_applied": bool}
        for key, kind in kinds.items():
            value = data.get(key, True if kind is bool else "" if kind is str else 1)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise TypeError(f"field {key} is {value!r}, not {'an integer' if kind is int else 'a ' + kind.__name__}")
        for key in ("rope_theta", "vocab_size"):
            value = data.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"field {key} is {value!r}, not a number")
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class LayerKV:
    """One layer's cache.

    keys, values: ``[B, Hkv, T, D]``; queries: ``[B, H, T, D]`` or None; hidden: ``[B, T, hidden]``
    or None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    def slice_tokens(self, start: int | None = None, stop: int | None = None) -> "LayerKV":
        """The tokens ``start:stop`` of every tensor (views, no copy)."""
        sl = slice(start, stop)
        return LayerKV(
            keys=self.keys[:, :, sl],
            values=self.values[:, :, sl],
            queries=None if self.queries is None else self.queries[:, :, sl],
            hidden=None if self.hidden is None else self.hidden[:, sl],
        )

    def to(self, *args, **kwargs) -> "LayerKV":
        """``Tensor.to`` on every tensor."""
        return LayerKV(
            keys=self.keys.to(*args, **kwargs),
            values=self.values.to(*args, **kwargs),
            queries=None if self.queries is None else self.queries.to(*args, **kwargs),
            hidden=None if self.hidden is None else self.hidden.to(*args, **kwargs),
        )


@dataclass
class KVCache:
    """A captured cache: model facts, per-layer tensors keyed by layer index, token ids, and
    ``info`` (capture settings: prompt sha256, prefill and generated token counts, ...).

    ``attention_mask`` (``[B, T]`` int64, 1 = real token) is present only for left-padded batches.
    """

    facts: ModelFacts
    layers: dict[int, LayerKV]
    token_ids: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)
    attention_mask: torch.Tensor | None = None

    @property
    def layer_indices(self) -> list[int]:
        return sorted(self.layers)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[1])

    @property
    def batch_size(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def has_queries(self) -> bool:
        return all(layer.queries is not None for layer in self.layers.values())

    def has_queries_for(self, indices: list[int]) -> bool:
        """Whether every one of the layers ``indices`` holds queries."""
        return all(i in self.layers and self.layers[i].queries is not None for i in indices)

    @property
    def has_hidden(self) -> bool:
        return all(layer.hidden is not None for layer in self.layers.values())

    def layer(self, index: int) -> LayerKV:
        """The layer with model index ``index``; a clear error if it was not captured."""
        if index not in self.layers:
            raise UsageError(f"layer {index} is not in this capture (it has layers {format_indices(self.layer_indices)})")
        return self.layers[index]

    def dense_kv_bytes(self) -> int:
        """Bytes of keys + values over all captured layers, in the stored dtype."""
        return sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size() for l in self.layers.values())


def format_indices(indices: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def parse_indices(text: str, upper: int, what: str = "layer") -> list[int]:
    """``"0,5,10-12"`` -> ``[0, 5, 10, 11, 12]``.

    Raises UsageError naming the bad part, a negative index, or an index out of ``0..upper-1``.
    Both ends of a range are read and checked before it is built (``0-99999999999999`` is refused
    at once, never materialised), so the work is bounded by ``upper``."""
    result: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("-"):
            raise UsageError(f"{what} {part} is negative: give {what}s as 0..{upper - 1} or ranges like 3-7")
        ends = part.split("-", 1)
        if not all(e.strip().isascii() and e.strip().isdigit() for e in ends):
            raise UsageError(f"cannot read {what} selection {text[:80]!r}: {part[:40]!r} is not a number or a range like 3-7")
        for e in ends:
            e = e.strip().lstrip("0") or "0"
            if len(e) > len(str(upper)) or int(e) >= upper:
                raise UsageError(f"{what} {e[:24]}{'...' if len(e) > 24 else ''} is out of range: there are {upper} {what}s (0..{upper - 1})")
        a, b = int(ends[0]), int(ends[-1])
        if b < a:
            raise UsageError(f"{what} range {part} is empty: write the lower index first ({b}-{a})")
        result.update(range(a, b + 1))
    if not result:
        raise UsageError(f"the {what} selection {text[:80]!r} is empty")
    return sorted(result)
