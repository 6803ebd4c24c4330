"""Page-selection kernels for the ``pagestat`` format (UNIQUE / Quest), each beside its torch
reference.

Entry points (B batch, H query heads, Hkv KV heads, G = H / Hkv, Tq query tokens, T tokens, D
head_dim, NP = ceil(T / P) pages of P tokens; dt = float16 / bfloat16 / float32, fp32 accumulation):

- :func:`page_criticality` (q ``[B, H, Tq, D]`` dt, stats dict of the format's tensors, score,
  lam) -> ``[B, Hkv, Tq, NP]`` float32: UNIQUE ``q.mu + lam*||q||*sigma`` / Quest ``sum max(q*max,
  q*min)`` / mean ``q.mu``, max over the G query heads, in one pass that reads each page's
  statistics once for the whole group, as ``tl.dot`` products on the tensor cores (Quest as
  ``dot(max(q,0), maxT) + dot(min(q,0), minT)``; about 5x faster on the H100 than a
  broadcast-multiply reduction over D). Reference: :func:`page_scores`.
- :func:`paged_attention` (q ``[B, H, Tq, D]``, keys/values ``[B, Hkv, T, D]`` dt, pages int32
  ``[B, Hkv, Tq, n]``, page_size) -> partial (out ``[B, H, Tq, D]`` float32, lse ``[B, H, Tq]``
  float32) over the tokens of the listed pages (a page past T contributes its tokens below T only).
  Reference: :func:`paged_attention_reference`.
  The list is split across programs (flash-decoding); :func:`combine_splits` merges the splits in
  one Triton launch (log2 space).
- :func:`select_pages_triton` (scores ``[B, Hkv, Tq, NP]`` float32, forced pages, k) -> int32
  ``[B, Hkv, Tq, n_forced + k]``: forced pages, then the k best others in ascending page order; one
  program per row, exact radix select on the scores' order-preserving uint32 image (NaN highest,
  ties at the k-th value to the lowest pages), cumsum compaction. Reference:
  :func:`select_pages_triton_reference`; torch.topk (:func:`select_pages_device`) picks the same set
  unless the k-th value is tied.

The format's decode step (:func:`kvtool.formats.pagestat.pagestat_decode`) chains them: criticality ->
Triton page selection (forced first page and window pages) -> paged attention -> Triton split
merge, four launches with no host copies or syncs (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.core.attention import attend_partial, default_scale, expand_kv
from kvtool.core.errors import UsageError
from kvtool.kernels.common import (
    LOG2E,
    check_device,
    check_query,
    dot_flags,
    num_splits,
)
from kvtool.kernels.online_softmax import attend_block as _attend_block, merge_split_partials

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
    if score not in SCORE_ID:
        raise UsageError(f"score must be one of {', '.join(SCORE_ID)}, got {score!r}")
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
    (batch, KV head, query) row (default: about 4 programs per SM). The splits merge in one
    :func:`combine_splits` launch."""
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
    if keys.stride(-1) != 1 or values.stride() != keys.stride():  # the kernel reads both with the keys' strides
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
    return combine_splits(out, lse, h, d)


