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


# ----------------------------------------------------------------------------- inputs are never outputs


@pytest.fixture()
def capture_and_compressed(tmp_path):
    cap = tmp_path / "cap.safetensors"
    io.save(synthetic_cache(tokens=96), cap)
    comp = tmp_path / "cap.bitmap.safetensors"
    assert runner.invoke(app, ["compress", str(cap), "--format", "bitmap", "--heldout", "16", "-o", str(comp)]).exit_code == 0
    return cap, comp


def _commands(cap: Path, comp: Path, out: Path) -> list[list[str]]:
    return [
        ["compress", str(cap), "--format", "bitmap", "--heldout", "16", "-o", str(out), "--force"],
        ["prune", str(cap), "--sparsity", "0.5", "-o", str(out), "--force"],
        ["decompress", str(comp), "-o", str(out), "--force"],
        ["export", str(comp), "--to", "paged", "-o", str(out), "--force"],
    ]


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_output_that_is_an_input_is_refused_even_with_force(tmp_path, capture_and_compressed, how):
    cap, comp = capture_and_compressed
    for args in _commands(cap, comp, tmp_path / "placeholder"):
        source = Path(args[1])
        before = source.read_bytes()
        out = source if how == "same" else tmp_path / f"alias-{how}"
        if how == "symlink":
            out.symlink_to(source)
        elif how == "hardlink":
            os.link(source, out)
        args = [a if a != str(tmp_path / "placeholder") else str(out) for a in args]
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "is the input" in res.output
        assert source.read_bytes() == before, args
        if how != "same":
            out.unlink()


def test_library_functions_refuse_their_input(capture_and_compressed):
    from kvtool.core.errors import UsageError
    from kvtool.formats.files import compress_file, decompress_file
    from kvtool.methods.prune import prune_file

    cap, comp = capture_and_compressed
    with pytest.raises(UsageError):
        compress_file(cap, "bitmap", output=cap, heldout=16, force=True)
    with pytest.raises(UsageError):
        decompress_file(comp, comp, force=True)
    with pytest.raises(UsageError):
        prune_file(cap, output=cap, sparsity=0.5, force=True)


def test_non_regular_destination_is_refused(tmp_path, capture_and_compressed):
    cap, comp = capture_and_compressed
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for args in _commands(cap, comp, fifo):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "not a regular file" in res.output
        assert fifo.is_fifo()
    res = runner.invoke(app, ["decompress", str(comp), "-o", "/dev/null", "--force"])
    assert res.exit_code == 2
