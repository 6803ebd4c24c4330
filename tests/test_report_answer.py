"""The report's first screen (kvtool.analysis.answer): the plan in words from its per-head specs, GiB
at a batch and context, decode speed matched from a bench decode JSON, one best uniform per budget
shared by every section, and the numbered decision region of the frontier."""

from __future__ import annotations

import json
import math

import pytest

from kvtool.analysis import answer as A
from kvtool.core.cache import ModelFacts
from kvtool.formats.plan import Plan

FACTS = ModelFacts(name="m", architecture="LlamaForCausalLM", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                   rope_theta=None, dtype="float16")
KIVI4 = "quant:bits=4,group=32,residual=0,partial=true"


def test_plan_words_come_from_the_per_head_specs():
    plan = Plan({0: [KIVI4], 1: [f"snapkv:share=0.3+{KIVI4}", f"snapkv:share=0.3+{KIVI4}", "dense"]})
    assert A.plan_words(plan, 3) == "keep 4 of 6 KV heads whole (3 KIVI-4, 1 float16), evict 70% of the tokens in the other 2 (kept in KIVI-4)"
    plan = Plan({0: ["snapstream:share=0.25"], 1: ["snapstream:share=0.5"]})
    assert A.plan_words(plan, 3) == "evict 50-75% of the tokens (62% on average) in all 6 KV heads (kept in float16)"  # heads weighted: 1 - (0.25 + 0.5) / 2
    assert A.plan_words(Plan({0: ["quant:bits=2"]}), 3) == "all 3 KV heads whole in KIVI-2"
    assert A.uniform_words("snapkv:share=0.53125+quant:bits=4,group=128,residual=0,partial=true") == "evict 47% of the tokens (kept in KIVI-4 g128)"
    assert A.uniform_words("bitmap:sparsity=0.7") == "every token, 70% of elements pruned"


def test_gib_at_batch_and_context():
    # 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 2 bytes = 23,040 bytes per token
    assert A.kv_gib(FACTS, 1.0, 8, 32768) == pytest.approx(23040 * 8 * 32768 / 1024**3)
    assert A.kv_gib(FACTS, 0.15, 16, 1000) == pytest.approx(0.15 * 23040 * 16 * 1000 / 1024**3)


def _record(provider, tps, ratio, batch=8, seq=32768, **kw):
    return {"kernel": "decode", "provider": provider, "batch": batch, "seq": seq, "heads": 32, "kv_heads": 8, "head_dim": 128,
            "tokens_per_s": tps, "storage_ratio": ratio, "status": "ok", **kw}


def test_decode_speed_matches_plan_by_its_budget_and_uniform_by_spec(tmp_path):
    plan = tmp_path / "my-plan.json"
    plan.write_text(json.dumps({"budget": {"text": "15%", "fraction": 0.15}}))
    doc = {"subcommand": "decode", "env": {"device": "Card X"}, "shape": {"name": "llama3-8b"}, "records": [
        _record("dense/sdpa", 400.0, 1.0), _record("dense/sdpa", 100.0, 1.0, batch=32),
        _record(str(plan), 600.0, 0.14), _record("quant:bits=4", 150.0, 0.33), _record("quant:bits=2", 300.0, 0.2, batch=32),
        _record("snapstream:budget=4096", 800.0, 0.13, status="skipped: out of memory"),
        _record("dense/sdpa", 420.0, 1.0, memory_budget=4e10),  # a --memory-budget row: another question
    ]}
    recs = A.decode_records([doc], FACTS)
    got = A.decode_speed(recs, 0.15)
    assert got["tokens_per_s"] == 600.0 and got["speedup"] == pytest.approx(1.5) and got["device"] == "Card X"
    assert got["shape"] == "llama3-8b" and got["same_shape"] is False
    assert A.decode_speed(recs, 0.25) is None  # no plan made for 25% was timed
    assert A.decode_speed(recs, 0.4, "quant:bits=4")["speedup"] == pytest.approx(150 / 400)
    # same format within the budget, beside the dense of its own batch
    assert A.decode_speed(recs, 0.25, "quant:bits=2,group=64")["speedup"] == pytest.approx(3.0)
    assert A.decode_speed(recs, 0.15, "snapstream:share=0.1") is None  # the only snapstream row was skipped


