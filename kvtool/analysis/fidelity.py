"""Verifying a compressed cache against the dense capture it came from.

Attention level (:func:`attention_fidelity`). A compressed file holds the first ``P = T - W``
tokens encoded and the last ``W`` tokens dense (``tails``). The last ``M <= W`` captured queries
``[B, H, M, D]`` are held out: the compressor never saw them. Each one attends, as a decode step
would, to the encoded prefix through the format (``fmt.attend``, a partial) and to its own dense
causal window of tail tokens; the partials merge exactly. The reference is dense causal attention
of the same queries over the capture's full keys/values ``[B, Hkv, T, D]``. Per layer and over all
layers: relative L2 error, cosine, max abs error (:mod:`kvtool.analysis.metrics`), attention-mass recall for
formats with a selection (``fmt.selected_mask``), storage and traffic bytes. With the Triton
backend the kernel's output is also compared with the torch path on the same data (the kernel's
own error, separate from the format's loss).

Model level (:func:`model_fidelity`): the continuation tokens (the W held-out ones) run through the
real model after the prefix, once on the dense prefix and once with the file's layers attending to
their encoded prefix inside attention (:mod:`kvtool.hf.attention`); NLL, perplexity ratio, top-1
agreement, KL, and greedy generation until the first divergence.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kvtool.hf import attention as hfattn
from kvtool.core import io
from kvtool.core.attention import attend_partial, attention_probs, dense_attention, merge_partials
from kvtool.core.cache import KVCache, ModelFacts, dense_reference_bytes
from kvtool.core.placement import device_label, layer_placement, resolve_device, resolve_devices, run_per_device
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats.base import CompressedCache, Encoded, Format
from kvtool.analysis.metrics import (
    compare_logits,
    first_divergence,
    mass_recall,
    output_errors,
    pool_errors,
    pool_recall,
)
from kvtool.hf.models import facts_of, ModelSource
from kvtool.hf.devices import layer_devices
from kvtool.hf.keycheck import EXACT_LAYERS, compare_keys

BACKENDS = ("auto", "torch", "triton")


# ----------------------------------------------------------------------------- inputs


def find_source(cc: CompressedCache, compressed_path: Path | None = None, capture: Path | None = None) -> Path:
    """The capture a compressed file came from: ``capture`` when given (its sha256 must match the
    file's ``source_sha256`` when recorded), else ``info['source_path']`` (as written, then beside
    the compressed file) if its sha256 matches. BadDataError saying how to pass ``--capture``
    otherwise."""
    want = str(cc.info.get("source_sha256") or "")
    if capture is not None:
        if not Path(capture).exists():
            raise BadDataError(f"--capture {capture}: no such file")
        io.read_header(Path(capture))  # a regular kvtool file, before hashing it
        if want and not is_source(capture, want):
            got = io.source_sha256(capture)
            raise BadDataError(f"--capture {capture} is not the capture this file was compressed from (sha256 {got[:12]}…, the file records {want[:12]}…)")
        return Path(capture)
    recorded = cc.info.get("source_path")
    candidates: list[Path] = []
    if recorded:
        candidates.append(Path(recorded))
        if compressed_path is not None:
            candidates.append(Path(compressed_path).parent / Path(recorded).name)
    for cand in candidates:
        # only a regular file that reads as a capture of the right length is hashed: a recorded
        # path may name anything (/dev/zero, a FIFO, a huge unrelated file)
        if plausible_source(cand, cc) and (not want or is_source(cand, want)):
            return cand
    where = f" (it was {recorded}, sha256 {want[:12]}…)" if recorded else ""
    raise BadDataError(f"the source capture of this compressed file was not found{where}; pass it with --capture CAPTURE.safetensors")


def is_source(path: str | Path, want: str) -> bool:
    """Whether ``path`` is the file whose ``source_sha256`` (:func:`kvtool.core.kvfile.source_sha256`)
    is ``want``; a file recorded by the sha256 of its whole content (kvtool before header digests) is
    recognised too."""
    return io.source_sha256(path) == want or io.sha256_file(path) == want


def plausible_source(path: Path, cc: CompressedCache) -> bool:
    """True when ``path`` is a regular file whose header is a capture of ``cc``'s token count."""
    try:
        io.check_regular_file(path)
        meta, entries = io.read_header(path)
        io.check_schema(path, meta, io.CAPTURE_SCHEMA)
    except BadDataError:
        return False
    shape = entries.get("token_ids", ("", []))[1]
    return len(shape) == 2 and shape[1] == cc.token_ids.shape[1]


