"""Streaming capture (blocks written in place as the model runs), chunked prefill, per-layer
queries, and the lazy per-layer reader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import kvtool
from kvtool.core import io
from kvtool.hf.capture import capture_to_file
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.streaming import StreamingWriter, open_capture

from .conftest import make_tiny_llama


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(num_layers=3)


def _ids(t: int, batch: int = 1, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 250, (batch, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_chunked_prefill_matches_one_pass(model):
    ids = _ids(37, batch=2)
    # stored in the model's float32: the comparison is of the computation, not of 16-bit rounding
    one = kvtool.capture(model=(model, None), input_ids=ids, hidden=True, dtype="float32")
    chunked = kvtool.capture(model=(model, None), input_ids=ids, hidden=True, chunk_size=8, dtype="float32")
    assert chunked.info["chunk_size"] == 8 and "chunk_size" not in one.info
    for i in range(3):
        a, b = one.layers[i], chunked.layers[i]
        # layer 0's keys come from the embeddings alone: positions and RoPE must match exactly
        if i == 0:
            torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=1e-6)
        for part in ("keys", "values", "queries", "hidden"):
            torch.testing.assert_close(getattr(b, part), getattr(a, part), rtol=1e-5, atol=1e-5)
    # positions really continue: a chunk restarted at position 0 would repeat the first chunk's rotation
    k = chunked.layers[0].keys
    assert not torch.allclose(k[:, :, 8:16], k[:, :, 0:8])


@torch.no_grad()
def test_chunked_prefill_with_generation_matches_one_pass(model):
    ids = _ids(20)
    one = kvtool.capture(model=(model, None), input_ids=ids, generate=4, dtype="float32")
    chunked = kvtool.capture(model=(model, None), input_ids=ids, generate=4, chunk_size=6, dtype="float32")
    assert torch.equal(one.token_ids, chunked.token_ids)
    torch.testing.assert_close(chunked.layers[2].keys, one.layers[2].keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.layers[2].queries, one.layers[2].queries, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_streamed_file_equals_in_memory_capture(model, tmp_path):
    ids = _ids(29, batch=2)
    mem = kvtool.capture(model=(model, None), input_ids=ids, hidden=True, generate=3, chunk_size=10)
    path, summary = capture_to_file(tmp_path / "s.safetensors", model=(model, None), input_ids=ids, hidden=True, generate=3, chunk_size=10)
    assert summary["tokens"] == 32 and summary["layers"] == [0, 1, 2]
    back = io.load(path)
    assert torch.equal(back.token_ids, mem.token_ids)
    for i in range(3):
        for part in ("keys", "values", "queries", "hidden"):
            assert torch.equal(getattr(back.layers[i], part), getattr(mem.layers[i], part)), (i, part)
    assert back.info["generated_tokens"] == 3 and back.info["chunk_size"] == 10
    # safetensors' own reader accepts the padded header and the layout
    with safe_open(str(path), framework="pt") as fh:
        assert torch.equal(fh.get_tensor("layers.1.keys"), mem.layers[1].keys)
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]


@torch.no_grad()
def test_query_layers_and_dtype(model, tmp_path):
    path, summary = capture_to_file(tmp_path / "q.safetensors", model=(model, None), input_ids=_ids(16), query_layers="2", dtype="bfloat16", chunk_size=5)
    assert summary["query_layers"] == [2]
    meta, entries = io.read_header(path)
    assert "layers.2.queries" in entries and "layers.0.queries" not in entries
    assert json.loads(meta["kvtool.info"])["query_layers"] == [2]
    cache = io.load(path)
    assert cache.layers[0].queries is None and cache.layers[2].queries.dtype == torch.bfloat16
    mem = kvtool.capture(model=(model, None), input_ids=_ids(16), dtype="bfloat16")
    assert torch.equal(cache.layers[2].queries, mem.layers[2].queries)
    with pytest.raises(UsageError, match="query.layers"):
        kvtool.capture(model=(model, None), input_ids=_ids(8), layers="0,1", query_layers="2")


@torch.no_grad()
def test_failed_capture_leaves_no_file(model, tmp_path, monkeypatch):
    from kvtool.hf import capture as capturing

    def boom(*a, **k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(capturing, "_run", boom)
    with pytest.raises(RuntimeError):
        capture_to_file(tmp_path / "x.safetensors", model=(model, None), input_ids=_ids(8))
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_unwritten_and_misplaced_blocks(tmp_path):
    specs = [("a", torch.float32, [2, 3, 4], 1)]
    with pytest.raises(BadDataError, match="0 of 96 bytes"):
        with StreamingWriter(tmp_path / "w", specs, {}):
            pass
    with pytest.raises(UsageError, match="does not fit"):
        with StreamingWriter(tmp_path / "w", specs, {}) as w:
            w.write("a", 2, torch.zeros(2, 2, 4))
    x = torch.arange(24.0).reshape(2, 3, 4)
    with StreamingWriter(tmp_path / "w", specs, {"k": "v"}) as w:
        w.write("a", 1, x[:, 1:])
        w.write("a", 0, x[:, :1])
    with safe_open(str(tmp_path / "w"), framework="pt") as fh:
        assert torch.equal(fh.get_tensor("a"), x) and fh.metadata()["k"] == "v"
    assert io.verify_checksums(tmp_path / "w")  # blocks out of token order: the CRC is read back


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_writer_checksums_match_the_tensors_as_stored(tmp_path, dtype):
    """Running CRCs per row, combined: the same CRC-32 as the whole tensor's bytes, for blocks of any size."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 37, 8, generator=gen).to(dtype)
    h = torch.randn(2, 37, 5, generator=gen).to(dtype)
    specs = [("k", dtype, list(k.shape), 2), ("h", dtype, list(h.shape), 1), ("empty", dtype, [2, 0, 4], 1)]
    with StreamingWriter(tmp_path / "w", specs, {"k": "v"}) as w:
        for start, stop in ((0, 1), (1, 20), (20, 21), (21, 37)):
            w.write("k", start, k[:, :, start:stop])
            w.write("h", start, h[:, start:stop])
    table = json.loads(io.read_header(tmp_path / "w")[0][io.CHECKSUM_KEY])
    assert table["tensors"] == {"k": f"{io.tensor_crc32(k):08x}", "h": f"{io.tensor_crc32(h):08x}", "empty": "00000000"}
    assert io.verify_checksums(tmp_path / "w")
    meta = io.read_header(tmp_path / "w")[0]
    assert table["metadata"] == f"{io.metadata_crc32(meta):08x}"


