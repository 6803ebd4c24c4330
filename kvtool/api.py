"""The Python API: one function per CLI command, with the same parameters and the same results.

Each function is a thin wrapper over the library function the command calls and returns a frozen
dataclass: the numbers people look at as typed fields, the whole report in ``report``, and
``to_dict()`` giving exactly the object ``kvtool COMMAND --json`` prints (docs/cli.md). Ratios are
fractions (0.41, not 41 %). Every path parameter accepts ``"sample:"`` for the capture bundled with
kvtool. Errors are :class:`~kvtool.core.errors.UsageError` / :class:`~kvtool.core.errors.BadDataError`
with messages that name Python parameters (``heldout=64``), not command-line flags.

>>> import kvtool
>>> r = kvtool.compress("sample:", "bitmap:sparsity=0.7", "cap.bitmap.safetensors")
>>> r.storage_ratio                      # 0.41: compressed bytes / dense bytes
>>> kvtool.verify(r.output, use_model=False).rel_l2
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from kvtool.core.errors import KvtoolError
from kvtool.core.jsonio import envelope
from kvtool.core.names import canonical_dtype
from kvtool.core.outputs import output_beside
from kvtool.core.progress import Progress
from kvtool.core.sample import SAMPLE_PATH, resolve_sample

if TYPE_CHECKING:
    from kvtool.core.cache import KVCache

PathLike = str | Path
F = TypeVar("F", bound=Callable[..., Any])

# `--heldout 64` -> `heldout=64`, `pass --truncate` -> `pass truncate=True`, `--no-model` -> `use_model=False`
_FLAG = re.compile(r"(pass )?--([a-z][a-z0-9-]*)( (?=[0-9'\"-]))?")
_SPECIAL = {"force": "force=True", "no-model": "use_model=False", "no-queries": "queries=False"}


def python_message(message: str) -> str:
    """A library message with its command-line flags named as this API's parameters."""

    def swap(m: re.Match) -> str:
        advice, name, value = m.group(1) or "", m.group(2), m.group(3)
        if value:
            return f"{advice}{name.replace('-', '_')}="
        if name in _SPECIAL:
            return advice + _SPECIAL[name]
        return advice + name.replace("-", "_") + ("=True" if advice else "")

    return _FLAG.sub(swap, message.replace("without --no-queries", "with queries=True"))