def check_source(cc: CompressedCache, source: KVCache, heldout: int | None = None) -> int:
    """Check that ``source`` is the capture ``cc`` was made from and holds what verification needs;
    return the number of held-out queries to score (``heldout`` or the file's W)."""
    w = int(cc.info.get("heldout", 0) or 0)
    if w <= 0:
        raise UsageError("this compressed file holds no held-out tokens (it was compressed with --heldout 0); recompress with --heldout 64 to verify it")
    m = w if heldout is None else int(heldout)
    if m <= 0:
        raise UsageError(f"--heldout must be at least 1, got {m}")
    if m > w:
        raise UsageError(f"--heldout {m}: the file keeps only its last {w} tokens out of the compressor's sight (it was compressed with --heldout {w}); use --heldout {w} or less, or recompress with --heldout {m}")
    if source.num_tokens != cc.prefix_tokens + w:
        raise BadDataError(f"the capture has {source.num_tokens} tokens but the compressed file covers {cc.prefix_tokens + w}: not its source")
    if not torch.equal(source.token_ids.cpu(), cc.token_ids.cpu()):
        raise BadDataError("the capture's token ids differ from the compressed file's: not its source")
    missing = [i for i in cc.layer_indices if i not in source.layers]
    if missing:
        raise BadDataError(f"the capture lacks layer {missing[0]}, which the compressed file holds")
    if not source.has_queries_for(cc.layer_indices):
        raise UsageError("the capture has no queries for the compressed layers, which verify scores; recapture without --no-queries (or with --query-layers covering them)")
    return m


def resolve_backend(backend: str, fmt: Format, device: str | torch.device | None = None) -> tuple[str, torch.device]:
    """The backend (``triton``: the format's kernel; ``torch``: its plain-torch reference) and the
    device it runs on (``device``, default CUDA when present). ``auto`` -> ``triton`` on a CUDA
    device when the format has a kernel, else ``torch``. ``triton`` on the CPU needs TRITON_INTERPRET=1."""
    if backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    if backend == "auto":
        backend = "triton" if cuda and fmt.has_kernel else "torch"
    if backend == "torch":
        return "torch", dev
    if not fmt.has_kernel:
        raise UsageError(f"format {fmt.name} has no Triton kernel; use --backend torch")
    if cuda:
        return "triton", dev
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        return "triton", torch.device("cpu")
    raise UsageError("--backend triton needs a CUDA GPU (or TRITON_INTERPRET=1 to run the kernels on the CPU, slowly); use --backend torch")


def _on(enc: Encoded, device: torch.device) -> Encoded:
    if all(t.device == device for t in enc.tensors.values()):
        return enc
    return Encoded({n: t.to(device) for n, t in enc.tensors.items()}, enc.meta)


# ----------------------------------------------------------------------------- attention level


@dataclass
class HeldoutData:
    """One layer's held-out inputs: queries ``[B, H, M, D]``, full dense keys/values
    ``[B, Hkv, T, D]``, and the file's dense tail ``[B, Hkv, W, D]``."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    tail_keys: torch.Tensor
    tail_values: torch.Tensor


def heldout_data(cc: CompressedCache, source: KVCache, layer: int, m: int, device: torch.device | None = None) -> HeldoutData:
    """Layer ``layer``'s held-out inputs, on ``device`` (default: where the source layer is)."""
    src = source.layers[layer]
    tail = cc.tails.get(layer)
    if tail is None:
        tail_k, tail_v = src.keys[:, :, cc.prefix_tokens:], src.values[:, :, cc.prefix_tokens:]
    else:
        tail_k, tail_v = tail.keys, tail.values
    # the source may hold every query or (kvtool verify) only the last ones: take the last m
    device = device or src.keys.device
    return HeldoutData(*(x.to(device) for x in (src.queries[:, :, src.queries.shape[2] - m:], src.keys, src.values, tail_k, tail_v)))


def heldout_output(fmt: Format, enc: Encoded, d: HeldoutData, kernel: bool = False, device: torch.device | None = None) -> torch.Tensor:
    """Output ``[B, H, M, D]`` float32 on ``device`` (default: the queries' device) of the held-out
    queries over the encoded prefix (``fmt.attend`` or, with ``kernel``, ``fmt.attend_kernel``)
    merged with their dense causal window of tail tokens (query i of M sees tail tokens 0..W-M+i)."""
    device = device or d.queries.device
    q = d.queries.to(device)
    if kernel:
        part = fmt.attend_kernel(q, _on(enc, device), None)
    else:
        part = fmt.attend(q, _on(enc, device), None)
    m, w = q.shape[2], d.tail_keys.shape[2]
    mask = torch.ones(m, w, dtype=torch.bool, device=device).tril(diagonal=w - m)
    tail = attend_partial(q, d.tail_keys.to(device), d.tail_values.to(device), None, mask)
    out, _ = merge_partials((part[0].float(), part[1].float()), tail)
    return out


