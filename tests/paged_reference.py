"""What the FlashInfer check compares against: synthetic paged KV made with kvtool's own pager, and
plain dense attention over the sequences read back through the page table (shared by the GPU test
and its CPU check)."""

from __future__ import annotations

import torch

from kvtool.core.cache import KVCache, LayerKV, ModelFacts
from kvtool.export.paged import PagedKV, to_paged


def synthetic_paged(lengths: list[int], heads: int, kv_heads: int, head_dim: int, page_size: int, layout: str, seed: int = 0) -> PagedKV:
    """Paged KV (one layer, fp16) of a left-padded batch of ``lengths`` random sequences."""
    b, t = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(seed)
    facts = ModelFacts(name="synthetic", architecture="synthetic", num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=head_dim, hidden_size=heads * head_dim, rope_theta=None, dtype="float16")
    keys = torch.randn(b, kv_heads, t, head_dim, generator=g).half()
    values = torch.randn(b, kv_heads, t, head_dim, generator=g).half()
    mask = torch.tensor([[0] * (t - n) + [1] * n for n in lengths])
    return to_paged(KVCache(facts, {0: LayerKV(keys, values)}, torch.zeros(b, t, dtype=torch.int64), {}, mask), page_size, layout)


def dense_reference(q: torch.Tensor, seqs: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """q ``[B, H, D]``; seqs[b] = keys/values ``[Hkv, L_b, D]``. Output ``[B, H, D]`` float32."""
    outs = []
    for b, (k, v) in enumerate(seqs):
        group = q.shape[1] // k.shape[0]
        kf = k.float().repeat_interleave(group, 0)  # [H, L, D]: query head h reads KV head h // group
        vf = v.float().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hld->hl", q[b].float(), kf) * scale
        outs.append(torch.einsum("hl,hld->hd", torch.softmax(scores, -1), vf))
    return torch.stack(outs)
