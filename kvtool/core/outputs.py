"""Writing files: the one output check, atomic writes, and the inputs of the running command.

Every kvtool writer goes through :func:`check_output` (before any work) and :func:`atomic_path`
(the write itself). Both refuse an output that is one of the command's inputs, ``--force`` or not:
the inputs are those passed in ``inputs=`` and every file the running command declared or read
(:func:`note_input`, called by the readers of :mod:`kvtool.core.io` and :mod:`kvtool.core.limits`
and, for the CLI, by :func:`kvtool.commands._common.kvtool_command` for each path argument that is
not an output). Files are compared by device and inode, so a symlink or a hard link to an input is
the input.

:func:`atomic_path` writes a temporary file beside the output, fsyncs it and renames it into place.
Without ``force`` the rename is an exclusive create (``renameat2(RENAME_NOREPLACE)``, else a hard
link, else a check just before an ordinary rename on file systems that have neither): when two
writers race for one output, the second fails instead of replacing the first one's file.

This module imports nothing heavy (no torch), so the CLI can use it at start-up.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import glob
import os
import signal
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from kvtool.core.errors import BadDataError, OutputExistsError, UsageError
from kvtool.core.sample import SAMPLE_NAME

PACKAGE_DIR = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- the running command's inputs

# (st_dev, st_ino) -> the path as given, for every regular file the running command declared or read
_INPUTS: contextvars.ContextVar[dict[tuple[int, int], str] | None] = contextvars.ContextVar("kvtool_inputs", default=None)


@contextlib.contextmanager
def command_inputs() -> Iterator[dict[tuple[int, int], str]]:
    """A scope (one command) whose inputs :func:`note_input` records and every output check consults."""
    token = _INPUTS.set({})
    try:
        yield _INPUTS.get()  # type: ignore[misc]
    finally:
        _INPUTS.reset(token)


# the files of an input folder (a --model folder) recorded at most: its own files and those of its
# subfolders, MAX_FOLDER_DEPTH deep (a Hugging Face folder keeps its weights at the top)
MAX_FOLDER_FILES = 4096
MAX_FOLDER_DEPTH = 2


def note_input(path: Any, folder: bool = False) -> None:
    """Record ``path`` as an input of the running command (if a :func:`command_inputs` scope is open;
    otherwise nothing happens): an existing regular file itself; with ``folder`` (a model folder,
    every file of which the command reads), the regular files in the folder and in its subfolders
    up to :data:`MAX_FOLDER_DEPTH` deep (at most :data:`MAX_FOLDER_FILES`), so no output can replace
    a model's weights or config."""
    seen = _INPUTS.get()
    if seen is None or not isinstance(path, (str, Path)) or not str(path):
        return
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return
    if stat.S_ISREG(st.st_mode):
        seen.setdefault((st.st_dev, st.st_ino), str(path))
    elif folder and stat.S_ISDIR(st.st_mode):
        _note_folder(Path(path), seen)


def _note_folder(folder: Path, seen: dict[tuple[int, int], str]) -> None:
    """Record the regular files of ``folder`` (bounded in depth and count; unreadable parts skipped)."""
    stack, count = [(folder, 1)], 0
    while stack and count < MAX_FOLDER_FILES:
        current, depth = stack.pop()
        try:
            entries = os.scandir(current)
        except OSError:
            continue
        with entries:
            for entry in entries:
                count += 1
                if count > MAX_FOLDER_FILES:
                    break
                try:
                    if entry.is_file():
                        est = entry.stat()
                        seen.setdefault((est.st_dev, est.st_ino), entry.path)
                    elif entry.is_dir(follow_symlinks=False) and depth < MAX_FOLDER_DEPTH:
                        stack.append((Path(entry.path), depth + 1))
                except OSError:
                    continue


def _same_file_as_input(st: os.stat_result, inputs: tuple | list) -> str | None:
    """The input (given or recorded) that is the file ``st`` describes, or None."""
    for source in inputs:
        if source is None:
            continue
        try:
            other = os.stat(source)
        except (OSError, ValueError):
            continue
        if (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino):
            return str(source)
    seen = _INPUTS.get() or {}
    return seen.get((st.st_dev, st.st_ino))


