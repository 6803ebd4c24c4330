"""Compressing capture files and decoding compressed files back to dense captures."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from kvtool.core import io
from kvtool.core.cache import KVCache, LayerKV, format_indices, parse_indices
from kvtool.core.errors import UsageError
from kvtool.core.placement import layer_placement, resolve_devices
from kvtool.core.progress import Progress, or_silent
from kvtool.core.streaming import open_capture
from kvtool.formats.base import CompressedCache, compress_cache, compress_cache_over, load_compressed, save_compressed
from kvtool.formats.pipeline import resolve
from kvtool.formats.plan import compress_plan, load_plan


def default_output(capture: Path, fmt: str) -> Path:
    """``CAPTURE.FORMAT.safetensors`` beside the capture (for the bundled sample: in the current folder)."""
    return io.output_beside(capture, f"{capture.stem}.{fmt}.safetensors")


def compress_file(
    capture: Path,
    spec: str,
    output: Path | None = None,
    options: dict[str, Any] | None = None,
    heldout: int = 64,
    layers: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
    device: str | None = None,
    plan: Path | None = None,
) -> tuple[CompressedCache, Path, dict[str, Any]]:
    """Compress a capture file and write the result; returns (container, path, report).

    ``spec``: ``NAME[:key=value,...]`` or an eviction + pruning + format chain; ``options``: format
    parameters given apart from the spec (and ``evict``/``prune`` step specs); ``progress``: one stage,
    a unit per layer. Layers are read one at a time onto ``device`` (default ``auto``: every
    visible GPU, layers spread over them in contiguous blocks, one thread per GPU; else the CPU)
    and encoded there; formats that read the whole capture (selection, eviction, plans) run on
    the first device. With ``plan`` (a plan file, :mod:`kvtool.formats.plan`) each layer gets the
    plan's format(s) instead of ``spec``."""
    devices = resolve_devices(device)
    if plan is not None:
        plan_obj = load_plan(plan)
        fmt, params, name = resolve("mixed")
    else:
        fmt, params, name = resolve(spec, options)  # --evict/--prune (or a + chain) make a pipeline
    output = output or default_output(capture, name)
    io.check_output(output, force, inputs=(capture,))
    meta, _ = io.read_header(capture)
    io.check_schema(capture, meta, io.CAPTURE_SCHEMA)
    facts = io.facts_from_meta(capture, meta)
    selected = parse_indices(layers, facts.num_layers) if layers else None
    # only the tensors the format reads: queries when it (or its report) uses them, never hidden
    parts = ("queries",) if plan is not None or fmt.reads_queries(params) else ()
    # one open file for every layer (checked once as a capture; each layer read ahead of its use)
    lazy = open_capture(capture, layers=selected, parts=parts, device=devices[0])
    indices = lazy.layer_indices
    check_compressible(capture, lazy, heldout)
    whole = plan is not None or fmt.selects or fmt.evicts or fmt.needs_queries  # their reports read the source capture
    start = time.perf_counter()
    progress = or_silent(progress)
    progress.stage(f"compress {name}", len(indices))
    cache: KVCache | None = None
    if whole:
        # encode where the data is best served
        cache = KVCache(lazy.facts, {i: lazy.layers[i] for i in indices}, lazy.token_ids, lazy.info, lazy.attention_mask)
        with torch.cuda.device(devices[0]) if devices[0].type == "cuda" else contextlib.nullcontext():
            if plan is not None:
                cc = compress_plan(cache, plan_obj, heldout=heldout, progress=lambda i: progress.advance())
            else:
                cc = compress_cache(cache, fmt, params, heldout=heldout, progress=lambda i: progress.advance())
    else:
        cc = compress_cache_over(lazy, fmt, params, layer_placement(indices, devices), heldout=heldout, progress=lambda i: progress.advance())
    cc.info["source_sha256"] = io.source_sha256(capture)  # its header names it (or its whole content, once per version)
    cc.info["source_path"] = str(capture)
    cc.info["seconds"] = round(time.perf_counter() - start, 3)
    if fmt.name == "pipeline":
        cc.info["pipeline"] = next(iter(cc.layers.values())).meta.get("label")
    path = save_compressed(cc, output, force=force)
    report = build_report(cc, cache)
    report["output"] = str(path)
    report["file_bytes"] = path.stat().st_size
    return cc, path, report


def check_compressible(capture: Path, cache: KVCache, heldout: int) -> None:
    """UsageError for a left-padded batch or a --heldout that leaves no tokens to compress."""
    if cache.attention_mask is not None and bool((cache.attention_mask == 0).any()):
        raise UsageError(f"{capture} holds a left-padded batch; compress needs equal-length prompts (recapture with --align truncate)")
    if heldout >= cache.num_tokens:
        raise UsageError(f"--heldout {heldout} leaves no tokens to compress: {capture} has {cache.num_tokens} tokens (lower --heldout)")


