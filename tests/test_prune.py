"""Pruning methods against hand-worked examples, exact sparsity, the dense window, bad input, the
`kvtool prune` command, and the paper's ordering on the real sample."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from kvtool.core import io
from kvtool.core.attention import dense_attention
from kvtool.core.cache import LayerKV
from kvtool.cli import app
from kvtool.core.errors import UsageError
from kvtool.methods.prune import (
    accumulated_attention,
    group_query_abs_sum,
    keep_count,
    parse_method,
    per_channel_mask,
    per_token_mask,
    prune_layer,
    think_key_channel_score,
    topk_mask,
    two_four_mask,
)

from .conftest import synthetic_cache

runner = CliRunner()


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_keep_count_is_round_half_up_of_the_kept_share():
    assert keep_count(64, 0.7) == 19  # 19.2
    assert keep_count(64, 0.5) == 32
    assert keep_count(128, 0.7) == 38  # 38.4 (the reference code keeps 40)
    assert keep_count(10, 0.25) == 8  # 7.5 rounds up
    assert keep_count(64, 0.99) == 1  # 0.64
    assert keep_count(64, 0.0) == 64
    assert keep_count(5, 0.7) == 2  # 1.5 rounds up


def test_topk_ties_keep_the_lower_index():
    assert topk_mask(t([1, 1, 1, 1]), 2, 0).tolist() == [True, True, False, False]
    assert topk_mask(t([0, 2, 2, 1, 2]), 2, 0).tolist() == [False, True, True, False, False]


def test_per_token_hand_example():
    score = t([[3, 1, 2, 4], [1, 1, 1, 1]]).abs()
    assert per_token_mask(score, 0.5).tolist() == [[True, False, False, True], [True, True, False, False]]
    assert per_token_mask(score, 0.7).tolist() == [[False, False, False, True], [True, False, False, False]]  # keep round(1.2)=1


def test_per_channel_hand_example_groups_and_short_last_group():
    # 5 tokens, 2 channels, groups of 3: tokens 0-2 keep round(1.5)=2, tokens 3-4 keep 1
    score = t([[1, 9], [5, 9], [3, 0], [2, 4], [2, 8]])
    mask = per_channel_mask(score, 0.5, group=3)
    assert mask[:, 0].tolist() == [False, True, True, True, False]
    assert mask[:, 1].tolist() == [True, True, False, False, True]


def test_two_four_hand_example():
    score = t([1, 5, 3, 2, 0, 0, 7, 7, 9, 9])
    assert two_four_mask(score).tolist() == [False, True, True, False, False, False, True, True, True, False]


def test_output_aware_key_score_hand_example():
    # 2 query heads on 1 KV head, 3 tokens, horizon 2: sum |Q| over heads, then over t..t+1
    q = torch.tensor([[[[1, 0], [0, 2], [1, 1]], [[-1, 1], [0, 0], [0, -3]]]], dtype=torch.float32)
    a = group_query_abs_sum(q, 1, horizon=2)
    assert a[0, 0].tolist() == [[2, 3], [1, 6], [1, 4]]
    # magnitude keeps channel 0 of key [2, 1.5]; the output-aware score [2*2, 1.5*3] keeps channel 1
    keys = torch.tensor([[[[2, 1.5], [1, 1], [1, 1]]]])
    layer = LayerKV(keys, keys.clone(), q)
    mag = prune_layer(layer, 0.5, 0.0, "per-token", dense_window=0)
    oa = prune_layer(layer, 0.5, 0.0, "output-aware", dense_window=0)
    assert mag.key_mask[0, 0, 0].tolist() == [True, False]
    assert oa.key_mask[0, 0, 0].tolist() == [False, True]


def test_accumulated_attention_hand_example():
    # keys all zero: query t' spreads 1/(t'+1) over keys 0..t'; token t collects from t'=t..T-1
    keys = torch.zeros(1, 1, 3, 2)
    q = torch.ones(1, 2, 3, 2)
    a = accumulated_attention(keys, q)
    want = [1 + 1 / 2 + 1 / 3, 1 / 2 + 1 / 3, 1 / 3]
    torch.testing.assert_close(a[0, 0], 2 * torch.tensor(want))  # two query heads in the group
    # per-channel output-aware values: token 0 (weight 3.67) beats token 2 (0.67) despite |v| 2 < 3
    v = torch.tensor([[[[2.0], [0.1], [3.0]]]])
    layer = LayerKV(torch.zeros(1, 1, 3, 1), v, q[..., :1])
    res = prune_layer(layer, 0.0, 0.7, "per-token/output-aware", dense_window=0)
    assert res.value_mask[0, 0, :, 0].tolist() == [True, False, False]


def test_think_hand_example_drops_whole_channels():
    keys = torch.tensor([[[[3.0, 0.0], [4.0, 1.0]]]])
    q = torch.tensor([[[[0.0, 2.0], [0.0, 0.0]]]])
    assert think_key_channel_score(keys, q)[0, 0].tolist() == [0.0, 2.0]  # ||q|| * ||k|| = [0*5, 2*1]
    res = prune_layer(LayerKV(keys, keys.clone(), q), 0.5, 0.0, "think", dense_window=0)
    assert res.key_mask[0, 0].tolist() == [[False, True], [False, True]]
    # values: zero keys give A = [[1, 0], [.5, .5]]; A V = [[2, 0], [1, .5]] -> channel 0 wins
    v = torch.tensor([[[[2.0, 0.0], [0.0, 1.0]]]])
    res = prune_layer(LayerKV(torch.zeros(1, 1, 2, 2), v, q), 0.0, 0.5, "think", dense_window=0)
    assert res.value_mask[0, 0].tolist() == [[True, False], [True, False]]


@pytest.mark.parametrize("method", ["per-token", "per-channel", "output-aware", "think"])
@pytest.mark.parametrize("s", [0.0, 0.5, 0.7, 0.9])
def test_exact_sparsity_window_untouched_and_zeros(method, s):
    layer = synthetic_cache(tokens=100, head_dim=64, heads=6, kv_heads=2).layers[0]
    res = prune_layer(layer, s, s, method, dense_window=20)
    assert res.key_mask.shape == layer.keys.shape and res.key_mask.dtype == torch.bool
    for mask, x, pruned in ((res.key_mask, layer.keys, res.keys), (res.value_mask, layer.values, res.values)):
        assert mask[:, :, 80:].all()
        assert torch.equal(pruned[:, :, 80:], x[:, :, 80:])
        assert torch.equal(pruned, x.masked_fill(~mask, 0))
    kept = res.key_mask[:, :, :80].sum().item() / res.key_mask[:, :, :80].numel()
    if method in ("per-token", "output-aware"):
        assert (res.key_mask[:, :, :80].sum(-1) == keep_count(64, s)).all()
    if method == "think":
        assert kept == pytest.approx(keep_count(64, s) / 64)
    assert res.stats["achieved_key_sparsity"] == pytest.approx(1 - kept)


def test_bad_input():
    layer = synthetic_cache(tokens=40, head_dim=16).layers[0]
    for s in (-0.1, 1.0, 1.5, math.nan):
        with pytest.raises(UsageError, match="at least 0 and below 1"):
            prune_layer(layer, s, 0.5)
    with pytest.raises(UsageError, match="unknown pruning method 'magic'"):
        prune_layer(layer, 0.5, 0.5, "magic")
    with pytest.raises(UsageError, match="KEYS/VALUES"):
        parse_method("a/b/c")
    with pytest.raises(UsageError, match="2:4"):
        prune_layer(layer, 0.7, 0.5, "2:4")
    noq = LayerKV(layer.keys, layer.values)
    with pytest.raises(UsageError, match="recapture without --no-queries"):
        prune_layer(noq, 0.5, 0.5, "output-aware")
    assert parse_method("output-aware/per-token") == ("output-aware", "per-token")


def test_prune_command(tmp_path):
    cap = tmp_path / "cap.safetensors"
    io.save(synthetic_cache(tokens=70, head_dim=16), cap)
    out = tmp_path / "p.safetensors"
    res = runner.invoke(app, ["prune", str(cap), "-o", str(out), "--key-sparsity", "0.5", "--value-sparsity", "0.75", "--dense-window", "6", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["achieved_key_sparsity"] == 0.5 and rep["achieved_value_sparsity"] == 0.75
    pruned = io.load(out)
    assert pruned.info["pruned"]["method"] == "per-token" and pruned.info["pruned"]["achieved_value_sparsity"] == 0.75
    k = pruned.layers[0].keys
    assert (k[:, :, :64] == 0).float().mean().item() == pytest.approx(0.5, abs=0.01) and (k[:, :, 64:] != 0).all()
    res = runner.invoke(app, ["prune", str(cap), "-o", str(out)])
    assert res.exit_code == 2 and "exists" in res.output
    res = runner.invoke(app, ["prune", str(cap), "-o", str(out), "--force", "--sparsity", "1"])
    assert res.exit_code == 2 and "below 1" in res.output
    res = runner.invoke(app, ["prune", str(cap), "-o", str(out), "--force", "--method", "nope"])
    assert res.exit_code == 2 and "unknown pruning method" in res.output
    noq = tmp_path / "noq.safetensors"
    io.save(synthetic_cache(tokens=70, head_dim=16, queries=False), noq)
    res = runner.invoke(app, ["prune", str(noq), "-o", str(out), "--force", "--method", "output-aware"])
    assert res.exit_code == 2 and "recapture without --no-queries" in res.output


def _key_error(cache, method, s, heldout=64):
    errs = []
    for layer in cache.layers.values():
        t = layer.num_tokens
        res = prune_layer(layer.slice_tokens(0, t - heldout), s, 0.0, method, dense_window=32)
        keys = torch.cat([res.keys, layer.keys[:, :, t - heldout :]], 2)
        q = layer.queries[:, :, t - heldout :]
        ref = dense_attention(q, layer.keys, layer.values, causal=True)
        out = dense_attention(q, keys, layer.values, causal=True)
        errs.append(float((out - ref).norm() / ref.norm()))
    return sum(errs) / len(errs)


def test_paper_ordering_on_the_real_sample(sample_capture):
    """Per-token unstructured pruning of keys keeps more of the attention output (smaller relative
    L2 error on the held-out queries) than ThinK-like structured pruning at the same sparsity, and
    more than 2:4 at 50%."""
    cache = io.load(sample_capture, parts=("keys", "values", "queries"))
    for s in (0.5, 0.7):
        assert _key_error(cache, "per-token", s) < _key_error(cache, "think", s)
    assert _key_error(cache, "per-token", 0.5) < _key_error(cache, "2:4", 0.5)
