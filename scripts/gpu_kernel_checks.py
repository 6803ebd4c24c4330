"""The kernels against their torch references on CUDA tensors, at real and at awkward shapes.

The CI tests run every kernel under TRITON_INTERPRET=1 on small CPU tensors; this script runs the
same comparisons compiled for the GPU: odd token counts, partial and empty blocks, GQA groups 1, 3,
4, 8, sparsity 0 and 0.99, fp16 and bf16, up to Llama-3-8B shapes. Prints one line per case
(relative L2 error of the output, and the largest lse difference) and exits 1 if any case fails.

    python scripts/gpu_kernel_checks.py            # on a machine with a CUDA GPU, from the repo root
    python scripts/gpu_kernel_checks.py signvq     # only some groups: bitmap heads signvq pages
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.attention import attend_partial  # noqa: E402

FAILED: list[str] = []
TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


def report(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, lse=None, ref_lse=None, rows=None) -> None:
    if rows is not None:
        out, ref = out[rows], ref[rows]
        if lse is not None:
            lse, ref_lse = lse[rows], ref_lse[rows]
    rel = float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    dl = 0.0
    if lse is not None:
        fin = torch.isfinite(ref_lse)
        dl = float((lse[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
        if not torch.equal(torch.isfinite(lse), fin):
            dl = float("inf")
    ok = rel <= TOL[dtype] and dl <= 2e-2 and bool(torch.isfinite(out).all())
    print(f"{'ok  ' if ok else 'FAIL'} {name}: rel {rel:.2e}  max|dlse| {dl:.2e}")
    if not ok:
        FAILED.append(name)


def case(fn):
    def run(*args):
        name = f"{fn.__name__}{args}"
        try:
            fn(*args)
        except Exception as exc:  # a crash is a failure; keep going
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=3)
            FAILED.append(name)
    return run


def rand(*shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


@case
def bitmap(b, hkv, g, t, d, sp, window, dtype, module, fn_name, opts=None):
    comp = __import__("kvtool.kernels.bitmap_compress", fromlist=["x"])
    mod = __import__(f"kvtool.kernels.{module}", fromlist=["x"])
    keys = comp.random_pruned(b, hkv, t, d, sp, dtype=dtype, device="cuda", seed=1, window=window)
    values = comp.random_pruned(b, hkv, t, d, sp, dtype=dtype, device="cuda", seed=2, window=window)
    cache = comp.encode_cache(keys, values, window=window, backend="triton")
    ref_cache = comp.encode_cache(keys, values, window=window, backend="torch")
    for part in ("keys", "values"):
        a, r = getattr(cache, part), getattr(ref_cache, part)
        if not (torch.equal(a.nz.view(torch.int16), r.nz.view(torch.int16)) and torch.equal(a.bitmaps, r.bitmaps) and torch.equal(a.offsets, r.offsets)):
            print(f"FAIL bitmap encode {part} {(b, hkv, t, d, sp, dtype)}: Triton bytes differ from torch bytes")
            FAILED.append(f"encode {part}")
    q = rand(b, hkv * g, 1, d, dtype=dtype, seed=3)
    out, lse = getattr(mod, fn_name)(q, cache, **(opts or {}))
    ref_out, ref_lse = attend_partial(q, keys, values)
    report(f"{module}.{fn_name}{opts or ''} b{b} hkv{hkv} g{g} t{t} d{d} sp{sp} w{window} {dtype}", out, ref_out, dtype, lse, ref_lse)


@case
def heads(b, hkv, g, n, d, k, dtype):
    from kvtool.kernels.heads import selective_head_attention, selective_head_attention_reference

    h = hkv * g
    q, keys, values = rand(b, h, d, dtype=dtype, seed=1), rand(b, hkv, n, d, dtype=dtype, seed=2), rand(b, hkv, n, d, dtype=dtype, seed=3)
    idx = torch.stack([torch.randperm(h, device="cuda")[:k] for _ in range(b)]).int()
    out, lse = selective_head_attention(q, keys, values, idx)
    ref, ref_lse = selective_head_attention_reference(q, keys, values, idx)
    report(f"heads b{b} hkv{hkv} g{g} n{n} d{d} k{k} {dtype}", out, ref, dtype, lse, ref_lse)


@case
def signvq(b, hkv, g, t, d, budget, dtype):
    from kvtool.formats.signvq import SignVQFormat, lut_scores
    from kvtool.kernels.signvq_lut import lut_scores_kernel, make_signvq_inputs, signvq_decode

    q, enc = make_signvq_inputs(b, hkv * g, hkv, t, d, dtype=dtype, device="cuda", budget=budget)
    codes, book, gqa = enc.tensors["index.codes"], enc.tensors["index.codebook"], enc.meta["gqa"]
    ref_scores = lut_scores(q, codes, book, gqa)
    report(f"lut_scores b{b} hkv{hkv} g{g} t{t} d{d} {dtype}", lut_scores_kernel(q, codes, book, gqa), ref_scores, dtype)
    for lookup in ("gather", "onehot"):
        report(f"lut_scores {lookup} b{b} hkv{hkv} g{g} t{t} d{d} {dtype}", lut_scores_kernel(q, codes, book, gqa, lookup=lookup), ref_scores, dtype)
    report(f"lut_scores max b{b} hkv{hkv} g{g} t{t} d{d} {dtype}", lut_scores_kernel(q, codes, book, "max"), lut_scores(q, codes, book, "max"), dtype)
    out, lse = signvq_decode(q, enc)
    ref, ref_lse = SignVQFormat().attend(q, enc)
    report(f"signvq_decode b{b} hkv{hkv} g{g} t{t} d{d} budget{budget} {dtype}", out, ref, dtype, lse, ref_lse)


@case
def pages(b, hkv, g, t, d, budget, page, dtype, score):
    from kvtool.kernels.pages import make_pagestat_inputs, pagestat_decode, pagestat_decode_reference

    q, enc = make_pagestat_inputs(b, hkv * g, hkv, t, d, dtype=dtype, device="cuda", page_size=page, budget=budget, score=score)
    out, lse = pagestat_decode(q, enc)
    ref, ref_lse = pagestat_decode_reference(q, enc)
    report(f"pagestat_decode b{b} hkv{hkv} g{g} t{t} d{d} budget{budget} page{page} {score} {dtype}", out, ref, dtype, lse, ref_lse)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this script checks the compiled kernels on a GPU")
        return 2
    groups = set(sys.argv[1:]) or {"bitmap", "heads", "signvq", "pages"}
    f16, bf16 = torch.float16, torch.bfloat16
    bitmap_kernels = [("bitmap_attention", "bitmap_decode_attention", None),
                      ("bitmap_attention", "bitmap_decode_attention", {"expansion": "popc", "maxnreg": None})]
    for module, fn_name, opts in bitmap_kernels if "bitmap" in groups else []:
        for args in [(1, 8, 4, 32768, 128, 0.7, 32, f16), (8, 8, 4, 4096, 128, 0.5, 32, f16), (2, 3, 3, 1000, 64, 0.0, 7, f16),
                     (1, 2, 8, 777, 96, 0.99, 0, bf16), (3, 1, 1, 130, 128, 0.7, 64, bf16), (1, 4, 4, 40, 64, 0.5, 40, f16),
                     (2, 2, 4, 300, 80, 0.6, 3, f16), (1, 2, 2, 200, 32, 0.3, 0, bf16)]:
            bitmap(*args, module, fn_name, opts)
    for args in [(8, 8, 4, 32768, 128, 16, f16), (1, 8, 4, 4097, 128, 3, bf16), (3, 3, 3, 1000, 64, 9, f16), (2, 2, 1, 77, 128, 1, f16), (1, 1, 8, 129, 64, 8, bf16)] if "heads" in groups else []:
        heads(*args)
    for args in [(8, 8, 4, 32768, 128, 2048, f16), (1, 3, 3, 1000, 64, 100, bf16), (2, 2, 1, 4097, 128, 512, f16), (1, 1, 8, 300, 128, 64, f16)] if "signvq" in groups else []:
        signvq(*args)
    for args in [(2, 8, 4, 131072, 128, 2048, 16, f16, "unique"), (1, 3, 3, 1000, 64, 100, 5, bf16, "quest"), (2, 2, 1, 4097, 128, 512, 16, f16, "mean"),
                 (1, 1, 8, 300, 128, 64, 8, bf16, "unique")] if "pages" in groups else []:
        pages(*args)
    print(f"{len(FAILED)} failed" + (": " + "; ".join(FAILED) if FAILED else ""))
    return 1 if FAILED else 0


if __name__ == "__main__":
    raise SystemExit(main())
