"""Exporting kvtool files to what other tools read (``kvtool export``).

Targets (``TARGETS``):

- ``hf``: a kvtool file that :func:`kvtool.hf.cache.to_hf_cache` turns into a transformers cache. A
  capture or a format whose decode keeps every token becomes a capture-schema file of dense
  keys/values for every model layer (lossy formats decoded); a format that selects tokens at
  attention time or keeps fewer tokens than it was given stays a compressed file (its attention runs
  inside the model through kvtool's attention function). HF caches need every layer.
- ``paged``: FlashInfer / vLLM pages and page table (:mod:`kvtool.export.paged`).
- ``npz``: numpy arrays ``layers.{i}.keys`` / ``.values`` ``[B, Hkv, T, D]`` (queries/hidden when
  present), ``token_ids``, and ``kvtool_metadata`` (JSON text).
- ``dense``: the decoded capture (what ``kvtool decompress`` writes).
- ``csv`` / ``json``: tables. From a JSON results file (``kvtool stats --json``, ``kvtool eval
  --json``, ...) the records; from a kvtool file its tensor table (csv) or description (json).
"""

from __future__ import annotations

import csv
import io as _stdio
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtool.core import io
from kvtool.core.limits import read_json_input
from kvtool.core.cache import KVCache, LayerKV
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats.base import CompressedCache, save_compressed
from kvtool.formats.files import check_all_layers, dense_of, keeps_every_token, needs_attention, read_kv_file
from kvtool.export.paged import check_layout, save_paged, to_paged, to_paged_layers
from kvtool.core.cache import ModelFacts
from kvtool.core.jsonio import to_json_text

TARGETS = ("hf", "paged", "npz", "dense", "csv", "json")
SUFFIX = {"hf": ".hf.safetensors", "paged": ".paged.safetensors", "npz": ".npz", "dense": ".dense.safetensors", "csv": ".csv", "json": ".json"}
TENSOR_TARGETS = ("hf", "paged", "npz", "dense")
TABLE_TARGETS = ("csv", "json")


def default_output(source: Path, target: str) -> Path:
    """``cap.safetensors`` -> ``cap.paged.safetensors`` etc. (next to the input; for the bundled
    sample, in the current folder)."""
    stem = source.name
    for ext in (".safetensors", ".json"):
        if stem.endswith(ext):
            stem = stem[: -len(ext)]
    return io.output_beside(source, stem + SUFFIX[target])


def export_hf(obj: KVCache | CompressedCache, source: Path, output: Path, force: bool = False) -> dict[str, Any]:
    """Write the hf export of ``obj`` (see the module docstring); returns a small report."""
    check_all_layers(obj.layer_indices, obj.facts.num_layers, source)
    provenance = {"export": "hf", "source_path": str(source), "source_sha256": io.source_sha256(source)}
    if isinstance(obj, CompressedCache) and needs_attention(obj):
        mode = "ring" if obj.fmt.appends_tokens else "attend"
        cc = CompressedCache(obj.facts, obj.format, obj.params, obj.layers, obj.tails, obj.token_ids, {**obj.info, **provenance, "hf_mode": mode})
        save_compressed(cc, output, force=force)
        return {"mode": mode, "format": obj.format, "tokens": int(obj.token_ids.shape[1]), "prefix_tokens": obj.prefix_tokens}
    cache = dense_of(obj, source, "hf")
    layers = {i: LayerKV(keys=l.keys, values=l.values) for i, l in cache.layers.items()}
    info = {**cache.info, **provenance, "hf_mode": "dense"}
    if isinstance(obj, CompressedCache):
        info["format"] = obj.format
    out = KVCache(cache.facts, layers, cache.token_ids, info, cache.attention_mask)
    path = io.save(out, output, force=force)
    return {"mode": "dense", "format": info.get("format", "capture"), "tokens": out.num_tokens, "output": str(path)}


