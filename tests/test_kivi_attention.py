"""The KIVI decode kernel (kvtool.kernels.kivi_attention) against its torch references under
TRITON_INTERPRET=1 on small tensors: code widths 2/4/8, key groups inside and across token blocks,
odd token counts, residual tokens present, absent or all, float16/bfloat16/float32, GQA groups
1/3/4, several query tokens, any split count; and the live KIVI layer that holds the kernel's cache
with room to grow (lengths on the device, as a replayed CUDA graph leaves them).
The same comparisons at the Llama-3-8B shape run on a GPU (tests/test_kernels_gpu.py, tests/test_live_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtool.core.attention import attend_partial
from kvtool.core.cache import LayerKV
from kvtool.core.errors import UsageError
from kvtool.formats import get_format
from kvtool.formats.base import make_params
from kvtool.formats.quant import QuantLive, SymmetricLive, quantize_keys_kivi, quantize_values_kivi
from kvtool.kernels.kivi_attention import block_tokens, cache_from_encoded, dequantize, kivi_attention, kivi_attention_reference

FMT = get_format("quant")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
TOL = {F16: 2e-3, BF16: 1e-2, F32: 1e-5}


def tensors(b, hkv, t, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, t, d, generator=g)
    k[..., 3] *= 8  # an outlier channel, as real keys have
    v = torch.randn(b, hkv, t, d, generator=g)
    return k.to(dtype), v.to(dtype)


def query(b, h, tq, d, dtype, seed=1):
    return torch.randn(b, h, tq, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def encode(k, v, bits, group, residual):
    return FMT.encode(LayerKV(k, v), make_params(FMT, {"bits": str(bits), "group": str(group), "residual": str(residual)}))


def close(got, ref, dtype):
    out, lse = got
    rout, rlse = ref
    assert out.dtype == torch.float32 and out.shape == rout.shape and lse.shape == rlse.shape
    err = float((out.double() - rout.double()).norm() / rout.double().norm())
    assert err <= TOL[dtype], err
    assert float((lse - rlse).abs().max()) <= 1e-3


# (batch, KV heads, GQA group, tokens, head_dim, bits, group, residual, dtype, query tokens)
CASES = [
    (1, 2, 4, 100, 16, 4, 32, 32, F16, 1),    # the defaults: blocks of one key group, value scales gathered
    (2, 2, 3, 77, 32, 2, 16, 8, F16, 1),      # 2-bit, odd tokens, GQA 3
    (1, 1, 1, 200, 16, 8, 64, 0, F32, 1),     # 8-bit, no residual left (200 - 192 keys: a partial group stays full precision)
    (1, 2, 4, 192, 16, 4, 64, 0, BF16, 1),    # no residual at all, bfloat16
    (1, 2, 1, 99, 24, 4, 5, 7, BF16, 1),      # a group that is no power of two: key scales gathered; head_dim 24
    (1, 2, 4, 300, 64, 4, 128, 0, F16, 3),    # the 15% plan's group 128 (blocks of 64 inside a group), 3 query tokens
    (1, 2, 4, 40, 16, 4, 32, 100, F16, 1),    # every token in the residual
]


@pytest.mark.parametrize("b,hkv,g,t,d,bits,group,residual,dtype,tq", CASES)
def test_kernel_equals_the_references(b, hkv, g, t, d, bits, group, residual, dtype, tq):
    k, v = tensors(b, hkv, t, d, dtype)
    enc = encode(k, v, bits, group, residual)
    q = query(b, hkv * g, tq, d, dtype)
    cache = cache_from_encoded(enc)
    ref = FMT.attend(q, enc)  # the format's decode, then attention
    close(kivi_attention(q, cache), ref, dtype)
    close(FMT.attend_kernel(q, enc), ref, dtype)
    # the kernel module's own reference agrees with the format's decode to the bit
    keys, values = dequantize(cache)
    dense = FMT.decode(enc)
    assert torch.equal(keys, dense.keys) and torch.equal(values, dense.values)
    torch.testing.assert_close(kivi_attention_reference(q, cache)[0], ref[0])


@pytest.mark.parametrize("splits", [2, 3, 7, 40])
def test_any_split_count_and_empty_splits(splits):
    """Splits share the tokens in use (read from the lengths); splits past the last block are empty."""
    k, v = tensors(1, 2, 160, 32, F16)
    enc = encode(k, v, 4, 16, 8)
    q = query(1, 4, 1, 32, F16)
    close(kivi_attention(q, cache_from_encoded(enc), splits=splits), FMT.attend(q, enc), F16)


def test_keys_quantised_past_the_values():
    """A live layer can hold more quantised keys than values (its key and value residuals fill at
    different times): token t's key and value still pair up."""
    k, v = tensors(1, 2, 160, 32, F16, seed=3)
    cache = cache_from_encoded(encode(k, v, 4, 16, 8))
    kc, ks, kz = quantize_keys_kivi(k[:, :, :144], 4, 16, torch.float16)
    vc, vs, vz = quantize_values_kivi(v[:, :, :100], 4, 16, torch.float16)
    lengths = torch.tensor([144, 100, 16, 60], dtype=torch.int32)
    mixed = dataclasses.replace(cache, key_codes=kc, key_scales=ks, key_zeros=kz, value_codes=vc, value_scales=vs, value_zeros=vz,
                                residual_keys=k[:, :, 144:].contiguous(), residual_values=v[:, :, 100:].contiguous(), lengths=lengths)
    q = query(1, 4, 1, 32, F16)
    ref = kivi_attention_reference(q, mixed)
    keys, values = dequantize(mixed)
    assert torch.equal(keys[:, :, 144:], k[:, :, 144:]) and torch.equal(values[:, :, 100:], v[:, :, 100:])
    for splits in (1, 3):
        close(kivi_attention(q, mixed, splits=splits), ref, F16)


