"""The bitmap Triton kernels under TRITON_INTERPRET=1 on small shapes: the compression kernel makes
the torch encoder's bytes; decode attention over the compressed cache + window matches the torch
reference (odd lengths, partial and empty tiles, sparsity 0 and 0.99, GQA groups 1, 3, 4, 8)."""

from __future__ import annotations

import pytest
import torch

from kvtool.core import io
from kvtool.core.errors import UsageError
from kvtool.formats import get_format
from kvtool.formats.base import compress_cache, make_params
from kvtool.kernels.bitmap_attention import bitmap_attention_reference, bitmap_decode_attention
from kvtool.kernels import bitmap_compress as C
from kvtool.kernels.bitmap_compress import encode_cache, encode_torch, encode_triton, random_pruned


def rel_l2(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def same_bytes(a, b):
    assert torch.equal(a.bitmaps, b.bitmaps)
    assert torch.equal(a.offsets, b.offsets)
    assert a.nz.dtype == b.nz.dtype and torch.equal(a.nz.view(torch.uint8), b.nz.view(torch.uint8))


@pytest.mark.parametrize(
    "shape,s,dtype",
    [
        ((1, 2, 100, 64), 0.7, torch.float16),
        ((2, 1, 64, 80), 0.5, torch.bfloat16),
        ((1, 1, 5, 16), 0.0, torch.float16),
        ((1, 2, 130, 128), 0.99, torch.float16),
        ((1, 1, 3, 200), 0.9, torch.float32),
        ((1, 1, 0, 64), 0.5, torch.float16),
        ((1, 1, 70, 96), 0.3, torch.float32),
        ((1, 2, 65, 96), 0.6, torch.bfloat16),
        ((1, 1, 70, 192), 0.5, torch.float16),  # 6 value words per token in a tile of 8 (DP 256)
    ],
)
def test_compression_kernel_bytes_equal_torch_bytes(shape, s, dtype):
    x = random_pruned(*shape, s, dtype=dtype, seed=3)
    for kind in ("keys", "values"):
        ref = encode_torch(x, kind)
        got = encode_triton(x, kind)
        same_bytes(ref, got)
        got.validate()


def test_compression_kernel_empty_tiles(monkeypatch):
    x = random_pruned(1, 2, 130, 64, 0.5, seed=4)
    x[:, 0, :64] = 0  # a whole block of nothing
    x[:, 1, :, 10] = 0  # an empty key tile (channel 10) in every block
    x[:, 1, 64:128] = 1.5  # a fully dense block
    x[0, 1, 129, 3] = -0.0  # stored by its bit pattern
    for kind in ("keys", "values"):
        ref = encode_torch(x, kind)
        assert int(ref.offsets[1]) == 0 and int(ref.offsets[5] - ref.offsets[4]) == 64 * 64  # block (head 1, tokens 64..127)
        empty = torch.empty  # nz is allocated uninitialised: garbage there must not reach the padding
        monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(3.0))
        same_bytes(ref, C.encode_triton(x, kind))
        monkeypatch.setattr(torch, "empty", empty)


CASES = [
    # B, Hkv, G, Tq, T, D, window, sparsity, dtype, splits
    (1, 2, 1, 1, 200, 64, 32, 0.7, torch.float16, None),
    (2, 1, 3, 1, 131, 64, 3, 0.5, torch.float16, 2),
    (1, 2, 4, 2, 97, 80, 0, 0.0, torch.bfloat16, 3),
    (1, 1, 8, 1, 70, 32, 5, 0.99, torch.float16, 2),
    (1, 1, 3, 1, 40, 64, 40, 0.7, torch.bfloat16, None),  # everything in the window
    (1, 1, 4, 1, 64, 16, 0, 0.7, torch.float32, 1),
]


