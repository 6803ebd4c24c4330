"""The CUDA extension cache is private, verified before load and never waits forever (issue 34).

No GPU here: the device capability is patched and the compiler replaced by a fake build that writes
the library file a real build would, as the issue's reproduction did. Imports are recorded instead of
run, so a test sees exactly which library file would have been loaded."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtool.core import settings
from kvtool.core.errors import BadDataError, UsageError
from kvtool.kernels import common

SOURCE = Path(common.__file__).with_name("bitmap_prune_encode.cu")


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    """KVTOOL_CACHE in tmp, sm_90, a fake compiler and a recording importer."""
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(common, "_EXTENSIONS", {})
    monkeypatch.setattr(settings, "notes", True)
    state = {"builds": 0, "imports": []}

    def build(module, sources, flags, folder):
        assert not (Path(folder) / "lock").exists(), "torch's build would wait forever on this lock"
        state["builds"] += 1
        (Path(folder) / f"{module}.so").write_bytes(b"built by kvtool " + module.encode())
        return ("built", module)

    def load(module, so):
        state["imports"].append(Path(so).read_bytes())
        return ("imported", module)

    monkeypatch.setattr(common, "_build", build)
    monkeypatch.setattr(common, "_import", load)
    return state


def folder_of(name: str = "bitmap_prune_encode") -> tuple[Path, str]:
    flags = common.build_flags(("-O3",), "90")
    key = common.build_inputs(name, [SOURCE], flags, "90")[:16]
    return common.cuda_cache_root() / f"{name}-{key}", f"kvtool_{name}_{key}"


def test_cache_folders_are_private_and_a_build_says_so(fake, capsys):
    assert common.cuda_extension("bitmap_prune_encode", [SOURCE]) == ("built", folder_of()[1])
    folder, module = folder_of()
    for path in (common.cuda_cache_root(), folder):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700
    err = capsys.readouterr().err
    assert "compiling the CUDA extension bitmap_prune_encode for sm_90 (about 1 to 2 minutes" in err and "built bitmap_prune_encode in" in err
    manifest = json.loads((folder / common.MANIFEST).read_text())
    assert manifest["library_sha256"] == common._sha256(folder / f"{module}.so") and manifest["inputs_sha256"].startswith(folder.name.split("-")[-1])
    # the next process imports the verified library without building or a word on stderr
    common._EXTENSIONS.clear()
    assert common.cuda_extension("bitmap_prune_encode", [SOURCE]) == ("imported", module)
    assert fake["builds"] == 1 and fake["imports"] == [b"built by kvtool " + module.encode()]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("how", ["planted", "replaced"])
def test_a_library_no_build_wrote_is_never_imported(fake, how):
    """The issue's case: a .so planted in the predictable folder was imported without a build. Now a
    library is imported only if the manifest its build wrote names it; anything else is rebuilt."""
    folder, module = folder_of()
    if how == "planted":
        common.private_folder(common.private_folder(common.cuda_cache_root()) / folder.name)
    else:
        common.cuda_extension("bitmap_prune_encode", [SOURCE])
        common._EXTENSIONS.clear()
    (folder / f"{module}.so").write_bytes(b"planted code")
    assert common.cuda_extension("bitmap_prune_encode", [SOURCE]) == ("built", module)
    assert b"planted code" not in fake["imports"]
    assert (folder / f"{module}.so").read_bytes() != b"planted code"


def test_a_stale_torch_lock_does_not_hang_the_build(fake):
    """A `lock` file left in the build folder (a killed build, or planted) made torch wait forever."""
    folder, module = folder_of()
    common.private_folder(common.private_folder(common.cuda_cache_root()) / folder.name)
    (folder / "lock").write_text("")
    assert common.cuda_extension("bitmap_prune_encode", [SOURCE]) == ("built", module)


def test_another_users_or_a_linked_folder_is_refused(fake, tmp_path, monkeypatch):
    root = common.cuda_cache_root()
    root.parent.mkdir(parents=True)
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    root.symlink_to(elsewhere)
    with pytest.raises(BadDataError, match="not a folder"):
        common.cuda_extension("bitmap_prune_encode", [SOURCE])
    root.unlink()
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    monkeypatch.setattr(common.os, "geteuid", lambda: os.lstat(root).st_uid + 1)
    with pytest.raises(BadDataError, match="belongs to user id"):
        common.cuda_extension("bitmap_prune_encode", [SOURCE])
    assert fake["builds"] == 0 and fake["imports"] == []
    monkeypatch.undo()


def test_a_folder_of_ours_open_to_others_is_closed(fake):
    root = common.cuda_cache_root()
    root.mkdir(parents=True, mode=0o777)
    os.chmod(root, 0o777)
    common.cuda_extension("bitmap_prune_encode", [SOURCE])
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700


def test_the_wait_for_another_build_is_bounded(fake, monkeypatch):
    """Another process holds the build lock (a build running elsewhere): kvtool waits at most
    KVTOOL_CUDA_BUILD_WAIT seconds, then fails with one line naming that process."""
    folder, _ = folder_of()
    common.private_folder(common.private_folder(common.cuda_cache_root()) / folder.name)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(folder / common.LOCK)!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); os.pwrite(fd, str(os.getpid()).encode(), 0)\n"
        "print('held', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("KVTOOL_CUDA_BUILD_WAIT", "1")
        started = time.monotonic()
        with pytest.raises(BadDataError, match=f"another process \\(pid {holder.pid}\\).*longer than 1 s"):
            common.cuda_extension("bitmap_prune_encode", [SOURCE])
        assert time.monotonic() - started < 10
        assert fake["builds"] == 0
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: the kernel released its lock, nothing stale is left to wait on
    assert common.cuda_extension("bitmap_prune_encode", [SOURCE])[0] == "built"


def test_a_failed_build_is_one_line_and_leaves_no_library(fake, monkeypatch):
    def broken(module, sources, flags, folder):
        raise RuntimeError("Error building extension 'x':\n[1/3] nvcc ...\nerror: identifier undefined\n" + "frame\n" * 30)

    monkeypatch.setattr(common, "_build", broken)
    with pytest.raises(BadDataError) as info:
        common.cuda_extension("bitmap_prune_encode", [SOURCE])
    assert "\n" not in str(info.value) and "kvtool-build-error.log" in str(info.value)
    folder, module = folder_of()
    assert "identifier undefined" in (folder / "kvtool-build-error.log").read_text()
    assert not (folder / common.MANIFEST).exists()


def test_the_cache_key_follows_every_source_and_the_toolchain(tmp_path, monkeypatch):
    """A new kernel version (any .cu / .cuh of the extension, headers included), another torch or
    CUDA, or another GPU architecture is a new folder: never a stale library."""
    import shutil

    kernels = Path(common.__file__).parent
    for f in kernels.glob("bitmap_sparse_attention*.cu*"):
        shutil.copy(f, tmp_path / f.name)
    sources = [tmp_path / "bitmap_sparse_attention.cu", tmp_path / "bitmap_sparse_attention_f16.cu", tmp_path / "bitmap_sparse_attention_bf16.cu"]
    flags = ["-O3", "--use_fast_math"]
    key = common.build_inputs("bitmap_sparse_attention", sources, flags, "90")
    header = tmp_path / "bitmap_sparse_attention_mma.cuh"  # not listed: found beside the first source
    text = header.read_text()
    header.write_text(text + "\n// one more line\n")
    assert common.build_inputs("bitmap_sparse_attention", sources, flags, "90") != key
    header.write_text(text)
    assert common.build_inputs("bitmap_sparse_attention", sources, flags, "90") == key
    assert common.build_inputs("bitmap_sparse_attention", sources, flags, "100") != key
    assert common.build_inputs("bitmap_sparse_attention", sources, flags + ["-G"], "90") != key
    monkeypatch.setattr(torch.version, "cuda", "99.9")
    assert common.build_inputs("bitmap_sparse_attention", sources, flags, "90") != key
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert common.build_inputs("bitmap_sparse_attention", sources, flags, "90") != key


def test_a_builder_killed_mid_build_leaves_the_next_one_free_to_build(fake, tmp_path):
    """SIGKILL in the middle of a build (the kernel releases the flock with the process): the next
    process takes the lock at once, clears the half-built folder and builds afresh."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, torch\n"
        "from pathlib import Path\n"
        "from kvtool.kernels import common\n"
        "torch.cuda.get_device_capability = lambda *a: (9, 0)\n"
        "def slow(module, sources, flags, folder):\n"
        "    (Path(folder) / 'half-built.o').write_bytes(b'partial')\n"
        "    print('building', flush=True); time.sleep(120)\n"
        "common._build = slow\n"
        f"common.cuda_extension('bitmap_prune_encode', [Path({str(SOURCE)!r})])\n")],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(Path(common.__file__).parents[2])))
    try:
        assert child.stdout.readline().strip() == "building"
        folder, module = folder_of()
        assert (folder / "half-built.o").exists()
        os.kill(child.pid, 9)
        child.wait()
        started = time.monotonic()
        assert common.cuda_extension("bitmap_prune_encode", [SOURCE]) == ("built", module)
        assert time.monotonic() - started < 5 and fake["builds"] == 1
        assert not (folder / "half-built.o").exists() and (folder / common.MANIFEST).exists()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_env_build_kernels_says_what_is_missing(monkeypatch):
    """`kvtool env --build-kernels` where nothing can be built: exit 2 and one line naming why."""
    from typer.testing import CliRunner

    from kvtool.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["env", "--help"])
    assert res.exit_code == 0 and "--build-kernels" in res.output and "kvtool env --build-kernels --json" in res.output
    monkeypatch.setattr(torch.version, "cuda", None)
    res = runner.invoke(app, ["env", "--build-kernels", "--json"])
    assert res.exit_code == 2, res.output
    err = json.loads(res.stdout)["error"]
    assert err["type"] == "UsageError" and err["message"].startswith("no CUDA toolchain: torch") and "CPU build" in err["message"]
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["env", "--build-kernels"])
    assert res.exit_code == 2 and "no CUDA device" in res.stderr and "Traceback" not in res.output
    res = runner.invoke(app, ["env", "--json"])  # without the flag env reports, builds nothing
    assert res.exit_code == 0 and "kernels" not in json.loads(res.stdout)


