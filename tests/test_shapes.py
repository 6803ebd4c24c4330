"""Named model shapes and the random-weight builder (kvtool.hf.shapes): the table, meta-device
construction, per-parameter seeding (a slice or another placement has the same weights), device
maps planned by accelerate, and captures of ``random:<shape>`` models."""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.core.errors import UsageError
from kvtool.hf import shapes
from kvtool.hf.shapes import SHAPES, build_model, empty_model, plan_device_map


def test_table_sizes_match_the_published_parameter_counts():
    # Llama-3-8B has 8.03e9 parameters and Llama-3-70B 70.55e9 (their model cards round to 8B / 70B)
    assert SHAPES["llama3-8b"].params() == 8_030_261_248
    assert SHAPES["llama3-70b"].params() == 70_553_706_496
    # SmolLM2-135M ties its embeddings: counted once
    assert 134e6 < SHAPES["smollm2"].params() < 136e6
    m = empty_model("llama3-70b")
    assert sum(p.numel() for p in m.parameters()) == SHAPES["llama3-70b"].params()
    cfg = SHAPES["llama3-70b"].config()
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (80, 8192, 64, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_parameters["rope_theta"]) == (28672, 128256, 500000.0)


def test_bench_shapes_come_from_the_same_table():
    from kvtool.bench import harness

    assert set(harness.MODEL_SHAPES) == set(SHAPES)
    s = harness.model_shape("llama3-70b")
    assert (s.heads, s.kv_heads, s.head_dim) == (64, 8, 128)


def test_unknown_shape_and_bad_slice_are_usage_errors():
    with pytest.raises(UsageError, match="llama3-70b"):
        shapes.shape_named("random:gpt5")
    with pytest.raises(UsageError, match="1..4"):
        build_model("tiny", layers=5)


def test_built_model_has_no_meta_tensors_and_the_rotary_buffers_of_a_normal_build():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    m = build_model("tiny")
    assert all(t.device.type == "cpu" for t in list(m.parameters()) + list(m.buffers()))
    assert m.model.embed_tokens.weight.dtype == torch.float32
    ref = LlamaRotaryEmbedding(SHAPES["tiny"].config())
    assert torch.equal(m.model.rotary_emb.inv_freq, ref.inv_freq)
    assert torch.equal(m.model.rotary_emb.original_inv_freq, ref.original_inv_freq)
    assert torch.equal(m.model.norm.weight, torch.ones(64))
    w = m.model.layers[0].mlp.down_proj.weight
    assert abs(float(w.std()) - 0.02) < 0.002 and abs(float(w.mean())) < 0.002
    assert not any(p.requires_grad for p in m.parameters()) and not m.training


def test_weights_depend_on_seed_and_name_only():
    a = build_model("tiny").state_dict()
    b = build_model("tiny").state_dict()
    c = build_model("tiny", seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])
    # two parameters of one shape are not the same draw
    assert not torch.equal(a["model.layers.0.self_attn.k_proj.weight"], a["model.layers.0.self_attn.v_proj.weight"])
    assert not torch.equal(a["model.layers.0.self_attn.k_proj.weight"], a["model.layers.1.self_attn.k_proj.weight"])


def test_a_slice_has_the_full_models_weights_and_keys_values():
    full = build_model("tiny")
    part = build_model("tiny", layers=2)
    fs, ps = full.state_dict(), part.state_dict()
    assert set(ps) < set(fs)
    assert all(torch.equal(fs[k], v) for k, v in ps.items())
    from kvtool.hf.capture import capture, random_token_ids

    ids = random_token_ids(40, SHAPES["tiny"].vocab_size)
    a = capture(model=(full, None), input_ids=ids)
    b = capture(model=(part, None), input_ids=ids)
    for i in (0, 1):
        assert torch.equal(a.layers[i].keys, b.layers[i].keys)
        assert torch.equal(a.layers[i].values, b.layers[i].values)
        assert torch.equal(a.layers[i].queries, b.layers[i].queries)


def test_an_explicit_device_map_is_passed_through_with_the_same_weights():
    plan = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
            "model.layers.2": "cpu", "model.layers.3": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    mapped = build_model("tiny", device_map=plan)
    plain = build_model("tiny")
    assert mapped.hf_device_map == plan
    ms, ps = mapped.state_dict(), plain.state_dict()
    assert all(torch.equal(ms[k], ps[k]) for k in ps)
    ids = torch.arange(30)[None]
    assert torch.equal(mapped(ids).logits, plain(ids).logits)
    with pytest.raises(UsageError, match="no module"):
        build_model("tiny", device_map={"model.layers": "cpu"})