def layer_fidelity(fmt: Format, enc: Encoded, d: HeldoutData, prefix_tokens: int, backend: str = "torch", device: torch.device | None = None) -> dict[str, Any]:
    """Errors, recall, bytes and (Triton backend) the kernel's own error for one layer. Everything
    runs on ``device`` (default: where ``d`` is): the dense reference, the format's torch path and
    its kernel."""
    device = device or d.queries.device
    enc = _on(enc, device)
    ref = dense_attention(d.queries, d.keys, d.values, causal=True)
    torch_out = heldout_output(fmt, enc, d, device=device)
    result: dict[str, Any] = {}
    if backend == "triton":
        kernel_out = heldout_output(fmt, enc, d, kernel=True, device=device)
        result["errors"] = output_errors(kernel_out, ref)
        result["torch_errors"] = output_errors(torch_out, ref)
        result["kernel_vs_torch"] = output_errors(kernel_out, torch_out)
    else:
        result["errors"] = output_errors(torch_out, ref)
    sel = fmt.selected_mask(d.queries, enc)
    if sel is not None:
        probs = attention_probs(d.queries, d.keys, causal=True)[..., :prefix_tokens]
        result["recall"] = mass_recall(sel.to(device=probs.device, dtype=torch.bool), probs)
    b, hkv, _, hd = d.keys.shape
    result["dense_bytes"] = dense_reference_bytes(b, hkv, prefix_tokens, hd)
    result["stored_bytes"] = int(sum(fmt.nbytes(enc).values()))
    result["traffic_bytes"] = int(fmt.traffic_bytes(enc, d.queries[:, :, -1:]))
    return result


def attention_fidelity(
    cc: CompressedCache,
    source: KVCache,
    heldout: int | None = None,
    backend: str = "auto",
    progress: Callable[[int], None] | None = None,
    device: str | torch.device | list[torch.device] | None = None,
) -> dict[str, Any]:
    """Score every layer of ``cc`` on the held-out queries of ``source`` (see the module docstring),
    one layer at a time on ``device`` (default ``auto``: every visible GPU, layers spread over them
    in contiguous blocks, the GPUs at once; else the CPU; or a list of devices).

    Returns ``{"backend", "device", "heldout", "prefix_tokens", "layers": {i: {...}}, "overall":
    {...}, "storage_ratio", "traffic_ratio", "recall" (or None), "kernel_vs_torch" (Triton only)}``."""
    m = check_source(cc, source, heldout)
    fmt = cc.fmt
    devices = list(device) if isinstance(device, (list, tuple)) else resolve_devices(device)
    backend, first = resolve_backend(backend, fmt, devices[0])
    if first.type != devices[0].type:  # the kernels on the CPU interpreter
        devices = [first]
    per = run_per_device(lambda i, dev: layer_fidelity(fmt, cc.layers[i], heldout_data(cc, source, i, m, dev), cc.prefix_tokens, backend, dev),
                         layer_placement(cc.layer_indices, devices), on_done=progress)
    dense = sum(r["dense_bytes"] for r in per.values())
    out: dict[str, Any] = {
        "format": cc.format,
        "params": cc.params,
        "backend": backend,
        "device": device_label(devices),
        "heldout": m,
        "prefix_tokens": cc.prefix_tokens,
        "layers": per,
        "overall": pool_errors([r["errors"] for r in per.values()]),
        "recall": pool_recall([r["recall"] for r in per.values() if "recall" in r]),
        "dense_bytes": dense,
        "stored_bytes": sum(r["stored_bytes"] for r in per.values()),
        "traffic_bytes": sum(r["traffic_bytes"] for r in per.values()),
    }
    out["storage_ratio"] = out["stored_bytes"] / dense if dense else math.nan
    out["traffic_ratio"] = out["traffic_bytes"] / dense if dense else math.nan
    if backend == "triton":
        out["kernel_vs_torch"] = pool_errors([r["kernel_vs_torch"] for r in per.values()])
        out["torch_overall"] = pool_errors([r["torch_errors"] for r in per.values()])
    return out


# ----------------------------------------------------------------------------- model level


