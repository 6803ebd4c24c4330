"""Task accuracy through a compressed context (the library behind ``kvtool tasks``).

For each sample of :mod:`kvtool.analysis.tasks`:

1. **Prefill** (:func:`prepare`): the model reads the *context only* (the question is not seen yet)
   and kvtool records its keys, values and queries in every layer (and, for kvpress presses, the
   attention inputs). This is the one expensive step; everything below reuses it.
2. **Compress** the context's cache with a format spec, a plan, or a press's kept tokens
   (:class:`Setting`): a :class:`~kvtool.formats.base.CompressedCache` whose bytes are counted
   against float16 keys and values of the same tokens.
3. **Answer** (:func:`answer`): the question runs through the model after the compressed context,
   each compressed layer attending to its encoded prefix through the format
   (:mod:`kvtool.hf.attention`), then greedy decoding. Formats whose attention is attention over
   their decoded tensors (KIVI, bitmap, eviction, ...) are decoded once per sample instead of once
   per step; formats that select per query (sign-VQ, page statistics) attend through their own
   ``attend`` at every step. The dense ceiling answers from the model's own cache.
4. **Score**: RULER's string match: the answer is right when every expected value occurs in the
   greedy output (``correct``); ``part`` is the share found. Decoding stops once all are found, at
   the end-of-turn token, or after the answer's length plus :data:`EXTRA_TOKENS` tokens.

With ``question_aware`` the question is part of the compressed context (all but its last token,
which the answer's decoding starts from), as kvpress's query-aware evaluation does.

Intervals are Wilson score intervals (95%) over the samples (:func:`wilson`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from kvtool.core.attention import attend_partial
from kvtool.core.cache import DTYPES, KVCache, LayerKV, dtype_name
from kvtool.formats.base import CompressedCache, Encoded, Format
from kvtool.formats.mixed import _q_heads, groups_of
from kvtool.formats.pipeline import storage_of
from kvtool.hf import attention as hfattn
from kvtool.hf import capture as capturing
from kvtool.hf.interface import cache_kwargs
from kvtool.hf.devices import layer_devices
from kvtool.analysis.tasks import TaskSample

EXTRA_TOKENS = 8
Z95 = 1.959963984540054


def wilson(k: int, n: int) -> dict[str, Any]:
    """Share ``k / n`` with its 95% Wilson score interval: ``{"mean", "lo", "hi", "n", "k"}``."""
    if n <= 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0, "k": 0}
    p = k / n
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    lo = 0.0 if k == 0 else max(0.0, centre - half)  # the bounds are exact at the ends
    hi = 1.0 if k == n else min(1.0, centre + half)
    return {"mean": p, "lo": lo, "hi": hi, "n": n, "k": k}


@dataclass
class Prepared:
    """One sample after its prefill: ``cache`` holds the compressed part's keys/values/queries (and
    hidden states when asked) in the capture dtype, ``dense`` the model's own cache (model dtype),
    ``feed`` the token ids decoded after the compressed part."""

    sample: TaskSample
    cache: KVCache
    dense: dict[int, LayerKV]
    feed: torch.Tensor
    question_aware: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix_tokens(self) -> int:
        return int(self.cache.num_tokens)


@torch.no_grad()
def prepare(model: Any, tokenizer: Any, sample: TaskSample, dtype: str = "float16", hidden: bool = False, question_aware: bool = False) -> Prepared:
    """Prefill the compressed part of ``sample`` once (see the module docstring)."""
    ids = sample.context + (sample.question[:-1] if question_aware else [])
    feed = sample.question[-1:] if question_aware else sample.question
    param = next(model.parameters())
    model_dtype, device = param.dtype, param.device
    cap = capturing.capture(model=(model, tokenizer), input_ids=torch.tensor([ids]), queries=True, hidden=hidden, dtype=dtype_name(model_dtype))
    # the compressors work where the model computes (a GPU compresses a sample's 84 settings in a
    # fraction of the CPU's time); the capture hands back CPU tensors
    dense = {i: LayerKV(keys=l.keys.to(device), values=l.values.to(device)) for i, l in cap.layers.items()}
    store = {}
    for i, l in cap.layers.items():
        store[i] = LayerKV(keys=l.keys.to(device, _dtype(dtype)), values=l.values.to(device, _dtype(dtype)),
                           queries=None if l.queries is None else l.queries.to(device, _dtype(dtype)),
                           hidden=None if l.hidden is None else l.hidden.to(device))
    facts = type(cap.facts)(**{**cap.facts.to_dict(), "dtype": dtype})
    cache = KVCache(facts, store, cap.token_ids, cap.info)
    return Prepared(sample, cache, dense, torch.tensor([feed]), question_aware)


def _dtype(name: str) -> torch.dtype:
    return DTYPES[name]


# ----------------------------------------------------------------------------- attention


class _Decoded:
    """Attention over a compressed prefix where each layer's encoding has been resolved once: parts
    that are plain attention over decoded keys/values are held decoded; parts that select tokens
    per query keep their format's ``attend``. Same maths as the format's own ``attend``."""

    @staticmethod
    def resolve(fmt: Format, enc: Encoded) -> Any:
        if fmt.name == "mixed":
            return ("groups", [(heads, _Decoded.resolve(f, e)) for heads, f, e in groups_of(enc)], enc.meta["shape"][1])
        if fmt.name == "pipeline":
            inner_fmt, inner = storage_of(enc)
            return _Decoded.resolve(inner_fmt, inner)
        if type(fmt).attend is Format.attend or fmt.name in ("bitmap", "snapstream"):
            d = fmt.decode(enc)
            return ("dense", d.keys, d.values)
        return ("attend", fmt, enc)

    def attend(self, q: torch.Tensor, part: Any, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        kind = part[0]
        if kind == "dense":
            return attend_partial(q, part[1].to(q.dtype), part[2].to(q.dtype), scale)
        if kind == "attend":
            return part[1].attend(q, part[2], scale)
        groups, hkv = part[1], part[2]
        b, h, tq, _ = q.shape
        out = q.new_zeros((b, h, tq, q.shape[-1]), dtype=torch.float32)
        lse = q.new_zeros((b, h, tq), dtype=torch.float32)
        for heads, sub in groups:
            if len(heads) == hkv:
                o, l = self.attend(q, sub, scale)
                return o.float(), l.float()
            idx = torch.tensor(_q_heads(heads, h // hkv), dtype=torch.int64, device=q.device)
            o, l = self.attend(q.index_select(1, idx), sub, scale)
            out.index_copy_(1, idx, o.float())
            lse.index_copy_(1, idx, l.float())
        return out, lse


def decoded_prefix(cc: CompressedCache, device: torch.device | str | Mapping[int, torch.device] = "cpu") -> hfattn.CompressedPrefix:
    """A :class:`~kvtool.hf.attention.CompressedPrefix` of ``cc`` whose layers are resolved once,
    on ``device`` (or layer ``i`` on ``device[i]``: a model's layer devices)."""
    fmt = cc.fmt
    layers = {}
    for i, enc in cc.layers.items():
        dev = device[i] if isinstance(device, Mapping) else device
        moved = Encoded({n: t.to(dev) for n, t in enc.tensors.items()}, enc.meta)
        layers[i] = _Decoded.resolve(fmt, moved)
    return hfattn.CompressedPrefix(_Decoded(), layers, cc.prefix_tokens)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- answering


def stop_ids(tokenizer: Any) -> set[int]:
    out = set()
    for name in ("eos_token_id",):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            out.add(v)
    for tok in ("<|im_end|>", "<|endoftext|>"):
        try:
            i = tokenizer.convert_tokens_to_ids(tok)
        except (KeyError, ValueError):
            continue
        if isinstance(i, int) and i >= 0 and i != getattr(tokenizer, "unk_token_id", None):
            out.add(i)
    return out


def found(text: str, answers: list[str]) -> list[bool]:
    """Which expected answers occur in ``text`` (case-insensitive, whitespace-trimmed)."""
    low = text.lower()
    return [a.strip().lower() in low for a in answers]


SCORING = ("forced", "greedy")


def _runs(scored: list[bool]) -> list[list[int]]:
    """Index runs of consecutive scored answer tokens (one per listed value)."""
    runs: list[list[int]] = []
    for j, ok in enumerate(scored):
        if ok:
            if runs and runs[-1][-1] == j - 1:
                runs[-1].append(j)
            else:
                runs.append([j])
    return runs


@torch.no_grad()
def answer(model: Any, tokenizer: Any, prep: Prepared, cc: CompressedCache | None = None, scoring: str = "forced", max_new: int | None = None) -> dict[str, Any]:
    """Score the answer after the (compressed) context (``cc=None``: the model's own dense cache).

    ``forced`` (default): one pass over the question and the expected answer; right when every
    scored answer token is the top-1 next token (``part``: share of the listed values whose tokens
    all are; ``nll``: mean negative log-likelihood of the scored tokens). ``greedy``: greedy decoding
    and string match (``text`` is the output)."""
    s = prep.sample
    prefix = None if cc is None else decoded_prefix(cc, layer_devices(model))
    cache = hfattn.build_cache(model, prep.dense, prefix)
    if scoring == "forced":
        ans = torch.tensor([s.answer])
        with hfattn.compressed_attention(model, prefix):
            logits = hfattn.forward(model, cache, torch.cat([prep.feed, ans[:, :-1]], dim=1))
        f = prep.feed.shape[1]
        pred_logits = logits[0, f - 1:]  # [A, V]: position j predicts answer token j
        top = pred_logits.argmax(-1)
        hit = (top == ans[0]).tolist()
        logp = torch.log_softmax(pred_logits, dim=-1).gather(1, ans[0][:, None])[:, 0]
        scored = [j for j, ok in enumerate(s.scored) if ok]
        runs = _runs(s.scored)
        values = [all(hit[j] for j in run) for run in runs]
        return {"correct": all(values), "part": sum(values) / max(len(values), 1),
                "nll": float(-logp[scored].mean()) if scored else 0.0,
                "text": tokenizer.decode([int(t) for t in top]), "ids": [int(t) for t in top], "tokens": len(s.answer)}
    if scoring != "greedy":
        raise ValueError(f"scoring must be one of {SCORING}")
    max_new = max_new or (len(s.answer) + EXTRA_TOKENS)
    stops = stop_ids(tokenizer)
    tokens: list[int] = []
    with hfattn.compressed_attention(model, prefix):
        logits = hfattn.forward(model, cache, prep.feed)
        nxt = int(logits[0, -1].argmax())
        for step in range(max_new):
            if nxt in stops:
                break
            tokens.append(nxt)
            if all(found(tokenizer.decode(tokens, skip_special_tokens=True), s.answers)):
                break
            if step + 1 < max_new:
                logits = hfattn.forward(model, cache, torch.tensor([[nxt]]))
                nxt = int(logits[0, -1].argmax())
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    hits = found(text, s.answers)
    return {"text": text, "ids": tokens, "correct": all(hits), "part": sum(hits) / len(hits), "tokens": len(tokens)}


def answer_questions(model: Any, tokenizer: Any, prep: Prepared, cc: CompressedCache | None, questions: list[TaskSample],
                     scoring: str = "forced") -> list[dict[str, Any]]:
    """One compressed context, several questions: ``cc`` (compressed once from ``prep``'s context;
    None: the dense cache) answers each of ``questions`` (samples sharing ``prep``'s context,
    :func:`kvtool.analysis.tasks.each_needle`) from a fresh copy of the cache (what one question's
    decoding appends never reaches the next), as :func:`answer` scores one. The question is never part
    of the compressed context (``prep`` must not be question-aware)."""
    if prep.question_aware:
        raise ValueError("several questions need the question after compression (prep is question-aware)")
    return [answer(model, tokenizer, dataclasses.replace(prep, sample=q, feed=torch.tensor([q.question])), cc, scoring) for q in questions]
