"""The CLI contract of docs/cli.md: every command's ``--json`` object (success and failure), the
rendering rule off a terminal (nothing cut, data printed literally), plain progress lines, the
deprecated option names, fast start-up, and the Python API's results matching the JSON."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool._version import __version__
from kvtool.cli import app
from kvtool.core.schema import validate

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
NUMBER_TEXT = re.compile(r"^-?\d+(\.\d+)?([eE][-+]?\d+)?%?$")
BENCH_TINY = ["--model-shape", "custom", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--batch", "1", "--seq", "24", "--rep-ms", "1"]


# objects that hold a file's content as stored, which the JSON naming rules do not reach (docs/cli.md)
AS_STORED = ("metadata", "plan")


def numbers_are_numbers(obj, where="") -> list[str]:
    """Paths of string values that are numbers written as text, of maps keyed by numbers (per-layer
    and per-head data are lists of objects), and of lists of layer numbers under the name ``layers``."""
    bad = []
    if isinstance(obj, dict):
        if obj and all(str(k).lstrip("-").isdigit() for k in obj):
            bad.append(f"{where}: a map keyed by numbers (use a list of objects)")
        for k, v in obj.items():
            if k in AS_STORED:
                continue
            if k == "layers" and isinstance(v, list) and v and not all(isinstance(e, dict) and "layer" in e for e in v):
                bad.append(f"{where}.layers: not a list of objects with a layer field")
            bad += numbers_are_numbers(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            bad += numbers_are_numbers(v, f"{where}[{i}]")
    elif isinstance(obj, str) and NUMBER_TEXT.match(obj) and not re.search(r"commit|sha|spec$|^text$", where.rsplit(".", 1)[-1]):
        # (a git commit such as '71e1927' reads as a number but is an id; a spec as the user wrote it, '15%', is text)
        bad.append(f"{where}: {obj!r}")
    return bad


def run_json(args: list[str]) -> tuple[int, dict]:
    res = runner.invoke(app, args)
    try:
        data = json.loads(res.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{args}: stdout is not one JSON object ({exc}):\n{res.stdout}\n{res.stderr}") from None
    assert isinstance(data, dict), args
    return res.exit_code, data


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_capture):
    """A compressed sample layer and a bench JSON file, made once for the module."""
    d = tmp_path_factory.mktemp("contract")
    comp = d / "s.bitmap.safetensors"
    res = runner.invoke(app, ["compress", "sample:", "--layers", "7", "--format", "bitmap", "-o", str(comp)])
    assert res.exit_code == 0, res.output
    tiny_comp = d / "tiny.dense.safetensors"
    res = runner.invoke(app, ["compress", str(tiny_capture), "--heldout", "16", "-o", str(tiny_comp)])
    assert res.exit_code == 0, res.output
    return {"dir": d, "comp": comp, "tiny_comp": tiny_comp}


def success_cases(files, tiny_capture, tiny_llama_dir, tmp: Path) -> list[tuple[str, list[str], str | None, bool]]:
    """(command, args, the input it must name or None, whether it writes an output)."""
    comp, tiny_comp = files["comp"], files["tiny_comp"]
    bench_out = tmp / "bench.json"
    return [
        ("version", ["version"], None, False),
        ("env", ["env"], None, False),
        ("sample path", ["sample", "path"], None, False),
        ("capture", ["capture", "--model", str(tiny_llama_dir), "--prompt", "hello there", "-o", str(tmp / "c.safetensors")], str(tiny_llama_dir), True),
        ("info", ["info", "sample:"], "sample", False),
        ("stats", ["stats", "sample:", "--layers", "7", "--heads", "0", "--queries", "8"], "sample", False),
        ("recommend", ["recommend", str(tiny_capture), "--budget", "40%", "--heldout", "16", "--no-model", "--no-texts", "-o", str(tmp / "plan.json")], "tiny", True),
        ("report", ["report", str(tiny_capture), "--budgets", "40%", "--heldout", "16", "--no-model", "--no-texts", "-o", str(tmp / "r.html")], "tiny", True),
        ("plot", ["plot", "sample:", "--layer", "7", "--what", "heatmap", "--out-dir", str(tmp / "plots")], "sample", True),
        ("prune", ["prune", "sample:", "--layers", "7", "-o", str(tmp / "p.safetensors")], "sample", True),
        ("heads", ["heads", "sample:", "--layers", "7", "--steps", "3", "-o", str(tmp / "r.safetensors")], "sample", True),
        ("compress", ["compress", "sample:", "--layers", "7", "--format", "quant:bits=4", "-o", str(tmp / "q.safetensors")], "sample", True),
        ("decompress", ["decompress", str(comp), "-o", str(tmp / "d.safetensors")], str(comp), True),
        ("verify", ["verify", str(comp), "--no-model"], str(comp), False),
        ("eval", ["eval", str(tiny_capture), "--formats", "dense", "--no-paper", "--heldout", "16", "--no-model", "--out-dir", str(tmp / "ev")], None, True),
        ("export", ["export", str(comp), "--to", "npz", "-o", str(tmp / "e.npz")], str(comp), True),
        ("generate", ["generate", str(tiny_comp), "--prompt", " hi", "-n", "2"], str(tiny_comp), False),
        ("bench dense", ["bench", "dense", *BENCH_TINY, "-o", str(bench_out)], None, True),
        ("bench report", ["bench", "report", str(bench_out)], None, False),
        ("tasks", ["tasks", "--model", str(tiny_llama_dir), "--tasks", "niah_single", "--lengths", "400", "--samples", "1", "--methods", "dense",
                   "--out-dir", str(tmp / "tk")], None, True),
    ]


def test_every_command_json_shape(files, tiny_capture, tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = set()
    for command, args, want_input, writes in success_cases(files, tiny_capture, tiny_llama_dir, tmp_path):
        code, data = run_json(args + ["--json"])
        assert code == 0, (command, data)
        assert data["kvtool_version"] == __version__ and data["command"] == command, (command, list(data))
        assert "error" not in data
        if want_input is not None:
            assert want_input in data["input"], (command, data.get("input"))
        if command in ("eval", "bench report"):
            assert isinstance(data["inputs"], list) and data["inputs"]
        if writes:
            assert Path(data["output"]).exists(), (command, data.get("output"))
        assert numbers_are_numbers(data) == [], (command, numbers_are_numbers(data))
        assert validate(data) == [], (command, validate(data)[:8])
        seen.add(command.split()[0])
    import typer.main

    assert seen == set(typer.main.get_command(app).commands)


FAILURES = [
    ("info", ["info", "missing.safetensors"], 1),
    ("stats", ["stats", "missing.safetensors"], 1),
    ("plot", ["plot", "missing.safetensors"], 1),
    ("prune", ["prune", "sample:", "--sparsity", "1.5"], 2),
    ("heads", ["heads", "sample:", "--top-k", "0"], 2),
    ("compress", ["compress", "sample:", "--format", "nosuch"], 2),
    ("decompress", ["decompress", "missing.safetensors"], 1),
    ("verify", ["verify", "sample:", "--no-model"], 1),
    ("eval", ["eval", "missing.safetensors", "--no-model"], 2),
    ("export", ["export", "sample:", "--to", "nosuch"], 2),
    ("generate", ["generate", "sample:", "-n", "0"], 2),
    ("recommend", ["recommend", "missing.safetensors", "--budget", "15%", "--no-model"], 2),
    ("report", ["report", "missing.safetensors", "--no-model"], 2),
    ("capture", ["capture", "--dtype", "int8"], 2),
    ("bench dense", ["bench", "dense", "--dtype", "fp8"], 2),
    ("bench report", ["bench", "report", "missing.json"], 1),
    ("version", ["version", "--no-such-option"], 2),
    ("env", ["env", "--no-such-option"], 2),
    ("sample path", ["sample", "path", "--no-such-option"], 2),
]


@pytest.mark.parametrize("command,args,exit_code", FAILURES, ids=[f[0] for f in FAILURES])
def test_failure_is_one_error_object(command, args, exit_code, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.chdir(tmp_path)
    code, data = run_json(args + ["--json"])
    assert code == exit_code, data
    err = data["error"]
    assert set(err) == {"type", "message", "exit_code"} and err["exit_code"] == exit_code and err["message"]
    assert data["command"] == command and data["kvtool_version"] == __version__
    assert validate(data) == [], validate(data)


def test_error_types_are_the_documented_ones(tmp_path, monkeypatch):
    """A subclass (an output that exists) is reported as its documented type; a bug as InternalError."""
    out = tmp_path / "q.safetensors"
    args = ["compress", "sample:", "--layers", "7", "--format", "quant:bits=4", "-o", str(out), "--json"]
    assert runner.invoke(app, args).exit_code == 0
    code, data = run_json(args)
    assert code == 2 and data["error"]["type"] == "UsageError" and "exists" in data["error"]["message"]
    from kvtool.core import io

    monkeypatch.setattr(io, "inspect_file", lambda path: 1 / 0)  # what info calls first
    code, data = run_json(["info", "sample:", "--json"])
    assert code == 1 and data["error"]["type"] == "InternalError" and "ZeroDivisionError" in data["error"]["message"]
    assert validate(data) == []


def test_the_schema_refuses_what_the_contract_forbids():
    """The checker is not a rubber stamp: undocumented keys, text numbers, numeric keys and unknown
    error types fail."""
    good = {"kvtool_version": "0.1.0", "command": "decompress", "input": "a", "output": "b", "format": "bitmap", "tokens": 8, "layers": [{"layer": 7}]}
    assert validate(good) == []
    assert validate({**good, "extra": 1}) and validate({**good, "tokens": "8"}) and validate({**good, "layers": [7]})
    assert validate({**good, "command": "nosuch"})
    bad_error = {"kvtool_version": "0.1.0", "command": "info", "error": {"type": "OutputExistsError", "message": "x", "exit_code": 2}}
    assert validate(bad_error) and not validate({**bad_error, "error": {**bad_error["error"], "type": "UsageError"}})


def test_the_schema_is_valid_json_schema_and_agrees_with_jsonschema():
    jsonschema = pytest.importorskip("jsonschema")
    from kvtool.core.schema import output_schema

    schema = output_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    good = {"kvtool_version": "0.1.0", "command": "decompress", "input": "a", "format": "bitmap", "tokens": 8, "layers": [{"layer": 7}]}
    for obj in (good, {**good, "extra": 1}, {**good, "layers": [7]}, {"kvtool_version": "0.1.0", "command": "x", "error": {"type": "Nope", "message": "m", "exit_code": 1}}):
        theirs = list(jsonschema.Draft202012Validator(schema).iter_errors(obj))
        assert bool(theirs) == bool(validate(obj)), (obj, theirs, validate(obj))


def test_tables_off_a_terminal_are_never_cut_and_data_prints_literally(tmp_path):
    src = tmp_path / "d["
    src.mkdir()
    cap = src / "red].safetensors"  # the path reads d[/red].safetensors: markup if not escaped
    shutil.copy(ROOT / "kvtool" / "data" / "smollm2-sample.safetensors", cap)
    res = runner.invoke(app, ["stats", str(cap), "--sort", "k_outliers", "--top", "10"])
    assert res.exit_code == 0, res.output
    assert "…" not in res.stdout and str(cap) in res.stdout
    out = tmp_path / "o[bold]x.safetensors"
    res = runner.invoke(app, ["compress", str(cap), "--layers", "7", "--format", "bitmap", "-o", str(out)])
    assert res.exit_code == 0 and f"wrote {out}" in res.stdout and "…" not in res.stdout
    res = runner.invoke(app, ["info", str(tmp_path / "no[word].safetensors")])
    assert res.exit_code == 1 and "no[word].safetensors" in res.stderr


def test_progress_lines_off_a_terminal_and_quiet(tmp_path):
    res = runner.invoke(app, ["stats", "sample:", "--layers", "7,15"])
    assert res.exit_code == 0
    lines = [line for line in res.stderr.splitlines() if line.startswith("kvtool stats:")]
    assert lines and re.search(r"stats \d+/2 \(\d+%\), \d+ s", lines[0]) and "done in" in lines[-1]
    res = runner.invoke(app, ["stats", "sample:", "--layers", "7", "-q"])
    assert res.exit_code == 0 and res.stderr == ""
    res = runner.invoke(app, ["-q", "stats", "sample:", "--layers", "7"])
    assert res.exit_code == 0 and res.stderr == ""


def test_heartbeat_reports_a_long_unit_of_work():
    import io

    from kvtool.commands._common import LineProgress

    stream = io.StringIO()
    sink = LineProgress("eval", stream=stream, heartbeat=0.2)
    sink.stage("points", 3)
    time.sleep(0.75)  # one long point: no advance, yet lines keep coming
    sink.advance()
    sink.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("kvtool eval: points 0/3 (0%)")
    assert sum("points 0/3" in line for line in lines) >= 3 and lines[-1].startswith("kvtool eval: done in")


def test_deprecated_names_still_work(tmp_path):
    res = runner.invoke(app, ["plot", "sample:", "--layer", "7", "--what", "heatmap", "--out", str(tmp_path / "a"), "--format", "svg"])
    assert res.exit_code == 0, res.output
    assert list((tmp_path / "a").glob("*.svg")) and "--out/-o is deprecated" in res.stderr and "--format is deprecated" in res.stderr
    res = runner.invoke(app, ["heads", "sample:", "--layers", "7", "--steps", "3", "--k", "2", "--router-out", str(tmp_path / "r.safetensors")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "r.safetensors").exists() and "--k is deprecated" in res.stderr


def test_bench_json_path_alias(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "b.json"
    res = runner.invoke(app, ["bench", "dense", *BENCH_TINY, "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["subcommand"] == "dense" and "deprecated" in res.stderr
    res = runner.invoke(app, ["bench", "dense", *BENCH_TINY, "--json", "-"])
    assert res.exit_code == 0 and json.loads(res.stdout)["command"] == "bench dense"


def test_dtype_spellings_and_typed_thresholds(tmp_path, tiny_llama_dir, files):
    res = runner.invoke(app, ["capture", "--model", str(tiny_llama_dir), "--prompt", "abc", "--dtype", "fp16", "-o", str(tmp_path / "a.safetensors"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["model_facts"]["dtype"] == "float16"
    res = runner.invoke(app, ["verify", str(files["comp"]), "--no-model", "--max-error", "abc"])
    assert res.exit_code == 2 and "--max-error must be a number, got 'abc'" in res.stderr


def test_version_env_and_sample_commands():
    res = runner.invoke(app, ["version"])
    assert res.exit_code == 0 and res.stdout.strip() == f"kvtool {__version__}"
    res = runner.invoke(app, ["env"])
    assert res.exit_code == 0 and "torch" in res.stdout and "transformers" in res.stdout and "flashinfer" in res.stdout
    res = runner.invoke(app, ["sample", "path"])
    assert res.exit_code == 0 and Path(res.stdout.strip()).is_file()
    res = runner.invoke(app, ["--help"])
    assert "--install-completion" in res.stdout


def test_help_lists_match_the_library():
    """The names --help shows without importing torch are the library's own."""
    from kvtool.analysis.fidelity import BACKENDS
    from kvtool.analysis.plots import KINDS
    from kvtool.analysis.sweep import METRICS
    from kvtool.commands import eval as eval_cmd, export as export_cmd, plot as plot_cmd, prune as prune_cmd
    from kvtool.commands._catalog import format_summaries
    from kvtool.export.convert import TARGETS
    from kvtool.formats import load_all
    from kvtool.methods.prune import DEFAULT_WINDOW, METHODS

    assert format_summaries() == {n: f.summary for n, f in sorted(load_all().items()) if not n.startswith("test-")}
    assert eval_cmd.BACKEND_NAMES == tuple(BACKENDS) and eval_cmd.METRIC_NAMES == tuple(METRICS)
    assert export_cmd.TARGET_NAMES == tuple(TARGETS) and plot_cmd.KIND_NAMES == tuple(KINDS)
    assert prune_cmd.METHOD_NAMES == tuple(METHODS) and prune_cmd.DEFAULT_DENSE_WINDOW == DEFAULT_WINDOW


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["compress", "--help"], ["bench", "--help"]])
def test_start_up_loads_no_heavy_library(args):
    code = ("import sys, runpy; sys.argv = ['kvtool', *%r]\n"
            "try:\n    runpy.run_module('kvtool', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'matplotlib', 'triton') if m in sys.modules]\n"
            "sys.stderr.write('HEAVY=' + ','.join(heavy))\n") % (args,)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert "HEAVY=" in res.stderr and res.stderr.rsplit("HEAVY=", 1)[1].strip() == "", res.stderr[-2000:]


