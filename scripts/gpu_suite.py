"""The whole gpu suite in chunks that each fit one GPU run, every test under a timeout, results as
JUnit XML per chunk and one JSON summary. Driven by scripts/gpu_suite.sh (read its header for use).

Also a pytest plugin (``-p gpu_suite``, active only under the GPU_SUITE_* variables below): it writes
each test's start and result to a JSON-lines file the moment they happen (unbuffered), so that a test
that hangs and gets its process killed (pytest-timeout's thread method ends the process) is still
known, recorded as a timeout, and the chunk goes on after it in a fresh pytest.

  GPU_SUITE_RECORDS  path of the JSON-lines file the plugin appends to
  GPU_SUITE_SELECT   path of a JSON list of node ids: every other collected test is deselected
  GPU_SUITE_COLLECT  path: the plugin writes the collected tests (node id, file, markers) there
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "kvtool.gpu-suite/1"
DEFAULT_TIMEOUT = 120.0  # seconds per test
DEFAULT_BUDGET = 570.0  # seconds for one invocation: one device call is at most 600 s
CHUNK_TARGET = 400.0  # estimated seconds of tests per chunk (about 8 minutes with the build and slack)
EST_DEFAULT, EST_MODEL = 3.0, 20.0  # estimated seconds of a test without a measured duration
DURATIONS = ROOT / "scripts" / "gpu_suite_durations.json"  # measured {node id: seconds} (optional)
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "timeout", "crashed", "not_run")


# ---------------------------------------------------------------- the pytest plugin


def _append(path: str, record: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


_STACKS = []
_CFG: dict[str, str | None] = {}


def pytest_configure(config):
    # read once and taken out of the environment, so that a test that starts a pytest of its own
    # does not record into (or select from) the suite's files
    for name in ("GPU_SUITE_RECORDS", "GPU_SUITE_SELECT", "GPU_SUITE_COLLECT"):
        _CFG[name] = os.environ.pop(name, None)
    path = _CFG["GPU_SUITE_RECORDS"]
    if path:
        # the runner's watchdog sends SIGUSR1 before it kills a hung pytest: the stacks of all threads,
        # dumped from C even while the main thread waits inside a CUDA call, into a file beside the
        # records (pytest's capture owns stderr)
        _STACKS.append(open(path + ".stacks", "a"))
        faulthandler.register(signal.SIGUSR1, file=_STACKS[0], all_threads=True)


def pytest_collection_modifyitems(config, items):
    select = _CFG.get("GPU_SUITE_SELECT")
    if not select:
        return
    wanted = set(json.loads(Path(select).read_text()))
    keep = [it for it in items if it.nodeid in wanted]
    drop = [it for it in items if it.nodeid not in wanted]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_collection_finish(session):
    path = _CFG.get("GPU_SUITE_COLLECT")
    if path:
        tests = [{"nodeid": it.nodeid, "file": str(it.path), "markers": sorted({m.name for m in it.iter_markers()})} for it in session.items]
        Path(path).write_text(json.dumps(tests))


def pytest_runtest_logstart(nodeid, location):
    path = _CFG.get("GPU_SUITE_RECORDS")
    if path:
        _append(path, {"event": "start", "nodeid": nodeid, "t": time.time()})


_PHASES: dict[str, list] = {}


def pytest_runtest_logreport(report):
    path = _CFG.get("GPU_SUITE_RECORDS")
    if not path:
        return
    phases = _PHASES.setdefault(report.nodeid, [])
    lr = report.longrepr
    text = "" if lr is None or report.passed else str(lr[2]) if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    phases.append((report.when, report.outcome, float(report.duration), text, bool(getattr(report, "wasxfail", ""))))
    if report.when != "teardown":
        return
    del _PHASES[report.nodeid]
    outcome, message = "passed", ""
    for when, out, _, txt, xfail in phases:
        if out == "failed":
            outcome = "failed" if when == "call" else "error"
            message = txt
            if "Timeout" in txt and "pytest-timeout" in txt:  # its signal method fails the test
                outcome = "timeout"
            break
        if out == "skipped":
            outcome, message = ("xfailed" if xfail else "skipped"), txt
            break
    _append(path, {"event": "finish", "nodeid": report.nodeid, "outcome": outcome, "duration_s": round(sum(p[2] for p in phases), 3),
                   "message": message[-4000:], "t": time.time()})


# ---------------------------------------------------------------- collection and chunks


def base_cmd(python: str) -> list[str]:
    return [python, "-m", "pytest", "-p", "gpu_suite", "-p", "no:cacheprovider"]


def suite_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    paths = [str(ROOT / "scripts"), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def collect(args, workdir: Path) -> list[dict]:
    """The tests of ``-m MARKER`` in ``args.paths``, in pytest's order."""
    out = workdir / "collected.json"
    cmd = base_cmd(args.python) + ["--collect-only", "-q", "--continue-on-collection-errors", "-m", args.marker, *args.paths]
    res = subprocess.run(cmd, cwd=ROOT, env=suite_env({"GPU_SUITE_COLLECT": str(out)}), capture_output=True, text=True)
    if res.returncode not in (0, 5) or not out.exists():
        sys.stderr.write(res.stdout[-4000:] + res.stderr[-4000:])
        raise SystemExit(f"gpu_suite: collecting the tests failed (pytest exit {res.returncode})")
    return json.loads(out.read_text())


