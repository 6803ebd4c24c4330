"""Left-padded batches through live caches: each row of a padded batch generates, under
``kvtool.press``, the greedy tokens of its prompt generated alone (unpadded), for every format and
every family of ``recommend``'s menu (KIVI at several bits, groups and residuals; each eviction; a
pruning step), a plan and a plan ``recommend`` made; what
cannot be served (right padding, a live cache that kept every position, a file's encoded prefix, a
mask that disagrees with the pads dropped) is a UsageError before the token it would get wrong."""

from __future__ import annotations

import json

import pytest
import torch

import kvtool
from kvtool.analysis.allocation import menu
from kvtool.formats.base import load_all
from kvtool.core.errors import UsageError
from kvtool.formats._rows import RowsLive
from kvtool.formats.base import compress_cache
from kvtool.formats.pipeline import resolve
from kvtool.hf import models
from kvtool.hf.attention import CompressedPrefix, build_cache, compressed_attention, prefill
from kvtool.hf.interface import cache_kwargs, output_cache
from kvtool.hf.live import compress_hf_cache, live_layers
from .test_live_ways import PLAN  # the hand-written plan of every live way in

# 70 new tokens: formats that grow by blocks of up to 64 tokens (KIVI groups, bitmap blocks, signvq
# chunks, pages) encode at least one during the decode of each row, and the rings evict
STEPS = 70
PROMPTS = ("row one, a shorter prompt of the padded batch. " * 3, "row two is the longest prompt; the others are padded on the left to it. " * 3)
# every format (the registry's), KIVI at several bits / groups / residuals, each eviction and a pruning step
SPECS = [
    "dense",
    "quant:bits=4",
    "quant:bits=2",
    "quant:bits=8",
    "quant:bits=4,group=128,residual=0,partial=true",
    "quant:bits=2,group=64,residual=0,partial=true,rotate=hadamard",
    "quant:bits=4,group=16,residual=8,partial=true",
    "quant:bits=2,group=16,residual=40",
    "quant:scheme=int8",
    "quant:scheme=fp8,residual=16",
    "bitmap:sparsity=0.7",
    "bitmapq:sparsity=0.5,bits=4",
    "signvq:bits=2",
    "pagestat:budget_ratio=0.25",
    "snapstream:share=0.125",
    "snapstream:budget=64",
    "snapkv:share=0.25+quant:bits=4,group=32,residual=0,partial=true",
    "snapkv:budget=48,recent=8+quant:bits=4",
    "streaming:budget=40,recent=16+dense",
    "per-token:k=0.5,v=0.7+quant:bits=4",
    "mixed:heads=quant:bits=2|bitmap:sparsity=0.7",
]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    model, tokenizer, _ = models.load(str(tiny_llama_dir))
    tokenizer.padding_side = "left"
    return model, tokenizer


@pytest.fixture(scope="module")
def plans(tmp_path_factory, tiny_capture):
    """``plan``: test_live_ways's :data:`PLAN`; ``recommended``: the plan ``kvtool recommend`` makes for the tiny capture."""
    folder = tmp_path_factory.mktemp("plans")
    (folder / "plan.json").write_text(json.dumps(PLAN))
    r = kvtool.recommend(tiny_capture, budget="25%", heldout=16, model=False, no_texts=True, output=folder / "recommended.json")
    return {"plan": str(folder / "plan.json"), "recommended": r.budgets[0]["plan_file"]}


