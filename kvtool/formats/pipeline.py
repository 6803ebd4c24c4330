"""Composed compression: token eviction, then pruning, then a storage format, as one file.

Syntax (``kvtool compress``): ``--evict POLICY:budget=N[,sinks=..,recent=..,window=..,pool=..]``,
``--prune METHOD[:k=KEY_SPARSITY,v=VALUE_SPARSITY,s=BOTH,window=DENSE_WINDOW]`` and ``--format
NAME[:key=value,...]``; or the whole chain in ``--format`` with ``+`` between the steps, in order:
``snapkv:budget=256+per-token:k=0.5,v=0.7+quant:bits=4``. Policies are those of
:mod:`kvtool.methods.evict` (snapkv, streaming), methods those of :mod:`kvtool.methods.prune` (per-token, per-channel,
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

The composed file (format ``pipeline``). Per layer it stores the storage format's own tensors under their own names, plus, when eviction ran,
``pipeline.kept``: int16 (int32 when T > 32767) ``[B, Hkv, K]``, the original positions (ascending)
of the K tokens each KV head kept. The layer metadata holds ``tokens`` (T before eviction),
``storage`` (the format holding the tensors), ``storage_params`` and ``storage_meta`` (that
format's own per-layer metadata). ``decode`` gives ``[B, Hkv, K, D]``; ``attend`` is the storage
format's attention over the kept tokens; ``selected_mask`` maps the kept tokens back to their
positions, so attention-mass recall counts what eviction dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtool.core.cache import LayerKV
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.spec import merge_options, parse_spec
from kvtool.formats.base import CompressedCache, Encoded, Format, FormatParams, get_format, load_all, make_params, register
from kvtool.methods.evict import POLICIES, evict_with, gather_tokens, parse_evict
from kvtool.methods.prune import METHODS, check_sparsity, method_needs_queries, parse_method, prune_layer

PRUNE_KEYS = {"k": "key_sparsity", "v": "value_sparsity", "s": "sparsity", "window": "dense_window"}


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


def compose_help() -> str:
    """Which steps compose, from the formats' declared capabilities."""
    formats = load_all()
    evicting = ", ".join(sorted(n for n, f in formats.items() if f.evicts))
    pruning = ", ".join(sorted(n for n, f in formats.items() if f.prunes_itself))
    return (
        f"eviction ({', '.join(POLICIES)}) can precede any format that needs no queries except {evicting}; "
        f"pruning can precede dense, formats that store pruned tensors in their own way, and formats "
        f"that do not prune themselves ({pruning} prune by themselves)"
    )


def plan(evict: str | None, prune: str | None, fmt_spec: str, extra: dict[str, Any] | None = None) -> Plan:
    """Resolve step specs into a :class:`Plan` (UsageError when the steps cannot compose).

    ``extra``: format options given apart from ``fmt_spec`` (``--bits 4`` ...), applied to the
    storage format."""
    evict, prune, fmt_spec = (unsemi(s) for s in (evict, prune, fmt_spec))
    name, values = parse_spec(fmt_spec)
    values = merge_options(name, values, extra or {})
    if name == "pipeline":
        raise UsageError("a pipeline's storage format cannot be another pipeline; give --evict/--prune with a plain --format")
    fmt = get_format(name)
    ev = parse_evict(evict) if evict else None
    pr = parse_prune(prune) if prune else None
    if ev is not None:
        if fmt.evicts:
            raise UsageError(f"--evict cannot precede --format {name}: it evicts tokens itself ({compose_help()})")
        if fmt.needs_queries:
            raise UsageError(f"--evict cannot precede --format {name}: it needs every token's queries, which eviction does not keep ({compose_help()})")
        if pr is not None:
            if method_needs_queries(pr.method):
                raise UsageError(f"--prune {pr.method} needs every token's queries and cannot follow --evict; use per-token, per-channel or 2:4")
    if pr is not None and fmt.prunes_itself:
        raise UsageError(f"--prune cannot precede --format {name}: {name} prunes by itself, give it --method/--key-sparsity/--value-sparsity instead (pruning composes with quant, dense and formats that do not prune)")
    storage, storage_params = fmt, make_params(fmt, values)
    if pr is not None:
        after = fmt.storage_after_pruning(storage_params, pr)
        if after is not None:  # the format stores pruned tensors in a format of its own choosing
            storage, storage_params = after
            pr = None
    steps = [s for s in (evict, prune) if s] + [fmt_spec]
    return Plan(ev, pr, storage, storage_params, " -> ".join(steps))