def estimates(tests: list[dict], durations: dict) -> list[float]:
    return [float(durations.get(t["nodeid"], EST_MODEL if "model" in t["markers"] else EST_DEFAULT)) for t in tests]


def load_durations(path: str | None) -> dict:
    """{node id: seconds} from a summary.json of an earlier run or a plain mapping (default:
    scripts/gpu_suite_durations.json where it exists)."""
    p = Path(path) if path else DURATIONS
    if not p.exists():
        if path:
            raise SystemExit(f"gpu_suite: no durations file {p}")
        return {}
    data = json.loads(p.read_text())
    if isinstance(data, dict) and "tests" in data:
        return {t["nodeid"]: t["duration_s"] for t in data["tests"] if t.get("outcome") in ("passed", "failed", "skipped")}
    return {str(k): float(v) for k, v in data.items()}


def split_chunks(est: list[float], n: int) -> list[list[int]]:
    """Indices of the tests in ``n`` contiguous chunks of about equal estimated time (pytest's order
    kept, so a file's tests and its module fixtures stay together where the cut allows)."""
    total = sum(est)
    chunks: list[list[int]] = [[] for _ in range(n)]
    acc = 0.0
    for i, e in enumerate(est):
        k = min(n - 1, int((acc + e / 2) * n / total)) if total > 0 else i * n // max(len(est), 1)
        chunks[k].append(i)
        acc += e
    return chunks


def parse_chunk(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"gpu_suite: --chunk takes I/N (e.g. 1/3), got {text!r}") from None
    if not 1 <= i <= n:
        raise SystemExit(f"gpu_suite: --chunk {text}: I must be between 1 and N")
    return i, n


# ---------------------------------------------------------------- running a chunk


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return out


def timeout_available(python: str) -> bool:
    if os.environ.get("GPU_SUITE_NO_PYTEST_TIMEOUT", "0") not in ("", "0"):  # the watchdog alone (tests/test_gpu_suite.py)
        return False
    res = subprocess.run([python, "-c", "import pytest_timeout"], capture_output=True, env=suite_env())
    return res.returncode == 0


class Log:
    """Everything the chunks print, to stdout (the device tool shows its tail) and to one log file."""

    def __init__(self, path: Path):
        self.fh = open(path, "a", encoding="utf-8", errors="replace")

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self.fh.write(text)
        self.fh.flush()


