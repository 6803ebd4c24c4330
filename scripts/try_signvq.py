"""GPU try-out: where the time of one ``signvq_decode`` step goes, and the launch settings of its
parts, at Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128, fp16, budget 2048).

For each (batch, tokens): checks ``signvq_decode`` against ``SignVQFormat.attend``, then times, as
CUDA-graph replays with L2 flushed (``kvtool.bench.Timer``): the whole step; the LUT scores; the
token selection by ``torch.topk`` and by the Triton radix select of the pages kernels
(``select_pages_triton``, no forced entries); the fused attention over the chosen tokens for several
(block_tokens, num_warps, splits). --json PATH writes the records; --tiny runs on the CPU interpreter.

    python scripts/try_signvq.py [--json out.json] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.formats.signvq import SignVQFormat, mask_kept, topk_indices  # noqa: E402
from kvtool.kernels import signvq_lut as S  # noqa: E402
from kvtool.kernels.pages import combine_splits, select_pages_triton  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    dev = "cpu" if a.tiny else "cuda"
    h, hkv, d = (8, 2, 64) if a.tiny else (32, 8, 128)
    configs = [(1, 300, 64)] if a.tiny else [(1, 32768, 2048), (8, 32768, 2048), (8, 4096, 2048)]
    timer = None
    if not a.tiny:
        from kvtool.bench import Timer, detect_env

        timer = Timer(detect_env(measure_copy=False), cuda_graph=True)
        print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")

    def us(fn):
        if timer is None:
            fn()
            return float("nan")
        return timer.time(fn).median_us

    recs = []
    for b, t, budget in configs:
        q, enc = S.make_signvq_inputs(b, h, hkv, t, d, device=dev, budget=budget)
        tens, m = enc.tensors, enc.meta
        out, lse = S.signvq_decode(q, enc)
        ref, ref_lse = SignVQFormat().attend(q, enc)
        rel = float((out - ref).norm() / ref.norm())
        cfg = f"b{b} T{t} budget{budget}"
        print(f"{cfg}: decode rel err {rel:.2e}, max|dlse| {float((lse - ref_lse).abs().max()):.2e}")
        scores = S.lut_scores_kernel(q, tens["index.codes"], tens["index.codebook"], m["gqa"])
        masked = mask_kept(scores, enc)
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        k = m["select"]
        got = select_pages_triton(masked, none, k).sort(-1).values
        want = topk_indices(masked, k).sort(-1).values.to(torch.int32)
        print(f"  radix select == torch.topk set: {bool((got == want).all())}")
        idx = topk_indices(masked, k).to(torch.int32)
        parts = {
            "decode": lambda: S.signvq_decode(q, enc),
            "lut_scores": lambda: S.lut_scores_kernel(q, tens["index.codes"], tens["index.codebook"], m["gqa"]),
            "topk_torch": lambda: topk_indices(masked, k),
            "mask_kept+topk": lambda: topk_indices(mask_kept(scores, enc), k),
        }
        for bt, nw, sp, mr in ((16, 4, None, None), (16, 4, 2, None), (16, 4, None, 128), (16, 4, None, 96), (16, 4, 2, 128),
                               (32, 4, None, 128), (32, 8, None, 128), (16, 8, None, 96)):
            splits = None if sp is None else sp * S.num_splits(b * hkv, -(-k // bt), q.device)
            def att(bt=bt, nw=nw, splits=splits, mr=mr):
                o, s_ = S._signvq_partials(q, enc, idx, None, splits, True, bt, nw, maxnreg=mr)
                return combine_splits(o, s_, h, d)
            o, _ = att()
            err = float((o - ref).norm() / ref.norm())
            parts[f"attention_bt{bt}_w{nw}_splits{splits}_r{mr} (rel {err:.1e})"] = att
        for name, fn in parts.items():
            try:
                t_us = us(fn)
                print(f"  {name:40s} {t_us:9.1f} us")
                recs.append(dict(config=cfg, part=name, median_us=t_us))
            except Exception as exc:  # one failing part must not hide the others
                print(f"  {name:40s} FAILED {type(exc).__name__}: {str(exc)[:200]}")
    if a.json:
        Path(a.json).write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
