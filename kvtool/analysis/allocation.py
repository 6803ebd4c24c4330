"""Choosing a compression plan for a byte budget (the library behind ``kvtool recommend``).

1. **Menu** (:func:`menu`): candidate settings of every format and composition kvtool has (dense,
   KIVI bits and group sizes, bitmap sparsities, bitmapq, sign-VQ, page selection, SnapKV +
   StreamingLLM eviction at several budgets, eviction + quantisation pipelines). Token budgets are
   fractions of the capture's prefix, so the menu fits any capture length.
2. **Sensitivity** (:func:`measure_sensitivity`): every layer's prefix is encoded with every
   candidate and ``W`` queries no candidate saw attend to it as a decode step would (encoded prefix +
   their dense causal window, :func:`kvtool.analysis.fidelity.heldout_output`): by default the prompt's last
   ``W`` queries over the ``P - W`` tokens before them (``calibrate="prefix"``, so the capture's
   held-out continuation stays out of the choice), or the held-out queries over the whole prefix. The loss of candidate c on KV head h of layer l is that
   head's squared attention-output error over the layer's squared reference norm
   (``sum over its query heads of ||out - ref||^2 / ||ref_layer||^2``), so a layer's loss is its
   squared relative L2 error and losses add over heads and layers. Bytes are the candidate's
   stored bytes of that layer (split evenly over the KV heads: a head's share).
3. **Allocation** (:func:`solve_knapsack`): a multiple-choice knapsack, one candidate per group
   (layer, or KV head of a layer), minimising the summed loss under the byte budget: an exact
   dynamic programme over byte buckets, every cost rounded *up* to whole buckets (so a solution
   never exceeds the budget; finer buckets only tighten it).
4. **Uniform baselines** (:func:`uniform_options`): each candidate on every layer, with its bytes and
   predicted loss, for the model-level comparison in :mod:`kvtool.commands.recommend`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from kvtool.core.attention import dense_attention
from kvtool.core.cache import KVCache, LayerKV, REFERENCE_BYTES, dense_reference_bytes
from kvtool.core.placement import run_per_device
from kvtool.core.progress import Progress, or_silent
from kvtool.core.streaming import LazyCapture
from kvtool.core.errors import KvtoolError, UsageError
from kvtool.analysis.fidelity import HeldoutData, heldout_output
from kvtool.formats.base import serving_nbytes
from kvtool.formats.mixed import resolve_spec
from kvtool.formats.plan import Plan, model_shape

# Shares of the prefix kept by the eviction candidates (SnapKV + sinks + recent), and by the eviction +
# KIVI 4 / 2-bit pipelines: shares, not token counts, so a plan fits captures of any length. The
# smallest pipelines store 1-2% of the float16 bytes, so a plan at 5% can still keep a few heads whole
EVICT_SHARES = (0.0625, 0.125, 0.25, 0.5)
PIPELINE_SHARES = (0.0625, 0.125, 0.25, 0.5)
PIPELINE_SHARES_2BIT = (0.0625, 0.125, 0.25, 0.5)
KIVI_STORE = "quant:bits={bits},group=32,residual=0,partial=true"
# families whose files the paged layout (FlashInfer, vLLM) holds as they are: every head of a layer
# keeps the same tokens count when the layer's candidates share one token share
SERVABLE_FAMILIES = ("dense", "quant", "evict", "pipeline")


def menu(prefix_tokens: int | None = None, families: list[str] | None = None) -> list[str]:
    """Candidate specs (every token budget a share of the prefix, so the menu and the plans it makes
    fit any capture length; ``prefix_tokens`` is accepted for callers that pass it).

    ``families`` (names such as ``quant``, ``bitmap``, ``evict``, ``pipeline``) restricts the menu."""
    specs = {
        "dense": ["dense"],
        "quant": ["quant:bits=8", "quant:bits=4", "quant:bits=4,group=128,residual=0,partial=true",
                  "quant:bits=2", "quant:bits=2,group=64,residual=0,partial=true", "quant:bits=2,group=128,residual=0,partial=true",
                  "quant:bits=2,group=64,residual=0,partial=true,rotate=hadamard", "quant:bits=2,group=128,residual=0,partial=true,rotate=hadamard"],
        "bitmap": ["bitmap:sparsity=0.5", "bitmap:sparsity=0.7", "bitmap:sparsity=0.9"],
        "bitmapq": ["bitmapq:sparsity=0.5,bits=4", "bitmapq:sparsity=0.7,bits=4", "bitmapq:sparsity=0.5,bits=2"],
        "signvq": ["signvq:bits=2", "signvq:bits=4"],
        "pagestat": ["pagestat:budget_ratio=0.25"],
        "evict": [f"snapstream:share={s:g}" for s in EVICT_SHARES],
        "pipeline": [f"snapkv:share={s:g}+" + KIVI_STORE.format(bits=4) for s in PIPELINE_SHARES]
                    + [f"snapkv:share={s:g}+" + KIVI_STORE.format(bits=2) for s in PIPELINE_SHARES_2BIT],
    }
    chosen = families or list(specs)
    unknown = [f for f in chosen if f not in specs]
    if unknown:
        raise UsageError(f"--menu {unknown[0]!r} is not a family; families: {', '.join(specs)}")
    out = [s for f in chosen for s in specs[f]]
    return out if "dense" in out else ["dense"] + out


def token_share(spec: str) -> float:
    """The share of a prefix's tokens a candidate keeps: its eviction share, 1.0 when it keeps
    every token (quantisation, pruning, dense). UsageError for an absolute token budget."""
    import re

    first = spec.split("+")[0]
    m = re.search(r"(?:^|[:,])share=([0-9.]+)", first)
    if m:
        return float(m.group(1))
    if first.startswith(("snapstream", "snapkv", "streaming")):
        raise UsageError(f"candidate {spec!r} keeps an absolute number of tokens; a servable plan needs shares (share=0.25)")
    return 1.0


@dataclass
class Sensitivity:
    """Per group (``groups[g] = (layer, kv_head or None)``) and candidate (``specs[c]``): stored
    ``bytes[g, c]`` and ``loss[g, c]`` (float64 tensors); ``dense_bytes`` of the whole prefix;
    ``errors[spec]`` the reason a candidate was dropped (it could not encode some layer)."""

    groups: list[tuple[int, int | None]]
    specs: list[str]
    bytes: torch.Tensor
    loss: torch.Tensor
    dense_bytes: int
    prefix_tokens: int
    heldout: int
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    calibrate: str = "prefix"


def _layer_errors(fmt, params, head: LayerKV, data: HeldoutData, ref: torch.Tensor, hkv: int) -> tuple[int, torch.Tensor]:
    """(stored bytes, squared output error per KV head ``[Hkv]``) of one candidate on one layer."""
    enc = fmt.encode(head, params)
    out = heldout_output(fmt, enc, data)
    sq = ((out - ref) ** 2).sum(dim=(0, 2, 3))  # [H]
    return int(sum(serving_nbytes(fmt, enc, head.keys.dtype).values())), sq.reshape(hkv, -1).sum(-1).double()


def _layer_sensitivity(full: LayerKV, resolved: list, prefix: int, calib_prefix: int, heldout: int, hkv: int,
                       skip: Callable[[int], bool]) -> tuple[int, torch.Tensor, torch.Tensor, dict[int, str]]:
    """One layer's (dense bytes of its prefix, stored bytes ``[Hkv, C]``, losses ``[Hkv, C]``, the
    candidates ``{c: reason}`` that failed on it), computed where its tensors are; candidates for
    which ``skip(c)`` is true are left out (zeros)."""
    head = full.slice_tokens(0, prefix)
    cal = full.slice_tokens(0, calib_prefix + heldout)
    cal_head = cal.slice_tokens(0, calib_prefix)
    data = HeldoutData(cal.queries[:, :, calib_prefix:], cal.keys, cal.values, cal.keys[:, :, calib_prefix:], cal.values[:, :, calib_prefix:])
    ref = dense_attention(data.queries, data.keys, data.values, causal=True).float()
    ref_sq = float((ref**2).sum()) or 1.0
    dense = dense_reference_bytes(*head.keys.shape[:3], head.keys.shape[3])
    byte_row = torch.zeros(hkv, len(resolved), dtype=torch.float64)
    loss_row = torch.zeros(hkv, len(resolved), dtype=torch.float64)
    failed: dict[int, str] = {}
    for c, (_spec, fmt, params) in enumerate(resolved):
        if skip(c):
            continue
        try:
            fmt.check(cal_head, params)
            nb, sq = _layer_errors(fmt, params, cal_head, data, ref, hkv)
            if calib_prefix != prefix:
                fmt.check(head, params)
                nbytes = int(sum(fmt.nbytes(fmt.encode(head, params)).values()))
            else:
                nbytes = nb
        except KvtoolError as exc:
            failed[c] = str(exc)
            continue
        byte_row[:, c] = nbytes / hkv
        loss_row[:, c] = sq / ref_sq
    return dense, byte_row, loss_row, failed


def _layer_devices(cache: KVCache, layers: list[int]) -> dict[int, torch.device]:
    """Where each layer's tensors live (a capture read lazily: where it reads them)."""
    if isinstance(cache, LazyCapture):
        return {i: cache.device for i in layers}
    return {i: cache.layers[i].keys.device for i in layers}


