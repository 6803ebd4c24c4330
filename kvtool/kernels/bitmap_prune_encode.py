"""Per-token magnitude pruning and bitmap encoding in one GPU launch, beside its torch reference.

:func:`prune_encode` ``(x, kind, keep, backend="auto") -> BitmapTensor``: ``x`` ``[B, Hkv, Tc, D]``
float16 / bfloat16 / float32 dense keys or values; every token keeps its ``keep`` largest ``|x|``
(equal magnitudes: the lower channel first, the choice of a stable descending sort) and the rest
become +0.0; the result is the bitmap layout of :mod:`.bitmap_layout` in orientation ``kind``
("values": token tiles, "keys": channel tiles; layout version 2 stores keys as token tiles). Both
backends give the bytes of :func:`prune_encode_reference`, which prunes in torch and encodes with
:func:`.bitmap_compress.encode_torch` (so a kept +0.0 is not stored, a kept -0.0 is).

Backends:

- ``cuda`` (:file:`bitmap_prune_encode.cu`, built on first use): one launch, one program per
  64-token block; the thread of a token finds its keep-th largest magnitude by bisection over the
  15-bit magnitude patterns, builds the keep mask and writes the bitmaps, the packed run and the
  offsets. Exactly ``keep`` elements per token fix every block's place in ``nz`` from the shapes,
  so nothing waits on the host between passes; one flag read after the launch says whether a block stored fewer (a
  token with fewer than ``keep`` non-zero patterns: the runs are then compacted, :func:`compact_runs`)
  or met a NaN (then the torch path runs). float16 / bfloat16 CUDA tensors with head_dim 64, 128
  or 256.
- ``torch``: :func:`prune_encode_reference`, any device and dtype.
- ``auto``: cuda where it can run, else torch.

Timings against copy bandwidth: ``kvtool bench compress`` (docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvtool.core.errors import UsageError
from kvtool.core.selection import magnitude_keep
from kvtool.kernels.bitmap_compress import check_input, encode_torch
from kvtool.kernels.bitmap_layout import TILE, BitmapTensor, align_elements
from kvtool.kernels.common import cuda_extension, interpreting

BACKENDS = ("auto", "torch", "cuda")
CUDA_HEAD_DIMS = (64, 128, 256)
_SOURCE = Path(__file__).with_name("bitmap_prune_encode.cu")


def prune_encode_reference(x: torch.Tensor, kind: str, keep: int) -> BitmapTensor:
    """Torch reference: prune ``x`` ``[B, Hkv, Tc, D]`` to ``keep`` elements per token, then encode."""
    _check(x, kind, keep)
    return encode_torch(x.masked_fill(~magnitude_keep(x, keep), 0), kind)


def _check(x: torch.Tensor, kind: str, keep: int) -> None:
    check_input(x, kind)
    if not 0 <= keep <= x.shape[-1]:
        raise UsageError(f"keep must be between 0 and head_dim {x.shape[-1]}, got {keep}")


def can_run_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda and not interpreting() and x.dtype in (torch.float16, torch.bfloat16) and x.shape[-1] in CUDA_HEAD_DIMS


def pick_backend(x: torch.Tensor, backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise UsageError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "cuda" and not can_run_cuda(x):
        raise UsageError(f"the cuda backend needs float16/bfloat16 CUDA tensors (not under TRITON_INTERPRET) with head_dim in {CUDA_HEAD_DIMS}")
    if backend == "auto":
        return "cuda" if can_run_cuda(x) else "torch"
    return backend


def head_span(tokens: int, keep: int, align: int) -> int:
    """Elements of ``nz`` one KV head takes when every token stores ``keep``: full blocks of
    ``64 * keep`` (a multiple of 8, so already aligned) and the last block's run padded to ``align``."""
    nb = -(-tokens // TILE)
    if nb == 0:
        return 0
    tail = tokens - (nb - 1) * TILE
    return (nb - 1) * TILE * keep + -(-tail * keep // align) * align


def run_starts(batch_heads: int, tokens: int, keep: int, align: int, device="cpu") -> torch.Tensor:
    """The offsets (int64 ``[batch_heads * NB + 1]``) when every token stores ``keep`` elements:
    what the CUDA kernel writes, spelled out in torch."""
    nb = -(-tokens // TILE)
    if nb == 0:
        return torch.zeros(1, dtype=torch.int64, device=device)
    g = torch.arange(batch_heads * nb + 1, dtype=torch.int64, device=device)
    return (g // nb) * head_span(tokens, keep, align) + (g % nb) * TILE * keep


def compact_runs(nz: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of ``counts[g]`` elements at ``starts[g]`` of ``nz`` -> (packed ``nz``, offsets), each run
    padded with zeros to a multiple of ``align``: the layout when some block stored fewer elements
    than its place in ``nz`` left room for."""
    counts = counts.to(torch.int64)
    padded = (counts + align - 1) // align * align
    offsets = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    pos = torch.arange(int(offsets[-1]), device=nz.device)
    block = torch.searchsorted(offsets, pos, right=True) - 1
    inner = pos - offsets[block]
    stored = inner < counts[block]
    src = torch.where(stored, starts[block] + inner, torch.zeros_like(inner))
    packed = torch.where(stored, nz[src], torch.zeros((), dtype=nz.dtype, device=nz.device))
    return packed, offsets


def _cuda_extension():
    """The CUDA backend (:func:`kvtool.kernels.common.cuda_extension`: built on first use, cached)."""
    return cuda_extension("bitmap_prune_encode", [_SOURCE])


def prune_encode(x: torch.Tensor, kind: str, keep: int, backend: str = "auto") -> BitmapTensor:
    """Prune ``x`` ``[B, Hkv, Tc, D]`` to ``keep`` elements per token and encode it (module doc)."""
    _check(x, kind, keep)
    if pick_backend(x, backend) == "torch":
        return prune_encode_reference(x, kind, keep)
    b, h, tc, d = x.shape
    nb = -(-tc // TILE)
    align = align_elements(x.dtype)
    head = head_span(tc, keep, align)
    offsets = (torch.empty if b * h * nb else torch.zeros)(b * h * nb + 1, dtype=torch.int64, device=x.device)  # the kernel writes it
    shape = (b, h, tc, d // TILE) if kind == "values" else (b, h, nb, d)
    bitmaps = torch.empty(shape, dtype=torch.int64, device=x.device)
    nz = torch.empty(b * h * head, dtype=x.dtype, device=x.device)
    counts = torch.empty(b * h * nb, dtype=torch.int32, device=x.device)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    xc = x.contiguous()
    xc = xc if xc.data_ptr() % 16 == 0 else xc.clone()
    if b * h * nb:
        _cuda_extension().prune_encode(
            xc.view(torch.int16).view(b * h, tc, d), bitmaps, nz.view(torch.int16), offsets, counts, flag, keep, head,
            kind == "keys", torch.cuda.current_stream(x.device).cuda_stream,
        )
    state = int(flag.item())  # the one host read, after the launch
    if state & 2:
        return prune_encode_reference(x, kind, keep)
    if state & 1:
        nz, offsets = compact_runs(nz, offsets[:-1], counts, align)
    return BitmapTensor(kind, nz, bitmaps, offsets, tc, d)
