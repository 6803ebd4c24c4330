"""Check a capture made over several GPUs against a single-device run of the same layers.

The capture names its model (``random:SHAPE``, seeded per parameter) and where each layer ran
(``info.layer_devices``, e.g. ``cuda:0 0-39; cuda:1 40-79``). This builds the first ``n`` layers of
the same model on one device, where ``n`` reaches one layer past the first device boundary,
captures the same token ids with the same chunking, and compares two 2-layer slices: layers 0-1
and the two layers on either side of the boundary (the second one ran on another GPU in the
split run). Prints one JSON line: per layer and part, whether the tensors are equal and the
largest absolute difference.

    python scripts/multi_gpu_check.py cap70b.safetensors --device cuda:0
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def boundary(layer_devices: str | None) -> int | None:
    """The first layer on the second device of ``"cuda:0 0-39; cuda:1 40-79"``, or None."""
    if not layer_devices:
        return None
    from kvtool.core.cache import parse_indices

    blocks = [part.strip().split(" ", 1) for part in layer_devices.split(";") if part.strip()]
    return min(parse_indices(blocks[1][1], 1 << 20)) if len(blocks) > 1 else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("capture")
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    from kvtool.core.streaming import open_capture
    from kvtool.hf.capture import capture
    from kvtool.hf.shapes import build_model

    cap = open_capture(args.capture, parts=("keys", "values", "queries"))
    info = cap.info
    spec = info.get("model_path", "")
    if not spec.startswith("random:"):
        print(json.dumps({"error": f"the capture's model is {spec!r}, not random:SHAPE"}))
        return 1
    b = boundary(info.get("layer_devices"))
    n = (b + 1) if b is not None else 2
    layers = sorted({0, 1, n - 2, n - 1})
    t0 = time.perf_counter()
    model = build_model(spec, layers=n, device=args.device)
    ref = capture(model=(model, None), input_ids=cap.token_ids, layers=layers, chunk_size=info.get("chunk_size"))
    seconds = time.perf_counter() - t0
    rows = {}
    equal = True
    for i in layers:
        got = cap.layers[i]
        row = {}
        for part in ("keys", "values", "queries"):
            a, r = getattr(got, part), getattr(ref.layers[i], part)
            same = a is not None and r is not None and a.shape == r.shape and torch.equal(a, r)
            diff = float((a.float() - r.float()).abs().max()) if a is not None and r is not None and a.shape == r.shape else None
            row[part] = {"equal": same, "max_abs_diff": diff}
            equal = equal and same
        rows[str(i)] = row
    out = {"capture": args.capture, "model": spec, "boundary_layer": b, "reference_layers": n, "reference_device": args.device,
           "compared_layers": layers, "all_equal": equal, "layers": rows, "reference_seconds": round(seconds, 2),
           "split_layer_devices": info.get("layer_devices")}
    print(json.dumps(out))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
