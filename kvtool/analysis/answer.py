"""The report's first screen: for each budget, the plan in words, its GiB at a batch and context, its
decode speed against dense (from a ``kvtool bench decode`` JSON), its fidelity, and the one command
that applies it; and the one *best uniform* setting per budget that every section of the report names.

Every key read from another command's output (recommend's check, tasks.json, bench JSON) goes
through :func:`field`, so a renamed key is adapted in :data:`KEYS` alone.
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path
from typing import Any

from kvtool.analysis.bands import grade
from kvtool.analysis.palette import spec_format

# one quantity -> the keys it has been written under, newest first
KEYS: dict[str, tuple[str, ...]] = {
    "storage_ratio": ("storage_ratio", "stored_ratio"),
    "tokens_per_s": ("tokens_per_s",),
    "provider": ("provider",),
}

REFERENCE_BYTES = 2  # budgets are shares of float16 keys and values
DEFAULT_BATCH = 8
DEFAULT_CONTEXT = 32768  # batch 8 x 32k: kvtool bench decode's default case


def field(row: dict[str, Any], quantity: str, default: Any = None) -> Any:
    """``row``'s value of ``quantity`` under any of its known keys (:data:`KEYS`)."""
    for key in KEYS.get(quantity, (quantity,)):
        if row.get(key) is not None:
            return row[key]
    return default


# ----------------------------------------------------------------------------- specs in words


def _param(spec: str, name: str) -> str | None:
    m = re.search(rf"(?:^|[:,]){name}=([^,+]+)", spec)
    return m.group(1) if m else None


def _share(x: float) -> str:
    return f"{100 * x:.0f}%"


def store_words(step: str) -> str:
    """How one storage step keeps the tokens it keeps: ``quant:bits=4,...`` -> ``KIVI-4``."""
    fmt = step.partition(":")[0]
    if fmt == "dense" or not step:
        return "float16"
    if fmt == "quant":
        bits, group = _param(step, "bits"), _param(step, "group")
        return f"KIVI-{bits or '?'}" + (f" g{group}" if group and group not in ("32",) else "")
    if fmt == "bitmap":
        return f"{_share(float(_param(step, 'sparsity') or 0))} of elements pruned"
    if fmt == "bitmapq":
        return f"{_share(float(_param(step, 'sparsity') or 0))} pruned, rest {_param(step, 'bits') or '?'}-bit"
    if fmt == "signvq":
        return f"sign-VQ {_param(step, 'bits') or '?'}-bit"
    if fmt == "pagestat":
        return f"pages selected ({_share(float(_param(step, 'budget_ratio') or 0))} read)"
    return step


def spec_words(spec: str) -> tuple[float | None, str]:
    """``(share of tokens kept or None when all are kept, how the kept tokens are stored)``:
    ``snapkv:share=0.3+quant:bits=4,...`` -> ``(0.3, "KIVI-4")``; ``quant:bits=2`` -> ``(None, "KIVI-2")``."""
    steps = spec.split("+")
    first = steps[0]
    fmt = first.partition(":")[0]
    if fmt in ("snapkv", "snapstream", "streaming"):
        share = _param(first, "share")
        kept = float(share) if share else None
        return (kept if kept is not None else math.nan), store_words(steps[1] if len(steps) > 1 else "dense")
    return None, store_words(spec)


def head_counts(plan: Any, num_kv_heads: int) -> dict[str, int]:
    """KV heads per spec over the plan's layers (a one-spec layer counts all its heads)."""
    counts: dict[str, int] = {}
    for specs in plan.layers.values():
        for s in specs * (num_kv_heads if len(specs) == 1 else 1):
            counts[s] = counts.get(s, 0) + 1
    return counts


def _heads(n: int) -> str:
    return f"{n} KV head" + ("" if n == 1 else "s")


def _mix(counts: dict[str, int], limit: int = 2) -> str:
    """``KIVI-4`` or ``2 KIVI-4 g128, 1 KIVI-4`` (most first, ``limit`` named)."""
    items = sorted(counts.items(), key=lambda kv: -kv[1])
    if len(items) == 1:
        return items[0][0]
    text = ", ".join(f"{n} {how}" for how, n in items[:limit])
    return text + (f", {sum(n for _, n in items[limit:])} other" if len(items) > limit else "")


