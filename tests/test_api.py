"""The Python API: built from the commands' declarations, so every command has its function with the
CLI's parameter names and defaults; progress reaches a callback; ``model=False`` never runs the model;
the docs' Python snippets import what exists."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import typer.main

import kvtool
from kvtool import api
from kvtool.cli import app
from kvtool.commands._command import declared_parameters, parameter_meta

ROOT = Path(__file__).resolve().parents[1]
# commands whose function is written by hand in kvtool.api (and why), and commands with none
WRITTEN = {"capture": "capture", "sample path": "sample_path"}
NO_FUNCTION = {"bench": "GPU timing suites, built lazily per suite; run them with the CLI"}


def cli_commands() -> dict[str, object]:
    """Every command below ``kvtool`` by its full name (``sample path``), groups walked."""
    out = {}

    def walk(group, prefix):
        for name, cmd in group.commands.items():
            full = f"{prefix}{name}"
            if hasattr(cmd, "commands") and full not in NO_FUNCTION:
                walk(cmd, full + " ")
            else:
                out[full] = cmd
    walk(typer.main.get_command(app), "")
    return out


def test_every_command_has_its_function():
    for name in cli_commands():
        if name in NO_FUNCTION:
            continue
        if name in WRITTEN:
            assert callable(getattr(kvtool, WRITTEN[name])), name
            continue
        assert name in api.COMMAND_FUNCTIONS, f"kvtool {name} has no Python function (declare it and add it in kvtool/api.py)"
        fn = api.COMMAND_FUNCTIONS[name]
        assert getattr(kvtool, fn.__name__) is fn, f"kvtool.{fn.__name__} is not exported by kvtool/__init__.py"


def test_functions_take_the_cli_parameters_with_the_same_defaults():
    """Each CLI option of a command is a parameter of its function, under the same Python name, with
    the same default; hidden (deprecated) options and the CLI-only ones are not."""
    commands = cli_commands()
    for name, fn in api.COMMAND_FUNCTIONS.items():
        params = inspect.signature(fn).parameters
        cli_params = {p.name: p for p in commands[name].params}
        for pname, cp in cli_params.items():
            if pname in ("json_out", "quiet", "debug") or cp.hidden or pname == "no_model":
                assert pname not in params, (name, pname)
                continue
            assert pname in params, f"kvtool.{fn.__name__} lacks {pname} (kvtool {name} has {cp.opts})"
            want = cp.default if not callable(cp.default) else cp.default()
            got = params[pname].default
            if cp.required:
                assert got is inspect.Parameter.empty, (name, pname)
            else:
                assert got == want or (got is None and want in (None, [], ())), (name, pname, got, want)
        assert params["progress"].default == "auto"
        assert f"kvtool {name}" in fn.__doc__


def test_capture_takes_every_capture_option():
    cli = {p.name: p for p in cli_commands()["capture"].params}
    params = inspect.signature(kvtool.capture).parameters
    for name, cp in cli.items():
        if name in ("json_out", "quiet", "debug") or name in api.CAPTURE_CLI_ONLY:
            continue
        assert name in params, f"kvtool.capture lacks {name}"
        default = params[name].default
        assert default == cp.default or (name == "cache_dir" and default is None), (name, default, cp.default)


def test_arguments_are_positional_and_options_keywords():
    sig = inspect.signature(kvtool.compress)
    kinds = {n: p.kind for n, p in sig.parameters.items()}
    assert list(sig.parameters)[:3] == ["capture", "format", "output"]
    assert kinds["capture"] is inspect.Parameter.POSITIONAL_OR_KEYWORD and kinds["sparsity"] is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(TypeError):
        kvtool.stats("sample:", "7")  # layers is an option: keyword only


def test_declared_types_are_plain_in_the_api():
    for fn in api.COMMAND_FUNCTIONS.values():
        for p in inspect.signature(fn).parameters.values():
            assert "typer" not in repr(p.annotation) and "Api(" not in repr(p.annotation), (fn.__name__, p)


def test_progress_callback_and_paths_as_text(tmp_path):
    events = []
    r = kvtool.stats("sample:", layers="7,15", queries=8, progress=lambda stage, done, total: events.append((stage, done, total)))
    assert isinstance(r, kvtool.StatsResult) and r.rows and r.input.endswith(".safetensors")
    assert events[0] == ("stats", 0, 2) and events[-1] == ("stats", 2, 2)
    out = tmp_path / "p"
    p = kvtool.plot("sample:", layer=7, what="heatmap", out_dir=str(out), progress=False)  # a str where a path is declared
    assert isinstance(p, kvtool.PlotResult) and p.files and all(Path(f["path"]).exists() for f in p.files)


def test_verify_model_false_never_runs_the_model(tmp_path, monkeypatch):
    from kvtool.analysis import verify as verifying

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(verifying, "load_model", refuse)
    out = kvtool.compress("sample:", "quant:bits=4", tmp_path / "q.safetensors", layers="7", progress=False)
    v = kvtool.verify(out.output, model=False, progress=False)
    assert v.nll_increase is None and v.report["model_fidelity"] is None and 0 < v.rel_l2 < 1
    with pytest.warns(DeprecationWarning):
        assert kvtool.verify(out.output, use_model=False, progress=False).report["model_fidelity"] is None


def test_api_errors_name_python_parameters(tmp_path):
    out = tmp_path / "b.safetensors"
    kvtool.compress("sample:", "bitmap", out, layers="7", progress=False)
    with pytest.raises(kvtool.UsageError) as err:
        kvtool.compress("sample:", "bitmap", out, layers="7", progress=False)
    assert "--" not in str(err.value) and "force=True" in str(err.value)


def test_lazy_exports_cover_the_api():
    import kvtool as pkg

    public = {n for n in dir(api) if not n.startswith("_") and (inspect.isfunction(getattr(api, n)) or inspect.isclass(getattr(api, n)))
              and getattr(getattr(api, n), "__module__", "") == "kvtool.api" and n not in ("from_command", "api_signature", "api_doc", "python_message")}
    missing = public - set(pkg.__all__)
    assert not missing, f"kvtool/__init__.py does not export {sorted(missing)}"


def test_python_snippets_in_the_docs_import_what_exists():
    """Every ``import``/``from ... import`` line of a Python block in README.md and docs/*.md runs."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                if re.match(r"\s*(import|from) \S+", line) and "kvtool" in line:
                    exec(line.split("#")[0].strip(), {})  # noqa: S102 (our own docs)


def test_parameter_meta_reads_api_markers():
    from kvtool.commands import verify as verify_cmd

    by_name = {p.name: parameter_meta(p.annotation) for p in declared_parameters(verify_cmd.verify)}
    assert by_name["no_model"][2].skip and by_name["model"][2].type is not None


def test_export_stays_the_function_after_the_export_package_loads():
    import importlib

    importlib.import_module("kvtool.export.convert")  # the import system sets kvtool.export to the subpackage
    assert kvtool.export is api.export and callable(kvtool.export)
    from kvtool.export import convert

    assert convert.__name__ == "kvtool.export.convert"


def test_functions_take_caches_in_memory(tmp_path):
    """A KVCache where a capture path is declared: the same result as from the file."""
    cache = kvtool.load("sample:", layers=[7])
    from_file = kvtool.stats("sample:", layers="7", queries=8, progress=False)
    from_memory = kvtool.stats(cache, queries=8, progress=False)
    assert from_memory.rows == from_file.rows and from_memory.input == from_memory.to_dict()["input"] == "<memory>"
    with pytest.raises(kvtool.UsageError, match="output="):
        kvtool.prune(cache, progress=False)  # nowhere beside a cache in memory to write to
    pruned = kvtool.prune(cache, tmp_path / "p.safetensors", progress=False)
    assert Path(pruned.output).exists() and pruned.achieved_key_sparsity > 0.6
    with pytest.raises(TypeError, match="KVCache"):
        kvtool.stats(42)
    api.OBJECT_HANDLERS["info"] = lambda **kw: api.Result("info", {"handled": type(kw["path"]).__name__})
    try:
        assert kvtool.info(cache).report == {"handled": "KVCache"}  # a command's own handler wins
    finally:
        del api.OBJECT_HANDLERS["info"]


def test_recommend_and_heads_report_progress_in_stages(tiny_capture, tmp_path):
    events = []
    r = kvtool.recommend(tiny_capture, budget="40%", heldout=16, model=False, no_texts=True, output=tmp_path / "plan.json",
                         progress=lambda *e: events.append(e))
    assert isinstance(r, kvtool.RecommendResult) and Path(r.budgets[0]["plan_file"]).exists()
    stages = [e for e in events if e[0].startswith("sensitivity")]
    assert stages[0][1] == 0 and stages[-1][1] == stages[-1][2] == 2  # every layer of the tiny capture
    events.clear()
    kvtool.heads("sample:", layers="7", steps=5, progress=lambda *e: events.append(e))
    assert events[-1][1] == events[-1][2] == 1 + 5  # the oracle curves, then each router training step
