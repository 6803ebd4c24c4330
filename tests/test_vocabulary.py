"""One name per quantity: the JSON schema and every writer against the glossary of docs/cli.md.

The rules (docs/cli.md, Glossary): ``bytes`` / ``*_bytes`` are integers; shares are ``*_ratio`` (or
``kept_of_dense``) fractions; counts are integers named ``*_tokens``, ``*_count`` or ``num_*``; lists of
token ids are ``*_ids``, and other lists of integers are lists of layer, head or channel numbers named
for what they hold. No key renamed in the current output schema (``RENAMED_KEYS``) is written anywhere.
Every command's ``--json`` object is validated against the schema in tests/test_cli_contract.py, so
walking the schema here covers the commands; the files (tasks folders, eval CSVs, plans, bench JSON,
byte reports) are walked by value.
"""

from __future__ import annotations

import csv
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from kvtool.core.names import OUTPUT_SCHEMA_VERSION, RENAMED_KEYS, upgrade_keys
from kvtool.core.schema import output_schema

ROOT = Path(__file__).resolve().parents[1]
# lists of integers that are not token ids: layer / head / channel numbers and shapes, named for what they hold
POSITION_LISTS = {"heads", "selected_kv_heads", "persistent", "shape", "seq_lens", "lengths"}
# documents of their own (docs/cli.md): kept as stored, exempt from the naming rules
EXEMPT = {"metadata", "plan"}


def _types(node: dict[str, Any]) -> set[str]:
    t = node.get("type")
    return set(t if isinstance(t, list) else [t]) - {None}


def _int_list(node: dict[str, Any]) -> bool:
    """An array of integers, or of arrays of integers."""
    items = node.get("items") if "array" in _types(node) else None
    if not isinstance(items, dict):
        return False
    return "integer" in _types(items) or _int_list(items)


def _counts_by_case(node: dict[str, Any]) -> bool:
    """An object of integer counts (``score_tokens``: tokens scored per case)."""
    props = node.get("properties") or {}
    return _types(node) == {"object"} and bool(props) and all(_types(p) <= {"integer"} for p in props.values())


def schema_problems(node: Any, where: str = "$") -> list[str]:
    """Every property of the schema that breaks a naming rule, as ``path: problem``."""
    out: list[str] = []
    if isinstance(node, list):
        for i, item in enumerate(node):
            out += schema_problems(item, f"{where}[{i}]")
        return out
    if not isinstance(node, dict):
        return out
    for key, sub in (node.get("properties") or {}).items():
        if not isinstance(sub, dict):
            continue
        at = f"{where}.{key}"
        types = _types(sub)
        if key in RENAMED_KEYS:
            out.append(f"{at}: renamed to {RENAMED_KEYS[key]!r} (docs/cli.md, Glossary)")
        if (key == "bytes" or key.endswith("_bytes")) and types and not types <= {"integer", "null"}:
            out.append(f"{at}: bytes are integers, not {sorted(types)}")
        if re.search(r"(_tokens|_count)$|^num_", key) and types and not (types <= {"integer", "null"} or _counts_by_case(sub)):
            out.append(f"{at}: a count is an integer, not {sorted(types)}")
        if re.search(r"_ratio(_max)?$", key) and types and not types <= {"number", "null"}:
            out.append(f"{at}: a ratio is a number (a fraction), not {sorted(types)}")
        if key.endswith("_ids") and not _int_list(sub):
            out.append(f"{at}: *_ids is a list of integer ids")
        if _int_list(sub) and not (key.endswith("_ids") or key.endswith("_layers") or key in POSITION_LISTS):
            out.append(f"{at}: a list of integers: name token ids *_ids, positions for what they hold")
        if key not in EXEMPT:
            out += schema_problems(sub, at)
    for word, sub in node.items():
        if word != "properties" and isinstance(sub, (dict, list)):
            out += schema_problems(sub, f"{where}/{word}")
    return out


def value_problems(obj: Any, where: str = "$") -> list[str]:
    """The same rules on written data (any JSON-like value)."""
    out: list[str] = []
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            out += value_problems(item, f"{where}[{i}]")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            at = f"{where}.{key}"
            if not isinstance(key, str) or key in EXEMPT:
                continue
            if key in RENAMED_KEYS:
                out.append(f"{at}: renamed to {RENAMED_KEYS[key]!r}")
            if (key == "bytes" or key.endswith("_bytes")) and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                out.append(f"{at}: bytes are integers, not {value!r}")
            if re.search(r"(_tokens|_count)$|^num_", key) and value is not None and not isinstance(value, (int, list, dict)):
                out.append(f"{at}: a count is an integer, not {value!r}")
            if key.endswith("_ids") and not isinstance(value, list):
                out.append(f"{at}: *_ids is a list of ids, not {value!r}")
            out += value_problems(value, at)
    return out


