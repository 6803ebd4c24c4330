"""Live layers: one model layer's cache in a format while a model decodes.

A live layer holds the format's *encoded* tensors on the model's device (not dense tensors standing in
for them) and grows the way the format grows during decoding: the ``bitmap`` format prunes and encodes
each filled block of 64 recent tokens, KIVI quantises each filled residual group, page statistics add
a page, a ring buffer overwrites its oldest recent slot. Attention runs through the format's kernel on
CUDA tensors and through its plain-torch reference elsewhere. Each format builds its live layer in its
own module (``Format.live_layer``; ``Format.live_grows`` says whether new tokens are encoded too); the
hf layer wraps live layers in a transformers cache (:mod:`kvtool.hf.live`).

The contract every live layer keeps (tensors ``[B, Hkv, N, D]`` for keys/values, ``[B, H, Tq, D]`` for
queries; query head h reads KV head ``h // (H / Hkv)``):

- :meth:`LiveLayer.step` ``(q, keys, values, scale) -> out [B, H, Tq, D]``: the new tokens' keys and
  values join the layer and their queries attend to everything before them and to themselves
  (causally). One new token (decoding) is appended first and its query then attends to the layer;
  several (a prompt continued in one call) attend first and are appended after, so a filled block is
  never encoded ahead of a query that should see it dense. Ring buffers (``writes_first``) write
  each token before its own query attends, one token at a time.
- :meth:`LiveLayer.prepare` does the host-side work a step needs (page plans); it runs before a step
  that is captured in a CUDA graph; a captured step does no host syncs and allocates only from the
  graph's pool. A step that fills a block encodes it eagerly (host syncs allowed), so callers that
  capture steps keep :meth:`LiveLayer.room` steps ahead of the next encode.
- :meth:`LiveLayer.stored_bytes` counts every byte the layer holds (encoded tensors and the
  preallocated recent-token buffer); :meth:`LiveLayer.workspace_bytes` bounds what one step (or
  one block's encode) allocates on top of that and frees again. docs/decode.md states the bounds.
- :meth:`LiveLayer.encoded` returns what the layer holds as the format's :class:`Encoded` (a copy
  where the layout needs one): the bytes ``fmt.encode`` would write for the same tokens.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterator

import torch

from kvtool.core.attention import attend_partial, merge_partials
from kvtool.formats.encoded import Encoded
from kvtool.kernels.common import interpreting


_REFERENCE = threading.local()


def on_gpu(x: torch.Tensor) -> bool:
    """Whether the kernels (not the torch references) serve tensors like ``x``."""
    return x.is_cuda and not interpreting() and not getattr(_REFERENCE, "on", False)


@contextlib.contextmanager
def reference_paths() -> Iterator[None]:
    """Within the block live layers attend through the torch references on every device (the
    kernels' checks compare the two on the same live layer)."""
    before = getattr(_REFERENCE, "on", False)
    _REFERENCE.on = True
    try:
        yield
    finally:
        _REFERENCE.on = before


def causal_new_mask(tq: int, device: torch.device) -> torch.Tensor:
    """Bool ``[Tq, Tq]``: new query i sees new tokens 0..i."""
    return torch.ones(tq, tq, dtype=torch.bool, device=device).tril()


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def dense_attention_out(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output over dense keys/values: torch SDPA (GQA, no mask: its fused kernels) for
    one query token on CUDA, the float32 reference (:func:`attend_partial`) elsewhere."""
    if on_gpu(q) and q.shape[2] == 1 and mask is None and keys.dtype == q.dtype:
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)
    return attend_partial(q, keys, values, scale, mask)[0]


class LiveLayer(ABC):
    """One layer of a live cache (module docstring). Subclasses implement :meth:`append`,
    :meth:`partial` (attention over what the layer holds, as a partial ``(out, lse)``),
    :meth:`stored_bytes` and :meth:`encoded`; :meth:`attend_one` may be a faster path for one query
    token that returns only the output."""

    writes_first: ClassVar[bool] = False
    fmt: Any  # the layer's Format (kvtool.formats.base, which imports this module)

    @property
    @abstractmethod
    def tokens(self) -> int:
        """Tokens the layer holds (evicted tokens are not held; a ring holds at most its slots)."""

    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add new tokens ``[B, Hkv, N, D]`` the way the format grows."""

    @abstractmethod
    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q ``[B, H, Tq, D]`` over every token held: (out float32, lse)."""

    @abstractmethod
    def stored_bytes(self) -> int:
        """Bytes held on the device (encoded tensors and preallocated buffers)."""

    @abstractmethod
    def encoded(self) -> Encoded:
        """What the layer holds, as the format's :class:`Encoded`."""

    def attend_one(self, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Output ``[B, H, 1, D]`` of one query token over what is held (after its own token was appended)."""
        return self.partial(q, scale)[0]

    def step(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None) -> torch.Tensor:
        """The new tokens join the layer and their queries attend (module docstring); ``[B, H, Tq, D]``."""
        tq = q.shape[2]
        if self.writes_first:
            outs = []
            for j in range(tq):
                self.append(keys[:, :, j:j + 1], values[:, :, j:j + 1])
                outs.append(self.attend_one(q[:, :, j:j + 1], scale))
            return outs[0] if tq == 1 else torch.cat([o.float() for o in outs], dim=2)
        if tq == 1:
            self.append(keys, values)
            return self.attend_one(q, scale)
        held = self.partial(q, scale)
        new = attend_partial(q, keys, values, scale, causal_new_mask(tq, q.device))
        self.append(keys, values)
        return merge_partials(held, new)[0]

    def prepare(self, query_tokens: int = 1) -> None:
        """Host-side work before a step of ``query_tokens`` new tokens (default: none)."""

    def room(self) -> int:
        """Steps of one token each that fit before the layer next encodes a block eagerly
        (a large number when it never does)."""
        return 1 << 30

    def reserve(self, steps: int) -> None:
        """Make :meth:`room` at least ``steps`` where the layer can (by encoding a block now);
        before capturing steps in a CUDA graph. Default: nothing to do."""

    def workspace_bytes(self, query_rows: int) -> int:
        """Bytes one decode step allocates and frees again, for ``query_rows`` = B * H * Tq query
        rows, beyond the layer's stored bytes (the attention's partials by default)."""
        return 4 * query_rows * (self.head_dim + 2) * 2

    def join_bytes(self) -> int:
        """Bytes the encoding of one filled block allocates and frees again (once every ``chunk``
        tokens, outside the steady decode step; 0 for layers that never encode)."""
        return 0

    @property
    def head_dim(self) -> int:
        return int(self.encoded_shape()[3])

    @abstractmethod
    def encoded_shape(self) -> tuple[int, int, int, int]:
        """``(B, Hkv, tokens, D)``."""

    @abstractmethod
    def reference_tensor(self) -> torch.Tensor:
        """A tensor of the layer in the cache dtype on its device (new tokens are converted to it)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.reference_tensor().dtype

    @property
    def device(self) -> torch.device:
        return self.reference_tensor().device


class Tail:
    """A preallocated buffer of recent dense tokens ``[B, Hkv, capacity, D]`` holding ``n`` of them
    (the format's dense window, plus the tokens of the block being filled)."""

    def __init__(self, like: torch.Tensor, capacity: int, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        b, h, _, d = like.shape
        self.keys = like.new_zeros((b, h, capacity, d))
        self.values = like.new_zeros((b, h, capacity, d))
        self.n = 0
        if keys is not None and keys.shape[2]:
            self.keys[:, :, :keys.shape[2]] = keys
            self.values[:, :, :keys.shape[2]] = values
            self.n = keys.shape[2]

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, :self.n], self.values[:, :, :self.n]

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Copy as many of ``keys``/``values`` ``[B, Hkv, N, D]`` as fit; return how many."""
        take = min(keys.shape[2], self.capacity - self.n)
        if take:
            self.keys[:, :, self.n:self.n + take] = keys[:, :, :take]
            self.values[:, :, self.n:self.n + take] = values[:, :, :take]
            self.n += take
        return take

    def pop_front(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The oldest ``m`` tokens (copies), removed; the rest move to the front."""
        k = self.keys[:, :, :m].clone()
        v = self.values[:, :, :m].clone()
        rest = self.n - m
        if rest:
            self.keys[:, :, :rest] = self.keys[:, :, m:self.n].clone()
            self.values[:, :, :rest] = self.values[:, :, m:self.n].clone()
        self.n = rest
        return k, v

    def nbytes(self) -> int:
        return nbytes(self.keys, self.values)


class ChunkedLive(LiveLayer):
    """A format part that grows by encoded chunks of ``chunk`` tokens, and a :class:`Tail` of the
    most recent ``window`` to ``window + chunk - 1`` tokens kept dense. When the tail reaches
    ``window + chunk`` tokens its oldest ``chunk`` are encoded (:meth:`absorb`). Subclasses hold the
    encoded part and implement :meth:`absorb`, :meth:`encoded_partial` and :meth:`encoded_bytes`."""

    def __init__(self, fmt: Any, like: torch.Tensor, window: int, chunk: int, tail_keys: torch.Tensor | None = None,
                 tail_values: torch.Tensor | None = None) -> None:
        self.fmt = fmt
        self.window, self.chunk = int(window), int(chunk)
        self.tail = Tail(like, self.window + self.chunk, tail_keys, tail_values)
        self._shape = tuple(like.shape)
        while self.tail.n >= self.window + self.chunk:  # a long initial tail: encode its full chunks
            self.absorb(*self.tail.pop_front(self.next_chunk()))

    @abstractmethod
    def absorb(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Encode ``chunk`` tokens (the oldest of the tail) onto the encoded part."""

    @abstractmethod
    def encoded_partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over the encoded part alone."""

    @abstractmethod
    def encoded_bytes(self) -> int:
        """Bytes of the encoded part."""

    @property
    @abstractmethod
    def encoded_tokens(self) -> int:
        """Tokens in the encoded part."""

    @property
    def tokens(self) -> int:
        return self.encoded_tokens + self.tail.n

    def reference_tensor(self) -> torch.Tensor:
        return self.tail.keys

    def encoded_shape(self) -> tuple[int, int, int, int]:
        b, h, _, d = self._shape
        return b, h, self.tokens, d

    def next_chunk(self) -> int:
        """Tokens the next :meth:`absorb` takes from the tail (``chunk``; fewer where the encoded
        part ends in a partial chunk that the first absorb completes)."""
        return self.chunk

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        done = 0
        while done < keys.shape[2]:
            done += self.tail.add(keys[:, :, done:], values[:, :, done:])
            if self.tail.n == self.tail.capacity:
                self.absorb(*self.tail.pop_front(self.next_chunk()))

    def room(self) -> int:
        return self.tail.capacity - self.tail.n - 1

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        if self.encoded_tokens:
            parts.append(self.encoded_partial(q, scale))
        k, v = self.tail.view()
        if k.shape[2] or not parts:
            parts.append(attend_partial(q, k, v, scale))
        return parts[0] if len(parts) == 1 else merge_partials(*parts)

    def stored_bytes(self) -> int:
        return self.encoded_bytes() + self.tail.nbytes()

    def join_bytes(self) -> int:
        """The encoded part once more (joined by concatenation) and the block's dense copy."""
        return self.encoded_bytes() + 2 * self.tail.nbytes()


class DenseLive(LiveLayer):
    """Dense keys/values in a preallocated buffer ``[B, Hkv, capacity, D]`` (the baseline: what a
    serving engine holds). One query token attends through torch SDPA over the filled part (no mask,
    so its fused kernels run) on CUDA, or through ``attention`` when given (a callable
    ``(q, layer) -> out``, e.g. FlashInfer's decode, :mod:`kvtool.hf.live`)."""

    def __init__(self, fmt: Any, keys: torch.Tensor, values: torch.Tensor, capacity: int | None = None) -> None:
        self.fmt = fmt
        t = keys.shape[2]
        cap = max(int(capacity or 0), t + 64)
        self.buf = Tail(keys, cap, keys, values)
        self.attention: Any = None

    @property
    def tokens(self) -> int:
        return self.buf.n

    def reference_tensor(self) -> torch.Tensor:
        return self.buf.keys

    def encoded_shape(self) -> tuple[int, int, int, int]:
        b, h, _, d = self.buf.keys.shape
        return b, h, self.buf.n, d

    def _grow(self, need: int) -> None:
        cap = max(need, self.buf.capacity + self.buf.capacity // 2)
        old = self.buf
        k, v = old.view()
        self.buf = Tail(old.keys, cap, k, v)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.buf.n + keys.shape[2] > self.buf.capacity:
            self._grow(self.buf.n + keys.shape[2])
        self.buf.add(keys, values)

    def room(self) -> int:
        return self.buf.capacity - self.buf.n - 1

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.buf.view()
        return attend_partial(q, k, v, scale)

    def attend_one(self, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        if self.attention is not None:
            return self.attention(q, self)
        k, v = self.buf.view()
        return dense_attention_out(q, k, v, scale)

    def prepare(self, query_tokens: int = 1) -> None:
        if self.buf.n + query_tokens > self.buf.capacity:
            self._grow(self.buf.n + query_tokens)
        if self.attention is not None and hasattr(self.attention, "prepare"):
            self.attention.prepare(self, query_tokens)

    def stored_bytes(self) -> int:
        return self.buf.nbytes()

    def encoded(self) -> Encoded:
        k, v = self.buf.view()
        return Encoded({"keys": k.contiguous(), "values": v.contiguous()})


class PrefixLive(LiveLayer):
    """A format without live growth of its own: its encoded prefix stays as encoded (read through
    ``fmt.attend_kernel`` on CUDA when the format has a kernel, else ``fmt.attend``) and new tokens
    are held dense after it (a :class:`DenseLive`); the two partials merge exactly."""

    def __init__(self, fmt: Any, enc: Encoded, like: torch.Tensor) -> None:
        self.fmt, self.enc = fmt, enc
        b, h, _, d = like.shape
        self.prefix_tokens = int(fmt.decode(enc).keys.shape[2]) if "tokens" not in enc.meta else int(enc.meta["tokens"])
        self.recent = DenseLive(fmt, like.new_zeros((b, h, 0, d)), like.new_zeros((b, h, 0, d)), capacity=256)

    @property
    def tokens(self) -> int:
        return self.prefix_tokens + self.recent.tokens

    def reference_tensor(self) -> torch.Tensor:
        return self.recent.buf.keys

    def encoded_shape(self) -> tuple[int, int, int, int]:
        b, h, _, d = self.recent.buf.keys.shape
        return b, h, self.tokens, d

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.recent.append(keys, values)

    def prefix_partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        if on_gpu(q) and self.fmt.has_kernel:
            return self.fmt.attend_kernel(q, self.enc, scale)
        return self.fmt.attend(q, self.enc, scale)

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self.prefix_partial(q, scale)
        if not self.recent.tokens:
            return out.float(), lse.float()
        return merge_partials((out.float(), lse.float()), self.recent.partial(q, scale))

    def prepare(self, query_tokens: int = 1) -> None:
        self.recent.prepare(query_tokens)

    def room(self) -> int:
        return self.recent.room()

    def stored_bytes(self) -> int:
        return self.enc.tensor_bytes() + self.recent.stored_bytes()

    def encoded(self) -> Encoded:
        return self.enc
