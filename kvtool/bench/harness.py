"""Timing harness for the decode kernels: environment, timer, inputs, baselines, records.

Everything ``kvtool bench`` reports is measured here in one run on one device:

- :func:`detect_env` names the device and the versions (torch, triton, CUDA, FlashInfer) and measures
  the device-to-device copy bandwidth (bytes read + bytes written over the time of a large copy);
- :class:`Timer` times a callable with CUDA events: warm-up, then many runs, each preceded (with
  ``cold_l2``) by a write over a buffer larger than the L2 cache so that no run reads its inputs from
  L2; it reports the median and the 10th / 90th percentiles in microseconds;
- the dense baselines work on the decode layout: q ``[B, H, D]``, keys / values ``[B, Hkv, T, D]``
  (query head h reads KV head ``h // (H // Hkv)``), fp16 or bf16, scale ``1/sqrt(D)``;
- :func:`make_record` builds one JSON record per configuration and provider with the stable fields
  listed in :data:`RECORD_FIELDS`.

Without CUDA the harness runs only under ``TRITON_INTERPRET=1`` on the CPU for tiny configurations
(functional checks); those timings are wall-clock times of the interpreter and mean nothing
(``timing_valid`` is false in every record).
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from kvtool.kernels.common import interpreting
from kvtool.core.errors import UsageError
from kvtool.core import io
from kvtool.hf.shapes import SHAPES

RECORD_FIELDS = (
    "kernel", "provider", "device", "batch", "seq", "heads", "kv_heads", "head_dim", "dtype",
    "sparsity", "budget", "k", "median_us", "p10_us", "p90_us", "runs", "bytes_read",
    "bandwidth_gbps", "bandwidth_fraction", "floor_us", "rel_err", "status", "speedup", "timing_valid", "cold_l2",
    "method", "versions", "data", "backend",
)

# attention part (heads, KV heads, head_dim) of kvtool's one table of model shapes
MODEL_SHAPES = {name: (s.heads, s.kv_heads, s.head_dim) for name, s in SHAPES.items()}

# Largest configuration the CPU interpreter path accepts (elements of one K tensor).
INTERPRET_MAX_ELEMENTS = 1 << 17

NOT_INSTALLED = "not installed"


class BenchUnavailable(UsageError):
    """The benchmark cannot run here (no CUDA, a kernel module missing): exit code 2."""


@dataclass(frozen=True)
class ModelShape:
    """Attention shape: query heads, KV heads, head_dim."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def model_shape(name: str, heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None) -> ModelShape:
    """A named shape (:data:`kvtool.hf.shapes.SHAPES`: ``llama3-8b``, ``llama3-70b``, ...) or ``custom`` with all three given.
    Explicit ``heads`` / ``kv_heads`` / ``head_dim`` override a named shape."""
    if name == "custom":
        if None in (heads, kv_heads, head_dim):
            raise UsageError("--model-shape custom needs --heads, --kv-heads and --head-dim")
        base = (heads, kv_heads, head_dim)
    elif name in MODEL_SHAPES:
        base = MODEL_SHAPES[name]
    else:
        raise UsageError(f"--model-shape {name!r} is unknown; use one of {', '.join(MODEL_SHAPES)} or custom")
    h = heads if heads is not None else base[0]
    hkv = kv_heads if kv_heads is not None else base[1]
    d = head_dim if head_dim is not None else base[2]
    if min(h, hkv, d) < 1 or h % hkv:
        raise UsageError(f"heads {h} must be a positive multiple of kv-heads {hkv} (and head_dim {d} positive)")
    return ModelShape(name, h, hkv, d)


# --------------------------------------------------------------------------- environment


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception:
        return NOT_INSTALLED
    return str(getattr(mod, "__version__", "unknown"))


def interpret_mode() -> bool:
    """True under ``TRITON_INTERPRET=1`` (the CPU functional path)."""
    return interpreting()


def flashinfer_module():
    """The ``flashinfer`` module, or None when it cannot be imported (any reason)."""
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return None
    return flashinfer


