"""Real generation through a live cache, every encode included, and the stable cost of growth.

:class:`GrowthLoop` runs greedy decode steps through a live cache the way a serving loop does: the
step is captured once in a CUDA graph (``capture``) and replayed; replays append each new token on
the device (bitmap, KIVI and the plans built of them advance their device counters; layers indexed
on the host, such as the dense baselines, rewrite the captured position, so their replays decode
at the captured context), and the step's own positions advance on the device
(:func:`kvtool.bench.decode.decode_step`), so a replay is the eager step. Replays never encode: when the layers have no room left for another
replayed token, the loop calls :func:`kvtool.hf.live.reserve` eagerly between two replays, which
encodes every filled block / group (bitmap prune + encode, KIVI quantisation) -- the *growth*.
If the growth re-allocated a layer's tensors (a full capacity re-laid), the step is captured
again (``recaptures``). Without CUDA the step runs eagerly (layers may then encode inside it).

Timing (CUDA): wall-clock ``time.perf_counter`` around sections bracketed by
``torch.cuda.synchronize``, because growth is host work (it reads the device's counters) mixed
with kernels, and replays are launched asynchronously:

- :func:`generate`: N untimed greedy tokens first (the warm-up: each kernel's first-use
  compilation, once per process -- on an H100 a KIVI layer's first group absorb compiled for about
  3 s inside the timed tokens -- and the residual buffers' growth to their full size), then N timed
  tokens from the phase right after an encode, then the encode of what those tokens filled (whole
  blocks only): ``tokens_per_s`` = batch x N / wall time of the lot; ``encode_share`` = the encodes'
  time / that wall time (each encode bracketed by syncs, so replays queued before it are not
  counted as encoding). Capacity re-allocations, their copies and new captures are timed where
  they fall;
- :func:`growth_cost`: after one untimed encode (the warm-up: first-call compilation and the
  allocator's growth), ``repeats`` spans, each from right after an encode to the first encode at
  or beyond ``span`` replayed tokens: the encodes' time / the span's tokens. The median over spans
  (and the 10th / 90th percentiles) is the growth cost per decoded position.
"""

from __future__ import annotations

import statistics
import time
import types
from typing import Any, Callable

import torch

from kvtool.hf.live import live_layers, prepare, reserve, room
from kvtool.bench.harness import percentile


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture(fn: Callable[[], Any], device: torch.device, graph: bool) -> tuple[Callable[[], Any], str, str | None]:
    """``fn`` captured in a CUDA graph when ``graph`` and ``device`` is CUDA: (its replay,
    ``"cuda-graph"``, None); where capture fails or is not asked for: (``fn``, ``"eager"``, why)."""
    if not (graph and device.type == "cuda"):
        return fn, "eager", None
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize(device)
        return g.replay, "cuda-graph", None
    except Exception as exc:  # a host sync or CPU work inside the step: run it eagerly, say why
        torch.cuda.synchronize(device)
        return fn, "eager", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def chunk_of(live: Any) -> int:
    """Tokens a live layer encodes at a time (0: it never encodes); a mixed layer's largest."""
    own = int(getattr(live, "chunk", 0) or 0)
    return max([own] + [chunk_of(inner) for _, inner in getattr(live, "groups", ())])


def fingerprint(obj: Any, depth: int = 7) -> tuple[int, ...]:
    """The storage addresses of every tensor reachable from ``obj``'s attributes (dicts, lists,
    tuples and objects, ``depth`` levels; modules and classes are not entered): a captured graph
    stays valid while this is unchanged."""
    seen: set[int] = set()
    out: list[int] = []

    def walk(x: Any, d: int) -> None:
        if id(x) in seen or d < 0:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            out.append(x.data_ptr())
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, d - 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, d - 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (type, types.ModuleType)) and not callable(x):
            for k, v in vars(x).items():
                if k != "fmt":  # the format object: no tensors of the layer
                    walk(v, d - 1)

    walk(obj, depth)
    return tuple(out)


