"""One compressed context, several questions (``kvtool tasks --questions N``): the questions share the
context and ask about different needles; each answer comes from a copy of the one compressed cache
(answering in any order gives the same scores); the run writes a row and a cell per question."""

from __future__ import annotations

import json

import pytest

from kvtool.analysis import taskeval, taskrun
from kvtool.analysis import tasks as T
from kvtool.core.errors import UsageError
from kvtool.core.schema import validate
from kvtool.formats.base import compress_cache
from kvtool.formats.mixed import resolve_spec


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from kvtool.hf import models

    model, tokenizer, _ = models.load(str(tiny_llama_dir))
    return model, tokenizer


def test_each_needle_shares_the_context_and_asks_each_key(tiny):
    _, tok = tiny
    s = T.generate_sample(tok, "niah_multikey", 900, seed=1, index=3)
    qs = T.each_needle(tok, s, 4)
    assert [q.meta["question"] for q in qs] == [1, 2, 3, 4]
    assert qs[0].question == s.question and qs[0].answer == s.answer and qs[0].answers == s.answers
    assert all(q.context == s.context for q in qs)
    assert sorted(q.meta["asked"][0] for q in qs) == [0, 1, 2, 3]
    for q in qs:
        key, number = s.meta["keys"][q.meta["asked"][0]], s.meta["numbers"][q.meta["asked"][0]]
        assert key in tok.decode(q.question) and q.answers == [number] and tok.decode(q.answer).strip() == number
        assert sum(q.scored) == sum(s.scored) or q.meta["question"] == 1
    with pytest.raises(UsageError, match="niah_multikey"):
        T.each_needle(tok, T.generate_sample(tok, "niah_single", 900), 2)
    with pytest.raises(UsageError, match="1 to 4"):
        T.each_needle(tok, s, 5)


def test_questions_answer_from_copies_of_one_compressed_cache(tiny):
    """The scores of each question equal answering it alone, in either order (what one question
    appends never reaches the next), for a compressed context and the dense one."""
    model, tok = tiny
    s = T.generate_sample(tok, "niah_multikey", 900, seed=0, index=0)
    qs = T.each_needle(tok, s, 3)
    prep = taskeval.prepare(model, tok, s)
    cc = compress_cache(prep.cache, *resolve_spec("quant:bits=2,group=16,residual=16,rotate=hadamard"))
    for c in (cc, None):
        together = taskeval.answer_questions(model, tok, prep, c, qs)
        backwards = taskeval.answer_questions(model, tok, prep, c, qs[::-1])[::-1]
        assert [r["ids"] for r in together] == [r["ids"] for r in backwards]
        assert [r["nll"] for r in together] == pytest.approx([r["nll"] for r in backwards], rel=1e-5)
        alone = taskeval.answer(model, tok, prep, c)
        assert together[0]["ids"] == alone["ids"]
        assert len({tuple(r["ids"]) for r in together}) >= 1 and all(r["tokens"] == len(q.answer) for r, q in zip(together, qs))


def test_tasks_cli_questions(tiny_llama_dir, tmp_path):
    from typer.testing import CliRunner

    from kvtool.cli import app

    out = tmp_path / "q"
    args = ["tasks", "--model", str(tiny_llama_dir), "--questions", "3", "--tasks", "niah_multikey", "--lengths", "900", "--samples", "2",
            "--methods", "dense,rkivi", "--budgets", "25%", "--out-dir", str(out), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert not validate(data)
    assert data["run"]["questions"] == 3
    assert {(r["setting"], r["question"]) for r in data["by_question"]} == {(s, q) for s in ("dense", "rkivi @ 25%") for q in (1, 2, 3)}
    assert all(r["n"] == 2 for r in data["by_question"]) and all(c["n"] == 2 for c in data["cells"])
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 3 and {r["question"] for r in rows} == {1, 2, 3}
    assert "question" in (out / "tasks.csv").read_text().splitlines()[0]
    res = CliRunner().invoke(app, args)  # resumes: nothing new
    assert res.exit_code == 0 and len((out / "samples.jsonl").read_text().splitlines()) == len(rows)
    text = CliRunner().invoke(app, args[:-1])
    assert text.exit_code == 0 and "question 3" in text.output
    bad = CliRunner().invoke(app, args[:-1] + ["--tasks", "niah_single", "--out-dir", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "niah_multikey" in bad.output


def test_summary_per_question():
    rows = []
    for i in range(4):
        for q in (1, 2):
            rows.append({"sample": f"niah_multikey:900:0:{i}", "task": "niah_multikey", "length": 900, "setting": "dense", "method": "dense",
                         "budget": None, "question": q, "correct": True, "storage_ratio": 1.0})
            rows.append({"sample": f"niah_multikey:900:0:{i}", "task": "niah_multikey", "length": 900, "setting": "kivi @ 15%", "method": "kivi",
                         "budget": 0.15, "question": q, "correct": q == 1 or i == 0, "storage_ratio": 0.15})
    s = taskrun.summarize(rows)
    by = {(r["setting"], r["question"]): r for r in s["by_question"]}
    assert by[("kivi @ 15%", 1)]["accuracy"] == 1.0 and by[("kivi @ 15%", 2)]["accuracy"] == 0.25
    assert by[("kivi @ 15%", 2)]["kept_of_dense"] == 0.25 and by[("dense", 2)]["n"] == 4
    assert {c["question"] for c in s["cells"]} == {1, 2}
    assert "by_question" not in taskrun.summarize([{**r, "question": None} for r in rows if r["question"] == 1])
