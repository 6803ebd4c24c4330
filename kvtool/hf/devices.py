"""Where a loaded model's decoder layers live: one device, or several under accelerate's device map.

Per-layer work that must sit beside the model's own layer (a live cache of layer ``i``, its keys
and values read back) asks :func:`layer_devices`; work with no model spreads layers with
:func:`kvtool.core.placement.layer_placement`, which cuts them the same way accelerate does."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from kvtool.core.cache import format_indices


def decoder_layers(model: Any) -> Any:
    """The model's decoder layers (``model.model.layers`` for transformers' ``*ForCausalLM``)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise AttributeError(f"{type(model).__name__}: no decoder layers found (model.model.layers)")
    return layers


def module_device(module: Any) -> torch.device:
    """Where ``module`` computes: accelerate's hook's execution device when it has one (weights
    offloaded to the CPU or disk run there), else the device of its first parameter or buffer."""
    hook = getattr(module, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def layer_devices(model: Any) -> dict[int, torch.device]:
    """``{layer index: device}`` for every decoder layer of ``model`` (one device for a model on
    one device; a model loaded with ``device_map="auto"`` over GPUs gives each layer its GPU). A
    model whose decoder layers are not found at ``model.model.layers`` is taken to run where its
    first parameter is, for each of its ``config.num_hidden_layers`` layers."""
    try:
        layers = decoder_layers(model)
    except AttributeError:
        n = int(getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0)
        return {i: module_device(model) for i in range(n)}
    return {i: module_device(layer) for i, layer in enumerate(layers)}


def devices_of(model: Any) -> list[torch.device]:
    """The distinct devices of ``model``'s decoder layers, in layer order."""
    out: list[torch.device] = []
    for dev in layer_devices(model).values():
        if dev not in out:
            out.append(dev)
    return out


def layer_devices_text(where: Mapping[int, torch.device], layers: Iterable[int] | None = None) -> str:
    """Where ``layers`` (default: all of ``where``) run, for reports: ``"cuda:0"`` on one device,
    ``"cuda:0 0-39; cuda:1 40-79"`` over several."""
    by_device: dict[str, list[int]] = {}
    for i in (sorted(where) if layers is None else layers):
        by_device.setdefault(str(where.get(i, "?")), []).append(i)
    if len(by_device) == 1:
        return next(iter(by_device))
    return "; ".join(f"{d} {format_indices(ls)}" for d, ls in by_device.items())


def model_device_text(model: Any) -> str:
    """:func:`layer_devices_text` of ``model``'s decoder layers."""
    return layer_devices_text(layer_devices(model))
