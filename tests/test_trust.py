"""Trust: files never run code, never destroy inputs, and corrupted payloads are caught (issue 18)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import kvtool
from kvtool.cli import app
from kvtool.core import io
from tests.conftest import synthetic_cache

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def run_kvtool(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kvtool", *args], input=stdin, capture_output=True, text=True, env=env, timeout=300)


def custom_code_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A model folder whose config names its own Python (auto_map); importing it writes ``marker``."""
    folder = tmp_path / "evil-model"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import LlamaConfig, LlamaForCausalLM\n"
    code += "class EvilConfig(LlamaConfig):\n    model_type = 'evilllama'\n"
    code += "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    (folder / "evil.py").write_text(code)
    cfg = {"model_type": "evilllama", "architectures": ["EvilModel"],
           "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
           "vocab_size": 258, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, marker


def test_capture_naming_custom_code_model_never_runs_it(tmp_path):
    folder, marker = custom_code_folder(tmp_path)
    cache = synthetic_cache(layers=(0, 1))
    cache.facts = type(cache.facts)(**{**cache.facts.to_dict(), "name": str(folder), "source": "hf-folder"})
    cap = tmp_path / "evil.safetensors"
    io.save(cache, cap)
    res = run_kvtool("generate", str(cap), "-n", "1", stdin="y\ny\n")
    assert not marker.exists(), "the folder's code ran"
    assert res.returncode == 1, res.stderr
    assert f"loading model {folder}" in res.stderr
    assert "Traceback" not in res.stderr
    # the library entry point, asked directly, refuses the same way
    res = subprocess.run([sys.executable, "-c", f"from kvtool.hf import models; models.load({str(folder)!r})"],
                         input="y\ny\n", capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert not marker.exists()
    assert "BadDataError" in res.stderr


def test_model_path_from_metadata_must_be_plain_local_folder(tmp_path):
    from kvtool.core.errors import UsageError
    from kvtool.hf.cache import model_spec

    folder, _ = custom_code_folder(tmp_path)
    link = tmp_path / "link-model"
    link.symlink_to(folder)
    cache = synthetic_cache(layers=(0,))
    for name, ok in ((str(folder), True), (str(link), False), (str(tmp_path / "nope"), False), ("/dev/null", False)):
        cache.facts = type(cache.facts)(**{**cache.facts.to_dict(), "name": name, "source": "hf-folder"})
        if ok:
            assert model_spec(cache, tmp_path / "x") == name
        else:
            with pytest.raises(UsageError):
                model_spec(cache, tmp_path / "x")
