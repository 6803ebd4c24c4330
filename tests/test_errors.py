"""One error translation at the CLI edge: every case of issue 34 exits 1 or 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.core import io
from tests.conftest import make_byte_tokenizer, make_tiny_llama, synthetic_cache
from tests.test_trust import PY_ERRORS, rewrite

runner = CliRunner()


def one_line(res, code: int, *needles: str) -> None:
    assert res.exit_code == code, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert "\x1b" not in res.output
    assert not any(e in res.output for e in (*PY_ERRORS, "OverflowError", "UnicodeDecodeError")), res.output
    for needle in needles:
        assert needle in res.output, (needle, res.output)


@pytest.fixture(scope="module")
def files(tiny_llama_dir, tmp_path_factory):
    """A capture of the tiny model, its snapstream and mixed (plan) compressions."""
    folder = tmp_path_factory.mktemp("errors")
    cap = folder / "cap.safetensors"
    res = runner.invoke(app, ["-q", "capture", "--model", str(tiny_llama_dir), "--prompt", "The lighthouse keeper " * 6, "-o", str(cap)])
    assert res.exit_code == 0, res.output
    snap = folder / "snap.safetensors"
    res = runner.invoke(app, ["-q", "compress", str(cap), "--format", "snapstream:budget=40,recent=8,sinks=2,window=8", "--heldout", "16", "-o", str(snap)])
    assert res.exit_code == 0, res.output
    plan = folder / "plan.json"
    plan.write_text(json.dumps({"schema": "kvtool.plan", "version": 1, "layers": {"0": ["quant:bits=4", "dense"], "1": "bitmap"}}))
    mixed = folder / "mixed.safetensors"
    res = runner.invoke(app, ["-q", "compress", str(cap), "--plan", str(plan), "--heldout", "16", "-o", str(mixed)])
    assert res.exit_code == 0, res.output
    return {"cap": cap, "snap": snap, "mixed": mixed, "folder": folder}


def edit_layer_meta(src: Path, dst: Path, edit) -> Path:
    def meta_edit(meta):
        layer_meta = json.loads(meta["kvtool.layer_meta"])
        for value in layer_meta.values():
            edit(value)
        meta["kvtool.layer_meta"] = json.dumps(layer_meta)
    return rewrite(src, dst, meta_edit=meta_edit)


@pytest.mark.parametrize("which", ["snapstream-length", "mixed-shape"])
def test_forged_but_consistent_layers_are_refused_before_generate(files, tiny_llama_dir, tmp_path, which):
    """snapstream length 2^40 was a RuntimeError inside generate; a mixed shape of other tokens
    generated silently from the wrong cache. Both are refused by the loader, for every command."""
    if which == "snapstream-length":
        bad = edit_layer_meta(files["snap"], tmp_path / "bad.safetensors", lambda m: m.__setitem__("length", 1 << 40))
        needle = "length 1099511627776 is not the file's"
    else:
        bad = edit_layer_meta(files["mixed"], tmp_path / "bad.safetensors", lambda m: m["shape"].__setitem__(2, m["shape"][2] + 5))
        needle = "is not the file's"
    one_line(runner.invoke(app, ["-q", "generate", str(bad), "--model", str(tiny_llama_dir), "-n", "2"]), 1, needle)
    one_line(runner.invoke(app, ["-q", "info", str(bad)]), 1, needle)
    one_line(runner.invoke(app, ["-q", "verify", str(bad), "--capture", str(files["cap"]), "--no-model"]), 1, needle)


def test_bad_device_is_a_usage_error_before_the_model_loads(files, tiny_llama_dir, monkeypatch):
    """`--device "[bold]x"` was a RuntimeError after a 19 s model load."""
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --device was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    one_line(runner.invoke(app, ["-q", "capture", "--model", str(tiny_llama_dir), "--prompt", "x", "--device", "[bold]x", "-o", str(files["folder"] / "d.safetensors")]),
             2, "--device must be auto, cpu, cuda or cuda:N, got '[bold]x'")
    # generate spreads a model too large for one GPU over several: its --device takes a list
    one_line(runner.invoke(app, ["-q", "generate", str(files["snap"]), "--model", str(tiny_llama_dir), "--device", "[bold]x", "-n", "1"]),
             2, "--device must be auto, cpu, cuda, cuda:N or a list such as cuda:0,cuda:2, got '[bold]x'")


def test_pickled_weights_are_never_loaded(tmp_path):
    folder = tmp_path / "pickled"
    model = make_tiny_llama()
    model.config.save_pretrained(folder)
    make_byte_tokenizer().save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    one_line(runner.invoke(app, ["-q", "capture", "--model", str(folder), "--prompt", "x", "-o", str(tmp_path / "c.safetensors")]), 1,
             "pytorch_model.bin is a pickle, which kvtool never loads")


PLANS = {
    "version-text": '{"schema": "kvtool.plan", "version": "abc", "layers": {"0": "quant"}}',
    "version-null": '{"schema": "kvtool.plan", "version": null, "layers": {"0": "quant"}}',
    "version-huge": '{"schema": "kvtool.plan", "version": 1e999, "layers": {"0": "quant"}}',
    "model-text": '{"schema": "kvtool.plan", "version": 1, "model": "str", "layers": {"0": "quant"}}',
    "model-head-dim-text": '{"schema": "kvtool.plan", "version": 1, "model": {"head_dim": "16"}, "layers": {"0": "quant"}}',
    "deep": '{"schema": "kvtool.plan", "version": 1, "layers": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "not-utf8": b'{"schema": "kvtool.plan", "version": 1, "layers": {"0": "quant\xff"}}',
    "not-json": "{schema: plan",
    "array": "[1, 2]",
    "layers-list": '{"schema": "kvtool.plan", "version": 1, "layers": [1]}',
    "spec-number": '{"schema": "kvtool.plan", "version": 1, "layers": {"0": 4}}',
    "layer-key": '{"schema": "kvtool.plan", "version": 1, "layers": {"' + "9" * 5000 + '": "quant"}}',
    "bad-spec": '{"schema": "kvtool.plan", "version": 1, "layers": {"0": "quant:bits=4,group=99999999999999999999"}}',
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_malformed_plan_files_are_one_line(files, tmp_path, name):
    plan = tmp_path / "plan.json"
    text = PLANS[name]
    plan.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "o.safetensors"
    res = runner.invoke(app, ["-q", "compress", str(files["cap"]), "--plan", str(plan), "--heldout", "16", "-o", str(out)])
    one_line(res, 2)
    assert not out.exists()


def test_plan_model_check_compares_numbers(files, tmp_path):
    """"made for head dim 64; the capture's model has 64" came from a plan whose head_dim was text;
    such a plan is refused when read, and a real mismatch names two different numbers."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema": "kvtool.plan", "version": 1, "model": {"head_dim": 32}, "layers": {"0": "quant"}}))
    res = runner.invoke(app, ["-q", "compress", str(files["cap"]), "--plan", str(plan), "--heldout", "16", "-o", str(tmp_path / "o.safetensors")])
    one_line(res, 2, "made for a model with head dim 32; the capture's model has 16")


