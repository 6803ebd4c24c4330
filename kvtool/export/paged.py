"""The paged KV layout that FlashInfer's and vLLM's decode kernels read, and its file.

A batch of B sequences of lengths ``L_b`` is cut into pages of ``page_size`` (P) tokens. Sequence b
owns ``n_b = ceil(L_b / P)`` pages, listed in order by the page table:

- ``kv_indptr`` int32 ``[B + 1]``: sequence b's pages are ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``;
- ``kv_indices`` int32 ``[sum n_b]``: page ids into the page pool;
- ``kv_last_page_len`` int32 ``[B]``: tokens used in each sequence's last page, ``1..P``;
- ``seq_lens`` int32 ``[B]`` and ``block_table`` int32 ``[B, max n_b]`` (vLLM's view of the same
  table; entries past ``n_b`` are 0 and never read).

Per layer the page pool holds keys and values apart (FlashInfer's ``(k_cache, v_cache)`` tuple,
vLLM's per-layer key/value caches):

- ``NHD``: ``[num_pages, P, Hkv, D]`` (token, head, dim; FlashInfer's default, vLLM's flash-attn layout);
- ``HND``: ``[num_pages, Hkv, P, D]``.

Unused slots of a last page are zero. kvtool writes pages in sequence order (``kv_indices`` is
``0..num_pages-1``), but readers must follow the table.

Layers that keep fewer tokens (an eviction format, or a plan written with ``kvtool recommend
--servable paged``: every KV head of a layer keeps the same number of tokens, layers differ) carry
their own page table: the five table tensors under ``layers.{i}.`` (``layers.{i}.kv_indptr``, ...),
and ``kvtool.paged`` lists them in ``layer_tables``; a serving engine plans those layers with their
table (FlashInfer: one ``plan`` per distinct table). The kept tokens sit in pages in the order kept,
with RoPE applied at their original positions, so a new token's position is ``next_position`` in
``kvtool.info`` (the original token count), not the layer's sequence length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtool._version import __version__
from kvtool.core.cache import KVCache, ModelFacts
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.limits import MAX_PAGE_SIZE, bounded_int

from kvtool.core.io import PAGED_SCHEMA  # one name for the schema, shared with kvtool info
from kvtool.core.io import SCHEMA_VERSION, write_safetensors
from kvtool.core.io import check_schema, facts_from_meta, layer_list, parse_json_meta, read_header, read_tensors
LAYOUTS = ("NHD", "HND")
TABLE_NAMES = ("kv_indptr", "kv_indices", "kv_last_page_len", "seq_lens", "block_table")


@dataclass
class PagedKV:
    """Pages for some layers of one batch plus the shared page table (see the module docstring).

    ``k_pages[i]`` / ``v_pages[i]``: model layer i's page pools in ``layout``."""

    facts: ModelFacts
    page_size: int
    layout: str
    k_pages: dict[int, torch.Tensor]
    v_pages: dict[int, torch.Tensor]
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)
    layer_tables: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def table(self, layer: int | None = None) -> dict[str, torch.Tensor]:
        """The page table of ``layer`` (its own when it keeps a different token count, else the
        shared one)."""
        if layer is not None and layer in self.layer_tables:
            return self.layer_tables[layer]
        return {name: getattr(self, name) for name in TABLE_NAMES}

    @property
    def layer_indices(self) -> list[int]:
        return sorted(self.k_pages)

    @property
    def num_pages(self) -> int:
        return int(self.kv_indices.numel())


def check_layout(page_size: int, layout: str) -> str:
    """Validate ``--page-size`` (1 to MAX_PAGE_SIZE: the one bounded-size rule, so the pages of a
    short capture cannot ask for gigabytes of padding) and ``--layout``; return the layout in upper
    case."""
    bounded_int("--page-size", page_size, 1, MAX_PAGE_SIZE)
    up = layout.upper()
    if up not in LAYOUTS:
        raise UsageError(f"--layout must be NHD or HND, got {layout!r}")
    return up