def _python_errors(fn: F) -> F:
    """Re-raise the library's KvtoolError with :func:`python_message`'s wording (same type)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KvtoolError as exc:
            new = type(exc).__new__(type(exc))  # same type (and exit code); some types build their message in __init__
            Exception.__init__(new, python_message(str(exc)))
            raise new from None

    return wrapper  # type: ignore[return-value]


def _path(p: PathLike) -> Path:
    return Path(resolve_sample(p))


def sample_path() -> Path:
    """The capture bundled with kvtool (also reachable as ``"sample:"`` in every path parameter)."""
    return SAMPLE_PATH


@dataclass(frozen=True)
class Result:
    """What every API function returns: ``report`` is the library's report; ``to_dict()`` the JSON
    object the matching command prints with ``--json``."""

    command: str
    report: dict[str, Any] = field(repr=False)
    input: str | None = None
    inputs: tuple[str, ...] | None = None
    output: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return envelope(self.command, self.report, input=self.input, inputs=self.inputs, output=self.output)


@dataclass(frozen=True)
class CaptureResult(Result):
    """``capture(..., output=...)``: the file written and its shape."""

    tokens: int = 0
    layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class CompressResult(Result):
    """``storage_ratio``: compressed bytes / dense bytes of the compressed tokens (a fraction)."""

    format: str = ""
    storage_ratio: float = 0.0
    compressed_bytes: int = 0
    dense_bytes: int = 0


@dataclass(frozen=True)
class DecompressResult(Result):
    format: str = ""
    tokens: int = 0


@dataclass(frozen=True)
class VerifyResult(Result):
    """Attention error over every held-out query (``rel_l2``, ``cosine``), attention-mass ``recall``,
    and with the model ``nll_increase`` (nats/token) and top-1 ``agreement`` (a fraction)."""

    rel_l2: float = 0.0
    cosine: float = 0.0
    recall: float | None = None
    storage_ratio: float = 0.0
    nll_increase: float | None = None
    agreement: float | None = None


@dataclass(frozen=True)
class EvalResult(Result):
    """One row per swept point in ``points``; ``files``: eval.json, eval.csv and the plot."""

    points: tuple[dict[str, Any], ...] = ()
    files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportResult(Result):
    target: str = ""


@dataclass(frozen=True)
class StatsResult(Result):
    """``rows``: one dict per (layer, KV head), as ``kvtool stats`` tables them."""

    rows: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class PruneResult(Result):
    achieved_key_sparsity: float = 0.0
    achieved_value_sparsity: float = 0.0


@dataclass(frozen=True)
class InfoResult(Result):
    schema: str = ""
    tensor_bytes: int = 0
    file_bytes: int = 0


# --------------------------------------------------------------------------- functions


@_python_errors
def load(path: PathLike, layers: Sequence[int] | None = None, parts: tuple[str, ...] = ("keys", "values", "queries", "hidden")) -> "KVCache":
    """Read a capture file into a :class:`~kvtool.core.cache.KVCache` (``"sample:"`` for the bundled one);
    keys/values ``[batch, kv_heads, tokens, head_dim]``. ``layers``: only those model layers;
    ``parts``: only some of keys, values, queries, hidden (keys and values are always read)."""
    from kvtool.core import io  # deferred: start-up time (torch)

    return io.load(_path(path), layers=list(layers) if layers is not None else None, parts=tuple(parts))


@_python_errors
def save(cache: "KVCache", path: PathLike, force: bool = False) -> Path:
    """Write ``cache`` as a capture file (atomically; an existing file only with ``force=True``)."""
    from kvtool.core import io  # deferred: start-up time (torch)

    return io.save(cache, Path(path), force=force)


@_python_errors
def capture(
    prompt: str | list[str] | None = None,
    model: Any = None,
    *,
    output: PathLike | None = None,
    layers: str | Sequence[int] | None = None,
    queries: bool = True,
    hidden: bool = False,
    generate: int = 0,
    chat: bool = False,
    max_tokens: int | None = None,
    truncate: bool = False,
    align: str = "truncate",
    dtype: str | None = None,
    device: str = "cpu",
    device_map: str | None = None,
    cache_dir: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
    **kwargs: Any,
) -> "KVCache":
    """Run a model on a prompt and return its KV cache (``kvtool capture``).

    ``prompt``: text, or a list of texts for a batch (default: the built-in ~1,000-token text);
    ``model``: None/"embedded" (SmolLM2-135M shipped with kvtool), a local HF folder, a ``.gguf``
    file or a loaded ``(model, tokenizer)``; ``dtype``: float16/fp16, bfloat16/bf16, float32/fp32.
    With ``output`` the cache is also saved there. Keys/values are ``[batch, kv_heads, tokens,
    head_dim]`` after RoPE, queries ``[batch, heads, tokens, head_dim]``. Other keyword arguments
    (e.g. ``input_ids``) go to :func:`kvtool.hf.capture.capture`.
    """
    from kvtool.core import io  # deferred: start-up time (torch)
    from kvtool.hf.capture import capture as run_capture  # deferred: transformers loads only when a capture is asked for
    from kvtool.hf.prompts import DEFAULT_PROMPT  # deferred: start-up time

    if output is not None:
        io.check_output(Path(output), force)
    callback = None
    if progress is not None:
        state = {"stage": None, "done": 0}

        def callback(stage: str, done: int, total: int) -> None:
            if stage != state["stage"]:
                state.update(stage=stage, done=0)
                progress.stage(stage, total)
            if done > state["done"]:
                progress.advance(done - state["done"])
                state["done"] = done

    cache = run_capture(
        DEFAULT_PROMPT if prompt is None and "input_ids" not in kwargs else prompt, model=model, layers=layers, queries=queries,
        hidden=hidden, generate=generate, chat=chat, max_tokens=max_tokens, truncate=truncate, align=align,
        dtype=canonical_dtype(dtype), device=device, device_map=device_map, cache_dir=cache_dir, progress=callback, **kwargs,
    )
    if output is not None:
        io.save(cache, Path(output), force=force)
    return cache


@_python_errors
def compress(
    capture: PathLike,
    format: str = "dense",
    output: PathLike | None = None,
    *,
    params: dict[str, Any] | None = None,
    heldout: int = 64,
    layers: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> CompressResult:
    """Compress a capture file with one format and write the compressed file (``kvtool compress``).

    ``format``: ``NAME[:key=value,...]`` or a chain (``snapkv:budget=256+per-token:k=0.5,v=0.7+quant:bits=4``);
    ``params``: more format parameters by name (``{"sparsity": 0.7}``, ``{"evict": "snapkv:budget=256"}``);
    ``heldout``: last tokens kept dense (their queries are what :func:`verify` scores); ``output``
    defaults to ``CAPTURE.FORMAT.safetensors`` next to the capture.
    """
    from kvtool.formats.files import compress_file  # deferred: start-up time (torch)

    src = _path(capture)
    _, path, report = compress_file(src, format, Path(output) if output is not None else None, dict(params or {}), heldout, layers, force, progress=progress)
    return CompressResult("compress", report, input=str(src), output=str(path), format=report["format"], storage_ratio=report["ratio"],
                          compressed_bytes=report["compressed_bytes"], dense_bytes=report["dense_bytes"])


@_python_errors
def decompress(compressed: PathLike, output: PathLike | None = None, *, force: bool = False) -> DecompressResult:
    """Decode a compressed file back to a capture-schema file (``kvtool decompress``)."""
    from kvtool.core import io  # deferred: start-up time (torch)
    from kvtool.formats.base import load_compressed  # deferred: start-up time (torch)
    from kvtool.formats.files import decompress_cache  # deferred: start-up time (torch)

    src = _path(compressed)
    cc = load_compressed(src)
    out = Path(output) if output is not None else io.output_beside(src, f"{src.stem}.dense.safetensors")
    io.check_output(out, force, inputs=(src,))
    cache = decompress_cache(cc)
    cache.info = {"decompressed_from": str(src), "format": cc.format, "params": cc.params, **{k: v for k, v in cc.info.items() if k != "source_info"}}
    path = io.save(cache, out, force=force)
    report = {"format": cc.format, "tokens": cache.num_tokens, "layers": cache.layer_indices}
    return DecompressResult("decompress", report, input=str(src), output=str(path), format=cc.format, tokens=cache.num_tokens)


@_python_errors
def verify(
    compressed: PathLike,
    capture: PathLike | None = None,
    *,
    heldout: int | None = None,
    backend: str = "auto",
    model: str | None = None,
    use_model: bool = True,
    generate: int = 16,
    progress: Progress | None = None,
) -> VerifyResult:
    """Score a compressed file against its source capture (``kvtool verify``): attention-output error
    and recall on the held-out queries, and with ``use_model`` the model's NLL increase and top-1
    agreement on the continuation. ``capture`` defaults to the one the file records."""
    from kvtool.analysis.verify import verify_file  # deferred: start-up time (torch)

    src = _path(compressed)
    report = verify_file(src, _path(capture) if capture is not None else None, heldout, backend, model, use_model, generate, progress=progress)
    att, mdl = report["attention"], report.get("model")
    return VerifyResult("verify", report, input=str(src), rel_l2=att["overall"]["rel_l2"], cosine=att["overall"]["cosine"],
                        recall=(att.get("recall") or {}).get("recall"), storage_ratio=att["storage_ratio"],
                        nll_increase=mdl["nll_increase"] if mdl else None, agreement=mdl["agreement"] if mdl else None)


@_python_errors
def evaluate(
    captures: PathLike | Sequence[PathLike],
    formats: Sequence[str] = (),
    out_dir: PathLike | None = None,
    *,
    paper: bool | None = None,
    heldout: int = 64,
    backend: str = "auto",
    model: str | None = None,
    use_model: bool = True,
    generate: int = 0,
    metric: str | None = None,
    x: str = "storage",
    layers: str | None = None,
    recompute: bool = False,
    progress: Progress | None = None,
) -> EvalResult:
    """Sweep formats and parameters over captures (``kvtool eval``); writes eval.json, eval.csv and the
    frontier plot into ``out_dir`` (default ``CAPTURE.eval`` next to the first capture) and resumes
    finished points unless ``recompute``. ``formats``: sweep specs ``NAME[:key=v1,v2,...]``; without
    any, every registered format with default values plus the papers' comparison rows."""
    from kvtool.analysis.evaluate import run_eval  # deferred: start-up time (torch)

    items = [captures] if isinstance(captures, (str, Path)) else list(captures)
    paths = [_path(c) for c in items]
    if out_dir is None:
        first = paths[0]
        out_dir = output_beside(first, f"{first.stem}.eval")
    specs = list(formats)
    use_paper = (not specs) if paper is None else paper
    result = run_eval(paths, specs, Path(out_dir), use_paper, heldout, backend, model, use_model, generate, metric, x, recompute,
                      progress=progress, layers=layers)
    report = {"files": result["files"], "resumed": result["resumed"], "metric": result["metric"], "x": result["x"], "points": result["rows"]}
    return EvalResult("eval", report, inputs=tuple(str(p) for p in paths), output=str(out_dir), points=tuple(result["rows"]), files=dict(result["files"]))