BENCH = {"subcommand": "attention", "env": {"device": "GPU", "versions": {"torch": "2.13.0", "triton": None, "cuda": None, "flashinfer": None}, "copy_gbps": 3000.0, "cold_l2": True},
         "primary_baselines": ["sdpa"], "records": [{"kernel": "k", "provider": "sdpa", "batch": 1, "seq": 64, "median_us": 5.0, "p10_us": 4.0, "p90_us": 6.0,
                                                    "bandwidth_gbps": 100.0, "bandwidth_fraction": 0.03, "rel_err": 0.0, "status": "ok", "speedup": {}}]}


def _bench_variants():
    no_versions = json.loads(json.dumps(BENCH))
    del no_versions["env"]["versions"]
    median_text = json.loads(json.dumps(BENCH))
    median_text["records"][0]["median_us"] = "fast"
    no_spread = json.loads(json.dumps(BENCH))
    del no_spread["records"][0]["p10_us"]
    records_obj = json.loads(json.dumps(BENCH))
    records_obj["records"] = {"a": 1}
    return {"no-env-versions": json.dumps(no_versions), "median-text": json.dumps(median_text), "no-spread": json.dumps(no_spread),
            "records-object": json.dumps(records_obj), "not-json": "{", "nan": json.dumps(BENCH).replace("3000.0", "NaN"), "list": "[]"}


