"""Rotated storage: a layer's keys and values stored after an orthonormal rotation of each head vector
(:mod:`kvtool.methods.rotation`), and the live layer that attends through such storage.

The rotation R (a Walsh-Hadamard transform over head_dim, optionally after a seeded sign flip) is
orthonormal, so attention over rotated keys K' = K R^T and values V' = V R^T with a rotated query
q' = R q gives scores q' . k' = q . k and the output R out: a live layer rotates the step's query
(and new keys / values) once, attends over what it stores as stored (the KIVI kernel reads ordinary
KIVI codes), and rotates the output back once (:class:`RotatedLive`). Decoding a stored layer is its
format's decode followed by R^T.

What is stored beside the format's tensors: ``rotation.signs`` int8 ``[D]`` when a seed was given
(counted in the bytes as the part ``rotation``); the layer's meta holds ``rotate`` ("hadamard") and
``rotate_seed`` (or None).
"""

from __future__ import annotations

import torch

from kvtool.core.cache import LayerKV
from kvtool.core.errors import BadDataError
from kvtool.formats._live import LiveLayer
from kvtool.formats.base import Encoded
from kvtool.methods.rotation import random_signs, rotate, rotation_matrix, unrotate

SIGNS = "rotation.signs"


def signs_for(d: int, seed: int | None) -> torch.Tensor | None:
    """int8 ``[d]`` sign vector of ``seed``, or None (no sign flip)."""
    return None if seed is None else random_signs(d, seed)


def rotate_layer(layer: LayerKV, signs: torch.Tensor | None) -> LayerKV:
    """Keys/values ``[B, Hkv, T, D]`` rotated (float32 maths) and rounded to their dtype; queries and
    hidden states dropped (a rotated format reads neither)."""
    out = []
    for x in (layer.keys, layer.values):
        r = rotate(x, signs).to(x.dtype)
        if not bool(torch.isfinite(r).all()):
            raise BadDataError(f"a rotated head vector exceeds {x.dtype}'s range; compress without rotate")
        out.append(r)
    return LayerKV(keys=out[0], values=out[1])


