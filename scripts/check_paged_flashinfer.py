#!/usr/bin/env python3
"""Check that FlashInfer's batched paged decode reads kvtool's paged export as intended.

Runs ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` on the pages and page table of a file written by
``kvtool export FILE --to paged`` (or on synthetic pages made with the same code when no file is
given) for one decode query per sequence, and compares its output with plain dense attention over
the same sequences read back through the page table, in float32. Prints one line per layer with
the max absolute and relative error and exits 1 if any error exceeds --tol.

Needs a CUDA GPU with torch and flashinfer; run from the repository root (kvtool is imported from
here, no install needed):

    kvtool export cap.safetensors --to paged --page-size 16 -o cap.paged.safetensors
    python scripts/check_paged_flashinfer.py cap.paged.safetensors
    python scripts/check_paged_flashinfer.py            # synthetic: 4 sequences of 37..1000 tokens
    python scripts/check_paged_flashinfer.py --layout HND --page-size 1 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.cache import KVCache, LayerKV, ModelFacts  # noqa: E402
from kvtool.paged import PagedKV, from_paged, load_paged, to_paged  # noqa: E402


def synthetic(args: argparse.Namespace) -> PagedKV:
    """Paged KV of ``--lengths`` sequences (left-padded batch), made with kvtool's own pager."""
    lens = [int(x) for x in args.lengths.split(",")]
    b, t = len(lens), max(lens)
    g = torch.Generator().manual_seed(0)
    facts = ModelFacts(name="synthetic", architecture="synthetic", num_layers=1, num_heads=args.heads, num_kv_heads=args.kv_heads,
                       head_dim=args.head_dim, hidden_size=args.heads * args.head_dim, rope_theta=None, dtype="float16")
    keys = torch.randn(b, args.kv_heads, t, args.head_dim, generator=g).half()
    values = torch.randn(b, args.kv_heads, t, args.head_dim, generator=g).half()
    mask = torch.tensor([[0] * (t - n) + [1] * n for n in lens])
    cache = KVCache(facts, {0: LayerKV(keys, values)}, torch.zeros(b, t, dtype=torch.int64), {}, mask)
    return to_paged(cache, args.page_size, args.layout)


def dense_reference(q: torch.Tensor, seqs: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """q ``[B, H, D]``; seqs[b] = keys/values ``[Hkv, L_b, D]``. Output ``[B, H, D]`` float32."""
    outs = []
    for b, (k, v) in enumerate(seqs):
        group = q.shape[1] // k.shape[0]
        kf = k.float().repeat_interleave(group, 0)  # [H, L, D]: query head h reads KV head h // group
        vf = v.float().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hld->hl", q[b].float(), kf) * scale
        outs.append(torch.einsum("hl,hld->hd", torch.softmax(scores, -1), vf))
    return torch.stack(outs)


def flashinfer_decode(paged: PagedKV, q: torch.Tensor, layer: int, dtype: torch.dtype, tensor_cores: bool) -> torch.Tensor:
    import flashinfer

    dev = q.device
    f = paged.facts
    workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, paged.layout, use_tensor_cores=tensor_cores)
    table = (paged.kv_indptr.to(dev), paged.kv_indices.to(dev), paged.kv_last_page_len.to(dev))
    shape = (f.num_heads, f.num_kv_heads, f.head_dim, paged.page_size)
    if hasattr(wrapper, "plan"):
        try:
            wrapper.plan(*table, *shape, pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype)
        except TypeError:
            wrapper.plan(*table, *shape, pos_encoding_mode="NONE", data_type=dtype)
        run = wrapper.run
    else:  # flashinfer < 0.2
        wrapper.begin_forward(*table, *shape, data_type=dtype)  # no positional encoding by default
        run = wrapper.forward
    kv = (paged.k_pages[layer].to(dev, dtype), paged.v_pages[layer].to(dev, dtype))
    return run(q.to(dtype), kv).float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", help="a kvtool paged file (kvtool export --to paged); synthetic pages if omitted")
    ap.add_argument("--layers", default=None, help="layers to check, e.g. 0,7 (default: all in the file)")
    ap.add_argument("--page-size", type=int, default=16, help="synthetic only")
    ap.add_argument("--layout", default="NHD", help="synthetic only: NHD or HND")
    ap.add_argument("--lengths", default="37,128,511,1000", help="synthetic only: sequence lengths")
    ap.add_argument("--heads", type=int, default=32, help="synthetic only")
    ap.add_argument("--kv-heads", type=int, default=8, help="synthetic only")
    ap.add_argument("--head-dim", type=int, default=128, help="synthetic only")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--tensor-cores", action="store_true", help="use FlashInfer's tensor-core decode (prefill kernels)")
    ap.add_argument("--tol", type=float, default=2e-2, help="max absolute error allowed")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device; FlashInfer needs one", file=sys.stderr)
        return 2
    try:
        import flashinfer
    except ImportError:
        print("error: flashinfer is not installed (pip install flashinfer-python)", file=sys.stderr)
        return 2
    paged = load_paged(args.file) if args.file else synthetic(args)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else paged.layer_indices
    dtype = getattr(torch, args.dtype)
    f = paged.facts
    batch = int(paged.seq_lens.numel())
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, f.num_heads, f.head_dim, generator=g).to(dtype).cuda()
    scale = 1.0 / math.sqrt(f.head_dim)
    seqs = from_paged(paged)
    rows = []
    for i in layers:
        used_tc = args.tensor_cores
        try:
            out = flashinfer_decode(paged, q, i, dtype, used_tc)
        except Exception as exc:  # e.g. a GQA group size the CUDA-core decode kernels were not built for
            if used_tc:
                raise
            print(f"note: layer {i}: CUDA-core decode failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); retrying with tensor cores", file=sys.stderr)
            used_tc = True
            out = flashinfer_decode(paged, q, i, dtype, used_tc)
        ref = dense_reference(q.float().cpu(), [(k.to(dtype).float(), v.to(dtype).float()) for k, v in seqs[i]], scale)
        err = (out.cpu() - ref).abs()
        rows.append({"layer": i, "max_abs_err": err.max().item(), "max_rel_err": (err.max() / ref.abs().max()).item(), "tensor_cores": used_tc})
    result = {
        "file": args.file or "synthetic",
        "flashinfer": getattr(flashinfer, "__version__", "?"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "layout": paged.layout,
        "page_size": paged.page_size,
        "seq_lens": paged.seq_lens.tolist(),
        "heads": f.num_heads,
        "kv_heads": f.num_kv_heads,
        "head_dim": f.head_dim,
        "dtype": args.dtype,
        "layers": rows,
        "max_abs_err": max(r["max_abs_err"] for r in rows),
        "tol": args.tol,
    }
    result["ok"] = result["max_abs_err"] <= args.tol
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['device']}, flashinfer {result['flashinfer']}, {paged.layout} pages of {paged.page_size}, sequences {result['seq_lens']}, "
              f"{f.num_heads} heads / {f.num_kv_heads} KV heads, head_dim {f.head_dim}, {args.dtype}")
        for r in rows:
            print(f"layer {r['layer']}: max |flashinfer - dense| = {r['max_abs_err']:.3e} (relative {r['max_rel_err']:.3e}){' [tensor cores]' if r['tensor_cores'] else ''}")
        print(("OK" if result["ok"] else "FAIL") + f": max abs error {result['max_abs_err']:.3e} (tolerance {args.tol})")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
