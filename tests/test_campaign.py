"""The held-out reliability campaign of issue 44 (CPU): each defect D1-D24 it found, as a test.

Data loss and silently wrong results first, then unbounded work, then error classes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import kvtool
from kvtool.cli import app
from kvtool.core.errors import BadDataError, UsageError

runner = CliRunner()


def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def model_copy(tiny_llama_dir: Path, tmp_path: Path, name: str = "model") -> Path:
    folder = tmp_path / name
    shutil.copytree(tiny_llama_dir, folder)
    return folder


# ----------------------------------------------------------------------------- data loss


def test_d1_capture_never_writes_over_a_model_folders_weights(tiny_llama_dir, tmp_path):
    folder = model_copy(tiny_llama_dir, tmp_path)
    weights = folder / "model.safetensors"
    before = digest(weights)
    for target in (weights, folder / "config.json", folder / "tokenizer.json"):
        res = runner.invoke(app, ["capture", "--model", str(folder), "--prompt", "hi", "-o", str(target), "--force"])
        assert res.exit_code == 2, res.output
        assert "is the input" in res.output
    assert digest(weights) == before
    # through the Python API too
    with pytest.raises(UsageError, match="is the input"):
        kvtool.capture("hi", model=str(folder), output=weights, force=True)
    assert digest(weights) == before


# ----------------------------------------------------------------------------- silently wrong


def test_d6_a_model_folder_without_its_weights_is_refused(tiny_llama_dir, tmp_path):
    from safetensors.torch import save_file

    folder = model_copy(tiny_llama_dir, tmp_path)
    save_file({"foo": torch.zeros(3)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadDataError, match="random weights"):
        kvtool.load_model(str(folder))
    res = runner.invoke(app, ["capture", "--model", str(folder), "--prompt", "hi", "-o", str(tmp_path / "c.safetensors")])
    assert res.exit_code == 1, res.output
    assert "no weights for" in res.output
    assert not (tmp_path / "c.safetensors").exists()


def tasks_args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["tasks", "--model", str(model), "--tasks", "niah_single", "--lengths", "400", "--methods", "dense",
            "--out-dir", str(out), *extra]


def cells(res) -> dict[str, int]:
    """{setting: n} of a run's summary (its tasks.json; notes went to stderr)."""
    assert res.exit_code == 0, res.output
    out = Path(res.out_dir)
    return {c["setting"]: c["n"] for c in json.loads((out / "tasks.json").read_text())["cells"]}


def invoke(args: list[str]):
    res = runner.invoke(app, args)
    res.out_dir = args[args.index("--out-dir") + 1]
    return res


def test_d2_a_cut_row_is_recovered_never_swallowed(tiny_llama_dir, tmp_path):
    out = tmp_path / "t"
    assert cells(invoke(tasks_args(tiny_llama_dir, out, "--samples", "2"))) == {"dense": 2}
    rows = out / "samples.jsonl"
    lines = rows.read_bytes().splitlines(keepends=True)
    rows.write_bytes(b"".join(lines[:-1]) + lines[-1][:25])  # the last write cut (killed, full disk)
    res = invoke(tasks_args(tiny_llama_dir, out, "--samples", "3"))
    assert cells(res) == {"dense": 3}
    assert "cut by an interrupted write" in res.stderr
    assert [json.loads(x)["sample"] for x in rows.read_text().splitlines()] == [json.loads(x)["sample"] for x in lines] + [
        json.loads(rows.read_text().splitlines()[-1])["sample"]]
    # a file an earlier kvtool damaged: a row appended after a cut line; the row is kept
    good = rows.read_text().splitlines()
    rows.write_text("\n".join(good[:-1]) + "\n" + good[-1][:30] + good[-1] + "\n")
    assert cells(invoke(tasks_args(tiny_llama_dir, out, "--samples", "3"))) == {"dense": 3}
    assert len(rows.read_text().splitlines()) == 3
    # --force starts over but keeps the old rows, said so
    res = invoke(tasks_args(tiny_llama_dir, out, "--samples", "1", "--force"))
    assert cells(res) == {"dense": 1}
    kept = list(out.glob("samples.*.jsonl"))
    assert len(kept) == 1 and len(kept[0].read_text().splitlines()) == 3
    assert str(kept[0]) in res.stderr


