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

from .conftest import synthetic_cache

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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_compress_and_verify_over_two_gpus_equal_one(tmp_path):
    cache = synthetic_cache(heads=32, kv_heads=8, head_dim=128, tokens=4096, layers=(0, 1, 2, 3), dtype=torch.bfloat16)
    cap = tmp_path / "cap.safetensors"
    io.save(cache, cap)
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
