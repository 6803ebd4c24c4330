"""Fuzz: mutated files of every format (captures as `kvtool capture` streams them included, and mixed
files from plans) through info, decompress, verify and export; mutated plan files, bench JSON and
eval.json through the commands that read them.

Deterministic (seeded) and small enough for CI (about a minute on 2 cores). Every mutation of a
file's bytes must give exit 1 and one ``error:`` line from every command (checksums on); with
``--no-verify-checksums`` the structural checks alone must still give exit 0, 1 or 2 with one line:
never a traceback, a Python exception name, a hang or a signal. A mutated JSON input gives exit 0
(still valid) or one error line."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.core import io
from tests.conftest import synthetic_cache

runner = CliRunner()
SPECS = ["dense", "bitmap", "bitmapq", "quant", "quant:scheme=int8", "signvq", "snapstream:budget=40,recent=8,sinks=2,window=8", "pagestat:page_size=8,dense_window=8", "quant+evict=snapkv:budget=40,recent=8,sinks=2,window=8"]
PY_ERRORS = ("Traceback", "TypeError", "AttributeError", "RecursionError", "KeyError", "ValueError", "IndexError", "RuntimeError", "OverflowError", "ZeroDivisionError")
SECONDS_PER_RUN = 20


def _spec_args(spec: str) -> list[str]:
    if "+evict=" in spec:
        fmt, evict = spec.split("+evict=")
        return ["--format", fmt, "--evict", evict]
    return ["--format", spec]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A capture, one compressed file per format and a paged export, all small."""
    folder = tmp_path_factory.mktemp("fuzz")
    cap = folder / "cap.safetensors"
    io.save(synthetic_cache(tokens=80, head_dim=32, heads=4, kv_heads=2, layers=(0, 1)), cap)
    out = {"capture": cap}
    for n, spec in enumerate(SPECS):
        path = folder / f"c{n}.safetensors"
        res = runner.invoke(app, ["compress", str(cap), *_spec_args(spec), "--heldout", "16", "-o", str(path)])
        assert res.exit_code == 0, (spec, res.output)
        out[spec] = path
    paged = folder / "paged.safetensors"
    assert runner.invoke(app, ["export", str(cap), "--to", "paged", "-o", str(paged)]).exit_code == 0
    out["paged"] = paged
    return out


