"""The README's commands run as written from an empty folder.

Every ``kvtool ...`` line of the README's shell blocks is parsed like a shell would and run in a temp
folder (in-process, through Typer's runner), in order, so files made by earlier lines feed later ones.
``cap.safetensors`` is seeded with a copy of the bundled sample (a real capture of 4 of the model's 30
layers) because making it needs the model. Lines that need the model, the GPU or all 30 layers are
not run here; NEEDS says why for each kind, and the test fails if no line is run at all.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SAMPLE = ROOT / "kvtool" / "data" / "smollm2-sample.safetensors"

# why a README line is not run here: a predicate on its arguments, and the reason
NEEDS = [
    (lambda a: a[0] in ("capture", "generate"), "runs the model"),
    (lambda a: a[0] == "bench" and "report" not in a, "times GPU kernels"),
    (lambda a: a[0] in ("verify", "eval") and "--no-model" not in a, "scores the continuation with the model"),
    (lambda a: a[0] == "report" and "--eval" in a, "reads the model-level eval folder and a GPU bench file made above"),
    (lambda a: a[0] == "export" and "hf" in a, "a transformers cache needs all 30 layers; the seeded capture holds 4"),
    (lambda a: a[0] == "tasks" or (a[0] == "recommend" and "tasks" in a), "runs the model on long-context task samples (tests/test_tasks.py runs them on a tiny model)"),
]


def readme_commands() -> list[list[str]]:
    """Argument lists of the README's ``kvtool`` lines (shell comments dropped)."""
    blocks = re.findall(r"^```(?:\w*)\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    out = []
    for block in blocks:
        for line in block.splitlines():
            line = line.strip()
            if line.startswith("kvtool "):
                out.append(shlex.split(line, comments=True)[1:])
    return out


def skip_reason(args: list[str]) -> str | None:
    return next((why for test, why in NEEDS if test(args)), None)


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(SAMPLE, tmp_path / "cap.safetensors")
    runner = CliRunner()
    ran = []
    for args in readme_commands():
        if skip_reason(args):
            continue
        res = runner.invoke(app, args)
        assert res.exit_code == 0, f"kvtool {shlex.join(args)}\n{res.output}"
        assert "…" not in res.stdout, f"kvtool {shlex.join(args)} cut a value off a terminal"
        ran.append(args[0])
    # the sample block and the cheap half of the walk-through did run
    assert {"info", "stats", "compress", "verify", "eval", "heads", "prune", "decompress", "plot", "export"} <= set(ran), ran


def test_readme_python_snippet_keeps_to_its_own_files():
    """The Python block writes no file that the shell walk-through makes, and suggests no CLI flag."""
    text = README.read_text()
    python = "\n".join(re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M))
    shell_files = set(re.findall(r"[\w.-]+\.safetensors", "\n".join(" ".join(a) for a in readme_commands())))
    python_files = set(re.findall(r"[\w.-]+\.safetensors", python))
    assert python and not (python_files & shell_files), python_files & shell_files
    assert "--" not in python


@pytest.mark.parametrize("example", ["kvtool info sample:", "kvtool stats sample: -q", "kvtool sample path"])
def test_help_examples_on_the_sample_run_from_anywhere(example, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, shlex.split(example)[1:])
    assert res.exit_code == 0, res.output