def export_paged_evicted(cc: CompressedCache, source: Path, output: Path, page_size: int, layout: str, force: bool = False) -> dict[str, Any]:
    """Pages of a file whose layers keep fewer tokens than they were given (eviction formats; plans
    written with ``recommend --servable paged``): every KV head of a layer must keep the same count
    (layers may differ: each such layer gets its own page table, :mod:`kvtool.export.paged`). The
    kept tokens are decoded (dequantised where stored quantised) and followed by the held-out tail."""
    fmt = cc.fmt
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    kept: dict[int, int] = {}
    for i in cc.layer_indices:
        try:
            dense = fmt.decode(cc.layers[i])
        except UsageError as exc:
            raise UsageError(f"{source}: layer {i} cannot be paged: {exc}; make the plan with `kvtool recommend --servable paged` (one token budget per layer)") from None
        tail = cc.tails.get(i)
        k, v = dense.keys.to(cc.facts.torch_dtype), dense.values.to(cc.facts.torch_dtype)
        if tail is not None and tail.keys.shape[2]:
            k, v = torch.cat([k, tail.keys.to(k.dtype)], dim=2), torch.cat([v, tail.values.to(v.dtype)], dim=2)
        layers[i] = (k.contiguous(), v.contiguous())
        kept[i] = int(dense.keys.shape[2])
    paged = to_paged_layers(cc.facts, layers, page_size, layout)
    paged.info = {"source_path": str(source), "source_sha256": io.sha256_file(source), "format": cc.format,
                  "next_position": int(cc.token_ids.shape[1]), "kept_prefix_tokens": {str(i): n for i, n in kept.items()},
                  "prefix_tokens": cc.prefix_tokens}
    save_paged(paged, output, force=force)
    layer_rows = [{"layer": i, "num_pages": int(paged.k_pages[i].shape[0]), "seq_len": int(paged.table(i)["seq_lens"][0])} for i in paged.layer_indices]
    return {"page_size": page_size, "layout": paged.layout, "num_pages": sum(r["num_pages"] for r in layer_rows), "layers": layer_rows,
            "next_position": int(cc.token_ids.shape[1])}


# ----------------------------------------------------------------------------- npz


def npz_arrays(cache: KVCache) -> dict[str, np.ndarray]:
    """Every tensor of a capture as numpy (bfloat16, which numpy lacks, becomes float32)."""
    arrays: dict[str, np.ndarray] = {}
    for name, t in io.capture_tensors(cache).items():
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        arrays[name] = t.numpy()
    meta = io.capture_metadata(cache)
    meta["kvtool.npz_dtype"] = "float32" if cache.facts.dtype == "bfloat16" else cache.facts.dtype
    arrays["kvtool_metadata"] = np.array(json.dumps(meta))
    return arrays


def save_npz(cache: KVCache, output: Path, force: bool = False) -> Path:
    """Write ``cache`` as an uncompressed ``.npz`` atomically (readable with ``np.load(path)``)."""
    io.check_output(output, force)
    arrays = npz_arrays(cache)
    with io.atomic_path(output, force) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    return output


