"""JSON text of kvtool results: NaN/inf become null, tensors and paths plain values."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        return jsonable(obj.item())
    return obj


def to_json_text(data: Any) -> str:
    """``data`` as indented JSON text with a final newline (see :func:`jsonable`)."""
    return json.dumps(jsonable(data), indent=2) + "\n"
