"""The bitmap sparse layout (Mustafar's format with per-block offsets), its torch decoder and its
validation. docs/formats.md (section ``bitmap``) is the byte-level specification.

One pruned tensor ``x`` ``[B, Hkv, Tc, D]`` (keys or values of the compressed tokens) is cut along the
token axis into *blocks* of 64 tokens (NB = ceil(Tc / 64); the last block is padded with zero tokens).
Blocks are numbered ``g = (b * Hkv + h) * NB + blk``. A block is a set of 64-element *tiles*, each
with a 64-bit bitmap (bit i, least significant first, set when tile element i is stored):

- keys: tile c of a block = channel c of its 64 tokens (bit i <-> token ``blk*64 + i``);
  ``bitmaps`` int64 ``[B, Hkv, NB, D]``; the block's elements in order (channel, token);
- values: tile (t, j) = one token, channels ``64j .. 64j+63`` (bit i <-> channel ``64j + i``);
  ``bitmaps`` int64 ``[B, Hkv, Tc, DT]`` with DT = ceil(D / 64) (no tiles for padding tokens);
  the block's elements in order (token, channel).

A block's stored elements (set bits, in that element order) are packed contiguously into ``nz``
(1-D, the cache dtype) from ``offsets[g]``; ``offsets`` int64 ``[B * Hkv * NB + 1]`` holds each
block's start in elements and, last, ``len(nz)``. Every block starts on a 16-byte boundary: its run
is padded with zeros to a multiple of ``ALIGN`` elements (8 for 2-byte dtypes). A tile's position
inside its block is not stored: it is the sum of the popcounts of the block's earlier tiles, which a
kernel computes with a prefix sum while it expands the bitmaps anyway.

A set bit marks a stored element by its bit pattern (not its value): ``-0.0`` is stored, so
decoding is bit-exact.

``BitmapTensor.kind`` names the tile orientation above ("keys": channel tiles, bits along tokens;
"values": token tiles, bits along channels). Layout version 1 (:data:`LAYOUT_V1`) stores keys as
channel tiles and values as token tiles; version 2 (:data:`LAYOUT_V2`, what the ``bitmap`` format
writes) swaps them, so that each operand's bits run along the axis its product reduces over: key
rows hold a token's channels (q.K^T sums over channels) and value tiles hold a channel's tokens (P.V
sums over tokens). A kernel then visits each stored element once and fetches the dense operand at
its position (:mod:`.bitmap_sparse_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.core.errors import BadDataError

TILE = 64
LAYOUT_V1 = 1
LAYOUT_V2 = 2
# tile orientation (BitmapTensor.kind) of (keys, values) in each layout version
ORIENTATIONS = {LAYOUT_V1: ("keys", "values"), LAYOUT_V2: ("values", "keys")}
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def align_elements(dtype: torch.dtype) -> int:
    """Elements per 16 bytes: the alignment of every block's run in ``nz``."""
    return 16 // torch.empty(0, dtype=dtype).element_size()


def nonzero_bits(x: torch.Tensor) -> torch.Tensor:
    """Bool, True where the element's bit pattern is not all zero (``-0.0`` counts as stored)."""
    if x.dtype not in _INT_VIEW:
        raise BadDataError(f"bitmap format stores float16, bfloat16 or float32, got {x.dtype}")
    return x.view(_INT_VIEW[x.dtype]) != 0


