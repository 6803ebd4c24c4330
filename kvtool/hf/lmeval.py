"""A model type for EleutherAI's lm-evaluation-harness (``kvtool[lm-eval]``): any lm-eval task through a
kvtool press or plan on a local model, offline.

    python -m kvtool.hf.lmeval --model kvtool --model_args pretrained=DIR,press=plan.json \\
        --tasks niah_single_1 --metadata '{"max_seq_lengths":[4096]}'

(``kvtool-lm-eval`` is the same command; lm-eval versions that discover models through entry points
find ``kvtool`` through the ``lm_eval.models`` entry point too, so plain ``lm_eval --model kvtool``
works there.) ``model_args``:

- ``pretrained``: a local HF folder, a ``.gguf`` file or ``embedded`` (:func:`kvtool.hf.models.load`);
- ``press``: a plan file (``kvtool recommend``) or a format spec whose parameters are separated by
  ``;`` (lm-eval splits ``model_args`` at commas): ``press=quant:bits=2;group=128;rotate=hadamard``;
  default ``dense``;
- ``split``: text at which each prompt is split (its last occurrence; several texts separated by
  ``|``: the last occurrence of any); the part before it is the context that is compressed, the rest
  (the question) is read through the compressed cache: question-agnostic compression. Without ``split`` the whole prompt but its last token is compressed
  (the question is inside lm-eval's prompt: question-aware compression);
- ``max_length`` (default: the model's window), ``device`` (``cpu``, ``cuda``, ``auto``; lm-eval's
  ``--device``; a CUDA device on a machine without one falls back to the CPU, saying so).

Each request compresses its context once with :func:`kvtool.hf.live.press` (the live cache: the
format's own encoded tensors, attended through its kernel on CUDA and its reference elsewhere), then
continues: ``generate_until`` decodes greedily (stopping at ``until`` or the end-of-text token, at most
``max_gen_toks`` tokens), ``loglikelihood`` scores the continuation's tokens after the compressed
context (its first token predicted by the context's last token, which is read through the
compressed cache). ``loglikelihood_rolling`` (perplexity over a whole text, no context) is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from kvtool.core.errors import UsageError
from kvtool.hf import models
from kvtool.hf.interface import cache_kwargs, output_cache
from kvtool.hf.live import press as kv_press

try:  # lm-eval is optional: kvtool[lm-eval]
    from lm_eval.api.model import LM as _LMBase
    from lm_eval.api.registry import register_model as _register
except ImportError:  # pragma: no cover - exercised where lm-eval is absent
    _LMBase = object  # type: ignore[assignment, misc]

    def _register(*names):  # type: ignore[no-redef]
        return lambda cls: cls


def press_spec(text: str | None) -> str | Path:
    """A ``press`` model argument as :func:`kvtool.press` takes it: a plan file's path, or a spec
    with ``;`` between parameters turned back into commas."""
    if not text:
        return "dense"
    p = Path(text)
    if p.suffix == ".json" or p.exists():
        if not p.is_file():
            raise UsageError(f"press={text}: no such plan file")
        return p
    return text.replace(";", ",")


@_register("kvtool")
class KvtoolLM(_LMBase):  # type: ignore[misc, valid-type]
    """lm-eval's ``LM`` over a local model whose context caches a kvtool press compresses (module docstring)."""

    def __init__(self, pretrained: str = "embedded", press: str | None = None, split: str | None = None, max_length: int | None = None,
                 device: str | None = "cpu", batch_size: Any = 1, **_ignored: Any) -> None:
        if _LMBase is object:
            raise UsageError("lm-eval is not installed: pip install 'kvtool[lm-eval]'")
        super().__init__()
        where = "cpu" if device in (None, "") else str(device)
        if where.startswith("cuda") and not torch.cuda.is_available():  # lm-eval's default device is cuda:0
            sys.stderr.write(f"kvtool: device {where} is not available here; the model runs on the CPU\n")
            where = "cpu"
        self.model, self.tokenizer, self.source = models.load(None if pretrained in ("", "embedded") else str(pretrained), device=where)
        self.model.eval()
        self.spec = press_spec(press)
        self.split = [m for m in str(split or "").split("|") if m]
        window = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.max_length = int(max_length) if max_length else (window or 8192)
        self._device = next(self.model.parameters()).device
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos = {eos} if isinstance(eos, int) else set()

    # -- helpers

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _split(self, prompt: str) -> tuple[list[int], list[int]]:
        """(context ids compressed, ids read after compression): at the last ``split`` marker, or all
        but the prompt's last token."""
        at = max((prompt.rfind(m) for m in self.split), default=-1)
        if at > 0:
            ctx, rest = self._ids(prompt[:at]), self._ids(prompt[at:])
        else:
            ids = self._ids(prompt)
            ctx, rest = ids[:-1], ids[-1:]
        if not ctx or not rest:
            raise UsageError("a prompt needs a context and at least one token after it")
        return ctx, rest

    def _fit(self, ctx: list[int], rest: list[int], room: int) -> list[int]:
        """The context cut from the left so that context + rest + ``room`` tokens fit the window."""
        keep = self.max_length - len(rest) - room
        if keep < 1:
            raise UsageError(f"the question and answer take {len(rest) + room} tokens, more than max_length {self.max_length}")
        return ctx[-keep:]

    @torch.no_grad()
    def _compressed(self, ctx: list[int]) -> Any:
        """The model's cache of ``ctx`` compressed by the press (a live cache)."""
        out = self.model(input_ids=torch.tensor([ctx], device=self._device), use_cache=True)
        return output_cache(out)

    @torch.no_grad()
    def _forward(self, cache: Any, ids: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([ids], device=self._device), use_cache=True, **cache_kwargs(self.model, cache))
        return out.logits[0].float()

    # -- lm-eval's interface

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of the continuation's tokens, whether each is the greedy one),
        the continuation read through the compressed context."""
        out = []
        with kv_press(self.spec, model=self.model):
            for req in requests:
                context, continuation = req.args[0], req.args[1]
                ctx, rest = self._split(context)
                cont = self._ids(continuation)
                if not cont:
                    raise UsageError("an empty continuation has no likelihood")
                ctx = self._fit(ctx, rest, len(cont))
                cache = self._compressed(ctx)
                logits = self._forward(cache, rest + cont[:-1])[len(rest) - 1:]
                logp = torch.log_softmax(logits, dim=-1)
                target = torch.tensor(cont, device=logp.device)
                out.append((float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        raise NotImplementedError("kvtool compresses a context and then continues; rolling log-likelihood (perplexity over a whole text) has no context to compress")

    def generate_until(self, requests: list[Any]) -> list[str]:
        """Greedy text after the compressed context, cut at the first ``until`` string."""
        out = []
        with kv_press(self.spec, model=self.model):
            for req in requests:
                context, kwargs = req.args[0], dict(req.args[1] or {})
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                most = int(kwargs.get("max_gen_toks", 256))
                ctx, rest = self._split(context)
                ctx = self._fit(ctx, rest, most)
                cache = self._compressed(ctx)
                logits = self._forward(cache, rest)
                tokens: list[int] = []
                text = ""
                for step in range(most):
                    nxt = int(logits[-1].argmax())
                    if nxt in self.eos:
                        break
                    tokens.append(nxt)
                    text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                    if any(u and u in text for u in until) or step + 1 == most:
                        break
                    logits = self._forward(cache, [nxt])
                for u in until:
                    if u and u in text:
                        text = text[:text.index(u)]
                out.append(text)
        return out


def main() -> None:
    """lm-eval's command line with the ``kvtool`` model type registered (``python -m kvtool.hf.lmeval``)."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        sys.stderr.write("lm-eval is not installed: pip install 'kvtool[lm-eval]'\n")
        raise SystemExit(2) from None
    cli_evaluate()


if __name__ == "__main__":
    main()