def test_lazy_capture_reads_one_layer_at_a_time(model, tmp_path, monkeypatch):
    ids = _ids(12)
    path, _ = capture_to_file(tmp_path / "l.safetensors", model=(model, None), input_ids=ids)
    full = io.load(path)
    lazy = open_capture(path, layers=[0, 2], parts=("keys", "values"))
    assert lazy.layer_indices == [0, 2] and lazy.num_tokens == 12 and not lazy.has_queries
    assert lazy.layers[2].queries is None and torch.equal(lazy.layers[2].keys, full.layers[2].keys)
    assert lazy.dense_kv_bytes() == sum(full.layers[i].keys.numel() * full.layers[i].keys.element_size() * 2 for i in (0, 2))
    with pytest.raises(UsageError, match="layer 5 is not in"):
        open_capture(path, layers=[5])
    names = []
    real = io.KVFile.read

    def spy(self, wanted, *a, **k):
        names.extend(wanted)
        return real(self, wanted, *a, **k)

    monkeypatch.setattr(io.KVFile, "read", spy)  # the reader the lazy capture goes through
    lazy.prefetch = False
    lazy.layers[0]
    assert names == ["layers.0.keys", "layers.0.values"]
    lazy.prefetch = True
    names.clear()
    lazy.layers[0]
    assert list(lazy._ahead) == [2]  # the next selected layer is read while layer 0 is used
    assert torch.equal(lazy.layers[2].keys, full.layers[2].keys)
    assert sorted(names) == ["layers.0.keys", "layers.0.values", "layers.2.keys", "layers.2.values"]  # each read once


