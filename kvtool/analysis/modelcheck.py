"""Model-level cost of compression plans over several texts, with 95% intervals.

A *case* is one text run through the model: its first ``P`` tokens are the prefix a plan compresses
and its last ``W`` tokens the continuation scored teacher-forced (NLL, top-1 agreement, KL against
the dense run: :func:`kvtool.analysis.fidelity.model_fidelity`). Cases come from

- the capture itself (:func:`capture_case`): its prefix is re-run densely once for the reference;
- held-out texts (:func:`text_case`): the shipped ones (:mod:`kvtool.texts`) or the user's
  ``--texts`` files, tokenised and cut to the capture's length. One pass of the model over the
  prefix records the keys/values/queries a plan encodes *and* serves as the dense reference.

:func:`score_plans` compresses every case with every plan (:func:`kvtool.formats.plan.compress_plan`) and
runs only the continuation per plan (the dense prefix and the model are shared).
:func:`interval` gives the mean and a 95% Student-t interval over cases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvtool.core.progress import Progress
from kvtool.core.cache import DTYPES, KVCache, LayerKV, dtype_name
from kvtool.core.errors import UsageError
from kvtool.analysis.fidelity import DenseReference, dense_reference, model_fidelity
from kvtool.formats.plan import Plan, compress_kept, compress_plan
from kvtool.hf import capture as capturing, attention as hfattn
from kvtool.formats.base import compress_cache

# two-sided 95% Student-t quantiles by degrees of freedom (larger: the normal 1.96)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


# metrics that cannot leave a range: their intervals are clipped to it (agreement is a share)
METRIC_BOUNDS: dict[str, tuple[float | None, float | None]] = {"agreement": (0.0, 1.0), "kl": (0.0, None)}


def metric_interval(metric: str, values: list[float]) -> dict[str, Any]:
    """:func:`interval` clipped to the metric's range (:data:`METRIC_BOUNDS`)."""
    iv = interval(values)
    lo, hi = METRIC_BOUNDS.get(metric, (None, None))
    if iv["mean"] is not None:
        if lo is not None:
            iv["lo"] = max(iv["lo"], lo)
        if hi is not None:
            iv["hi"] = min(iv["hi"], hi)
    return iv


