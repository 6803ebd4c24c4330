"""The plain-torch reference attention: key chunks merge to the one-pass result (bounded memory on
long caches), GQA groups read their KV head without copies, masks and empty rows."""

from __future__ import annotations

import pytest
import torch

from kvtool.core.attention import attend_partial, expand_kv


def reference(q, keys, values, scale, mask=None):
    """float64, explicit repeat of the KV heads, one softmax over every key."""
    group = q.shape[1] // keys.shape[1]
    s = torch.matmul(q.double(), expand_kv(keys.double(), group).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.matmul(p, expand_kv(values.double(), group)), lse


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("mask_kind", [None, "tail", "full", "column"])
def test_chunked_keys_match_one_softmax(chunk, mask_kind):
    g = torch.Generator().manual_seed(chunk)
    b, hkv, group, tq, t, d = 2, 3, 3, 5, 61, 16
    q = torch.randn(b, hkv * group, tq, d, generator=g).to(torch.bfloat16)
    keys = torch.randn(b, hkv, t, d, generator=g).to(torch.bfloat16) * 3
    values = torch.randn(b, hkv, t, d, generator=g).to(torch.bfloat16)
    mask = None
    if mask_kind == "tail":
        mask = torch.ones(tq, t, dtype=torch.bool).tril(diagonal=t - tq)
    elif mask_kind == "full":
        mask = torch.rand(b, hkv * group, tq, t, generator=g) > 0.5
        mask[0, 0, 0] = False  # a row that sees no key: out 0, lse -inf
    elif mask_kind == "column":
        mask = torch.rand(b, hkv * group, tq, 1, generator=g) > 0.3
    out, lse = attend_partial(q, keys, values, 0.25, mask, chunk=chunk)
    ref_out, ref_lse = reference(q, keys, values, 0.25, mask)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
    assert bool((out[~torch.isfinite(lse)] == 0).all())


def test_no_keys_is_an_empty_partial():
    q = torch.randn(1, 4, 2, 8)
    out, lse = attend_partial(q, torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8))
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
