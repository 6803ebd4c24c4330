"""The format interface every compression format implements, and the compressed container.

A format is one module in ``kvtool/formats/`` with a :class:`Format` subclass decorated by
:func:`register`. It works one layer at a time:

- ``encode(layer, params) -> Encoded``: ``layer`` is a :class:`~kvtool.core.cache.LayerKV` of the tokens
  to compress (keys/values ``[B, Hkv, T, D]``, queries ``[B, H, T, D]`` when captured);
- ``decode(encoded) -> LayerKV``: the dense keys/values the format represents (lossy where the format
  is), ``[B, Hkv, T', D]`` (T' < T for eviction formats);
- ``nbytes(encoded) -> {part: bytes}``: every byte a decoder needs, from the stored tensors;
- ``attend(q, encoded, scale) -> (out, lse)``: decode-step attention of q ``[B, H, Tq, D]`` over the
  encoded tokens, as a partial (see :mod:`kvtool.core.attention`), in plain torch. Kernels must agree.
- ``validate(encoded)``: check stored tensors before anything reads them (offsets in range, counts).

Selection formats (``selects = True``) also implement ``traffic_bytes(encoded, q)``: the bytes one
decode step reads, so reports can give storage and traffic ratios.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvtool._version import __version__
from kvtool.core.attention import attend_partial
from kvtool.core.cache import DTYPES, KVCache, LayerKV, ModelFacts, dense_reference_bytes
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.limits import MAX_TOKENS, bounded_int, finite_float
from kvtool.formats.encoded import Encoded
from kvtool.formats._live import PrefixLive
from kvtool.core.names import FORMAT_ALIASES, closest
from kvtool.core.io import (
    COMPRESSED_SCHEMA,
    SCHEMA_VERSION,
    KVFile,
    check_schema,
    facts_from_meta,
    parse_json_meta,
    read_tensors,
    write_safetensors,
)


@dataclass
class FormatParams:
    """Base for a format's parameters. Subclasses are dataclasses whose fields have defaults;
    field names match the ``kvtool compress`` option names with dashes as underscores."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Format(ABC):
    """A compression format. Subclasses set ``name``, ``summary`` and ``Params``, and declare their
    capabilities as class attributes; the pipeline, sweeps, CLI help, export and bench read them
    through the registry, so no other module names a format.

    Capabilities:
    - ``selects``: a selection format (reports traffic as well as storage bytes);
    - ``needs_queries``: encoding reads the captured queries;
    - ``prunes_itself``: the format prunes (a ``--prune`` step cannot precede it);
    - ``evicts``: the format drops tokens itself (an ``--evict`` step cannot precede it);
    - ``default_sweep``: the ``kvtool eval`` specs swept when the format is named without parameters
      (an empty tuple: the format with its defaults; ``swept_by_default = False`` leaves the format
      out of the sweep of every format);
    - ``paper_rows``: (comparison, label, spec) rows of the papers' tables for ``eval --paper``;
    - ``has_kernel``: :meth:`attend_kernel` runs a Triton kernel;
    - ``appends_tokens``: :meth:`append_token` adds a decoded token to the stored layer;
    - ``live_grows``: :meth:`live_layer` gives a live cache layer that encodes new tokens the
      format's way while a model decodes (:mod:`kvtool.formats._live`); without it the live layer
      keeps the encoded prefix and holds new tokens dense beside it;
    - :meth:`storage_after_pruning`: how the format stores tensors pruned by a pipeline step;
    - :meth:`reads_queries`: whether encoding (or the report) reads the captured queries.

    Formats that neither select nor evict are compressed one layer at a time (their ``report`` is
    given no source capture), so ``kvtool compress`` holds one source layer in memory.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    Params: ClassVar[type[FormatParams]] = FormatParams
    selects: ClassVar[bool] = False
    needs_queries: ClassVar[bool] = False
    prunes_itself: ClassVar[bool] = False
    evicts: ClassVar[bool] = False
    default_sweep: ClassVar[tuple[str, ...]] = ()
    swept_by_default: ClassVar[bool] = True
    paper_rows: ClassVar[tuple[tuple[str, str, str], ...]] = ()
    appends_tokens: ClassVar[bool] = False
    live_grows: ClassVar[bool] = False

    def check(self, layer: LayerKV, params: FormatParams) -> None:
        """Raise UsageError/BadDataError if ``params`` cannot apply to ``layer`` (called before encode)."""

    def reads_queries(self, params: FormatParams) -> bool:
        """Whether encoding with ``params`` (or the format's report) reads the captured queries;
        ``kvtool compress`` loads them only then."""
        return self.needs_queries or self.selects or self.evicts

    @abstractmethod
    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        """Compress one layer's tokens. See the module docstring for shapes."""

    @abstractmethod
    def decode(self, enc: Encoded) -> LayerKV:
        """Dense keys/values ``[B, Hkv, T', D]`` that the encoded layer represents."""

    def nbytes(self, enc: Encoded) -> dict[str, int]:
        """Bytes by part; the default counts every stored tensor, grouped by the first name part."""
        parts: dict[str, int] = {}
        for name, t in enc.tensors.items():
            part = name.split(".")[0]
            parts[part] = parts.get(part, 0) + t.numel() * t.element_size()
        return parts

    def attend(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention over the encoded tokens (default: dense attention over ``decode``)."""
        dense = self.decode(enc)
        return attend_partial(q, dense.keys, dense.values, scale)

    has_kernel: ClassVar[bool] = False

    def attend_kernel(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton kernel path of :meth:`attend` (same contract, same maths). Formats with a
        kernel set ``has_kernel = True`` and override this; it runs on CUDA tensors, or on CPU
        tensors under ``TRITON_INTERPRET=1``."""
        raise UsageError(f"format {self.name} has no Triton kernel; use the torch backend")

    def storage_after_pruning(self, params: FormatParams, prune: Any) -> tuple["Format", FormatParams] | None:
        """When a pipeline's pruning step (``prune``: a :class:`~kvtool.formats.pipeline.PruneStep`)
        precedes this format: the format and parameters that store the pruned layer, or None to
        store the pruned tensors with this format as they are."""
        return None

    def append_token(self, enc: Encoded, key: torch.Tensor, value: torch.Tensor, inplace: bool = False) -> Encoded:
        """For formats with ``appends_tokens``: the layer with one decoded token's key/value
        (``[B, Hkv, D]`` or ``[B, Hkv, 1, D]``) added the way the format's decoder would (a ring
        buffer, say); a copy unless ``inplace``."""
        raise UsageError(f"format {self.name} does not append tokens")

    def live_layer(self, enc: Encoded, like: torch.Tensor) -> Any:
        """The encoded layer as a live cache layer (a :class:`kvtool.formats._live.LiveLayer`) on
        ``like``'s device and dtype (``like``: any
        tensor ``[B, Hkv, *, D]`` of the layer). Default: the encoded prefix read through
        :meth:`attend` (or :meth:`attend_kernel` on CUDA) with new tokens held dense beside it;
        formats with ``live_grows`` override it (:mod:`kvtool.formats._live`)."""
        return PrefixLive(self, enc, like)

    def live_from_dense(self, layer: LayerKV, params: FormatParams) -> Any:
        """A live layer holding the tokens of ``layer`` (keys/values ``[B, Hkv, T, D]`` on the
        model's device, queries ``[B, H, T, D]`` when the format reads them), encoded with
        ``params``: what ``kvtool.press`` does to each layer of a prompt's cache."""
        self.check(layer, params)
        return self.live_layer(self.encode(layer, params), layer.keys)

    def sweep_specs(self) -> tuple[str, ...]:
        """What ``kvtool eval`` sweeps for this format by default."""
        return self.default_sweep or (self.name,)

    def selected_mask(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor | None:
        """For selection formats: bool ``[B, H, Tq, T]`` (T = encoded prefix tokens, in original
        positions), True where query token t of head h attends a prefix token. Used for
        attention-mass recall. Formats that keep every token return None."""
        return None

    def traffic_bytes(self, enc: Encoded, q: torch.Tensor | None = None) -> int:
        """Bytes one decode step reads; the default is everything stored."""
        return sum(self.nbytes(enc).values())

    def validate(self, enc: Encoded) -> None:
        """Check the stored tensors; raise BadDataError (message without the file name) if wrong."""

    def report(self, cc: "CompressedCache", source: KVCache | None = None) -> dict[str, Any]:
        """Format-specific numbers for ``kvtool compress`` / ``info`` (achieved sparsity, bits per
        element, recall, ...). ``source`` is the capture the file was made from, when at hand."""
        return {}


FORMATS: dict[str, Format] = {}


def register(cls: type[Format]) -> type[Format]:
    """Class decorator: make a format available under ``cls.name``."""
    FORMATS[cls.name] = cls()
    return cls


_loaded = False


def load_all() -> dict[str, Format]:
    """Import every module of the ``kvtool.formats`` package so its formats register; return the
    registry. A new format is one module in that folder: nothing else needs to name it."""
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
            if not mod.name.startswith("_") and mod.name != "base":
                importlib.import_module(f"kvtool.formats.{mod.name}")
    return FORMATS


def get_format(name: str) -> Format:
    load_all()
    if name not in FORMATS:
        from kvtool.methods.evict import POLICIES  # deferred: only to word the error
        from kvtool.methods.prune import METHODS  # deferred: only to word the error

        known = [*FORMATS, *FORMAT_ALIASES, *POLICIES, *METHODS]
        raise UsageError(f"unknown format {name!r}{closest(name, known)}; known formats: {', '.join(sorted(FORMATS))} "
                         f"(also {', '.join(FORMAT_ALIASES)}; eviction and pruning steps chain with +: snapkv:budget=256+quant:bits=4)")
    return FORMATS[name]


# ----------------------------------------------------------------------------- parameters


def _convert(value: Any, annotation: Any, name: str) -> Any:
    """``value`` (text from a spec or an option's value) as the field's type. Integers go through the
    one bounded-size rule (:func:`kvtool.core.limits.bounded_int`: at most MAX_TOKENS in size, so no
    number reaches torch too large for it), floats must be finite."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", ())) and args:
        if isinstance(value, str) and value.lower() in ("none", "null"):
            return None
        if value is None:
            return None
        annotation = args[0]
    if annotation is int and not isinstance(value, bool) and isinstance(value, (int, str)):
        return bounded_int(name, value, -MAX_TOKENS, MAX_TOKENS)
    if annotation is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        return finite_float(name, value)
    if not isinstance(value, str):
        return value
    if origin is typing.Literal:
        if value not in typing.get_args(annotation):
            raise UsageError(f"{name} must be one of {', '.join(map(str, typing.get_args(annotation)))}, got {value!r}")
        return value
    try:
        if annotation is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
    except ValueError:
        raise UsageError(f"{name} must be a {annotation.__name__}, got {value!r}") from None
    return value


def make_params(fmt: Format, values: dict[str, Any]) -> FormatParams:
    """Build ``fmt.Params`` from option values (strings are converted to the field types).

    Unknown names raise UsageError listing the parameters the format has."""
    hints = typing.get_type_hints(fmt.Params)
    names = [f.name for f in dataclasses.fields(fmt.Params)]
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        key = key.replace("-", "_")
        if key not in names:
            raise UsageError(
                f"--format {fmt.name} has no parameter {key.replace('_', '-')!r}; it takes: {', '.join(n.replace('_', '-') for n in names) or 'no parameters'}"
            )
        kwargs[key] = _convert(value, hints.get(key, str), key.replace("_", "-"))
    try:
        return fmt.Params(**kwargs)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--format {fmt.name}: {exc}") from None


# ----------------------------------------------------------------------------- compressed container


SERVING_DTYPE = torch.float16  # the dtype storage ratios count full-precision parts and the dense cache in


def serving_nbytes(fmt: "Format", enc: Encoded, capture_dtype: torch.dtype | None) -> dict[str, int]:
    """``fmt.nbytes(enc)`` with every floating tensor in a capture dtype wider than float16 (the
    full-precision parts: residuals, windows, kept values, statistics; every float tensor of a
    format follows the capture's dtype) counted at float16's size, as a float16 model serves them.
    A capture of float16 or bfloat16 counts as stored."""
    if capture_dtype is None or capture_dtype.itemsize <= SERVING_DTYPE.itemsize:
        return fmt.nbytes(enc)
    narrow = {n: torch.empty(t.shape, dtype=SERVING_DTYPE) if t.is_floating_point() and t.dtype == capture_dtype else t for n, t in enc.tensors.items()}
    return fmt.nbytes(Encoded(narrow, enc.meta))


@dataclass
class CompressedCache:
    """A compressed capture.

    ``layers[i]`` is the encoded prefix (the first ``prefix_tokens`` tokens) of model layer i.
    ``tails[i]`` holds the remaining ``heldout`` tokens dense (keys/values ``[B, Hkv, W, D]``): they
    are the tokens whose queries score the format (``kvtool verify``) and that a continuation sees
    as recent context. ``info`` records the source file's sha256 and path, token counts, the
    pipeline and anything a format wants to report.
    """

    facts: ModelFacts
    format: str
    params: dict[str, Any]
    layers: dict[int, Encoded]
    tails: dict[int, LayerKV]
    token_ids: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def layer_indices(self) -> list[int]:
        return sorted(self.layers)

    @property
    def prefix_tokens(self) -> int:
        return int(self.info["prefix_tokens"])

    @property
    def fmt(self) -> Format:
        return get_format(self.format)

    def layer_bytes(self, layer: int) -> dict[str, int]:
        """Bytes by part of one layer as served in float16 (:func:`serving_nbytes`)."""
        return serving_nbytes(self.fmt, self.layers[layer], DTYPES.get(self.facts.dtype))

    def byte_report(self) -> dict[str, Any]:
        """Bytes by part over all layers, the float16 bytes of the same prefix's keys and values
        (whatever the capture's dtype), and the ratio: the denominator is float16 and the
        full-precision parts count in float16 too (:func:`serving_nbytes`), so a file's share does
        not depend on its capture's dtype. A live cache's ``storage_ratio`` is the same quotient
        in its own (the model's) dtype."""
        parts: dict[str, int] = {}
        for i in self.layers:
            for part, n in self.layer_bytes(i).items():
                parts[part] = parts.get(part, 0) + n
        f = self.facts
        dense = dense_reference_bytes(self.token_ids.shape[0], f.num_kv_heads, self.prefix_tokens, f.head_dim, len(self.layers))
        total = sum(parts.values())
        return {"parts": parts, "stored_bytes": total, "dense_bytes": dense, "storage_ratio": total / dense if dense else float("nan")}


def compress_cache(cache: KVCache, fmt: Format, params: FormatParams, heldout: int = 0, progress=None) -> CompressedCache:
    """Encode the first ``T - heldout`` tokens of every layer of ``cache`` with ``fmt``.

    ``progress``: optional callable(layer_index) called after each layer."""
    t = cache.num_tokens
    if not 0 <= heldout < t:
        raise UsageError(f"--heldout {heldout} must be at least 0 and below the capture's {t} tokens")
    if fmt.needs_queries and not cache.has_queries:
        raise UsageError(f"--format {fmt.name} needs queries; recapture without --no-queries")
    prefix = t - heldout
    layers: dict[int, Encoded] = {}
    tails: dict[int, LayerKV] = {}
    for i in cache.layer_indices:
        full = cache.layers[i]
        head = full.slice_tokens(0, prefix)
        fmt.check(head, params)
        layers[i] = fmt.encode(head, params)
        tail = full.slice_tokens(prefix, None)
        # a copy, never a view: a view would keep the whole layer (possibly on a GPU) alive
        tails[i] = LayerKV(keys=tail.keys.clone(memory_format=torch.contiguous_format), values=tail.values.clone(memory_format=torch.contiguous_format))
        if progress is not None:
            progress(i)
    info = {"prefix_tokens": prefix, "heldout": heldout, "total_tokens": t, "source_info": cache.info}
    return CompressedCache(cache.facts, fmt.name, params.to_dict(), layers, tails, cache.token_ids, info)


def compress_cache_over(cache: KVCache, fmt: Format, params: FormatParams, placement: "typing.Mapping[int, torch.device]", heldout: int = 0, progress=None) -> CompressedCache:
    """:func:`compress_cache` with layer ``i`` read onto ``placement[i]`` and encoded there, each
    device's layers in a thread of its own, the devices at once
    (:func:`kvtool.core.placement.run_per_device`). The same container as :func:`compress_cache`
    (every format encodes one layer at a time), its layers on their devices. A lazily read capture
    (:class:`~kvtool.core.streaming.LazyCapture`) reads each layer in the thread that encodes it.
    ``progress(layer)`` is called from the calling thread."""
    from kvtool.core.placement import run_per_device  # deferred: threads only where several devices work

    def one(i: int, dev: torch.device) -> CompressedCache:
        read = getattr(cache, "read_layer", None)
        layer = read(i, dev) if read is not None else cache.layers[i].to(dev)
        part = KVCache(cache.facts, {i: layer}, cache.token_ids, cache.info, cache.attention_mask)
        return compress_cache(part, fmt, params, heldout=heldout)  # a streamed layer is dropped once encoded

    done = run_per_device(one, placement, on_done=progress)
    parts = list(done.values())
    cc = parts[0]
    for part in parts[1:]:
        cc.layers.update(part.layers)
        cc.tails.update(part.tails)
    cc.layers = {i: cc.layers[i] for i in placement}
    cc.tails = {i: cc.tails[i] for i in placement if i in cc.tails}
    return cc


def compressed_tensors(cc: CompressedCache) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {"token_ids": cc.token_ids.to(torch.int64)}
    for i in cc.layer_indices:
        for name, t in cc.layers[i].tensors.items():
            tensors[f"layers.{i}.{name}"] = t
        tail = cc.tails.get(i)
        if tail is not None and tail.keys.shape[2] > 0:
            tensors[f"tails.{i}.keys"] = tail.keys
            tensors[f"tails.{i}.values"] = tail.values
    return tensors


def save_compressed(cc: CompressedCache, path: str | Path, force: bool = False) -> Path:
    """Write a compressed file atomically (schema ``kvtool.compressed``)."""
    meta = {
        "kvtool.schema": COMPRESSED_SCHEMA,
        "kvtool.schema_version": SCHEMA_VERSION,
        "kvtool.version": __version__,
        "kvtool.model": json.dumps(cc.facts.to_dict()),
        "kvtool.layers": json.dumps(cc.layer_indices),
        "kvtool.format": cc.format,
        "kvtool.params": json.dumps(cc.params),
        "kvtool.layer_meta": json.dumps({str(i): cc.layers[i].meta for i in cc.layer_indices}),
        "kvtool.info": json.dumps(cc.info),
        "kvtool.source_sha256": str(cc.info.get("source_sha256", "")),
    }
    return write_safetensors(path, compressed_tensors(cc), meta, force=force)


def check_container_meta(path: Path, facts: ModelFacts, params: Any, indices: Any, layer_meta: Any, info: Any, entries: dict[str, tuple[str, list[int]]]) -> None:
    """The compressed container's own metadata: types, layer indices within the model, and token
    counts (``prefix_tokens`` + ``heldout`` = the tokens of ``token_ids``). BadDataError, one line."""
    if not isinstance(params, dict):
        raise BadDataError(f"{path}: kvtool.params is not a JSON object")
    if not isinstance(indices, list) or not indices or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < facts.num_layers for i in indices) or len(set(indices)) != len(indices):
        raise BadDataError(f"{path}: kvtool.layers is not a list of distinct layer indices of the model's {facts.num_layers}")
    if not isinstance(layer_meta, dict):
        raise BadDataError(f"{path}: kvtool.layer_meta is not a JSON object")
    if not isinstance(info, dict):
        raise BadDataError(f"{path}: kvtool.info is not a JSON object")
    prefix, heldout = info.get("prefix_tokens"), info.get("heldout", 0)
    info.setdefault("heldout", 0)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (prefix, heldout)) or prefix < 1 or heldout < 0:
        raise BadDataError(f"{path}: kvtool.info prefix_tokens/heldout are not token counts ({prefix!r}, {heldout!r})")
    dt, shape = entries["token_ids"]
    if dt != "I64" or len(shape) != 2 or shape[0] < 1 or shape[1] != prefix + heldout:
        raise BadDataError(f"{path}: token_ids is {dt} {shape}; the file says [batch, {prefix} + {heldout}] int64")


def check_geometry(meta: dict[str, Any], batch: int, kv_heads: int, tokens: int, head_dim: int) -> None:
    """An encoded layer's declared geometry against the container's: ``shape`` (``[B, Hkv, T, D]``:
    mixed, bitmapq), ``tokens`` (bitmap, pagestat, pipeline) and ``prefix_tokens``/``length``
    (snapstream) must describe the ``tokens`` compressed tokens of ``batch`` x ``kv_heads`` x
    ``head_dim``; a file holds no appended tokens, so ``length`` equals the tokens too. A forged but
    self-consistent layer (snapstream length 2^40, a mixed shape of other tokens) is refused here
    instead of reaching a decoder or a model with the wrong size (BadDataError)."""
    want = [batch, kv_heads, tokens, head_dim]
    if "shape" in meta and meta["shape"] != want:
        raise BadDataError(f"its metadata shape {meta['shape']} is not the file's {want} (batch, KV heads, compressed tokens, head_dim)")
    for key in ("tokens", "prefix_tokens", "length"):
        if key in meta and meta[key] != tokens:
            raise BadDataError(f"its metadata {key} {meta[key]} is not the file's {tokens} compressed tokens")


def check_tail(path: Path, i: int, tensors: dict[str, torch.Tensor], facts: ModelFacts, heldout: int) -> LayerKV | None:
    """Layer ``i``'s dense held-out tail: keys and values ``[B, Hkv, heldout, D]`` in the model dtype,
    both present when ``heldout`` > 0, absent otherwise."""
    keys, values = tensors.get(f"tails.{i}.keys"), tensors.get(f"tails.{i}.values")
    if keys is None and values is None:
        if heldout:
            raise BadDataError(f"{path}: tails.{i}.keys/values are missing for the {heldout} held-out tokens")
        return None
    want = [tensors["token_ids"].shape[0], facts.num_kv_heads, heldout, facts.head_dim]
    for name, t in (("keys", keys), ("values", values)):
        if t is None:
            raise BadDataError(f"{path}: tails.{i}.{name} is missing")
        if list(t.shape) != want or t.dtype != facts.torch_dtype:
            raise BadDataError(f"{path}: tails.{i}.{name} is {t.dtype} {list(t.shape)}, expected {facts.dtype} {want}")
    return LayerKV(keys=keys, values=values)


def load_compressed(path: str | Path, allow_nonfinite: bool | None = None, device: Any = None) -> CompressedCache:
    """Load and validate a compressed file: schema, model facts, tensor names, checksums, finite
    floating tensors (unless ``allow_nonfinite``), and the format's own ``validate`` on every layer
    before any kernel or decoder touches the data. With ``device`` the layers' tensors are moved
    there first and validated there (``token_ids`` stays on the CPU)."""
    path = Path(path)
    file = KVFile(path)
    try:
        return _load_compressed(path, file, allow_nonfinite, device)
    finally:
        file.close()


def _load_compressed(path: Path, file: KVFile, allow_nonfinite: bool | None, device: Any) -> CompressedCache:
    meta, entries = file.meta, file.entries
    check_schema(path, meta, COMPRESSED_SCHEMA)
    facts = facts_from_meta(path, meta)
    name = meta.get("kvtool.format")
    if not name:
        raise BadDataError(f"{path}: metadata key 'kvtool.format' is missing")
    try:
        fmt = get_format(name)
    except UsageError:
        raise BadDataError(f"{path}: format {name!r} is not known to this kvtool") from None
    params = parse_json_meta(path, meta, "kvtool.params")
    indices = parse_json_meta(path, meta, "kvtool.layers")
    layer_meta = parse_json_meta(path, meta, "kvtool.layer_meta")
    info = parse_json_meta(path, meta, "kvtool.info")
    if "token_ids" not in entries:
        raise BadDataError(f"{path}: tensor 'token_ids' is missing")
    check_container_meta(path, facts, params, indices, layer_meta, info, entries)
    # checksums and finite values in the same pass as the read
    tensors = read_tensors(path, finite=True, allow_nonfinite=allow_nonfinite, file=file)
    if device is not None and torch.device(device).type != "cpu":
        tensors = {n: t if n == "token_ids" else t.to(device) for n, t in tensors.items()}
    layers: dict[int, Encoded] = {}
    tails: dict[int, LayerKV] = {}
    for i in indices:
        prefix = f"layers.{i}."
        own = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
        if not own:
            raise BadDataError(f"{path}: layer {i} has no tensors")
        enc_meta = layer_meta.get(str(i), {})
        if not isinstance(enc_meta, dict):
            raise BadDataError(f"{path}: kvtool.layer_meta for layer {i} is not a JSON object")
        layers[i] = Encoded(own, enc_meta)
        try:
            fmt.validate(layers[i])
            check_geometry(enc_meta, int(tensors["token_ids"].shape[0]), facts.num_kv_heads, int(info["prefix_tokens"]), facts.head_dim)
        except BadDataError as exc:
            raise BadDataError(f"{path}: layer {i}: {exc}") from None
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError) as exc:
            # metadata of the wrong type or tensors of an impossible shape that the format's checks
            # did not foresee: still bad data, said in one line
            raise BadDataError(f"{path}: layer {i}: malformed {fmt.name} metadata or tensors ({str(exc).splitlines()[0] if str(exc) else 'wrong type'})") from None
        tail = check_tail(path, i, tensors, facts, int(info["heldout"]))
        if tail is not None:
            tails[i] = tail
    known = {n for n in tensors if n == "token_ids" or any(n.startswith(f"layers.{i}.") or n.startswith(f"tails.{i}.") for i in indices)}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise BadDataError(f"{path}: unexpected tensor {unknown[0]!r} (not named in kvtool.layers)")
    if meta.get("kvtool.source_sha256"):
        info.setdefault("source_sha256", meta["kvtool.source_sha256"])
    return CompressedCache(facts, name, params, layers, tails, tensors["token_ids"], info)
