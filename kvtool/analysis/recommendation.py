"""``kvtool recommend`` end to end: sensitivity -> plan per budget -> model-level check against the
best uniform setting, over the capture's own continuation and held-out texts.

:func:`recommend_capture` measures the capture's sensitivity once (:mod:`kvtool.analysis.allocation`), solves
the allocation for each budget, and (with the model) scores each plan and a shortlist of uniform
settings that fit the same budget (the ``uniform_checks`` with the lowest predicted loss) on the
capture's continuation; the uniform setting with the lowest NLL there is the *best uniform*. Plan
and best uniform are then scored on every held-out text too (:mod:`kvtool.analysis.modelcheck`), giving the
mean and a 95% interval over all cases (the capture's continuation and the texts).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvtool.core import io
from kvtool.core.placement import resolve_device
from kvtool.core.streaming import open_capture
from kvtool.core.progress import Progress, or_silent
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats.plan import Plan
from kvtool.analysis.allocation import allocate, measure_sensitivity, menu, parse_budget, uniform_options
from kvtool.core.cache import KVCache
from kvtool.analysis.fidelity import dense_reference, model_fidelity
from kvtool.formats.plan import compress_plan
from kvtool.analysis.modelcheck import capture_case, text_case
from kvtool.analysis.fidelity import default_model_spec
from kvtool.hf import models
from kvtool import texts as shipped_texts
from kvtool.analysis.fidelity import check_model_facts
from kvtool.analysis.modelcheck import metric_interval, score_plans


WEIGHT_PROBE = "quant:bits=2"


def layer_weights(model: Any, cache, sens, heldout: int, probe: str = WEIGHT_PROBE, model_name: str = "the model", progress=None) -> dict[int, float]:
    """How much a layer's attention error costs the model, per unit of predicted loss: compress one
    layer at a time with ``probe`` and measure the KL of the next-token distributions on the prompt's
    last ``heldout`` tokens (not the held-out continuation), divided by that layer's predicted loss
    for ``probe``. Returns ``{layer: weight}`` normalised to mean 1 (1.0 everywhere when no layer
    shows any cost)."""
    if probe not in sens.specs:
        return {i: 1.0 for i, _ in sens.groups}
    col = sens.specs.index(probe)
    p = cache.num_tokens - heldout  # the calibration window ends where the held-out tokens begin
    window = KVCache(cache.facts, {i: l.slice_tokens(0, p) for i, l in cache.layers.items()}, cache.token_ids[:, :p], cache.info)
    ref = dense_reference(model, window.token_ids, p - heldout, 0, window, model_name)
    predicted_loss: dict[int, float] = {}
    for g, (i, _h) in enumerate(sens.groups):
        predicted_loss[i] = predicted_loss.get(i, 0.0) + float(sens.loss[g, col])
    raw: dict[int, float] = {}
    progress = or_silent(progress)
    progress.stage(f"layer weights ({probe} on one layer at a time), layers", len(predicted_loss))
    for i in sorted(predicted_loss):
        one = KVCache(cache.facts, {i: window.layers[i]}, window.token_ids, cache.info)
        cc = compress_plan(one, Plan({i: [probe]}), heldout=heldout)
        kl = model_fidelity(model, cc, ref)["kl"]
        raw[i] = kl / predicted_loss[i] if predicted_loss[i] > 0 else 0.0
        progress.advance()
    mean = sum(raw.values()) / len(raw) if raw else 0.0
    if mean <= 0:
        return {i: 1.0 for i in raw}
    return {i: v / mean for i, v in raw.items()}


def fit_exactly(cache, sens, fraction: float, heldout: int, buckets: int = 4000, tries: int = 4) -> tuple[Plan, dict[str, float]]:
    """:func:`~kvtool.analysis.allocation.allocate`, then compress the plan and count its bytes exactly (a KV
    head's bytes in the sensitivity table are its share of the layer's); when they exceed the budget,
    solve again with the budget lowered by the excess. ``predicted`` gains ``exact_bytes`` and
    ``exact_ratio``."""
    target = fraction
    for _ in range(tries):
        plan, pred = allocate(sens, target, cache.facts, buckets)
        rep = compress_plan(cache, plan, heldout).byte_report()
        pred.update({"exact_bytes": rep["compressed_bytes"], "exact_ratio": rep["ratio"]})
        if rep["ratio"] <= fraction + 1e-12 or fraction >= 1:
            return plan, pred
        target -= rep["ratio"] - fraction + 1e-4
    raise UsageError(f"no plan's exact bytes fit {100 * fraction:.2f}% after {tries} tries (the last took {100 * rep['ratio']:.2f}%); raise --budget slightly")


def _allocate_all(result: dict[str, Any], parsed: list[dict[str, Any]], cache, sens, heldout: int, buckets: int, capture: Path) -> None:
    for b in parsed:
        plan, pred = fit_exactly(cache, sens, b["fraction"], heldout, buckets)
        fitting = [r for r in uniform_options(sens) if r["ratio"] <= b["fraction"] + 1e-12]
        plan.extra.update({"budget": {"text": b["budget"], "fraction": b["fraction"], "how": b["how"]}, "predicted": pred,
                           "capture": str(capture), "heldout": heldout, "calibrate": sens.calibrate})
        result["budgets"].append({**b, "plan": plan, "predicted": pred, "uniform": fitting, "check": None, "best_uniform": None})


def load_cases(model: Any, tokenizer: Any, cache, heldout: int, texts: list[tuple[str, str]], model_name: str, progress=None) -> list:
    """The capture's continuation, then one case per text (cut to the capture's length)."""
    progress = or_silent(progress)
    progress.stage("model check: dense reference runs, texts", 1 + len(texts))
    cases = [capture_case(model, cache, heldout, "capture", model_name)]
    progress.advance()
    for name, text in texts:
        cases.append(text_case(model, tokenizer, text, name, cache.num_tokens, heldout, cache.layer_indices))
        progress.advance()
    return cases


def recommend_capture(
    capture: Path,
    budgets: list[str],
    batch: int | None = None,
    context: str | None = None,
    heldout: int = 64,
    per_head: bool = True,
    families: list[str] | None = None,
    model: str | None = None,
    use_model: bool = True,
    texts: list[Path] | None = None,
    use_texts: bool = True,
    uniform_checks: int = 3,
    buckets: int = 4000,
    progress: Progress | None = None,
    calibrate: str = "prefix",
    weights: bool = True,
    threads: int | None = 1,
    device: str | None = "auto",
) -> dict[str, Any]:
    """Plans for each budget, with their predicted and (with the model) measured cost.

    Returns ``{"capture", "model", "heldout", "menu", "sensitivity": {...}, "cases": [names],
    "budgets": [{"budget", "fraction", "how", "plan" (Plan), "predicted", "uniform" (rows fitting the
    budget), "check": {label: scores} or None, "best_uniform": spec or None}], "seconds"}``.

    ``weights``: with the model, scale each layer's losses by what its error costs the model
    (:func:`layer_weights`). ``threads``: torch CPU threads while it runs (1 by default: the work is
    many small operations, which a second thread slows down on a shared 2-core machine). ``device``:
    where the capture's layers are scored and the model runs (auto: CUDA when present)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _recommend(capture, budgets, batch, context, heldout, per_head, families, model, use_model, texts, use_texts,
                          uniform_checks, buckets, progress, calibrate, weights, resolve_device(device))
    finally:
        torch.set_num_threads(before)