def check_model_facts(model: Any, facts: ModelFacts, model_name: str) -> None:
    """BadDataError naming the first structural fact where ``model`` differs from the capture's."""
    got = facts_of(model, ModelSource("hf-folder", Path("."), model_name))
    for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size"):
        a, b = getattr(got, key), getattr(facts, key)
        if a != b:
            raise BadDataError(f"model {model_name} does not match the capture: {key.replace('_', ' ')} is {a}, the capture's model ({facts.name}) has {b}")
    if got.vocab_size and facts.vocab_size and got.vocab_size != facts.vocab_size:
        raise BadDataError(f"model {model_name} does not match the capture: vocabulary {got.vocab_size}, the capture's model ({facts.name}) has {facts.vocab_size}")


@dataclass
class DenseReference:
    """The dense run a lossy run is compared with: the model's dense prefix cache per layer, the
    continuation logits ``[B, W, V]`` and the greedy tokens ``[B, N]``."""

    prefix: dict[int, Any]
    logits: torch.Tensor
    generated: torch.Tensor
    prefix_tokens: int


# a random-weight 70B in bf16, captured in chunks of 8,192 tokens, differs from one 32k-token pass
# by 5% in its keys at layer 45: deep layers are held to a looser bound than the first ones
KEY_CHECK_EXACT_LAYERS = EXACT_LAYERS


def dense_reference(model: Any, token_ids: torch.Tensor, prefix_tokens: int, generate: int = 0, source: KVCache | None = None, model_name: str = "the model") -> DenseReference:
    """Prefill ``token_ids[:, :P]`` densely, run the continuation and greedy generation.

    With ``source`` the prefill keys of the captured layers must reproduce the capture's keys,
    otherwise the model is not the one the capture came from: relative L2 below 5% in the first
    ``KEY_CHECK_EXACT_LAYERS`` captured layers, below 50% in deeper ones (a capture prefilled in
    chunks drifts from one pass with depth in bf16; other weights give errors near 1 everywhere)."""
    if token_ids.shape[1] - prefix_tokens < 1:
        raise UsageError("no continuation tokens after the prefix: the file needs held-out tokens (compress with --heldout 64)")
    vocab = getattr(model.config, "vocab_size", None)
    if vocab and int(token_ids.max()) >= vocab:
        raise BadDataError(f"model {model_name} does not match the capture: token id {int(token_ids.max())} is outside its vocabulary of {vocab}")
    prefix = hfattn.prefill(model, token_ids[:, :prefix_tokens])
    if source is not None:
        compare_keys(prefix, source, prefix_tokens, model_name, exact_layers=KEY_CHECK_EXACT_LAYERS)
    cache = hfattn.build_cache(model, prefix, None)
    with hfattn.compressed_attention(model, None):
        logits = hfattn.forward(model, cache, token_ids[:, prefix_tokens:])
        gen = hfattn.greedy(model, cache, logits[:, -1], generate)
    return DenseReference(prefix, logits, gen, prefix_tokens)


def model_fidelity(model: Any, cc: CompressedCache, reference: DenseReference, generate: int = 0, backend: str = "torch") -> dict[str, Any]:
    """Run the continuation with the file's layers attending to their encoded prefix and compare with
    ``reference``: ``nll_dense``, ``nll_lossy``, ``nll_increase``, ``ppl_ratio``, ``agreement``,
    ``kl``, ``max_kl`` and, with ``generate``, ``generated`` tokens and ``first_divergence``."""
    if reference.prefix_tokens != cc.prefix_tokens:
        raise UsageError("the dense reference was made for a different prefix length")
    # each layer's encoded prefix sits beside the model's layer (one device, or a device map's GPUs)
    prefix = hfattn.CompressedPrefix.from_compressed(cc, backend=backend).to(layer_devices(model))
    cont = cc.token_ids[:, cc.prefix_tokens:]
    cache = hfattn.build_cache(model, reference.prefix, prefix)
    with hfattn.compressed_attention(model, prefix):
        logits = hfattn.forward(model, cache, cont)
        gen = hfattn.greedy(model, cache, logits[:, -1], generate)
    result = compare_logits(reference.logits, logits, cont[:, 1:])
    result["compressed_layers"] = cc.layer_indices
    result["model_layers"] = int(model.config.num_hidden_layers)
    if generate:
        result["generate"] = generate
        result["first_divergence"] = first_divergence(reference.generated, gen)
        result["generated_dense_ids"] = reference.generated.tolist()
        result["generated_lossy_ids"] = gen.tolist()
    return result


def default_model_spec(facts: ModelFacts, model: str | None) -> str | None:
    """The model to use for model-level fidelity: ``model`` when given, the embedded model when the
    capture came from it, else None (model-level metrics are skipped)."""
    if model:
        return model
    if facts.source == "embedded":
        return "embedded"
    return None
