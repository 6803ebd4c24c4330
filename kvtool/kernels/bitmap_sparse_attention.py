"""Decode attention over a bitmap cache in layout version 2 (keys as token tiles, values as channel
tiles: :mod:`.bitmap_layout`), its encoder from pruned dense K/V, and a plain-torch reference of
the same maths.

Entry point: :func:`bitmap_sparse_attention` ``(q, cache, scale=None, backend="auto") -> (out,
lse)``, the partial of :mod:`kvtool.core.attention`: q ``[B, H, Tq, D]`` in the cache dtype (H a
multiple of Hkv; query head h reads KV head ``h // G``), out ``[B, H, Tq, D]`` float32, lse
``[B, H, Tq]`` float32 (natural log). All G * Tq query rows of a KV head are served by one pass
over its data; token-axis splits are merged by
:func:`kvtool.kernels.online_softmax.merge_split_partials`.

The call contract (what a decode loop relies on):

- **Checked once, planned once.** The first call on a cache (or :func:`prepare_attention`, e.g.
  right after loading) validates it and holds its stage plan on it (``cache.plan``: the stage
  capacities of :func:`stage_capacity`, aligned sources, and per query shape the walk, splits and
  rows per program). Later calls read the plan: no host syncs, no validation, the same speed as
  the tuned call (:func:`_tuned_attention`, the benchmarks' and tests' way to set knobs). A cache
  of fixed lengths whose tensors are replaced or written in place is checked again on its next
  call.
- **CUDA graphs.** On the CUDA backend (16-bit caches, head_dim <= 256, CUDA tensors) a call after
  the first can be captured in a CUDA graph and replayed; call once (or :func:`prepare_attention`)
  before the capture, as for any kernel that compiles on first use. The Triton backend is
  capturable for caches of fixed lengths.
- **Caches that grow** (``cache.lengths`` not None; :func:`.bitmap_layout.growable_cache`,
  :func:`.bitmap_layout.append_blocks`): every tensor is allocated for a capacity (compressed
  tokens in whole 64-token blocks, window tokens) and ``lengths`` (int32 ``[2]`` on the device)
  holds the compressed and window tokens in use. Each block's keys and values sit in a fixed slot
  of ``nz`` (``offsets[g] = g * slot``, set at allocation and never changed), so appending a block
  writes its run, its bitmaps and ``lengths[0] += 64`` on the device, and a window token is written
  at index ``lengths[1]`` of the window tensors followed by ``lengths[1] += 1``: no shape, offset
  or plan changes, no host sync. The CUDA kernels read ``lengths`` at the start of every program
  and spread the blocks in use over the splits planned for the capacity, so one plan and one
  captured graph serve every length. Attention does not depend on the order of tokens (positions
  are in the rotated keys), so the window may be refilled in any order. The plan checks the
  layout once (:func:`.bitmap_layout.validate_growable`); the appended blocks are trusted: each
  block's padded run must fit its slot, and lengths must stay within the capacities (the kernels
  clamp them there). The Triton backend reads the lengths on the host (one sync per call).

The maths (what :func:`sparse_attention_reference` spells out in torch): for each stored key
element (token t, channel c, value x) ``score[r, t] += x * q[r, c]``; softmax over tokens; for each
stored value element (token t, channel c, value x) ``out[r, c] += x * p[r, t]``. A v2 layout puts a
key row's bits along channels and a value tile's bits along tokens, so a thread that walks the set
bits of its word touches each stored element once and gathers the dense operand at its position.

Backends:

- ``cuda`` (:file:`bitmap_sparse_attention.cu`, built on first use with
  ``torch.utils.cpp_extension.load`` under the kvtool cache): the walk above, per thread, with the
  pair of 64-token blocks staged in shared memory by ``cp.async`` (keys and values as two load
  groups, each requested for the next pair as soon as this pair is done with it). Its cost follows
  the stored elements (a few instructions each) instead of the dense ones. Triton has no per-thread
  loop over a variable number of set bits nor a register-to-shared gather at a run-time position,
  which is what this needs (the expand-then-multiply Triton kernels cost about 13 instructions per
  dense element). At head_dim 64 and 128 it has a second, tensor-core walk
  (:file:`bitmap_sparse_attention_mma.cuh`, :func:`use_tensor_cores`): each thread expands its
  bitmap bits a nibble at a time straight into an mma operand, a cost per dense element (about 5
  instructions) that does not depend on the density, which wins from 25% density and in short
  launches.
- ``triton``: expands each 64-token block to dense tiles (the helpers of :mod:`.bitmap_attention`
  with the orientations swapped) and multiplies on the tensor cores; runs under the interpreter,
  for any head_dim and float32 caches.
- ``auto``: cuda for CUDA tensors of 16-bit dtype and head_dim <= 256, else triton.

Measured results and limits: docs/benchmarks.md (bitmap attention); both walks are bound by the
shared-memory pipe and instruction issue, not bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
import triton.language as tl

from kvtool.core.attention import attend_partial, default_scale
from kvtool.core.errors import UsageError
from kvtool.kernels.bitmap_attention import LOG2E, _expand_keys, _expand_values, check_query
from kvtool.kernels.bitmap_compress import encode, encode_cache
from kvtool.kernels.bitmap_layout import LAYOUT_V2, ORIENTATIONS, TILE, BitmapCache, BitmapTensor
from kvtool.kernels.common import check_device, cuda_extension, interpreting
from kvtool.kernels.online_softmax import attend_block, attend_dense_window, merge_split_partials, split_partials, store_split_partial

BACKENDS = ("auto", "triton", "cuda")
_SOURCE = Path(__file__).with_name("bitmap_sparse_attention.cu")


def encode_cache_v2(keys: torch.Tensor, values: torch.Tensor, window: int = 0, backend: str = "torch") -> BitmapCache:
    """Pruned keys/values ``[B, Hkv, T, D]`` -> a layout-v2 :class:`BitmapCache` whose last
    ``window`` tokens stay dense. ``backend`` ``torch`` / ``triton`` picks the encoder
    (:func:`.bitmap_compress.encode`, identical bytes)."""
    if keys.shape != values.shape:
        raise UsageError(f"keys {list(keys.shape)} and values {list(values.shape)} must have one shape")
    t = keys.shape[2]
    if not 0 <= window <= t:
        raise UsageError(f"window {window} must be between 0 and the {t} tokens")
    tc = t - window
    korient, vorient = ORIENTATIONS[LAYOUT_V2]
    ck = encode(keys[:, :, :tc].contiguous(), korient, backend)
    cv = encode(values[:, :, :tc].contiguous(), vorient, backend)
    ck.label, cv.label = "keys", "values"
    return BitmapCache(ck, cv, keys[:, :, tc:].contiguous(), values[:, :, tc:].contiguous(), version=LAYOUT_V2)


def convert_layout(cache: BitmapCache, version: int = LAYOUT_V2, backend: str = "torch") -> BitmapCache:
    """The same cache in layout ``version`` (decode, then encode the other way; bit-exact)."""
    if cache.version == version:
        return cache
    keys, values = cache.decode()
    w = cache.window_keys.shape[2]
    if version == LAYOUT_V2:
        return encode_cache_v2(keys, values, window=w, backend=backend)

    return encode_cache(keys, values, window=w, backend=backend)


def _stored_elements(bt: BitmapTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every stored element of ``bt``: (row = b * Hkv + h, token, channel, value), 1-D each,
    read from the bitmaps and the packed runs (not via the dense decode)."""
    nbt = bt.batch * bt.kv_heads * bt.blocks
    bits = bt.block_bits()  # [NBt, slots] in storage order
    g, slot = torch.nonzero(bits, as_tuple=True)
    rank = bits.to(torch.int64).cumsum(-1) - 1
    vals = bt.nz[bt.offsets[:-1][g] + rank[g, slot]]
    if bt.kind == "keys":  # channel tiles: slot = channel * 64 + token in block
        chan, tok = slot // TILE, slot % TILE
    else:  # token tiles: slot = token in block * (64 * DT) + channel
        width = bits.shape[1] // TILE if nbt else 1
        tok, chan = slot // width, slot % width
    return g // bt.blocks, (g % bt.blocks) * TILE + tok, chan, vals


