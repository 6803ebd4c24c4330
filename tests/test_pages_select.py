"""Triton page selection and split merge of kvtool.kernels.pages against their torch references
(interpreter, small shapes)."""

import pytest
import torch

from kvtool.formats import pagestat as F
from kvtool.kernels.pages import select_pages
from kvtool.kernels import pages as P
from kvtool.kernels.common import merge_splits


def _sets(x):
    return [sorted(r) for r in x.reshape(-1, x.shape[-1]).tolist()]


def test_select_matches_topk_without_ties():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 2, 1, 37, generator=gen)  # NP not a power of two
    forced = torch.tensor([0, 35, 36])
    one = P.select_pages_triton(scores, forced[:1], 1)  # one forced page, k = 1
    assert one[..., 0].eq(0).all() and _sets(one) == _sets(select_pages(scores, [0], 1))
    for k in (0, 1, 5, 34):  # 34 = NP - forced
        got = P.select_pages_triton(scores, forced, k)
        assert got.dtype == torch.int32 and got.shape == (2, 2, 1, 3 + k)
        assert got[..., :3].tolist() == forced.expand(2, 2, 1, 3).tolist()
        assert _sets(got) == _sets(select_pages(scores, [0, 35, 36], k))
        assert torch.equal(got, P.select_pages_triton_reference(scores, forced, k))


def test_select_ties_inf_nan_and_chunks():
    s = torch.tensor([1.0, 2.0, 2.0, float("-inf"), 2.0, float("nan"), -0.0, 0.0, 2.0, -5.0])
    scores = s.reshape(1, 1, 1, -1)
    forced = torch.tensor([9], dtype=torch.int32)
    # NaN highest, then the 2.0 ties by lowest page: 1, 2 (not 4, 8)
    assert P.select_pages_triton(scores, forced, 3).tolist() == [[[[9, 1, 2, 5]]]]
    # every non-forced page, -inf included
    assert sorted(P.select_pages_triton(scores, forced, 9)[0, 0, 0].tolist()) == list(range(10))
    # -inf only when nothing else is left; +0 and -0 are both above -5
    assert P.select_pages_triton(scores, forced, 8)[0, 0, 0].tolist() == [9, 0, 1, 2, 4, 5, 6, 7, 8]
    # chunked rows (block 16 over 50 pages) give the same lists as one block
    gen = torch.Generator().manual_seed(1)
    big = torch.randint(0, 6, (1, 2, 2, 50), generator=gen).float()  # many ties
    big[0, 0, 0, 7] = float("-inf")
    f = torch.tensor([0, 49])
    for k in (0, 3, 20, 48):
        want = P.select_pages_triton_reference(big, f, k)
        assert torch.equal(P.select_pages_triton(big, f, k, block=16), want)
        assert torch.equal(P.select_pages_triton(big, f, k), want)


@pytest.mark.parametrize("s", [3, 70])  # 70 splits: three steps of the merge's 32-split loads
def test_combine_matches_torch_merge(s):
    gen = torch.Generator().manual_seed(2)
    b, hkv, tq, gp, dp, g, d = 2, 2, 2, 16, 16, 4, 12
    part = torch.randn(b, hkv, tq, s, gp, dp, generator=gen)
    lse = torch.randn(b, hkv, tq, s, gp, generator=gen)
    lse[0, 0, 0, 1] = float("-inf")  # one empty split
    lse[1, 1, 1, :, 2] = float("-inf")  # one head row with no key at all
    out, l = P.combine_splits(part, lse, hkv * g, d)
    want_o, want_l = merge_splits(part[..., :d], lse, hkv * g)
    assert torch.allclose(out, want_o, atol=1e-5) and torch.allclose(l, want_l, atol=1e-5)
    assert torch.equal(out[1, 1 * g + 2, 1], torch.zeros(d)) and l[1, 1 * g + 2, 1] == float("-inf")


def test_decode_step_new_path_matches_reference():
    q, enc = F.make_pagestat_inputs(batch=1, heads=4, kv_heads=2, tokens=200, head_dim=16, dtype=torch.float32,
                                     device="cpu", page_size=8, budget=64, dense_window=8)
    o, l = F.pagestat_decode(q, enc)
    ro, rl = F.pagestat_decode_reference(q, enc)
    assert torch.allclose(o, ro, atol=1e-4) and torch.allclose(l, rl, atol=1e-4)
    m = enc.meta
    pages = P.select_pages_triton(torch.randn(1, 2, 1, 25), torch.tensor(m["forced_pages"]), 3)
    o1, l1 = P.paged_attention_reference(q, enc.tensors["keys"], enc.tensors["values"], pages, 8)
    o2, l2 = P.paged_attention(q, enc.tensors["keys"], enc.tensors["values"], pages, 8)
    assert torch.allclose(o1, o2, atol=1e-5) and torch.allclose(l1, l2, atol=1e-5)
