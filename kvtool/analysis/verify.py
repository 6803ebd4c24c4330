"""Verifying a compressed file against the capture it came from (the library of ``kvtool verify``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvtool.analysis.fidelity import (
    attention_fidelity,
    check_model_facts,
    default_model_spec,
    dense_reference,
    find_source,
    model_fidelity,
)
from kvtool.core import io
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.placement import resolve_devices
from kvtool.core.streaming import open_capture
from kvtool.core.progress import Progress, or_silent
from kvtool.hf.passes import layer_calls
from kvtool.formats.base import CompressedCache, load_compressed
from kvtool.hf import models
from kvtool.hf.devices import model_device_text


def load_model(spec: str, facts, device: Any = None) -> tuple[Any, str]:
    """Load a model for model-level fidelity and check it against the capture's facts. On a CUDA
    ``device`` it loads there in the capture's dtype; on the CPU (the default) as it is stored.
    ``device`` may be a list of devices (:func:`~kvtool.core.placement.resolve_devices`): a model
    too large for the first GPU is then spread over the listed GPUs by accelerate
    (:func:`kvtool.hf.models.load_on_devices`); the caches it runs on follow its layers."""
    devices = list(device) if isinstance(device, (list, tuple)) else [torch.device(device) if device is not None else torch.device("cpu")]
    model, _tok, source = models.load_on_devices(spec, devices, torch_dtype=facts.torch_dtype if devices[0].type == "cuda" else None)
    name = source.name if spec in (None, "", "embedded", "smollm2") else str(spec)
    check_model_facts(model, facts, name)
    return model, name


def verify_file(
    compressed: Path,
    capture: Path | None = None,
    heldout: int | None = None,
    backend: str = "auto",
    model: str | None = None,
    use_model: bool = True,
    generate: int = 16,
    progress: Progress | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Attention-level and (with a model) model-level fidelity of a compressed file; see
    :mod:`kvtool.analysis.fidelity`. The capture's layers are read one at a time onto ``device``
    (default ``auto``: every visible GPU, layers spread over them and scored at once; else the
    CPU), where the references and the format run. The model runs on the first device, or, when
    its weights do not fit there, spread over the devices by accelerate, each layer's compressed
    prefix beside it (:func:`load_model`); ``model_fidelity.device`` says where. Returns the
    report dict that ``--json`` prints."""
    if generate < 0:
        raise UsageError(f"--generate must be 0 or more, got {generate}")
    devices = resolve_devices(device)
    dev = devices[0]
    # checked (and validated) on the device that will use it, when there is one
    cc: CompressedCache = load_compressed(compressed, device=dev if len(devices) == 1 else None)
    source_path = find_source(cc, compressed, capture)
    # keys and values of the captured layers, and only the queries that are scored: the last
    # M = --heldout (default: the file's held-out W) of each layer; hidden states are not read.
    # Each layer is read when scored, by the thread of the device that scores it.
    missing = [i for i in cc.layer_indices if i not in io.load_header_layers(source_path, io.read_header(source_path)[0])]
    if missing:
        raise BadDataError(f"the capture lacks layer {missing[0]}, which the compressed file holds")
    tail = int(heldout if heldout is not None else cc.info.get("heldout", 0) or 0)
    source = open_capture(source_path, layers=cc.layer_indices, parts=("queries",) if tail > 0 else (), query_tail=tail)
    report: dict[str, Any] = {"capture": str(source_path), "model_facts": cc.facts.to_dict()}
    progress = or_silent(progress)
    progress.stage("attention fidelity, layers", len(cc.layer_indices))
    report["attention"] = attention_fidelity(cc, source, heldout, backend, progress=lambda i: progress.advance(), device=devices)
    spec = default_model_spec(cc.facts, model) if use_model else None
    if spec is None:
        report["model_fidelity"] = None
        report["model_skipped"] = "--no-model" if not use_model else (
            f"the capture came from {cc.facts.name} ({cc.facts.source}); pass --model to score the continuation"
        )
        return report
    progress.stage("loading the model", 1)
    try:
        mdl, name = load_model(spec, cc.facts, devices)
    except BadDataError as exc:
        if model:
            raise
        raise BadDataError(f"{exc} (or pass --no-model for attention-level fidelity only)") from None
    steps = max(0, generate - 1)  # greedy tokens after the first, which the continuation's last logits give
    with layer_calls(mdl, progress, f"dense pass (prefill, continuation, {generate} generated)", 2 + steps):
        ref = dense_reference(mdl, cc.token_ids, cc.prefix_tokens, generate, source, name)
    with layer_calls(mdl, progress, f"compressed pass (continuation, {generate} generated)", 1 + steps):
        report["model_fidelity"] = model_fidelity(mdl, cc, ref, generate, backend=report["attention"]["backend"])
    report["model_fidelity"]["model"] = name
    report["model_fidelity"]["device"] = model_device_text(mdl)
    return report


def check_thresholds(report: dict[str, Any], max_nll_increase: float | None, min_agreement: float | None, max_error: float | None) -> list[str]:
    """Human-readable lines for every threshold missed."""
    missed = []
    model = report.get("model_fidelity")
    if max_error is not None:
        err = report["attention"]["overall"]["rel_l2"]
        if not err <= max_error:
            missed.append(f"attention-output relative L2 error {err:.4g} > --max-error {max_error:g}")
    if model is not None and max_nll_increase is not None and not model["nll_increase"] <= max_nll_increase:
        missed.append(f"NLL increase {model['nll_increase']:.4g} > --max-nll-increase {max_nll_increase:g}")
    if model is not None and min_agreement is not None and not model["agreement"] >= min_agreement:
        missed.append(f"top-1 agreement {model['agreement']:.4g} < --min-agreement {min_agreement:g}")
    return missed