def page_table(seq_lens: list[int], page_size: int) -> dict[str, torch.Tensor]:
    """The page table for sequences of ``seq_lens`` tokens with pages assigned in order."""
    if any(n < 1 for n in seq_lens):
        raise UsageError("every sequence needs at least one token to be paged")
    pages = [(n + page_size - 1) // page_size for n in seq_lens]
    indptr = [0]
    for n in pages:
        indptr.append(indptr[-1] + n)
    total = indptr[-1]
    block = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    for b in range(len(seq_lens)):
        block[b, : pages[b]] = torch.arange(indptr[b], indptr[b + 1], dtype=torch.int32)
    return {
        "kv_indptr": torch.tensor(indptr, dtype=torch.int32),
        "kv_indices": torch.arange(total, dtype=torch.int32),
        "kv_last_page_len": torch.tensor([n - (p - 1) * page_size for n, p in zip(seq_lens, pages)], dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_table": block,
    }


def sequences(cache: KVCache) -> list[torch.Tensor]:
    """Per sequence b, the bool ``[T]`` of its real tokens (all True unless the batch is left-padded)."""
    t = cache.num_tokens
    if cache.attention_mask is None:
        return [torch.ones(t, dtype=torch.bool) for _ in range(cache.batch_size)]
    return [row.to(torch.bool) for row in cache.attention_mask]


def to_paged(cache: KVCache, page_size: int = 16, layout: str = "NHD") -> PagedKV:
    """Page every layer of ``cache`` (keys/values ``[B, Hkv, T, D]``). Left padding is dropped:
    sequence b keeps only its real tokens, so sequences may differ in length."""
    layout = check_layout(page_size, layout)
    real = sequences(cache)
    lens = [int(m.sum()) for m in real]
    table = page_table(lens, page_size)
    f = cache.facts
    num_pages = int(table["kv_indices"].numel())
    k_pages: dict[int, torch.Tensor] = {}
    v_pages: dict[int, torch.Tensor] = {}
    for i in cache.layer_indices:
        layer = cache.layers[i]
        pools = []
        for src in (layer.keys, layer.values):
            # token-major pool [num_pages * P, Hkv, D], then cut into pages
            flat = src.new_zeros((num_pages * page_size, f.num_kv_heads, src.shape[-1]))
            for b in range(cache.batch_size):
                start = int(table["kv_indptr"][b]) * page_size
                toks = src[b][:, real[b]].transpose(0, 1)  # [L_b, Hkv, D]
                flat[start : start + lens[b]] = toks
            pool = flat.view(num_pages, page_size, f.num_kv_heads, src.shape[-1])
            if layout == "HND":
                pool = pool.transpose(1, 2)
            pools.append(pool.contiguous())
        k_pages[i], v_pages[i] = pools
    return PagedKV(f, page_size, layout, k_pages, v_pages, info={}, **table)


def gather_sequence(pool: torch.Tensor, paged: PagedKV, b: int, layer: int | None = None) -> torch.Tensor:
    """Sequence b's tokens ``[Hkv, L_b, D]`` read from one page pool by following the page table
    (``layer``'s own table when it has one)."""
    t = paged.table(layer)
    pages = t["kv_indices"][int(t["kv_indptr"][b]) : int(t["kv_indptr"][b + 1])].long()
    chosen = pool[pages]
    if paged.layout == "HND":
        chosen = chosen.transpose(1, 2)  # -> [n_b, P, Hkv, D]
    flat = chosen.reshape(-1, chosen.shape[2], chosen.shape[3])
    return flat[: int(t["seq_lens"][b])].transpose(0, 1)


def from_paged(paged: PagedKV) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, per sequence: ``(keys, values)`` each ``[Hkv, L_b, D]``, read back through the page table."""
    out: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    batch = int(paged.seq_lens.numel())
    for i in paged.layer_indices:
        out[i] = [(gather_sequence(paged.k_pages[i], paged, b, i), gather_sequence(paged.v_pages[i], paged, b, i)) for b in range(batch)]
    return out


def _pools(src: torch.Tensor, real: list[torch.Tensor], table: dict[str, torch.Tensor], page_size: int, layout: str) -> torch.Tensor:
    """One layer's keys or values ``[B, Hkv, T, D]`` (sequence b's real tokens ``real[b]``) cut
    into its pages."""
    num_pages = int(table["kv_indices"].numel())
    lens = [int(m.sum()) for m in real]
    flat = src.new_zeros((num_pages * page_size, src.shape[1], src.shape[-1]))
    for b in range(src.shape[0]):
        start = int(table["kv_indptr"][b]) * page_size
        flat[start : start + lens[b]] = src[b][:, real[b]].transpose(0, 1)
    pool = flat.view(num_pages, page_size, src.shape[1], src.shape[-1])
    if layout == "HND":
        pool = pool.transpose(1, 2)
    return pool.contiguous()


def to_paged_layers(facts: ModelFacts, layers: dict[int, tuple[torch.Tensor, torch.Tensor]], page_size: int = 16, layout: str = "NHD") -> PagedKV:
    """Page layers that may keep different token counts: ``layers[i]`` = keys/values ``[B, Hkv,
    L_i, D]`` (every sequence and KV head of a layer keeps L_i tokens). Layers of the first layer's
    count share the file's table; the others get their own (module docstring)."""
    layout = check_layout(page_size, layout)
    order = sorted(layers)
    if not order:
        raise UsageError("no layers to page")
    batch = layers[order[0]][0].shape[0]
    shared_len = layers[order[0]][0].shape[2]
    shared = page_table([shared_len] * batch, page_size)
    k_pages: dict[int, torch.Tensor] = {}
    v_pages: dict[int, torch.Tensor] = {}
    own: dict[int, dict[str, torch.Tensor]] = {}
    for i in order:
        k, v = layers[i]
        n = k.shape[2]
        table = shared if n == shared_len else page_table([n] * batch, page_size)
        if n != shared_len:
            own[i] = table
        real = [torch.ones(n, dtype=torch.bool) for _ in range(batch)]
        k_pages[i], v_pages[i] = _pools(k, real, table, page_size, layout), _pools(v, real, table, page_size, layout)
    return PagedKV(facts, page_size, layout, k_pages, v_pages, info={}, layer_tables=own, **shared)


def save_paged(paged: PagedKV, path: str | Path, force: bool = False) -> Path:
    """Write a paged file atomically (schema ``kvtool.export.paged``; docs/formats.md)."""
    tensors: dict[str, torch.Tensor] = {name: getattr(paged, name) for name in TABLE_NAMES}
    for i in paged.layer_indices:
        tensors[f"layers.{i}.k_pages"] = paged.k_pages[i]
        tensors[f"layers.{i}.v_pages"] = paged.v_pages[i]
        for name, t in paged.layer_tables.get(i, {}).items():
            tensors[f"layers.{i}.{name}"] = t
    meta = {
        "kvtool.schema": PAGED_SCHEMA,
        "kvtool.schema_version": SCHEMA_VERSION,
        "kvtool.version": __version__,
        "kvtool.model": json.dumps(paged.facts.to_dict()),
        "kvtool.layers": json.dumps(paged.layer_indices),
        "kvtool.paged": json.dumps({"page_size": paged.page_size, "layout": paged.layout, "num_pages": paged.num_pages, "batch": int(paged.seq_lens.numel()),
                                    **({"layer_tables": sorted(paged.layer_tables)} if paged.layer_tables else {})}),
        "kvtool.info": json.dumps(paged.info),
    }
    return write_safetensors(path, tensors, meta, force=force)


def load_paged(path: str | Path) -> PagedKV:
    """Load and validate a paged file: schema, table dtypes, monotone indptr, indices in range,
    last-page lengths in 1..P consistent with seq_lens, and page pool shapes."""
    path = Path(path)
    meta, entries = read_header(path)
    check_schema(path, meta, PAGED_SCHEMA)
    facts = facts_from_meta(path, meta)
    geo = parse_json_meta(path, meta, "kvtool.paged")
    indices = layer_list(path, meta, facts)
    info = parse_json_meta(path, meta, "kvtool.info", default={})
    try:
        page_size, layout = int(geo["page_size"]), str(geo["layout"])
    except (KeyError, TypeError, ValueError):
        raise BadDataError(f"{path}: kvtool.paged lacks page_size or layout") from None
    if page_size < 1 or layout not in LAYOUTS:
        raise BadDataError(f"{path}: kvtool.paged has page_size {page_size} and layout {layout!r}")
    own = geo.get("layer_tables", []) if isinstance(geo, dict) else []
    if not isinstance(own, list) or not all(isinstance(i, int) and i in indices for i in own):
        raise BadDataError(f"{path}: kvtool.paged layer_tables must list layers of the file")
    tensors = read_tensors(path)

    def checked_table(prefix: str, what: str) -> dict[str, torch.Tensor]:
        for name in TABLE_NAMES:
            if prefix + name not in entries:
                raise BadDataError(f"{path}: tensor {prefix + name!r} is missing")
            if entries[prefix + name][0] != "I32":
                raise BadDataError(f"{path}: {prefix + name} should be int32, it is {entries[prefix + name][0]}")
        indptr, idx, last, lens = (tensors[prefix + n].long() for n in TABLE_NAMES[:4])
        batch = lens.numel()
        if indptr.numel() != batch + 1 or last.numel() != batch or int(indptr[0]) != 0 or bool((indptr[1:] < indptr[:-1]).any()):
            raise BadDataError(f"{path}: {what}kv_indptr must be [batch + 1], start at 0 and never decrease")
        if int(indptr[-1]) != idx.numel():
            raise BadDataError(f"{path}: {what}kv_indptr ends at {int(indptr[-1])} but kv_indices has {idx.numel()} entries")
        pages_per_seq = indptr[1:] - indptr[:-1]
        if bool((last < 1).any() or (last > page_size).any()) or not torch.equal((pages_per_seq - 1) * page_size + last, lens):
            raise BadDataError(f"{path}: {what}kv_last_page_len disagrees with seq_lens and the page counts")
        return {n: tensors[prefix + n] for n in TABLE_NAMES}

    table = checked_table("", "")
    layer_tables = {i: checked_table(f"layers.{i}.", f"layer {i}'s ") for i in own}
    if any(t["seq_lens"].numel() != table["seq_lens"].numel() for t in layer_tables.values()):
        raise BadDataError(f"{path}: a layer's page table holds another batch size than the file's")
    k_pages: dict[int, torch.Tensor] = {}
    v_pages: dict[int, torch.Tensor] = {}
    for i in indices:
        for part, store in (("k_pages", k_pages), ("v_pages", v_pages)):
            name = f"layers.{i}.{part}"
            if name not in tensors:
                raise BadDataError(f"{path}: tensor {name!r} is missing")
            pool = tensors[name]
            want_mid = [page_size, facts.num_kv_heads] if layout == "NHD" else [facts.num_kv_heads, page_size]
            if pool.ndim != 4 or list(pool.shape[1:3]) != want_mid or pool.shape[3] != facts.head_dim:
                raise BadDataError(f"{path}: {name} has shape {list(pool.shape)}, expected [pages, {', '.join(map(str, want_mid))}, {facts.head_dim}] for {layout}")
            store[i] = pool
        idx = layer_tables.get(i, table)["kv_indices"].long()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= k_pages[i].shape[0]):
            raise BadDataError(f"{path}: kv_indices point outside layer {i}'s {k_pages[i].shape[0]} pages")
    return PagedKV(facts, page_size, layout, k_pages, v_pages, info=info, layer_tables=layer_tables, **table)
