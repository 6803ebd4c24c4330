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