def measure_sensitivity(
    cache: KVCache,
    specs: list[str],
    heldout: int,
    per_head: bool = True,
    progress: Progress | None = None,
    calibrate: str = "prefix",
    placement: Mapping[int, torch.device] | None = None,
) -> Sensitivity:
    """Encode every layer's prefix with every candidate and score queries no candidate saw (see the
    module docstring). A candidate that fails on some layer is dropped and reported in ``errors``
    (``"layer i: why"``, i the lowest layer it fails on).

    Each layer is scored where its tensors live (``placement``, ``{layer: device}``, says where
    when given: the placement the layers were read with; two CPU "devices" ``cpu`` and ``cpu:0``
    are told apart only there): a cache whose layers sit on several devices (read per
    :func:`kvtool.core.placement.layer_placement`) is scored on them at once, one thread per
    device (:func:`kvtool.core.placement.run_per_device`); one device runs the layers in order,
    without threads. Either way the numbers are the same, bit for bit: every layer's math is the
    same, and the rows are assembled in layer order.

    ``calibrate="prefix"`` (default) scores the last ``heldout`` queries *of the prefix* against the
    prefix before them, so the capture's own held-out continuation stays out of the choice and can
    judge it; ``"heldout"`` scores the held-out queries themselves. Bytes are always those of the
    full prefix (``T - heldout`` tokens)."""
    if calibrate not in ("prefix", "heldout"):
        raise UsageError(f"--calibrate must be prefix or heldout, got {calibrate!r}")
    import time

    start = time.perf_counter()
    if not cache.has_queries:
        raise UsageError("the capture has no queries, which recommend scores; recapture without --no-queries")
    t = cache.num_tokens
    if not 1 <= heldout < t:
        raise UsageError(f"--heldout {heldout} must be at least 1 and below the capture's {t} tokens")
    prefix = t - heldout
    calib_prefix = prefix - heldout if calibrate == "prefix" else prefix
    if calib_prefix < 16:
        raise UsageError(f"the capture's {t} tokens leave {calib_prefix} prefix tokens to calibrate on with --heldout {heldout}; capture a longer prompt, lower --heldout or use --calibrate heldout")
    hkv = cache.facts.num_kv_heads
    resolved = []
    errors: dict[str, str] = {}
    for s in specs:
        try:
            resolved.append((s, *resolve_spec(s)))
        except KvtoolError as exc:
            errors[s] = str(exc)
    layers = cache.layer_indices
    n_c = len(resolved)
    progress = or_silent(progress)
    progress.stage(f"sensitivity of {n_c} candidates, layers", len(layers))
    # the lowest layer each candidate is known to fail on, shared by the devices' threads: a layer
    # above it skips the candidate (it is dropped anyway); the layers below it still try it, so the
    # lowest failing layer is always found (one device, layers in order: exactly the serial loop)
    lowest_failure: dict[int, int] = {}
    lock = threading.Lock()

    def one(i: int, _device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor, dict[int, str]]:
        def skip(c: int) -> bool:
            with lock:
                return lowest_failure.get(c, i) < i

        out = _layer_sensitivity(cache.layers[i], resolved, prefix, calib_prefix, heldout, hkv, skip)
        with lock:
            for c in out[3]:
                lowest_failure[c] = min(lowest_failure.get(c, i), i)
        return out

    where = {i: placement[i] for i in layers} if placement is not None else _layer_devices(cache, layers)
    rows = run_per_device(one, where, on_done=lambda i: progress.advance())
    # candidate failures in the order the serial loop meets them (layer, then candidate); each
    # candidate reported at its lowest failing layer
    failures = sorted((i, c, why) for i in layers for c, why in rows[i][3].items())
    ok = [True] * n_c
    for i, c, why in failures:
        if ok[c]:
            ok[c] = False
            errors[resolved[c][0]] = f"layer {i}: {why}"
    dense_bytes = sum(rows[i][0] for i in layers)
    byte_rows = torch.stack([rows[i][1] for i in layers]) if layers else torch.zeros(0, hkv, n_c, dtype=torch.float64)
    loss_rows = torch.stack([rows[i][2] for i in layers]) if layers else torch.zeros(0, hkv, n_c, dtype=torch.float64)
    keep = [c for c in range(n_c) if ok[c]]
    byte_rows, loss_rows = byte_rows[..., keep], loss_rows[..., keep]
    kept_specs = [resolved[c][0] for c in keep]
    if per_head:
        groups = [(i, h) for i in layers for h in range(hkv)]
        b, l = byte_rows.reshape(-1, len(keep)), loss_rows.reshape(-1, len(keep))
    else:
        groups = [(i, None) for i in layers]
        b, l = byte_rows.sum(1), loss_rows.sum(1)
    return Sensitivity(groups, kept_specs, b, l, dense_bytes, prefix, heldout, errors, time.perf_counter() - start, calibrate)


