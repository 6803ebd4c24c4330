"""Per-layer work over several devices (kvtool.core.placement, kvtool.hf.devices): which devices,
which layer goes where, one thread per device, and compress / verify giving the same file and the
same numbers spread over two devices as on one. On the CPU the two devices are ``cpu`` and
``cpu:0`` (the same memory, two threads); the ``gpu`` tests at the end need 2 GPUs."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.core import io
from kvtool.core.errors import UsageError
from kvtool.core.placement import device_label, layer_placement, resolve_devices, run_per_device

from .conftest import gpu_capture_file, synthetic_cache

runner = CliRunner()
CPU2 = "cpu,cpu:0"


def test_resolve_devices():
    if not torch.cuda.is_available():
        assert resolve_devices(None) == resolve_devices("auto") == [torch.device("cpu")]
        with pytest.raises(UsageError, match="CUDA"):
            resolve_devices("cuda:0,cuda:1")
    else:
        assert resolve_devices("auto") == [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    assert resolve_devices("cpu") == [torch.device("cpu")]
    assert [str(d) for d in resolve_devices(CPU2)] == ["cpu", "cpu:0"]
    with pytest.raises(UsageError, match="twice"):
        resolve_devices("cpu,cpu")
    with pytest.raises(UsageError, match="--device"):
        resolve_devices("cpu,tpu")


@pytest.mark.parametrize("n,k", [(80, 2), (80, 4), (7, 3), (2, 4), (1, 1)])
def test_layer_placement_is_contiguous_and_balanced(n, k):
    devices = [f"d{j}" for j in range(k)]
    layers = list(range(3, 3 + n))
    place = layer_placement(layers, devices)
    assert list(place) == layers
    order = [devices.index(place[i]) for i in layers]
    assert order == sorted(order)  # one block per device, in order
    counts = [order.count(j) for j in range(k)]
    assert max(counts) - min(counts) <= 1 and sum(counts) == n
    with pytest.raises(UsageError):
        layer_placement(layers, [])


def test_layer_placement_matches_accelerate_on_two_gpus():
    # layer i of a capture is worked on by the GPU that held layer i when a 70B model was split
    from kvtool.hf.shapes import empty_model, plan_device_map

    plan = plan_device_map(empty_model("llama3-70b"), "auto", max_memory={0: 80 << 30, 1: 80 << 30})
    held = {int(k.split(".")[2]): v for k, v in plan.items() if k.startswith("model.layers.")}
    assert layer_placement(list(range(80)), [0, 1]) == held


def test_run_per_device_threads_order_and_results():
    place = layer_placement(list(range(8)), [torch.device("cpu"), torch.device("cpu", 0)])
    seen: dict[int, tuple[str, int, float, float]] = {}

    def work(i, dev):
        t = time.perf_counter()
        time.sleep(0.05)
        seen[i] = (str(dev), threading.get_ident(), t, time.perf_counter())
        return i * 10

    done_order: list[int] = []
    out = run_per_device(work, place, on_done=done_order.append)
    assert out == {i: i * 10 for i in range(8)} and list(out) == list(range(8))
    assert sorted(done_order) == list(range(8)) and done_order[:2] == [0, 4]
    assert all(str(place[i]) == seen[i][0] for i in range(8))
    # each device's first layer ran alone, one after the other, before the rest
    assert seen[4][2] >= seen[0][3] and all(seen[i][2] >= seen[4][3] for i in (1, 2, 3, 5, 6, 7))
    for d in ("cpu", "cpu:0"):  # one thread per device; its layers one after another, in order
        mine = sorted((i for i in (1, 2, 3, 5, 6, 7) if seen[i][0] == d), key=lambda i: seen[i][2])
        assert mine == sorted(mine) and len({seen[i][1] for i in mine}) == 1
    assert seen[1][1] != seen[5][1]
    # then the devices ran at once: each one's next layer started before the other's ended
    assert seen[5][2] < seen[1][3] and seen[1][2] < seen[5][3]


def test_run_per_device_raises_the_first_error_and_stops():
    place = layer_placement(list(range(10)), [torch.device("cpu"), torch.device("cpu", 0)])
    ran: list[int] = []

    def work(i, dev):
        ran.append(i)
        if i == 6:
            raise ValueError("layer 6 is bad")
        time.sleep(0.01)
        return i

    with pytest.raises(ValueError, match="layer 6"):
        run_per_device(work, place)
    assert 9 not in ran  # the failing device's thread stopped


def _tensors(path):
    return io.read_tensors(path)


def test_compress_and_verify_over_two_devices_equal_one(tmp_path, sample_capture):
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    for out, dev in ((one, "cpu"), (two, CPU2)):
        r = runner.invoke(app, ["compress", str(sample_capture), "--format", "bitmap", "--sparsity", "0.7", "--device", dev, "-o", str(out), "--json"])
        assert r.exit_code == 0, r.output
    a, b = _tensors(one), _tensors(two)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    reports = []
    for dev in ("cpu", CPU2):
        r = runner.invoke(app, ["verify", str(two), "--no-model", "--backend", "torch", "--device", dev, "--json"])
        assert r.exit_code == 0, r.output
        reports.append(json.loads(r.stdout))
    assert reports[1]["attention"]["device"] == "cpu,cpu:0" and reports[0]["attention"]["device"] == "cpu"
    assert reports[0]["attention"]["layers"] == reports[1]["attention"]["layers"]
    assert reports[0]["attention"]["overall"] == reports[1]["attention"]["overall"]


def test_a_bad_layer_on_the_second_device_fails_compress_cleanly(tmp_path, sample_capture):
    # a capture whose last layer is not finite: the thread that reads it raises, compress exits 1
    cache = io.load(sample_capture)
    last = max(cache.layer_indices)
    cache.layers[last].keys[0, 0, 0, 0] = float("nan")
    bad = tmp_path / "bad.safetensors"
    _save_nonfinite(cache, bad)
    out = tmp_path / "out.safetensors"
    r = runner.invoke(app, ["compress", str(bad), "--format", "bitmap", "--device", CPU2, "-o", str(out)])
    assert r.exit_code == 1 and f"layers.{last}.keys" in r.output and not out.exists()


def _save_nonfinite(cache, path):
    io.set_allow_nonfinite(True)
    try:
        io.save(cache, path, force=True)
    finally:
        io.set_allow_nonfinite(False)


def test_device_label():
    assert device_label([torch.device("cuda", 0), torch.device("cuda", 1)]) == "cuda:0,cuda:1"


def test_layer_devices_of_a_model_and_capture_info(tmp_path, monkeypatch):
    from kvtool.hf import capture as cap_mod
    from kvtool.hf import devices
    from kvtool.hf.shapes import build_model

    m = build_model("tiny")
    assert devices.layer_devices(m) == {i: torch.device("cpu") for i in range(4)}
    assert devices.devices_of(m) == [torch.device("cpu")]
    # a model spread by a device map records where each captured layer ran (faked here: no GPUs)
    split = {0: torch.device("cuda", 0), 1: torch.device("cuda", 0), 2: torch.device("cuda", 1), 3: torch.device("cuda", 1)}
    monkeypatch.setattr(devices, "layer_devices", lambda mdl: split)
    out, summary = cap_mod.capture_to_file(tmp_path / "c.safetensors", model=(m, None), random_tokens=16, layers=[0, 2, 3])
    assert summary["info"]["device"] == "cuda:0,cuda:1"
    assert summary["info"]["layer_devices"] == "cuda:0 0; cuda:1 2-3"


def _eval_json(args):
    r = runner.invoke(app, ["eval", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _same_points(a, b):
    assert len(a["points"]) == len(b["points"])
    for x, y in zip(a["points"], b["points"]):
        assert {k: v for k, v in x.items() if k != "seconds"} == {k: v for k, v in y.items() if k != "seconds"}


def test_eval_over_two_devices_equals_one(tmp_path, sample_capture):
    sweep = ["--formats", "bitmap:sparsity=0.5,0.7", "quant:bits=2", "snapstream:budget=64", "--no-paper", "--no-model", "--force"]
    one = _eval_json([str(sample_capture), *sweep, "--device", "cpu", "--out-dir", str(tmp_path / "one")])
    two = _eval_json([str(sample_capture), *sweep, "--device", CPU2, "--out-dir", str(tmp_path / "two")])
    assert one["device"] == "cpu" and two["device"] == "cpu,cpu:0"
    assert not any(p.get("skipped") for p in two["points"])
    _same_points(one, two)


def test_eval_with_the_model_over_two_devices_equals_one(tmp_path):
    cap = tmp_path / "tiny.safetensors"
    r = runner.invoke(app, ["capture", "--model", "random:tiny", "--random-tokens", "160", "--dtype", "float32", "-o", str(cap), "--json"])
    assert r.exit_code == 0, r.output
    sweep = ["--formats", "bitmap:sparsity=0.7", "--no-paper", "--model", "random:tiny", "--heldout", "16", "--generate", "4", "--force"]
    one = _eval_json([str(cap), *sweep, "--device", "cpu", "--out-dir", str(tmp_path / "one")])
    two = _eval_json([str(cap), *sweep, "--device", CPU2, "--out-dir", str(tmp_path / "two")])
    assert two["device"] == "cpu,cpu:0" and two["model_device"] == "cpu"  # a model that fits stays on the first device
    assert two["points"][0]["agreement"] is not None
    _same_points(one, two)


def test_a_compressed_prefix_and_a_dense_cache_follow_the_layer_devices(monkeypatch):
    # a model spread by a device map: layer 1 lives elsewhere ("meta" stands in for a second GPU on the CPU)
    from kvtool.formats.base import FORMATS, compress_cache, make_params
    from kvtool.hf import attention as hfattn
    from kvtool.hf import cache as hfcache
    from kvtool.hf.shapes import build_model

    model = build_model("tiny", layers=2)
    cache = synthetic_cache(heads=4, kv_heads=2, head_dim=16, tokens=40, layers=(0, 1), dtype=torch.float32)
    cc = compress_cache(cache, FORMATS["bitmap"], make_params(FORMATS["bitmap"], {"sparsity": 0.5}), heldout=8)
    where = {0: torch.device("cpu"), 1: torch.device("meta")}
    moved = hfattn.CompressedPrefix.from_compressed(cc).to(where)
    assert {i: {t.device.type for t in e.tensors.values()} for i, e in moved.layers.items()} == {0: {"cpu"}, 1: {"meta"}}
    monkeypatch.setattr(hfattn.hfdevices, "layer_devices", lambda m: where)
    built = hfattn.build_cache(model, {i: cache.layers[i].slice_tokens(0, 32) for i in (0, 1)}, None)
    assert [layer.keys.device.type for layer in built.layers] == ["cpu", "meta"]
    monkeypatch.setattr(hfcache, "layer_devices", lambda m: where)
    monkeypatch.setattr(hfcache, "check_model", lambda *a: None)
    monkeypatch.setattr(hfcache, "check_all_layers", lambda *a: None)
    attend = hfcache.cache_from(cc, model, mode="attend")
    assert [layer.keys.device.type for layer in attend.layers] == ["cpu", "meta"]
    assert {t.device.type for t in attend.kvtool_prefix.layers[1].tensors.values()} == {"meta"}


def test_layer_devices_text():
    from kvtool.hf.devices import layer_devices_text

    cpu = torch.device("cpu")
    assert layer_devices_text({0: cpu, 1: cpu}) == "cpu"
    split = {i: torch.device("cuda", i // 40) for i in range(80)}
    assert layer_devices_text(split) == "cuda:0 0-39; cuda:1 40-79"
    assert layer_devices_text(split, [0, 1, 79]) == "cuda:0 0-1; cuda:1 79"


def test_a_model_too_large_for_the_first_gpu_is_spread_over_the_gpus_given(monkeypatch):
    from kvtool.hf import models

    calls = []
    monkeypatch.setattr(models, "load", lambda spec, **kw: calls.append(kw) or ("model", None, None))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (80 * 2**30, 80 * 2**30))
    gpus = [torch.device("cuda", 0), torch.device("cuda", 2)]
    models.load_on_devices("random:llama3-70b", gpus, torch_dtype=torch.bfloat16)  # 141 GB of weights
    assert calls[-1]["device_map"] == "balanced" and sorted(calls[-1]["max_memory"]) == [0, 2]
    models.load_on_devices("random:llama3-8b", gpus, torch_dtype=torch.bfloat16)  # 16 GB: one GPU
    assert calls[-1] == {"device": "cuda:0", "torch_dtype": torch.bfloat16}
    models.load_on_devices("random:llama3-70b", [torch.device("cpu")])
    assert calls[-1] == {}
    assert models.weight_bytes("random:llama3-70b", torch.bfloat16) == 2 * 70_553_706_496


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_compress_and_verify_over_two_gpus_equal_one(tmp_path):
    cap = gpu_capture_file(tmp_path / "cap.safetensors")
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    for out, dev in ((one, "cuda:0"), (two, "auto")):
        r = runner.invoke(app, ["compress", str(cap), "--format", "bitmap", "--sparsity", "0.7", "--device", dev, "-o", str(out)])
        assert r.exit_code == 0, r.output
    a, b = _tensors(one), _tensors(two)
    assert all(torch.equal(a[k], b[k]) for k in a)
    reps = []
    for dev in ("cuda:0", "cuda:0,cuda:1"):
        r = runner.invoke(app, ["verify", str(two), "--no-model", "--backend", "triton", "--device", dev, "--json"])
        assert r.exit_code == 0, r.output
        reps.append(json.loads(r.stdout)["attention"])
    assert reps[1]["device"] == "cuda:0,cuda:1"
    assert [row["layer"] for row in reps[0]["layers"]] == [row["layer"] for row in reps[1]["layers"]] == [0, 1, 2, 3]
    for one_gpu, two_gpus in zip(reps[0]["layers"], reps[1]["layers"]):
        assert one_gpu["errors"]["rel_l2"] == pytest.approx(two_gpus["errors"]["rel_l2"], rel=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_layer_devices_follow_the_device_map(tmp_path):
    from kvtool.hf import devices
    from kvtool.hf.capture import capture_to_file
    from kvtool.hf.shapes import build_model

    m = build_model("llama3-8b", layers=4, device_map={"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                                                        "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1})
    assert devices.devices_of(m) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    _, summary = capture_to_file(tmp_path / "c.safetensors", model=(m, None), random_tokens=256)
    assert summary["info"]["layer_devices"] == "cuda:0 0-1; cuda:1 2-3"


TWO_GPU_MAP = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
               "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_eval_over_two_gpus_equals_one(tmp_path):
    cap = gpu_capture_file(tmp_path / "cap.safetensors")
    sweep = ["--formats", "bitmap:sparsity=0.5,0.7", "quant:bits=2,4", "--no-paper", "--no-model", "--backend", "triton", "--force"]
    one = _eval_json([str(cap), *sweep, "--device", "cuda:0", "--out-dir", str(tmp_path / "one")])
    two = _eval_json([str(cap), *sweep, "--device", "cuda:0,cuda:1", "--out-dir", str(tmp_path / "two")])
    assert two["device"] == "cuda:0,cuda:1" and not any(p.get("skipped") for p in two["points"])
    for a, b in zip(one["points"], two["points"]):
        assert a["spec"] == b["spec"] and a["storage_ratio"] == b["storage_ratio"]
        assert a["rel_l2"] == pytest.approx(b["rel_l2"], rel=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("spec", ["bitmap:sparsity=0.7", "quant:bits=4"])
def test_gpu_live_caches_follow_the_device_map_and_decode_as_on_one_gpu(tmp_path, spec):
    from kvtool.hf import devices
    from kvtool.hf.cache import continuation_ids, to_hf_cache
    from kvtool.hf.capture import capture_to_file
    from kvtool.hf.interface import cache_kwargs
    from kvtool.hf.live import is_live
    from kvtool.hf.shapes import build_model

    one = build_model("llama3-8b", layers=4, device="cuda:0")
    split = build_model("llama3-8b", layers=4, device_map=TWO_GPU_MAP)
    cap, packed = tmp_path / "c.safetensors", tmp_path / "c.packed.safetensors"
    capture_to_file(cap, model=(one, None), random_tokens=512)
    r = runner.invoke(app, ["compress", str(cap), "--format", spec, "--device", "cuda:0", "-o", str(packed)])
    assert r.exit_code == 0, r.output
    logits = []
    for model in (one, split):
        cache = to_hf_cache(packed, model, hold_last=True)
        assert is_live(cache)
        where = devices.layer_devices(model)
        for i, layer in enumerate(cache.layers):
            assert layer.live.device == where[i] and {t.device for t in layer.live.encoded().tensors.values()} == {where[i]}, i
        ids = continuation_ids(io.read_tensors(packed, ["token_ids"])["token_ids"][:, -1:], [11, 12, 13, 14])
        with torch.no_grad():
            out = model(input_ids=ids.to("cuda:0"), use_cache=True, **cache_kwargs(model, cache))
        logits.append(out.logits.float().cpu())
    assert where[3] == torch.device("cuda", 1)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
    assert torch.allclose(logits[0], logits[1], atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_verify_with_the_model_spread_over_two_gpus_equals_one(tmp_path, monkeypatch):
    from kvtool.hf import models
    from kvtool.hf.capture import capture_to_file
    from kvtool.hf.shapes import build_model

    cap, packed = tmp_path / "c.safetensors", tmp_path / "c.bitmap.safetensors"
    capture_to_file(cap, model=(build_model("llama3-8b", device="cuda:0"), None), random_tokens=1024)
    torch.cuda.empty_cache()
    r = runner.invoke(app, ["compress", str(cap), "--format", "bitmap", "--sparsity", "0.7", "--device", "cuda:0", "-o", str(packed)])
    assert r.exit_code == 0, r.output
    reports = []
    for dev, share in (("cuda:0", models.ONE_GPU_SHARE), ("cuda:0,cuda:1", 0.0)):  # share 0: the model never fits one GPU
        monkeypatch.setattr(models, "ONE_GPU_SHARE", share)
        r = runner.invoke(app, ["verify", str(packed), "--model", "random:llama3-8b", "--generate", "8", "--device", dev, "--json"])
        assert r.exit_code == 0, r.output
        reports.append(json.loads(r.stdout)["model_fidelity"])
        torch.cuda.empty_cache()
    assert reports[0]["device"] == "cuda:0" and reports[1]["device"].startswith("cuda:0 0-") and "; cuda:1 " in reports[1]["device"]
    assert reports[0]["nll_increase"] == pytest.approx(reports[1]["nll_increase"], rel=1e-3, abs=1e-4)
    assert reports[0]["generated_lossy_ids"] == reports[1]["generated_lossy_ids"]
