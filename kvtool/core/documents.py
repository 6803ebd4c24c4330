"""The JSON documents kvtool writes and reads back: bench results (``kvtool bench -o FILE``, read
by ``bench report`` and ``report --bench``) and eval results (``eval.json``, read by ``report
--eval`` and by ``eval`` when it resumes).

A reader checks a document's shape here before it uses any field, so a malformed, truncated or
hand-edited file is one BadDataError naming the file and the field, never a KeyError or TypeError
deep inside a table or a figure. Files are read with :func:`kvtool.core.limits.read_json_input`
(regular files, bounded size and nesting, no NaN)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtool.core.errors import BadDataError, KvtoolError
from kvtool.core.limits import read_json_input

NUMBER = (int, float)

# bench: the fields the tables, figures and environment line read
BENCH_VERSIONS = ("torch", "triton", "cuda", "flashinfer")
BENCH_RECORD_TEXT = ("kernel", "provider", "status")
BENCH_RECORD_INTS = ("batch", "seq")
BENCH_RECORD_NUMBERS = ("median_us", "p10_us", "p90_us", "bandwidth_gbps", "bandwidth_fraction", "rel_err", "floor_us", "sparsity", "budget", "k")
BENCH_TIMED = ("p10_us", "p90_us", "bandwidth_gbps")  # numbers wherever median_us is one

# eval points: the fields the report, the frontier and a resumed run read, by type
EVAL_TEXT = ("key", "capture", "label", "comparison", "format", "params_text", "spec", "skipped", "backend")
EVAL_NUMBERS = ("storage_ratio", "traffic_ratio", "rel_l2", "cosine", "max_abs", "recall", "agreement", "nll_increase", "ppl_ratio", "kl", "seconds")
# where each measured number of an eval point can lie (a resumed point outside it did not come from kvtool);
# sizes and errors are finite and at most 1e6 (1e6 x the dense bytes, a relative error of a million)
EVAL_RANGES = {"recall": (0.0, 1.0), "agreement": (0.0, 1.0), "cosine": (-1.0, 1.0)}
EVAL_LIMIT = 1e6


def _fail(where: str, what: str, kind: str) -> BadDataError:
    return BadDataError(f"{where}: not a kvtool {kind} JSON file ({what})")


def _number(value: Any) -> bool:
    return isinstance(value, NUMBER) and not isinstance(value, bool)


def check_bench_document(doc: Any, where: str, tables: bool = True) -> dict[str, Any]:
    """``doc`` if it is a bench result document (``subcommand``, ``env`` with ``device`` and
    ``versions``, ``records`` each with the fields the tables use); BadDataError naming the first
    field that is missing or of the wrong type. Optional fields absent from an older or hand-made
    file are filled with null. ``tables=False`` (``report --bench``, which draws medians only): the
    versions and each timed record's spread and bandwidth may be absent too."""
    if not isinstance(doc, dict):
        raise _fail(where, "not an object", "bench")
    for key in ("subcommand", "env", "records"):
        if key not in doc:
            raise _fail(where, f"no {key}", "bench")
    if not isinstance(doc["subcommand"], str):
        raise _fail(where, "subcommand is not text", "bench")
    env = doc["env"]
    if not isinstance(env, dict) or not isinstance(env.get("device"), str):
        raise _fail(where, "env.device is missing", "bench")
    versions = env.setdefault("versions", None if tables else {})
    if not isinstance(versions, dict):
        raise _fail(where, "env.versions is missing", "bench")
    for name in BENCH_VERSIONS:
        versions.setdefault(name, None)
        if versions[name] is not None and not isinstance(versions[name], str):
            raise _fail(where, f"env.versions.{name} is not text", "bench")
    for key in ("copy_gbps", "read_gbps"):
        env.setdefault(key, None)
        if env[key] is not None and not _number(env[key]):
            raise _fail(where, f"env.{key} is not a number", "bench")
    env.setdefault("cold_l2", False)
    env.setdefault("timing_valid", True)
    env.setdefault("notes", [])
    if not isinstance(env["notes"], list) or not all(isinstance(n, str) for n in env["notes"]):
        raise _fail(where, "env.notes is not a list of text", "bench")
    for key in ("primary_baselines",):
        doc.setdefault(key, [])
        if not isinstance(doc[key], list) or not all(isinstance(n, str) for n in doc[key]):
            raise _fail(where, f"{key} is not a list of names", "bench")
    for key in ("command", "date", "commit"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise _fail(where, f"{key} is not text", "bench")
    records = doc["records"]
    if not isinstance(records, list):
        raise _fail(where, "records is not a list", "bench")
    for n, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise _fail(where, f"records[{n}] is not an object", "bench")
        for key in BENCH_RECORD_TEXT:
            if not isinstance(rec.get(key), str):
                raise _fail(where, f"records[{n}].{key} is missing or not text", "bench")
        for key in BENCH_RECORD_INTS:
            if not isinstance(rec.get(key), int) or isinstance(rec.get(key), bool):
                raise _fail(where, f"records[{n}].{key} is missing or not an integer", "bench")
        for key in BENCH_RECORD_NUMBERS:
            rec.setdefault(key, None)
            if rec[key] is not None and not _number(rec[key]):
                raise _fail(where, f"records[{n}].{key} is not a number", "bench")
        if tables and rec["median_us"] is not None and not all(_number(rec.get(key)) for key in BENCH_TIMED):
            raise _fail(where, f"records[{n}] has a median but not {', '.join(BENCH_TIMED)}", "bench")
        rec.setdefault("speedup", {})
        if not isinstance(rec["speedup"], dict) or not all(v is None or isinstance(v, (str, *NUMBER)) for v in rec["speedup"].values()):
            raise _fail(where, f"records[{n}].speedup is not a map of numbers", "bench")
    return doc


def read_bench_document(path: str | Path, what: str | None = None, tables: bool = True) -> dict[str, Any]:
    """A bench result file, read and checked (:func:`check_bench_document`)."""
    where = what or str(path)
    return check_bench_document(read_json_input(path, where), where, tables)


def check_eval_points(doc: Any, where: str, error: type[KvtoolError] = BadDataError) -> list[dict[str, Any]]:
    """The ``points`` of an eval result document: each an object with a ``format``; its text fields
    text (or null), its ratios and metrics numbers (or null) in their range (:data:`EVAL_RANGES`,
    else within +-:data:`EVAL_LIMIT`: a frontier cannot be drawn through 1e308), ``params`` an
    object. ``error`` naming ``where`` otherwise."""
    if not isinstance(doc, dict) or not isinstance(doc.get("points"), list):
        raise error(f"{where}: not a kvtool eval result (no list of points)")
    for n, point in enumerate(doc["points"]):
        if not isinstance(point, dict) or not isinstance(point.get("format"), str):
            raise error(f"{where}: not a kvtool eval result (point {n} has no format)")
        for key, value in point.items():
            if key in EVAL_TEXT:
                ok = value is None or isinstance(value, str)
            elif key in EVAL_NUMBERS:
                lo, hi = EVAL_RANGES.get(key, (-EVAL_LIMIT, EVAL_LIMIT))
                ok = value is None or (isinstance(value, NUMBER) and not isinstance(value, bool) and lo <= value <= hi)
            else:
                ok = key != "params" or isinstance(value, dict)
            if not ok:
                what = f"{value!r} is out of range" if isinstance(value, NUMBER) and not isinstance(value, bool) else f"is {type(value).__name__}"
                raise error(f"{where}: not a kvtool eval result (point {n}: {key} {what})")
    return doc["points"]