def plan_words(plan: Any, num_kv_heads: int) -> str:
    """The plan in words, from its per-head specs: the heads that keep every token and how they are
    stored, then the share of the tokens the other heads evict (heads weighted) and how their kept
    tokens are stored: ``keep 3 of 12 KV heads whole (2 KIVI-4 g128, 1 KIVI-4), evict 69% of the
    tokens in the other 9 (KIVI-4)``."""
    counts = head_counts(plan, num_kv_heads)
    total = sum(counts.values())
    if not total:
        return f"every KV head {plan.default}"
    keep: dict[str, int] = {}
    evict: dict[str, int] = {}
    kept_tokens, known, shares = 0.0, 0, set()
    for spec, n in counts.items():
        kept, how = spec_words(spec)
        if kept is None:
            keep[how] = keep.get(how, 0) + n
        else:
            evict[how] = evict.get(how, 0) + n
            if not math.isnan(kept):
                kept_tokens, known = kept_tokens + kept * n, known + n
                shares.add(round(1 - kept, 4))
    n_keep, n_ev = sum(keep.values()), sum(evict.values())
    parts = []
    if n_keep:
        parts.append(f"all {_heads(total)} whole in {_mix(keep)}" if n_keep == total else f"keep {n_keep} of {total} KV heads whole ({_mix(keep)})")
    if n_ev:
        share = f"evict {_share(1 - kept_tokens / known)} of the tokens" if known else "evict to a fixed number of tokens"
        if len(shares) > 1:
            share = f"evict {100 * min(shares):.0f}-{_share(max(shares))} of the tokens ({_share(1 - kept_tokens / known)} on average)"
        where = f"in the other {n_ev}" if n_keep else f"in all {_heads(n_ev)}"
        parts.append(f"{share} {where} (kept in {_mix(evict)})")
    return ", ".join(parts)


def uniform_words(spec: str) -> str:
    """A uniform setting in words: ``evict 47% of the tokens (kept in KIVI-4 g128)``, ``KIVI-4``."""
    kept, how = spec_words(spec)
    if kept is None:
        return f"every token, {how}" if how[:1].isdigit() else f"every token in {how}"
    return ("evict to a fixed number of tokens" if math.isnan(kept) else f"evict {_share(1 - kept)} of the tokens") + f" (kept in {how})"


# ----------------------------------------------------------------------------- best uniform


def best_uniform(b: dict[str, Any]) -> dict[str, Any] | None:
    """The one best uniform setting for budget ``b`` (a ``recommend_capture`` budget), named alike in
    every section: the model-checked budget-filling setting with the lowest NLL increase when the
    plan was checked on the model, else the fitting menu setting with the lowest predicted attention
    loss. Returns ``{"spec", "ratio" (stored share), "how"}`` or None when nothing fits."""
    check = b.get("check") or {}
    spec = b.get("best_uniform")
    if spec and spec in check:
        c0 = check[spec]["cases"][0]
        return {"spec": spec, "ratio": field(c0, "storage_ratio"), "how": "lowest NLL increase on the model among the budget-filling settings"}
    fit = [r for r in b.get("uniform") or [] if r.get("loss", 0) > 0 or r.get("spec") != "dense"]
    if not fit:
        return None
    best = min(fit, key=lambda r: r["loss"])
    return {"spec": best["spec"], "ratio": best["storage_ratio"], "how": "lowest predicted attention error among the menu settings that fit"}


# ----------------------------------------------------------------------------- GiB, speed, fidelity


def kv_gib(facts: Any, ratio: float, batch: int, context: int) -> float:
    """GiB of the compressed cache of ``batch`` sequences of ``context`` tokens of the whole model
    (every layer), ``ratio`` of the float16 keys and values."""
    dense = 2 * facts.num_layers * facts.num_kv_heads * facts.head_dim * REFERENCE_BYTES * batch * context
    return ratio * dense / 1024**3


