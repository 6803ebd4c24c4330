"""The Python API: one function per CLI command, built from the command's own declaration.

Each command is declared once in :mod:`kvtool.commands` (see :mod:`kvtool.commands._command`);
:func:`from_command` turns that declaration into a Python function with the same parameter names
and defaults (Typer arguments are positional, options keyword-only), a ``progress=`` parameter, and
a docstring made of the command's help and its options' help. It runs the same body as the CLI and
returns a frozen :class:`Result` (typed fields for the numbers people look at, the whole report in
``report``, ``to_dict()`` equal to ``kvtool COMMAND --json``). Nothing here repeats a signature by
hand; ``tests/test_api.py`` checks every command has its function.

A few functions are not commands (``load``, ``save``, ``sample_path``, ``to_hf_cache``) or work on
objects the CLI cannot pass (``capture`` returns the :class:`~kvtool.core.cache.KVCache`); they are
written here, and the test checks that ``capture`` takes every option of ``kvtool capture``.

``progress``: ``"auto"`` (default: a bar in a terminal, plain lines with rate and time left on
stderr elsewhere), ``False``/``None`` for silence, a callable ``fn(stage, done, total)``, or a
:class:`kvtool.core.progress.Progress`. Every path parameter accepts ``"sample:"`` for the capture
bundled with kvtool. Errors are :class:`~kvtool.core.errors.UsageError` /
:class:`~kvtool.core.errors.BadDataError` with messages that name Python parameters (``heldout=64``),
not command-line flags.

>>> import kvtool
>>> r = kvtool.compress("sample:", "bitmap:sparsity=0.7", "cap.bitmap.safetensors")
>>> r.storage_ratio                      # compressed bytes / dense bytes, a fraction
>>> kvtool.verify(r.output, model=False).rel_l2
"""

from __future__ import annotations

import functools
import inspect
import re
import tempfile
import typing
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

from kvtool.commands import about, compress as compress_cmd, eval as eval_cmd, export as export_cmd, generate as generate_cmd
from kvtool.commands import heads as heads_cmd, info as info_cmd, plot as plot_cmd, prune as prune_cmd
from kvtool.commands import recommend as recommend_cmd, report as report_cmd, stats as stats_cmd, verify as verify_cmd
from kvtool.commands import tasks as tasks_cmd
from kvtool.commands._command import Outcome, declared_parameters, parameter_meta, spec_of
from kvtool.commands._common import declare_files
from kvtool.core import outputs
from kvtool.core.errors import KvtoolError, UsageError
from kvtool.core.jsonio import envelope
from kvtool.core.names import RENAMED_KEYS, canonical_dtype
from kvtool.core.progress import Progress, make_sink, stage_callback
from kvtool.core.sample import SAMPLE_PATH, resolve_sample

if TYPE_CHECKING:
    from kvtool.core.cache import KVCache

PathLike = str | Path
F = TypeVar("F", bound=Callable[..., Any])
ProgressArg = Progress | Callable[[str, int, "int | None"], Any] | bool | str | None

# `--heldout 64` -> `heldout=64`, `pass --truncate` -> `pass truncate=True`, `--no-model` -> `model=False`
_FLAG = re.compile(r"(pass )?--([a-z][a-z0-9-]*)( (?=[0-9'\"-]))?")
_SPECIAL = {"force": "force=True", "no-model": "model=False", "no-queries": "queries=False"}
# keyword arguments of earlier releases: old name -> (new name, value converter)
LEGACY = {"use_model": ("model", lambda v: None if v else False), "recompute": ("force", bool)}


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


# --------------------------------------------------------------------------- results


def _at(key: str, default: Any = None) -> Any:
    """A typed result field filled from the JSON object at dotted ``key`` (None where absent)."""
    return field(default=default, metadata={"key": key})


