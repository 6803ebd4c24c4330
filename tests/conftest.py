"""Shared fixtures: a tiny random Llama saved as a local HF folder (with a byte-level tokenizer), a
synthetic capture, and the real sample capture from the embedded model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "smollm2-sample.safetensors"

if not torch.cuda.is_available():  # on a GPU the kernels run compiled (the gpu tests need that)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# converted GGUF weights are shared by every test that loads the embedded model (ignored by git)
os.environ.setdefault("KVTOOL_CACHE", str(ROOT / ".kvtool-cache"))


def make_byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + <s> (256) + </s> (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    vocab["<s>"] = 256
    vocab["</s>"] = 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    return fast


def make_tiny_llama(num_layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=258,
        hidden_size=heads * head_dim,
        intermediate_size=4 * heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A local HF folder: tiny random Llama (2 layers, 4 heads, 2 KV heads, head_dim 16) + tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = make_tiny_llama()
    model.save_pretrained(folder)
    make_byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_capture(tiny_llama_dir, tmp_path_factory) -> Path:
    """A capture file (96 tokens, 2 layers, queries and hidden) from the tiny Llama."""
    import kvtool

    cache = kvtool.capture("kvtool tiny capture " * 5, model=str(tiny_llama_dir), hidden=True)
    path = tmp_path_factory.mktemp("caps") / "tiny.safetensors"
    kvtool.save(cache, path)
    return path


@pytest.fixture(scope="session")
def sample_capture() -> Path:
    """The real 512-token capture from the embedded model shipped in samples/."""
    assert SAMPLE.exists(), "samples/smollm2-sample.safetensors is missing"
    return SAMPLE


def gpu_capture_file(path, tokens=4096):
    """A synthetic bf16 capture of Llama-3-8B's attention shape (32 / 8 heads, head_dim 128), layers
    0-3, saved at ``path``: what the multi-GPU tests spread over two GPUs."""
    from kvtool.core import io

    io.save(synthetic_cache(heads=32, kv_heads=8, head_dim=128, tokens=tokens, layers=(0, 1, 2, 3), dtype=torch.bfloat16), path)
    return path


def synthetic_cache(batch=1, heads=4, kv_heads=2, tokens=80, head_dim=16, layers=(0, 1), dtype=torch.float16, seed=0, queries=True):
    """A random KVCache with planted outlier key channel 3 (x8)."""
    from kvtool.core.cache import KVCache, LayerKV, ModelFacts, dtype_name

    g = torch.Generator().manual_seed(seed)
    facts = ModelFacts(
        name="synthetic", architecture="LlamaForCausalLM", num_layers=max(layers) + 1, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=heads * head_dim, rope_theta=10000.0,
        dtype=dtype_name(dtype), source="synthetic",
    )
    out = {}
    for i in layers:
        k = torch.randn(batch, kv_heads, tokens, head_dim, generator=g)
        k[..., 3] *= 8
        v = torch.randn(batch, kv_heads, tokens, head_dim, generator=g)
        q = torch.randn(batch, heads, tokens, head_dim, generator=g) if queries else None
        out[i] = LayerKV(k.to(dtype), v.to(dtype), None if q is None else q.to(dtype))
    ids = torch.randint(0, 250, (batch, tokens), generator=g)
    return KVCache(facts, out, ids, {"prefill_tokens": tokens, "generated_tokens": 0})


# every gpu test runs under a timeout where pytest-timeout is installed (the dev extra): a kernel that
# hangs becomes a failure with the stacks of all threads instead of a stalled run. The thread method,
# since a hung kernel blocks the main thread inside a CUDA call, where no signal handler runs (it
# ends the process: scripts/gpu_suite.sh records the test as a timeout and goes on after it).
GPU_TEST_TIMEOUT = float(os.environ.get("KVTOOL_GPU_TEST_TIMEOUT") or 120)


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu`` tests without CUDA, and under the interpreter (set above only where there is no
    CUDA; a GPU machine that exports TRITON_INTERPRET=1 runs the CPU suite). Give each ``gpu`` test
    a timeout (``GPU_TEST_TIMEOUT``) unless it has its own or ``--timeout`` was given."""
    if config.pluginmanager.hasplugin("timeout") and not config.getoption("timeout", None):
        for item in items:
            if "gpu" in item.keywords and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT, method="thread"))
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and TRITON_INTERPRET=0")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