def decode_records(docs: list[dict[str, Any]], facts: Any = None) -> list[dict[str, Any]]:
    """The timed records of every ``kvtool bench decode`` document, each with ``_device``, ``_shape``
    (the model shape timed), ``_same_shape`` (whether it has ``facts``' heads, KV heads and head dim),
    ``_plan`` (a plan file's record) and ``_budget`` (the budget fraction that plan was made for)."""
    out = []
    for doc in docs:
        if doc.get("subcommand") != "decode":
            continue
        dev = (doc.get("env") or {}).get("device") or "?"
        for r in doc.get("records") or []:
            if r.get("status", "ok") == "ok" and field(r, "tokens_per_s") and not r.get("memory_budget"):
                shape = (doc.get("shape") or {}).get("name") or str(r.get("data") or "?").removeprefix("random:")
                same = (r.get("kv_heads"), r.get("head_dim"), r.get("heads")) == (facts.num_kv_heads, facts.head_dim, facts.num_heads) if facts else None
                provider = str(field(r, "provider", ""))
                plan = provider.endswith(".json")
                out.append({**r, "_device": r.get("device") or dev, "_doc": doc.get("_path", ""), "_shape": shape, "_same_shape": same,
                            "_plan": plan, "_budget": _plan_budget(provider) if plan else None})
    return out


def _plan_budget(provider: str) -> float | None:
    """The budget fraction a plan file says it was made for (None when unreadable)."""
    from kvtool.core.limits import read_json_input  # deferred: only with a bench decode file

    try:
        return float(read_json_input(Path(provider), provider)["budget"]["fraction"])
    except Exception:  # noqa: BLE001 - a bench record names a file that may be elsewhere, or not a plan
        m = re.search(r"(\d+(?:\.\d+)?)(?:%|\.json$)", Path(provider).name)
        return float(m.group(1)) / 100 if m else None


def decode_speed(records: list[dict[str, Any]], fraction: float, spec: str | None = None) -> dict[str, Any] | None:
    """Decode tokens/s against dense for budget ``fraction``: the record of a plan made for that
    budget (``spec`` None), or of the uniform ``spec`` (the same spec, else the same format with the
    largest stored share within the budget), beside the dense record of the same card, batch and
    context (``records`` from :func:`decode_records`). ``{"tokens_per_s", "dense_tokens_per_s",
    "speedup", "device", "batch", "seq", "what" (the provider timed), "shape", "same_shape"}`` or None."""
    if spec is None:
        mine = [r for r in records if r["_plan"] and r["_budget"] is not None and abs(r["_budget"] - fraction) < 1e-6]
    else:
        mine = [r for r in records if field(r, "provider") == spec]
        if not mine:
            fam = spec_format(spec)
            mine = sorted((r for r in records if not r["_plan"] and not str(field(r, "provider")).startswith("dense")
                           and spec_format(str(field(r, "provider"))) == fam and (field(r, "storage_ratio") or 2) <= fraction + 1e-6),
                          key=lambda r: -field(r, "storage_ratio"))
    for r in mine:
        dense = [d for d in records if str(field(d, "provider")).startswith("dense") and d["_device"] == r["_device"]
                 and d.get("batch") == r.get("batch") and d.get("seq") == r.get("seq")]
        if dense:
            t, t0 = field(r, "tokens_per_s"), field(dense[0], "tokens_per_s")
            return {"tokens_per_s": t, "dense_tokens_per_s": t0, "speedup": t / t0, "device": r["_device"], "batch": r.get("batch"),
                    "seq": r.get("seq"), "what": str(field(r, "provider")), "shape": r.get("_shape"), "same_shape": r.get("_same_shape")}
    return None


def task_rows(summary: dict[str, Any] | None, fraction: float, family: str | None = None) -> dict[str, Any] | None:
    """The tasks run's row for budget ``fraction``: its plan (``family`` None) or the uniform
    ``family`` (``kivi``, ``snapkv+kivi4``...); None when the run has no such row."""
    if not summary:
        return None
    for r in summary.get("by_setting") or []:
        if r.get("accuracy") is None or r.get("budget") is None or abs(float(r["budget"]) - fraction) > 1e-6:
            continue
        if (family is None and str(r.get("method", "")).startswith("plan")) or (family is not None and r.get("method") == family):
            return r
    return None