def resolve(spec: str, options: dict[str, Any] | None = None):
    """The format and parameters ``kvtool compress`` uses for ``--format spec`` with ``options``
    (which may hold ``evict``/``prune`` step specs): (Format, FormatParams, short name).

    Without eviction or pruning this is the named format itself; otherwise the ``pipeline`` format
    with :class:`~kvtool.formats.pipeline.PipelineParams`. An eviction or pruning step alone
    (``snapkv:budget=128``) is the chain ending in ``dense``; ``kivi`` and the other names of
    :data:`kvtool.core.names.FORMAT_ALIASES` are the formats they stand for."""
    options = dict(options or {})
    evict, prune = options.pop("evict", None), options.pop("prune", None)
    if "+" in spec or step_kind(spec) != "format":  # a lone step (snapkv:budget=128) keeps its tokens dense
        ce, cp, spec = split_chain(spec)
        if (ce and evict) or (cp and prune):
            raise UsageError("give each pipeline step once: either in the --format chain or as --evict/--prune")
        evict, prune = evict or ce, prune or cp
    name, values = parse_spec(spec)
    if not evict and not prune:
        fmt = get_format(name)
        return fmt, make_params(fmt, merge_options(name, values, options)), name
    values = merge_options(name, values, options)
    merged = name + (":" + ",".join(f"{k}={v}" for k, v in values.items()) if values else "")
    params = PipelineParams(evict=evict, prune=prune, format=merged)
    plan(params.evict, params.prune, params.format)  # refuse early, before any data is read
    short = "+".join(s.partition(":")[0].replace("/", "-") for s in (evict, prune) if s) + f"+{name}"
    return get_format("pipeline"), params, short


KEPT = "pipeline.kept"


