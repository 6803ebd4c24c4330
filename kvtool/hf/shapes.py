"""Named full model shapes and random-weight models built straight where they will run.

``SHAPES`` is kvtool's one table of model shapes (``bench``'s ``--model-shape`` reads its attention
part from it). :func:`build_model` makes a transformers ``LlamaForCausalLM`` of a shape with seeded
random weights for measuring without downloading weights:

- the model is constructed on the ``meta`` device (no memory), then every parameter is created on
  the device that will hold it and filled there, so a 70B-shaped model never has a host copy;
- a device map (accelerate's: ``"auto"``, ``"balanced"``, ``"sequential"`` or an explicit dict)
  spreads decoder layers over GPUs, and accelerate's hooks move activations between them;
- every parameter is filled from its own generator, seeded from ``seed`` and the parameter's name,
  so a layer's weights do not depend on which device holds it, on the other layers, or on the
  order of construction: a 2-layer slice (``layers=2``) built on one GPU has exactly the weights of
  layers 0 and 1 of the full model spread over several. Values match between devices of one type
  (one CUDA generator per device; the CPU's generator gives different numbers than CUDA's);
- non-persistent buffers (the rotary ``inv_freq``) are recomputed on their device.

Weights are ``normal(0, 0.02)`` (the config's ``initializer_range``), norms 1: the numbers say
nothing about a trained model's KV cache, only about sizes, speed and memory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from kvtool.core.cache import DTYPES
from kvtool.core.errors import UsageError

RANDOM_PREFIX = "random:"


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-architecture model's sizes (``LlamaForCausalLM``; SmolLM2 and Llama 2/3 share it)."""

    name: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    max_positions: int = 131072
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "bfloat16"  # what build_model uses unless told otherwise

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    def params(self, layers: int | None = None) -> int:
        """Number of parameters (tied embeddings counted once)."""
        n = self.layers if layers is None else layers
        attn = self.hidden_size * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return n * (attn + mlp + 2 * self.hidden_size) + emb + self.hidden_size

    def config(self, layers: int | None = None) -> Any:
        """A transformers ``LlamaConfig`` of this shape (``layers``: only the first that many)."""
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.layers if layers is None else layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_positions,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_embeddings,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        cfg._name_or_path = RANDOM_PREFIX + self.name
        return cfg


SHAPES: dict[str, LlamaShape] = {
    s.name: s
    for s in (
        LlamaShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 500000.0),
        LlamaShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 500000.0),
        LlamaShape("llama2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 10000.0, max_positions=4096),
        LlamaShape("smollm2", 30, 576, 9, 3, 64, 1536, 49152, 100000.0, max_positions=8192, tie_embeddings=True),
        # for tests on the CPU: 4 layers, float32
        LlamaShape("tiny", 4, 64, 4, 2, 16, 128, 512, 10000.0, max_positions=4096, dtype="float32"),
    )
}


