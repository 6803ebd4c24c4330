"""One colour per format across every kvtool figure (frontier plots, reports): a format's colour
depends only on its name, so the same format looks the same in every picture."""

from __future__ import annotations

# Okabe-Ito-like qualitative colours, distinguishable in print and by most colour-blind readers.
FORMAT_COLORS: dict[str, str] = {
    "dense": "#000000",
    "quant": "#0072B2",
    "bitmap": "#E69F00",
    "bitmapq": "#D55E00",
    "signvq": "#009E73",
    "pagestat": "#CC79A7",
    "snapstream": "#56B4E9",
    "pipeline": "#7F3C8D",
    "mixed": "#C00000",
    "heads": "#999933",
}
_SPARE = ("#882255", "#44AA99", "#332288", "#AA4499", "#117733", "#888888")


def format_color(name: str) -> str:
    """The colour of format ``name`` (a stable spare colour for formats not listed)."""
    if name in FORMAT_COLORS:
        return FORMAT_COLORS[name]
    return _SPARE[sum(map(ord, name)) % len(_SPARE)]


def spec_format(spec: str) -> str:
    """The format a spec is stored as: ``snapkv:budget=256+quant:bits=4`` -> ``pipeline``,
    ``quant:bits=2`` -> ``quant``."""
    return "pipeline" if "+" in spec else spec.partition(":")[0]
