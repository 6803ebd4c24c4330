"""Page-selection kernels for the ``pagestat`` format (UNIQUE / Quest), each beside its torch
reference.

Entry points (B batch, H query heads, Hkv KV heads, G = H / Hkv, Tq query tokens, T tokens, D
head_dim, NP = ceil(T / P) pages of P tokens; dt = float16 / bfloat16 / float32, fp32 accumulation):

- :func:`page_criticality` (q ``[B, H, Tq, D]`` dt, stats dict of the format's tensors, score,
  lam) -> ``[B, Hkv, Tq, NP]`` float32: UNIQUE ``q.mu + lam*||q||*sigma`` / Quest ``sum max(q*max,
  q*min)`` / mean ``q.mu``, max over the G query heads, in one pass that reads each page's
  statistics once for the whole group, as ``tl.dot`` products on the tensor cores (Quest as
  ``dot(max(q,0), maxT) + dot(min(q,0), minT)``; bench, H100: about 5x faster than a
  broadcast-multiply reduction over D). Reference: :func:`kvtool.formats.pagestat.page_scores`.
- :func:`paged_attention` (q ``[B, H, Tq, D]``, keys/values ``[B, Hkv, T, D]`` dt, pages int32
  ``[B, Hkv, Tq, n]``, page_size) -> partial (out ``[B, H, Tq, D]`` float32, lse ``[B, H, Tq]``
  float32) over the tokens of the listed pages (a page past T contributes its tokens below T only).
  The list is split across programs (flash-decoding) and merged. Reference:
  :func:`paged_attention_reference`.
- :func:`pagestat_decode` (q, encoded layer, scale): criticality -> torch.topk pages (forced first
  page and window pages, chosen on the device) -> paged attention; the kernel path of
  ``pagestat``'s ``attend``. No host copies, so the step can be captured in a CUDA graph.
- :func:`make_pagestat_inputs`: random encoded inputs at any size, for benchmarks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention import attend_partial, default_scale, expand_kv
from ..errors import UsageError
from ..formats.base import Encoded
from ..formats.pagestat import SCORES, PageStatParams, PageStatFormat, page_scores, pages_to_token_mask, select_pages
from .retrieval_common import LOG2E, check_device, check_query, dot_flags, merge_splits, num_splits, random_decode_inputs
from .online_softmax import attend_block as _attend_block

SCORE_ID = {"unique": 0, "quest": 1, "mean": 2}


# ----------------------------------------------------------------------------- criticality


@triton.jit
def _criticality_kernel(
    q_ptr, a_ptr, c_ptr, sig_ptr, out_ptr, lam, NP, HKV, D,
    sq_b, sq_h, sq_t, sa_b, sa_h, sa_n, ss_b, ss_h, so_b, so_h, so_t,
    G: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, SCORE: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program: BN pages of one (batch, KV head, query token), all G query heads (rows padded to
    GP >= 16 for the MMA, masked to -inf before the max) with ``tl.dot`` on a transposed [DP, BN]
    tile. a = mean (unique, mean) or max (quest); c = min (quest); sig = sigma (unique)."""
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
        # Quest: sum_d max(q_d * max_d, q_d * min_d) = dot(max(q, 0), maxT) + dot(min(q, 0), minT)
        c_t = tl.load(c_ptr + soff, mask=smask, other=0.0)
        if UPCAST:
            c_t = c_t.to(tl.float32)
        zero = tl.zeros_like(q)
        # max/min may promote 16-bit operands: cast back so both dot operands share the dtype
        s = tl.dot(tl.maximum(q, zero).to(a_t.dtype), a_t, input_precision=DOT_PREC) + tl.dot(tl.minimum(q, zero).to(c_t.dtype), c_t, input_precision=DOT_PREC)
    else:
        s = tl.dot(q, a_t, input_precision=DOT_PREC)
        if SCORE == 0:
            qf = q.to(tl.float32)
            qn = tl.sqrt(tl.sum(qf * qf, axis=1))
            sig = tl.load(sig_ptr + b * ss_b + kh * ss_h + n, mask=nmask, other=0.0).to(tl.float32)
            s = s + lam * qn[:, None] * sig[None, :]
    s = tl.where(gmask[:, None], s, float("-inf"))
    best = tl.max(s, axis=0)
    tl.store(out_ptr + b * so_b + kh * so_h + pid_t * so_t + n, best, mask=nmask)