def _budget(check: bool):
    b = {"budget": "15%", "fraction": 0.15, "predicted": {"exact_storage_ratio": 0.149, "loss": 0.01},
         "uniform": [{"spec": "quant:bits=2", "storage_ratio": 0.14, "loss": 0.5}, {"spec": "bitmap:sparsity=0.9", "storage_ratio": 0.12, "loss": 0.3}],
         "check": None, "best_uniform": None}
    if check:
        row = lambda nll: {"cases": [{"storage_ratio": 0.148, "nll_increase": nll}], "nll_increase": {"mean": nll, "lo": nll, "hi": nll, "n": 1},  # noqa: E731
                           "agreement": {"mean": 0.9}, "kl": {"mean": 0.01}}
        b.update(check={"plan @ 15%": row(0.01), "snapkv:share=0.5+quant:bits=4": row(0.02)}, best_uniform="snapkv:share=0.5+quant:bits=4",
                 plan_label="plan @ 15%")
    return b


def test_one_best_uniform_per_budget():
    assert A.best_uniform(_budget(False))["spec"] == "bitmap:sparsity=0.9"  # lowest predicted loss that fits
    got = A.best_uniform(_budget(True))
    assert got["spec"] == "snapkv:share=0.5+quant:bits=4" and got["ratio"] == 0.148  # the model-checked one, with its stored share


def test_frontier_reading_names_the_same_best_uniform():
    from kvtool.analysis.html_report import reading_frontier, region_points

    for b in (_budget(False), _budget(True)):
        b["plan"] = Plan({})
        rec = {"menu": ["x"], "budgets": [b], "sensitivity": {"uniform": b["uniform"]}}
        assert A.best_uniform(b)["spec"] in reading_frontier(rec)
    numbered = region_points(_budget(False)["uniform"] + [{"spec": "dense", "storage_ratio": 0.1, "loss": 0.0}, {"spec": "q8", "storage_ratio": 0.5, "loss": 0.1}], 0.15)
    assert [(r["number"], r["spec"]) for r in numbered] == [(1, "bitmap:sparsity=0.9"), (2, "quant:bits=2")]


def test_every_dot_of_the_decision_region_is_labelled_without_overlap():
    from kvtool.analysis.html_report import attention_frontier_figure, region_points

    # 24 settings crowded at 5-20%, as the sample's menu is
    uniform = [{"spec": f"{f}:x={k}", "storage_ratio": 0.05 + 0.025 * k + 0.006 * n, "loss": (0.6 - 0.06 * k + 0.02 * n) ** 2 * 4}
               for n, f in enumerate(("quant", "bitmap", "signvq", "snapstream")) for k in range(6)]
    region = 0.2
    fig = attention_frontier_figure(uniform, [{"storage_ratio": 0.15, "loss": 0.4, "budget": "15%"}], 4, region)
    ax = fig.axes[0]
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    numbers = {int(t.get_text()) for t in ax.texts if t.get_text().isdigit()}
    want = region_points(uniform, region)
    assert len(want) >= 16 and numbers == {r["number"] for r in want}
    boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a.x0 < b.x1 - 0.5 and b.x0 < a.x1 - 0.5 and a.y0 < b.y1 - 0.5 and b.y0 < a.y1 - 0.5), "two labels overlap"
    for t in ax.texts:  # a numbered label without a leader line sits nearest its own dot
        if t.get_text().isdigit() and t.arrow_patch is None:
            r = want[int(t.get_text()) - 1]
            own = ax.transData.transform((100 * r["storage_ratio"], math.sqrt(r["loss"] / 4)))
            assert tuple(ax.transData.transform(t.xy)) == pytest.approx(tuple(own))


def test_plan_words_give_the_range_of_eviction_shares():
    plan = Plan({0: ["snapstream:share=0.125", "snapstream:share=0.5", KIVI4]})
    assert A.plan_words(plan, 3) == "keep 1 of 3 KV heads whole (KIVI-4), evict 50-88% of the tokens (69% on average) in the other 2 (kept in float16)"


def test_the_command_names_the_bundled_sample_as_sample():
    from kvtool.core.sample import SAMPLE_PATH

    assert A.capture_arg(SAMPLE_PATH) == "sample:" and A.capture_arg("caps/x.safetensors") == "caps/x.safetensors"