def solve_knapsack(costs: torch.Tensor, losses: torch.Tensor, budget: float, buckets: int = 4000) -> list[int] | None:
    """Multiple-choice knapsack: pick one column per row of ``costs``/``losses`` ``[G, C]`` (bytes,
    loss) minimising the summed loss with summed cost <= ``budget``. Exact dynamic programme over
    ``buckets`` byte buckets of ``budget / buckets`` bytes, costs rounded up to whole buckets (every
    returned choice fits the budget). Returns the column per row, or None when nothing fits."""
    g, c = costs.shape
    if budget <= 0:
        return None
    unit = budget / buckets
    w = torch.ceil(costs.double() / unit - 1e-9).long().clamp_min(0)
    inf = float("inf")
    best = torch.full((buckets + 1,), inf, dtype=torch.float64)
    best[0] = 0.0
    picks = torch.zeros(g, buckets + 1, dtype=torch.int64)
    for row in range(g):
        new = torch.full_like(best, inf)
        arg = torch.zeros(buckets + 1, dtype=torch.int64)
        for col in range(c):
            wc = int(w[row, col])
            if wc > buckets or not math.isfinite(float(losses[row, col])):
                continue
            cand = torch.full_like(best, inf)
            cand[wc:] = best[: buckets + 1 - wc] + float(losses[row, col])
            better = cand < new
            new = torch.where(better, cand, new)
            arg = torch.where(better, torch.full_like(arg, col), arg)
        best = new
        picks[row] = arg
    if not math.isfinite(float(best.min())):
        return None
    at = int(best.argmin())
    choice = [0] * g
    for row in range(g - 1, -1, -1):
        col = int(picks[row, at])
        choice[row] = col
        at -= int(w[row, col])
    return choice


