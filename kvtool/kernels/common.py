"""Helpers shared by the retrieval kernels (``signvq_lut``, ``pages``): device checks before launch,
the split count, the dot-product precision flags and the flash-decoding combine of split partials."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from kvtool.core.errors import UsageError
from kvtool.core.cache import LayerKV


class EncodedLike(Protocol):
    """What a kernel wrapper reads of an encoded layer: its named tensors and metadata. Kernels take
    this shape, never a format class, so they sit below the formats."""

    tensors: Mapping[str, torch.Tensor]
    meta: Mapping[str, Any]

LOG2E = 1.4426950408889634
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def check_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, CUDA or (under ``TRITON_INTERPRET=1``) CPU; UsageError naming the
    first tensor that is not."""
    device = None
    for name, t in tensors.items():
        if device is None:
            device = t.device
            if device.type != "cuda" and not interpreting():
                raise UsageError(f"{name} is on {device}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
        elif t.device != device:
            raise UsageError(f"{name} is on {t.device} but the other inputs are on {device}")
    assert device is not None
    return device


def check_query(q: torch.Tensor, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """q must be ``[batch, a multiple of kv_heads, Tq, head_dim]`` in ``dtype``."""
    if q.ndim != 4 or q.shape[0] != batch or q.shape[1] % kv_heads or q.shape[3] != head_dim or q.shape[1] == 0:
        raise UsageError(f"q has shape {list(q.shape)}; expected [{batch}, a multiple of {kv_heads} heads, query_tokens, {head_dim}]")
    if q.dtype != dtype:
        raise UsageError(f"q is {q.dtype} but the cache is {dtype}")
    if dtype not in KERNEL_DTYPES:
        raise UsageError(f"dtype {dtype} is not supported by the kernels (float16, bfloat16, float32)")


def dot_flags(dtype: torch.dtype, device: torch.device) -> tuple[str, bool]:
    """(input precision, upcast): float32 runs IEEE products; the CPU interpreter computes bfloat16
    ``tl.dot`` wrongly, so there bfloat16 operands are upcast to float32."""
    upcast = dtype == torch.bfloat16 and device.type != "cuda"
    return ("ieee" if dtype == torch.float32 or upcast else "tf32"), upcast


_EXTENSIONS: dict[str, Any] = {}


def cuda_extension(name: str, sources: list[Path], extra_cflags: tuple[str, ...] = ("-O3",)) -> Any:
    """A CUDA extension compiled on first use for this GPU with ``torch.utils.cpp_extension.load``
    (nvcc + ninja) under ``$KVTOOL_CACHE`` (default ``~/.cache/kvtool``)/cuda-ext, keyed by the
    sources' hash (every ``.cu`` / ``.cuh`` beside the first one that shares its stem) and the GPU's
    compute capability; loaded once per process."""
    if name not in _EXTENSIONS:
        from torch.utils.cpp_extension import load

        first = sources[0]
        src = b"".join(p.read_bytes() for p in sorted(first.parent.glob(f"{first.stem}*.cu*")))
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}"
        key = hashlib.sha256(src + arch.encode()).hexdigest()[:16]
        root = Path(os.environ.get("KVTOOL_CACHE") or Path.home() / ".cache" / "kvtool")
        build = root / "cuda-ext" / f"{name}-{key}"
        build.mkdir(parents=True, exist_ok=True)
        _EXTENSIONS[name] = load(
            name=f"kvtool_{name}_{key}",
            sources=[str(s) for s in sources],
            extra_cuda_cflags=[*extra_cflags, f"-gencode=arch=compute_{arch},code=sm_{arch}"],
            build_directory=str(build),
            verbose=False,
        )
    return _EXTENSIONS[name]


def num_splits(rows: int, items: int, device: torch.device, per_split_min: int = 1) -> int:
    """How many programs share one (batch, KV head, query) row's ``items`` (tokens or pages): about
    4 programs per SM on CUDA, 1 on the interpreter; never more than the items."""
    if items <= 0:
        return 1
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, math.ceil(4 * sms / max(rows, 1)))
    return max(1, min(want, -(-items // per_split_min)))


def merge_splits(out: torch.Tensor, lse: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of the split merge (:func:`kvtool.kernels.pages.combine_splits`). Combine split partials: out ``[B, Hkv, Tq, S, GP, D]`` float32 (normalised per split) and lse
    ``[B, Hkv, Tq, S, GP]`` (natural log, -inf for an empty split; GP >= G padded head rows) ->
    (out ``[B, H, Tq, D]``, lse ``[B, H, Tq]``) with H = ``heads`` (G = H / Hkv)."""
    b, hkv, tq, s, gp, d = out.shape
    g = heads // hkv
    out, lse = out[..., :g, :], lse[..., :g]
    total = torch.logsumexp(lse, dim=3)  # [B,Hkv,Tq,G]
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    w = torch.exp(lse - safe[:, :, :, None])
    w = torch.where(torch.isfinite(lse), w, torch.zeros_like(w))
    merged = (w[..., None] * out).sum(3)  # [B,Hkv,Tq,G,D]
    return merged.permute(0, 1, 3, 2, 4).reshape(b, heads, tq, d), total.permute(0, 1, 3, 2).reshape(b, heads, tq)


def random_decode_inputs(
    batch: int, heads: int, kv_heads: int, tokens: int, head_dim: int, dtype: torch.dtype, device, seed: int
):
    """Random keys/values ``[batch, kv_heads, tokens, head_dim]`` with one planted outlier key
    channel (channel 3, x6) as a :class:`~kvtool.core.cache.LayerKV`, and a decode query
    ``[batch, heads, 1, head_dim]``, all in ``dtype`` on ``device`` (drawn on the CPU from ``seed``,
    so every device gets the same numbers)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen)
    k[..., 3] *= 6
    v = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen)
    q = torch.randn(batch, heads, 1, head_dim, generator=gen)
    layer = LayerKV(k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype))
    return q.to(device=device, dtype=dtype), layer