class GrowthLoop:
    """Greedy decode steps through ``cache`` (module docstring): ``step`` runs one step (the model
    on the last token, its argmax fed back on the device); ``graph``: replay a captured step."""

    def __init__(self, cache: Any, step: Callable[[], Any], device: torch.device, graph: bool = True) -> None:
        self.cache, self.step, self.device, self.graph = cache, step, device, graph
        self.recaptures = -1
        self.since = -1  # steps since the last encode (-1: none yet)
        self.chunk = max((chunk_of(live) for live in live_layers(cache)), default=0)
        self.cap = 8 * self.chunk + 128  # steps within which a growing layer encodes (else: it encodes inside eager steps)
        reserve(cache, 1)
        self._capture()

    def _capture(self) -> None:
        prepare(self.cache, 1)
        self.call, self.method, self.capture_error = capture(self.step, self.device, self.graph)
        self.recaptures += 1
        reserve(self.cache, 1)  # the counters read back from the device (a capture moves the host's)
        self.left = room(self.cache)
        self.print = fingerprint(live_layers(self.cache))

    def encode(self) -> float:
        """Seconds of one eager growth (every filled block / group encoded), between syncs."""
        sync(self.device)
        t0 = time.perf_counter()
        reserve(self.cache, 1)
        sync(self.device)
        dt = time.perf_counter() - t0
        if self.call is not self.step and fingerprint(live_layers(self.cache)) != self.print:
            self._capture()  # the growth moved a layer's tensors: the old graph reads stale addresses
        self.left = room(self.cache)
        self.since = 0
        return dt

    def token(self) -> float:
        """One decode step (an encode first when no room is left); the encode's seconds."""
        dt = self.encode() if self.left < 1 else 0.0
        self.call()
        self.left -= 1
        self.since += self.since >= 0
        return dt

    def to_encode(self) -> int:
        """Steps until the next encode has run (none for layers that never encode, or right after
        an encode; at most ``cap``); how many."""
        n = 0
        if not self.chunk or self.since == 0:
            return n
        while self.left >= 1 and n < self.cap:
            self.token()
            n += 1
        if self.left < 1:
            self.encode()
        return n


def generate(loop: GrowthLoop, tokens: int, batch: int, warmup: int | None = None) -> dict[str, Any]:
    """``tokens`` greedy steps from right after an encode, then the encode of what they filled
    (module docstring): tokens/s, the share of the time spent encoding, the encodes run. First,
    untimed: ``warmup`` steps (default ``tokens``), then the steps that reach an encode."""
    warmup = tokens if warmup is None else warmup
    for _ in range(warmup):
        loop.token()
    loop.to_encode()
    sync(loop.device)
    t0 = time.perf_counter()
    enc, events = 0.0, 0
    for _ in range(tokens):
        dt = loop.token()
        enc += dt
        events += dt > 0
    enc += loop.encode()
    events += 1
    sync(loop.device)
    total = time.perf_counter() - t0
    return {"generate_tokens": tokens, "generate_warmup_tokens": warmup, "generate_tokens_per_s": batch * tokens / total, "generate_s": total,
            "generate_encode_share": enc / total, "generate_encodes": events, "generate_method": loop.method}


def growth_cost(loop: GrowthLoop, repeats: int) -> dict[str, Any]:
    """Growth per decoded position, µs: median (p10, p90) over ``repeats`` spans of at least the
    loop's ``chunk`` tokens each (module docstring). Spans that meet no encode within the loop's
    ``cap`` steps (layers that encode inside an eager step) count 0."""
    span = max(1, loop.chunk)
    loop.to_encode()  # the warm-up encode, untimed
    samples = []
    for _ in range(repeats):
        n, enc = 0, 0.0
        while n < loop.cap:
            if loop.left < 1:
                enc += loop.encode()
                if n >= span:
                    break
            loop.token()
            n += 1
        samples.append(enc * 1e6 / max(1, n))
    return {"encode_us_per_token": statistics.median(samples), "encode_us_p10": percentile(samples, 0.1), "encode_us_p90": percentile(samples, 0.9),
            "encode_repeats": len(samples), "encode_span_tokens": span}