def build_report(cc: CompressedCache, source: KVCache | None = None) -> dict[str, Any]:
    """What ``kvtool compress`` and ``info`` report of a compressed file: bytes by part and by layer
    against the dense bytes of the same tokens (``storage_ratio``: stored / dense, a fraction), and
    the format's own figures (``source``: the capture, if at hand)."""
    fmt = cc.fmt
    rep = cc.byte_report()
    per_layer_dense = rep["dense_bytes"] // max(1, len(cc.layers))
    layers = [{"layer": i, "stored_bytes": int(sum(cc.layer_bytes(i).values())), "dense_bytes": per_layer_dense} for i in cc.layer_indices]
    return {
        "format": cc.format,
        "params": cc.params,
        "layers": layers,
        "prefix_tokens": cc.prefix_tokens,
        "heldout": cc.info.get("heldout", 0),
        "dense_bytes": rep["dense_bytes"],
        "stored_bytes": rep["stored_bytes"],
        "bytes_by_part": rep["parts"],
        "storage_ratio": rep["storage_ratio"],
        "details": fmt.report(cc, source),
        **({"plan_default_layers": cc.info["plan_default_layers"]} if "plan_default_layers" in cc.info else {}),
    }


def decompress_cache(cc: CompressedCache) -> KVCache:
    """Decode every layer and append the dense held-out tail: a capture-schema container."""
    fmt = cc.fmt
    layers: dict[int, LayerKV] = {}
    for i in cc.layer_indices:
        dense = fmt.decode(cc.layers[i])
        if dense.keys.shape[2] != cc.prefix_tokens:
            raise UsageError(
                f"format {cc.format} keeps {dense.keys.shape[2]} of {cc.prefix_tokens} tokens per head; "
                "its tokens cannot be written as a capture (use `kvtool export --to hf`)"
            )
        tail = cc.tails.get(i)
        keys, values = dense.keys, dense.values
        if tail is not None:
            keys = torch.cat([keys, tail.keys.to(keys.dtype)], dim=2)
            values = torch.cat([values, tail.values.to(values.dtype)], dim=2)
        dtype = cc.facts.torch_dtype
        layers[i] = LayerKV(keys=keys.to(dtype).contiguous(), values=values.to(dtype).contiguous())
    return KVCache(cc.facts, layers, cc.token_ids, {})


def decompress_file(compressed: Path, output: Path | None = None, force: bool = False) -> tuple[KVCache, Path]:
    """Decode a compressed file and write the dense capture (default ``NAME.dense.safetensors``);
    returns (capture, path). The output may not be the input, ``force`` or not."""
    output = output or io.output_beside(compressed, f"{compressed.stem}.dense.safetensors")
    io.check_output(output, force, inputs=(compressed,))
    cc = load_compressed(compressed)
    cache = decompress_cache(cc)
    cache.info = {"decompressed_from": str(compressed), "format": cc.format, "params": cc.params, **{k: v for k, v in cc.info.items() if k != "source_info"}}
    path = io.save(cache, output, force=force)
    return cache, path


def read_kv_file(path: Path) -> KVCache | CompressedCache:
    """A capture (:class:`KVCache`) or a compressed file (:class:`CompressedCache`), validated."""
    meta, _ = io.read_header(path)
    schema = io.check_schema(path, meta, (io.CAPTURE_SCHEMA, io.COMPRESSED_SCHEMA))
    return io.load(path) if schema == io.CAPTURE_SCHEMA else load_compressed(path)


def keeps_every_token(cc: CompressedCache) -> bool:
    """True when the format's decode gives all ``prefix_tokens`` tokens of every layer."""
    fmt = cc.fmt
    return all(fmt.decode(enc).keys.shape[2] == cc.prefix_tokens for enc in cc.layers.values())


def needs_attention(cc: CompressedCache) -> bool:
    """True when no dense cache can stand in for the format: it selects tokens per query, or keeps
    fewer tokens than it was given. Such files run through kvtool's attention function."""
    return bool(cc.fmt.selects) or not keeps_every_token(cc)


def dense_of(obj: KVCache | CompressedCache, path: Path, target: str) -> KVCache:
    """The dense keys/values an object represents (a capture as it is, a compressed file decoded
    with its held-out tail appended). UsageError naming the targets that can hold the format when its
    decode does not keep every token."""
    if isinstance(obj, KVCache):
        return obj
    if not keeps_every_token(obj):
        raise UsageError(
            f"{path}: format {obj.format} keeps fewer tokens than it was given, so --to {target} cannot hold it; "
            "--to hf can (its attention runs inside the model)"
        )
    cache = decompress_cache(obj)
    cache.info = {"decompressed_from": str(path), "format": obj.format, "params": obj.params, **{k: v for k, v in obj.info.items() if k != "source_info"}}
    return cache


def check_all_layers(layer_indices: list[int], num_layers: int, path: Path) -> None:
    missing = [i for i in range(num_layers) if i not in layer_indices]
    if missing:
        raise UsageError(
            f"{path} holds layers {format_indices(layer_indices)} of the model's {num_layers}; a transformers cache needs every layer "
            "(recapture without --layers); --to paged, npz or dense can hold a partial capture"
        )


def file_info(path: Path) -> dict[str, Any]:
    """Schema, model facts, tensors and totals; for compressed files also bytes by part and ratio."""
    data = io.describe(path)
    if data["schema"] == io.CAPTURE_SCHEMA:
        io.load(path)  # validated like every other command reads it: shapes, checksums, finite data
    elif data["schema"] == io.PAGED_SCHEMA:
        io.verify_checksums(path)
    if data["schema"] == io.COMPRESSED_SCHEMA:
        cc = load_compressed(path)
        data["compression"] = build_report(cc)
    return data
