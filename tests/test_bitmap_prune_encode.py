"""Per-token pruning + bitmap encoding (kvtool.kernels.bitmap_prune_encode): the torch reference
against kvtool's pruning method, the run placement and compaction on the CPU, and the CUDA kernel's
bytes against the reference on the GPU (``gpu`` marker) at odd shapes and on ties, zeros,
subnormals and NaNs."""

from __future__ import annotations

import pytest
import torch

from kvtool.core.errors import UsageError
from kvtool.kernels.bitmap_compress import encode_torch
from kvtool.kernels.bitmap_layout import align_elements
from kvtool.kernels.bitmap_prune_encode import compact_runs, head_span, prune_encode, prune_encode_reference, run_starts
from kvtool.methods.prune import keep_count, per_token_mask


def hard_input(b, h, t, d, dtype, device="cpu", seed=0):
    """Random rows plus rows full of ties, rows with few non-zeros (+0.0 and -0.0) and subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=g)
    x[:, :, 1::7] = torch.randint(-3, 4, (b, h, len(range(1, t, 7)), d), generator=g).float() / 2  # ties
    x[:, :, 2::11] = 0.0
    x[:, :, 2::11, 5] = -0.0
    x[:, :, 2::11, 9] = 1.5
    x = x.to(dtype)
    if dtype == torch.float16:
        n = len(range(3, t, 13))  # subnormals of both signs
        bits = torch.randint(0, 1024, (b, h, n, d), generator=g) | (torch.randint(0, 2, (b, h, n, d), generator=g) << 15)
        x[:, :, 3::13] = bits.to(torch.int32).to(torch.int16).view(torch.float16)
    return x.to(device)


@pytest.mark.parametrize("d,sparsity", [(64, 0.7), (128, 0.5), (128, 0.7), (96, 0.3)])
def test_reference_keeps_what_the_pruning_method_keeps(d, sparsity):
    x = hard_input(2, 2, 70, d, torch.float16)
    keep = keep_count(d, sparsity)
    got = prune_encode_reference(x, "values", keep)
    want = encode_torch(x.masked_fill(~per_token_mask(x.float().abs(), sparsity), 0), "values")
    assert got.same_bytes(want)
    got.validate()


def test_run_starts_match_full_blocks():
    x = torch.randn(3, 2, 200, 64, dtype=torch.float16)
    for keep in (0, 1, 7, 19, 64):
        ref = prune_encode_reference(x, "keys", keep)
        assert torch.equal(run_starts(6, 200, keep, align_elements(torch.float16)), ref.offsets)
        assert head_span(200, keep, 8) * 6 == ref.nz.numel()


def test_compact_runs_packs_short_blocks():
    x = hard_input(2, 3, 150, 64, torch.float16)
    ref = prune_encode_reference(x, "values", 40)
    counts = ref.block_counts()
    starts = run_starts(6, 150, 40, 8)
    # the kernel's placement: each run at its full-block start, garbage after it
    spread = torch.full((int(starts[-1]),), 7.0, dtype=torch.float16)
    for gi in range(counts.numel()):
        n = int(counts[gi])
        spread[int(starts[gi]) : int(starts[gi]) + n] = ref.nz[int(ref.offsets[gi]) : int(ref.offsets[gi]) + n]
    nz, offsets = compact_runs(spread, starts[:-1], counts, 8)
    assert torch.equal(offsets, ref.offsets)
    assert torch.equal(nz.view(torch.int16), ref.nz.view(torch.int16))


def test_arguments_are_checked():
    x = torch.randn(1, 1, 8, 64)
    with pytest.raises(UsageError):
        prune_encode(x, "keys", 65)
    with pytest.raises(UsageError):
        prune_encode(x, "rows", 3)
    with pytest.raises(UsageError):
        prune_encode(x, "keys", 3, backend="cuda")
    assert prune_encode(x, "keys", 3).same_bytes(prune_encode_reference(x, "keys", 3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["keys", "values"])
@pytest.mark.parametrize("b,h,t,d,keep", [(1, 1, 64, 128, 38), (2, 3, 1000, 128, 64), (1, 2, 77, 64, 19), (2, 1, 130, 256, 77), (1, 1, 5, 128, 0), (1, 2, 100, 128, 128), (1, 1, 129, 64, 1)])
def test_cuda_kernel_bytes_equal_the_reference(dtype, kind, b, h, t, d, keep):
    x = hard_input(b, h, t, d, dtype, device="cuda")
    want = prune_encode_reference(x, kind, keep)
    got = prune_encode(x, kind, keep, backend="cuda")
    assert got.same_bytes(want)
    got.validate()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["keys", "values"])
def test_cuda_kernel_full_rows_and_nan(kind):
    x = torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.float16)
    keep = keep_count(128, 0.7)
    assert prune_encode(x, kind, keep, backend="cuda").same_bytes(prune_encode_reference(x, kind, keep))
    x[3, 2, 100, 7] = float("nan")
    x[1, 1, 200, :100] = float("nan")  # fewer non-NaN elements than keep: the search must still end
    assert prune_encode(x, kind, keep, backend="cuda").same_bytes(prune_encode_reference(x, kind, keep))