@_python_errors
def export(source: PathLike, to: str, output: PathLike | None = None, *, page_size: int = 16, layout: str = "NHD", force: bool = False) -> ExportResult:
    """Export a kvtool file (``kvtool export``): ``to`` is hf, paged, npz, dense, csv or json."""
    from kvtool.export.convert import export_file  # deferred: start-up time (torch)

    src = _path(source)
    report = export_file(src, to.lower(), Path(output) if output is not None else None, page_size=page_size, layout=layout, force=force)
    return ExportResult("export", report, input=str(src), output=report.get("output"), target=report["to"])


@_python_errors
def stats(
    capture: PathLike,
    *,
    layers: str | None = None,
    heads: str | None = None,
    sort: str | None = None,
    top: int | None = None,
    outlier_factor: float = 4.0,
    queries: int = 64,
    sink: int = 4,
    attention: bool | None = None,
    progress: Progress | None = None,
) -> StatsResult:
    """Statistics of a capture per layer and KV head (``kvtool stats``)."""
    from kvtool.analysis.file_drivers import stats_file  # deferred: start-up time (torch)
    from kvtool.analysis.stats import StatsSettings  # deferred: start-up time (torch)

    src = _path(capture)
    settings = StatsSettings(outlier_factor=outlier_factor, max_queries=queries, sink_tokens=sink)
    report = stats_file(src, layers, heads, settings, attention, sort, top, progress=progress)
    return StatsResult("stats", report, input=str(src), rows=tuple(report["rows"]))