def shape_named(name: str) -> LlamaShape:
    """The shape called ``name`` (``random:`` prefix allowed); UsageError listing the names if unknown."""
    key = name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name
    if key not in SHAPES:
        raise UsageError(f"model shape {name!r} is unknown; use one of {', '.join(SHAPES)}")
    return SHAPES[key]


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` (a 63-bit integer from SHA-256 of seed and name)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _device_of(name: str, device_map: Mapping[str, Any]) -> torch.device:
    """The device ``device_map`` (accelerate's: module prefix -> device) gives tensor ``name``."""
    best = None
    for prefix in device_map:
        if prefix == "" or name == prefix or name.startswith(prefix + "."):
            if best is None or len(prefix) > len(best):
                best = prefix
    if best is None:
        raise UsageError(f"the device map places no module holding {name}")
    dev = device_map[best]
    return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)


def plan_device_map(model: Any, device_map: str | Mapping[str, Any], max_memory: Mapping[Any, Any] | None = None) -> dict[str, Any]:
    """Accelerate's device map for a model built on the meta device.

    A dict is returned as is; ``"auto"``/``"balanced"``/``"balanced_low_0"`` balance the decoder
    layers (never split: ``model._no_split_modules``) over the GPUs in ``max_memory`` (default:
    accelerate's view of the free memory of every visible GPU), ``"sequential"`` fills them in
    order. Without CUDA and without ``max_memory`` everything goes to the CPU. With tied
    embeddings ``lm_head`` goes where ``model.embed_tokens`` is."""
    if isinstance(device_map, Mapping):
        return dict(device_map)
    if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
        raise UsageError(f"device map {device_map!r}: use auto, balanced, balanced_low_0, sequential or a dict")
    if max_memory is None and not torch.cuda.is_available():
        return {"": "cpu"}
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory, get_max_memory

    dtype = next(model.parameters()).dtype
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    if device_map == "sequential":
        budget = get_max_memory(dict(max_memory) if max_memory is not None else None)
    else:
        budget = get_balanced_memory(model, max_memory=dict(max_memory) if max_memory is not None else None,
                                     no_split_module_classes=no_split, dtype=dtype, low_zero=device_map == "balanced_low_0")
    plan = dict(infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split, dtype=dtype))
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in plan and "model.embed_tokens" in plan:
        plan["lm_head"] = plan["model.embed_tokens"]
    return plan


def _recompute_buffers(module: Any, device: torch.device) -> None:
    """Rebuild a module's non-persistent buffers on ``device`` by constructing the module again
    there (rotary embeddings compute ``inv_freq`` from the config in ``__init__``)."""
    config = getattr(module, "config", None)
    if config is None:
        raise UsageError(f"{type(module).__name__}: cannot recompute its buffers (no config)")
    with torch.device(device):
        fresh = type(module)(config)
    for name, buf in fresh.named_buffers(recurse=False):
        module.register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)
    for name, value in vars(fresh).items():  # plain tensor attributes (original_inv_freq in some versions), scalars
        if name not in fresh._buffers and (isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool)):
            setattr(module, name, value)


def empty_model(shape: str | LlamaShape, *, layers: int | None = None, dtype: str | torch.dtype | None = None, attn_implementation: str = "sdpa") -> Any:
    """A ``LlamaForCausalLM`` of ``shape`` on the ``meta`` device (no memory): what device maps are
    planned on. ``layers``: only the first that many decoder layers; ``dtype``: default the shape's."""
    from transformers import LlamaForCausalLM

    s = shape if isinstance(shape, LlamaShape) else shape_named(shape)
    if layers is not None and not 1 <= layers <= s.layers:
        raise UsageError(f"layers={layers}: the shape {s.name} has 1..{s.layers} layers")
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else DTYPES[dtype or s.dtype]
    with torch.device("meta"):
        return LlamaForCausalLM._from_config(s.config(layers), dtype=torch_dtype, attn_implementation=attn_implementation)


@torch.no_grad()
def _materialize(model: Any, device_map: Mapping[str, Any], seed: int, std: float) -> None:
    """Create every meta parameter on its device and fill it from its own seeded generator."""
    generators: dict[torch.device, torch.Generator] = {}
    for full, param in list(model.named_parameters()):
        dev = _device_of(full, device_map)
        if dev.type in ("meta", "disk"):
            raise UsageError(f"{full}: random weights must live on a CPU or GPU, not {dev.type}")
        owner_name, _, pname = full.rpartition(".")
        owner = model.get_submodule(owner_name)
        data = torch.empty(param.shape, dtype=param.dtype, device=dev)
        if "norm" in owner_name.rsplit(".", 1)[-1]:
            data.fill_(1.0)
        elif pname == "bias":
            data.zero_()
        else:
            g = generators.get(dev)
            if g is None:
                g = generators[dev] = torch.Generator(device=dev)
            g.manual_seed(param_seed(seed, full))
            data.normal_(0.0, std, generator=g)
        owner._parameters[pname] = torch.nn.Parameter(data, requires_grad=False)
    for mod_name, module in model.named_modules():
        meta = [b for b, t in module.named_buffers(recurse=False) if t.device.type == "meta"]
        if meta:
            _recompute_buffers(module, _device_of(f"{mod_name}.{meta[0]}" if mod_name else meta[0], device_map))


def build_model(
    shape: str | LlamaShape,
    *,
    device: str | torch.device = "cpu",
    device_map: str | Mapping[str, Any] | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    layers: int | None = None,
    attn_implementation: str = "sdpa",
) -> Any:
    """A ``LlamaForCausalLM`` of ``shape`` with seeded random weights, in eval mode, no gradients.

    Args:
        shape: a name from :data:`SHAPES` (``random:`` prefix allowed) or a :class:`LlamaShape`.
        device: where the whole model goes when ``device_map`` is None (``cpu``, ``cuda:1``, ...).
        device_map: accelerate's device map (``auto``, ``balanced``, ``sequential`` or a dict of
            module prefix -> device); the model then carries ``hf_device_map`` and, over several
            devices, accelerate's hooks.
        max_memory: per-device budgets for a string ``device_map`` (``{0: "70GiB", 1: ...}``).
        dtype: parameter dtype (default: the shape's, bfloat16 except ``tiny``'s float32).
        seed: weights are a function of ``seed`` and each parameter's name only.
        layers: build only the first ``layers`` decoder layers (same weights as the full model's).

    Returns the model; parameters ``[out, in]`` in ``dtype`` on their devices, no host copy."""
    model = empty_model(shape, layers=layers, dtype=dtype, attn_implementation=attn_implementation)
    plan = plan_device_map(model, device_map, max_memory) if device_map is not None else {"": str(torch.device(device))}
    _materialize(model, plan, seed, float(model.config.initializer_range))
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    devices = {str(_device_of(n, plan)) for n, _ in model.named_parameters()}
    if device_map is not None:
        model.hf_device_map = plan
        if len(devices) > 1:
            from accelerate import dispatch_model

            dispatch_model(model, device_map=plan)
    model.requires_grad_(False)
    return model.eval()
