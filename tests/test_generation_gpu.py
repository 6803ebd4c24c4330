"""`kvtool bench decode --generate` on the GPU (kvtool.bench.generation): the step captured in a CUDA
graph and replayed with every block encoded eagerly between replays gives eager steps' logits for the
same inputs, and `measure` reports the generation and a growth cost from replays.
Run with ``pytest -m gpu`` on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_replays_with_encodes_between_them_decode_like_eager_steps():
    """Bitmap: the loop encodes a block before the step that would overfill the window, the eager
    step inside it; both attend over the same pruned blocks and window. The same 160 input tokens
    (teacher-forced: a random 2-layer model's greedy argmax is near-tied, so one rounding apart
    would change every later input) give the same logits step by step, across the encodes and the
    recapture after the capacity is re-laid, and the layers hold the same tokens. A replay reading
    stale addresses after a re-allocation would be off by the logits' own scale, not by rounding."""
    from kvtool.bench.decode import ModelInfo, build_cache
    from kvtool.bench.generation import GrowthLoop, generate
    from kvtool.hf.interface import cache_kwargs
    from kvtool.hf.live import live_layers
    from kvtool.hf.shapes import build_model

    model = build_model("llama3-8b", device="cuda", dtype=torch.float16, layers=2)
    info = ModelInfo.of(model)
    inputs = torch.randint(0, model.config.vocab_size, (2, 161), generator=torch.Generator().manual_seed(0)).cuda()
    runs = {}
    for mode in ("graph", "eager"):
        cache, _ = build_cache(model, info, "bitmap:sparsity=0.7", 2, 4096)
        ids = inputs[:, :1].clone()
        last = torch.empty(2, model.config.vocab_size, dtype=torch.float32, device="cuda")
        kw = cache_kwargs(model, cache)
        seen = []

        pos = torch.full_like(ids, cache.get_seq_length())  # on the device, as decode_step holds them

        def step() -> None:
            out = model(input_ids=ids, position_ids=pos, use_cache=True, **kw)
            last.copy_(out.logits[:, -1].float())
            pos.add_(1)

        with torch.no_grad():
            step()
            loop = GrowthLoop(cache, step, torch.device("cuda"), graph=mode == "graph")
            assert loop.method == ("cuda-graph" if mode == "graph" else "eager"), loop.capture_error
            for i in range(1, 161):
                ids.copy_(inputs[:, i:i + 1])  # outside the graph: the replay reads the static input
                loop.token()
                seen.append(last.clone())
            out = generate(loop, 0, 2)  # the closing encode
        torch.cuda.synchronize()
        for live in live_layers(cache):
            live.reserve(1)  # the host's counts from the device
        runs[mode] = (torch.stack(seen, dim=1), [live.tokens for live in live_layers(cache)], loop.recaptures, out)
    assert runs["graph"][1] == runs["eager"][1]
    assert runs["graph"][2] <= 1  # a capacity re-laid once (1/32 more blocks at 4,096 tokens) is captured again
    graph, eager = runs["graph"][0], runs["eager"][0]  # [2, 160, vocab] float32
    err = (graph - eager).norm(dim=-1) / eager.norm(dim=-1)
    assert err.max().item() < 1e-2, f"step {int(err.amax(0).argmax())}: logits relative L2 {err.max().item():.3g}"


@pytest.mark.parametrize("provider", ["dense/sdpa", "bitmap:sparsity=0.7", "quant:bits=4", "snapkv:budget=1984+quant:bits=4,group=128,residual=0"])
def test_measure_reports_generation_and_growth(provider):
    from kvtool.bench.decode import measure
    from kvtool.hf.shapes import build_model

    model = build_model("llama3-8b", device="cuda", dtype=torch.float16, layers=2)
    m = measure(model, provider, 2, 4096, runs=5, generate_tokens=200, encode_repeats=3)
    # a growing layer re-allocates its capacity (KIVI: at least 256 tokens more, or 1/64; bitmap: 1/32
    # more blocks) and the loop captures the step again. The loop decodes about 200 generated tokens
    # + 3 growth spans of at least a chunk (128-token KIVI groups here) + the steps to reach an encode:
    # under 800 tokens, so at most 3 re-allocations of 256 tokens
    assert m["generate_method"] == "cuda-graph" and m["generate_recaptures"] <= 3
    assert m["generate_tokens"] == 200 and m["generate_tokens_per_s"] > 0 and 0 <= m["generate_encode_share"] < 1
    if provider.startswith("dense"):
        assert "encode_us_per_token" not in m  # dense never encodes: no growth measured
    else:
        assert m["generate_encodes"] >= 200 // m["chunk"]
        assert m["encode_repeats"] == 3 and 0 < m["encode_us_p10"] <= m["encode_us_per_token"] <= m["encode_us_p90"]