@pytest.mark.parametrize("gpus", [2, 4])
def test_auto_map_of_the_70b_shape_balances_whole_decoder_layers(gpus):
    m = empty_model("llama3-70b")
    per_gpu = 2 * SHAPES["llama3-70b"].params() // gpus  # bf16 bytes, spread evenly
    plan = plan_device_map(m, "auto", max_memory={i: int(per_gpu * 1.2) for i in range(gpus)})
    layer_dev = {int(k.split(".")[2]): v for k, v in plan.items() if k.startswith("model.layers.")}
    assert sorted(layer_dev) == list(range(80))  # no decoder layer is split into pieces
    assert set(layer_dev.values()) == set(range(gpus))
    order = [layer_dev[i] for i in range(80)]
    assert order == sorted(order)  # contiguous blocks, in order: activations cross each boundary once
    counts = [order.count(d) for d in range(gpus)]
    assert max(counts) - min(counts) <= 80 // gpus // 2
    for name, _ in m.named_parameters():
        shapes._device_of(name, plan)  # every parameter has a place


def test_tied_embeddings_stay_together():
    m = empty_model("smollm2")
    plan = plan_device_map(m, "auto", max_memory={0: 200 * 2**20, 1: 200 * 2**20})
    assert plan.get("lm_head", plan["model.embed_tokens"]) == plan["model.embed_tokens"]
    built = build_model("smollm2", layers=1, dtype="float32")
    assert built.lm_head.weight is built.model.embed_tokens.weight


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: auto places on the GPUs")
def test_auto_map_without_cuda_is_the_cpu():
    assert plan_device_map(empty_model("tiny"), "auto") == {"": "cpu"}
    m = build_model("tiny", device_map="auto")
    assert m.hf_device_map == {"": "cpu"} and m.model.embed_tokens.weight.device.type == "cpu"
    with pytest.raises(UsageError, match="device map"):
        plan_device_map(empty_model("tiny"), "everywhere")


def test_models_load_and_the_capture_cli_take_random_shapes(tmp_path):
    from typer.testing import CliRunner

    from kvtool.cli import app
    from kvtool.core.streaming import open_capture
    from kvtool.hf import models

    mdl, tok, source = models.load("random:tiny")
    assert tok is None and source.kind == "random" and mdl.config.num_hidden_layers == 4
    out = tmp_path / "r.safetensors"
    r = CliRunner().invoke(app, ["capture", "--model", "random:tiny", "--random-tokens", "64", "--chunk-size", "24", "--dtype", "float32", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == 64
    cap = open_capture(out)
    assert cap.facts.source == "random" and cap.info["model_path"] == "random:tiny" and cap.info["random_tokens"]
    # the same model and ids in one pass, built again: the same keys (seeded weights and ids)
    from kvtool.hf.capture import capture, random_token_ids

    ref = capture(model=(build_model("tiny"), None), input_ids=random_token_ids(64, 512), dtype="float32")
    assert torch.equal(ref.token_ids, cap.token_ids)
    assert torch.allclose(ref.layers[3].keys, cap.layers[3].keys, atol=1e-5)
    from kvtool.hf.cache import model_spec

    assert model_spec(cap, out) == "random:tiny"
    r = CliRunner().invoke(app, ["capture", "--model", "random:tiny", "-o", str(tmp_path / "x.safetensors")])
    assert r.exit_code == 2 and "--random-tokens" in r.output
    r = CliRunner().invoke(app, ["capture", "--model", "random:tiny", "--random-tokens", "8", "--prompt", "hi", "-o", str(tmp_path / "y.safetensors")])
    assert r.exit_code == 2 and "replaces the prompt" in r.output


@pytest.mark.gpu
def test_built_on_the_gpu_without_a_host_copy():
    torch.cuda.reset_peak_memory_stats()
    m = build_model("llama3-8b", layers=2, device="cuda")
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in m.parameters())
    assert m.model.rotary_emb.inv_freq.device.type == "cuda"
    assert torch.cuda.memory_allocated() >= 2 * SHAPES["llama3-8b"].params(2) * 0.99


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_slice_split_over_two_gpus_equals_one_gpu():
    from kvtool.hf.capture import capture, random_token_ids

    plan = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    split = build_model("llama3-8b", layers=2, device_map=plan)
    assert split.model.layers[1].self_attn.k_proj.weight.device == torch.device("cuda:1")
    one = build_model("llama3-8b", layers=2, device="cuda:0")
    ss, os_ = split.state_dict(), one.state_dict()
    assert all(torch.equal(ss[k].cpu(), os_[k].cpu()) for k in os_)
    ids = random_token_ids(1024, SHAPES["llama3-8b"].vocab_size)
    a = capture(model=(split, None), input_ids=ids, chunk_size=512)
    del split
    b = capture(model=(one, None), input_ids=ids, chunk_size=512)
    for i in (0, 1):
        assert torch.equal(a.layers[i].keys, b.layers[i].keys)
        assert torch.equal(a.layers[i].values, b.layers[i].values)
