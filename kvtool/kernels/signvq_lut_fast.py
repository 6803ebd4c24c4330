"""Sign-VQ LUT scores with the table built once per program and the codes read as 32-bit words (a
variant of :func:`.signvq_lut.lut_scores_kernel`, same maths, inputs and output), written from the
bench's H100 measurements.

Measured (H100, Llama-3-8B shapes, batch 8, 32k tokens): the owner's kernel takes 90 µs for 33.9 MB
of codes and codebooks (13% of the copy bandwidth; floor 11 µs). Each program scores 128 tokens: it
rebuilds the ``[G4, 16]`` table from the 4 KB codebook for every 2 KB of codes it reads, and it loads
the packed codes one byte per lane with the lanes along tokens (16-byte stride, uncoalesced).

Here a program scores ``BT * ITERS`` tokens of one (batch, KV head, query token) with one table:

- the table ``lutT[c, n] = q_n . codebook[n, c]`` (``[16, G4]``, summed or per head over the G query
  heads of the KV head) is built once;
- the codes of a block of ``BT`` tokens are loaded as ``[BT, G4/8]`` int32 words (row-major, lanes
  along the words of a token: coalesced) and unpacked to ``[BT, G4]`` nibbles (group n is nibble
  ``n % 8`` of word ``n // 8``: byte ``n // 2``, low nibble for even n, little-endian);
- ``tl.gather(lutT, codes, axis=0)`` gives ``[BT, G4]`` table entries, summed per token.

Entry point: :func:`lut_scores_fast` (q ``[B, H, Tq, D]``, codes uint8 ``[B, Hkv, Tc, D/8]``,
codebook ``[B, Hkv, D/4, 16, 4]``, gqa ``"sum" | "max"``) -> scores ``[B, Hkv, Tq, Tc]`` float32, as
:func:`kvtool.formats.signvq.lut_scores`. Needs D a multiple of 32 (whole 32-bit code words) and
codes contiguous in their last axis; otherwise it calls the owner's kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import UsageError
from .retrieval_common import check_device, check_query
from .signvq_lut import lut_scores_kernel


@triton.jit
def _lut_fast_kernel(
    q_ptr, words_ptr, cb_ptr, out_ptr, TC, HKV, G4, NW,
    sq_b, sq_h, sq_t, sw_b, sw_h, sw_t, sb_b, sb_h, so_b, so_h, so_t,
    G: tl.constexpr, BG: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, ITERS: tl.constexpr, MAX: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_q = tl.program_id(2)
    b = (pid_bh // HKV).to(tl.int64)
    kh = (pid_bh % HKV).to(tl.int64)
    n = tl.arange(0, BG)
    c = tl.arange(0, 16)
    j = tl.arange(0, 4)
    nmask = n < G4
    # codebook as [16 codes, BG groups, 4]
    cb = tl.load(cb_ptr + b * sb_b + kh * sb_h + n[None, :, None] * 64 + c[:, None, None] * 4 + j[None, None, :],
                 mask=nmask[None, :, None], other=0.0).to(tl.float32)
    qbase = q_ptr + b * sq_b + pid_q * sq_t + (n * 4)[:, None] + j[None, :]
    w = tl.arange(0, BW)
    k8 = tl.arange(0, 8)
    if not MAX:
        qs = tl.zeros([BG, 4], tl.float32)
        for h in tl.static_range(G):
            qs += tl.load(qbase + (kh * G + h) * sq_h, mask=nmask[:, None], other=0.0).to(tl.float32)
        lut_t = tl.sum(cb * qs[None, :, :], axis=2)  # [16, BG]
    for it in tl.static_range(ITERS):
        t = (pid_t * ITERS + it) * BT + tl.arange(0, BT)
        tmask = t < TC
        words = tl.load(words_ptr + b * sw_b + kh * sw_h + t[:, None] * sw_t + w[None, :],
                        mask=tmask[:, None] & (w[None, :] < NW), other=0)  # [BT, BW] int32
        nib = (words[:, :, None] >> (k8 * 4)[None, None, :]) & 15  # [BT, BW, 8]
        codes = tl.reshape(nib, (BT, BW * 8))  # [BT, BG]: group n = word n // 8, nibble n % 8
        if MAX:
            score = tl.full([BT], float("-inf"), tl.float32)
            for h in tl.static_range(G):
                qh = tl.load(qbase + (kh * G + h) * sq_h, mask=nmask[:, None], other=0.0).to(tl.float32)
                lut_h = tl.sum(cb * qh[None, :, :], axis=2)
                vals = tl.gather(lut_h, codes, axis=0)
                score = tl.maximum(score, tl.sum(tl.where(nmask[None, :], vals, 0.0), axis=1))
        else:
            vals = tl.gather(lut_t, codes, axis=0)  # [BT, BG]
            score = tl.sum(tl.where(nmask[None, :], vals, 0.0), axis=1)
        tl.store(out_ptr + b * so_b + kh * so_h + pid_q * so_t + t, score, mask=tmask)


def lut_scores_fast(q: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, gqa: str = "sum", block_tokens: int = 64,
                    iters: int = 16, num_warps: int = 4) -> torch.Tensor:
    """LUT scores ``[B, Hkv, Tq, Tc]`` float32 (see the module docstring); ``block_tokens`` tokens per
    step, at most ``iters`` steps per program (one table per program; fewer when that would leave
    under about 4 programs per SM)."""
    if gqa not in ("sum", "max"):
        raise UsageError(f"gqa must be sum or max, got {gqa!r}")
    if codebook.ndim != 5 or tuple(codebook.shape[3:]) != (16, 4):
        raise UsageError(f"codebook must be [batch, kv_heads, head_dim/4, 16, 4], got {list(codebook.shape)}")
    b, hkv, g4 = codebook.shape[:3]
    check_query(q, b, hkv, 4 * g4, codebook.dtype)
    nbytes = (g4 + 1) // 2
    if codes.ndim != 4 or codes.dtype != torch.uint8 or tuple(codes.shape[:2]) != (b, hkv) or codes.shape[3] != nbytes:
        raise UsageError(f"codes must be uint8 [{b}, {hkv}, tokens, {nbytes}], got {codes.dtype} {list(codes.shape)}")
    device = check_device(q=q, codes=codes, codebook=codebook)
    aligned = codes.stride(3) == 1 and codes.stride(2) % 4 == 0 and codes.storage_offset() % 4 == 0 and codes.data_ptr() % 4 == 0
    if nbytes % 4 or g4 % 8 or not aligned:
        return lut_scores_kernel(q, codes, codebook, gqa)
    words = codes.view(torch.int32)  # [B, Hkv, Tc, nbytes / 4]
    codebook = codebook.contiguous()
    tc, tq, h = codes.shape[2], q.shape[2], q.shape[1]
    out = torch.empty(b, hkv, tq, tc, dtype=torch.float32, device=device)
    if tc == 0 or tq == 0:
        return out
    nw = nbytes // 4
    bw = triton.next_power_of_2(nw)
    bg = bw * 8
    bt = max(16, min(triton.next_power_of_2(block_tokens), triton.next_power_of_2(tc)))
    if device.type == "cuda":
        # keep about 4 programs per SM: fewer token blocks per program when there are few heads
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        iters = min(iters, max(1, triton.cdiv(tc, bt) * b * hkv * tq // (4 * sms)))
    iters = max(1, min(iters, triton.cdiv(tc, bt)))
    grid = (triton.cdiv(tc, bt * iters), b * hkv, tq)
    _lut_fast_kernel[grid](
        q, words, codebook, out, tc, hkv, g4, nw,
        q.stride(0), q.stride(1), q.stride(2), words.stride(0), words.stride(1), words.stride(2),
        codebook.stride(0), codebook.stride(1), out.stride(0), out.stride(1), out.stride(2),
        G=h // hkv, BG=bg, BW=bw, BT=bt, ITERS=iters, MAX=gqa == "max", num_warps=num_warps,
    )
    return out
