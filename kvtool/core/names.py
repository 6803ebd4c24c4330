"""Names people type for the same thing: dtype spellings (``fp16`` and ``float16`` alike)."""

from __future__ import annotations

# every accepted spelling -> the canonical torch name
DTYPE_ALIASES = {
    "fp16": "float16", "float16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}


def canonical_dtype(name: str | None) -> str | None:
    """``"fp16"`` -> ``"float16"``, ``"BF16"`` -> ``"bfloat16"``; unknown names and None come back as
    given, for the caller's own check to refuse with its message."""
    if name is None:
        return None
    return DTYPE_ALIASES.get(name.strip().lower(), name)
