"""Page criticality on the tensor cores (a variant of :func:`.pages.page_criticality`, same maths,
same inputs and output), written from the bench's H100 profile.

Profile of :func:`.pages.pagestat_decode` (H100, Llama-3-8B shapes, batch 8, 128k tokens, pages of
16, 2048-token budget): the criticality kernel takes 314 µs of the 446 µs of GPU time per step (70%)
while it reads 135 MB of page statistics (15% of the copy bandwidth): each program scores 16 pages
with a ``[G, 16, D]`` broadcast-multiply and a reduction over D, so it has little data in flight
and spends its time on the reduction.

Here one program scores ``BN`` (64) pages of one (batch, KV head, query token) for all G query
heads with ``tl.dot``: the ``[BN, D]`` tile of page means is one coalesced load, and

- UNIQUE: ``q . mean + lam * ||q|| * sigma`` = ``dot(q, meanᵀ)`` plus a rank-1 term;
- Quest: ``sum_d max(q_d * max_d, q_d * min_d)`` = ``dot(max(q, 0), maxᵀ) + dot(min(q, 0), minᵀ)``;
- mean: ``dot(q, meanᵀ)``;

then the max over the G query heads. The query rows are padded to 16 for the MMA (rows past G are
masked to -inf before the max). Operands are in the statistics' dtype with fp32 accumulation, as a
fused tensor-core score: fp16 rounding of q is the only difference from the owner's fp32 products
(the bench checks the scores against :func:`kvtool.formats.pagestat.page_scores`).

Entry points: :func:`page_criticality_dot` (same signature and result as
:func:`.pages.page_criticality`: ``[B, Hkv, Tq, NP]`` float32) and :func:`pagestat_decode_dot`
(criticality here, the page choice on the device, then the owner's paged attention; no host
copies, so the step can be captured in a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import UsageError
from ..formats.base import Encoded
from ..formats.pagestat import SCORES
from .pages import SCORE_ID, paged_attention
from .retrieval_common import check_device, check_query


@triton.jit
def _criticality_dot_kernel(
    q_ptr, a_ptr, c_ptr, sig_ptr, out_ptr, lam, NP, HKV, D,
    sq_b, sq_h, sq_t, sa_b, sa_h, sa_n, ss_b, ss_h, so_b, so_h, so_t,
    G: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, SCORE: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_t = tl.program_id(2)
    b = (pid_bh // HKV).to(tl.int64)
    kh = (pid_bh % HKV).to(tl.int64)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    n = pid_n * BN + tl.arange(0, BN)
    gmask = g < G
    dmask = d < D
    nmask = n < NP
    q = tl.load(q_ptr + b * sq_b + (kh * G + g)[:, None] * sq_h + pid_t * sq_t + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    soff = b * sa_b + kh * sa_h + n[None, :] * sa_n + d[:, None]  # transposed tile [DP, BN]
    smask = dmask[:, None] & nmask[None, :]
    a_t = tl.load(a_ptr + soff, mask=smask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        a_t = a_t.to(tl.float32)
    if SCORE == 1:
        c_t = tl.load(c_ptr + soff, mask=smask, other=0.0)
        if UPCAST:
            c_t = c_t.to(tl.float32)
        zero = tl.zeros_like(q)
        # max/min may promote 16-bit operands: cast back so both dot operands share the dtype
        s = tl.dot(tl.maximum(q, zero).to(a_t.dtype), a_t) + tl.dot(tl.minimum(q, zero).to(c_t.dtype), c_t)
    else:
        s = tl.dot(q, a_t)
        if SCORE == 0:
            qf = q.to(tl.float32)
            qn = tl.sqrt(tl.sum(qf * qf, axis=1))
            sig = tl.load(sig_ptr + b * ss_b + kh * ss_h + n, mask=nmask, other=0.0).to(tl.float32)
            s = s + lam * qn[:, None] * sig[None, :]
    s = tl.where(gmask[:, None], s, float("-inf"))
    best = tl.max(s, axis=0)
    tl.store(out_ptr + b * so_b + kh * so_h + pid_t * so_t + n, best, mask=nmask)


def page_criticality_dot(q: torch.Tensor, stats: dict[str, torch.Tensor], score: str, lam: float = 1.0, block_pages: int = 64,
                         num_warps: int = 4) -> torch.Tensor:
    """Page scores ``[B, Hkv, Tq, NP]`` float32 from q ``[B, H, Tq, D]`` and the pagestat statistics
    (``mean`` ``[B, Hkv, NP, D]`` and ``sigma`` ``[B, Hkv, NP]`` for unique; ``mean`` for mean;
    ``min`` / ``max`` for quest; q's dtype). Same result as :func:`.pages.page_criticality`."""
    if score not in SCORES:
        raise UsageError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
    need = {"unique": ("mean", "sigma"), "quest": ("max", "min"), "mean": ("mean",)}[score]
    for name in need:
        if name not in stats:
            raise UsageError(f"score {score} needs the page statistic {name!r}")
    a = stats[need[0]].contiguous()
    if a.ndim != 4:
        raise UsageError(f"stats.{need[0]} must be [batch, kv_heads, pages, head_dim], got {list(a.shape)}")
    b, hkv, npages, d = a.shape
    check_query(q, b, hkv, d, a.dtype)
    c = stats["min"].contiguous() if score == "quest" else a
    sig = stats["sigma"].contiguous() if score == "unique" else a
    if c.shape != a.shape:
        raise UsageError(f"stats.min has shape {list(c.shape)}, expected {list(a.shape)}")
    if score == "unique" and tuple(sig.shape) != (b, hkv, npages):
        raise UsageError(f"stats.sigma has shape {list(sig.shape)}, expected {[b, hkv, npages]}")
    device = check_device(q=q, stats=a, min=c, sigma=sig)
    h, tq = q.shape[1], q.shape[2]
    g = h // hkv
    out = torch.empty(b, hkv, tq, npages, dtype=torch.float32, device=device)
    if npages == 0 or tq == 0:
        return out
    gp = max(16, triton.next_power_of_2(g))
    dp = max(16, triton.next_power_of_2(d))
    bn = max(16, triton.next_power_of_2(block_pages))
    upcast = not q.is_cuda or q.dtype == torch.float32
    grid = (triton.cdiv(npages, bn), b * hkv, tq)
    _criticality_dot_kernel[grid](
        q, a, c, sig, out, float(lam), npages, hkv, d,
        q.stride(0), q.stride(1), q.stride(2), a.stride(0), a.stride(1), a.stride(2),
        sig.stride(0), sig.stride(1), out.stride(0), out.stride(1), out.stride(2),
        G=g, GP=gp, DP=dp, BN=bn, SCORE=SCORE_ID[score], UPCAST=upcast, num_warps=num_warps,
    )
    return out


_FORCED: dict[tuple, torch.Tensor] = {}


def forced_index(forced: list[int], device: torch.device) -> torch.Tensor:
    """The forced-page list as an int64 device tensor, made once per (list, device): the decode step
    then copies nothing from the host, so it can be captured in a CUDA graph."""
    key = (tuple(forced), str(device))
    if key not in _FORCED:
        _FORCED[key] = torch.tensor(forced, dtype=torch.int64, device=device)
    return _FORCED[key]


def select_pages_device(scores: torch.Tensor, forced: torch.Tensor, k: int) -> torch.Tensor:
    """Page indices int64 ``[B, Hkv, Tq, len(forced) + k]``: the forced pages (int64 device tensor),
    then the k best-scoring other pages of ``scores`` ``[B, Hkv, Tq, NP]`` float32 — the same choice
    as :func:`kvtool.formats.pagestat.select_pages`, without a host-to-device copy."""
    s = scores.index_fill(-1, forced, float("-inf"))
    top = torch.topk(s, k, dim=-1, sorted=False).indices
    return torch.cat([forced.expand(*scores.shape[:3], -1), top], -1)


def pagestat_decode_dot(q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pagestat`` decode step with :func:`page_criticality_dot`, the page choice on the device
    (:func:`select_pages_device`) and the owner's :func:`.pages.paged_attention`: the partial (out
    ``[B, H, Tq, D]`` float32, lse ``[B, H, Tq]`` float32), as :func:`.pages.pagestat_decode`. No host
    copies or syncs, so the whole step can be captured in a CUDA graph."""
    m = enc.meta
    stats = {n.split(".", 1)[1]: x for n, x in enc.tensors.items() if n.startswith("stats.")}
    crit = page_criticality_dot(q, stats, m["score"], m["lam"])
    pages = select_pages_device(crit, forced_index(m["forced_pages"], q.device), m["select"]).to(torch.int32)
    # top-k page lists are distinct and in range: skip the checks (and their device-to-host syncs)
    return paged_attention(q, enc.tensors["keys"], enc.tensors["values"], pages, m["page_size"], scale, check=False)