def column_problems(columns: list[str] | tuple[str, ...], where: str) -> list[str]:
    """The rules a CSV header or a record's field list can break: renamed names."""
    return [f"{where}: column {c!r} is now {RENAMED_KEYS[c]!r}" for c in columns if c in RENAMED_KEYS]


# ----------------------------------------------------------------------------- the schema and the glossary


def test_the_schema_follows_the_glossary():
    assert schema_problems(output_schema()) == []


def test_the_rules_catch_what_they_forbid():
    bad = {"properties": {"x": {"type": "object", "properties": {
        "compressed_bytes": {"type": "integer"}, "stored_bytes": {"type": "number"}, "prompt_tokens": {"type": "number"},
        "new_token_ids": {"type": "integer"}, "new_tokens": {"type": "array", "items": {"type": "integer"}}}}}}
    found = "\n".join(schema_problems(bad))
    for key in ("compressed_bytes", "stored_bytes", "prompt_tokens", "new_token_ids", "new_tokens"):
        assert f".{key}:" in found, (key, found)
    assert len(value_problems({"a": [{"stored_bytes": 1.5, "stored_ratio": 0.1, "cached_tokens": "3", "x_ids": 4}]})) == 4


def test_renamed_keys_are_the_documented_ones_and_the_schema_version_is_named():
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text[text.index("Renamed in output schema"):]
    table = re.findall(r"^\| `(\w+)` \| `(\w+)` \|", section[: section.index("\n\n", section.index("| old |"))], flags=re.M)
    assert dict(table) == RENAMED_KEYS
    assert f"output schema version {OUTPUT_SCHEMA_VERSION}" in output_schema()["$comment"]
    assert f"Renamed in output schema {OUTPUT_SCHEMA_VERSION}" in text
    # no renamed key is mentioned as current anywhere in the docs' command tables or the README
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        body = doc.read_text(encoding="utf-8")
        if doc.name == "cli.md":  # the renamed-keys table names them, as old names
            body = body[: body.index("Renamed in output schema")] + body[body.index("- A value appears once"):]
        for old in RENAMED_KEYS:
            assert not re.search(rf"[`\"']{old}[`\"']", body), f"{doc.name} still names {old!r}"


# ----------------------------------------------------------------------------- the writers


def _task_rows() -> list[dict[str, Any]]:
    rows = []
    for i in range(2):
        for setting, method, budget, ok, stored in (("dense", "dense", None, True, 1.0), ("kivi @ 25%", "kivi", 0.25, i == 0, 0.248)):
            rows.append({"sample": f"niah_single:400:0:{i}", "task": "niah_single", "length": 400, "setting": setting, "method": method,
                         "budget": budget, "correct": ok, "part": float(ok), "storage_ratio": stored, "spec": method})
    return rows


def test_tasks_folder_files(tmp_path):
    from kvtool.analysis import taskrun

    summary = taskrun.summarize(_task_rows())
    files = taskrun.write_outputs(summary, tmp_path)
    data = json.loads(Path(files["json"]).read_text())
    assert value_problems(data) == []
    assert {"storage_ratio", "storage_ratio_max"} <= set(data["cells"][0])
    with open(files["csv"], newline="") as fh:
        header = next(csv.reader(fh))
    assert column_problems(header, "tasks.csv") == [] and "storage_ratio" in header
    assert value_problems(_task_rows()) == []  # samples.jsonl rows


def test_old_tasks_files_stay_readable(tmp_path):
    """A tasks folder of schema 1 (``stored_ratio``, ``stored_max``) is read with a FutureWarning."""
    from kvtool.analysis import taskrun
    from kvtool.analysis.html_report import read_tasks

    summary = taskrun.summarize(_task_rows())
    old = json.loads(json.dumps(summary).replace('"storage_ratio_max"', '"stored_max"').replace('"storage_ratio"', '"stored_ratio"'))
    (tmp_path / "tasks.json").write_text(json.dumps(old))
    with pytest.warns(FutureWarning, match="stored_ratio -> storage_ratio"):
        back = read_tasks(tmp_path)
    assert back["cells"] == json.loads(json.dumps(summary["cells"]))
    rows = [json.loads(json.dumps(r).replace('"storage_ratio"', '"stored_ratio"')) for r in _task_rows()]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(FutureWarning):
        assert taskrun.read_rows(tmp_path / "samples.jsonl") == _task_rows()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert upgrade_keys(_task_rows()) == _task_rows()  # current data: no warning


