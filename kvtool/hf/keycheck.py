"""Whether a model is the one a capture came from: run it on the capture's first tokens and compare
the keys it makes with the capture's (the check ``verify``, ``eval`` and ``generate`` share).

A model of the same shapes with other weights (another checkpoint, another fine-tune, a folder whose
weights were replaced) makes keys with relative L2 errors near 1 at every layer; the model the
capture came from reproduces them to rounding: below 5% in the first ``EXACT_LAYERS`` captured
layers, below 50% deeper (a capture prefilled in chunks drifts from one pass with depth in bf16)."""

from __future__ import annotations

from typing import Any

import torch

from kvtool.core.cache import KVCache
from kvtool.core.errors import BadDataError

EXACT_LAYERS = 4
# tokens of the capture the model re-runs in :func:`check_model_reproduces` (keys are causal: the
# first tokens' keys do not depend on the rest)
CHECK_TOKENS = 64


def compare_keys(prefix: dict[int, Any], source: KVCache, tokens: int, model_name: str, rows: int | None = None,
                 exact_layers: int = EXACT_LAYERS) -> None:
    """BadDataError unless ``prefix`` (layer -> LayerKV ``[B, Hkv, tokens, D]`` from the model)
    reproduces ``source``'s keys over their first ``tokens`` positions (and first ``rows`` batch
    rows when given) on every captured layer the prefix holds (the first ``exact_layers`` of them
    within 5%, deeper ones within 50%)."""
    for n, i in enumerate(i for i in sorted(source.layer_indices) if i in prefix):
        got = prefix[i].keys.float().cpu()
        want = source.layers[i].keys[:rows, :, :tokens].float().cpu()
        rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
        limit = 0.05 if n < exact_layers else 0.5
        if rel > limit:
            raise BadDataError(f"model {model_name} does not reproduce the capture's keys (layer {i}: relative error {rel:.2f}, "
                               f"above {limit:.0%}); pass the model the capture came from with --model")


def check_model_reproduces(model: Any, source: KVCache, model_name: str, tokens: int = CHECK_TOKENS) -> None:
    """Run ``model`` on the first ``tokens`` tokens of ``source``'s first prompt and
    :func:`compare_keys` (a few ms for small models; the model's weights are what is checked)."""
    from kvtool.hf.attention import prefill  # deferred: transformers

    if source.token_ids is None or not source.layer_indices:
        return
    n = min(int(tokens), int(source.token_ids.shape[1]))
    if n < 1:
        return
    with torch.no_grad():
        prefix = prefill(model, source.token_ids[:1, :n])
    compare_keys(prefix, source, n, model_name, rows=1)
