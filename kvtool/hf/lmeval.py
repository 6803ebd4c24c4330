"""A model type for EleutherAI's lm-evaluation-harness (``kvtool[lm-eval]``): any lm-eval task through a
kvtool press or plan on a local model, offline.

    kvtool-lm-eval --model kvtool --model_args press=plan.json --tasks niah_single_1 \\
        --metadata '{"max_seq_lengths":[1024]}' --limit 20

``kvtool-lm-eval`` (or ``python -m kvtool.hf.lmeval``) is lm-eval's own command line (every
subcommand and option) with the ``kvtool`` model type registered: lm-eval 0.4.13 finds model types
only in its own source tree, so plain ``lm_eval --model kvtool`` answers that no model has that
name; the ``lm_eval.models`` entry point kvtool declares is for lm-eval versions that read one.
``model_args``:

- ``pretrained``: a local HF folder, a ``.gguf`` file or ``embedded`` (:func:`kvtool.hf.models.load`;
  default: the embedded SmolLM2-135M);
- ``press``: a plan file (``kvtool recommend``) or a format spec whose parameters are separated by
  ``;`` (lm-eval splits ``model_args`` at commas): ``press=quant:bits=2;group=128;rotate=hadamard``;
  default ``dense``;
- ``split``: text at which each prompt is split (its last occurrence; several texts separated by
  ``|``: the last occurrence of any); the part before it is the context that is compressed, the rest
  (the question) is read through the compressed cache: question-agnostic compression. Without
  ``split`` the whole prompt but its last token is compressed (the question is inside lm-eval's
  prompt: question-aware compression);
- ``tokenizer``: a folder AutoTokenizer loads, for lm-eval's tasks that build their samples with the
  model's tokenizer (RULER's synthetic tasks read it from the model arguments by name, and
  ``embedded`` or a ``.gguf`` file is no name AutoTokenizer knows); the model itself always uses its
  own tokenizer. ``kvtool-lm-eval`` adds ``tokenizer=`` :func:`tokenizer_folder` where it is not given;
  with ``lm_eval.simple_evaluate`` pass it in ``model_args``;
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

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvtool.core.errors import BadDataError, UsageError
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


def tokenizer_folder(pretrained: str | None = None) -> str:
    """A folder ``AutoTokenizer.from_pretrained`` loads the model's tokenizer from: a Hugging Face
    folder itself; for the embedded model or a ``.gguf`` file the folder :func:`kvtool.hf.models.load`
    converts it into (made by one load on first use; a temporary folder where it cannot be written)."""
    source = models.resolve(None if pretrained in (None, "", "embedded") else str(pretrained))
    if source.kind == "hf-folder":
        return str(source.path)
    if source.kind == "random":
        raise UsageError(f"model {source.name} has no tokenizer; lm-eval's tasks need one (pass tokenizer=FOLDER)")
    folder = models.converted_folder(source)
    if not (folder / "tokenizer.json").exists():
        _, tokenizer, _ = models.load(str(source.path))
        if not (folder / "tokenizer.json").exists():  # the converted folder could not be written
            folder = Path(tempfile.mkdtemp(prefix="kvtool-tokenizer-"))
            tokenizer.save_pretrained(folder)
    return str(folder)


def _model_args(values: list[str]) -> dict[str, str]:
    """The keys of ``--model_args`` values as lm-eval 0.4.13 reads them (``k=v,k=v``, space-separated
    ``k=v`` or a JSON object), values as text; enough to find ``pretrained`` and ``tokenizer``."""
    out: dict[str, str] = {}
    for value in values:
        parsed = _json_object(value)
        if parsed is not None:
            out.update(parsed)
            continue
        for item in value.split(","):
            key, eq, val = item.partition("=")
            if eq:
                out[key.strip()] = val
    return out


def _json_dict(value: str) -> dict[str, Any] | None:
    """``value`` read as a JSON object (its values as JSON gave them); None when it is not one (then
    it is read as ``k=v`` pairs)."""
    if not value.lstrip().startswith("{"):
        return None
    try:
        obj = json.loads(value)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _json_object(value: str) -> dict[str, str] | None:
    """:func:`_json_dict` with keys and values as text."""
    obj = _json_dict(value)
    return None if obj is None else {str(k): str(v) for k, v in obj.items()}


def with_tokenizer(argv: list[str]) -> list[str]:
    """lm-eval's command-line arguments with ``tokenizer=FOLDER`` (:func:`tokenizer_folder`) added to a
    ``kvtool`` model's arguments when neither ``--model_args`` nor ``--metadata`` names a tokenizer: into
    the last ``--model_args`` value (``k=v`` text gets ``,tokenizer=FOLDER``, a JSON object the key),
    or as a ``--model_args`` of its own at the end; the subcommand and every other argument unchanged."""
    argv = list(argv)
    model, args, meta, last = None, [], [], None  # last: (index in argv, whether inline --model_args=...)
    i = 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        if argv[i].startswith("-") and name in ("--model", "-M", "--model_args", "-a", "--metadata"):
            vals, j = ([inline], i + 1) if eq else ([], i + 1)
            while not eq and j < len(argv) and not argv[j].startswith("-"):
                vals.append(argv[j])
                j += 1
            if name in ("--model", "-M"):
                model = vals[0] if vals else None
            elif name == "--metadata":
                meta += vals
            elif vals:
                args += vals
                last = (i, True) if eq else (j - 1, False)
            i = j
            continue
        i += 1
    if model != "kvtool" or "tokenizer" in _model_args(args) or "tokenizer" in _model_args(meta):
        return argv
    folder = tokenizer_folder(_model_args(args).get("pretrained"))
    if last is None:
        return argv + ["--model_args", f"tokenizer={folder}"]
    at, inline_form = last
    value = argv[at].partition("=")[2] if inline_form else argv[at]
    obj = _json_dict(value)
    value = json.dumps({**obj, "tokenizer": folder}) if obj is not None else f"{value},tokenizer={folder}"
    argv[at] = f"{argv[at].partition('=')[0]}={value}" if inline_form else value
    return argv


@_register("kvtool")
class KvtoolLM(_LMBase):  # type: ignore[misc, valid-type]
    """lm-eval's ``LM`` over a local model whose context caches a kvtool press compresses (module docstring)."""

    def __init__(self, pretrained: str = "embedded", press: str | None = None, split: str | None = None, max_length: int | None = None,
                 device: str | None = "cpu", batch_size: Any = 1, tokenizer: str | None = None, **_ignored: Any) -> None:
        if _LMBase is object:
            raise UsageError("lm-eval is not installed: pip install 'kvtool[lm-eval]'")
        super().__init__()
        del tokenizer  # read by lm-eval's tasks from the model arguments; the model uses its own tokenizer
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
        raise UsageError("the kvtool model type has no rolling log-likelihood: kvtool compresses a context and then continues, and perplexity "
                         "over a whole text has no context to compress (use a generation or multiple-choice task)")

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
    """lm-eval's command line with the ``kvtool`` model type registered (``python -m kvtool.hf.lmeval``),
    ``tokenizer=`` added to a kvtool model's arguments where missing (:func:`with_tokenizer`)."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        sys.stderr.write("lm-eval is not installed: pip install 'kvtool[lm-eval]'\n")
        raise SystemExit(2) from None
    try:
        sys.argv[1:] = with_tokenizer(sys.argv[1:])
    except (UsageError, BadDataError) as exc:
        sys.stderr.write(f"kvtool-lm-eval: {exc}\n")
        raise SystemExit(2 if isinstance(exc, UsageError) else 1) from None
    cli_evaluate()


if __name__ == "__main__":
    main()
