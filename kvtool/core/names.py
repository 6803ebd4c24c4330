"""Names people type for the same thing: dtype spellings (``fp16`` and ``float16`` alike), and the
keys of kvtool's results (one name per quantity; the renamed ones and how old files are read)."""

from __future__ import annotations

import warnings
from typing import Any

from kvtool.core.errors import UsageError

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


# ----------------------------------------------------------------------------- result keys
# The JSON vocabulary (docs/cli.md, Glossary): one name per quantity in every --json object, every file
# kvtool writes and every Python result. OUTPUT_SCHEMA_VERSION counts changes of that vocabulary; the keys
# renamed by its last change are RENAMED_KEYS (old -> new): readers of kvtool's own files accept the old
# key for one version with a FutureWarning (:func:`upgrade_keys`), and so does ``Result["old"]``.
OUTPUT_SCHEMA_VERSION = 2
RENAMED_KEYS = {
    "compressed_bytes": "stored_bytes",      # compress / info layers and totals, CompressedCache.byte_report()
    "stored_ratio": "storage_ratio",         # tasks files and --json, recommend's model-check cases, report budgets
    "stored_max": "storage_ratio_max",       # tasks.json / tasks.csv cells
    "new_tokens": "new_token_ids",           # generate: the generated token ids (a list per sequence)
    "generated_dense": "generated_dense_ids",  # verify --generate: greedy token ids of the dense run
    "generated_lossy": "generated_lossy_ids",  # verify --generate: greedy token ids of the compressed run
    "exact_bytes": "exact_stored_bytes",     # plan files' "predicted" block
    "exact_ratio": "exact_storage_ratio",    # plan files' "predicted" block
}


def renamed_key(key: str) -> str:
    """The current name of ``key`` (itself unless it is a renamed one)."""
    return RENAMED_KEYS.get(key, key)


def upgrade_keys(obj: Any, where: str = "") -> Any:
    """``obj`` (JSON data kvtool wrote: dicts and lists, any depth) with every old key of
    :data:`RENAMED_KEYS` under its current name, and one FutureWarning naming them when any was found;
    a key whose new name is present too is dropped (the new one wins)."""
    found: set[str] = set()
    out = _upgrade(obj, found)
    if found:
        names = ", ".join(f"{k} -> {RENAMED_KEYS[k]}" for k in sorted(found))
        warnings.warn(f"{where or 'data'} uses keys renamed in kvtool's output schema {OUTPUT_SCHEMA_VERSION} ({names}); "
                      "the old names are read until the next version", FutureWarning, stacklevel=2)
    return out


def _upgrade(obj: Any, found: set[str]) -> Any:
    if isinstance(obj, list):
        return [_upgrade(v, found) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out: dict[str, Any] = {}
    for key, value in obj.items():
        new = RENAMED_KEYS.get(key) if isinstance(key, str) else None
        if new is not None:
            found.add(key)
            if new in obj:
                continue
            key = new
        out[key] = _upgrade(value, found)
    return out


# ----------------------------------------------------------------------------- method names
# Names for a way to compress that are not registered formats: each stands for a registered format with
# some parameters fixed (the format registry stays the one list of formats). ``kivi`` is the quant
# format's KIVI scheme; ``kivi4`` / ``kivi2`` are the KIVI settings the task families and presses store
# tokens with (groups of 32, the partial group quantised, no full-precision residual).
FORMAT_ALIASES: dict[str, tuple[str, dict[str, str]]] = {
    "kivi": ("quant", {"scheme": "kivi"}),
    "kivi4": ("quant", {"scheme": "kivi", "bits": "4", "group": "32", "residual": "0", "partial": "true"}),
    "kivi2": ("quant", {"scheme": "kivi", "bits": "2", "group": "32", "residual": "0", "partial": "true"}),
}


def unalias(name: str, values: dict[str, str], spec: str = "") -> tuple[str, dict[str, str]]:
    """``("kivi", {"bits": "2"})`` -> ``("quant", {"scheme": "kivi", "bits": "2"})``; other names come
    back as given. An alias fixes its parameters: giving one of them another value is a UsageError."""
    if name not in FORMAT_ALIASES:
        return name, values
    base, fixed = FORMAT_ALIASES[name]
    for key, value in values.items():
        k = key.strip().replace("-", "_")
        if k in fixed and str(value).strip().lower() != fixed[k]:
            text = ",".join(f"{a}={b}" for a, b in fixed.items())
            raise UsageError(f"{spec or name}: {name} is {base}:{text}; {k}={value} contradicts it (name {base} to choose {k})")
    return base, {**fixed, **{k: v for k, v in values.items() if k.strip().replace('-', '_') not in fixed}}


def closest(name: str, known: "list[str] | tuple[str, ...] | set[str]") -> str:
    """`` (did you mean 'quant'?)`` when a known name is close to ``name`` (difflib), else ``""``."""
    import difflib

    match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""
