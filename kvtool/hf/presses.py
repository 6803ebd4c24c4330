"""kvpress presses as token selectors whose choice becomes a kvtool file (``pip install kvpress``).

kvpress (NVIDIA) compresses a model's cache during prefill: a *press* scores the context's tokens
per layer and KV head and keeps the best ones. kvtool runs a press on the model's own attention
modules with the inputs the prefill recorded (:class:`AttentionInputs`: each layer's attention input,
its keys and values, RoPE's cos/sin), reads which tokens it kept, and stores those tokens as a kvtool
eviction (:func:`kvtool.formats.plan.compress_kept`): a real file whose bytes are counted (kept
positions included), whose tokens can be quantised (``storage="quant:bits=4"``) and exported.

How the kept tokens are read:

- selecting presses (every ``ScorerPress``: SnapKV, ExpectedAttention, TOVA, Knorm, StreamingLLM,
  ...) return the kept rows of the keys they were given: each is matched exactly to its position;
- head-wise presses (``AdaKVPress`` around a scorer) leave the keys whole and list the evicted
  (batch, head, position) triples in ``module.masked_key_indices``: kvtool keeps the complement, so
  heads of one layer may keep different counts.

A press is given by a spec :func:`parse_press` reads: ``NAME[:keep=0.15,field=value,...]`` where
NAME is one of :data:`PRESSES` (``adakv-NAME`` wraps a scorer in AdaKV), ``keep`` is the share of
the context's tokens kept (kvpress's ``compression_ratio`` is ``1 - keep``) and the other fields are
the press's own dataclass fields (``window_size=32``). This module imports kvpress only inside
:func:`make_press`; everything else works with any object that has kvpress's
``compress(module, hidden_states, keys, values, attentions, kwargs)`` method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.names import closest
from kvtool.core.spec import parse_spec

# kvtool name -> kvpress class (scorer presses; ``adakv-NAME`` wraps one of them in AdaKVPress)
PRESSES = {
    "snapkv": "SnapKVPress",
    "expected_attention": "ExpectedAttentionPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "streaming_llm": "StreamingLLMPress",
    "keydiff": "KeyDiffPress",
    "pyramidkv": "PyramidKVPress",
    "random": "RandomPress",
}
INSTALL = "pip install 'kvtool[kvpress]' && pip install --no-deps kvpress==0.5.5"


@dataclass
class PressSpec:
    """A parsed press spec: ``name`` (a key of :data:`PRESSES`), AdaKV wrapping, kept share, the
    press's own fields."""

    name: str
    keep: float
    adakv: bool = False
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in sorted(self.fields.items()))
        return f"{'adakv-' if self.adakv else ''}{self.name}:keep={self.keep:.4g}{extra}"


def parse_press(spec: str, keep: float | None = None) -> PressSpec:
    """``"adakv-snapkv:keep=0.25,window_size=32"`` -> PressSpec (UsageError naming what is wrong).
    ``keep`` given here overrides the spec's."""
    name, values = parse_spec(spec.strip())
    adakv = name.startswith("adakv-")
    base = name[len("adakv-"):] if adakv else name
    if base not in PRESSES:
        raise UsageError(f"unknown press {name!r}{closest(base, PRESSES)}; presses: {', '.join(PRESSES)} (adakv-NAME wraps one in AdaKV)")
    share = values.pop("keep", None)
    if keep is None:
        if share is None:
            raise UsageError(f"press {spec!r}: give the share of tokens kept, e.g. {name}:keep=0.15")
        try:
            keep = float(share)
        except ValueError:
            raise UsageError(f"press {spec!r}: keep must be a number, got {share!r}") from None
    if not 0 < keep <= 1:
        raise UsageError(f"press {spec!r}: keep must be in (0, 1], got {keep}")
    return PressSpec(base, float(keep), adakv, dict(values))


def check_installed() -> None:
    """UsageError (with the install line) when kvpress is not installed; imports nothing."""
    import importlib.util

    if importlib.util.find_spec("kvpress") is None:
        raise UsageError(f"kvpress is not installed; install it with: {INSTALL}")


def _kvpress() -> Any:
    try:
        import kvpress  # deferred: optional dependency, loads transformers' whole model zoo
    except ImportError as exc:
        raise UsageError(f"kvpress is not installed ({exc}); install it with: {INSTALL}") from None
    return kvpress


def _convert(value: str, kind: Any) -> Any:
    kind = {"int": int, "float": float, "bool": bool}.get(kind, kind) if isinstance(kind, str) else kind
    if kind is bool:
        return value.lower() in ("1", "true", "yes", "on")
    if kind in (int, float):
        return kind(value)
    return value