def refuse_input(path: str | Path, inputs: tuple | list = ()) -> None:
    """UsageError if ``path`` names the bundled sample (``sample:``) or an existing file that is one
    of ``inputs`` or of the running command's inputs."""
    if str(path) == SAMPLE_NAME:
        raise UsageError("'sample:' names the bundled sample, which kvtool never writes; choose another output")
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return
    source = _same_file_as_input(st, inputs)
    if source is not None:
        raise UsageError(f"the output {path} is the input {source} (the same file); choose another output")


def output_beside(source: str | Path, name: str) -> Path:
    """The default output ``name`` beside ``source``; in the current folder instead when ``source``
    lies inside the installed kvtool package (the bundled sample), which kvtool never writes into."""
    source = Path(source)
    with contextlib.suppress(OSError, ValueError):
        if source.resolve().is_relative_to(PACKAGE_DIR):
            return Path(name)
    return source.with_name(name)


# ----------------------------------------------------------------------------- the output check


def check_output(path: str | Path, force: bool, inputs: tuple[str | Path | None, ...] | list = ()) -> Path:
    """Check that ``path`` may be written; return it as a Path.

    Refused with UsageError (exit 2), ``force`` or not: ``sample:``; an output that is one of
    ``inputs`` or of the running command's inputs (:func:`note_input`; the same file by device and
    inode, so a symlink or hard link to an input counts); an existing destination that is not a
    regular file (a folder, FIFO, device, socket); a missing or read-only folder. An existing regular
    file is refused (OutputExistsError) unless ``force``."""
    refuse_input(path, inputs)
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UsageError(f"cannot check the output {path} ({exc.strerror or exc})") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{path} is a folder, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path} exists and is not a regular file (a FIFO, device or socket); choose another output")
        if not force:
            raise OutputExistsError(path)
    elif path.is_symlink():
        raise UsageError(f"{path} is a symlink to a missing file; choose another output")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise UsageError(f"the folder {parent} does not exist")
    check_can_create(parent)
    return path


