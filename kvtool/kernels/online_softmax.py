"""The online-softmax step shared by kvtool's flash-decoding style Triton kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def attend_block(q, kt, v, s_mask, m_i, l_i, acc, scale_log2, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One block of keys into a running softmax (base 2).

    q ``[R, DP]`` query rows, kt ``[DP, N]`` keys transposed, v ``[N, DP]`` values, s_mask ``[R, N]``
    (or broadcastable) True where a key counts; m_i ``[R]`` running max, l_i ``[R]`` running sum,
    acc ``[R, DP]`` float32 running output. ``scale_log2`` = softmax scale × log2(e). UPCAST runs
    the products in float32 (the CPU interpreter computes bfloat16 ``tl.dot`` wrongly). Returns the
    updated ``(m_i, l_i, acc)``; rows that saw no key keep m = -inf, l = 0, acc = 0."""
    if UPCAST:
        q = q.to(tl.float32)
        kt = kt.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, kt, input_precision=DOT_PREC) * scale_log2
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


def split_partials(groups: int, slots: int, rows: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised flash-decoding partials for ``groups`` KV heads of ``rows`` query rows, one slot
    per split (the window's included): acc ``[groups, slots, RP, DP]``, m and l ``[groups, slots, RP]``,
    float32, RP = max(16, next power of two >= rows), DP = max(64, next power of two >= head_dim);
    the layout :func:`store_split_partial` writes and :func:`merge_split_partials` reads."""
    rp = max(16, triton.next_power_of_2(rows))
    dp = max(64, triton.next_power_of_2(head_dim))
    acc = torch.empty(groups, slots, rp, dp, dtype=torch.float32, device=device)
    m = torch.empty(groups, slots, rp, dtype=torch.float32, device=device)
    l = torch.empty(groups, slots, rp, dtype=torch.float32, device=device)
    return acc, m, l


@triton.jit
def attend_dense_window(q, wk_ptr, wv_ptr, bh, W, D, c, cmask, m_i, l_i, acc, scale_log2,
                        DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """The dense window of KV head ``bh`` into a running softmax, 64 tokens at a time: window keys /
    values ``[B*Hkv, W, D]`` at ``wk_ptr`` / ``wv_ptr``, channels ``c`` ``[DP]`` (``cmask``: c < D);
    the rest as :func:`attend_block`. Returns the updated ``(m_i, l_i, acc)``."""
    t = tl.arange(0, 64)
    for w0 in range(0, W, 64):
        tw = w0 + t
        wmask = tw < W
        kt = tl.load(wk_ptr + (bh * W + tw[None, :]) * D + c[:, None], mask=wmask[None, :] & cmask[:, None], other=0.0)
        v = tl.load(wv_ptr + (bh * W + tw[:, None]) * D + c[None, :], mask=wmask[:, None] & cmask[None, :], other=0.0)
        m_i, l_i, acc = attend_block(q, kt, v, wmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    return m_i, l_i, acc


@triton.jit
def store_split_partial(acc_ptr, m_ptr, l_ptr, slot, rows, rmask, c, acc, m_i, l_i, RP: tl.constexpr, DP: tl.constexpr):
    """One split's partial at ``slot`` = KV head × (S + 1) + split: acc ``[P*(S+1), RP, DP]`` float32,
    m / l ``[P*(S+1), RP]`` float32, rows ``[RB]`` (``rmask``: real rows), the layout
    :func:`merge_splits_kernel` reads."""
    tl.store(acc_ptr + (slot * RP + rows[:, None]) * DP + c[None, :], acc, mask=rmask[:, None])
    tl.store(m_ptr + slot * RP + rows, m_i, mask=rmask)
    tl.store(l_ptr + slot * RP + rows, l_i, mask=rmask)


@triton.jit
def merge_splits_kernel(val_ptr, m_ptr, l_ptr, out_ptr, lse_ptr, idx_ptr, S, R, TQ, D, HKV, K,
                        RP: tl.constexpr, DP: tl.constexpr, SB: tl.constexpr, KP: tl.constexpr,
                        NORMALISED: tl.constexpr, LISTED: tl.constexpr):
    """Flash-decoding merge, one program per (partial group p, row r < R): reads the row's S split
    partials, SB splits per vector load with online rescaling, and writes one output row.

    Partials: val ``[P, S, RP, DP]`` float32, m ``[P, S, RP]`` float32 (and l, same shape) at slot
    ``(p * S + s) * RP + r``. NORMALISED: val is each split's normalised output and m its natural
    log-sum-exp (-inf for an empty split; l unused); else val is the unnormalised accumulator, m the
    running max of the base-2 scores and l the sum of exp2(score - m). Output row
    ``(p // TQ) * R * TQ + r * TQ + p % TQ`` of out ``[rows, D]`` / lse ``[rows]`` float32 (natural
    log; 0 / -inf for a row that saw no key). LISTED: query head ``(p % HKV) * R + r`` of batch
    ``p // HKV`` is merged only when it is among the K entries of ``idx[batch]`` (else 0 / -inf,
    and its slots are not read)."""
    pid = tl.program_id(0).to(tl.int64)
    p = pid // R
    r = pid % R
    c = tl.arange(0, DP)
    sb = tl.arange(0, SB)
    valid = tl.full([], 1, tl.int32) > 0
    if LISTED:
        kk = tl.arange(0, KP)
        listed = tl.load(idx_ptr + (p // HKV) * K + kk, mask=kk < K, other=-1)
        valid = tl.max((listed == (p % HKV) * R + r).to(tl.int32), axis=0) > 0
    m_run = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    out = tl.zeros([DP], tl.float32)
    if valid:
        for s0 in range(0, S, SB):
            smask = s0 + sb < S
            slot = (p * S + s0 + sb) * RP + r  # [SB]
            m = tl.load(m_ptr + slot, mask=smask, other=float("-inf"))
            if NORMALISED:
                m = m * 1.4426950408889634
                mass = tl.where(smask, 1.0, 0.0)
            else:
                mass = tl.load(l_ptr + slot, mask=smask, other=0.0)
            # only the D columns a split wrote (the padding up to DP is never written: compute-sanitizer's initcheck)
            val = tl.load(val_ptr + slot[:, None] * DP + c[None, :], mask=smask[:, None] & (c < D)[None, :], other=0.0)
            m_new = tl.maximum(m_run, tl.max(m, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            w_old = tl.exp2(m_run - m_safe)
            w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_safe))
            total = total * w_old + tl.sum(mass * w, axis=0)
            out = out * w_old + tl.sum(val * w[:, None], axis=0)
            m_run = m_new
    ok = valid & (total > 0)
    out = tl.where(ok, out / tl.where(ok, total, 1.0), 0.0)
    lse = tl.where(ok, (m_run + tl.log2(tl.where(ok, total, 1.0))) * 0.6931471805599453, float("-inf"))
    orow = (p // TQ) * R * TQ + r * TQ + p % TQ
    tl.store(out_ptr + orow * D + c, out, mask=c < D)
    tl.store(lse_ptr + orow, lse)


def merge_split_partials(val, m, l, out, lse, rows: int, tq: int = 1, normalised: bool = False, listed=None) -> None:
    """Launch :func:`merge_splits_kernel` over partials val ``[P, S, RP, DP]``, m / l ``[P, S, RP]``
    (contiguous float32; ``l`` None when ``normalised``) into out ``[P * rows, D]`` and lse
    ``[P * rows]`` (contiguous float32, any view), ``rows`` <= RP rows per partial group. ``listed``:
    None, or ``(idx, kv_heads)`` with idx int32 ``[B, K]`` the query heads to merge (P = B * kv_heads,
    rows = the GQA group)."""
    p, s, rp, dp = val.shape
    if p * rows == 0:
        return
    d = out.shape[-1]
    idx, hkv = listed if listed is not None else (m, 1)
    k = idx.shape[1] if listed is not None else 1
    merge_splits_kernel[(p * rows,)](
        val, m, m if l is None else l, out, lse, idx, s, rows, tq, d, hkv, k,
        RP=rp, DP=dp, SB=min(32, max(2, triton.next_power_of_2(s))), KP=max(2, triton.next_power_of_2(k)),
        NORMALISED=normalised, LISTED=listed is not None, num_warps=4,
    )