@pytest.mark.parametrize("b,hkv,g,tq,t,d,w,s,dtype,splits", CASES)
def test_attention_kernel_matches_reference(b, hkv, g, tq, t, d, w, s, dtype, splits):
    keys = random_pruned(b, hkv, t, d, s, dtype=dtype, seed=1, window=w)
    values = random_pruned(b, hkv, t, d, s, dtype=dtype, seed=2, window=w)
    cache = encode_cache(keys, values, window=w, backend="triton")
    q = (torch.randn(b, hkv * g, tq, d) * 2).to(dtype)
    out, lse = bitmap_decode_attention(q, cache, num_splits=splits)
    ref_out, ref_lse = bitmap_attention_reference(q, cache)
    assert out.shape == (b, hkv * g, tq, d) and out.dtype == torch.float32 and lse.shape == (b, hkv * g, tq)
    assert rel_l2(out, ref_out) < 1e-2
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3)


def test_attention_kernel_with_empty_blocks_and_splits():
    keys = random_pruned(1, 1, 256, 64, 0.9, seed=5)
    values = random_pruned(1, 1, 256, 64, 0.9, seed=6)
    keys[:, :, 64:128] = 0  # an empty block: its tokens score 0, still part of the softmax
    values[:, :, 64:128] = 0
    cache = encode_cache(keys, values, window=0)
    q = torch.randn(1, 3, 1, 64).half()
    ref = bitmap_attention_reference(q, cache)
    for splits in (1, 3, 8):  # 8 > 4 blocks: some programs get no block
        out, lse = bitmap_decode_attention(q, cache, num_splits=splits)
        assert rel_l2(out, ref[0]) < 1e-2
        torch.testing.assert_close(lse, ref[1], atol=1e-2, rtol=1e-3)


def test_format_kernel_path_on_the_real_sample(sample_capture):
    fmt = get_format("bitmap")
    cache = io.load(sample_capture, layers=[7], parts=("keys", "values", "queries"))
    cc = compress_cache(cache, fmt, make_params(fmt, {"sparsity": "0.7"}), heldout=64)
    q = cache.layers[7].queries[:, :, -1:]
    out, lse = fmt.attend_kernel(q, cc.layers[7])
    ref_out, ref_lse = fmt.attend(q, cc.layers[7])
    assert rel_l2(out, ref_out) < 1e-2
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3)


def test_expansion_choice_is_checked():
    cache = encode_cache(random_pruned(1, 1, 70, 64, 0.5, seed=1), random_pruned(1, 1, 70, 64, 0.5, seed=2), window=3)
    q = torch.randn(1, 2, 1, 64).half()
    ref = bitmap_attention_reference(q, cache)
    out, _ = bitmap_decode_attention(q, cache, expansion="popc", maxnreg=None)
    assert rel_l2(out, ref[0]) < 1e-2
    with pytest.raises(UsageError, match="walk expansion needs CUDA"):
        bitmap_decode_attention(q, cache, expansion="walk")
    with pytest.raises(UsageError, match="expansion must be"):
        bitmap_decode_attention(q, cache, expansion="mma")


def test_bad_inputs_are_refused_before_launch(monkeypatch):
    keys = random_pruned(1, 2, 70, 64, 0.5)
    cache = encode_cache(keys, keys.clone(), window=6)
    with pytest.raises(UsageError, match=r"q has shape \[1, 3, 1, 64\]"):
        bitmap_decode_attention(torch.randn(1, 3, 1, 64).half(), cache)
    with pytest.raises(UsageError, match="head_dim|q has shape"):
        bitmap_decode_attention(torch.randn(1, 2, 1, 32).half(), cache)
    with pytest.raises(UsageError, match="q is torch.bfloat16 but the cache is torch.float16"):
        bitmap_decode_attention(torch.randn(1, 2, 1, 64).bfloat16(), cache)
    with pytest.raises(UsageError, match=r"q must be \[batch"):
        bitmap_decode_attention(torch.randn(2, 1, 64).half(), cache)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UsageError, match="need CUDA tensors"):
        bitmap_decode_attention(torch.randn(1, 2, 1, 64).half(), cache)
    with pytest.raises(UsageError, match="need CUDA tensors"):
        encode_triton(keys, "keys")


