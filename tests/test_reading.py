"""Reading files fast without checking less: CRC-32 and finite tests on chunks read in parallel, one
header parse per file, the source's SHA-256 once per file version, header-only commands without
torch, and ``--device`` checked before anything loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.core import io, kvfile
from kvtool.core.errors import BadDataError

from .conftest import synthetic_cache

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def test_crc32_combine_matches_zlib_at_any_split():
    data = os.urandom(100_003)
    for cut in (0, 1, 7, 4096, 50_000, 100_002, 100_003):
        a, b = data[:cut], data[cut:]
        assert kvfile.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2])
def test_nonfinite_count_from_the_bits_agrees_with_torch(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4099, generator=g) * 100
    x[::97] = float("nan")
    x[5::89] = float("inf")
    x[7::83] = -float("inf")
    t = x.to(dtype)
    want = int((~torch.isfinite(t.float())).sum())
    code = io._st_codes()[dtype]
    assert want > 0 and kvfile.nonfinite_count(t.view(torch.uint8).numpy().tobytes(), code) == want
    with pytest.raises(BadDataError, match=f"holds {want} NaN or infinite values"):
        io.check_finite("f", {"t": t})


def test_chunked_parallel_read_checks_every_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(kvfile, "CHUNK", 4096)  # many chunks per tensor, read by the thread pool
    cache = synthetic_cache(tokens=640, dtype=torch.bfloat16)
    path = io.save(cache, tmp_path / "c.safetensors")
    back = io.load(path)
    assert torch.equal(back.layers[1].queries, cache.layers[1].queries)
    with io.KVFile(path) as f:
        begin, end = f.header.spans["layers.1.queries"]
        assert (end - begin) // kvfile.CHUNK >= 4
        assert f.crc32("layers.1.queries") == zlib.crc32(path.read_bytes()[begin:end])
    # one flipped bit in the last chunk of a tensor, then NaNs spread over several chunks
    raw = bytearray(path.read_bytes())
    raw[end - 3] ^= 0x10
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw)
    with pytest.raises(BadDataError, match="'layers.1.queries' fails its checksum"):
        io.load(bad)
    q = cache.layers[1].queries.clone()
    q.view(-1)[:: q.numel() // 5] = float("nan")
    cache.layers[1].queries = q
    io.set_verify_checksums(True)
    nan_path = tmp_path / "nan.safetensors"
    io.write_safetensors(nan_path, io.capture_tensors(cache), io.capture_metadata(cache))
    with pytest.raises(BadDataError, match="'layers.1.queries' holds 5 NaN or infinite values"):
        io.load(nan_path)
    with pytest.raises(BadDataError, match="holds 5 NaN"):
        io.check_capture_file(nan_path)  # kvtool info's torch-free check, streamed
    assert io.load(nan_path, allow_nonfinite=True).layers[1].queries.isnan().sum() == 5


def test_tail_read_checks_the_whole_tensor(tmp_path, monkeypatch):
    monkeypatch.setattr(kvfile, "CHUNK", 1024)
    cache = synthetic_cache(tokens=200)
    path = io.save(cache, tmp_path / "c.safetensors")
    tail = io.read_tail(path, "layers.0.queries", 16)
    assert torch.equal(tail, cache.layers[0].queries[:, :, -16:])
    raw = bytearray(path.read_bytes())
    with io.KVFile(path) as f:
        begin, _ = f.header.spans["layers.0.queries"]
    raw[begin + 5] ^= 1  # far from the tail
    (tmp_path / "bad.safetensors").write_bytes(raw)
    with pytest.raises(BadDataError, match="fails its checksum"):
        io.read_tail(tmp_path / "bad.safetensors", "layers.0.queries", 16)


def test_header_parsed_once_per_version(tmp_path, monkeypatch):
    path = io.save(synthetic_cache(), tmp_path / "c.safetensors")
    calls = []
    real = json.loads
    monkeypatch.setattr(kvfile.json, "loads", lambda *a, **k: calls.append(1) or real(*a, **k))
    io.read_header(path)
    first = len(calls)
    for _ in range(3):
        io.read_header(path)
        with io.KVFile(path):
            pass
    assert first >= 1 and len(calls) == first  # the same header bytes are not parsed again
    raw = bytearray(path.read_bytes())
    at = raw.index(b'"kvtool.schema_version":"1"') + len(b'"kvtool.schema_version":"')
    raw[at] = ord("2")  # same size, new header: parsed and checked again
    path.write_bytes(raw)
    with pytest.raises(BadDataError, match="fails its checksum|not supported"):
        io.load(path)


def test_source_sha256_hashed_once_per_file_version(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kvfile, "_SHA_MEMO", {})
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(10_000))
    import hashlib

    made = []
    real = kvfile._hash_fd
    monkeypatch.setattr(kvfile, "_hash_fd", lambda fd: made.append(1) or real(fd))
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    assert kvfile.sha256_file(path) == want and kvfile.sha256_file(path) == want and len(made) == 1
    kvfile._SHA_MEMO.clear()  # as a new process: read back from $KVTOOL_CACHE/sha256
    assert kvfile.sha256_file(path) == want and len(made) == 1
    assert oct((tmp_path / "cache" / "sha256").stat().st_mode & 0o777) == "0o700"
    before = path.stat().st_mtime_ns
    path.write_bytes(os.urandom(10_000))  # a new version (its mtime moved on, as a later write's does): hashed again
    os.utime(path, ns=(before + 10**9, before + 10**9))
    assert kvfile.sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest() and len(made) == 2


def test_source_named_by_its_header_when_it_carries_checksums(tmp_path):
    import hashlib

    from kvtool.analysis.fidelity import is_source

    path = io.save(synthetic_cache(), tmp_path / "c.safetensors")
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    digest = io.source_sha256(path)
    assert digest == hashlib.sha256(raw[8 : 8 + n]).hexdigest()  # the header alone: no pass over the payload
    assert is_source(path, digest) and is_source(path, hashlib.sha256(raw).hexdigest())  # and what older kvtool recorded
    other = io.save(synthetic_cache(seed=1), tmp_path / "d.safetensors")
    assert io.source_sha256(other) != digest and not is_source(other, digest)
    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.ones(3)}, str(plain))  # no checksum table: the whole file names it
    assert io.source_sha256(plain) == hashlib.sha256(plain.read_bytes()).hexdigest()


def test_capture_writes_behind_the_model_and_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    """Blocks are written by the writer thread while the model computes; a write that fails there
    (a full disk) fails the capture as before: a BadDataError naming the output, no file left."""
    import errno

    from kvtool.core import streaming
    from kvtool.hf.capture import capture_to_file

    from .conftest import make_tiny_llama

    model = make_tiny_llama()
    ids = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    path, _ = capture_to_file(tmp_path / "ok.safetensors", model=(model, None), input_ids=ids, chunk_size=8)
    assert io.load(path).num_tokens == 40  # checksums of blocks written by the thread hold
    real = os.pwrite
    calls = []

    def full(fd, data, offset):
        calls.append(offset)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(streaming.os, "pwrite", full)
    with pytest.raises(BadDataError, match="No space left"):
        capture_to_file(tmp_path / "full.safetensors", model=(model, None), input_ids=ids, chunk_size=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.safetensors"]


def _imports_torch(args: list[str]) -> bool:
    code = ("import sys; from typer.testing import CliRunner; from kvtool.cli import app; "
            f"r = CliRunner().invoke(app, {args!r}); assert r.exit_code == 0, r.output; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1] == "True"


HEADER_ONLY = [["info", "sample:"], ["info", "sample:", "--json"], ["version"], ["sample", "path"], ["--help"]]
HEADER_ONLY += [["bench", suite, "--help"] for suite in ("attention", "dense")]
HEADER_ONLY += [[name, "--help"] for name in ("capture", "compress", "verify", "eval", "stats", "heads", "recommend", "report", "generate",
                                              "info", "export", "prune", "plot", "decompress", "bench")]


@pytest.mark.parametrize("args", HEADER_ONLY, ids=[" ".join(a) for a in HEADER_ONLY])
def test_header_only_commands_never_import_torch(args):
    assert not _imports_torch(args)


@pytest.mark.skipif(not (torch.__version__.endswith("+cpu")), reason="a CUDA build of torch is asked for its device")
def test_env_on_a_cpu_torch_build_never_imports_torch():
    assert not _imports_torch(["env"])


COMPUTING = ["capture", "compress", "verify", "eval", "stats", "heads", "recommend", "report", "generate"]


@pytest.mark.parametrize("command", COMPUTING)
def test_every_computing_command_takes_device_auto(command):
    import typer.main

    group = typer.main.get_group(app)
    params = {p.name: p for p in group.commands[command].params}
    assert params["device"].default == "auto", command
    res = runner.invoke(app, [command] + ([] if command == "capture" else ["x"]) + ["--device", "[bold]gpu"])
    assert res.exit_code == 2 and "--device must be auto, cpu, cuda" in res.output, res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    from kvtool.hf import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    res = runner.invoke(app, ["capture", "--device", "cuda", "--prompt", "hi", "-o", str(tmp_path / "c.safetensors")])
    assert res.exit_code == 2 and "CUDA is not available" in res.output
    res = runner.invoke(app, ["verify", "sample:", "--device", "cuda:0"])
    assert res.exit_code == 2 and "CUDA is not available" in res.output


def test_model_on_a_device_is_read_a_tensor_at_a_time_not_mapped(tiny_llama_dir, monkeypatch):
    """A model placed on a device: its weights go there a few at a time through short-lived host
    tensors (kvtool's chunked reader), never through a memory map that keeps every page resident
    until the model is loaded; the weights are the ones transformers' own loading gives."""
    import safetensors

    from kvtool.hf import models

    mapped, read = [], []
    real_open, real_read = safetensors.safe_open, io.KVFile.read
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: mapped.append(a) or real_open(*a, **k))
    monkeypatch.setattr(io.KVFile, "read", lambda self, names, *a, **k: read.extend(names) or real_read(self, names, *a, **k))
    # what models.load does for a CUDA device, here onto the meta device (no GPU needed)
    model = models._from_folder_on_device(Path(tiny_llama_dir), {"device_map": {"": "meta"}})
    assert next(model.parameters()).device.type == "meta" and not mapped and len(read) == len(set(read)) > 0
    host, _tok, _src = models.load(str(tiny_llama_dir))  # on the CPU: transformers' own loading
    placed = models._from_folder_on_device(Path(tiny_llama_dir), {"device_map": {"": "cpu"}})
    want, got = host.state_dict(), placed.state_dict()
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    budget = models._HostBudget(100, wait_s=0.1)
    budget.take(60)
    budget.take(60)  # over the budget: waits for the first (bounded), here not given back in time
    assert budget.held == 120
