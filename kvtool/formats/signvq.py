"""``signvq``: Self-Indexing KVCache keys (sign codes + 16-entry codebooks) with token-wise
quantised magnitudes and values; top-k retrieval in the compressed domain.

Per layer, batch b and KV head h (D = head_dim, Tc = compressed tokens, F = full-precision tokens):

- keys are centred per channel (``center``: mean or median over the compressed tokens);
- the centred key's signs, 4 dims at a time, give a 4-bit code per group (bit j set when dim
  4g+j is >= 0), packed two groups per byte (low nibble = even group);
- per group and code, the codebook holds the mean of the centred 4-d sub-vectors with that code
  (an empty code holds zeros and is flagged unused in ``index.used``);
- |centred key| / alpha (alpha = per-channel max) and the values are quantised token-wise with
  ``bits`` bits, a scale and zero point per ``group`` channels (capped at head_dim: the default 64
  is one group per token at head_dim 64), packed little-endian in bytes;
- the first ``sinks`` tokens, the last ``dense_window`` tokens and ``keep_top`` tokens (highest
  centred-key score against the prefix's last query, mean over the GQA group) stay full precision.

Retrieval: a table ``q_g . centroid[g, c]`` per group and code; a token's score is the sum of its
table entries (exactly ``q . k_hat`` with ``k_hat`` the codebook reconstruction), summed (``gqa=sum``)
or maxed over the query heads of the group; the top ``budget - F`` compressed tokens plus the F
full-precision tokens are attended, keys and values dequantised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvtool.core.attention import attend_partial, expand_kv, merge_partials
from kvtool.core.cache import DTYPES, KVCache, LayerKV
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats._retrieval import oracle_recall, resolve_budget, selection_recall
from kvtool.formats.base import CompressedCache, Encoded, Format, FormatParams, register
from kvtool.formats._live import ChunkedLive, on_gpu
from kvtool.methods.quantize import pack_codes, unpack_codes
from kvtool.kernels.common import random_decode_inputs
from kvtool.kernels.pages import combine_splits
from kvtool.kernels.signvq_lut import check_encoded, lut_scores_kernel, signvq_partials

ALLOWED_BITS = (2, 4, 8)
CODES = 16


@dataclass
class SignVQParams(FormatParams):
    center: Literal["mean", "median"] = "mean"
    bits: int = 2
    group: int = 64
    sinks: int = 4
    keep_top: int = 0
    dense_window: int = 0
    budget: int | None = None
    budget_ratio: float | None = 0.25
    gqa: Literal["sum", "max"] = "sum"

    def __post_init__(self) -> None:
        if self.bits not in ALLOWED_BITS:
            raise ValueError(f"--bits must be one of {', '.join(map(str, ALLOWED_BITS))}, got {self.bits}")
        if self.group <= 0:
            raise ValueError(f"--group must be positive, got {self.group}")
        for name in ("sinks", "keep_top", "dense_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.center not in ("mean", "median"):
            raise ValueError(f"--center must be mean or median, got {self.center!r}")
        if self.gqa not in ("sum", "max"):
            raise ValueError(f"gqa must be sum or max, got {self.gqa!r}")


# ----------------------------------------------------------------------------- reference maths


def sign_nibbles(centred: torch.Tensor) -> torch.Tensor:
    """4-bit sign codes uint8 ``[..., D/4]`` of centred keys ``[..., D]``: bit j of group g is set
    when dim 4g+j is >= 0."""
    s = (centred >= 0).to(torch.uint8).unflatten(-1, (-1, 4))
    return s[..., 0] | (s[..., 1] << 1) | (s[..., 2] << 2) | (s[..., 3] << 3)


def pack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """``[..., G]`` values 0..15 -> uint8 ``[..., ceil(G/2)]``: group 2i low nibble, 2i+1 high
    (:func:`~kvtool.methods.quantize.pack_codes` at 4 bits)."""
    return pack_codes(nib, 4)

def unpack_nibbles(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., ceil(G/2)]`` -> int64 ``[..., G]``."""
    return unpack_codes(packed, 4, groups).to(torch.int64)

def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., N]`` in 0..2^bits-1 -> uint8 ``[..., N*bits/8]``; element i sits at byte
    ``i*bits // 8``, bit offset ``i*bits % 8`` (:func:`~kvtool.methods.quantize.pack_codes`)."""
    return pack_codes(codes, bits)

