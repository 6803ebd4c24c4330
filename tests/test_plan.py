"""Compression plans and the mixed format: a plan file applies per layer and per KV head, the file
round-trips, its bytes are the sum of the inner formats' bytes, attention matches each inner
format's own attention on its heads, and verify / export / compress --plan work on it."""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.core import io
from kvtool.core.errors import UsageError
from kvtool.formats.base import compress_cache, get_format, load_compressed, save_compressed
from kvtool.formats.mixed import head_groups, resolve_spec, slice_heads
from kvtool.formats.plan import Plan, compress_plan, load_plan, plan_from_dict, save_plan

from .conftest import synthetic_cache

SPECS = ["quant:bits=2", "bitmap:sparsity=0.7", "snapkv:budget=40,recent=16+quant:bits=4"]


def _plan() -> Plan:
    return Plan({0: ["quant:bits=4"], 1: SPECS[:2]}, default="dense")


def test_head_groups_share_equal_specs():
    assert head_groups(["a", "b", "a"]) == [("a", [0, 2]), ("b", [1])]


def test_plan_round_trips_and_bytes_add_up(tmp_path):
    cache = synthetic_cache(kv_heads=2, heads=4, tokens=96)
    cc = compress_plan(cache, _plan(), heldout=16)
    path = save_compressed(cc, tmp_path / "p.safetensors")
    back = load_compressed(path)
    assert back.format == "mixed" and back.layer_indices == [0, 1]
    for i in (0, 1):
        assert set(back.layers[i].tensors) == set(cc.layers[i].tensors)
        for n, t in cc.layers[i].tensors.items():
            assert torch.equal(back.layers[i].tensors[n], t)
    # layer 0: the whole layer in quant 4-bit -> the same bytes as quant alone
    fmt, params = resolve_spec("quant:bits=4")
    alone = compress_cache(cache, fmt, params, heldout=16)
    mixed = get_format("mixed")
    assert sum(mixed.nbytes(back.layers[0]).values()) == sum(fmt.nbytes(alone.layers[0]).values())
    # layer 1: one KV head per format -> the sum of each format on its head
    head = cache.layers[1].slice_tokens(0, 80)
    want = 0
    for h, spec in enumerate(SPECS[:2]):
        f, p = resolve_spec(spec)
        want += sum(f.nbytes(f.encode(slice_heads(head, [h]), p)).values())
    assert sum(mixed.nbytes(back.layers[1]).values()) == want
    assert back.byte_report()["stored_bytes"] == sum(sum(mixed.nbytes(e).values()) for e in back.layers.values())


def test_mixed_attention_is_each_groups_attention():
    cache = synthetic_cache(kv_heads=3, heads=6, tokens=96, layers=(0,))
    layer = cache.layers[0].slice_tokens(0, 80)
    from kvtool.formats.mixed import encode_groups

    enc = encode_groups(layer, SPECS)
    q = cache.layers[0].queries[:, :, 80:]
    out, lse = get_format("mixed").attend(q, enc)
    for h, spec in enumerate(SPECS):
        f, p = resolve_spec(spec)
        o, l = f.attend(q[:, 2 * h : 2 * h + 2], f.encode(slice_heads(layer, [h]), p))
        assert torch.allclose(out[:, 2 * h : 2 * h + 2], o.float(), atol=1e-5)
        assert torch.allclose(lse[:, 2 * h : 2 * h + 2], l.float(), atol=1e-5)
    # the same spec on every head equals the format on the whole layer
    enc_all = encode_groups(layer, ["quant:bits=4"] * 3)
    f, p = resolve_spec("quant:bits=4")
    ref = f.attend(q, f.encode(layer, p))
    assert torch.allclose(get_format("mixed").attend(q, enc_all)[0], ref[0].float(), atol=1e-6)


def test_plan_file_and_errors(tmp_path):
    path = save_plan(_plan(), tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["schema"] == "kvtool.plan" and data["layers"]["1"] == SPECS[:2]
    assert load_plan(path).layers == _plan().layers
    with pytest.raises(UsageError, match="not a kvtool plan"):
        plan_from_dict({"layers": {}})
    cache = synthetic_cache(kv_heads=2, heads=4, tokens=64)
    with pytest.raises(UsageError, match="one spec or 2"):
        compress_plan(cache, Plan({0: SPECS}), heldout=8)
    with pytest.raises(UsageError, match="does not hold"):
        compress_plan(cache, Plan({5: ["dense"]}), heldout=8)
    with pytest.raises(UsageError, match="unknown format"):
        compress_plan(cache, Plan({0: ["nosuch:x=1"]}), heldout=8)


def test_compress_plan_cli_verify_and_export(sample_capture, tmp_path):
    from typer.testing import CliRunner

    from kvtool.cli import app
    from kvtool.analysis.verify import verify_file

    plan = {"schema": "kvtool.plan", "version": 1, "default": "quant:bits=4",
            "layers": {"0": "dense", "7": SPECS, "15": "snapstream:budget=128"}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "cap.plan.safetensors"
    res = CliRunner().invoke(app, ["compress", str(sample_capture), "--plan", str(tmp_path / "plan.json"), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["format"] == "mixed" and report["details"]["kv_heads_by_spec"]["quant:bits=4"] == 3
    # layers the plan does not list use its default, said on stderr and in --json
    assert report["plan_default_layers"] == [23] and "use its default 'quant:bits=4'" in res.stderr
    rep = verify_file(out, use_model=False)
    att = rep["attention"]
    assert att["layers"][0]["errors"]["rel_l2"] < 1e-3  # dense layer
    assert 0 < att["layers"][7]["errors"]["rel_l2"] < 1 and att["storage_ratio"] < 1
    res = CliRunner().invoke(app, ["compress", str(sample_capture), "--plan", str(tmp_path / "plan.json"), "--format", "quant", "-o", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2 and "--plan sets every layer" in res.output
    res = CliRunner().invoke(app, ["info", str(out), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["compression"]["format"] == "mixed"


def test_plan_file_exports_and_generates(tiny_capture, tiny_llama_dir, tmp_path):
    """A mixed file of the tiny Llama (both layers planned, per-head in layer 1) goes through
    export --to hf and generate (attention mode, since groups may select)."""
    from typer.testing import CliRunner

    from kvtool.cli import app

    plan = {"schema": "kvtool.plan", "version": 1, "layers": {"0": "quant:bits=4", "1": ["quant:bits=8", "bitmap:sparsity=0.5"]}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "tiny.plan.safetensors"
    r = CliRunner()
    res = r.invoke(app, ["compress", str(tiny_capture), "--plan", str(tmp_path / "plan.json"), "--heldout", "16", "-o", str(out)])
    assert res.exit_code == 0, res.output
    res = r.invoke(app, ["generate", str(out), "--prompt", " hi", "-n", "3", "--json"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["new_token_ids"][0]) == 3
    res = r.invoke(app, ["export", str(out), "--to", "hf", "-o", str(tmp_path / "hf.safetensors")])
    assert res.exit_code == 0, res.output
    res = r.invoke(app, ["verify", str(out), "--json", "--generate", "2", "--model", str(tiny_llama_dir)])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["model_fidelity"]["compressed_layers"] == [0, 1] and rep["attention"]["format"] == "mixed"
