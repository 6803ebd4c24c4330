"""Sign-VQ retrieval kernels for the ``signvq`` format, each beside its torch reference.

Entry points (B batch, H query heads, Hkv KV heads, G = H / Hkv, Tq query tokens, Tc compressed
tokens, D head_dim, G4 = D / 4; dt = float16 / bfloat16 / float32, fp32 accumulation):

- :func:`lut_scores_kernel` (q ``[B, H, Tq, D]`` dt, codes uint8 ``[B, Hkv, Tc, ceil(G4/2)]``,
  codebook dt ``[B, Hkv, G4, 16, 4]``, gqa ``"sum"|"max"``) -> scores ``[B, Hkv, Tq, Tc]`` float32.
  Each program builds the table ``q_g . codebook[g, c]`` (G4 x 16 entries, per query head, or once
  for the summed query with ``sum``) once and sums one table entry per group for up to ``iters``
  blocks of tokens. Default ``lookup="table"``: one token per lane, the table written to a scratch
  slot of the program and read back through L1 (the lanes of a warp read the same 64-byte row of
  the table at once, so a lookup is one L1 wavefront). ``"gather"`` keeps the table in registers
  and looks up with ``tl.gather`` (shared-memory round trips); ``"onehot"`` sums masked entries.
  The packed 4-bit codes are read as 32-bit words when D is a multiple of 32 and the codes are
  4-byte aligned, otherwise one byte per pair of groups. (On the H100 the table lookup is about 1.8x
  faster than the gather.)
  Reference: :func:`kvtool.formats.signvq.lut_scores`.
- :func:`signvq_attention` (q, encoded layer, idx int32 ``[B, Hkv, Tq, k]`` compressed-token
  indices) -> partial (out ``[B, H, Tq, D]`` float32, lse ``[B, H, Tq]`` float32) over the chosen
  compressed tokens: codes, magnitudes, values and their scales are gathered per token and
  dequantised in the load (k = c + s*alpha*(code*scale + zero), rounded to dt as ``decode`` does);
  all G query heads share one pass; the k tokens are split across programs and merged.
  Reference: :func:`kvtool.formats.signvq.signvq_attention_reference`.
- :func:`signvq_partials`: the same launch returning the raw split partials, optionally with the
  full-precision (sink / keep-top / window) tokens read by extra splits; the format's decode step
  (:func:`kvtool.formats.signvq.signvq_decode`) merges them with
  :func:`kvtool.kernels.pages.combine_splits`.

Encoded layers are read through their ``tensors`` / ``meta`` (:class:`~kvtool.kernels.common.EncodedLike`),
so no format class is imported here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.core.attention import default_scale
from kvtool.core.errors import UsageError
from kvtool.kernels.pages import _attend_block, _store_partial, combine_splits
from kvtool.kernels.common import (
    EncodedLike,
    LOG2E,
    check_device,
    check_query,
    dot_flags,
    num_splits,
)


# ----------------------------------------------------------------------------- LUT scores


@triton.jit
def _lookup(lut_t, codes, nmask, USE_GATHER: tl.constexpr):
    """Sum over groups of lut_t[codes[t, n], n]: lut_t [16, BG] float32, codes [BT, BG] int32 -> [BT]
    (groups outside ``nmask`` count zero)."""
    if USE_GATHER:
        vals = tl.gather(lut_t, codes, axis=0)
    else:
        c = tl.arange(0, 16)
        hit = codes[:, :, None] == c[None, None, :]
        vals = tl.sum(tl.where(hit, tl.trans(lut_t)[None, :, :], 0.0), axis=2)
    return tl.sum(tl.where(nmask[None, :], vals, 0.0), axis=1)


@triton.jit
def _codebook_and_query(cb_ptr, q_ptr, pid_bh, pid_q, HKV, G4, sq_b, sq_t, sb_b, sb_h, BG: tl.constexpr):
    """Program prologue of the LUT kernels: the (batch, KV head) codebook as float32 [16 codes, BG
    groups, 4] (groups past G4 zero), the query row's base pointers [BG, 4] (add a head's stride),
    the group mask [BG] and the batch and KV head indices (int64)."""
    b = (pid_bh // HKV).to(tl.int64)
    kh = (pid_bh % HKV).to(tl.int64)
    n = tl.arange(0, BG)
    c = tl.arange(0, 16)
    j = tl.arange(0, 4)
    nmask = n < G4
    cb = tl.load(cb_ptr + b * sb_b + kh * sb_h + n[None, :, None] * 64 + c[:, None, None] * 4 + j[None, None, :],
                 mask=nmask[None, :, None], other=0.0).to(tl.float32)
    qbase = q_ptr + b * sq_b + pid_q * sq_t + (n * 4)[:, None] + j[None, :]
    return cb, qbase, nmask, b, kh


@triton.jit
def _query_table(cb, qbase, nmask, head0, sq_h, NH: tl.constexpr, BG: tl.constexpr):
    """Table ``q_g . codebook[g, c]`` float32 [16, BG] of the sum of query heads head0 .. head0+NH-1
    (NH = G: the GQA group's summed query; NH = 1: one head)."""
    qs = tl.zeros([BG, 4], tl.float32)
    for h in tl.static_range(NH):
        qs += tl.load(qbase + (head0 + h) * sq_h, mask=nmask[:, None], other=0.0).to(tl.float32)
    return tl.sum(cb * qs[None, :, :], axis=2)


@triton.jit
def _lut_score_kernel(
    q_ptr, codes_ptr, cb_ptr, out_ptr, TC, HKV, G4, NW,
    sq_b, sq_h, sq_t, sc_b, sc_h, sc_t, sb_b, sb_h, so_b, so_h, so_t,
    G: tl.constexpr, BG: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, ITERS: tl.constexpr, MAX: tl.constexpr,
    WORDS: tl.constexpr, USE_GATHER: tl.constexpr,
):
    """One program: ITERS blocks of BT tokens of one (batch, KV head, query token), one table.
    WORDS: codes read as [BT, BW] int32 words (NW per token, coalesced) and unpacked to nibbles
    (group n = nibble n % 8 of word n // 8); otherwise one byte per group (byte n // 2)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_q = tl.program_id(2)
    cb, qbase, nmask, b, kh = _codebook_and_query(cb_ptr, q_ptr, pid_bh, pid_q, HKV, G4, sq_b, sq_t, sb_b, sb_h, BG)
    n = tl.arange(0, BG)
    if not MAX:
        lut_t = _query_table(cb, qbase, nmask, kh * G, sq_h, G, BG)  # [16, BG]
    for it in tl.static_range(ITERS):
        t = (pid_t * ITERS + it) * BT + tl.arange(0, BT)
        tmask = t < TC
        if WORDS:
            w = tl.arange(0, BW)
            k8 = tl.arange(0, 8)
            words = tl.load(codes_ptr + b * sc_b + kh * sc_h + t[:, None] * sc_t + w[None, :],
                            mask=tmask[:, None] & (w[None, :] < NW), other=0)  # [BT, BW] int32
            nib = (words[:, :, None] >> (k8 * 4)[None, None, :]) & 15  # [BT, BW, 8]
            codes = tl.reshape(nib, (BT, BW * 8))  # [BT, BG]
        else:
            byte = tl.load(codes_ptr + b * sc_b + kh * sc_h + t[:, None] * sc_t + (n // 2)[None, :],
                           mask=tmask[:, None] & nmask[None, :], other=0).to(tl.int32)  # [BT, BG]
            codes = (byte >> ((n % 2) * 4)[None, :]) & 15
        if MAX:
            score = tl.full([BT], float("-inf"), tl.float32)
            for h in tl.static_range(G):
                lut_h = _query_table(cb, qbase, nmask, kh * G + h, sq_h, 1, BG)
                score = tl.maximum(score, _lookup(lut_h, codes, nmask, USE_GATHER))
        else:
            score = _lookup(lut_t, codes, nmask, USE_GATHER)
        tl.store(out_ptr + b * so_b + kh * so_h + pid_q * so_t + t, score, mask=tmask)


@triton.jit
def _lut_table_kernel(
    q_ptr, codes_ptr, cb_ptr, tab_ptr, out_ptr, TC, HKV,
    sq_b, sq_h, sq_t, sc_b, sc_h, sc_t, sb_b, sb_h, so_b, so_h, so_t,
    G: tl.constexpr, G4: tl.constexpr, BG: tl.constexpr, NT: tl.constexpr, BT: tl.constexpr, ITERS: tl.constexpr,
    WORDS: tl.constexpr,
):
    """One program: ITERS blocks of BT tokens of one (batch, KV head, query token), one token per
    lane. The NT tables ([NT, G4, 16] float32: the summed query's when NT == 1, else one per query
    head, maxed) are built in registers, written to this program's scratch slot and read back
    through L1 (lanes of a warp look up the same group at once: one 64-byte row). WORDS: each
    token's codes are read as G4 / 8 int32 words, else as ceil(G4 / 2) bytes."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_q = tl.program_id(2)
    cb, qbase, nmask, b, kh = _codebook_and_query(cb_ptr, q_ptr, pid_bh, pid_q, HKV, G4, sq_b, sq_t, sb_b, sb_h, BG)
    n = tl.arange(0, BG)
    c = tl.arange(0, 16)
    slot = ((pid_q * tl.num_programs(1) + pid_bh) * tl.num_programs(0) + pid_t).to(tl.int64)
    tab = tab_ptr + slot * (NT * G4 * 16)
    for h in tl.static_range(NT):  # NT == 1: the summed query's table; else one per query head
        lut_h = _query_table(cb, qbase, nmask, kh * G + h, sq_h, G if NT == 1 else 1, BG)
        tl.store(tab + (h * G4 + n[None, :]) * 16 + c[:, None], lut_h, mask=nmask[None, :])
    tl.debug_barrier()
    for it in tl.static_range(ITERS):
        t = (pid_t * ITERS + it) * BT + tl.arange(0, BT)
        tmask = t < TC
        row = codes_ptr + b * sc_b + kh * sc_h + t * sc_t  # [BT]
        score = tl.full([BT], float("-inf"), tl.float32)
        for h in tl.static_range(NT):
            s = tl.zeros([BT], tl.float32)
            if WORDS:
                for k in tl.static_range(G4 // 8):
                    w = tl.load(row + k, mask=tmask, other=0)
                    for i in tl.static_range(8):
                        s += tl.load(tab + (h * G4 + k * 8 + i) * 16 + ((w >> (4 * i)) & 15))
            else:
                for k in tl.static_range((G4 + 1) // 2):
                    byte = tl.load(row + k, mask=tmask, other=0).to(tl.int32)
                    s += tl.load(tab + (h * G4 + 2 * k) * 16 + (byte & 15))
                    if 2 * k + 1 < G4:
                        s += tl.load(tab + (h * G4 + 2 * k + 1) * 16 + (byte >> 4))
            score = tl.maximum(score, s)
        tl.store(out_ptr + b * so_b + kh * so_h + pid_q * so_t + t, score, mask=tmask)


LOOKUPS = ("table", "gather", "onehot")


def lut_scores_kernel(q: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, gqa: str = "sum", lookup: str = "table",
                      block_tokens: int | None = None, iters: int | None = None, num_warps: int = 4, maxnreg: int | None = None) -> torch.Tensor:
    """LUT scores ``[B, Hkv, Tq, Tc]`` float32 (see the module docstring). With ``gqa="sum"`` the
    table is built once from the summed query of the group (the sum of the per-head tables).
    ``lookup``: ``"table"`` (default) one token per lane, the tables in a scratch slot read through
    L1; ``"gather"`` a register table and ``tl.gather``; ``"onehot"`` a one-hot sum (slowest).
    ``block_tokens``: tokens per step (default 256 for the table, 64 with gather, 32 one-hot); at
    most ``iters`` steps per program (default 8 for the table, else 16; one table per program;
    fewer when that would leave under about 4 programs per SM). Codes are read as 32-bit words when D is a multiple of 32 and each
    token's codes are contiguous and 4-byte aligned, else one byte per group. ``maxnreg``: register
    cap per thread (CUDA; a tuning knob)."""
    if gqa not in ("sum", "max"):
        raise UsageError(f"gqa must be sum or max, got {gqa!r}")
    if lookup not in LOOKUPS:
        raise UsageError(f"lookup must be one of {', '.join(LOOKUPS)}, got {lookup!r}")
    if codebook.ndim != 5 or tuple(codebook.shape[3:]) != (16, 4):
        raise UsageError(f"codebook must be [batch, kv_heads, head_dim/4, 16, 4], got {list(codebook.shape)}")
    b, hkv, g4 = codebook.shape[:3]
    check_query(q, b, hkv, 4 * g4, codebook.dtype)
    nbytes = (g4 + 1) // 2
    if codes.ndim != 4 or codes.dtype != torch.uint8 or tuple(codes.shape[:2]) != (b, hkv) or codes.shape[3] != nbytes:
        raise UsageError(f"codes must be uint8 [{b}, {hkv}, tokens, {nbytes}], got {codes.dtype} {list(codes.shape)}")
    device = check_device(q=q, codes=codes, codebook=codebook)
    codebook = codebook.contiguous()
    codes = codes if codes.stride(3) == 1 else codes.contiguous()
    aligned = codes.stride(2) % 4 == 0 and codes.storage_offset() % 4 == 0 and codes.data_ptr() % 4 == 0
    words = nbytes % 4 == 0 and g4 % 8 == 0 and aligned
    tc, tq, h = codes.shape[2], q.shape[2], q.shape[1]
    out = torch.empty(b, hkv, tq, tc, dtype=torch.float32, device=device)
    if tc == 0 or tq == 0:
        return out
    nw = nbytes // 4 if words else 0
    bw = triton.next_power_of_2(nw) if words else 1
    bg = bw * 8 if words else max(2, triton.next_power_of_2(g4))
    src = codes.view(torch.int32) if words else codes  # [B, Hkv, Tc, nbytes / 4] when words
    block_tokens = block_tokens or {"table": 256, "gather": 64, "onehot": 32}[lookup]
    iters = iters or (8 if lookup == "table" else 16)
    bt = max(16, min(triton.next_power_of_2(block_tokens), triton.next_power_of_2(tc)))
    if device.type == "cuda":
        # keep about 4 programs per SM: fewer token blocks per program when there are few heads
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        iters = min(iters, max(1, triton.cdiv(tc, bt) * b * hkv * tq // (4 * sms)))
    iters = max(1, min(iters, triton.cdiv(tc, bt)))
    grid = (triton.cdiv(tc, bt * iters), b * hkv, tq)
    strides = (q.stride(0), q.stride(1), q.stride(2), src.stride(0), src.stride(1), src.stride(2),
               codebook.stride(0), codebook.stride(1), out.stride(0), out.stride(1), out.stride(2))
    launch = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg and device.type == "cuda" else {})}
    if lookup == "table":
        nt = 1 if gqa == "sum" else h // hkv
        scratch = torch.empty(grid[0] * grid[1] * grid[2], nt * g4 * 16, dtype=torch.float32, device=device)
        _lut_table_kernel[grid](q, src, codebook, scratch, out, tc, hkv, *strides,
                                G=h // hkv, G4=g4, BG=max(2, triton.next_power_of_2(g4)), NT=nt, BT=bt, ITERS=iters,
                                WORDS=words, **launch)
        return out
    _lut_score_kernel[grid](
        q, src, codebook, out, tc, hkv, g4, nw, *strides,
        G=h // hkv, BG=bg, BW=bw, BT=bt, ITERS=iters, MAX=gqa == "max", WORDS=words, USE_GATHER=lookup == "gather",
        **launch,
    )
    return out


# ----------------------------------------------------------------------------- fused attention


@triton.jit
def _to_dtype(x, like, UPCAST: tl.constexpr):
    """float32 x rounded to the dtype of tensor ``like`` (nearest even). UPCAST (bfloat16 on the CPU interpreter, whose
    float32 -> bfloat16 cast truncates) rounds with integer arithmetic and keeps float32 storage."""
    if UPCAST:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(like.dtype)


@triton.jit
def _token_qparams(qp_ptr, r, NGRP, qgrp, lm, tmask, NG: tl.constexpr):
    """(scale, zero) float32 [BT, DP] of each element's quantisation group, rows r [BT, 1]. NG > 0
    (NG == NGRP groups per token): NG per-token loads of each, spread by group (far fewer loads);
    else one load per element."""
    if NG > 0:
        sc = tl.zeros(lm.shape, tl.float32)
        zp = tl.zeros(lm.shape, tl.float32)
        for gi in tl.static_range(NG):
            p = qp_ptr + (r * NGRP + gi) * 2  # [BT, 1]
            sel = qgrp == gi
            sc = tl.where(sel, tl.load(p, mask=tmask[:, None], other=0.0).to(tl.float32), sc)
            zp = tl.where(sel, tl.load(p + 1, mask=tmask[:, None], other=0.0).to(tl.float32), zp)
        return sc, zp
    else:
        p = qp_ptr + (r * NGRP + qgrp) * 2
        return tl.load(p, mask=lm, other=0.0).to(tl.float32), tl.load(p + 1, mask=lm, other=0.0).to(tl.float32)


@triton.jit
def _signvq_attention_kernel(
    q_ptr, idx_ptr, codes_ptr, mag_ptr, kqp_ptr, vq_ptr, vqp_ptr, center_ptr, alpha_ptr, fk_ptr, fv_ptr, out_ptr, lse_ptr,
    scale_log2, K, TPS, SC, S, HKV, TQ, D, TC, NB, NQB, NGRP, F,
    sq_b, sq_h, sq_t, si_b, si_h, si_t,
    G: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr, BITS: tl.constexpr, QG: tl.constexpr,
    NG: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program, all G query heads of one (batch, KV head, query token). Splits below SC: the
    chosen compressed tokens [split*TPS, (split+1)*TPS), dequantised in the load; splits SC..S-1:
    full-precision tokens [(split-SC)*TPS, ...) of F. The per-token tensors are contiguous
    [B*Hkv*Tc, row]: codes NB bytes, mag and values NQB bytes, qparams NGRP (scale, zero) pairs;
    centre and alpha [B*Hkv, D]; full keys / values [B*Hkv, F, D]."""
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_t = tl.program_id(2)
    b = pid_bh // HKV
    kh = pid_bh % HKV
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    dmask = d < D
    q = tl.load(q_ptr + b * sq_b + (kh * G + g)[:, None] * sq_h + pid_t * sq_t + d[None, :], mask=(g < G)[:, None] & dmask[None, :], other=0.0)
    center = tl.load(center_ptr + pid_bh * D + d, mask=dmask, other=0.0).to(tl.float32)
    alpha = tl.load(alpha_ptr + pid_bh * D + d, mask=dmask, other=0.0).to(tl.float32)
    levels: tl.constexpr = (1 << BITS) - 1
    sbit = (d % 8)[None, :]
    qbyte = (d * BITS // 8)[None, :]
    qshift = ((d * BITS) % 8)[None, :]
    qgrp = (d // QG)[None, :]
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    start = pid_s * TPS
    end = tl.minimum(start + TPS, K)
    if pid_s >= SC:  # full-precision tokens: no chosen token in this split
        end = start
    for t0 in range(start, end, BT):
        ti = t0 + tl.arange(0, BT)
        tmask = ti < end
        tok = tl.load(idx_ptr + b * si_b + kh * si_h + pid_t * si_t + ti, mask=tmask, other=0)
        r = (pid_bh.to(tl.int64) * TC + tok.to(tl.int64))[:, None]  # [BT, 1] token rows
        lm = tmask[:, None] & dmask[None, :]
        sbyte = tl.load(codes_ptr + r * NB + (d // 8)[None, :], mask=lm, other=0).to(tl.int32)
        sign = ((sbyte >> sbit) & 1).to(tl.float32) * 2.0 - 1.0
        mcode = ((tl.load(mag_ptr + r * NQB + qbyte, mask=lm, other=0).to(tl.int32) >> qshift) & levels).to(tl.float32)
        ksc, kzp = _token_qparams(kqp_ptr, r, NGRP, qgrp, lm, tmask, NG)
        mag = mcode * ksc + kzp
        k = _to_dtype(center[None, :] + sign * alpha[None, :] * mag, q, UPCAST)  # [BT, DP]
        vcode = ((tl.load(vq_ptr + r * NQB + qbyte, mask=lm, other=0).to(tl.int32) >> qshift) & levels).to(tl.float32)
        vsc, vzp = _token_qparams(vqp_ptr, r, NGRP, qgrp, lm, tmask, NG)
        v = _to_dtype(vcode * vsc + vzp, q, UPCAST)
        m_i, l_i, acc = _attend_block(q, tl.trans(k), v, tmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    fstart = (pid_s - SC) * TPS
    fend = tl.minimum(fstart + TPS, F)
    if pid_s < SC:
        fend = fstart
    for t0 in range(fstart, fend, BT):
        ti = t0 + tl.arange(0, BT)
        tmask = ti < fend
        r = (pid_bh.to(tl.int64) * F + ti)[:, None] * D
        lm = tmask[:, None] & dmask[None, :]
        k = tl.load(fk_ptr + r + d[None, :], mask=lm, other=0.0)
        v = tl.load(fv_ptr + r + d[None, :], mask=lm, other=0.0)
        m_i, l_i, acc = _attend_block(q, tl.trans(k), v, tmask[None, :], m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST)
    prow = (pid_bh * TQ + pid_t) * S + pid_s
    _store_partial(out_ptr, lse_ptr, prow, acc, m_i, l_i, g, d, GP, DP)


SIGNVQ_TENSORS = ("index.codes", "keys.mag", "keys.qparams", "values.q", "values.qparams", "keys.center", "keys.alpha")


def check_encoded(q: torch.Tensor, enc: EncodedLike) -> None:
    """Shapes and dtypes of the encoded layer against its metadata and q; UsageError naming the
    first tensor that disagrees (raised before any launch)."""
    t, m = enc.tensors, enc.meta
    for name in SIGNVQ_TENSORS + ("index.codebook", "full.keys", "full.values", "full.positions"):
        if name not in t:
            raise UsageError(f"encoded layer lacks tensor {name!r}")
    b, hkv, tc = t["keys.mag"].shape[:3]
    d, bits = m["head_dim"], m["bits"]
    dtype = t["full.keys"].dtype
    group = m["group"]
    want = {
        "index.codes": ((b, hkv, tc, (d // 4 + 1) // 2), torch.uint8),
        "keys.mag": ((b, hkv, tc, d * bits // 8), torch.uint8),
        "values.q": ((b, hkv, tc, d * bits // 8), torch.uint8),
        "keys.qparams": ((b, hkv, tc, d // group, 2), dtype),
        "values.qparams": ((b, hkv, tc, d // group, 2), dtype),
        "keys.center": ((b, hkv, d), dtype),
        "keys.alpha": ((b, hkv, d), dtype),
    }
    for name, (shape, dt) in want.items():
        if tuple(t[name].shape) != shape or t[name].dtype != dt:
            raise UsageError(f"{name} is {t[name].dtype} {list(t[name].shape)}; expected {dt} {list(shape)}")
    if tc != m["compressed_tokens"]:
        raise UsageError(f"keys.mag holds {tc} tokens but the metadata says {m['compressed_tokens']}")
    check_query(q, b, hkv, d, dtype)


def signvq_partials(q: torch.Tensor, enc: EncodedLike, idx: torch.Tensor, scale: float | None, splits: int | None, with_full: bool,
                     block_tokens: int = 16, num_warps: int = 4, maxnreg: int | None = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`_signvq_attention_kernel`: raw split partials (out ``[B, Hkv, Tq, S, GP, DP]``,
    lse ``[B, Hkv, Tq, S, GP]`` float32) over the tokens of ``idx`` and, with ``with_full``, the
    full-precision tokens in extra splits (checked inputs). ``maxnreg``: register cap (CUDA; 128 by
    default: unbounded, ptxas takes 189 registers and only two programs fit on an SM)."""
    t, m = enc.tensors, enc.meta
    b, hkv, tc = t["keys.mag"].shape[:3]
    h, tq, d = q.shape[1], q.shape[2], q.shape[3]
    device = q.device
    k = idx.shape[3]
    ten = {n: t[n].contiguous() for n in SIGNVQ_TENSORS}
    ngrp = ten["keys.qparams"].shape[3]
    full_k, full_v = (t["full.keys"].contiguous(), t["full.values"].contiguous()) if with_full else (ten["keys.center"], ten["keys.center"])
    f = full_k.shape[2] if with_full else 0
    g = h // hkv
    gp = max(16, triton.next_power_of_2(g))
    dp = max(16, triton.next_power_of_2(d))
    bt = max(16, triton.next_power_of_2(block_tokens))
    blocks = -(-k // bt) + -(-f // bt)
    if splits is None:
        # about 4 programs per SM, 8 when there are 32 rows or more (16% faster at batch 8 / 32k on the
        # H100 with the register cap; batch 1 is slower with more)
        s = min(num_splits(b * hkv * tq, blocks, device) * (2 if b * hkv * tq >= 32 else 1), max(blocks, 1))
    else:
        s = max(1, int(splits))
    tps = bt * max(1, -(-(k + f) // (bt * s)))
    sc = max(1, -(-k // tps)) if k else (0 if f else 1)
    s = sc + -(-f // tps)
    out = torch.empty(b, hkv, tq, s, gp, dp, dtype=torch.float32, device=device)
    lse = torch.empty(b, hkv, tq, s, gp, dtype=torch.float32, device=device)
    scale = default_scale(d) if scale is None else scale
    prec, upcast = dot_flags(q.dtype, device)
    _signvq_attention_kernel[(s, b * hkv, tq)](
        q, idx, ten["index.codes"], ten["keys.mag"], ten["keys.qparams"], ten["values.q"], ten["values.qparams"],
        ten["keys.center"], ten["keys.alpha"], full_k, full_v, out, lse,
        float(scale) * LOG2E, k, tps, sc, s, hkv, tq, d, tc,
        ten["index.codes"].shape[3], ten["keys.mag"].shape[3], ngrp, f,
        q.stride(0), q.stride(1), q.stride(2), idx.stride(0), idx.stride(1), idx.stride(2),
        G=g, GP=gp, DP=dp, BT=bt, BITS=m["bits"], QG=m["group"], NG=ngrp if ngrp <= 4 else 0, DOT_PREC=prec, UPCAST=upcast,
        num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg and q.is_cuda else {}),
    )
    return out, lse


def signvq_attention(q: torch.Tensor, enc: EncodedLike, idx: torch.Tensor, scale: float | None = None, splits: int | None = None,
                     block_tokens: int = 16, num_warps: int = 4, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial over the compressed tokens listed in ``idx`` int32 ``[B, Hkv, Tq, k]`` (distinct
    entries in 0..Tc-1, checked unless ``check=False``, for top-k output), dequantised in the
    kernel (see the module docstring). ``splits``: programs per (batch, KV head, query) row
    (default: about 4 programs per SM, 8 from 32 rows up); ``block_tokens``: tokens per inner step. The splits are
    merged by :func:`kvtool.kernels.pages.combine_splits`."""
    check_encoded(q, enc)
    t = enc.tensors
    b, hkv, tc = t["keys.mag"].shape[:3]
    tq = q.shape[2]
    if idx.ndim != 4 or tuple(idx.shape[:3]) != (b, hkv, tq) or idx.dtype != torch.int32:
        raise UsageError(f"idx must be int32 [{b}, {hkv}, {tq}, k], got {idx.dtype} {list(idx.shape)}")
    check_device(q=q, idx=idx, **{n.replace(".", "_"): t[n] for n in SIGNVQ_TENSORS})
    k = idx.shape[3]
    if check and k and (int(idx.min()) < 0 or int(idx.max()) >= tc):
        raise UsageError(f"idx holds a token index outside 0..{tc - 1}")
    if check and k > 1 and bool((idx.sort(-1).values.diff(dim=-1) == 0).any()):
        raise UsageError("idx lists a token twice for one query")
    out, lse = signvq_partials(q, enc, idx, scale, splits, False, block_tokens, num_warps)
    return combine_splits(out, lse, q.shape[1], q.shape[3])


# ----------------------------------------------------------------------------- the format's decode step