def test_build_extensions_runs_the_builds_at_once_and_names_a_failure(monkeypatch):
    """kvtool env --build-kernels: one process per extension, all started before any is waited for;
    a failed build is one line naming the extension (the builds themselves need a GPU: stand-ins here)."""
    from kvtool.kernels import extensions as ext

    real_popen = subprocess.Popen
    outcome = {"a": "ok", "b": "ok"}

    def popen(cmd, **kw):
        name = cmd[-1]
        body = (f"import json, time; time.sleep(1); print(json.dumps({{'name': {name!r}, 'status': 'built', 'seconds': 1.0}}))" if outcome[name] == "ok"
                else "import sys; print('RuntimeError: nvcc failed', file=sys.stderr); sys.exit(1)")
        return real_popen([sys.executable, "-c", body], **kw)

    monkeypatch.setattr(ext, "toolchain_problem", lambda: None)
    monkeypatch.setattr(ext, "known_extensions", lambda: {"a": None, "b": None})
    monkeypatch.setattr(ext.subprocess, "Popen", popen)
    started = time.monotonic()
    got = ext.build_extensions()
    assert [g["name"] for g in got] == ["a", "b"] and time.monotonic() - started < 1.9  # together, not one after the other
    outcome["b"] = "fail"
    with pytest.raises(BadDataError, match="building the CUDA extension b failed: RuntimeError: nvcc failed"):
        ext.build_extensions()
    with pytest.raises(UsageError, match="unknown CUDA extension 'c'"):
        ext.build_extensions(["c"])
