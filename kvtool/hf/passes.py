"""Progress inside a model's forward passes: one unit per attention-layer call.

A continuation run of a 30-layer model over hundreds of tokens takes minutes on a CPU as a handful
of ``forward`` calls; counting its attention layers as they run gives a progress line (and a time
left) that moves. :func:`layer_calls` hooks every attention module (the ones that carry transformers'
``layer_idx``) for the duration of a ``with`` block.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from kvtool.core.progress import Progress, or_silent


def attention_modules(model: Any) -> list[Any]:
    """The model's attention modules in order (each has an integer ``layer_idx``)."""
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")]


def num_layers(model: Any) -> int:
    return len(attention_modules(model)) or int(getattr(model.config, "num_hidden_layers", 0))


@contextmanager
def layer_calls(model: Any, progress: Progress | None, what: str, forwards: int) -> Iterator[None]:
    """Within the block, a stage ``what`` of ``forwards`` x layers units, advanced once per attention
    layer call of ``model`` (``forwards``: the forward calls the block makes)."""
    progress = or_silent(progress)
    modules = attention_modules(model)
    progress.stage(f"{what}, layer calls", forwards * len(modules) if modules else None)
    handles = [m.register_forward_hook(lambda *_: progress.advance()) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