def dense_task_row(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    return next((r for r in (summary or {}).get("by_setting") or [] if r.get("method") == "dense" and r.get("accuracy") is not None), None)


# ----------------------------------------------------------------------------- the first screen


def capture_arg(capture: Path | str) -> str:
    """How a command names the capture: ``sample:`` for the bundled sample, else its path."""
    from kvtool.core.sample import SAMPLE_PATH  # deferred: only the first screen needs it

    try:
        return "sample:" if Path(capture).resolve() == SAMPLE_PATH else str(capture)
    except OSError:
        return str(capture)


def _gib(v: float) -> str:
    return f"{v:.2f} GiB" if v < 10 else f"{v:.1f} GiB"


def _ctx(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else f"{tokens:,}"


def fidelity(b: dict[str, Any], label: str | None, tasks: dict[str, Any] | None, family: str | None, plan: bool) -> dict[str, Any]:
    """One setting's fidelity at budget ``b``: task accuracy with its 95% interval when the tasks run
    has the setting at this budget; else NLL increase, top-1 agreement and KL on the model (mean and
    95% interval over the cases when several); else the plan's predicted attention error.
    ``{"text", "short", "metric", "value", "source"}`` (``source``: where the numbers come from)."""
    row = task_rows(tasks, b["fraction"], None if plan else family) if tasks else None
    if row is not None:
        acc = f"{100 * row['accuracy']:.0f}% [{100 * row['lo']:.0f}, {100 * row['hi']:.0f}]"
        name = str(row.get("method", "")).removeprefix("plan:")
        return {"text": f"task accuracy {acc} ({name}, n={row.get('n')})", "short": f"task accuracy {100 * row['accuracy']:.0f}%", "metric": "accuracy", "value": row["accuracy"],
                "source": f"tasks run, {row.get('setting', '')}, n={row.get('n')}"}
    check = (b.get("check") or {}).get(label) if label else None
    if check:
        nll, ag, kl = check["nll_increase"], check["agreement"], check["kl"]
        iv = f" [{nll['lo']:+.4f}, {nll['hi']:+.4f}]" if nll["n"] > 1 else ""
        return {"text": f"NLL {nll['mean']:+.4f}{iv}, top-1 {ag['mean']:.1%}, KL {kl['mean']:.4f}",
                "short": f"NLL {nll['mean']:+.4f} nats/token, top-1 {ag['mean']:.0%}", "metric": "nll_increase", "value": nll["mean"],
                "source": f"mean [95%] of {nll['n']} cases" if nll["n"] > 1 else "the capture's continuation"}
    if plan:
        err = math.sqrt(max(b["predicted"]["loss"], 0.0))
        return {"text": f"attention error {err:.3g} (predicted)", "short": f"predicted attention error {err:.3g}", "metric": None, "value": None,
                "source": "not checked on the model"}
    return {"text": "-", "short": "not checked", "metric": None, "value": None, "source": "not checked on the model"}


def first_screen(rec: dict[str, Any], facts: Any, capture: Path | str, batch: int, context: int, bench_docs: list[dict[str, Any]],
                 tasks: dict[str, Any] | None, layers_captured: int, plan_links: dict[str, str]) -> tuple[list[dict[str, Any]], str]:
    """Per budget of ``rec`` (:func:`kvtool.analysis.recommendation.recommend_capture`): one answer
    dict (``budget``, ``sentence``, ``plan_words``, ``storage_ratio``, ``gib``, ``speed``,
    ``fidelity``, ``command``, ``best_uniform``) and the HTML of the first screen: a table with one
    row per budget (and its best uniform setting beneath, muted), then one sentence per budget.
    ``plan_links``: budget -> the plan file the command applies, ``"_data:" + budget`` -> its
    ``data:`` URI (a download link beside the command)."""
    esc = html.escape
    records = decode_records(bench_docs, facts)
    dense_gib = kv_gib(facts, 1.0, batch, context)
    cap = capture_arg(capture)
    stem = Path(str(capture)).stem
    answers, rows = [], []
    for b in rec["budgets"]:
        tag = b["budget"].rstrip("%")
        ratio = b["predicted"]["exact_storage_ratio"]
        words = plan_words(b["plan"], facts.num_kv_heads)
        gib = kv_gib(facts, ratio, batch, context)
        speed = decode_speed(records, b["fraction"]) if records else None
        fid = fidelity(b, b.get("plan_label"), tasks, None, plan=True)
        uni = best_uniform(b)
        fills = b.get("uniform_fills") or {}
        family = next((f for f, sp in fills.items() if uni and sp == uni["spec"]), None) if uni else None
        plan_file = plan_links.get(b["budget"], f"plan-{tag}.json")
        command = f"kvtool compress {cap} --plan {plan_file} -o {stem}-{tag}.safetensors"
        speed_text = (f", decodes at {speed['tokens_per_s']:.0f} tokens/s ({speed['speedup']:.2f}x dense) on {speed['device']}"
                      + ("" if speed["same_shape"] else f" ({speed['shape']} shape)") if speed else "")
        sentence = (f"At {b['budget']}: {words}; {_gib(gib)} at batch {batch} x {_ctx(context)}{speed_text}, {fid['short']}")
        uni_row = None
        if uni:
            ufid = fidelity(b, uni["spec"], tasks, family, plan=False)
            uspeed = decode_speed(records, b["fraction"], uni["spec"]) if records else None
            sentence += f"; the best uniform setting gets {ufid['short']}."
            uni_row = {"spec": uni["spec"], "words": uniform_words(uni["spec"]), "family": family, "storage_ratio": uni["ratio"], "fidelity": ufid,
                       "speed": uspeed, "how": uni["how"],
                       "command": f"kvtool compress {cap} --format {uni['spec']} -o {stem}-uniform-{tag}.safetensors"}
        else:
            sentence += "; no uniform setting fits this budget."
        answers.append({"budget": b["budget"], "sentence": sentence, "plan_words": words, "storage_ratio": ratio, "gib": gib,
                        "batch": batch, "context_tokens": context, "speed": speed, "fidelity": fid, "command": command, "best_uniform": uni_row})

        def row(first: str, what: str, title: str, r: float | None, sp: dict | None, f: dict[str, Any], cmd: str, link: str | None, css: str) -> str:
            spd = "not timed" if not sp else f"{sp['tokens_per_s']:.0f} ({sp['speedup']:.2f}x)"
            timed = f"timed: {sp['what']} ({sp['shape']})" if sp else "no kvtool bench decode record for this setting"
            band = (grade(f["metric"], f["value"]) or "") if f["metric"] else ""
            uri = plan_links.get("_data:" + b["budget"]) if link else None
            dl = f' <a download="{esc(link)}" href="{esc(uri)}">save {esc(link)}</a>' if link and uri else ""
            return (f'<tr class="{css}"><td>{first}</td><td class="words" title="{esc(title)}">{esc(what)}</td>'
                    f'<td>{"-" if r is None else f"{100 * r:.1f}%"}</td><td>{"-" if r is None else _gib(kv_gib(facts, r, batch, context))}</td>'
                    f'<td title="{esc(timed)}">{esc(spd)}</td><td class="fid {band}" title="{esc(f["source"])}">{esc(f["text"])}</td>'
                    f"<td class=\"cmd\"><code>{esc(cmd)}</code>{dl}</td></tr>")

        rows.append(row(f"<b>{esc(b['budget'])}</b>", words, "the plan, from its per-head settings", ratio, speed, fid, command, plan_file, "plan"))
        if uni_row:
            rows.append(row("uniform", uni_row["words"], uni_row["spec"], uni_row["storage_ratio"], uni_row["speed"], uni_row["fidelity"],
                            f"--format {uni_row['spec']}", None, "uniform"))
    card = next((a["speed"] for a in answers if a["speed"]), None)
    speed_sub = f"{card['device']}, {card['shape']}, batch {card['batch']} x {_ctx(card['seq'])}" if card else "no bench decode JSON"
    sources = sorted({a["fidelity"]["source"] for a in answers} | {a["best_uniform"]["fidelity"]["source"] for a in answers if a["best_uniform"]})
    fid_head = "fidelity" + (f" ({sources[0]})" if len(sources) == 1 else " (hover a cell for its source)")
    head = ("<tr><th>budget</th><th>what it keeps (the plan, from its per-head settings; below it the best uniform setting)</th><th>stored</th>"
            f"<th>KV GiB at batch {batch} x {_ctx(context)}</th><th>decode tok/s (x dense)<br><span class=\"sub\">{esc(speed_sub)}</span></th>"
            f"<th>{esc(fid_head)}</th><th>apply it (uniform: the same with --format)</th></tr>")
    note = [f"GiB: the stored share of the float16 keys and values of all {facts.num_layers} layers of {facts.name} at batch {batch} x {context:,} "
            f"tokens (dense: {_gib(dense_gib)}; set with --batch and --context, default {DEFAULT_BATCH} x {_ctx(DEFAULT_CONTEXT)})."]
    if layers_captured < facts.num_layers:
        note.append(f"The capture holds {layers_captured} of {facts.num_layers} layers; their share is taken for every layer.")
    if card and not card["same_shape"]:
        note.append(f"The decode timings are of the {card['shape']} shape, not of {facts.name}: they tell the formats' relative speed, not this model's.")
    if records:
        note.append("Speed: kvtool bench decode records, a plan matched by the budget its file was made for, a uniform setting by its spec "
                    "(else its format's largest within the budget), each beside dense on the same card, batch and context.")
    else:
        note.append("Speed: no kvtool bench decode JSON was given (run kvtool bench decode --plan PLAN -o decode.json on a GPU, then report --bench decode.json).")
    if any(a["fidelity"]["metric"] == "nll_increase" for a in answers):
        note.append("NLL: increase over dense in nats/token; top-1: agreement with dense's next token.")
    body = (f'<p class="reading">{esc(reading(answers))}</p><table class="answer">{head}{"".join(rows)}</table>'
            + "<ol class=\"sentences\">" + "".join(f"<li>{esc(a['sentence'])}</li>" for a in answers) + "</ol>"
            + f'<p class="muted small">{esc(" ".join(note))}</p>')
    return answers, body


def _better(plan: dict[str, Any], uni: dict[str, Any]) -> bool | None:
    """Whether the plan's fidelity beats the uniform's (None when they are not the same measure)."""
    if plan["metric"] != uni["metric"] or plan["value"] is None or uni["value"] is None:
        return None
    return plan["value"] > uni["value"] if plan["metric"] == "accuracy" else plan["value"] < uni["value"]


def reading(answers: list[dict[str, Any]]) -> str:
    """One line over the budgets: where the plan's fidelity beats the best uniform setting's on the
    same measure (task accuracy or NLL increase)."""
    if not answers:
        return "No budgets."
    names = {"accuracy": "task accuracy", "nll_increase": "NLL increase"}
    wins: dict[str, list[str]] = {}
    losses: dict[str, list[str]] = {}
    for a in answers:
        verdict = _better(a["fidelity"], a["best_uniform"]["fidelity"]) if a["best_uniform"] else None
        if verdict is not None:
            (wins if verdict else losses).setdefault(names[a["fidelity"]["metric"]], []).append(a["budget"])
    if not wins and not losses:
        return (f"The plan per budget below ({', '.join(a['budget'] for a in answers)}), stored in "
                + ", ".join(f"{a['gib']:.2f} GiB" for a in answers) + f" at batch {answers[0]['batch']} x {_ctx(answers[0]['context_tokens'])}"
                + "; it was not checked on the model, so no measured comparison with the best uniform setting.")
    parts = []
    for measure in dict.fromkeys(list(wins) + list(losses)):
        w, l = wins.get(measure, []), losses.get(measure, [])
        text = f"on {measure} the plan is better than the best uniform setting at {', '.join(w)}" if w else f"on {measure} the best uniform setting is as good as the plan at {', '.join(l)}"
        parts.append(text + (f", not at {', '.join(l)}" if w and l else ""))
    return ("At the same bytes, " + "; ".join(parts) + " (means; the 95% intervals in the table tell whether a difference is beyond noise).")
