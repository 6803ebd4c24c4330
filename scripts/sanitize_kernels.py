"""Launch every kvtool kernel once at small odd shapes: what scripts/gpu_sanitize.sh runs under
compute-sanitizer (memcheck, racecheck, initcheck, synccheck). Each case checks its result against
the torch reference too, so a launch that the sanitizer passes but that computes garbage fails here.

  python3 scripts/sanitize_kernels.py            on CUDA: the CUDA extensions (bitmap attention, every
                                                 walk and staging; prune + encode) and the Triton kernels
  TRITON_INTERPRET=1 python3 scripts/sanitize_kernels.py --triton-only   the Triton cases on the CPU
                                                 (what CI checks: the calls and shapes stay valid)
  ... --list                                     the case names;  ... -k TEXT   the cases whose name holds TEXT
  ... --summarize OUT TOOL LOG DRIVER_OUTPUT     (gpu_sanitize.sh) one tool's reports, per kernel, into
                                                 OUT/sanitize-TOOL.txt and OUT/sanitize.json

Prints one line per case ("case NAME: ok" or "case NAME: FAILED: ...") and a closing count. Exit 1
when a case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.core.attention import attend_partial  # noqa: E402
from kvtool.core.cache import LayerKV  # noqa: E402
from kvtool.formats import get_format  # noqa: E402
from kvtool.formats.base import make_params  # noqa: E402

CUDA_KERNELS = ("bitmap_sparse_attention_kernel", "bitmap_sparse_attention_mma_kernel", "prune_encode_kernel", "kivi_decode_kernel",
                "kivi_decode_swapped_kernel")


def kvtool_kernel_names() -> list[str]:
    """Names of kvtool's device functions (a report in any of them is kvtool's): the CUDA kernels and
    every Triton jit function of kvtool.kernels and kvtool.formats (a Triton kernel's name is its
    function's)."""
    import importlib
    import pkgutil

    import triton

    import kvtool.formats
    import kvtool.kernels

    kinds = tuple(k for k in (getattr(triton.runtime, "JITFunction", None), getattr(getattr(triton.runtime, "interpreter", None), "InterpretedFunction", None)) if k)
    names = set(CUDA_KERNELS)
    for pkg in (kvtool.kernels, kvtool.formats):
        for info in pkgutil.iter_modules(pkg.__path__):
            try:
                mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            except Exception:  # a module with a missing optional dependency has no kernel to run here
                continue
            for obj in vars(mod).values():
                if isinstance(obj, kinds):
                    names.add(getattr(obj, "__name__", None) or obj.fn.__name__)
    return sorted(names)

CASES = {}


def case(name: str, cuda_only: bool = False):
    def mark(fn):
        CASES[name] = (fn, cuda_only)
        return fn
    return mark


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def expect(value: float, limit: float, what: str) -> None:
    if not value <= limit:
        raise AssertionError(f"{what}: relative error {value:.3g} > {limit:g}")


def rand(*shape, dtype, dev, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=dev, dtype=dtype)


# ---------------------------------------------------------------- CUDA extensions


def sparse_cache(dev, b, hkv, t, d, w, dtype=torch.float16, dense=False):
    from kvtool.kernels.bitmap_compress import random_pruned
    from kvtool.kernels.bitmap_sparse_attention import encode_cache_v2

    if dense:  # variable counts, 50-70% kept: the buffered walk and the paired values
        g = torch.Generator().manual_seed(7)
        keys = (torch.randn(b, hkv, t, d, generator=g) * (torch.rand(b, hkv, t, d, generator=g) < 0.7)).to(device=dev, dtype=dtype) + 0.0
        values = (torch.randn(b, hkv, t, d, generator=g) * (torch.rand(b, hkv, t, d, generator=g) < 0.5)).to(device=dev, dtype=dtype) + 0.0
    else:
        keys = random_pruned(b, hkv, t, d, 0.6, dtype=dtype, device=dev, seed=1, window=w)
        values = random_pruned(b, hkv, t, d, 0.6, dtype=dtype, device=dev, seed=2, window=w)
    return encode_cache_v2(keys, values, window=w, backend="triton")


def run_knobs(dev, cache, g, knob_sets, dtype=torch.float16, backend="cuda"):
    from kvtool.kernels.bitmap_sparse_attention import _tuned_attention, sparse_attention_reference

    bk = cache.keys
    q = (rand(bk.batch, bk.kv_heads * g, 1, bk.head_dim, dtype=torch.float32, dev=dev, seed=3) * 2).to(dtype)
    ref, _ = sparse_attention_reference(q, cache)
    for knobs in knob_sets:
        out, _ = _tuned_attention(q, cache, backend=backend, **knobs)
        expect(rel_l2(out, ref), 2e-2, f"{backend} {knobs}")


SCALAR = [dict(tensor_cores=False, paired=False), dict(tensor_cores=False, paired=True), dict(tensor_cores=False, accumulate="fp16"),
          dict(tensor_cores=False, half_tables=False), dict(tensor_cores=False, bits_global=True), dict(tensor_cores=False, rows_per_program=1),
          dict(tensor_cores=False, rows_per_program=2, num_splits=3), dict(tensor_cores=False, rows_per_program=4)]
MMA = [dict(tensor_cores=True, bulk_copies=False), dict(tensor_cores=True, bulk_copies=True, num_splits=3)]


@case("cuda bitmap attention d64 odd tail (the H200 hang shape)", cuda_only=True)
def _(dev):
    run_knobs(dev, sparse_cache(dev, 1, 1, 2049, 64, 130), 7, [dict(k, num_splits=5) for k in SCALAR[:3] + MMA])


@case("cuda bitmap attention d64 even tail, bulk", cuda_only=True)
def _(dev):
    run_knobs(dev, sparse_cache(dev, 2, 1, 2 * 64 * 5 + 2 + 65, 64, 65), 5, MMA)


@case("cuda bitmap attention d128 scalar walks", cuda_only=True)
def _(dev):
    run_knobs(dev, sparse_cache(dev, 1, 2, 333, 128, 7), 3, SCALAR)


@case("cuda bitmap attention d128 tensor cores, buffered", cuda_only=True)
def _(dev):
    run_knobs(dev, sparse_cache(dev, 2, 2, 257 + 40, 128, 40, dense=True), 12, MMA + [dict(tensor_cores=False)])


@case("cuda bitmap attention bf16 d128", cuda_only=True)
def _(dev):
    run_knobs(dev, sparse_cache(dev, 1, 1, 200, 128, 9, dtype=torch.bfloat16), 4, [SCALAR[0], SCALAR[1]] + MMA, dtype=torch.bfloat16)


@case("cuda bitmap attention d80 / d192 (two channels a thread)", cuda_only=True)
def _(dev):
    run_knobs(dev, sparse_cache(dev, 1, 3, 333, 80, 0), 5, [dict(num_splits=3), dict(accumulate="fp16")])
    run_knobs(dev, sparse_cache(dev, 3, 2, 77, 192, 11), 1, [dict(), dict(paired=True)])


@case("cuda bitmap attention growable, odd length in use", cuda_only=True)
def _(dev):
    from kvtool.kernels.bitmap_compress import encode, random_pruned
    from kvtool.kernels.bitmap_layout import append_blocks, growable_cache
    from kvtool.kernels.bitmap_sparse_attention import _tuned_attention, sparse_attention_reference

    b, hkv, d, tc, w = 2, 3, 64, 5 * 64, 9
    keys = random_pruned(b, hkv, tc + w, d, 0.6, dtype=torch.float16, device=dev, seed=3, window=w)
    values = random_pruned(b, hkv, tc + w, d, 0.6, dtype=torch.float16, device=dev, seed=4, window=w)
    keys[:, :, tc - 1] = 0
    values[:, :, tc - 1] = 0
    grow = growable_cache(b, hkv, d, capacity=tc + 128, window=w + 5, slot=64 * d, dtype=torch.float16, device=dev)
    append_blocks(grow, encode(keys[:, :, :tc].contiguous(), "values", "triton"), encode(values[:, :, :tc].contiguous(), "keys", "triton"))
    grow.window_keys[:, :, :w] = keys[:, :, tc:]
    grow.window_values[:, :, :w] = values[:, :, tc:]
    grow.lengths[1] = w
    grow.lengths[0] = tc - 1
    q = rand(b, hkv * 4, 1, d, dtype=torch.float16, dev=dev, seed=5)
    ref, _ = sparse_attention_reference(q, grow)
    for knobs in [dict(tensor_cores=False)] + MMA:
        out, _ = _tuned_attention(q, grow, backend="cuda", **knobs)
        expect(rel_l2(out, ref), 2e-2, f"growable {knobs}")


@case("cuda prune + encode", cuda_only=True)
def _(dev):
    from kvtool.kernels.bitmap_prune_encode import prune_encode, prune_encode_reference

    for d, kind, keep, dtype in ((64, "values", 19, torch.float16), (128, "keys", 40, torch.bfloat16), (256, "values", 77, torch.float16)):
        x = rand(2, 3, 131, d, dtype=dtype, dev=dev, seed=d)
        x[:, :, 5, : d - 3] = 0  # a token with fewer than keep non-zero elements: the compaction path
        got, ref = prune_encode(x, kind, keep, backend="cuda"), prune_encode_reference(x, kind, keep)
        if not (torch.equal(got.bitmaps, ref.bitmaps) and torch.equal(got.offsets, ref.offsets) and torch.equal(got.nz.view(torch.int16), ref.nz.view(torch.int16))):
            raise AssertionError(f"prune_encode d={d} {kind}: bytes differ from the reference")


# ---------------------------------------------------------------- Triton kernels


@case("triton bitmap attention v2 + merge")
def _(dev):
    run_knobs(dev, sparse_cache(dev, 1, 2, 199, 64, 5), 3, [dict(num_splits=2), dict(num_splits=1, rows_per_program=16)], backend="triton")


@case("triton bitmap encode + attention v1")
def _(dev):
    from kvtool.kernels.bitmap_attention import bitmap_decode_attention
    from kvtool.kernels.bitmap_compress import encode_cache, random_pruned

    keys = random_pruned(1, 2, 133, 64, 0.6, dtype=torch.float16, device=dev, seed=1, window=5)
    values = random_pruned(1, 2, 133, 64, 0.6, dtype=torch.float16, device=dev, seed=2, window=5)
    cache = encode_cache(keys, values, window=5, backend="triton")
    q = rand(1, 6, 1, 64, dtype=torch.float16, dev=dev, seed=3)
    out, _ = bitmap_decode_attention(q, cache, num_splits=2)
    expect(rel_l2(out, attend_partial(q, keys, values)[0]), 2e-2, "bitmap v1")


@case("triton bitmap spmv")
def _(dev):
    from kvtool.kernels.bitmap_compress import encode, random_pruned
    from kvtool.kernels.bitmap_spmv import bitmap_pv, bitmap_qk

    keys = random_pruned(1, 2, 77, 64, 0.6, device=dev, seed=4)
    values = random_pruned(1, 2, 77, 64, 0.6, device=dev, seed=5)
    q = rand(1, 6, 64, dtype=torch.float16, dev=dev, seed=6)
    p = torch.softmax(rand(1, 6, 77, dtype=torch.float32, dev=dev, seed=7), -1).half()
    s = bitmap_qk(q, encode(keys, "keys"))
    expect(rel_l2(s, torch.einsum("bhd,bhtd->bht", q.float(), keys.float().repeat_interleave(3, 1))), 2e-2, "bitmap_qk")
    o = bitmap_pv(p, encode(values, "values"), num_splits=2)
    expect(rel_l2(o, torch.einsum("bht,bhtd->bhd", p.float(), values.float().repeat_interleave(3, 1))), 2e-2, "bitmap_pv")


@case("triton selective heads")
def _(dev):
    from kvtool.kernels.heads import selective_head_attention, selective_head_attention_reference

    q, keys, values = rand(1, 8, 64, dtype=torch.float16, dev=dev, seed=1), rand(1, 1, 129, 64, dtype=torch.float16, dev=dev, seed=2), \
        rand(1, 1, 129, 64, dtype=torch.float16, dev=dev, seed=3)
    idx = torch.tensor([[0, 3, 5]], dtype=torch.int32, device=dev)
    out, _ = selective_head_attention(q, keys, values, idx, num_splits=3)
    expect(rel_l2(out, selective_head_attention_reference(q, keys, values, idx)[0]), 2e-2, "selective heads")


@case("triton signvq lut + decode")
def _(dev):
    from kvtool.formats.signvq import SignVQFormat, lut_scores, make_signvq_inputs, signvq_decode
    from kvtool.kernels.signvq_lut import lut_scores_kernel

    q, enc = make_signvq_inputs(1, 6, 2, 300, 64, dtype=torch.float16, device=dev, budget=64)
    codes, book, gqa = enc.tensors["index.codes"], enc.tensors["index.codebook"], enc.meta["gqa"]
    ref = lut_scores(q, codes, book, gqa)
    for lookup in ("table", "gather", "onehot"):
        expect(rel_l2(lut_scores_kernel(q, codes, book, gqa, lookup=lookup), ref), 2e-2, f"lut {lookup}")
    out, _ = signvq_decode(q, enc)
    expect(rel_l2(out, SignVQFormat().attend(q, enc)[0]), 2e-2, "signvq decode")


@case("triton pagestat (criticality, page selection, paged attention)")
def _(dev):
    from kvtool.formats.pagestat import make_pagestat_inputs, pagestat_decode, pagestat_decode_reference

    q, enc = make_pagestat_inputs(1, 6, 2, 300, 64, dtype=torch.float16, device=dev, page_size=8, budget=64, score="quest")
    out, _ = pagestat_decode(q, enc)
    expect(rel_l2(out, pagestat_decode_reference(q, enc)[0]), 2e-2, "pagestat")


@case("triton kivi")
def _(dev):
    from kvtool.kernels.kivi_attention import cache_from_encoded, kivi_attention

    fmt = get_format("quant")
    keys, values = rand(1, 2, 133, 64, dtype=torch.float16, dev=dev, seed=1), rand(1, 2, 133, 64, dtype=torch.float16, dev=dev, seed=2)
    enc = fmt.encode(LayerKV(keys, values), make_params(fmt, {"bits": "4", "group": "32", "residual": "7"}))
    q = rand(1, 6, 1, 64, dtype=torch.float16, dev=dev, seed=3)
    out = kivi_attention(q, cache_from_encoded(enc), backend="triton")[0] if dev == "cuda" else fmt.attend_kernel(q, enc)[0]
    expect(rel_l2(out, fmt.attend(q, enc)[0]), 2e-2, "kivi")


@case("triton kivi absorb (a live KIVI layer's growth: quantise a residual group, pack, move the residual down)")
def _(dev):
    from kvtool.formats import quant

    fmt = get_format("quant")
    keys, values = rand(1, 2, 200, 64, dtype=torch.float16, dev="cpu", seed=4), rand(1, 2, 200, 64, dtype=torch.float16, dev="cpu", seed=5)
    params = make_params(fmt, {"bits": "4", "group": "32", "residual": "16"})
    grown = {}
    for mode, where in (("never", "cpu"), ("always", dev)):  # the prompt of 40 tokens stays in the residual: every group is an absorb
        old, quant.ABSORB_KERNEL = quant.ABSORB_KERNEL, mode
        try:
            live = fmt.live_from_dense(LayerKV(keys[:, :, :40].to(where), values[:, :, :40].to(where)), params)
            for t in range(40, 200):
                live.append(keys[:, :, t:t + 1].to(where), values[:, :, t:t + 1].to(where))
            live.reserve(1)
            grown[mode] = {k: v.cpu() for k, v in live.encoded().tensors.items()}
        finally:
            quant.ABSORB_KERNEL = old
    for name, x in grown["always"].items():
        y = grown["never"][name]
        same = torch.equal(x, y) if not x.is_floating_point() else bool(((x == y) | (x.isnan() & y.isnan())).all())
        expect(0.0 if same else 1.0, 0.5, f"kivi absorb {name} equals the torch path's")


@case("cuda kivi (codes dequantised in the MMA fragments, both kernels: 2 / 4 / 8 bits, head_dim 64 / 128, aligned and file layouts)", cuda_only=True)
def _(dev):
    from kvtool.kernels.kivi_attention import cache_from_encoded, cuda_path, kivi_attention

    fmt = get_format("quant")
    # (KV heads, GQA group, tokens, head_dim, bits, group, residual): 777 tokens leave a file's rows 2-byte aligned
    for hkv, g, t, d, bits, group, residual in ((2, 4, 300, 128, 4, 32, 7), (1, 3, 777, 64, 2, 32, 9), (2, 16, 200, 64, 8, 16, 0),
                                                (1, 4, 400, 128, 4, 128, 0)):
        keys, values = rand(1, hkv, t, d, dtype=torch.float16, dev=dev, seed=1), rand(1, hkv, t, d, dtype=torch.float16, dev=dev, seed=2)
        enc = fmt.encode(LayerKV(keys, values), make_params(fmt, {"bits": str(bits), "group": str(group), "residual": str(residual)}))
        q = rand(1, hkv * g, 1, d, dtype=torch.float16, dev=dev, seed=3)
        cache = cache_from_encoded(enc)
        expect(0.0 if cuda_path(q, cache) is None else 1.0, 0.5, f"the cuda backend serves {bits}-bit head_dim {d}")
        for kernel in ("swapped", "rows16"):  # the swapped kernel serves at most 8 query rows, the 16-row one the rest
            os.environ["KVTOOL_KIVI_CUDA_KERNEL"] = kernel
            for splits in (None, 4, 12):
                expect(rel_l2(kivi_attention(q, cache, splits=splits, backend="cuda")[0], fmt.attend(q, enc)[0]), 2e-3, f"cuda kivi ({kernel})")
        os.environ.pop("KVTOOL_KIVI_CUDA_KERNEL")


# ---------------------------------------------------------------- compute-sanitizer's reports

PREFIX = "========= "
NOT_A_REPORT = ("ERROR SUMMARY", "COMPUTE-SANITIZER", "RACECHECK SUMMARY", "LEAK SUMMARY", "Target application", "This tool", "Program finished")


def parse_reports(text: str) -> tuple[list[dict], int | None]:
    """compute-sanitizer's log -> reports (first line, the device function it names, the lines) and
    the ERROR SUMMARY count, racecheck's RACECHECK SUMMARY hazards (None when the log has neither:
    the run did not finish)."""
    reports: list[dict] = []
    total = None
    for line in text.splitlines():
        if not line.startswith(PREFIX.rstrip()):
            continue
        body = line[len(PREFIX):] if line.startswith(PREFIX) else ""
        m = re.match(r"ERROR SUMMARY: (\d+) error", body) or re.match(r"RACECHECK SUMMARY: (\d+) hazards? displayed", body)
        if m:  # racecheck closes with its own summary (every hazard displayed, errors and warnings), no ERROR SUMMARY
            total = int(m.group(1)) + (total or 0)
            continue
        if body and not body[0].isspace() and not body.startswith(NOT_A_REPORT):
            reports.append({"what": body.strip(), "kernel": device_function(body, first=True), "lines": [body]})
        elif reports and body.strip():
            rep = reports[-1]
            if len(rep["lines"]) < 40:
                rep["lines"].append(body)
            if rep["kernel"] is None:
                rep["kernel"] = device_function(body)
    return reports, total


def device_function(line: str, first: bool = False) -> str | None:
    """The device function a report line names: ``at FUNC+0xOFF`` (memcheck's ``    at`` lines,
    racecheck's ``Race reported between Write access at FUNC+0x..``) or a ``in FILE:LINE:FUNC``
    location (racecheck's hazard lines); None when the line names none (a report's first line of
    memcheck / initcheck names its access, not its function)."""
    at = re.search(r"\bat (?!0x)(.+?)\+0x[0-9a-f]+", line)
    if at is None and not first:
        at = re.match(r"\s+at (?!0x)(.+?)( in |$)", line)
    if at:
        return at.group(1).strip()
    bare = re.match(r"\s+at 0x[0-9a-f]+ in (?![^\s:]+:\d+)(.+)$", line)  # no symbol offset: the function after "in"
    if bare and not first:
        return bare.group(1).strip()
    loc = re.search(r" in [^\s:]+:\d+:(\S.*?)(\s*\[\d+ hazards?\])?$", line)
    return loc.group(1).strip() if loc else None


def summarize(out: Path, tool: str, log: Path, driver: Path) -> dict:
    """One tool's summary file and its entry in OUT/sanitize.json (kept across the tools)."""
    names = kvtool_kernel_names()
    text = log.read_text(errors="replace") if log.exists() else ""
    drv = driver.read_text(errors="replace") if driver.exists() else ""
    reports, total = parse_reports(text)

    def ours(kernel: str | None) -> bool:
        return kernel is not None and any(re.search(rf"\b{re.escape(n)}\b", kernel) for n in names)

    per_kernel: dict[str, int] = {}
    for r in reports:
        key = r["kernel"] or "(no device function named)"
        per_kernel[key] = per_kernel.get(key, 0) + 1
    closing = re.findall(r"^(\d+) passed, (\d+) failed$", drv, re.M)
    entry = {"tool": tool, "finished": total is not None, "error_summary": total, "reports": len(reports),
             "kvtool_reports": sum(1 for r in reports if ours(r["kernel"])), "other_reports": sum(1 for r in reports if not ours(r["kernel"])),
             "per_kernel": per_kernel, "driver": {"passed": int(closing[-1][0]), "failed": int(closing[-1][1])} if closing else None}
    # clean: the run finished, every case passed and no report names a kvtool kernel (reports in torch's
    # own kernels are listed and counted apart: they are not kvtool's to fix)
    entry["clean"] = bool(entry["finished"] and entry["kvtool_reports"] == 0 and entry["driver"] and entry["driver"]["failed"] == 0)
    lines = [f"compute-sanitizer --tool {tool} over scripts/sanitize_kernels.py: "
             f"{'ERROR SUMMARY: %d errors' % total if total is not None else 'did not finish (timeout or crash: no ERROR SUMMARY)'}; "
             f"{entry['kvtool_reports']} reports in kvtool kernels, {entry['other_reports']} elsewhere; "
             f"driver: {entry['driver'] or 'no closing count'}; {'CLEAN' if entry['clean'] else 'NOT CLEAN'}", ""]
    lines += [f"{n:6d}  {k}" for k, n in sorted(per_kernel.items(), key=lambda kv: -kv[1])]
    for r in reports[:20]:
        lines += ["", *r["lines"]]
    lines += ["", "driver output (last 40 lines):", *drv.splitlines()[-40:]]
    (out / f"sanitize-{tool}.txt").write_text("\n".join(lines) + "\n")
    doc_path = out / "sanitize.json"
    doc = json.loads(doc_path.read_text()) if doc_path.exists() else {"tools": {}}
    doc["tools"][tool] = entry
    doc["clean"] = all(t["clean"] for t in doc["tools"].values())
    doc_path.write_text(json.dumps(doc, indent=1) + "\n")
    print(lines[0])
    return entry


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--summarize"]:
        out, tool, log, driver = argv[1:5]
        return 0 if summarize(Path(out), tool, Path(log), Path(driver))["clean"] else 1
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--triton-only", action="store_true", help="leave out the CUDA extensions (no CUDA here)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("-k", default="", help="only the cases whose name holds this text")
    args = ap.parse_args(argv)
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    dev = "cpu" if interp else "cuda"
    todo = {n: c for n, c in CASES.items() if args.k in n and not (c[1] and (args.triton_only or interp))}
    if args.list:
        print("\n".join(todo))
        return 0
    failed = 0
    for name, (fn, _) in todo.items():
        t0 = time.time()
        try:
            fn(dev)
            if dev == "cuda":
                torch.cuda.synchronize()
            print(f"case {name}: ok ({time.time() - t0:.1f} s)", flush=True)
        except Exception as exc:  # every case runs; the failures are listed
            failed += 1
            print(f"case {name}: FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
            traceback.print_exc()
    print(f"{len(todo) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
