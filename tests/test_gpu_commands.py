"""GPU guards on the commands users type, at 32k tokens x 8 layers of Llama-3-8B shape (bf16, 3.2 GB):
each command's time held against the time of reading its input file once (ratios, measured in the
same process, so they hold on any card), and the share of that time its integrity checks take
(the same command with and without ``--no-verify-checksums --allow-nonfinite``). A change to the
checks or the reading that makes a command several times slower fails here. Run on a CUDA machine
with ``pytest -m gpu``; skipped elsewhere. The ratios are printed (``-s``) and written to
``$KVTOOL_GPU_RATIOS`` when set."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.core import io, kvfile
from kvtool.core.cache import KVCache, LayerKV, ModelFacts

pytestmark = pytest.mark.gpu

TOKENS, LAYERS = 32768, 8
# command -> (its arguments, largest time / read-time ratio, warm-up arguments). The limits are about
# 2.5x the ratios the commands show on an H100 at 32 layers (docs/scale.md), so a command 5x slower
# than now fails; a warm-up of one layer loads the command's kernels first.
COMMANDS = {
    "info": (["info", "{cap}", "--json"], 4.0, None),
    "compress": (["compress", "{cap}", "--format", "bitmap", "--sparsity", "0.7", "--device", "cuda", "-o", "{out}/c.bitmap.safetensors", "--force", "--json"], 12.0,
                 ["compress", "{cap}", "--format", "bitmap", "--sparsity", "0.7", "--layers", "0", "--device", "cuda", "-o", "{out}/w.safetensors", "--force"]),
    "verify": (["verify", "{out}/c.bitmap.safetensors", "--no-model", "--device", "cuda", "--json"], 12.0, None),
    "eval": (["eval", "{cap}", "--formats", "bitmap:sparsity=0.7", "signvq", "pagestat", "snapstream", "quant", "bitmapq", "--no-paper",
              "--no-model", "--device", "cuda", "--out-dir", "{out}/eval", "--force", "--json"], 40.0,
             ["eval", "{cap}", "--formats", "bitmap:sparsity=0.7", "signvq", "pagestat", "snapstream", "quant", "bitmapq", "--no-paper",
              "--no-model", "--layers", "0", "--device", "cuda", "--out-dir", "{out}/warm", "--force", "--json"]),
}
# info is all checks (it reads nothing else): its share is not held
SHARED = [name for name in COMMANDS if name != "info"]
CHECK_SHARE = 0.10  # of a command's time, plus CHECK_SLACK_S, may go to its checks
CHECK_SLACK_S = 0.5
runner = CliRunner()


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> Path:
    """A synthetic capture of Llama-3-8B attention shapes: keys with two large channels, values around
    a per-channel mean, Gaussian queries (what real ones look like to the formats)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    facts = ModelFacts(name="llama3-8b-shaped", architecture="LlamaForCausalLM", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                       hidden_size=4096, rope_theta=500000.0, dtype="bfloat16", source="synthetic")
    layers = {}
    for i in range(LAYERS):
        k = torch.randn(1, 8, TOKENS, 128, device="cuda", generator=g)
        k[..., 5] *= 6
        k[..., 70] *= 4
        v = torch.randn(1, 8, TOKENS, 128, device="cuda", generator=g) + torch.randn(1, 8, 1, 128, device="cuda", generator=g)
        q = torch.randn(1, 32, TOKENS, 128, device="cuda", generator=g)
        layers[i] = LayerKV(k.bfloat16(), v.bfloat16(), q.bfloat16())
    ids = torch.randint(0, 128000, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("gpu-commands") / "cap.safetensors"
    io.save(KVCache(facts, layers, ids, {"prefill_tokens": TOKENS, "generated_tokens": 0}), path)
    return path


def read_time(path: Path) -> float:
    """Seconds to read the file once (64 MiB reads into one buffer, no checks): the floor of any
    command that reads it. The better of two reads (the page cache holds the file)."""
    best = float("inf")
    buf = memoryview(bytearray(64 << 20))
    for _ in range(2):
        fd = os.open(path, os.O_RDONLY)
        start = time.perf_counter()
        offset = 0
        while (n := os.preadv(fd, [buf], offset)) > 0:
            offset += n
        best = min(best, time.perf_counter() - start)
        os.close(fd)
    return best


def run(args: list[str], checks: bool = True) -> float:
    """Wall seconds of one command in this process, as the CLI runs it (the source's sha256 not yet
    known: every run hashes it, as a first command on a new capture does)."""
    kvfile._SHA_MEMO.clear()
    extra = [] if checks else ["--no-verify-checksums", "--allow-nonfinite"]
    start = time.perf_counter()
    res = runner.invoke(app, extra + args)
    seconds = time.perf_counter() - start
    assert res.exit_code == 0, res.output[-2000:]
    return seconds


@pytest.fixture(scope="module")
def timings(capture, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-commands-out")
    remembered = kvfile._sha_cache_dir
    kvfile._sha_cache_dir = lambda: None  # no sha256 remembered between runs
    try:
        return _timings(capture, out)
    finally:
        kvfile._sha_cache_dir = remembered


def _timings(capture: Path, out: Path) -> dict:
    t_read = read_time(capture)
    rows = {}
    for name, (template, _limit, warm) in COMMANDS.items():
        args = [a.format(cap=capture, out=out) for a in template]
        run([a.format(cap=capture, out=out) for a in warm] if warm else args)  # kernels compiled and loaded, CUDA up
        rows[name] = {"seconds": run(args)}
        if name in SHARED:
            rows[name]["seconds_unchecked"] = run(args, checks=False)
        rows[name]["ratio"] = rows[name]["seconds"] / t_read
    result = {"device": torch.cuda.get_device_name(), "tokens": TOKENS, "layers": LAYERS, "bytes": capture.stat().st_size,
              "read_seconds": t_read, "commands": rows}
    print(json.dumps(result, indent=1))
    if os.environ.get("KVTOOL_GPU_RATIOS"):
        Path(os.environ["KVTOOL_GPU_RATIOS"]).write_text(json.dumps(result, indent=1))
    return result


@pytest.mark.parametrize("name", list(COMMANDS))
def test_command_time_against_reading_its_input(timings, name):
    row, limit = timings["commands"][name], COMMANDS[name][1]
    assert row["ratio"] <= limit, f"{name}: {row['seconds']:.2f} s is {row['ratio']:.1f}x the {timings['read_seconds']:.2f} s read of its input (limit {limit}x)"


@pytest.mark.parametrize("name", SHARED)
def test_checks_take_a_small_share(timings, name):
    row = timings["commands"][name]
    extra = row["seconds"] - row["seconds_unchecked"]
    assert extra <= CHECK_SHARE * row["seconds"] + CHECK_SLACK_S, f"{name}: checks cost {extra:.2f} s of {row['seconds']:.2f} s"


def test_lazy_capture_keeps_layers_on_the_gpu_once_read(capture):
    from kvtool.core.streaming import open_capture

    cap = open_capture(capture, parts=("keys", "values", "queries"), device="cuda")
    assert cap.keep_on_device()
    first = cap.layers[3]
    assert first.keys.is_cuda and cap.layers[3] is first  # read once, then served from the device


def test_recommend_scores_candidates_on_the_gpu(capture, tmp_path):
    """recommend --no-model reads the capture onto the GPU and scores there (2 layers of the capture)."""
    small = tmp_path / "two.safetensors"
    cache = io.load(capture, layers=[0, 1])
    layers = {i: LayerKV(*(t[:, :, :4096].contiguous() for t in (l.keys, l.values, l.queries))) for i, l in cache.layers.items()}
    io.save(KVCache(cache.facts, layers, cache.token_ids[:, :4096].contiguous(), cache.info), small)
    res = runner.invoke(app, ["recommend", str(small), "--budget", "15%", "--no-model", "--device", "cuda", "--menu", "quant,bitmap,evict",
                              "-o", str(tmp_path / "plan.json"), "--json"])
    assert res.exit_code == 0, res.output[-2000:]
    assert json.loads(res.output)["budgets"]
