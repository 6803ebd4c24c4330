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
from typing import Any

import torch
from safetensors import safe_open

from kvtool._version import __version__
from kvtool.core.cache import DTYPES, KVCache, LayerKV, ModelFacts
from kvtool.core import settings
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.cache import format_indices
from kvtool.core.limits import MAX_HEADER_BYTES, MAX_LAYERS, MAX_WIDTH
# the output check and atomic writes (torch-free, so the CLI uses them at start-up); re-exported here
from kvtool.core.outputs import atomic_path, atomic_write_bytes, atomic_write_text, check_output, note_input, output_beside, remove_stale_temps  # noqa: F401

CAPTURE_SCHEMA = "kvtool.capture"
COMPRESSED_SCHEMA = "kvtool.compressed"
SCHEMA_VERSION = "1"
PAGED_SCHEMA = "kvtool.paged"  # written by kvtool.paged (kvtool export --to paged)
KNOWN_SCHEMAS = (CAPTURE_SCHEMA, COMPRESSED_SCHEMA, PAGED_SCHEMA)
LAYER_PARTS = ("keys", "values", "queries", "hidden")


CHECKSUM_KEY = "kvtool.checksums"
CHECKSUM_ALGORITHM = "crc32"


def set_verify_checksums(on: bool) -> None:
    """Turn checking of ``kvtool.checksums`` on load on or off (the CLI's ``--no-verify-checksums``)."""
    settings.verify_checksums = on


def verifying_checksums() -> bool:
    return settings.verify_checksums and os.environ.get("KVTOOL_NO_VERIFY_CHECKSUMS", "") in ("", "0")




def set_allow_nonfinite(on: bool) -> None:
    """Let loads accept NaN/infinite tensor values (the CLI's ``--allow-nonfinite``)."""
    settings.allow_nonfinite = on


def check_finite(path: Path | str, tensors: dict[str, torch.Tensor], allow: bool | None = None) -> None:
    """BadDataError naming the first floating tensor that holds NaN or infinite values, and how
    many, unless ``allow`` (default: :func:`set_allow_nonfinite`'s setting) or KVTOOL_ALLOW_NONFINITE=1."""
    if allow is None:
        allow = settings.allow_nonfinite or os.environ.get("KVTOOL_ALLOW_NONFINITE", "") not in ("", "0")
    if allow:
        return
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel():
            flat = t.reshape(-1)
            # in chunks: isfinite makes several temporaries the size of its input
            bad = sum(int((~torch.isfinite(flat[i : i + (1 << 20)])).sum()) for i in range(0, flat.numel(), 1 << 20))
            if bad:
                raise BadDataError(f"{path}: tensor {name!r} holds {bad} NaN or infinite values of {t.numel()}; kvtool --allow-nonfinite accepts them")


