"""Long-context tasks (kvtool tasks), budget-filling baselines, press adapters and share budgets.

Everything runs on the tiny random Llama and its byte tokenizer (fast, CI); the real kvpress presses
are tested only where kvpress is installed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvtool.analysis import fill, taskeval, taskrun
from kvtool.analysis import tasks as T
from kvtool.core.cache import KVCache, LayerKV
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats.base import compress_cache, get_format, load_compressed, save_compressed
from kvtool.formats.mixed import encode_kept_heads, resolve_spec
from kvtool.formats.pipeline import encode_kept
from kvtool.formats.plan import compress_kept
from kvtool.hf import presses as hfpress
from tests.conftest import make_byte_tokenizer, synthetic_cache


@pytest.fixture(scope="module")
def tok():
    return make_byte_tokenizer()


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from kvtool.hf import models

    model, tokenizer, source = models.load(str(tiny_llama_dir))
    return model, tokenizer, source


# ----------------------------------------------------------------------------- generation


@pytest.mark.parametrize("task", T.TASKS)
def test_samples_fill_the_length_and_repeat_from_the_seed(tok, task):
    # the byte tokenizer spends a token per character: 1,500 tokens are a few hundred words
    a = T.generate_sample(tok, task, 1500, seed=3, index=1)
    b = T.generate_sample(tok, task, 1500, seed=3, index=1)
    c = T.generate_sample(tok, task, 1500, seed=4, index=1)
    assert (a.context, a.question, a.answer) == (b.context, b.question, b.answer)
    assert (a.context, a.answer) != (c.context, c.answer)
    assert 1500 - 12 <= a.prompt_tokens <= 1500
    assert len(a.scored) == len(a.answer) and any(a.scored)
    text = tok.decode(a.context)
    if task.startswith("niah") or task == "vt":
        for value in a.answers:  # every value asked for is in the context, before the question
            assert value in text


def test_needles_sit_at_their_depths(tok):
    s = T.generate_sample(tok, "niah_multikey", 1200, seed=0, index=2)
    assert len(s.meta["depths"]) == 4 and all(0 <= d <= 1 for d in s.meta["depths"])


def test_task_and_family_names_agree_with_the_cli():
    from kvtool.commands import tasks as cmd

    assert cmd.TASK_NAMES == T.TASKS and cmd.FAMILY_NAMES == fill.FAMILIES and cmd.MULTI_QUESTION_TASKS == T.MULTI_QUESTION_TASKS


def test_parse_lengths_and_tasks():
    assert T.parse_lengths("1k,2048") == [1024, 2048]
    assert T.parse_tasks("all") == list(T.TASKS)
    with pytest.raises(UsageError):
        T.parse_tasks("niah_nope")
    with pytest.raises(UsageError):
        T.parse_lengths("100")


def test_wilson_interval():
    iv = taskeval.wilson(45, 50)
    assert iv["mean"] == 0.9 and 0.78 < iv["lo"] < 0.79 and 0.95 < iv["hi"] < 0.96
    assert taskeval.wilson(0, 50)["lo"] == 0.0 and taskeval.wilson(50, 50)["hi"] == 1.0


# ----------------------------------------------------------------------------- scoring


def test_forced_scoring_agrees_with_greedy_decoding(tiny):
    """The forced pass's top-1 at the first answer position is greedy decoding's first token, and a
    sample whose expected answer is what greedy decoding produces is scored right both ways."""
    model, tokenizer, _ = tiny
    s = T.generate_sample(tokenizer, "niah_single", 400, seed=0, index=0)
    prep = taskeval.prepare(model, tokenizer, s)
    forced = taskeval.answer(model, tokenizer, prep, scoring="forced")
    greedy = taskeval.answer(model, tokenizer, prep, scoring="greedy", max_new=4)
    assert greedy["ids"], "the seeded tiny model ended its turn at once: nothing to compare"
    assert greedy["ids"][0] == forced["ids"][0]
    # make the model's own greedy output the expected answer: both scorings call it right
    out = greedy["ids"][:3]
    s.answer, s.scored, s.answers = out, [True] * len(out), [tokenizer.decode(out)]
    assert taskeval.answer(model, tokenizer, prep, scoring="forced")["correct"]
    assert taskeval.answer(model, tokenizer, prep, scoring="greedy", max_new=4)["correct"]


def test_compressed_answer_through_dense_spec_matches_dense(tiny):
    model, tokenizer, _ = tiny
    s = T.generate_sample(tokenizer, "niah_multikey", 700, seed=1, index=0)
    prep = taskeval.prepare(model, tokenizer, s, dtype="float32")
    fmt, params = resolve_spec("dense")
    a = taskeval.answer(model, tokenizer, prep, compress_cache(prep.cache, fmt, params))
    b = taskeval.answer(model, tokenizer, prep, None)
    assert a["text"] == b["text"] and math.isclose(a["nll"], b["nll"], rel_tol=1e-4)


# ----------------------------------------------------------------------------- fair bytes


@pytest.mark.parametrize("family", fill.FAMILIES)
@pytest.mark.parametrize("fraction", [0.15, 0.5])
def test_filled_families_fit_and_fill_the_budget(family, fraction):
    spec = fill.fill_spec(family, fraction, 300, 2, 4, 64)
    if spec is None:
        assert family in ("kivi", "rkivi", "signvq", "bitmap", "bitmapq")  # bitmap keeps 32 recent tokens dense: too many of 300
        return
    r = fill.spec_ratio(spec, 300, 2, 4, 64)
    assert r <= fraction + 1e-12
    if family != "signvq":  # sign-VQ has no knob finer than its bits
        # the searched parameter fills the budget up to one step (a token, or an element per token),
        # or as far as the family's most generous setting goes (eviction keeping every token, say)
        most = fill.spec_ratio(fill.fill_spec(family, 0.99, 300, 2, 4, 64), 300, 2, 4, 64)
        assert r > min(fraction, most) - 0.02


def test_kivi_fills_with_partial_groups_and_residual():
    spec = fill.fill_spec("kivi", 0.25, 1000, 3, 9, 64)
    assert "partial=true" in spec and "residual=" in spec
    assert fill.fill_spec("kivi", 0.10, 1000, 3, 9, 64) is None


def test_quant_partial_groups_round_trip():
    cache = synthetic_cache(tokens=70, head_dim=16)
    layer = cache.layers[0]
    fmt, params = resolve_spec("quant:bits=4,group=32,residual=0,partial=true")
    enc = fmt.encode(layer, params)
    fmt.validate(enc)
    assert enc.meta["key_tokens"] == 70 and "residual.keys" in enc.tensors and enc.tensors["residual.keys"].shape[2] == 0
    back = fmt.decode(enc)
    err = (back.keys.float() - layer.keys.float()).norm() / layer.keys.float().norm()
    assert err < 0.2
    whole = fmt.encode(layer, resolve_spec("quant:bits=4,group=32,residual=0")[1])
    assert sum(fmt.nbytes(enc).values()) < sum(fmt.nbytes(whole).values())


def test_ratios_are_over_float16_whatever_the_capture_dtype():
    c32 = synthetic_cache(dtype=torch.float32)
    c16 = synthetic_cache(dtype=torch.float16)
    fmt, params = resolve_spec("quant:bits=4")
    r32 = compress_cache(c32, fmt, params).byte_report()
    r16 = compress_cache(c16, fmt, params).byte_report()
    assert r32["dense_bytes"] == r16["dense_bytes"] and r32["stored_bytes"] == r16["stored_bytes"]
    dense = compress_cache(c32, *resolve_spec("dense")).byte_report()
    assert math.isclose(dense["storage_ratio"], 1.0)  # full-precision parts count in float16, the denominator's dtype


def test_eviction_share_fits_any_length():
    for tokens in (80, 160):
        cache = synthetic_cache(tokens=tokens)
        cc = compress_cache(cache, *resolve_spec("snapkv:share=0.5+dense"))
        kept = cc.layers[0].tensors["pipeline.kept"].shape[-1]
        assert kept == tokens // 2
        ss = compress_cache(cache, *resolve_spec("snapstream:share=0.5"))
        assert ss.layers[0].meta["budget"] == tokens // 2
    with pytest.raises(UsageError):
        resolve_spec("snapkv:share=0.5,budget=20+dense")


def test_default_capture_dtype_is_16_bit(tiny):
    from kvtool.hf.capture import capture

    model, tokenizer, _ = tiny
    cache = capture("a short prompt", model=(model, tokenizer))
    assert cache.facts.dtype == "float16" and cache.layers[0].keys.dtype == torch.float16


# ----------------------------------------------------------------------------- kept tokens


def test_kept_tokens_become_a_real_file(tmp_path):
    cache = synthetic_cache(tokens=64)
    kept = {i: [torch.tensor([[0, 3, 9, 40]]), torch.tensor([[1, 2, 5, 7, 8, 63]])] for i in cache.layer_indices}
    cc = compress_kept(cache, kept, "dense", "hand-made")
    assert cc.format == "mixed"
    rep = cc.byte_report()
    per_token = 2 * 16 * 2 + 2  # keys + values float16, one int16 position
    assert rep["stored_bytes"] == len(cache.layers) * (4 + 6) * per_token
    path = save_compressed(cc, tmp_path / "kept.safetensors")
    back = load_compressed(path)
    q = torch.randn(1, 4, 2, 16, dtype=torch.float16)
    for i in cache.layer_indices:
        out, _ = get_format("mixed").attend(q, back.layers[i])
        # head 0's query heads attend exactly the 4 kept tokens of KV head 0
        k = cache.layers[i].keys[:, 0:1, [0, 3, 9, 40]].float()
        v = cache.layers[i].values[:, 0:1, [0, 3, 9, 40]].float()
        p = torch.softmax(q[:, :2].float() @ k.transpose(-1, -2) / 4.0, -1)
        assert torch.allclose(out[:, :2], p @ v, atol=1e-3)
    quant = compress_kept(cache, kept, "quant:bits=4,group=32,residual=0,partial=true", "hand-made")
    assert quant.byte_report()["stored_bytes"] < rep["stored_bytes"]


def test_kept_positions_are_checked():
    layer = synthetic_cache(tokens=32).layers[0]
    with pytest.raises(UsageError):
        encode_kept(layer, torch.tensor([[[3, 2], [0, 1]]]))  # not ascending
    with pytest.raises(UsageError):
        encode_kept(layer, torch.tensor([[[0, 99], [0, 1]]]))  # outside the tokens
    with pytest.raises(UsageError):
        encode_kept_heads(layer, [torch.tensor([[0, 1]])])  # one head of two


class FakeScorer:
    """A stand-in with kvpress's press interface: keeps the ``n`` keys of largest norm per head."""

    def __init__(self, n: int):
        self.n = n
        self.compression_ratio = 0.5

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return keys.float().norm(dim=-1)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        idx = self.score(module, hidden_states, keys, values, attentions, kwargs).topk(self.n, dim=-1).indices
        g = idx[..., None].expand(*idx.shape, keys.shape[-1])
        return keys.gather(2, g), values.gather(2, g)


