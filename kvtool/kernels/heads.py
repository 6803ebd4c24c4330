"""Selective head attention for one decode step (Polar Sparsity), Triton, and its torch reference.

Entry point: :func:`selective_head_attention` ``(q, keys, values, head_index, scale=None,
num_splits=None, validate=True) -> (out, lse)``

- ``q``: ``[B, H, D]`` float16 / bfloat16 (float32 works too): one decode query per sequence and head.
- ``keys``, ``values``: ``[B, Hkv, N, D]``, q's dtype and device, H a multiple of Hkv (query head h
  reads KV head ``h // G``); the last axis must be contiguous (other strides are passed through).
- ``head_index``: int32 / int64 ``[B, k]``, 1 <= k <= H: the query heads to compute for each sequence
  (distinct within a row, any order).
- returns ``out`` ``[B, H, D]`` float32 (softmax-weighted values; 0 for heads not listed) and
  ``lse`` ``[B, H]`` float32 (natural log-sum-exp of the scaled scores; -inf for heads not listed):
  the partial convention of :mod:`kvtool.core.attention`.

How it runs: grid ``(B * Hkv, S)``, S splits of the token axis (flash-decoding). Program (b, g, s)
reads the row ``head_index[b]`` and finds which of KV head g's G query heads are listed; if none, it
returns at once and **the KV head's keys and values are never read**. Otherwise it makes one pass
over its token range of that KV head (blocks of 64 tokens), scoring all listed query heads of the
group together (one read of the group's KV for however many of its heads are listed), with an online
softmax in base 2 and float32 accumulation. A second kernel, one program per (batch, query head),
merges that head's S partials (up to 32 splits per vector load, online rescaling) and writes its
row (zeros / -inf for unlisted heads), so ``out`` needs no memset. Bytes
read: the keys and values of the KV heads with at least one listed query head, see
:func:`bytes_read`.

Validation (``validate=True``, before launch): shapes, dtypes, devices, and head indices in
``0..H-1`` without repeats in a row (one device-to-host copy of a ``[B]`` flag); a wrong input
raises UsageError naming the tensor and the expected shape or dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvtool.core.attention import attend_partial, default_scale
from kvtool.core.errors import UsageError
from kvtool.kernels.common import check_device
from kvtool.kernels.online_softmax import merge_split_partials

LOG2E = 1.4426950408889634
BLOCK_N = 64
SHORT_TOKENS = 8192  # at most this many tokens: 128-token steps and one stage by default


@triton.jit
def _select_heads_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, acc_ptr, m_ptr, l_ptr,
    sqb, sqh, skb, skh, skn, svb, svh, svn,
    Hkv, N, D, K, TPS, S, scale_log2,
    G: tl.constexpr, GP: tl.constexpr, KP: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid // Hkv
    kvh = pid % Hkv
    rows = tl.arange(0, GP)
    heads = kvh * G + rows
    kk = tl.arange(0, KP)
    listed = tl.load(idx_ptr + b * K + kk, mask=kk < K, other=-1)
    sel = tl.max((listed[None, :] == heads[:, None]).to(tl.int32), axis=1) > 0
    sel = sel & (rows < G)
    if tl.max(sel.to(tl.int32), axis=0) > 0:
        c = tl.arange(0, DP)
        cmask = c < D
        q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + c[None, :], mask=sel[:, None] & cmask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        start = split * TPS
        end = tl.minimum(start + TPS, N)
        t = tl.arange(0, BN)
        kbase = k_ptr + b * skb + kvh * skh
        vbase = v_ptr + b * svb + kvh * svh
        for n0 in range(start, end, BN):
            tok = n0 + t
            tmask = tok < end
            kt = tl.load(kbase + tok[None, :].to(tl.int64) * skn + c[:, None], mask=tmask[None, :] & cmask[:, None], other=0.0)  # [DP, BN]
            if UPCAST:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt, input_precision=DOT_PREC) * scale_log2
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vbase + tok[:, None].to(tl.int64) * svn + c[None, :], mask=tmask[:, None] & cmask[None, :], other=0.0)  # [BN, DP]
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
        slot = pid * S + split
        tl.store(acc_ptr + (slot * GP + rows[:, None]) * DP + c[None, :], acc)
        tl.store(m_ptr + slot * GP + rows, m_i)
        tl.store(l_ptr + slot * GP + rows, l_i)


FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, head_index: torch.Tensor, check_values: bool = True) -> None:
    """UsageError naming the tensor and what was expected, before any launch."""
    if keys.ndim != 4:
        raise UsageError(f"keys must be [batch, kv_heads, tokens, head_dim], got shape {list(keys.shape)}")
    b, hkv, n, d = keys.shape
    if tuple(values.shape) != tuple(keys.shape):
        raise UsageError(f"values must have the shape of keys {list(keys.shape)}, got {list(values.shape)}")
    if q.ndim != 3 or q.shape[0] != b or q.shape[2] != d or q.shape[1] % hkv or q.shape[1] == 0:
        raise UsageError(f"q must be [batch={b}, heads (a multiple of {hkv}), head_dim={d}], got shape {list(q.shape)}")
    h = q.shape[1]
    if q.dtype not in FLOATS:
        raise UsageError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("keys", keys), ("values", values)):
        if t.dtype != q.dtype:
            raise UsageError(f"{name} is {t.dtype} but q is {q.dtype}; they must match")
        if t.device != q.device:
            raise UsageError(f"{name} is on {t.device} but q is on {q.device}")
    if head_index.dtype not in (torch.int32, torch.int64):
        raise UsageError(f"head_index must be int32 or int64, got {head_index.dtype}")
    if head_index.ndim != 2 or head_index.shape[0] != b or not 1 <= head_index.shape[1] <= h:
        raise UsageError(f"head_index must be [batch={b}, k] with 1 <= k <= {h}, got shape {list(head_index.shape)}")
    if head_index.device != q.device:
        raise UsageError(f"head_index is on {head_index.device} but q is on {q.device}")
    check_device(q=q)
    if check_values and head_index.numel():
        bad_range = (head_index < 0) | (head_index >= h)
        srt = head_index.sort(dim=1).values
        repeats = (srt[:, 1:] == srt[:, :-1]).any(dim=1) if head_index.shape[1] > 1 else torch.zeros(b, dtype=torch.bool, device=q.device)
        flags = torch.stack([bad_range.any(dim=1), repeats]).cpu()
        if bool(flags[0].any()):
            row = int(flags[0].nonzero()[0])
            raise UsageError(f"head_index row {row} holds a head outside 0..{h - 1}: {head_index[row].tolist()}")
        if bool(flags[1].any()):
            row = int(flags[1].nonzero()[0])
            raise UsageError(f"head_index row {row} lists a head twice: {head_index[row].tolist()}")


def _workspace(groups: int, splits: int, gp: int, dp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partials (acc ``[groups, S, GP, DP]``, m and l ``[groups, S, GP]``) float32, uninitialised:
    every program of a listed KV head writes its slot; the others' slots are never read."""
    acc = torch.empty(groups, splits, gp, dp, dtype=torch.float32, device=device)
    m = torch.empty(groups, splits, gp, dtype=torch.float32, device=device)
    l = torch.empty(groups, splits, gp, dtype=torch.float32, device=device)
    return acc, m, l


