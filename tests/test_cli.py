"""The CLI through Typer's runner: --help of every command, --json, exit codes, one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtool._version import __version__
from kvtool.cli import app

runner = CliRunner()


def command_names() -> list[str]:
    import typer.main

    group = typer.main.get_command(app)
    return sorted(group.commands)


def test_version_and_root_help():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"kvtool {__version__}"
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for name in command_names():
        assert name in res.output
    assert {"capture", "info", "compress", "decompress"} <= set(command_names())


@pytest.mark.parametrize("name", command_names())
def test_every_command_has_help_with_example(name):
    res = runner.invoke(app, [name, "--help"])
    assert res.exit_code == 0, res.output
    assert "Examples" in res.output and "kvtool " + name in res.output
    assert "--json" in res.output or name in ("plot",)


def test_info_json_on_sample(sample_capture):
    res = runner.invoke(app, ["info", str(sample_capture), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["schema"] == "kvtool.capture"
    assert data["metadata"]["kvtool.model"]["num_kv_heads"] == 3
    names = {t["name"] for t in data["tensors"]}
    assert {"layers.7.keys", "layers.7.queries", "token_ids"} <= names
    res = runner.invoke(app, ["info", str(sample_capture)])
    assert res.exit_code == 0 and "layers.7.keys" in res.output


def test_bad_file_is_one_line_exit_1(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_text("nope")
    res = runner.invoke(app, ["info", str(bad)])
    assert res.exit_code == 1
    assert res.stderr.count("\n") == 1 and "not a safetensors file" in res.stderr
    assert "Traceback" not in res.output + res.stderr
    res = runner.invoke(app, ["--debug", "info", str(bad)])
    assert res.exit_code == 1 and "Traceback" in res.stderr


def test_bad_usage_exit_2(tmp_path, sample_capture):
    res = runner.invoke(app, ["capture", "--dtype", "int8", "-o", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2 and "--dtype" in res.stderr
    res = runner.invoke(app, ["info"])
    assert res.exit_code == 2


def test_capture_cli_tiny_model_json_and_overwrite(tmp_path, tiny_llama_dir):
    out = tmp_path / "cap.safetensors"
    args = ["capture", "--model", str(tiny_llama_dir), "--prompt", "hello there", "--generate", "3", "-o", str(out), "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["tokens"] == len("hello there") + 3 and data["model_facts"]["num_kv_heads"] == 2 and data["generated_tokens"] == 3
    assert len(data["generated_text"]) == 1 and isinstance(data["generated_text"][0], str)  # the text the 3 tokens decode to
    res = runner.invoke(app, args[:-1] + ["--force"])
    assert res.exit_code == 0 and f"generated: {data['generated_text'][0]}" in res.stdout
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "--force" in res.stderr
    res = runner.invoke(app, args + ["--force"])
    assert res.exit_code == 0


def test_capture_cli_prompt_file_and_stdin(tmp_path, tiny_llama_dir):
    pf = tmp_path / "p.txt"
    pf.write_text("first line\nsecond one\n")
    res = runner.invoke(app, ["capture", "--model", str(tiny_llama_dir), "--prompt-file", str(pf), "--batch", "-o", str(tmp_path / "b.safetensors"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["batch"] == 2
    res = runner.invoke(app, ["capture", "--model", str(tiny_llama_dir), "--prompt-file", "-", "-o", str(tmp_path / "s.safetensors"), "--json"], input="from stdin")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tokens"] == len("from stdin")


def test_capture_cli_errors(tmp_path, tiny_llama_dir):
    res = runner.invoke(app, ["capture", "--model", str(tmp_path / "nope"), "-o", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 1 and "no such file or folder" in res.stderr
    res = runner.invoke(app, ["capture", "--model", str(tiny_llama_dir), "--prompt", "abc", "--layers", "9", "-o", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2 and "out of range" in res.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_compress_decompress_dense_round_trip(tmp_path, sample_capture):
    out = tmp_path / "d.safetensors"
    res = runner.invoke(app, ["compress", str(sample_capture), "--format", "dense", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["storage_ratio"] == pytest.approx(1.0) and rep["prefix_tokens"] == 512 - 64
    back = tmp_path / "back.safetensors"
    res = runner.invoke(app, ["decompress", str(out), "-o", str(back)])
    assert res.exit_code == 0, res.output
    import kvtool

    a, b = kvtool.load(sample_capture), kvtool.load(back)
    for i in a.layer_indices:
        assert (a.layers[i].keys == b.layers[i].keys).all() and (a.layers[i].values == b.layers[i].values).all()
    res = runner.invoke(app, ["compress", str(sample_capture), "--format", "dense", "--bits", "4", "-o", str(tmp_path / "e.safetensors")])
    assert res.exit_code == 2 and "has no parameter 'bits'" in res.stderr
    res = runner.invoke(app, ["compress", str(sample_capture), "--format", "nosuch", "-o", str(tmp_path / "e.safetensors")])
    assert res.exit_code == 2 and "unknown format" in res.stderr


def test_python_m_kvtool():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "kvtool", "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == f"kvtool {__version__}"


def test_shell_completion_offers_formats_models_and_devices(monkeypatch, tmp_path):
    import click
    import typer.main

    from kvtool.commands._catalog import model_shape_names
    from kvtool.hf.shapes import SHAPES

    group = typer.main.get_command(app)

    def values(command: str, option: str, incomplete: str) -> list[str]:
        cmd = group.commands[command]
        param = next(p for p in cmd.params if option in p.opts)
        return [item.value for item in param.shell_complete(click.Context(cmd), incomplete)]

    assert values("compress", "--format", "bit") == ["bitmap", "bitmapq"]
    assert values("compress", "--format", "snapkv:budget=256+qu") == ["snapkv:budget=256+quant"]
    assert "quant" in values("eval", "--formats", "q") and values("compress", "--evict", "s") == ["snapkv:budget=", "streaming:budget="]
    assert model_shape_names() == tuple(SHAPES)
    assert "random:llama3-8b" in values("capture", "--model", "random:") and values("verify", "--model", "emb") == ["embedded"]
    (tmp_path / "llama-local").mkdir()
    (tmp_path / "small.gguf").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert values("generate", "--model", "llama") == ["llama-local"] and values("report", "--model", "sm") == ["small.gguf"]
    assert values("stats", "--device", "cuda:1") == ["cuda:1"] and "cpu" in values("verify", "--device", "")


def test_eval_table_reads_nll_in_nats_with_intervals_only_over_several_cases(monkeypatch):
    from rich.console import Console

    from kvtool.commands import eval as eval_cmd

    console = Console(record=True, width=400)
    monkeypatch.setattr(eval_cmd, "console", console)
    row = {"capture": "c.safetensors", "format": "quant", "params_text": "bits=4", "storage_ratio": 0.35, "traffic_ratio": 0.35,
           "rel_l2": 0.05, "cosine": 0.998, "recall": None, "nll_increase": -0.002, "agreement": 0.97}
    several = {**row, "cases": [{}, {}, {}], "nll_increase_mean": 0.004, "nll_increase_lo": -0.001, "nll_increase_hi": 0.009,
               "agreement_mean": 0.96, "agreement_lo": 0.93, "agreement_hi": 0.99}
    eval_cmd.print_results({"rows": [several], "resumed": 0, "files": {"json": "e/eval.json"}})
    text = console.export_text()
    assert "NLL + mean [95%] over 3 cases (nats/token)" in text and "+0.0040 [-0.0010, +0.0090]" in text
    assert "-0.0020*" in text and "noise" in text and "%" not in text.split("NLL + mean")[1].split("\n")[2]
    console = Console(record=True, width=400)
    monkeypatch.setattr(eval_cmd, "console", console)
    eval_cmd.print_results({"rows": [{**row, "cases": [{}], "nll_increase_mean": 0.001, "nll_increase_lo": None, "nll_increase_hi": None,
                                      "agreement_mean": 0.9, "agreement_lo": None, "agreement_hi": None}], "resumed": 0, "files": {}})
    assert "mean [95%]" not in console.export_text()  # one case: no interval columns