def page_criticality(q: torch.Tensor, stats: dict[str, torch.Tensor], score: str, lam: float = 1.0, block_pages: int = 64,
                     num_warps: int = 4) -> torch.Tensor:
    """Page scores ``[B, Hkv, Tq, NP]`` float32 (see the module docstring). ``stats``: ``mean``
    ``[B, Hkv, NP, D]`` and ``sigma`` ``[B, Hkv, NP]`` (unique), ``mean`` (mean), ``min``/``max``
    (quest), in q's dtype. ``block_pages`` pages per program."""
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
    # the CPU interpreter computes 16-bit tl.dot wrongly: upcast there; float32 runs IEEE products (no TF32)
    upcast = not q.is_cuda or q.dtype == torch.float32
    prec = "ieee" if upcast else "tf32"
    grid = (triton.cdiv(npages, bn), b * hkv, tq)
    _criticality_kernel[grid](
        q, a, c, sig, out, float(lam), npages, hkv, d,
        q.stride(0), q.stride(1), q.stride(2), a.stride(0), a.stride(1), a.stride(2),
        sig.stride(0), sig.stride(1), out.stride(0), out.stride(1), out.stride(2),
        G=g, GP=gp, DP=dp, BN=bn, SCORE=SCORE_ID[score], UPCAST=upcast, DOT_PREC=prec, num_warps=num_warps,
    )
    return out


# ----------------------------------------------------------------------------- paged attention


