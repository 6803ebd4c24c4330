"""Streaming capture of a Llama-3-8B-shaped model with random weights, for docs/scale.md.

Builds the model on the GPU with :func:`kvtool.hf.shapes.build_model` (shape ``llama3-8b``: hidden 4096,
32 heads, 8 KV heads, head_dim 128, intermediate 14336, 32 layers, bf16, seeded random weights), captures random token ids with
:func:`kvtool.hf.capture.capture_to_file` (chunked prefill, every layer streamed to disk) and prints
one JSON line: tokens, seconds, tokens/s, bytes written, bytes/s and the process's peak host RSS.

    python scripts/scale_llama8b.py --tokens 131072 --chunk-size 8192 --query-layers 31 -o /tmp/cap.safetensors

``--small`` uses the ``tiny`` shape (hidden 64, float32) to try the script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--chunk-size", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=None, help="only the first N layers (default: all of the shape)")
    ap.add_argument("--query-layers", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    from kvtool.hf.capture import capture_to_file
    from kvtool.hf.shapes import build_model

    t0 = time.perf_counter()
    model = build_model("tiny" if args.small else "llama3-8b", device=args.device, layers=args.layers)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t1 = time.perf_counter()
    path, summary = capture_to_file(args.output, model=(model, None), input_ids=ids, chunk_size=args.chunk_size,
                                    query_layers=args.query_layers, force=True)
    seconds = time.perf_counter() - t1
    size = path.stat().st_size
    result = {
        "tokens": args.tokens,
        "layers": len(summary["layers"]),
        "query_layers": summary["query_layers"],
        "chunk_size": args.chunk_size,
        "dtype": summary["facts"].dtype,
        "model_build_seconds": round(build_s, 2),
        "capture_seconds": round(seconds, 2),
        "tokens_per_second": round(args.tokens / seconds, 1),
        "bytes_written": size,
        "bytes_per_second": round(size / seconds),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_capture_bytes": rss_before,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else None,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