def test_eval_csv_and_bench_record_fields():
    from kvtool.analysis.evaluate import CSV_FIELDS
    from kvtool.bench.harness import RECORD_FIELDS
    from kvtool.bench.suites.decode import EXTRA_FIELDS

    assert column_problems(CSV_FIELDS, "eval CSV") == []
    assert column_problems(RECORD_FIELDS + EXTRA_FIELDS, "bench record") == []


def test_shipped_bench_plan_and_tasks_files():
    """The measured files under docs/benchmarks (bench JSON, plans, tasks summaries) use the current names."""
    found = []
    for path in sorted((ROOT / "docs" / "benchmarks").glob("*.json")):
        found += value_problems(json.loads(path.read_text(encoding="utf-8")), path.name)
        if path.name.startswith(("tasks", "decode-plan")):
            found += value_problems(json.loads(path.read_text(encoding="utf-8")).get("predicted", {}), f"{path.name} predicted")
    for path in sorted((ROOT / "docs" / "benchmarks").glob("*.csv")):
        found += column_problems(path.read_text(encoding="utf-8").splitlines()[0].split(","), path.name)
    assert found == []


def test_byte_report_plan_and_results(tmp_path):
    """CompressedCache.byte_report(), a recommend plan's ``predicted`` block and CompressResult."""
    import kvtool
    from kvtool.analysis.allocation import Sensitivity, predicted, uniform_options
    from kvtool.formats.plan import Plan

    from kvtool.core import io
    from kvtool.formats.base import compress_cache
    from kvtool.formats.mixed import resolve_spec

    r = kvtool.compress("sample:", "quant:bits=4", tmp_path / "q.safetensors", layers="7")
    assert value_problems(r.to_dict()) == []
    assert isinstance(r.stored_bytes, int) and r.stored_bytes == r["stored_bytes"]
    with pytest.warns(FutureWarning):
        assert r.compressed_bytes == r.stored_bytes
    with pytest.warns(FutureWarning):
        assert r["compressed_bytes"] == r.stored_bytes
    cache = io.load(kvtool.sample_path(), layers=[7])
    rep = compress_cache(cache, *resolve_spec("quant:bits=4")).byte_report()
    assert value_problems(rep) == [] and set(rep) == {"parts", "stored_bytes", "dense_bytes", "storage_ratio"}

    import torch

    sens = Sensitivity([(0, None), (1, None)], ["dense", "quant:bits=4"], torch.tensor([[100.0, 25.5], [100.0, 25.5]], dtype=torch.float64),
                       torch.tensor([[0.0, 1.0], [0.0, 2.0]], dtype=torch.float64), 200, 16, 4)
    pred = predicted(sens, [1, 0])
    assert pred["stored_bytes"] == 126 and pred["storage_ratio"] == pytest.approx(125.5 / 200)
    shares = Sensitivity(sens.groups, sens.specs, sens.bytes / 200, sens.loss, 1, 16, 4, calibrate="tasks")
    assert "stored_bytes" not in predicted(shares, [1, 0])  # shares of the dense bytes are not bytes
    plan = Plan({0: ["quant:bits=4"]}, default="dense", extra={"predicted": pred, "uniform": uniform_options(sens)})
    assert value_problems({k: v for k, v in plan.to_dict().items() if k != "layers"}) == []


def test_result_fields_are_named_as_their_json_keys():
    """A typed field of a Python result reads the JSON key of its own name (or a dotted path ending in it)."""
    from dataclasses import fields

    import kvtool.api as api

    for cls in vars(api).values():
        if isinstance(cls, type) and issubclass(cls, api.Result) and cls is not api.Result:
            for f in fields(cls):
                key = f.metadata.get("key", f.name)
                if f.name not in api._BASE and f.name != "compressed":
                    assert key.split(".")[-1] == f.name or key.endswith(f".{f.name}"), (cls.__name__, f.name, key)