def test_strided_queries_and_bad_inputs():
    """Queries may be views (a plan's head group narrows them); wrong inputs are usage errors before launch."""
    k, v = tensors(1, 4, 70, 16, F16)
    enc = encode(k, v, 4, 16, 4)
    q = query(1, 16, 1, 16, F16)
    part = FMT.encode(LayerKV(k[:, 1:3].contiguous(), v[:, 1:3].contiguous()), make_params(FMT, {"bits": "4", "group": "16", "residual": "4"}))
    close(kivi_attention(q.narrow(1, 4, 8), cache_from_encoded(part)), FMT.attend(q.narrow(1, 4, 8).contiguous(), part), F16)
    cache = cache_from_encoded(enc)
    with pytest.raises(UsageError, match="q is"):
        kivi_attention(q.float(), cache)
    with pytest.raises(UsageError, match="expected"):
        kivi_attention(q[:, :, :, :8], cache)
    with pytest.raises(UsageError, match="lengths"):
        kivi_attention(q, dataclasses.replace(cache, lengths=cache.lengths.long()))
    with pytest.raises(UsageError, match="scheme kivi"):
        cache_from_encoded(FMT.encode(LayerKV(k, v), make_params(FMT, {"scheme": "int8"})))


def test_block_tokens():
    assert block_tokens(32) == (32, True) and block_tokens(128) == (64, True) and block_tokens(48) == (16, True)
    assert block_tokens(5) == (64, False) and block_tokens(8) == (64, False)


def test_the_format_declares_its_kernel():
    """quant has a kernel (verify's triton backend, live layers on CUDA); int8 / fp8 fall back to their reference."""
    assert FMT.has_kernel
    k, v = tensors(1, 2, 50, 16, F16)
    enc = FMT.encode(LayerKV(k, v), make_params(FMT, {"scheme": "int8"}))
    q = query(1, 4, 1, 16, F16)
    out, lse = FMT.attend_kernel(q, enc)
    ref, rlse = FMT.attend(q, enc)
    assert torch.equal(out, ref) and torch.equal(lse, rlse)
    assert isinstance(FMT.live_layer(enc, k), SymmetricLive)


# ----------------------------------------------------------------------------- the live layer


def live_layer(t=100, d=32, bits=4, group=16, residual=16, dtype=F16, seed=0):
    k, v = tensors(1, 2, t, d, dtype, seed)
    params = make_params(FMT, {"bits": str(bits), "group": str(group), "residual": str(residual)})
    live = FMT.live_from_dense(LayerKV(k, v), params)
    assert isinstance(live, QuantLive)
    return live


