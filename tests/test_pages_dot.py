"""The tensor-core page criticality variant against the format's torch scores, and its decode step
against the owner's torch reference, under TRITON_INTERPRET=1 (GQA groups 1, 3, 4, 8; all three
scores; partial last page)."""

from __future__ import annotations

import pytest
import torch

from kvtool.formats.pagestat import page_scores
from kvtool.kernels.pages import make_pagestat_inputs, pagestat_decode_reference
from kvtool.kernels.pages_dot import page_criticality_dot, pagestat_decode_dot


def stats_of(enc):
    return {n.split(".", 1)[1]: x for n, x in enc.tensors.items() if n.startswith("stats.")}


@pytest.mark.parametrize("group,score,tokens,dtype", [(1, "unique", 300, torch.float16), (3, "quest", 257, torch.float32),
                                                      (4, "mean", 1000, torch.float16), (8, "unique", 129, torch.bfloat16)])
def test_scores_match_the_format(group, score, tokens, dtype):
    q, enc = make_pagestat_inputs(2, 2 * group, 2, tokens, 64, dtype=dtype, device="cpu", page_size=16, budget=64, score=score)
    st = stats_of(enc)
    got = page_criticality_dot(q, st, score, enc.meta["lam"], block_pages=16)
    ref = page_scores(q, st, score, enc.meta["lam"]).float()
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())


def test_decode_step_matches_reference():
    q, enc = make_pagestat_inputs(1, 8, 2, 600, 64, dtype=torch.float16, device="cpu", page_size=16, budget=128)
    out, lse = pagestat_decode_dot(q, enc)
    ref, ref_lse = pagestat_decode_reference(q, enc)
    assert (out - ref).norm() / ref.norm() < 1e-2
    assert torch.allclose(lse, ref_lse, atol=1e-2)


def test_unknown_score_and_missing_statistic():
    q, enc = make_pagestat_inputs(1, 4, 2, 64, 64, dtype=torch.float16, device="cpu", budget=32)
    from kvtool.errors import UsageError

    with pytest.raises(UsageError, match="score must be"):
        page_criticality_dot(q, stats_of(enc), "best")
    with pytest.raises(UsageError, match="needs the page statistic 'max'"):
        page_criticality_dot(q, stats_of(enc), "quest")


def test_device_page_choice_matches_the_format():
    from kvtool.formats.pagestat import select_pages
    from kvtool.kernels.pages_dot import forced_index, select_pages_device

    scores = torch.randn(2, 3, 1, 50, generator=torch.Generator().manual_seed(0))
    forced = [0, 47, 48, 49]
    got = select_pages_device(scores, forced_index(forced, scores.device), 7)
    ref = select_pages(scores, forced, 7)
    assert torch.equal(got[..., :4], ref[..., :4])
    assert torch.equal(got[..., 4:].sort(-1).values, ref[..., 4:].sort(-1).values)
    assert forced_index(forced, scores.device) is forced_index(forced, scores.device)
