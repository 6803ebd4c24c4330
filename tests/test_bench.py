"""`kvtool bench` on the CPU: option parsing, the record schema, a tiny run under TRITON_INTERPRET=1,
and the messages for a missing GPU, a missing kernel module and a missing FlashInfer. No test asserts
a speed: CPU interpreter timings mean nothing."""

from __future__ import annotations

import importlib
import json
import pkgutil
import shutil

import pytest
import torch
from typer.testing import CliRunner

from kvtool.bench import harness as B
from kvtool.bench.suites import require_kernel
from kvtool.cli import app
from kvtool.bench.runner import parse_float_list, parse_int_list
from kvtool.core.errors import UsageError

import kvtool.kernels  # noqa: E402

# Triton reads TRITON_INTERPRET when a kernel is decorated: import every kernel module now, under
# the interpreter (conftest), so that a test that unsets it does not leave GPU-compiled kernels behind
# for the tiny runs that follow (when this file runs on its own).
for _mod in pkgutil.iter_modules(kvtool.kernels.__path__):
    importlib.import_module(f"kvtool.kernels.{_mod.name}")

runner = CliRunner()
TINY = ["--model-shape", "custom", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--batch", "1,2", "--seq", "40", "--rep-ms", "1"]


def test_parse_lists():
    assert parse_int_list("4096, 32k,128K", "seq") == [4096, 32768, 131072]
    assert parse_float_list("0.5,0.7", "sparsity") == [0.5, 0.7]
    for bad in ("", "x", "0", "-3"):
        with pytest.raises(UsageError):
            parse_int_list(bad, "seq")
    with pytest.raises(UsageError):
        parse_float_list("1.0", "sparsity")


def test_model_shapes():
    assert B.model_shape("llama3-8b") == B.ModelShape("llama3-8b", 32, 8, 128)
    assert B.model_shape("llama2-7b", kv_heads=8).kv_heads == 8
    assert B.model_shape("custom", 6, 2, 64).group == 3
    with pytest.raises(UsageError, match="--heads"):
        B.model_shape("custom", 6, None, 64)
    with pytest.raises(UsageError, match="multiple"):
        B.model_shape("custom", 6, 4, 64)
    with pytest.raises(UsageError, match="unknown"):
        B.model_shape("gpt5")


def test_summarize_percentiles():
    t = B.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (t.median_us, t.p10_us, t.p90_us, t.runs) == (3.0, 1.4, 4.6, 5)


def test_add_speedups_by_configuration():
    env = B.BenchEnv("dev", "cuda", True, True, {}, copy_gbps=1000.0)
    s = B.ModelShape("custom", 4, 2, 16)
    t = lambda us: B.Timing(us, us, us, 10)  # noqa: E731
    recs = [
        B.make_record(env, "x", "base", s, 1, 64, torch.float16, t(100.0), 10**6),
        B.make_record(env, "x", "kern", s, 1, 64, torch.float16, t(25.0), 10**6, sparsity=0.7),
        B.make_record(env, "x", "fi", s, 1, 64, torch.float16, None, 10**6, status=B.NOT_INSTALLED),
        B.make_record(env, "x", "base", s, 2, 64, torch.float16, t(400.0), 10**6),
    ]
    B.add_speedups(recs, ["base", "fi"])
    assert recs[1]["speedup"] == {"base": 4.0, "fi": "not installed"}
    assert recs[0]["speedup"] == {"fi": "not installed"}
    # 1e6 bytes in 25 µs = 40 GB/s = 4% of 1000 GB/s
    assert recs[1]["bandwidth_gbps"] == pytest.approx(40.0) and recs[1]["bandwidth_fraction"] == pytest.approx(0.04)


def test_plot_lines_one_colour_per_kernel_and_no_two_alike():
    from kvtool.bench.plots import line_styles

    labels = [f"bitmap_{k} sparsity={s}" for k in ("triton", "fp16acc", "tensor_cores") for s in (0.5, 0.7)]
    labels += ["cublas_qk+pv", "flashinfer_batch", "flashinfer_batch_tc", "sdpa", "torch_dense"]
    styles = line_styles(labels, ["c%d" % i for i in range(10)])
    looks = {(st["color"], st["linestyle"]) for st in styles.values()}
    assert len(looks) == len(labels)  # the default cycle repeats a colour past ten lines
    assert styles["bitmap_triton sparsity=0.5"]["color"] == styles["bitmap_triton sparsity=0.7"]["color"]
    assert styles["bitmap_triton sparsity=0.5"]["linestyle"] != styles["bitmap_triton sparsity=0.7"]["linestyle"]


def test_no_cuda_without_interpreter_is_a_clear_usage_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["bench", "dense", *TINY])
    assert res.exit_code == 2
    assert "no CUDA device" in res.output and "TRITON_INTERPRET=1" in res.output


