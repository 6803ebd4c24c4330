"""The sample capture shipped inside the package, and its name ``sample:``.

``kvtool/data/smollm2-sample.safetensors``: a real capture of the embedded SmolLM2-135M-Instruct
(512 tokens, layers 0, 7, 15, 23, keys/values/queries/hidden in float16; see samples/README.md).
Every command and :mod:`kvtool`'s Python API accept the literal name ``sample:`` for it, so examples
work from any folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SAMPLE_NAME = "sample:"
SAMPLE_PATH = Path(__file__).resolve().parents[1] / "data" / "smollm2-sample.safetensors"


def resolve_sample(path: Any) -> Any:
    """``path`` itself, or the bundled sample's path when ``path`` is the name ``sample:``."""
    if isinstance(path, (str, Path)) and str(path) == SAMPLE_NAME:
        return SAMPLE_PATH
    return path
