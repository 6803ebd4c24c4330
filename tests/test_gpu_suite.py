"""scripts/gpu_suite.sh on the CPU: its dry mode over real gpu tests (collection, chunks, JUnit and
summary), and its runner over a small made-up suite with a test that hangs: the hang becomes a
timeout with the stacks in the log, the tests after it still run, and the summary counts each
outcome (issue 44)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_suite.sh"


def suite(tmp_path, *args, dry=False, timeout=300):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, GPU_SUITE_DRY="1" if dry else "0")
    for name in ("PYTEST_ADDOPTS", "GPU_SUITE_RECORDS", "GPU_SUITE_SELECT", "GPU_SUITE_COLLECT"):
        env.pop(name, None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def script_module(name: str):
    """scripts/NAME.py imported as a module of its own (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_dry_run_collects_and_chunks_the_gpu_tests(tmp_path):
    target = "tests/test_bitmap_sparse_attention.py"
    res = suite(tmp_path, "--all", "--chunks", "2", target, dry=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "out"
    doc = json.loads((out / "summary.json").read_text())
    assert doc["schema"] == "kvtool.gpu-suite/1" and doc["dry_run"] and doc["commit"]
    assert [c["chunk"] for c in doc["chunks"]] == ["1-of-2", "2-of-2"] and all(c["counts"]["total"] > 0 for c in doc["chunks"])
    ids = [t["nodeid"] for t in doc["tests"]]
    assert len(ids) == len(set(ids)) == doc["counts"]["not_run"] > 30
    assert "tests/test_bitmap_sparse_attention.py::test_cuda_backend_odd_shapes[1-1-7-2049-64-130-5]" in ids
    assert all(t["message"] == "dry run: collected, not run" for t in doc["tests"])  # every node id resolves in its chunk
    for c in doc["chunks"]:
        xml = ET.parse(out / f"chunk-{c['chunk']}.xml").getroot()
        assert xml.tag == "testsuite" and int(xml.get("tests")) == c["counts"]["total"] == len(xml.findall("testcase"))
    assert sorted(p.name for p in out.iterdir()) == ["chunk-1-of-2.xml", "chunk-2-of-2.xml", "suite.log", "summary.json"]
    listed = suite(tmp_path, "--list", "--chunks", "2", target, dry=True)
    assert listed.returncode == 0 and "chunk 1/2:" in listed.stdout and "chunk 2/2:" in listed.stdout


FAKE = '''
import time
import pytest

pytestmark = pytest.mark.gpu

def test_a_passes():
    pass

def test_b_fails():
    assert 1 == 2

def test_c_hangs():
    time.sleep(120)

def test_d_runs_after_the_hang():
    pass

@pytest.mark.skip(reason="not here")
def test_e_skipped():
    pass
'''


@pytest.mark.slow
@pytest.mark.parametrize("ender", ["pytest-timeout", "watchdog"])
def test_a_hang_becomes_a_timeout_and_the_chunk_goes_on(tmp_path, monkeypatch, ender):
    """pytest-timeout (thread method) ends the hung pytest with its stacks; without it the suite's
    watchdog does, after a faulthandler dump of every thread."""
    if ender == "pytest-timeout":
        pytest.importorskip("pytest_timeout")
    else:
        monkeypatch.setenv("GPU_SUITE_NO_PYTEST_TIMEOUT", "1")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: fake\n")
    (fake / "test_fake.py").write_text(FAKE)
    res = suite(tmp_path, "--all", "--chunks", "1", "--timeout", "4", "--no-build", str(fake), timeout=240)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "summary.json").read_text())
    got = {t["nodeid"].split("::")[-1]: t["outcome"] for t in doc["tests"]}
    assert got == {"test_a_passes": "passed", "test_b_fails": "failed", "test_c_hangs": "timeout",
                   "test_d_runs_after_the_hang": "passed", "test_e_skipped": "skipped"}
    c = doc["counts"]
    assert (c["passed"], c["failed"], c["timeout"], c["skipped"], c["total"]) == (2, 1, 1, 1, 5)
    hang = next(t for t in doc["tests"] if t["nodeid"].endswith("test_c_hangs"))
    assert 3 <= hang["duration_s"] < 60
    log = (tmp_path / "out" / "suite.log").read_text()
    stack_line = "line 14 in test_c_hangs" if ender == "watchdog" else "time.sleep(120)"  # faulthandler's, pytest-timeout's
    assert stack_line in log and stack_line in hang["message"]
    case = [e for e in ET.parse(tmp_path / "out" / "chunk-1-of-1.xml").getroot() if e.get("name") == "test_c_hangs"][0]
    assert case.find("failure").get("type") == "timeout"
    assert "1 timeouts" in res.stdout