@pytest.mark.parametrize("name", sorted(_bench_variants()))
def test_malformed_bench_json_is_one_line(tmp_path, name):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(BENCH))
    res = runner.invoke(app, ["-q", "bench", "report", str(good)])
    assert res.exit_code == 0 and "| sdpa |" in res.output, res.output
    bad = tmp_path / "bad.json"
    bad.write_text(_bench_variants()[name])
    one_line(runner.invoke(app, ["-q", "bench", "report", str(bad)]), 1, str(bad))


@pytest.mark.parametrize("content", ['{"points": [{"format": "quant", "storage_ratio": "big"}]}', '{"points": {}}', '{"points": [1]}', "[" * 5000 + "]" * 5000, "\xff"])
def test_malformed_eval_and_bench_inputs_of_report_are_one_line(files, tmp_path, content):
    evald = tmp_path / "ev"
    evald.mkdir()
    (evald / "eval.json").write_bytes(content.encode("latin-1"))
    res = runner.invoke(app, ["-q", "report", str(files["cap"]), "--no-model", "--heldout", "16", "--eval", str(evald), "-o", str(tmp_path / "r.html")])
    one_line(res, 1, "--eval")
    bench = tmp_path / "b.json"
    bench.write_bytes(content.encode("latin-1"))
    res = runner.invoke(app, ["-q", "report", str(files["cap"]), "--no-model", "--heldout", "16", "--bench", str(bench), "-o", str(tmp_path / "r.html")])
    one_line(res, 1, "--bench")
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("args, needle", [
    (["--format", "quant:bits=4,bits=2"], "'bits' is given twice"),
    (["--format", "bitmap:key-sparsity=0.5,key_sparsity=0.7"], "given twice"),
    (["--format", "quant:bits=4", "--bits", "2"], "bits=4 in --format contradicts --bits 2"),
    (["--format", "snapkv:budget=64+quant:bits=4", "--bits", "2"], "contradicts --bits 2"),
])
def test_repeated_or_contradictory_parameters_are_refused(files, tmp_path, args, needle):
    one_line(runner.invoke(app, ["-q", "compress", str(files["cap"]), *args, "--heldout", "16", "-o", str(tmp_path / "o.safetensors")]), 2, needle)


def test_the_same_parameter_given_twice_with_one_value_is_fine(files, tmp_path):
    res = runner.invoke(app, ["-q", "compress", str(files["cap"]), "--format", "quant:bits=4", "--bits", "4", "--heldout", "16", "-o", str(tmp_path / "o.safetensors")])
    assert res.exit_code == 0, res.output


def test_an_eval_whose_every_point_is_invalid_fails(files, tmp_path):
    res = runner.invoke(app, ["-q", "eval", str(files["cap"]), "--formats", "bitmap:sparsity=1.5", "quant:bits=3", "--no-model", "--heldout", "16", "--out-dir", str(tmp_path / "e")])
    one_line(res, 1, "no point of the sweep could run: all 2 were skipped")
    res = runner.invoke(app, ["-q", "eval", str(files["cap"]), "--formats", "bitmap:sparsity=1.5", "quant:bits=4", "--no-model", "--heldout", "16", "--out-dir", str(tmp_path / "f")])
    assert res.exit_code == 0, res.output


def test_ctrl_c_with_json_prints_one_json_object(files, monkeypatch):
    from kvtool.core import io as core_io

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(core_io, "describe", interrupted)
    res = runner.invoke(app, ["info", str(files["cap"]), "--json"])
    assert res.exit_code == 130
    obj = json.loads(res.stdout)
    assert obj["command"] == "info" and obj["error"] == {"type": "Interrupted", "message": "interrupted (Ctrl-C)", "exit_code": 130}


def test_a_foreign_error_is_its_first_line_without_escapes(files, monkeypatch):
    """torch's RuntimeErrors carry C++ frames after their first line, some libraries colour theirs."""
    from kvtool.core import io as core_io

    def foreign(*args, **kwargs):
        raise RuntimeError("\x1b[31mvalue cannot be converted\x1b[0m to type int\nException raised from checked_convert at c10/util/TypeCast.h:25\nframe #0: c10::Error")

    monkeypatch.setattr(core_io, "describe", foreign)
    res = runner.invoke(app, ["info", str(files["cap"])])
    assert res.exit_code == 1
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert lines == ["error: RuntimeError: value cannot be converted to type int (run with --debug for the traceback)"], res.output
