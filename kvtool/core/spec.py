"""The ``NAME:key=value,...`` spec syntax shared by formats, eviction policies and pruning steps."""

from __future__ import annotations

from typing import Any

from kvtool.core.errors import UsageError
from kvtool.core.names import unalias


def _key(name: str) -> str:
    return name.strip().replace("-", "_")


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"quant:bits=4,group=32"`` -> ``("quant", {"bits": "4", "group": "32"})``. A parameter given
    twice (``quant:bits=4,bits=2``, or ``key-sparsity`` and ``key_sparsity``) is a UsageError: which
    one was meant is not for kvtool to guess. A name of :data:`kvtool.core.names.FORMAT_ALIASES`
    comes back as the format it stands for (``"kivi:bits=2"`` -> ``("quant", {"scheme": "kivi", "bits": "2"})``)."""
    name, _, rest = spec.partition(":")
    values: dict[str, str] = {}
    spelled: dict[str, str] = {}  # the canonical name (_key) -> the spelling given: one lookup per parameter
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(f"cannot read {_short(item)!r} in {_short(spec)!r}: write name=value")
        key = key.strip()
        twin = spelled.get(_key(key))
        if twin is not None:
            raise UsageError(f"{_short(name.strip())}: parameter {_short(key)!r} is given twice in {_short(spec)!r} "
                             f"({_short(values[twin])} and {_short(value.strip())}); give it once")
        spelled[_key(key)] = key
        values[key] = value.strip()
    return unalias(name.strip(), values, spec)


def _short(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters for a message (a spec may be a whole plan's)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _same(a: Any, b: Any) -> bool:
    if str(a).strip() == str(b).strip():
        return True
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def merge_options(name: str, values: dict[str, Any], options: dict[str, Any], where: str = "--format") -> dict[str, Any]:
    """``values`` (from a spec) with ``options`` (given apart, ``--bits 2``) added; a parameter given
    both ways with different values (``--format quant:bits=4 --bits 2``) is a UsageError."""
    merged = dict(values)
    for key, value in options.items():
        if value is None:
            continue
        twin = next((k for k in values if _key(k) == _key(key)), None)
        if twin is not None:
            if not _same(values[twin], value):
                flag = "--" + _key(key).replace("_", "-")
                raise UsageError(f"{name}: {twin}={values[twin]} in {where} contradicts {flag} {value}; give the parameter once")
            continue
        merged[key] = value
    return merged
