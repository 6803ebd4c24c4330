"""The signvq and pagestat Triton kernels against their torch references under TRITON_INTERPRET=1:
small odd shapes, GQA groups 1, 3, 4, 8, fp16/bf16, several splits, real captured tensors, bad input."""

from __future__ import annotations

import pytest
import torch

from kvtool.core.cache import LayerKV
from kvtool.core.errors import UsageError
from kvtool.formats import get_format
from kvtool.formats.pagestat import PageStatParams, make_pagestat_inputs, pagestat_decode, pagestat_decode_reference
from kvtool.formats.signvq import (
    SignVQParams,
    lut_scores,
    make_signvq_inputs,
    signvq_attention_reference,
    signvq_decode,
)
from kvtool.kernels.pages import page_criticality, page_scores, paged_attention, paged_attention_reference
from kvtool.kernels.signvq_lut import lut_scores_kernel, signvq_attention

SIGNVQ = get_format("signvq")
PAGESTAT = get_format("pagestat")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def untied_topk_equal(kernel: torch.Tensor, ref: torch.Tensor, k: int, gap: float = 1e-3) -> None:
    """Top-k sets agree for every row whose k-th and (k+1)-th reference scores are not tied."""
    srt = ref.sort(-1, descending=True).values
    clear = (srt[..., k - 1] - srt[..., k]) > gap if k < ref.shape[-1] else torch.ones(ref.shape[:-1], dtype=torch.bool)
    a = torch.zeros_like(ref, dtype=torch.bool).scatter_(-1, kernel.topk(k, -1).indices, True)
    b = torch.zeros_like(ref, dtype=torch.bool).scatter_(-1, ref.topk(k, -1).indices, True)
    assert clear.any()
    assert torch.equal(a[clear], b[clear])


CASES = [  # group, dtype, head_dim, tokens, bits, gqa
    (1, torch.float16, 64, 53, 2, "sum"),
    (3, torch.bfloat16, 20, 41, 4, "max"),
    (4, torch.float16, 32, 37, 8, "max"),
    (8, torch.bfloat16, 32, 29, 2, "sum"),
]


@pytest.mark.parametrize("group,dtype,d,tokens,bits,gqa", CASES)
def test_lut_scores_kernel(group, dtype, d, tokens, bits, gqa):
    q, enc = make_signvq_inputs(batch=2, heads=2 * group, kv_heads=2, tokens=tokens, head_dim=d, dtype=dtype, device="cpu", bits=bits, group=d // 2 if d % 8 == 0 else d, budget=16, sinks=2, dense_window=3, gqa=gqa)
    q = torch.cat([q, -q], 2)
    t = enc.tensors
    ref = lut_scores(q, t["index.codes"], t["index.codebook"], gqa)
    for lookup in ("table", "gather", "onehot"):
        got = lut_scores_kernel(q, t["index.codes"], t["index.codebook"], gqa, lookup=lookup, block_tokens=16)
        assert got.shape == ref.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    untied_topk_equal(got, ref, 8)


@pytest.mark.parametrize("group,d,tokens,gqa,dtype", [(1, 64, 300, "sum", torch.float16), (3, 128, 257, "max", torch.float32),
                                                      (4, 128, 1000, "sum", torch.float16), (8, 64, 129, "max", torch.bfloat16)])
def test_lut_scores_kernel_word_reads_several_blocks_per_program(group, d, tokens, gqa, dtype):
    """D a multiple of 32: codes read as 32-bit words, 3 blocks of 32 tokens per program (one table)."""
    q, enc = make_signvq_inputs(2, 2 * group, 2, tokens, d, dtype=dtype, device="cpu", budget=32, gqa=gqa)
    codes, book = enc.tensors["index.codes"], enc.tensors["index.codebook"]
    ref = lut_scores(q, codes, book, gqa)
    for lookup in ("table", "gather"):
        got = lut_scores_kernel(q, codes, book, gqa, lookup=lookup, block_tokens=32, iters=3)
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-3 * ref.abs().max().item())


