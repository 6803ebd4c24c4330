"""GPU checks at Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128): every format through
the verify path (compress on the GPU, score the held-out queries) with its kernel against its torch
reference, the torch path on the GPU against the same path on the CPU, and model-level fidelity on
the GPU against the CPU. Run on a CUDA machine with ``pytest -m gpu``; skipped elsewhere."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvtool.core.cache import KVCache, LayerKV, ModelFacts
from kvtool.analysis.fidelity import attention_fidelity
from kvtool.formats import load_all
from kvtool.formats.base import CompressedCache, Encoded, compress_cache, make_params

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
LAYERS = (0, 1)
KERNEL_TOLERANCE = 1e-3
FORMATS = sorted(load_all())
# The bitmap kernel's fp16 build at head_dim 128 fails in Triton's TritonGPUOptimizeDotOperands pass
# (seen on the H100 with Triton 3.6); the kernel fix belongs to the bitmap-kernel work (issue 21).


def llama8b_capture(tokens: int, dtype: torch.dtype, seed: int = 0) -> KVCache:
    """A synthetic capture of real Llama-3-8B attention shapes on the GPU: keys with two large
    channels (as RoPE'd keys have), queries Gaussian, values Gaussian around a per-channel mean of
    the same size (as real values have; zero-mean values would make every output a near-zero
    average whose relative error is all bf16 rounding of the probabilities)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    facts = ModelFacts(name="llama3-8b-shaped", architecture="LlamaForCausalLM", num_layers=32, num_heads=HEADS,
                       num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden_size=4096, rope_theta=500000.0,
                       dtype=str(dtype).removeprefix("torch."), source="synthetic")
    layers = {}
    for i in LAYERS:
        k = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, device="cuda", generator=g)
        k[..., 5] *= 6
        k[..., 70] *= 4
        v = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, device="cuda", generator=g)
        v += torch.randn(1, KV_HEADS, 1, HEAD_DIM, device="cuda", generator=g)
        q = torch.randn(1, HEADS, tokens, HEAD_DIM, device="cuda", generator=g)
        layers[i] = LayerKV(k.to(dtype), v.to(dtype), q.to(dtype))
    ids = torch.randint(0, 128000, (1, tokens), generator=torch.Generator().manual_seed(seed))
    return KVCache(facts, layers, ids, {"prefill_tokens": tokens, "generated_tokens": 0})


_captures: dict[tuple[int, str], KVCache] = {}
_compressed: dict[tuple[int, str, str], CompressedCache] = {}


def compressed(tokens: int, dtype: torch.dtype, name: str) -> tuple[KVCache, CompressedCache]:
    key = (tokens, str(dtype))
    if key not in _captures:
        _captures.clear()
        _compressed.clear()
        _captures[key] = llama8b_capture(tokens, dtype)
    cache = _captures[key]
    if (tokens, str(dtype), name) not in _compressed:
        fmt = load_all()[name]
        _compressed[(tokens, str(dtype), name)] = compress_cache(cache, fmt, make_params(fmt, {}), heldout=64)
    return cache, _compressed[(tokens, str(dtype), name)]


def on_cpu(cc: CompressedCache) -> CompressedCache:
    layers = {i: Encoded({n: t.cpu() for n, t in e.tensors.items()}, e.meta) for i, e in cc.layers.items()}
    tails = {i: t.to("cpu") for i, t in cc.tails.items()}
    return CompressedCache(cc.facts, cc.format, cc.params, layers, tails, cc.token_ids, cc.info)


CASES = [(t, d, n) for t in (4096, 32768) for d in (torch.float16, torch.bfloat16) for n in FORMATS]


