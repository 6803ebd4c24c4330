"""Capture files written and read one layer at a time.

Writing (:class:`StreamingWriter`). A safetensors file starts with its JSON header, which names
every tensor with its byte offsets. A capture knows every tensor's name, dtype and shape before the
model runs (layers, batch, heads, prompt + generated tokens), so the header's offsets are fixed up
front: the writer lays the tensors out contiguously in that order, reserves room for the header
(its JSON padded with spaces, which the format allows), and writes each block of tokens straight
to its place in the file as the forward pass produces it (``os.pwrite``, one call per outer row;
the tokens axis is not the outermost one, so a block of ``n`` tokens lands in ``B * H`` pieces).
Host memory holds one block at a time. Each tensor's CRC-32 (``kvtool.checksums``, as every kvtool
writer stores it) is computed from the blocks as they are written: one running CRC per outer row
while blocks arrive in token order, the rows' CRCs then combined (:func:`crc32_combine`); a tensor
whose blocks came in another order is read back from the file once instead. On success the final
header (metadata known only at the end: generated tokens, timings, the checksums) is written into
the reserved room, every byte is checked to be written, and the temporary file is fsynced and
renamed onto the output (:func:`kvtool.io.atomic_path`); on any error the output is untouched. The
result is an ordinary capture file: every loader reads and checks it.

Reading (:class:`LazyCapture`). :func:`open_capture` checks the header like :func:`kvtool.io.load`
and returns an object with the :class:`~kvtool.cache.KVCache` attributes whose ``layers[i]`` reads
that layer's tensors from the file when asked (through one open :class:`~kvtool.core.kvfile.KVFile`,
never the whole file) and places them on a device, so commands stream a long capture through a GPU
one layer at a time.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import zlib
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import torch

from kvtool.core import io
from kvtool.core.kvfile import crc32_combine
from kvtool.core.cache import KVCache, LayerKV, ModelFacts, format_indices
from kvtool.core.errors import BadDataError, UsageError

ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}
HEADER_SLACK = 64 * 1024  # room for metadata known only at the end (timings, generated tokens)
READ_BACK_CHUNK = 4 << 20
IN_FLIGHT = 512 << 20  # bytes of blocks the writer thread may have queued


class StreamingWriter:
    """A safetensors file whose tensors are written in token blocks, in any order.

    ``specs``: ``[(name, dtype, shape, token_axis)]``; tensors are laid out in this order.
    ``token_axis`` is the dimension blocks are cut along (every dimension before it is an outer row).
    Use as a context manager around :func:`kvtool.io.atomic_path`'s temporary path::

        with io.atomic_path(out) as tmp, StreamingWriter(tmp, specs, metadata) as w:
            w.write("layers.0.keys", start, block)   # block [B, Hkv, n, D] for tokens start..start+n
            w.metadata["kvtool.info"] = ...          # final metadata, written on close
    """

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, list[int], int]], metadata: dict[str, str]):
        self.path = Path(path)
        self.metadata = dict(metadata)
        self.entries: dict[str, dict[str, Any]] = {}
        offset = 0
        for name, dtype, shape, axis in specs:
            if dtype not in ST_NAMES:
                raise UsageError(f"{name}: dtype {dtype} cannot be streamed")
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            self.entries[name] = {"dtype": dtype, "shape": list(shape), "axis": axis, "begin": offset, "end": offset + nbytes, "written": 0,
                                  "row_crcs": [0] * math.prod(shape[:axis]), "next_token": 0, "in_order": True}
            offset += nbytes
        self.data_bytes = offset
        # room for the final checksum table too (the same length whatever the CRCs are)
        self.metadata[io.CHECKSUM_KEY] = self._checksums_json({name: 0 for name in self.entries})
        self.header_room = len(self._header_json()) + HEADER_SLACK
        self.header_room += (-(8 + self.header_room)) % 8  # data starts 8-byte aligned
        self.fd = -1

    def _header_json(self) -> bytes:
        header: dict[str, Any] = {"__metadata__": self.metadata}
        for name, e in self.entries.items():
            header[name] = {"dtype": ST_NAMES[e["dtype"]], "shape": e["shape"], "data_offsets": [e["begin"], e["end"]]}
        return json.dumps(header, separators=(",", ":")).encode()

    def __enter__(self) -> "StreamingWriter":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
        os.ftruncate(self.fd, 8 + self.header_room + self.data_bytes)
        # blocks are written (and checksummed) by one background thread, in the order they came,
        # while the caller's model computes the next ones; at most IN_FLIGHT bytes wait for it
        self._jobs: queue.Queue = queue.Queue()
        self._room = threading.Condition()
        self._in_flight = 0
        self._failed: BaseException | None = None
        self._worker = threading.Thread(target=self._drain, name="kvtool-writer", daemon=True)
        self._worker.start()
        return self

    def _drain(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            raw, e, base, start, inner, in_order = job
            try:
                if self._failed is None:
                    shape, axis = e["shape"], e["axis"]
                    for r in range(raw.shape[0]):
                        os.pwrite(self.fd, raw[r].data, base + (r * shape[axis] + start) * inner)
                        if in_order:
                            e["row_crcs"][r] = zlib.crc32(raw[r], e["row_crcs"][r])
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self._failed = exc
            finally:
                with self._room:
                    self._in_flight -= raw.nbytes
                    self._room.notify_all()

    def _stop_writer(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None and worker.is_alive():
            self._jobs.put(None)
            worker.join()

    def _finish_writes(self) -> None:
        """Wait for every queued block to be written; raise the writer thread's error, if any."""
        worker = getattr(self, "_worker", None)
        if worker is not None and worker.is_alive():
            self._jobs.put(None)
            worker.join()
        if self._failed is not None:
            raise self._failed

    def write(self, name: str, start: int, block: torch.Tensor) -> None:
        """Write ``block`` (shape of tensor ``name`` with ``n`` tokens on its token axis) as tokens
        ``start .. start + n``. The block is converted to the tensor's dtype and moved to the CPU."""
        e = self.entries[name]
        shape, axis = e["shape"], e["axis"]
        n = block.shape[axis]
        if list(block.shape[:axis]) != shape[:axis] or list(block.shape[axis + 1:]) != shape[axis + 1:] or start < 0 or start + n > shape[axis]:
            raise UsageError(f"{name}: block {list(block.shape)} at token {start} does not fit {shape}")
        if n == 0:
            return
        host = block.detach().to(e["dtype"]).contiguous().cpu()
        rows = math.prod(shape[:axis])
        inner = math.prod(shape[axis + 1:]) * host.element_size()
        raw = host.reshape(-1).view(torch.uint8).numpy().reshape(rows, n * inner)
        base = 8 + self.header_room + e["begin"]
        in_order = e["in_order"] and start == e["next_token"]
        if self._failed is not None:
            raise self._failed
        with self._room:
            self._room.wait_for(lambda: self._in_flight == 0 or self._in_flight + raw.nbytes <= IN_FLIGHT)
            self._in_flight += raw.nbytes
        self._jobs.put((raw, e, base, start, inner, in_order))
        e["in_order"] = in_order
        e["next_token"] = start + n
        e["written"] += raw.nbytes

    def _checksums_json(self, crcs: dict[str, int]) -> str:
        rest = {k: v for k, v in self.metadata.items() if k != io.CHECKSUM_KEY}
        return json.dumps({"algorithm": io.CHECKSUM_ALGORITHM, "metadata": f"{io.metadata_crc32(rest):08x}",
                           "tensors": {name: f"{crc:08x}" for name, crc in crcs.items()}})

    def tensor_crc32(self, name: str) -> int:
        """CRC-32 of tensor ``name``'s bytes as written: combined from the rows' running CRCs, or read
        back from the file when its blocks did not arrive in token order."""
        e = self.entries[name]
        if e["in_order"] and e["next_token"] == e["shape"][e["axis"]]:
            row_bytes = (e["end"] - e["begin"]) // max(len(e["row_crcs"]), 1)
            crc = 0
            for row_crc in e["row_crcs"]:
                crc = crc32_combine(crc, row_crc, row_bytes)
            return crc
        crc, at, end = 0, 8 + self.header_room + e["begin"], 8 + self.header_room + e["end"]
        while at < end:
            chunk = os.pread(self.fd, min(READ_BACK_CHUNK, end - at), at)
            if not chunk:
                raise BadDataError(f"{self.path}: {name} could not be read back for its checksum")
            crc = zlib.crc32(chunk, crc)
            at += len(chunk)
        return crc

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None:
                self._failed = self._failed or exc  # the queued blocks are dropped, not written
            self._finish_writes() if exc_type is None else self._stop_writer()
            if exc_type is None:
                short = [n for n, e in self.entries.items() if e["written"] != e["end"] - e["begin"]]
                if short:
                    raise BadDataError(f"{short[0]}: {self.entries[short[0]]['written']} of {self.entries[short[0]]['end'] - self.entries[short[0]]['begin']} bytes were produced")
                self.metadata.pop(io.CHECKSUM_KEY, None)
                self.metadata[io.CHECKSUM_KEY] = self._checksums_json({name: self.tensor_crc32(name) for name in self.entries})
                header = self._header_json()
                if len(header) > self.header_room:
                    raise BadDataError(f"the capture's metadata ({len(header)} bytes) outgrew the room reserved for it")
                os.pwrite(self.fd, self.header_room.to_bytes(8, "little") + header.ljust(self.header_room, b" "), 0)
        finally:
            os.close(self.fd)
            self.fd = -1


