"""Names and one-line summaries of the compression formats, for ``--help``, without importing them.

Importing the formats loads torch (seconds); ``kvtool compress --help`` only needs each format class's
``name`` and ``summary``, which are string literals in its module. This reads them from the source
of every module in the ``kvtool.formats`` folder (the same modules :func:`kvtool.formats.base.load_all`
imports); tests/test_cli.py checks that both agree.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

FORMATS_DIR = Path(__file__).resolve().parents[1] / "formats"
SUITES_DIR = Path(__file__).resolve().parents[1] / "bench" / "suites"


# a top-level class, and a class attribute assigned a one-line string literal (parsing whole modules
# with ast takes a third of a second; these two patterns take milliseconds)
CLASS = re.compile(r"^class \w+", re.M)
ATTRIBUTE = re.compile(r"^    (name|summary)\s*=\s*([\"'].*[\"'])\s*$", re.M)


def class_literals(block: str) -> dict[str, str]:
    """``name`` and ``summary`` string literals assigned in the body of one class's source."""
    found = {}
    for key, literal in ATTRIBUTE.findall(block):
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, str):
            found.setdefault(key, value)
    return found


@lru_cache(maxsize=1)
def format_summaries() -> dict[str, str]:
    """``{format name: summary}`` of every format class in the formats folder, sorted by name."""
    out: dict[str, str] = {}
    for path in sorted(FORMATS_DIR.glob("*.py")):
        if path.name.startswith("_") or path.stem == "base":
            continue
        text = path.read_text(encoding="utf-8")
        starts = [m.start() for m in CLASS.finditer(text)] + [len(text)]
        for a, b in zip(starts, starts[1:]):
            lit = class_literals(text[a:b])
            if "name" in lit and "summary" in lit:
                out[lit["name"]] = lit["summary"]
    return dict(sorted(out.items()))


@lru_cache(maxsize=1)
def bench_suite_summaries() -> dict[str, str]:
    """``{suite name: summary}`` from the ``@register_suite(name, baselines, summary, example)``
    decorators of the bench suites' modules (for ``kvtool bench --help``; only that help parses them)."""
    out: dict[str, str] = {}
    for path in sorted(SUITES_DIR.glob("*.py")):
        if path.name.startswith("_") or path.stem == "common":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_suite" and len(node.args) >= 3
                    and all(isinstance(a, ast.Constant) for a in (node.args[0], node.args[2]))):
                out[node.args[0].value] = node.args[2].value
    return out


SHAPES_FILE = Path(__file__).resolve().parents[1] / "hf" / "shapes.py"
SHAPE = re.compile(r"""LlamaShape\(\s*["']([\w.-]+)["']""")


@lru_cache(maxsize=1)
def model_shape_names() -> tuple[str, ...]:
    """The named model shapes of :data:`kvtool.hf.shapes.SHAPES` (``--model random:NAME``), read from
    the source (shell completion must not import torch); tests/test_cli.py checks both agree."""
    return tuple(SHAPE.findall(SHAPES_FILE.read_text(encoding="utf-8")))


@lru_cache(maxsize=1)
def bench_suite_catalog() -> dict[str, tuple[str, str]] | None:
    """``{suite name: (summary, example)}`` from the same decorators, so that ``kvtool bench SUITE
    --help`` is built without importing the suites (torch, the kernels); None when a decorator's
    summary or example is not a plain string (the caller then imports the suites)."""
    out: dict[str, tuple[str, str]] = {}
    for path in sorted(SUITES_DIR.glob("*.py")):
        if path.name.startswith("_") or path.stem == "common":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_suite":
                args = list(node.args) + [kw.value for kw in node.keywords if kw.arg in ("summary", "example")]
                if len(args) < 4 or not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in (args[0], args[2], args[3])):
                    return None
                out[args[0].value] = (args[2].value, args[3].value)
    return out