class FakeHeadwise(FakeScorer):
    """Evicts per head like kvpress's AdaKV: leaves the keys whole and lists what it drops."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        b, h, t, _ = keys.shape
        drop = [(0, hh, p) for hh in range(h) for p in range(t) if p % (hh + 2) == 1]
        module.masked_key_indices = tuple(torch.tensor(x) for x in zip(*drop))
        return keys, values


def _inputs(model, tokenizer, text="a context of some length for the press " * 4):
    from kvtool.hf.capture import capture

    inputs = hfpress.AttentionInputs()
    with hfpress.recording_inputs(model, inputs):
        cache = capture(text, model=(model, tokenizer), dtype="float32")
    for i, layer in cache.layers.items():
        inputs.keys[i], inputs.values[i] = layer.keys, layer.values
    return cache, inputs


def test_press_adapter_reads_kept_rows_and_headwise_masks(tiny):
    model, tokenizer, _ = tiny
    cache, inputs = _inputs(model, tokenizer)
    t = cache.num_tokens
    kept = hfpress.press_kept(model, FakeScorer(10), inputs)
    for i, heads in kept.items():
        for h, pos in enumerate(heads):
            want = cache.layers[i].keys[0, h].float().norm(dim=-1).topk(10).indices.sort().values
            assert torch.equal(pos[0], want)
    ragged = hfpress.press_kept(model, FakeHeadwise(0), inputs)
    assert [len(p[0]) for p in ragged[0]] == [t - len(range(1, t, 2)), t - len(range(1, t, 3))]
    cc = compress_kept(cache, ragged, "dense", "fake head-wise")
    assert len(cc.layers[0].meta["groups"]) == 2
    assert not hasattr(model.model.layers[0].self_attn, "rotary_emb")  # lent to the press, taken back


def test_press_adapter_refuses_presses_that_change_keys(tiny):
    model, tokenizer, _ = tiny

    class Merging(FakeScorer):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            return keys[:, :, :4] * 0.5, values[:, :, :4]

    _, inputs = _inputs(model, tokenizer)
    with pytest.raises(BadDataError):
        hfpress.press_kept(model, Merging(4), inputs)


def test_press_specs():
    spec = hfpress.parse_press("adakv-snapkv:keep=0.25,window_size=16")
    assert spec.adakv and spec.name == "snapkv" and spec.keep == 0.25 and spec.fields == {"window_size": "16"}
    with pytest.raises(UsageError):
        hfpress.parse_press("nopress:keep=0.2")
    with pytest.raises(UsageError):
        hfpress.parse_press("snapkv")
    assert fill.press_keep(0.15, 1000, 64) == pytest.approx(0.1485, abs=1e-3)


def test_real_kvpress_presses_become_files(tiny):
    pytest.importorskip("kvpress")
    model, tokenizer, _ = tiny
    cache, inputs = _inputs(model, tokenizer, "the real press reads this context " * 8)
    for name in ("snapkv:window_size=8", "knorm", "tova", "expected_attention:n_future_positions=16", "streaming_llm", "adakv-knorm"):
        spec = hfpress.parse_press(name, keep=0.3)
        press = hfpress.reuse_scores(hfpress.make_press(spec))
        kept = hfpress.press_kept(model, press, inputs)
        cc = compress_kept(cache, kept, "dense", spec.label)
        assert 0.25 < cc.byte_report()["storage_ratio"] < 0.45  # 30% of the tokens (float32 counted in float16) and their positions
        hfpress.set_keep(press, 0.6)  # the same press again at another share reuses its scores
        again = hfpress.press_kept(model, press, inputs)
        assert sum(len(p[0]) for p in again[0]) > sum(len(p[0]) for p in kept[0])


# ----------------------------------------------------------------------------- the run and the CLI


def test_tasks_cli_runs_resumes_and_writes(tiny_llama_dir, tmp_path):
    from typer.testing import CliRunner

    from kvtool.cli import app

    out = tmp_path / "t"
    args = ["tasks", "--model", str(tiny_llama_dir), "--tasks", "niah_single,niah_essay", "--lengths", "400", "--samples", "2",
            "--methods", "dense,kivi,snapkv+kivi4", "--budgets", "25%", "--out-dir", str(out), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert {c["setting"] for c in data["cells"]} == {"dense", "kivi @ 25%", "snapkv+kivi4 @ 25%"}
    assert all(c["n"] == 2 for c in data["cells"])
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 3
    for r in map(json.loads, lines):
        assert r["storage_ratio"] <= (1.0 if r["setting"] == "dense" else 0.25 + 1e-9)
    res = CliRunner().invoke(app, args)  # a rerun reads every row back, computes nothing
    assert res.exit_code == 0 and len((out / "samples.jsonl").read_text().splitlines()) == len(lines)
    assert (out / "tasks.csv").exists() and (out / "frontier.png").exists()


def test_summary_marks_budgets_a_family_cannot_reach():
    rows = [{"sample": "a", "task": "niah_single", "length": 1024, "setting": "signvq @ 10%", "method": "signvq", "budget": 0.1,
             "unavailable": "cannot"},
            {"sample": "a", "task": "niah_single", "length": 1024, "setting": "dense", "method": "dense", "budget": None, "correct": True,
             "part": 1.0, "storage_ratio": 1.0, "spec": "dense"}]
    s = taskrun.summarize(rows)
    cell = next(c for c in s["cells"] if c["setting"] == "signvq @ 10%")
    assert cell["n"] == 0 and cell["unavailable"]


def test_recommend_tasks_objective_and_servable_plan(tiny_llama_dir, tmp_path):
    from kvtool.analysis.recommendation import recommend_tasks
    from kvtool.analysis.allocation import token_share

    res = recommend_tasks(["30%"], ["niah_single"], [400], calib_samples=1, calib_seed=1, check_samples=1, check_seed=0,
                          model=str(tiny_llama_dir), weights=False, servable="paged")
    b = res["budgets"][0]
    plan = b["plan"]
    assert plan.extra["budget"]["fraction"] == 0.3 and plan.extra["servable"] == "paged"
    for specs in plan.layers.values():
        assert len({token_share(s) for s in specs}) == 1  # one token budget per layer
    assert b["predicted"]["exact_storage_ratio"] <= 0.3 + 1e-9
    assert {"dense", "plan:recommended @ 30%"} <= {r["setting"] for r in b["task_check"]["by_setting"]}
    with pytest.raises(UsageError):
        recommend_tasks(["30%"], ["niah_single"], [400], calib_seed=2, check_seed=2, model=str(tiny_llama_dir))


def test_servable_plan_exports_to_pages(tmp_path):
    from kvtool.export.convert import export_file
    from kvtool.export.paged import from_paged, load_paged
    from kvtool.formats.plan import Plan, compress_plan

    cache = synthetic_cache(tokens=96, head_dim=16, dtype=torch.float16)
    plan = Plan({0: ["snapkv:share=0.5+quant:bits=4,group=32,residual=0,partial=true"], 1: ["quant:bits=4", "dense"]})
    cc = compress_plan(cache, plan, heldout=16)
    src = tmp_path / "plan.safetensors"
    save_compressed(cc, src)
    report = export_file(src, "paged", tmp_path / "p.paged.safetensors", page_size=8)
    paged = load_paged(tmp_path / "p.paged.safetensors")
    assert paged.layer_tables  # the layers keep different token counts
    seqs = from_paged(paged)
    assert seqs[0][0][0].shape[1] == 40 + 16 and seqs[1][0][0].shape[1] == 80 + 16
    assert report["next_position"] == 96
    assert [(r["layer"], r["seq_len"]) for r in report["layers"]] == [(0, 40 + 16), (1, 80 + 16)]


def test_report_takes_a_tasks_folder(tiny_capture, tmp_path):
    from kvtool.analysis.html_report import build_report

    rows = []
    for i in range(3):
        for setting, method, budget, ok, stored in (("dense", "dense", None, True, 1.0), ("kivi @ 25%", "kivi", 0.25, i == 0, 0.248)):
            rows.append({"sample": f"niah_single:400:0:{i}", "task": "niah_single", "length": 400, "setting": setting, "method": method,
                         "budget": budget, "correct": ok, "part": float(ok), "storage_ratio": stored, "spec": method})
    out = tmp_path / "t"
    out.mkdir()
    taskrun.write_outputs(taskrun.summarize(rows), out)
    text, summary = build_report(tiny_capture, ["40%"], use_model=False, use_texts=False, heldout=16, tasks_dir=out)
    assert "tasks" in summary["sections"] and "kivi @ 25%" in text and "33% [" in text
    with pytest.raises(UsageError):
        build_report(tiny_capture, ["40%"], use_model=False, use_texts=False, heldout=16, tasks_dir=tmp_path / "nothing")


def test_the_attend_path_answers_as_the_live_cache(tiny):
    """kvtool tasks decodes the question through the encoded prefix (decoded once where the format's
    attention is attention over its decoding); the live cache of the same file gives the same logits
    for a format that keeps the question's tokens (KIVI)."""
    from kvtool.hf import attention as hfattn
    from kvtool.hf.live import live_cache_from

    model, tokenizer, _ = tiny
    s = T.generate_sample(tokenizer, "niah_single", 400, seed=2, index=0)
    prep = taskeval.prepare(model, tokenizer, s)
    cc = compress_cache(prep.cache, *resolve_spec("quant:bits=4"))
    ours = taskeval.answer(model, tokenizer, prep, cc)
    ids = torch.cat([prep.feed, torch.tensor([s.answer])[:, :-1]], dim=1)
    logits = hfattn.forward(model, live_cache_from(cc, model), ids)
    top = logits[0, prep.feed.shape[1] - 1:].argmax(-1).tolist()
    assert top == ours["ids"]


