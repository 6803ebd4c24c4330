"""Composed compression: token eviction, then pruning, then a storage format, as one file.

Syntax (``kvtool compress``): ``--evict POLICY:budget=N[,sinks=..,recent=..,window=..,pool=..]``,
``--prune METHOD[:k=KEY_SPARSITY,v=VALUE_SPARSITY,s=BOTH,window=DENSE_WINDOW]`` and ``--format
NAME[:key=value,...]``; or the whole chain in ``--format`` with ``+`` between the steps, in order:
``snapkv:budget=256+per-token:k=0.5,v=0.7+quant:bits=4``. Policies are those of
:mod:`kvtool.evict` (snapkv, streaming), methods those of :mod:`kvtool.prune` (per-token, per-channel,
output-aware, think, 2:4, or KEYS/VALUES such as output-aware/per-token).

How steps compose (:func:`plan`):

- eviction runs first on each layer's keys/values ``[B, Hkv, T, D]`` and keeps ``[B, Hkv, K, D]``
  (kept positions stored as ``pipeline.kept``); the storage format then sees no queries, so formats
  that need queries, eviction formats (snapstream) and query-aware pruning cannot follow it;
- pruning + ``quant`` (scheme kivi) is stored as ``bitmapq``: the bitmap stays and the kept elements
  become low-bit codes with their scales (the joint Mustafar + KIVI case);
- pruning + ``bitmap``/``bitmapq`` is refused: those formats prune by themselves (give their
  ``--method``/``--key-sparsity``/``--value-sparsity`` instead);
- pruning + any other format (dense, signvq, pagestat, ...) stores the pruned tensors with that format.

A composed file's format is ``pipeline``; its parameters are the step specs (``kvtool info`` shows
them) and each layer's metadata names the storage format that holds the tensors. The ``pipeline``
format can also be named directly, with ``;`` between a step's own parameters:
``pipeline:evict=snapkv:budget=128,prune=per-token:k=0.5;v=0.7,format=quant:bits=4`` (the form a
``kvtool eval`` sweep spec takes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import UsageError

PRUNE_KEYS = {"k": "key_sparsity", "v": "value_sparsity", "s": "sparsity", "window": "dense_window"}
SELF_PRUNING = ("bitmap", "bitmapq")
SELF_EVICTING = ("snapstream",)


@dataclass
class PruneStep:
    """A parsed ``--prune`` spec: method and sparsities (0 when not given), recent tokens left dense."""

    method: str = "per-token"
    key_sparsity: float = 0.0
    value_sparsity: float = 0.0
    dense_window: int = 32

    def spec(self) -> str:
        return f"{self.method}:k={self.key_sparsity:g},v={self.value_sparsity:g},window={self.dense_window}"


def parse_prune(spec: str) -> PruneStep:
    """``"per-token:k=0.5,v=0.7"`` -> PruneStep (UsageError naming the problem)."""
    from .formats.base import parse_spec
    from .prune import check_sparsity, parse_method

    text = spec.strip()
    if text.startswith("2:4"):  # the method name holds a colon
        name, values = "2:4", parse_spec("x" + text[3:])[1]
    else:
        name, values = parse_spec(text)
    parse_method(name)
    fields: dict[str, Any] = {}
    for key, value in values.items():
        if key not in PRUNE_KEYS:
            raise UsageError(f"--prune {spec!r}: unknown parameter {key!r}; it takes k (key sparsity), v (value sparsity), s (both), window (dense tokens)")
        try:
            fields[PRUNE_KEYS[key]] = int(value) if key == "window" else float(value)
        except ValueError:
            raise UsageError(f"--prune {spec!r}: {key} must be a number, got {value!r}") from None
    both = fields.pop("sparsity", None)
    step = PruneStep(method=name, key_sparsity=fields.get("key_sparsity", both or 0.0), value_sparsity=fields.get("value_sparsity", both or 0.0), dense_window=fields.get("dense_window", 32))
    if "2:4" in name and both is None and "key_sparsity" not in fields and "value_sparsity" not in fields:
        step.key_sparsity = step.value_sparsity = 0.5
    check_sparsity(step.key_sparsity, f"--prune {spec!r}: k")
    check_sparsity(step.value_sparsity, f"--prune {spec!r}: v")
    if step.key_sparsity == 0 and step.value_sparsity == 0:
        raise UsageError(f"--prune {spec!r} prunes nothing; give k=, v= or s= (e.g. per-token:k=0.5,v=0.7)")
    if step.dense_window < 0:
        raise UsageError(f"--prune {spec!r}: window must be at least 0")
    return step


def step_kind(spec: str) -> str:
    """``evict``, ``prune`` or ``format`` for one step of a ``+`` chain, by its name."""
    from .evict import POLICIES
    from .prune import METHODS

    name = spec.strip()
    if name.startswith("2:4"):
        return "prune"
    name = name.partition(":")[0].strip()
    if name in POLICIES:
        return "evict"
    if name in METHODS or ("/" in name and all(p in METHODS for p in name.split("/"))):
        return "prune"
    return "format"


def split_chain(spec: str) -> tuple[str | None, str | None, str]:
    """``"snapkv:budget=256+per-token:k=0.5+quant:bits=4"`` -> (evict, prune, format) specs."""
    parts = [p.strip() for p in spec.split("+")]
    found: dict[str, str] = {}
    order = ("evict", "prune", "format")
    last = -1
    for part in parts:
        if not part:
            raise UsageError(f"--format {spec!r}: empty step between '+' signs")
        kind = step_kind(part)
        if kind in found:
            raise UsageError(f"--format {spec!r}: two {kind} steps ({found[kind]!r} and {part!r}); a pipeline has at most one of each")
        if order.index(kind) < last:
            raise UsageError(f"--format {spec!r}: steps go in the order eviction + pruning + format")
        last = order.index(kind)
        found[kind] = part
    return found.get("evict"), found.get("prune"), found.get("format", "dense")


def unsemi(spec: str | None) -> str | None:
    """Step specs may separate their parameters with ``;`` instead of ``,`` (so that a whole
    pipeline fits in one ``pipeline:evict=...,prune=...,format=...`` spec): ``;`` -> ``,``."""
    return spec.replace(";", ",") if spec else spec


@dataclass
class Plan:
    """What a pipeline runs: the eviction parameters (or None), the generic pruning step (or None,
    also when the storage format does the pruning itself), the storage format and its parameters."""

    evict: Any
    prune: PruneStep | None
    storage: Any
    storage_params: Any
    label: str


COMPOSE_HELP = (
    "eviction (snapkv, streaming) can precede any format that needs no queries except snapstream; "
    "pruning can precede quant (stored as bitmapq), dense, and formats that do not prune themselves "
    "(bitmap and bitmapq prune by themselves)"
)


def plan(evict: str | None, prune: str | None, fmt_spec: str, extra: dict[str, Any] | None = None) -> Plan:
    """Resolve step specs into a :class:`Plan` (UsageError when the steps cannot compose).

    ``extra``: format options given apart from ``fmt_spec`` (``--bits 4`` ...), applied to the
    storage format."""
    from .evict import parse_evict
    from .formats.base import get_format, make_params, parse_spec

    evict, prune, fmt_spec = (unsemi(s) for s in (evict, prune, fmt_spec))
    name, values = parse_spec(fmt_spec)
    values.update({k: v for k, v in (extra or {}).items() if v is not None})
    if name == "pipeline":
        raise UsageError("a pipeline's storage format cannot be another pipeline; give --evict/--prune with a plain --format")
    fmt = get_format(name)
    ev = parse_evict(evict) if evict else None
    pr = parse_prune(prune) if prune else None
    if ev is not None:
        if name in SELF_EVICTING:
            raise UsageError(f"--evict cannot precede --format {name}: it evicts tokens itself ({COMPOSE_HELP})")
        if fmt.needs_queries:
            raise UsageError(f"--evict cannot precede --format {name}: it needs every token's queries, which eviction does not keep ({COMPOSE_HELP})")
        if pr is not None:
            from .prune import method_needs_queries

            if method_needs_queries(pr.method):
                raise UsageError(f"--prune {pr.method} needs every token's queries and cannot follow --evict; use per-token, per-channel or 2:4")
    if pr is not None and name in SELF_PRUNING:
        raise UsageError(f"--prune cannot precede --format {name}: {name} prunes by itself, give it --method/--key-sparsity/--value-sparsity instead (pruning composes with quant, dense and formats that do not prune)")
    storage, storage_params = fmt, None
    if pr is not None and name == "quant":
        q = make_params(fmt, values)
        if q.scheme != "kivi":
            raise UsageError(f"--prune with --format quant needs scheme kivi (the kept elements become low-bit codes); scheme {q.scheme} cannot compose with pruning")
        storage = get_format("bitmapq")
        storage_params = make_params(storage, {
            "bits": q.bits, "group": q.group, "residual": q.residual, "method": pr.method,
            "key_sparsity": pr.key_sparsity, "value_sparsity": pr.value_sparsity, "dense_window": pr.dense_window,
        })
        pr = None
    else:
        storage_params = make_params(fmt, values)
    steps = [s for s in (evict, prune) if s] + [fmt_spec]
    return Plan(ev, pr, storage, storage_params, " -> ".join(steps))


def resolve(spec: str, options: dict[str, Any] | None = None):
    """The format and parameters ``kvtool compress`` uses for ``--format spec`` with ``options``
    (which may hold ``evict``/``prune`` step specs): (Format, FormatParams, short name).

    Without eviction or pruning this is the named format itself; otherwise the ``pipeline`` format
    with :class:`~kvtool.formats.pipeline.PipelineParams`."""
    from .formats.base import get_format, make_params, parse_spec

    options = dict(options or {})
    evict, prune = options.pop("evict", None), options.pop("prune", None)
    if "+" in spec:
        ce, cp, spec = split_chain(spec)
        if (ce and evict) or (cp and prune):
            raise UsageError("give each pipeline step once: either in the --format chain or as --evict/--prune")
        evict, prune = evict or ce, prune or cp
    name, values = parse_spec(spec)
    if not evict and not prune:
        fmt = get_format(name)
        values.update({k: v for k, v in options.items() if v is not None})
        return fmt, make_params(fmt, values), name
    from .formats.pipeline import PipelineParams

    values.update({k: v for k, v in options.items() if v is not None})
    merged = name + (":" + ",".join(f"{k}={v}" for k, v in values.items()) if values else "")
    params = PipelineParams(evict=evict, prune=prune, format=merged)
    plan(params.evict, params.prune, params.format)  # refuse early, before any data is read
    short = "+".join(s.partition(":")[0].replace("/", "-") for s in (evict, prune) if s) + f"+{name}"
    return get_format("pipeline"), params, short