def _dig(data: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


@dataclass(frozen=True)
class Result:
    """What every command's function returns: ``report`` is the command's result (the ``--json``
    object's own keys); ``to_dict()`` the JSON object ``kvtool COMMAND --json`` prints; ``r["key"]``
    reads ``report``. Subclasses add typed fields read from the same object."""

    command: str
    report: dict[str, Any] = field(repr=False)
    input: str | None = None
    inputs: tuple[str, ...] | None = None
    output: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return envelope(self.command, self.report, input=self.input, inputs=self.inputs, output=self.output)

    def __getitem__(self, key: str) -> Any:
        if key not in self.report and key in RENAMED_KEYS:  # a key of an earlier version: its new name, with a warning
            warnings.warn(f"result key {key!r} is now {RENAMED_KEYS[key]!r}", FutureWarning, stacklevel=2)
            key = RENAMED_KEYS[key]
        return self.report[key]

    @classmethod
    def of(cls, command: str, outcome: Outcome) -> "Result":
        own = {f.name: _freeze(_dig(outcome.data, f.metadata.get("key", f.name))) for f in fields(cls) if f.name not in _BASE}
        own = {k: v for k, v in own.items() if v is not None}
        return cls(command, outcome.data, input=None if outcome.input is None else str(outcome.input),
                   inputs=None if outcome.inputs is None else tuple(str(p) for p in outcome.inputs),
                   output=None if outcome.output is None else str(outcome.output), **own)


_BASE = {"command", "report", "input", "inputs", "output"}


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class CompressResult(Result):
    """``storage_ratio``: ``stored_bytes`` / ``dense_bytes`` of the compressed tokens (a fraction).
    ``compressed``: the in-memory :class:`~kvtool.formats.base.CompressedCache` when a
    :class:`~kvtool.core.cache.KVCache` was compressed (None for files)."""

    format: str = ""
    storage_ratio: float = 0.0
    stored_bytes: int = 0
    dense_bytes: int = 0
    compressed: Any = field(default=None, repr=False, compare=False)

    @property
    def compressed_bytes(self) -> int:
        """Deprecated name of :attr:`stored_bytes` (read until the next version)."""
        warnings.warn("CompressResult.compressed_bytes is now stored_bytes", FutureWarning, stacklevel=2)
        return self.stored_bytes


@dataclass(frozen=True)
class DecompressResult(Result):
    format: str = ""
    tokens: int = 0


@dataclass(frozen=True)
class VerifyResult(Result):
    """Attention error over every held-out query (``rel_l2``, ``cosine``), attention-mass ``recall``,
    and with the model ``nll_increase`` (nats/token) and top-1 ``agreement`` (a fraction);
    ``passed``: every threshold given was met."""

    rel_l2: float = _at("attention.overall.rel_l2", 0.0)
    cosine: float = _at("attention.overall.cosine", 0.0)
    recall: float | None = _at("attention.recall.recall")
    storage_ratio: float = _at("attention.storage_ratio", 0.0)
    nll_increase: float | None = _at("model_fidelity.nll_increase")
    agreement: float | None = _at("model_fidelity.agreement")
    passed: bool = _at("thresholds.passed", True)


@dataclass(frozen=True)
class EvalResult(Result):
    """One row per swept point in ``points``; ``files``: eval.json, eval.csv and the plot."""

    points: tuple[dict[str, Any], ...] = ()
    files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportResult(Result):
    """``to``: the layout written (``--to``)."""

    to: str = ""

    @property
    def target(self) -> str:
        """Deprecated name of :attr:`to` (read until the next version)."""
        warnings.warn("ExportResult.target is now to", FutureWarning, stacklevel=2)
        return self.to


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


@dataclass(frozen=True)
class PlotResult(Result):
    """``files``: one dict per figure written (kind, layer, head, part, path); ``index``: index.html."""

    files: tuple[dict[str, Any], ...] = ()
    index: str | None = None


@dataclass(frozen=True)
class HeadsResult(Result):
    """``curve``: the oracle's error per number of heads computed; ``k``: heads per token compared."""

    k: int = 0
    curve: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class RecommendResult(Result):
    """``budgets``: one entry per budget with its plan (as JSON) and ``plan_file``."""

    budgets: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ReportResult(Result):
    figures: int = 0


@dataclass(frozen=True)
class GenerateResult(Result):
    """``text``: the generated text of each sequence of the batch."""

    text: tuple[str, ...] = ()


# --------------------------------------------------------------------------- functions from the declarations


def _is_path(annotation: Any) -> bool:
    return annotation is Path or Path in typing.get_args(annotation)


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list or any(typing.get_origin(a) is list for a in typing.get_args(annotation))


def _coerce(annotation: Any, value: Any) -> Any:
    """An API value as the declaration takes it: a single item where a list is declared becomes a
    one-item list; a string where a path is declared becomes a path (``sample:`` resolved)."""
    if value is None:
        return None
    if _is_list(annotation):
        items = [value] if isinstance(value, (str, Path)) else list(value)
        inner = next((a for a in typing.get_args(annotation) if typing.get_origin(a) is list), annotation)
        return [_coerce(typing.get_args(inner)[0] if typing.get_args(inner) else Any, v) for v in items]
    if _is_path(annotation) and isinstance(value, (str, Path)):
        return Path(resolve_sample(value))
    return value


def _api_type(base: Any, capture: bool = False) -> Any:
    """The annotation a declared type has in Python: a path is ``str | Path`` (``"sample:"`` too); a
    ``capture`` also takes a :class:`kvtool.KVCache`."""
    if base is Path:
        return "str | Path | kvtool.KVCache" if capture else PathLike
    args = typing.get_args(base)
    if not args or not any(_is_path(a) or a is Path for a in args):
        return base
    swapped = tuple(_api_type(a) for a in args)
    return list[swapped[0]] if typing.get_origin(base) is list else typing.Union[swapped]


def api_signature(fn: Callable[..., Outcome]) -> tuple[inspect.Signature, dict[str, Any], dict[str, Any]]:
    """The Python signature of a declared command (arguments positional, options keyword-only unless
    marked ``Api(positional=True)``, hidden and ``Api(skip=True)`` parameters left out, ``progress``
    added), the declared annotations by name, and the left-out parameters' defaults."""
    positional, keyword, skipped, types = [], [], {}, {}
    for p in declared_parameters(fn):
        base, info, api = parameter_meta(p.annotation)
        types[p.name] = base
        if api.skip or getattr(info, "hidden", False):
            skipped[p.name] = p.default
            continue
        is_arg = type(info).__name__ == "ArgumentInfo"
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if is_arg or api.positional else inspect.Parameter.KEYWORD_ONLY
        param = inspect.Parameter(p.name, kind, default=p.default, annotation=api.type if api.type is not None else _api_type(base, p.name == "capture"))
        (positional if kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else keyword).append(param)
    keyword.append(inspect.Parameter("progress", inspect.Parameter.KEYWORD_ONLY, default="auto", annotation=ProgressArg))
    return inspect.Signature(positional + keyword), types, skipped


def api_doc(fn: Callable[..., Outcome], signature: inspect.Signature) -> str:
    """A docstring from the declaration: the command's help, then each parameter with its option's
    help text and default."""
    spec = spec_of(fn)
    helps = {p.name: getattr(parameter_meta(p.annotation)[1], "help", None) for p in declared_parameters(fn)}
    lines = [f"``kvtool {spec.name}`` from Python. " + spec.help_text().replace("\n\n", "\n"), "", "Parameters:"]
    for name, p in signature.parameters.items():
        if name == "progress":
            text = "'auto' (a bar in a terminal, lines on stderr elsewhere), False, a callable (stage, done, total) or a Progress"
        else:
            text = python_message((helps.get(name) or "").replace("\\[", "["))
        default = "" if p.default is inspect.Parameter.empty else f" (default {p.default!r})"
        lines.append(f"    {name}: {text}{default}")
    return "\n".join(lines)


# Objects in place of files. A command whose function is given an object where its declaration
# takes a path either has a handler here (``OBJECT_HANDLERS[command](**arguments, progress=sink)``
# returns its Result; kvtool.compress on an in-memory cache is one), or, for a KVCache, runs on a
# temporary capture file of it (commands that only read the capture). Commands that would write
# their output beside the input need ``output=`` then: there is no folder beside a cache in memory.
OBJECT_HANDLERS: dict[str, Callable[..., Result]] = {}
WRITES_BESIDE_INPUT = {"prune": "output", "decompress": "output", "export": "output", "eval": "out_dir", "compress": "output"}


def _objects(values: dict[str, Any], types: dict[str, Any]) -> dict[str, Any]:
    """The arguments that are objects where the declaration takes a path (or a list of paths)."""
    found = {}
    for k, v in values.items():
        if v is None or not (_is_path(types[k]) or (_is_list(types[k]) and k in ("captures",))):
            continue
        items = v if isinstance(v, (list, tuple)) else [v]
        if any(not isinstance(i, (str, Path)) for i in items):
            found[k] = v
    return found


@contextmanager
def _as_files(command: str, objects: dict[str, Any], values: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Each KVCache in ``objects`` saved as a capture in a temporary folder, its path in its place;
    the folder is removed afterwards. Any other object is a TypeError naming what is accepted."""
    from kvtool.core.cache import KVCache  # deferred: start-up time (torch)
    from kvtool.core import io  # deferred: start-up time (torch)

    beside = WRITES_BESIDE_INPUT.get(command)
    if beside and values.get(beside) is None:
        raise UsageError(f"kvtool.{command}: give {beside}=... (the capture is a cache in memory: there is no folder to write beside it)")
    with tempfile.TemporaryDirectory(prefix="kvtool-") as folder:
        paths: dict[str, Any] = {}
        for n, (key, value) in enumerate(objects.items()):
            items = value if isinstance(value, (list, tuple)) else [value]
            saved = []
            for m, item in enumerate(items):
                if isinstance(item, (str, Path)):
                    saved.append(item)
                elif isinstance(item, KVCache):
                    saved.append(io.save(item, Path(folder) / f"{key}-{n}-{m}.safetensors"))
                else:
                    raise TypeError(f"kvtool.{command}({key}=...): a path, 'sample:' or a kvtool.KVCache, not {type(item).__name__}")
            paths[key] = saved if isinstance(value, (list, tuple)) else saved[0]
        yield paths


def from_command(fn: Callable[..., Outcome], result: type[Result] = Result) -> Callable[..., Result]:
    """The Python function of a declared command (see the module docstring)."""
    spec = spec_of(fn)
    signature, types, skipped = api_signature(fn)

    def api_function(*args: Any, **kwargs: Any) -> Result:
        for old in [k for k in kwargs if k in LEGACY and k not in signature.parameters]:
            new, convert = LEGACY[old]
            warnings.warn(f"kvtool.{spec.api_name}({old}=...) is now {new}=...", DeprecationWarning, stacklevel=3)
            kwargs[new] = convert(kwargs.pop(old))
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        sink = make_sink(values.pop("progress"), spec.name)
        objects = _objects(values, types)
        try:
            if objects and spec.name in OBJECT_HANDLERS:
                res = OBJECT_HANDLERS[spec.name](**values, progress=sink)
            else:
                with _as_files(spec.name, objects, values) as paths:
                    call = {**skipped, **{k: _coerce(types[k], paths.get(k, v)) for k, v in values.items()}}
                    with outputs.command_inputs():  # as the CLI: no output may be one of the inputs
                        outcome = fn(**declare_files(call), progress=sink)
                res = result.of(spec.name, outcome)
                if objects:  # the input was a cache in memory, not a file anyone can open
                    res = replace(res, input="<memory>", inputs=None if res.inputs is None else tuple(p if not p.startswith(tempfile.gettempdir()) else "<memory>" for p in res.inputs))
        except BaseException:
            sink.close(failed=True)
            raise
        sink.close()
        return res

    api_function.__name__ = api_function.__qualname__ = spec.api_name or fn.__name__
    api_function.__module__ = __name__
    api_function.__signature__ = signature.replace(return_annotation=result)  # type: ignore[attr-defined]
    api_function.__doc__ = api_doc(fn, signature)
    api_function.command = spec.name  # type: ignore[attr-defined]
    return _python_errors(api_function)


info = from_command(info_cmd.info, InfoResult)
stats = from_command(stats_cmd.stats, StatsResult)
plot = from_command(plot_cmd.plot, PlotResult)
prune = from_command(prune_cmd.prune, PruneResult)
compress = from_command(compress_cmd.compress, CompressResult)
decompress = from_command(compress_cmd.decompress, DecompressResult)
heads = from_command(heads_cmd.heads, HeadsResult)
verify = from_command(verify_cmd.verify, VerifyResult)
recommend = from_command(recommend_cmd.recommend, RecommendResult)
evaluate = from_command(eval_cmd.eval_cmd, EvalResult)
report = from_command(report_cmd.report, ReportResult)
export = from_command(export_cmd.export, ExportResult)
generate = from_command(generate_cmd.generate, GenerateResult)
env = from_command(about.env)
version = from_command(about.version)
tasks = from_command(tasks_cmd.tasks_cmd)

# the command each function above stands for; tests/test_api.py checks every command has one
COMMAND_FUNCTIONS = {f.command: f for f in (info, stats, plot, prune, compress, decompress, heads, verify, recommend, evaluate, report,
                                             export, generate, env, version, tasks)}


# --------------------------------------------------------------------------- functions written here


@_python_errors
def load(path: PathLike, layers: Sequence[int] | None = None, parts: tuple[str, ...] = ("keys", "values", "queries", "hidden")) -> "KVCache":
    """Read a capture file into a :class:`~kvtool.core.cache.KVCache` (``"sample:"`` for the bundled one);
    keys/values ``[batch, kv_heads, tokens, head_dim]``. ``layers``: only those model layers;
    ``parts``: only some of keys, values, queries, hidden (keys and values are always read)."""
    from kvtool.core import io  # deferred: start-up time (torch)
    from kvtool.core.errors import BadDataError, UsageError  # deferred: start-up time

    p = _path(path)
    try:
        return io.load(p, layers=list(layers) if layers is not None else None, parts=tuple(parts))
    except BadDataError as exc:
        if f"is a {io.COMPRESSED_SCHEMA} file" not in str(exc):
            raise
        raise UsageError(f"{p} is a compressed file: load reads captures; continue from it with kvtool.to_hf_cache(path, model) and "
                         "kvtool.continuation_ids(path, new_ids), or decode it with kvtool.decompress") from None


@_python_errors
def save(cache: "KVCache", path: PathLike, force: bool = False) -> Path:
    """Write ``cache`` as a capture file (atomically; an existing file only with ``force=True``)."""
    from kvtool.core import io  # deferred: start-up time (torch)

    return io.save(cache, Path(path), force=force)


# options of `kvtool capture` that capture() takes in another form: the prompt text(s) themselves
CAPTURE_CLI_ONLY = ("prompt_file", "batch")


@_python_errors
def capture(
    prompt: str | list[str] | None = None,
    model: Any = None,
    *,
    output: PathLike | None = None,
    random_tokens: int | None = None,
    layers: str | Sequence[int] | None = None,
    queries: bool = True,
    query_layers: str | None = None,
    hidden: bool = False,
    generate: int = 0,
    chat: bool = False,
    max_tokens: int | None = None,
    truncate: bool = False,
    align: str = "truncate",
    chunk_size: int | None = None,
    dtype: str | None = None,
    device: str = "auto",
    device_map: str | None = None,
    cache_dir: str | None = None,
    force: bool = False,
    progress: ProgressArg = "auto",
    **kwargs: Any,
) -> "KVCache":
    """Run a model on a prompt and return its KV cache (``kvtool capture``).

    ``prompt``: text, or a list of texts for a batch (default: the built-in ~1,000-token text);
    ``model``: None/"embedded" (SmolLM2-135M shipped with kvtool), a local HF folder, a ``.gguf``
    file, ``random:SHAPE`` (seeded random weights; give ``random_tokens``) or a loaded ``(model, tokenizer)``; ``dtype``: float16/fp16, bfloat16/bf16, float32/fp32.
    With ``output`` the cache is also saved there. Keys/values are ``[batch, kv_heads, tokens,
    head_dim]`` after RoPE, queries ``[batch, heads, tokens, head_dim]``. Other keyword arguments
    (e.g. ``input_ids``) go to :func:`kvtool.hf.capture.capture`.
    """
    from kvtool.core import io  # deferred: start-up time (torch)

    with outputs.command_inputs():  # as the CLI: the output is never one of the model's files
        if isinstance(model, (str, Path)):
            outputs.note_input(model, folder=True)
        if output is not None:
            io.check_output(Path(output), force)
        return _capture(prompt, model, output, random_tokens, layers, queries, query_layers, hidden, generate, chat, max_tokens, truncate,
                        align, chunk_size, dtype, device, device_map, cache_dir, force, progress, kwargs)


def _capture(prompt: Any, model: Any, output: Any, random_tokens: Any, layers: Any, queries: bool, query_layers: Any, hidden: bool,
             generate: int, chat: bool, max_tokens: Any, truncate: bool, align: str, chunk_size: Any, dtype: Any, device: str,
             device_map: Any, cache_dir: Any, force: bool, progress: Any, kwargs: dict[str, Any]) -> "KVCache":
    """The body of :func:`capture` (inside its inputs scope)."""
    from kvtool.core import io  # deferred: start-up time (torch)
    from kvtool.hf.capture import capture as run_capture  # deferred: transformers loads only when a capture is asked for
    from kvtool.hf.prompts import DEFAULT_PROMPT  # deferred: start-up time

    sink = make_sink(progress, "capture")
    try:
        cache = run_capture(
            DEFAULT_PROMPT if prompt is None and "input_ids" not in kwargs and random_tokens is None else prompt, model=model, layers=layers, queries=queries,
            query_layers=query_layers, hidden=hidden, generate=generate, chat=chat, max_tokens=max_tokens, truncate=truncate, align=align,
            chunk_size=chunk_size, random_tokens=random_tokens, dtype=canonical_dtype(dtype), device=device, device_map=device_map, cache_dir=cache_dir,
            progress=stage_callback(sink), **kwargs,
        )
        if output is not None:
            io.save(cache, Path(output), force=force)
    except BaseException:
        sink.close(failed=True)
        raise
    sink.close()
    return cache


@_python_errors
def to_hf_cache(path: PathLike, model: Any, mode: str = "auto", hold_last: bool = False) -> Any:
    """A transformers cache (``model.generate(..., cache=cache)``, ``past_key_values=`` on older
    transformers) from a kvtool file: a compressed file becomes a *live* cache (the format's
    encoded tensors on the model's device, attended through its kernel, growing the format's way),
    a capture a ``DynamicCache``; ``mode`` picks another way in (see
    :func:`kvtool.hf.cache.to_hf_cache`)."""
    from kvtool.core.errors import UsageError  # deferred: start-up time
    from kvtool.hf.cache import to_hf_cache as _to_hf_cache  # deferred: transformers loads only when asked for

    if model is None or not hasattr(model, "config"):
        raise UsageError(f"to_hf_cache: model must be the transformers model the cache is for (kvtool.load_model() gives one), not {type(model).__name__}")
    return _to_hf_cache(_path(path), model, mode=mode, hold_last=hold_last)


@_python_errors
def continuation_ids(path: PathLike, new_ids: Any) -> Any:
    """``[B, T + N]`` int64: the token ids ``model.generate`` takes with :func:`to_hf_cache`'s cache
    (the file's ``T`` cached tokens, then the ``N`` new ids, ``[N]`` or a list, the same for every
    row). A capture or a compressed file."""
    from kvtool.formats.files import read_kv_file  # deferred: start-up time (torch)
    from kvtool.hf.cache import continuation_ids as _continuation  # deferred: start-up time

    return _continuation(read_kv_file(_path(path)).token_ids, new_ids)


# --------------------------------------------------------------------------- live use (compression in a running model)


@_python_errors
def load_model(model: str | PathLike | None = None, *, device: str = "cpu", dtype: str | None = None, device_map: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` loaded offline, in eval mode: None / ``"embedded"`` (SmolLM2-135M
    shipped with kvtool), a local Hugging Face folder or a ``.gguf`` file (nothing is downloaded);
    ``dtype``: float16/fp16, bfloat16/bf16, float32/fp32 (default: the checkpoint's)."""
    import torch  # deferred: start-up time

    from kvtool.hf.models import check_dtype, load  # deferred: transformers loads only when asked for

    name = canonical_dtype(dtype)
    check_dtype(name)  # a name torch does not have is a UsageError naming dtype=, not an AttributeError
    mdl, tok, _ = load(None if model is None else str(model), device=device, device_map=device_map, torch_dtype=getattr(torch, name) if name else None)
    return mdl, tok


@_python_errors
def press(spec: Any, model: Any = None):
    """A context manager that compresses prompts' caches in place as a model fills them, then decodes
    through the live cache (kvpress-style)::

        model, tok = kvtool.load_model()
        with kvtool.press("bitmap:sparsity=0.7"):
            out = model.generate(ids, max_new_tokens=64)

    ``spec``: a format spec (chains included), a plan file (``plan.json``) or a typed press
    (:mod:`kvtool.presses`: ``Bitmap(sparsity=0.7)``, ``Plan("plan.json")``); ``model``: also switch
    that model's attention implementation to kvtool's explicitly (needed only for models that do not
    dispatch attention by name). Presses in several threads are independent; transformers' own
    attention functions come back when the last one exits. See :func:`kvtool.hf.live.press`."""
    from kvtool.hf.live import press as _press, resolve_layer_specs  # deferred: transformers loads only when asked for
    from kvtool.presses import spec_of  # deferred: start-up time

    spec = spec_of(spec)
    spec = _path(spec) if str(spec).endswith(".json") else spec
    resolve_layer_specs(spec)  # a bad spec or plan is refused here, naming this API's parameters, not when the block is entered
    return _press(spec, model)


@_python_errors
def answer(model: Any, tokenizer: Any, context: str, questions: Sequence[str] | str, press: Any = "dense", *, max_new_tokens: int = 32,
           chat: bool = False) -> list[str]:
    """Answers to ``questions`` about ``context``, kvpress-style: the context is prefilled once
    under ``press`` (a spec, plan file or :mod:`kvtool.presses` object) without any question, so its
    cache is compressed knowing nothing of them; each question then continues greedily from its own
    copy of the compressed cache (what ``kvtool tasks`` measures). ``chat``: wrap the context and
    question in the tokenizer's chat template (the question after the context, in one user turn).
    Returns one string per question."""
    import copy

    import torch  # deferred: start-up time

    from kvtool.core.errors import UsageError  # deferred: start-up time
    from kvtool.hf.interface import cache_kwargs  # deferred: transformers loads only when asked for

    if model is None or not hasattr(model, "generate"):
        raise UsageError("answer: model must be a transformers causal LM (kvtool.load_model() gives one)")
    if tokenizer is None:
        raise UsageError("answer: tokenizer is required (the context and questions are text)")
    qs = [questions] if isinstance(questions, str) else list(questions)
    if not qs or not str(context):
        raise UsageError("answer: give a context and at least one question")
    if chat:
        sep = "\u0000"
        whole = tokenizer.apply_chat_template([{"role": "user", "content": f"{context}\n\n{sep}"}], tokenize=False, add_generation_prompt=True)
        head, _, tail = whole.partition(sep)
        ctx_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        suffix = lambda q: tokenizer(q + tail, add_special_tokens=False)["input_ids"]  # noqa: E731
    else:
        ctx_ids = tokenizer(context)["input_ids"]
        suffix = lambda q: tokenizer(q, add_special_tokens=False)["input_ids"]  # noqa: E731
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([ctx_ids], device=device)
    from transformers import DynamicCache  # deferred: transformers loads only when asked for

    cache = DynamicCache(config=model.config)
    with _press_context(press), torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for q in qs:
        q_ids = torch.tensor([suffix(q)], device=device)
        if not q_ids.shape[1]:
            raise UsageError(f"answer: question {q!r} has no tokens")
        full = torch.cat([ids, q_ids], dim=1)
        with torch.no_grad():
            gen = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                                 top_p=None, top_k=None, pad_token_id=pad, **cache_kwargs(model, copy.deepcopy(cache)))
        out.append(tokenizer.decode(gen[0, full.shape[1]:], skip_special_tokens=True))
    return out


_press_context = press


_COMPRESS_OPTIONS = ("sparsity", "key_sparsity", "value_sparsity", "method", "dense_window", "bits", "group", "center", "sinks", "keep_top",
                     "page_size", "score", "budget", "budget_ratio", "lam", "recent", "window", "pool", "residual", "evict", "prune")


@_python_errors
def _compress_in_memory(cache: Any, format: str = "dense", output: PathLike | None = None, *, heldout: int | None = None, plan: PathLike | None = None,
                          param: Sequence[str] | None = None, force: bool = False, progress: Any = None, **options: Any) -> Any:
    """:func:`compress` of an in-memory cache. A :class:`~kvtool.core.cache.KVCache`: its first
    ``T - heldout`` tokens encoded as the command does a file (``format`` or ``plan``, the same format
    options; ``heldout`` None or 0, the default here: every token is encoded, so the bytes are the
    whole cache's; a capture *file* keeps the command's 64 held out for ``verify``); returns a
    :class:`CompressResult` whose ``compressed`` is the
    :class:`~kvtool.formats.base.CompressedCache`, written to ``output`` only when one is given. A
    transformers cache: compressed in place into a live cache (each dense layer in the format's
    encoded tensors on its device, attending through the format's kernel; ``heldout`` does not
    apply), which is returned for ``model.generate(ids, cache=cache)``; ``format`` may be a plan file."""
    from kvtool.core.cache import KVCache  # deferred: start-up time (torch)
    from kvtool.core.errors import UsageError  # deferred: start-up time

    if options.get("device") == "auto":  # the command's default: an in-memory cache stays where it is
        options.pop("device")
    unknown = sorted(k for k, v in options.items() if k not in _COMPRESS_OPTIONS and v is not None)
    if unknown:
        raise UsageError(f"compress of an in-memory cache takes no {unknown[0]}=")
    values = {k: v for k, v in options.items() if v is not None}
    for item in param or []:
        key, sep, value = str(item).partition("=")
        if not sep:
            raise UsageError(f"param {item!r} is not key=value")
        values[key.strip().replace("-", "_")] = value.strip()
    spec = str(plan if plan is not None else format)
    heldout = 0 if heldout is None else heldout
    if isinstance(cache, KVCache):
        from kvtool.formats.base import compress_cache, save_compressed  # deferred: start-up time (torch)
        from kvtool.formats.files import build_report  # deferred: start-up time (torch)
        from kvtool.formats.pipeline import resolve  # deferred: start-up time (torch)

        if plan is not None or spec.endswith(".json"):
            from kvtool.formats.plan import compress_plan, load_plan  # deferred: start-up time (torch)

            if values:
                raise UsageError("plan sets every layer's format; drop the format options")
            cc = compress_plan(cache, load_plan(_path(spec)), heldout=heldout)
        else:
            fmt, fparams, _ = resolve(spec, values)
            cc = compress_cache(cache, fmt, fparams, heldout=heldout)
        report = build_report(cc, cache)
        out = None
        if output is not None:
            out = str(save_compressed(cc, Path(output), force=force))
            report["output"] = out
        return CompressResult("compress", report, input="<memory>", output=out, format=report["format"], storage_ratio=report["storage_ratio"],
                              stored_bytes=report["stored_bytes"], dense_bytes=report["dense_bytes"], compressed=cc)
    if hasattr(cache, "layers") and hasattr(cache, "get_seq_length"):
        from kvtool.hf.live import compress_hf_cache  # deferred: transformers loads only when asked for

        if values or output is not None:
            raise UsageError("a transformers cache is compressed in place: give its format parameters inside the spec (bitmap:sparsity=0.7), no output")
        return compress_hf_cache(cache, _path(spec) if spec.endswith(".json") else spec)
    raise UsageError(f"compress takes a capture path, a kvtool KVCache or a transformers cache, not {type(cache).__name__}")


def _compress_handler(capture: Any, **values: Any) -> Any:
    """kvtool.compress's handler of objects (:data:`OBJECT_HANDLERS`): the declared arguments, in memory
    (an option it cannot apply there, such as ``layers=``, is refused by name)."""
    return _compress_in_memory(capture, **values)


OBJECT_HANDLERS["compress"] = _compress_handler
compress.__doc__ = (compress.__doc__ or "") + (
    "\n\n``capture`` may also be a cache in memory: a kvtool KVCache (its first ``T - heldout`` tokens encoded as the command "
    "encodes a file; the result's ``compressed`` holds the CompressedCache, written only with ``output=``) or a transformers "
    "cache (compressed in place into a live cache, which is returned; the format's parameters go inside the spec, no output).")
compress.__signature__ = compress.__signature__.replace(parameters=[  # type: ignore[attr-defined]
    p.replace(annotation="str | Path | kvtool.KVCache | transformers.Cache") if p.name == "capture" else p
    for p in compress.__signature__.parameters.values()])  # type: ignore[attr-defined]
