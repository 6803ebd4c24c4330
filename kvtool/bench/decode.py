"""End-to-end decode measurements: a model generating from each format's live cache, against dense.

What one measurement does (:func:`measure`), for a model, a provider (a dense baseline or a format
spec), a batch and a context length:

1. every layer's cache is filled with ``context`` random tokens (seeded normal keys / values of the
   model's shape and dtype; queries of the last 32 positions for formats that read them) and made live:
   the format encodes the layer on the model's device (``Format.live_from_dense``) and only the encoded
   tensors stay; the dense baselines hold a preallocated cache (torch SDPA over it, or FlashInfer's
   paged decode with its pages of 16);
2. two greedy decode steps run eagerly (``model(input_ids=last token, cache=live cache)``, the next
   token the argmax of the logits, fed back on the device; positions held and advanced on the device:
   :func:`decode_step`), then one step is captured in a CUDA graph
   and its replays are timed with CUDA events (median, 10th / 90th percentiles). Every provider gets
   the same treatment; a step that cannot be captured is timed as eager launches (``method``). A
   replay writes its token into the same cache position, so the step is measured at that context;
3. the attention alone: the 32 layers' live steps captured in a second graph, timed the same way;
   ``attention_share`` = its time / the step's time;
4. memory: the peak of ``torch.cuda.max_memory_allocated`` from the cache's construction to the last
   replay, less what was allocated before (the weights), against the bytes the live layers hold
   (``stored_bytes``) and the workspace their docs state (``workspace_bytes``, the largest layer's,
   plus the model's activations for one step);
5. the format's own growth, after the memory is read: the step captured again and replayed through
   :class:`~kvtool.bench.generation.GrowthLoop` (replays append on the device; every filled block /
   group is encoded eagerly between replays, as a serving loop would); ``encode_us_per_token`` is
   the median over ``encode_repeats`` spans of at least ``chunk`` tokens of the encodes' time per
   decoded position, after an untimed warm-up encode (:func:`~kvtool.bench.generation.growth_cost`
   says how it is timed); ``encode_step_share`` = that / the step's time;
6. with ``generate_tokens`` N: N greedy tokens through the same loop, encodes included, after N
   untimed ones (first-use compilation; :func:`~kvtool.bench.generation.generate`):
   ``generate_tokens_per_s``, ``generate_encode_share`` and ``generate_vs_step`` (its tokens/s over
   the replayed step's).

Tokens per second = batch / step time. Without CUDA the same runs eagerly on the CPU (under
``TRITON_INTERPRET=1``: a functional check; the times mean nothing).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvtool.core.cache import LayerKV
from kvtool.bench.harness import percentile
from kvtool.bench.generation import GrowthLoop, capture, chunk_of, generate, growth_cost
from kvtool.core.errors import UsageError
from kvtool.formats._live import DenseLive, LiveLayer
from kvtool.formats.base import get_format
from kvtool.hf.interface import cache_kwargs
from kvtool.hf.attention import clear_handovers
from kvtool.hf.live import live_layers, make_live_layer, prepare, reserve, resolve_layer_specs, room

DENSE_SDPA = "dense/sdpa"
DENSE_FLASHINFER = "dense/flashinfer"
DENSE = (DENSE_SDPA, DENSE_FLASHINFER)
OBS_WINDOW = 32  # query positions given to formats that read queries (SnapKV's observation window)
ACTIVATION_BYTES_PER_ROW = 64  # bytes of one step's activations per (sequence, hidden unit), a bound
LOGIT_BYTES = 4  # float32 logits and their argmax per (sequence, vocabulary entry)


@dataclass
class ModelInfo:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    dtype: torch.dtype
    device: torch.device
    weights_bytes: int

    @classmethod
    def of(cls, model: Any) -> "ModelInfo":
        cfg = model.config
        heads = int(cfg.num_attention_heads)
        p = next(model.parameters())
        return cls(int(cfg.num_hidden_layers), heads, int(getattr(cfg, "num_key_value_heads", None) or heads),
                   int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads), int(cfg.hidden_size), int(cfg.vocab_size), p.dtype, p.device,
                   sum(t.numel() * t.element_size() for t in model.parameters()))

    def dense_bytes(self, batch: int, context: int) -> int:
        """Bytes of a dense fp cache of ``context`` tokens (keys and values, every layer)."""
        return 2 * self.layers * batch * self.kv_heads * context * self.head_dim * self.dtype.itemsize

    def activation_bytes(self, batch: int) -> int:
        """A bound on one decode step's activations outside attention (hidden states, MLP, logits)."""
        return batch * (self.hidden * ACTIVATION_BYTES_PER_ROW + self.vocab * LOGIT_BYTES * 2)


