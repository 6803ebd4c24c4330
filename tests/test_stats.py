"""kvtool.stats against hand-computed values, planted patterns and the real sample; `kvtool stats`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import kvtool
from kvtool.analysis import stats as S
from kvtool.core.attention import attention_probs
from kvtool.core.cache import LayerKV, ModelFacts
from kvtool.cli import app
from kvtool.core.errors import BadDataError

from .conftest import synthetic_cache

runner = CliRunner()


# ----------------------------------------------------------------------------- element statistics


def test_planted_outlier_channel_is_found():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 32, generator=g)
    x[:, 5] *= 10
    means = S.channel_mean_abs(x)
    assert S.outlier_channels(means, 4.0) == [5]
    ratio = float(S.outlier_ratios(means)[5])
    assert 7 < ratio < 13
    assert S.outlier_channels(means, ratio + 0.01) == []


def test_outlier_ratio_uses_the_true_median():
    means = torch.tensor([1.0, 2.0, 3.0, 4.0, 40.0, 5.0])  # median of 6 values = (3 + 4) / 2
    assert torch.allclose(S.outlier_ratios(means), means / 3.5)
    assert S.outlier_channels(means, 4.0) == [4]


def test_magnitude_summary_hand_values():
    x = torch.tensor([1.0, -1.0, 1.0, -1.0])
    s = S.magnitude_summary([x])
    assert s["mean_abs"] == 1.0 and s["max_abs"] == 1.0
    assert s["kurtosis"] == pytest.approx(-2.0)  # a two-point distribution: 1 - 3
    y = torch.arange(1, 101, dtype=torch.float32) * torch.where(torch.arange(100) % 2 == 0, 1.0, -1.0)
    s = S.magnitude_summary([y[:50], y[50:]])  # parts are pooled
    assert s["p50"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1) and s["max_abs"] == 100
    assert s["mean_abs"] == pytest.approx(50.5)


def test_kurtosis_of_a_gaussian_is_near_zero_and_grows_with_outliers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g)
    assert abs(S.excess_kurtosis(x)) < 0.1
    x[:200] *= 20
    assert S.excess_kurtosis(x) > 10


def test_top_mass_share_hand_values():
    x = torch.tensor([[3.0, -4.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(S.top_mass_share(x, 0.25), torch.tensor([16 / 25, 0.25, 1.0]))
    assert torch.allclose(S.top_mass_share(x, 0.5), torch.tensor([1.0, 0.5, 1.0]))
    assert S.kept_elements(64, 0.3) == 19 and S.kept_elements(64, 0.5) == 32 and S.kept_elements(4, 0.01) == 1


def test_sign_balance_and_binary_entropy():
    x = torch.tensor([[1.0, -1.0], [2.0, -2.0], [-1.0, -3.0], [0.0, 5.0]])
    assert torch.allclose(S.sign_balance(x), torch.tensor([0.75, 0.25]))
    assert torch.allclose(S.binary_entropy(torch.tensor([0.5, 0.0, 1.0])), torch.tensor([1.0, 0.0, 0.0]))


def test_sign_codes_bit_order():
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 5.0]])  # trailing 9th channel left out
    assert S.sign_codes(x).tolist() == [[1 + 4, 0]]
    assert S.sign_codes(torch.ones(1, 4)).tolist() == [[15]]


def test_code_entropy_hand_values():
    every = torch.arange(16)[:, None]
    assert S.code_entropy(every).tolist() == [pytest.approx(4.0)]
    assert S.code_entropy(torch.full((10, 1), 7)).tolist() == [0.0]
    half = torch.tensor([[3], [3], [12], [12]])
    assert S.code_entropy(half).tolist() == [pytest.approx(1.0)]


def offset_patterns() -> torch.Tensor:
    """16 rows x 4 channels: channel j = 10 + (+1 if bit j of the row index else -1)."""
    bits = (torch.arange(16)[:, None] >> torch.arange(4)) & 1
    return 10 + (2 * bits - 1).float()


def test_centring_restores_sign_entropy():
    x = offset_patterns()  # every element positive: one code only
    s = S.sign_summary(x)
    assert s["code_entropy_raw"] == 0.0 and s["sign_imbalance_raw"] == 0.5
    assert s["code_entropy_mean"] == pytest.approx(4.0) and s["sign_imbalance_mean"] == 0.0
    assert s["code_entropy_median"] == pytest.approx(4.0)  # median of {9 x8, 11 x8} is 10, not 9
    assert torch.equal(S.channel_median(x), torch.full((4,), 10.0))


def test_head_rows_drop_padding():
    keys = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).reshape(2, 1, 3, 2)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    rows = S.head_rows(keys, mask)
    assert rows.shape == (1, 5, 2)
    assert rows[0, 0].tolist() == [2.0, 3.0]
    assert S.head_rows(keys).shape == (1, 6, 2)


# ----------------------------------------------------------------------------- attention statistics


def test_keys_for_mass_and_sink_share_hand_values():
    p = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    assert S.keys_for_mass(p, 0.9).tolist() == [3]
    assert S.keys_for_mass(p, 0.99).tolist() == [4]
    assert S.keys_for_mass(p, 0.5).tolist() == [1]
    assert S.sink_share(p, 2).tolist() == [pytest.approx(0.55)]
    assert torch.allclose(S.mass_curve(p, torch.tensor([1, 2, 4])), torch.tensor([0.5, 0.8, 1.0]))


def test_query_positions():
    assert S.query_positions(10, 64).tolist() == [5, 6, 7, 8, 9]
    pos = S.query_positions(512, 64)
    assert pos.numel() == 64 and pos[0] == 256 and pos[-1] == 511
    assert S.query_positions(1, 4).tolist() == [0]


def pattern_layer(t: int = 12, d: int = 8) -> tuple[LayerKV, ModelFacts]:
    """4 query heads over 2 KV heads (G = 2). KV head 0: zero queries -> uniform causal attention,
    values all 1. KV head 1: heads 2, 3 look only at key 0 (a strong sink), values all 3."""
    facts = ModelFacts("pattern", "LlamaForCausalLM", 1, 4, 2, d, 4 * d, 10000.0, "float32")
    keys = torch.zeros(1, 2, t, d)
    keys[0, 1, 0, 0] = 1.0
    q = torch.zeros(1, 4, t, d)
    q[0, 2:, :, 0] = 200.0
    values = torch.ones(1, 2, t, d)
    values[0, 1] = 3.0
    return LayerKV(keys, values, q), facts


def test_known_attention_pattern_gives_known_concentration():
    layer, facts = pattern_layer()
    settings = S.StatsSettings(max_queries=64, sink_tokens=4)
    att = S.layer_attention(layer, facts, settings)
    pos = S.query_positions(12, 64)  # 6..11
    visible = pos + 1
    assert att.visible.tolist() == visible.tolist()
    for h in (0, 1):  # uniform over the visible keys
        assert att.keys_needed[0.9][h].tolist() == [math.ceil(0.9 * n - 1e-9) for n in visible.tolist()]
        assert att.keys_needed[0.99][h].tolist() == visible.tolist()
        assert torch.allclose(att.sink[h], 4 / visible.float())
    for h in (2, 3):  # everything on key 0: GQA head h reads KV head h // 2 = 1
        assert att.keys_needed[0.9][h].tolist() == [1] * len(pos)
        assert torch.allclose(att.sink[h], torch.ones(len(pos)))
    # values are constant per KV head, so each head's output is that vector: norm = value * sqrt(D)
    assert torch.allclose(att.out_norm[:2], torch.full((2, len(pos)), math.sqrt(8)))
    assert torch.allclose(att.out_norm[2:], torch.full((2, len(pos)), 3 * math.sqrt(8)))
    summary = S.attention_summary(att, settings)
    assert summary["heads"][2]["out_norm_share"] == pytest.approx(3 / 8)
    # norms 1,1,3,3 (x sqrt 8): 90% of 8 needs 3+3+1+1 -> 4 heads; 75% needs 2
    assert summary["all_heads"]["heads90"] == 4.0
    assert S.heads_for_norm(att.out_norm, 0.75).tolist() == [2] * len(pos)
    kv1 = S.kv_head_attention(summary, 1)
    assert kv1["query_heads"] == [2, 3] and kv1["keys90"] == 1.0 and kv1["sink_share"] == pytest.approx(1.0)


def test_causal_probs_never_look_ahead():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(20, 8, generator=g), torch.randn(20, 8, generator=g)
    pos = torch.tensor([3, 10, 19])
    p = S.causal_probs(q, k, pos)
    assert p.shape == (3, 20)
    assert float(p[0, 4:].sum()) == 0.0 and float(p[1, 11:].sum()) == 0.0
    assert torch.allclose(p.sum(-1), torch.ones(3))
    ref = attention_probs(q[None, None, pos], k[None, None, :4])[0, 0, 0]
    assert torch.allclose(p[0, :4], ref, atol=1e-6)


def test_attention_with_left_padding_uses_real_tokens_only():
    layer, facts = pattern_layer(t=12)
    pad = 4
    padded = LayerKV(
        torch.cat([torch.full((1, 2, pad, 8), 50.0), layer.keys], dim=2),
        torch.cat([torch.full((1, 2, pad, 8), 50.0), layer.values], dim=2),
        torch.cat([torch.zeros(1, 4, pad, 8), layer.queries], dim=2),
    )
    mask = torch.tensor([[0] * pad + [1] * 12])
    a = S.layer_attention(padded, facts, S.StatsSettings(), attention_mask=mask)
    b = S.layer_attention(layer, facts, S.StatsSettings())
    assert torch.equal(a.keys_needed[0.9], b.keys_needed[0.9])
    assert torch.allclose(a.out_norm, b.out_norm)
    assert a.positions == [[p + pad for p in b.positions[0]]]


def test_outlier_consistency_hand_example():
    outl = {0: {0: [3, 5], 1: []}, 7: {0: [3], 1: [9]}, 15: {0: [3, 9], 1: [9]}}
    c = S.outlier_consistency(outl)
    assert [h["kv_head"] for h in c["per_kv_head"]] == [0, 1]
    assert c["per_kv_head"][0]["persistent"] == [3]
    assert c["per_kv_head"][0]["recurring"] == [{"channel": 3, "layers": [0, 7, 15]}]
    assert c["per_kv_head"][0]["jaccard_consecutive"] == pytest.approx((1 / 2 + 1 / 2) / 2)
    assert c["per_kv_head"][1]["recurring"] == [{"channel": 9, "layers": [7, 15]}]
    assert [(e["channel"], e["pairs"]) for e in c["by_channel"]] == [(3, 3), (9, 3), (5, 1)]
    assert c["layer_head_pairs"] == 6


# ----------------------------------------------------------------------------- whole captures


def test_capture_stats_on_synthetic_cache_finds_the_planted_key_channel():
    cache = synthetic_cache(tokens=64, head_dim=16, layers=(0, 1))  # key channel 3 is x8
    r = S.capture_stats(cache, settings=S.StatsSettings(max_queries=8))
    for entry in r["layers"]:
        for head in entry["heads"]:
            assert head["keys"]["outlier_channels"] == [3]
            assert head["values"]["outliers"] == 0
            assert head["keys"]["top30_share"] > head["values"]["top30_share"]
            assert head["attention"]["query_heads"] == [2 * head["kv_head"], 2 * head["kv_head"] + 1]
        assert entry["keys"]["outliers"] == 2
    assert r["outlier_consistency"]["keys"]["per_kv_head"][0]["persistent"] == [3]
    assert r["model_summary"]["keys"]["outliers"] == 4
    assert r["settings"]["kept_elements"] == {"top30": 5, "top50": 8}
    assert r["selection"]["attention"] is True
    json.dumps(r)  # JSON-ready


def test_selection_narrows_layers_and_heads():
    cache = synthetic_cache(tokens=32, head_dim=8, layers=(0, 1, 2))
    r = S.capture_stats(cache, layers=[2], kv_heads=[1], attention=False)
    assert [e["layer"] for e in r["layers"]] == [2]
    assert [h["kv_head"] for h in r["layers"][0]["heads"]] == [1]
    assert "attention" not in r["layers"][0]


def test_query_statistics_without_queries():
    cache = synthetic_cache(tokens=32, head_dim=8, queries=False)
    with pytest.raises(BadDataError, match="--no-queries"):
        S.capture_stats(cache, attention=True)
    assert S.capture_stats(cache)["selection"]["attention"] is False


def test_real_sample_has_key_outliers_in_middle_and_late_layers_but_not_value_outliers(sample_capture):
    cache = kvtool.load(sample_capture, parts=("keys", "values"))
    r = S.capture_stats(cache, layers=[7, 15, 23], attention=False)
    key_out = value_out = 0
    for entry in r["layers"]:
        assert entry["keys"]["outliers"] >= 2, entry["layer"]
        assert entry["keys"]["max_ratio"] >= 8
        assert entry["values"]["max_ratio"] < 6  # values: nothing like the keys' 8-17x channels
        assert entry["keys"]["max_ratio"] > 2 * entry["values"]["max_ratio"]
        assert entry["keys"]["code_entropy_mean"] > entry["keys"]["code_entropy_raw"] + 0.4
        key_out += entry["keys"]["outliers"]
        value_out += entry["values"]["outliers"]
    assert key_out >= 5 * max(value_out, 1)


def test_real_sample_attention_concentrates_in_later_layers(sample_capture):
    cache = kvtool.load(sample_capture, layers=[0, 23])
    r = S.capture_stats(cache, settings=S.StatsSettings(max_queries=16))
    l0, l23 = (e["attention"]["all_heads"] for e in r["layers"])
    assert l23["keys90_frac"] < l0["keys90_frac"]
    assert l23["sink_share"] > l0["sink_share"]
    assert l23["heads90"] >= 1 and l23["heads90"] <= l23["heads99"] <= 9


# ----------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def no_query_capture(tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "noq.safetensors"
    kvtool.save(synthetic_cache(tokens=32, head_dim=8, queries=False), path)
    return path


def test_cli_stats_table_and_json(sample_capture):
    res = runner.invoke(app, ["stats", str(sample_capture), "--layers", "7,23", "--queries", "8"])
    assert res.exit_code == 0, res.output
    assert "outlier" in res.output and "sink" in res.output
    res = runner.invoke(app, ["stats", str(sample_capture), "--sort", "k_outliers", "--top", "3", "--queries", "8", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    counts = [r["k_outliers"] for r in data["rows"]]
    assert len(counts) == 3 and counts == sorted(counts, reverse=True)
    assert counts[0] == max(h["keys"]["outliers"] for e in data["layers"] for h in e["heads"])
    assert data["selection"]["selected_layers"] == [0, 7, 15, 23]


def test_cli_stats_outlier_factor_and_heads(sample_capture):
    res = runner.invoke(app, ["stats", str(sample_capture), "--layers", "15", "--heads", "1", "--outlier-factor", "10", "--no-attention", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["settings"]["outlier_factor"] == 10
    head = data["layers"][0]["heads"][0]
    assert head["kv_head"] == 1 and all(r >= 10 for r in head["keys"]["outlier_ratios"])


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["--layers", "5"], 2, "layer 5 is not in"),
        (["--layers", "99"], 2, "out of range"),
        (["--heads", "3"], 2, "KV head 3 is out of range"),
        (["--sort", "nope"], 2, "cannot sort by 'nope'"),
    ],
)
def test_cli_stats_bad_usage(sample_capture, args, code, text):
    res = runner.invoke(app, ["stats", str(sample_capture), "--no-attention", *args])
    assert res.exit_code == code, res.output
    assert text in res.output and "Traceback" not in res.output


def test_cli_stats_without_queries(no_query_capture, tmp_path):
    res = runner.invoke(app, ["stats", str(no_query_capture), "--attention"])
    assert res.exit_code == 1 and "recapture without --no-queries" in res.output
    res = runner.invoke(app, ["stats", str(no_query_capture)])
    assert res.exit_code == 0 and "no attention statistics" in res.output
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a capture")
    res = runner.invoke(app, ["stats", str(bad)])
    assert res.exit_code == 1 and "not a safetensors file" in res.output


def test_magnitude_accumulator_pools_exactly_and_samples_large_inputs(monkeypatch):
    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(300, 8, generator=g), 3 * torch.randn(100, 8, generator=g)]
    pooled = S.magnitude_summary(parts)
    whole = torch.cat([p.reshape(-1) for p in parts])
    assert pooled["mean_abs"] == pytest.approx(float(whole.abs().mean()), rel=1e-6)
    assert pooled["kurtosis"] == pytest.approx(S.excess_kurtosis(whole), rel=1e-9)
    assert pooled["p99"] == pytest.approx(float(np.percentile(whole.abs().numpy(), 99)), rel=1e-6)
    monkeypatch.setattr(S, "PERCENTILE_SAMPLE", 400)  # 3200 elements -> every 8th for percentiles
    sampled = S.magnitude_summary(parts)
    assert sampled["mean_abs"] == pooled["mean_abs"] and sampled["max_abs"] == pooled["max_abs"]
    assert sampled["p50"] != pooled["p50"] and sampled["p50"] == pytest.approx(pooled["p50"], rel=0.15)


def test_per_channel_lists_in_head_stats():
    x = torch.tensor([[1.0, -2.0, 3.0, 0.0], [-1.0, -2.0, 5.0, 0.0]])
    s = S.tensor_head_stats(x, S.StatsSettings())
    assert s["channel_mean_abs"] == [1.0, 2.0, 4.0, 0.0]
    assert s["sign_balance"] == [0.5, 0.0, 1.0, 1.0]
    assert s["sign_imbalance_raw"] == pytest.approx((0 + 0.5 + 0.5 + 0.5) / 4)