def load_npz(path: Path) -> KVCache:
    """Read an npz export back into a :class:`KVCache` (tensors in the stored numpy dtypes)."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise BadDataError(f"{path}: not an npz file ({exc})") from None
    if "kvtool_metadata" not in data.files:
        raise BadDataError(f"{path}: not a kvtool npz export (no kvtool_metadata)")
    meta = json.loads(str(data["kvtool_metadata"]))
    facts = ModelFacts.from_dict(json.loads(meta["kvtool.model"]))
    indices = json.loads(meta["kvtool.layers"])
    layers = {i: LayerKV(**{p: torch.from_numpy(data[f"layers.{i}.{p}"]) for p in io.LAYER_PARTS if f"layers.{i}.{p}" in data.files}) for i in indices}
    mask = torch.from_numpy(data["attention_mask"]) if "attention_mask" in data.files else None
    return KVCache(facts, layers, torch.from_numpy(data["token_ids"]), json.loads(meta.get("kvtool.info", "{}")), mask)


# ----------------------------------------------------------------------------- tables


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, list) and not all(isinstance(v, (dict, list)) for v in obj):
        out[prefix[:-1]] = json.dumps(obj) if any(isinstance(v, (dict, list)) for v in obj) else ";".join(map(str, obj))
        return out
    if isinstance(obj, list):
        for n, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{n}."))
        return out
    out[prefix[:-1]] = obj
    return out


def _record_lists(obj: Any, where: str = "") -> list[tuple[str, list[dict]]]:
    found: list[tuple[str, list[dict]]] = []
    if isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        found.append((where, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found.extend(_record_lists(v, f"{where}.{k}" if where else str(k)))
    return found


def result_records(data: Any) -> tuple[str, list[dict[str, Any]]]:
    """The table a JSON result holds: the longest list of objects anywhere in it (``rows``,
    ``results``, ``layers``, ...), each object flattened with dotted keys; a JSON object with no
    such list becomes one flattened record. Returns (where the list was, records)."""
    lists = _record_lists(data)
    if lists:
        where, rows = max(lists, key=lambda item: len(item[1]))
        return where or "(top level)", [_flatten(r) for r in rows]
    if isinstance(data, dict):
        return "(top level)", [_flatten(data)]
    raise BadDataError("the JSON holds no object or list of objects to turn into a table")


def records_csv(records: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    for r in records:
        columns.extend(c for c in r if c not in columns)
    buf = _stdio.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow({c: "" if r.get(c) is None else r.get(c) for c in columns})
    return buf.getvalue()


def export_table(source: Path, target: str, output: Path, force: bool = False) -> dict[str, Any]:
    """csv/json: records of a JSON result, or a kvtool file's tensor table / description."""
    io.check_output(output, force, inputs=(source,))
    if source.suffix.lower() == ".json":
        data = read_json_input(source, str(source))
        try:
            where, records = result_records(data)
        except BadDataError as exc:
            raise BadDataError(f"{source}: {exc}") from None
    else:
        desc = io.describe(source)
        io.verify_checksums(source)  # a description of a corrupted file is not exported
        if target == "json":
            io.atomic_write_text(output, to_json_text(desc), force=force)
            return {"rows": len(desc["tensors"]), "table": "description"}
        where = "tensors"
        records = [{"name": t["name"], "dtype": t["dtype"], "shape": "x".join(map(str, t["shape"])), "bytes": t["bytes"]} for t in desc["tensors"]]
    text = records_csv(records) if target == "csv" else to_json_text(records)
    io.atomic_write_text(output, text, force=force)
    return {"rows": len(records), "table": where}


# ----------------------------------------------------------------------------- one entry point


def export_file(source: str | Path, target: str, output: str | Path | None = None, page_size: int = 16, layout: str = "NHD", force: bool = False) -> dict[str, Any]:
    """Export ``source`` to ``target`` (one of :data:`TARGETS`); returns a report with ``output``."""
    source = Path(source)
    if target not in TARGETS:
        raise UsageError(f"--to must be one of {', '.join(TARGETS)}, got {target!r}")
    output = Path(output) if output is not None else default_output(source, target)
    io.check_output(output, force, inputs=(source,))
    if target == "paged":
        layout = check_layout(page_size, layout)
    if target in TABLE_TARGETS:
        report = export_table(source, target, output, force)
    else:
        if source.suffix.lower() == ".json":
            raise UsageError(f"{source} is a JSON result; it exports --to csv or json only")
        obj = read_kv_file(source)
        if target == "hf":
            report = export_hf(obj, source, output, force)
        elif target == "paged" and isinstance(obj, CompressedCache) and not keeps_every_token(obj):
            report = export_paged_evicted(obj, source, output, page_size, layout, force)
        else:
            cache = dense_of(obj, source, target)
            if target == "paged":
                paged = to_paged(cache, page_size, layout)
                paged.info = {"source_path": str(source), "source_sha256": io.source_sha256(source), "format": getattr(obj, "format", "capture")}
                save_paged(paged, output, force=force)
                report = {"page_size": page_size, "layout": layout, "num_pages": paged.num_pages, "seq_lens": paged.seq_lens.tolist(), "layers": paged.layer_indices}
            elif target == "npz":
                save_npz(cache, output, force=force)
                report = {"layers": cache.layer_indices, "tokens": cache.num_tokens}
            else:
                io.save(cache, output, force=force)
                report = {"layers": cache.layer_indices, "tokens": cache.num_tokens}
    if report.get("layers") and all(isinstance(i, int) for i in report["layers"]):
        report["layers"] = [{"layer": i} for i in report["layers"]]  # per-layer data is a list of objects (docs/cli.md)
    report.update({"to": target, "output": str(output), "file_bytes": output.stat().st_size})
    return report