def plan_of(sens: Sensitivity, choice: list[int], facts, extra: dict[str, Any] | None = None) -> Plan:
    """The plan a knapsack choice describes: one spec per layer when its heads agree, else per head."""
    per_layer: dict[int, list[str]] = {}
    for (layer, _head), col in zip(sens.groups, choice):
        per_layer.setdefault(layer, []).append(sens.specs[col])
    layers = {i: (s[:1] if len(set(s)) == 1 else s) for i, s in per_layer.items()}
    more = dict(extra or {})
    if len(per_layer) < facts.num_layers:  # a capture of some layers: the plan says which it chose for
        more["chosen_layers"] = sorted(per_layer)
        more["unchosen_layers_use"] = "default"
    return Plan(layers, default="dense", model=model_shape(facts), extra=more)


def _sizes(sens: Sensitivity, nbytes: float) -> dict[str, Any]:
    """``stored_bytes`` (whole bytes; absent where the sensitivity counts shares of the dense bytes,
    ``calibrate="tasks"``) and ``storage_ratio`` (a fraction of the dense bytes)."""
    ratio = {"storage_ratio": nbytes / sens.dense_bytes}
    return ratio if sens.calibrate == "tasks" else {"stored_bytes": round(nbytes), **ratio}


def predicted(sens: Sensitivity, choice: list[int]) -> dict[str, float]:
    """A choice's predicted ``stored_bytes``, ``storage_ratio`` (:func:`_sizes`) and ``loss``."""
    idx = torch.arange(len(choice))
    col = torch.tensor(choice)
    return {**_sizes(sens, float(sens.bytes[idx, col].sum())), "loss": float(sens.loss[idx, col].sum())}


