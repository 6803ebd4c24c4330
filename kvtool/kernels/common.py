"""Helpers shared by the kernels: device checks before launch, the split count, the dot-product
precision flags, the flash-decoding combine of split partials, and :func:`cuda_extension`, which
builds a CUDA extension on first use in a private, verified cache."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import shutil
import stat
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol

import torch

from kvtool.core import settings
from kvtool.core.errors import BadDataError, UsageError
from kvtool.core.cache import LayerKV


class EncodedLike(Protocol):
    """What a kernel wrapper reads of an encoded layer: its named tensors and metadata. Kernels take
    this shape, never a format class, so they sit below the formats."""

    tensors: Mapping[str, torch.Tensor]
    meta: Mapping[str, Any]

LOG2E = 1.4426950408889634
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def check_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, CUDA or (under ``TRITON_INTERPRET=1``) CPU; UsageError naming the
    first tensor that is not."""
    device = None
    for name, t in tensors.items():
        if device is None:
            device = t.device
            if device.type != "cuda" and not interpreting():
                raise UsageError(f"{name} is on {device}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
        elif t.device != device:
            raise UsageError(f"{name} is on {t.device} but the other inputs are on {device}")
    assert device is not None
    return device


def check_query(q: torch.Tensor, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """q must be ``[batch, a multiple of kv_heads, Tq, head_dim]`` in ``dtype``."""
    if q.ndim != 4 or q.shape[0] != batch or q.shape[1] % kv_heads or q.shape[3] != head_dim or q.shape[1] == 0:
        raise UsageError(f"q has shape {list(q.shape)}; expected [{batch}, a multiple of {kv_heads} heads, query_tokens, {head_dim}]")
    if q.dtype != dtype:
        raise UsageError(f"q is {q.dtype} but the cache is {dtype}")
    if dtype not in KERNEL_DTYPES:
        raise UsageError(f"dtype {dtype} is not supported by the kernels (float16, bfloat16, float32)")


def dot_flags(dtype: torch.dtype, device: torch.device) -> tuple[str, bool]:
    """(input precision, upcast): float32 runs IEEE products; the CPU interpreter computes bfloat16
    ``tl.dot`` wrongly, so there bfloat16 operands are upcast to float32."""
    upcast = dtype == torch.bfloat16 and device.type != "cuda"
    return ("ieee" if dtype == torch.float32 or upcast else "tf32"), upcast


_EXTENSIONS: dict[str, Any] = {}
BUILT_HERE: set[str] = set()  # extensions this process compiled (not found built): kvtool env --build-kernels reports them
MANIFEST = "kvtool-build.json"
LOCK = "kvtool-build.lock"
# how long to wait for another process building the same extension (KVTOOL_CUDA_BUILD_WAIT overrides)
BUILD_WAIT_S = 900.0
# what a build of one extension takes on a typical GPU machine (nvcc for one architecture)
BUILD_TIME_HINT = "about 1 to 2 minutes"


def cuda_cache_root() -> Path:
    """``$KVTOOL_CACHE/cuda-ext`` (default ``~/.cache/kvtool/cuda-ext``)."""
    return Path(os.environ.get("KVTOOL_CACHE") or Path.home() / ".cache" / "kvtool") / "cuda-ext"


def private_folder(path: Path) -> Path:
    """``path`` as a folder only its owner can use: created with mode 0700 (parents as usual);
    BadDataError if it is a symlink or not a folder, or belongs to another user (someone else's
    folder could hold a library of their making); group/other permissions of a folder of ours are
    removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise BadDataError(f"{path} is not a folder (a symlink or a file); remove it, or set KVTOOL_CACHE to a folder of your own")
    if st.st_uid != os.geteuid():
        raise BadDataError(f"{path} belongs to user id {st.st_uid}, not to you ({os.geteuid()}): kvtool builds and loads CUDA extensions only in a "
                           "folder of your own; set KVTOOL_CACHE to one")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_inputs(name: str, sources: list[Path], flags: list[str], arch: str) -> str:
    """sha256 of everything a build depends on: the sources (every ``.cu``/``.cuh`` beside the first
    one that shares its stem, and the listed ones), the compiler flags, the GPU architecture, and the
    torch, CUDA and Python versions the library links against."""
    first = sources[0]
    files = sorted({*first.parent.glob(f"{first.stem}*.cu*"), *sources})
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    for part in (name, *flags, arch, torch.__version__, str(torch.version.cuda), sysconfig.get_config_var("EXT_SUFFIX") or ""):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


@contextlib.contextmanager
def _build_lock(folder: Path, name: str) -> Iterator[None]:
    """Hold ``folder/kvtool-build.lock`` (an flock: released by the kernel when its holder dies, so
    a killed build leaves no stale lock); wait at most ``KVTOOL_CUDA_BUILD_WAIT`` seconds (default
    900) for another process building the same extension, then BadDataError naming it."""
    import fcntl

    wait = float(os.environ.get("KVTOOL_CUDA_BUILD_WAIT") or BUILD_WAIT_S)
    path = folder / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        deadline = time.monotonic() + wait
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                if time.monotonic() >= deadline:
                    raise BadDataError(f"the CUDA extension {name} is being built by another process (pid {holder}) in {folder} for longer than "
                                       f"{wait:.0f} s; wait for it or stop it (KVTOOL_CUDA_BUILD_WAIT sets how long kvtool waits)") from None
                if not told:
                    note(f"kvtool: waiting for another process (pid {holder}) that is building the CUDA extension {name} in {folder}")
                    told = True
                time.sleep(min(0.5, max(deadline - time.monotonic(), 0.01)))
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def note(text: str) -> None:
    """A one-line note on stderr (not under ``-q`` or ``--json``: :data:`kvtool.core.settings.notes`)."""
    if settings.notes:
        print(text, file=sys.stderr, flush=True)



def _verified(folder: Path, so: Path, inputs: str) -> bool:
    """True when ``folder`` holds the library a build of ``inputs`` wrote, unchanged since: the
    manifest the build wrote names these inputs and the library's sha256."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return manifest.get("inputs_sha256") == inputs and so.is_file() and manifest.get("library_sha256") == _sha256(so)
    except (OSError, ValueError, AttributeError):
        return False


def _clear(folder: Path) -> None:
    """Remove everything in ``folder`` but the build lock (a failed, foreign or stale build)."""
    for entry in folder.iterdir():
        if entry.name == LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _build(module: str, sources: list[Path], cuda_flags: list[str], folder: Path) -> Any:
    """Compile and import the extension with ``torch.utils.cpp_extension.load`` (nvcc + ninja)."""
    from torch.utils.cpp_extension import load

    return load(name=module, sources=[str(s) for s in sources], extra_cuda_cflags=cuda_flags, build_directory=str(folder), verbose=False)


def _import(module: str, so: Path) -> Any:
    """Import the verified library ``so`` as ``module``."""
    spec = importlib.util.spec_from_file_location(module, so)
    if spec is None or spec.loader is None:
        raise BadDataError(f"{so}: cannot be imported")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_flags(extra_cflags: tuple[str, ...], arch: str) -> list[str]:
    """nvcc's flags for one GPU architecture (``"90"``): the extension's own, ``-lineinfo`` (so that
    compute-sanitizer and ncu name the source line of a report; the code generated is the same) and
    the one ``-gencode``."""
    return [*extra_cflags, "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def cuda_extension(name: str, sources: list[Path], extra_cflags: tuple[str, ...] = ("-O3",)) -> Any:
    """A CUDA extension compiled on first use for this GPU and loaded once per process.

    Built with ``torch.utils.cpp_extension.load`` (nvcc + ninja) in ``$KVTOOL_CACHE/cuda-ext/NAME-KEY``
    (:func:`cuda_cache_root`), KEY from :func:`build_inputs`. Both folders are private
    (:func:`private_folder`: mode 0700, owned by the user). A build holds an flock on the folder
    (another process building the same extension is waited for, at most ``KVTOOL_CUDA_BUILD_WAIT``
    seconds), says on stderr that it compiles and about how long it takes, and writes a manifest of
    its inputs' hash and the library's sha256. A library is imported only if the manifest matches;
    anything else in the folder (a library no build of these inputs wrote, a changed one, a stale
    lock of torch's) is removed and the extension is built afresh."""
    if name in _EXTENSIONS:
        return _EXTENSIONS[name]
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    flags = build_flags(extra_cflags, arch)
    inputs = build_inputs(name, sources, flags, arch)
    key = inputs[:16]
    folder = private_folder(private_folder(cuda_cache_root()) / f"{name}-{key}")
    module = f"kvtool_{name}_{key}"
    so = folder / f"{module}.so"
    with _build_lock(folder, name):
        if _verified(folder, so, inputs):
            _EXTENSIONS[name] = _import(module, so)
            return _EXTENSIONS[name]
        _clear(folder)
        note(f"kvtool: compiling the CUDA extension {name} for sm_{arch} ({BUILD_TIME_HINT}; once per kernel version and GPU type) in {folder}")
        started = time.monotonic()
        try:
            ext = _build(module, sources, flags, folder)
        except Exception as exc:
            log = folder / "kvtool-build-error.log"
            log.write_text(f"{type(exc).__name__}: {exc}\n")
            raise BadDataError(f"building the CUDA extension {name} failed ({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}); "
                               f"the compiler's output is in {log}") from exc
        if not so.is_file():
            raise BadDataError(f"building the CUDA extension {name} made no {so.name} in {folder}")
        manifest = {"name": name, "module": module, "inputs_sha256": inputs, "library": so.name, "library_sha256": _sha256(so),
                    "arch": f"sm_{arch}", "torch": torch.__version__, "cuda": torch.version.cuda, "seconds": round(time.monotonic() - started, 1)}
        tmp = folder / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, folder / MANIFEST)
        note(f"kvtool: built {name} in {manifest['seconds']:.0f} s")
        BUILT_HERE.add(name)
        _EXTENSIONS[name] = ext
    return _EXTENSIONS[name]


def num_splits(rows: int, items: int, device: torch.device, per_split_min: int = 1) -> int:
    """How many programs share one (batch, KV head, query) row's ``items`` (tokens or pages): about
    4 programs per SM on CUDA, 1 on the interpreter; never more than the items."""
    if items <= 0:
        return 1
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, math.ceil(4 * sms / max(rows, 1)))
    return max(1, min(want, -(-items // per_split_min)))


def merge_splits(out: torch.Tensor, lse: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of the split merge (:func:`kvtool.kernels.pages.combine_splits`). Combine split partials: out ``[B, Hkv, Tq, S, GP, D]`` float32 (normalised per split) and lse
    ``[B, Hkv, Tq, S, GP]`` (natural log, -inf for an empty split; GP >= G padded head rows) ->
    (out ``[B, H, Tq, D]``, lse ``[B, H, Tq]``) with H = ``heads`` (G = H / Hkv)."""
    b, hkv, tq, s, gp, d = out.shape
    g = heads // hkv
    out, lse = out[..., :g, :], lse[..., :g]
    total = torch.logsumexp(lse, dim=3)  # [B,Hkv,Tq,G]
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    w = torch.exp(lse - safe[:, :, :, None])
    w = torch.where(torch.isfinite(lse), w, torch.zeros_like(w))
    merged = (w[..., None] * out).sum(3)  # [B,Hkv,Tq,G,D]
    return merged.permute(0, 1, 3, 2, 4).reshape(b, heads, tq, d), total.permute(0, 1, 3, 2).reshape(b, heads, tq)


def random_decode_inputs(
    batch: int, heads: int, kv_heads: int, tokens: int, head_dim: int, dtype: torch.dtype, device, seed: int
):
    """Random keys/values ``[batch, kv_heads, tokens, head_dim]`` with one planted outlier key
    channel (channel 3, x6) as a :class:`~kvtool.core.cache.LayerKV`, and a decode query
    ``[batch, heads, 1, head_dim]``, all in ``dtype`` on ``device`` (drawn on the CPU from ``seed``,
    so every device gets the same numbers)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen)
    k[..., 3] *= 6
    v = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen)
    q = torch.randn(batch, heads, 1, head_dim, generator=gen)
    layer = LayerKV(k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype))
    return q.to(device=device, dtype=dtype), layer