def test_tiny_dense_run_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out, fig = tmp_path / "r.json", tmp_path / "r.png"
    res = runner.invoke(app, ["bench", "dense", *TINY, "--json", str(out), "--plot", str(fig)])
    assert res.exit_code == 0, res.output
    assert "meaningless" in res.output
    doc = json.loads(out.read_text())
    assert doc["subcommand"] == "dense" and doc["env"]["timing_valid"] is False
    recs = doc["records"]
    assert {r["provider"] for r in recs} >= {"cublas_qk", "cublas_pv", "torch_dense", "sdpa", "flashinfer_batch"}
    assert len({(r["batch"], r["provider"]) for r in recs}) == len(recs)
    for r in recs:
        assert tuple(r) == B.RECORD_FIELDS
        assert r["timing_valid"] is False and r["device"].startswith("cpu")
        assert r["method"] in ("wall-clock (interpreter)", None)
        if r["provider"].startswith("flashinfer"):
            # FlashInfer is not installed in CI; on the CPU it could not run anyway
            assert r["status"] in (B.NOT_INSTALLED, "skipped: needs CUDA") and r["median_us"] is None
        else:
            assert r["status"] == "ok" and r["rel_err"] < 1e-2 and r["median_us"] > 0
    qk = next(r for r in recs if r["provider"] == "cublas_qk" and r["batch"] == 2)
    assert qk["bytes_read"] == 2 * 2 * 40 * 16 * 2 + 2 * 4 * 16 * 2  # keys + queries, fp16
    assert fig.read_bytes()[:4] == b"\x89PNG"
    # existing outputs are not overwritten without --force
    res = runner.invoke(app, ["bench", "dense", *TINY, "--json", str(out)])
    assert res.exit_code == 2 and "--force" in res.output


def test_json_to_stdout_is_clean(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = ["--model-shape", "custom", "--heads", "3", "--kv-heads", "3", "--head-dim", "8", "--batch", "1", "--seq", "17", "--rep-ms", "1"]
    res = runner.invoke(app, ["bench", "dense", *args, "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["shape"] == {"name": "custom", "heads": 3, "kv_heads": 3, "head_dim": 8}
    assert doc["env"]["versions"]["flashinfer"] == B.NOT_INSTALLED
    assert [r["seq"] for r in doc["records"]] == [17] * len(doc["records"])


def test_too_large_for_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = runner.invoke(app, ["bench", "dense", "--batch", "8", "--seq", "32k"])
    assert res.exit_code == 2 and "too large for the CPU" in res.output


def test_missing_kernel_module_is_named():
    with pytest.raises(B.BenchUnavailable, match=r"kvtool.kernels.no_such_kernel is not in this checkout"):
        require_kernel("no_such_kernel", "spmv")


def test_bad_options(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = runner.invoke(app, ["bench", "dense", "--dtype", "fp8"])
    assert res.exit_code == 2 and "--dtype" in res.output
    res = runner.invoke(app, ["bench", "heads", "--top-k", "99"])
    assert res.exit_code == 2 and "--top-k 99" in res.output
    res = runner.invoke(app, ["bench", "heads", "--k", "99"])  # the old name still works
    assert res.exit_code == 2 and "--top-k 99" in res.output


def test_capture_tensors_are_tiled(monkeypatch, sample_capture):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = runner.invoke(app, ["bench", "dense", "--capture", str(sample_capture), "--layer", "7", "--batch", "2", "--seq", "300",
                              "--rep-ms", "1", "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["shape"] == {"name": f"capture:{sample_capture.name}", "heads": 9, "kv_heads": 3, "head_dim": 64}
    assert {r["data"] for r in doc["records"]} == {f"capture:{sample_capture.name}"}
    assert all(r["seq"] == 300 and r["batch"] == 2 for r in doc["records"])
    assert all(r["status"] == "ok" for r in doc["records"] if not r["provider"].startswith("flashinfer"))


def test_capture_decode_inputs_repeat_the_layer(sample_capture):
    shape, q, k, v = B.capture_decode_inputs(sample_capture, 0, 3, 600, torch.float16, "cpu")
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (9, 3, 64)
    assert tuple(k.shape) == (3, 3, 600, 64) and tuple(q.shape) == (3, 9, 64)
    assert torch.equal(k[:, :, 512:], k[:, :, :88]) and torch.equal(v[:, :, 512:], v[:, :, :88])
    assert torch.equal(k[2], k[0]) and torch.equal(q[1], q[0])


@pytest.mark.parametrize("sub,extra", [("attention", ["--sparsity", "0.7"]), ("spmv", ["--sparsity", "0.7"]), ("compress", ["--sparsity", "0.7", "--budget", "48"]),
                                       ("heads", ["--k", "2"]), ("lut", ["--budget", "32"]), ("pages", ["--budget", "32"]),
                                       ("kivi", [])])
def test_every_kernel_suite_runs_tiny(sub, extra, monkeypatch):
    """Each suite end to end on the CPU interpreter: kernels checked against their references (status
    ok), baselines beside them, speedups filled in by name."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = ["--model-shape", "custom", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--batch", "1", "--seq", "80",
            "--rep-ms", "1", "--window", "8", *extra]
    res = runner.invoke(app, ["bench", sub, *args, "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    kernels = [r for r in doc["records"] if not r["provider"].startswith(("cublas", "torch_dense", "sdpa", "flashinfer"))]
    assert kernels and all(r["status"] == "ok" for r in kernels), [(r["provider"], r["status"]) for r in kernels]
    assert all(tuple(r) == B.RECORD_FIELDS for r in doc["records"])
    if sub != "compress":
        assert all(any(isinstance(v, float) for v in r["speedup"].values()) for r in kernels)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_source_commit_flags_changed_package_files(tmp_path, monkeypatch):
    import subprocess

    from kvtool.bench.runner import source_commit

    monkeypatch.delenv("KVTOOL_COMMIT", raising=False)
    pkg = tmp_path / "kvtool"
    pkg.mkdir()
    (pkg / "kernel.py").write_text("x = 1\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "PATH": __import__("os").environ["PATH"]}
    for cmd in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-q", "-m", "one"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, env=env)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert source_commit(pkg) == head
    (pkg / "kernel.py").write_text("x = 2\n")  # timed code that is not the commit's
    assert source_commit(pkg) == head + "+changes"
    monkeypatch.setenv("KVTOOL_COMMIT", "abc1234")
    assert source_commit(pkg) == "abc1234"