@dataclass
class BenchEnv:
    """Where the run happens. ``copy_gbps`` is the measured device copy bandwidth in GB/s (1e9 B/s),
    counting bytes read plus bytes written (the reference for ``bandwidth_fraction``); ``read_gbps``
    the rate of a read-only stream (a large sum), which a read-mostly decode kernel can approach and
    which can exceed the copy figure. Both None on the CPU path."""

    device: str
    device_type: str
    timing_valid: bool
    cold_l2: bool
    versions: dict[str, str]
    copy_gbps: float | None = None
    read_gbps: float | None = None
    l2_bytes: int | None = None
    sms: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect_env(cold_l2: bool = True, measure_copy: bool = True) -> BenchEnv:
    """Check the device and read versions. Raises :class:`BenchUnavailable` without CUDA unless
    ``TRITON_INTERPRET=1`` is set (the CPU functional path)."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = NOT_INSTALLED
    fi = flashinfer_module()
    versions = {
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": str(torch.version.cuda) if torch.version.cuda else "none",
        "flashinfer": str(getattr(fi, "__version__", "unknown")) if fi is not None else NOT_INSTALLED,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available() and not interpret_mode():
        props = torch.cuda.get_device_properties(0)
        env = BenchEnv(
            device=props.name, device_type="cuda", timing_valid=True, cold_l2=cold_l2, versions=versions,
            l2_bytes=int(getattr(props, "L2_cache_size", 0)) or None, sms=props.multi_processor_count,
        )
        if measure_copy:
            env.copy_gbps = measure_copy_bandwidth()
            env.read_gbps = measure_read_bandwidth()
        return env
    if not interpret_mode():
        raise BenchUnavailable(
            "no CUDA device: kvtool bench times GPU kernels and needs one (torch.cuda.is_available() is false). "
            "For a functional check on the CPU set TRITON_INTERPRET=1 and use a tiny configuration, e.g. "
            "--model-shape custom --heads 4 --kv-heads 2 --head-dim 64 --batch 1 --seq 256 (timings then mean nothing)"
        )
    return BenchEnv(
        device=f"cpu ({platform.processor() or platform.machine()}, TRITON_INTERPRET=1)", device_type="cpu",
        timing_valid=False, cold_l2=False, versions=versions,
        notes=["CPU interpreter run: timings are wall-clock times of the Triton interpreter and mean nothing"],
    )


def check_size(env: BenchEnv, batch: int, kv_heads: int, seq: int, head_dim: int) -> None:
    """On the CPU path only tiny configurations run; raise a clear error otherwise."""
    if env.device_type == "cpu" and batch * kv_heads * seq * head_dim > INTERPRET_MAX_ELEMENTS:
        raise BenchUnavailable(
            f"batch {batch} x kv-heads {kv_heads} x seq {seq} x head_dim {head_dim} is too large for the CPU "
            f"interpreter path (at most {INTERPRET_MAX_ELEMENTS} elements per K tensor); run on a CUDA GPU"
        )


def measure_copy_bandwidth(nbytes: int = 1 << 30, runs: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s: 2 * nbytes (read + write) over the median time."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9


def measure_read_bandwidth(nbytes: int = 1 << 30, runs: int = 20) -> float:
    """Read-only bandwidth in GB/s: nbytes over the median time of an fp32-accumulated sum of them."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    for _ in range(3):
        src.sum(dtype=torch.float32)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        src.sum(dtype=torch.float32)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del src
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / 1e9


# --------------------------------------------------------------------------- timer


@dataclass
class Timing:
    """Microseconds: median and the 10th / 90th percentiles of ``runs`` timed runs."""

    median_us: float
    p10_us: float
    p90_us: float
    runs: int
    method: str = "stream"