def test_lut_scores_kernel_bad_gqa_mode():
    q, enc = make_signvq_inputs(1, 4, 2, 64, 64, dtype=torch.float16, device="cpu", budget=16)
    with pytest.raises(UsageError, match="gqa must be"):
        lut_scores_kernel(q, enc.tensors["index.codes"], enc.tensors["index.codebook"], "mean")
    with pytest.raises(UsageError, match="lookup must be"):
        lut_scores_kernel(q, enc.tensors["index.codes"], enc.tensors["index.codebook"], lookup="shared")


@pytest.mark.parametrize("group,dtype,d,tokens,bits,gqa", CASES)
def test_signvq_attention_kernel_and_decode(group, dtype, d, tokens, bits, gqa):
    q, enc = make_signvq_inputs(batch=1, heads=2 * group, kv_heads=2, tokens=tokens, head_dim=d, dtype=dtype, device="cpu", bits=bits, group=d // 2 if d % 8 == 0 else d, budget=24, sinks=2, dense_window=3, gqa=gqa)
    q = torch.cat([q, q.flip(1)], 2)
    tc = enc.meta["compressed_tokens"]
    g = torch.Generator().manual_seed(group)
    idx = torch.stack([torch.randperm(tc, generator=g)[:19] for _ in range(2 * 2)]).reshape(1, 2, 2, 19).to(torch.int32)
    ref = signvq_attention_reference(q, enc, idx)
    for splits in (1, 3):
        out, lse = signvq_attention(q, enc, idx, splits=splits, block_tokens=16)
        assert rel_l2(out, ref[0]) < 1e-2 and torch.allclose(lse, ref[1], atol=1e-3, rtol=1e-3)
    out, lse = signvq_decode(q, enc)
    r_out, r_lse = SIGNVQ.attend(q, enc)
    assert rel_l2(out, r_out) < 1e-2 and torch.allclose(lse, r_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("qgroup", [8, 16, 64])
def test_signvq_attention_quantisation_groups_per_token(qgroup):
    """8 groups per token (per-element scale loads), 4 and 1 (per-token loads spread by group)."""
    q, enc = make_signvq_inputs(batch=2, heads=4, kv_heads=2, tokens=70, head_dim=64, dtype=torch.float16, device="cpu",
                                group=qgroup, budget=24, sinks=2, dense_window=5)
    out, lse = signvq_decode(q, enc)
    r_out, r_lse = SIGNVQ.attend(q, enc)
    assert rel_l2(out, r_out) < 1e-2 and torch.allclose(lse, r_lse, atol=1e-3, rtol=1e-3)


def test_signvq_attention_empty_selection_is_an_empty_partial():
    q, enc = make_signvq_inputs(batch=1, heads=4, kv_heads=2, tokens=40, head_dim=16, dtype=torch.float16, device="cpu", group=16, budget=8)
    out, lse = signvq_attention(q, enc, torch.zeros(1, 2, 1, 0, dtype=torch.int32))
    assert (out == 0).all() and torch.isinf(lse).all() and (lse < 0).all()


@pytest.mark.parametrize("group,score,dtype", [(1, "unique", torch.float16), (3, "quest", torch.bfloat16), (4, "mean", torch.float16), (8, "unique", torch.bfloat16)])
def test_page_criticality_kernel(group, score, dtype):
    q, enc = make_pagestat_inputs(batch=2, heads=2 * group, kv_heads=2, tokens=83, head_dim=24, dtype=dtype, device="cpu", page_size=8, budget=40, score=score)
    q = torch.cat([q, -q * 2], 2)
    stats = PAGESTAT.stats(enc)
    ref = page_scores(q, stats, score, 0.8)
    got = page_criticality(q, stats, score, 0.8)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    untied_topk_equal(got, ref, 4)


@pytest.mark.parametrize("group,dtype,page", [(1, torch.float16, 16), (3, torch.bfloat16, 8), (4, torch.float16, 5), (8, torch.bfloat16, 16)])
def test_paged_attention_kernel_and_decode(group, dtype, page):
    q, enc = make_pagestat_inputs(batch=1, heads=2 * group, kv_heads=2, tokens=71, head_dim=32, dtype=dtype, device="cpu", page_size=page, budget=40, score="quest")
    q = torch.cat([q, q.flip(1)], 2)
    k, v = enc.tensors["keys"], enc.tensors["values"]
    npages = -(-71 // page)
    g = torch.Generator().manual_seed(group)
    pages = torch.stack([torch.randperm(npages - 1, generator=g)[:4] for _ in range(4)]).reshape(1, 2, 2, 4)
    pages = torch.cat([pages, torch.full((1, 2, 2, 1), npages - 1)], -1).to(torch.int32)  # + the short last page
    ref = paged_attention_reference(q, k, v, pages, page)
    for splits in (1, 2, 5):
        out, lse = paged_attention(q, k, v, pages, page, splits=splits)
        assert rel_l2(out, ref[0]) < 1e-2 and torch.allclose(lse, ref[1], atol=1e-3, rtol=1e-3)
    out, lse = pagestat_decode(q, enc)
    r_out, r_lse = PAGESTAT.attend(q, enc)
    assert rel_l2(out, r_out) < 1e-2 and torch.allclose(lse, r_lse, atol=1e-3, rtol=1e-3)


def test_kernels_on_real_captured_tensors(sample_capture):
    from kvtool.core import io

    cache = io.load(sample_capture, layers=[15])
    full = cache.layers[15]
    prefix = full.slice_tokens(0, 448)
    q = full.queries[:, :, 448:451]
    for fmt, params, run in (
        (SIGNVQ, SignVQParams(keep_top=8, dense_window=16), signvq_decode),
        (PAGESTAT, PageStatParams(score="unique"), pagestat_decode),
    ):
        enc = fmt.encode(LayerKV(prefix.keys, prefix.values, prefix.queries), params)
        out, lse = run(q, enc)
        r_out, r_lse = fmt.attend(q, enc)
        assert rel_l2(out, r_out) < 1e-2 and torch.allclose(lse, r_lse, atol=1e-3, rtol=1e-3)


def test_bad_input_raises_before_launch(monkeypatch):
    q, enc = make_signvq_inputs(batch=1, heads=4, kv_heads=2, tokens=40, head_dim=16, dtype=torch.float16, device="cpu", group=16, budget=8)
    t = enc.tensors
    with pytest.raises(UsageError, match="q is torch.float32"):
        signvq_decode(q.float(), enc)
    with pytest.raises(UsageError, match="q has shape"):
        signvq_decode(q[:, :3], enc)
    with pytest.raises(UsageError, match="outside"):
        signvq_attention(q, enc, torch.full((1, 2, 1, 2), 99, dtype=torch.int32))
    with pytest.raises(UsageError, match="codes must be uint8"):
        lut_scores_kernel(q, t["index.codes"][..., :0], t["index.codebook"])
    q2, enc2 = make_pagestat_inputs(batch=1, heads=4, kv_heads=2, tokens=40, head_dim=16, dtype=torch.float16, device="cpu", page_size=8, budget=24)
    with pytest.raises(UsageError, match="pages must be int32"):
        paged_attention(q2, enc2.tensors["keys"], enc2.tensors["values"], torch.zeros(1, 2, 1, 2, dtype=torch.int64), 8)
    with pytest.raises(UsageError, match="twice"):
        paged_attention(q2, enc2.tensors["keys"], enc2.tensors["values"], torch.ones(1, 2, 1, 2, dtype=torch.int32), 8)
    with pytest.raises(UsageError, match="outside"):
        paged_attention(q2, enc2.tensors["keys"], enc2.tensors["values"], torch.full((1, 2, 1, 1), 5, dtype=torch.int32), 8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UsageError, match="need CUDA tensors"):
        pagestat_decode(q2, enc2)


def test_full_budget_kernels_equal_dense_attention_over_decode():
    from kvtool.core.attention import attend_partial

    q, enc = make_signvq_inputs(batch=1, heads=6, kv_heads=2, tokens=45, head_dim=16, dtype=torch.float16, device="cpu", group=16, budget=45, sinks=3, dense_window=2)
    assert enc.meta["select"] == 40
    dec = SIGNVQ.decode(enc)
    out, lse = signvq_decode(q, enc)
    ref = attend_partial(q, dec.keys, dec.values)
    assert rel_l2(out, ref[0]) < 1e-2 and torch.allclose(lse, ref[1], atol=1e-3, rtol=1e-3)
    q, enc = make_pagestat_inputs(batch=1, heads=6, kv_heads=2, tokens=45, head_dim=16, dtype=torch.float16, device="cpu", page_size=8, budget=45)
    out, lse = pagestat_decode(q, enc)
    ref = attend_partial(q, enc.tensors["keys"], enc.tensors["values"])
    assert rel_l2(out, ref[0]) < 1e-2 and torch.allclose(lse, ref[1], atol=1e-3, rtol=1e-3)


def pagestat_stats(enc):
    return {n.split(".", 1)[1]: x for n, x in enc.tensors.items() if n.startswith("stats.")}


@pytest.mark.parametrize("group,score,tokens,dtype", [(1, "unique", 300, torch.float16), (3, "quest", 257, torch.float32),
                                                      (4, "mean", 1000, torch.float16), (8, "unique", 129, torch.bfloat16)])
def test_page_criticality_several_program_blocks(group, score, tokens, dtype):
    """head_dim 64, 16 pages per program, partial last page."""
    q, enc = make_pagestat_inputs(2, 2 * group, 2, tokens, 64, dtype=dtype, device="cpu", page_size=16, budget=64, score=score)
    st = pagestat_stats(enc)
    got = page_criticality(q, st, score, enc.meta["lam"], block_pages=16)
    ref = page_scores(q, st, score, enc.meta["lam"]).float()
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())


def test_pagestat_decode_head_dim_64_matches_reference():
    q, enc = make_pagestat_inputs(1, 8, 2, 600, 64, dtype=torch.float16, device="cpu", page_size=16, budget=128)
    out, lse = pagestat_decode(q, enc)
    ref, ref_lse = pagestat_decode_reference(q, enc)
    assert (out - ref).norm() / ref.norm() < 1e-2
    assert torch.allclose(lse, ref_lse, atol=1e-2)


def test_page_criticality_unknown_score_and_missing_statistic():
    q, enc = make_pagestat_inputs(1, 4, 2, 64, 64, dtype=torch.float16, device="cpu", budget=32)
    with pytest.raises(UsageError, match="score must be"):
        page_criticality(q, pagestat_stats(enc), "best")
    with pytest.raises(UsageError, match="needs the page statistic 'max'"):
        page_criticality(q, pagestat_stats(enc), "quest")


def test_device_page_choice_matches_the_format():
    from kvtool.formats.pagestat import select_pages
    from kvtool.kernels.pages import forced_index, select_pages_device

    scores = torch.randn(2, 3, 1, 50, generator=torch.Generator().manual_seed(0))
    forced = [0, 47, 48, 49]
    got = select_pages_device(scores, forced_index(forced, scores.device), 7)
    ref = select_pages(scores, forced, 7)
    assert torch.equal(got[..., :4], ref[..., :4])
    assert torch.equal(got[..., 4:].sort(-1).values, ref[..., 4:].sort(-1).values)
    assert forced_index(forced, scores.device) is forced_index(forced, scores.device)