def test_capture_cli_chunked_query_layers_and_device_map(tmp_path, tiny_llama_dir):
    from typer.testing import CliRunner

    from kvtool.cli import app

    runner = CliRunner()
    out = tmp_path / "c.safetensors"
    args = ["capture", "--model", str(tiny_llama_dir), "--prompt", "a longer prompt for chunks", "--chunk-size", "7",
            "--query-layers", "1", "--device-map", "auto", "--dtype", "float32", "-o", str(out), "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["chunk_size"] == 7 and data["bytes_written"] == out.stat().st_size
    assert data["layers"] == [{"layer": 0, "queries": False}, {"layer": 1, "queries": True}]
    one = kvtool.capture("a longer prompt for chunks", model=str(tiny_llama_dir), dtype="float32")
    back = io.load(out)
    assert back.layers[0].queries is None
    torch.testing.assert_close(back.layers[1].queries, one.layers[1].queries, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(back.layers[1].keys, one.layers[1].keys, rtol=1e-5, atol=1e-5)
    res = runner.invoke(app, ["capture", "--model", str(tiny_llama_dir), "--prompt", "x", "--no-queries", "--query-layers", "1", "-o", str(tmp_path / "n.safetensors")])
    assert res.exit_code == 2 and "--query-layers needs queries" in res.output


def test_device_option_on_every_command(tmp_path, sample_capture, monkeypatch):
    """--device cpu gives the same numbers as the default on a CPU machine; cuda without CUDA and a
    device that is not one are one-line usage errors (exit 2)."""
    from typer.testing import CliRunner

    from kvtool.cli import app
    from kvtool.core.placement import resolve_device

    runner = CliRunner()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")
    out = tmp_path / "b.safetensors"
    res = runner.invoke(app, ["compress", str(sample_capture), "--format", "bitmap", "--sparsity", "0.7", "--layers", "7", "--device", "cpu", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    a = runner.invoke(app, ["verify", str(out), "--no-model", "--backend", "torch", "--device", "cpu", "--json"])
    b = runner.invoke(app, ["verify", str(out), "--no-model", "--backend", "torch", "--json"])
    assert a.exit_code == 0 and json.loads(a.output)["attention"]["overall"] == json.loads(b.output)["attention"]["overall"]
    assert json.loads(a.output)["attention"]["device"] == "cpu"
    for cmd in (["compress", str(sample_capture), "-o", str(tmp_path / "x.safetensors")], ["verify", str(out)],
                ["eval", str(sample_capture), "--formats", "dense"], ["stats", str(sample_capture)]):
        res = runner.invoke(app, cmd + ["--device", "cuda"])
        assert res.exit_code == 2 and "CUDA is not available" in res.output, (cmd, res.output)
        res = runner.invoke(app, cmd + ["--device", "tpu"])
        assert res.exit_code == 2 and "--device must be" in res.output, (cmd, res.output)
    res = runner.invoke(app, ["stats", str(sample_capture), "--layers", "15", "--device", "cpu", "--json"])
    ref = runner.invoke(app, ["stats", str(sample_capture), "--layers", "15", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["model_summary"] == json.loads(ref.output)["model_summary"]


def test_same_device_reads_cuda_as_the_current_gpu(monkeypatch):
    from kvtool.core.streaming import same_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert same_device(torch.device("cuda"), torch.device("cuda:0")) and same_device(torch.device("cuda:0"), torch.device("cuda"))
    assert not same_device(torch.device("cuda"), torch.device("cuda:1")) and not same_device(torch.device("cuda:0"), torch.device("cpu"))
    assert same_device(torch.device("cpu"), torch.device("cpu")) and not same_device(torch.device("cpu"), torch.device("cpu:0"))