def make_press(spec: PressSpec) -> Any:
    """The kvpress press object a spec names (kvpress must be installed)."""
    kvpress = _kvpress()
    cls = getattr(kvpress, PRESSES[spec.name])
    names = {f.name: f.type for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in spec.fields.items():
        if key not in names or key == "compression_ratio":
            raise UsageError(f"press {spec.name} has no field {key!r}; it takes: {', '.join(n for n in names if n != 'compression_ratio')} (and keep)")
        try:
            kwargs[key] = _convert(value, names[key])
        except ValueError:
            raise UsageError(f"press {spec.name}: {key} must be a {names[key]}, got {value!r}") from None
    ratio = 1.0 - spec.keep
    press = cls(compression_ratio=ratio if not spec.adakv else 0.0, **kwargs)
    if spec.adakv:
        press = kvpress.AdaKVPress(press=press)
        press.compression_ratio = ratio
    return press


def set_keep(press: Any, keep: float) -> None:
    """Set the kept share of a press made by :func:`make_press` (kvpress's ``compression_ratio``)."""
    press.compression_ratio = 1.0 - keep


def reuse_scores(press: Any) -> Any:
    """Make a press compute each layer's scores once: the scorer's ``score`` (AdaKV's inner press's)
    remembers its result per attention module and inputs, so the same press at several kept shares
    (:func:`set_keep`) scores a context once. A scorer whose ``score`` reads
    ``compression_ratio`` (StreamingLLM's) is left as it is. Use such a press for one context (one set of recorded inputs). Returns the press."""
    scorer = getattr(press, "press", press)
    if not hasattr(scorer, "score") or getattr(scorer, "_kvtool_reuses_scores", False):
        return press
    try:
        source = inspect.getsource(type(scorer).score)
    except (OSError, TypeError):
        return press
    if "compression_ratio" in source:  # this scorer's scores change with the kept share (StreamingLLM's do)
        return press
    original = scorer.score
    memo: dict[tuple[int, int], torch.Tensor] = {}

    def score(module, hidden_states, keys, values, attentions, kwargs):
        key = (id(module), keys.data_ptr(), tuple(keys.shape))
        if key not in memo:
            memo[key] = original(module, hidden_states, keys, values, attentions, kwargs)
        return memo[key].clone()  # AdaKV writes into the scores it gets

    scorer.score = score
    scorer._kvtool_reuses_scores = True
    return press


# ----------------------------------------------------------------------------- inputs


@dataclass
class AttentionInputs:
    """What a press reads per layer, recorded at prefill: ``hidden[i]`` the attention input
    ``[B, T, hidden]`` (after the layer's input norm), ``keys[i]``/``values[i]`` ``[B, Hkv, T, D]``
    in the model's dtype, ``position_embeddings`` RoPE's ``(cos, sin)`` ``[B, T, D]``."""

    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None

    def trimmed(self, tokens: int) -> "AttentionInputs":
        """The first ``tokens`` positions (the compressed prefix of a longer prefill)."""
        pe = None if self.position_embeddings is None else tuple(x[:, :tokens] for x in self.position_embeddings)
        return AttentionInputs({i: h[:, :tokens] for i, h in self.hidden.items()}, {i: k[:, :, :tokens] for i, k in self.keys.items()},
                               {i: v[:, :, :tokens] for i, v in self.values.items()}, pe)  # type: ignore[arg-type]


def attention_modules(model: Any) -> list[Any]:
    """The self-attention module of every decoder layer (``model.model.layers[i].self_attn``)."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UsageError(f"{type(model).__name__}: no decoder layers found (model.model.layers); kvpress presses need a Llama-like model")
    return [layer.self_attn for layer in layers]


@contextlib.contextmanager
def recording_inputs(model: Any, inputs: AttentionInputs) -> Iterator[AttentionInputs]:
    """Within the block every forward of ``model`` records each attention module's input and RoPE
    into ``inputs`` (a prefill in chunks appends along the tokens)."""
    handles = []

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        idx = int(module.layer_idx)
        h = kwargs.get("hidden_states", args[0] if args else None)
        if h is None:
            return
        prev = inputs.hidden.get(idx)
        inputs.hidden[idx] = h.detach() if prev is None else torch.cat([prev, h.detach()], dim=1)
        pe = kwargs.get("position_embeddings")
        if pe is not None and idx == 0:
            cos, sin = (x.detach() for x in pe)
            if inputs.position_embeddings is None:
                inputs.position_embeddings = (cos, sin)
            else:
                inputs.position_embeddings = (torch.cat([inputs.position_embeddings[0], cos], dim=1), torch.cat([inputs.position_embeddings[1], sin], dim=1))

    try:
        for m in attention_modules(model):
            handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
        yield inputs
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- kept tokens


def match_rows(full: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Positions (int64 ``[B, Hkv, K]``, ascending) of the rows of ``kept`` ``[B, Hkv, K, D]`` in
    ``full`` ``[B, Hkv, T, D]``: each kept row must equal a row of ``full`` exactly (BadDataError
    otherwise: the press changed the keys, e.g. by merging or re-rotating them)."""
    b, hkv, t, d = full.shape
    k = kept.shape[2]
    gen = torch.Generator().manual_seed(0)
    coef = torch.randint(1, 1 << 20, (d,), generator=gen, dtype=torch.int64)

    def row_hash(x: torch.Tensor) -> torch.Tensor:
        # exact: the rows' bit patterns as integers, mixed with integer arithmetic (no rounding)
        bits = x.contiguous().cpu().view(torch.int16 if x.element_size() == 2 else torch.int32).to(torch.int64)
        return (bits * coef).sum(-1)

    out = torch.empty(b, hkv, k, dtype=torch.int64)
    for bi in range(b):
        for h in range(hkv):
            fh = row_hash(full[bi, h])
            kh = row_hash(kept[bi, h])
            order = torch.argsort(fh, stable=True)
            at = torch.searchsorted(fh[order], kh).clamp(max=t - 1)
            pos = order[at]
            if not torch.equal(full[bi, h, pos].cpu(), kept[bi, h].cpu()):
                raise BadDataError("the press returned keys that are not rows of the keys it was given (it merges or re-rotates tokens); only selecting presses can become kvtool files")
            pos = pos.sort().values
            if k > 1 and bool((pos[1:] == pos[:-1]).any()):
                raise BadDataError("the press kept a position twice (two identical keys in one head)")
            out[bi, h] = pos
    return out


def _complement(masked: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b: int, hkv: int, t: int) -> list[torch.Tensor]:
    """Kept positions per KV head (``[B, K_h]`` each; batch 1 for ragged counts) from kvpress's
    evicted (batch, head, position) triples."""
    mask = torch.ones(b, hkv, t, dtype=torch.bool)
    bi, hi, si = (x.to(torch.int64).cpu() for x in masked)
    mask[bi, hi, si] = False
    counts = mask.sum(-1)
    out = []
    for h in range(hkv):
        if b > 1 and not bool((counts[:, h] == counts[0, h]).all()):
            raise BadDataError("a head-wise press kept different counts in one head across the batch; compress one sequence at a time")
        out.append(torch.stack([mask[bi_, h].nonzero()[:, 0] for bi_ in range(b)]))
    return out


@contextlib.contextmanager
def _rotary_on_modules(model: Any) -> Iterator[None]:
    """kvpress reads RoPE from ``module.rotary_emb`` (its context manager sets it on every attention
    module); set it for the block and take it away after."""
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    mods = attention_modules(model)
    had = [hasattr(m, "rotary_emb") for m in mods]
    try:
        for m, h in zip(mods, had):
            if not h and rotary is not None:
                m.rotary_emb = rotary
        yield
    finally:
        for m, h in zip(mods, had):
            if not h and hasattr(m, "rotary_emb"):
                del m.rotary_emb


@torch.no_grad()
def press_kept(model: Any, press: Any, inputs: AttentionInputs, layers: list[int] | None = None) -> dict[int, list[torch.Tensor]]:
    """Run ``press.compress`` on each layer's recorded inputs and return, per layer, the kept
    positions per KV head (int64 ``[B, K_h]``, ascending). See the module docstring."""
    mods = attention_modules(model)
    chosen = sorted(inputs.keys) if layers is None else layers
    if inputs.position_embeddings is None:
        raise UsageError("the recorded inputs lack RoPE's cos/sin; record them with recording_inputs during the prefill")
    if hasattr(press, "post_init_from_model"):
        press.post_init_from_model(model)
    out: dict[int, list[torch.Tensor]] = {}
    with _rotary_on_modules(model):
        for i in chosen:
            module = mods[i]
            hidden = inputs.hidden[i]
            keys, values = inputs.keys[i].to(hidden.device), inputs.values[i].to(hidden.device)  # where the module computes
            b, hkv, t, _ = keys.shape
            kwargs = {"position_embeddings": inputs.position_embeddings, "cache_position": torch.arange(t, device=hidden.device), "attention_mask": None}
            module.masked_key_indices = None
            try:
                new_k, _ = press.compress(module, hidden, keys, values, None, kwargs)
                masked = getattr(module, "masked_key_indices", None)
            finally:
                module.masked_key_indices = None
            if masked is not None:
                out[i] = _complement(masked, b, hkv, t)
            elif new_k.shape[2] == t and torch.equal(new_k, keys):
                out[i] = [torch.arange(t).expand(b, t).clone() for _ in range(hkv)]
            else:
                pos = match_rows(keys, new_k)
                out[i] = [pos[:, h] for h in range(hkv)]
    return out
