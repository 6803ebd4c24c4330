"""kvtool recommend: the knapsack against brute force, budgets, sensitivity on the sample capture,
the CLI (plan file that compress --plan applies, JSON, exit codes) and, with the embedded model,
the model check against the best uniform setting."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from kvtool.core import io
from kvtool.core.errors import UsageError
from kvtool.analysis.modelcheck import interval
from kvtool.analysis.allocation import (
    allocate,
    measure_sensitivity,
    menu,
    parse_budget,
    predicted,
    solve_knapsack,
    uniform_options,
)


def brute_force(costs, losses, budget):
    best, pick = None, None
    for combo in itertools.product(*(range(costs.shape[1]) for _ in range(costs.shape[0]))):
        c = sum(float(costs[g, k]) for g, k in enumerate(combo))
        l = sum(float(losses[g, k]) for g, k in enumerate(combo))
        if c <= budget and (best is None or l < best):
            best, pick = l, combo
    return best, pick


@pytest.mark.parametrize("seed", range(6))
def test_knapsack_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    costs = torch.randint(1, 20, (5, 4), generator=g).double()
    losses = torch.rand(5, 4, generator=g, dtype=torch.float64)
    budget = float(costs.min(1).values.sum() + 15)
    want, _ = brute_force(costs, losses, budget)
    choice = solve_knapsack(costs, losses, budget, buckets=int(budget))  # integer costs: exact buckets
    got = sum(float(losses[r, c]) for r, c in enumerate(choice))
    assert sum(float(costs[r, c]) for r, c in enumerate(choice)) <= budget
    assert got == pytest.approx(want)


def test_knapsack_never_exceeds_budget_with_coarse_buckets():
    g = torch.Generator().manual_seed(7)
    costs = torch.rand(8, 5, generator=g, dtype=torch.float64) * 100
    losses = torch.rand(8, 5, generator=g, dtype=torch.float64)
    budget = float(costs.mean(1).sum())
    choice = solve_knapsack(costs, losses, budget, buckets=37)
    assert sum(float(costs[r, c]) for r, c in enumerate(choice)) <= budget
    best, _ = brute_force(costs[:5], losses[:5], float(costs[:5].mean(1).sum()))
    assert best is not None
    assert solve_knapsack(costs, losses, 1e-3) is None


def test_budget_parsing(sample_capture):
    meta, _ = io.read_header(sample_capture)
    facts = io.facts_from_meta(sample_capture, meta)
    assert parse_budget("15%", facts)["fraction"] == pytest.approx(0.15)
    assert parse_budget("0.25", facts)["fraction"] == pytest.approx(0.25)
    # SmolLM2-135M float16: 2 x 30 layers x 3 KV heads x 64 dims x 2 bytes = 23,040 bytes per token
    b = parse_budget("2GiB", facts, batch=16, context="32k")
    assert b["fraction"] == pytest.approx(2 * 1024**3 / (23040 * 16 * 32768))
    assert "batch 16 x 32768 tokens" in b["how"]
    with pytest.raises(UsageError, match="--batch and --context"):
        parse_budget("2GiB", facts)
    with pytest.raises(UsageError, match="share like 15%"):
        parse_budget("lots", facts)
    with pytest.raises(UsageError, match="fraction"):
        parse_budget("15", facts)


def test_interval():
    iv = interval([1.0, 2.0, 3.0])
    assert iv["mean"] == 2.0 and iv["lo"] == pytest.approx(2 - 4.303 / 3**0.5) and iv["n"] == 3
    assert interval([5.0]) == {"mean": 5.0, "lo": 5.0, "hi": 5.0, "n": 1}


def test_sensitivity_and_allocation_on_the_sample(sample_capture):
    cache = io.load(sample_capture, layers=[7, 15], parts=("keys", "values", "queries"))
    specs = ["dense", "quant:bits=4", "quant:bits=2", "bitmap:sparsity=0.7", "snapstream:budget=96"]
    sens = measure_sensitivity(cache, specs, 32)
    assert sens.bytes.shape == (6, 5) and sens.loss.shape == (6, 5)  # 2 layers x 3 KV heads
    assert float(sens.loss[:, 0].max()) < 1e-6  # dense loses nothing
    assert (sens.loss[:, 2] > sens.loss[:, 1]).all()  # 2-bit worse than 4-bit on every head
    rows = {r["spec"]: r for r in uniform_options(sens)}
    assert rows["dense"]["storage_ratio"] == pytest.approx(1.0)
    plan, pred = allocate(sens, 0.3, cache.facts)
    assert pred["storage_ratio"] <= 0.3
    # the plan is at least as good as every uniform setting that fits
    assert pred["loss"] <= min(r["loss"] for r in rows.values() if r["storage_ratio"] <= 0.3) + 1e-12
    assert set(plan.layers) == {7, 15}
    assert "snapstream:share=0.5" in menu(448) and "dense" in menu(448, ["quant"])  # budgets are shares: plans fit any length


def test_recommend_cli_no_model(sample_capture, tmp_path):
    from typer.testing import CliRunner

    from kvtool.cli import app

    plan_path = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["recommend", str(sample_capture), "--budget", "20%", "--no-model", "--menu", "quant,evict",
                                   "--heldout", "32", "-o", str(plan_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    b = out["budgets"][0]
    assert b["predicted"]["exact_storage_ratio"] <= 0.2 and out["model"] is None and "capture" not in out
    plan = json.loads(plan_path.read_text())
    assert plan["schema"] == "kvtool.plan" and set(plan["layers"]) == {"0", "7", "15", "23"}
    assert plan["chosen_layers"] == [0, 7, 15, 23]  # a capture of 4 of 30 layers: the plan says which it chose for
    comp = tmp_path / "c.safetensors"
    res = CliRunner().invoke(app, ["compress", str(sample_capture), "--plan", str(plan_path), "--heldout", "32", "-o", str(comp), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["storage_ratio"] == pytest.approx(b["predicted"]["exact_storage_ratio"])
    res = CliRunner().invoke(app, ["recommend", str(sample_capture), "--budget", "1%", "--no-model", "-o", str(tmp_path / "p2.json")])
    assert res.exit_code == 2 and "no plan fits" in res.output
    res = CliRunner().invoke(app, ["recommend", str(sample_capture), "--budget", "20%", "--no-model", "--max-nll-increase", "1%", "-o", str(tmp_path / "p3.json")])
    assert res.exit_code == 2 and "needs the model" in res.output


@pytest.mark.model
@pytest.mark.slow
def test_recommend_with_model_checks_a_budget_filling_uniform(sample_capture, tmp_path):
    from kvtool.analysis.recommendation import recommend_capture

    res = recommend_capture(sample_capture, ["20%"], heldout=32, families=["quant", "evict"], use_texts=False, uniform_checks=1)
    b = res["budgets"][0]
    check = b["check"]
    plan = check[b["plan_label"]]["cases"][0]
    best = check[b["best_uniform"]]["cases"][0]
    assert plan["storage_ratio"] <= 0.2 and best["storage_ratio"] <= 0.2
    # the uniform baseline fills the budget (its parameter searched), it is not a menu point that fits
    assert best["storage_ratio"] >= 0.19 and b["best_uniform"] in b["uniform_fills"].values()
    assert plan["kl"] >= 0 and best["kl"] > 0
    assert set(res["layer_weights"]) == {0, 7, 15, 23}


@pytest.mark.model
@pytest.mark.slow
def test_eval_texts_give_intervals(sample_capture, tmp_path):
    from typer.testing import CliRunner

    from kvtool.cli import app

    res = CliRunner().invoke(app, ["eval", str(sample_capture), "--formats", "quant:bits=4", "--no-paper", "--texts", "shipped",
                                   "--heldout", "32", "-o", str(tmp_path / "ev"), "--json"])
    assert res.exit_code == 0, res.output
    row = json.loads(res.output)["points"][0]
    assert [c["case"] for c in row["cases"]] == ["capture", "prose", "code", "dialogue"]
    assert row["relative_nll_increase_lo"] <= row["relative_nll_increase_mean"] <= row["relative_nll_increase_hi"]
    assert 0.5 < row["agreement_mean"] <= 1.0