def default_splits(groups: int, tokens: int, device: torch.device, block_n: int = BLOCK_N) -> int:
    """Token-axis splits: on CUDA about 2 programs per SM under 32 KV-head groups in all (batch 1 of
    an 8-KV-head model), 4 above; 1 on the CPU interpreter. (H100: 2 per SM is 18% faster at batch 1,
    32k tokens; 4 wins from batch 32.)"""
    blocks = max(1, -(-tokens // block_n))
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = 2 if groups < 32 else 4
    return max(1, min(blocks, math.ceil(per_sm * sms / max(groups, 1))))


def selective_head_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    head_index: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    validate: bool = True,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    maxnreg: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention for the listed (batch, head) pairs only; see the module docstring.

    ``validate=False`` skips the head-index value check (its device-to-host copy), for timing loops
    over an index tensor that was validated before; shapes and dtypes are always checked.
    ``num_splits``, ``block_n`` (tokens per step, a power of two >= 16), ``num_warps``,
    ``num_stages`` and ``maxnreg`` (register cap, CUDA only) are tuning knobs. Defaults: 128-token
    steps in one stage up to ``SHORT_TOKENS`` tokens, else 64-token steps with Triton's stages (a
    graph-timed H100 sweep of steps, stages and warps: 3% faster at 4k tokens, no gain at 32k)."""
    check_inputs(q, keys, values, head_index, check_values=validate)
    b, hkv, n, d = keys.shape
    h = q.shape[1]
    g = h // hkv
    k = head_index.shape[1]
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    if values.stride(-1) != 1:
        values = values.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    idx = head_index.to(torch.int32).contiguous()
    groups = b * hkv
    if block_n is None:
        block_n = 128 if n <= SHORT_TOKENS else BLOCK_N
        num_stages = num_stages or (1 if n <= SHORT_TOKENS else None)
    if block_n < 16 or block_n & (block_n - 1):
        raise UsageError(f"block_n must be a power of two >= 16, got {block_n}")
    splits = default_splits(groups, n, q.device, block_n) if num_splits is None else int(num_splits)
    if splits < 1:
        raise UsageError(f"num_splits must be at least 1, got {num_splits}")
    tps = max(block_n, -(-max(n, 1) // splits))
    tps = -(-tps // block_n) * block_n
    splits = max(1, -(-n // tps))
    gp = max(16, triton.next_power_of_2(g))
    dp = max(16, triton.next_power_of_2(d))
    kp = max(2, triton.next_power_of_2(k))
    out = torch.empty(b, h, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, dtype=torch.float32, device=q.device)
    acc, m, l = _workspace(groups, splits, gp, dp, q.device)
    scale = default_scale(d) if scale is None else scale
    # the CPU interpreter computes bfloat16 tl.dot wrongly: there (only) bfloat16 runs in float32
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda
    prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    _select_heads_kernel[(groups, splits)](
        q, keys, values, idx, acc, m, l,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        hkv, n, d, k, tps, splits, float(scale) * LOG2E,
        G=g, GP=gp, KP=kp, DP=dp, BN=block_n, DOT_PREC=prec, UPCAST=upcast, num_warps=num_warps,
        **({"num_stages": num_stages} if num_stages else {}), **({"maxnreg": maxnreg} if maxnreg and q.is_cuda else {}),
    )
    merge_split_partials(acc, m, l, out, lse, g, listed=(idx, hkv))
    return out, lse


def selective_head_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, head_index: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of the same maths: dense attention of every head, then zeros / -inf for the
    heads not listed. Shapes as :func:`selective_head_attention`."""
    out, lse = attend_partial(q[:, :, None], keys, values, scale)
    listed = torch.zeros(q.shape[0], q.shape[1], dtype=torch.bool, device=q.device).scatter_(1, head_index.to(torch.int64), True)
    out = torch.where(listed[..., None], out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    lse = torch.where(listed, lse[:, :, 0], torch.full_like(lse[:, :, 0], float("-inf")))
    return out, lse


def bytes_read(q: torch.Tensor, keys: torch.Tensor, head_index: torch.Tensor) -> int:
    """Bytes the kernel must read: keys + values of every KV head with a listed query head, the
    listed query rows, and the index tensor (``[B, k]``). For bandwidth figures."""
    b, hkv, n, d = keys.shape
    g = q.shape[1] // hkv
    touched = torch.zeros(b, hkv, dtype=torch.bool, device=head_index.device).scatter_(1, head_index.to(torch.int64) // g, True)
    kv = int(touched.sum()) * n * d * keys.element_size() * 2
    return kv + head_index.numel() * (q.shape[2] * q.element_size() + head_index.element_size())