def kernel_vs_reference(live, dtype=F16, seed=5):
    """The kernel over the live layer's cache (device lengths) against the layer's torch path (host counts)."""
    q = query(live.b, 2 * live.h, 1, live.d, dtype, seed)
    close(kivi_attention(q, live.cache), live.partial(q, None), dtype)


def test_live_steps_through_the_kernel_match_the_reference():
    """Decode steps one token at a time through groups joining and the capacity growing: at every
    step the kernel (which reads the lengths on the device) equals the torch path, and the layer
    holds what `encode` writes for the same tokens."""
    live = live_layer(t=100)
    cap = live.capacity
    k, v = tensors(1, 2, 160, 32, F16, seed=7)
    phases = set()
    assert [int(x) for x in live.lengths] == [live.kt, live.vt, live.res_n["keys"], live.res_n["values"]]
    for j in range(k.shape[2]):
        q = query(1, 4, 1, 32, F16, seed=j)
        out = live.step(q, k[:, :, j:j + 1], v[:, :, j:j + 1], None)
        ref = attend_partial(q, *live.dense(), None)[0]
        torch.testing.assert_close(out, ref)
        if j % 16 in (3, 11):  # both residual phases: keys quantised ahead of values, and behind
            kernel_vs_reference(live, seed=j)
            phases.add((live.kt > live.vt) - (live.kt < live.vt))
    assert phases == {-1, 1}
    assert live.capacity > cap and live.tokens == 260
    assert [int(x) for x in live.lengths] == [live.kt, live.vt, live.res_n["keys"], live.res_n["values"]]
    enc = live.encoded()
    FMT.validate(enc)
    whole = torch.cat([tensors(1, 2, 100, 32, F16)[0], k], dim=2)
    ref = FMT.encode(LayerKV(whole, whole), make_params(FMT, {"bits": "4", "group": "16", "residual": str(260 - enc.meta["key_tokens"])}))
    assert torch.equal(enc.tensors["codes.keys"], ref.tensors["codes.keys"])


def test_live_replayed_steps_are_picked_up_by_the_next_eager_step():
    """A captured step replayed leaves the device's lengths ahead of the host's counts; the kernel
    reads the device's, and the next eager join reads them too, so no token is lost or repeated."""
    live = live_layer(t=90)
    twin = live_layer(t=90)
    k, v = tensors(1, 2, 40, 32, F16, seed=9)
    live.reserve(20)  # what a decode loop does before replaying a captured step 20 times
    counts = (live.kt, live.vt, dict(live.res_n))
    for j in range(20):  # what 20 replays of a captured step do: device writes, host counts unchanged
        live.append(k[:, :, j:j + 1], v[:, :, j:j + 1])
        live.kt, live.vt, live.res_n = counts[0], counts[1], dict(counts[2])
        twin.append(k[:, :, j:j + 1], v[:, :, j:j + 1])
    kernel_vs_reference(twin)
    q = query(1, 4, 1, 32, F16)
    stale = (live.kt, live.vt, dict(live.res_n))
    live._sync()  # the torch path reads the host's counts: bring them up to date for the reference only
    assert live.tokens == twin.tokens == 110
    ref = live.partial(q, None)
    live.kt, live.vt, live.res_n = stale
    close(kivi_attention(q, live.cache), ref, F16)  # the kernel sees the 20 tokens
    live.append(k[:, :, 20:], v[:, :, 20:])  # eager: the joins read the device's lengths first
    twin.append(k[:, :, 20:], v[:, :, 20:])
    live._sync()
    assert (live.kt, live.vt, live.res_n) == (twin.kt, twin.vt, twin.res_n)
    a, b = live.encoded(), twin.encoded()
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