def test_d2_a_full_disk_is_the_documented_message(tmp_path, monkeypatch):
    import errno
    import os

    from kvtool.analysis import taskfiles

    rows = tmp_path / "samples.jsonl"
    taskfiles.append_rows(rows, [{"sample": "a", "setting": "dense", "method": "dense", "task": "t", "length": 1}])
    before = rows.read_bytes()
    real = os.write

    def full(fd, data):
        real(fd, bytes(data[:7]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(BadDataError, match=r"cannot write .*samples.jsonl: No space left on device"):
        taskfiles.append_rows(rows, [{"sample": "b", "setting": "dense", "method": "dense", "task": "t", "length": 1}])
    monkeypatch.undo()
    assert rows.read_bytes() == before  # the cut batch was taken back


def test_d8_the_summary_counts_only_this_runs_rows(tiny_llama_dir, tmp_path):
    out = tmp_path / "t"
    assert cells(invoke(tasks_args(tiny_llama_dir, out, "--samples", "2"))) == {"dense": 2}
    res = invoke(tasks_args(tiny_llama_dir, out, "--samples", "2", "--seed", "5"))
    assert cells(res) == {"dense": 2}
    assert "rows of other samples or settings" in res.stderr
    args = ["tasks", "--model", str(tiny_llama_dir), "--tasks", "niah_single", "--lengths", "400", "--out-dir", str(out),
            "--samples", "1", "--methods", "dense,streaming", "--budgets", "50%"]
    assert set(cells(invoke(args))) == {"dense", "streaming @ 50%"}
    args[args.index("dense,streaming")] = "dense"
    assert set(cells(invoke(args))) == {"dense"}


def test_d7_generate_refuses_a_same_shaped_model_with_other_weights(tiny_llama_dir, tiny_capture, tmp_path):
    from tests.conftest import make_byte_tokenizer, make_tiny_llama

    other = tmp_path / "other"
    make_tiny_llama(seed=1).save_pretrained(other)
    make_byte_tokenizer().save_pretrained(other)
    res = runner.invoke(app, ["generate", str(tiny_capture), "--model", str(other), "-n", "2"])
    assert res.exit_code == 1, res.output
    assert "does not reproduce the capture's keys" in res.output
    res = runner.invoke(app, ["generate", str(tiny_capture), "--model", str(tiny_llama_dir), "-n", "2"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("layers", ['{"0": "dense", "00": "quant:bits=4"}', '{"0": "dense", "0": "quant:bits=4"}',
                                    '{"+1": "dense"}', '{" 1": "dense"}', '{"-1": "dense"}', '{"1e3": "dense"}'])
def test_d22_plan_layer_keys_are_canonical_and_unique(tmp_path, layers):
    from kvtool.core.errors import KvtoolError
    from kvtool.formats.plan import load_plan

    plan = tmp_path / "plan.json"
    plan.write_text('{"schema": "kvtool.plan", "version": 1, "default": "dense", "layers": ' + layers + "}")
    with pytest.raises(KvtoolError, match="layer key|appears twice"):
        load_plan(plan)


def write_plan(path: Path, **extra) -> Path:
    path.write_text(json.dumps({"schema": "kvtool.plan", "version": 1, "default": "dense", "layers": {"0": "quant:bits=4"}, **extra}))
    return path


@pytest.mark.parametrize("fraction", [1e300, -5, 0, 1.5, "abc", None, [0.1], True])
def test_d10_a_plans_budget_fraction_is_checked(tmp_path, fraction):
    from kvtool.analysis import taskrun

    plan = write_plan(tmp_path / "plan.json", budget={"fraction": fraction})
    with pytest.raises(BadDataError, match="budget.fraction"):
        taskrun.parse_method(f"plan:{plan}")
    ok = write_plan(tmp_path / "ok.json", budget={"fraction": 0.25})
    assert taskrun.settings_of([taskrun.parse_method(f"plan:{ok}")], [])[0].budget == 0.25


def test_d23_a_plan_that_is_a_tasks_output_is_refused_up_front(tiny_llama_dir, tmp_path):
    out = tmp_path / "t"
    out.mkdir()
    plan = write_plan(out / "tasks.json")
    res = runner.invoke(app, ["tasks", "--model", "/nonexistent-model", "--methods", f"plan:{plan}", "--out-dir", str(out)])
    assert res.exit_code == 2, res.output
    assert "is the input" in res.output  # refused before the model (which does not exist) was looked at


@pytest.mark.parametrize("name", ["run.json", "samples.jsonl"])
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_d13_d16_a_fifo_or_folder_in_a_tasks_folder_is_refused(tmp_path, name, kind):
    import os

    out = tmp_path / "t"
    out.mkdir()
    if kind == "fifo":
        os.mkfifo(out / name)
    else:
        (out / name).mkdir()
    res = runner.invoke(app, ["tasks", "--model", "/nonexistent-model", "--out-dir", str(out)])
    assert res.exit_code == 1, res.output
    assert "not a regular file" in res.output and "InternalError" not in res.output


@pytest.mark.parametrize("content", [b'[1, 2]\n', b'{"a": 1}\n', b'"text"\n', b'\xff\xfe{}\n', b'not json\n',
                                     b'{"sample": "x", "setting": "dense", "method": "dense", "task": "t", "length": "9"}\n'])
def test_d16_bad_rows_are_bad_data_with_one_line(tmp_path, content):
    from kvtool.analysis import taskfiles

    rows = tmp_path / "samples.jsonl"
    rows.write_bytes(content)
    with pytest.raises(BadDataError, match="line 1"):
        taskfiles.read_rows(rows)


@pytest.mark.parametrize("content", [b"{not json", b"[1]", b"\xff\xfe"])
def test_d16_a_corrupt_run_json_is_bad_data(tmp_path, content):
    from kvtool.analysis import taskfiles

    (tmp_path / "run.json").write_bytes(content)
    with pytest.raises(BadDataError):
        taskfiles.read_run(tmp_path / "run.json")


# ----------------------------------------------------------------------------- unbounded work


def test_d12_a_huge_layer_range_is_refused_before_it_is_built():
    import time

    from kvtool.core.cache import parse_indices

    for text in ("0-150000000", "0-99999999999999", "0-" + "9" * 5000, "3-99999999999999999999"):
        start = time.perf_counter()
        with pytest.raises(UsageError, match="out of range"):
            parse_indices(text, 30)
        assert time.perf_counter() - start < 0.1
    assert parse_indices("0,5,10-12, 3 - 4", 30) == [0, 3, 4, 5, 10, 11, 12]
    for text in ("5-3", "1-2-3", "0x1", "\u0663"):
        with pytest.raises(UsageError):
            parse_indices(text, 30)


def test_d14_parse_spec_is_linear():
    import time

    from kvtool.core.spec import parse_spec

    spec = "quant:" + ",".join(f"p{i}=1" for i in range(100_000))
    start = time.perf_counter()
    assert len(parse_spec(spec)[1]) == 100_000
    assert time.perf_counter() - start < 2.0  # 12,000 parameters took 18 s when each looked at all before it
    with pytest.raises(UsageError, match="given twice") as err:
        parse_spec(spec + ",p5=2")
    assert len(str(err.value)) < 400  # the message quotes the spec cut short


@pytest.mark.parametrize("args", [["tasks", "--samples", "100000000000000000000000"], ["tasks", "--threads", "99999999999"],
                                  ["tasks", "--lengths", "infk"], ["tasks", "--lengths", "nan"], ["tasks", "--lengths", "1e30"],
                                  ["capture", "--generate", "100000000000000000000"],
                                  ["recommend", "--objective", "tasks", "--budget", "15%", "--calib-samples", "100000000000000000000"]])
def test_d15_d17_integers_beyond_the_size_rule_are_usage_errors(tmp_path, args):
    res = runner.invoke(app, [*args, "--model", "/nonexistent-model", "-o" if args[0] != "tasks" else "--out-dir", str(tmp_path / "x"), "--json"])
    assert res.exit_code == 2, res.output
    err = json.loads(res.stdout)["error"]
    assert err["type"] == "UsageError" and "Overflow" not in err["message"]


def test_d15_d24_positions_beyond_the_model_are_refused(tiny_llama_dir, tmp_path):
    res = runner.invoke(app, ["capture", "--model", str(tiny_llama_dir), "--random-tokens", "25000", "-o", str(tmp_path / "c.safetensors")])
    assert res.exit_code == 2 and "reads at most 2048 positions" in res.output, res.output
    res = runner.invoke(app, ["capture", "--model", str(tiny_llama_dir), "--random-tokens", "2000", "--generate", "100", "-o", str(tmp_path / "c.safetensors")])
    assert res.exit_code == 2 and "reads at most 2048 positions" in res.output, res.output
    res = runner.invoke(app, ["recommend", "--objective", "tasks", "--model", str(tiny_llama_dir), "--lengths", "64k", "--budget", "15%",
                              "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 2 and "reads at most 2048 positions" in res.output, res.output


# ----------------------------------------------------------------------------- error classes


def test_d18_outputs_on_a_read_only_or_pseudo_file_system_are_refused_up_front(tmp_path, monkeypatch):
    import errno
    import os
    import sys

    if sys.platform == "linux":
        res = runner.invoke(app, ["compress", "sample:", "--format", "quant:bits=4", "-o", "/proc/version", "--force", "--json"])
        assert res.exit_code == 2 and "cannot hold new files" in json.loads(res.stdout)["error"]["message"], res.output
        res = runner.invoke(app, ["eval", "sample:", "--formats", "quant:bits=4", "--no-model", "--out-dir", "/proc/kvtool-x", "--json"])
        assert res.exit_code == 2 and "cannot make the folder" in res.output, res.output
    # a read-only mount: the folder cannot be made, or holds no new file
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if str(self).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    for args in (["eval", "sample:", "--formats", "quant:bits=4", "--no-model", "--out-dir", str(tmp_path / "ro" / "e")],
                 ["tasks", "--model", "/nonexistent-model", "--out-dir", str(tmp_path / "ro" / "t")]):
        res = runner.invoke(app, [*args, "--json"])
        assert res.exit_code == 2, res.output
        err = json.loads(res.stdout)["error"]
        assert err["type"] == "UsageError" and "Read-only file system" in err["message"]


def tasks_summary(**change) -> dict:
    cell = {"setting": "dense", "method": "dense", "budget": None, "task": "niah_single", "length": 1024, "accuracy": 1.0, "lo": 0.5,
            "hi": 1.0, "n": 2, "correct": 2, "storage_ratio": 1.0}
    by = {"setting": "dense", "method": "dense", "budget": None, "accuracy": 1.0, "lo": 0.5, "hi": 1.0, "n": 2, "storage_ratio": 1.0}
    data = {"run": {}, "cells": [cell], "by_setting": [by], "tasks": [{"task": "niah_single", "length": 1024}], "settings": ["dense"]}
    for key, value in change.items():
        part, field = key.split("__")
        data[part][0][field] = value
    return data


@pytest.mark.parametrize("change", [{"by_setting__accuracy": "high"}, {"by_setting__storage_ratio": "x"}, {"cells__lo": [1]},
                                    {"cells__n": "2"}, {"tasks__length": "1k"}, {"by_setting__n": None}])
def test_d19_report_tasks_with_bad_cells_is_bad_data(tiny_capture, tmp_path, change):
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "tasks.json").write_text(json.dumps(tasks_summary(**change)))
    res = runner.invoke(app, ["report", str(tiny_capture), "--no-model", "--tasks", str(folder), "-o", str(tmp_path / "r.html"), "--json"])
    assert res.exit_code == 1, res.output
    err = json.loads(res.stdout)["error"]
    assert err["type"] == "BadDataError" and "tasks.json" in err["message"]


def test_d20_d21_load_model_names_its_parameter():
    with pytest.raises(UsageError, match=r"^dtype must be float16, bfloat16 or float32, got 'float7'"):
        kvtool.load_model(dtype="float7")
    with pytest.raises(UsageError, match=r"^samples must be at most"):
        kvtool.tasks(samples=10**30)
    with pytest.raises(UsageError, match=r"^lengths must be token counts"):
        kvtool.tasks(lengths="infk")


@pytest.mark.parametrize("spec", [dict(name="quant", bits=4, group=1 << 24, residual=16), dict(name="quant", bits=4, group=32, residual=1 << 24),
                                  dict(name="quant", scheme="int8", residual=1 << 24), dict(name="bitmap", sparsity=0.7, dense_window=1 << 24)])
def test_d11_live_layers_allocate_for_their_tokens_not_their_parameters(spec):
    """A token-measured parameter of 2^24 (in bounds) compresses, and its live layer allocates for
    the tokens it holds plus a headroom (it asked for 6-13 GB per layer), grows as tokens come, and
    attends as the file decodes."""
    from kvtool.core.attention import attend_partial
    from kvtool.core.limits import LIVE_HEADROOM
    from tests.conftest import synthetic_cache

    from kvtool.formats.base import get_format

    spec = dict(spec)
    fmt = get_format(spec.pop("name"))
    layer = synthetic_cache(tokens=600, head_dim=32, heads=4, kv_heads=2, queries=False).layers[0]
    live = fmt.live_from_dense(layer.slice_tokens(0, 100), fmt.Params(**spec))
    dense_bytes = 2 * layer.keys[:, :, :100].numel() * 2
    limit = 8 * (2 * 2 * (100 + 2 * LIVE_HEADROOM) * 32 * 2)  # a few copies of the tokens + headroom in float16
    assert live.stored_bytes() < limit, (live.stored_bytes(), dense_bytes)
    for start in range(100, 600, 100):  # eager appends past the first allocation
        live.append(layer.keys[:, :, start:start + 100], layer.values[:, :, start:start + 100])
    for _ in range(3):  # single-token steps, with room made first as a decode loop does
        live.reserve(1)
    assert live.tokens == 600
    dense = fmt.decode(live.encoded())
    q = torch.randn(1, 4, 2, 32, dtype=torch.float16)
    torch.testing.assert_close(live.partial(q, None)[0], attend_partial(q, dense.keys, dense.values)[0])
    assert live.stored_bytes() < limit


def test_d21_press_refuses_a_bad_spec_when_called_naming_python_parameters():
    with pytest.raises(UsageError, match=r"^bits must be one of 2, 4, 8"):
        kvtool.press("quant:bits=3")  # before any block is entered
    with pytest.raises(UsageError, match=r"^dense_window must be at least 0"):
        kvtool.press("bitmap:dense-window=-1")