def test_merge_adds_up_separate_chunk_runs(tmp_path):
    gs = script_module("gpu_suite")
    for k, outcome in ((1, "passed"), (2, "timeout")):
        d = tmp_path / f"run{k}"
        d.mkdir()
        tests = [{"nodeid": f"tests/t.py::test_{k}", "chunk": f"{k}-of-2", "outcome": outcome, "duration_s": 1.0, "message": ""}]
        doc = {"schema": gs.SCHEMA, "device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0", "commit": "abc", "wall_s": 5.0,
               "chunks": [{"chunk": f"{k}-of-2", "wall_s": 5.0, "counts": gs.counts(tests)}], "tests": tests}
        (d / "summary.json").write_text(json.dumps(doc))
    merged = gs.merge([str(tmp_path / "run1"), str(tmp_path / "run2")], tmp_path / "merged")
    assert merged["counts"]["passed"] == 1 and merged["counts"]["timeout"] == 1 and merged["wall_s"] == 10.0
    assert json.loads((tmp_path / "merged" / "summary.json").read_text())["counts"]["total"] == 2
    assert not gs.ok(merged)
    assert gs.split_chunks([1.0] * 10, 3) == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]


@pytest.mark.slow
def test_sanitizer_driver_runs_the_triton_cases_on_the_cpu():
    """scripts/sanitize_kernels.py's Triton cases under the interpreter (the CUDA ones need a GPU):
    every call and shape stays valid and matches its reference."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "scripts/sanitize_kernels.py", "--triton-only"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "0 failed" in res.stdout and res.stdout.count(": ok") >= 7
    listed = subprocess.run([sys.executable, "scripts/sanitize_kernels.py", "--list"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "cuda" not in listed.stdout  # the interpreter leaves the CUDA extensions out


SANITIZER_LOG = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at void bsa::bitmap_sparse_attention_mma_kernel<__half, (int)64, (bool)1, (bool)0>(bsa::Params)+0x1a0 in /x/mma.cuh:180
=========     by thread (0,0,0) in block (4,0,0)
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at void at::native::vectorized_elementwise_kernel<4, float>(int, float)+0x90
=========
========= ERROR SUMMARY: 2 errors
"""


def test_sanitizer_summary_counts_kvtools_reports_apart(tmp_path):
    sk = script_module("sanitize_kernels")
    log, drv = tmp_path / "log", tmp_path / "drv"
    log.write_text(SANITIZER_LOG)
    drv.write_text("case x: ok\n15 passed, 0 failed\n")
    entry = sk.summarize(tmp_path, "memcheck", log, drv)
    assert (entry["error_summary"], entry["kvtool_reports"], entry["other_reports"], entry["clean"]) == (2, 1, 1, False)
    assert "_sparse_attention_kernel" in sk.kvtool_kernel_names() and "merge_splits_kernel" in sk.kvtool_kernel_names()
    log.write_text("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n")
    assert sk.summarize(tmp_path, "racecheck", log, drv)["clean"]
    log.write_text("========= COMPUTE-SANITIZER\n")  # killed by the timeout: no ERROR SUMMARY
    assert not sk.summarize(tmp_path, "synccheck", log, drv)["clean"]
    doc = json.loads((tmp_path / "sanitize.json").read_text())
    assert set(doc["tools"]) == {"memcheck", "racecheck", "synccheck"} and doc["clean"] is False
    assert "NOT CLEAN" in (tmp_path / "sanitize-memcheck.txt").read_text()


RACECHECK_LOG = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at _kivi_kernel+0x1b0 in kivi_attention.py:21
=========     and Read access at _kivi_kernel+0x2e0 in kivi_attention.py:23 [4 hazards]
=========
========= WARN:(Warp Level Programming) Potential RAW hazard detected at __shared__ 0x0 in block (0, 0, 0) :
=========     Write Thread (31, 0, 0) at 0x00000170 in race.cu:24:void at::native::reduce_kernel(int)
=========     Read Thread (0, 0, 0) at 0x000001b0 in race.cu:25:void at::native::reduce_kernel(int)
=========
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""


def test_racecheck_reports_name_their_kernel(tmp_path):
    """racecheck names the function on a report's first line (``at FUNC+0x..``) or in a hazard's
    ``in FILE:LINE:FUNC``: each report is counted against its kernel, kvtool's apart."""
    sk = script_module("sanitize_kernels")
    reports, total = sk.parse_reports(RACECHECK_LOG)
    # racecheck closes with RACECHECK SUMMARY (no ERROR SUMMARY line): the run finished, 2 hazards
    assert total == 2 and [r["kernel"] for r in reports] == ["_kivi_kernel", "void at::native::reduce_kernel(int)"]
    log, drv = tmp_path / "log", tmp_path / "drv"
    log.write_text(RACECHECK_LOG)
    drv.write_text("16 passed, 0 failed\n")
    entry = sk.summarize(tmp_path, "racecheck", log, drv)
    assert (entry["finished"], entry["kvtool_reports"], entry["other_reports"], entry["clean"]) == (True, 1, 1, False)
    log.write_text("========= COMPUTE-SANITIZER\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    assert sk.summarize(tmp_path, "racecheck", log, drv)["clean"]