def test_live_appends_during_a_capture_never_quantise(monkeypatch):
    """While a CUDA graph is captured an append cannot quantise (that reads the lengths on the host):
    tokens past R + group wait in the residual's spare slots until the next eager append or reserve."""
    import kvtool.formats.quant as quant

    live, twin = live_layer(t=90), live_layer(t=90)
    k, v = tensors(1, 2, 40, 32, F16, seed=4)
    live.reserve(23)  # room for what the captured appends write (a decode loop reserves before capturing)
    monkeypatch.setattr(quant, "capturing", lambda x: True)
    monkeypatch.setattr(QuantLive, "_sync", lambda self: pytest.fail("a host read during a capture"))
    kt = live.kt
    for j in range(20):
        live.append(k[:, :, j:j + 1], v[:, :, j:j + 1])
    live.append(k[:, :, 20:23], v[:, :, 20:23])
    assert live.kt == kt and max(live.res_n.values()) >= live.threshold
    monkeypatch.undo()
    twin.append(k[:, :, :23], v[:, :, :23])
    kernel_vs_reference(live)
    live.reserve(1)
    a, b = live.encoded(), twin.encoded()
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


def test_live_reserve_makes_room_for_replays():
    live = live_layer(t=100, group=16, residual=0)
    assert live.room() < 64  # residual buffers of R + group slots: replays get their room from reserve
    live.reserve(200)
    assert live.room() >= 200
    kernel_vs_reference(live)
    k, v = tensors(1, 2, 3, 32, F16, seed=2)
    live.append(k, v)
    kernel_vs_reference(live)


def test_live_bytes_are_the_tensors_held():
    live = live_layer(t=1000)
    held = sum(t.numel() * t.element_size() for t in live.cache.tensors()) + live.lengths.numel() * 4
    assert live.stored_bytes() == held
    dense = 2 * 1000 * 2 * 32 * 2
    # 4-bit codes and 1/32 room to grow (0.27), scales and zero points of 16 elements (0.13), 96 residual slots (0.1)
    assert held < 0.55 * dense
    assert live.workspace_bytes(4) > 0 and live.join_bytes() > 0


@pytest.mark.parametrize("bits,group,block", [(4, 32, 32), (4, 32, 64), (2, 16, 64), (2, 32, 128), (8, 64, 32), (4, 128, 128), (4, 8, 32)])
def test_packed_kernel_blocks(bits, group, block):
    """The packed-codes kernel (float16, power-of-two groups) at several blocks and splits equals
    the references; its tail (codes and residual tokens mixed) runs in the generic kernel."""
    from kvtool.kernels.kivi_attention import packed_path

    k, v = tensors(1, 2, 260, 64, F16, seed=5)
    enc = encode(k, v, bits, group, 9)
    cache = cache_from_encoded(enc)
    q = query(1, 8, 1, 64, F16)
    assert packed_path(q, cache)
    ref = kivi_attention_reference(q, cache)
    for splits in (1, 3):
        close(kivi_attention(q, cache, block=block, splits=splits), ref, F16)
    for bad in (24, 16):
        with pytest.raises(UsageError, match="block"):
            kivi_attention(q, cache, block=bad)


def test_packed_path_is_float16_power_of_two_groups():
    from kvtool.kernels.kivi_attention import packed_path

    k, v = tensors(1, 2, 100, 16, BF16)
    assert not packed_path(query(1, 4, 1, 16, BF16), cache_from_encoded(encode(k, v, 4, 32, 8)))
    k, v = tensors(1, 2, 100, 16, F16)
    assert not packed_path(query(1, 4, 1, 16, F16), cache_from_encoded(encode(k, v, 4, 5, 8)))
    assert not packed_path(query(1, 4, 1, 16, F16), cache_from_encoded(encode(k, v, 4, 32, 8)))  # head_dim 16: generic (wrong on an H100)
    k, v = tensors(1, 2, 100, 32, F16)
    assert packed_path(query(1, 4, 1, 32, F16), cache_from_encoded(encode(k, v, 4, 32, 8)))