def uniform_options(sens: Sensitivity) -> list[dict[str, Any]]:
    """Every candidate applied to every layer: ``spec``, predicted ``stored_bytes`` and
    ``storage_ratio`` (:func:`_sizes`) and ``loss``, cheapest first."""
    rows = [{"spec": s, **_sizes(sens, float(sens.bytes[:, c].sum())), "loss": float(sens.loss[:, c].sum())} for c, s in enumerate(sens.specs)]
    return sorted(rows, key=lambda r: r["storage_ratio"])


def allocate(sens: Sensitivity, fraction: float, facts, buckets: int = 4000, servable: str | None = None) -> tuple[Plan, dict[str, float]]:
    """The plan minimising the predicted loss at ``fraction`` of the dense prefix bytes.
    ``servable="paged"``: every KV head of a layer keeps the same tokens (:func:`allocate_servable`)."""
    if servable is not None:
        return allocate_servable(sens, fraction, facts, buckets)
    budget = fraction * sens.dense_bytes
    choice = solve_knapsack(sens.bytes, sens.loss, budget, buckets)
    if choice is None:
        cheapest = min(r["storage_ratio"] for r in uniform_options(sens))
        raise UsageError(f"no plan fits {100 * fraction:.1f}% of the dense bytes: the cheapest candidate takes {100 * cheapest:.1f}% (raise --budget)")
    pred = predicted(sens, choice)
    return plan_of(sens, choice, facts), pred


def pareto(options: list[tuple[float, float, tuple[int, ...]]], cap: int = 256) -> list[tuple[float, float, tuple[int, ...]]]:
    """The (bytes, loss, choice) options no other option beats in both bytes and loss, cheapest
    first; thinned evenly to at most ``cap`` (the cheapest and the best kept)."""
    front: list[tuple[float, float, tuple[int, ...]]] = []
    for opt in sorted(options, key=lambda o: (o[0], o[1])):
        if not front or opt[1] < front[-1][1]:
            front.append(opt)
    if len(front) > cap:
        step = (len(front) - 1) / (cap - 1)
        front = [front[round(j * step)] for j in range(cap)]
    return front


def allocate_servable(sens: Sensitivity, fraction: float, facts, buckets: int = 4000) -> tuple[Plan, dict[str, float]]:
    """A plan that a paged cache can serve: in every layer all KV heads keep the same share of the
    tokens (one token budget per layer), while each head still picks its own storage among the
    candidates of that share. Per layer and share, the heads' options are merged into a Pareto
    front of (bytes, loss); a multiple-choice knapsack then picks one option per layer."""
    if any(h is None for _, h in sens.groups):
        raise UsageError("--servable needs the per-KV-head sensitivity (drop --per-layer)")
    shares = [token_share(s) for s in sens.specs]
    layers = sorted({i for i, _ in sens.groups})
    rows = {i: [g for g, (li, _) in enumerate(sens.groups) if li == i] for i in layers}
    per_layer: list[list[tuple[float, float, tuple[int, ...]]]] = []
    for i in layers:
        opts: list[tuple[float, float, tuple[int, ...]]] = []
        for share in sorted(set(shares)):
            cols = [c for c, sh in enumerate(shares) if sh == share]
            merged: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
            for g in rows[i]:
                head = [(float(sens.bytes[g, c]), float(sens.loss[g, c]), c) for c in cols if math.isfinite(float(sens.loss[g, c]))]
                merged = pareto([(b + hb, l + hl, ch + (c,)) for b, l, ch in merged for hb, hl, c in head])
            opts += merged
        per_layer.append(pareto(opts))
    width = max(len(o) for o in per_layer)
    costs = torch.full((len(layers), width), float("inf"), dtype=torch.float64)
    losses = torch.full((len(layers), width), float("inf"), dtype=torch.float64)
    for r, opts in enumerate(per_layer):
        for c, (b, l, _) in enumerate(opts):
            costs[r, c], losses[r, c] = b, l
    costs = torch.where(torch.isfinite(costs), costs, torch.full_like(costs, fraction * sens.dense_bytes * 10 + 1))
    choice = solve_knapsack(costs, losses, fraction * sens.dense_bytes, buckets)
    if choice is None:
        raise UsageError(f"no servable plan fits {100 * fraction:.1f}% of the dense bytes (raise --budget)")
    head_choice = [0] * len(sens.groups)
    for r, i in enumerate(layers):
        for g, col in zip(rows[i], per_layer[r][choice[r]][2]):
            head_choice[g] = col
    plan = plan_of(sens, head_choice, facts, {"servable": "paged"})
    return plan, predicted(sens, head_choice)