def run_pytest(args, files: list[str], select: Path, records: Path, log: Log, deadline: float, has_timeout: bool) -> tuple[int | None, str, str]:
    """One pytest over the selected tests; a watchdog kills it when a test outlives the timeout
    (plus a grace for pytest-timeout's own report) or the budget runs out. Returns (exit code or
    None when killed, why it was killed, what pytest printed)."""
    cmd = base_cmd(args.python) + ["-m", args.marker, "-rfE", "-v", "--continue-on-collection-errors"]
    if has_timeout:
        cmd += [f"--timeout={args.timeout:g}", "--timeout-method=thread"]
    else:
        cmd += ["-p", "no:timeout"]  # absent, or left out: no half-configured plugin
    cmd += files
    env = suite_env({"GPU_SUITE_RECORDS": str(records), "GPU_SUITE_SELECT": str(select)})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)

    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            log.write(line)
            lines.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    limit = args.timeout + (30.0 if has_timeout else 0.0)
    killed = ""
    while proc.poll() is None:
        time.sleep(0.5)
        now = time.time()
        recs = read_records(records)
        running = None
        done = {r["nodeid"] for r in recs if r["event"] == "finish"}
        for r in recs:
            if r["event"] == "start" and r["nodeid"] not in done:
                running = r
        if now >= deadline:
            killed = "budget"
        elif running is not None and now - running["t"] > limit:
            killed = "timeout"
        if killed:
            log.write(f"\ngpu_suite: {'the time budget ran out' if killed == 'budget' else 'a test outlived its timeout'}: dumping stacks, then killing pytest\n")
            with_signal(proc, signal.SIGUSR1)
            time.sleep(2)
            with_signal(proc, signal.SIGKILL)
            proc.wait()
            break
    reader.join(timeout=10)
    return (None if killed else proc.returncode), killed, "".join(lines)


def with_signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_chunk(args, label: str, tests: list[dict], work: Path, log: Log, deadline: float, has_timeout: bool) -> dict:
    """Run ``tests`` to the end: after a killed pytest (a hang, a crash) the test it was running is
    recorded and a fresh pytest takes the rest. Returns the chunk's results."""
    work = work / label
    work.mkdir(parents=True, exist_ok=True)
    records = work / "records.jsonl"
    records.unlink(missing_ok=True)
    results: dict[str, dict] = {}
    order = [t["nodeid"] for t in tests]
    file_of = {t["nodeid"]: t["file"] for t in tests}
    started = time.time()
    log.write(f"\n=== gpu_suite chunk {label}: {len(order)} tests ===\n")
    while True:
        left = [n for n in order if n not in results]
        if not left:
            break
        if time.time() >= deadline:
            for n in left:
                results[n] = {"outcome": "not_run", "duration_s": 0.0, "message": "the suite's time budget ran out before it"}
            break
        select = work / "select.json"
        select.write_text(json.dumps(left))
        files = sorted({file_of[n] for n in left})
        before = len(results)
        code, killed, printed = run_pytest(args, files, select, records, log, deadline, has_timeout)
        stacks = Path(str(records) + ".stacks")
        if stacks.exists() and stacks.stat().st_size:
            dump = stacks.read_text(errors="replace")[-20000:]
            printed += dump
            log.write("gpu_suite: stacks of the killed pytest:\n" + dump + "\n")
        stacks.unlink(missing_ok=True)
        recs = read_records(records)
        begun = {}
        for r in recs:
            if r["event"] == "finish":
                results[r["nodeid"]] = {k: r[k] for k in ("outcome", "duration_s", "message")}
            elif r["event"] == "start":
                begun[r["nodeid"]] = r["t"]
        hung = [n for n in begun if n not in results]
        for n in hung:  # started, never finished: the process was ended under it
            ran = time.time() - begun[n]
            if killed == "budget":
                outcome, why = "not_run", f"the suite's time budget ran out while it ran ({ran:.0f} s)"
            elif killed == "timeout" or ran >= args.timeout - 1:
                outcome, why = "timeout", f"still running after {args.timeout:g} s; pytest was ended (stacks in the log)"
            else:
                outcome, why = "crashed", f"the pytest process ended (exit {code}) {ran:.0f} s into it"
            at = printed.rfind("::" + n.split("::")[-1])  # its line in -v output, then the stacks
            tail = printed[at:][-6000:] if at >= 0 else printed[-6000:]
            results[n] = {"outcome": outcome, "duration_s": round(ran, 3), "message": f"{tail}\n{why}"}
            log.write(f"gpu_suite: {n}: {outcome}: {why}\n")
        records.unlink(missing_ok=True)
        if len(results) == before:  # pytest ran none of them: an import error, a bad option
            for n in left:
                results[n] = {"outcome": "not_run", "duration_s": 0.0, "message": f"pytest exited ({code}) without running it; see the log"}
            break
    tests_out = [{"nodeid": n, "chunk": label, **results[n]} for n in order]
    return {"chunk": label, "wall_s": round(time.time() - started, 1), "tests": tests_out}


