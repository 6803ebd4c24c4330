"""A new format is one file: a module dropped into ``kvtool/formats/`` appears in ``compress --help``,
compresses, shows in ``info`` and joins the default ``eval`` sweep, with no other module touched.

The test copies the package, adds one module to the copy and runs the CLI on it in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, SAMPLE

TOY = '''
"""``toyhalf``: keys and values stored in bfloat16 (a test format)."""

from dataclasses import dataclass

import torch

from kvtool.core.cache import LayerKV
from kvtool.formats.base import Encoded, Format, FormatParams, register


@dataclass
class ToyParams(FormatParams):
    scale: float = 1.0


@register
class ToyHalfFormat(Format):
    name = "toyhalf"
    summary = "keys and values rounded to bfloat16 (toy)"
    Params = ToyParams
    default_sweep = ("toyhalf:scale=1.0,2.0",)

    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        return Encoded({"keys": (layer.keys * params.scale).to(torch.bfloat16), "values": layer.values.to(torch.bfloat16)},
                       {"dtype": str(layer.keys.dtype).removeprefix("torch."), "scale": params.scale})

    def decode(self, enc: Encoded) -> LayerKV:
        dtype = getattr(torch, enc.meta["dtype"])
        return LayerKV(keys=(enc.tensors["keys"].float() / enc.meta["scale"]).to(dtype), values=enc.tensors["values"].to(dtype))
'''


@pytest.fixture(scope="module")
def package_with_toy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pkg")
    shutil.copytree(ROOT / "kvtool", root / "kvtool", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "kvtool" / "formats" / "toyhalf.py").write_text(TOY)
    return root


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200", "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "kvtool", *args], capture_output=True, text=True, env=env, cwd=root, timeout=300)


@pytest.mark.slow
def test_one_file_adds_a_format(package_with_toy, tmp_path):
    help_text = " ".join(run(package_with_toy, "compress", "--help").stdout.split())  # help wraps lines
    assert "toyhalf (keys and values rounded to bfloat16 (toy))" in help_text

    out = tmp_path / "cap.toy.safetensors"
    res = run(package_with_toy, "compress", str(SAMPLE), "--format", "toyhalf:scale=2.0", "-o", str(out), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["format"] == "toyhalf"

    info = run(package_with_toy, "info", str(out), "--json")
    assert info.returncode == 0, info.stderr
    assert "toyhalf" in info.stdout

    probe = ("from kvtool.analysis.sweep import resolve_points; "
             "print([p.spec for p in resolve_points([]) if p.format == 'toyhalf'])")
    env = {**os.environ, "PYTHONPATH": str(package_with_toy)}
    specs = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=package_with_toy, timeout=120)
    assert specs.stdout.strip() == "['toyhalf:scale=1.0', 'toyhalf:scale=2.0']", specs.stderr

    # the copy without the module knows nothing of it: the format really came from that one file
    assert "toyhalf" not in run(ROOT, "compress", "--help").stdout
