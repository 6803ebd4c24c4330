"""Typed presses: the format specs ``kvtool.press`` takes, as objects with keyword parameters.

Each class stands for one spec string and takes the same parameters (``Bitmap(sparsity=0.7)`` is
``"bitmap:sparsity=0.7"``); the spec strings stay and mean the same. Parameters are checked when the
object is made (a :class:`~kvtool.core.errors.UsageError` naming the parameter). ``a + b`` chains
two stages (``SnapKV(budget=512) + Quant(bits=4)`` is ``"snapkv:budget=512+quant:bits=4"``);
:class:`Plan` names a plan file::

    from kvtool.presses import Bitmap, Quant, Plan
    with kvtool.press(Bitmap(sparsity=0.7)):
        out = model.generate(ids, max_new_tokens=64)
    kvtool.answer(model, tok, context, ["Who?", "When?"], Quant(bits=4))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtool.core.errors import UsageError


class Press:
    """A press given by a spec (:attr:`spec`); ``str(press)`` is the spec."""

    spec: str

    def __str__(self) -> str:
        return self.spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Press) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(self.spec)

    def __add__(self, other: "Press") -> "Press":
        if isinstance(self, Plan) or isinstance(other, Plan) or not isinstance(other, Press):
            raise UsageError("only format presses chain (+); a plan sets every layer's format")
        return Spec(f"{self.spec}+{other.spec}")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class FormatPress(Press):
    """One stage: ``NAME:key=value,...`` with the stage's parameters (checked on creation)."""

    stage: str = ""

    def __init__(self, **params: Any) -> None:
        self.params = {k: v for k, v in params.items() if v is not None}
        body = ",".join(f"{k}={_text(v)}" for k, v in self.params.items())
        self.spec = f"{self.stage}:{body}" if body else self.stage
        _check(self.spec + ("+dense" if self.stage == "snapkv" else ""))  # eviction alone: a chain's first stage


class Spec(Press):
    """A press from a spec string (``Spec("snapkv:budget=512+quant:bits=4")``), checked on creation."""

    def __init__(self, spec: str) -> None:
        self.spec = str(spec).strip()
        _check(self.spec)


class Plan(Press):
    """A plan file (``kvtool recommend``'s ``plan.json``), read and checked on creation."""

    def __init__(self, path: str | Path) -> None:
        from kvtool.formats.plan import load_plan  # deferred: start-up time (torch)

        self.path = Path(path)
        self.plan = load_plan(self.path)
        self.spec = str(self.path)

    def __repr__(self) -> str:
        return f"Plan({str(self.path)!r})"


def _check(spec: str) -> None:
    from kvtool.formats.pipeline import resolve  # deferred: start-up time (torch)

    try:
        resolve(spec)
    except UsageError as exc:
        raise UsageError(str(exc).replace("--format ", "").replace("--", "")) from None


def _stage(name: str, stage: str, doc: str) -> type:
    return type(name, (FormatPress,), {"stage": stage, "__doc__": doc, "__module__": __name__})


Dense = _stage("Dense", "dense", "Dense keys and values (the baseline): ``dense``.")
Bitmap = _stage("Bitmap", "bitmap", "Mustafar pruning + bitmap tiles: ``bitmap:sparsity=0.7`` (sparsity, key_sparsity, value_sparsity, method, dense_window, ...).")
BitmapQ = _stage("BitmapQ", "bitmapq", "Pruning with KIVI-quantised kept elements: ``bitmapq:sparsity=0.7,bits=4``.")
Quant = _stage("Quant", "quant", "KIVI / int8 / fp8 quantisation: ``quant:bits=4`` (bits, group, residual, scheme, partial).")
SignVQ = _stage("SignVQ", "signvq", "Sign-code selection with quantised magnitudes: ``signvq:bits=4``.")
PageStat = _stage("PageStat", "pagestat", "Page statistics selection: ``pagestat:budget=64``.")
SnapStream = _stage("SnapStream", "snapstream", "Eviction into a ring of slots: ``snapstream:budget=256``.")
SnapKV = _stage("SnapKV", "snapkv", "SnapKV eviction (a chain's first stage): ``snapkv:budget=512``; chain with ``+ Quant(bits=4)``.")
Mixed = _stage("Mixed", "mixed", "One spec per KV head: ``mixed:heads=quant:bits=2|bitmap:sparsity=0.5``.")


def spec_of(press: "Press | str | Path") -> "str | Path":
    """What :func:`kvtool.hf.live.press` takes: a spec string or a plan file's path."""
    if isinstance(press, Plan):
        return press.path
    if isinstance(press, Press):
        return press.spec
    if isinstance(press, (str, Path)):
        return press
    raise UsageError(f"press must be a spec string, a plan file or a kvtool.presses object, not {type(press).__name__}")