# ----------------------------------------------------------------------------- budgets

SIZE_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_count(text: str, what: str) -> int:
    """``32k`` -> 32768, ``4096`` -> 4096 (k = 1024 tokens)."""
    t = text.strip().lower()
    mult = 1024 if t.endswith("k") else 1
    try:
        value = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise UsageError(f"{what} must be a count like 4096 or 32k, got {text!r}") from None
    if value < 1:
        raise UsageError(f"{what} must be at least 1, got {text!r}")
    return int(value)


def parse_budget(text: str, facts, batch: int | None = None, context: str | None = None) -> dict[str, Any]:
    """A budget as a fraction of the dense KV bytes: ``15%`` or ``0.15``; or an absolute size
    (``2GiB``, ``500MB``) for ``batch`` sequences of ``context`` tokens of the capture's model, turned
    into a fraction of ``2 * layers * batch * kv_heads * context * head_dim * bytes per element``.
    Returns ``{"fraction", "how"}``."""
    t = text.strip().lower().replace(" ", "")
    if not t:
        raise UsageError("--budget is empty; write 15% or 2GiB")
    import re

    m = re.fullmatch(r"([0-9]*\.?[0-9]+)(%|[a-z]*)", t)
    if m is None or (m.group(2) not in ("", "%") and m.group(2) not in SIZE_UNITS):
        raise UsageError(f"--budget must be a share like 15% or a size like 2GiB, got {text!r}")
    value, unit = _number(m.group(1), text), m.group(2)
    if unit == "%":
        frac, how = value / 100, f"{text} of the float16 KV bytes"
    elif unit == "":
        if value > 1:
            raise UsageError(f"--budget {text}: a bare number is a fraction (0..1); write 15% or 2GiB")
        frac, how = value, f"{value:g} of the float16 KV bytes"
    else:
        if batch is None or context is None:
            raise UsageError(f"--budget {text} is a size: give --batch and --context (e.g. --batch 16 --context 32k) to turn it into a share of the KV cache")
        tokens = parse_count(context, "--context")
        elt = REFERENCE_BYTES
        dense = dense_reference_bytes(batch, facts.num_kv_heads, tokens, facts.head_dim, facts.num_layers)
        frac = value * SIZE_UNITS[unit] / dense
        how = (f"{text} / the dense KV cache of {facts.name} at batch {batch} x {tokens} tokens "
               f"(2 x {facts.num_layers} layers x {facts.num_kv_heads} KV heads x {facts.head_dim} dims x {elt} bytes (float16) = {dense / 1024**3:.2f} GiB)")
    if not 0 < frac:
        raise UsageError(f"--budget {text} must be above 0")
    if frac >= 1:
        how += "; at or above the dense size, so nothing needs compressing"
    return {"fraction": min(frac, 1.0), "how": how}


def _number(text: str, original: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--budget must be a share like 15% or a size like 2GiB, got {original!r}") from None
    if math.isnan(value) or value <= 0:
        raise UsageError(f"--budget must be above 0, got {original!r}")
    return value
