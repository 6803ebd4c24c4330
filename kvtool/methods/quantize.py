"""Low-bit quantisation building blocks: exact bit packing and asymmetric uniform group quantisation.

Bit packing (:func:`pack_codes` / :func:`unpack_codes`): codes ``uint8 [..., n]`` with values below
``2**bits`` are packed along the last axis into ``uint8 [..., ceil(n * bits / 8)]``, little-endian
inside each byte: 2-bit codes four to a byte (element ``j`` in bits ``2*(j%4) .. 2*(j%4)+1`` of byte
``j//4``), 4-bit codes two to a byte (even elements in the low nibble), 8-bit codes one to a byte.
A last byte that is not filled is padded with zero bits (and counted: it is stored).

Group quantisation (:func:`quantize_groups` / :func:`dequantize_groups`): elements ``x [N]`` carry a
group index ``[N]`` in ``0 .. n_groups-1``; each group gets a zero point ``z`` (its minimum, rounded
*down* to the stored scale dtype) and a scale ``s = (max - z) / (2**bits - 1)`` (rounded *up* to the
stored dtype), codes ``q = clamp(round((x - z) / s), 0, 2**bits - 1)`` and ``x_hat = q * s + z``
(float32). Rounding the stored z down and s up keeps every element inside the representable range,
so ``|x - x_hat| <= s / 2`` holds for the *stored* scale (up to float32 rounding). A group whose
elements are all equal has ``s = 0`` and codes 0 (``x_hat = z``, exact when z is representable).

Symmetric per-row references (:func:`quantize_int8` / :func:`quantize_fp8`): one scale per row (the
last axis), ``s = max|x| / 127`` (int8 codes, round to nearest, clamp to [-127, 127]) or
``s = max|x| / 448`` (float8 e4m3fn codes, the largest finite e4m3 value is 448), scale rounded up.
"""

from __future__ import annotations

import math

import torch

from kvtool.core.errors import UsageError

BITS = (2, 4, 8)
FP8_MAX = 448.0  # largest finite float8 e4m3fn value
FP16_SAFE = 60000.0  # below float16's 65504: scales and zero points fit float16


def check_bits(bits: int) -> int:
    """UsageError unless ``bits`` is one of 2, 4, 8."""
    if bits not in BITS:
        raise UsageError(f"--bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    return bits


def packed_length(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits take when packed: ``ceil(n * bits / 8)``."""
    return (n * bits + 7) // 8


def _check_pack_bits(bits: int) -> None:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"codes pack at 1, 2, 4 or 8 bits, not {bits}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``uint8 [..., n]`` codes (each below ``2**bits``) along the last axis into ``uint8
    [..., ceil(n * bits / 8)]`` (layout in the module docstring; ``bits=1`` packs bitmaps, element
    ``j`` in bit ``j % 8`` of byte ``j // 8``)."""
    _check_pack_bits(bits)
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    per = 8 // bits
    n = codes.shape[-1]
    pad = (-n) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], dim=-1)
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8 [..., m]`` -> ``uint8 [..., n]`` (``n <= m * 8 / bits``)."""
    _check_pack_bits(bits)
    if bits == 8:
        return packed[..., :n]
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :n].to(torch.uint8)


def scale_dtype_for(x: torch.Tensor) -> torch.dtype:
    """float16 for scales and zero points, float32 when ``|x|`` reaches float16's range."""
    if x.numel() and float(x.float().abs().max()) >= FP16_SAFE:
        return torch.float32
    return torch.float16


def round_to_dtype(x: torch.Tensor, dtype: torch.dtype, direction: str) -> torch.Tensor:
    """float32 ``x`` as ``dtype``, rounded ``"down"`` (result <= x) or ``"up"`` (result >= x)."""
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    toward = torch.full_like(y, float("-inf") if direction == "down" else float("inf"))
    wrong = (y.float() > x) if direction == "down" else (y.float() < x)
    return torch.where(wrong, torch.nextafter(y, toward), y)


