"""An orthonormal Walsh-Hadamard rotation of head vectors, optionally with a seeded random sign flip.

Quantising a rotated vector spreads an outlier channel over every channel, so low-bit codes lose far
less (QuaRot, SpinQuant and the TurboQuant presses rotate; KIVI does not). With ``d`` a power of two,
``H_d`` the Sylvester Hadamard matrix (``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``) and
``s`` a vector of ``d`` signs (+1 / -1, all +1 without a seed), the rotation of a head vector x is

    R x = H_d (s * x) / sqrt(d),   and its inverse   R^T y = s * (H_d y) / sqrt(d)

(``H_d`` is symmetric and ``H_d H_d = d I``, so R is orthonormal: ``(R q) . (R k) = q . k``). Attention
over rotated keys and values with a rotated query gives the rotated output, so a model attends
through rotated storage with one rotation of the query before and one inverse rotation of the output
after (never one per stored token).

- :func:`hadamard_transform`: the fast transform (``d log2 d`` additions, plain torch) over the last axis.
- :func:`rotate` / :func:`unrotate`: R and R^T over the last axis, in float32.
- :func:`rotation_matrix`: R as a ``[d, d]`` float32 matrix for row vectors (``x @ M`` = R x), what a
  decode step multiplies by (one small matmul per step).
- :func:`random_signs`: the seeded sign vector, int8 ``[d]``.
- :func:`sylvester`: the reference matrix ``H_d`` the tests hold the fast transform to.
"""

from __future__ import annotations

import math

import torch

from kvtool.core.errors import UsageError

ROTATIONS = ("none", "hadamard")


def check_dim(d: int) -> int:
    """UsageError unless ``d`` (the head dimension) is a power of two, what the Hadamard transform needs."""
    if d < 1 or d & (d - 1):
        raise UsageError(f"rotate=hadamard needs a head dimension that is a power of two, got {d}")
    return d


def sylvester(d: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix ``H_d`` (entries +-1, unnormalised), float32 ``[d, d]`` (the reference)."""
    check_dim(d)
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``H_d x / sqrt(d)`` over the last axis (``d`` a power of two), float32, any leading shape:
    the butterfly of log2(d) stages of sums and differences."""
    d = check_dim(int(x.shape[-1]))
    lead = x.shape[:-1]
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(*lead, d) * (1.0 / math.sqrt(d))).contiguous()


def random_signs(d: int, seed: int) -> torch.Tensor:
    """int8 ``[d]`` of +1 / -1 drawn from ``torch.Generator().manual_seed(seed)`` (the same on every machine)."""
    g = torch.Generator().manual_seed(int(seed))
    return (torch.randint(0, 2, (d,), generator=g, dtype=torch.int8) * 2 - 1).to(torch.int8)


def _signs(signs: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    return None if signs is None else signs.to(device=x.device, dtype=torch.float32)


def rotate(x: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """R x over the last axis: float32, the shape of ``x`` (``signs``: int8 ``[d]`` or None)."""
    s = _signs(signs, x)
    return hadamard_transform(x if s is None else x.float() * s)


def unrotate(y: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """R^T y over the last axis (the inverse of :func:`rotate`): float32, the shape of ``y``."""
    x = hadamard_transform(y)
    s = _signs(signs, y)
    return x if s is None else x * s


def rotation_matrix(d: int, signs: torch.Tensor | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 ``[d, d]`` M with ``x @ M == rotate(x)`` for row vectors x (and ``y @ M.T == unrotate(y)``)."""
    m = rotate(torch.eye(d), signs)  # row i: R e_i, i.e. M[i, j] = R[j, i]
    return m.to(device) if device is not None else m