def combine_splits(part: torch.Tensor, plse: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton merge of split partials: part ``[B, Hkv, Tq, S, GP, DP]`` float32 (normalised per
    split, contiguous) and plse ``[B, Hkv, Tq, S, GP]`` float32 (natural log, -inf for an empty
    split) -> (out ``[B, H, Tq, D]`` float32, lse ``[B, H, Tq]`` float32), D = ``head_dim``. Same
    maths as the torch reference :func:`~kvtool.kernels.common.merge_splits`, in one launch of the shared
    :func:`~kvtool.kernels.online_softmax.merge_splits_kernel` (one program per query head row)."""
    b, hkv, tq, s, gp, dp = part.shape
    g = heads // hkv
    out = torch.empty(b, heads, tq, head_dim, dtype=torch.float32, device=part.device)
    lse = torch.empty(b, heads, tq, dtype=torch.float32, device=part.device)
    if out.numel() == 0 or lse.numel() == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    merge_split_partials(part.view(b * hkv * tq, s, gp, dp), plse.view(b * hkv * tq, s, gp), None, out, lse, g, tq=tq, normalised=True)
    return out, lse


def page_scores(q: torch.Tensor, stats: dict[str, torch.Tensor], score: str, lam: float = 1.0) -> torch.Tensor:
    """Criticality ``[B, Hkv, Tq, NP]`` float32 of every page for q ``[B, H, Tq, D]``: the chosen
    score per query head, then the max over the G query heads of each KV head. Unscaled."""
    b, h, tq, d = q.shape
    ref = stats["mean"] if "mean" in stats else stats["max"]
    hkv = ref.shape[1]
    qg = q.float().reshape(b, hkv, h // hkv, tq, d)
    if score == "quest":
        hi, lo = stats["max"].float(), stats["min"].float()
        per = torch.maximum(qg[..., None, :] * hi[:, :, None, None], qg[..., None, :] * lo[:, :, None, None]).sum(-1)
    else:
        per = torch.einsum("bkgtd,bknd->bkgtn", qg, stats["mean"].float())
        if score == "unique":
            per = per + lam * qg.norm(dim=-1)[..., None] * stats["sigma"].float()[:, :, None, None]
    return per.amax(2)


def select_pages(scores: torch.Tensor, forced: list[int], k: int) -> torch.Tensor:
    """Page indices int64 ``[B, Hkv, Tq, len(forced) + k]``: the forced pages, then the k best-
    scoring other pages of ``scores`` ``[B, Hkv, Tq, NP]``."""
    s = scores.clone()
    f = torch.tensor(forced, dtype=torch.int64, device=scores.device)
    s[..., f] = float("-inf")
    top = torch.topk(s, k, dim=-1, sorted=False).indices
    return torch.cat([f.expand(*scores.shape[:3], -1), top], -1)


def pages_to_token_mask(pages: torch.Tensor, page_size: int, tokens: int) -> torch.Tensor:
    """bool ``[B, Hkv, Tq, T]`` from page indices ``[B, Hkv, Tq, n]``."""
    n = -(-tokens // page_size)
    pm = torch.zeros(*pages.shape[:3], n, dtype=torch.bool, device=pages.device)
    pm.scatter_(3, pages, True)
    return pm.repeat_interleave(page_size, dim=3)[..., :tokens]


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
    as :func:`select_pages`, without a host-to-device copy."""
    s = scores.index_fill(-1, forced, float("-inf"))
    top = torch.topk(s, k, dim=-1, sorted=False).indices
    return torch.cat([forced.expand(*scores.shape[:3], -1), top], -1)


@triton.jit
def _order_keys(ptr, n, NP, forced_ptr, NF):
    """uint32 keys of scores ``ptr[n]`` whose unsigned order is the float order (NaN canonical
    largest, 0xFFFFFFFF); forced pages and positions past NP get 0 (never chosen)."""
    x = tl.load(ptr + n, mask=n < NP, other=0.0)
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
    key = tl.where(x != x, tl.full([], 0xFFFFFFFF, tl.uint32), key)
    keep = n < NP
    for f in range(0, NF):
        keep = keep & (n != tl.load(forced_ptr + f).to(tl.int32))
    return tl.where(keep, key, tl.zeros([], tl.uint32))


@triton.jit
def _select_pages_kernel(scores_ptr, forced_ptr, out_ptr, NP, NF, K, s_row, o_row,
                         BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """One program per (batch, KV head, query token) row: out[row] = forced pages, then the K best
    non-forced pages in ascending page order. Threshold = the K-th largest key, found bit by bit
    (radix select, 32 counting passes); ties at it go to the lowest page indices."""
    row = tl.program_id(0).to(tl.int64)
    src = scores_ptr + row * s_row
    dst = out_ptr + row * o_row
    off = tl.arange(0, BLOCK)
    # integer arguments equal to 1 arrive as constexprs on the GPU: make the scalars tensors first
    kk = (K + tl.zeros([], tl.int32)).to(tl.uint32)
    if CHUNKS == 1:
        keys = _order_keys(src, off, NP, forced_ptr, NF)
    prefix = tl.zeros([], tl.uint32)
    for i in tl.static_range(32):
        cand = prefix | (tl.full([], 1, tl.uint32) << (31 - i))
        if CHUNKS == 1:
            cnt = tl.sum((keys >= cand).to(tl.int32), axis=0)
        else:
            cnt = tl.zeros([], tl.int32)
            for c in range(0, CHUNKS):
                kc = _order_keys(src, c * BLOCK + off, NP, forced_ptr, NF)
                cnt += tl.sum((kc >= cand).to(tl.int32), axis=0)
        prefix = tl.where(cnt.to(tl.uint32) >= kk, cand, prefix)
    # K == 0 leaves prefix at 0xFFFFFFFF: nothing is above it and no tie is needed
    if CHUNKS == 1:
        above = tl.sum((keys > prefix).to(tl.int32), axis=0)
    else:
        above = tl.zeros([], tl.int32)
        for c in range(0, CHUNKS):
            kc = _order_keys(src, c * BLOCK + off, NP, forced_ptr, NF)
            above += tl.sum((kc > prefix).to(tl.int32), axis=0)
    ties_left = K - above + tl.zeros([], tl.int32)
    for f in range(0, NF):
        tl.store(dst + f, tl.load(forced_ptr + f).to(tl.int32))
    pos = NF + tl.zeros([], tl.int32)
    for c in range(0, CHUNKS):
        if CHUNKS == 1:
            kc = keys
        else:
            kc = _order_keys(src, c * BLOCK + off, NP, forced_ptr, NF)
        tie = (kc == prefix) & (kc != 0)
        tie_i = tie.to(tl.int32)
        tie_rank = tl.cumsum(tie_i, axis=0) - tie_i
        sel = (kc > prefix) | (tie & (tie_rank < ties_left))
        sel_i = sel.to(tl.int32)
        at = pos + tl.cumsum(sel_i, axis=0) - sel_i
        tl.store(dst + at, (c * BLOCK + off).to(tl.int32), mask=sel)
        pos += tl.sum(sel_i, axis=0)
        ties_left -= tl.sum(tie_i, axis=0)


def select_pages_triton(scores: torch.Tensor, forced: torch.Tensor, k: int, block: int = 8192, num_warps: int = 8) -> torch.Tensor:
    """Page lists int32 ``[B, Hkv, Tq, len(forced) + k]`` from scores ``[B, Hkv, Tq, NP]`` float32
    and forced pages (int32/int64 device tensor, distinct, in range): the forced pages, then the k
    best non-forced pages in ascending page order, one Triton program per row (radix select on the
    order-preserving uint32 image of the scores, then a cumsum compaction). NaN ranks above +inf,
    -inf below every finite score; equal scores at the k-th value go to the lowest page indices, so
    the set is deterministic (torch.topk may pick other tied pages: the sets agree when the k-th
    value is not tied). Rows longer than ``block`` are walked in chunks. No host sync."""
    if scores.ndim != 4 or scores.dtype != torch.float32:
        raise UsageError(f"scores must be float32 [batch, kv_heads, query_tokens, pages], got {scores.dtype} {list(scores.shape)}")
    npages = scores.shape[3]
    nf = forced.numel()
    if k < 0 or k > npages - nf:
        raise UsageError(f"k must be in 0..{npages - nf} (pages {npages} minus {nf} forced), got {k}")
    check_device(scores=scores, forced=forced)
    scores = scores.contiguous()
    forced = forced.contiguous()
    out = torch.empty(*scores.shape[:3], nf + k, dtype=torch.int32, device=scores.device)
    rows = scores.shape[0] * scores.shape[1] * scores.shape[2]
    if rows == 0 or nf + k == 0:
        return out
    bl = min(triton.next_power_of_2(max(block, 16)), max(16, triton.next_power_of_2(npages)))
    chunks = -(-npages // bl)
    _select_pages_kernel[(rows,)](scores, forced, out, npages, nf, k, npages, nf + k, BLOCK=bl, CHUNKS=chunks, num_warps=num_warps)
    return out


def select_pages_triton_reference(scores: torch.Tensor, forced: torch.Tensor, k: int) -> torch.Tensor:
    """Torch reference of :func:`select_pages_triton` (same order keys, same tie rule): int32
    ``[B, Hkv, Tq, len(forced) + k]``."""
    bits = scores.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)
    key = torch.where(torch.isnan(scores), torch.full_like(key, 0xFFFFFFFF), key)
    key = key.index_fill(-1, forced.to(torch.int64), -1)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]
    top = order.sort(-1).values
    return torch.cat([forced.to(torch.int64).expand(*scores.shape[:3], -1), top], -1).to(torch.int32)


