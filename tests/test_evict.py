"""SnapKV / StreamingLLM eviction and the snapstream format: selection against a direct computation,
the ring buffer against slice-and-concatenate, a planted needle, bad inputs, and the real sample."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from kvtool.core.attention import attend_partial
from kvtool.core.cache import LayerKV
from kvtool.core.errors import BadDataError, UsageError
from kvtool.methods.evict import (
    attention_mass_recall,
    evict_layer,
    evict_with,
    gather_tokens,
    parse_evict,
    snapkv_scores,
)
from kvtool.formats.base import Encoded, compress_cache, get_format
from kvtool.formats.snapstream import SnapStreamParams, append_token, naive_append, ring_slot

from .conftest import synthetic_cache


def rand_layer(b=1, h=4, hkv=2, t=24, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return LayerKV(
        keys=torch.randn(b, hkv, t, d, generator=g).to(dtype),
        values=torch.randn(b, hkv, t, d, generator=g).to(dtype),
        queries=torch.randn(b, h, t, d, generator=g).to(dtype),
    )


def direct_snapkv(layer, sinks, recent, window, pool, k):
    """Loops and math.exp: the same selection written out element by element."""
    b, hkv, t, d = layer.keys.shape
    h = layer.queries.shape[1]
    g = h // hkv
    cands = list(range(sinks, t - recent))
    result = []
    for bi in range(b):
        per_b = []
        for kv in range(hkv):
            total = [0.0] * len(cands)
            for qh in range(kv * g, kv * g + g):
                for qt in range(t - window, t):
                    q = layer.queries[bi, qh, qt].tolist()
                    vis = [c for c in cands if c <= qt]
                    if not vis:
                        continue
                    s = {c: sum(a * x for a, x in zip(q, layer.keys[bi, kv, c].tolist())) / math.sqrt(d) for c in vis}
                    mx = max(s.values())
                    z = sum(math.exp(v - mx) for v in s.values())
                    for c in vis:
                        total[c - sinks] += math.exp(s[c] - mx) / z
            pooled = []
            for j in range(len(cands)):
                lo, hi = j - pool // 2, j + pool // 2
                pooled.append(sum(total[i] for i in range(lo, hi + 1) if 0 <= i < len(cands)) / pool)
            best = sorted(range(len(cands)), key=lambda j: -pooled[j])[:k]
            per_b.append(sorted(sinks + j for j in best))
        result.append(per_b)
    return torch.tensor(result)


@pytest.mark.parametrize("window,pool", [(3, 1), (6, 3), (9, 5)])
def test_snapkv_matches_direct_computation(window, pool):
    layer = rand_layer(b=2, t=24)
    sinks, recent, k = 2, 4, 5
    kept = evict_layer(layer, budget=sinks + recent + k, sinks=sinks, recent=recent, window=window, pool=pool)
    expect = direct_snapkv(layer, sinks, recent, window, pool, k)
    assert kept.shape == (2, 2, sinks + k + recent)
    assert torch.equal(kept[..., :sinks], torch.arange(sinks).expand(2, 2, sinks))
    assert torch.equal(kept[..., -recent:], torch.arange(24 - recent, 24).expand(2, 2, recent))
    assert torch.equal(kept[..., sinks:sinks + k], expect)


def test_snapkv_scores_hand_example():
    # one head, D=1, keys 0/1 at candidates: a query of +big puts all mass on the '1' keys
    keys = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0]).view(1, 1, 6, 1)
    q = torch.full((1, 1, 6, 1), 50.0)
    scores = snapkv_scores(q, keys, sinks=1, recent=1, window=1, pool=1)
    torch.testing.assert_close(scores, torch.tensor([[[0.0, 0.5, 0.0, 0.5]]]))
    pooled = snapkv_scores(q, keys, sinks=1, recent=1, window=1, pool=3)
    torch.testing.assert_close(pooled, torch.tensor([[[0.5, 0.5, 1.0, 0.5]]]) / 3)


def test_streaming_policy_keeps_sinks_and_latest():
    layer = rand_layer(t=30)
    kept = evict_layer(layer, budget=12, sinks=2, recent=4, policy="streaming")
    assert kept[0, 0].tolist() == [0, 1] + list(range(20, 30))
    assert evict_layer(rand_layer(t=10), budget=12, sinks=2, recent=4).tolist()[0][0] == list(range(10))


def test_needle_survives_snapkv_but_not_streaming():
    layer = rand_layer(t=96, d=16, seed=3)
    layer.keys *= 0.1
    needle = 40
    direction = layer.queries[0, :, -8:].mean(dim=(0, 1))
    layer.keys[0, :, needle] = 6 * direction / direction.norm()
    kept = evict_layer(layer, budget=24, sinks=4, recent=8, window=8, pool=3)
    assert bool((kept == needle).any(-1).all()), "the needle must be kept by every KV head"
    stream = evict_layer(layer, budget=24, sinks=4, recent=8, policy="streaming")
    assert not bool((stream == needle).any())
    q = layer.queries[:, :, -8:]
    assert attention_mass_recall(q, layer.keys, kept).mean() > attention_mass_recall(q, layer.keys, stream).mean()


def test_gather_and_parse_evict():
    layer = rand_layer(t=40)
    params = parse_evict("snapkv:budget=16,sinks=2,recent=4,window=4,pool=3")
    small, kept = evict_with(layer, params)
    assert small.keys.shape == (1, 2, 16, 8)
    torch.testing.assert_close(small.keys[0, 1, 5], layer.keys[0, 1, kept[0, 1, 5]])
    torch.testing.assert_close(gather_tokens(layer, kept).values, small.values)
    assert parse_evict("streaming:budget=8").policy == "streaming"
    for bad in ("h2o:budget=4", "snapkv:window=4", "snapkv:budget=x", "snapkv:budget=4,foo=1"):
        with pytest.raises(UsageError):
            parse_evict(bad)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(budget=5, sinks=4, recent=4), "below --sinks"),
        (dict(budget=20, recent=4, window=50), "longer than"),
        (dict(budget=20, recent=4, pool=4), "odd"),
        (dict(budget=20, recent=4, policy="h2o"), "policy"),
    ],
)
def test_bad_eviction_parameters(kwargs, needle):
    with pytest.raises(UsageError, match=needle):
        evict_layer(rand_layer(t=40), **kwargs)


def test_missing_queries_is_a_clear_error():
    layer = rand_layer(t=40)
    layer.queries = None
    with pytest.raises(UsageError, match="no-queries"):
        evict_layer(layer, budget=20, recent=4)
    assert evict_layer(layer, budget=20, recent=4, policy="streaming").shape[-1] == 20


# ----------------------------------------------------------------------------- the format


def encode(layer, **kw):
    fmt = get_format("snapstream")
    return fmt, fmt.encode(layer, SnapStreamParams(**kw))


def pack(layer_k, layer_v, positions):
    return torch.cat([layer_k, layer_v, positions[..., None].to(layer_k.dtype)], dim=-1)


def test_layout_and_attend_mask_padding():
    layer = rand_layer(t=9)  # a short prefix: 2 candidates for 5 top-K slots
    fmt, enc = encode(layer, budget=12, sinks=2, recent=5, window=3, pool=1)
    pos = enc.tensors["positions"][0, 0].tolist()
    assert pos[:2] == [0, 1]
    assert sorted(pos[2:7]) == [4, 5, 6, 7, 8] and all(ring_slot(p, 2, 5) == 2 + j for j, p in enumerate(pos[2:7]))
    # the budget is clamped to the 9 tokens: no top-K slot would ever be filled beyond the 2 candidates
    assert pos[7:] == [2, 3] and int(enc.tensors["topk_pad"][0]) == 0
    assert enc.meta["budget"] == 9 and enc.meta["budget_clamped_from"] == 12
    fmt.validate(enc)
    q = torch.randn(1, 4, 3, 8)
    out, lse = fmt.attend(q, enc)
    ref_out, ref_lse = attend_partial(q, layer.keys, layer.values)  # every token kept: exact
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert torch.equal(fmt.decode(enc).keys, layer.keys)
    _, short = encode(layer, budget=12, sinks=2, recent=5)  # default window 32 > 9 tokens: nothing to evict, fine
    assert torch.equal(short.tensors["positions"], enc.tensors["positions"])


def test_ring_buffer_many_steps_matches_slice_and_concatenate():
    torch.manual_seed(0)
    for t, sinks, recent, budget in ((30, 3, 5, 14), (4, 3, 5, 10), (2, 3, 4, 9)):
        layer = rand_layer(t=t)
        fmt, enc = encode(layer, budget=budget, sinks=sinks, recent=recent, window=2, pool=1)
        kept = fmt.kept_positions(enc)
        full = pack(layer.keys, layer.values, torch.arange(t).expand(1, 2, t))
        s_part = [full[:, :, : min(sinks, t)]]
        r_part = [full[:, :, max(sinks, t - recent):t]]
        mid = kept[0, 0][(kept[0, 0] >= sinks) & (kept[0, 0] < t - recent)]
        top = [torch.stack([full[:, h, kept[0, h][(kept[0, h] >= sinks) & (kept[0, h] < t - recent)]] for h in range(2)], 1)]
        assert top[0].shape[2] == len(mid)
        for step in range(3 * recent + 7):
            p = t + step
            k, v = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
            before = enc.tensors["positions"].clone()
            slot = ring_slot(p, sinks, recent)
            enc = append_token(enc, k, v)
            # only that slot changed, and it held the oldest recent token (or was empty)
            changed = (enc.tensors["positions"] != before).any(0).any(0).nonzero().flatten().tolist()
            assert changed == [slot]
            old = int(before[0, 0, slot])
            assert old == -1 or old == p - recent
            s_part, r_part, top = naive_append(s_part, r_part, top, pack(k[:, :, None], v[:, :, None], torch.full((1, 2, 1), p)), sinks, recent)
            ref = torch.cat(s_part + top + r_part, 2)
            ref = torch.stack([ref[:, h, ref[0, h, :, -1].argsort()] for h in range(2)], 1)
            dense = fmt.decode(enc)
            got = pack(dense.keys, dense.values, fmt.kept_positions(enc))
            torch.testing.assert_close(got, ref)
            fmt.validate(enc)
        assert enc.meta["length"] == t + 3 * recent + 7


def test_paper_figure4_example():
    # L=26, sinks 1, recent 4: the newly generated token 27 replaces token 23
    assert ring_slot(27, 1, 4) == ring_slot(23, 1, 4)
    assert sorted(ring_slot(p, 1, 4) for p in range(22, 26)) == [1, 2, 3, 4]


def test_append_in_place_and_bad_shapes():
    fmt, enc = encode(rand_layer(t=20), budget=10, sinks=2, recent=3, window=2, pool=1)
    same = append_token(enc, torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8), inplace=True)
    assert same is enc and enc.meta["length"] == 21
    with pytest.raises(UsageError, match="key should be"):
        append_token(enc, torch.ones(1, 3, 8), torch.ones(1, 3, 8))


def test_validate_rejects_corruption():
    fmt, enc = encode(rand_layer(t=30), budget=12, sinks=2, recent=4, window=2, pool=1)
    bad = [
        ("positions", lambda p: p.__setitem__((0, 0, 0), 5)),
        ("positions", lambda p: p.__setitem__((0, 0, 3), 7)),
        ("positions", lambda p: p.__setitem__((0, 0, 8), 99)),
        ("positions", lambda p: p.__setitem__((0, 1, 7), p[0, 1, 6].item())),
        ("topk_pad", lambda p: p.__setitem__(0, 2)),
    ]
    for name, corrupt in bad:
        t = {k: v.clone() for k, v in enc.tensors.items()}
        corrupt(t[name])
        with pytest.raises(BadDataError):
            fmt.validate(Encoded(t, dict(enc.meta)))
    with pytest.raises(BadDataError, match="budget"):
        fmt.validate(Encoded(enc.tensors, dict(enc.meta, topk=1)))


def test_selected_mask_gives_the_same_recall():
    cache = synthetic_cache(tokens=120, head_dim=16)
    fmt = get_format("snapstream")
    cc = compress_cache(cache, fmt, SnapStreamParams(budget=40, sinks=2, recent=8, window=8, pool=3), heldout=20)
    enc = cc.layers[0]
    q = cache.layers[0].queries[:, :, 100:]
    keys = cache.layers[0].keys[:, :, :100]
    mask = fmt.selected_mask(q, enc)
    assert mask.shape == (1, 4, 20, 100) and int(mask[0, 0, 0].sum()) == 40
    probs = torch.softmax((q.float() @ keys.float().repeat_interleave(2, 1).transpose(-1, -2)) / 4, -1)
    torch.testing.assert_close((probs * mask).sum(-1), attention_mass_recall(q, keys, fmt.kept_positions(enc)))


def test_sample_snapkv_beats_streaming_at_equal_budget(sample_capture):
    from kvtool.core import io
    from kvtool.formats.base import compress_cache

    cache = io.load(sample_capture, layers=[7, 15])
    fmt = get_format("snapstream")
    cc = compress_cache(cache, fmt, SnapStreamParams(budget=128), heldout=64)
    rep = fmt.report(cc, cache)
    assert rep["kept_tokens"] == 128 and rep["kept_sinks"] == 4 and rep["kept_recent"] == 32 and rep["kept_topk"] == 92
    assert rep["recall"] > rep["recall_streaming_same_budget"] + 0.05
    assert 0.0 < rep["recall_streaming_same_budget"] < rep["recall"] <= 1.0


def test_cli_budget_below_sinks_plus_recent(sample_capture, tmp_path):
    from kvtool.cli import app

    out = tmp_path / "x.safetensors"
    res = CliRunner().invoke(app, ["compress", str(sample_capture), "--format", "snapstream", "--budget", "8", "--sinks", "4", "--recent", "8", "-o", str(out)])
    assert res.exit_code == 2 and "below --sinks" in res.output and not out.exists()
    res = CliRunner().invoke(app, ["compress", str(sample_capture), "-F", "snapstream", "--window", "600", "--heldout", "0", "-o", str(out)])
    assert res.exit_code == 2 and "longer than" in res.output