@_python_errors
def prune(
    capture: PathLike,
    output: PathLike | None = None,
    *,
    sparsity: float = 0.7,
    key_sparsity: float | None = None,
    value_sparsity: float | None = None,
    method: str = "per-token",
    dense_window: int = 32,
    layers: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> PruneResult:
    """Prune keys and values to a target sparsity and write the pruned capture (``kvtool prune``);
    the last ``dense_window`` tokens are never pruned."""
    from kvtool.methods.prune import prune_file  # deferred: start-up time (torch)

    src = _path(capture)
    report = prune_file(src, Path(output) if output is not None else None, sparsity, key_sparsity, value_sparsity, method, dense_window, layers, force,
                        progress=progress)
    return PruneResult("prune", report, input=str(src), output=report.get("output"), achieved_key_sparsity=report["achieved_key_sparsity"],
                       achieved_value_sparsity=report["achieved_value_sparsity"])


@_python_errors
def info(path: PathLike) -> InfoResult:
    """What a kvtool file holds (``kvtool info``): schema, metadata, tensors and bytes."""
    from kvtool.formats.files import file_info  # deferred: start-up time (torch)

    src = _path(path)
    data = file_info(src)
    version = data.get("schema_version")
    report = {**data, "schema_version": int(version) if str(version).isdigit() else version}
    return InfoResult("info", report, input=str(src), schema=data["schema"], tensor_bytes=data["tensor_bytes"], file_bytes=data["file_bytes"])


@_python_errors
def to_hf_cache(path: PathLike, model: Any, mode: str = "auto", hold_last: bool = False) -> Any:
    """A transformers cache (``model.generate(..., cache=cache)``, ``past_key_values=`` on older
    transformers) from a kvtool file; see :func:`kvtool.hf.cache.to_hf_cache`."""
    from kvtool.hf.cache import to_hf_cache as _to_hf_cache  # deferred: transformers loads only when asked for

    return _to_hf_cache(_path(path), model, mode=mode, hold_last=hold_last)
