"""The one-launch KIVI absorb kernel (kvtool.kernels.kivi_quantize) against the torch reference.

(a) codes, scales and zero points bit for bit equal to ``quantize_keys_kivi`` / ``quantize_values_kivi``
(signed zeros, constant rows, tiny and near-float16-limit values), the residual moved down, the lengths
and the range flags; (b) a live KIVI layer grown with the kernel forced holds exactly the tensors the
torch path gives; (c) on CUDA the same at the Llama-3-8B shape, and the full grid.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvtool.formats import quant
from kvtool.formats.base import get_format
from kvtool.kernels import kivi_quantize as kq
from kvtool.methods.quantize import FP16_SAFE

from .conftest import synthetic_cache

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
FLAG_GROUPS = 2


def _tokens(b: int, h: int, n: int, d: int, g: int, dtype: torch.dtype, sdt: torch.dtype) -> torch.Tensor:
    """``[b, h, n, d]`` tokens whose first group has the awkward cases: a constant row, signed
    zeros in either order, tiny values (zero points and scales of the smallest subnormals), values
    near float16's limits (within the scale dtype's range); then, in the moved residual, one value
    beyond FP16_SAFE in its first group and a NaN in its second (the range flags)."""
    gen = torch.Generator().manual_seed(b * 1000 + n * 10 + d + g)
    x = torch.randn(b, h, n, d, generator=gen) * 3
    x[0, 0, :g, :] = 1.25
    x[0, -1, :g, 0] = -0.0
    x[-1, 0, :g, 1] = torch.tensor([-0.0, 0.0] * g)[:g]
    x[-1, 0, :g, 2] = torch.tensor([0.0, -0.0] * g)[:g]
    x[-1, -1, :g, 3] = -1e-9
    x[-1, -1, :g, 4] = 1e-9
    x[-1, -1, :g // 2, 5] = -1e-9
    top = 59999.0 if sdt != F32 else (65504.0 if dtype == F16 else 3e5)
    x[0, -1, :g, 6] = top
    x[0, -1, 0, 7] = -top
    x[-1, -1, g:2 * g, 8] = top  # residual group g .. 2g-1 (the moved residual's first)
    x[0, 0, g:2 * g, 0] = 70000.0 if dtype != F16 else 65000.0
    x[-1, 0, 2 * g + 1, 3] = float("nan")
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns (signed zeros and NaNs compare exactly)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(x: torch.Tensor, y: torch.Tensor, signed_zeros: bool = True) -> bool:
    """Bit-equal float tensors; without ``signed_zeros``, a zero equals a zero of either sign (on
    CUDA the order in which a group's min / max meet -0.0 and 0.0 is not defined, in torch's
    scatter_reduce either: the sign a zero point or a zero scale keeps is not compared there)."""
    same = _bits(x) == _bits(y)
    if not signed_zeros:
        same |= (x == 0) & (y == 0)
    return bool(same.all())


def _expected_flags(moved: torch.Tensor, rest: int, g: int) -> list[int]:
    """The flags the kernel leaves for the moved residual ``[B, H, S, D]``: ``[FLAG_GROUPS, B*H]``."""
    out = []
    for i in range(FLAG_GROUPS):
        part = moved[:, :, i * g:min((i + 1) * g, rest)].float().flatten(2)
        if part.shape[-1] == 0:
            out += [0] * (moved.shape[0] * moved.shape[1])
            continue
        big = (part.abs() >= FP16_SAFE).any(-1).int()
        nan = torch.isnan(part).any(-1).int() * 2
        out += (big | nan).flatten().tolist()
    return out


def check_absorb(kind: str, dtype, sdt, bits: int, g: int, d: int, device: str = "cpu", b: int = 2, h: int = 2, signed_zeros: bool = True) -> None:
    """One absorb at token ``pos = g`` (the second group's slots) of a residual of ``3g + 5``
    tokens, compared with the torch reference on the CPU."""
    n = 3 * g + 5
    x = _tokens(b, h, n + 2, d, g, dtype, sdt)
    res = x.to(device, copy=True)
    status = torch.zeros(kq.status_size(b, h, FLAG_GROUPS), dtype=torch.int32, device=device)
    cap, pos = 2 * g, g
    if kind == "keys":
        codes = torch.zeros(b, h, d, cap * bits // 8, dtype=torch.uint8, device=device)
        scales = torch.zeros(b, h, cap // g, d, dtype=sdt, device=device).transpose(2, 3)  # group-major, as the live cache holds them
        zeros = torch.zeros_like(scales)
        kq.absorb_keys(res, n, codes, scales, zeros, status, pos, bits, g, FP16_SAFE, FLAG_GROUPS)
        ref = quant.quantize_keys_kivi(x[:, :, :g], bits, g, sdt)
        got = (codes[..., pos * bits // 8:], scales[..., pos // g:], zeros[..., pos // g:])
        at = 0
    else:
        ngv = -(-d // g)
        codes = torch.zeros(b, h, cap, -(-d * bits // 8), dtype=torch.uint8, device=device)
        scales = torch.zeros(b, h, cap, ngv, dtype=sdt, device=device)
        zeros = torch.zeros_like(scales)
        kq.absorb_values(res, n, codes, scales, zeros, status, pos, bits, g, FP16_SAFE, FLAG_GROUPS)
        ref = quant.quantize_values_kivi(x[:, :, :g], bits, g, sdt)
        got = (codes[:, :, pos:], scales[:, :, pos:], zeros[:, :, pos:])
        at = 1
    what = f"{kind} {dtype} {sdt} bits {bits} group {g} D {d}"
    assert torch.equal(got[0].cpu(), ref[0]), f"codes: {what}"
    assert torch.equal(_bits(got[1].cpu()), _bits(ref[1])), f"scales: {what}"
    assert torch.equal(_bits(got[2].cpu()), _bits(ref[2])), f"zeros: {what}"
    rest = n - g
    assert torch.equal(_bits(res[:, :, :rest].cpu()), _bits(x[:, :, g:n])), f"residual move: {what}"
    assert torch.equal(_bits(res[:, :, n:].cpu()), _bits(x[:, :, n:])), f"slots past the residual: {what}"
    got_status = status.tolist()
    assert got_status[at] == pos + g and got_status[at + 2] == rest, what
    off = kq.flag_offset(at, b, h, FLAG_GROUPS)
    assert got_status[off:off + FLAG_GROUPS * b * h] == _expected_flags(x[:, :, g:n], rest, g), f"flags: {what}"


# every value of each axis at least once (the full product is the gpu test below)
CPU_GRID = [
    ("keys", F16, F16, 4, 32, 128),
    ("values", F16, F16, 4, 32, 128),
    ("keys", BF16, F32, 2, 32, 64),
    ("values", BF16, F32, 2, 128, 64),  # a group wider than D: one group of D
    ("keys", F32, F16, 8, 128, 16),
    ("values", F32, F16, 8, 32, 16),
    ("keys", F16, F32, 2, 128, 64),
    ("values", F32, F32, 4, 48, 128),  # 48 does not divide 128: groups of 48, 48, 32
    ("keys", F16, BF16, 4, 48, 16),
    ("values", BF16, F16, 8, 128, 128),
]


@pytest.mark.parametrize("kind,dtype,sdt,bits,g,d", CPU_GRID)
def test_absorb_is_bit_exact(kind, dtype, sdt, bits, g, d):
    check_absorb(kind, dtype, sdt, bits, g, d)


def test_supported_routes_the_rest_to_torch():
    assert kq.supported(F16, F16, 4, 32, 128)
    assert not kq.supported(F16, F16, 4, 512, 128)  # a [512, 128] block per program: torch
    assert not kq.supported(torch.float64, F16, 4, 32, 128)
    assert not kq.supported(F16, F16, 4, 3, 128)  # 3 codes of 4 bits: not whole bytes


# ----------------------------------------------------------------------------- live layers


def _replay(live, keys, values):
    """Replays of a captured step: tokens written at the device's lengths, the host not told."""
    for t in range(keys.shape[2]):
        for i, (kind, x) in enumerate((("keys", keys), ("values", values))):
            live.res[kind][:, :, int(live.lengths[2 + i])] = x[:, :, t]
        live.lengths[2:4] += 1


def grow(layer, params, start: int, mode: str, device: str = "cpu"):
    """A live layer from the first ``start`` tokens, grown to all of them the ways a model does:
    replayed steps with ``reserve`` between, single eager appends, and one long append."""
    old = quant.ABSORB_KERNEL
    quant.ABSORB_KERNEL = mode
    try:
        fmt = get_format("quant")
        live = fmt.live_from_dense(layer.slice_tokens(0, start).to(device), params)
        keys, values = layer.keys.to(device), layer.values.to(device)
        t, total = start, keys.shape[2]
        steps = [1] * 40 + [3] * 10 + [1] * 20
        for i, n in enumerate(steps):
            n = min(n, total - t)
            if n <= 0:
                break
            if i % 3 == 2:
                live.append(keys[:, :, t:t + n], values[:, :, t:t + n])
            else:
                live.reserve(n)
                _replay(live, keys[:, :, t:t + n], values[:, :, t:t + n])
            t += n
        live.append(keys[:, :, t:], values[:, :, t:])
        live.reserve(1)
        assert live.kernel_absorbs() == (mode == "always" or (mode == "auto" and keys.is_cuda))
        return live
    finally:
        quant.ABSORB_KERNEL = old


def assert_same_layers(a, b, signed_zeros: bool = True):
    ea, eb = a.encoded(), b.encoded()
    assert ea.meta == eb.meta
    assert set(ea.tensors) == set(eb.tensors)
    for name in ea.tensors:
        x, y = ea.tensors[name].cpu(), eb.tensors[name].cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, name
        if x.is_floating_point():
            assert _same(x, y, signed_zeros), name
        else:
            assert torch.equal(x, y), f"{name}: {int((x != y).sum())} of {x.numel()} bytes differ"
    assert a.lengths.tolist() == b.lengths.tolist()


@pytest.mark.parametrize("dtype,bits,group,residual,big", [
    (F16, 4, 16, 32, False),
    (BF16, 2, 16, 16, False),
    (F16, 8, 16, 48, True),  # a token beyond float16's range arrives: every scale widens to float32
])
def test_live_layer_grown_by_the_kernel_is_the_torch_layer(dtype, bits, group, residual, big):
    cache = synthetic_cache(tokens=260, head_dim=32, heads=4, kv_heads=2, queries=False)
    layer = cache.layers[0]
    layer = type(layer)(keys=layer.keys.to(dtype), values=layer.values.to(dtype))
    if big:
        layer.keys[0, 1, 200, 3] = 61000.0
    params = get_format("quant").Params(bits=bits, group=group, residual=residual)
    torch_live = grow(layer, params, 70, "never")
    kernel_live = grow(layer, params, 70, "always")
    assert kernel_live.tokens == torch_live.tokens == 260
    assert_same_layers(kernel_live, torch_live)
    assert (torch_live.encoded().meta["scale_dtype"] == "float32") == big


def test_replayed_growth_reads_the_range_with_the_lengths(monkeypatch):
    """A decode loop (reserve, one replayed step): after each kind's first absorb, the range flags
    read with the lengths decide the scale dtype, so scale_dtype_for (a second host sync) never runs."""
    layer = synthetic_cache(tokens=200, head_dim=32, heads=4, kv_heads=2, queries=False).layers[0]
    monkeypatch.setattr(quant, "ABSORB_KERNEL", "always")
    checks, syncs = [], []
    real_check, real_sync = quant.scale_dtype_for, quant.QuantLive._sync
    monkeypatch.setattr(quant, "scale_dtype_for", lambda x: checks.append(1) or real_check(x))
    monkeypatch.setattr(quant.QuantLive, "_sync", lambda self: syncs.append(1) or real_sync(self))
    live = get_format("quant").live_from_dense(layer.slice_tokens(0, 60), get_format("quant").Params(bits=4, group=16, residual=32))
    before = live.kt
    for t in range(60, 200):
        live.reserve(1)
        _replay(live, layer.keys[:, :, t:t + 1], layer.values[:, :, t:t + 1])
    live.reserve(1)
    assert live.kt - before >= 8 * 16 and len(syncs) == 141  # one sync per reserve
    assert len(checks) == 3, len(checks)  # encoding the prompt, and each kind's first absorb after the layer was built


# ----------------------------------------------------------------------------- GPU


# every (token dtype, scale dtype) pair with two (bits, group, head_dim) each: every value of each
# axis, groups wider than D and not dividing it; each combination is a compile (the whole product, 108
# per kind, took over 90 s of a chunk on the H200)
GPU_GRID = [(dtype, sdt, *shape) for (dtype, sdt), shapes in zip(
    itertools.product((F16, BF16, F32), (F16, F32, BF16)),
    itertools.cycle([[(4, 32, 128), (2, 128, 64)], [(8, 32, 16), (4, 48, 128)], [(2, 32, 64), (8, 128, 128)]]))
    for shape in shapes]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["keys", "values"])