def tensor_crc32(tensor: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes as stored (any dtype), continuing from ``crc``."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return crc
    return zlib.crc32(flat.view(torch.uint8).numpy(), crc)


def metadata_crc32(metadata: dict[str, str]) -> int:
    """CRC-32 of every metadata entry except the checksums themselves (keys sorted, JSON text)."""
    rest = {k: v for k, v in metadata.items() if k != CHECKSUM_KEY}
    return zlib.crc32(json.dumps(rest, sort_keys=True).encode())


_ST_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
             torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], force: bool = False, inputs: tuple = ()) -> Path:
    """Save ``tensors`` with string ``metadata`` atomically, with ``kvtool.checksums`` added.

    The file is streamed: the header first, then each tensor's bytes straight from the tensor, so
    no second copy of the payload is built in memory. Tensors are made contiguous on the CPU one at a
    time."""
    path = check_output(path, force, inputs)
    clean = {name: tensors[name].detach() for name in sorted(tensors)}
    crcs: dict[str, str] = {}
    entries: dict[str, Any] = {}
    offset = 0
    for name, t in clean.items():
        if t.dtype not in _ST_CODES:
            raise UsageError(f"cannot store tensor {name!r} of dtype {t.dtype} in a safetensors file")
        cpu = t.to("cpu").contiguous()
        crcs[name] = f"{tensor_crc32(cpu):08x}"
        nbytes = cpu.numel() * cpu.element_size()
        entries[name] = {"dtype": _ST_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
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


def read_checksums(path: Path, meta: dict[str, str]) -> dict[str, str] | None:
    """``{tensor name: hex}`` from the file's ``kvtool.checksums`` (after checking the metadata's own
    checksum), or None when the file has none or checking is off. BadDataError if malformed or wrong."""
    if CHECKSUM_KEY not in meta or not verifying_checksums():
        return None
    try:
        data = json.loads(meta[CHECKSUM_KEY])
    except (json.JSONDecodeError, RecursionError):
        raise BadDataError(f"{path}: metadata {CHECKSUM_KEY!r} is not valid JSON (the header is corrupted)") from None
    if (
        not isinstance(data, dict)
        or data.get("algorithm") != CHECKSUM_ALGORITHM
        or not isinstance(data.get("tensors"), dict)
        or not all(isinstance(v, str) for v in data["tensors"].values())
    ):
        raise BadDataError(f"{path}: metadata {CHECKSUM_KEY!r} is not a {CHECKSUM_ALGORITHM} checksum table (the header is corrupted)")
    if data.get("metadata") != f"{metadata_crc32(meta):08x}":
        raise BadDataError(f"{path}: the metadata fails its checksum (the header is corrupted); --no-verify-checksums skips the check")
    return data["tensors"]


def check_tensor_checksum(path: Path, name: str, checksums: dict[str, str] | None, crc: int) -> None:
    if checksums is None:
        return
    want = checksums.get(name)
    if want is None:
        raise BadDataError(f"{path}: tensor {name!r} has no checksum in {CHECKSUM_KEY} (the header is corrupted)")
    if want != f"{crc:08x}":
        raise BadDataError(f"{path}: tensor {name!r} fails its checksum (its bytes are corrupted); --no-verify-checksums skips the check")


def sha256_file(path: str | Path) -> str:
    """sha256 of a regular file (BadDataError for a FIFO, device or folder: no unbounded reads)."""
    check_regular_file(path)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_regular_file(path: str | Path) -> int:
    """The size of ``path``; BadDataError unless it is an existing regular file (after symlinks)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise BadDataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadDataError(f"{path}: not a regular file")
    note_input(path)  # an input of the running command: no output may be it
    return st.st_size


# ----------------------------------------------------------------------------- reading


def read_header(path: str | Path) -> tuple[dict[str, str], dict[str, tuple[str, list[int]]]]:
    """Metadata and ``{name: (dtype, shape)}`` of a safetensors file, without loading tensors.

    Raises BadDataError for a missing, unreadable, truncated or non-safetensors file."""
    path = Path(path)
    if not path.exists():
        raise BadDataError(f"{path}: no such file")
    if path.is_dir():
        raise BadDataError(f"{path}: is a folder, not a kvtool file")
    check_regular_file(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise BadDataError(f"{path}: not a safetensors file (too short)")
            n = int.from_bytes(head, "little")
            size = path.stat().st_size
            if n <= 0 or n > min(size - 8, MAX_HEADER_BYTES):
                raise BadDataError(f"{path}: not a safetensors file (bad header length)")
            header = json.loads(fh.read(n))
    except (OSError, PermissionError) as exc:
        raise BadDataError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadDataError(f"{path}: not a safetensors file (header is not JSON)") from None
    except RecursionError:
        raise BadDataError(f"{path}: not a safetensors file (header nests too deeply)") from None
    if not isinstance(header, dict):
        raise BadDataError(f"{path}: not a safetensors file (header is not an object)")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise BadDataError(f"{path}: not a safetensors file (its metadata is not a table of strings)")
    checksums = read_checksums(path, meta)
    if checksums is not None and set(checksums) != set(header):
        odd = sorted(set(checksums) ^ set(header))[0]
        raise BadDataError(f"{path}: tensor {odd!r} is missing from the file or from {CHECKSUM_KEY} (the header is corrupted)")
    entries: dict[str, tuple[str, list[int]]] = {}
    end = 0
    for name, spec in header.items():
        try:
            dt, shape, (begin, stop) = spec["dtype"], list(spec["shape"]), spec["data_offsets"]
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in [*shape, begin, stop]) or dt not in ITEMSIZE:
                raise ValueError
        except (KeyError, TypeError, IndexError, ValueError):
            raise BadDataError(f"{path}: not a safetensors file (bad entry for {name!r})") from None
        count = 1
        for n_ in shape:
            count *= n_
        if stop - begin != count * ITEMSIZE[dt]:
            raise BadDataError(f"{path}: tensor {name!r} of shape {shape} {ST_DTYPES.get(dt, dt)} needs {count * ITEMSIZE[dt]} bytes, the header gives it {stop - begin}")
        entries[name] = (dt, shape)
        end = max(end, stop)
    if 8 + n + end > size:
        raise BadDataError(f"{path}: truncated: the header promises {8 + n + end} bytes, the file has {size}")
    return meta, entries


def read_tensors(path: str | Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Load tensors (all, or ``names``) from a safetensors file, CPU, each checked against its
    ``kvtool.checksums`` entry (BadDataError naming the tensor on a mismatch)."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            meta = fh.metadata() or {}
            checksums = read_checksums(path, meta)
            out = {}
            for name in names if names is not None else fh.keys():
                out[name] = fh.get_tensor(name)
                if checksums is not None:
                    check_tensor_checksum(path, name, checksums, tensor_crc32(out[name]))
            if checksums is not None and set(checksums) - set(fh.keys()):
                extra = sorted(set(checksums) - set(fh.keys()))[0]
                raise BadDataError(f"{path}: {CHECKSUM_KEY} names tensor {extra!r}, which the file lacks (the header is corrupted)")
            return out
    except BadDataError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt data
        raise BadDataError(f"{path}: cannot read tensors ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc


def read_tail(path: str | Path, name: str, tokens: int, axis: int = 2) -> torch.Tensor:
    """The last ``tokens`` entries along ``axis`` of tensor ``name`` (e.g. the held-out queries
    ``[B, H, tokens, D]`` of ``layers.{i}.queries``), read without loading the rest. The tensor's
    checksum is still checked, by streaming its bytes from the file in 4 MiB chunks."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            meta = fh.metadata() or {}
            sl = fh.get_slice(name)
            shape = sl.get_shape()
            index = tuple(slice(max(shape[axis] - tokens, 0), None) if d == axis else slice(None) for d in range(len(shape)))
            tensor = sl[index]
    except Exception as exc:  # safetensors raises its own error types for corrupt data
        raise BadDataError(f"{path}: cannot read tensor {name!r} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
    checksums = read_checksums(path, meta)
    if checksums is not None:
        check_tensor_checksum(path, name, checksums, file_range_crc32(path, name))
    return tensor


def verify_checksums(path: str | Path) -> bool:
    """Check every tensor of a kvtool file against ``kvtool.checksums`` by streaming the file (no
    tensor is loaded). False when the file has no checksums or checking is off; BadDataError naming
    the first tensor that fails."""
    path = Path(path)
    meta, entries = read_header(path)
    checksums = read_checksums(path, meta)
    if checksums is None:
        return False
    for name in entries:
        check_tensor_checksum(path, name, checksums, file_range_crc32(path, name))
    return True


def file_range_crc32(path: Path, name: str) -> int:
    """CRC-32 of tensor ``name``'s bytes as they lie in the file, read in chunks."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        begin, stop = header[name]["data_offsets"]
        fh.seek(8 + n + begin)
        crc, left = 0, stop - begin
        while left > 0:
            chunk = fh.read(min(left, 4 << 20))
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
    return crc


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


ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1, "F64": 8}
ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "BOOL": "bool"}


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
    meta, entries = read_header(path)
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
    tensors = read_tensors(path, wanted)
    check_finite(path, tensors, allow_nonfinite)
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
    decoded: dict[str, Any] = {}
    for key, value in meta.items():
        try:
            decoded[key] = json.loads(value)
        except json.JSONDecodeError:
            decoded[key] = value
        except RecursionError:
            raise BadDataError(f"{path}: metadata {key!r} nests too deeply") from None
    itemsize = ITEMSIZE
    tensors = []
    total = 0
    for name, (dt, shape) in sorted(entries.items(), key=lambda kv: _natural_key(kv[0])):
        n = 1
        for s in shape:
            n *= s
        nbytes = n * itemsize.get(dt, 0)
        total += nbytes
        tensors.append({"name": name, "dtype": ST_DTYPES.get(dt, dt), "shape": shape, "bytes": nbytes})
    return {
        "path": str(path),
        "schema": schema,
        "schema_version": meta.get("kvtool.schema_version"),
        "metadata": decoded,
        "tensors": tensors,
        "tensor_bytes": total,
        "file_bytes": path.stat().st_size,
    }


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in name.split(".")]
