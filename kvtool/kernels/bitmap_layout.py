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

A cache with room to grow (:func:`growable_cache`, :func:`append_blocks`; ``BitmapCache.lengths``
not None) has the same tensors sized for a capacity, each block in a fixed slot of the packed
elements (``offsets[g] = g * slot``; a block's run, padded to 16 bytes, fits its slot and the rest of
the slot is never read as elements), and its valid lengths on the device, so that appending a block
or a window token needs no host sync and changes no tensor's shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    orientation of keys and values).

    ``lengths``: None, or for a cache with room to grow (:func:`growable_cache`) int32 ``[2]`` on
    the cache's device: the compressed tokens and window tokens in use, of the capacities that
    ``keys.tokens`` and the window's length give. ``plan``: what
    :func:`kvtool.kernels.bitmap_sparse_attention.prepare_attention` held for this cache (not part of
    the data)."""

    keys: BitmapTensor
    values: BitmapTensor
    window_keys: torch.Tensor
    window_values: torch.Tensor
    version: int = LAYOUT_V1
    lengths: torch.Tensor | None = None
    plan: Any = field(default=None, repr=False, compare=False)

    @property
    def tokens(self) -> int:
        """Tokens attended (for a cache with room to grow: read from the device, one host sync)."""
        if self.lengths is not None:
            return int(self.lengths.sum())
        return self.keys.tokens + self.window_keys.shape[2]

    def validate(self) -> None:
        if self.lengths is not None:
            validate_growable(self)
            return
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
        if self.lengths is not None:
            return self.in_use().decode()
        keys = torch.cat([self.keys.decode(), self.window_keys], dim=2)
        values = torch.cat([self.values.decode(), self.window_values], dim=2)
        return keys, values

    def in_use(self) -> "BitmapCache":
        """The part of a cache with room to grow that is in use, as a cache of fixed lengths (views
        and a gather of the offsets; one host sync to read the lengths). Its runs keep their slots,
        so it decodes and attends like the packed layout but does not pass :meth:`validate`, whose
        offsets check asks for packed runs. A cache without lengths is returned as it is."""
        if self.lengths is None:
            return self
        tc, w = (int(x) for x in self.lengths.tolist())
        k, v = self.keys, self.values
        nb_cap, nb = k.blocks, -(-tc // TILE)
        bh = k.batch * k.kv_heads
        dev = k.offsets.device
        blocks = (torch.arange(bh, device=dev)[:, None] * nb_cap + torch.arange(nb, device=dev)[None, :]).reshape(-1)

        def part(bt: BitmapTensor) -> BitmapTensor:
            # the starts of the blocks in use, then the end of the last one's slot
            end = bt.offsets[blocks[-1:] + 1] if nb else bt.offsets[:1]
            off = torch.cat([bt.offsets[blocks], end])
            bits = (bt.bitmaps[:, :, :tc] if bt.kind == "values" else bt.bitmaps[:, :, :nb]).contiguous()
            return BitmapTensor(bt.kind, bt.nz, bits, off, tc, bt.head_dim, bt.label)

        return BitmapCache(part(k), part(v), self.window_keys[:, :, :w].contiguous(), self.window_values[:, :, :w].contiguous(), version=self.version)


def validate_growable(cache: BitmapCache) -> None:
    """Checks of a cache with room to grow that hold for its whole life (the appended blocks are
    trusted, as :func:`append_blocks` writes them): layout version 2, shapes and dtypes as a packed
    cache of the capacities, lengths int32 ``[2]`` on the cache's device, offsets monotone, aligned to
    16 bytes and within ``nz``. BadDataError naming the problem."""
    k, v = cache.keys, cache.values
    if cache.version != LAYOUT_V2 or (k.kind, v.kind) != ORIENTATIONS[LAYOUT_V2]:
        raise BadDataError("a cache with room to grow is in layout version 2")
    ln = cache.lengths
    if ln is None or ln.dtype != torch.int32 or list(ln.shape) != [2] or ln.device != k.nz.device:
        raise BadDataError(f"lengths must be int32 [2] on {k.nz.device}")
    for bt in (k, v):
        name = bt.label or bt.kind
        if bt.bitmaps.dtype != torch.int64 or bt.offsets.dtype != torch.int64 or bt.nz.ndim != 1 or bt.nz.dtype not in _INT_VIEW:
            raise BadDataError(f"{name}: bitmaps and offsets int64, nz 1-D float16/bfloat16/float32")
        if list(bt.bitmaps.shape) != bt.expected_bitmap_shape():
            raise BadDataError(f"{name}.bitmaps has shape {list(bt.bitmaps.shape)}, expected {bt.expected_bitmap_shape()}")
        n = bt.batch * bt.kv_heads * bt.blocks + 1
        off = bt.offsets
        if list(off.shape) != [n]:
            raise BadDataError(f"{name}.offsets has shape {list(off.shape)}, expected [{n}]")
        if bool((off[1:] < off[:-1]).any()) or int(off[0]) < 0 or int(off[-1]) > bt.nz.numel():
            raise BadDataError(f"{name}.offsets must rise from 0 and stay within the {bt.nz.numel()} elements of nz")
        if bool((off % align_elements(bt.nz.dtype) != 0).any()):
            raise BadDataError(f"{name}.offsets must be multiples of {align_elements(bt.nz.dtype)} (16-byte alignment)")
    if (k.batch, k.kv_heads, k.tokens, k.head_dim, k.dtype) != (v.batch, v.kv_heads, v.tokens, v.head_dim, v.dtype):
        raise BadDataError("compressed keys and values disagree in batch, heads, capacity, head_dim or dtype")
    want = [k.batch, k.kv_heads, cache.window_keys.shape[2] if cache.window_keys.ndim == 4 else -1, k.head_dim]
    for nm, t in (("window.keys", cache.window_keys), ("window.values", cache.window_values)):
        if list(t.shape) != want or t.dtype != k.dtype:
            raise BadDataError(f"window {nm} has shape {list(t.shape)} {t.dtype}, expected {want} {k.dtype}")


def growable_cache(batch: int, kv_heads: int, head_dim: int, capacity: int, window: int, slot: int,
                   dtype: torch.dtype, device: torch.device | str) -> BitmapCache:
    """An empty layout-v2 cache with room for ``capacity`` compressed tokens (whole 64-token blocks)
    and ``window`` dense window tokens, each block's keys and values in a slot of ``slot`` elements
    (at least the elements a block stores, e.g. ``64 * keep`` for per-token pruning keeping
    ``keep`` of each token's channels; a multiple of 16 bytes). Lengths start at (0, 0); fill it
    with :func:`append_blocks` and by writing window tokens at ``lengths[1]`` and raising it."""
    align = align_elements(dtype)
    if capacity % TILE or capacity < 0 or window < 0 or slot < 0 or slot % align or slot > TILE * head_dim:
        raise BadDataError(f"capacity must be whole blocks of {TILE} tokens and slot a multiple of {align} elements up to {TILE * head_dim}")
    nb = capacity // TILE
    dt = -(-head_dim // TILE)
    n = batch * kv_heads * nb
    offsets = torch.arange(n + 1, dtype=torch.int64, device=device) * slot

    def part(kind: str, label: str) -> BitmapTensor:
        shape = [batch, kv_heads, capacity, dt] if kind == "values" else [batch, kv_heads, nb, head_dim]
        return BitmapTensor(kind, torch.zeros(n * slot, dtype=dtype, device=device), torch.zeros(shape, dtype=torch.int64, device=device),
                            offsets.clone(), capacity, head_dim, label)

    korient, vorient = ORIENTATIONS[LAYOUT_V2]
    wk = torch.zeros(batch, kv_heads, window, head_dim, dtype=dtype, device=device)
    return BitmapCache(part(korient, "keys"), part(vorient, "values"), wk, torch.zeros_like(wk), version=LAYOUT_V2,
                       lengths=torch.zeros(2, dtype=torch.int32, device=device))


def append_blocks(cache: BitmapCache, keys: BitmapTensor, values: BitmapTensor) -> None:
    """Append whole 64-token blocks to a cache with room to grow, after its compressed tokens in use:
    ``keys`` / ``values`` are a layout-v2 encoding (keys token tiles, values channel tiles, e.g.
    :func:`kvtool.kernels.bitmap_prune_encode.prune_encode`) of ``n * 64`` tokens of every KV head.
    Device work only (no host sync: the place is ``lengths[0]``, which rises by ``n * 64``), so a
    decode step that appends can be captured in a CUDA graph. The caller keeps within the capacity
    and within each block's slot (unchecked on the device)."""
    dst_k, dst_v = cache.keys, cache.values
    if cache.lengths is None:
        raise BadDataError("append_blocks needs a cache with room to grow (growable_cache)")
    if (keys.kind, values.kind) != (dst_k.kind, dst_v.kind) or keys.tokens % TILE or keys.tokens != values.tokens:
        raise BadDataError("append_blocks takes layout-v2 keys and values of whole 64-token blocks")
    if (keys.batch, keys.kv_heads, keys.head_dim) != (dst_k.batch, dst_k.kv_heads, dst_k.head_dim) or keys.dtype != dst_k.dtype:
        raise BadDataError("the appended blocks disagree with the cache in batch, heads, head_dim or dtype")
    n = keys.blocks
    if n == 0:
        return
    bh = dst_k.batch * dst_k.kv_heads
    nb_cap = dst_k.blocks
    dev = dst_k.nz.device
    tc = cache.lengths[0].long()
    first = tc // TILE  # the first new block of every head, on the device
    for src, dst in ((keys, dst_k), (values, dst_v)):
        # each source block's run goes to its slot: element i of block s lands at slot start + i
        dst_block = (torch.arange(bh, device=dev)[:, None] * nb_cap + first + torch.arange(n, device=dev)[None, :]).reshape(-1)
        if src.nz.numel():
            pos = torch.arange(src.nz.numel(), device=dev)
            blk = torch.searchsorted(src.offsets, pos, right=True) - 1
            dst.nz.index_copy_(0, dst.offsets[dst_block[blk]] + pos - src.offsets[blk], src.nz)
        if dst.kind == "values":  # token tiles: rows of tokens
            dst.bitmaps.index_copy_(2, tc + torch.arange(n * TILE, device=dev), src.bitmaps)
        else:
            dst.bitmaps.index_copy_(2, first + torch.arange(n, device=dev), src.bitmaps)
    cache.lengths[0] += n * TILE