AOT_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from kvtool.kernels import bitmap_attention as A, bitmap_compress as C

def build(fn, sig, consts, warps=4, stages=3, maxnreg=None):
    src = triton.compiler.ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
    opts = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    assert len(k.asm["cubin"]) > 0

for dt, dp in (("fp16", 128), ("bf16", 64)):
    sig = dict(q_ptr=f"*{dt}", kbm_ptr="*i32", knz_ptr=f"*{dt}", koff_ptr="*i64", vbm_ptr="*i32", vnz_ptr=f"*{dt}",
               voff_ptr="*i64", wk_ptr=f"*{dt}", wv_ptr=f"*{dt}", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32",
               scale_log2="fp32", Tc="i32", W="i32", D="i32", DT="i32", NB="i32", R="i32", BPS="i32", S="i32")
    for walk in ("", A.WALK_PTX):
        # RP 256: 64 held-out queries of a 4-query-head group, served 32 rows per program
        for rp in (16, 256):
            build(A._bitmap_attention_kernel, sig, dict(RP=rp, DP=dp, DTP=dp // 64, DOT_PREC="tf32", UPCAST=False, USE_ASM=True, WALK=walk, RB=min(rp, 32)), stages=1, maxnreg=128)
    from kvtool.kernels import bitmap_sparse_attention as SA
    for rb in (16, 64):
        build(SA._sparse_attention_kernel, sig, dict(RB=rb, RP=256, DP=dp, DTP=dp // 64, DOT_PREC="tf32", UPCAST=False, USE_ASM=True))
from kvtool.kernels import bitmap_spmv as V
build(V._bitmap_qk_kernel, dict(q_ptr="*fp16", kbm_ptr="*i32", knz_ptr="*fp16", koff_ptr="*i64", s_ptr="*fp32", Tc="i32", D="i32", NB="i32", R="i32"),
      dict(RP=16, DP=128, USE_ASM=True, WALK=A.WALK_PTX), maxnreg=128)
build(V._bitmap_pv_kernel, dict(p_ptr="*fp16", vbm_ptr="*i32", vnz_ptr="*fp16", voff_ptr="*i64", o_ptr="*fp32", Tc="i32", D="i32", DT="i32", NB="i32", R="i32", BPS="i32"),
      dict(RP=16, DP=128, DTP=2, USE_ASM=True, WALK=A.WALK_PTX), maxnreg=128)
from kvtool.kernels import online_softmax as O
msig = dict(val_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr="*fp32", lse_ptr="*fp32", idx_ptr="*i32", S="i32", R="i32", TQ="i32", D="i32", HKV="i32", K="i32")
for norm, listed in ((False, False), (True, False), (False, True)):
    build(O.merge_splits_kernel, msig, dict(RP=16, DP=128, SB=32, KP=16, NORMALISED=norm, LISTED=listed))
from kvtool.kernels import signvq_lut as L
lsig = dict(q_ptr="*fp16", codes_ptr="*i32", cb_ptr="*fp16", tab_ptr="*fp32", out_ptr="*fp32", TC="i32", HKV="i32",
            **{n: "i32" for n in ("sq_b", "sq_h", "sq_t", "sc_b", "sc_h", "sc_t", "sb_b", "sb_h", "so_b", "so_h", "so_t")})
build(L._lut_table_kernel, lsig, dict(G=4, G4=32, BG=32, NT=1, BT=256, ITERS=8, WORDS=True))
csig = dict(x_ptr="*i16", bitmap_ptr="*i32", offset_ptr="*i64", nz_ptr="*i16", Tc="i32", D="i32", NB="i32")
for key in (True, False):
    for write in (False, True):
        build(C._bitmap_compress_kernel, csig, dict(IS_KEY=key, DP=128, WRITE=write, USE_ASM=True, ALIGN=8), warps=8)
print("compiled")
"""


def test_kernels_compile_for_h100(tmp_path):
    """The interpreter does not compile: build the kernels for sm_90 with the bundled ptxas (no GPU
    needed) so that a kernel the GPU would refuse fails here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize(
    "b,hkv,g,t,d,sp,window,splits",
    [
        (1, 2, 4, 130, 64, 0.7, 32, None),
        (2, 1, 3, 64, 128, 0.5, 0, 2),
        (1, 2, 1, 77, 96, 0.0, 5, 3),
        (1, 1, 8, 200, 64, 0.99, 16, 2),
        (1, 2, 4, 40, 64, 0.7, 40, None),  # everything in the window: no compressed block
    ],
)
def test_attention_kernel_head_dims_64_96_128_torch_encoded(b, hkv, g, t, d, sp, window, splits):
    keys = random_pruned(b, hkv, t, d, sp, window=window, seed=1)
    values = random_pruned(b, hkv, t, d, sp, window=window, seed=2)
    cache = encode_cache(keys, values, window=window, backend="torch")
    q = torch.randn(b, hkv * g, 1, d, generator=torch.Generator().manual_seed(3)).half()
    out, lse = bitmap_decode_attention(q, cache, num_splits=splits)
    ref_out, ref_lse = bitmap_attention_reference(q, cache)
    assert torch.isfinite(out).all()
    rel = (out - ref_out).norm() / ref_out.norm()
    assert rel < 1e-2, rel
    assert torch.allclose(lse, ref_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("b,hkv,g,t,d,sp", [(1, 2, 4, 130, 64, 0.7), (2, 1, 3, 64, 128, 0.5), (1, 2, 1, 77, 96, 0.0), (1, 1, 8, 200, 64, 0.99)])
def test_spmv_halves_match_dense_products(b, hkv, g, t, d, sp):
    from kvtool.kernels.bitmap_compress import encode
    from kvtool.kernels.bitmap_spmv import bitmap_pv, bitmap_qk

    keys = random_pruned(b, hkv, t, d, sp, seed=4)
    values = random_pruned(b, hkv, t, d, sp, seed=5)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(b, hkv * g, d, generator=gen).half()
    p = torch.softmax(torch.randn(b, hkv * g, t, generator=gen), -1).half()
    kx = keys.float().repeat_interleave(g, 1)  # [B, H, T, D]: query head h reads KV head h // g
    vx = values.float().repeat_interleave(g, 1)
    scores = bitmap_qk(q, encode(keys, "keys"))
    ref_s = torch.einsum("bhd,bhtd->bht", q.float(), kx)
    assert (scores - ref_s).norm() / ref_s.norm() < 1e-2
    out = bitmap_pv(p, encode(values, "values"), num_splits=2)
    ref_o = torch.einsum("bht,bhtd->bhd", p.float(), vx)
    assert (out - ref_o).norm() / ref_o.norm() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tq", [1, 16, 64])
def test_attention_kernel_at_llama3_8b_shapes_on_the_gpu(dtype, tq):
    """Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128): 64 held-out queries give 256
    query rows per KV head, which once failed to compile as one dot tile."""
    b, hkv, g, t, d, w = 1, 8, 4, 700, 128, 32
    keys = random_pruned(b, hkv, t, d, 0.7, dtype=dtype, seed=1, window=w, device="cuda")
    values = random_pruned(b, hkv, t, d, 0.7, dtype=dtype, seed=2, window=w, device="cuda")
    cache = encode_cache(keys, values, window=w, backend="triton")
    q = (torch.randn(b, hkv * g, tq, d, device="cuda") * 2).to(dtype)
    ref_out, ref_lse = bitmap_attention_reference(q, cache)
    for expansion in ("walk", "popc"):
        out, lse = bitmap_decode_attention(q, cache, expansion=expansion)
        assert rel_l2(out, ref_out) < 1e-2, expansion
        torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)