def sparse_attention_reference(q: torch.Tensor, cache: BitmapCache, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of the element-wise maths (module docstring) in float64 for any layout
    version (a cache with room to grow: its part in use); same return as :func:`bitmap_sparse_attention`."""
    cache = cache.in_use()
    check_query(q, cache)
    b, h, tq, d = q.shape
    hkv, tc, w = cache.keys.kv_heads, cache.keys.tokens, cache.window_keys.shape[2]
    g = h // hkv
    scale = default_scale(d) if scale is None else scale
    qr = q.double().reshape(b * hkv, g * tq, d)  # rows of one KV head
    scores = torch.zeros(b * hkv, g * tq, tc + w, dtype=torch.float64, device=q.device)
    row, tok, chan, x = _stored_elements(cache.keys)
    scores[:, :, :tc].index_put_((row[:, None], torch.arange(g * tq, device=q.device)[None, :], tok[:, None]), x.double()[:, None] * qr[row, :, chan], accumulate=True)
    scores[:, :, tc:] = qr @ cache.window_keys.double().reshape(b * hkv, w, d).transpose(1, 2)
    scores = scores * scale
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None]) if tc + w else scores
    out = torch.zeros(b * hkv, g * tq, d, dtype=torch.float64, device=q.device)
    row, tok, chan, x = _stored_elements(cache.values)
    out.index_put_((row[:, None], torch.arange(g * tq, device=q.device)[None, :], chan[:, None]), x.double()[:, None] * p[row, :, tok], accumulate=True)
    out += p[:, :, tc:] @ cache.window_values.double().reshape(b * hkv, w, d)
    if tc + w == 0:
        lse = torch.full_like(lse, float("-inf"))
    return out.float().reshape(b, h, tq, d), lse.float().reshape(b, h, tq)


@triton.jit
def _sparse_attention_kernel(
    q_ptr, kbm_ptr, knz_ptr, koff_ptr, vbm_ptr, vnz_ptr, voff_ptr, wk_ptr, wv_ptr, acc_ptr, m_ptr, l_ptr,
    scale_log2, Tc, W, D, DT, NB, R, BPS, S,
    RB: tl.constexpr, RP: tl.constexpr, DP: tl.constexpr, DTP: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """Triton backend, one program per (KV head bh, split, chunk of RB query rows): token blocks
    [split * BPS, (split + 1) * BPS) (split < S) or the dense window (split == S). Keys (token
    tiles) expand to ``[64, DP]`` and values (channel tiles) to ``[DP, 64]``, transposed for the
    two products. q [B*Hkv, R, D]; int32 views of keys.bitmaps [B*Hkv, Tc, DT, 2] and
    values.bitmaps [B*Hkv, NB, D, 2]; acc float32 [B*Hkv, S+1, RP, DP]."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    rows = tl.program_id(2) * RB + tl.arange(0, RB)
    c = tl.arange(0, DP)
    t = tl.arange(0, 64)
    cmask = c < D
    rmask = rows < R
    q = tl.load(q_ptr + (bh * R + rows[:, None]) * D + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    m_i = tl.full([RB], float("-inf"), tl.float32)
    l_i = tl.zeros([RB], tl.float32)
    acc = tl.zeros([RB, DP], tl.float32)
    if split < S:
        blk_start = split * BPS
        blk_end = tl.minimum(blk_start + BPS, NB)
        bit3 = (tl.full([32], 1, tl.int32) << tl.arange(0, 32))[None, None, :]
        below3 = bit3 - 1
        for blk in range(blk_start, blk_end):
            g = bh * NB + blk
            tok = blk * 64 + t
            tmask = tok < Tc
            k = _expand_values(kbm_ptr, knz_ptr, koff_ptr, g, bh * Tc + tok, tmask, DT, bit3, below3, DP, DTP, USE_ASM)
            vt = _expand_keys(vbm_ptr, vnz_ptr, voff_ptr, g, c, cmask, D, bit3, below3, DP, USE_ASM)
            m_i, l_i, acc = attend_block(q, tl.trans(k), tl.trans(vt), tmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    else:
        m_i, l_i, acc = attend_dense_window(q, wk_ptr, wv_ptr, bh, W, D, c, cmask, m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    store_split_partial(acc_ptr, m_ptr, l_ptr, bh * (S + 1) + split, rows, rmask, c, acc, m_i, l_i, RP, DP)


def _cuda_extension():
    """The CUDA backend (:func:`kvtool.kernels.common.cuda_extension`: built on first use, cached)."""
    sources = [_SOURCE] + [_SOURCE.with_name(f"bitmap_sparse_attention_{t}.cu") for t in ("f16", "bf16")]
    return cuda_extension("bitmap_sparse_attention", sources, ("-O3", "--use_fast_math"))


def pick_backend(q: torch.Tensor, backend: str = "auto") -> str:
    """``cuda`` or ``triton`` for ``q`` (UsageError for an unknown name or cuda where it cannot run)."""
    if backend not in BACKENDS:
        raise UsageError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    interp = interpreting()
    can_cuda = q.is_cuda and not interp and q.shape[-1] <= 256
    if backend == "cuda" and not can_cuda:
        raise UsageError("the cuda backend needs CUDA tensors (not under TRITON_INTERPRET) and head_dim <= 256")
    if backend == "auto":
        return "cuda" if can_cuda and q.dtype in (torch.float16, torch.bfloat16) else "triton"
    return backend


def stage_capacity(cache: BitmapCache) -> tuple[int, int]:
    """Largest packed run, in elements, of two neighbouring 64-token blocks of one KV head, for keys
    and values: the CUDA backend's shared-memory staging size (one host sync)."""
    caps = []
    nb = cache.keys.blocks
    for bt in (cache.keys, cache.values):
        bh = bt.batch * bt.kv_heads
        if nb == 0 or bh == 0:
            caps.append(0)
            continue
        blk = torch.arange(0, nb, 2, device=bt.offsets.device)
        head = torch.arange(bh, device=bt.offsets.device)[:, None] * nb
        start = bt.offsets[head + blk]
        end = bt.offsets[head + torch.clamp(blk + 2, max=nb)]
        caps.append(int((end - start).max()))
    return caps[0], caps[1]


def default_splits(bh: int, blocks: int, programs_per_split: int, device: torch.device, per_sm: int = 8) -> int:
    """Token-axis splits per KV head, 1 on the CPU: :func:`plan_splits` with ``per_sm`` programs
    resident per SM (the CUDA backend's shared memory allows 8)."""
    if blocks == 0 or device.type != "cuda":
        return 1
    return plan_splits(bh * programs_per_split, blocks, torch.cuda.get_device_properties(device).multi_processor_count * per_sm)


def plan_splits(programs: int, blocks: int, wave: int) -> int:
    """Splits per KV head for ``programs`` per split (KV heads × row chunks), ``blocks`` 64-token
    blocks per head and ``wave`` programs resident at once: at most 4 pairs of blocks per program
    (shorter programs balance the SMs better, and their loads and work overlap across programs),
    but at least half a wave of programs (fewer leave SMs idle), at most one split per pair.
    Measured on the H100 against the best of 4–256 splits: within 2% at batch 1–32, 4k and 32k
    (docs/benchmarks.md)."""
    pairs = max(1, -(-blocks // 2))
    programs = max(programs, 1)
    return min(pairs, max(-(-pairs // 4), -(-wave // (2 * programs))))


PAIRED_DENSITY = 0.4


def stage_density(kcap: int, vcap: int, head_dim: int) -> float:
    """The fraction of its elements that the densest pair of blocks stores (:func:`stage_capacity`'s
    ``kcap``, ``vcap`` over the 2 x 64 x head_dim elements of a pair): what the walk choices test."""
    return max(kcap, vcap) / (2 * TILE * head_dim)


def walk_mode(kcap: int, vcap: int, head_dim: int, accumulate: str = "fp32", paired: bool | None = None) -> int:
    """The CUDA walk (``Walk`` in :file:`bitmap_sparse_attention.cuh`): 2 for fp16 sums, else 1
    (values read as aligned pairs) when ``paired`` or, for None, when the densest pair of blocks
    (:func:`stage_capacity`) stores at least ``PAIRED_DENSITY`` of its elements, else 0. On the H100
    the pairs take batch 8 / 32k from 475 to 403 us at 50% sparsity and cost 2% at 70%."""
    if accumulate == "fp16":
        return 2
    if paired is None:
        paired = stage_density(kcap, vcap, head_dim) >= PAIRED_DENSITY
    return int(bool(paired))


TENSOR_CORE_DENSITY = 0.25
TENSOR_CORE_SHORT = 4096  # pairs of blocks in a whole launch (KV heads x pairs per head)
MMA_ROWS = 8  # query rows per program of the tensor-core walk (the mma's N)
WALK_MMA = 3
WALK_MMA_BUFFERED = 4  # the tensor-core walk reading each run through a two-word buffer
BUFFERED_DENSITY = 0.4


def use_tensor_cores(kcap: int, vcap: int, head_dim: int, tensor_cores: bool | None = None, bits_global: bool = False,
                     launch_pairs: int | None = None) -> bool:
    """Whether the CUDA backend takes its tensor-core walk (``WALK_MMA``,
    :file:`bitmap_sparse_attention_mma.cuh`), which serves head_dim 64 and 128 with staged bitmaps. None:
    when the densest pair of blocks (:func:`stage_capacity`) stores at least
    ``TENSOR_CORE_DENSITY`` of its elements, or when the launch walks at most
    ``TENSOR_CORE_SHORT`` pairs of blocks (``launch_pairs``: KV heads x pairs per head). The tensor
    cores' cost per dense element does not depend on the density, the scalar walk's follows the
    stored elements; and a short launch is bound by the latency of each program, which the tensor
    cores shorten. On the H100 at batch 8 / 32k (bulk copies) it takes 0.78x the scalar walk's time
    at 75% sparsity, 1.01x at 80% (1.03x at batch 32) and 1.27x at 90% (docs/benchmarks.md)."""
    eligible = head_dim in (64, 128) and not bits_global
    if tensor_cores and not eligible:
        raise UsageError("the tensor-core walk serves head_dim 64 and 128 with staged bitmaps (bits_global=False)")
    if tensor_cores is None:
        dense = stage_density(kcap, vcap, head_dim) >= TENSOR_CORE_DENSITY
        short = launch_pairs is not None and launch_pairs <= TENSOR_CORE_SHORT
        return eligible and (dense or short)
    return bool(tensor_cores)


def use_bulk_copies(launch_pairs: int, capability: tuple[int, int], bulk_copies: bool | None = None, key_rows_16: bool = True) -> bool:
    """Whether the tensor-core walk stages its pairs with bulk copies (``cp.async.bulk``, sm_90+: one
    thread, one mbarrier per half) instead of cp.async by every thread. None: on sm_90+ when the
    launch walks more than ``TENSOR_CORE_SHORT`` pairs of blocks. Bulk copies drop the staging's
    per-thread address arithmetic, but their loads land later: on the H100 they take batch 8 / 32k
    at 70% sparsity from 242 to 220 us and batch 32 from 888 to 780 us, while the short launches of
    batch 8 / 4k (43 -> 47 us) and batch 1 / 32k (46 -> 49 us) are slower (docs/benchmarks.md).
    ``key_rows_16``: a KV head's key bitmaps span a multiple of 16 bytes (tokens x ceil(D / 64)
    words even); bulk copies move whole 16-byte units from 16-byte aligned addresses, so a cache
    without it (head_dim 64 with an odd number of compressed tokens) stages with cp.async whatever
    ``bulk_copies`` says (a knob changes speed only)."""
    able = tuple(capability) >= (9, 0)
    if bulk_copies and not able:
        raise UsageError(f"bulk copies need an sm_90 or newer GPU (this one is sm_{capability[0]}{capability[1]})")
    if not key_rows_16:
        return False
    if bulk_copies is None:
        return able and launch_pairs > TENSOR_CORE_SHORT
    return bool(bulk_copies)


def mma_walk(kcap: int, vcap: int, head_dim: int, bulk: bool) -> int:
    """The tensor-core walk's mode: ``WALK_MMA_BUFFERED`` (with bulk staging, where it was measured)
    when the densest pair of blocks (:func:`stage_capacity`) stores at least ``BUFFERED_DENSITY`` of
    its elements, else ``WALK_MMA``. The buffer reads each staged word once per walk instead of once
    per nibble that touches it, for more instructions: on the H100 at batch 8 / 32k it takes 50%
    sparsity from 278 to 270 us but 70% from 220 to 230 us (docs/benchmarks.md)."""
    return WALK_MMA_BUFFERED if bulk and stage_density(kcap, vcap, head_dim) >= BUFFERED_DENSITY else WALK_MMA


@dataclass
class _Plan:
    """What :func:`prepare_attention` holds on a cache (``BitmapCache.plan``): the identity of the
    tensors it checked (``key``), the stage capacities (:func:`stage_capacity`), 16-byte aligned
    sources for the CUDA stage, and launch choices per query shape and knobs."""

    key: tuple
    kcap: int
    vcap: int
    sources: tuple | None = None
    launches: dict = field(default_factory=dict)
    empty: dict = field(default_factory=dict)


def _tensors(cache: BitmapCache) -> tuple[torch.Tensor, ...]:
    k, v = cache.keys, cache.values
    return (k.nz, k.bitmaps, k.offsets, v.nz, v.bitmaps, v.offsets, cache.window_keys, cache.window_values)


def _plan_key(cache: BitmapCache) -> tuple:
    """The tensors' storage, shapes and, for caches of fixed lengths, their in-place versions (a
    cache written in place is checked again); a cache with room to grow is checked once, since its
    appends change its data, never its offsets or shapes."""
    ts = _tensors(cache)
    key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in ts) + (cache.keys.tokens, cache.version, cache.lengths is None)
    if cache.lengths is None:
        key += tuple(t._version for t in ts)
    return key


def prepare_attention(cache: BitmapCache) -> BitmapCache:
    """Validate ``cache`` and hold its stage plan on it (``cache.plan``), so that later calls of
    :func:`bitmap_sparse_attention` do no host work that waits for the device. Called by the first
    attention call of a cache; call it yourself once after loading (before capturing a CUDA graph,
    which cannot capture the checks' host syncs). Checked again only when a tensor of the cache is
    replaced or, for a cache of fixed lengths, written in place. Returns ``cache``."""
    key = _plan_key(cache)
    if cache.plan is not None and cache.plan.key == key:
        return cache
    if cache.version != LAYOUT_V2:
        raise UsageError(f"bitmap_sparse_attention reads layout version {LAYOUT_V2}; convert with convert_layout (this cache is version {cache.version})")
    cache.validate()
    kcap, vcap = stage_capacity(cache)
    cache.plan = _Plan(key, kcap, vcap)
    return cache


def bitmap_sparse_attention(q: torch.Tensor, cache: BitmapCache, scale: float | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, H, Tq, D]`` over a layout-v2 ``cache`` (compressed tokens + dense
    window): (out ``[B, H, Tq, D]`` float32, lse ``[B, H, Tq]`` float32). The first call validates
    the cache and holds its plan (:func:`prepare_attention`); later calls on the CUDA backend do no
    host syncs and can be captured in a CUDA graph. ``backend``: ``auto``, ``cuda`` or ``triton``
    (module docstring). A cache with room to grow (``cache.lengths``, module docstring) is attended
    over its lengths in use, read on the device by the CUDA backend (the Triton backend reads them
    on the host)."""
    return _attend(q, cache, scale, backend, ())


def _tuned_attention(q: torch.Tensor, cache: BitmapCache, scale: float | None = None, backend: str = "auto", **knobs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`bitmap_sparse_attention` with tuning knobs, for benchmarks and tests (not public API;
    they change speed and rounding only). ``capacity``: stage capacities (kcap, vcap) in place of
    the held :func:`stage_capacity`. ``num_splits``, ``rows_per_program`` (1, 2, 4 or 8 on cuda; a
    power of two on triton), ``half_tables`` (cuda: fp16 gather tables), ``bits_global`` (cuda:
    bitmap words read from global memory instead of staged), ``paired`` (cuda, fp32 sums: values
    read two at a time; None: :func:`walk_mode`'s choice) and ``num_warps`` (triton).
    ``accumulate="fp16"`` (cuda, float16 caches, scalar walk): the products of each 32-element
    bitmap word summed in fp16 before joining the fp32 sums (about 8e-4 relative error on random
    data instead of 3e-4). ``tensor_cores`` (cuda, head_dim 64 or 128): the tensor-core walk (True),
    the scalar one (False) or :func:`use_tensor_cores`'s choice (None); the tensor-core walk serves 8
    query rows per program (``rows_per_program`` and ``accumulate`` apply to the scalar walk).
    ``bulk_copies`` (cuda, tensor-core walk, sm_90+): how it stages the cache, :func:`use_bulk_copies`."""
    unknown = set(knobs) - set(_KNOBS)
    if unknown:
        raise UsageError(f"unknown knob {sorted(unknown)[0]!r}; knobs: {', '.join(_KNOBS)}")
    return _attend(q, cache, scale, backend, tuple(sorted(knobs.items())))


_KNOBS = {"num_splits": None, "capacity": None, "rows_per_program": None, "half_tables": True, "bits_global": False, "paired": None,
          "num_warps": 4, "accumulate": "fp32", "tensor_cores": None, "bulk_copies": None}


@dataclass(frozen=True)
class _Launch:
    which: str
    nr: int
    chunks: int
    splits: int
    bps: int
    walk: int = 0
    bulk: bool = False
    kcap: int = 0
    vcap: int = 0


def _launch(plan: _Plan, q: torch.Tensor, cache: BitmapCache, backend: str, knobs: tuple) -> _Launch:
    """The launch for this query shape, backend and knobs: computed once per plan, then held."""
    lkey = (tuple(q.shape), q.dtype, q.device, backend, knobs)
    got = plan.launches.get(lkey)
    if got is not None:
        return got
    kn = dict(_KNOBS, **dict(knobs))
    which = pick_backend(q, backend)
    if kn["accumulate"] not in ("fp32", "fp16"):
        raise UsageError(f"accumulate must be fp32 or fp16, got {kn['accumulate']!r}")
    b, h, tq, d = q.shape
    hkv = cache.keys.kv_heads
    rows, bh, nb = (h // hkv) * tq, b * hkv, cache.keys.blocks
    walk, bulk, kcap, vcap = 0, False, 0, 0
    if which == "cuda":
        kcap, vcap = (plan.kcap, plan.vcap) if kn["capacity"] is None else (int(kn["capacity"][0]), int(kn["capacity"][1]))
        launch_pairs = bh * -(-nb // 2)
        mma = use_tensor_cores(kcap, vcap, d, kn["tensor_cores"], kn["bits_global"], launch_pairs=launch_pairs)
        key_rows_16 = cache.keys.tokens * -(-d // TILE) % 2 == 0  # a KV head's key bits: a multiple of 16 bytes
        bulk = mma and use_bulk_copies(launch_pairs, torch.cuda.get_device_capability(q.device), kn["bulk_copies"], key_rows_16)
        nr = MMA_ROWS if mma else kn["rows_per_program"] or min(8, triton.next_power_of_2(rows))
        if nr not in (1, 2, 4, 8):
            raise UsageError(f"rows_per_program must be 1, 2, 4 or 8 on cuda, got {nr}")
        walk = mma_walk(kcap, vcap, d, bulk) if mma else walk_mode(kcap, vcap, d, kn["accumulate"], kn["paired"])
    else:
        nr = kn["rows_per_program"] or min(64, max(16, triton.next_power_of_2(rows)))
    chunks = -(-rows // nr)
    splits = default_splits(bh, nb, chunks, q.device) if kn["num_splits"] is None else int(kn["num_splits"])
    if splits < 1:
        raise UsageError(f"num_splits must be at least 1, got {kn['num_splits']}")
    bps = max(1, -(-nb // splits))
    if which == "cuda":
        bps += bps % 2  # splits start on a pair of blocks
    splits = max(1, -(-nb // bps)) if nb else 1
    got = _Launch(which, nr, chunks, splits, bps, walk, bulk, kcap, vcap)
    plan.launches[lkey] = got
    return got


def _cuda_sources(plan: _Plan, cache: BitmapCache) -> tuple:
    """nz and bitmaps of keys and values as the CUDA stage copies them: 16-byte aligned sources
    (copied once into the plan when not; a cache with room to grow must be aligned, since a copy
    would not see its appends)."""
    if plan.sources is None:
        k, v = cache.keys, cache.values
        srcs = (k.nz, v.nz, k.bitmaps, v.bitmaps)
        if any(x.data_ptr() % 16 for x in srcs if x.numel()):
            if cache.lengths is not None:
                raise UsageError("a cache with room to grow must have 16-byte aligned nz and bitmaps")
            srcs = tuple(x.clone() if x.data_ptr() % 16 else x for x in srcs)
        plan.sources = srcs
    return plan.sources


def _placeholder(plan: _Plan, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    if key not in plan.empty:
        plan.empty[key] = torch.zeros(8, dtype=dtype, device=device)
    return plan.empty[key]


def _attend(q: torch.Tensor, cache: BitmapCache, scale: float | None, backend: str, knobs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    check_query(q, cache)
    check_device(q=q)
    prepare_attention(cache)
    plan = cache.plan
    ln = _launch(plan, q, cache, backend, knobs)
    if cache.lengths is not None and ln.which != "cuda":
        # the Triton backend reads the lengths on the host: the part in use as a fixed-length cache
        view = cache.in_use()
        vplan = _Plan((), plan.kcap, plan.vcap)
        return _run(q, view, vplan, _launch(vplan, q, view, backend, knobs), scale, knobs)
    return _run(q, cache, plan, ln, scale, knobs)


def _run(q: torch.Tensor, cache: BitmapCache, plan: _Plan, ln: _Launch, scale: float | None, knobs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The launches: split partials by the chosen backend, then their merge."""
    b, h, tq, d = q.shape
    k, v = cache.keys, cache.values
    hkv = k.kv_heads
    rows, bh, nb = (h // hkv) * tq, b * hkv, k.blocks
    w = cache.window_keys.shape[2]
    out = torch.empty(b, h, tq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, tq, dtype=torch.float32, device=q.device)
    if bh == 0 or rows == 0:
        return out, lse
    acc, m, l = split_partials(bh, ln.splits + 1, rows, d, q.device)
    rp, dp = acc.shape[2], acc.shape[3]
    scale = default_scale(d) if scale is None else scale
    qc = q.contiguous()
    empty = _placeholder(plan, q.dtype, q.device)
    wk = cache.window_keys if w else empty
    wv = cache.window_values if w else empty
    if ln.which == "cuda":
        knz, vnz, kbm, vbm = _cuda_sources(plan, cache)
        kn = dict(_KNOBS, **dict(knobs))
        lens = cache.lengths if cache.lengths is not None else _placeholder(plan, torch.int32, q.device)[:0]
        _cuda_extension().bitmap_sparse_attention(
            qc.view(bh, rows, d), kbm, knz if knz.numel() else empty, k.offsets, vbm, vnz if vnz.numel() else empty, v.offsets,
            wk.contiguous(), wv.contiguous(), lens, acc, m, l,
            float(scale) * LOG2E, k.tokens, w, nb, ln.bps, ln.splits, ln.kcap, ln.vcap, ln.nr, int(kn["half_tables"]), ln.walk,
            int(kn["bits_global"]), int(ln.bulk), torch.cuda.current_stream(q.device).cuda_stream,
        )
    else:
        kn = dict(_KNOBS, **dict(knobs))
        knz = k.nz if k.nz.numel() else empty
        vnz = v.nz if v.nz.numel() else empty
        use_asm = q.is_cuda and not interpreting()
        upcast = q.dtype == torch.bfloat16 and not q.is_cuda  # the interpreter gets bfloat16 tl.dot wrong
        _sparse_attention_kernel[(bh, ln.splits + 1, ln.chunks)](
            qc, k.bitmaps.view(torch.int32), knz, k.offsets, v.bitmaps.view(torch.int32), vnz, v.offsets, wk.contiguous(), wv.contiguous(), acc, m, l,
            float(scale) * LOG2E, k.tokens, w, d, -(-d // TILE), nb, rows, ln.bps, ln.splits,
            RB=ln.nr, RP=rp, DP=dp, DTP=dp // TILE, DOT_PREC="ieee" if q.dtype == torch.float32 or upcast else "tf32",
            UPCAST=upcast, USE_ASM=use_asm, num_warps=kn["num_warps"], num_stages=1,
        )
    merge_split_partials(acc, m, l, out, lse, rows)
    return out, lse


def dense_attention_reference(q: torch.Tensor, cache: BitmapCache, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention over the decoded cache (:func:`kvtool.core.attention.attend_partial`)."""
    keys, values = cache.decode()
    return attend_partial(q, keys, values, scale)
