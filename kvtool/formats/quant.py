"""The quantisation baseline: KIVI (keys per channel, values per token, low-bit codes with a scale and
zero point per group, a full-precision residual window), plus plain per-token int8 and fp8 (e4m3).

Shapes: a layer's keys/values ``[B, Hkv, T, D]``. With ``R = min(residual, T)`` and ``n = T - R``:

- ``scheme=kivi``: keys quantise their first ``Tk = floor(n / group) * group`` tokens, per channel in
  groups of ``group`` tokens (KIVI's key cache: whole groups only; the ``T - Tk`` last keys, between R
  and R + group - 1 of them, stay in full precision, as KIVI keeps its key tail; with ``partial=true``
  the last, shorter group is quantised too, ``Tk = n``, with its own scale and zero point). Values quantise their
  first ``Tv = n`` tokens, per token in groups of ``group`` channels (the last group of a token shorter
  when ``group`` does not divide D: it still has its own scale and zero point, counted). Codes are
  bit-packed (:mod:`kvtool.methods.quantize`): keys along tokens, ``codes.keys`` ``uint8 [B, Hkv, D,
  ceil(Tk*bits/8)]``; values along channels, ``codes.values`` ``uint8 [B, Hkv, Tv, ceil(D*bits/8)]``.
  Scales/zero points: ``scales.keys``/``zeros.keys`` ``[B, Hkv, D, ceil(Tk/group)]``,
  ``scales.values``/``zeros.values`` ``[B, Hkv, Tv, ceil(D/group)]``, float16 (float32 when a value
  reaches float16's range; ``meta["scale_dtype"]``).
- ``scheme=int8`` / ``fp8``: symmetric, one scale per token and head (``max|x| / 127`` or ``/ 448``),
  codes ``int8`` / ``uint8`` (e4m3fn bit patterns) ``[B, Hkv, n, D]`` for keys and values, scales
  ``[B, Hkv, n]``; no zero points. The residual window defaults to 0 (the plain engine cache).
- ``residual.keys`` ``[B, Hkv, T - Tk, D]`` and ``residual.values`` ``[B, Hkv, T - Tv, D]`` in the
  capture dtype: the most recent tokens, unquantised.

Every one of these tensors is stored and counted (parts: codes, scales, zeros, residual).

``rotate=hadamard`` (any scheme) stores the layer after an orthonormal Walsh-Hadamard rotation of
each key and value head vector (:mod:`kvtool.formats._rotated`; ``head_dim`` a power of two): the
tensors above hold the rotated keys/values (the residual too, rounded to the capture dtype), decode
rotates the dequantised tokens back, and ``rotate_seed=N`` flips signs first (``rotation.signs``
int8 ``[D]``, counted as the part ``rotation``). A live layer and the kernel attend over the rotated
tensors as stored, with the query rotated before and the output rotated back after.

Attention: :meth:`QuantFormat.attend` attends over the decoded (dequantised) tokens, the torch
reference; :meth:`QuantFormat.attend_kernel` reads a kivi layer's stored bytes through the KIVI
decode kernel (:mod:`kvtool.kernels.kivi_attention`); int8 / fp8 have no kernel. A live layer
(:class:`QuantLive`, kivi) holds these tensors with room to grow and attends through the kernel on
CUDA (docs/decode.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvtool.core.cache import DTYPES, LayerKV, dtype_name
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.limits import LIVE_HEADROOM
from kvtool.core.attention import attend_partial
from kvtool.methods.quantize import (
    FP16_SAFE,
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
from kvtool.formats import _rotated
from kvtool.methods.rotation import ROTATIONS, check_dim, rotate, unrotate
from kvtool.kernels import kivi_quantize
from kvtool.kernels.kivi_attention import KiviCache, cache_from_encoded, kivi_attention, workspace_bytes as kivi_workspace_bytes

SCHEMES = ("kivi", "int8", "fp8")


@dataclass
class QuantParams(FormatParams):
    """``scheme`` kivi|int8|fp8; ``bits`` 2|4|8 (kivi; int8/fp8 are 8); ``group`` elements per scale
    and zero point (kivi, default 32); ``residual`` most recent tokens kept in full precision
    (default 32 for kivi, 0 for int8/fp8); ``partial`` (kivi) quantises the keys' last, partial
    group of tokens too (its own scale and zero point) instead of keeping it in full precision.
    ``rotate`` none|hadamard rotates each head vector before quantising (module docstring);
    ``rotate_seed`` adds a seeded random sign flip to the rotation.
    ``None`` means the scheme's default."""

    bits: int | None = None
    group: int | None = None
    residual: int | None = None
    scheme: Literal["kivi", "int8", "fp8"] = "kivi"
    partial: bool = False
    rotate: Literal["none", "hadamard"] = "none"
    rotate_seed: int | None = None

    def __post_init__(self) -> None:
        if self.rotate not in ROTATIONS:
            raise UsageError(f"--format quant: rotate must be one of {', '.join(ROTATIONS)}, got {self.rotate!r}")
        if self.rotate_seed is not None and (self.rotate != "hadamard" or self.rotate_seed < 0):
            raise UsageError(f"--format quant: rotate_seed (a seed of 0 or more, got {self.rotate_seed}) needs rotate=hadamard")
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
            if self.partial:
                raise UsageError(f"--format quant scheme {self.scheme} quantises every token; --partial applies to scheme kivi only")
            self.bits = 8
            self.residual = 0 if self.residual is None else self.residual
        if self.residual < 0:
            raise UsageError(f"--residual must be at least 0, got {self.residual}")


