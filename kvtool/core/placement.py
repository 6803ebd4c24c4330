"""Where commands compute: ``--device`` (default: CUDA when present, else the CPU).

The device is where a capture's layers are placed one at a time (:func:`kvtool.core.streaming.open_capture`),
where formats encode and the torch references run; ``--backend`` stays the choice between a
format's Triton kernel and its plain-torch reference."""

from __future__ import annotations

import torch

from kvtool.core.errors import UsageError

DEVICE_HELP = "Where layers are computed: cpu, cuda, cuda:1 (default: cuda when present, else cpu)."


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
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got {spec!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got {spec!r}")
    return device