def interval(values: list[float]) -> dict[str, Any]:
    """``{"mean", "lo", "hi", "n"}``: the mean and a 95% Student-t interval (lo = hi = mean for one value)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(vals)
    if n == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    mean = sum(vals) / n
    if n == 1:
        return {"mean": mean, "lo": mean, "hi": mean, "n": 1}
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    df = n - 1
    t = _T975.get(df) or next((q for d, q in sorted(_T975.items(), reverse=True) if d <= df), 1.96)
    if df > 30:
        t = 1.96
    half = t * sd / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}


@dataclass
class Case:
    """One text: ``cache`` holds the prefix's keys/values/queries (``P`` tokens, all layers) and
    ``token_ids`` ``[1, P + W]``; ``reference`` the dense run of the continuation."""

    name: str
    cache: KVCache
    token_ids: torch.Tensor
    reference: DenseReference
    layers: list[int] | None = None  # the layers compressed (the capture's); None: all

    def compressible(self) -> KVCache:
        """The cache restricted to the layers a plan or format compresses (others stay dense)."""
        if self.layers is None or set(self.layers) == set(self.cache.layers):
            return self.cache
        return KVCache(self.cache.facts, {i: self.cache.layers[i] for i in self.layers}, self.cache.token_ids, self.cache.info)

    @property
    def prefix_tokens(self) -> int:
        return self.reference.prefix_tokens


def capture_case(model: Any, cache: KVCache, heldout: int, name: str = "capture", model_name: str = "the model") -> Case:
    """The capture's own continuation: its last ``heldout`` tokens after the first ``T - heldout``
    (the dense reference re-runs the prefix and checks the model reproduces the capture's keys)."""
    p = cache.num_tokens - heldout
    ref = dense_reference(model, cache.token_ids, p, 0, cache, model_name)
    return Case(name, cache, cache.token_ids, ref)


@torch.no_grad()
def text_case(model: Any, tokenizer: Any, text: str, name: str, tokens: int, heldout: int, layers: list[int] | None = None, dtype: str | None = None) -> Case:
    """A held-out text cut to its first ``tokens`` tokens: one pass over the prefix records its cache
    (the compressor's input, stored in ``dtype`` like the capture it is compared with; the dense
    reference keeps the model's own), then the continuation runs densely."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :tokens]
    if ids.shape[1] <= heldout + 16:
        raise UsageError(f"text {name} has {ids.shape[1]} tokens, too few for {heldout} held-out tokens (give a longer text)")
    p = ids.shape[1] - heldout
    model_dtype = next(model.parameters()).dtype
    full = capturing.capture(model=(model, tokenizer), input_ids=ids[:, :p], queries=True, dtype=dtype_name(model_dtype))
    prefix = {i: type(layer)(keys=layer.keys, values=layer.values) for i, layer in full.layers.items()}
    cache = full
    if dtype is not None and dtype != dtype_name(model_dtype):
        dt = DTYPES[dtype]
        cache = KVCache(type(full.facts)(**{**full.facts.to_dict(), "dtype": dtype}),
                        {i: LayerKV(l.keys.to(dt), l.values.to(dt), None if l.queries is None else l.queries.to(dt)) for i, l in full.layers.items()},
                        full.token_ids, full.info)
    dense = hfattn.build_cache(model, prefix, None)
    with hfattn.compressed_attention(model, None):
        logits = hfattn.forward(model, dense, ids[:, p:])
    ref = DenseReference(prefix, logits, torch.zeros(1, 0, dtype=torch.int64), p)
    return Case(name, cache, ids, ref, layers)


def score_case(model: Any, case: Case, plan: Plan) -> dict[str, Any]:
    """Compress the case's prefix with ``plan`` and score its continuation: ``nll_dense``,
    ``nll_increase``, ``relative_nll_increase``, ``agreement``, ``kl``, ``storage_ratio``, ``stored_bytes``."""
    cache = case.compressible()
    heldout = cache.num_tokens - case.prefix_tokens  # the capture case keeps its tail; text cases have none
    return _scores(model, case, compress_plan(cache, plan, heldout=heldout))


@torch.no_grad()
def press_inputs(model: Any, case: Case) -> Any:
    """What a kvpress press reads of the case's prefix (:class:`kvtool.hf.presses.AttentionInputs`:
    each layer's attention input, keys and values in the model's dtype, RoPE), from one more
    prefill of its ``P`` prefix tokens."""
    from kvtool.hf import presses as hfpress  # deferred: transformers loads only when a press is checked

    inputs = hfpress.AttentionInputs()
    ids = case.token_ids[:, :case.prefix_tokens]
    with hfpress.recording_inputs(model, inputs):
        cap = capturing.capture(model=(model, None), input_ids=ids, queries=False, dtype=dtype_name(next(model.parameters()).dtype))
    for i, layer in cap.layers.items():
        inputs.keys[i], inputs.values[i] = layer.keys, layer.values
    return inputs.trimmed(case.prefix_tokens)


def score_kept(model: Any, case: Case, kept: dict[int, list[torch.Tensor]], storage: str, label: str) -> dict[str, Any]:
    """:func:`score_case` for the tokens a selector (a kvpress press) kept of the case's prefix
    (``kept[i][h]``: positions ``[B, K]`` of KV head h), stored with ``storage``."""
    cache = case.compressible()
    cc = compress_kept(cache, {i: kept[i] for i in cache.layer_indices}, storage, label, heldout=cache.num_tokens - case.prefix_tokens)
    return _scores(model, case, cc)


def _scores(model: Any, case: Case, cc: Any) -> dict[str, Any]:
    cc.token_ids = case.token_ids
    res = model_fidelity(model, cc, case.reference)
    rep = cc.byte_report()
    return {
        "case": case.name,
        "nll_dense": res["nll_dense"],
        "nll_increase": res["nll_increase"],
        "relative_nll_increase": res["nll_increase"] / res["nll_dense"] if res["nll_dense"] else None,
        "agreement": res["agreement"],
        "kl": res["kl"],
        "storage_ratio": rep["storage_ratio"],
        "stored_bytes": rep["stored_bytes"],
    }


def intervals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"cases": rows, "<metric>": interval}`` over the cases' rows, as :func:`score_plans` gives."""
    return {"cases": rows, **{m: metric_interval(m, [r[m] for r in rows]) for m in ("relative_nll_increase", "nll_increase", "agreement", "kl")}}


def score_plans(model: Any, cases: list[Case], plans: dict[str, Plan], progress: Progress | None = None) -> dict[str, dict[str, Any]]:
    """Every plan on every case: ``{label: {"cases": [score_case rows], "<metric>": interval}}``
    for ``relative_nll_increase``, ``nll_increase``, ``agreement``, ``kl`` (first case = the capture
    when it is one of them; its own numbers are in ``cases[0]``)."""
    out: dict[str, dict[str, Any]] = {}
    for label, plan in plans.items():
        rows = []
        for case in cases:
            rows.append(score_case(model, case, plan))
            if progress is not None:
                progress.advance()
        out[label] = intervals(rows)
    return out


def score_format_on_cases(model: Any, cases: list[Case], fmt: Any, params: Any) -> list[dict[str, Any]]:
    """One format (not a plan) on text cases (prefix-only caches): ``nll_increase``,
    ``relative_nll_increase``, ``agreement``, ``kl`` per case."""
    rows = []
    for case in cases:
        cache = case.compressible()
        cc = compress_cache(cache, fmt, params, heldout=cache.num_tokens - case.prefix_tokens)
        cc.token_ids = case.token_ids
        res = model_fidelity(model, cc, case.reference)
        rows.append({"case": case.name, "nll_increase": res["nll_increase"], "relative_nll_increase": res["nll_increase"] / res["nll_dense"],
                     "agreement": res["agreement"], "kl": res["kl"]})
    return rows


def text_cases(model: Any, tokenizer: Any, texts: list[tuple[str, str]], tokens: int, heldout: int, layers: list[int] | None = None, dtype: str | None = None) -> list[Case]:
    return [text_case(model, tokenizer, text, name, tokens, heldout, layers, dtype) for name, text in texts]