def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., n*bits/8]`` -> int64 ``[..., n]``."""
    return unpack_codes(packed, bits, n).to(torch.int64)

def quantize(x: torch.Tensor, bits: int, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-wise asymmetric quantisation of ``x`` ``[..., D]`` (float) in groups of ``group``
    channels: returns packed codes uint8 ``[..., D*bits/8]`` and ``qparams`` ``[..., D/group, 2]``
    in ``dtype`` (scale = (max-min)/(2^bits-1), zero point = min). Codes are computed against the
    stored (rounded) scale and zero point, so the error is at most scale/2 plus their rounding."""
    levels = (1 << bits) - 1
    xg = x.float().unflatten(-1, (-1, group))
    lo, hi = xg.amin(-1), xg.amax(-1)
    qparams = torch.stack([(hi - lo) / levels, lo], -1).to(dtype)
    scale, zero = qparams.float().unbind(-1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(((xg - zero[..., None]) / safe[..., None]).clamp(0, levels))
    codes = torch.where(scale[..., None] > 0, codes, torch.zeros_like(codes))
    return pack_bits(codes.flatten(-2).to(torch.int64), bits), qparams


def dequantize(packed: torch.Tensor, qparams: torch.Tensor, bits: int, group: int, dim: int) -> torch.Tensor:
    """float32 ``[..., D]`` = code * scale + zero point (inverse of :func:`quantize`)."""
    codes = unpack_bits(packed, bits, dim).float().unflatten(-1, (-1, group))
    scale, zero = qparams.float().unbind(-1)
    return (codes * scale[..., None] + zero[..., None]).flatten(-2)


def build_codebook(centred: torch.Tensor, nib: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codebooks from centred keys ``[B, Hkv, T, D]`` and their codes ``[B, Hkv, T, D/4]``.

    Returns centroids float32 ``[B, Hkv, D/4, 16, 4]`` (mean of the sub-vectors with each code;
    zeros for empty codes) and counts int64 ``[B, Hkv, D/4, 16]``."""
    b, h, t, d = centred.shape
    g4 = d // 4
    sub = centred.float().reshape(b * h, t, g4, 4).permute(0, 2, 1, 3)  # [BH, G4, T, 4]
    idx = nib.to(torch.int64).reshape(b * h, t, g4).permute(0, 2, 1)  # [BH, G4, T]
    sums = torch.zeros(b * h, g4, CODES, 4, dtype=torch.float32, device=centred.device)
    sums.scatter_add_(2, idx[..., None].expand(-1, -1, -1, 4), sub)
    counts = torch.zeros(b * h, g4, CODES, dtype=torch.int64, device=centred.device)
    counts.scatter_add_(2, idx, torch.ones_like(idx))
    cent = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], torch.zeros_like(sums))
    return cent.reshape(b, h, g4, CODES, 4), counts.reshape(b, h, g4, CODES)


def used_mask_bytes(counts: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2]``: bit c%8 of byte c//8 set when code c has members (``counts`` ``[..., 16]``)."""
    used = (counts > 0).to(torch.uint8).unflatten(-1, (2, 8))
    weights = (1 << torch.arange(8, dtype=torch.uint8, device=counts.device))
    return (used * weights).sum(-1).to(torch.uint8)


def used_from_bytes(used: torch.Tensor) -> torch.Tensor:
    """bool ``[..., 16]`` from the packed ``index.used`` bytes ``[..., 2]``."""
    bits = (used.to(torch.int64)[..., None] >> torch.arange(8, device=used.device)) & 1
    return bits.flatten(-2).bool()


def lut_scores(q: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, gqa: str = "sum") -> torch.Tensor:
    """Compressed-domain scores (reference of the LUT kernel).

    q ``[B, H, Tq, D]``; codes uint8 ``[B, Hkv, Tc, ceil(D/8)]`` (packed sign nibbles); codebook
    ``[B, Hkv, D/4, 16, 4]``. Returns ``[B, Hkv, Tq, Tc]`` (float64 for float64 inputs, else
    float32): per query head the sum over groups of ``q_g . codebook[g, code]``, then summed or
    maxed over the G query heads of each KV head. Unscaled (no 1/sqrt(D))."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, tq, d = q.shape
    hkv, g4 = codebook.shape[1], codebook.shape[2]
    qg = q.to(ct).reshape(b, hkv, h // hkv, tq, g4, 4)
    lut = torch.einsum("bkgtnj,bkncj->bkgtnc", qg, codebook.to(ct))  # [B,Hkv,G,Tq,G4,16]
    onehot = torch.nn.functional.one_hot(unpack_nibbles(codes, g4), CODES).to(ct)  # [B,Hkv,Tc,G4,16]
    per_head = torch.einsum("bkgtnc,bksnc->bkgts", lut, onehot)
    return per_head.sum(2) if gqa == "sum" else per_head.amax(2)


def reconstruct_index_keys(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``k_hat`` ``[B, Hkv, Tc, D]`` (codebook dtype): each group's centroid for the token's code."""
    g4 = codebook.shape[2]
    nib = unpack_nibbles(codes, g4)  # [B,Hkv,Tc,G4]
    cb = codebook[:, :, None].expand(-1, -1, nib.shape[2], -1, -1, -1)  # [B,Hkv,Tc,G4,16,4]
    got = torch.gather(cb, 4, nib[..., None, None].expand(-1, -1, -1, -1, 1, 4)).squeeze(4)
    return got.flatten(-2)


def dequant_keys(t: dict[str, torch.Tensor], meta: dict[str, Any]) -> torch.Tensor:
    """Dequantised compressed keys float32 ``[B, Hkv, Tc, D]`` = center + sign * alpha * |k|~."""
    d, bits, group = meta["head_dim"], meta["bits"], meta["group"]
    nib = unpack_nibbles(t["index.codes"], d // 4)
    signs = ((nib[..., None] >> torch.arange(4, device=nib.device)) & 1).flatten(-2).float() * 2 - 1
    mag = dequantize(t["keys.mag"], t["keys.qparams"], bits, group, d)
    return t["keys.center"].float()[:, :, None] + signs * t["keys.alpha"].float()[:, :, None] * mag


def dequant_values(t: dict[str, torch.Tensor], meta: dict[str, Any]) -> torch.Tensor:
    """Dequantised compressed values float32 ``[B, Hkv, Tc, D]``."""
    return dequantize(t["values.q"], t["values.qparams"], meta["bits"], meta["group"], meta["head_dim"])


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 ``[..., k]`` indices of the k largest scores (ties: torch.topk's choice)."""
    return torch.topk(scores, k, dim=-1, sorted=False).indices


def select_compressed(q: torch.Tensor, enc: Encoded) -> torch.Tensor:
    """Indices int64 ``[B, Hkv, Tq, k]`` into the compressed tokens chosen by the LUT scores for
    each query token (tokens kept in full precision by ``keep_top`` are never chosen here)."""
    t, m = enc.tensors, enc.meta
    scores = lut_scores(q, t["index.codes"], t["index.codebook"], m["gqa"])
    return topk_indices(mask_kept(scores, enc), m["select"])


def mask_kept(scores: torch.Tensor, enc: Encoded) -> torch.Tensor:
    """``scores`` ``[B, Hkv, Tq, Tc]`` with the keep-top tokens (already full precision) at -inf."""
    m = enc.meta
    if m["keep_top"] == 0:
        return scores
    s, kt = m["sinks"], m["keep_top"]
    kept = enc.tensors["full.positions"][:, :, s:s + kt].to(torch.int64) - s  # [B,Hkv,kt]
    blocked = torch.zeros(scores.shape[0], scores.shape[1], scores.shape[-1], dtype=torch.bool, device=scores.device)
    blocked.scatter_(2, kept, True)
    return scores.masked_fill(blocked[:, :, None], float("-inf"))


# ----------------------------------------------------------------------------- the format


def _dtype_of(name: str) -> torch.dtype:
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def sign_entropy(centred: torch.Tensor) -> float:
    """Mean over (batch, head, channel) of the binary entropy (bits) of the sign of ``centred``
    ``[B, Hkv, T, D]`` across tokens: 1.0 = perfectly balanced signs."""
    p = (centred >= 0).float().mean(2).clamp(1e-12, 1 - 1e-12)
    h = -(p * p.log2() + (1 - p) * (1 - p).log2())
    return float(h.mean())


def center_of(keys: torch.Tensor, how: str) -> torch.Tensor:
    """Per-channel centre ``[B, Hkv, D]`` float32 of keys ``[B, Hkv, T, D]`` over the tokens."""
    k = keys.float()
    return k.mean(2) if how == "mean" else k.median(2).values


@register
class SignVQFormat(Format):
    name = "signvq"
    summary = "Self-Indexing KV: 1-bit sign codes + codebook for top-k retrieval, 2-bit |K| and V"
    Params = SignVQParams
    default_sweep = (
        'signvq:bits=2,4',
    )
    paper_rows = (
        ('sign-VQ key centring (Self-Indexing)', 'centred (mean)', 'signvq:center=mean'),
        ('sign-VQ key centring (Self-Indexing)', 'centred (median)', 'signvq:center=median'),
    )
    selects = True
    has_kernel = True
    live_grows = True

    def live_layer(self, enc: Encoded, like: torch.Tensor) -> "SignVQLive":
        """The layer as a live cache layer (:class:`SignVQLive`) on ``like``'s device."""
        return SignVQLive(self, Encoded({n: t.to(like.device) for n, t in enc.tensors.items()}, dict(enc.meta)))

    def check(self, layer: LayerKV, params: FormatParams) -> None:
        p: SignVQParams = params  # type: ignore[assignment]
        b, h, t, d = layer.keys.shape
        if d % 4:
            raise UsageError(f"signvq needs head_dim a multiple of 4 (sign codes cover 4 dims), got {d}")
        if d % min(p.group, d):
            raise UsageError(f"--group {p.group} must divide head_dim {d}")
        full = p.sinks + p.dense_window + p.keep_top
        if full >= t:
            raise UsageError(f"--sinks {p.sinks} + --dense-window {p.dense_window} + --keep-top {p.keep_top} leave no tokens to compress out of {t}")
        budget = resolve_budget(p.budget, p.budget_ratio, t)
        if budget < full:
            raise UsageError(f"token budget {budget} is smaller than --sinks {p.sinks} + --dense-window {p.dense_window} + --keep-top {p.keep_top}")
        if p.keep_top and layer.queries is None:
            raise UsageError("--keep-top needs the capture's queries (recapture without --no-queries)")

    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        """keys/values ``[B, Hkv, T, D]`` (queries ``[B, H, T, D]`` for ``keep_top``) -> the tensors
        of docs/formats.md ``### signvq``."""
        p: SignVQParams = params  # type: ignore[assignment]
        self.check(layer, p)
        k, v = layer.keys, layer.values
        b, hkv, t, d = k.shape
        dtype = k.dtype
        s, w = p.sinks, p.dense_window
        kc, vc = k[:, :, s:t - w].float(), v[:, :, s:t - w].float()
        tc = kc.shape[2]
        center = center_of(kc, p.center).to(dtype)
        centred = kc - center.float()[:, :, None]
        nib = sign_nibbles(centred)
        cent, counts = build_codebook(centred, nib)
        alpha = centred.abs().amax(2).to(dtype)
        a = alpha.float()[:, :, None]
        norm = torch.where(a > 0, centred.abs() / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(centred))
        group = min(p.group, d)
        kmag, kq = quantize(norm, p.bits, group, dtype)
        vq, vqp = quantize(vc, p.bits, group, dtype)
        sinks = torch.arange(s, device=k.device)
        window = torch.arange(t - w, t, device=k.device)
        if p.keep_top:
            qlast = layer.queries[:, :, t - 1].float().reshape(b, hkv, -1, d).mean(2)  # [B,Hkv,D]
            score = torch.einsum("bktd,bkd->bkt", centred, qlast)
            top = torch.topk(score, p.keep_top, dim=-1).indices.sort(-1).values + s  # [B,Hkv,kt]
        else:
            top = torch.zeros(b, hkv, 0, dtype=torch.int64, device=k.device)
        positions = torch.cat([sinks.expand(b, hkv, -1), top, window.expand(b, hkv, -1)], -1)
        idx = positions[..., None].expand(-1, -1, -1, d)
        tensors = {
            "index.codes": pack_nibbles(nib).contiguous(),
            "index.codebook": cent.to(dtype).contiguous(),
            "index.used": used_mask_bytes(counts).contiguous(),
            "keys.center": center.contiguous(),
            "keys.alpha": alpha.contiguous(),
            "keys.mag": kmag.contiguous(),
            "keys.qparams": kq.contiguous(),
            "values.q": vq.contiguous(),
            "values.qparams": vqp.contiguous(),
            "full.keys": torch.gather(k, 2, idx).contiguous(),
            "full.values": torch.gather(v, 2, idx).contiguous(),
            "full.positions": positions.to(torch.int32).contiguous(),
        }
        budget = resolve_budget(p.budget, p.budget_ratio, t)
        full = positions.shape[-1]
        meta = {
            "tokens": t, "compressed_tokens": tc, "head_dim": d, "dtype": str(dtype).removeprefix("torch."),
            "bits": p.bits, "group": group, "center": p.center, "gqa": p.gqa,
            "sinks": s, "keep_top": p.keep_top, "dense_window": w, "full_tokens": full,
            "budget": budget, "select": max(0, min(budget - full, tc - p.keep_top)),
        }
        return Encoded(tensors, meta)

    # ------------------------------------------------------------------ decoding and attention

    def decode(self, enc: Encoded) -> LayerKV:
        """Dense keys/values ``[B, Hkv, T, D]`` (capture dtype) in original token order: the
        dequantised compressed tokens with the full-precision tokens put back in place."""
        t, m = enc.tensors, enc.meta
        dtype = t["full.keys"].dtype
        b, hkv, tc, _ = t["keys.mag"].shape
        d, s, total = m["head_dim"], m["sinks"], m["tokens"]
        keys = torch.zeros(b, hkv, total, d, dtype=dtype, device=t["keys.mag"].device)
        values = torch.zeros_like(keys)
        keys[:, :, s:s + tc] = dequant_keys(t, m).to(dtype)
        values[:, :, s:s + tc] = dequant_values(t, m).to(dtype)
        idx = t["full.positions"].to(torch.int64)[..., None].expand(-1, -1, -1, d)
        keys.scatter_(2, idx, t["full.keys"])
        values.scatter_(2, idx, t["full.values"])
        return LayerKV(keys=keys, values=values)

    def select(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """Original token positions int64 ``[B, Hkv, Tq, budget]`` each query token attends (the
        chosen compressed tokens, then the full-precision ones)."""
        sel = select_compressed(q, enc) + enc.meta["sinks"]
        pos = enc.tensors["full.positions"].to(torch.int64)[:, :, None].expand(-1, -1, q.shape[2], -1)
        return torch.cat([sel, pos], -1)

    def selected_mask(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        b, h, tq, _ = q.shape
        hkv = enc.tensors["keys.mag"].shape[1]
        mask = torch.zeros(b, hkv, tq, enc.meta["tokens"], dtype=torch.bool, device=q.device)
        mask.scatter_(3, self.select(q, enc), True)
        return expand_kv(mask, h // hkv)

    def attend(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial over the selected compressed tokens (dequantised through the capture dtype, as
        :meth:`decode` gives them) and the full-precision tokens; q ``[B, H, Tq, D]``."""
        t, m = enc.tensors, enc.meta
        dtype = t["full.keys"].dtype
        h = q.shape[1]
        hkv = t["keys.mag"].shape[1]
        sel = select_compressed(q, enc)
        mask = torch.zeros(*sel.shape[:3], m["compressed_tokens"], dtype=torch.bool, device=q.device)
        mask.scatter_(3, sel, True)
        kd, vd = dequant_keys(t, m).to(dtype), dequant_values(t, m).to(dtype)
        part = attend_partial(q, kd, vd, scale, expand_kv(mask, h // hkv))
        full = attend_partial(q, t["full.keys"], t["full.values"], scale)
        return merge_partials(part, full)

    def attend_kernel(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return signvq_decode(q, enc, scale)

    # ------------------------------------------------------------------ bytes

    def nbytes(self, enc: Encoded) -> dict[str, int]:
        parts: dict[str, int] = {}
        for name, t in enc.tensors.items():
            part = name.split(".")[0]
            parts[part] = parts.get(part, 0) + t.numel() * t.element_size()
        return parts

    def traffic_bytes(self, enc: Encoded, q: torch.Tensor | None = None) -> int:
        """One decode step: every sign code, the codebooks, centre and alpha (for the table and
        q.center), the keep-top positions, then magnitudes, values and their scales for the chosen
        tokens, and the full-precision keys/values."""
        t, m = enc.tensors, enc.meta

        def size(name: str) -> int:
            return t[name].numel() * t[name].element_size()

        tc = max(1, m["compressed_tokens"])
        per_token = sum(size(n) for n in ("keys.mag", "keys.qparams", "values.q", "values.qparams")) / tc
        fixed = sum(size(n) for n in ("index.codes", "index.codebook", "keys.center", "keys.alpha", "full.keys", "full.values"))
        kept = size("full.positions") if m["keep_top"] else 0
        return int(fixed + kept + per_token * m["select"])

    def validate(self, enc: Encoded) -> None:
        t, m = enc.tensors, enc.meta
        need = ("index.codes", "index.codebook", "index.used", "keys.center", "keys.alpha", "keys.mag", "keys.qparams",
                "values.q", "values.qparams", "full.keys", "full.values", "full.positions")
        for name in need:
            if name not in t:
                raise BadDataError(f"tensor {name!r} is missing")
        extra = sorted(set(t) - set(need))
        if extra:
            raise BadDataError(f"unexpected tensor {extra[0]!r}")
        for key in ("tokens", "compressed_tokens", "head_dim", "bits", "group", "sinks", "keep_top", "dense_window", "full_tokens", "select", "dtype", "gqa"):
            if key not in m:
                raise BadDataError(f"layer metadata lacks {key!r}")
        try:
            dtype = _dtype_of(m["dtype"])
        except KeyError:
            raise BadDataError(f"unknown dtype {m['dtype']!r}") from None
        d, tc, bits, group, total = m["head_dim"], m["compressed_tokens"], m["bits"], m["group"], m["tokens"]
        s, kt, w, f = m["sinks"], m["keep_top"], m["dense_window"], m["full_tokens"]
        if bits not in ALLOWED_BITS or d % 4 or group <= 0 or d % group or f != s + kt + w or tc != total - s - w or tc <= 0:
            raise BadDataError(f"inconsistent metadata (bits {bits}, head_dim {d}, group {group}, tokens {total}, compressed {tc})")
        b, hkv = t["keys.mag"].shape[:2]
        shapes = {
            "index.codes": ((b, hkv, tc, (d // 4 + 1) // 2), torch.uint8),
            "index.codebook": ((b, hkv, d // 4, CODES, 4), dtype),
            "index.used": ((b, hkv, d // 4, 2), torch.uint8),
            "keys.center": ((b, hkv, d), dtype),
            "keys.alpha": ((b, hkv, d), dtype),
            "keys.mag": ((b, hkv, tc, d * bits // 8), torch.uint8),
            "keys.qparams": ((b, hkv, tc, d // group, 2), dtype),
            "values.q": ((b, hkv, tc, d * bits // 8), torch.uint8),
            "values.qparams": ((b, hkv, tc, d // group, 2), dtype),
            "full.keys": ((b, hkv, f, d), dtype),
            "full.values": ((b, hkv, f, d), dtype),
            "full.positions": ((b, hkv, f), torch.int32),
        }
        for name, (shape, dt) in shapes.items():
            if tuple(t[name].shape) != shape or t[name].dtype != dt:
                raise BadDataError(f"{name} is {tuple(t[name].shape)} {t[name].dtype}, expected {shape} {dt}")
        for name in ("index.codebook", "keys.center", "keys.alpha", "keys.qparams", "values.qparams", "full.keys", "full.values"):
            if not torch.isfinite(t[name]).all():
                raise BadDataError(f"{name} holds NaN or infinite values")
        if (t["keys.alpha"] < 0).any() or (t["keys.qparams"][..., 0] < 0).any() or (t["values.qparams"][..., 0] < 0).any():
            raise BadDataError("negative alpha or quantisation scale")
        # codebooks: each used entry's signs match its code; unused entries are zero; the used set
        # is exactly the set of codes the tokens carry
        used = used_from_bytes(t["index.used"])  # [B,Hkv,G4,16]
        cb = t["index.codebook"].float()
        bitset = ((torch.arange(CODES, device=cb.device)[:, None] >> torch.arange(4, device=cb.device)) & 1).bool()  # [16,4]
        wrong_sign = torch.where(bitset, cb < 0, cb > 0).any(-1)
        if (wrong_sign & used).any():
            raise BadDataError("index.codebook: a centroid's signs disagree with its code (corrupted codebook)")
        if ((cb != 0).any(-1) & ~used).any():
            raise BadDataError("index.codebook: an unused code has a non-zero centroid (corrupted codebook)")
        nib = unpack_nibbles(t["index.codes"], d // 4)
        present = torch.zeros_like(used)
        present.scatter_(3, nib.permute(0, 1, 3, 2), True)
        if (present != used).any():
            raise BadDataError("index.codes: the codes present disagree with index.used (corrupted codes or codebook)")
        if d // 4 % 2 and (t["index.codes"][..., -1] >> 4).any():
            raise BadDataError("index.codes: padding nibble is not zero (corrupted codes)")
        pos = t["full.positions"].to(torch.int64)
        if f:
            if (pos[..., :s] != torch.arange(s, device=pos.device)).any() or (pos[..., s + kt:] != torch.arange(total - w, total, device=pos.device)).any():
                raise BadDataError("full.positions: sink or window positions are wrong")
            top = pos[..., s:s + kt]
            if kt and ((top < s).any() or (top >= total - w).any() or (top.diff(dim=-1) <= 0).any()):
                raise BadDataError("full.positions: keep-top positions out of range or not strictly increasing")

    # ------------------------------------------------------------------ report

    def report(self, cc: CompressedCache, source: KVCache | None = None) -> dict[str, Any]:
        key_parts, value_parts, elements = 0, 0, 0
        capture_dtype = DTYPES.get(cc.facts.dtype)
        for enc in cc.layers.values():
            t, m = enc.tensors, enc.meta
            for name, x in t.items():
                # full-precision parts at float16's size, as byte_report counts them (serving_nbytes)
                wide = capture_dtype is not None and x.is_floating_point() and x.dtype == capture_dtype and x.element_size() > 2
                n = x.numel() * (2 if wide else x.element_size())
                if name.startswith("values") or name == "full.values":
                    value_parts += n
                elif name == "full.positions":
                    key_parts += n / 2
                    value_parts += n / 2
                else:
                    key_parts += n
            b, hkv = t["keys.mag"].shape[:2]
            elements += b * hkv * m["tokens"] * m["head_dim"]
        rep = cc.byte_report()
        first = cc.layers[cc.layer_indices[0]].meta
        out: dict[str, Any] = {
            "bits_per_element_keys": round(8 * key_parts / elements, 3),
            "bits_per_element_values": round(8 * value_parts / elements, 3),
            "bits_per_element_mean": round(4 * (key_parts + value_parts) / elements, 3),
            "times_smaller_than_dense": round(1 / rep["storage_ratio"], 3),
            "times_smaller_than_fp16": round(4 * elements / (key_parts + value_parts), 3),
            "budget_tokens": first["budget"],
            "selected_compressed_tokens": first["select"],
            "full_precision_tokens": first["full_tokens"],
            "traffic_ratio": round(sum(self.traffic_bytes(e) for e in cc.layers.values()) / rep["dense_bytes"], 4),
        }
        if source is not None:
            ent = {"mean": [], "median": []}
            for i in cc.layer_indices:
                m = cc.layers[i].meta
                k = source.layers[i].keys[:, :, m["sinks"]:m["tokens"] - m["dense_window"]].float()
                for how in ent:
                    ent[how].append(sign_entropy(k - center_of(k, how).to(k.dtype)[:, :, None]))
            out["sign_entropy_mean_center"] = round(sum(ent["mean"]) / len(ent["mean"]), 4)
            out["sign_entropy_median_center"] = round(sum(ent["median"]) / len(ent["median"]), 4)
            out["better_balanced_center"] = "mean" if out["sign_entropy_mean_center"] >= out["sign_entropy_median_center"] else "median"
            recall = selection_recall(self, cc, source)
            if recall is not None:
                out["recall"] = recall["overall"]
                out["recall_min"] = recall["min"]
                out["recall_per_layer"] = recall["per_layer"]
                out["recall_oracle_same_budget"] = oracle_recall(cc, source, first["budget"])
        return out


def signvq_attention_reference(q: torch.Tensor, enc: Encoded, idx: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`signvq_attention`: dequantise every compressed token (through the
    capture dtype) and attend under the mask of ``idx``."""
    t, m = enc.tensors, enc.meta
    dtype = t["full.keys"].dtype
    mask = torch.zeros(*idx.shape[:3], m["compressed_tokens"], dtype=torch.bool, device=q.device)
    mask.scatter_(3, idx.to(torch.int64), True)
    kd, vd = dequant_keys(t, m).to(dtype), dequant_values(t, m).to(dtype)
    return attend_partial(q, kd, vd, scale, expand_kv(mask, q.shape[1] // kd.shape[1]))


def signvq_decode(q: torch.Tensor, enc: Encoded, scale: float | None = None, lookup: str = "table") -> tuple[torch.Tensor, torch.Tensor]:
    """``signvq`` attention through the kernels: LUT scores, torch.topk (keep-top tokens masked),
    then one launch of the fused dequantising attention over the chosen tokens with the
    full-precision (sink / keep-top / window) tokens in extra splits, and the Triton split merge.
    Same contract as ``SignVQFormat.attend``. No host sync (CUDA-graph capturable)."""
    check_encoded(q, enc)
    t, m = enc.tensors, enc.meta
    scores = lut_scores_kernel(q, t["index.codes"], t["index.codebook"], m["gqa"], lookup=lookup)
    idx = topk_indices(mask_kept(scores, enc), m["select"]).to(torch.int32)
    out, lse = signvq_partials(q, enc, idx, scale, None, True)
    return combine_splits(out, lse, q.shape[1], q.shape[3])


def make_signvq_inputs(
    batch: int = 1, heads: int = 32, kv_heads: int = 8, tokens: int = 4096, head_dim: int = 128,
    dtype: torch.dtype = torch.float16, device: str | torch.device = "cuda", bits: int = 2, group: int = 64,
    budget: int = 512, sinks: int = 4, dense_window: int = 0, gqa: str = "sum", seed: int = 0,
) -> tuple[torch.Tensor, Encoded]:
    """Random keys/values (one planted outlier channel) encoded as ``signvq`` on ``device`` and a
    decode query ``[batch, heads, 1, head_dim]``: ``signvq_decode(q, enc)`` runs on them."""
    q, lay = random_decode_inputs(batch, heads, kv_heads, tokens, head_dim, dtype, device, seed)
    params = SignVQParams(bits=bits, group=group, budget=budget, budget_ratio=None, sinks=sinks, dense_window=dense_window, gqa=gqa)
    return q, SignVQFormat().encode(lay, params)


# ----------------------------------------------------------------------------- live cache

LIVE_CHUNK = 64  # tokens a live sign-VQ layer encodes at a time


class SignVQLive(ChunkedLive):
    """A live ``signvq`` layer: the stored layer (sign codes, codebooks, quantised magnitudes and
    values, the full-precision sink / keep-top / window tokens) and a dense tail of the layer's
    ``dense_window`` most recent new tokens plus up to 63 more. When the tail holds ``dense_window +
    64`` tokens its oldest 64 are encoded against the layer's centre, per-channel scale and codebooks
    (sign codes, token-wise quantised magnitudes and values; the codebooks are not refitted, so a
    code first seen then reads as a zero centroid in the scores) and joined to the stored tokens. A
    step scores and selects among the stored tokens as the format does (the LUT kernel and the fused
    attention on CUDA, :func:`signvq_decode`; the torch reference elsewhere), attends the tail densely
    and merges the partials. The number of tokens selected per step stays the stored layer's."""

    def __init__(self, fmt: "SignVQFormat", enc: Encoded) -> None:
        self.t = dict(enc.tensors)
        self.m = dict(enc.meta)
        keys = self.t["full.keys"]
        b, h, _, d = keys.shape
        super().__init__(fmt, keys.new_zeros((b, h, 0, d)), int(self.m["dense_window"]), LIVE_CHUNK)

    @property
    def encoded_tokens(self) -> int:
        return int(self.m["compressed_tokens"]) + int(self.m["full_tokens"])

    def absorb(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        t, m = self.t, self.m
        dtype = t["full.keys"].dtype
        bits, group = int(m["bits"]), int(m["group"])
        centred = keys.float() - t["keys.center"].float()[:, :, None]
        nib = sign_nibbles(centred)
        a = t["keys.alpha"].float()[:, :, None]
        norm = torch.where(a > 0, centred.abs() / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(centred))
        kmag, kq = quantize(norm, bits, group, dtype)
        vq, vqp = quantize(values.float(), bits, group, dtype)
        new = {"index.codes": pack_nibbles(nib), "keys.mag": kmag, "keys.qparams": kq, "values.q": vq, "values.qparams": vqp}
        for name, x in new.items():
            t[name] = torch.cat([t[name], x.to(t[name].dtype)], dim=2)
        seen = torch.zeros(*nib.shape[:2], nib.shape[3], CODES, dtype=torch.int64, device=nib.device)
        seen.scatter_add_(3, nib.to(torch.int64).permute(0, 1, 3, 2), torch.ones_like(nib, dtype=torch.int64).permute(0, 1, 3, 2))
        t["index.used"] = t["index.used"] | used_mask_bytes(seen)
        m["compressed_tokens"] = int(m["compressed_tokens"]) + keys.shape[2]
        m["tokens"] = int(m["tokens"]) + keys.shape[2]

    def _enc(self) -> Encoded:
        return Encoded(self.t, self.m)

    def encoded_partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        if on_gpu(q):
            return signvq_decode(q, self._enc(), scale)
        return self.fmt.attend(q, self._enc(), scale)

    def encoded_bytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.t.values())

    def workspace_bytes(self, query_rows: int) -> int:
        """A step: float32 scores of every stored token per KV head and query token (and their
        top-k), the selected indices and the fused attention's partials, the tail's partial."""
        b, h, _, d = self.encoded_shape()
        tq = max(1, query_rows // max(1, b * 4 * h))
        tc = int(self.m["compressed_tokens"])
        return 4 * b * h * tq * tc * 2 + 4 * query_rows * (d + 2) * 8 + self.tail.nbytes()

    def encoded(self) -> Encoded:
        """The stored layer (the tail's tokens are not in it: they are dense; see :meth:`tokens`)."""
        return Encoded(dict(self.t), dict(self.m))
