"""``kvtool recommend`` over several devices: the sensitivity scores each layer on the device it was
read onto, the devices at once (kvtool.core.placement.run_per_device), and gives the same plans and
numbers as one device, a candidate that fails on some layers reported at its lowest failing layer
whichever thread meets it first. On the CPU the two devices are ``cpu`` and ``cpu:0`` (two threads);
the ``gpu`` test at the end needs 2 GPUs."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from typer.testing import CliRunner

from kvtool.analysis import allocation
from kvtool.analysis.allocation import measure_sensitivity
from kvtool.cli import app
from kvtool.core import io
from kvtool.core.errors import UsageError
from kvtool.core.placement import layer_placement, resolve_devices

from .conftest import gpu_capture_file

runner = CliRunner()
CPU2 = "cpu,cpu:0"
SPECS = ["dense", "quant:bits=4", "quant:bits=2", "bitmap:sparsity=0.7", "snapstream:share=0.25"]
FAILING = "quant:bits=4"  # made to fail on chosen layers below
RESOLVE_SPEC = allocation.resolve_spec


def _without_times(obj):
    """The JSON object less what differs run to run: times, the device it names, output paths."""
    if isinstance(obj, dict):
        return {k: _without_times(v) for k, v in obj.items() if k not in ("seconds", "device", "output", "plan_file")}
    if isinstance(obj, list):
        return [_without_times(v) for v in obj]
    return obj


def _fingerprint(layer) -> tuple[float, ...]:
    return tuple(float(x) for x in layer.keys[0, 0, 0, :4])


def _fail_on(monkeypatch, cache, bad: set[int], slow: dict[int, float] | None = None) -> list[int]:
    """``FAILING`` raises a UsageError naming the layer on the layers ``bad`` (told apart by their
    first key values), after sleeping ``slow[layer]`` seconds; returns the layers it failed on, in
    the order it failed."""
    which = {_fingerprint(cache.layers[i]): i for i in cache.layer_indices}
    failed: list[int] = []
    class Failing:
        def __init__(self, fmt):
            self._fmt = fmt

        def __getattr__(self, name):
            return getattr(self._fmt, name)

        def check(self, layer, params):
            i = which[_fingerprint(layer)]
            if i in bad:
                time.sleep((slow or {}).get(i, 0.0))
                failed.append(i)
                raise UsageError(f"no good on layer {i}")
            return self._fmt.check(layer, params)

    def resolve(spec):
        fmt, params = RESOLVE_SPEC(spec)
        return (Failing(fmt), params) if spec == FAILING else (fmt, params)

    monkeypatch.setattr(allocation, "resolve_spec", resolve)
    return failed


def _on_two(cache):
    return layer_placement(cache.layer_indices, resolve_devices(CPU2))


def _same(a, b):
    assert a.groups == b.groups and a.specs == b.specs and a.errors == b.errors
    assert a.dense_bytes == b.dense_bytes and a.prefix_tokens == b.prefix_tokens
    assert torch.equal(a.bytes, b.bytes) and torch.equal(a.loss, b.loss)


def test_measure_sensitivity_over_two_devices_equals_one(sample_capture, monkeypatch):
    cache = io.load(sample_capture, parts=("keys", "values", "queries"))
    place = _on_two(cache)
    assert sorted({str(d) for d in place.values()}) == ["cpu", "cpu:0"]
    threads: set[int] = set()
    real = allocation._layer_sensitivity

    def spy(*args, **kwargs):
        threads.add(threading.get_ident())
        return real(*args, **kwargs)

    class Count:
        def stage(self, *a, **k):
            pass

        def advance(self, n=1):
            advanced.append(threading.get_ident())

    one = measure_sensitivity(cache, SPECS, 32)
    monkeypatch.setattr(allocation, "_layer_sensitivity", spy)
    advanced: list[int] = []
    two = measure_sensitivity(cache, SPECS, 32, progress=Count(), placement=place)
    monkeypatch.undo()
    _same(one, two)
    # each device's first layer in the calling thread, then one thread per device
    assert threading.get_ident() in threads and len(threads) == 3
    assert advanced == [threading.get_ident()] * len(cache.layer_indices)  # progress from the calling thread
    per_layer = measure_sensitivity(cache, SPECS, 32, per_head=False, placement=place, calibrate="heldout")
    _same(measure_sensitivity(cache, SPECS, 32, per_head=False, calibrate="heldout"), per_layer)


def test_a_failing_candidate_is_reported_at_its_lowest_layer_under_threads(sample_capture, monkeypatch):
    cache = io.load(sample_capture, parts=("keys", "values", "queries"))
    place = _on_two(cache)  # layers 0, 7 on cpu; 15, 23 on cpu:0
    second = [i for i in cache.layer_indices if str(place[i]) == "cpu:0"]
    # only on the second device: its lowest layer is named
    _fail_on(monkeypatch, cache, set(second))
    one, two = measure_sensitivity(cache, SPECS, 32), measure_sensitivity(cache, SPECS, 32, placement=place)
    _same(one, two)
    assert FAILING not in two.specs and two.errors[FAILING] == f"layer {second[0]}: no good on layer {second[0]}"
    # layers 7 (first device) and 23 (second): 23 fails first, 7 is still the one reported
    failed = _fail_on(monkeypatch, cache, {7, 23}, slow={7: 0.3})
    two = measure_sensitivity(cache, SPECS, 32, placement=place)
    assert failed == [23, 7] and two.errors == {FAILING: "layer 7: no good on layer 7"}
    failed.clear()
    one = measure_sensitivity(cache, SPECS, 32)
    assert failed == [7] and one.errors == two.errors  # one device stops trying it after layer 7
    _same(one, two)


def test_recommend_cli_over_two_devices_equals_one(sample_capture, tmp_path, monkeypatch):
    outs = {}
    for dev in ("cpu", CPU2):
        r = runner.invoke(app, ["recommend", str(sample_capture), "--budget", "25%", "--no-model", "--device", dev, "--json",
                                "-o", str(tmp_path / f"plan-{dev}.json")])
        assert r.exit_code == 0, r.output
        outs[dev] = json.loads(r.stdout)
    assert outs["cpu"]["device"] == "cpu" and outs[CPU2]["device"] == "cpu,cpu:0"
    assert _without_times(outs["cpu"]) == _without_times(outs[CPU2])
    assert outs[CPU2]["budgets"][0]["plan"]["layers"] and outs[CPU2]["sensitivity"]["uniform"]
    # a candidate failing on the second device's layers: dropped, named at its lowest layer, both ways
    cache = io.load(sample_capture, parts=("keys", "values", "queries"))
    second = [i for i in cache.layer_indices if str(_on_two(cache)[i]) == "cpu:0"]
    _fail_on(monkeypatch, cache, set(second))
    for dev in ("cpu", CPU2):
        r = runner.invoke(app, ["recommend", str(sample_capture), "--budget", "25%", "--no-model", "--menu", "quant", "--device", dev,
                                "--json", "-o", str(tmp_path / f"plan-bad-{dev}.json")])
        assert r.exit_code == 0, r.output
        outs[dev] = json.loads(r.stdout)
    assert outs[CPU2]["dropped"] == {FAILING: f"layer {second[0]}: no good on layer {second[0]}"}
    assert FAILING not in outs[CPU2]["menu"]
    assert _without_times(outs["cpu"]) == _without_times(outs[CPU2])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_recommend_over_two_gpus_equals_one(tmp_path):
    cap = gpu_capture_file(tmp_path / "cap.safetensors", tokens=2048)
    outs = []
    for dev in ("cuda:0", "cuda:0,cuda:1"):
        r = runner.invoke(app, ["recommend", str(cap), "--budget", "25%", "--no-model", "--device", dev, "--json",
                                "-o", str(tmp_path / f"plan-{dev}.json")])
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.stdout))
    one, two = outs
    assert one["device"] == "cuda:0" and two["device"] == "cuda:0,cuda:1"
    assert one["menu"] == two["menu"] and one["dropped"] == two["dropped"]
    assert [b["plan"]["layers"] for b in one["budgets"]] == [b["plan"]["layers"] for b in two["budgets"]]
    rows_one, rows_two = one["sensitivity"]["uniform"], two["sensitivity"]["uniform"]
    assert [r["spec"] for r in rows_one] == [r["spec"] for r in rows_two]
    for a, b in zip(rows_one, rows_two):
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-12), (a["spec"], k)
    for a, b in zip(one["budgets"], two["budgets"]):
        for k, v in a["predicted"].items():
            if isinstance(v, float):
                assert b["predicted"][k] == pytest.approx(v, rel=1e-6, abs=1e-12), k