@pytest.mark.parametrize("tokens,dtype,name", CASES, ids=[f"{t}-{str(d)[6:]}-{n}" for t, d, n in CASES])
def test_every_format_verifies_on_the_gpu_at_llama8b_shapes(tokens, dtype, name):
    cache, cc = compressed(tokens, dtype, name)
    assert all(t.is_cuda for e in cc.layers.values() for t in e.tensors.values()), "the format encoded off the GPU"
    fmt = cc.fmt
    for m in (1, 16, 64):
        torch_gpu = attention_fidelity(cc, cache, m, "torch", device="cuda")
        assert torch_gpu["device"].startswith("cuda") and torch_gpu["backend"] == "torch"
        err = torch_gpu["overall"]["rel_l2"]
        assert math.isfinite(err), (m, err)
        if fmt.has_kernel:
            got = attention_fidelity(cc, cache, m, "triton", device="cuda")
            assert got["backend"] == "triton"
            assert got["kernel_vs_torch"]["rel_l2"] < KERNEL_TOLERANCE, (m, got["kernel_vs_torch"])
            assert abs(got["torch_overall"]["rel_l2"] - err) < 1e-4


@pytest.mark.parametrize("name", FORMATS)
def test_torch_path_on_gpu_matches_cpu(name):
    cache, cc = compressed(4096, torch.bfloat16, name)
    gpu = attention_fidelity(cc, cache, 16, "torch", device="cuda")
    host = KVCache(cache.facts, {i: l.to("cpu") for i, l in cache.layers.items()}, cache.token_ids, cache.info)
    cpu = attention_fidelity(on_cpu(cc), host, 16, "torch", device="cpu")
    assert cpu["device"] == "cpu"
    # the same maths; bf16 products may round differently on the two devices
    for key in ("rel_l2", "cosine"):
        assert close(gpu["overall"][key], cpu["overall"][key]), (key, gpu["overall"], cpu["overall"])
    if cpu["recall"] is not None:
        assert close(gpu["recall"]["recall"], cpu["recall"]["recall"])


def close(a: float, b: float, rel: float = 1e-2, abs_: float = 1e-4) -> bool:
    return abs(a - b) <= abs_ + rel * abs(b)


def test_model_level_fidelity_gpu_matches_cpu(tiny_llama_dir, tmp_path):
    """Capture, compress and verify with the model on the GPU and on the CPU (same float32 model)."""
    from typer.testing import CliRunner

    from kvtool.cli import app

    runner = CliRunner()
    cap = tmp_path / "cap.safetensors"
    res = runner.invoke(app, ["capture", "--model", str(tiny_llama_dir), "--prompt", "kvtool on the GPU " * 12, "--device", "cuda", "--chunk-size", "64", "-o", str(cap), "--json"])
    assert res.exit_code == 0, res.output
    comp = tmp_path / "cap.quant.safetensors"
    res = runner.invoke(app, ["compress", str(cap), "--format", "quant:bits=4", "--heldout", "32", "--device", "cuda", "-o", str(comp), "--json"])
    assert res.exit_code == 0, res.output
    out = {}
    for device in ("cpu", "cuda"):
        res = runner.invoke(app, ["verify", str(comp), "--model", str(tiny_llama_dir), "--generate", "4", "--device", device, "--json"])
        assert res.exit_code == 0, res.output
        out[device] = json.loads(res.output)
    assert out["cuda"]["attention"]["device"].startswith("cuda") and out["cpu"]["attention"]["device"] == "cpu"
    gpu, cpu = out["cuda"]["model_fidelity"], out["cpu"]["model_fidelity"]  # verify --json names it model_fidelity
    for key in ("nll_dense", "nll_lossy"):
        assert abs(gpu[key] - cpu[key]) < 1e-3, (key, gpu[key], cpu[key])
    # one near-tied argmax may flip between devices
    assert abs(gpu["agreement"] - cpu["agreement"]) <= 1.5 / gpu["positions"], (gpu["agreement"], cpu["agreement"])
    assert close(out["cuda"]["attention"]["overall"]["rel_l2"], out["cpu"]["attention"]["overall"]["rel_l2"])
