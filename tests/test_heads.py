"""Polar Sparsity head selection: norms and oracle against brute force, the error curve, the router on
the real sample, the CLI; and the selective head attention kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from typer.testing import CliRunner

from kvtool.core import io
from kvtool.core.errors import UsageError
from kvtool.methods.heads import (
    analyse_heads,
    error_curve,
    head_norms,
    head_outputs,
    kv_traffic,
    load_routers,
    oracle_topk,
    selection_error,
    selection_mask,
)
from kvtool.kernels import heads as kh

from .conftest import synthetic_cache


def brute_outputs(q, k, v):
    """Per token and head, a softmax over keys 0..t written with loops over tokens."""
    b, h, t, d = q.shape
    g = h // k.shape[1]
    out = torch.zeros(b, h, t, d)
    for bi, hi, ti in itertools.product(range(b), range(h), range(t)):
        s = (k[bi, hi // g, : ti + 1].float() @ q[bi, hi, ti].float()) / d**0.5
        out[bi, hi, ti] = torch.softmax(s, 0) @ v[bi, hi // g, : ti + 1].float()
    return out


def test_norms_and_oracle_against_brute_force():
    layer = synthetic_cache(tokens=12, head_dim=8, heads=6, kv_heads=2, dtype=torch.float32).layers[0]
    out = head_outputs(layer.queries, layer.keys, layer.values)
    torch.testing.assert_close(out, brute_outputs(layer.queries, layer.keys, layer.values), rtol=1e-5, atol=1e-5)
    norms = head_norms(out)[0]  # [T, H]
    for k in (1, 3, 6):
        oracle = selection_mask(oracle_topk(norms, k), 6)
        err = selection_error(norms, oracle)
        for t in range(12):
            # brute force over every k-subset: the oracle's error is the smallest, computed from the outputs
            full = out[0, :, t].reshape(-1)
            best = min(
                float((full - torch.where(torch.isin(torch.arange(6), torch.tensor(c))[:, None], out[0, :, t], 0.0).reshape(-1)).norm() / full.norm())
                for c in itertools.combinations(range(6), k)
            )
            assert abs(float(err[t]) - best) < 1e-5


def test_error_curve_hand_example():
    norms = torch.tensor([[3.0, 4.0, 0.0, 0.0]])  # head 1 then head 0; two KV heads of 2
    rows = error_curve(norms, kv_heads=2)
    assert [r["k"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["rel_l2"] == pytest.approx(3 / 5) and rows[1]["rel_l2"] == pytest.approx(0.0)
    assert rows[0]["traffic_ratio"] == 0.5 and rows[1]["traffic_ratio"] == 0.5 and rows[2]["traffic_ratio"] == 1.0
    assert float(kv_traffic(torch.tensor([[True, False, False, True]]), 2)[0]) == 1.0


def test_k_out_of_range_and_missing_inputs():
    cache = synthetic_cache(tokens=40, head_dim=8)
    for k in (0, 5):
        with pytest.raises(UsageError, match="1..4"):
            analyse_heads(cache, k=k, heldout=10)
    report, routers = analyse_heads(cache, k=2, heldout=10)
    assert routers == {} and "--hidden" in report["router_skipped"]
    no_q = synthetic_cache(tokens=40, head_dim=8, queries=False)
    with pytest.raises(UsageError, match="no-queries"):
        analyse_heads(no_q, k=2, heldout=10)


def test_router_beats_random_on_the_sample(sample_capture):
    cache = io.load(sample_capture, layers=[7, 23])
    report, routers = analyse_heads(cache, k=5, heldout=128)
    a = report["at_k"]
    assert set(routers) == {7, 23}
    assert a["random"]["recall"] == pytest.approx(5 / 9, abs=0.03)
    assert a["router"]["recall"] > a["random"]["recall"] + 0.1
    assert a["router"]["rel_l2"] < a["random"]["rel_l2"] - 0.1
    assert a["oracle"]["rel_l2"] <= a["router"]["rel_l2"]
    curve = [r["rel_l2"] for r in report["curve"]]
    assert all(x >= y - 1e-6 for x, y in zip(curve, curve[1:])) and curve[-1] == pytest.approx(0.0)


def test_cli_heads_json_router_and_plot(sample_capture, tmp_path):
    from kvtool.cli import app

    router, plot = tmp_path / "r.safetensors", tmp_path / "h.png"
    args = ["heads", str(sample_capture), "--layers", "15", "--k", "3", "--steps", "50", "--router-out", str(router), "--plot", str(plot), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["k"] == 3 and len(rep["curve"]) == 9 and rep["output"] == str(router) and "router_file" not in rep
    assert plot.read_bytes()[:4] == b"\x89PNG"
    routers, k = load_routers(router)
    assert k == 3 and routers[15].weight.shape == (9, 576)
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "exists" in again.output
    bad = CliRunner().invoke(app, ["heads", str(sample_capture), "--k", "0"])
    assert bad.exit_code == 2 and "out of range" in bad.output


def test_cli_router_needs_hidden(tmp_path):
    from kvtool.cli import app

    cap = tmp_path / "c.safetensors"
    io.save(synthetic_cache(tokens=40, head_dim=8), cap)
    res = CliRunner().invoke(app, ["heads", str(cap), "--heldout", "10", "--router-out", str(tmp_path / "r.safetensors")])
    assert res.exit_code == 2 and "--hidden" in res.output
    ok = CliRunner().invoke(app, ["heads", str(cap), "--heldout", "10"])
    assert ok.exit_code == 0 and "router skipped" in ok.output


# ----------------------------------------------------------------------------- kernel


def run_case(b, h, hkv, n, d, k, dtype, splits=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    keys = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    values = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(h, generator=g)[:k] for _ in range(b)])
    out, lse = kh.selective_head_attention(q, keys, values, idx, num_splits=splits)
    ref_out, ref_lse = kh.selective_head_attention_reference(q, keys, values, idx)
    listed = torch.zeros(b, h, dtype=torch.bool).scatter_(1, idx, True)
    assert torch.equal(out[~listed], torch.zeros_like(out[~listed])) and bool(torch.isneginf(lse[~listed]).all())
    if n:
        rel = (out - ref_out).norm() / ref_out.norm()
        assert rel < 1e-2, f"relative L2 {rel}"
        torch.testing.assert_close(lse[listed], ref_lse[listed], rtol=1e-3, atol=1e-3)
    else:
        assert bool(torch.isneginf(lse).all()) and not bool(out.any())


@pytest.mark.parametrize(
    "b,h,hkv,n,d,k,dtype,splits",
    [
        (2, 4, 4, 37, 16, 2, torch.float16, None),  # MHA, one partial tile
        (2, 6, 2, 130, 64, 3, torch.float16, 3),  # group 3, odd length over 3 splits
        (1, 8, 2, 64, 32, 1, torch.bfloat16, 2),  # group 4, an empty-ish second split, bf16
        (3, 8, 1, 70, 24, 8, torch.float32, 2),  # group 8, every head, head_dim not a power of 2
        (1, 4, 2, 0, 16, 2, torch.float16, None),  # no tokens
    ],
)
def test_kernel_matches_reference(b, h, hkv, n, d, k, dtype, splits):
    run_case(b, h, hkv, n, d, k, dtype, splits)


def test_kernel_merges_more_splits_than_one_combine_step():
    """44 splits of 16 tokens: the combine kernel walks them in steps of 32 (online rescaling)."""
    g = torch.Generator().manual_seed(5)
    q, keys, values = torch.randn(2, 8, 16, generator=g), torch.randn(2, 2, 700, 16, generator=g), torch.randn(2, 2, 700, 16, generator=g)
    keys[:, :, 650:] *= 4  # the largest scores sit in the last step's splits
    idx = torch.tensor([[0, 5, 6], [7, 1, 2]])
    out, lse = kh.selective_head_attention(q.half(), keys.half(), values.half(), idx, num_splits=44, block_n=16)
    ref_out, ref_lse = kh.selective_head_attention_reference(q.half(), keys.half(), values.half(), idx)
    listed = torch.zeros(2, 8, dtype=torch.bool).scatter_(1, idx, True)
    assert (out - ref_out).norm() / ref_out.norm() < 1e-2
    torch.testing.assert_close(lse[listed], ref_lse[listed], rtol=1e-3, atol=1e-3)


def test_kernel_skips_unlisted_kv_heads(monkeypatch):
    sentinel = 1234.5
    real = kh._workspace

    def marked(*args):
        acc, m, l = real(*args)
        m.fill_(sentinel)
        return acc, m, l

    monkeypatch.setattr(kh, "_workspace", marked)
    captured = {}
    orig_merge = kh.merge_split_partials

    def spy(acc, m, l, *rest, **kw):
        captured["m"] = m.clone()
        return orig_merge(acc, m, l, *rest, **kw)

    monkeypatch.setattr(kh, "merge_split_partials", spy)
    q = torch.randn(2, 6, 16).half()
    keys, values = torch.randn(2, 3, 50, 16).half(), torch.randn(2, 3, 50, 16).half()
    idx = torch.tensor([[0, 1], [5, 2]])  # batch 0: KV head 0 only; batch 1: KV heads 2 and 1
    out, _ = kh.selective_head_attention(q, keys, values, idx)
    m = captured["m"].view(2, 3, -1)
    touched = {(0, 0), (1, 2), (1, 1)}
    for bi, g in itertools.product(range(2), range(3)):
        untouched = bool((m[bi, g] == sentinel).all())
        assert untouched == ((bi, g) not in touched), (bi, g)
    assert kh.bytes_read(q, keys, idx) == 3 * 50 * 16 * 2 * 2 + 4 * (16 * 2 + 8)


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda a: a.update(idx=torch.tensor([[0, 9]])), "outside 0..5"),
        (lambda a: a.update(idx=torch.tensor([[1, 1]])), "twice"),
        (lambda a: a.update(idx=torch.tensor([[1.0, 2.0]])), "int32 or int64"),
        (lambda a: a.update(idx=torch.zeros(1, 7, dtype=torch.int64)), r"head_index must be \[batch=1, k\]"),
        (lambda a: a.update(idx=torch.zeros(2, 1, dtype=torch.int64)), r"head_index must be \[batch=1, k\]"),
        (lambda a: a.update(keys=a["keys"].float()), "keys is torch.float32"),
        (lambda a: a.update(q=a["q"][:, :5]), "q must be"),
        (lambda a: a.update(values=a["values"][:, :, :3]), "values must have the shape"),
    ],
)
def test_kernel_rejects_bad_inputs(mutate, needle):
    args = {"q": torch.randn(1, 6, 16).half(), "keys": torch.randn(1, 2, 8, 16).half(), "values": torch.randn(1, 2, 8, 16).half(), "idx": torch.tensor([[0, 3]])}
    mutate(args)
    with pytest.raises(UsageError, match=needle):
        kh.selective_head_attention(args["q"], args["keys"], args["values"], args["idx"])


def test_kernel_needs_cuda_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UsageError, match="CUDA"):
        kh.selective_head_attention(torch.randn(1, 2, 16).half(), torch.randn(1, 1, 8, 16).half(), torch.randn(1, 1, 8, 16).half(), torch.tensor([[0]]))


def test_kernel_on_real_sample(sample_capture):
    cache = io.load(sample_capture, layers=[15])
    layer = cache.layers[15]
    q = layer.queries[:, :, -1].contiguous()  # the last token's query, decode-style
    norms = head_norms(head_outputs(layer.queries[:, :, -1:], layer.keys, layer.values))[:, 0]  # [B, H]
    idx = oracle_topk(norms, 4)
    out, lse = kh.selective_head_attention(q, layer.keys, layer.values, idx, num_splits=3)
    ref_out, ref_lse = kh.selective_head_attention_reference(q, layer.keys, layer.values, idx)
    assert (out - ref_out).norm() / ref_out.norm() < 1e-2
