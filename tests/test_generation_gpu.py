"""`kvtool bench decode --generate` on the GPU (kvtool.bench.generation): the step captured in a CUDA
graph and replayed with every block encoded eagerly between replays decodes the same greedy tokens
as eager steps, and `measure` reports the generation and a growth cost from replays.
Run with ``pytest -m gpu`` on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_replays_with_encodes_between_them_decode_like_eager_steps():
    """Bitmap: the loop encodes a block before the step that would overfill the window, the eager
    step inside it; both attend over the same pruned blocks and window, so 160 greedy tokens (two
    blocks encoded) come out the same and the layers hold the same tokens."""
    from kvtool.bench.decode import ModelInfo, build_cache
    from kvtool.bench.generation import GrowthLoop, generate
    from kvtool.hf.interface import cache_kwargs
    from kvtool.hf.live import live_layers
    from kvtool.hf.shapes import build_model

    model = build_model("llama3-8b", device="cuda", dtype=torch.float16, layers=2)
    info = ModelInfo.of(model)
    runs = {}
    for mode in ("graph", "eager"):
        cache, _ = build_cache(model, info, "bitmap:sparsity=0.7", 2, 4096)
        ids = torch.full((2, 1), 7, dtype=torch.int64, device="cuda")
        kw = cache_kwargs(model, cache)
        seen = []

        def step() -> None:
            out = model(input_ids=ids, use_cache=True, **kw)
            ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))

        with torch.no_grad():
            step()
            loop = GrowthLoop(cache, step, torch.device("cuda"), graph=mode == "graph")
            assert loop.method == ("cuda-graph" if mode == "graph" else "eager"), loop.capture_error
            for _ in range(160):
                loop.token()
                seen.append(ids.clone())
            out = generate(loop, 0, 2)  # the closing encode
        torch.cuda.synchronize()
        for live in live_layers(cache):
            live.reserve(1)  # the host's counts from the device
        runs[mode] = (torch.cat(seen, dim=1), [live.tokens for live in live_layers(cache)], loop.recaptures, out)
    assert runs["graph"][1] == runs["eager"][1]
    assert runs["graph"][2] <= 1  # a capacity re-laid once (1/32 more blocks at 4,096 tokens) is captured again
    assert torch.equal(runs["graph"][0], runs["eager"][0])


@pytest.mark.parametrize("provider", ["dense/sdpa", "bitmap:sparsity=0.7", "quant:bits=4", "snapkv:budget=1984+quant:bits=4,group=128,residual=0"])
def test_measure_reports_generation_and_growth(provider):
    from kvtool.bench.decode import measure
    from kvtool.hf.shapes import build_model

    model = build_model("llama3-8b", device="cuda", dtype=torch.float16, layers=2)
    m = measure(model, provider, 2, 4096, runs=5, generate_tokens=200, encode_repeats=3)
    # a growing layer re-allocates its capacity (KIVI: one group spare, then 1/64 more; bitmap: 1/32
    # more blocks) within 200 tokens of 4,096, and the loop captures the step again: at most twice
    assert m["generate_method"] == "cuda-graph" and m["generate_recaptures"] <= 2
    assert m["generate_tokens"] == 200 and m["generate_tokens_per_s"] > 0 and 0 <= m["generate_encode_share"] < 1
    if provider.startswith("dense"):
        assert "encode_us_per_token" not in m  # dense never encodes: no growth measured
    else:
        assert m["generate_encodes"] >= 200 // m["chunk"]
        assert m["encode_repeats"] == 3 and 0 < m["encode_us_p10"] <= m["encode_us_per_token"] <= m["encode_us_p90"]
