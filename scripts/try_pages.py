"""GPU check and timing of the pagestat decode step: old (torch top-k + torch split merge) against
new (Triton page selection + Triton split merge), each piece alone, eager and under a CUDA graph.

Llama-3-8B shapes (32 q heads, 8 KV heads, head_dim 128, fp16), 131072 tokens, pages of 16,
budget 2048 tokens; batch 1 and 8 with the UNIQUE score, Quest at batch 8. Checks every variant
against ``pagestat_decode_reference`` (and the Triton page sets against torch.topk's), then times
with ``triton.testing.do_bench(fn, warmup=25, rep=100)``; one line per configuration and variant
(median µs, GB/s, fraction of the measured copy bandwidth). Also sweeps the selection kernel's
num_warps and the paged-attention splits.

    python scripts/try_pages.py [--json PATH]          # from the repo root, on a CUDA machine
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.formats.base import Encoded  # noqa: E402
from kvtool.kernels import pages as P  # noqa: E402

RECORDS: list[dict] = []
FAILED: list[str] = []
COPY_GBS = 0.0


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1000.0


def graphed(fn):
    """Capture fn in a CUDA graph (after a warm-up on a side stream); return the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def timed(cfg: str, name: str, fn, nbytes: int, graph: bool = True) -> None:
    for mode in (("eager", "graph") if graph else ("eager",)):
        label = f"{name}[{mode}]"
        try:
            f = graphed(fn) if mode == "graph" else fn
            us = bench(f)
            gbs = nbytes / (us * 1e-6) / 1e9
            print(f"{cfg:28s} {label:34s} {us:9.1f} us {gbs:8.1f} GB/s {gbs / COPY_GBS:6.3f} of copy")
            RECORDS.append({"config": cfg, "variant": name, "mode": mode, "us": us, "bytes": nbytes, "gbs": gbs, "copy_frac": gbs / COPY_GBS})
        except Exception as exc:
            print(f"{cfg:28s} {label:34s} FAILED: {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=2)
            FAILED.append(f"{cfg} {label}")


def check(cfg: str, name: str, fn) -> None:
    try:
        fn()
        print(f"ok   {cfg} {name}")
    except Exception as exc:
        print(f"FAIL {cfg} {name}: {type(exc).__name__}: {exc}")
        FAILED.append(f"{cfg} check {name}")


def close(o, l, ro, rl) -> None:
    rel = float((o.double() - ro.double()).norm() / ro.double().norm().clamp_min(1e-30))
    fin = torch.isfinite(rl)
    dl = float((l[fin] - rl[fin]).abs().max()) if fin.any() else 0.0
    if rel > 1e-2 or dl > 2e-2 or not torch.equal(torch.isfinite(l), fin):
        raise AssertionError(f"rel {rel:.2e} max|dlse| {dl:.2e}")
    print(f"     rel {rel:.2e} max|dlse| {dl:.2e}")


def copy_bandwidth() -> float:
    src = torch.empty(512 * 1024 * 1024, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * 1024**3 / (us * 1e-6) / 1e9


def old_step(q, enc, stats, forced):
    """The previous decode step: criticality, torch index_fill + topk + cat, int32 cast, paged
    attention with the torch split merge."""
    m = enc.meta
    crit = P.page_criticality(q, stats, m["score"], m["lam"])
    pages = P.select_pages_device(crit, forced, m["select"]).to(torch.int32)
    return P.paged_attention(q, enc.tensors["keys"], enc.tensors["values"], pages, m["page_size"], check=False, merge="torch")


def edge_checks() -> None:
    """Selection and merge at awkward shapes on CUDA (GPU-only integer specialisation of 1s)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    for npages, forced, k, block in ((37, [0], 1, 8192), (37, [0, 36], 0, 8192), (37, [0, 36], 35, 8192), (20000, [0, 19999], 128, 8192),
                                     (8192, [0, 8191], 128, 2048), (1, [0], 0, 8192)):
        name = f"select NP={npages} forced={forced} k={k} block={block}"

        def one():
            sc = torch.randint(0, 50, (2, 3, 1, npages), generator=gen, device="cuda").float()  # many ties
            sc[0, 0, 0, -1] = float("-inf")
            sc[1, 2, 0, 0] = float("nan")
            f = torch.tensor(forced, device="cuda")
            got = P.select_pages_triton(sc, f, k, block=block)
            if not torch.equal(got, P.select_pages_triton_reference(sc, f, k)):
                raise AssertionError("differs from select_pages_triton_reference")

        check("edge", name, one)
    for s, tq in ((1, 1), (3, 2)):
        def merge():
            part = torch.randn(2, 8, tq, s, 16, 128, generator=gen, device="cuda")
            lse = torch.randn(2, 8, tq, s, 16, generator=gen, device="cuda")
            lse[0, 0, 0, 0] = float("-inf")
            o, l = P.combine_splits(part, lse, 32, 128)
            ro, rl = P.merge_splits(part, lse, 32)
            close(o, l, ro, rl)

        check("edge", f"combine_splits S={s} Tq={tq}", merge)


def run_config(batch: int, score: str, tokens: int = 131072, budget: int = 2048) -> None:
    cfg = f"b{batch} T{tokens} {score} bud{budget}"
    q, enc = P.make_pagestat_inputs(batch=batch, tokens=tokens, budget=budget, score=score, device="cuda")
    m = enc.meta
    stats = {n.split(".", 1)[1]: x for n, x in enc.tensors.items() if n.startswith("stats.")}
    keys, values = enc.tensors["keys"], enc.tensors["values"]
    forced = P.forced_index(m["forced_pages"], q.device)
    k = m["select"]
    crit = P.page_criticality(q, stats, m["score"], m["lam"])
    pages = P.select_pages_triton(crit, forced, k)
    ref = {}

    def chk_ref():
        # one batch row at a time: the dense masked reference expands keys/values to all heads in fp32
        parts = [P.pagestat_decode_reference(q[i:i + 1], Encoded({n: t[i:i + 1] for n, t in enc.tensors.items()}, m)) for i in range(batch)]
        ref["o"] = torch.cat([o for o, _ in parts])
        ref["l"] = torch.cat([l for _, l in parts])

    check(cfg, "reference", chk_ref)

    def chk_select():
        torch_pages = P.select_pages_device(crit, forced, k)
        a = pages.long().sort(-1).values
        b = torch_pages.sort(-1).values
        same = (a == b).all(-1)
        if not bool(same.all()):
            raise AssertionError(f"{int((~same).sum())} rows differ from torch.topk's set")
        want = P.select_pages_triton_reference(crit, forced, k)
        if not torch.equal(pages, want):
            raise AssertionError("differs from select_pages_triton_reference")

    check(cfg, "select_pages_triton vs torch.topk", chk_select)
    if ref:
        check(cfg, "new step vs reference", lambda: close(*P.pagestat_decode(q, enc), ref["o"], ref["l"]))
        check(cfg, "old step vs reference", lambda: close(*old_step(q, enc, stats, forced), ref["o"], ref["l"]))
    ref.clear()
    torch.cuda.empty_cache()

    n = pages.shape[-1]
    b_stats = sum(t.numel() * t.element_size() for t in stats.values()) + q.numel() * q.element_size()
    b_sel = crit.numel() * 4 + pages.numel() * 4
    b_att = pages.numel() * m["page_size"] * keys.shape[-1] * keys.element_size() * 2 + q.numel() * q.element_size()
    b_step = b_stats + b_att
    timed(cfg, "old_step", lambda: old_step(q, enc, stats, forced), b_step)
    timed(cfg, "new_step", lambda: P.pagestat_decode(q, enc), b_step)
    timed(cfg, "criticality", lambda: P.page_criticality(q, stats, m["score"], m["lam"]), b_stats)
    timed(cfg, "select_torch(topk+cast)", lambda: P.select_pages_device(crit, forced, k).to(torch.int32), b_sel)
    timed(cfg, "select_triton", lambda: P.select_pages_triton(crit, forced, k), b_sel)
    timed(cfg, "attention+torch_merge", lambda: P.paged_attention(q, keys, values, pages, m["page_size"], check=False, merge="torch"), b_att)
    timed(cfg, "attention+combine", lambda: P.paged_attention(q, keys, values, pages, m["page_size"], check=False), b_att)
    for w in (4, 8, 16):
        timed(cfg, f"select_triton_w{w}", lambda w=w: P.select_pages_triton(crit, forced, k, num_warps=w), b_sel, graph=False)
    timed(cfg, "select_triton_block2048", lambda: P.select_pages_triton(crit, forced, k, block=2048), b_sel, graph=False)
    for s in (1, 2, 4, 8, 16):
        timed(cfg, f"attention+combine_s{s}", lambda s=s: P.paged_attention(q, keys, values, pages, m["page_size"], splits=s, check=False), b_att)
    print(f"{cfg}: {n} pages per row, {crit.shape[-1]} pages in all")
    del q, enc, stats, keys, values, crit, pages
    torch.cuda.empty_cache()


def main() -> int:
    global COPY_GBS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the timing records here")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    COPY_GBS = copy_bandwidth()
    print(f"copy bandwidth (1 GiB fp16 copy_): {COPY_GBS:.0f} GB/s")
    edge_checks()
    for batch, score in ((1, "unique"), (8, "unique"), (8, "quest")):
        try:
            run_config(batch, score)
        except Exception as exc:
            print(f"FAIL config b{batch} {score}: {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=3)
            FAILED.append(f"config b{batch} {score}")
    if args.json:
        args.json.write_text(json.dumps({"copy_gbs": COPY_GBS, "records": RECORDS, "failed": FAILED}, indent=1))
        print(f"wrote {args.json}")
    print("all ok" if not FAILED else f"{len(FAILED)} failures: {FAILED}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