def split_tokens(t: int, p: QuantParams) -> tuple[int, int]:
    """(Tk, Tv): tokens whose keys / values are quantised (module docstring)."""
    n = max(t - p.residual, 0)
    if p.scheme == "kivi":
        return (n if p.partial else (n // p.group) * p.group), n
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
    tensors["scales.keys"] = scale.reshape(b, h, d, math.ceil(tk / p.group))
    tensors["zeros.keys"] = zero.reshape(b, h, d, math.ceil(tk / p.group))
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
            "scales.keys": ((b, h, d, math.ceil(tk / g)), sdt),
            "zeros.keys": ((b, h, d, math.ceil(tk / g)), sdt),
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
    has_kernel = True

    def live_layer(self, enc: Encoded, like: torch.Tensor) -> "LiveLayer":
        """The layer as a live cache layer on ``like``'s device: :class:`QuantLive` (scheme kivi,
        attending through the KIVI kernel on CUDA) or :class:`SymmetricLive` (int8 / fp8); a rotated
        layer's inside a :class:`~kvtool.formats._rotated.RotatedLive`."""
        moved = Encoded({n: t.to(like.device) for n, t in enc.tensors.items()}, dict(enc.meta))
        if moved.meta.get("rotate"):
            inner = self.live_layer(_rotated.without_rotation(moved), like)
            return _rotated.RotatedLive(inner, moved.meta.get("rotate_seed"), _rotated.stored_signs(moved))
        return QuantLive(self, moved) if enc.meta["scheme"] == "kivi" else SymmetricLive(self, moved)

    def attend_kernel(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scheme kivi: :func:`~kvtool.kernels.kivi_attention.kivi_attention` over the stored codes,
        scales and residual (the maths of :meth:`attend`). Schemes int8 / fp8 have no kernel: their
        torch reference (:meth:`attend`)."""
        if enc.meta["scheme"] != "kivi":
            return self.attend(q, enc, scale)
        if enc.meta.get("rotate"):
            signs = _rotated.stored_signs(enc)
            out, lse = self.attend_kernel(rotate(q, signs).to(q.dtype), _rotated.without_rotation(enc), scale)
            return unrotate(out, signs).to(out.dtype), lse
        return kivi_attention(q, cache_from_encoded(enc), scale)

    def storage_after_pruning(self, params: FormatParams, prune: Any) -> tuple[Format, FormatParams]:
        """Pruned tensors keep their bitmap and quantise only the kept elements: ``bitmapq`` (the
        joint Mustafar + KIVI case), which needs scheme kivi."""
        if params.rotate != "none":
            raise UsageError("--prune with --format quant needs rotate=none (pruning keeps elements of the unrotated tensors)")
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
        if getattr(params, "rotate", "none") != "none":
            check_dim(int(layer.keys.shape[-1]))

    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        """keys/values ``[B, Hkv, T, D]`` -> the tensors of the module docstring."""
        p = params if isinstance(params, QuantParams) else QuantParams(**params.to_dict())
        signs = None
        if p.rotate != "none":
            check_dim(int(layer.keys.shape[-1]))
            signs = _rotated.signs_for(int(layer.keys.shape[-1]), p.rotate_seed)
            layer = _rotated.rotate_layer(layer, signs)
        keys, values = layer.keys, layer.values
        if p.scheme == "kivi":
            tensors, meta = encode_kivi(keys, values, p)
        else:
            tensors, meta = encode_symmetric(keys, values, p)
        meta.update({"scheme": p.scheme, "bits": p.bits, "group": p.group, "residual": p.residual, "shape": list(keys.shape), "dtype": dtype_name(keys.dtype)})
        if p.partial:
            meta["partial"] = True
        enc = Encoded(tensors, meta)
        return enc if p.rotate == "none" else _rotated.with_rotation(enc, p.rotate_seed, signs)

    def decode(self, enc: Encoded) -> LayerKV:
        """Dequantised keys/values; a rotated layer's rotated back (float32 maths, then the capture dtype)."""
        plain = _rotated.without_rotation(enc) if enc.meta.get("rotate") else enc
        keys, values = decode_kivi(plain) if enc.meta["scheme"] == "kivi" else decode_symmetric(plain)
        if enc.meta.get("rotate"):
            keys, values = _rotated.unrotate_layer(keys, values, _rotated.stored_signs(enc))
        dt = DTYPES[enc.meta["dtype"]]
        return LayerKV(keys=keys.to(dt), values=values.to(dt))

    def validate(self, enc: Encoded) -> None:
        if "rotate" in enc.meta:
            if enc.meta["rotate"] != "hadamard" or not isinstance(enc.meta.get("shape"), list) or len(enc.meta["shape"]) != 4:
                raise BadDataError(f"bad rotation in layer metadata: {enc.meta['rotate']!r}")
            d = enc.meta["shape"][3]
            if not isinstance(d, int) or d < 1 or d & (d - 1):
                raise BadDataError(f"a rotated layer needs a head dimension that is a power of two, got {d}")
            _rotated.check_signs(enc, d)
            enc = _rotated.without_rotation(enc)
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
        if not (0 <= m["key_tokens"] <= t and 0 <= m["value_tokens"] <= t) or (m["scheme"] == "kivi" and not m.get("partial") and m["key_tokens"] % m["group"]):
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
            "rotate": first.get("rotate") or "none",
        }


# ----------------------------------------------------------------------------- live cache

LIVE_CHUNK_SYMMETRIC = 32  # int8 / fp8: recent tokens quantised 32 at a time in a live cache
# how a live KIVI layer quantises a residual group (QuantLive._absorb): "auto" takes the one-launch
# Triton kernel (kvtool.kernels.kivi_quantize) on CUDA and torch elsewhere; "always" takes the kernel
# wherever it runs (tests: CPU tensors under TRITON_INTERPRET=1); "never" keeps torch
ABSORB_KERNEL: Literal["auto", "always", "never"] = "auto"
ABSORB_FLAG_GROUPS = 4  # residual groups whose range flags the kernel leaves for the next absorbs


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


def _dequant(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``codes [..., L]`` (uint8) with one scale / zero point per ``group`` along the last axis
    ``[..., ceil(L/group)]`` -> ``[..., L]`` in ``dtype``: float32 maths, the numbers of
    :func:`dequantize_groups` (the torch reference), rounded to ``dtype``."""
    length = codes.shape[-1]
    if length % group == 0:
        out = codes.float().unflatten(-1, (length // group, group))
        out.mul_(scale.float()[..., None]).add_(zero.float()[..., None])
        out = out.flatten(-2)
    else:  # a group longer than the row is one group: repeated ``length`` times, never ``group`` times
        reps = min(group, length)
        s = scale.float().repeat_interleave(reps, dim=-1)[..., :length]
        z = zero.float().repeat_interleave(reps, dim=-1)[..., :length]
        out = codes.float() * s + z
    return out.to(dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def capturing(x: torch.Tensor) -> bool:
    """Whether work on ``x``'s device is being captured in a CUDA graph right now."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class _ResidualLive(LiveLayer):
    """What the quantised live layers share: ``kt`` tokens quantised, ``res_n`` per kind in the
    full-precision residual buffers ``res``; shape ``b`` x ``h`` x tokens x ``d``."""

    kt: int
    res_n: dict[str, int]
    res: dict[str, torch.Tensor]
    b: int
    h: int
    d: int

    @property
    def tokens(self) -> int:
        return self.kt + self.res_n["keys"]

    def reference_tensor(self) -> torch.Tensor:
        return self.res["keys"]

    def encoded_shape(self) -> tuple[int, int, int, int]:
        return self.b, self.h, self.tokens, self.d

    def _residual_slots(self, have: int, limit: int) -> int:
        """Residual buffer slots for ``have`` tokens held and at most ``limit`` ever held at once:
        ``limit`` when that is within :data:`LIVE_HEADROOM` of ``have`` (the usual R + group), else
        ``have`` + the headroom (a residual or group of 2^24 tokens allocates for the tokens there
        are, not for the parameter; :meth:`_grow_residual` adds slots as tokens come)."""
        return max(min(limit, have + LIVE_HEADROOM), have)

    def _grow_residual(self, need: int, limit: int, slack: int = 0) -> None:
        """Residual buffers of at least ``need`` slots (+ ``slack``), doubling up to ``limit`` (eager
        work only: a re-allocation invalidates CUDA graphs captured before)."""
        size = self.res["keys"].shape[2]
        if need + slack <= size:
            return
        slots = max(need, min(2 * (size - slack), limit)) + slack
        for kind in ("keys", "values"):
            old = self.res[kind]
            self.res[kind] = old.new_zeros((self.b, self.h, slots, self.d))
            self.res[kind][:, :, :self.res_n[kind]] = old[:, :, :self.res_n[kind]]
        cache = getattr(self, "cache", None)
        if cache is not None:
            cache.residual_keys, cache.residual_values = self.res["keys"], self.res["values"]



class QuantLive(_ResidualLive):
    """A live KIVI layer on the kernel's cache with room to grow (:class:`~kvtool.kernels.kivi_attention.KiviCache`).

    Holds, on the model's device: packed key codes with a scale and zero point per channel and group
    of tokens, packed value codes with a scale and zero point per token (and group of channels),
    all allocated for a capacity of tokens (one group more than held; a re-allocation adds 1/64, at least 256 tokens),
    and full-precision residual keys / values in the cache dtype in buffers of R + group slots
    (:meth:`reserve` widens them for steps replayed from a CUDA graph); ``lengths`` (int32
    ``[4]`` on the device) holds the quantised key and value tokens and the residual tokens in use.
    A file's partial last key group (``partial=true``) rejoins the key residual dequantised (the
    numbers ``decode`` gives) and is quantised again with the next whole group.

    A new token is written at the residual's length on the device (both lengths + 1), so a step
    captured in a CUDA graph keeps appending when replayed (:meth:`room` replays; a step being
    captured never quantises). When an eager append fills a residual to R + group tokens, its oldest ``group``
    are quantised (keys per channel, values per token, the codes :func:`encode_kivi` writes for the
    same tokens) into the next slots of the codes, and the residual moves down; this reads the
    lengths on the host first (a captured step may have appended since). A full capacity is
    re-allocated 1/64 (at least 256 tokens) larger. A step attends through :func:`~kvtool.kernels.kivi_attention.kivi_attention`
    on CUDA (no host syncs, no dequantised copy), through the float32 reference over the
    dequantised tokens elsewhere."""

    def __init__(self, fmt: "QuantFormat", enc: Encoded, dtype: torch.dtype | None = None) -> None:
        self.fmt = fmt
        m, ts = enc.meta, enc.tensors
        self.bits, self.group, self.residual = int(m["bits"]), int(m["group"]), int(m["residual"])
        self.chunk = self.group
        if self.chunk * self.bits % 8:
            raise UsageError(f"a live KIVI cache packs whole groups of codes: group {self.chunk} x {self.bits} bits is not a whole number of bytes")
        self.cache_dtype = dtype or DTYPES[m["dtype"]]
        b, h, _, d = m["shape"]
        self.b, self.h, self.d = b, h, d
        self.kt, self.vt = int(m["key_tokens"]), int(m["value_tokens"])
        rk, rv = ts["residual.keys"].to(self.cache_dtype), ts["residual.values"].to(self.cache_dtype)
        if self.kt % self.group:  # partial=true: the keys' last, shorter group rejoins the residual dequantised
            rk = torch.cat([self._partial_keys(ts), rk], dim=2)
        self.res_n = {"keys": int(rk.shape[2]), "values": int(rv.shape[2])}
        self.threshold = self.residual + self.chunk
        rcap = self._residual_slots(max(rk.shape[2], rv.shape[2]), self.threshold)
        self.res = {"keys": rk.new_zeros((b, h, rcap, d)), "values": rv.new_zeros((b, h, rcap, d))}
        self.res["keys"][:, :, :rk.shape[2]] = rk
        self.res["values"][:, :, :rv.shape[2]] = rv
        self._status_init(rk.device)
        sdt = ts["scales.keys"].dtype
        self._allocate(self._capacity_for(max(self.kt, self.vt) + max(self.res_n.values()) - self.residual, grow=False), sdt, ts)
        self._absorb_full_groups()

    def _partial_keys(self, ts: dict[str, torch.Tensor]) -> torch.Tensor:
        """A file's last, partial key group (``partial=true``: ``kt`` not a multiple of ``group``)
        dequantised ``[B, Hkv, kt % group, D]`` in the cache dtype (the numbers ``decode`` gives);
        ``kt`` drops to whole groups, which is what the live layer quantises."""
        whole = self.kt // self.group * self.group
        codes = unpack_fast(ts["codes.keys"], self.bits, self.kt)[..., whole:]
        g0 = whole // self.group
        deq = _dequant(codes, ts["scales.keys"][..., g0:g0 + 1], ts["zeros.keys"][..., g0:g0 + 1], self.group, self.cache_dtype)
        self.kt = whole
        return deq.transpose(-1, -2)

    # -- storage

    def _capacity_for(self, tokens: int, grow: bool = True) -> int:
        """Quantised slots for ``tokens``: one spare group (a new layer), or 1/64 more, at least 256
        tokens (a re-allocation, so that growing costs a copy, and a replayed step a new capture,
        once every 256 tokens at most; the H100 gate saw one every 64 tokens at 4,096); for a
        group far longer than the tokens (more than :data:`LIVE_HEADROOM` ahead), the tokens plus
        the headroom, grown when a whole group is quantised (:meth:`_absorb`)."""
        tokens = max(tokens, 0)  # a residual longer than the tokens leaves none to quantise yet
        extra = max(tokens // 64, 256) if grow else 0  # at least 256 tokens: a generation recaptures its graph rarely
        whole = _round_up(tokens + max(self.group, extra), self.group)
        if whole <= tokens + LIVE_HEADROOM + self.group:
            return _round_up(whole, 64) if self.group % 64 == 0 or 64 % self.group == 0 else whole  # key rows in 16-byte runs (the CUDA kernel's copies)
        # key scales cover the whole groups that fit (capacity // group): every group quantised so far
        return _round_up(tokens + max(LIVE_HEADROOM, extra), 64)

    def _allocate(self, capacity: int, sdt: torch.dtype, old: dict[str, torch.Tensor]) -> None:
        """Buffers for ``capacity`` quantised tokens, holding the tokens in use of ``old`` (tensors
        named as the format stores them, each at least as long as the tokens in use)."""
        b, h, d, g, bits = self.b, self.h, self.d, self.group, self.bits
        dev = self.res["keys"].device
        ngv = math.ceil(d / g)
        kb, kg = self.kt * bits // 8, self.kt // g
        kc = torch.zeros((b, h, d, capacity * bits // 8), dtype=torch.uint8, device=dev)
        # key scales group-major (the kernel reads one group of every channel per block: one run of bytes)
        ks = torch.zeros((b, h, capacity // g, d), dtype=sdt, device=dev).transpose(2, 3)
        kz = torch.zeros((b, h, capacity // g, d), dtype=sdt, device=dev).transpose(2, 3)
        vc = torch.zeros((b, h, capacity, packed_length(d, bits)), dtype=torch.uint8, device=dev)
        vs = torch.zeros((b, h, capacity, ngv), dtype=sdt, device=dev)
        vz = torch.zeros_like(vs)
        kc[..., :kb] = old["codes.keys"][..., :kb]
        ks[..., :kg] = old["scales.keys"][..., :kg]
        kz[..., :kg] = old["zeros.keys"][..., :kg]
        vc[:, :, :self.vt] = old["codes.values"][:, :, :self.vt]
        vs[:, :, :self.vt] = old["scales.values"][:, :, :self.vt]
        vz[:, :, :self.vt] = old["zeros.values"][:, :, :self.vt]
        self.capacity = capacity
        self.cache = KiviCache(kc, ks, kz, vc, vs, vz, self.res["keys"], self.res["values"], self.lengths, bits, g)

    def _stored(self) -> dict[str, torch.Tensor]:
        c = self.cache
        return {"codes.keys": c.key_codes, "scales.keys": c.key_scales, "zeros.keys": c.key_zeros,
                "codes.values": c.value_codes, "scales.values": c.value_scales, "zeros.values": c.value_zeros}

    # -- growth

    def _status_init(self, device: torch.device) -> None:
        """``lengths`` (int32 ``[4]``: Tk, Tv, nk, nv) as the head of a device buffer that also holds
        the range flags the absorb kernel leaves (:mod:`kvtool.kernels.kivi_quantize`), so that one
        ``tolist`` (:meth:`_sync`) reads both; the host's copy of the flags and what they cover."""
        self.flag_groups = max(1, min(ABSORB_FLAG_GROUPS, self.residual // self.chunk))
        self.status = torch.zeros(kivi_quantize.status_size(self.b, self.h, self.flag_groups), dtype=torch.int32, device=device)
        self.lengths = self.status[:4]
        self.lengths.copy_(torch.tensor([self.kt, self.vt, self.res_n["keys"], self.res_n["values"]], dtype=torch.int32))
        self.flags: list[int] = []  # the flags as last read
        self.flags_cover = {"keys": 0, "values": 0}  # whole groups those flags describe (0: none valid)
        self.flags_device_cover = {"keys": 0, "values": 0}  # whole groups the device's flags describe now
        self.flags_used = {"keys": 0, "values": 0}  # groups absorbed since the flags were read

    def _sync(self) -> None:
        """The host's counts (and the absorb kernel's range flags) from the device (eager work only:
        one host sync)."""
        values = self.status.tolist()
        self.kt, self.vt, nk, nv = (int(x) for x in values[:4])
        self.res_n = {"keys": nk, "values": nv}
        self.flags = values[4:]
        self.flags_cover = dict(self.flags_device_cover)
        self.flags_used = {"keys": 0, "values": 0}

    def kernel_absorbs(self) -> bool:
        """Whether :meth:`_absorb` takes the one-launch kernel (:data:`ABSORB_KERNEL`): on CUDA (or
        always, when forced) for the combinations :func:`kivi_quantize.supported` serves."""
        where = self.res["keys"]
        if ABSORB_KERNEL == "never" or (ABSORB_KERNEL == "auto" and not where.is_cuda):
            return False
        return kivi_quantize.supported(where.dtype, self.cache.key_scales.dtype, self.bits, self.chunk, self.d)

    def _needs_float32(self, kind: str) -> bool:
        """Whether the residual's oldest group of ``kind`` reaches float16's range
        (:func:`scale_dtype_for`): from the range flags read with the lengths when they cover this
        group (no host sync; a NaN in the group keeps float16, as the reference's max does), else
        from the tokens (a host sync)."""
        used = self.flags_used[kind]
        if used < self.flags_cover[kind]:
            k = kivi_quantize.KEYS if kind == "keys" else kivi_quantize.VALUES
            at = kivi_quantize.flag_offset(k, self.b, self.h, self.flag_groups) - 4 + used * self.b * self.h
            word = 0
            for flag in self.flags[at:at + self.b * self.h]:
                word |= int(flag)
            return word == 1
        return scale_dtype_for(self.res[kind][:, :, :self.chunk]) == torch.float32

    def _absorb(self, kind: str) -> None:
        """The residual's oldest ``group`` tokens of ``kind`` quantised into the next slots (eager;
        the host's counts exact: after :meth:`_sync`, or kept so since).

        Launches per absorb (B=8, Hkv=8, D=128, group 32, float16; aten ops that are not views,
        counted with a dispatch mode on the CPU, each a launch on CUDA): the torch path
        (:meth:`_absorb_torch`) runs 68 (keys and values alike: quantisation with its index,
        rounding and packing temporaries, stores, the residual move, lengths) and, before the kernel,
        two host syncs (``_sync``'s lengths inside every absorb, then :func:`scale_dtype_for`); the
        kernel path (:meth:`_absorb_kernel`) runs 1 launch and no host sync when the range flags read
        with the lengths at the caller's one :meth:`_sync` cover the group (every absorb of a
        reserve/decode loop after each kind's first while R >= group), else 3 more ops and the one
        host sync of :func:`scale_dtype_for` (a kind's first absorb; absorbs of tokens appended in
        the same eager call). Widening the scales to float32 or a larger capacity re-allocates
        (rare) on either path."""
        g, pos = self.chunk, (self.kt if kind == "keys" else self.vt)
        sdt = self.cache.key_scales.dtype
        if sdt != torch.float32 and self._needs_float32(kind):  # beyond float16's range: widen every scale
            sdt = torch.float32
            self._allocate(self.capacity, sdt, self._stored())
        self.flags_used[kind] += 1
        if pos + g > self.capacity:
            self._allocate(self._capacity_for(pos + g), sdt, self._stored())
        if self.kernel_absorbs():
            self._absorb_kernel(kind, pos)
        else:
            self._absorb_torch(kind, pos, sdt)
        if kind == "keys":
            self.kt += g
        else:
            self.vt += g
        self.res_n[kind] -= g

    def _absorb_full_groups(self) -> None:
        """Every residual at R + group tokens or more gives its oldest groups to the codes (the
        host's counts exact)."""
        for kind in ("keys", "values"):
            while self.res_n[kind] >= self.threshold:
                self._absorb(kind)

    def _absorb_kernel(self, kind: str, pos: int) -> None:
        """One launch: quantise, store, move the residual down, lengths and range flags."""
        c, n = self.cache, self.res_n[kind]
        absorb = kivi_quantize.absorb_keys if kind == "keys" else kivi_quantize.absorb_values
        tensors = (c.key_codes, c.key_scales, c.key_zeros) if kind == "keys" else (c.value_codes, c.value_scales, c.value_zeros)
        absorb(self.res[kind], n, *tensors, self.status, pos, self.bits, self.chunk, FP16_SAFE, self.flag_groups)
        self.flags_device_cover[kind] = min((n - self.chunk) // self.chunk, self.flag_groups)

    def _absorb_torch(self, kind: str, pos: int, sdt: torch.dtype) -> None:
        """The torch reference of :meth:`_absorb_kernel` (the device's range flags go stale)."""
        g, buf, n, c = self.chunk, self.res[kind], self.res_n[kind], self.cache
        if kind == "keys":
            codes, scale, zero = quantize_keys_kivi(buf[:, :, :g], self.bits, g, sdt)
            c.key_codes[..., pos * self.bits // 8:(pos + g) * self.bits // 8] = codes
            c.key_scales[..., pos // g:pos // g + 1] = scale
            c.key_zeros[..., pos // g:pos // g + 1] = zero
        else:
            codes, scale, zero = quantize_values_kivi(buf[:, :, :g], self.bits, g, sdt)
            c.value_codes[:, :, pos:pos + g] = codes
            c.value_scales[:, :, pos:pos + g] = scale
            c.value_zeros[:, :, pos:pos + g] = zero
        rest = n - g
        buf[:, :, :rest] = buf[:, :, g:n].clone()
        i = 0 if kind == "keys" else 1
        self.lengths[i:i + 1] += g
        self.lengths[i + 2:i + 3] -= g
        self.flags_device_cover[kind] = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New tokens ``[B, Hkv, N, D]`` into the residuals at the device's lengths; eagerly, each
        residual that reaches R + group tokens has its oldest group quantised. While a CUDA graph is
        being captured nothing is quantised (that reads the lengths on the host): the tokens go into
        the residual's spare slots and the next eager append or :meth:`reserve` quantises."""
        n = keys.shape[2]
        rk, rv = self.res["keys"], self.res["values"]
        deferred = capturing(rk)
        if not deferred:  # slots for the new tokens (up to R + group): buffers follow the tokens held
            self._grow_residual(min(max(self.res_n.values()) + n, self.threshold), self.threshold)
            rk, rv = self.res["keys"], self.res["values"]
        fast = deferred or (n == 1 and max(self.res_n.values()) < self.threshold)
        if fast:
            # both written where the device says the residuals end (a replayed step keeps appending)
            at = self.lengths[2:4].long()
            if n == 1:
                rk.index_copy_(2, at[0:1], keys.to(rk.dtype))
                rv.index_copy_(2, at[1:2], values.to(rv.dtype))
            else:
                span = torch.arange(n, device=rk.device)
                rk.index_copy_(2, at[0] + span, keys.to(rk.dtype))
                rv.index_copy_(2, at[1] + span, values.to(rv.dtype))
            self.lengths[2:4] += n
            self.res_n["keys"] += n
            self.res_n["values"] += n
        else:
            self._sync()  # replayed steps may have appended on the device since the host last counted
            for i, (kind, x) in enumerate((("keys", keys), ("values", values))):
                buf, done = self.res[kind], 0
                while done < n:
                    while self.res_n[kind] >= self.threshold:
                        self._absorb(kind)
                    take = min(n - done, self.threshold - self.res_n[kind])
                    at = self.lengths[i + 2:i + 3].long() + torch.arange(take, device=buf.device)
                    buf.index_copy_(2, at, x[:, :, done:done + take].to(buf.dtype))
                    self.lengths[i + 2:i + 3] += take
                    self.res_n[kind] += take
                    done += take
        if not deferred and max(self.res_n.values()) >= self.threshold:
            if fast:
                self._sync()  # replayed steps may have appended since the host last counted
            self._absorb_full_groups()

    def room(self) -> int:
        """Single-token steps that fit the residual buffers: what a loop replaying a captured step
        (which appends on the device and never quantises) may run before an eager step; eager
        steps quantise a group whenever a residual reaches R + group."""
        return self.res["keys"].shape[2] - max(self.res_n.values()) - 1

    def reserve(self, steps: int) -> None:
        """Make room for ``steps`` replayed steps: the counts read from the device, every full group
        quantised (what appends during a capture left), then, if that is not enough, the residual
        buffers re-allocated larger (which invalidates graphs captured before)."""
        self._sync()
        self._absorb_full_groups()
        if self.room() < steps:
            self._grow_residual(max(self.res_n.values()) + steps + 1, max(self.res_n.values()) + steps + 1)

    # -- attention

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys / values ``[B, Hkv, T, D]`` in the cache dtype: codes dequantised with float32
        maths as ``decode`` does, then the residual tokens (the torch reference)."""
        c = self.cache
        kq = _dequant(unpack_fast(c.key_codes, self.bits, self.kt), c.key_scales[..., :self.kt // self.group],
                      c.key_zeros[..., :self.kt // self.group], self.group, self.cache_dtype).transpose(-1, -2)
        vq = _dequant(unpack_fast(c.value_codes[:, :, :self.vt], self.bits, self.d), c.value_scales[:, :, :self.vt],
                      c.value_zeros[:, :, :self.vt], self.group, self.cache_dtype)
        return (torch.cat([kq, self.res["keys"][:, :, :self.res_n["keys"]]], dim=2),
                torch.cat([vq, self.res["values"][:, :, :self.res_n["values"]]], dim=2))

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        if on_gpu(q):
            return kivi_attention(q, self.cache, scale)
        keys, values = self.dense()
        return attend_partial(q, keys, values, scale)

    # -- bytes

    def stored_bytes(self) -> int:
        return tensor_nbytes(*self.cache.tensors(), self.lengths)

    def join_bytes(self) -> int:
        """A group's quantisation: float32 temporaries of its tokens (a few copies) and the residual
        moved down; a full capacity re-allocated (rare): the quantised tensors once more."""
        b, h, _, d = self.encoded_shape()
        group = 8 * b * h * self.chunk * d * 4 + tensor_nbytes(self.res["keys"])
        return max(group, tensor_nbytes(*self._stored().values()))

    def workspace_bytes(self, query_rows: int) -> int:
        """A step on the GPU: the kernel's split partials, output and lse (no dequantised copy)."""
        rows = max(1, query_rows // (self.b * self.h))
        return kivi_workspace_bytes(self.cache, rows, self.res["keys"].device)

    def encoded(self) -> Encoded:
        c, g = self.cache, self.group
        tensors = {
            "codes.keys": c.key_codes[..., :self.kt * self.bits // 8].contiguous(),
            "scales.keys": c.key_scales[..., :self.kt // g].contiguous(),
            "zeros.keys": c.key_zeros[..., :self.kt // g].contiguous(),
            "codes.values": c.value_codes[:, :, :self.vt].contiguous(),
            "scales.values": c.value_scales[:, :, :self.vt].contiguous(),
            "zeros.values": c.value_zeros[:, :, :self.vt].contiguous(),
        }
        for kind in ("keys", "values"):
            tensors[f"residual.{kind}"] = self.res[kind][:, :, :self.res_n[kind]].contiguous()
        meta = {"scheme": "kivi", "bits": self.bits, "group": self.group, "residual": self.residual, "shape": [self.b, self.h, self.tokens, self.d],
                "dtype": dtype_name(self.cache_dtype), "scale_dtype": dtype_name(c.key_scales.dtype), "key_tokens": self.kt, "value_tokens": self.vt}
        return Encoded(tensors, meta)


class SymmetricLive(_ResidualLive):
    """A live ``quant`` layer of scheme int8 / fp8: codes with one scale per token, and
    full-precision residual keys / values (R to R + 31 tokens). A new token joins both residuals;
    when they reach R + 32 tokens their oldest 32 are quantised and joined to the stored codes. A
    step dequantises the codes (cache dtype) and attends with torch SDPA on CUDA (these schemes
    have no kernel of their own), or with the float32 reference elsewhere; the dequantised copy
    lives for one layer's attention (the workspace)."""

    def __init__(self, fmt: "QuantFormat", enc: Encoded, dtype: torch.dtype | None = None) -> None:
        self.fmt = fmt
        m, ts = enc.meta, enc.tensors
        self.scheme = m["scheme"]
        self.residual = int(m["residual"])
        self.cache_dtype = dtype or DTYPES[m["dtype"]]
        self.kt, self.vt = int(m["key_tokens"]), int(m["value_tokens"])
        b, h, _, d = m["shape"]
        self.b, self.h, self.d = b, h, d
        self.chunk = LIVE_CHUNK_SYMMETRIC
        self.codes = {kind: ts[f"codes.{kind}"] for kind in ("keys", "values")}
        self.scales = {kind: ts[f"scales.{kind}"] for kind in ("keys", "values")}
        cap = self._residual_slots(max(ts["residual.keys"].shape[2], ts["residual.values"].shape[2]), self.residual + self.chunk)
        self.res: dict[str, torch.Tensor] = {}
        self.res_n: dict[str, int] = {}
        for kind in ("keys", "values"):
            r = ts[f"residual.{kind}"].to(self.cache_dtype)
            buf = r.new_zeros((b, h, max(cap, r.shape[2]), d))
            buf[:, :, :r.shape[2]] = r
            self.res[kind], self.res_n[kind] = buf, r.shape[2]
        for kind in ("keys", "values"):
            self._absorb_full(kind)

    # -- growth

    @property
    def capacity(self) -> int:
        return self.residual + self.chunk

    def _absorb_full(self, kind: str) -> None:
        while self.res_n[kind] >= self.capacity:
            self._absorb(kind)

    def _absorb(self, kind: str) -> None:
        g, buf, n = self.chunk, self.res[kind], self.res_n[kind]
        x = buf[:, :, :g]
        sdt = self.scales[kind].dtype
        if scale_dtype_for(x) == torch.float32 and sdt != torch.float32:  # a chunk beyond float16's range: widen the stored scales
            self.scales = {k: s.float() for k, s in self.scales.items()}
            sdt = torch.float32
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
                self._grow_residual(n + take, self.capacity)
                self.res[kind][:, :, n:n + take] = x[:, :, done:done + take]
                self.res_n[kind] = n + take
                done += take
                self._absorb_full(kind)

    def room(self) -> int:
        return min(self.capacity, self.res["keys"].shape[2]) - max(self.res_n.values()) - 1

    def reserve(self, steps: int) -> None:
        """Residual slots for ``steps`` single-token steps (up to R + 32, where the next quantises)."""
        self._grow_residual(min(max(self.res_n.values()) + steps + 1, self.capacity), self.capacity)

    # -- attention

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys / values ``[B, Hkv, T, D]`` in the cache dtype: dequantised codes, then the residual."""
        out = []
        for kind in ("keys", "values"):
            deq = dequantize_symmetric(self.codes[kind], self.scales[kind], self.scheme).to(self.cache_dtype)
            out.append(torch.cat([deq, self.res[kind][:, :, :self.res_n[kind]]], dim=2))
        return out[0], out[1]

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.dense()
        return attend_partial(q, keys, values, scale)

    def attend_one(self, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        keys, values = self.dense()
        return dense_attention_out(q, keys, values, scale)

    # -- bytes

    def stored_bytes(self) -> int:
        return tensor_nbytes(*self.codes.values(), *self.scales.values(), *self.res.values())

    def join_bytes(self) -> int:
        """A chunk's join: the stored codes and scales once more (concatenation)."""
        return tensor_nbytes(*self.codes.values(), *self.scales.values())

    def workspace_bytes(self, query_rows: int) -> int:
        """A step on the GPU: the dequantised keys and values with the residual (cache dtype), the
        float32 products of dequantising one of them and the dequantised copy before the residual
        joins (the float32 reference path on the CPU takes more)."""
        b, h, t, d = self.encoded_shape()
        dense = b * h * t * d * self.cache_dtype.itemsize
        return 3 * dense + 8 * b * h * t * d + 4 * query_rows * (d + 2) * 2

    def encoded(self) -> Encoded:
        tensors = {f"codes.{k}": v for k, v in self.codes.items()}
        tensors.update({f"scales.{k}": v for k, v in self.scales.items()})
        for kind in ("keys", "values"):
            tensors[f"residual.{kind}"] = self.res[kind][:, :, :self.res_n[kind]].contiguous()
        meta = {"scheme": self.scheme, "bits": 8, "group": None, "residual": self.residual, "shape": [self.b, self.h, self.tokens, self.d],
                "dtype": dtype_name(self.cache_dtype), "scale_dtype": dtype_name(self.scales["keys"].dtype), "key_tokens": self.kt, "value_tokens": self.vt}
        return Encoded(tensors, meta)
