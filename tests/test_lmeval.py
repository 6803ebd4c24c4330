"""kvtool as an lm-eval model type (kvtool.hf.lmeval): the ``press`` argument, the registration under
``kvtool``, and requests through a press on the tiny Llama: with ``dense`` the answers are the model's
own (greedy text, log-likelihoods of a full forward); with a compressing press they run through the
live cache. The lm-eval parts skip when lm-eval is not importable (it is an optional extra)."""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.core.errors import UsageError
from kvtool.hf.lmeval import press_spec


def test_press_argument(tmp_path):
    assert press_spec(None) == "dense"
    assert press_spec("quant:bits=2;group=128;rotate=hadamard") == "quant:bits=2,group=128,rotate=hadamard"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema": "kvtool.plan", "version": 1, "default": "dense", "layers": {}}))
    assert press_spec(str(plan)) == plan
    with pytest.raises(UsageError, match="no such plan"):
        press_spec(str(tmp_path / "missing.json"))


@pytest.fixture(scope="module")
def lm(tiny_llama_dir):
    pytest.importorskip("lm_eval")
    from kvtool.hf.lmeval import KvtoolLM

    return KvtoolLM(pretrained=str(tiny_llama_dir))


def _req(kind, *args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


def test_registered_as_kvtool():
    pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model

    from kvtool.hf.lmeval import KvtoolLM

    assert get_model("kvtool") is KvtoolLM


def test_dense_requests_are_the_models_own(lm):
    prompt = "kvtool lm-eval test: the quick brown fox " * 4
    [text] = lm.generate_until([_req("generate_until", prompt, {"until": ["\n\n"], "max_gen_toks": 6})])
    ids = torch.tensor([lm._ids(prompt)])
    ref = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    want = lm.tokenizer.decode([t for t in ref if t not in lm.eos], skip_special_tokens=True).split("\n\n")[0]
    assert text == want
    cont = " jumps over"
    [(ll, greedy)] = lm.loglikelihood([_req("loglikelihood", prompt, cont)])
    full = torch.tensor([lm._ids(prompt) + lm._ids(cont)])
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(full).logits[0].float(), -1)
    n = len(lm._ids(cont))
    target = full[0, -n:]
    assert ll == pytest.approx(float(logp[-n - 1:-1].gather(1, target[:, None]).sum()), rel=1e-4)
    assert greedy == bool((logp[-n - 1:-1].argmax(-1) == target).all())


def test_a_press_compresses_the_context(lm):
    from kvtool.hf.lmeval import KvtoolLM

    prompt = "a long context for the press to compress, " * 8 + "and the question"
    dense = lm.loglikelihood([_req("loglikelihood", prompt, " is here")])[0][0]
    pressed = KvtoolLM.__new__(KvtoolLM)
    pressed.__dict__.update(lm.__dict__)
    pressed.spec = press_spec("snapstream:budget=32;recent=8")
    ll = pressed.loglikelihood([_req("loglikelihood", prompt, " is here")])[0][0]
    assert ll != pytest.approx(dense, rel=1e-6)  # 32 of the context's tokens kept: the scores change
    pressed.split = ["no such marker", ", and the"]
    assert pressed._split(prompt)[1] == pressed._ids(", and the question")
    [text] = pressed.generate_until([_req("generate_until", prompt, {"until": ["."], "max_gen_toks": 3})])
    assert isinstance(text, str) and "." not in text


def test_the_command_line_gets_the_models_tokenizer(tiny_llama_dir):
    """kvtool-lm-eval adds tokenizer=FOLDER for a kvtool model (RULER's tasks load it by name) unless one is given."""
    from kvtool.hf.lmeval import with_tokenizer

    tiny = str(tiny_llama_dir)
    base = ["--model", "kvtool", "--model_args", f"pretrained={tiny},press=dense", "--tasks", "niah_single_1"]
    assert with_tokenizer(base) == base[:3] + [f"pretrained={tiny},press=dense,tokenizer={tiny}"] + base[4:]
    assert with_tokenizer(["run"] + base) == ["run"] + with_tokenizer(base)
    spaced = ["run", "-M", "kvtool", "-a", f"pretrained={tiny}", "press=dense", "--tasks", "niah_single_1"]
    assert with_tokenizer(spaced) == spaced[:5] + [f"press=dense,tokenizer={tiny}"] + spaced[6:]
    as_json = ["--model=kvtool", f'--model_args={{"pretrained": "{tiny}"}}']
    assert with_tokenizer(as_json) == ["--model=kvtool", "--model_args=" + json.dumps({"pretrained": tiny, "tokenizer": tiny})]
    for given in (base[:3] + [f"pretrained={tiny},tokenizer=other"],
                  base + ["--metadata", '{"tokenizer": "other", "max_seq_lengths": [512]}'],
                  ["--model", "hf", "--model_args", "pretrained=gpt2"], ["ls", "tasks"]):
        assert with_tokenizer(given) == given


def test_a_ruler_task_through_the_harness(tiny_llama_dir, monkeypatch):
    """lm-eval's own evaluator runs RULER's niah_single_1 (generated offline with the model's
    tokenizer) through the kvtool model type and a press: every request answered, scored by RULER."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")  # lm-eval's ruler extra
    nltk = pytest.importorskip("nltk")
    monkeypatch.setattr(nltk, "download", lambda *a, **k: False)  # RULER's generator fetches punkt_tab on import; niah_single_1 never reads it
    from lm_eval import simple_evaluate

    import kvtool.hf.lmeval as lmeval  # registers the model type

    used = []
    real = lmeval.kv_press
    monkeypatch.setattr(lmeval, "kv_press", lambda spec, **kw: used.append(spec) or real(spec, **kw))
    tiny = str(tiny_llama_dir)
    out = simple_evaluate(model="kvtool", model_args=f"pretrained={tiny},press=quant:bits=4;group=32", tasks=["niah_single_1"],
                          limit=2, metadata={"max_seq_lengths": [512]}, gen_kwargs="max_gen_toks=6", log_samples=True, device="cpu")
    assert 0.0 <= out["results"]["niah_single_1"]["512,none"] <= 1.0
    samples = out["samples"]["niah_single_1"]
    assert len(samples) == 2
    for s in samples:
        prompt = s["arguments"][0][0]
        assert "special magic number" in prompt and isinstance(s["resps"][0][0], str)
    assert used == ["quant:bits=4,group=32"]  # the requests ran through the press
