"""pagestat: page statistics and UNIQUE / Quest / mean scores against direct formulas, Quest's upper
bound, forced pages and budgets, recall 1.0 at full budget, bad input, and the sample's recall."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvtool.core.attention import attend_partial
from kvtool.core.cache import LayerKV
from kvtool.cli import app
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats import get_format
from kvtool.formats.base import Encoded
from kvtool.formats.pagestat import PageStatParams, forced_pages, page_scores, page_stats, pages_to_select

from .conftest import synthetic_cache

FMT = get_format("pagestat")
runner = CliRunner()


def layer(tokens=50, d=8, heads=6, kv=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, kv, tokens, d, generator=g)
    v = torch.randn(1, kv, tokens, d, generator=g)
    return LayerKV(k.to(dtype), v.to(dtype))


def test_stats_hand_example_with_short_last_page():
    keys = torch.tensor([[1.0, 0], [3, 0], [2, 4], [2, 8], [5, -1]]).reshape(1, 1, 5, 2)
    st = page_stats(keys, 2, "unique")
    assert st["mean"][0, 0].tolist() == [[2.0, 0.0], [2.0, 6.0], [5.0, -1.0]]
    # population std per dim: page 0 (1, 0), page 1 (0, 2), page 2 (0, 0); sigma = L2 norm
    assert st["sigma"][0, 0].tolist() == pytest.approx([1.0, 2.0, 0.0])
    qs = page_stats(keys, 2, "quest")
    assert qs["max"][0, 0].tolist() == [[3.0, 0.0], [2.0, 8.0], [5.0, -1.0]]
    assert qs["min"][0, 0].tolist() == [[1.0, 0.0], [2.0, 4.0], [5.0, -1.0]]


def test_scores_match_direct_formulas():
    lay = layer(tokens=37, d=8, heads=6, kv=2)
    q = torch.randn(1, 6, 2, 8)
    ps = 8
    uni = page_scores(q, page_stats(lay.keys, ps, "unique"), "unique", lam=0.7)
    quest = page_scores(q, page_stats(lay.keys, ps, "quest"), "quest")
    mean = page_scores(q, page_stats(lay.keys, ps, "mean"), "mean")
    for b_h in range(2):
        for g in range(3):
            h = b_h * 3 + g
            for t in range(2):
                qv = q[0, h, t]
                for p in range(5):
                    kp = lay.keys[0, b_h, p * ps:(p + 1) * ps]
                    mu = kp.mean(0)
                    sigma = kp.std(0, unbiased=False).norm()
                    u = qv @ mu + 0.7 * qv.norm() * sigma
                    qu = torch.maximum(qv * kp.max(0).values, qv * kp.min(0).values).sum()
                    assert uni[0, b_h, t, p] >= u - 1e-5 and quest[0, b_h, t, p] >= qu - 1e-5 and mean[0, b_h, t, p] >= qv @ mu - 1e-5
    # and the max over the group is attained by one of its heads
    for p in range(5):
        kp = lay.keys[0, 0, p * ps:(p + 1) * ps]
        direct = max(float(q[0, h, 0] @ kp.mean(0) + 0.7 * q[0, h, 0].norm() * kp.std(0, unbiased=False).norm()) for h in range(3))
        assert float(uni[0, 0, 0, p]) == pytest.approx(direct, rel=1e-5, abs=1e-5)
        direct_q = max(float(torch.maximum(q[0, h, 0] * kp.max(0).values, q[0, h, 0] * kp.min(0).values).sum()) for h in range(3))
        assert float(quest[0, 0, 0, p]) == pytest.approx(direct_q, rel=1e-5, abs=1e-5)


def test_quest_score_bounds_the_true_max_in_every_page():
    for seed in range(5):
        lay = layer(tokens=101, d=16, heads=8, kv=2, seed=seed)
        q = torch.randn(1, 8, 4, 16, generator=torch.Generator().manual_seed(100 + seed)) * 3
        s = page_scores(q, page_stats(lay.keys, 16, "quest"), "quest")  # [1,2,4,7]
        true = torch.einsum("bkgtd,bksd->bkgts", q.reshape(1, 2, 4, 4, 16), lay.keys).amax(2)  # [1,2,4,101]
        pad = torch.full((1, 2, 4, 7 * 16 - 101), float("-inf"))
        page_max = torch.cat([true, pad], -1).unflatten(-1, (7, 16)).amax(-1)
        assert (s >= page_max - 1e-4).all()


def test_forced_pages_and_budget():
    assert forced_pages(50, 16, 16) == [0, 2, 3]  # tokens 34..49 touch pages 2 and 3 (a 2-token page)
    assert forced_pages(50, 16, 0) == [0]
    assert pages_to_select(50, 16, 16, 50) == 1  # 16 + 16 + 2 forced tokens leave 16 = the one other page
    assert pages_to_select(50, 16, 16, 49) == 0
    assert pages_to_select(64, 16, 0, 48) == 2


def test_full_budget_recalls_everything_and_matches_dense():
    lay = layer(tokens=50)
    enc = FMT.encode(lay, PageStatParams(page_size=8, budget=50))
    q = torch.randn(1, 6, 3, 8)
    assert FMT.selected_mask(q, enc).all()
    out, lse = FMT.attend(q, enc)
    ref_out, ref_lse = attend_partial(q, lay.keys, lay.values)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def test_selection_keeps_first_page_window_and_best_pages():
    lay = layer(tokens=64)
    enc = FMT.encode(lay, PageStatParams(page_size=8, budget=32, dense_window=8, score="quest"))
    assert enc.meta["forced_pages"] == [0, 7] and enc.meta["select"] == 2
    q = torch.randn(1, 6, 1, 8)
    pages = FMT.select(q, enc)
    s = page_scores(q, FMT.stats(enc), "quest")
    for h in range(2):
        got = pages[0, h, 0].tolist()
        assert got[:2] == [0, 7]
        order = [p for p in s[0, h, 0].argsort(descending=True).tolist() if p not in (0, 7)]
        assert set(got[2:]) == set(order[:2])
    mask = FMT.selected_mask(q, enc)
    assert mask.shape == (1, 6, 1, 64) and int(mask[0, 0, 0].sum()) == 32
    # traffic = statistics + the 32 attended tokens' keys and values
    stats = 2 * 8 * 2 * 8 * 4
    assert FMT.traffic_bytes(enc) == stats + 32 * 2 * 2 * 8 * 4


def test_bad_input():
    with pytest.raises(UsageError, match="page-size"):
        FMT.check(layer(tokens=10), PageStatParams(page_size=16, budget=10))
    with pytest.raises(UsageError, match="page-size"):
        from kvtool.formats.base import make_params

        make_params(FMT, {"page_size": "0"})
    with pytest.raises(UsageError, match="smaller than"):
        FMT.check(layer(tokens=100), PageStatParams(page_size=16, dense_window=16, budget=20))
    with pytest.raises(UsageError, match="score"):
        from kvtool.formats.base import make_params

        make_params(FMT, {"score": "best"})
    enc = FMT.encode(layer(tokens=50), PageStatParams(page_size=8, score="quest", budget=24))
    FMT.validate(enc)
    t = dict(enc.tensors)
    t["stats.min"] = t["stats.max"] + 1
    with pytest.raises(BadDataError, match="min"):
        FMT.validate(Encoded(t, enc.meta))
    t = dict(enc.tensors)
    t["stats.max"] = t["stats.max"][:, :, :-1]
    with pytest.raises(BadDataError, match="stats.max"):
        FMT.validate(Encoded(t, enc.meta))


def test_cli_and_sample_recall_unique_vs_quest(sample_capture, tmp_path):
    reports = {}
    for score in ("unique", "quest"):
        out = tmp_path / f"{score}.safetensors"
        res = runner.invoke(app, ["compress", str(sample_capture), "--format", "pagestat", "--score", score, "--budget", "128", "-o", str(out), "--json"])
        assert res.exit_code == 0, res.output
        reports[score] = json.loads(res.output)
    u, q = reports["unique"]["details"], reports["quest"]["details"]
    # statistics: unique = mean (D) + sigma (1) per page, quest = min + max (2D); 28 pages of 16
    assert u["storage_overhead"] == pytest.approx((64 + 1) / (2 * 16 * 64), abs=1e-4)
    assert q["storage_overhead"] == pytest.approx(2 * 64 / (2 * 16 * 64), abs=1e-4)
    assert u["recall_by_score"] == q["recall_by_score"]
    assert u["recall"] == u["recall_by_score"]["unique"] and q["recall"] == q["recall_by_score"]["quest"]
    assert all(0.3 < r <= 1 for r in u["recall_by_score"].values())
    assert u["pages_attended"] == 8 and u["traffic_ratio"] < 0.35


def test_synthetic_cli_bad_page_size(tmp_path):
    from kvtool.core import io

    cap = tmp_path / "cap.safetensors"
    io.save(synthetic_cache(tokens=80), cap)
    res = runner.invoke(app, ["compress", str(cap), "--format", "pagestat", "--page-size", "0", "-o", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2 and "page-size" in res.output
    res = runner.invoke(app, ["compress", str(cap), "--format", "pagestat", "--page-size", "64", "--heldout", "32", "-o", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2 and "larger than" in res.output