def unrotate_layer(keys: torch.Tensor, values: torch.Tensor, signs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded (rotated) keys/values ``[B, Hkv, T, D]`` rotated back, float32."""
    return unrotate(keys, signs), unrotate(values, signs)


def stored_signs(enc: Encoded) -> torch.Tensor | None:
    return enc.tensors.get(SIGNS)


def without_rotation(enc: Encoded) -> Encoded:
    """The format's own tensors and meta (the signs and the rotation keys removed): what the
    unrotated format reads."""
    meta = {k: v for k, v in enc.meta.items() if k not in ("rotate", "rotate_seed")}
    return Encoded({n: t for n, t in enc.tensors.items() if n != SIGNS}, meta)


def with_rotation(enc: Encoded, seed: int | None, signs: torch.Tensor | None) -> Encoded:
    tensors = dict(enc.tensors)
    if signs is not None:
        tensors[SIGNS] = signs
    return Encoded(tensors, {**enc.meta, "rotate": "hadamard", "rotate_seed": seed})


def check_signs(enc: Encoded, d: int) -> None:
    """BadDataError unless the stored signs are what the meta says (int8 +-1 ``[d]`` with a seed, none without)."""
    seed = enc.meta.get("rotate_seed")
    s = enc.tensors.get(SIGNS)
    if seed is None:
        if s is not None:
            raise BadDataError(f"tensor {SIGNS!r} is unexpected without rotate_seed")
        return
    if s is None:
        raise BadDataError(f"tensor {SIGNS!r} is missing")
    if s.dtype != torch.int8 or tuple(s.shape) != (d,) or not bool(((s == 1) | (s == -1)).all()):
        raise BadDataError(f"{SIGNS} must be int8 [{d}] of +1/-1")


_MATRICES: dict[tuple[str, int, tuple[int, ...] | None], torch.Tensor] = {}
_SIGN_MATRICES: dict[tuple[str, str, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _signs_key(signs: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if signs is None else tuple(int(x) for x in signs.tolist())


def shared_matrix(d: int, signs: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The float32 ``[d, d]`` rotation matrix of ``d`` and ``signs`` on ``device``, one shared by every
    layer that rotates alike (``d * d * 4`` bytes per model and device, not counted per layer)."""
    key = (str(device), d, _signs_key(signs))
    if key not in _MATRICES:
        _MATRICES[key] = rotation_matrix(d, signs, device)
    return _MATRICES[key]


def _sign_matrix(matrix: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``matrix * sqrt(d)`` (every entry +-1, exact in any float dtype) in ``dtype``, and a 0-d zero
    of ``dtype`` (addmm's ignored input), cached per matrix object and dtype (the shared matrices
    live as long as the process, so their identity is stable)."""
    key = (str(matrix.device), str(dtype), matrix.shape[0], matrix.data_ptr())
    hit = _SIGN_MATRICES.get(key)
    if hit is None or hit[0] is not matrix:
        d = matrix.shape[0]
        hit = (matrix, torch.round(matrix * d ** 0.5).to(dtype), torch.zeros((), dtype=dtype, device=matrix.device))
        _SIGN_MATRICES[key] = hit
    return hit[1], hit[2]


def turn(x: torch.Tensor, matrix: torch.Tensor, back: bool = False) -> torch.Tensor:
    """Rows ``x [..., D]`` rotated (``x @ matrix``) or rotated back (``x @ matrix.T``), rounded once to
    ``x``'s dtype. ``matrix`` float32 ``[D, D]`` (:func:`shared_matrix`). On CUDA one GEMM: the +-1
    matrix in ``x``'s dtype (exact), float32 accumulation, 1 / sqrt(D) applied as its alpha, so a
    step pays one launch per side (the float32 path pays three: cast, matmul, cast); elsewhere the
    float32 product."""
    d = x.shape[-1]
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        signs, zero = _sign_matrix(matrix, x.dtype)
        flat = x.reshape(-1, d)
        out = torch.addmm(zero, flat, signs.T if back else signs, beta=0, alpha=d ** -0.5)
        return out.view(x.shape)
    return (x.float() @ (matrix.T if back else matrix)).to(x.dtype)


class RotatedLive(LiveLayer):
    """A live layer over rotated storage: ``inner`` (the format's own live layer) holds the rotated
    keys/values; each step rotates its queries (one float32 ``[D, D]`` matmul) and its new keys/values
    (:func:`~kvtool.methods.rotation.rotate`, bit for bit what encoding the same tokens stores, then the
    cache dtype), and rotates the output back once (one matmul). The matrix is shared by the layers
    (:func:`shared_matrix`); ``stored_bytes`` counts the inner layer's and the signs."""

    def __init__(self, inner: LiveLayer, seed: int | None, signs: torch.Tensor | None) -> None:
        self.inner, self.fmt, self.seed = inner, inner.fmt, seed
        self.signs = None if signs is None else signs.to(inner.device)
        d = inner.head_dim
        self.matrix = shared_matrix(d, signs, inner.device)  # x @ M = R x
        if self.matrix.is_cuda and inner.dtype in (torch.float16, torch.bfloat16):
            _sign_matrix(self.matrix, inner.dtype)  # made now, eagerly: never inside a captured step
        self.writes_first = inner.writes_first

    def _rot(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return turn(x.to(dtype), self.matrix)

    def _rot_kv(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt = self.inner.dtype
        return rotate(keys, self.signs).to(dt), rotate(values, self.signs).to(dt)

    def _back(self, y: torch.Tensor) -> torch.Tensor:
        return turn(y, self.matrix, back=True)

    @property
    def tokens(self) -> int:
        return self.inner.tokens

    def reference_tensor(self) -> torch.Tensor:
        return self.inner.reference_tensor()

    def encoded_shape(self) -> tuple[int, int, int, int]:
        return self.inner.encoded_shape()

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.inner.append(*self._rot_kv(keys, values))

    def step(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None) -> torch.Tensor:
        return self._back(self.inner.step(self._rot(q, q.dtype), *self._rot_kv(keys, values), scale))

    def partial(self, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self.inner.partial(self._rot(q, q.dtype), scale)
        return self._back(out), lse

    def attend_one(self, q: torch.Tensor, scale: float | None) -> torch.Tensor:
        return self._back(self.inner.attend_one(self._rot(q, q.dtype), scale))

    def prepare(self, query_tokens: int = 1) -> None:
        self.inner.prepare(query_tokens)

    def room(self) -> int:
        return self.inner.room()

    def reserve(self, steps: int) -> None:
        self.inner.reserve(steps)

    def stored_bytes(self) -> int:
        extra = 0 if self.signs is None else self.signs.numel() * self.signs.element_size()
        return self.inner.stored_bytes() + extra

    def workspace_bytes(self, query_rows: int) -> int:
        """The inner layer's, plus the rotated query and output (float32) beside it."""
        return self.inner.workspace_bytes(query_rows) + 2 * 4 * query_rows * self.head_dim

    def join_bytes(self) -> int:
        return self.inner.join_bytes()

    def encoded(self) -> Encoded:
        return with_rotation(self.inner.encoded(), self.seed, None if self.signs is None else self.signs)
