"""The popcount-rank bitmap attention variant against the owner's torch reference (decode the layout,
dense attention) on small shapes under TRITON_INTERPRET=1: odd lengths, partial and empty blocks,
sparsity 0 / 0.5 / 0.99, GQA groups 1, 3, 4, 8, head_dim 64 / 96 / 128, with and without a window."""

from __future__ import annotations

import pytest
import torch

from kvtool.kernels.bitmap_attention import bitmap_attention_reference
from kvtool.kernels.bitmap_attention_popc import bitmap_decode_attention_popc
from kvtool.kernels.bitmap_compress import encode_cache, random_pruned


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
@pytest.mark.parametrize("variant", ["2d", "3d"])
def test_matches_reference(b, hkv, g, t, d, sp, window, splits, variant):
    keys = random_pruned(b, hkv, t, d, sp, window=window, seed=1)
    values = random_pruned(b, hkv, t, d, sp, window=window, seed=2)
    cache = encode_cache(keys, values, window=window, backend="torch")
    q = torch.randn(b, hkv * g, 1, d, generator=torch.Generator().manual_seed(3)).half()
    out, lse = bitmap_decode_attention_popc(q, cache, num_splits=splits, variant=variant)
    ref_out, ref_lse = bitmap_attention_reference(q, cache)
    assert torch.isfinite(out).all()
    rel = (out - ref_out).norm() / ref_out.norm()
    assert rel < 1e-2, rel
    assert torch.allclose(lse, ref_lse, atol=1e-2, rtol=1e-3)


def test_rejects_a_query_of_the_wrong_shape():
    keys = random_pruned(1, 2, 64, 64, 0.5)
    cache = encode_cache(keys, keys.clone(), window=0)
    from kvtool.errors import UsageError

    with pytest.raises(UsageError, match="q has shape"):
        bitmap_decode_attention_popc(torch.zeros(1, 3, 1, 64, dtype=torch.float16), cache)


@pytest.mark.parametrize("b,hkv,g,t,d,sp", [(1, 2, 4, 130, 64, 0.7), (2, 1, 3, 64, 128, 0.5), (1, 2, 1, 77, 96, 0.0), (1, 1, 8, 200, 64, 0.99)])
def test_spmv_halves_match_dense_products(b, hkv, g, t, d, sp):
    from kvtool.kernels.bitmap_attention_popc import bitmap_pv, bitmap_qk
    from kvtool.kernels.bitmap_compress import encode

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