# ----------------------------------------------------------------------------- reading


class _LazyLayers(Mapping):
    """``{layer index: LayerKV}`` read from the file on each access (nothing is kept unless the
    capture keeps layers on its device)."""

    def __init__(self, owner: "LazyCapture"):
        self.owner = owner

    def __getitem__(self, index: int) -> LayerKV:
        if index not in self.owner.indices:
            raise KeyError(index)
        return self.owner.read_layer(index)

    def __contains__(self, index: object) -> bool:  # Mapping's own would read the layer
        return index in self.owner.indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.owner.indices)

    def __len__(self) -> int:
        return len(self.owner.indices)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether tensors on ``a`` are on ``b``: ``cuda`` means the current GPU, so it is the ``cuda:0``
    a tensor reports when GPU 0 is current (other devices compare as they are)."""
    if a.type != "cuda" or b.type != "cuda":
        return a == b

    def index(d: torch.device) -> int:
        return d.index if d.index is not None else torch.cuda.current_device()

    return index(a) == index(b)


_PREFETCH: ThreadPoolExecutor | None = None


def _prefetcher() -> ThreadPoolExecutor:
    global _PREFETCH
    if _PREFETCH is None:
        _PREFETCH = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-prefetch")
    return _PREFETCH


class LazyCapture(KVCache):
    """A :class:`~kvtool.cache.KVCache` whose layers stay in the file until read.

    ``layers[i]`` reads layer i's ``parts`` (keys and values always; queries and hidden when asked
    for and present) through one open :class:`~kvtool.core.kvfile.KVFile` (the header was checked
    once, when the capture was opened), checks them (checksums and finite values in the same pass,
    shapes) and returns them on ``device``. ``token_ids`` and ``attention_mask`` are read once, on
    the CPU.

    - ``query_tail``: read only the last ``query_tail`` tokens of each layer's queries (the held-out
      ones that ``verify`` scores; the whole tensor's checksum is still checked).
    - ``keep``: keep layers once read, on ``device`` (``eval`` on a GPU, which scores every point on
      the same layers: each layer is read and checked once instead of twice per point).
    - reading layer i starts reading the next layer of ``indices`` in the background (one layer
      ahead, on the host), so the file is read while the device computes."""

    def __init__(self, path: Path, facts: ModelFacts, indices: list[int], names: set[str], token_ids: torch.Tensor,
                 info: dict[str, Any], attention_mask: torch.Tensor | None, parts: tuple[str, ...], device: torch.device,
                 query_tail: int | None = None, file: io.KVFile | None = None):
        self.path = path
        self.indices = sorted(indices)
        self.names = names
        self.parts = parts
        self.device = device
        self.file = file if file is not None else io.KVFile(path)
        self.query_tail = query_tail
        self.keep = False
        self.homes: dict[int, torch.device] = {}  # where a kept layer stays (default: the capture's device)
        self.prefetch = True
        self._kept: dict[int, LayerKV] = {}
        self._ahead: dict[int, Future] = {}
        super().__init__(facts=facts, layers=_LazyLayers(self), token_ids=token_ids, info=info, attention_mask=attention_mask)  # type: ignore[arg-type]

    def layer_parts(self, index: int) -> list[str]:
        return [p for p in ("keys", "values", "queries", "hidden") if (p in self.parts or p in ("keys", "values")) and f"layers.{index}.{p}" in self.names]

    def read_layer(self, index: int, device: torch.device | None = None) -> LayerKV:
        """Layer ``index``'s selected tensors, checked as :func:`kvtool.core.io.load` checks them
        (checksums, finite values, shapes), on ``device`` (default: the capture's). With
        ``query_tail`` only the last that many queries ``[B, H, query_tail, D]`` are read."""
        device = torch.device(device) if device is not None else self.device
        kept = self._kept.get(index)
        if kept is not None:
            return kept if same_device(kept.keys.device, device) else kept.to(device)
        ahead = self._ahead.pop(index, None)
        layer = ahead.result() if ahead is not None else self._read_host(index)
        self._read_ahead(index)
        layer = layer if device.type == "cpu" else layer.to(device)
        if self.keep and same_device(device, self.homes.get(index, self.device)):
            self._kept[index] = layer
        return layer

    def _read_ahead(self, index: int) -> None:
        pos = self.indices.index(index)
        if not self.prefetch or pos + 1 >= len(self.indices):
            return
        nxt = self.indices[pos + 1]
        if nxt not in self._ahead and nxt not in self._kept:
            self._ahead = {nxt: _prefetcher().submit(self._read_host, nxt)}  # one layer ahead, at most

    def _read_host(self, index: int) -> LayerKV:
        parts = self.layer_parts(index)
        tail = self.query_tail if self.query_tail and "queries" in parts else None
        names = [f"layers.{index}.{p}" for p in parts if not (tail and p == "queries")]
        tensors = io.read_tensors(self.path, names, finite=True, file=self.file)
        got = {n.rsplit(".", 1)[1]: t for n, t in tensors.items()}
        layer = LayerKV(**{p: got.get(p) for p in ("keys", "values", "queries", "hidden")})
        _check_layer(self, index, layer)
        if tail:
            name = f"layers.{index}.queries"
            want = [self.batch_size, self.facts.num_heads, self.num_tokens, self.facts.head_dim]
            if list(self.file.entries[name][1]) != want:
                raise BadDataError(f"{self.path}: {name} has shape {list(self.file.entries[name][1])}, the metadata says {want}")
            layer.queries = io.read_tail(self.path, name, min(tail, self.num_tokens), finite=True, file=self.file)
        return layer

    @property
    def has_queries(self) -> bool:
        return all(f"layers.{i}.queries" in self.names for i in self.indices) and "queries" in self.parts

    @property
    def has_hidden(self) -> bool:
        return all(f"layers.{i}.hidden" in self.names for i in self.indices) and "hidden" in self.parts

    def has_queries_for(self, indices: list[int]) -> bool:
        return "queries" in self.parts and all(f"layers.{i}.queries" in self.names for i in indices)

    def dense_kv_bytes(self) -> int:
        f = self.facts
        return 2 * len(self.indices) * self.batch_size * f.num_kv_heads * self.num_tokens * f.head_dim * torch.empty(0, dtype=f.torch_dtype).element_size()

    def selected_bytes(self) -> int:
        """Bytes of every tensor the selected layers and parts would read."""
        return sum(self.layer_bytes(i) for i in self.indices)

    def keep_on_device(self, share: float = 0.3, placement: dict[int, torch.device] | None = None) -> bool:
        """Keep layers once read when the device is a GPU whose free memory holds every selected
        layer within ``share`` of it; returns whether it does. With ``placement`` (``{layer:
        device}``, layers spread over GPUs) each GPU must hold its own layers that way, and a
        layer is kept where the placement puts it."""
        homes = dict(placement) if placement is not None else {i: self.device for i in self.indices}
        if any(d.type != "cuda" for d in homes.values()):
            return False
        need: dict[str, int] = {}
        for i in self.indices:
            need[str(homes[i])] = need.get(str(homes[i]), 0) + self.layer_bytes(i)
        self.homes = homes
        self.keep = all(n <= share * torch.cuda.mem_get_info(torch.device(d))[0] for d, n in need.items())
        return self.keep

    def layer_bytes(self, index: int) -> int:
        """Bytes of the tensors layer ``index``'s selected parts would read."""
        total = 0
        for p in self.layer_parts(index):
            begin, end = self.file.header.spans[f"layers.{index}.{p}"]
            total += end - begin
        return total

    def materialize(self) -> KVCache:
        """Every selected layer read into memory (on the device): an ordinary KVCache."""
        return KVCache(self.facts, {i: self.read_layer(i) for i in self.indices}, self.token_ids, self.info, self.attention_mask)


def _check_layer(cap: LazyCapture, index: int, layer: LayerKV) -> None:
    io.validate_cache(KVCache(cap.facts, {index: layer}, cap.token_ids, cap.info, cap.attention_mask), cap.path)


def open_capture(path: str | Path, layers: list[int] | None = None, parts: tuple[str, ...] = ("keys", "values", "queries", "hidden"),
                 device: str | torch.device = "cpu", query_tail: int | None = None) -> LazyCapture:
    """Check a capture file's header (as :func:`kvtool.io.load` does) and return a
    :class:`LazyCapture` of the ``layers`` selection whose layers are read on access onto ``device``
    (``query_tail``: only the last that many tokens of each layer's queries)."""
    path = Path(path)
    f = io.KVFile(path)
    try:
        meta, entries = f.meta, f.entries
        io.check_schema(path, meta, io.CAPTURE_SCHEMA)
        facts = io.facts_from_meta(path, meta)
        indices = io.layer_list(path, meta, facts)
        info = io.parse_json_meta(path, meta, "kvtool.info", default={})
        io.check_entries(path, facts, indices, entries)
        if layers is not None:
            missing = [i for i in layers if i not in indices]
            if missing:
                raise UsageError(f"layer {missing[0]} is not in {path} (it has layers {format_indices(indices)})")
            indices = [i for i in indices if i in layers]
        small = io.read_tensors(path, ["token_ids"] + (["attention_mask"] if "attention_mask" in entries else []), file=f)
    except BaseException:
        f.close()
        raise
    return LazyCapture(path, facts, indices, set(entries), small["token_ids"], info, small.get("attention_mask"), tuple(parts),
                       torch.device(device), query_tail=query_tail, file=f)
