"""kvtool files as transformers caches, and generation from them (``kvtool generate``).

:func:`to_hf_cache` turns a capture, a compressed file or an ``kvtool export --to hf`` file into a
cache that ``model.generate(input_ids, cache=cache)`` accepts (``past_key_values=`` on older
transformers); ``input_ids`` must start with the file's ``token_ids`` (:func:`continuation_ids`
builds them), as with any transformers cache.

- Captures and formats whose decode keeps every token: a ``DynamicCache`` holding, per layer,
  keys/values ``[B, Hkv, T, D]`` in the model's dtype and device (lossy formats decoded).
- Formats that select tokens at attention time or keep fewer tokens: a :class:`KvtoolCache` (a
  ``DynamicCache``) holding a zero placeholder of P = ``prefix_tokens`` positions followed by the
  dense held-out tail; the model's attention implementation is switched to ``kvtool``,
  under which each layer's new queries attend to the encoded prefix through the format's ``attend``
  and to the dense tokens after it causally; the two partials merge exactly. The maths is
  :func:`kvtool.hf.attention.compressed_layer_attention`, the function model-level verification uses. The placeholder keeps lengths,
  positions and masks right; it is never read while the cache is in use. Any other cache used with
  the same model gets the model's SDPA attention unchanged.
- Formats with a decode-time ring buffer (``appends_tokens`` formats such as snapstream, through
  ``fmt.append_token(enc, key, value, inplace)``): a cache whose layers are :class:`RingLayer` s holding only the
  format's fixed-size slots. The held-out tail and every new token are written into the ring with
  ``append_token`` (overwriting the oldest recent token), and each new query attends to the slots
  through ``fmt.attend`` right after its own token is written, so nothing grows with the sequence.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtool.hf import models, shapes
from kvtool.hf.keycheck import check_model_reproduces
from kvtool.core.cache import KVCache, ModelFacts
from kvtool.core.errors import UsageError
from kvtool.core.placement import device_guard, resolve_devices
from kvtool.formats.files import check_all_layers, dense_of, read_kv_file
from kvtool.formats.base import CompressedCache, Encoded, Format
from kvtool.hf.attention import CompressedPrefix, hand_over, use_kvtool_attention
from kvtool.hf.devices import layer_devices, model_device_text
from kvtool.hf.interface import cache_kwargs


@dataclass
class RingState:
    """One layer's ring: the format, its ``append_token`` and the encoded slots (updated in place)."""

    fmt: Format
    append: Any
    enc: Encoded

    @property
    def length(self) -> int:
        """Tokens seen so far (= the next token's position)."""
        return int(self.enc.meta["length"])

    def push(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write tokens ``[B, Hkv, N, D]`` into the ring one by one."""
        for j in range(keys.shape[2]):
            self.enc = self.append(self.enc, keys[:, :, j], values[:, :, j], inplace=True)

    def attend_layer(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Queries ``[B, H, N, D]`` of N new tokens (keys/values ``[B, Hkv, N, D]``): token j is
        written, then query j attends to the ring. Returns ``[B, H, N, D]`` float32."""
        outs = []
        for j in range(query.shape[2]):
            self.push(keys[:, :, j : j + 1], values[:, :, j : j + 1])
            outs.append(self.fmt.attend(query[:, :, j : j + 1], self.enc, scale)[0].float())
        return torch.cat(outs, dim=2)


def _ring_layer_class():
    from transformers.cache_utils import DynamicLayer

    class RingLayer(DynamicLayer):
        """A transformers cache layer that is a format's ring buffer: fixed size, never grows.
        ``update`` hands the new tokens to the ``kvtool`` attention function, which writes
        them into the ring query by query; ``get_seq_length`` is the tokens seen (positions)."""

        is_croppable = False

        def __init__(self, layer_idx: int, ring: RingState) -> None:
            super().__init__()
            self.layer_idx, self.ring = layer_idx, ring
            self.keys, self.values = ring.enc.tensors["keys"], ring.enc.tensors["values"]
            self.dtype, self.device = self.keys.dtype, self.keys.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            hand_over(self.layer_idx, self.ring, key_states)
            return key_states, value_states

        def get_seq_length(self) -> int:
            return self.ring.length

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.ring.length + query_length, 0

        def crop(self, tokens_to_remove: int) -> None:
            raise UsageError("a ring-buffer cache cannot drop tokens (they were overwritten in place)")

        def batch_repeat_interleave(self, repeats: int) -> None:
            raise UsageError("a ring-buffer cache cannot be expanded for beam search or sampling several sequences")

    return RingLayer


def _dynamic_cache_class():
    from transformers import DynamicCache

    class KvtoolCache(DynamicCache):
        """A ``DynamicCache`` whose layers in ``kvtool_prefix.layers`` hold P placeholder positions
        standing for an encoded prefix; ``update`` hands the prefix to the ``kvtool``
        attention function of the same layer."""

        kvtool_prefix: CompressedPrefix | None = None

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            prefix = self.kvtool_prefix
            if prefix is not None and layer_idx in prefix.layers:
                hand_over(layer_idx, prefix, keys)
            return keys, values

    return KvtoolCache


def model_facts_problem(model: Any, facts: ModelFacts) -> str | None:
    """None if ``model`` has the shapes ``facts`` describe, else what differs."""
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    have = {
        "layers": int(cfg.num_hidden_layers),
        "query heads": heads,
        "KV heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        "hidden size": int(cfg.hidden_size),
    }
    want = {"layers": facts.num_layers, "query heads": facts.num_heads, "KV heads": facts.num_kv_heads, "head_dim": facts.head_dim, "hidden size": facts.hidden_size}
    if facts.vocab_size and getattr(cfg, "vocab_size", None):
        have["vocabulary"], want["vocabulary"] = int(cfg.vocab_size), int(facts.vocab_size)
    for what in want:
        if have[what] != want[what]:
            return f"the file's model ({facts.name}) has {want[what]} {what}, this model has {have[what]}"
    return None


def check_model(model: Any, facts: ModelFacts, path: Path | str) -> None:
    problem = model_facts_problem(model, facts)
    if problem:
        raise UsageError(f"{path}: the model does not match: {problem}")


MODES = ("auto", "live", "dense", "attend", "ring")


def cache_from(obj: KVCache | CompressedCache, model: Any, path: Path | str = "<memory>", mode: str = "auto", hold_last: bool = False) -> Any:
    """The transformers cache for a loaded kvtool object (see :func:`to_hf_cache`). ``mode``:
    ``auto`` (a capture: dense; a compressed file: ``live``, or ``ring`` for a ring-buffer format
    without a live layer of its own), ``live`` (the format's encoded tensors
    on the device of the model's layer, growing the format's way: :mod:`kvtool.hf.live`), ``dense`` (decoded
    tensors, where a dense cache can stand in for the file), ``attend`` (the compressed prefix through
    kvtool's attention function, new tokens dense) or ``ring`` (new tokens through the format's ring
    buffer).
    ``hold_last``: leave the file's last token out of the cache so it can be fed again (a
    continuation without new prompt tokens)."""
    from transformers import DynamicCache

    path = Path(str(path))
    if mode not in MODES:
        raise UsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode in ("attend", "ring", "live") and not isinstance(obj, CompressedCache):
        raise UsageError(f"{path} is a capture: it has no compressed prefix to attend through")
    if mode == "ring" and not obj.fmt.appends_tokens:
        raise UsageError(f"{path}: format {obj.format} has no ring buffer (its module offers no append_token); use attend")
    if mode == "dense" and isinstance(obj, CompressedCache) and obj.fmt.selects:
        raise UsageError(f"{path}: format {obj.format} selects tokens per query; a dense cache cannot stand in for it")
    check_model(model, obj.facts, path)
    check_all_layers(obj.layer_indices, obj.facts.num_layers, path)
    dtype = next(model.parameters()).dtype
    where = layer_devices(model)  # layer i's cache sits on layer i's device (one, or a device map's)
    if mode == "auto":
        if isinstance(obj, KVCache):
            mode = "dense"
        else:  # a format's own live layer; a ring of a format without one; else the generic live prefix
            mode = "ring" if obj.fmt.appends_tokens and not obj.fmt.live_grows else "live"
    if mode == "live":
        from kvtool.hf.live import live_cache_from  # deferred: the live layers import the formats' kernels

        if hold_last and not any(t.keys.shape[2] for t in obj.tails.values()):
            raise UsageError(f"{path} has no held-out tokens after its compressed prefix: give --prompt text to continue from")
        return live_cache_from(obj, model, hold_last)
    if mode == "dense":
        dense = dense_of(obj, path, "hf")
        data = [(dense.layers[i].keys.to(where[i], dtype), dense.layers[i].values.to(where[i], dtype)) for i in range(obj.facts.num_layers)]
        cache = DynamicCache(ddp_cache_data=data, config=model.config)
        if hold_last:
            cache.crop(-1)
        return cache
    if hold_last and not any(t.keys.shape[2] for t in obj.tails.values()):
        raise UsageError(f"{path} has no held-out tokens after its compressed prefix: give --prompt text to continue from")
    if mode == "ring":
        return ring_cache(obj, model, hold_last)
    f = obj.facts
    b = int(obj.token_ids.shape[0])
    data = []
    for i in range(f.num_layers):
        device = where[i]
        placeholder = torch.zeros(b, f.num_kv_heads, obj.prefix_tokens, f.head_dim, dtype=dtype, device=device)
        tail = obj.tails.get(i)
        keys, values = placeholder, placeholder
        if tail is not None:
            keys = torch.cat([placeholder, tail.keys.to(device, dtype)], dim=2)
            values = torch.cat([placeholder, tail.values.to(device, dtype)], dim=2)
        data.append((keys, values))
    cache = _dynamic_cache_class()(ddp_cache_data=data, config=model.config)
    cache.kvtool_prefix = CompressedPrefix(obj.fmt, obj.layers, obj.prefix_tokens).to(where)
    if hold_last:
        cache.crop(-1)
    use_kvtool_attention(model)
    return cache


def ring_cache(cc: CompressedCache, model: Any, hold_last: bool = False) -> Any:
    """A ``DynamicCache`` whose layers are :class:`RingLayer` s: the format's slots, with the
    held-out tail already written into the ring (all but its last token with ``hold_last``)."""
    from transformers import DynamicCache

    where = layer_devices(model)
    append = cc.fmt.append_token
    cache = DynamicCache(config=model.config)
    ring_layer = _ring_layer_class()
    for i in range(cc.facts.num_layers):
        enc, device = cc.layers[i], where[i]
        ring = RingState(cc.fmt, append, Encoded({n: t.to(device).clone() for n, t in enc.tensors.items()}, dict(enc.meta)))
        tail = cc.tails.get(i)
        if tail is not None:
            stop = tail.keys.shape[2] - (1 if hold_last else 0)
            with device_guard(device):
                ring.push(tail.keys[:, :, :stop].to(device), tail.values[:, :, :stop].to(device))
        cache.layers[i] = ring_layer(i, ring)
    use_kvtool_attention(model)
    return cache


def to_hf_cache(path: str | Path, model: Any, mode: str = "auto", hold_last: bool = False) -> Any:
    """A transformers cache from a kvtool file (capture, compressed, or ``export --to hf``) for
    ``model`` (a transformers causal LM whose shapes match the file's model facts).

    A compressed file becomes a live cache (``mode="live"``, :mod:`kvtool.hf.live`): each layer
    holds the format's encoded tensors on the device of the model's layer (one device, or each
    layer's GPU when accelerate spread the model), attends through the format's kernel
    (CUDA) or torch reference, and encodes new tokens the format's way. A capture becomes a
    ``DynamicCache`` of keys/values ``[B, Hkv, T, D]`` in the model's dtype on its layers' devices, for every
    layer (a capture that lacks layers is refused). Continue with
    ``model.generate(continuation_ids(path, new_ids), cache=cache)`` (``past_key_values=`` on
    older transformers). For selection formats the model is switched to kvtool's attention
    function (module docstring)."""
    return cache_from(read_kv_file(Path(path)), model, path, mode, hold_last)


def continuation_ids(token_ids: torch.Tensor, new_ids: list[int] | torch.Tensor) -> torch.Tensor:
    """``[B, T + N]``: the file's ``token_ids`` ``[B, T]`` followed by the same N new ids per row."""
    new = torch.as_tensor(new_ids, dtype=torch.int64).reshape(1, -1).expand(token_ids.shape[0], -1)
    return torch.cat([token_ids.to(torch.int64), new], dim=1)


def model_spec(obj: KVCache | CompressedCache, path: Path) -> str | None:
    """What :func:`kvtool.hf.models.load` should load for the file: the embedded model, the capture's
    HF folder or GGUF file, or the ``random:<shape>`` model that made it. A path named by the file's metadata is used only when it is a local,
    plain (not symlinked) folder holding config.json or a plain ``.gguf`` file; nothing is fetched.
    UsageError for synthetic files (no model) and for models not found here."""
    f = obj.facts
    info = obj.info if isinstance(obj.info, dict) else {}
    source_info = info.get("source_info") if isinstance(info.get("source_info"), dict) else {}
    if f.source == "embedded":
        return None
    for candidate in (info.get("model_path"), source_info.get("model_path"), f.name):
        if isinstance(candidate, str) and candidate and plain_model_path(Path(candidate)):
            return candidate
        if f.source == "random" and isinstance(candidate, str) and candidate.startswith(shapes.RANDOM_PREFIX) and candidate[len(shapes.RANDOM_PREFIX):] in shapes.SHAPES:
            return candidate  # random weights of a named shape: rebuilt, nothing read from disk
    if f.source == "synthetic":
        raise UsageError(f"{path} holds synthetic tensors made without a model; pass --model")
    raise UsageError(f"{path} was made by {f.name}, which is not found here as a local model folder or .gguf file; pass --model with a local copy")


def plain_model_path(candidate: Path) -> bool:
    """True for a local folder with config.json or a regular ``.gguf`` file, neither a symlink."""
    try:
        if candidate.is_symlink():
            return False
        if candidate.is_dir():
            return (candidate / "config.json").is_file()
        return candidate.is_file() and candidate.suffix.lower() == ".gguf"
    except OSError:
        return False


def cache_mode(cache: Any) -> str:
    """``live``, ``dense``, ``attend`` or ``ring``: how a cache from :func:`cache_from` carries the file."""
    from kvtool.hf.live import is_live  # deferred: the live layers import the formats' kernels

    if is_live(cache):
        return "live"
    if getattr(cache, "kvtool_prefix", None) is not None:
        return "attend"
    if any(isinstance(getattr(layer, "ring", None), RingState) for layer in cache.layers):
        return "ring"
    return "dense"


@torch.no_grad()
def generate(path: str | Path, prompt: str = "", model: str | None = None, max_new_tokens: int = 32, device: str = "auto", loaded: tuple[Any, Any] | None = None, mode: str = "auto") -> dict[str, Any]:
    """Greedy continuation of a kvtool file: its cached tokens, then ``prompt``, then
    ``max_new_tokens`` tokens (fewer if the model stops). ``loaded`` = (model, tokenizer) skips
    loading; ``device``: where the model runs (auto: the first GPU, or, for a model too large for
    it, every visible GPU through accelerate's device map, each layer's cache beside its layer:
    :func:`kvtool.hf.models.load_on_devices`; a list such as ``cuda:0,cuda:1`` picks the GPUs).
    A model without a tokenizer (``random:<shape>``) continues the cached tokens only (no
    ``prompt``; empty ``text``). Returns text, token ids, the generation's wall time and where
    the model's layers ran."""
    path = Path(path)
    if max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    devices = resolve_devices(device)  # checked before the model loads
    obj = read_kv_file(path)
    if isinstance(obj, KVCache) and obj.attention_mask is not None and bool((obj.attention_mask == 0).any()):
        raise UsageError(f"{path} holds a left-padded batch; generate needs equal-length prompts (recapture with --align truncate)")
    if loaded is None:
        spec = model if model is not None else model_spec(obj, path)
        if model is None:
            # the file chose the model: say which one is loaded, before anything of it is read
            print(f"loading model {spec or models.EMBEDDED_NAME} (named by {path})", file=sys.stderr)
        mdl, tokenizer, source = models.load_on_devices(spec, devices)
        model_name = source.name
    else:
        mdl, tokenizer = loaded
        model_name = getattr(mdl.config, "_name_or_path", "") or type(mdl).__name__
    check_model(mdl, obj.facts, path)
    if isinstance(obj, KVCache):  # same shapes are not the same model: it must make the capture's keys
        check_model_reproduces(mdl, obj, model_name)
    if prompt and tokenizer is None:
        raise UsageError(f"model {model_name} has no tokenizer: --prompt needs one (leave it out to continue the cached tokens)")
    new_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    cache = cache_from(obj, mdl, path, mode, hold_last=not new_ids)
    ids = continuation_ids(obj.token_ids, new_ids)
    dev = mdl.get_input_embeddings().weight.device  # where the ids enter (the first GPU of a device map)
    pad = None if tokenizer is None else (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    start = time.perf_counter()
    out = mdl.generate(
        ids.to(dev),
        attention_mask=torch.ones_like(ids).to(dev),
        **cache_kwargs(mdl, cache),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=pad if pad is not None else getattr(mdl.generation_config, "eos_token_id", None),
    )
    seconds = time.perf_counter() - start
    generated = out[:, ids.shape[1] :].cpu()
    return {
        "file": str(path),
        "model": model_name,
        "mode": cache_mode(cache),
        "format": getattr(obj, "format", "capture"),
        "cached_tokens": int(obj.token_ids.shape[1]),
        "prompt": prompt,
        "prompt_tokens": len(new_ids),
        "new_token_ids": generated.tolist(),
        "text": [tokenizer.decode(row, skip_special_tokens=True) if tokenizer is not None else "" for row in generated],
        "seconds": round(seconds, 3),
        "model_device": model_device_text(mdl),
    }
