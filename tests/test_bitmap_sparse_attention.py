"""Layout-v2 bitmap attention (kvtool.kernels.bitmap_sparse_attention): the Triton backend under
TRITON_INTERPRET=1 against the element-wise torch reference and dense attention on the decoded
cache (odd lengths and head_dims, GQA groups, several queries, fp16 / bf16 / fp32, empty blocks),
the v1 -> v2 conversion, and the CUDA backend on the GPU (``gpu`` marker) at Llama-3-8B shapes."""

from __future__ import annotations

import pytest
import torch

from kvtool.core.errors import UsageError
from kvtool.kernels.bitmap_compress import encode_cache, random_pruned
from kvtool.kernels.bitmap_layout import LAYOUT_V2
from kvtool.kernels.bitmap_sparse_attention import (
    _tuned_attention,
    bitmap_sparse_attention,
    convert_layout,
    dense_attention_reference,
    encode_cache_v2,
    sparse_attention_reference,
    stage_capacity,
)


def rel_l2(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_cache(b, hkv, t, d, s, dtype, w, device="cpu", seed=0, backend="torch"):
    keys = random_pruned(b, hkv, t, d, s, dtype=dtype, seed=seed + 1, window=w, device=device)
    values = random_pruned(b, hkv, t, d, s, dtype=dtype, seed=seed + 2, window=w, device=device)
    return encode_cache_v2(keys, values, window=w, backend=backend), keys, values


CASES = [
    # B, Hkv, G, Tq, T, D, window, sparsity, dtype, splits
    (1, 2, 4, 1, 200, 64, 32, 0.7, torch.float16, None),
    (2, 1, 3, 1, 131, 80, 3, 0.5, torch.float16, 2),
    (1, 2, 4, 2, 97, 96, 0, 0.0, torch.bfloat16, 3),
    (1, 1, 8, 1, 70, 32, 5, 0.99, torch.float16, 2),
    (1, 1, 3, 1, 40, 64, 40, 0.7, torch.bfloat16, None),  # everything in the window
    (1, 1, 4, 1, 64, 16, 0, 0.7, torch.float32, 1),
    (1, 1, 4, 5, 129, 72, 7, 0.6, torch.float32, 2),  # 20 query rows: two row chunks of 16
]


@pytest.mark.parametrize("b,hkv,g,tq,t,d,w,s,dtype,splits", CASES)
def test_triton_backend_matches_references(b, hkv, g, tq, t, d, w, s, dtype, splits):
    cache, keys, values = make_cache(b, hkv, t, d, s, dtype, w)
    cache.validate()
    q = (torch.randn(b, hkv * g, tq, d) * 2).to(dtype)
    rows = 16 if g * tq > 16 else None
    out, lse = _tuned_attention(q, cache, backend="triton", num_splits=splits, rows_per_program=rows)
    ref_out, ref_lse = sparse_attention_reference(q, cache)
    dense_out, dense_lse = dense_attention_reference(q, cache)
    assert out.shape == (b, hkv * g, tq, d) and out.dtype == torch.float32 and lse.shape == (b, hkv * g, tq)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_l2(out, ref_out) < tol
    assert rel_l2(dense_out, ref_out) < 1e-2
    torch.testing.assert_close(lse, ref_lse, atol=max(tol, 1e-4), rtol=1e-3)
    torch.testing.assert_close(dense_lse, ref_lse, atol=1e-2, rtol=1e-3)
    # the decoded cache is the pruned input
    dk, dv = cache.decode()
    assert torch.equal(dk.view(torch.uint8), keys.view(torch.uint8)) and torch.equal(dv.view(torch.uint8), values.view(torch.uint8))


def test_empty_blocks_and_more_splits_than_blocks():
    keys = random_pruned(1, 1, 256, 64, 0.9, seed=5)
    values = random_pruned(1, 1, 256, 64, 0.9, seed=6)
    keys[:, :, 64:128] = 0  # an empty block: its tokens score 0, still part of the softmax
    values[:, :, 64:128] = 0
    cache = encode_cache_v2(keys, values, window=0)
    q = torch.randn(1, 3, 1, 64).half()
    ref = sparse_attention_reference(q, cache)
    for splits in (1, 3, 8):
        out, lse = _tuned_attention(q, cache, backend="triton", num_splits=splits)
        assert rel_l2(out, ref[0]) < 1e-2
        torch.testing.assert_close(lse, ref[1], atol=1e-2, rtol=1e-3)


def bernoulli_pruned(b, hkv, t, d, keep, dtype, device="cpu", seed=0):
    """Each element kept with probability ``keep``: counts vary per token row and per channel tile
    (what the other pruning methods store)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(b, hkv, t, d, generator=g, device=device)
    return (x * (torch.rand(b, hkv, t, d, generator=g, device=device) < keep)).to(dtype)


def test_variable_counts_per_row():
    keys = bernoulli_pruned(1, 2, 300, 64, 0.35, torch.float16, seed=3)
    values = bernoulli_pruned(1, 2, 300, 64, 0.5, torch.float16, seed=4)
    cache = encode_cache_v2(keys, values, window=20)
    q = torch.randn(1, 8, 1, 64).half()
    ref = sparse_attention_reference(q, cache)
    out, lse = _tuned_attention(q, cache, backend="triton", num_splits=2)
    assert rel_l2(out, ref[0]) < 1e-2
    torch.testing.assert_close(lse, ref[1], atol=1e-2, rtol=1e-3)


def test_conversion_from_layout_v1_is_bit_exact():
    keys = random_pruned(2, 2, 150, 80, 0.7, dtype=torch.bfloat16, seed=7, window=9)
    values = random_pruned(2, 2, 150, 80, 0.7, dtype=torch.bfloat16, seed=8, window=9)
    v1 = encode_cache(keys, values, window=9)
    v2 = convert_layout(v1)
    assert v1.version == 1 and v2.version == LAYOUT_V2
    v2.validate()
    for a, b in zip(v1.decode(), v2.decode()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    direct = encode_cache_v2(keys, values, window=9)
    assert torch.equal(direct.keys.nz.view(torch.int16), v2.keys.nz.view(torch.int16))
    assert torch.equal(direct.values.bitmaps, v2.values.bitmaps)
    # the keys of v2 are token tiles: [B, Hkv, Tc, DT] bitmaps; the values channel tiles [B, Hkv, NB, D]
    assert list(v2.keys.bitmaps.shape) == [2, 2, 141, 2] and list(v2.values.bitmaps.shape) == [2, 2, 3, 80]


def test_version_and_backend_are_checked():
    cache, _, _ = make_cache(1, 1, 70, 64, 0.5, torch.float16, 3)
    q = torch.randn(1, 2, 1, 64).half()
    with pytest.raises(UsageError, match="layout version"):
        bitmap_sparse_attention(q, convert_layout(cache, 1), backend="triton")
    with pytest.raises(UsageError, match="backend"):
        bitmap_sparse_attention(q, cache, backend="tpu")
    with pytest.raises(UsageError, match="cuda backend"):
        bitmap_sparse_attention(q, cache, backend="cuda")
    with pytest.raises(UsageError, match="accumulate"):
        _tuned_attention(q, cache, accumulate="fp8")
    with pytest.raises(UsageError, match="knob"):
        _tuned_attention(q, cache, validate=False)


def test_stage_capacity_is_the_largest_pair_run():
    cache, _, _ = make_cache(1, 2, 200, 64, 0.5, torch.float16, 0)
    kcap, vcap = stage_capacity(cache)
    off = cache.keys.offsets
    # blocks per head: 4; pairs (0, 1), (2, 3) of each head
    runs = [int(off[h * 4 + p + 2] - off[h * 4 + p]) for h in range(2) for p in (0, 2)]
    assert kcap == max(runs) and vcap > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tq", [1, 16, 64])
def test_cuda_backend_at_llama3_8b_shapes(dtype, tq):
    b, hkv, g, t, d, w = 2, 8, 4, 1000, 128, 32
    for s in (0.5, 0.7):
        cache, _, _ = make_cache(b, hkv, t, d, s, dtype, w, device="cuda", backend="triton")
        cache.validate()
        q = (torch.randn(b, hkv * g, tq, d, device="cuda") * 2).to(dtype)
        ref_out, ref_lse = sparse_attention_reference(q, cache)
        # the scalar walk's knobs (this short launch would take the tensor cores), then the tensor cores
        scalar = [dict(half_tables=ht, bits_global=bg) for ht, bg in ((True, False), (False, False), (True, True))]
        scalar += [dict(paired=pr) for pr in (True, False)]  # values one or two at a time
        scalar.append(dict(accumulate="fp16"))  # fp16 per-word sums (bfloat16 caches keep fp32)
        mma = [dict(tensor_cores=True, bulk_copies=bulk) for bulk in (False, True)]  # staged by cp.async, by bulk copies
        runs = [("triton", {}), ("cuda", {})] + [("cuda", k) for k in mma] + [("cuda", dict(k, tensor_cores=False)) for k in scalar]
        for backend, knobs in runs:
            out, lse = _tuned_attention(q, cache, backend=backend, **knobs)
            assert bool(torch.isfinite(out).all())
            assert rel_l2(out, ref_out) < 1e-2, (backend, knobs, s)
            torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)


# B, Hkv, G, T, D, window, splits. The first eight are the original odd shapes; (1, 1, 7, 2049, 64, 130, 5)
# hung on the H200 (its last pair holds 127 tokens: an 8-byte-row bulk copy of 1016 bytes, which is
# not a 16-byte multiple, never completed its mbarrier). Then a grid at head_dim 64 and 128 with G 1-12,
# compressed token counts (T - window) around the 64-token block and 128-token pair edges (63, 64, 65,
# 127, 128, 129, 255, 257, 383, 640, 641, 642), splits that leave a lone block or a pair in the last
# split, windows past a block and a pair (65, 130, 200), and batch 2 (variable counts, odd KV heads).
ODD_SHAPES = [(1, 3, 5, 333, 80, 0, 3), (3, 2, 1, 77, 192, 11, None), (1, 1, 7, 2049, 64, 130, 5), (2, 8, 4, 1000, 128, 32, None),
              (1, 3, 3, 333, 128, 7, 3), (1, 1, 12, 100, 128, 100, None), (2, 1, 1, 1, 128, 0, 1), (1, 2, 9, 4100, 128, 200, 7)]
EDGE_SHAPES = [
    (1, 1, 1, 63, 64, 0, None), (1, 2, 2, 64 + 65, 64, 65, 1), (2, 1, 3, 65 + 1, 64, 1, None), (1, 1, 4, 127 + 130, 64, 130, 2),
    (1, 3, 5, 128 + 200, 64, 200, 2), (1, 1, 6, 129 + 64, 64, 64, 2), (2, 2, 7, 255, 64, 0, 3), (1, 1, 8, 257 + 130, 64, 130, None),
    (1, 1, 9, 641 + 65, 64, 65, 3), (1, 2, 10, 640 + 1, 64, 1, 3), (1, 1, 11, 383 + 200, 64, 200, 4), (1, 1, 12, 642 + 129, 64, 129, 5),
    (1, 1, 12, 63 + 1, 128, 1, 1), (2, 1, 11, 64, 128, 0, None), (1, 2, 10, 65 + 130, 128, 130, 2), (1, 1, 9, 127 + 65, 128, 65, 2),
    (1, 3, 8, 128 + 1, 128, 1, 3), (2, 2, 7, 129 + 200, 128, 200, 2), (1, 1, 6, 255 + 64, 128, 64, 3), (1, 1, 5, 257, 128, 0, 2),
    (1, 1, 4, 641 + 130, 128, 130, 3), (1, 2, 3, 640 + 65, 128, 65, 3), (1, 1, 2, 383 + 200, 128, 200, 4), (2, 1, 1, 1919 + 130, 128, 130, 5),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,hkv,g,t,d,w,splits", ODD_SHAPES + EDGE_SHAPES)
def test_cuda_backend_odd_shapes(b, hkv, g, t, d, w, splits):
    cache, _, _ = make_cache(b, hkv, t, d, 0.6, torch.float16, w, device="cuda", backend="triton")
    if b == 2:  # variable counts per key row and per value tile
        keys = bernoulli_pruned(b, hkv, t, d, 0.3, torch.float16, device="cuda", seed=1)
        values = bernoulli_pruned(b, hkv, t, d, 0.5, torch.float16, device="cuda", seed=2)
        cache = encode_cache_v2(keys, values, window=w, backend="triton")
    q = (torch.randn(b, hkv * g, 1, d, device="cuda") * 2).half()
    ref_out, ref_lse = sparse_attention_reference(q, cache)
    knobs_list = [dict(paired=False), dict(paired=True), dict(accumulate="fp16")]
    if d in (64, 128):  # the scalar walk forced (short launches take the tensor cores), then the tensor cores: 12 query rows take two programs
        knobs_list = [dict(k, tensor_cores=False) for k in knobs_list] + [dict(tensor_cores=True, bulk_copies=bulk) for bulk in (False, True)]
    for knobs in knobs_list:
        out, lse = _tuned_attention(q, cache, backend="cuda", num_splits=splits, **knobs)
        assert rel_l2(out, ref_out) < 1e-2, knobs
        torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)


def test_bulk_copies_on_sm90_in_long_launches():
    from kvtool.kernels.bitmap_sparse_attention import use_bulk_copies

    assert use_bulk_copies(64 * 256, (9, 0)) and not use_bulk_copies(64 * 256, (8, 0))  # batch 8 / 32k
    assert not use_bulk_copies(64 * 32, (9, 0)) and not use_bulk_copies(8 * 256, (9, 0))  # batch 8 / 4k, batch 1 / 32k
    assert use_bulk_copies(1, (9, 0), bulk_copies=True) and not use_bulk_copies(10**6, (9, 0), bulk_copies=False)
    # key bits of a KV head that are not a multiple of 16 bytes (head_dim 64, an odd token count) cannot be bulk copied
    assert not use_bulk_copies(64 * 256, (9, 0), key_rows_16=False) and not use_bulk_copies(1, (9, 0), bulk_copies=True, key_rows_16=False)
    with pytest.raises(UsageError, match="sm_90"):
        use_bulk_copies(1, (8, 6), bulk_copies=True)


def test_buffered_walk_for_dense_stages_with_bulk_copies():
    from kvtool.kernels.bitmap_sparse_attention import WALK_MMA, WALK_MMA_BUFFERED, mma_walk

    full = 2 * 64 * 128
    assert mma_walk(full // 2, 100, 128, bulk=True) == WALK_MMA_BUFFERED  # 50% sparsity
    assert mma_walk(128 * 38, 128 * 38, 128, bulk=True) == WALK_MMA  # 70%
    assert mma_walk(full, full, 128, bulk=False) == WALK_MMA  # cp.async staging keeps the word walk


def test_walk_mode_pairs_values_from_40_percent_density():
    from kvtool.kernels.bitmap_sparse_attention import walk_mode

    full = 2 * 64 * 128  # elements of a pair of blocks at head_dim 128
    assert walk_mode(int(0.3 * full), int(0.3 * full), 128) == 0  # 70% sparsity: one value per load
    assert walk_mode(int(0.5 * full), 100, 128) == 1  # 50%: pairs
    assert walk_mode(10, 10, 128, paired=True) == 1 and walk_mode(full, full, 128, paired=False) == 0
    assert walk_mode(0, 0, 128, accumulate="fp16") == 2


def test_tensor_cores_from_25_percent_density_or_in_short_launches():
    from kvtool.kernels.bitmap_sparse_attention import use_tensor_cores

    full = 2 * 64 * 128
    keep_38 = 128 * 38  # 70% per-token pruning of 128 channels: 38 kept per token
    assert use_tensor_cores(int(0.5 * full), 10, 128) and use_tensor_cores(keep_38, keep_38, 128)
    sparse = (int(0.2 * full), int(0.2 * full), 128)  # 80%
    assert not use_tensor_cores(*sparse)
    assert use_tensor_cores(*sparse, launch_pairs=64 * 32)  # batch 8 / 4k: a short launch
    assert not use_tensor_cores(*sparse, launch_pairs=64 * 256)  # batch 8 / 32k
    assert use_tensor_cores(full, full, 64) and not use_tensor_cores(full, full, 80)
    assert not use_tensor_cores(full, full, 128, bits_global=True)
    assert use_tensor_cores(0, 0, 128, tensor_cores=True) and not use_tensor_cores(full, full, 128, tensor_cores=False)
    with pytest.raises(UsageError):
        use_tensor_cores(full, full, 96, tensor_cores=True)


def test_split_plan_short_programs_and_half_a_wave():
    from kvtool.kernels.bitmap_sparse_attention import plan_splits

    wave = 8 * 132  # the H100: 132 SMs, 8 programs each
    assert plan_splits(8 * 32, 512, wave) == 64  # batch 32 / 32k: 4 pairs per program
    assert plan_splits(8 * 8, 512, wave) == 64  # batch 8 / 32k
    assert plan_splits(8 * 8, 64, wave) == 9  # batch 8 / 4k: half a wave (the caller rounds to pairs)
    assert plan_splits(8, 512, wave) == 66  # batch 1 / 32k: half a wave, 4 pairs per program
    assert plan_splits(8, 64, wave) == 32  # batch 1 / 4k: a pair per program, still under half a wave
    assert plan_splits(8, 1, wave) == 1  # one block: one split
    assert plan_splits(3, 7, wave) == 4  # few programs: one split per pair, the cap
    assert plan_splits(64, 100, wave) == 13  # 50 pairs: 4 pairs per program beats half a wave (9)
    assert plan_splits(500, 2048, wave) == 256  # many programs: only the 4-pair rule binds


def test_plain_call_checks_the_cache_once_and_again_after_a_write(monkeypatch):
    from kvtool.kernels.bitmap_layout import BitmapCache
    from kvtool.kernels.bitmap_sparse_attention import prepare_attention

    checks = []
    real = BitmapCache.validate
    monkeypatch.setattr(BitmapCache, "validate", lambda self: (checks.append(1), real(self))[1])
    cache, _, _ = make_cache(1, 2, 150, 64, 0.7, torch.float16, 10)
    q = torch.randn(1, 4, 1, 64).half()
    first = bitmap_sparse_attention(q, cache)
    assert len(checks) == 1 and cache.plan is not None and cache.plan.kcap == stage_capacity(cache)[0]
    again = bitmap_sparse_attention(q, cache, backend="triton")
    assert len(checks) == 1 and torch.equal(first[0], again[0])
    assert prepare_attention(cache) is cache and len(checks) == 1
    cache.keys.nz.mul_(1)  # written in place: checked again on the next call
    bitmap_sparse_attention(q, cache)
    assert len(checks) == 2
    cache.values.nz[cache.values.offsets[1]] = 1.0  # a stored zero would now sit in a padding slot or a set bit changed its value
    bitmap_sparse_attention(q, cache)
    assert len(checks) == 3


def _grow(keys, values, w, slot, device="cpu", steps=(1, 2)):
    """A cache with room to grow holding the pruned ``keys`` / ``values`` ``[B, Hkv, T, D]``: their
    whole blocks appended ``steps`` blocks at a time (the rest at once), the last ``w`` tokens
    written into the window."""
    from kvtool.kernels.bitmap_compress import encode
    from kvtool.kernels.bitmap_layout import append_blocks, growable_cache

    b, hkv, t, d = keys.shape
    tc = t - w
    grow = growable_cache(b, hkv, d, capacity=tc + 128, window=w + 5, slot=slot, dtype=keys.dtype, device=device)
    backend = "triton" if keys.is_cuda else "torch"
    done = 0
    for n in list(steps) + [tc // 64]:
        n = min(n, (tc - done) // 64)
        if n:
            part = slice(done, done + 64 * n)
            append_blocks(grow, encode(keys[:, :, part].contiguous(), "values", backend), encode(values[:, :, part].contiguous(), "keys", backend))
            done += 64 * n
    grow.window_keys[:, :, :w] = keys[:, :, tc:]
    grow.window_values[:, :, :w] = values[:, :, tc:]
    grow.lengths[1] = w
    return grow


@pytest.mark.parametrize("keep_all", [False, True])
def test_growable_cache_attends_as_the_packed_cache(keep_all):
    b, hkv, t, d, w = 2, 2, 4 * 64 + 7, 64, 7
    keys = random_pruned(b, hkv, t, d, 0.7, seed=11, window=w)
    values = bernoulli_pruned(b, hkv, t, d, 0.4, torch.float16, seed=12) + 0.0  # counts vary per block (no -0.0: not stored)
    values[:, :, t - w:] = torch.randn(b, hkv, w, d).half()
    packed = encode_cache_v2(keys, values, window=w)
    slot = 64 * d if keep_all else 64 * 40  # a slot fits the block's run (40 of 64 channels at most here)
    grow = _grow(keys, values, w, slot)
    grow.validate()
    assert grow.lengths.tolist() == [4 * 64, w] and grow.tokens == t
    for a, c in zip(grow.decode(), packed.decode()):
        assert torch.equal(a.view(torch.int16), c.view(torch.int16))
    q = torch.randn(b, 4 * hkv, 1, d).half()
    ref_out, ref_lse = sparse_attention_reference(q, packed)
    got = sparse_attention_reference(q, grow.in_use())
    assert rel_l2(got[0], ref_out) < 1e-6
    out, lse = bitmap_sparse_attention(q, grow)
    assert rel_l2(out, ref_out) < 1e-2
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3)


def test_growable_cache_checks():
    from kvtool.core.errors import BadDataError
    from kvtool.kernels.bitmap_layout import append_blocks, growable_cache

    with pytest.raises(BadDataError, match="capacity"):
        growable_cache(1, 1, 64, capacity=100, window=4, slot=64, dtype=torch.float16, device="cpu")
    grow = growable_cache(1, 1, 64, capacity=128, window=4, slot=64 * 20, dtype=torch.float16, device="cpu")
    q = torch.randn(1, 2, 1, 64).half()
    out, lse = bitmap_sparse_attention(q, grow)  # nothing in use yet: no key, lse -inf
    assert bool(torch.isneginf(lse).all()) and bool((out == 0).all())
    packed = encode_cache_v2(random_pruned(1, 1, 64, 64, 0.7), random_pruned(1, 1, 64, 64, 0.7, seed=3))
    with pytest.raises(BadDataError, match="layout-v2"):
        append_blocks(grow, packed.values, packed.keys)  # orientations swapped
    grow.lengths = grow.lengths.long()
    with pytest.raises(BadDataError, match="int32"):
        grow.validate()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_plain_call_has_no_host_syncs_and_replays_in_a_cuda_graph(d, dtype):
    cache, _, _ = make_cache(2, 8, 3000, d, 0.7, dtype, 32, device="cuda", backend="triton")
    q = (torch.randn(2, 32, 1, d, device="cuda") * 2).to(dtype)
    ref_out, _ = sparse_attention_reference(q, cache)
    out, lse = bitmap_sparse_attention(q, cache)  # checks and plan
    assert rel_l2(out, ref_out) < 1e-2
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again, _ = bitmap_sparse_attention(q, cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = bitmap_sparse_attention(q, cache)
    q.copy_((torch.randn(2, 32, 1, d, device="cuda") * 2).to(dtype))
    graph.replay()
    new_out, new_lse = sparse_attention_reference(q, cache)
    assert rel_l2(g_out, new_out) < 1e-2
    torch.testing.assert_close(g_lse, new_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_growable_cache_on_cuda_grows_under_one_cuda_graph(d, dtype):
    from kvtool.kernels.bitmap_compress import encode
    from kvtool.kernels.bitmap_layout import append_blocks, growable_cache

    b, hkv, g, w = 2, 8, 4, 40
    keys = random_pruned(b, hkv, 64 * 40 + w, d, 0.7, dtype=dtype, device="cuda", seed=1, window=w)
    values = bernoulli_pruned(b, hkv, 64 * 40 + w, d, 0.45, dtype, device="cuda", seed=2) + 0.0  # no -0.0: runs fit the slots
    keep = int(round(0.3 * d))
    grow = growable_cache(b, hkv, d, capacity=64 * 48, window=64, slot=64 * max(keep, int(0.6 * d)) // 8 * 8, dtype=dtype, device="cuda")
    q = (torch.randn(b, hkv * g, 1, d, device="cuda") * 2).to(dtype)

    def fill(upto: int, wlen: int) -> None:  # blocks up to `upto` tokens (appending what is missing), wlen window tokens
        have = int(grow.lengths[0])
        if upto > have:
            part = slice(have, upto)
            append_blocks(grow, encode(keys[:, :, part].contiguous(), "values", "triton"), encode(values[:, :, part].contiguous(), "keys", "triton"))
        grow.window_keys[:, :, :wlen] = keys[:, :, keys.shape[2] - wlen :]
        grow.window_values[:, :, :wlen] = values[:, :, values.shape[2] - wlen :]
        grow.lengths[1] = wlen

    fill(64 * 3, 5)
    bitmap_sparse_attention(q, grow)  # checks and plan, then one graph for every length
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = bitmap_sparse_attention(q, grow)
    for upto, wlen in ((64 * 3, 5), (64 * 4, 17), (64 * 21, 0), (64 * 40, w)):
        fill(upto, wlen)
        graph.replay()
        ref_out, ref_lse = sparse_attention_reference(q, grow.in_use())
        assert rel_l2(g_out, ref_out) < 1e-2, (upto, wlen)
        torch.testing.assert_close(g_lse, ref_lse, atol=2e-2, rtol=1e-3)
        for knobs in (dict(tensor_cores=False), dict(tensor_cores=True, bulk_copies=False), dict(tensor_cores=True, bulk_copies=True)):
            out, lse = _tuned_attention(q, grow, **knobs)
            assert rel_l2(out, ref_out) < 1e-2, (upto, wlen, knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_growable_cache_with_an_odd_length_in_use(d):
    """lengths[0] is device data: an odd count of compressed tokens (here 5 blocks less one token)
    makes the last pair's key bits at head_dim 64 an odd number of 8-byte rows, which the bulk copy
    rounds up to 16 bytes (one row of the capacity past the tail) instead of hanging."""
    b, hkv, g, w, tc = 2, 3, 5, 9, 5 * 64
    keys = random_pruned(b, hkv, tc + w, d, 0.6, dtype=torch.float16, device="cuda", seed=3, window=w)
    values = bernoulli_pruned(b, hkv, tc + w, d, 0.5, torch.float16, device="cuda", seed=4) + 0.0
    keys[:, :, tc - 1] = 0  # the token left out of use stores nothing, so the in-use view is exact
    values[:, :, tc - 1] = 0
    grow = _grow(keys, values, w, 64 * d, device="cuda")
    grow.lengths[0] = tc - 1
    q = (torch.randn(b, hkv * g, 1, d, device="cuda") * 2).half()
    ref_out, ref_lse = sparse_attention_reference(q, grow)
    for knobs in (dict(tensor_cores=False), dict(tensor_cores=True, bulk_copies=False), dict(tensor_cores=True, bulk_copies=True)):
        for splits in (1, 2):
            out, lse = _tuned_attention(q, grow, backend="cuda", num_splits=splits, **knobs)
            assert rel_l2(out, ref_out) < 1e-2, (knobs, splits)
            torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)