def popcount64(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each int64 (as int64), by 32-bit halves so that signed shifts do no harm."""
    out = torch.zeros_like(x)
    for half in (x & 0xFFFFFFFF, (x >> 32) & 0xFFFFFFFF):
        v = half - ((half >> 1) & 0x55555555)
        v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
        v = (v + (v >> 4)) & 0x0F0F0F0F
        out += ((v * 0x01010101) & 0xFFFFFFFF) >> 24
    return out


def bits_to_words(bits: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., 64]`` -> int64 ``[...]`` with bit i = ``bits[..., i]``."""
    shifts = torch.arange(TILE, device=bits.device, dtype=torch.int64)
    return (bits.to(torch.int64) << shifts).sum(-1)


def words_to_bits(words: torch.Tensor) -> torch.Tensor:
    """int64 ``[...]`` -> bool ``[..., 64]`` (bit i at index i)."""
    shifts = torch.arange(TILE, device=words.device, dtype=torch.int64)
    return ((words[..., None] >> shifts) & 1).bool()


@dataclass
class BitmapTensor:
    """Keys or values of ``tokens`` compressed tokens in the bitmap layout (see module docstring).

    nz: 1-D, cache dtype; bitmaps: int64 (keys ``[B, Hkv, NB, D]``, values ``[B, Hkv, Tc, DT]``);
    offsets: int64 ``[B * Hkv * NB + 1]``."""

    kind: str
    nz: torch.Tensor
    bitmaps: torch.Tensor
    offsets: torch.Tensor
    tokens: int
    head_dim: int
    label: str = ""  # the name in error messages ("keys" / "values"); kind when empty

    @property
    def batch(self) -> int:
        return self.bitmaps.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.bitmaps.shape[1]

    @property
    def blocks(self) -> int:
        return -(-self.tokens // TILE)

    @property
    def dtype(self) -> torch.dtype:
        return self.nz.dtype

    def expected_bitmap_shape(self) -> list[int]:
        if self.kind == "keys":
            return [self.batch, self.kv_heads, self.blocks, self.head_dim]
        return [self.batch, self.kv_heads, self.tokens, -(-self.head_dim // TILE)]

    def block_bits(self) -> torch.Tensor:
        """Bool ``[B * Hkv * NB, 64 * D']``: each block's element slots in storage order (keys D' =
        D: (channel, token); values D' = 64 * DT: (token, channel incl. padding channels))."""
        b, h, nb = self.batch, self.kv_heads, self.blocks
        bits = words_to_bits(self.bitmaps)
        if self.kind == "keys":
            return bits.reshape(b * h * nb, self.head_dim * TILE)
        pad = nb * TILE - self.tokens
        if pad:
            bits = torch.cat([bits, bits.new_zeros(b, h, pad, *bits.shape[3:])], dim=2)
        return bits.reshape(b * h * nb, TILE * self.bitmaps.shape[3] * TILE)

    def block_counts(self) -> torch.Tensor:
        """Stored elements per block, int64 ``[B * Hkv * NB]``, from the bitmaps' popcounts."""
        b, h, nb = self.batch, self.kv_heads, self.blocks
        pc = popcount64(self.bitmaps)
        if self.kind == "keys":
            return pc.reshape(b * h * nb, self.head_dim).sum(-1)
        pad = nb * TILE - self.tokens
        per_token = pc.sum(-1)
        if pad:
            per_token = torch.cat([per_token, per_token.new_zeros(b, h, pad)], dim=2)
        return per_token.reshape(b * h * nb, TILE).sum(-1)

    def pad_bits(self) -> int:
        """Bitmap bits that stand for padding positions (tokens past Tc for keys, channels past D
        for values)."""
        b, h = self.batch, self.kv_heads
        if self.kind == "keys":
            return b * h * (self.blocks * TILE - self.tokens) * self.head_dim
        return b * h * self.tokens * (-(-self.head_dim // TILE) * TILE - self.head_dim)

    def validate(self) -> None:
        """Check shapes, offsets and popcounts before anything reads ``nz`` (BadDataError)."""
        validate_bitmap_tensor(self)

    def same_bytes(self, other: "BitmapTensor") -> bool:
        """True when ``other`` is the same layout byte for byte: orientation, shape, nz bit patterns,
        bitmaps and offsets (compared on the CPU when the two sit on different devices)."""
        if (self.kind, self.tokens, self.head_dim) != (other.kind, other.tokens, other.head_dim):
            return False
        for a, b in ((self.nz, other.nz), (self.bitmaps, other.bitmaps), (self.offsets, other.offsets)):
            if a.dtype != b.dtype:
                return False
            if a.is_floating_point():  # bit patterns: -0.0 and NaNs compare as stored
                a, b = a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype])
            if a.device != b.device:
                a, b = a.cpu(), b.cpu()
            if not torch.equal(a, b):
                return False
        return True

    def decode(self) -> torch.Tensor:
        """The pruned dense tensor ``[B, Hkv, Tc, D]`` (bit-exact)."""
        return decode_bitmap_tensor(self)


def validate_bitmap_tensor(bt: BitmapTensor) -> None:
    """Shapes and dtypes, offsets (start at 0, aligned, monotone, last == len(nz)), popcounts equal
    the stored block sizes, padding bits clear. Raises BadDataError naming the problem."""
    name = bt.label or bt.kind
    if bt.kind not in ("keys", "values"):
        raise BadDataError(f"bitmap tensor kind must be keys or values, got {bt.kind!r}")
    if bt.nz.ndim != 1 or bt.nz.dtype not in _INT_VIEW:
        raise BadDataError(f"{name}.nz should be 1-D float16/bfloat16/float32, got {bt.nz.dtype} {list(bt.nz.shape)}")
    if bt.bitmaps.dtype != torch.int64 or bt.offsets.dtype != torch.int64:
        raise BadDataError(f"{name}.bitmaps and {name}.offsets must be int64")
    if bt.bitmaps.ndim != 4 or bt.tokens < 0 or bt.head_dim <= 0:
        raise BadDataError(f"{name}.bitmaps should be 4-D, got {list(bt.bitmaps.shape)}")
    want = bt.expected_bitmap_shape()
    if list(bt.bitmaps.shape) != want:
        raise BadDataError(f"{name}.bitmaps has shape {list(bt.bitmaps.shape)}, expected {want} for {bt.tokens} tokens, head_dim {bt.head_dim}")
    nblocks = bt.batch * bt.kv_heads * bt.blocks
    if list(bt.offsets.shape) != [nblocks + 1]:
        raise BadDataError(f"{name}.offsets has shape {list(bt.offsets.shape)}, expected [{nblocks + 1}]")
    off = bt.offsets
    align = align_elements(bt.nz.dtype)
    if int(off[0]) != 0:
        raise BadDataError(f"{name}.offsets[0] is {int(off[0])}, expected 0")
    if bool((off[1:] < off[:-1]).any()):
        bad = int(torch.nonzero(off[1:] < off[:-1])[0, 0]) + 1
        raise BadDataError(f"{name}.offsets are not monotone (offsets[{bad}] = {int(off[bad])} < offsets[{bad - 1}] = {int(off[bad - 1])})")
    if int(off[-1]) != bt.nz.numel():
        raise BadDataError(f"{name}.offsets end at {int(off[-1])} but {name}.nz holds {bt.nz.numel()} elements")
    if bool((off % align != 0).any()):
        bad = int(torch.nonzero(off % align != 0)[0, 0])
        raise BadDataError(f"{name}.offsets[{bad}] = {int(off[bad])} is not a multiple of {align} (16-byte alignment)")
    counts = bt.block_counts()
    stored = off[1:] - off[:-1]
    need = (counts + align - 1) // align * align
    if bool((stored != need).any()):
        bad = int(torch.nonzero(stored != need)[0, 0])
        raise BadDataError(
            f"{name} block {bad}: the bitmaps' popcount is {int(counts[bad])} elements (padded {int(need[bad])}) but the offsets give it {int(stored[bad])}"
        )
    # element by element: the first popcount slots of each block's run hold stored (non-zero bit
    # pattern) elements and the alignment padding after them is zero, so a tile whose bitmap gained
    # or lost a bit is caught even when the block's padded size does not change
    if bt.nz.numel():
        pos = torch.arange(bt.nz.numel(), device=off.device)
        block = torch.searchsorted(off, pos, right=True) - 1
        stored_slot = (pos - off[block]) < counts[block]
        if bool((nonzero_bits(bt.nz) != stored_slot).any()):
            bad = int(block[torch.nonzero(nonzero_bits(bt.nz) != stored_slot)[0, 0]])
            raise BadDataError(f"{name} block {bad}: the stored elements disagree with the bitmaps' popcount (a stored zero or a non-zero padding element)")
    if bt.pad_bits():
        if bt.kind == "keys":  # only the last block holds padding tokens
            tail = bt.tokens - (bt.blocks - 1) * TILE
            padded = words_to_bits(bt.bitmaps[:, :, -1])[..., tail:]
        else:  # only the last channel tile of each token holds padding channels
            d_last = bt.head_dim - (bt.bitmaps.shape[3] - 1) * TILE
            padded = words_to_bits(bt.bitmaps[:, :, :, -1])[..., d_last:]
        if bool(padded.any()):
            raise BadDataError(f"{name}.bitmaps set bits for padding positions (past the {bt.tokens} tokens / {bt.head_dim} channels)")


def decode_bitmap_tensor(bt: BitmapTensor) -> torch.Tensor:
    """Dense ``[B, Hkv, Tc, D]`` from the layout (torch reference of the decoding maths)."""
    b, h, nb, d = bt.batch, bt.kv_heads, bt.blocks, bt.head_dim
    bits = bt.block_bits()  # [NBt, slots]
    rank = bits.to(torch.int64).cumsum(-1) - 1
    addr = bt.offsets[:-1, None] + rank
    flat = torch.zeros(bits.shape, dtype=bt.nz.dtype, device=bt.nz.device)
    flat[bits] = bt.nz[addr[bits]]
    if bt.kind == "keys":
        dense = flat.reshape(b, h, nb, d, TILE).transpose(-1, -2).reshape(b, h, nb * TILE, d)
        return dense[:, :, : bt.tokens].contiguous()
    dt = bt.bitmaps.shape[3]
    dense = flat.reshape(b, h, nb * TILE, dt * TILE)
    return dense[:, :, : bt.tokens, :d].contiguous()


@dataclass
class BitmapCache:
    """A layer's compressed keys and values plus the dense window of the most recent tokens.

    keys/values: :class:`BitmapTensor` over the first Tc tokens; window_keys/window_values
    ``[B, Hkv, W, D]`` in the cache dtype (W may be 0). Token order: the Tc compressed tokens, then
    the W window tokens. ``version``: the layout version (:data:`ORIENTATIONS` gives the tiles'
    orientation of keys and values)."""

    keys: BitmapTensor
    values: BitmapTensor
    window_keys: torch.Tensor
    window_values: torch.Tensor
    version: int = LAYOUT_V1

    @property
    def tokens(self) -> int:
        return self.keys.tokens + self.window_keys.shape[2]

    def validate(self) -> None:
        if self.version not in ORIENTATIONS:
            raise BadDataError(f"unknown bitmap layout version {self.version!r} (known: {sorted(ORIENTATIONS)})")
        if (self.keys.kind, self.values.kind) != ORIENTATIONS[self.version]:
            raise BadDataError(f"layout version {self.version} stores keys as {ORIENTATIONS[self.version][0]!r} tiles and values as {ORIENTATIONS[self.version][1]!r} tiles")
        self.keys.validate()
        self.values.validate()
        k, v = self.keys, self.values
        if (k.batch, k.kv_heads, k.tokens, k.head_dim) != (v.batch, v.kv_heads, v.tokens, v.head_dim):
            raise BadDataError("compressed keys and values disagree in batch, heads, tokens or head_dim")
        if k.nz.dtype != v.nz.dtype:
            raise BadDataError(f"keys are {k.nz.dtype} but values are {v.nz.dtype}")
        want = [k.batch, k.kv_heads, self.window_keys.shape[2] if self.window_keys.ndim == 4 else -1, k.head_dim]
        for nm, t in (("window.keys", self.window_keys), ("window.values", self.window_values)):
            if t.ndim != 4 or list(t.shape) != want:
                raise BadDataError(f"{nm} has shape {list(t.shape)}, expected {want}")
            if t.dtype != k.nz.dtype:
                raise BadDataError(f"{nm} is {t.dtype}, the compressed tokens are {k.nz.dtype}")

    def decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys, values ``[B, Hkv, Tc + W, D]``."""
        keys = torch.cat([self.keys.decode(), self.window_keys], dim=2)
        values = torch.cat([self.values.decode(), self.window_values], dim=2)
        return keys, values
