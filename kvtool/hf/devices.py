"""Where a loaded model's decoder layers live: one device, or several under accelerate's device map.

Per-layer work that must sit beside the model's own layer (a live cache of layer ``i``, its keys
and values read back) asks :func:`layer_devices`; work with no model spreads layers with
:func:`kvtool.core.placement.layer_placement`, which cuts them the same way accelerate does."""

from __future__ import annotations

from typing import Any

import torch


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
    one device; a model loaded with ``device_map="auto"`` over GPUs gives each layer its GPU)."""
    return {i: module_device(layer) for i, layer in enumerate(decoder_layers(model))}


def devices_of(model: Any) -> list[torch.device]:
    """The distinct devices of ``model``'s decoder layers, in layer order."""
    out: list[torch.device] = []
    for dev in layer_devices(model).values():
        if dev not in out:
            out.append(dev)
    return out
