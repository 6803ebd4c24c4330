"""``kvtool recommend`` end to end: sensitivity -> plan per budget -> model-level check against the
best uniform setting, over the capture's own continuation and held-out texts.

:func:`recommend_capture` measures the capture's sensitivity once (:mod:`kvtool.analysis.allocation`), solves
the allocation for each budget, and (with the model) scores each plan and a shortlist of uniform
settings that fit the same budget (the ``uniform_checks`` with the lowest predicted loss) on the
capture's continuation; the uniform setting with the lowest NLL there is the *best uniform*. Plan
and best uniform are then scored on every held-out text too (:mod:`kvtool.analysis.modelcheck`), giving the
mean and a 95% interval over all cases (the capture's continuation and the texts).

Where it runs: ``--device`` lists the devices (``auto``: every visible GPU). The capture's layers
are read in one contiguous block per device and the sensitivity scores each layer where it was
read, the devices at once; the plans' exact bytes and everything the model does then run on the
first device, where the model loads.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from typing import Any, Callable

from kvtool.core import io
from kvtool.core.placement import device_label, layer_placement, resolve_devices
from kvtool.core.streaming import open_capture
from kvtool.core.progress import Progress, or_silent
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats.plan import Plan
from kvtool.analysis.allocation import SERVABLE_FAMILIES, Sensitivity, allocate, measure_sensitivity, menu, parse_budget, uniform_options
from kvtool.analysis.fill import FAMILIES, fill_spec, press_keep as fill_press_keep
from kvtool.analysis import menu as uniform_menu, taskrun
from kvtool.analysis.tasks import Tokens, generate_sample
from kvtool.hf import capture as capturing
from kvtool.hf import presses as hfpress

# the budget-filling uniform families a paged cache holds (no per-element pruning or selection)
SERVABLE_UNIFORM = uniform_menu.servable_families()
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


def fit_exactly(cache, sens, fraction: float, heldout: int, buckets: int = 4000, tries: int = 4, servable: str | None = None) -> tuple[Plan, dict[str, float]]:
    """:func:`~kvtool.analysis.allocation.allocate`, then compress the plan and count its bytes exactly (a KV
    head's bytes in the sensitivity table are its share of the layer's); when they exceed the budget,
    solve again with the budget lowered by the excess. ``predicted`` gains ``exact_stored_bytes`` and
    ``exact_storage_ratio``."""
    target = fraction
    for _ in range(tries):
        plan, pred = allocate(sens, target, cache.facts, buckets, servable)
        rep = compress_plan(cache, plan, heldout).byte_report()
        pred.update({"exact_stored_bytes": rep["stored_bytes"], "exact_storage_ratio": rep["storage_ratio"]})
        if rep["storage_ratio"] <= fraction + 1e-12 or fraction >= 1:
            return plan, pred
        target -= rep["storage_ratio"] - fraction + 1e-4
    raise UsageError(f"no plan's exact bytes fit {100 * fraction:.2f}% after {tries} tries (the last took {100 * rep['storage_ratio']:.2f}%); raise --budget slightly")


def _allocate_all(result: dict[str, Any], parsed: list[dict[str, Any]], cache, sens, heldout: int, buckets: int, capture: Path | str,
                  servable: str | None = None) -> None:
    for b in parsed:
        plan, pred = fit_exactly(cache, sens, b["fraction"], heldout, buckets, servable=servable)
        fitting = [r for r in uniform_options(sens) if r["storage_ratio"] <= b["fraction"] + 1e-12]
        plan.extra.update({"budget": {"text": b["budget"], "fraction": b["fraction"], "how": b["how"], "of": "float16 keys and values of the context (a share: the plan fits any length)"},
                           "predicted": pred, "capture": str(capture), "heldout": heldout, "calibrate": sens.calibrate})
        result["budgets"].append({**b, "plan": plan, "predicted": pred, "uniform": fitting, "check": None, "best_uniform": None})


def load_cases(model: Any, tokenizer: Any, cache, heldout: int, texts: list[tuple[str, str]], model_name: str, progress=None, score_tokens: int | None = None) -> list:
    """The capture's continuation, then one case per text: the text's first ``P`` tokens (the
    capture's prefix length) and the next ``score_tokens`` (default: ``heldout``) scored, its prefix
    stored in the capture's dtype."""
    progress = or_silent(progress)
    progress.stage("model check: dense reference runs, texts", 1 + len(texts))
    cases = [capture_case(model, cache, heldout, "capture", model_name)]
    progress.advance()
    w = score_tokens or heldout
    prefix = cache.num_tokens - heldout
    for name, text in texts:
        cases.append(text_case(model, tokenizer, text, name, prefix + w, w, cache.layer_indices, cache.facts.dtype))
        progress.advance()
    return cases


def check_servable(servable: str | None, families: list[str] | None, per_head: bool) -> list[str] | None:
    """The menu families for ``--servable`` (only those a paged cache holds), or ``families``."""
    if servable is None:
        return families
    if servable != "paged":
        raise UsageError(f"--servable must be paged, got {servable!r}")
    if not per_head:
        raise UsageError("--servable paged chooses per KV head within one token budget per layer; drop --per-layer")
    if families is None:
        return list(SERVABLE_FAMILIES)
    bad = [f for f in families if f not in SERVABLE_FAMILIES]
    if bad:
        raise UsageError(f"--servable paged: family {bad[0]} selects or prunes per element, which pages cannot hold; servable families: {', '.join(SERVABLE_FAMILIES)}")
    return families


def filled_uniform(fraction: float, cache, heldout: int, servable: str | None = None) -> dict[str, str]:
    """Per format family, the uniform setting that fills ``fraction`` of the float16 bytes of the
    capture's prefix (:func:`kvtool.analysis.fill.fill_spec`); families that cannot get that small
    are left out. With ``servable`` only the families a paged cache holds."""
    f = cache.facts
    out = {}
    for fam in FAMILIES:
        if servable and fam not in SERVABLE_UNIFORM:
            continue
        spec = fill_spec(fam, fraction, cache.num_tokens - heldout, f.num_kv_heads, f.num_heads, f.head_dim)
        if spec is not None:
            out[fam] = spec
    return out


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
    uniform_checks: int | None = None,
    buckets: int = 4000,
    progress: Progress | None = None,
    calibrate: str = "prefix",
    weights: bool = True,
    threads: int | None = 1,
    device: str | None = "auto",
    servable: str | None = None,
    score_tokens: int = 256,
    presses: bool | None = None,
    menu_filter: Callable[[list[str]], list[str]] | None = None,
) -> dict[str, Any]:
    """Plans for each budget, with their predicted and (with the model) measured cost.

    Returns ``{"capture", "model", "heldout", "menu", "sensitivity": {...}, "cases": [names],
    "budgets": [{"budget", "fraction", "how", "plan" (Plan), "predicted", "uniform" (rows fitting the
    budget), "check": {label: scores} or None, "best_uniform": spec or None}], "seconds"}``.

    ``uniform_checks``: how many budget-filling uniform families are checked on the model (those
    with the lowest predicted loss); None (default): every family of the menu
    (:data:`kvtool.analysis.menu.FAMILIES`), so ``best_uniform`` is the best of the whole menu on
    the cases (:func:`best_uniform`). ``presses``: also check every kvpress press x every storage
    (:func:`press_checks`); None (default): when every family is checked, kvpress is installed and
    the plan is not ``servable``.

    ``weights``: with the model, scale each layer's losses by what its error costs the model
    (:func:`layer_weights`). ``threads``: torch CPU threads while it runs (1 by default: the work is
    many small operations, which a second thread slows down on a shared 2-core machine). ``device``:
    where the capture's layers are read and scored: ``auto`` (every visible GPU; the CPU without
    one), one device, or a list such as ``"cuda:0,cuda:1"``; with several, the layers are cut into
    one contiguous block per device and the devices score their layers at once (the same numbers
    as on one device). The model, and the plans' checks on it, run on the first device. The
    result's ``"device"`` names the devices (``"cuda:0,cuda:1"``). ``menu_filter``: keeps some of
    the candidate specs (``recommend --min-speedup``: :mod:`kvtool.analysis.speed`)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _recommend(capture, budgets, batch, context, heldout, per_head, families, model, use_model, texts, use_texts,
                          uniform_checks, buckets, progress, calibrate, weights, resolve_devices(device), servable, score_tokens, presses, menu_filter)
    finally:
        torch.set_num_threads(before)


def _recommend(capture, budgets, batch, context, heldout, per_head, families, model, use_model, texts, use_texts,
               uniform_checks, buckets, progress, calibrate, weights, devices=None, servable=None, score_tokens=256, presses=None,
               menu_filter=None) -> dict[str, Any]:
    start = time.perf_counter()
    devices = list(devices or [torch.device("cpu")])
    dev = devices[0]  # where the model loads and whatever needs one device runs
    progress = or_silent(progress)
    if not budgets:
        raise UsageError("give --budget, e.g. --budget 15%")
    if heldout < 1:
        raise UsageError(f"--heldout must be at least 1, got {heldout}")
    if uniform_checks is None:
        uniform_checks = len(FAMILIES)
    if uniform_checks < 1:
        raise UsageError(f"--uniform-checks must be at least 1, got {uniform_checks}")
    meta, _ = io.read_header(capture)
    io.check_schema(capture, meta, io.CAPTURE_SCHEMA)
    # every layer is scored many times: read once (checked as io.load checks) onto its device, the
    # layers cut into one contiguous block per device; measure_sensitivity scores each where it lives
    lazy = open_capture(capture, parts=("keys", "values", "queries"), device=dev)
    placement = layer_placement(lazy.layer_indices, devices)
    cache = KVCache(lazy.facts, {i: lazy.read_layer(i, d) for i, d in placement.items()}, lazy.token_ids, lazy.info, lazy.attention_mask)
    if cache.attention_mask is not None and bool((cache.attention_mask == 0).any()):
        raise UsageError(f"{capture} holds a left-padded batch; recommend needs equal-length prompts (recapture with --align truncate)")
    if cache.num_tokens <= heldout + 16:
        raise UsageError(f"{capture} has {cache.num_tokens} tokens, too few for --heldout {heldout} (capture a longer prompt or lower --heldout)")
    parsed = [dict(budget=b, **parse_budget(b, cache.facts, batch, context)) for b in budgets]
    families = check_servable(servable, families, per_head)
    specs = menu(cache.num_tokens - heldout, families)
    specs = menu_filter(specs) if menu_filter else specs
    sens = measure_sensitivity(cache, specs, heldout, per_head, progress, calibrate, placement)
    if len(devices) > 1:
        # what follows (each plan's exact bytes, the model's checks) runs on one device: the layers
        # gather on the first, which then holds them all as a single --device would
        cache = KVCache(cache.facts, {i: l.to(dev) for i, l in cache.layers.items()}, cache.token_ids, cache.info, cache.attention_mask)
    result: dict[str, Any] = {
        "capture": str(capture), "model_facts": cache.facts.to_dict(), "heldout": heldout, "per_head": per_head,
        "menu": sens.specs, "dropped": sens.errors, "calibrate": calibrate, "servable": servable, "device": device_label(devices),
        "sensitivity": {"seconds": round(sens.seconds, 1), "groups": len(sens.groups), "dense_bytes": sens.dense_bytes,
                        "prefix_tokens": sens.prefix_tokens, "uniform": uniform_options(sens)},
        "budgets": [], "cases": [], "model": None,
    }
    spec = default_model_spec(cache.facts, model) if use_model else None
    if spec is None:
        _allocate_all(result, parsed, cache, sens, heldout, buckets, capture, servable)
        result["model_skipped"] = "--no-model" if not use_model else f"the capture came from {cache.facts.name} ({cache.facts.source}); pass --model to check the plans on the model"
        result["seconds"] = round(time.perf_counter() - start, 1)
        return result

    progress.stage(f"loading the model {spec}")
    mdl, tok, source = models.load(spec, device=str(dev))
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
    _allocate_all(result, parsed, cache, sens, heldout, buckets, capture, servable)
    chosen_texts: list[tuple[str, str]] = []
    if texts:
        chosen_texts = shipped_texts.read_files(texts)
    elif use_texts and (cache.facts.source == "embedded" or model):
        chosen_texts = shipped_texts.shipped()
    cases = load_cases(mdl, tok, cache, heldout, chosen_texts, name, progress, score_tokens)
    result["model"] = name
    result["cases"] = [c.name for c in cases]
    result["score_tokens"] = {"capture": heldout, "texts": score_tokens}
    if presses is None:  # the whole menu: kvpress's presses too, where kvpress is installed
        presses = uniform_checks >= len(FAMILIES) and not servable and uniform_menu.kvpress_installed()
    n_presses = len(uniform_menu.press_methods(uniform_menu.PRESSES)) if presses else 0
    per_budget = [1 + min(uniform_checks, len(FAMILIES)) + n_presses for _ in result["budgets"]]  # plan and the budget-filling families, on the capture
    progress.stage("model check: plans and uniform settings on the texts", sum(per_budget) * len(cases))
    press_state: dict[tuple, Any] = {}
    for b in result["budgets"]:
        pct = f"{100 * b['fraction']:.0f}%"
        fills = filled_uniform(b["fraction"], cache, heldout, servable)
        if len(fills) > uniform_checks:
            # the families with the lowest predicted loss (their attention error on the prompt's tail)
            small = measure_sensitivity(cache, list(fills.values()), heldout, False, None, calibrate)
            order = sorted(range(len(small.specs)), key=lambda c: float(small.loss[:, c].sum()))
            keep = {small.specs[c] for c in order[:uniform_checks]}
            fills = {f: sp for f, sp in fills.items() if sp in keep}
        b["uniform_fills"] = fills
        shortlist = [{"spec": sp} for sp in fills.values()]
        plans = {f"plan @ {pct}": b["plan"], **{r["spec"]: Plan({}, default=r["spec"]) for r in shortlist}}
        # the plan and every budget-filling family on every case: the best uniform setting is the one
        # with the lowest mean relative NLL increase over the cases, and per case the lowest KL of
        # any family is kept too (the plan is compared with the best family of each text)
        first = score_plans(mdl, cases[:1], plans, progress)
        uniform_labels = [r["spec"] for r in shortlist]  # every one fills the budget
        rest = score_plans(mdl, cases[1:], plans, progress) if len(cases) > 1 else {}
        check = {}
        for label, scores in first.items():
            rows = scores["cases"] + (rest[label]["cases"] if label in rest else [])
            check[label] = {"cases": rows, **{m: metric_interval(m, [r[m] for r in rows]) for m in ("relative_nll_increase", "nll_increase", "agreement", "kl")}}
        if presses:
            found = press_checks(mdl, cases, b["fraction"], cache.facts.head_dim, press_state, progress)
            check.update(found)
            uniform_labels += list(found)
        best = best_uniform(check, uniform_labels)
        b["best_uniform_kl_per_case"] = {c["case"]: min(check[s]["cases"][n]["kl"] for s in uniform_labels)
                                         for n, c in enumerate(check[f"plan @ {pct}"]["cases"])} if uniform_labels else {}
        b["check"] = check
        b["best_uniform"] = best
        b["plan_label"] = f"plan @ {pct}"
        b["plan"].extra["verified"] = {k: {m: v[m] for m in ("relative_nll_increase", "agreement", "kl")} | {"capture": v["cases"][0]} for k, v in check.items() if k == b["plan_label"] or k == best}
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def press_checks(model: Any, cases: list, fraction: float, head_dim: int, state: dict[tuple, Any] | None = None, progress=None) -> dict[str, dict[str, Any]]:
    """Every kvpress press x every storage of the menu (:func:`kvtool.analysis.menu.press_methods`)
    on every case, each press keeping the share of the case's prefix that fills ``fraction`` of its
    float16 bytes (kept positions counted, :func:`kvtool.analysis.fill.press_keep`): ``{"press:NAME
    [+STORAGE]": {"cases": [...], "<metric>": interval}}`` as :func:`score_plans` gives. A press
    that cannot store that little is left out. ``state`` keeps each case's recorded attention inputs
    and each press's scores between calls (one prefill per case for all budgets)."""
    from kvtool.analysis.modelcheck import intervals, press_inputs, score_kept  # deferred: the model check loads only when presses are checked

    state = {} if state is None else state
    out: dict[str, dict[str, Any]] = {}
    for method in uniform_menu.press_methods(uniform_menu.PRESSES):
        m = taskrun.parse_method(method)
        rows = []
        for case in cases:
            keep = fill_press_keep(fraction, case.prefix_tokens, head_dim, m.storage)
            if keep is None:
                break
            inputs = state.get(("inputs", case.name))
            if inputs is None:
                inputs = state[("inputs", case.name)] = press_inputs(model, case)
            press = state.get(("press", case.name, m.name))
            if press is None:  # one press per name and case: its scores are reused across budgets and storages
                press = state[("press", case.name, m.name)] = hfpress.reuse_scores(hfpress.make_press(hfpress.parse_press(m.name, keep=keep)))
            hfpress.set_keep(press, keep)
            kept = hfpress.press_kept(model, press, inputs, case.compressible().layer_indices)
            rows.append(score_kept(model, case, kept, m.storage, f"kvpress {m.label}"))
            if progress is not None:
                progress.advance()
        if rows and len(rows) == len(cases):
            out[m.label] = intervals(rows)
    return out


def best_uniform(check: dict[str, Any], labels: list[str], objective: str = "nll") -> str | None:
    """The best uniform setting of one budget among ``labels`` (the budget-filling settings that
    were checked: by default every family of :data:`kvtool.analysis.menu.FAMILIES`, and with
    ``--objective tasks`` every kvpress press x storage too when kvpress is installed).

    ``objective="nll"``: ``check`` maps a label to its model check over the cases
    (``{"relative_nll_increase": {"mean", ...}, ...}``); the best has the lowest mean relative NLL
    increase. ``objective="tasks"``: ``check`` maps a setting to its ``by_setting`` row of a task
    check (``{"accuracy", "lo", "storage_ratio", ...}``); the best has the highest accuracy (ties:
    the higher interval low end, then the fewer bytes). None when no label was checked."""
    present = [s for s in labels if s in check]
    if not present:
        return None
    if objective == "nll":
        return min(present, key=lambda s: check[s]["relative_nll_increase"]["mean"])
    if objective == "tasks":
        rows = [s for s in present if check[s].get("accuracy") is not None]
        if not rows:
            return None
        return max(rows, key=lambda s: (check[s]["accuracy"], check[s].get("lo") or 0.0, -(check[s].get("storage_ratio") or 0.0)))
    raise UsageError(f"objective must be nll or tasks, got {objective!r}")


def task_check_methods(servable: str | None = None, presses: bool | None = None) -> list[Any]:
    """The methods a ``--objective tasks`` check runs: dense, then the whole uniform menu that fills
    a budget: every family (:data:`kvtool.analysis.menu.FAMILIES`; with ``servable`` only those a
    paged cache holds) and, when kvpress is installed (``presses=None``) or asked for, every press x
    every storage (:func:`kvtool.analysis.menu.press_methods`; not with ``servable``)."""
    methods = [taskrun.Method("dense", "dense")] + [taskrun.Method("uniform", f) for f in FAMILIES if not servable or f in SERVABLE_UNIFORM]
    if presses is None:
        presses = uniform_menu.kvpress_installed()
    if presses and not servable:
        methods += [taskrun.parse_method(m) for m in uniform_menu.press_methods()]
    return methods


# ----------------------------------------------------------------------------- objective: tasks


def task_cases(model: Any, tokenizer: Any, tasks: list[str], lengths: list[int], samples: int, seed: int, progress=None) -> list[tuple[Any, int]]:
    """Calibration cases for ``--objective tasks``: per task, length and index, the sample's context,
    question and answer captured in one pass (queries of every token), with ``heldout`` = the
    question and answer tokens. Their queries score the candidates on the compressed context only
    (the compressor never sees them)."""
    tok = Tokens(tokenizer)
    out = []
    progress = or_silent(progress)
    progress.stage("calibration: task samples captured", len(tasks) * len(lengths) * samples)
    for task in tasks:
        for length in lengths:
            for i in range(samples):
                s = generate_sample(tokenizer, task, length, seed, i, tok)
                ids = torch.tensor([s.context + s.question + s.answer])
                cache = capturing.capture(model=(model, tokenizer), input_ids=ids, queries=True, dtype="float16")
                out.append((cache, len(s.question) + len(s.answer)))
                progress.advance()
    return out


def combined_sensitivity(cases: list[tuple[Any, int]], specs: list[str], per_head: bool, progress=None) -> Any:
    """The sensitivity over several calibration cases: each case's losses (its held-out queries over
    its compressed prefix) averaged, and bytes as shares of each case's float16 bytes averaged, so
    ``dense_bytes`` is 1 and a budget is a share."""
    parts = []
    for cache, heldout in cases:
        parts.append(measure_sensitivity(cache, specs, heldout, per_head, progress, "heldout"))
    common = [s for s in parts[0].specs if all(s in p.specs for p in parts)]
    errors: dict[str, str] = {}
    for p in parts:
        errors.update(p.errors)
    cols = [[p.specs.index(s) for s in common] for p in parts]
    loss = sum(p.loss[:, c] for p, c in zip(parts, cols)) / len(parts)
    shares = sum(p.bytes[:, c] / p.dense_bytes for p, c in zip(parts, cols)) / len(parts)
    first = parts[0]
    return Sensitivity(first.groups, common, shares, loss, 1, first.prefix_tokens, first.heldout, errors,
                       sum(p.seconds for p in parts), "tasks")


def task_layer_weights(model: Any, cases: list[tuple[Any, int]], sens: Any, probe: str = WEIGHT_PROBE, progress=None) -> dict[int, float]:
    """:func:`layer_weights` for task calibration: each layer alone compressed with ``probe``; the KL
    of the next-token distributions over the question and answer of every case, divided by the
    layer's predicted loss, normalised to mean 1."""
    if probe not in sens.specs:
        return {i: 1.0 for i, _ in sens.groups}
    col = sens.specs.index(probe)
    predicted_loss: dict[int, float] = {}
    for g, (i, _h) in enumerate(sens.groups):
        predicted_loss[i] = predicted_loss.get(i, 0.0) + float(sens.loss[g, col])
    kl: dict[int, float] = {i: 0.0 for i in predicted_loss}
    progress = or_silent(progress)
    progress.stage(f"layer weights ({probe} on one layer at a time), cases x layers", len(cases) * len(predicted_loss))
    for cache, heldout in cases:
        p = cache.num_tokens - heldout
        ref = dense_reference(model, cache.token_ids, p, 0, cache)
        for i in sorted(predicted_loss):
            one = KVCache(cache.facts, {i: cache.layers[i]}, cache.token_ids, cache.info)
            cc = compress_plan(one, Plan({i: [probe]}), heldout=heldout)
            kl[i] += model_fidelity(model, cc, ref)["kl"] / len(cases)
            progress.advance()
    raw = {i: kl[i] / predicted_loss[i] if predicted_loss[i] > 0 else 0.0 for i in kl}
    mean = sum(raw.values()) / len(raw) if raw else 0.0
    return {i: (v / mean if mean > 0 else 1.0) for i, v in raw.items()}


def recommend_tasks(
    budgets: list[str],
    tasks: list[str],
    lengths: list[int],
    calib_samples: int = 1,
    calib_seed: int = 1,
    check_samples: int = 5,
    check_seed: int = 0,
    per_head: bool = True,
    families: list[str] | None = None,
    model: str | None = None,
    weights: bool = True,
    buckets: int = 4000,
    servable: str | None = None,
    progress: Progress | None = None,
    threads: int | None = 1,
    menu_filter: Callable[[list[str]], list[str]] | None = None,
) -> dict[str, Any]:
    """Plans for each budget calibrated on task samples (``--objective tasks``): the sensitivity is
    the attention error of the questions' and answers' queries over the compressed contexts of
    ``calib_samples`` samples per task and length (seed ``calib_seed``), layers weighted by their
    measured cost on those answers; then, with ``check_samples`` > 0, the plan, the dense model and
    every budget-filling uniform family answer ``check_samples`` other samples per task and length
    (seed ``check_seed``, which must differ from ``calib_seed``): accuracy with 95% intervals."""
    return taskrun.with_threads(threads, lambda: _recommend_tasks(budgets, tasks, lengths, calib_samples, calib_seed, check_samples, check_seed,
                                                                  per_head, families, model, weights, buckets, servable, progress, menu_filter))


def _recommend_tasks(budgets, tasks, lengths, calib_samples, calib_seed, check_samples, check_seed, per_head, families, model,
                     weights, buckets, servable, progress, menu_filter=None) -> dict[str, Any]:
    start = time.perf_counter()
    if not budgets:
        raise UsageError("give --budget, e.g. --budget 15%")
    if calib_samples < 1:
        raise UsageError(f"--calib-samples must be at least 1, got {calib_samples}")
    if check_samples and check_seed == calib_seed:
        raise UsageError(f"--check-seed {check_seed} equals --calib-seed: the plan would be checked on the samples it was calibrated on")
    mdl, tok, source = models.load(model)
    name = source.name
    facts = models.facts_of(mdl, source, "float16")
    parsed = [dict(budget=b, **parse_budget(b, facts)) for b in budgets]
    families = check_servable(servable, families, per_head)
    specs = menu(None, families)
    specs = menu_filter(specs) if menu_filter else specs
    progress = or_silent(progress)
    cases = task_cases(mdl, tok, tasks, lengths, calib_samples, calib_seed, progress)
    sens = combined_sensitivity(cases, specs, per_head, progress)
    result: dict[str, Any] = {
        "objective": "tasks", "model": name, "model_facts": facts.to_dict(), "per_head": per_head, "servable": servable,
        "calibration": {"tasks": tasks, "lengths": lengths, "samples": calib_samples, "seed": calib_seed},
        "menu": sens.specs, "dropped": sens.errors, "calibrate": "tasks", "heldout": None,
        "sensitivity": {"seconds": round(sens.seconds, 1), "groups": len(sens.groups), "dense_bytes": 1, "prefix_tokens": sens.prefix_tokens,
                        "uniform": uniform_options(sens)},
        "budgets": [], "cases": [],
    }
    if weights:
        w = task_layer_weights(mdl, cases, sens, progress=progress)
        for g, (i, _h) in enumerate(sens.groups):
            sens.loss[g] *= w[i]
        result["layer_weights"] = w
        result["sensitivity"]["uniform"] = uniform_options(sens)
    first_cache, first_heldout = cases[0]
    _allocate_all(result, parsed, first_cache, sens, first_heldout, buckets, f"task samples (seed {calib_seed})", servable)
    for b in result["budgets"]:
        b["plan"].extra.update({"objective": "tasks", "calibration": result["calibration"]})
        b["plan"].extra.pop("capture", None)
        b["plan"].extra.pop("heldout", None)
    if check_samples:
        methods = task_check_methods(servable)
        if not any(m.kind == "press" for m in methods):
            progress.note("task check: the uniform menu holds kvtool's families only" + (" (--servable)" if servable else
                          f" (kvpress is not installed: {hfpress.INSTALL})"))
        for b in result["budgets"]:
            pct = f"{100 * b['fraction']:g}%"
            plan_method = taskrun.Method("plan", "recommended", plan=b["plan"])
            rows = []
            sample_tok = Tokens(tok)
            progress.stage(f"task check @ {pct}: samples", len(tasks) * len(lengths) * check_samples)
            nominal: dict = {}
            for task in tasks:
                for length in lengths:
                    for i in range(check_samples):
                        s = generate_sample(tok, task, length, check_seed, i, sample_tok)
                        todo = taskrun.settings_of(methods, [b["fraction"]]) + [taskrun.Setting(plan_method, b["fraction"])]
                        rows += taskrun.run_sample(mdl, tok, s, todo, False, "forced", nominal)
                        progress.advance()
            summary = taskrun.summarize(rows)
            b["task_check"] = summary
            b["plan_label"] = f"plan:recommended @ {pct}"
            by = {r["setting"]: r for r in summary["by_setting"]}
            uniform = [r["setting"] for r in summary["by_setting"] if r["method"] in FAMILIES or r["method"].startswith("press:")]
            label = best_uniform(by, uniform, "tasks")
            best = by[label] if label else None
            b["best_uniform"] = label
            plan_row = next((r for r in summary["by_setting"] if r["method"].startswith("plan:")), None)
            b["plan"].extra["verified"] = {"tasks": {"plan": plan_row, "dense": by.get("dense"), "best_uniform": best}}
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result
