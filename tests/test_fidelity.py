"""Fidelity library: metrics against hand-computed values, held-out attention scoring with the dense
format (zero error) and with test-only lossy formats (planted corruption, a selection, a Triton
kernel run under TRITON_INTERPRET=1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from kvtool.core.attention import attend_partial, attention_probs
from kvtool.core.cache import KVCache, LayerKV
from kvtool.core.errors import BadDataError, UsageError
from kvtool.analysis.fidelity import attention_fidelity, check_source, find_source, resolve_backend
from kvtool.formats import load_all
from kvtool.formats.base import (
    FORMATS,
    Encoded,
    Format,
    FormatParams,
    compress_cache,
    get_format,
    make_params,
)
from kvtool.analysis.metrics import (
    compare_logits,
    first_divergence,
    mass_recall,
    nll,
    output_errors,
    pool_errors,
)
from kvtool.analysis.sweep import expand_spec, pareto_front, resolve_points

from .conftest import synthetic_cache

# ----------------------------------------------------------------------------- test-only formats


@dataclass
class NoisyParams(FormatParams):
    noise: float = 1.0
    seed: int = 0


class NoisyFormat(Format):
    """Planted corruption: keys and values plus ``noise`` x their std of Gaussian noise."""

    name = "test-noisy"
    summary = "test only: dense plus planted noise"
    Params = NoisyParams

    def encode(self, layer, params):
        g = torch.Generator().manual_seed(params.seed)
        k, v = layer.keys.float(), layer.values.float()
        k = k + params.noise * k.std() * torch.randn(k.shape, generator=g)
        v = v + params.noise * v.std() * torch.randn(v.shape, generator=g)
        return Encoded({"keys": k.to(layer.keys.dtype), "values": v.to(layer.values.dtype)})

    def decode(self, enc):
        return LayerKV(enc.tensors["keys"], enc.tensors["values"])


@dataclass
class FirstHalfParams(FormatParams):
    pass


class FirstHalfFormat(Format):
    """A selection: every query attends only the even prefix tokens (stores all, reads half)."""

    name = "test-even"
    summary = "test only: attend even tokens"
    Params = FirstHalfParams
    selects = True

    def encode(self, layer, params):
        return Encoded({"keys": layer.keys.contiguous(), "values": layer.values.contiguous()})

    def decode(self, enc):
        return LayerKV(enc.tensors["keys"], enc.tensors["values"])

    def _keep(self, t, device):
        return torch.arange(t, device=device) % 2 == 0

    def selected_mask(self, q, enc):
        t = enc.tensors["keys"].shape[2]
        b, h, tq, _ = q.shape
        return self._keep(t, q.device).expand(b, h, tq, t)

    def attend(self, q, enc, scale=None):
        t = enc.tensors["keys"].shape[2]
        return attend_partial(q, enc.tensors["keys"], enc.tensors["values"], scale, self._keep(t, q.device))

    def traffic_bytes(self, enc, q=None):
        return sum(self.nbytes(enc).values()) // 2


def _triton_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """A tiny online-softmax decode kernel: one program per (batch, head, query)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, T, TQ, scale, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        bh = pid // TQ
        h = bh % H
        b = bh // H
        kv = (b * (H // G) + h // G) * T * D
        d = tl.arange(0, D)
        qv = tl.load(q_ptr + pid * D + d).to(tl.float32)
        m = tl.zeros([1], tl.float32) - float("inf")
        l = tl.zeros([1], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for start in range(0, T, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < T
            k = tl.load(k_ptr + kv + offs[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv + offs[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            s = tl.where(ok, tl.sum(k * qv[None, :], axis=1) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m - m_new)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l = l * alpha + tl.sum(p, axis=0)
            m = m_new
        tl.store(o_ptr + pid * D + d, acc / l)
        tl.store(lse_ptr + pid + tl.arange(0, 1), m + tl.log(l))

    b, h, tq, d = q.shape
    out = torch.empty(b, h, tq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, tq, dtype=torch.float32, device=q.device)
    kernel[(b * h * tq,)](q.contiguous(), keys.contiguous(), values.contiguous(), out, lse, keys.shape[2], tq, scale,
                          H=h, G=h // keys.shape[1], D=d, BLOCK=16)
    return out, lse


class KernelFormat(Format):
    """Dense storage whose attend_kernel is the tiny Triton kernel above."""

    name = "test-kernel"
    summary = "test only: dense with a Triton attend kernel"
    Params = FirstHalfParams
    has_kernel = True

    def encode(self, layer, params):
        return Encoded({"keys": layer.keys.contiguous(), "values": layer.values.contiguous()})

    def decode(self, enc):
        return LayerKV(enc.tensors["keys"], enc.tensors["values"])

    def attend_kernel(self, q, enc, scale=None):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return _triton_attend(q, enc.tensors["keys"], enc.tensors["values"], scale)


TEST_FORMATS = (NoisyFormat, FirstHalfFormat, KernelFormat)


@pytest.fixture
def test_formats():
    """Register the test-only formats for one test, then remove them again."""
    load_all()
    for cls in TEST_FORMATS:
        FORMATS[cls.name] = cls()
    yield {cls.name: FORMATS[cls.name] for cls in TEST_FORMATS}
    for cls in TEST_FORMATS:
        FORMATS.pop(cls.name, None)


@pytest.fixture(scope="module")
def cache():
    return synthetic_cache(tokens=48, head_dim=16, heads=4, kv_heads=2, layers=(0, 2))


def _compress(cache, name, heldout=16, **values):
    fmt = get_format(name)
    return compress_cache(cache, fmt, make_params(fmt, values), heldout=heldout)


# ----------------------------------------------------------------------------- metrics


def test_output_errors_hand_computed():
    ref = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    out = torch.tensor([[0.0, 1.0], [0.0, 2.0]])
    e = output_errors(out, ref)
    assert e["rel_l2"] == pytest.approx(math.sqrt(2) / math.sqrt(5))
    assert e["cosine"] == pytest.approx(0.5)  # cosines 0 and 1
    assert e["min_cosine"] == pytest.approx(0.0)
    assert e["max_abs"] == pytest.approx(1.0)
    same = output_errors(ref, ref)
    assert same["rel_l2"] == 0.0 and same["cosine"] == pytest.approx(1.0)
    pooled = pool_errors([e, same])
    assert pooled["rel_l2"] == pytest.approx(math.sqrt(2 / 10))
    assert pooled["cosine"] == pytest.approx(0.75)


def test_mass_recall_hand_computed():
    probs = torch.tensor([[[[0.4, 0.3, 0.1]]]])  # prefix mass 0.8 (0.2 on the dense window)
    sel = torch.tensor([[[[True, False, True]]]])
    r = mass_recall(sel, probs)
    assert r["recall"] == pytest.approx(0.5 / 0.8)
    assert r["selected_fraction"] == pytest.approx(2 / 3)
    assert mass_recall(torch.ones_like(sel), probs)["recall"] == pytest.approx(1.0)


def test_compare_logits_hand_computed():
    dense = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]))
    lossy = torch.log(torch.tensor([[[0.5, 0.5], [0.2, 0.8]]]))
    targets = torch.tensor([[0]])
    r = compare_logits(dense, lossy, targets)
    kl2 = 0.9 * math.log(0.9 / 0.2) + 0.1 * math.log(0.1 / 0.8)
    assert r["kl"] == pytest.approx(kl2 / 2, rel=1e-5)
    assert r["agreement"] == pytest.approx(0.5)  # position 0 ties at index 0 in both; position 1 differs
    assert r["nll_dense"] == pytest.approx(math.log(2), rel=1e-5) and r["nll_increase"] == pytest.approx(0.0, abs=1e-6)
    same = compare_logits(dense, dense, torch.tensor([[0, 1]]))
    assert same["agreement"] == 1.0 and same["kl"] == 0.0 and same["ppl_ratio"] == 1.0
    assert nll(dense[:, 1:], torch.tensor([[1]])) == pytest.approx(-math.log(0.1), rel=1e-5)


def test_first_divergence():
    a = torch.tensor([[1, 2, 3, 4]])
    assert first_divergence(a, a) == 4
    assert first_divergence(a, torch.tensor([[1, 2, 9, 4]])) == 2
    assert first_divergence(torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 2], [0, 4]])) == 0


def test_sweep_spec_and_pareto():
    pts = expand_spec("bitmap:sparsity=0.5,0.7,method=per-token,2:4")
    assert [p[1] for p in pts] == [
        {"sparsity": "0.5", "method": "per-token"}, {"sparsity": "0.5", "method": "2:4"},
        {"sparsity": "0.7", "method": "per-token"}, {"sparsity": "0.7", "method": "2:4"},
    ]
    assert expand_spec("dense") == [("dense", {})]
    with pytest.raises(UsageError):
        expand_spec("bitmap:0.5")
    # x = bytes (lower better), y = agreement (higher better): point 2 is beaten by point 1
    assert pareto_front([0.3, 0.5, 0.6, 1.0], [0.8, 0.95, 0.9, 1.0], True) == [0, 1, 3]
    assert pareto_front([0.3, 0.5, 1.0], [0.2, 0.3, 0.0], False) == [0, 2]
    with pytest.raises(UsageError):
        resolve_points(["nosuchformat:x=1"])


# ----------------------------------------------------------------------------- attention level


def test_dense_format_gives_zero_error(cache):
    cc = _compress(cache, "dense")
    rep = attention_fidelity(cc, cache, backend="torch")
    assert rep["heldout"] == 16 and rep["prefix_tokens"] == 32 and rep["backend"] == "torch"
    assert set(rep["layers"]) == {0, 2}
    assert rep["overall"]["rel_l2"] < 1e-6 and rep["overall"]["max_abs"] < 1e-5
    assert rep["overall"]["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert rep["storage_ratio"] == pytest.approx(1.0) and rep["recall"] is None


def test_planted_corruption_gives_large_error(cache, test_formats):
    small = attention_fidelity(_compress(cache, "test-noisy", noise=0.01), cache, backend="torch")
    big = attention_fidelity(_compress(cache, "test-noisy", noise=2.0), cache, backend="torch")
    assert 0 < small["overall"]["rel_l2"] < 0.05
    assert big["overall"]["rel_l2"] > 0.3 and big["overall"]["cosine"] < 0.95


def test_selection_recall_and_traffic(cache, test_formats):
    cc = _compress(cache, "test-even")
    rep = attention_fidelity(cc, cache, backend="torch")
    # recall by hand: dense probabilities of the held-out queries on even prefix tokens / on all prefix tokens
    layer = cache.layers[0]
    probs = attention_probs(layer.queries[:, :, 32:], layer.keys, causal=True)[..., :32]
    want = (probs[..., ::2].sum(-1) / probs.sum(-1)).mean()
    assert rep["layers"][0]["recall"]["recall"] == pytest.approx(float(want), rel=1e-5)
    assert rep["layers"][0]["recall"]["selected_fraction"] == pytest.approx(0.5)
    assert rep["traffic_ratio"] == pytest.approx(0.5) and rep["storage_ratio"] == pytest.approx(1.0)
    assert rep["overall"]["rel_l2"] > 0.01


def test_fewer_heldout_queries_than_the_file_keeps(cache):
    cc = _compress(cache, "dense")
    rep = attention_fidelity(cc, cache, heldout=4, backend="torch")
    assert rep["heldout"] == 4 and rep["overall"]["rel_l2"] < 1e-6 and rep["overall"]["count"] == 2 * 1 * 4 * 4
    with pytest.raises(UsageError, match="--heldout 16 or less"):
        check_source(cc, cache, heldout=20)


def test_triton_backend_agrees_with_torch(cache, test_formats, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cc = _compress(cache, "test-kernel")
    assert resolve_backend("triton", cc.fmt)[0] == "triton"
    tri = attention_fidelity(cc, cache, backend="triton")
    ref = attention_fidelity(cc, cache, backend="torch")
    assert tri["backend"] == "triton" and ref["backend"] == "torch"
    assert tri["kernel_vs_torch"]["rel_l2"] < 1e-5
    assert tri["overall"]["rel_l2"] < 1e-5 and ref["overall"]["rel_l2"] < 1e-6


def test_backend_choice(monkeypatch, test_formats):
    dense = get_format("dense")
    assert resolve_backend("auto", dense)[0] == ("triton" if torch.cuda.is_available() and dense.has_kernel else "torch")
    with pytest.raises(UsageError, match="no Triton kernel"):
        resolve_backend("triton", dense)
    with pytest.raises(UsageError, match="--backend must be one of"):
        resolve_backend("cuda", dense)
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(UsageError, match="TRITON_INTERPRET=1"):
            resolve_backend("triton", test_formats["test-kernel"])


def test_source_checks(cache, tmp_path):
    cc = _compress(cache, "dense")
    other = synthetic_cache(tokens=48, head_dim=16, heads=4, kv_heads=2, layers=(0, 2), seed=5)
    with pytest.raises(BadDataError, match="token ids differ"):
        check_source(cc, other)
    no_q = KVCache(cache.facts, {i: LayerKV(l.keys, l.values) for i, l in cache.layers.items()}, cache.token_ids, {})
    with pytest.raises(UsageError, match="no queries"):
        check_source(cc, no_q)
    zero = _compress(cache, "dense", heldout=0)
    with pytest.raises(UsageError, match="--heldout 0"):
        check_source(zero, cache)
    cc.info["source_path"] = str(tmp_path / "gone.safetensors")
    cc.info["source_sha256"] = "ab" * 32
    with pytest.raises(BadDataError, match="pass it with --capture"):
        find_source(cc, tmp_path / "x.safetensors")


@pytest.mark.parametrize("spec", ["bitmap:sparsity=0.7", "signvq:bits=2", "pagestat:budget=32,page_size=8", "quant:bits=4,group=16"])
def test_registered_kernels_agree_with_torch(spec, monkeypatch):
    """Every merged format with a Triton kernel: the verify backends agree under TRITON_INTERPRET=1."""
    from kvtool.core.spec import parse_spec

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    name, values = parse_spec(spec)
    if name not in load_all():
        pytest.fail(f"format {name} is expected to be merged")
    small = synthetic_cache(tokens=72, head_dim=64, heads=6, kv_heads=2, layers=(0,))
    fmt = get_format(name)
    assert fmt.has_kernel
    cc = compress_cache(small, fmt, make_params(fmt, values), heldout=8)
    tri = attention_fidelity(cc, small, backend="triton")
    ref = attention_fidelity(cc, small, backend="torch")
    assert tri["kernel_vs_torch"]["rel_l2"] < 1e-2
    assert tri["overall"]["rel_l2"] == pytest.approx(ref["overall"]["rel_l2"], abs=1e-2)