def mutations(data: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    """Truncations, bit flips in the header and the payload, a zeroed region, metadata of other
    JSON types. All differ from ``data``."""
    n = int.from_bytes(data[:8], "little")
    body = 8 + n
    out = [rng.choice([("truncate-1", data[:-1]), ("truncate-header", data[: 8 + n // 2]), ("truncate-half", data[: len(data) // 2])])]
    for k in range(2):
        at = rng.randrange(8, body)
        out.append((f"header-bit{k}", data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]))
    if len(data) > body:
        for k in range(2):
            at = rng.randrange(body, len(data))
            out.append((f"payload-bit{k}", data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]))
        a = rng.randrange(body, len(data))
        b = min(len(data), a + rng.randrange(1, 64))
        if any(data[a:b]):
            out.append(("zero-region", data[:a] + bytes(b - a) + data[b:]))
    choices = [(key, value) for key in ("kvtool.model", "kvtool.layers", "kvtool.info", "kvtool.layer_meta", "kvtool.paged")
               for value in ([1, 2], "text", 7, None, {"a": {}}) if key in json.loads(data[8:body]).get("__metadata__", {})]
    for key, value in rng.sample(choices, min(2, len(choices))):
        h = json.loads(data[8:body])
        h["__metadata__"][key] = json.dumps(value)
        text = json.dumps(h).encode()
        out.append((f"type-{key}-{type(value).__name__}", len(text).to_bytes(8, "little") + text + data[body:]))
    return [(name, m) for name, m in out if m != data]


def _commands(path: Path, cap: Path, out: Path, kind: str) -> list[list[str]]:
    if kind == "paged":  # paged files are read by info and by the table exports
        return [["info", str(path)], ["export", str(path), "--to", "json", "-o", str(out), "--force"]]
    cmds = [["info", str(path)], ["export", str(path), "--to", "paged", "-o", str(out), "--force"]]
    if kind != "capture":
        cmds += [["decompress", str(path), "-o", str(out), "--force"], ["verify", str(path), "--capture", str(cap), "--no-model", "--backend", "torch"]]
    else:
        cmds.append(["stats", str(path)])
    return cmds


def _alarm(signum, frame):
    raise TimeoutError("a kvtool command hung on a mutated file")


def _run(args: list[str]):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS_PER_RUN)
    try:
        return runner.invoke(app, ["-q", *args])  # progress lines off: the output is the result or one error line
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _check(res, args, label, codes):
    assert res.exit_code in codes, (label, args, res.exit_code, res.output)
    assert not isinstance(res.exception, TimeoutError), (label, args)
    assert not any(e in res.output for e in PY_ERRORS), (label, args, res.output)
    if res.exit_code:
        lines = [l for l in res.output.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), (label, args, res.output)


@pytest.mark.parametrize("kind", ["capture", *SPECS, "paged"])
def test_fuzz_mutated_files(files, kind, tmp_path):
    src = files[kind]
    cap = files["capture"]
    data = src.read_bytes()
    rng = random.Random(f"kvtool-fuzz-{kind}")
    intact = {tuple(args[:1]): _run(args).exit_code for args in _commands(src, cap, tmp_path / "o.safetensors", kind)}
    assert all(code in (0, 2) for code in intact.values()), (kind, intact)  # 2: a target the format cannot hold
    bad = tmp_path / "bad.safetensors"
    for label, mutated in mutations(data, rng):
        bad.write_bytes(mutated)
        commands = _commands(bad, cap, tmp_path / "o.safetensors", kind)
        for args in commands:
            _check(_run(args), args, label, {1})
        # the structural checks alone: the command that reads the most (verify for compressed files)
        _check(_run(["--no-verify-checksums", *commands[-1]]), commands[-1], label, {0, 1, 2})


# ----------------------------------------------------------------------------- the surfaces issue 34 added


def _streamed_capture(path: Path) -> Path:
    """A capture written as `kvtool capture` writes it (the streaming writer: padded header, CRCs
    combined from the blocks), from the synthetic cache, without loading a model."""
    from kvtool.core.streaming import StreamingWriter

    cache = synthetic_cache(tokens=80, head_dim=32, heads=4, kv_heads=2, layers=(0, 1))
    tensors = io.capture_tensors(cache)
    specs = [(name, t.dtype, list(t.shape), 2 if name.startswith("layers.") else 1) for name, t in tensors.items()]
    with io.atomic_path(path) as tmp, StreamingWriter(tmp, specs, io.capture_metadata(cache)) as writer:
        for name, t in tensors.items():
            axis = 2 if name.startswith("layers.") else 1
            for start in range(0, 80, 24):
                writer.write(name, start, t.narrow(axis, start, min(24, 80 - start)))
    return path


@pytest.fixture(scope="module")
def new_files(files, tmp_path_factory):
    """A streamed capture and a mixed file compressed with a plan (one spec per KV head on layer 0)."""
    folder = tmp_path_factory.mktemp("fuzz-new")
    streamed = _streamed_capture(folder / "streamed.safetensors")
    plan = folder / "plan.json"
    plan.write_text(json.dumps({"schema": "kvtool.plan", "version": 1, "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32},
                                "default": "dense", "layers": {"0": ["quant:bits=4", "snapstream:budget=40,recent=8,sinks=2,window=8"], "1": "bitmap"}}))
    mixed = folder / "mixed.safetensors"
    res = runner.invoke(app, ["compress", str(files["capture"]), "--plan", str(plan), "--heldout", "16", "-o", str(mixed)])
    assert res.exit_code == 0, res.output
    return {"streamed": streamed, "mixed": mixed, "plan": plan}


@pytest.mark.parametrize("kind", ["streamed", "mixed"])
def test_fuzz_streamed_captures_and_mixed_files(files, new_files, kind, tmp_path):
    src = new_files[kind]
    cap = files["capture"]
    data = src.read_bytes()
    rng = random.Random(f"kvtool-fuzz-{kind}")
    commands = _commands(src, cap, tmp_path / "o.safetensors", "capture" if kind == "streamed" else kind)
    assert all(_run(args).exit_code in (0, 2) for args in commands), kind
    bad = tmp_path / "bad.safetensors"
    for label, mutated in mutations(data, rng):
        bad.write_bytes(mutated)
        commands = _commands(bad, cap, tmp_path / "o.safetensors", "capture" if kind == "streamed" else kind)
        for args in commands:
            _check(_run(args), args, label, {1})
        _check(_run(["--no-verify-checksums", *commands[-1]]), commands[-1], label, {0, 1, 2})


ODD_VALUES = (None, "text", "", -1, 0, 10**30, 1e308, True, [], {}, [[[[]]]], {"a": None}, "quant:bits=4,bits=2", "\u202e", "x" * 3000)


def json_mutations(data, rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    """Seeded mutations of a JSON document: one node (any depth) replaced by a value of another type,
    a key deleted, the text truncated, a byte flipped, invalid UTF-8, deep nesting, NaN."""
    text = json.dumps(data)
    out: list[tuple[str, bytes]] = [("truncate", text[: len(text) // 2].encode()), ("not-utf8", text.encode()[:-3] + b"\xff\xfe}"),
                                    ("deep", ("[" * 50_000 + "]" * 50_000).encode()), ("nan", text.replace("1", "NaN", 1).encode()),
                                    ("big-number", text.replace("1", "1e999", 1).encode())]
    at = rng.randrange(len(text))
    out.append(("byte-flip", (text[:at] + chr(ord(text[at]) ^ 0x20) + text[at + 1:]).encode()))

    def nodes(obj, path=()):
        yield path
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from nodes(v, path + (k,))
        elif isinstance(obj, list):
            for n, v in enumerate(obj):
                yield from nodes(v, path + (n,))

    paths = [p for p in nodes(data) if p]
    for n in range(count):
        doc = json.loads(text)
        where = rng.choice(paths)
        parent = doc
        for step in where[:-1]:
            parent = parent[step]
        if rng.random() < 0.2 and isinstance(parent, dict):
            del parent[where[-1]]
            label = f"delete-{'.'.join(map(str, where))}"
        else:
            value = rng.choice(ODD_VALUES)
            parent[where[-1]] = value
            label = f"set-{'.'.join(map(str, where))}={str(value)[:12]!r}"
        out.append((label, json.dumps(doc).encode()))
    return out


def _check_json(res, args, label, codes):
    assert res.exit_code in codes, (label, args, res.exit_code, res.output)
    assert not any(e in res.output for e in PY_ERRORS), (label, args, res.output)
    if res.exit_code:
        lines = [l for l in res.output.splitlines() if l.strip()]
        assert [l for l in lines if l.startswith("error:")] == lines[-1:], (label, args, res.output)


def test_fuzz_plan_files(files, new_files, tmp_path):
    """Mutated plans through compress --plan: applied (0) or one line (1 or 2)."""
    rng = random.Random("kvtool-fuzz-plan")
    plan = tmp_path / "plan.json"
    for label, text in json_mutations(json.loads(new_files["plan"].read_text()), rng, 14):
        plan.write_bytes(text)
        args = ["compress", str(files["capture"]), "--plan", str(plan), "--heldout", "16", "-o", str(tmp_path / "o.safetensors"), "--force"]
        _check_json(_run(args), args, label, {0, 1, 2})


BENCH_DOC = {"kvtool_bench": 1, "subcommand": "attention", "date": "2026-11-26T00:00:00Z", "commit": "abc", "command": "kvtool bench attention",
             "env": {"device": "GPU", "versions": {"torch": "2.13.0", "triton": "3.6", "cuda": "13.0", "flashinfer": None}, "copy_gbps": 3000.0,
                     "read_gbps": 3300.0, "cold_l2": True, "timing_valid": True, "notes": ["n"]},
             "primary_baselines": ["sdpa"],
             "records": [{"kernel": "bitmap_attention", "provider": p, "batch": 8, "seq": 4096, "sparsity": s, "budget": None, "k": None,
                          "median_us": us, "p10_us": us * 0.9, "p90_us": us * 1.1, "floor_us": 1.0, "bandwidth_gbps": 100.0,
                          "bandwidth_fraction": 0.1, "rel_err": 1e-3, "status": "ok", "speedup": {"sdpa": 60.0 / us}}
                         for p, s, us in (("sdpa", None, 60.0), ("bitmap_triton", 0.7, 40.0))]}


def test_fuzz_bench_and_eval_json(files, tmp_path):
    """Mutated bench JSON through bench report and export --to csv, mutated eval.json through an eval
    that resumes from it: a result (0) or one line (1 or 2), never a Python error."""
    rng = random.Random("kvtool-fuzz-json")
    bench = tmp_path / "bench.json"
    for label, text in json_mutations(BENCH_DOC, rng, 12):
        bench.write_bytes(text)
        for args in (["bench", "report", str(bench)], ["bench", "report", str(bench), "--summary"]):
            _check_json(_run(args), args, label, {0, 1})
    out = tmp_path / "ev"
    args = ["eval", str(files["capture"]), "--formats", "quant:bits=4", "--no-model", "--heldout", "16", "--out-dir", str(out)]
    assert _run(args).exit_code == 0
    good = json.loads((out / "eval.json").read_text())
    for label, text in json_mutations(good, rng, 6):
        (out / "eval.json").write_bytes(text)
        _check_json(_run(args), args, label, {0, 2})