@pytest.mark.gpu
@pytest.mark.parametrize("methods", ["dense,kivi,snapkv+kivi4,bitmap,streaming", "press:knorm,press:snapkv,press:adakv-expected_attention"])
def test_tasks_on_cuda_score_as_on_the_cpu(tiny_llama_dir, tmp_path, methods):
    """The model, its cache and the presses on the GPU; the compression and the scoring the same."""
    from typer.testing import CliRunner

    from kvtool.cli import app

    if methods.startswith("press:"):
        pytest.importorskip("kvpress")
    rows = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        args = ["tasks", "--model", str(tiny_llama_dir), "--tasks", "niah_single,niah_essay", "--lengths", "400", "--samples", "2",
                "--methods", methods, "--budgets", "25%", "--device", device, "--out-dir", str(out), "--json"]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        rows[device] = {(r["sample"], r["setting"]): r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}
    assert rows["cpu"].keys() == rows["cuda"].keys() and rows["cpu"]
    for key, cpu in rows["cpu"].items():
        gpu = rows["cuda"][key]
        if "unavailable" in cpu:  # a family that cannot reach the budget: the same on both
            assert gpu.get("unavailable") == cpu["unavailable"], key
            continue
        assert gpu["storage_ratio"] == pytest.approx(cpu["storage_ratio"], rel=1e-6), key
        assert gpu["answer_nll"] == pytest.approx(cpu["answer_nll"], rel=2e-2, abs=2e-2), key