# ---------------------------------------------------------------- outputs


def counts(tests: list[dict]) -> dict:
    c = {k: 0 for k in OUTCOMES}
    for t in tests:
        c[t["outcome"]] = c.get(t["outcome"], 0) + 1
    c["total"] = len(tests)
    return c


def write_junit(path: Path, label: str, tests: list[dict]) -> None:
    """JUnit XML of one chunk (timeouts and crashes as failures of type timeout / crashed)."""
    c = counts(tests)
    suite = ET.Element("testsuite", name=f"kvtool gpu suite, chunk {label}", tests=str(c["total"]),
                       failures=str(c["failed"] + c["timeout"] + c["crashed"]), errors=str(c["error"]),
                       skipped=str(c["skipped"] + c["xfailed"] + c["not_run"]), time=f"{sum(t['duration_s'] for t in tests):.3f}")
    for t in tests:
        path_part, _, name = t["nodeid"].partition("::")
        case = ET.SubElement(suite, "testcase", classname=path_part.replace("/", ".").removesuffix(".py"), name=name, time=f"{t['duration_s']:.3f}")
        msg = t.get("message") or ""
        first = msg.strip().splitlines()[-1][:500] if msg.strip() else t["outcome"]
        if t["outcome"] in ("failed", "timeout", "crashed"):
            ET.SubElement(case, "failure", type=t["outcome"], message=first).text = msg
        elif t["outcome"] == "error":
            ET.SubElement(case, "error", message=first).text = msg
        elif t["outcome"] in ("skipped", "xfailed", "not_run"):
            ET.SubElement(case, "skipped", type=t["outcome"], message=first)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def commit() -> str:
    if os.environ.get("KVTOOL_COMMIT"):
        return os.environ["KVTOOL_COMMIT"]
    if (ROOT / "COMMIT").is_file():
        return (ROOT / "COMMIT").read_text().strip()
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(args, log: Log, build: bool) -> dict:
    """Device, versions and (build) the CUDA extensions, by ``kvtool env [--build-kernels] --json``
    in a process of its own (the runner never holds a CUDA context)."""
    cmd = [args.python, "-m", "kvtool", "env", "--json"] + (["--build-kernels"] if build else [])
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env=suite_env(), capture_output=True, text=True)
    log.write(res.stderr)
    try:
        doc = json.loads(res.stdout)
    except ValueError:
        doc = {"error": {"message": (res.stdout + res.stderr).strip()[-2000:]}}
    pk = doc.get("packages") or {}
    env = {"device": (doc.get("device") or {}).get("name"), "device_info": doc.get("device"), "torch": pk.get("torch"), "triton": pk.get("triton"),
           "cuda": doc.get("cuda_version"), "python": doc.get("python"), "commit": commit()}
    if build:
        env["kernel_build"] = {"seconds": round(time.time() - t0, 1), "kernels": doc.get("kernels"), "error": (doc.get("error") or {}).get("message")}
        if env["kernel_build"]["error"]:
            log.write(f"gpu_suite: building the CUDA extensions failed: {env['kernel_build']['error']}\n")
        else:
            log.write(f"gpu_suite: CUDA extensions ready in {env['kernel_build']['seconds']:.0f} s: {doc.get('kernels')}\n")
    return env


