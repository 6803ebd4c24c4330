"""Bounded work: one size rule for budgets, page sizes, groups, prompt files and layer counts (issue 34)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.core import io, limits
from kvtool.core.errors import BadDataError, UsageError
from tests.conftest import synthetic_cache
from tests.test_trust import PY_ERRORS, raw_header_edit, rewrite

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def one_line(res, code: int, *needles: str) -> None:
    assert res.exit_code == code, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert not any(e in res.output for e in (*PY_ERRORS, "OverflowError", "MemoryError")), res.output
    for needle in needles:
        assert needle in res.output, (needle, res.output)


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
    path = tmp_path_factory.mktemp("limits") / "cap.safetensors"
    io.save(synthetic_cache(tokens=96, layers=(0, 1, 3)), path)  # 4 model layers, 3 captured
    return path


@pytest.mark.parametrize("args, needle", [
    (["compress", "CAP", "--format", "quant:bits=4,group=99999999999999999999"], "group must be at most 16777216"),
    (["compress", "CAP", "--format", "quant", "--group", "99999999999999999999"], "group must be at most"),
    (["compress", "CAP", "--format", "snapstream:budget=1000000000000"], "budget must be at most"),
    (["compress", "CAP", "--format", "bitmap:sparsity=nan"], "sparsity must be a finite number"),
    (["compress", "CAP", "--format", "quant:bits=1e999"], "bits must be an integer"),
    (["export", "CAP", "--to", "paged", "--page-size", "99999999999999999999"], "--page-size must be at most 4096"),
    (["export", "CAP", "--to", "paged", "--page-size", "10000000"], "--page-size must be at most 4096"),
    (["export", "CAP", "--to", "paged", "--page-size", "0"], "--page-size must be at least 1"),
])
def test_sizes_out_of_bounds_are_one_usage_line(cap, tmp_path, args, needle):
    out = tmp_path / "o.safetensors"
    args = [str(cap) if a == "CAP" else a for a in args] + ["-o", str(out)]
    one_line(runner.invoke(app, ["-q", *args]), 2, needle)
    assert not out.exists()


def test_snapstream_report_works_on_the_clamped_budget(cap, tmp_path, monkeypatch):
    """The issue's case: the file was clamped but the report step laid out the requested budget
    (7.6 GB at 1e8 on the sample). Every layout is now at most the tokens there are."""
    from kvtool.formats import snapstream

    sizes = []
    real = snapstream.layout_positions

    def spy(prefix, chosen, sinks, recent, topk):
        sizes.append(sinks + recent + topk)
        return real(prefix, chosen, sinks, recent, topk)

    monkeypatch.setattr(snapstream, "layout_positions", spy)
    res = runner.invoke(app, ["-q", "compress", str(cap), "--format", "snapstream:budget=16000000", "--heldout", "16", "-o", str(tmp_path / "s.safetensors"), "--json"])
    assert res.exit_code == 0, res.output
    details = json.loads(res.stdout)["details"]
    assert details["budget"] == 80 and details["budget_clamped_from"] == 16000000
    assert sizes and max(sizes) <= 80


def run_kvtool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kvtool", "-q", *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "folder", "too-large", "not-utf8"])
def test_prompt_files_are_bounded_regular_files(kind, tmp_path):
    """/dev/zero was read until MemoryError and a FIFO hung: both are refused before any read (a
    subprocess, so a hang would time out), as is a file over the size limit or one that is not text."""
    out = tmp_path / "o.safetensors"
    if kind == "dev-zero":
        prompt = Path("/dev/zero")
    elif kind == "fifo":
        prompt = tmp_path / "fifo"
        os.mkfifo(prompt)
    elif kind == "folder":
        prompt = tmp_path
    elif kind == "too-large":
        prompt = tmp_path / "big.txt"
        with open(prompt, "wb") as fh:
            fh.truncate(limits.MAX_TEXT_BYTES + 1)  # sparse: its size is refused before a byte is read
    else:
        prompt = tmp_path / "latin1.txt"
        prompt.write_bytes("caf\xe9 ".encode("latin-1") * 10)
    if kind == "fifo":  # in a subprocess: a hang would time out instead of stopping the suite
        res = run_kvtool("capture", "--prompt-file", str(prompt), "-o", str(out), timeout=60)
        assert res.returncode == 2, res.stderr
        assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: --prompt-file"), res.stderr
    else:
        one_line(runner.invoke(app, ["-q", "capture", "--prompt-file", str(prompt), "-o", str(out)]), 2, "error: --prompt-file")
    assert not out.exists()


def test_library_text_reader_opens_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(BadDataError, match="not a regular file"):
        limits.read_text_input(fifo, "x")
    with pytest.raises(UsageError, match="the JSON nests more than 64"):
        limits.parse_json_text("[" * 100_000 + "]" * 100_000, "x", UsageError)
    with pytest.raises(BadDataError, match="out of range"):
        limits.parse_json_text('{"version": 1e999}', "x")


def test_a_forged_layer_count_is_refused_before_anything_is_allocated(cap, tmp_path):
    """The issue's case: an 8 MB header listing 2^20 layers used 1.25 GB before it was refused."""
    many = list(range(1 << 20))

    def forge(num_layers):
        def edit(header):
            meta = header["__metadata__"]
            model = json.loads(meta["kvtool.model"])
            model["num_layers"] = num_layers
            meta["kvtool.model"] = json.dumps(model)
            meta["kvtool.layers"] = json.dumps(many)
            meta.pop(io.CHECKSUM_KEY)
        return edit

    for num_layers, needle in ((1 << 20, "implausible"), (limits.MAX_LAYERS, "more layers than the model's 4096")):
        bad = raw_header_edit(cap, tmp_path / "many.safetensors", forge(num_layers))
        assert bad.stat().st_size > 7 << 20
        tracemalloc.start()
        for cmd in ("info", "stats"):
            one_line(runner.invoke(app, ["-q", cmd, str(bad)]), 1, needle)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 200 << 20, peak


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.__setitem__("kvtool.layers", json.dumps([0, 1, 1])), "lists layer 1 twice"),
    (lambda m: m.__setitem__("kvtool.layers", json.dumps([1, 0, 1])), "lists layer 1 twice"),
    (lambda m: m.__setitem__("kvtool.model", json.dumps({**json.loads(m["kvtool.model"]), "hidden_size": -5})), "hidden size -5"),
    (lambda m: m.__setitem__("kvtool.model", json.dumps({**json.loads(m["kvtool.model"]), "hidden_size": 0})), "hidden size 0"),
])
def test_capture_metadata_repeated_layers_or_negative_sizes(cap, tmp_path, edit, needle):
    bad = rewrite(cap, tmp_path / "bad.safetensors", meta_edit=edit)
    for args in (["info", str(bad)], ["stats", str(bad)], ["compress", str(bad), "--format", "quant", "-o", str(tmp_path / "o.safetensors")]):
        one_line(runner.invoke(app, ["-q", *args]), 1, needle)


def test_bounded_int_rule():
    assert limits.bounded_int("--x", "12", 1, 16) == 12
    for value, needle in (("99999999999999999999", "at most 16"), ("1" * 5000, "at most 16"), ("0", "at least 1"), ("1.5", "an integer"), (True, "an integer")):
        with pytest.raises(UsageError, match=needle):
            limits.bounded_int("--x", value, 1, 16)