@triton.jit
def _store_partial(out_ptr, lse_ptr, row, acc, m_i, l_i, g, d, GP: tl.constexpr, DP: tl.constexpr):
    """Write one split's normalised output [GP, DP] and natural-log lse [GP] at partial ``row``."""
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(out_ptr + (row * GP + g[:, None]) * DP + d[None, :], out)
    tl.store(lse_ptr + row * GP + g, lse)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, pages_ptr, out_ptr, lse_ptr, scale_log2, T, NSEL, PPS, S, HKV, TQ, D,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sp_b, sp_h, sp_t,
    G: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr, BP: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program: pages [split*PPS, (split+1)*PPS) of the list of one (batch, KV head, query
    token), for its G query heads. Writes partial row ((b*HKV + kh)*TQ + t)*S + split."""
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_t = tl.program_id(2)
    b = (pid_bh // HKV).to(tl.int64)
    kh = (pid_bh % HKV).to(tl.int64)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    dmask = d < D
    q = tl.load(q_ptr + b * sq_b + (kh * G + g)[:, None] * sq_h + pid_t * sq_t + d[None, :], mask=(g < G)[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    j = tl.arange(0, BP)
    kbase = k_ptr + b * sk_b + kh * sk_h
    vbase = v_ptr + b * sk_b + kh * sk_h
    start = pid_s * PPS
    end = tl.minimum(start + PPS, NSEL)
    for i in range(start, end):
        page = tl.load(pages_ptr + b * sp_b + kh * sp_h + pid_t * sp_t + i)
        tok = page * PAGE + j
        tmask = (j < PAGE) & (tok < T)
        kt = tl.load(kbase + tok[None, :] * sk_t + d[:, None], mask=tmask[None, :] & dmask[:, None], other=0.0)
        v = tl.load(vbase + tok[:, None] * sk_t + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
        m_i, l_i, acc = _attend_block(q, kt, v, tmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    row = ((b * HKV + kh) * TQ + pid_t) * S + pid_s
    _store_partial(out_ptr, lse_ptr, row, acc, m_i, l_i, g, d, GP, DP)


def paged_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    scale: float | None = None,
    splits: int | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention over the listed pages (see the module docstring). ``pages`` int32
    ``[B, Hkv, Tq, n]`` (any strides; entries must be distinct and in range: checked here unless
    ``check=False``, for lists that come from top-k, which are). ``splits``: programs per
    (batch, KV head, query) row (default: about 4 programs per SM)."""
    if keys.ndim != 4 or values.shape != keys.shape:
        raise UsageError(f"keys/values must be [batch, kv_heads, tokens, head_dim] of one shape, got {list(keys.shape)} and {list(values.shape)}")
    b, hkv, t, d = keys.shape
    check_query(q, b, hkv, d, keys.dtype)
    if values.dtype != keys.dtype:
        raise UsageError(f"values are {values.dtype} but keys are {keys.dtype}")
    h, tq = q.shape[1], q.shape[2]
    if pages.ndim != 4 or tuple(pages.shape[:3]) != (b, hkv, tq) or pages.dtype != torch.int32:
        raise UsageError(f"pages must be int32 [{b}, {hkv}, {tq}, n], got {pages.dtype} {list(pages.shape)}")
    if page_size <= 0:
        raise UsageError(f"page_size must be positive, got {page_size}")
    device = check_device(q=q, keys=keys, values=values, pages=pages)
    npages = -(-t // page_size)
    n = pages.shape[3]
    if check and n and (int(pages.min()) < 0 or int(pages.max()) >= npages):
        raise UsageError(f"pages holds an index outside 0..{npages - 1}")
    if check and n > 1 and bool((pages.sort(-1).values.diff(dim=-1) == 0).any()):
        raise UsageError("pages lists a page twice for one query")
    keys, values = keys.contiguous(), values.contiguous()
    g = h // hkv
    gp = max(16, triton.next_power_of_2(g))
    dp = max(16, triton.next_power_of_2(d))
    bp = max(16, triton.next_power_of_2(page_size))
    s = num_splits(b * hkv * tq, n, device) if splits is None else max(1, min(int(splits), max(n, 1)))
    pps = max(1, -(-n // s))
    s = max(1, -(-n // pps)) if n else 1
    out = torch.empty(b, hkv, tq, s, gp, dp, dtype=torch.float32, device=device)
    lse = torch.empty(b, hkv, tq, s, gp, dtype=torch.float32, device=device)
    scale = default_scale(d) if scale is None else scale
    prec, upcast = dot_flags(keys.dtype, device)
    _paged_attention_kernel[(s, b * hkv, tq)](
        q, keys, values, pages, out, lse, float(scale) * LOG2E, t, n, pps, s, hkv, tq, d,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        pages.stride(0), pages.stride(1), pages.stride(2),
        G=g, GP=gp, DP=dp, PAGE=page_size, BP=bp, DOT_PREC=prec, UPCAST=upcast,
    )
    o, l = merge_splits(out[..., :d], lse, h)
    return o, l


def paged_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor, page_size: int, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`paged_attention`: dense attention under the pages' token mask."""
    mask = pages_to_token_mask(pages.to(torch.int64), page_size, keys.shape[2])
    return attend_partial(q, keys, values, scale, expand_kv(mask, q.shape[1] // keys.shape[1]))


# ----------------------------------------------------------------------------- the format's decode step


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


def pagestat_decode(q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pagestat`` attention through the kernels: criticality, torch.topk over non-forced pages
    (chosen on the device, :func:`select_pages_device`), paged attention. Same contract as
    ``PageStatFormat.attend``. No host copies or syncs, so the step can be captured in a CUDA graph."""
    m = enc.meta
    stats = {n.split(".", 1)[1]: x for n, x in enc.tensors.items() if n.startswith("stats.")}
    crit = page_criticality(q, stats, m["score"], m["lam"])
    pages = select_pages_device(crit, forced_index(m["forced_pages"], q.device), m["select"]).to(torch.int32)
    # top-k page lists are distinct and in range: skip the checks (and their device-to-host syncs)
    return paged_attention(q, enc.tensors["keys"], enc.tensors["values"], pages, m["page_size"], scale, check=False)


def pagestat_decode_reference(q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path (``PageStatFormat.attend``) with the scores of :func:`page_scores`."""
    m = enc.meta
    stats = {n.split(".", 1)[1]: x for n, x in enc.tensors.items() if n.startswith("stats.")}
    pages = select_pages(page_scores(q, stats, m["score"], m["lam"]), m["forced_pages"], m["select"])
    return paged_attention_reference(q, enc.tensors["keys"], enc.tensors["values"], pages, m["page_size"], scale)


def make_pagestat_inputs(
    batch: int = 1, heads: int = 32, kv_heads: int = 8, tokens: int = 4096, head_dim: int = 128,
    dtype: torch.dtype = torch.float16, device: str | torch.device = "cuda", page_size: int = 16,
    budget: int = 512, score: str = "unique", dense_window: int = 16, seed: int = 0,
) -> tuple[torch.Tensor, Encoded]:
    """Random keys/values (one planted outlier channel) encoded as ``pagestat`` on ``device`` and a
    decode query ``[batch, heads, 1, head_dim]``: ``pagestat_decode(q, enc)`` runs on them."""
    q, lay = random_decode_inputs(batch, heads, kv_heads, tokens, head_dim, dtype, device, seed)
    enc = PageStatFormat().encode(lay, PageStatParams(page_size=page_size, score=score, budget=budget, budget_ratio=None, dense_window=dense_window))
    return q, enc
