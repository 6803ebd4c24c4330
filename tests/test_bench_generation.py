"""The generation loop of `kvtool bench decode --generate` and the growth cost (kvtool.bench.generation)
on the CPU: encodes happen between steps exactly when the layers have no room, are counted and timed
apart from the steps; the growth cost is the encode time per decoded position; a moved tensor forces
a new capture. The step here appends one token to every live layer (no model forward: fast); the
end-to-end run through the CLI is in test_live.py. No test asserts a GPU speed."""

from __future__ import annotations

import time

import pytest
import torch

from kvtool.bench import generation as G
from kvtool.bench.decode import ModelInfo, build_cache
from kvtool.hf.live import live_layers
from kvtool.hf.shapes import build_model


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", device=torch.device("cpu"), dtype=torch.float32, seed=0)


def appending_loop(model, provider: str, context: int = 160, step_sleep: float = 0.0):
    """A GrowthLoop whose step appends one random token to every live layer (and sleeps)."""
    info = ModelInfo.of(model)
    cache, _ = build_cache(model, info, provider, 1, context)
    lives = live_layers(cache)
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        kv = torch.randn((1, info.kv_heads, 1, info.head_dim), generator=g)
        for live in lives:
            live.append(kv, kv)
        if step_sleep:
            time.sleep(step_sleep)

    return G.GrowthLoop(cache, step, torch.device("cpu"), graph=False), lives


def test_encodes_run_between_steps_when_no_room_is_left(tiny):
    """Also: a bitmap layer that grows past its capacity (160 tokens: room for 4 blocks) holds each
    token once (the block encoded while the cache is re-laid leaves the new cache's window)."""
    loop, lives = appending_loop(tiny, "bitmap:sparsity=0.7")
    assert loop.chunk == 64 and loop.method == "eager" and loop.recaptures == 0
    loop.to_encode()
    start = [live.tokens for live in lives]
    blocks = [live.nblocks for live in lives]
    out = G.generate(loop, 130, batch=1, warmup=0)
    # from right after an encode a bitmap layer has 64 steps of room: encodes before steps 65 and 129, and the final one
    assert out["generate_encodes"] == 3 and out["generate_tokens"] == 130
    assert [live.tokens for live in lives] == [t + 130 for t in start]
    assert [live.nblocks for live in lives] == [b + 2 for b in blocks]  # 130 tokens filled two whole blocks
    assert 0 < out["generate_encode_share"] < 1 and out["generate_tokens_per_s"] > 0


def test_growth_cost_is_the_encode_time_per_position_not_the_steps(tiny, monkeypatch):
    """Each reserve that encodes sleeps 32 ms more (0.5 ms per position of a 64-token block); each
    step sleeps 25 ms: the growth cost sees the first, not the second."""
    loop, lives = appending_loop(tiny, "bitmap:sparsity=0.7", step_sleep=0.025)
    real = G.reserve

    def slow_reserve(cache, steps):
        before = [live.nblocks for live in lives]
        real(cache, steps)
        if [live.nblocks for live in lives] != before:
            time.sleep(0.032)

    monkeypatch.setattr(G, "reserve", slow_reserve)
    out = G.growth_cost(loop, 2)
    assert out["encode_repeats"] == 2 and out["encode_span_tokens"] == 64
    assert 500 <= out["encode_us_p10"] <= out["encode_us_per_token"] <= out["encode_us_p90"]
    assert out["encode_us_per_token"] < 500 + 12000  # 25 ms x 64 steps would add 25,000 µs per position


def test_layers_that_never_encode_have_no_growth(tiny):
    loop, _ = appending_loop(tiny, "dense/sdpa")
    assert loop.chunk == 0 and loop.to_encode() == 0
    out = G.generate(loop, 5, batch=2)
    assert out["generate_tokens"] == 5 and out["generate_tokens_per_s"] > 0


def test_chunk_of_a_mixed_layer_is_its_largest(tiny):
    loop, lives = appending_loop(tiny, "mixed:heads=quant:bits=2|bitmap:sparsity=0.5")
    assert G.chunk_of(lives[0]) == 64 and loop.chunk == 64


def test_fingerprint_sees_a_moved_tensor():
    class Layer:
        def __init__(self):
            self.buf = {"k": torch.zeros(4)}
            self.n = 3

    layer = Layer()
    before = G.fingerprint([layer])
    layer.buf["k"][0] = 1  # written in place: the same storage
    assert G.fingerprint([layer]) == before
    layer.buf["k"] = torch.zeros(8)  # re-allocated: a captured graph would read the old storage
    assert G.fingerprint([layer]) != before


def test_fingerprint_reaches_the_layers_inside_a_mixed_layer(tiny):
    _, lives = appending_loop(tiny, "mixed:heads=quant:bits=2|bitmap:sparsity=0.5")
    before = G.fingerprint(lives)
    inner = lives[0].groups[1][1]  # the bitmap group's live layer
    inner.cache.window_keys = inner.cache.window_keys.clone()
    assert G.fingerprint(lives) != before


def test_generate_warms_up_untimed_then_times_its_tokens(tiny, monkeypatch):
    """The default warm-up is as many untimed tokens as timed ones (each kernel's first-use
    compilation falls there); a slow first encode stands for a compile and is not in the timed span."""
    loop, lives = appending_loop(tiny, "bitmap:sparsity=0.7")
    real, calls = G.reserve, []

    def first_slow(cache, steps):
        before = [live.nblocks for live in lives]
        real(cache, steps)
        if [live.nblocks for live in lives] != before:
            calls.append(1)
            if len(calls) == 1:
                time.sleep(0.5)

    monkeypatch.setattr(G, "reserve", first_slow)
    start = [live.tokens for live in lives]
    out = G.generate(loop, 70, batch=1)
    assert out["generate_warmup_tokens"] == 70 and out["generate_tokens"] == 70
    assert all(live.tokens >= t + 140 for live, t in zip(lives, start))
    assert len(calls) >= 3 and out["generate_s"] < 0.5  # the slow first encode ran in the warm-up
