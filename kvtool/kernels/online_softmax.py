"""The online-softmax step shared by kvtool's flash-decoding style Triton kernels."""

from __future__ import annotations

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