def summary(env: dict, chunks: list[dict], args, has_timeout: bool, wall: float) -> dict:
    tests = [t for c in chunks for t in c["tests"]]
    return {"schema": SCHEMA, **env, "marker": args.marker, "timeout_s": args.timeout,
            "per_test_timeout": "pytest-timeout (thread) + watchdog" if has_timeout else "watchdog only (pytest-timeout missing)",
            "dry_run": bool(args.dry), "wall_s": round(wall, 1), "counts": counts(tests),
            "chunks": [{"chunk": c["chunk"], "wall_s": c["wall_s"], "counts": counts(c["tests"])} for c in chunks], "tests": tests}


def print_counts(doc: dict) -> None:
    c = doc["counts"]
    bad = [t for t in doc["tests"] if t["outcome"] in ("failed", "error", "timeout", "crashed", "not_run")
           and not (doc.get("dry_run") and "dry run: collected" in (t.get("message") or ""))]
    for t in bad:
        print(f"  {t['outcome'].upper():8s} {t['nodeid']}  ({(t.get('message') or '').strip().splitlines()[-1][:160] if (t.get('message') or '').strip() else ''})")
    print(f"gpu suite on {doc.get('device') or 'no GPU'} (torch {doc.get('torch')}, triton {doc.get('triton')}, commit {str(doc.get('commit'))[:12]}): "
          f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, {c['timeout']} timeouts, {c['error']} errors, "
          f"{c['crashed']} crashed, {c['not_run']} not run in {doc['wall_s']:.0f} s")