def test_cuda_backend_choice_on_the_cpu():
    """The CUDA backend says why it cannot serve a call (CPU tensors here), ``backend="cuda"``
    refuses with that reason, ``auto`` falls back to Triton, and an unknown backend is a UsageError."""
    from kvtool.kernels.kivi_attention import cuda_path

    enc = FMT.encode(LayerKV(torch.randn(1, 2, 100, 64).half(), torch.randn(1, 2, 100, 64).half()),
                     make_params(FMT, {"bits": "4", "group": "32", "residual": "8"}))
    cache = cache_from_encoded(enc)
    q = torch.randn(1, 4, 1, 64).half()
    assert "CUDA tensors" in cuda_path(q, cache)
    with pytest.raises(UsageError, match="CUDA tensors"):
        kivi_attention(q, cache, backend="cuda")
    with pytest.raises(UsageError, match="backend must be one of"):
        kivi_attention(q, cache, backend="cutlass")
    close(kivi_attention(q, cache, backend="auto"), FMT.attend(q, enc), F16)


def test_auto_falls_back_to_triton_when_the_cuda_kernel_does_not_build(monkeypatch):
    """``backend="auto"`` where the CUDA kernel would serve but its extension fails to build: one
    note, then the Triton kernel's answer (and no second try); ``backend="cuda"`` raises the error."""
    from kvtool.core.errors import BadDataError
    from kvtool.kernels import kivi_attention as K

    enc = FMT.encode(LayerKV(torch.randn(1, 2, 100, 64).half(), torch.randn(1, 2, 100, 64).half()),
                     make_params(FMT, {"bits": "4", "group": "32", "residual": "8"}))
    cache = cache_from_encoded(enc)
    q = torch.randn(1, 4, 1, 64).half()
    calls = []

    def broken(*args):
        calls.append(1)
        raise BadDataError("building the CUDA extension kivi_decode failed (nvcc)")

    monkeypatch.setattr(K, "cuda_path", lambda q, cache: None)
    monkeypatch.setattr(K, "_toolchain_ok", lambda: K._TOOLCHAIN[0] if K._TOOLCHAIN else True)
    monkeypatch.setattr(K, "_TOOLCHAIN", [])
    monkeypatch.setattr(K, "_cuda_attention", broken)
    close(kivi_attention(q, cache), FMT.attend(q, enc), F16)
    close(kivi_attention(q, cache), FMT.attend(q, enc), F16)
    assert calls == [1]
    with pytest.raises(BadDataError, match="kivi_decode"):
        kivi_attention(q, cache, backend="cuda")


@pytest.mark.parametrize("t,residual", [(24, 0), (20, 0), (1000, 32), (777, 7)])
def test_cuda_backend_layouts_of_file_layers(t, residual):
    """The layouts a file's layer hands the CUDA backend (checked without a GPU): every key still in
    the residual (an empty key-code tensor, whose strides are degenerate) and odd token counts pass
    the backend's layout and shape checks."""
    from kvtool.kernels.kivi_attention import _cuda_layout_problem, _cuda_shape_problem

    enc = FMT.encode(LayerKV(torch.randn(2, 1, t, 128).half(), torch.randn(2, 1, t, 128).half()),
                     make_params(FMT, {"bits": "4", "group": "32", "residual": str(residual)}))
    cache = cache_from_encoded(enc)
    q = torch.randn(2, 4, 1, 128).half()
    assert _cuda_shape_problem(cache, 4) is None and _cuda_layout_problem(q, cache) is None


def test_cuda_kernel_choice(monkeypatch):
    """``$KVTOOL_KIVI_CUDA_KERNEL`` picks the CUDA kernel (swapped by default, the 16-row one to compare
    them in one run); another value is a usage error naming the choices. Both translation units
    are the extension's sources, so a change to either rebuilds it."""
    from kvtool.core.errors import UsageError
    from kvtool.kernels import kivi_attention as K

    monkeypatch.delenv("KVTOOL_KIVI_CUDA_KERNEL", raising=False)
    assert K.cuda_kernel() == "swapped" and K.CUDA_KERNELS["swapped"] == 0
    monkeypatch.setenv("KVTOOL_KIVI_CUDA_KERNEL", "rows16")
    assert K.CUDA_KERNELS[K.cuda_kernel()] == 1
    monkeypatch.setenv("KVTOOL_KIVI_CUDA_KERNEL", "fast")
    with pytest.raises(UsageError, match="swapped, rows16"):
        K.cuda_kernel()
    assert [p.name for p in K._CUDA_SOURCES] == ["kivi_decode.cu", "kivi_decode_swapped.cu"]
    assert all(p.is_file() for p in K._CUDA_SOURCES)
