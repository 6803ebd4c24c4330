"""kvtool's CUDA extensions, built ahead of use: all of them at once, each in a process of its own
(so their nvcc runs overlap), into the verified cache of :func:`.common.cuda_extension` (one build
per machine, kernel version and GPU type; a build holds an flock on its folder, which the OS
releases when a builder is killed). ``kvtool env --build-kernels`` runs :func:`build_extensions`,
so that a benchmark, a server or a test run never pays the first-use build (about a minute each).

:func:`toolchain_problem` says, in one line, why this machine cannot build them (None when it can).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from kvtool.core import settings
from kvtool.core.errors import BadDataError, UsageError

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def known_extensions() -> dict[str, Callable[[], Any]]:
    """``{name: function that builds (or finds) and loads it}`` for every CUDA extension of kvtool."""
    from kvtool.kernels import bitmap_prune_encode, bitmap_sparse_attention, kivi_attention  # deferred: they import Triton

    return {"bitmap_sparse_attention": bitmap_sparse_attention._cuda_extension, "bitmap_prune_encode": bitmap_prune_encode._cuda_extension,
            "kivi_decode": kivi_attention._cuda_extension}


def toolchain_problem() -> str | None:
    """Why the CUDA extensions cannot be built here (a CPU build of torch, no CUDA device, no nvcc),
    or None."""
    import torch  # deferred: start-up time of the CLI

    if torch.version.cuda is None:
        return f"no CUDA toolchain: torch {torch.__version__} is a CPU build, so kvtool's CUDA kernels cannot be built or run here"
    if not torch.cuda.is_available():
        return "no CUDA device: torch sees no GPU, and the kernels are built for the GPU in use"
    from torch.utils.cpp_extension import CUDA_HOME  # deferred: it looks for the toolkit when imported

    nvcc = Path(CUDA_HOME) / "bin" / "nvcc" if CUDA_HOME else None
    if not ((nvcc and nvcc.exists()) or shutil.which("nvcc")):
        return "no CUDA toolchain: nvcc was not found (set CUDA_HOME to the CUDA toolkit's folder)"
    return None


def build_extensions(names: list[str] | None = None) -> list[dict[str, Any]]:
    """Build (or find built) ``names`` (default: every extension), each in a subprocess, all at once.
    Returns one record per extension: name, status (``built`` by this call or ``cached``) and
    seconds. UsageError where :func:`toolchain_problem` finds one; BadDataError naming the first
    extension whose build failed."""
    problem = toolchain_problem()
    if problem:
        raise UsageError(problem)
    known = known_extensions()
    names = list(known) if names is None else names
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"unknown CUDA extension {unknown[0]!r}; kvtool has {', '.join(known)}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               KVTOOL_BUILD_NOTES="1" if settings.notes else "0")
    procs = {n: subprocess.Popen([sys.executable, "-m", "kvtool.kernels.extensions", n], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for n in names}
    out, failed = [], []
    for name, proc in procs.items():
        stdout, stderr = proc.communicate()
        if settings.notes:  # the builds' notes ("compiling ..."), not under --json / -q
            sys.stderr.write(stderr)
        try:
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            failed.append((name, (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]))
    if failed:
        raise BadDataError(f"building the CUDA extension {failed[0][0]} failed: {failed[0][1]}")
    return out


def _build_one(name: str) -> dict[str, Any]:
    """Build or load one extension in this process (the subprocess of :func:`build_extensions`)."""
    from kvtool.kernels import common  # deferred: only the subprocess needs it

    started = time.monotonic()
    known_extensions()[name]()
    built = name in common.BUILT_HERE
    return {"name": name, "status": "built" if built else "cached", "seconds": round(time.monotonic() - started, 1)}


if __name__ == "__main__":
    settings.notes = os.environ.get("KVTOOL_BUILD_NOTES", "1") != "0"
    try:
        print(json.dumps(_build_one(sys.argv[1])), flush=True)
    except Exception as exc:  # one line for the parent, which names the extension
        print(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}", file=sys.stderr)
        sys.exit(1)
