"""The ``NAME:key=value,...`` spec syntax shared by formats, eviction policies and pruning steps."""

from __future__ import annotations

from kvtool.core.errors import UsageError


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"quant:bits=4,group=32"`` -> ``("quant", {"bits": "4", "group": "32"})``."""
    name, _, rest = spec.partition(":")
    values: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(f"cannot read {item!r} in {spec!r}: write name=value")
        values[key.strip()] = value.strip()
    return name.strip(), values