def test_absorb_is_bit_exact_on_cuda_over_the_grid(kind):
    for dtype, sdt, bits, g, d in GPU_GRID:
        check_absorb(kind, dtype, sdt, bits, g, d, device="cuda", b=3, h=2, signed_zeros=False)


@pytest.mark.gpu
def test_live_layer_on_cuda_is_the_cpu_torch_layer_at_llama_shape():
    """B=8, Hkv=8, D=128, float16, KIVI-4 group 32 residual 128: grown on CUDA with the kernel
    (the default there), the CPU torch path's tensors bit for bit (the torch reference is the CPU's:
    torch on CUDA divides by the scalar ``levels`` through a reciprocal, which moves a scale by one
    ulp now and then). The prompt of 100 tokens stays in the residual, so every quantised group is
    an absorb."""
    gen = torch.Generator().manual_seed(0)
    keys = (torch.randn(8, 8, 420, 128, generator=gen) * 2).half()
    values = torch.randn(8, 8, 420, 128, generator=gen).half()
    from kvtool.core.cache import LayerKV

    layer = LayerKV(keys=keys, values=values)
    params = get_format("quant").Params(bits=4, group=32, residual=128)
    on_cpu = grow(layer, params, 100, "never")
    on_cuda = grow(layer, params, 100, "auto", device="cuda")
    assert on_cuda.kt >= 8 * 32
    assert_same_layers(on_cuda, on_cpu, signed_zeros=False)