def _recommend(capture, budgets, batch, context, heldout, per_head, families, model, use_model, texts, use_texts,
               uniform_checks, buckets, progress, calibrate, weights, dev=None) -> dict[str, Any]:
    start = time.perf_counter()
    progress = or_silent(progress)
    if not budgets:
        raise UsageError("give --budget, e.g. --budget 15%")
    if heldout < 1:
        raise UsageError(f"--heldout must be at least 1, got {heldout}")
    if uniform_checks < 1:
        raise UsageError(f"--uniform-checks must be at least 1, got {uniform_checks}")
    meta, _ = io.read_header(capture)
    io.check_schema(capture, meta, io.CAPTURE_SCHEMA)
    # every layer is scored many times: read once onto the device (checked as io.load checks)
    cache = open_capture(capture, parts=("keys", "values", "queries"), device=dev or "cpu").materialize()
    if cache.attention_mask is not None and bool((cache.attention_mask == 0).any()):
        raise UsageError(f"{capture} holds a left-padded batch; recommend needs equal-length prompts (recapture with --align truncate)")
    if cache.num_tokens <= heldout + 16:
        raise UsageError(f"{capture} has {cache.num_tokens} tokens, too few for --heldout {heldout} (capture a longer prompt or lower --heldout)")
    parsed = [dict(budget=b, **parse_budget(b, cache.facts, batch, context)) for b in budgets]
    specs = menu(cache.num_tokens - heldout, families)
    sens = measure_sensitivity(cache, specs, heldout, per_head, progress, calibrate)
    result: dict[str, Any] = {
        "capture": str(capture), "model_facts": cache.facts.to_dict(), "heldout": heldout, "per_head": per_head,
        "menu": sens.specs, "dropped": sens.errors, "calibrate": calibrate,
        "sensitivity": {"seconds": round(sens.seconds, 1), "groups": len(sens.groups), "dense_bytes": sens.dense_bytes,
                        "prefix_tokens": sens.prefix_tokens, "uniform": uniform_options(sens)},
        "budgets": [], "cases": [], "model": None,
    }
    spec = default_model_spec(cache.facts, model) if use_model else None
    if spec is None:
        _allocate_all(result, parsed, cache, sens, heldout, buckets, capture)
        result["model_skipped"] = "--no-model" if not use_model else f"the capture came from {cache.facts.name} ({cache.facts.source}); pass --model to check the plans on the model"
        result["seconds"] = round(time.perf_counter() - start, 1)
        return result

    progress.stage(f"loading the model {spec}")
    mdl, tok, source = models.load(spec, device=str(dev or "cpu"))
    name = source.name if spec in ("embedded", "smollm2") else str(spec)
    try:
        check_model_facts(mdl, cache.facts, name)
    except BadDataError as exc:
        raise BadDataError(f"{exc} (or pass --no-model for the predicted costs only)") from None
    if weights:
        w = layer_weights(mdl, cache, sens, heldout, model_name=name, progress=progress)
        for g, (i, _h) in enumerate(sens.groups):
            sens.loss[g] *= w[i]
        result["layer_weights"] = w
        result["sensitivity"]["uniform"] = uniform_options(sens)
    _allocate_all(result, parsed, cache, sens, heldout, buckets, capture)
    chosen_texts: list[tuple[str, str]] = []
    if texts:
        chosen_texts = shipped_texts.read_files(texts)
    elif use_texts and (cache.facts.source == "embedded" or model):
        chosen_texts = shipped_texts.shipped()
    cases = load_cases(mdl, tok, cache, heldout, chosen_texts, name, progress)
    result["model"] = name
    result["cases"] = [c.name for c in cases]
    per_budget = [1 + min(uniform_checks, len(b["uniform"])) + 1 for b in result["budgets"]]  # plan, shortlist, one above: on the capture
    progress.stage("model check: plans and uniform settings on the texts", sum(per_budget) + (len(cases) - 1) * 2 * len(result["budgets"]))
    for b in result["budgets"]:
        pct = f"{100 * b['fraction']:.0f}%"
        shortlist = sorted(b["uniform"], key=lambda r: r["loss"])[:uniform_checks]
        # the cheapest uniform setting with at least the plan's bytes (it may exceed the budget)
        above = [r for r in result["sensitivity"]["uniform"] if r["bytes"] >= b["predicted"]["bytes"] and r["spec"] not in {x["spec"] for x in shortlist}]
        b["uniform_above"] = above[0]["spec"] if above else None
        plans = {f"plan @ {pct}": b["plan"], **{r["spec"]: Plan({}, default=r["spec"]) for r in shortlist}}
        if above:
            plans[above[0]["spec"]] = Plan({}, default=above[0]["spec"])
        first = score_plans(mdl, cases[:1], plans, progress)
        uniform_labels = [r["spec"] for r in shortlist]  # the best uniform fits the budget
        best = min(uniform_labels, key=lambda s: first[s]["cases"][0]["nll_increase"]) if uniform_labels else None
        rest = score_plans(mdl, cases[1:], {k: plans[k] for k in [f"plan @ {pct}"] + ([best] if best else [])}, progress) if len(cases) > 1 else {}
        check = {}
        for label, scores in first.items():
            rows = scores["cases"] + (rest[label]["cases"] if label in rest else [])
            check[label] = {"cases": rows, **{m: metric_interval(m, [r[m] for r in rows]) for m in ("relative_nll_increase", "nll_increase", "agreement", "kl")}}
        b["check"] = check
        b["best_uniform"] = best
        b["plan_label"] = f"plan @ {pct}"
        b["plan"].extra["verified"] = {k: {m: v[m] for m in ("relative_nll_increase", "agreement", "kl")} | {"capture": v["cases"][0]} for k, v in check.items() if k == b["plan_label"] or k == best}
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result