def store_layer(x: LayerKV, storage: Format, storage_params: FormatParams, label: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Encoded:
    """The pipeline layer of ``x`` (the tokens left after eviction and pruning) stored with
    ``storage``; ``tensors``/``meta`` already hold the steps' own entries (``pipeline.kept``,
    ``tokens``, achieved sparsities)."""
    storage.check(x, storage_params)
    inner = storage.encode(x, storage_params)
    clash = [n for n in inner.tensors if n.startswith("pipeline.")]
    if clash:
        raise BadDataError(f"format {storage.name} stores a tensor named {clash[0]!r}, which pipeline reserves")
    tensors = {**tensors, **inner.tensors}
    meta = {**meta, "storage": storage.name, "storage_params": storage_params.to_dict(), "storage_meta": inner.meta, "label": label}
    return Encoded(tensors, meta)


def encode_kept(layer: LayerKV, kept: torch.Tensor, storage_spec: str = "dense", label: str = "kept tokens") -> Encoded:
    """A pipeline layer holding the tokens at ``kept`` (int ``[B, Hkv, K]``, ascending original
    positions of ``layer``'s ``[B, Hkv, T, D]`` tokens, chosen by anything: a kvpress press, a
    hand-made list) stored with ``storage_spec`` (``dense``, ``quant:bits=4``, ...). The layer reads
    like one that ``--evict`` made: ``pipeline.kept`` and the storage format's tensors; ``label``
    names the selector in the layer metadata."""
    t = layer.num_tokens
    k = kept.to(torch.int64)
    if k.ndim != 3 or tuple(k.shape[:2]) != tuple(layer.keys.shape[:2]):
        raise UsageError(f"kept positions should be [batch, kv_heads, K] = [{layer.keys.shape[0]}, {layer.keys.shape[1]}, K], got {list(k.shape)}")
    if k.numel() and (int(k.min()) < 0 or int(k.max()) >= t):
        raise UsageError(f"kept positions must lie in 0..{t - 1}")
    if k.shape[-1] > 1 and not bool((k[..., 1:] > k[..., :-1]).all()):
        raise UsageError("kept positions must be strictly ascending per KV head")
    name, values = parse_spec(unsemi(storage_spec) or "dense")
    storage = get_format(name)
    if storage.evicts or storage.needs_queries or storage.name in ("pipeline", "mixed"):
        raise UsageError(f"tokens kept by a selector cannot be stored with {name}: it needs every token (use dense, quant, bitmap, bitmapq, signvq without queries)")
    params = make_params(storage, values)
    x = gather_tokens(layer, k)
    tensors = {KEPT: k.to(torch.int16 if t <= 32767 else torch.int32).contiguous()}
    return store_layer(x, storage, params, label, tensors, {"tokens": t})


@dataclass
class PipelineParams(FormatParams):
    """``evict``: eviction spec (``snapkv:budget=N``...) or None; ``prune``: pruning spec
    (``per-token:k=0.5,v=0.7``) or None; ``format``: the storage format spec (``quant:bits=4``)."""

    evict: str | None = "snapkv:budget=128"
    prune: str | None = "per-token:k=0.5,v=0.7"
    format: str = "quant:bits=4"


def storage_of(enc: Encoded) -> tuple[Format, Encoded]:
    """The storage format of a pipeline layer and its own Encoded (tensors without ``pipeline.*``)."""
    name = enc.meta.get("storage")
    if not isinstance(name, str) or name == "pipeline":
        raise BadDataError(f"pipeline layer names no storage format (got {name!r})")
    try:
        fmt = get_format(name)
    except Exception:
        raise BadDataError(f"storage format {name!r} is not known to this kvtool") from None
    own = {n: t for n, t in enc.tensors.items() if not n.startswith("pipeline.")}
    return fmt, Encoded(own, enc.meta.get("storage_meta", {}))


@register
class PipelineFormat(Format):
    name = "pipeline"
    summary = "composed: --evict then --prune then a storage format (prune + quant stores as bitmapq)"
    Params = PipelineParams
    default_sweep = (
        'pipeline:evict=snapkv:budget=256,prune=none,format=quant:bits=4',
        'pipeline:evict=snapkv:budget=256,prune=per-token:k=0.5;v=0.7,format=quant:bits=4',
    )
    paper_rows = (
        ('pruning with eviction (Mustafar 4.2)', 'SnapKV 256 alone', 'pipeline:evict=snapkv:budget=256,prune=none,format=dense'),
        ('pruning with eviction (Mustafar 4.2)', 'SnapKV 256 + 50% per-token', 'pipeline:evict=snapkv:budget=256,prune=none,format=bitmap:sparsity=0.5'),
    )
    # A pipeline may store into a selecting format (signvq, pagestat); ``selects`` is per format, not
    # per file, so it is set conservatively: tools never stand a dense decode in for a pipeline file
    # (export/continuation go through ``attend``, which is right for every storage format).
    selects = True

    def check(self, layer: LayerKV, params: FormatParams) -> None:
        plan(params.evict, params.prune, params.format)

    def encode(self, layer: LayerKV, params: FormatParams) -> Encoded:
        """Run the steps on ``layer`` (keys/values ``[B, Hkv, T, D]``, queries for SnapKV and
        query-aware pruning) and store the result with the storage format."""
        pl = plan(params.evict, params.prune, params.format)
        t = layer.num_tokens
        x = layer
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {"tokens": t}
        if pl.evict is not None:
            x, kept = evict_with(layer, pl.evict)
            tensors[KEPT] = kept.to(torch.int16 if t <= 32767 else torch.int32).contiguous()
        if pl.prune is not None:
            res = prune_layer(x, pl.prune.key_sparsity, pl.prune.value_sparsity, pl.prune.method, pl.prune.dense_window)
            x = LayerKV(res.keys, res.values, x.queries, x.hidden)
            meta["achieved_key_sparsity"] = res.stats["achieved_key_sparsity"]
            meta["achieved_value_sparsity"] = res.stats["achieved_value_sparsity"]
        return store_layer(x, pl.storage, pl.storage_params, pl.label, tensors, meta)

    def decode(self, enc: Encoded) -> LayerKV:
        fmt, inner = storage_of(enc)
        return fmt.decode(inner)

    live_grows = True  # as its storage format grows; evicted tokens stay gone

    def live_layer(self, enc: Encoded, like: torch.Tensor):
        """The storage format's live layer over the kept tokens (new tokens join it the storage
        format's way)."""
        fmt, inner = storage_of(enc)
        return fmt.live_layer(inner, like)

    def nbytes(self, enc: Encoded) -> dict[str, int]:
        fmt, inner = storage_of(enc)
        parts = dict(fmt.nbytes(inner))
        if KEPT in enc.tensors:
            t = enc.tensors[KEPT]
            parts["positions"] = parts.get("positions", 0) + t.numel() * t.element_size()
        return parts

    def attend(self, q: torch.Tensor, enc: Encoded, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        fmt, inner = storage_of(enc)
        return fmt.attend(q, inner, scale)

    def traffic_bytes(self, enc: Encoded, q: torch.Tensor | None = None) -> int:
        """What the storage format reads per decode step (kept positions are not read by attention)."""
        fmt, inner = storage_of(enc)
        return fmt.traffic_bytes(inner, q)

    def selected_mask(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor | None:
        """Bool ``[B, H, Tq, T]`` in original positions: kept by eviction (and selected by the storage
        format, if it selects). None without eviction when the storage format keeps every token."""
        fmt, inner = storage_of(enc)
        sel = fmt.selected_mask(q, inner)
        if KEPT not in enc.tensors:
            return sel
        kept = enc.tensors[KEPT].to(torch.int64)
        b, hkv, k = kept.shape
        h, tq = q.shape[1], q.shape[2]
        pos = kept.repeat_interleave(h // hkv, dim=1)[:, :, None, :].expand(b, h, tq, k)
        src = torch.ones(b, h, tq, k, dtype=torch.bool, device=kept.device) if sel is None else sel.to(torch.bool)
        mask = torch.zeros(b, h, tq, int(enc.meta["tokens"]), dtype=torch.bool, device=kept.device)
        return mask.scatter(3, pos, src)

    def validate(self, enc: Encoded) -> None:
        fmt, inner = storage_of(enc)
        t = enc.meta.get("tokens")
        if not isinstance(t, int) or t < 0:
            raise BadDataError("pipeline layer metadata lacks the token count")
        try:
            fmt.validate(inner)
        except BadDataError as exc:
            raise BadDataError(f"{fmt.name} storage: {exc}") from None
        if KEPT in enc.tensors:
            kept = enc.tensors[KEPT]
            if kept.dtype not in (torch.int16, torch.int32) or kept.ndim != 3:
                raise BadDataError(f"{KEPT} should be int16/int32 [batch, kv_heads, kept]")
            k = kept.to(torch.int64)
            if k.numel() and (int(k.min()) < 0 or int(k.max()) >= t):
                raise BadDataError(f"{KEPT} holds positions outside 0..{t - 1}")
            if k.shape[-1] > 1 and not bool((k[..., 1:] > k[..., :-1]).all()):
                raise BadDataError(f"{KEPT} positions are not strictly ascending")
            shape = inner.meta.get("shape")
            if isinstance(shape, list) and len(shape) == 4 and shape[2] != k.shape[-1]:
                raise BadDataError(f"{KEPT} lists {k.shape[-1]} tokens but the storage holds {shape[2]}")

    def report(self, cc: CompressedCache, source=None) -> dict[str, Any]:
        encs = cc.layers
        first = next(iter(encs.values())) if encs else None
        out: dict[str, Any] = {"pipeline": first.meta.get("label") if first else None, "storage": first.meta.get("storage") if first else None}
        if first is None:
            return out
        fmt, _ = storage_of(first)
        inner = CompressedCache(cc.facts, fmt.name, first.meta.get("storage_params", {}), {i: storage_of(e)[1] for i, e in encs.items()}, cc.tails, cc.token_ids, cc.info)
        for key, value in fmt.report(inner, None).items():
            out.setdefault(key, value)
        if KEPT in first.tensors:
            kept = sum(e.tensors[KEPT].shape[-1] for e in encs.values())
            out["kept_tokens_per_head"] = kept / len(encs)
            out["kept_share"] = kept / sum(e.meta["tokens"] for e in encs.values())
        if "achieved_key_sparsity" in first.meta:
            out["achieved_key_sparsity"] = sum(e.meta["achieved_key_sparsity"] for e in encs.values()) / len(encs)
            out["achieved_value_sparsity"] = sum(e.meta["achieved_value_sparsity"] for e in encs.values()) / len(encs)
        # over the original tokens (a storage format's own figure would count only the kept ones)
        stored = sum(sum(self.nbytes(e).values()) for e in encs.values())
        b, hkv, d = cc.token_ids.shape[0], cc.facts.num_kv_heads, cc.facts.head_dim
        elements = sum(2 * b * hkv * e.meta["tokens"] * d for e in encs.values())
        out["bits_per_element"] = 8.0 * stored / elements if elements else float("nan")
        return out