def _percentile(sorted_vals: list[float], q: float) -> float:
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = q * (len(sorted_vals) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def percentile(vals: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``vals``, linear between the nearest ranks."""
    return _percentile(sorted(vals), q)


def summarize(times_us: list[float]) -> Timing:
    vals = sorted(times_us)
    return Timing(statistics.median(vals), _percentile(vals, 0.1), _percentile(vals, 0.9), len(vals))


class Timer:
    """Times callables on the env's device.

    CUDA: ``warmup_ms`` of warm-up calls, then runs until about ``rep_ms`` of kernel time (at least
    ``min_runs``, at most ``max_runs``), each bracketed by CUDA events; with ``cold_l2`` a 256 MiB
    buffer (several times any current L2) is overwritten before each run, outside the events. With
    ``hide_launch`` (default) a GPU sleep of about ``sleep_us`` precedes each start event so that the
    host has queued the callable's kernels before the GPU reaches them: the figure is device time,
    without Python / launch overhead (which a CUDA graph removes in a real decode loop), as long as
    the callable does not wait for the GPU itself. With ``cuda_graph`` the callable is captured in a
    CUDA graph and its replays are timed (``Timing.method`` says which way each figure was taken;
    callables that cannot be captured fall back to plain launches).
    CPU (interpreter): ``cpu_runs`` wall-clock runs, meaningless as speed."""

    def __init__(self, env: BenchEnv, warmup_ms: float = 25.0, rep_ms: float = 200.0, min_runs: int = 10,
                 max_runs: int = 500, cpu_runs: int = 1, hide_launch: bool = True, sleep_us: float = 300.0,
                 cuda_graph: bool = False) -> None:
        self.env = env
        self.cuda_graph = cuda_graph and env.device_type == "cuda"
        self.graph_errors: list[str] = []
        self.hide_launch = hide_launch and env.device_type == "cuda"
        self.sleep_cycles = int(sleep_us * 1.0e3 * 2.0)  # about sleep_us at 2 GHz; only needs to exceed host time
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.min_runs, self.max_runs, self.cpu_runs = min_runs, max_runs, cpu_runs
        self.flush = None
        if env.device_type == "cuda" and env.cold_l2:
            self.flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")

    def _graphed(self, fn: Callable[[], Any]) -> Callable[[], Any] | None:
        """``fn`` captured in a CUDA graph (its replay), or None when it cannot be captured (host
        syncs, CPU work on device values); the reason goes to ``graph_errors``."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            torch.cuda.synchronize()
        except Exception as exc:  # capture is refused by many host-side operations: say which
            torch.cuda.synchronize()
            self.graph_errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            return None
        return graph.replay

    def time(self, fn: Callable[[], Any]) -> Timing:
        if self.env.device_type != "cuda":
            times = []
            for _ in range(self.cpu_runs):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            timing = summarize(times)
            timing.method = "wall-clock (interpreter)"
            return timing
        method = "stream"
        if self.cuda_graph:
            replay = self._graphed(fn)
            if replay is not None:
                fn, method = replay, "cuda-graph"
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            fn()
        e.record()
        torch.cuda.synchronize()
        est_ms = max(s.elapsed_time(e) / 5, 1e-3)
        for _ in range(max(1, int(self.warmup_ms / est_ms))):
            fn()
        n = int(min(self.max_runs, max(self.min_runs, self.rep_ms / est_ms)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            if self.flush is not None:
                self.flush.zero_()
            if self.hide_launch:
                # keep the GPU busy while the host issues fn's launches, so the events bracket device
                # time only (what a CUDA-graph replay of the decode step would see)
                torch.cuda._sleep(self.sleep_cycles)
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        timing = summarize([st.elapsed_time(en) * 1e3 for st, en in zip(starts, ends)])
        timing.method = method
        return timing


# --------------------------------------------------------------------------- inputs


def device_of(env: BenchEnv) -> torch.device:
    return torch.device("cuda" if env.device_type == "cuda" else "cpu")


def random_decode_inputs(shape: ModelShape, batch: int, seq: int, dtype: torch.dtype, device, seed: int = 0):
    """q ``[B, H, D]``, keys and values ``[B, Hkv, T, D]``, standard normal in ``dtype``."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, shape.heads, shape.head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
    k = torch.randn(batch, shape.kv_heads, seq, shape.head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn(batch, shape.kv_heads, seq, shape.head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
    return q, k, v


def capture_decode_inputs(path, layer: int | None, batch: int, seq: int, dtype: torch.dtype, device):
    """Real tensors from a capture file, tiled along tokens to ``seq`` and along the batch to ``batch``.

    Returns (shape, q ``[B, H, D]`` = the layer's last captured query, keys, values ``[B, Hkv, seq, D]``)."""
    cache = io.load(path, layers=None if layer is None else [layer], parts=("keys", "values", "queries"))
    idx = cache.layer_indices[0] if layer is None else layer
    lay = cache.layer(idx)
    if lay.queries is None:
        raise UsageError(f"{path} has no queries for layer {idx}; recapture with queries to time on real tensors")
    f = cache.facts
    shape = ModelShape(f"capture:{f.name}", f.num_heads, f.num_kv_heads, f.head_dim)
    reps = math.ceil(seq / lay.keys.shape[2])

    def tile(x: torch.Tensor) -> torch.Tensor:
        x = x.repeat(1, 1, reps, 1)[:, :, :seq]
        return x.repeat(math.ceil(batch / x.shape[0]), 1, 1, 1)[:batch]

    k = tile(lay.keys).to(device=device, dtype=dtype).contiguous()
    v = tile(lay.values).to(device=device, dtype=dtype).contiguous()
    q = lay.queries[:, :, -1].repeat(math.ceil(batch / lay.queries.shape[0]), 1, 1)[:batch].to(device=device, dtype=dtype).contiguous()
    return shape, q, k, v


# --------------------------------------------------------------------------- dense baselines


def grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q ``[B, H, D]`` -> ``[B, Hkv, G, D]`` (a view: query heads of one KV head are consecutive)."""
    b, h, d = q.shape
    return q.view(b, kv_heads, h // kv_heads, d)


def cublas_qk(qg: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Scores ``[B, Hkv, G, T]`` (input dtype) = qg ``[B, Hkv, G, D]`` @ keysᵀ through torch.matmul (cuBLAS)."""
    return torch.matmul(qg, k.transpose(-1, -2))


def cublas_pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Output ``[B, Hkv, G, D]`` = p ``[B, Hkv, G, T]`` @ values ``[B, Hkv, T, D]`` (cuBLAS)."""
    return torch.matmul(p, v)


def torch_dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense decode attention ``[B, H, D]``: cuBLAS q·Kᵀ, softmax in fp32, cuBLAS P·V."""
    b, h, d = q.shape
    s = torch.matmul(grouped(q, k.shape[1]), k.transpose(-1, -2)).float() * scale
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p, v).view(b, h, d)


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch scaled_dot_product_attention for one query token, GQA enabled; ``[B, H, D]``."""
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)
    return out[:, :, 0]


def reference_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 reference decode attention ``[B, H, D]`` float32."""
    qg = grouped(q.float(), k.shape[1])
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).reshape(q.shape)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN anywhere gives NaN)."""
    out64, ref64 = out.double(), ref.double()
    denom = ref64.norm().item()
    return float((out64 - ref64).norm().item() / (denom if denom > 0 else 1.0))


class FlashInferDecode:
    """FlashInfer decode baselines over the same keys / values (layout HND, no positional encoding).

    ``single(q0)`` runs ``single_decode_with_kv_cache`` for request 0 (q0 ``[H, D]``, keys / values
    ``[Hkv, T, D]``); ``batch(q, tensor_cores)`` runs ``BatchDecodeWithPagedKVCacheWrapper`` (the CUDA-core
    decode kernel, or with ``tensor_cores`` the tensor-core path FlashInfer advises for GQA groups >= 4)
    over a paged copy of the whole batch (page size ``page_size``; the copy and ``plan`` are done once,
    outside the timing). q ``[B, H, D]`` -> ``[B, H, D]``."""

    def __init__(self, fi, k: torch.Tensor, v: torch.Tensor, heads: int, scale: float, page_size: int = 16) -> None:
        self.fi, self.k, self.v, self.scale = fi, k, v, scale
        b, hkv, t, d = k.shape
        self.heads, self.page_size = heads, page_size
        pages_per = math.ceil(t / page_size)
        pad = pages_per * page_size - t

        def paged(x: torch.Tensor) -> torch.Tensor:
            if pad:
                x = torch.nn.functional.pad(x, (0, 0, 0, pad))
            x = x.view(b, hkv, pages_per, page_size, d).permute(0, 2, 1, 3, 4)
            return x.reshape(b * pages_per, hkv, page_size, d).contiguous()

        self.k_pages, self.v_pages = paged(k), paged(v)
        dev = k.device
        self.indptr = torch.arange(0, b + 1, dtype=torch.int32, device=dev) * pages_per
        self.indices = torch.arange(b * pages_per, dtype=torch.int32, device=dev)
        self.last = torch.full((b,), t - (pages_per - 1) * page_size, dtype=torch.int32, device=dev)
        self.wrappers: dict[bool, Any] = {}

    def _wrapper(self, tensor_cores: bool):
        if tensor_cores not in self.wrappers:
            hkv, d = self.k.shape[1], self.k.shape[3]
            ws = torch.zeros(256 * 1024 * 1024, dtype=torch.uint8, device=self.k.device)
            w = self.fi.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="HND", use_tensor_cores=tensor_cores)
            w.plan(self.indptr, self.indices, self.last, self.heads, hkv, d, self.page_size, pos_encoding_mode="NONE",
                   q_data_type=self.k.dtype, kv_data_type=self.k.dtype, sm_scale=self.scale)
            self.wrappers[tensor_cores] = (w, ws)
        return self.wrappers[tensor_cores][0]

    def single(self, q0: torch.Tensor) -> torch.Tensor:
        return self.fi.single_decode_with_kv_cache(q0, self.k[0], self.v[0], kv_layout="HND", sm_scale=self.scale)

    def batch(self, q: torch.Tensor, tensor_cores: bool = False) -> torch.Tensor:
        return self._wrapper(tensor_cores).run(q, (self.k_pages, self.v_pages))

    def free(self) -> None:
        self.wrappers.clear()
        del self.k_pages, self.v_pages


# --------------------------------------------------------------------------- records


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def make_record(env: BenchEnv, kernel: str, provider: str, shape: ModelShape, batch: int, seq: int, dtype: torch.dtype,
                timing: Timing | None, bytes_read: int, *, sparsity: float | None = None, budget: int | None = None,
                k: int | None = None, rel: float | None = None, status: str = "ok", data: str = "random",
                backend: str | None = None) -> dict[str, Any]:
    """One result row. ``floor_us``: the byte floor, ``bytes_read`` at the measured copy bandwidth
    (None where it was not measured); ``backend``: which backend of a kernel ran, where it has
    several (bitmap attention: triton or cuda). ``speedup`` is filled by :func:`add_speedups` once every provider of the
    configuration has been timed; ``status`` is ``ok``, ``wrong`` (failed its correctness check; not
    timed), ``not installed`` or ``skipped: <why>``."""
    median = timing.median_us if timing else None
    gbps = bytes_read / (median * 1e-6) / 1e9 if median else None
    frac = gbps / env.copy_gbps if (gbps and env.copy_gbps) else None
    floor = bytes_read / (env.copy_gbps * 1e3) if env.copy_gbps else None  # µs to move the bytes at copy bandwidth
    return {
        "kernel": kernel, "provider": provider, "device": env.device, "batch": batch, "seq": seq,
        "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "dtype": str(dtype).removeprefix("torch."), "sparsity": sparsity, "budget": budget, "k": k,
        "median_us": median, "p10_us": timing.p10_us if timing else None, "p90_us": timing.p90_us if timing else None,
        "runs": timing.runs if timing else 0, "bytes_read": int(bytes_read), "bandwidth_gbps": gbps,
        "bandwidth_fraction": frac, "floor_us": floor, "rel_err": rel, "status": status, "speedup": {},
        "timing_valid": env.timing_valid, "cold_l2": env.cold_l2, "method": timing.method if timing else None,
        "versions": env.versions, "data": data, "backend": backend,
    }


# the pseudo-baseline of add_speedups: the fastest dense decode attention of the configuration
BEST_DENSE = "best_dense"
DENSE_DECODERS = ("cublas_qk+pv", "torch_dense", "sdpa", "flashinfer_single", "flashinfer_batch", "flashinfer_batch_tc")


def add_speedups(records: list[dict[str, Any]], baselines: list[str]) -> None:
    """For each record, ``speedup[b]`` = median of baseline provider ``b`` / this record's median.
    The baseline row is taken from the same configuration (batch, seq, shape, dtype, sparsity,
    budget, k) when there is one, else from any row of the same dense configuration (dense
    baselines are shared by every sparsity / budget / k). A baseline that did not run gives its
    status string (e.g. ``not installed``). ``best_dense`` (:data:`BEST_DENSE`) among ``baselines``:
    against the fastest of the :data:`DENSE_DECODERS` timed for that dense configuration in these
    records, whose name goes to ``speedup["best_dense_is"]`` (rows of kvtool kernels only)."""

    def key(r):
        return (r["batch"], r["seq"], r["heads"], r["kv_heads"], r["head_dim"], r["dtype"], r["sparsity"], r["budget"], r["k"])

    exact: dict[tuple, dict[str, dict]] = {}
    dense: dict[tuple, dict[str, dict]] = {}
    for r in records:
        exact.setdefault(key(r), {}).setdefault(r["provider"], r)
        slot = dense.setdefault(key(r)[:6], {})
        if r["provider"] not in slot or (slot[r["provider"]]["median_us"] is None and r["median_us"] is not None):
            slot[r["provider"]] = r
    for r in records:
        for name in baselines:
            if name == BEST_DENSE:
                timed = [d for p, d in dense[key(r)[:6]].items() if p in DENSE_DECODERS and d["median_us"]]
                if r["provider"] not in DENSE_DECODERS and timed and r["median_us"]:
                    best = min(timed, key=lambda d: d["median_us"])
                    r["speedup"][BEST_DENSE] = best["median_us"] / r["median_us"]
                    r["speedup"]["best_dense_is"] = best["provider"]
                continue
            if name == r["provider"]:
                continue
            b = exact[key(r)].get(name) or dense[key(r)[:6]].get(name)
            if b is None:
                continue
            if b["median_us"] is None:
                r["speedup"][name] = b["status"]
            elif r["median_us"]:
                r["speedup"][name] = b["median_us"] / r["median_us"]