# ----------------------------------------------------------------------------- FlashInfer dense baseline


class FlashInferPlan:
    """One ``BatchDecodeWithPagedKVCacheWrapper`` shared by every layer (tensor cores, CUDA-graph
    buffers, NHD pages): planned for a cache length on the host before a step, run inside it."""

    def __init__(self, fi: Any, batch: int, pages_per_seq: int, page_size: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 scale: float, device: torch.device) -> None:
        self.fi, self.batch, self.pps, self.page_size = fi, batch, pages_per_seq, page_size
        self.heads, self.kv_heads, self.head_dim, self.dtype, self.scale = heads, kv_heads, head_dim, dtype, scale
        self.workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(batch * pages_per_seq, dtype=torch.int32, device=device)
        self.last = torch.zeros(batch, dtype=torch.int32, device=device)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                                                             paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
                                                             paged_kv_last_page_len_buffer=self.last)
        self.planned: int | None = None

    def plan(self, length: int) -> None:
        if self.planned == length:
            return
        n = -(-length // self.page_size)
        indptr = torch.arange(self.batch + 1, dtype=torch.int32) * n
        indices = (torch.arange(self.batch, dtype=torch.int32)[:, None] * self.pps + torch.arange(n, dtype=torch.int32)[None]).reshape(-1)
        last = torch.full((self.batch,), length - (n - 1) * self.page_size, dtype=torch.int32)
        self.wrapper.plan(indptr, indices, last, self.heads, self.kv_heads, self.head_dim, self.page_size, pos_encoding_mode="NONE",
                          q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        self.planned = length


class FlashInferDenseLive(LiveLayer):
    """The dense baseline in FlashInfer's paged layout: pages ``[B * pages_per_seq, 16, Hkv, D]`` for
    keys and values (each sequence's pages consecutive), one query token through the shared
    :class:`FlashInferPlan`. A bench provider only (its ``fmt`` is the dense format)."""

    def __init__(self, plan: FlashInferPlan, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.fmt = get_format("dense")
        self.shared = plan
        b, h, t, d = keys.shape
        ps, pps = plan.page_size, plan.pps
        self.k = keys.new_zeros((b * pps, ps, h, d))
        self.v = values.new_zeros((b * pps, ps, h, d))
        self.seq_view(self.k)[:, :t] = keys.transpose(1, 2)
        self.seq_view(self.v)[:, :t] = values.transpose(1, 2)
        self.n = t

    def seq_view(self, pages: torch.Tensor) -> torch.Tensor:
        b = self.shared.batch
        return pages.view(b, self.shared.pps * self.shared.page_size, *pages.shape[2:])

    @property
    def tokens(self) -> int:
        return self.n

    def reference_tensor(self) -> torch.Tensor:
        return self.k

    def encoded_shape(self) -> tuple[int, int, int, int]:
        return self.shared.batch, self.shared.kv_heads, self.n, self.shared.head_dim

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        m = keys.shape[2]
        if self.n + m > self.shared.pps * self.shared.page_size:
            raise UsageError("the FlashInfer baseline's pages are full")
        self.seq_view(self.k)[:, self.n:self.n + m] = keys.transpose(1, 2)
        self.seq_view(self.v)[:, self.n:self.n + m] = values.transpose(1, 2)
        self.n += m

    def room(self) -> int:
        return self.shared.pps * self.shared.page_size - self.n - 1

    def prepare(self, query_tokens: int = 1) -> None:
        self.shared.plan(self.n + query_tokens)

    def attend_one(self, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.shared.plan(self.n)
        out = self.shared.wrapper.run(q[:, :, 0].contiguous(), (self.k, self.v))
        return out[:, :, None]

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        from kvtool.core.attention import attend_partial  # deferred: only the eager multi-token path uses it

        k = self.seq_view(self.k)[:, :self.n].transpose(1, 2)
        v = self.seq_view(self.v)[:, :self.n].transpose(1, 2)
        return attend_partial(q, k, v, scale)

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    def workspace_bytes(self, query_rows: int) -> int:
        """The shared plan's buffers (FlashInfer's 128 MiB workspace and page tables), held for
        the whole run, and the step's output."""
        plan = self.shared
        held = sum(t.numel() * t.element_size() for t in (plan.workspace, plan.indptr, plan.indices, plan.last))
        return held + plan.batch * plan.heads * plan.head_dim * self.k.element_size()

    def encoded(self):
        k = self.seq_view(self.k)[:, :self.n].transpose(1, 2).contiguous()
        v = self.seq_view(self.v)[:, :self.n].transpose(1, 2).contiguous()
        return self.fmt.encode(LayerKV(k, v), self.fmt.Params())


# ----------------------------------------------------------------------------- building live caches


def random_layer(info: ModelInfo, batch: int, context: int, seed: int, queries: bool) -> LayerKV:
    """Seeded normal keys / values ``[B, Hkv, T, D]`` on the model's device (one outlier key channel,
    as real keys have); with ``queries`` a query tensor ``[B, H, T, D]`` whose last positions hold
    one random query per head (an expanded view: no memory per position)."""
    g = torch.Generator(device=info.device).manual_seed(seed)
    shape = (batch, info.kv_heads, context, info.head_dim)
    k = torch.randn(shape, generator=g, device=info.device, dtype=info.dtype)
    k[..., 3] *= 4
    v = torch.randn(shape, generator=g, device=info.device, dtype=info.dtype)
    q = None
    if queries:
        q = torch.randn((batch, info.heads, 1, info.head_dim), generator=g, device=info.device, dtype=info.dtype).expand(batch, info.heads, context, info.head_dim)
    return LayerKV(k, v, q)


def build_cache(model: Any, info: ModelInfo, provider: str, batch: int, context: int, headroom: int = 96, seed: int = 0) -> tuple[Any, Any]:
    """A transformers cache whose layers are live layers of ``provider`` holding ``context`` random
    tokens per sequence; and the shared FlashInfer plan (or None)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    fi_plan = None
    if provider == DENSE_FLASHINFER:
        fi = flashinfer_module()
        if fi is None:
            raise UsageError("FlashInfer is not installed (pip install 'kvtool[bench]')")
        pps = -(-(context + headroom) // 16)
        fi_plan = FlashInferPlan(fi, batch, pps, 16, info.heads, info.kv_heads, info.head_dim, info.dtype, 1.0 / math.sqrt(info.head_dim), info.device)
        specs = None
    elif provider == DENSE_SDPA:
        specs = None
    else:
        specs = resolve_layer_specs(provider, info.layers)
    for i in range(info.layers):
        reads = specs is not None and specs(i)[0].reads_queries(specs(i)[1])
        layer = random_layer(info, batch, context, seed * 1000 + i, reads)
        if provider == DENSE_SDPA:
            live: LiveLayer = DenseLive(get_format("dense"), layer.keys, layer.values, capacity=context + headroom)
        elif provider == DENSE_FLASHINFER:
            live = FlashInferDenseLive(fi_plan, layer.keys, layer.values)
        else:
            fmt, params = specs(i)
            live = fmt.live_from_dense(layer, params)
        del layer
        cache.layers[i] = make_live_layer(i, live, context)
    return cache, fi_plan


def flashinfer_module():
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return None
    return flashinfer


# ----------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device, runs: int, graph: bool) -> tuple[list[float], str, str | None]:
    """Per-run milliseconds of ``fn`` (a CUDA-graph replay when ``graph`` and it can be captured,
    else eager calls), the method, and why capture failed (or None)."""
    call, method, why = capture(fn, device, graph)
    times = []
    if device.type == "cuda":
        call()
        torch.cuda.synchronize(device)
        for _ in range(runs):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            call()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
    else:
        for _ in range(runs):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return times, method, why


def measure(model: Any, provider: str, batch: int, context: int, runs: int = 20, graph: bool = True, growth: bool = True,
            generate_tokens: int = 0, encode_repeats: int = 5) -> dict[str, Any]:
    """One provider at one batch and context (module docstring): a dict of measured numbers.
    ``generate_tokens``: also time that many greedy tokens with every encode (step 6);
    ``encode_repeats``: spans the growth cost is the median of (step 5; 0: not measured)."""
    try:
        return _measure(model, provider, batch, context, runs, graph, growth, generate_tokens, encode_repeats)
    finally:
        clear_handovers()  # an interrupted step leaves none behind to keep a cache alive


def decode_step(model: Any, ids: torch.Tensor, cache: Any, kwargs: dict[str, Any]) -> Callable[[], None]:
    """One greedy decode step as a CUDA graph can replay it: the model on ``ids`` ``[B, 1]`` int64
    (its argmax written back into ``ids``) at positions held on the device, ``[B, 1]`` from the
    cache's length now, advanced by one on the device each step. Without them transformers takes the
    position from the cache's host count, which a captured graph freezes: replays would then rotate
    every new query and key (RoPE) to the captured position."""
    pos = torch.full_like(ids, int(cache.get_seq_length()))

    def step() -> None:
        out = model(input_ids=ids, position_ids=pos, use_cache=True, **kwargs)
        ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        pos.add_(1)

    return step


@torch.no_grad()
def _measure(model: Any, provider: str, batch: int, context: int, runs: int, graph: bool, growth: bool, generate_tokens: int,
             encode_repeats: int) -> dict[str, Any]:
    info = ModelInfo.of(model)
    dev = info.device
    cuda = dev.type == "cuda"
    _sync(dev)
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    cache, fi_plan = build_cache(model, info, provider, batch, context)
    _sync(dev)
    build_s = time.perf_counter() - t0
    lives = live_layers(cache)
    stored = sum(live.stored_bytes() for live in lives)
    rows = batch * info.heads
    workspace = max(live.workspace_bytes(rows) for live in lives) + info.activation_bytes(batch)
    if cuda:
        built_peak = torch.cuda.max_memory_allocated(dev) - base
        torch.cuda.reset_peak_memory_stats(dev)
    ids = torch.zeros((batch, 1), dtype=torch.int64, device=dev)
    kwargs = cache_kwargs(model, cache)
    step = decode_step(model, ids, cache, kwargs)

    for _ in range(2):
        step()
    _sync(dev)
    reserve(cache, 2 * runs + 8)  # the step's replays and the attention's: layers that append on the device advance
    if room(cache) < 8:
        raise UsageError(f"{provider}: the live layers would encode a block inside the timed steps (room {room(cache)})")
    prepare(cache, 1)
    times, method, why = time_fn(step, dev, runs, graph)
    # the attention alone: every layer's live step on fixed inputs
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn((batch, info.heads, 1, info.head_dim), generator=g, device=dev, dtype=info.dtype)
    kv = torch.randn((batch, info.kv_heads, 1, info.head_dim), generator=g, device=dev, dtype=info.dtype)
    scale = 1.0 / math.sqrt(info.head_dim)

    def attention() -> None:
        for live in lives:
            live.step(q, kv, kv, scale)

    attention()
    prepare(cache, 1)
    att_times, att_method, _ = time_fn(attention, dev, runs, graph)
    peak = (torch.cuda.max_memory_allocated(dev) - base) if cuda else None
    step_ms = statistics.median(times)
    att_ms = statistics.median(att_times)
    rec = {
        "provider": provider, "batch": batch, "seq": context, "method": method, "capture_error": why,
        "median_us": step_ms * 1e3, "p10_us": percentile(times, 0.1) * 1e3, "p90_us": percentile(times, 0.9) * 1e3, "runs": len(times),
        "tokens_per_s": batch / (step_ms * 1e-3), "ms_per_token": step_ms / batch,
        "attention_us": att_ms * 1e3, "attention_method": att_method, "attention_share": att_ms / step_ms,
        "stored_bytes": stored, "dense_kv_bytes": info.dense_bytes(batch, context), "storage_ratio": stored / info.dense_bytes(batch, context),
        "workspace_bytes": workspace, "weights_bytes": info.weights_bytes, "peak_bytes": peak,
        "build_peak_bytes": built_peak if cuda else None, "build_s": build_s,
        "peak_over_stated": (peak / (stored + workspace)) if peak is not None else None,
    }
    chunk = max((chunk_of(live) for live in lives), default=0)
    rec["chunk"] = chunk or None
    if generate_tokens or (growth and chunk and encode_repeats):
        loop = GrowthLoop(cache, step, dev, graph)
        if generate_tokens:
            rec.update(generate(loop, generate_tokens, batch))
            rec["generate_vs_step"] = rec["generate_tokens_per_s"] / rec["tokens_per_s"]
        if growth and chunk and encode_repeats:
            rec.update(growth_cost(loop, encode_repeats))
            rec["encode_step_share"] = rec["encode_us_per_token"] / rec["median_us"]
        rec["generate_recaptures"] = loop.recaptures
        del loop
    del cache, lives, fi_plan
    if cuda:
        torch.cuda.empty_cache()
    return rec


def stored_per_sequence(model: Any, provider: str, context: int) -> tuple[int, int]:
    """(stored bytes, workspace bound) of one sequence's live cache at ``context`` tokens (built at
    batch 1 and measured, not estimated from the format's nominal ratio)."""
    info = ModelInfo.of(model)
    cache, _ = build_cache(model, info, provider, 1, context)
    lives = live_layers(cache)
    stored = sum(live.stored_bytes() for live in lives)
    workspace = max(live.workspace_bytes(info.heads) for live in lives)
    del cache, lives
    if info.device.type == "cuda":
        torch.cuda.empty_cache()
    return stored, workspace


def largest_batch(model: Any, provider: str, context: int, budget: int) -> tuple[int, str]:
    """The largest batch whose live cache (stored bytes) and workspace (both scale with the batch)
    plus one step's activations fit ``budget`` bytes beside the weights, and what bounds it:
    ``budget``, or ``build`` where this bench cannot make the cache at that batch (it fills each
    layer from a dense random layer of the whole batch before encoding it, which must fit beside the
    layers made so far)."""
    info = ModelInfo.of(model)
    stored, ws = stored_per_sequence(model, provider, context)
    b = max(1, budget // max(1, stored))
    while b > 1 and b * (stored + ws) + info.activation_bytes(b) > budget:
        b -= 1
    if info.device.type != "cuda":
        return b, "budget"
    free = torch.cuda.mem_get_info(info.device)[0]
    dense_layer = info.dense_bytes(1, context) // info.layers
    bound = "budget"
    while b > 1 and b * (stored + 3 * dense_layer) > free:  # the dense layer, its encode's copies, the cache so far
        b, bound = b - 1, "build"
    return b, bound
