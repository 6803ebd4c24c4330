"""One method vocabulary: a name means the same in `compress --format`, `eval --formats`, `tasks --methods`,
`kvtool.press(...)`, plans and `bench ... --formats`; several values follow one option the same way
everywhere; an unknown name suggests the closest known one."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from kvtool.cli import _multi_values, app
from kvtool.core.errors import UsageError
from kvtool.core.names import FORMAT_ALIASES
from kvtool.formats.pipeline import resolve


def test_aliases_and_lone_steps_resolve_to_registered_formats():
    from kvtool.formats.base import load_all

    registry = load_all()
    for alias, (base, _) in FORMAT_ALIASES.items():
        assert alias not in registry and base in registry  # the registry stays the one list of formats
    fmt, params, _ = resolve("kivi:bits=2")
    same, same_params, _ = resolve("quant:scheme=kivi,bits=2")
    assert fmt is same and params == same_params
    _, kivi4, _ = resolve("kivi4")
    assert (kivi4.bits, kivi4.group, kivi4.residual, kivi4.partial) == (4, 32, 0, True)
    fmt, params, _ = resolve("snapkv:budget=128")  # alone: the chain that keeps its tokens dense
    assert fmt.name == "pipeline" and (params.evict, params.prune, params.format) == ("snapkv:budget=128", None, "dense")
    assert resolve("snapkv:budget=128")[1] == resolve("snapkv:budget=128+dense")[1]
    fmt, params, _ = resolve("snapkv:budget=128+kivi4")
    assert params.format.startswith("quant:") and "bits=4" in params.format
    with pytest.raises(UsageError, match="contradicts"):
        resolve("kivi:scheme=int8")


@pytest.mark.parametrize("typo, meant", [("qaunt:bits=4", "quant"), ("bitmpa", "bitmap"), ("snapvk:budget=9", "snapkv"), ("kivl", "kivi")])
def test_an_unknown_name_suggests_the_closest(typo, meant):
    with pytest.raises(UsageError, match=f"did you mean '{meant}'"):
        resolve(typo)


def test_tasks_methods_take_the_same_names():
    from kvtool.analysis.taskrun import parse_method
    from kvtool.commands.tasks import split_methods

    assert parse_method("quant").label == parse_method("kivi").label == "kivi"  # the budget-filling KIVI family
    assert parse_method("quant:bits=4").kind == "spec" and parse_method("snapkv:budget=128+kivi4").kind == "spec"
    assert parse_method("kivi4").name == "kivi4"
    with pytest.raises(UsageError, match="did you mean 'snapkv'"):
        parse_method("snpkv")
    assert split_methods(["dense,kivi", "quant:bits=4,group=64", "spec:kivi:bits=2,group=64"]) == [
        "dense", "kivi", "quant:bits=4,group=64", "spec:kivi:bits=2,group=64"]


def test_eval_sweeps_take_the_same_names():
    from kvtool.analysis.sweep import resolve_points

    points = resolve_points(["kivi:bits=2,4", "snapkv:budget=128+quant:bits=4,group=64", "per-token:k=0.5"])
    assert [p.skipped for p in points] == [None] * 4
    assert [p.params["bits"] for p in points[:2]] == [2, 4] and points[0].params["scheme"] == "kivi"
    chain = points[2].params
    assert (chain["evict"], chain["prune"], chain["format"].replace(";", ",")) == ("snapkv:budget=128", None, "quant:bits=4,group=64")
    assert (points[3].params["evict"], points[3].params["format"]) == (None, "dense")


def test_press_takes_the_same_names():
    import kvtool

    pytest.importorskip("transformers")
    for spec in ("kivi:bits=4", "snapkv:budget=128", "snapkv:budget=128+kivi4", "quant:bits=4"):
        with kvtool.press(spec):
            pass
    with pytest.raises(UsageError, match="did you mean 'quant'"):
        with kvtool.press("qunt:bits=4"):
            pass


def test_compress_takes_the_same_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    sizes = {}
    for name, spec in (("a", "kivi:bits=2"), ("b", "quant:bits=2"), ("c", "snapkv:budget=128")):
        res = runner.invoke(app, ["compress", "sample:", "--format", spec, "-o", f"{name}.safetensors", "--layers", "7", "--json"])
        assert res.exit_code == 0, res.output
        sizes[name] = json.loads(res.stdout)["stored_bytes"]
    assert sizes["a"] == sizes["b"] and sizes["c"] < sizes["b"] * 4
    res = runner.invoke(app, ["compress", "sample:", "--format", "bitmpa:sparsity=0.7", "-o", "d.safetensors"])
    assert res.exit_code == 2 and "did you mean 'bitmap'" in res.stderr


def test_several_values_after_one_option_everywhere():
    assert _multi_values(["bench", "decode", "--formats", "a", "b", "--plan", "p.json"]) == [
        "bench", "decode", "--formats", "a", "--formats", "b", "--plan", "p.json"]
    assert _multi_values(["-q", "tasks", "-M", "dense", "kivi", "--budgets", "25%"]) == ["-q", "tasks", "-M", "dense", "-M", "kivi", "--budgets", "25%"]
    assert _multi_values(["eval", "cap", "--formats", "a", "b"]) == ["eval", "cap", "--formats", "a", "b"]  # eval reads them itself
    # parsed by Click as the commands read them (parse only: nothing runs)
    from tests.docs_harness import parse_only

    params = parse_only(["bench", "decode", "--model-shape", "tiny", "--formats", "kivi:bits=4", "snapkv:budget=128", "--seq", "256"])
    assert list(params["formats"]) == ["kivi:bits=4", "snapkv:budget=128"] and params["seq"] == "256"
    params = parse_only(["tasks", "--methods", "dense", "quant", "--budgets", "25%"])
    assert list(params["methods"]) == ["dense", "quant"]


def test_bench_decode_runs_two_formats_after_one_option(tmp_path, monkeypatch):
    """`bench decode --formats a b` runs both on the CPU (the suite's smallest shape)."""
    if shutil.which("nvidia-smi"):
        pytest.skip("the CPU path is what this checks")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = CliRunner().invoke(app, ["bench", "decode", "--model-shape", "tiny", "--batch", "1", "--seq", "64", "--runs", "3",
                                   "--formats", "kivi:bits=4", "snapkv:budget=32", "--json"])
    assert res.exit_code == 0, res.output
    providers = {r["provider"] for r in json.loads(res.stdout)["records"]}
    assert {"kivi:bits=4", "snapkv:budget=32"} <= providers, providers


def test_plans_take_the_same_names():
    import kvtool
    from kvtool.core import io
    from kvtool.formats.plan import Plan, compress_plan

    cache = io.load(kvtool.sample_path(), layers=[7, 15])
    short = Plan({7: ["kivi:bits=2"], 15: ["snapkv:budget=64", "kivi4", "quant:bits=4"]})
    spelled = Plan({7: ["quant:scheme=kivi,bits=2"], 15: ["snapkv:budget=64+dense", "quant:scheme=kivi,bits=4,group=32,residual=0,partial=true", "quant:bits=4"]})
    a, b = (compress_plan(cache, p, heldout=16).byte_report() for p in (short, spelled))
    assert a == b