def check_can_create(folder: Path) -> None:
    """UsageError unless files can be created in ``folder``: its permissions, a read-only mount and
    pseudo file systems (``/proc``, where ``os.access`` says yes) are all tried by creating and
    removing one empty temp file, so no command finds out only when it writes its results."""
    if not os.access(folder, os.W_OK):
        raise UsageError(f"the folder {folder} is not writable")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvtool-probe.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise UsageError(f"the folder {folder} cannot hold new files ({exc.strerror or exc})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def output_folder(path: str | Path, what: str = "--out-dir") -> Path:
    """Make the output folder ``path`` if missing and check files can be created in it: UsageError
    naming ``what`` for a file in its place, a folder that cannot be made (a read-only mount) or
    cannot hold files. Every command that writes a folder of results goes through here."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what} {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot make the folder ({exc.strerror or exc})") from None
    check_can_create(path)
    return path


# ----------------------------------------------------------------------------- atomic writes


_PROCESS_START = time.time()
_ACTIVE_TEMPS: set[Path] = set()
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


def _remove_temps_and_die(signum: int, frame: Any) -> None:
    """SIGTERM while a temp file is open: remove every temp file, then die of the signal as usual."""
    for tmp in list(_ACTIVE_TEMPS):
        with contextlib.suppress(OSError):
            tmp.unlink()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_sigterm_cleanup() -> None:
    """Clean up temp files on SIGTERM, unless the program set its own handler (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _remove_temps_and_die)


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove the temp files earlier writes to ``path`` left behind when they were killed
    (SIGKILL, power loss): ``.NAME.PID.*.tmp`` whose process is gone, and older ``.NAME.*.tmp``
    files without a PID that are older than this process. Returns what was removed."""
    removed = []
    folder = path.parent if str(path.parent) else Path(".")
    with contextlib.suppress(OSError):
        for tmp in folder.glob(f".{glob.escape(path.name)}.*.tmp"):
            middle = tmp.name[len(path.name) + 2 : -len(".tmp")]
            pid = middle.split(".", 1)[0]
            try:
                if pid.isdigit() and "." in middle:
                    if int(pid) == os.getpid() or _process_alive(int(pid)):
                        continue
                elif tmp.stat().st_mtime >= _PROCESS_START:
                    continue
                if stat.S_ISREG(tmp.lstat().st_mode):
                    tmp.unlink()
                    removed.append(tmp)
            except OSError:
                continue
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_NO_EXCLUSIVE_RENAME = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM}
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS, errno.EXDEV}


def _renameat2_noreplace(src: Path, dst: Path) -> bool:
    """Rename ``src`` onto ``dst`` only if ``dst`` does not exist (Linux renameat2). True when done;
    False when the system or file system cannot do it; FileExistsError when ``dst`` exists."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), str(dst))
    if err in _NO_EXCLUSIVE_RENAME:
        return False
    raise OSError(err, os.strerror(err), str(dst))


def commit(tmp: Path, path: Path, force: bool, inputs: tuple | list = ()) -> None:
    """Move the finished temp file ``tmp`` onto ``path``: refused if ``path`` is now one of the
    inputs; with ``force`` an ordinary rename (replacing what is there); without, an exclusive create
    (OutputExistsError if another writer created ``path`` meanwhile)."""
    refuse_input(path, inputs)
    if force:
        os.replace(tmp, path)
        return
    try:
        if _renameat2_noreplace(tmp, path):
            return
        try:
            os.link(tmp, path)
        except OSError as exc:
            if isinstance(exc, FileExistsError) or exc.errno not in _NO_LINKS:
                raise
            # a file system with neither: check just before the rename (a short race window remains)
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
            os.replace(tmp, path)
            return
        os.unlink(tmp)
    except FileExistsError:
        raise OutputExistsError(path, "was created by another writer while this one ran; pass --force to overwrite it") from None


@contextlib.contextmanager
def atomic_path(path: str | Path, force: bool = False, inputs: tuple | list = ()) -> Iterator[Path]:
    """Yield a temporary path in the same folder; on success fsync it and move it onto ``path``
    (:func:`commit`: never onto an input; without ``force`` only if ``path`` still does not exist).

    The temp file is ``.NAME.PID.RANDOM.tmp``. On any exception (Ctrl-C included) and on SIGTERM it
    is removed and ``path`` is untouched; temp files of killed earlier writes are removed first. A
    full disk (or quota, read-only file system, I/O error) is a BadDataError naming ``path``."""
    path = Path(path)
    remove_stale_temps(path)
    _install_sigterm_cleanup()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent or ".")
    except OSError as exc:
        raise BadDataError(f"cannot write {path} ({exc.strerror or exc})") from None
    os.close(fd)
    tmp_path = Path(tmp)
    _ACTIVE_TEMPS.add(tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            fh.flush()
            os.fsync(fh.fileno())
        commit(tmp_path, path, force, inputs)
        with contextlib.suppress(OSError):
            dir_fd = os.open(path.parent or ".", os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        if exc.errno in _WRITE_ERRNOS:
            raise BadDataError(f"cannot write {path}: {exc.strerror or exc}") from exc
        raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise
    finally:
        _ACTIVE_TEMPS.discard(tmp_path)


def atomic_write_bytes(path: str | Path, data: bytes, force: bool = False, inputs: tuple | list = ()) -> Path:
    """Write ``data`` to ``path`` atomically (never a half-written file, never onto an input)."""
    path = check_output(path, force, inputs)
    with atomic_path(path, force, inputs) as tmp:
        tmp.write_bytes(data)
    return path


def atomic_write_text(path: str | Path, text: str, force: bool = False, inputs: tuple | list = ()) -> Path:
    return atomic_write_bytes(path, text.encode(), force=force, inputs=inputs)