def quantize_groups(x: torch.Tensor, group_index: torch.Tensor, n_groups: int, bits: int, scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantisation of ``x [N]`` (any float dtype) in groups.

    ``group_index``: int64 ``[N]`` in ``0 .. n_groups-1`` (every group should have an element).
    Returns codes ``uint8 [N]``, scales ``[n_groups]`` and zero points ``[n_groups]`` in
    ``scale_dtype``. See the module docstring for the maths and the error bound."""
    check_bits(bits)
    xf = x.reshape(-1).float()
    idx = group_index.reshape(-1).to(torch.int64)
    lo = torch.full((n_groups,), float("inf"), device=x.device).scatter_reduce(0, idx, xf, "amin")
    hi = torch.full((n_groups,), float("-inf"), device=x.device).scatter_reduce(0, idx, xf, "amax")
    empty = ~torch.isfinite(lo)
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    levels = (1 << bits) - 1
    zero = round_to_dtype(lo, scale_dtype, "down")
    span = hi - zero.float()
    # a tensor divisor: torch on CUDA divides by a Python scalar through its reciprocal, which moves
    # a scale by one ulp against IEEE division (the CPU's, and the Triton absorb kernel's)
    scale = round_to_dtype(span / torch.full_like(span, levels), scale_dtype, "up")
    s = scale.float()[idx]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((xf - zero.float()[idx]) / safe).clamp_(0, levels)
    q = torch.where(s > 0, q, torch.zeros_like(q))
    return q.to(torch.uint8), scale, zero


def dequantize_groups(codes: torch.Tensor, group_index: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``codes`` uint8 ``[N]`` -> float32 ``[N]``: ``q * scale[g] + zero[g]``."""
    idx = group_index.reshape(-1).to(torch.int64)
    return codes.reshape(-1).float() * scales.float()[idx] + zeros.float()[idx]


def row_groups(rows: int, length: int, group: int, device=None) -> tuple[torch.Tensor, int]:
    """Group indices for a dense ``[rows, length]`` block grouped along the row in runs of
    ``group`` (the last run of a row shorter when ``group`` does not divide ``length``):
    int64 ``[rows * length]`` and the number of groups ``rows * ceil(length / group)``."""
    per_row = math.ceil(length / group) if length else 0
    col = torch.arange(length, device=device) // group
    idx = (torch.arange(rows, device=device)[:, None] * per_row + col[None, :]).reshape(-1)
    return idx, rows * per_row


def masked_row_groups(mask: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a bool ``mask [rows, length]``: the group index of every kept element, in row-major
    order (int64 ``[mask.sum()]``: runs of ``group`` kept elements inside each row, the last run of a
    row shorter), and the groups per row (int64 ``[rows]`` = ``ceil(kept_in_row / group)``)."""
    counts = mask.sum(1)
    per_row = (counts + group - 1) // group
    base = torch.cumsum(per_row, 0) - per_row
    rank = torch.cumsum(mask.to(torch.int64), 1) - 1
    gidx = base[:, None] + rank // group
    return gidx[mask], per_row


def quantize_symmetric(x: torch.Tensor, kind: str, scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric quantisation of ``x [..., L]`` (one scale per row of the last axis).

    ``kind="int8"``: codes ``int8 [..., L]``; ``kind="fp8"``: codes ``uint8 [..., L]`` holding
    float8 e4m3fn bit patterns. Scales ``[...]`` in ``scale_dtype`` (default: the dtype
    :func:`scale_dtype_for` picks for ``x``)."""
    top = 127.0 if kind == "int8" else FP8_MAX
    xf = x.float()
    sdt = scale_dtype_for(x) if scale_dtype is None else scale_dtype
    scale = round_to_dtype(xf.abs().amax(-1) / top, sdt, "up") if xf.shape[-1] else torch.zeros(xf.shape[:-1], dtype=sdt, device=xf.device)
    s = scale.float()[..., None]
    y = xf / torch.where(s > 0, s, torch.ones_like(s))
    if kind == "int8":
        return torch.round(y).clamp_(-127, 127).to(torch.int8), scale
    return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_symmetric(codes: torch.Tensor, scales: torch.Tensor, kind: str) -> torch.Tensor:
    """Inverse of :func:`quantize_symmetric`: float32 ``[..., L]``."""
    vals = codes.float() if kind == "int8" else codes.view(torch.float8_e4m3fn).float()
    return vals * scales.float()[..., None]
