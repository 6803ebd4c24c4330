"""Files: atomic writes, and the capture file (safetensors) with its validation.

A capture file holds tensors ``layers.{i}.keys`` / ``.values`` ``[B, Hkv, T, D]``, optionally
``layers.{i}.queries`` ``[B, H, T, D]`` and ``layers.{i}.hidden`` ``[B, T, hidden]``, ``token_ids``
``[B, T]`` int64 and optionally ``attention_mask`` ``[B, T]`` int64. Header metadata (all strings):

- ``kvtool.schema``: ``kvtool.capture``; ``kvtool.schema_version``: ``1``;
- ``kvtool.version``: the writer's version;
- ``kvtool.model``: JSON of :class:`~kvtool.core.cache.ModelFacts`;
- ``kvtool.layers``: JSON list of the captured layer indices;
- ``kvtool.info``: JSON of the capture settings;
- ``kvtool.checksums``: JSON ``{"algorithm": "crc32", "metadata": HEX, "tensors": {name: HEX}}``, the
  CRC-32 of every tensor's bytes and of the other metadata, written by every kvtool writer
  (:func:`write_safetensors`) and checked by every reader (:func:`read_header`, :func:`read_tensors`)
  unless :func:`set_verify_checksums` turned it off (``--no-verify-checksums``,
  ``KVTOOL_NO_VERIFY_CHECKSUMS=1``). Files without the key (older kvtool) load unchecked.

docs/formats.md is the byte-level specification.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import zlib
from pathlib import Path
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from kvtool._version import __version__
from kvtool.core.cache import DTYPES, KVCache, LayerKV, ModelFacts
from kvtool.core import kvfile, settings
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.cache import format_indices
from kvtool.core.limits import MAX_HEADER_BYTES, MAX_LAYERS, MAX_WIDTH
# the output check and atomic writes (torch-free, so the CLI uses them at start-up); re-exported here
from kvtool.core.outputs import atomic_path, atomic_write_bytes, atomic_write_text, check_output, note_input, output_beside, remove_stale_temps  # noqa: F401

if TYPE_CHECKING:  # torch is imported where tensors are handled: reading a header needs none
    import torch

CAPTURE_SCHEMA = "kvtool.capture"
COMPRESSED_SCHEMA = "kvtool.compressed"
SCHEMA_VERSION = "1"
PAGED_SCHEMA = "kvtool.paged"  # written by kvtool.paged (kvtool export --to paged)
KNOWN_SCHEMAS = (CAPTURE_SCHEMA, COMPRESSED_SCHEMA, PAGED_SCHEMA)
LAYER_PARTS = ("keys", "values", "queries", "hidden")


CHECKSUM_KEY = kvfile.CHECKSUM_KEY
CHECKSUM_ALGORITHM = kvfile.CHECKSUM_ALGORITHM
# the torch-free parts of reading live in kvtool.core.kvfile (``kvtool info`` runs on it alone)
verifying_checksums = kvfile.verifying_checksums
metadata_crc32 = kvfile.metadata_crc32
read_checksums = kvfile.read_checksums
check_regular_file = kvfile.check_regular_file
sha256_file = kvfile.sha256_file
source_sha256 = kvfile.source_sha256
read_header = kvfile.read_header
KVFile = kvfile.KVFile


def set_verify_checksums(on: bool) -> None:
    """Turn checking of ``kvtool.checksums`` on load on or off (the CLI's ``--no-verify-checksums``)."""
    settings.verify_checksums = on




def set_allow_nonfinite(on: bool) -> None:
    """Let loads accept NaN/infinite tensor values (the CLI's ``--allow-nonfinite``)."""
    settings.allow_nonfinite = on


def check_finite(path: Path | str, tensors: dict[str, torch.Tensor], allow: bool | None = None) -> None:
    """BadDataError naming the first floating tensor that holds NaN or infinite values, and how
    many, unless ``allow`` (default: :func:`set_allow_nonfinite`'s setting) or KVTOOL_ALLOW_NONFINITE=1.

    Tested on the bits (an all-ones exponent), never by converting: CPU tensors with numpy in
    chunks on the reader threads, device tensors on their device with one host sync per call."""
    import torch

    if kvfile.allowing_nonfinite(allow):
        return
    floating = {name: t for name, t in tensors.items() if t.is_floating_point() and t.numel()}
    on_device = [name for name, t in floating.items() if t.device.type != "cpu"]
    counts: dict[str, int] = {}
    if on_device:
        flags = torch.stack([(~torch.isfinite(floating[n])).sum() for n in on_device]).tolist()
        counts.update(zip(on_device, (int(f) for f in flags)))
    for name, t in floating.items():
        if name not in counts:
            code = _st_codes().get(t.dtype)
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            step = kvfile.CHUNK
            parts = [raw[i : i + step] for i in range(0, raw.size, step)]
            counts[name] = sum(kvfile.pool().map(lambda b: kvfile.nonfinite_count(b, code), parts)) if len(parts) > 1 else kvfile.nonfinite_count(raw, code)
    for name, t in floating.items():
        if counts[name]:
            raise BadDataError(f"{path}: tensor {name!r} holds {counts[name]} NaN or infinite values of {t.numel()}; kvtool --allow-nonfinite accepts them")


def tensor_crc32(tensor: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes as stored (any dtype), continuing from ``crc``."""
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return crc
    return zlib.crc32(flat.view(torch.uint8).numpy(), crc)


@lru_cache(maxsize=1)
def _st_codes() -> dict[Any, str]:
    """torch dtype -> safetensors dtype code."""
    import torch

    return {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
             torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@lru_cache(maxsize=1)
def _st_torch() -> dict[str, Any]:
    """safetensors dtype code -> torch dtype."""
    import torch

    return {code: dt for dt, code in _st_codes().items()} | {code: getattr(torch, name) for code, name in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")) if hasattr(torch, name)}


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], force: bool = False, inputs: tuple = ()) -> Path:
    """Save ``tensors`` with string ``metadata`` atomically, with ``kvtool.checksums`` added.

    The file is streamed: the header first, then each tensor's bytes straight from the tensor, so
    no second copy of the payload is built in memory. Tensors are made contiguous on the CPU one at a
    time."""
    import torch

    path = check_output(path, force, inputs)
    clean = {name: tensors[name].detach() for name in sorted(tensors)}
    crcs: dict[str, str] = {}
    entries: dict[str, Any] = {}
    offset = 0
    for name, t in clean.items():
        if t.dtype not in _st_codes():
            raise UsageError(f"cannot store tensor {name!r} of dtype {t.dtype} in a safetensors file")
        cpu = t.to("cpu").contiguous()
        crcs[name] = f"{tensor_crc32(cpu):08x}"
        nbytes = cpu.numel() * cpu.element_size()
        entries[name] = {"dtype": _st_codes()[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    checks = json.dumps({"algorithm": CHECKSUM_ALGORITHM, "metadata": f"{metadata_crc32(metadata):08x}", "tensors": crcs})
    header = json.dumps({"__metadata__": {**metadata, CHECKSUM_KEY: checks}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with atomic_path(path, force, inputs) as tmp, open(tmp, "wb") as fh:
        fh.write(len(header).to_bytes(8, "little"))
        fh.write(header)
        for name, t in clean.items():
            cpu = t.to("cpu").contiguous()
            if cpu.numel():
                fh.write(memoryview(cpu.reshape(-1).view(torch.uint8).numpy()))
    return path


# ----------------------------------------------------------------------------- reading


def _torch_dtype(code: str) -> torch.dtype:
    dt = _st_torch().get(code)
    if dt is None:
        raise UsageError(f"tensors of safetensors dtype {code} cannot be read into torch here")
    return dt


def tensor_from_bytes(raw: Any, code: str, shape: list[int]) -> torch.Tensor:
    """A CPU tensor of safetensors dtype ``code`` and ``shape`` over the bytes ``raw`` (a numpy
    uint8 array, shared, not copied)."""
    import torch

    flat = torch.from_numpy(raw)
    return flat.view(_torch_dtype(code)).reshape(shape) if flat.numel() else torch.empty(shape, dtype=_torch_dtype(code))


def read_tensors(path: str | Path, names: list[str] | None = None, finite: bool = False, allow_nonfinite: bool | None = None,
                 file: KVFile | None = None) -> dict[str, torch.Tensor]:
    """Load tensors (all, or ``names``) from a safetensors file, CPU, each checked against its
    ``kvtool.checksums`` entry (BadDataError naming the tensor on a mismatch) and, with ``finite``,
    for NaN/infinite values (unless allowed) in the same pass. ``file``: an open :class:`KVFile` of
    ``path`` to read through (its header is not parsed again)."""
    path = Path(path)
    f = file if file is not None else KVFile(path)
    try:
        wanted = list(names) if names is not None else list(f.entries)
        missing = [n for n in wanted if n not in f.entries]
        if missing:
            raise BadDataError(f"{path}: cannot read tensors (no tensor {missing[0]!r} in the file)")
        raw = f.read(wanted, finite=finite, allow_nonfinite=allow_nonfinite)
        return {n: tensor_from_bytes(raw[n], *f.entries[n]) for n in wanted}
    except (BadDataError, UsageError):
        raise
    except (OSError, ValueError, RuntimeError) as exc:
        raise BadDataError(f"{path}: cannot read tensors ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
    finally:
        if file is None:
            f.close()


def read_tail(path: str | Path, name: str, tokens: int, axis: int = 2, finite: bool = False, file: KVFile | None = None) -> torch.Tensor:
    """The last ``tokens`` entries along ``axis`` of tensor ``name`` (e.g. the held-out queries
    ``[B, H, tokens, D]`` of ``layers.{i}.queries``), read without loading the rest. The tensor's
    checksum is still checked, by streaming its bytes from the file in parallel chunks."""
    path = Path(path)
    f = file if file is not None else KVFile(path)
    try:
        if name not in f.entries:
            raise BadDataError(f"{path}: cannot read tensor {name!r} (no such tensor in the file)")
        code, shape = f.entries[name]
        raw, got = f.read_rows(name, axis, shape[axis] - tokens, finite=finite)
        return tensor_from_bytes(raw, code, got)
    except (BadDataError, UsageError):
        raise
    except (OSError, ValueError, RuntimeError, IndexError) as exc:
        raise BadDataError(f"{path}: cannot read tensor {name!r} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
    finally:
        if file is None:
            f.close()


def verify_checksums(path: str | Path) -> bool:
    """Check every tensor of a kvtool file against ``kvtool.checksums`` by streaming the file (no
    tensor is loaded). False when the file has no checksums or checking is off; BadDataError naming
    the first tensor that fails."""
    with KVFile(path) as f:
        if f.checksums is None:
            return False
        for name in f.entries:
            f.verify(name)
    return True


def file_range_crc32(path: Path, name: str) -> int:
    """CRC-32 of tensor ``name``'s bytes as they lie in the file, read in parallel chunks."""
    with KVFile(path) as f:
        return f.crc32(name)


def parse_json_meta(path: Path, meta: dict[str, str], key: str, default: Any = ...) -> Any:
    if key not in meta:
        if default is not ...:
            return default
        raise BadDataError(f"{path}: metadata key {key!r} is missing")
    try:
        return json.loads(meta[key])
    except (json.JSONDecodeError, TypeError):
        raise BadDataError(f"{path}: metadata {key!r} is not valid JSON") from None
    except RecursionError:
        raise BadDataError(f"{path}: metadata {key!r} nests too deeply") from None


def check_schema(path: Path, meta: dict[str, str], expected: str | tuple[str, ...] = KNOWN_SCHEMAS) -> str:
    """Return the file's schema name after checking it is a kvtool file of a supported version."""
    schema = meta.get("kvtool.schema")
    if schema is None:
        raise BadDataError(f"{path}: not a kvtool file (no kvtool.schema in its metadata)")
    expected = (expected,) if isinstance(expected, str) else expected
    if schema not in expected:
        raise BadDataError(f"{path}: is a {schema} file; expected {' or '.join(expected)}")
    version = meta.get("kvtool.schema_version")
    if version != SCHEMA_VERSION:
        raise BadDataError(f"{path}: schema version {version!r} is not supported (this kvtool reads {SCHEMA_VERSION})")
    return schema


def facts_from_meta(path: Path, meta: dict[str, str]) -> ModelFacts:
    data = parse_json_meta(path, meta, "kvtool.model")
    try:
        facts = ModelFacts.from_dict(data)
    except KeyError as exc:
        raise BadDataError(f"{path}: kvtool.model lacks {exc.args[0]}") from None
    except TypeError as exc:
        raise BadDataError(f"{path}: kvtool.model {exc}") from None
    if facts.dtype not in DTYPES:
        raise BadDataError(f"{path}: kvtool.model dtype {facts.dtype!r} is not one of {', '.join(DTYPES)}")
    # the one bounded-size rule (kvtool.core.limits): refused before anything is allocated for them
    if facts.num_layers > MAX_LAYERS or max(facts.num_heads, facts.num_kv_heads, facts.head_dim, facts.hidden_size) > MAX_WIDTH:
        raise BadDataError(f"{path}: kvtool.model sizes are implausible ({facts.num_layers} layers, {facts.num_heads} heads, head_dim {facts.head_dim}, "
                           f"hidden size {facts.hidden_size}; kvtool reads at most {MAX_LAYERS} layers and widths of {MAX_WIDTH})")
    if min(facts.num_heads, facts.num_kv_heads, facts.head_dim, facts.num_layers, facts.hidden_size) <= 0 or facts.num_heads % facts.num_kv_heads:
        raise BadDataError(f"{path}: kvtool.model sizes are inconsistent ({facts.num_layers} layers, {facts.num_heads} heads, {facts.num_kv_heads} KV heads, "
                           f"head_dim {facts.head_dim}, hidden size {facts.hidden_size})")
    return facts


ITEMSIZE = kvfile.ITEMSIZE
ST_DTYPES = kvfile.ST_DTYPES


def capture_metadata(cache: KVCache) -> dict[str, str]:
    return {
        "kvtool.schema": CAPTURE_SCHEMA,
        "kvtool.schema_version": SCHEMA_VERSION,
        "kvtool.version": __version__,
        "kvtool.model": json.dumps(cache.facts.to_dict()),
        "kvtool.layers": json.dumps(cache.layer_indices),
        "kvtool.info": json.dumps(cache.info),
    }


def capture_tensors(cache: KVCache) -> dict[str, torch.Tensor]:
    import torch

    tensors: dict[str, torch.Tensor] = {"token_ids": cache.token_ids.to(torch.int64)}
    if cache.attention_mask is not None:
        tensors["attention_mask"] = cache.attention_mask.to(torch.int64)
    for i, layer in cache.layers.items():
        for part in LAYER_PARTS:
            t = getattr(layer, part)
            if t is not None:
                tensors[f"layers.{i}.{part}"] = t
    return tensors


def save(cache: KVCache, path: str | Path, force: bool = False) -> Path:
    """Save a capture atomically. Refuses to overwrite unless ``force``.

    Validates the container first (shapes against the model facts), so a bad cache is never
    written."""
    validate_cache(cache, Path(path))
    return write_safetensors(path, capture_tensors(cache), capture_metadata(cache), force=force)


def validate_cache(cache: KVCache, path: Path | str = "<memory>") -> None:
    """Check every tensor's shape and dtype against the model facts; BadDataError on the first problem."""
    import torch

    f = cache.facts
    if cache.token_ids.ndim != 2:
        raise BadDataError(f"{path}: token_ids should be [batch, tokens], got shape {list(cache.token_ids.shape)}")
    b, t = cache.token_ids.shape
    if b < 1 or t < 1:
        raise BadDataError(f"{path}: the capture holds no tokens (token_ids has shape {[b, t]})")
    if cache.token_ids.dtype != torch.int64:
        raise BadDataError(f"{path}: token_ids is {cache.token_ids.dtype}, expected int64")
    if cache.attention_mask is not None and list(cache.attention_mask.shape) != [b, t]:
        raise BadDataError(f"{path}: attention_mask should be {[b, t]}, got {list(cache.attention_mask.shape)}")
    if not cache.layers:
        raise BadDataError(f"{path}: the capture holds no layers")
    want = {
        "keys": [b, f.num_kv_heads, t, f.head_dim],
        "values": [b, f.num_kv_heads, t, f.head_dim],
        "queries": [b, f.num_heads, t, f.head_dim],
        "hidden": [b, t, f.hidden_size],
    }
    for i, layer in cache.layers.items():
        if not 0 <= i < f.num_layers:
            raise BadDataError(f"{path}: layer {i} is outside the model's {f.num_layers} layers")
        for part in LAYER_PARTS:
            tensor = getattr(layer, part)
            if tensor is None:
                if part in ("keys", "values"):
                    raise BadDataError(f"{path}: layer {i} has no {part}")
                continue
            if list(tensor.shape) != want[part]:
                raise BadDataError(f"{path}: layers.{i}.{part} has shape {list(tensor.shape)}, the metadata says {want[part]}")
            if tensor.dtype != f.torch_dtype:
                raise BadDataError(f"{path}: layers.{i}.{part} is {tensor.dtype}, the metadata says {f.dtype}")


def check_entries(path: Path, facts: ModelFacts, indices: list[int], entries: dict[str, tuple[str, list[int]]]) -> None:
    """The capture's tensor names against ``kvtool.layers`` and their dtypes against the facts."""
    allowed = {"token_ids", "attention_mask"} | {f"layers.{i}.{p}" for i in indices for p in LAYER_PARTS}
    unknown = sorted(set(entries) - allowed)
    if unknown:
        raise BadDataError(f"{path}: unexpected tensor {unknown[0]!r} (not named in kvtool.layers)")
    if "token_ids" not in entries:
        raise BadDataError(f"{path}: tensor 'token_ids' is missing")
    for i in indices:
        for p in ("keys", "values"):
            if f"layers.{i}.{p}" not in entries:
                raise BadDataError(f"{path}: tensor 'layers.{i}.{p}' is missing")
    for name, (dt, _shape) in entries.items():
        if name.startswith("layers.") and ST_DTYPES.get(dt) != facts.dtype:
            raise BadDataError(f"{path}: {name} is {ST_DTYPES.get(dt, dt)}, the metadata says {facts.dtype}")


def layer_list(path: Path, meta: dict[str, str], facts: ModelFacts) -> list[int]:
    """The layer indices ``kvtool.layers`` lists, in its order: a non-empty list of distinct layer
    indices of the model (BadDataError otherwise), counted before the list is even parsed, so a
    forged list of millions of layers costs nothing."""
    text = meta.get("kvtool.layers")
    if isinstance(text, str) and text.count(",") >= facts.num_layers:
        raise BadDataError(f"{path}: kvtool.layers lists more layers than the model's {facts.num_layers}")
    indices = parse_json_meta(path, meta, "kvtool.layers")
    if not isinstance(indices, list) or not indices or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise BadDataError(f"{path}: kvtool.layers is not a list of layer indices")
    seen: set[int] = set()
    for i in indices:
        if not 0 <= i < facts.num_layers:
            raise BadDataError(f"{path}: kvtool.layers names layer {i}, outside the model's {facts.num_layers} layers")
        if i in seen:
            raise BadDataError(f"{path}: kvtool.layers lists layer {i} twice")
        seen.add(i)
    return indices


def load_header_layers(path: Path, meta: dict[str, str]) -> list[int]:
    """The layer indices a capture's ``kvtool.layers`` lists, sorted (:func:`layer_list`)."""
    return sorted(layer_list(path, meta, facts_from_meta(path, meta)))


def load(path: str | Path, layers: list[int] | None = None, parts: tuple[str, ...] = LAYER_PARTS, allow_nonfinite: bool | None = None) -> KVCache:
    """Load and validate a capture file.

    ``layers`` restricts loading to those model layer indices; ``parts`` to some of keys, values,
    queries, hidden (keys and values are always loaded). Raises BadDataError naming the file and the
    problem for anything that is not a valid capture, NaN/infinite values included unless
    ``allow_nonfinite`` (default: the CLI's ``--allow-nonfinite``)."""
    path = Path(path)
    with KVFile(path) as f:  # one open file: the header and the bytes of one version of it
        meta, entries = f.meta, f.entries
        check_schema(path, meta, CAPTURE_SCHEMA)
        facts = facts_from_meta(path, meta)
        indices = layer_list(path, meta, facts)
        info = parse_json_meta(path, meta, "kvtool.info", default={})
        check_entries(path, facts, indices, entries)
        if layers is not None:
            missing = [i for i in layers if i not in indices]
            if missing:
                raise UsageError(f"layer {missing[0]} is not in {path} (it has layers {format_indices(indices)})")
            indices = [i for i in indices if i in layers]
        wanted = ["token_ids"] + (["attention_mask"] if "attention_mask" in entries else [])
        wanted += [f"layers.{i}.{p}" for i in indices for p in LAYER_PARTS if (p in parts or p in ("keys", "values")) and f"layers.{i}.{p}" in entries]
        # checksums and finite values in the same pass as the read
        tensors = read_tensors(path, wanted, finite=True, allow_nonfinite=allow_nonfinite, file=f)
    cache = KVCache(
        facts=facts,
        layers={
            i: LayerKV(**{p: tensors.get(f"layers.{i}.{p}") for p in LAYER_PARTS})
            for i in indices
        },
        token_ids=tensors["token_ids"],
        info=info,
        attention_mask=tensors.get("attention_mask"),
    )
    validate_cache(cache, path)
    return cache


def describe(path: str | Path) -> dict[str, Any]:
    """What ``kvtool info`` shows: schema, metadata (JSON decoded), tensors with shapes, dtypes and
    bytes, totals. Works on any kvtool file without loading its tensors."""
    path = Path(path)
    meta, entries = read_header(path)
    schema = check_schema(path, meta)
    data = kvfile.describe(path, meta, entries)
    return {"path": data["path"], "schema": schema, "schema_version": meta.get("kvtool.schema_version"), **{k: v for k, v in data.items() if k != "path"}}


def inspect_file(path: str | Path) -> dict[str, Any]:
    """:func:`describe` of a kvtool file, after checking what can be checked without the format
    registry (and without torch): a capture as :func:`load` would (:func:`check_capture_file`), a
    paged export's checksums. A compressed file's own checks and byte report come from
    :func:`kvtool.formats.files.file_info`."""
    data = describe(path)
    if data["schema"] == CAPTURE_SCHEMA:
        check_capture_file(path)
    elif data["schema"] == PAGED_SCHEMA:
        verify_checksums(path)
    return data


def check_capture_file(path: str | Path, allow_nonfinite: bool | None = None) -> None:
    """Check a capture file as :func:`load` does, without keeping its tensors (and without torch):
    the header (schema, model facts, layers, names, dtypes and shapes against the facts), then every
    tensor's bytes streamed in chunks against its checksum and for NaN/infinite values."""
    path = Path(path)
    with KVFile(path) as f:
        meta, entries = f.meta, f.entries
        check_schema(path, meta, CAPTURE_SCHEMA)
        facts = facts_from_meta(path, meta)
        indices = load_header_layers(path, meta)
        parse_json_meta(path, meta, "kvtool.info", default={})
        check_entries(path, facts, indices, entries)
        ids = entries["token_ids"]
        if ids[0] != "I64" or len(ids[1]) != 2 or min(ids[1]) < 1:
            raise BadDataError(f"{path}: token_ids should be [batch, tokens] int64, got {ST_DTYPES.get(ids[0], ids[0])} {ids[1]}")
        b, t = ids[1]
        want = {"keys": [b, facts.num_kv_heads, t, facts.head_dim], "values": [b, facts.num_kv_heads, t, facts.head_dim],
                "queries": [b, facts.num_heads, t, facts.head_dim], "hidden": [b, t, facts.hidden_size]}
        for i in indices:
            if not 0 <= i < facts.num_layers:
                raise BadDataError(f"{path}: layer {i} is outside the model's {facts.num_layers} layers")
            for part, shape in want.items():
                got = entries.get(f"layers.{i}.{part}")
                if got is not None and list(got[1]) != shape:
                    raise BadDataError(f"{path}: layers.{i}.{part} has shape {list(got[1])}, the metadata says {shape}")
        if "attention_mask" in entries and list(entries["attention_mask"][1]) != [b, t]:
            raise BadDataError(f"{path}: attention_mask should be {[b, t]}, got {list(entries['attention_mask'][1])}")
        f.scan(list(entries), finite=True, allow_nonfinite=allow_nonfinite)  # nothing kept: a chunk per reader thread


_natural_key = kvfile.natural_key
