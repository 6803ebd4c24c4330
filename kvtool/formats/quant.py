"""The quantisation baseline: KIVI (keys per channel, values per token, low-bit codes with a scale and
zero point per group, a full-precision residual window), plus plain per-token int8 and fp8 (e4m3).

Shapes: a layer's keys/values ``[B, Hkv, T, D]``. With ``R = min(residual, T)`` and ``n = T - R``:

- ``scheme=kivi``: keys quantise their first ``Tk = floor(n / group) * group`` tokens, per channel in
  groups of ``group`` tokens (KIVI's key cache: whole groups only; the ``T - Tk`` last keys, between R
  and R + group - 1 of them, stay in full precision, as KIVI keeps its key tail). Values quantise their
  first ``Tv = n`` tokens, per token in groups of ``group`` channels (the last group of a token shorter
  when ``group`` does not divide D: it still has its own scale and zero point, counted). Codes are
  bit-packed (:mod:`kvtool.methods.quantize`): keys along tokens, ``codes.keys`` ``uint8 [B, Hkv, D,
  ceil(Tk*bits/8)]``; values along channels, ``codes.values`` ``uint8 [B, Hkv, Tv, ceil(D*bits/8)]``.
  Scales/zero points: ``scales.keys``/``zeros.keys`` ``[B, Hkv, D, Tk/group]``,
  ``scales.values``/``zeros.values`` ``[B, Hkv, Tv, ceil(D/group)]``, float16 (float32 when a value
  reaches float16's range; ``meta["scale_dtype"]``).
- ``scheme=int8`` / ``fp8``: symmetric, one scale per token and head (``max|x| / 127`` or ``/ 448``),
  codes ``int8`` / ``uint8`` (e4m3fn bit patterns) ``[B, Hkv, n, D]`` for keys and values, scales
  ``[B, Hkv, n]``; no zero points. The residual window defaults to 0 (the plain engine cache).
- ``residual.keys`` ``[B, Hkv, T - Tk, D]`` and ``residual.values`` ``[B, Hkv, T - Tv, D]`` in the
  capture dtype: the most recent tokens, unquantised.

Every one of these tensors is stored and counted (parts: codes, scales, zeros, residual).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvtool.core.cache import DTYPES, LayerKV, dtype_name
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.attention import attend_partial
from kvtool.methods.quantize import (
    check_bits,
    dequantize_groups,
    dequantize_symmetric,
    pack_codes,
    packed_length,
    quantize_groups,
    quantize_symmetric,
    row_groups,
    scale_dtype_for,
    unpack_codes,
)
from kvtool.formats.base import Encoded, Format, FormatParams, get_format, make_params, register
from kvtool.formats._live import LiveLayer, dense_attention_out, nbytes as tensor_nbytes, on_gpu

SCHEMES = ("kivi", "int8", "fp8")


@dataclass
class QuantParams(FormatParams):
    """``scheme`` kivi|int8|fp8; ``bits`` 2|4|8 (kivi; int8/fp8 are 8); ``group`` elements per scale
    and zero point (kivi, default 32); ``residual`` most recent tokens kept in full precision
    (default 32 for kivi, 0 for int8/fp8). ``None`` means the scheme's default."""

    bits: int | None = None
    group: int | None = None
    residual: int | None = None
    scheme: Literal["kivi", "int8", "fp8"] = "kivi"

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise UsageError(f"--format quant: scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.scheme == "kivi":
            self.bits = 4 if self.bits is None else self.bits
            self.group = 32 if self.group is None else self.group
            self.residual = 32 if self.residual is None else self.residual
            check_bits(self.bits)
            if self.group < 1:
                raise UsageError(f"--group must be at least 1, got {self.group}")
        else:
            if self.bits not in (None, 8):
                raise UsageError(f"--format quant scheme {self.scheme} stores 8-bit codes; drop --bits {self.bits} or use scheme kivi for 2 or 4 bits")
            if self.group is not None:
                raise UsageError(f"--format quant scheme {self.scheme} has one scale per token; --group applies to scheme kivi only")
            self.bits = 8
            self.residual = 0 if self.residual is None else self.residual
        if self.residual < 0:
            raise UsageError(f"--residual must be at least 0, got {self.residual}")


def split_tokens(t: int, p: QuantParams) -> tuple[int, int]:
    """(Tk, Tv): tokens whose keys / values are quantised (module docstring)."""
    n = max(t - p.residual, 0)
    if p.scheme == "kivi":
        return (n // p.group) * p.group, n
    return n, n


def encode_kivi(keys: torch.Tensor, values: torch.Tensor, p: QuantParams) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """KIVI encoding of keys/values ``[B, Hkv, T, D]``; returns (tensors, meta)."""
    b, h, t, d = keys.shape
    tk, tv = split_tokens(t, p)
    sdt = scale_dtype_for(torch.cat([keys[:, :, :tk].reshape(-1), values[:, :, :tv].reshape(-1)]))
    tensors: dict[str, torch.Tensor] = {}
    # keys: rows are (b, h, channel), grouped along tokens
    krows = keys[:, :, :tk].transpose(-1, -2).reshape(b * h * d, tk)
    kidx, kgroups = row_groups(b * h * d, tk, p.group, keys.device)
    codes, scale, zero = quantize_groups(krows, kidx, kgroups, p.bits, sdt)
    tensors["codes.keys"] = pack_codes(codes.reshape(b, h, d, tk), p.bits)
    tensors["scales.keys"] = scale.reshape(b, h, d, tk // p.group)
    tensors["zeros.keys"] = zero.reshape(b, h, d, tk // p.group)
    # values: rows are (b, h, token), grouped along channels
    vrows = values[:, :, :tv].reshape(b * h * tv, d)
    vidx, vgroups = row_groups(b * h * tv, d, p.group, values.device)
    codes, scale, zero = quantize_groups(vrows, vidx, vgroups, p.bits, sdt)
    tensors["codes.values"] = pack_codes(codes.reshape(b, h, tv, d), p.bits)
    tensors["scales.values"] = scale.reshape(b, h, tv, math.ceil(d / p.group))
    tensors["zeros.values"] = zero.reshape(b, h, tv, math.ceil(d / p.group))
    tensors["residual.keys"] = keys[:, :, tk:].contiguous()
    tensors["residual.values"] = values[:, :, tv:].contiguous()
    return tensors, {"scale_dtype": dtype_name(sdt), "key_tokens": tk, "value_tokens": tv}


def decode_kivi(enc: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised keys/values float32 ``[B, Hkv, T, D]`` of a kivi layer."""
    m, ts = enc.meta, enc.tensors
    b, h, t, d = m["shape"]
    bits, group, tk, tv = m["bits"], m["group"], m["key_tokens"], m["value_tokens"]
    kcodes = unpack_codes(ts["codes.keys"], bits, tk).reshape(-1)
    kidx, _ = row_groups(b * h * d, tk, group, kcodes.device)
    kq = dequantize_groups(kcodes, kidx, ts["scales.keys"].reshape(-1), ts["zeros.keys"].reshape(-1)).reshape(b, h, d, tk).transpose(-1, -2)
    vcodes = unpack_codes(ts["codes.values"], bits, d).reshape(-1)
    vidx, _ = row_groups(b * h * tv, d, group, vcodes.device)
    vq = dequantize_groups(vcodes, vidx, ts["scales.values"].reshape(-1), ts["zeros.values"].reshape(-1)).reshape(b, h, tv, d)
    keys = torch.cat([kq, ts["residual.keys"].float()], dim=2)
    values = torch.cat([vq, ts["residual.values"].float()], dim=2)
    return keys, values


def encode_symmetric(keys: torch.Tensor, values: torch.Tensor, p: QuantParams) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Per-token int8 / fp8 encoding; returns (tensors, meta)."""
    n, _ = split_tokens(keys.shape[2], p)
    sdt = scale_dtype_for(torch.cat([keys[:, :, :n].reshape(-1), values[:, :, :n].reshape(-1)]))
    tensors: dict[str, torch.Tensor] = {}
    for kind, x in (("keys", keys), ("values", values)):
        codes, scale = quantize_symmetric(x[:, :, :n], p.scheme, sdt)
        tensors[f"codes.{kind}"] = codes.contiguous()
        tensors[f"scales.{kind}"] = scale.contiguous()
        tensors[f"residual.{kind}"] = x[:, :, n:].contiguous()
    return tensors, {"scale_dtype": dtype_name(sdt), "key_tokens": n, "value_tokens": n}


def decode_symmetric(enc: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
    ts, scheme = enc.tensors, enc.meta["scheme"]
    out = []
    for kind in ("keys", "values"):
        q = dequantize_symmetric(ts[f"codes.{kind}"], ts[f"scales.{kind}"], scheme)
        out.append(torch.cat([q, ts[f"residual.{kind}"].float()], dim=2))
    return out[0], out[1]


def expected_shapes(meta: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Tensor name -> (shape, dtype) that a layer with this meta must store."""
    b, h, t, d = meta["shape"]
    tk, tv, bits = meta["key_tokens"], meta["value_tokens"], meta["bits"]
    sdt = DTYPES[meta["scale_dtype"]]
    dt = DTYPES[meta["dtype"]]
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "residual.keys": ((b, h, t - tk, d), dt),
        "residual.values": ((b, h, t - tv, d), dt),
    }
    if meta["scheme"] == "kivi":
        g = meta["group"]
        shapes.update({
            "codes.keys": ((b, h, d, packed_length(tk, bits)), torch.uint8),
            "scales.keys": ((b, h, d, tk // g), sdt),
            "zeros.keys": ((b, h, d, tk // g), sdt),
            "codes.values": ((b, h, tv, packed_length(d, bits)), torch.uint8),
            "scales.values": ((b, h, tv, math.ceil(d / g)), sdt),
            "zeros.values": ((b, h, tv, math.ceil(d / g)), sdt),
        })
    else:
        cdt = torch.int8 if meta["scheme"] == "int8" else torch.uint8
        for kind, n in (("keys", tk), ("values", tv)):
            shapes[f"codes.{kind}"] = ((b, h, n, d), cdt)
            shapes[f"scales.{kind}"] = ((b, h, n), sdt)
    return shapes


@register
class QuantFormat(Format):
    name = "quant"
    summary = "KIVI 2/4/8-bit codes (keys per channel, values per token) with a full-precision residual; int8/fp8 per token"
    Params = QuantParams
    default_sweep = (
        'quant:bits=2,4,8',
        'quant:scheme=int8,fp8',
    )
    paper_rows = (
        ('pruning with KIVI quantisation (Mustafar 4.2)', 'KIVI 2-bit', 'quant:bits=2'),
        ('pruning with KIVI quantisation (Mustafar 4.2)', 'KIVI 4-bit', 'quant:bits=4'),
    )

    live_grows = True

    def live_layer(self, enc: Encoded, like: torch.Tensor) -> "QuantLive":
        """The layer as a live cache layer (:class:`QuantLive`) on ``like``'s device."""
        return QuantLive(self, Encoded({n: t.to(like.device) for n, t in enc.tensors.items()}, dict(enc.meta)))

    def storage_after_pruning(self, params: FormatParams, prune: Any) -> tuple[Format, FormatParams]:
        """Pruned tensors keep their bitmap and quantise only the kept elements: ``bitmapq`` (the
        joint Mustafar + KIVI case), which needs scheme kivi."""
        if params.scheme != "kivi":
            raise UsageError(f"--prune with --format quant needs scheme kivi (the kept elements become low-bit codes); scheme {params.scheme} cannot compose with pruning")
        storage = get_format("bitmapq")
        return storage, make_params(storage, {
            "bits": params.bits, "group": params.group, "residual": params.residual, "method": prune.method,
            "key_sparsity": prune.key_sparsity, "value_sparsity": prune.value_sparsity, "dense_window": prune.dense_window,
        })

    def check(self, layer: LayerKV, params: FormatParams) -> None:
        if layer.keys.dtype not in DTYPES.values():
            raise BadDataError(f"quant needs float16/bfloat16/float32 keys, got {layer.keys.dtype}")

    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        """keys/values ``[B, Hkv, T, D]`` -> the tensors of the module docstring."""
        p = params if isinstance(params, QuantParams) else QuantParams(**params.to_dict())
        keys, values = layer.keys, layer.values
        if p.scheme == "kivi":
            tensors, meta = encode_kivi(keys, values, p)
        else:
            tensors, meta = encode_symmetric(keys, values, p)
        meta.update({"scheme": p.scheme, "bits": p.bits, "group": p.group, "residual": p.residual, "shape": list(keys.shape), "dtype": dtype_name(keys.dtype)})
        return Encoded(tensors, meta)

    def decode(self, enc: Encoded) -> LayerKV:
        keys, values = decode_kivi(enc) if enc.meta["scheme"] == "kivi" else decode_symmetric(enc)
        dt = DTYPES[enc.meta["dtype"]]
        return LayerKV(keys=keys.to(dt), values=values.to(dt))

    def validate(self, enc: Encoded) -> None:
        m = enc.meta
        for key in ("scheme", "bits", "shape", "dtype", "scale_dtype", "key_tokens", "value_tokens"):
            if key not in m:
                raise BadDataError(f"layer metadata lacks {key!r}")
        if m["scheme"] not in SCHEMES:
            raise BadDataError(f"unknown quant scheme {m['scheme']!r}")
        if m["bits"] not in (2, 4, 8) or (m["scheme"] == "kivi" and not (isinstance(m.get("group"), int) and m["group"] >= 1)):
            raise BadDataError(f"bad bits/group in layer metadata: bits {m['bits']}, group {m.get('group')}")
        if m["dtype"] not in DTYPES or m["scale_dtype"] not in DTYPES or len(m["shape"]) != 4:
            raise BadDataError("bad dtype or shape in layer metadata")
        t = m["shape"][2]
        if not (0 <= m["key_tokens"] <= t and 0 <= m["value_tokens"] <= t) or (m["scheme"] == "kivi" and m["key_tokens"] % m["group"]):
            raise BadDataError(f"quantised token counts {m['key_tokens']}/{m['value_tokens']} do not fit {t} tokens")
        shapes = expected_shapes(m)
        if set(enc.tensors) != set(shapes):
            missing = sorted(set(shapes) - set(enc.tensors)) or sorted(set(enc.tensors) - set(shapes))
            raise BadDataError(f"tensor {missing[0]!r} is missing or unexpected")
        for name, (shape, dt) in shapes.items():
            got = enc.tensors[name]
            if tuple(got.shape) != shape or got.dtype != dt:
                raise BadDataError(f"{name} is {got.dtype} {list(got.shape)}, expected {dt} {list(shape)}")
        for name, (_, dt) in shapes.items():
            if name.startswith(("scales.", "zeros.", "residual.")) and not bool(torch.isfinite(enc.tensors[name].float()).all()):
                raise BadDataError(f"{name} holds non-finite numbers")
            if name.startswith("scales.") and bool((enc.tensors[name].float() < 0).any()):
                raise BadDataError(f"{name} holds negative scales")
        if m["scheme"] == "int8":
            for kind in ("keys", "values"):
                if bool((enc.tensors[f"codes.{kind}"] == -128).any()):
                    raise BadDataError(f"codes.{kind} holds -128, outside the symmetric int8 range -127..127")
        if m["scheme"] == "fp8":
            for kind in ("keys", "values"):
                c = enc.tensors[f"codes.{kind}"]
                if bool(((c & 0x7F) == 0x7F).any()):
                    raise BadDataError(f"codes.{kind} holds float8 NaN patterns")

    def report(self, cc, source=None) -> dict[str, Any]:
        stored = sum(sum(self.nbytes(e).values()) for e in cc.layers.values())
        elements = sum(2 * math.prod(e.meta["shape"]) for e in cc.layers.values())
        quantised = sum(math.prod(e.meta["shape"][:2]) * e.meta["shape"][3] * (e.meta["key_tokens"] + e.meta["value_tokens"]) for e in cc.layers.values())
        first = next(iter(cc.layers.values())).meta if cc.layers else {}
        return {
            "scheme": first.get("scheme"),
            "bits": first.get("bits"),
            "bits_per_element": 8.0 * stored / elements if elements else float("nan"),
            "quantised_share": quantised / elements if elements else float("nan"),
            "scale_dtype": first.get("scale_dtype"),
        }


# ----------------------------------------------------------------------------- live cache

LIVE_CHUNK_SYMMETRIC = 32  # int8 / fp8: recent tokens quantised 32 at a time in a live cache


def quantize_keys_kivi(keys: torch.Tensor, bits: int, group: int, sdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI keys ``[B, Hkv, n, D]`` (n a multiple of ``group``) -> packed codes ``[B, Hkv, D, n*bits/8]``
    and scales / zero points ``[B, Hkv, D, n/group]`` (the key half of :func:`encode_kivi`)."""
    b, h, n, d = keys.shape
    rows = keys.transpose(-1, -2).reshape(b * h * d, n)
    idx, groups = row_groups(b * h * d, n, group, keys.device)
    codes, scale, zero = quantize_groups(rows, idx, groups, bits, sdt)
    return pack_codes(codes.reshape(b, h, d, n), bits), scale.reshape(b, h, d, n // group), zero.reshape(b, h, d, n // group)


def quantize_values_kivi(values: torch.Tensor, bits: int, group: int, sdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI values ``[B, Hkv, n, D]`` -> packed codes ``[B, Hkv, n, ceil(D*bits/8)]`` and scales /
    zero points ``[B, Hkv, n, ceil(D/group)]`` (the value half of :func:`encode_kivi`)."""
    b, h, n, d = values.shape
    rows = values.reshape(b * h * n, d)
    idx, groups = row_groups(b * h * n, d, group, values.device)
    codes, scale, zero = quantize_groups(rows, idx, groups, bits, sdt)
    g = math.ceil(d / group)
    return pack_codes(codes.reshape(b, h, n, d), bits), scale.reshape(b, h, n, g), zero.reshape(b, h, n, g)


def unpack_fast(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """:func:`unpack_codes` in uint8 arithmetic (no int32 temporaries): ``[..., m]`` -> ``[..., n]``."""
    if bits == 8:
        return packed[..., :n]
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :n]


def _dequant(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype: torch.dtype, exact: bool = True) -> torch.Tensor:
    """``codes [..., L]`` (uint8) with one scale / zero point per ``group`` along the last axis
    ``[..., ceil(L/group)]`` -> ``[..., L]`` in ``dtype``. ``exact``: float32 maths, the numbers of
    :func:`dequantize_groups` (the torch reference); else in ``dtype`` in place (the GPU path: two
    temporaries of the output's size instead of five float32 ones; within ``dtype``'s rounding)."""
    length = codes.shape[-1]
    ct = torch.float32 if exact else dtype
    if length % group == 0:
        out = codes.to(ct).unflatten(-1, (length // group, group))
        out.mul_(scale.to(ct)[..., None]).add_(zero.to(ct)[..., None])
        out = out.flatten(-2)
    else:
        s = scale.to(ct).repeat_interleave(group, dim=-1)[..., :length]
        z = zero.to(ct).repeat_interleave(group, dim=-1)[..., :length]
        out = codes.to(ct) * s + z
    return out.to(dtype)


class QuantLive(LiveLayer):
    """A live ``quant`` layer. KIVI: packed key codes with a scale and zero point per channel and
    group of tokens, packed value codes per token, and full-precision residual keys / values (R to
    R + group - 1 tokens each). A new token joins both residuals; when one reaches R + group tokens
    its oldest ``group`` are quantised (keys per channel, values per token) and their codes joined
    to the stored ones. int8 / fp8 do the same with per-token scales, 32 tokens at a time. A step
    dequantises the codes (float32 maths, the cache dtype out), then attends with torch SDPA over
    the dequantised and residual tokens on CUDA (kvtool has no KIVI kernel), or with the float32
    reference on the CPU; the dequantised copy lives for one layer's attention (the workspace)."""

    def __init__(self, fmt: "QuantFormat", enc: Encoded) -> None:
        self.fmt = fmt
        m, ts = enc.meta, enc.tensors
        self.scheme, self.bits, self.group = m["scheme"], int(m["bits"]), m.get("group")
        self.residual = int(m["residual"])
        self.cache_dtype = DTYPES[m["dtype"]]
        self.kt, self.vt = int(m["key_tokens"]), int(m["value_tokens"])
        b, h, t, d = m["shape"]
        self.b, self.h, self.d = b, h, d
        self.chunk = int(self.group) if self.scheme == "kivi" else LIVE_CHUNK_SYMMETRIC
        if self.scheme == "kivi" and self.chunk * self.bits % 8:
            raise UsageError(f"a live KIVI cache packs whole groups of codes: group {self.chunk} x {self.bits} bits is not a whole number of bytes")
        self.codes = {kind: ts[f"codes.{kind}"] for kind in ("keys", "values")}
        self.scales = {kind: ts[f"scales.{kind}"] for kind in ("keys", "values")}
        self.zeros = {kind: ts[f"zeros.{kind}"] for kind in ("keys", "values")} if self.scheme == "kivi" else {}
        cap = self.residual + self.chunk
        self.res: dict[str, torch.Tensor] = {}
        self.res_n: dict[str, int] = {}
        for kind in ("keys", "values"):
            r = ts[f"residual.{kind}"]
            buf = r.new_zeros((b, h, max(cap, r.shape[2]), d))
            buf[:, :, :r.shape[2]] = r
            self.res[kind], self.res_n[kind] = buf, r.shape[2]
        for kind in ("keys", "values"):
            self._absorb_full(kind)

    # -- growth

    @property
    def capacity(self) -> int:
        return self.residual + self.chunk

    @property
    def tokens(self) -> int:
        return self.kt + self.res_n["keys"]

    def reference_tensor(self) -> torch.Tensor:
        return self.res["keys"]

    def encoded_shape(self) -> tuple[int, int, int, int]:
        return self.b, self.h, self.tokens, self.d

    def _absorb_full(self, kind: str) -> None:
        while self.res_n[kind] >= self.capacity:
            self._absorb(kind)

    def _absorb(self, kind: str) -> None:
        g, buf, n = self.chunk, self.res[kind], self.res_n[kind]
        x = buf[:, :, :g]
        sdt = self.scales[kind].dtype
        want = scale_dtype_for(x)
        if want == torch.float32 and sdt != torch.float32:  # a chunk beyond float16's range: widen the stored scales
            self.scales[kind] = self.scales[kind].float()
            if self.zeros:
                self.zeros[kind] = self.zeros[kind].float()
            sdt = torch.float32
        if self.scheme == "kivi":
            quant = quantize_keys_kivi if kind == "keys" else quantize_values_kivi
            codes, scale, zero = quant(x, self.bits, self.group, sdt)
            along = 3 if kind == "keys" else 2
            self.codes[kind] = torch.cat([self.codes[kind], codes], dim=along)
            self.scales[kind] = torch.cat([self.scales[kind], scale], dim=along)
            self.zeros[kind] = torch.cat([self.zeros[kind], zero], dim=along)
        else:
            codes, scale = quantize_symmetric(x, self.scheme, sdt)
            self.codes[kind] = torch.cat([self.codes[kind], codes], dim=2)
            self.scales[kind] = torch.cat([self.scales[kind], scale], dim=2)
        rest = n - g
        buf[:, :, :rest] = buf[:, :, g:n].clone()
        self.res_n[kind] = rest
        if kind == "keys":
            self.kt += g
        else:
            self.vt += g

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        for kind, x in (("keys", keys), ("values", values)):
            done = 0
            while done < x.shape[2]:
                take = min(x.shape[2] - done, self.capacity - self.res_n[kind])
                n = self.res_n[kind]
                self.res[kind][:, :, n:n + take] = x[:, :, done:done + take]
                self.res_n[kind] = n + take
                done += take
                self._absorb_full(kind)

    def room(self) -> int:
        return self.capacity - max(self.res_n.values()) - 1

    # -- attention

    def dense(self, exact: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys / values ``[B, Hkv, T, D]`` in the cache dtype: dequantised codes, then the residual
        (``exact``: float32 dequantisation maths, as ``decode``)."""
        out = []
        for kind in ("keys", "values"):
            n = self.kt if kind == "keys" else self.vt
            codes, scale = self.codes[kind], self.scales[kind]
            if self.scheme == "kivi":
                if kind == "keys":
                    deq = _dequant(unpack_fast(codes, self.bits, n), scale, self.zeros[kind], self.group, self.cache_dtype, exact).transpose(-1, -2)
                else:
                    deq = _dequant(unpack_fast(codes, self.bits, self.d), scale, self.zeros[kind], self.group, self.cache_dtype, exact)
            else:
                deq = dequantize_symmetric(codes, scale, self.scheme).to(self.cache_dtype)
            out.append(torch.cat([deq, self.res[kind][:, :, :self.res_n[kind]]], dim=2))
        return out[0], out[1]

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.dense()
        return attend_partial(q, keys, values, scale)

    def attend_one(self, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        keys, values = self.dense(exact=not on_gpu(q))
        return dense_attention_out(q, keys, values, scale)

    # -- bytes

    def stored_bytes(self) -> int:
        return tensor_nbytes(*self.codes.values(), *self.scales.values(), *self.zeros.values(), *self.res.values())

    def join_bytes(self) -> int:
        """A group's join: the stored codes and scales once more (concatenation)."""
        return tensor_nbytes(*self.codes.values(), *self.scales.values(), *self.zeros.values())

    def workspace_bytes(self, query_rows: int) -> int:
        """A step on the GPU: the dequantised keys and values with the residual (cache dtype), and
        while one of them is made, its unpacked codes (one byte per element and one more for the
        shifts) and the dequantised copy before the residual joins: 4 dense copies of the layer's
        keys or values in all (the float32 reference path on the CPU takes more)."""
        b, h, t, d = self.encoded_shape()
        dense = b * h * t * d * self.cache_dtype.itemsize
        return 3 * dense + 2 * b * h * t * d + 4 * query_rows * (d + 2) * 2

    def encoded(self) -> Encoded:
        tensors = {f"codes.{k}": v for k, v in self.codes.items()}
        tensors.update({f"scales.{k}": v for k, v in self.scales.items()})
        tensors.update({f"zeros.{k}": v for k, v in self.zeros.items()})
        for kind in ("keys", "values"):
            tensors[f"residual.{kind}"] = self.res[kind][:, :, :self.res_n[kind]].contiguous()
        sdt = self.scales["keys"].dtype
        meta = {"scheme": self.scheme, "bits": self.bits, "group": self.group, "residual": self.residual, "shape": [self.b, self.h, self.tokens, self.d],
                "dtype": dtype_name(self.cache_dtype), "scale_dtype": dtype_name(sdt), "key_tokens": self.kt, "value_tokens": self.vt}
        return Encoded(tensors, meta)
