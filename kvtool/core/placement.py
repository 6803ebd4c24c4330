"""Where commands compute: ``--device`` (``auto``, the default: CUDA when present, else the CPU).

The device is where a capture's layers are placed one at a time (:func:`kvtool.core.streaming.open_capture`),
where formats encode and the torch references run; ``--backend`` stays the choice between a
format's Triton kernel and its plain-torch reference.

On a host with several GPUs, per-layer work spreads over them: :func:`resolve_devices` lists the
devices (``auto``: every visible GPU), :func:`layer_placement` cuts the layers into one contiguous
block per device (as accelerate spreads a model's decoder layers), and :func:`run_per_device`
runs each device's layers in a thread of its own, the devices at once."""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Callable, Mapping, Sequence, TypeVar

import torch

from kvtool.core.errors import UsageError

DEVICE_HELP = "Where to compute: auto (CUDA when present, else the CPU), cpu, cuda or cuda:N."

T = TypeVar("T")


def resolve_device(spec: str | torch.device | None = None) -> torch.device:
    """``None``/``"auto"`` -> ``cuda`` when CUDA is available, else ``cpu``; ``"cuda[:n]"`` needs
    CUDA (and device n); anything else is a UsageError (one line)."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if spec is None or spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got {spec!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    return device


# ----------------------------------------------------------------------------- several devices

def resolve_devices(spec: str | torch.device | None = None) -> list[torch.device]:
    """The devices per-layer work is spread over: ``None``/``"auto"`` -> every visible CUDA device
    (``[cpu]`` without CUDA); ``"cuda:0,cuda:2"`` -> those; one device (``cuda`` = the current
    one) -> ``[it]``. Each is checked as :func:`resolve_device` checks it; repeats are a UsageError."""
    if spec is None or spec == "auto":
        if not torch.cuda.is_available():
            return [torch.device("cpu")]
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if isinstance(spec, torch.device) or "," not in spec:
        return [resolve_device(spec)]
    devices = [resolve_device(s.strip()) for s in spec.split(",") if s.strip()]
    if len({str(d) for d in devices}) != len(devices):
        raise UsageError(f"--device {spec}: a device is named twice")
    return devices


def layer_placement(layers: Sequence[int], devices: Sequence[torch.device]) -> dict[int, torch.device]:
    """``{layer: device}``: ``layers`` (in the given order) cut into ``len(devices)`` contiguous
    blocks whose sizes differ by at most one, the first block on ``devices[0]`` and so on; the
    way accelerate spreads a model's decoder layers, so layer ``i``'s work lands where a model
    spread with ``--device-map auto`` holds layer ``i``."""
    if not devices:
        raise UsageError("no device to place layers on")
    n, k = len(layers), len(devices)
    return {layer: devices[j * k // n] for j, layer in enumerate(layers)} if n else {}


def device_label(devices: Sequence[torch.device]) -> str:
    """``"cuda:0"`` or ``"cuda:0,cuda:1"``: how reports name where layers ran."""
    return ",".join(str(d) for d in devices)


def device_guard(device: torch.device | None):
    """A context with CUDA ``device`` current (Triton kernels and CUDA extensions launch on the
    current device, whatever device their tensors are on); a no-op for the CPU, for ``None`` and
    when ``device`` is current already (no device switch per attention call on one GPU)."""
    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)




def run_per_device(work: Callable[[int, torch.device], T], placement: Mapping[int, torch.device],
                   on_done: Callable[[int], None] | None = None) -> dict[int, T]:
    """``{layer: work(layer, device)}`` for every layer of ``placement``, the layers of one device
    one after another in a thread of their own (with that device current, as Triton and CUDA
    extensions launch on the current device), the devices at once.

    Each device's first layer runs alone, one device after another, before the threads start, so
    kernels compile and extensions load once per device without racing. ``on_done(layer)`` is
    called from the calling thread as layers finish (progress). The first exception stops the
    devices' remaining layers and is raised. Results are in ``placement``'s order."""
    order = list(placement)
    results: dict[int, T] = {}
    firsts: dict[str, int] = {}
    for layer in order:
        firsts.setdefault(str(placement[layer]), layer)
    for layer in firsts.values():
        with device_guard(placement[layer]):
            results[layer] = work(layer, placement[layer])
        if on_done is not None:
            on_done(layer)
    rest = [layer for layer in order if layer not in results]
    queues: dict[str, list[int]] = {}
    for layer in rest:
        queues.setdefault(str(placement[layer]), []).append(layer)
    if len(queues) <= 1:  # one device: no thread
        for layer in rest:
            with device_guard(placement[layer]):
                results[layer] = work(layer, placement[layer])
            if on_done is not None:
                on_done(layer)
        return {i: results[i] for i in order}
    stop = threading.Event()
    done: "queue.Queue[tuple[int, T | None, BaseException | None]]" = queue.Queue()

    def worker(layers: list[int]) -> None:
        for layer in layers:
            if stop.is_set():
                return
            try:
                with device_guard(placement[layer]):
                    out = work(layer, placement[layer])
            except BaseException as exc:  # handed to the calling thread, which raises it
                stop.set()
                done.put((layer, None, exc))
                return
            done.put((layer, out, None))

    threads = [threading.Thread(target=worker, args=(layers,), daemon=True) for layers in queues.values()]
    for t in threads:
        t.start()
    error: BaseException | None = None
    try:
        for _ in range(len(rest)):
            layer, out, exc = done.get()
            if exc is not None:
                error = exc
                break
            results[layer] = out  # type: ignore[assignment]
            if on_done is not None:
                on_done(layer)
    except BaseException:  # Ctrl-C in the calling thread: let the workers stop after their layer
        stop.set()
        raise
    finally:
        if error is not None:
            stop.set()
        for t in threads:
            t.join()
    if error is not None:
        raise error
    return {i: results[i] for i in order}