def merge(paths: list[str], out: Path) -> dict:
    """One summary of several runs' summary.json (chunks run as separate calls)."""
    docs = []
    for p in paths:
        f = Path(p) / "summary.json" if Path(p).is_dir() else Path(p)
        docs.append(json.loads(f.read_text()))
    first = dict(docs[0])
    chunks, tests, seen = [], [], set()
    for d in docs:
        for k in ("device", "torch", "triton", "cuda", "commit"):
            if d.get(k) != first.get(k):
                first[k] = f"{first.get(k)} / {d.get(k)}" if str(d.get(k)) not in str(first.get(k)) else first[k]
        chunks += d["chunks"]
        for t in d["tests"]:
            if t["nodeid"] not in seen:
                seen.add(t["nodeid"])
                tests.append(t)
    first.update(chunks=chunks, tests=tests, counts=counts(tests), wall_s=round(sum(d["wall_s"] for d in docs), 1), merged_from=[str(p) for p in paths])
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(first, indent=1) + "\n")
    return first


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_suite", description="the gpu suite in chunks (scripts/gpu_suite.sh)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true", help="print the chunk assignment and estimates")
    mode.add_argument("--chunk", help="run chunk I of N, e.g. 1/3")
    mode.add_argument("--all", action="store_true", help="run every chunk, one after another, within --budget")
    mode.add_argument("--merge", nargs="+", metavar="DIR", help="merge the summary.json of several runs into OUT/summary.json")
    ap.add_argument("--chunks", type=int, default=0, help="N for --list / --all (default: estimated time / %d s)" % CHUNK_TARGET)
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("GPU_SUITE_TIMEOUT") or DEFAULT_TIMEOUT), help="seconds per test")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("GPU_SUITE_BUDGET") or DEFAULT_BUDGET), help="seconds for this whole run")
    ap.add_argument("--marker", default="gpu", help="pytest -m expression (default gpu)")
    ap.add_argument("--durations", help="measured durations: an earlier summary.json or {node id: seconds}")
    ap.add_argument("--no-build", action="store_true", help="do not build the CUDA extensions up front")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("paths", nargs="*", default=["tests"], help="test files or folders (default tests)")
    args = ap.parse_args(argv)
    args.dry = os.environ.get("GPU_SUITE_DRY", "0") not in ("", "0")
    t0 = time.time()
    deadline = t0 + args.budget
    out = Path(os.environ.get("OUT") or ROOT / "out" / "gpu-suite")
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        doc = merge(args.merge, out)
        print_counts(doc)
        return 0 if ok(doc) else 1

    work = Path(tempfile.mkdtemp(prefix="gpu-suite-"))  # scratch outside $OUT: at most 8 files come back from a device call
    try:
        return run(args, out, work, t0, deadline)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, out: Path, work: Path, t0: float, deadline: float) -> int:
    tests = collect(args, work)
    est = estimates(tests, load_durations(args.durations))
    if args.chunk:
        i, n = parse_chunk(args.chunk)
    else:
        i, n = 0, args.chunks or max(1, math.ceil(sum(est) / CHUNK_TARGET))
    parts = split_chunks(est, n)
    if args.list:
        for k, idx in enumerate(parts, 1):
            print(f"chunk {k}/{n}: {len(idx)} tests, about {sum(est[j] for j in idx):.0f} s")
            for j in idx:
                print(f"  {tests[j]['nodeid']}  ~{est[j]:.0f} s")
        print(f"{len(tests)} tests of -m {args.marker!r} in {n} chunks, about {sum(est):.0f} s (run: bash scripts/gpu_suite.sh --chunk 1/{n})")
        return 0

    log = Log(out / "suite.log")
    has_timeout = timeout_available(args.python)
    if not has_timeout:
        log.write("gpu_suite: pytest-timeout is not installed: a hung test is ended by the watchdog alone, without a pytest stack "
                  "(scripts/gpu_suite.sh's header says how to carry its wheel)\n")
    env = environment(args, log, build=not args.dry and not args.no_build)
    wanted = [i] if i else list(range(1, n + 1))
    chunks = []
    for k in wanted:
        label = f"{k}-of-{n}"
        chunk_tests = [tests[j] for j in parts[k - 1]]
        if args.dry:
            res = dry_chunk(args, label, chunk_tests, work, log)
        else:
            res = run_chunk(args, label, chunk_tests, work, log, deadline, has_timeout)
        write_junit(out / f"chunk-{label}.xml", label, res["tests"])
        chunks.append(res)
    doc = summary(env, chunks, args, has_timeout, time.time() - t0)
    (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    print_counts(doc)
    print(f"gpu_suite: wrote {out / 'summary.json'} and {len(chunks)} JUnit file(s) under {out}")
    return 0 if ok(doc) else 1


def dry_chunk(args, label: str, tests: list[dict], work: Path, log: Log) -> dict:
    """GPU_SUITE_DRY=1: the chunk's node ids collected again through the selection a run uses (so a
    node id that does not resolve shows), nothing run; every test recorded as not run."""
    select = work / f"select-{label}.json"
    select.write_text(json.dumps([t["nodeid"] for t in tests]))
    got = work / f"collected-{label}.json"
    files = sorted({t["file"] for t in tests})
    cmd = base_cmd(args.python) + ["--collect-only", "-q", "-m", args.marker, *files] if files else []
    if cmd:
        res = subprocess.run(cmd, cwd=ROOT, env=suite_env({"GPU_SUITE_SELECT": str(select), "GPU_SUITE_COLLECT": str(got)}), capture_output=True, text=True)
        log.write(f"=== gpu_suite chunk {label} (dry): pytest --collect-only exit {res.returncode}\n")
        found = {t["nodeid"] for t in json.loads(got.read_text())} if got.exists() else set()
    else:
        found = set()
    out = []
    for t in tests:
        msg = "dry run: collected, not run" if t["nodeid"] in found else "dry run: the node id did not resolve"
        out.append({"nodeid": t["nodeid"], "chunk": label, "outcome": "not_run", "duration_s": 0.0, "message": msg})
    return {"chunk": label, "wall_s": 0.0, "tests": out}


def ok(doc: dict) -> bool:
    c = doc["counts"]
    if doc.get("dry_run"):
        return all("did not resolve" not in (t.get("message") or "") for t in doc["tests"])
    return c["failed"] + c["error"] + c["timeout"] + c["crashed"] + c["not_run"] == 0


if __name__ == "__main__":
    sys.exit(main())