def test_python_api_mirrors_the_cli(tmp_path, files):
    import kvtool

    out = tmp_path / "api.bitmap.safetensors"
    r = kvtool.compress("sample:", "bitmap:sparsity=0.7", out, layers="7")
    assert isinstance(r, kvtool.CompressResult) and 0 < r.storage_ratio < 1 and Path(r.output) == out
    cli = tmp_path / "cli.bitmap.safetensors"
    res = runner.invoke(app, ["compress", "sample:", "--format", "bitmap:sparsity=0.7", "--layers", "7", "-o", str(cli), "--json"])
    want = json.loads(res.stdout)
    got = json.loads(json.dumps(r.to_dict()))
    for key in ("kvtool_version", "command", "format", "params", "layers", "dense_bytes", "stored_bytes", "storage_ratio"):
        assert got[key] == want[key], key
    v = kvtool.verify(out, model=False)
    assert validate(json.loads(json.dumps(r.to_dict()))) == [] and validate(json.loads(json.dumps(v.to_dict()))) == []
    assert 0 < v.rel_l2 < 1 and v.nll_increase is None and v.to_dict()["attention"]["layers"][0]["layer"] == 7
    with pytest.raises(kvtool.UsageError) as err:
        kvtool.compress("sample:", "bitmap", out)
    assert "--" not in str(err.value) and "force=True" in str(err.value)
    assert kvtool.load("sample:").num_tokens == 512
    import inspect

    assert "heldout" in inspect.signature(kvtool.compress).parameters and kvtool.compress.__doc__


def test_import_kvtool_is_cheap():
    code = "import sys, kvtool; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.stdout.strip() == "[]", res.stderr


def test_no_color_option_and_readable_info():
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "FORCE_COLOR": "1"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvtool", *a], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)  # noqa: E731
    assert "\x1b[" in run("info", "missing.safetensors").stderr
    assert "\x1b[" not in run("--no-color", "info", "missing.safetensors").stderr
    res = runner.invoke(app, ["info", "sample:"])
    assert res.exit_code == 0 and "{'" not in res.stdout and "prompt preview" in res.stdout and "None" not in res.stdout


def test_every_command_takes_json_and_quiet():
    import typer.main

    def walk(group, prefix=""):
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                if hasattr(cmd, "_commands"):  # bench builds its suites on first use
                    cmd = cmd._commands()
                yield from walk(cmd, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}", cmd

    commands = dict(walk(typer.main.get_command(app)))
    assert {"compress", "recommend", "report", "info", "decompress", "export", "bench report", "bench dense"} <= set(commands)
    for name, cmd in commands.items():
        opts = {o for p in cmd.params for o in p.opts}
        assert {"--json", "-q", "--quiet", "--debug"} <= opts, name