def _generate(model, ids, mask, **kwargs):
    """Greedy ``STEPS`` new tokens ``[B, STEPS]`` and the cache they were generated with."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], out.past_key_values


@pytest.mark.parametrize("spec", SPECS + ["plan", "recommended"])
def test_each_padded_row_generates_its_own_tokens(spec, tiny, plans):
    model, tok = tiny
    spec = plans.get(spec, spec)
    batch = tok(list(PROMPTS), return_tensors="pt", padding=True, add_special_tokens=False)
    pads = (batch["attention_mask"] == 0).sum(1).tolist()
    assert pads[0] > 0 and pads[1] == 0
    with kvtool.press(spec) as state:
        both, cache = _generate(model, batch["input_ids"], batch["attention_mask"])
        assert state.layers == 2
        alone = [_generate(model, *(lambda e: (e["input_ids"], e["attention_mask"]))(tok([p], return_tensors="pt", add_special_tokens=False)))
                 for p in PROMPTS]
    for b, (tokens, solo_cache) in enumerate(alone):
        assert both[b].tolist() == tokens[0].tolist(), f"row {b}"
    for live, solo in zip(live_layers(cache), zip(*(live_layers(c) for _, c in alone))):
        assert isinstance(live, RowsLive) and live.pads == pads
        assert live.row_tokens() == [s.tokens for s in solo]  # the same tokens held: no pad kept, the same evicted
        assert live.stored_bytes() == sum(s.stored_bytes() for s in solo)


def test_the_specs_cover_every_format_and_the_menus_families():
    names = {resolve(s)[0].name for s in SPECS}
    assert names == set(load_all())
    assert {m.split(":")[0].split("+")[0] for m in menu()} <= {s.split(":")[0].split("+")[0] for s in SPECS}


@pytest.mark.parametrize("spec", ["quant:bits=4", "snapkv:budget=48,recent=8+quant:bits=4"])
def test_eager_attentions_additive_mask(spec, tiny):
    """The eager implementation's float mask (-inf where hidden) gives the same rows."""
    model, tok = tiny
    batch = tok(list(PROMPTS), return_tensors="pt", padding=True, add_special_tokens=False)
    before = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with kvtool.press(spec):
            both, _ = _generate(model, batch["input_ids"], batch["attention_mask"])
            for b, p in enumerate(PROMPTS):
                e = tok([p], return_tensors="pt", add_special_tokens=False)
                assert both[b].tolist() == _generate(model, e["input_ids"], e["attention_mask"])[0][0].tolist(), f"row {b}"
    finally:
        model.config._attn_implementation = before


def test_rows_of_equal_length_and_padded_rows_alike(tiny):
    """An equal-length batch stays one live layer of the batch, each row its own generation; a
    single prompt's mask of ones is no padding."""
    model, tok = tiny
    rows = tok(["equal one", "equal two"], return_tensors="pt", add_special_tokens=False)
    with kvtool.press("quant:bits=4"):
        both, cache = _generate(model, rows["input_ids"], rows["attention_mask"])
        one = [_generate(model, rows["input_ids"][i:i + 1], rows["attention_mask"][i:i + 1])[0] for i in range(2)]
    assert torch.equal(both, torch.cat(one))
    assert not any(isinstance(live, RowsLive) for live in live_layers(cache))


