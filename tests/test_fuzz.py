"""Fuzz: mutated files of every format through info, decompress, verify and export.

Deterministic (seeded) and small enough for CI (well under a minute on 2 cores). Every mutation of a
file's bytes must give exit 1 and one ``error:`` line from every command (checksums on); with
``--no-verify-checksums`` the structural checks alone must still give exit 0, 1 or 2 with one line:
never a traceback, a Python exception name, a hang or a signal."""

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
