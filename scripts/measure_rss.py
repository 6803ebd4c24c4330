"""Peak RSS of `kvtool compress` and `kvtool verify` against capture size (docs/formats.md, Memory).

Synthesises captures of the embedded model's shape (SmolLM2-135M: 9 query heads, 3 KV heads,
head_dim 64, bfloat16) for layers 0-3 with keys, values and queries, at each token count; then
runs each command in a fresh process under /usr/bin/time and prints a Markdown table.

    PYTHONPATH=$PWD python scripts/measure_rss.py [--kvtool-root DIR] [--tokens 4096,16384,...]

--kvtool-root runs another checkout's kvtool package (e.g. an export of main) for a before/after
comparison; the captures are always written by this checkout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kvtool.core import io
from kvtool.core.cache import KVCache, LayerKV, ModelFacts

LAYERS = 4


def synth_capture(path: Path, tokens: int) -> None:
    facts = ModelFacts(name="synthetic", architecture="LlamaForCausalLM", num_layers=30, num_heads=9, num_kv_heads=3,
                       head_dim=64, hidden_size=576, rope_theta=100000.0, dtype="bfloat16", source="synthetic")
    g = torch.Generator().manual_seed(tokens)
    layers = {}
    for i in range(LAYERS):
        k = torch.randn(1, 3, tokens, 64, generator=g).to(torch.bfloat16)
        v = torch.randn(1, 3, tokens, 64, generator=g).to(torch.bfloat16)
        q = torch.randn(1, 9, tokens, 64, generator=g).to(torch.bfloat16)
        layers[i] = LayerKV(k, v, q)
    ids = torch.randint(0, 49152, (1, tokens), generator=g)
    io.save(KVCache(facts, layers, ids, {}), path, force=True)


def peak_rss_mb(root: str, args: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=root)
    # cwd = root too: `python -m` puts the working folder ahead of PYTHONPATH
    res = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "kvtool", *args], env=env, cwd=root, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"kvtool {' '.join(args)} failed: {res.stderr.strip().splitlines()[-2:]}")
    return int(res.stderr.strip().splitlines()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvtool-root", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--tokens", default="4096,16384,65536,196608")
    ap.add_argument("--format", default="quant")
    ap.add_argument("--workdir", default=None)
    opts = ap.parse_args()
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="kvtool-rss-"))
    print(f"| tokens | capture MB | compress peak RSS MB | verify peak RSS MB |")
    print("|---:|---:|---:|---:|")
    for t in (int(x) for x in opts.tokens.split(",")):
        cap = work / f"cap{t}.safetensors"
        if not cap.exists():
            synth_capture(cap, t)
        out = work / f"cap{t}.{opts.format}.safetensors"
        comp = peak_rss_mb(opts.kvtool_root, ["compress", str(cap), "--format", opts.format, "-o", str(out), "--force", "--json"])
        ver = peak_rss_mb(opts.kvtool_root, ["verify", str(out), "--capture", str(cap), "--no-model", "--backend", "torch", "--json"])
        print(f"| {t} | {cap.stat().st_size / 2**20:.0f} | {comp:.0f} | {ver:.0f} |", flush=True)
        out.unlink()


if __name__ == "__main__":
    main()
