"""Predicted decode speed of plans and `recommend --card / --bench / --min-speedup`
(kvtool.analysis.speed): the prediction's arithmetic, which settings the filter keeps, the shipped
cost model, kernel speeds read from bench documents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.analysis import speed as S
from kvtool.core.errors import UsageError

KIVI4 = "quant:bits=4,group=32"


def card(**kernels) -> S.CardSpeed:
    return S.CardSpeed("h100", "NVIDIA H100 80GB HBM3", 0.6, "test",
                       [{"storage": k, "kernel_speedup": v} for k, v in kernels.items()])


def test_prediction_is_the_mean_of_kept_share_over_kernel_speed():
    c = card(**{KIVI4: 0.5, "bitmap:sparsity=0.7": 2.0})
    # layer 0 per KV head: dense (1) and bitmap (1 / 2); layer 1 whole: SnapKV 25% into KIVI-4 (0.25 / 0.5) on both heads
    p = c.predict({0: ["dense", "bitmap:sparsity=0.7"], 1: [f"snapkv:share=0.25+{KIVI4}"]}, num_layers=2, kv_heads=2)
    att = (1 + 0.5 + 0.5 + 0.5) / 4
    assert p["predicted_attention_speedup"] == pytest.approx(1 / att)
    assert p["predicted_decode_speedup"] == pytest.approx(1 / (0.4 + 0.6 * att))
    assert p["card"] == "h100" and p["attention_share"] == 0.6 and "unchanged" in p["assumes"]
    # a layer the plan leaves out takes its default (dense): slower overall
    q = c.predict({0: ["dense", "bitmap:sparsity=0.7"]}, num_layers=2, kv_heads=2)
    assert q["predicted_attention_speedup"] == pytest.approx(1 / ((1 + 0.5 + 1 + 1) / 4))
    # a plan of dense only is dense
    assert c.predict({}, num_layers=3, kv_heads=2)["predicted_decode_speedup"] == pytest.approx(1.0)


def test_an_unmeasured_storage_leaves_the_plan_unpredicted():
    p = card(**{KIVI4: 0.5}).predict({0: ["signvq:bits=2"]}, num_layers=1, kv_heads=2)
    assert p["predicted_decode_speedup"] is None and "signvq:bits=2" in p["unmeasured"]
    null = S.CardSpeed("h200", "H200", 0.5, "", [{"storage": KIVI4, "kernel_speedup": None, "source": "not yet measured"}])
    assert null.predict({0: ["quant:bits=4"]}, 1, 1)["unmeasured"] == {"quant:bits=4": "not yet measured"}


def test_entries_match_on_the_parameters_they_name_with_the_formats_defaults():
    c = card(**{KIVI4: 0.9, "quant:bits=4,group=128": 0.95})
    assert c.kernel_speedup("quant:bits=4")[0] == 0.9  # the format's default group is 32
    assert c.kernel_speedup("quant:bits=4,group=128,residual=0,partial=true")[0] == 0.95
    assert c.kernel_speedup("quant:bits=2")[0] is None
    assert S.split_setting("snapstream:share=0.25") == ("dense", 0.25)  # eviction alone: dense storage of the kept tokens
    assert S.split_setting(f"snapkv:share=0.5+{KIVI4}") == (KIVI4, 0.5)
    assert S.split_setting("snapkv:budget=8192+quant:bits=4", context=32768) == ("quant:bits=4", 0.25)
    with pytest.raises(UsageError, match="context"):
        S.split_setting("snapkv:budget=8192+quant:bits=4")


def test_min_speedup_keeps_only_settings_at_least_that_fast():
    c = card(**{KIVI4: 0.89, "bitmap:sparsity=0.7": 1.5})
    specs = ["dense", "quant:bits=4", "bitmap:sparsity=0.7", f"snapkv:share=0.5+{KIVI4}", "snapstream:share=1", "signvq:bits=2"]
    kept, dropped = c.keep(specs, 1.0)
    assert kept == ["dense", "bitmap:sparsity=0.7", f"snapkv:share=0.5+{KIVI4}", "snapstream:share=1"]  # 1.0x itself stays
    assert "0.89x" in dropped["quant:bits=4"] and "measured" in dropped["signvq:bits=2"]
    kept, _ = c.keep(specs, 1.6)
    assert kept == ["dense", f"snapkv:share=0.5+{KIVI4}"]  # 0.89 / 0.5 = 1.78; dense always stays (the plans' fallback)


def test_the_shipped_cost_model():
    doc = S.load_cost_model()
    h100, h200 = S.from_package("NVIDIA H100 80GB HBM3", doc), S.from_package("h200", doc)
    assert 0 < h100.attention_share < 1 and 0 < h200.attention_share < 1
    for c, name, key in ((h100, "kivi.json", "h100"), (h200, "kivi-h200.json", "h200")):
        shipped_run = S.from_bench(Path(__file__).resolve().parents[1] / "docs/benchmarks" / name, key)
        for spec in ("quant:bits=4", "quant:bits=4,group=128", "quant:bits=2"):  # the shipped entries are that run's
            assert c.kernel_speedup(spec)[0] > 1.5
            assert c.kernel_speedup(spec)[0] == pytest.approx(shipped_run.kernel_speedup(spec)[0], abs=1e-3)
    shipped_attention = S.from_bench(Path(__file__).resolve().parents[1] / "docs/benchmarks/attention.json", "h100")
    for spec in ("bitmap:sparsity=0.5", "bitmap:sparsity=0.7"):  # the H100's bitmap entries are that run's
        assert h100.kernel_speedup(spec)[0] == pytest.approx(shipped_attention.kernel_speedup(spec)[0], abs=1e-3)
    assert h200.kernel_speedup("bitmap:sparsity=0.5")[0] is None  # not measured on the H200
    for c in (h100, h200):
        for e in c.kernels:  # every entry names a storage kvtool can build, and states where its number comes from
            assert S._resolved(e["storage"]) or e["storage"] == "dense"
            assert e["source"]
    with pytest.raises(UsageError, match="H100 or an H200"):
        S.from_package("a100")


def test_choose_defaults():
    cards, chosen, m = S.choose(None, None, None)
    assert [c.card for c in cards] == ["h100", "h200"] and chosen is None and m is None
    cards, chosen, m = S.choose("h100", None, None)
    assert chosen.card == "h100" and m == 1.0
    assert S.choose("h100", None, 1.3)[2] == 1.3
    with pytest.raises(UsageError, match="needs a card"):
        S.choose(None, None, 1.2)


def bench_doc(sub, records, device="NVIDIA H100 80GB HBM3"):
    return {"kvtool_bench": 1, "subcommand": sub, "date": "2026-11-27T00:00:00Z", "commit": "abc", "env": {"device": device}, "records": records}


def rec(provider, us, batch=8, seq=32768, **kw):
    return {"kernel": kw.pop("kernel", "decode"), "provider": provider, "batch": batch, "seq": seq, "median_us": us, "speedup": kw.pop("speedup", {}), **kw}


def test_kernel_speeds_from_a_bench_decode_document(tmp_path):
    doc = bench_doc("decode", [
        rec("dense/sdpa", 20000, attention_us=12000, attention_share=0.6),
        rec("quant:bits=4", 22000, attention_us=15000),
        rec("snapstream:budget=4096", 9000, attention_us=2000),  # 12.5% of the tokens in 1/6 of the time
        rec("docs/plan.json", 9000, attention_us=2000),  # a plan: no single storage
        rec("dense/sdpa", 2000, batch=1, attention_us=1500, attention_share=0.75),
    ])
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(doc))
    c = S.from_bench(path)
    assert c.card == "h100" and c.attention_share == 0.6 and c.source == str(path)
    assert c.kernel_speedup("quant:bits=4")[0] == pytest.approx(0.8)
    assert c.kernel_speedup("bitmap:sparsity=0.7")[0] == 1.702  # not in the file: the shipped H100 number
    assert c.kernels[1]["storage"] == "dense" and c.kernels[1]["kernel_speedup"] == pytest.approx(6 * 0.125)
    with pytest.raises(UsageError, match="not the --card"):
        S.from_bench(path, "h200")


def test_kernel_speeds_from_bench_kivi_and_attention_documents(tmp_path):
    kivi = bench_doc("kivi", [rec("sdpa", 250, kernel="kivi"), rec("kivi4_g128", 125, kernel="kivi", speedup={"best_dense": 2.0}),
                              rec("kivi4", 125, batch=1, kernel="kivi", speedup={"best_dense": 9.0})], device="NVIDIA H200")
    (tmp_path / "k.json").write_text(json.dumps(kivi))
    c = S.from_bench(tmp_path / "k.json", "h200")
    assert c.kernel_speedup("quant:bits=4,group=128")[0] == 2.0
    # only batch 8 x 32k is read: the batch-1 record leaves the shipped H200 entry in place
    assert c.kernel_speedup("quant:bits=4")[0] == S.from_package("h200").kernel_speedup("quant:bits=4")[0] != 9.0
    att = bench_doc("attention", [rec("bitmap", 200, kernel="bitmap_attention", sparsity=0.5, speedup={"best_dense": 1.25})])
    (tmp_path / "a.json").write_text(json.dumps(att))
    assert S.from_bench(tmp_path / "a.json").kernel_speedup("bitmap:sparsity=0.5")[0] == 1.25
    (tmp_path / "x.json").write_text(json.dumps(bench_doc("dense", [rec("sdpa", 100, kernel="dense")])))
    with pytest.raises(UsageError, match="bench decode, kivi or attention"):
        S.from_bench(tmp_path / "x.json")


def test_recommend_states_each_plans_predicted_speed_and_keeps_fast_settings(tiny_capture, tmp_path):
    """`recommend --card h100`: the menu holds only settings at least 1.0x dense on the H100 (the
    shipped model), the plan file and --json carry the prediction for that card; without --card the
    plan carries one prediction per shipped card and nothing is dropped for speed."""
    from typer.testing import CliRunner

    from kvtool.cli import app

    base = ["recommend", str(tiny_capture), "--budget", "40%", "--heldout", "16", "--no-model", "--no-texts", "--menu", "quant,bitmap,evict,pipeline"]
    res = CliRunner().invoke(app, base + ["--card", "h100", "--json", "-o", str(tmp_path / "fast.json")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    data = out.get("data", out)
    ds = data["decode_speed"]
    # KIVI-4 runs at 1.84x dense on the H100 (the CUDA kernel) and stays; a storage with no measured speed goes
    assert ds["card"] == "h100" and ds["min_speedup"] == 1.0 and "quant:bits=4" in data["menu"] and "quant:bits=8" in ds["dropped"]
    h100 = S.from_package("h100")
    assert all(s == "dense" or h100.setting_speedup(s)[0] >= 1.0 for s in data["menu"])
    pred = data["budgets"][0]["predicted_decode"]
    assert [p["card"] for p in pred] == ["h100"] and pred[0]["predicted_decode_speedup"] >= 1.0
    plan = json.loads((tmp_path / "fast.json").read_text())
    assert plan["predicted_decode"] == pred
    layers = {int(i): (v if isinstance(v, list) else [v]) for i, v in plan["layers"].items()}
    again = h100.predict(layers, plan["model"]["num_layers"], plan["model"]["num_kv_heads"], plan["default"])
    assert again["predicted_decode_speedup"] == pytest.approx(pred[0]["predicted_decode_speedup"])
    res = CliRunner().invoke(app, base + ["--json", "-o", str(tmp_path / "any.json")])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    data = data.get("data", data)
    assert [p["card"] for p in data["budgets"][0]["predicted_decode"]] == ["h100", "h200"] and data["decode_speed"]["min_speedup"] is None
    assert "quant:bits=4" in data["menu"]
    bad = CliRunner().invoke(app, base + ["--min-speedup", "1.2", "-o", str(tmp_path / "x.json")])
    assert bad.exit_code == 2 and "needs a card" in bad.output