def _compressed_then_generated(model, spec, ids, mask):
    """All but the last prompt token prefilled (positions from the mask, as generate makes them),
    the cache compressed with the mask, then ``STEPS`` greedy tokens from it."""
    head, mhead = ids[:, :-1], mask[:, :-1]
    positions = (mhead.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        cache = output_cache(model(input_ids=head, attention_mask=mhead, position_ids=positions, use_cache=True))
    compress_hf_cache(cache, spec, attention_mask=mhead)
    return _generate(model, ids, mask, **cache_kwargs(model, cache))[0]


@pytest.mark.parametrize("spec", ["quant:bits=4", "bitmap:sparsity=0.7", "dense"])
def test_a_padded_transformers_cache_compressed_with_its_mask(spec, tiny):
    model, tok = tiny
    batch = tok(list(PROMPTS), return_tensors="pt", padding=True, add_special_tokens=False)
    both = _compressed_then_generated(model, spec, batch["input_ids"], batch["attention_mask"])
    for b, p in enumerate(PROMPTS):
        e = tok([p], return_tensors="pt", add_special_tokens=False)
        assert both[b].tolist() == _compressed_then_generated(model, spec, e["input_ids"], e["attention_mask"])[0].tolist(), f"row {b}"
    bad = torch.ones_like(batch["attention_mask"])
    bad[1, -1] = 0
    with torch.no_grad():
        cache = output_cache(model(**batch, use_cache=True))
    with pytest.raises(UsageError, match="left padding only"):
        compress_hf_cache(cache, spec, attention_mask=bad)


def test_right_padding_is_refused_before_the_first_token(tiny):
    model, tok = tiny
    tok.padding_side = "right"
    try:
        batch = tok(list(PROMPTS), return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tok.padding_side = "left"
    with kvtool.press("quant:bits=4"), pytest.raises(UsageError, match="left padding only"):
        model.generate(**batch, max_new_tokens=2, do_sample=False)


def test_a_mask_other_than_the_pads_dropped_is_refused(tiny):
    """A pressed padded batch continued with a mask that no longer hides its pads (or hides others)."""
    model, tok = tiny
    batch = tok(list(PROMPTS), return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with kvtool.press("bitmap:sparsity=0.7"):
        with torch.no_grad():
            cache = output_cache(model(input_ids=ids, attention_mask=mask, use_cache=True))
    nxt = torch.tensor([[5], [6]])
    good = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    p0 = int((mask[0] == 0).sum())
    for row, at in ((0, p0), (1, 0)):  # one more token of row 0 hidden / one of row 1, which had no pads
        wrong = good.clone()
        wrong[row, at] = 0
        with torch.no_grad(), pytest.raises(UsageError, match="dropped"):
            model(input_ids=nxt, attention_mask=wrong, use_cache=True, **cache_kwargs(model, cache))
    with torch.no_grad():
        model(input_ids=nxt, attention_mask=good, use_cache=True, **cache_kwargs(model, cache))  # the cache is still usable


def test_caches_that_kept_the_pads_are_refused(tiny, tmp_path):
    """``kvtool.compress`` of a padded transformers cache (without its mask) and ``to_hf_cache`` of a file encoded the
    pad tokens with the others: a mask that hides them is refused at the first step through the live
    cache; so is a file's encoded prefix (``compressed_attention``, ``kvtool generate``'s path)."""
    model, tok = tiny
    batch = tok(list(PROMPTS), return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    step = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    nxt = torch.tensor([[5], [6]])
    with torch.no_grad():
        hf = output_cache(model(input_ids=ids, attention_mask=mask, use_cache=True))
    kvtool.compress(hf, "quant:bits=4")
    with torch.no_grad(), pytest.raises(UsageError, match="padded batch.*kvtool.press"):
        model(input_ids=nxt, attention_mask=step, use_cache=True, **cache_kwargs(model, hf))
    cap = kvtool.capture(list(PROMPTS), model=(model, tok), align="pad")
    cc = compress_cache(cap, *resolve("quant:bits=4")[:2], heldout=0)
    prefix = CompressedPrefix.from_compressed(cc)
    cache = build_cache(model, prefill(model, cap.token_ids), prefix)
    with torch.no_grad(), compressed_attention(model, prefix), pytest.raises(UsageError, match="compressed file's prefix"):
        model(input_ids=nxt, attention_mask=step, use_cache=True, **cache_kwargs(model, cache))


def test_a_press_whose_prefill_bypasses_kvtools_attention_is_an_error(tiny):
    """A model whose attention does not dispatch through kvtool's function never hands the press
    its prompt layers: the next step fails instead of compressing a lone new token."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model, tok = tiny
    AttentionInterface.register("plain-copy-press", sdpa_attention_forward)
    before = model.config._attn_implementation
    model.config._attn_implementation = "plain-copy-press"
    try:
        with kvtool.press("quant:bits=4"), pytest.raises(UsageError, match="did not attend through kvtool"):
            model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False)
    finally:
        model.config._attn_implementation = before
