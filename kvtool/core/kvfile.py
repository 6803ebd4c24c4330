"""kvtool's safetensors files read without torch: the header checked once per open file, tensor bytes
read in chunks by a few threads with each chunk's CRC-32 and finite-value test done as it arrives.

A :class:`KVFile` is one open file: the header is read and checked when it opens (the parsed result
of identical header bytes is reused across opens within a process), every later read goes to the
same open file, so the header and the bytes come from one version of the file even if the path is
replaced meanwhile. Readers of one command share it (``kvtool.core.streaming.LazyCapture`` keeps
one for all its layers).

Speed. A tensor is read in chunks of :data:`CHUNK` bytes, several at once on a small thread pool
(``os.preadv``, ``zlib.crc32`` and numpy release the GIL); each chunk's CRC is combined into the
tensor's (:func:`crc32_combine`) and its floating values are tested on their bits (an all-ones
exponent is NaN or infinite): no conversion, no temporary larger than a chunk, no device sync.
:func:`sha256_file` remembers a file's SHA-256 per file version (device, inode, size, mtime and
ctime) in memory and under ``$KVTOOL_CACHE/sha256``, so a capture is hashed once, not by every
command that checks it is a compressed file's source.

Nothing here imports torch: ``kvtool info`` of a capture runs on this module alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from kvtool.core import settings
from kvtool.core.errors import BadDataError
from kvtool.core.limits import MAX_HEADER_BYTES
from kvtool.core.outputs import note_input

CHECKSUM_KEY = "kvtool.checksums"
CHECKSUM_ALGORITHM = "crc32"
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1, "F64": 8}
ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "BOOL": "bool"}
# floating dtypes: (unsigned integer of the same width, exponent mask); a value is NaN or infinite
# when all its exponent bits are set, that is when its bits without the sign are at least the mask
# (float8 e4m3fn has no infinity: NaN is exponent and mantissa all ones, 0x7f)
FLOAT_BITS = {"F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80), "F32": ("<u4", 0x7F800000), "F64": ("<u8", 0x7FF0000000000000),
              "F8_E4M3": ("u1", 0x7F), "F8_E5M2": ("u1", 0x7C)}
_SCRATCH = threading.local()  # per reader thread: one chunk buffer and one work array per dtype, reused
CHUNK = 16 << 20  # bytes read, checksummed and tested per task (a multiple of every item size)


# ----------------------------------------------------------------------------- settings


def verifying_checksums() -> bool:
    return settings.verify_checksums and os.environ.get("KVTOOL_NO_VERIFY_CHECKSUMS", "") in ("", "0")


def allowing_nonfinite(allow: bool | None = None) -> bool:
    if allow is not None:
        return allow
    return settings.allow_nonfinite or os.environ.get("KVTOOL_ALLOW_NONFINITE", "") not in ("", "0")


# ----------------------------------------------------------------------------- CRC-32


def metadata_crc32(metadata: dict[str, str]) -> int:
    """CRC-32 of every metadata entry except the checksums themselves (keys sorted, JSON text)."""
    rest = {k: v for k, v in metadata.items() if k != CHECKSUM_KEY}
    return zlib.crc32(json.dumps(rest, sort_keys=True).encode())


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


_SHIFTS: dict[int, list[int]] = {}
_SHIFTS_LOCK = threading.Lock()


def _shift_operator(length: int) -> list[int]:
    """The GF(2) matrix that moves a CRC-32 register past ``length`` zero bytes (zlib's
    crc32_combine, as one matrix so that combining equal-length chunks is one product each)."""
    with _SHIFTS_LOCK:
        if length in _SHIFTS:
            return _SHIFTS[length]
    op = [1 << n for n in range(32)]  # identity
    power = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):  # one zero byte = 8 zero bits
        power = _gf2_square(power)
    n = length
    while n:
        if n & 1:
            op = [_gf2_times(power, op[k]) for k in range(32)]
        n >>= 1
        if n:
            power = _gf2_square(power)
    with _SHIFTS_LOCK:
        if len(_SHIFTS) > 64:
            _SHIFTS.clear()
        _SHIFTS[length] = op
    return op


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B)."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_shift_operator(len2), crc1) ^ crc2


# ----------------------------------------------------------------------------- finite values


def nonfinite_count(buf: Any, dtype: str) -> int:
    """How many values of safetensors dtype ``dtype`` in the raw little-endian bytes ``buf`` are NaN
    or infinite (0 for non-floating dtypes), from their exponent bits."""
    if dtype not in FLOAT_BITS:
        return 0
    import numpy as np

    view, mask = FLOAT_BITS[dtype]
    arr = np.frombuffer(buf, dtype=view)
    if not arr.size:
        return 0
    # one pass drops the sign into a reused work array, one max tells whether anything is bad
    # (both release the GIL); only then are the bad values counted
    work = _scratch_array(arr.dtype, arr.size)
    np.bitwise_and(arr, arr.dtype.type(np.iinfo(arr.dtype).max >> 1), out=work)
    if work.max() < mask:
        return 0
    return int(np.count_nonzero(work >= mask))


def _scratch_array(dtype: Any, n: int) -> Any:
    import numpy as np

    arrays = getattr(_SCRATCH, "arrays", None)
    if arrays is None:
        arrays = _SCRATCH.arrays = {}
    have = arrays.get(dtype)
    if have is None or have.size < n:
        have = arrays[dtype] = np.empty(max(n, CHUNK // dtype.itemsize), dtype=dtype)
    return have[:n]


def _scratch_buffer(n: int) -> memoryview:
    """A reusable byte buffer of this thread (no allocation or zeroing per chunk)."""
    have = getattr(_SCRATCH, "buffer", None)
    if have is None or len(have) < n:
        have = _SCRATCH.buffer = memoryview(bytearray(max(n, CHUNK)))
    return have[:n]


# ----------------------------------------------------------------------------- threads


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def workers() -> int:
    """Reader threads: the CPUs this process may use, at most 8 (KVTOOL_READ_THREADS overrides)."""
    env = os.environ.get("KVTOOL_READ_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="kvtool-read")
        return _POOL


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset``; the number of bytes read (short only at end of file)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


# ----------------------------------------------------------------------------- the header


class Header:
    """A parsed, checked safetensors header: ``meta`` (string metadata), ``entries`` ``{name: (dtype,
    shape)}``, ``spans`` ``{name: (begin, end)}`` absolute byte offsets, ``checksums`` ``{name: hex}``
    or None (no table, or checking off)."""

    def __init__(self, meta: dict[str, str], entries: dict[str, tuple[str, list[int]]], spans: dict[str, tuple[int, int]],
                 checksums: dict[str, str] | None):
        self.meta = meta
        self.entries = entries
        self.spans = spans
        self.checksums = checksums


_PARSED: OrderedDict[tuple, Header] = OrderedDict()
_PARSED_LOCK = threading.Lock()


def read_checksums(path: Path, meta: dict[str, str]) -> dict[str, str] | None:
    """``{tensor name: hex}`` from the file's ``kvtool.checksums`` (after checking the metadata's own
    checksum), or None when the file has none or checking is off. BadDataError if malformed or wrong."""
    if CHECKSUM_KEY not in meta or not verifying_checksums():
        return None
    try:
        data = json.loads(meta[CHECKSUM_KEY])
    except (json.JSONDecodeError, RecursionError):
        raise BadDataError(f"{path}: metadata {CHECKSUM_KEY!r} is not valid JSON (the header is corrupted)") from None
    if (
        not isinstance(data, dict)
        or data.get("algorithm") != CHECKSUM_ALGORITHM
        or not isinstance(data.get("tensors"), dict)
        or not all(isinstance(v, str) for v in data["tensors"].values())
    ):
        raise BadDataError(f"{path}: metadata {CHECKSUM_KEY!r} is not a {CHECKSUM_ALGORITHM} checksum table (the header is corrupted)")
    if data.get("metadata") != f"{metadata_crc32(meta):08x}":
        raise BadDataError(f"{path}: the metadata fails its checksum (the header is corrupted); --no-verify-checksums skips the check")
    return data["tensors"]


def parse_header(path: Path, raw: bytes, size: int) -> Header:
    """Check and parse header bytes ``raw`` (the JSON after the 8-byte length) of a file of ``size``
    bytes. The same bytes of the same file size parse once per process (errors are not kept)."""
    key = (str(path), size, verifying_checksums(), raw)
    with _PARSED_LOCK:
        hit = _PARSED.get(key)
        if hit is not None:
            _PARSED.move_to_end(key)
            return hit
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadDataError(f"{path}: not a safetensors file (header is not JSON)") from None
    except RecursionError:
        raise BadDataError(f"{path}: not a safetensors file (header nests too deeply)") from None
    if not isinstance(header, dict):
        raise BadDataError(f"{path}: not a safetensors file (header is not an object)")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise BadDataError(f"{path}: not a safetensors file (its metadata is not a table of strings)")
    checksums = read_checksums(path, meta)
    if checksums is not None and set(checksums) != set(header):
        odd = sorted(set(checksums) ^ set(header))[0]
        raise BadDataError(f"{path}: tensor {odd!r} is missing from the file or from {CHECKSUM_KEY} (the header is corrupted)")
    entries: dict[str, tuple[str, list[int]]] = {}
    spans: dict[str, tuple[int, int]] = {}
    base = 8 + len(raw)
    end = 0
    for name, spec in header.items():
        try:
            dt, shape, (begin, stop) = spec["dtype"], list(spec["shape"]), spec["data_offsets"]
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in [*shape, begin, stop]) or dt not in ITEMSIZE:
                raise ValueError
        except (KeyError, TypeError, IndexError, ValueError):
            raise BadDataError(f"{path}: not a safetensors file (bad entry for {name!r})") from None
        count = 1
        for n_ in shape:
            count *= n_
        if stop - begin != count * ITEMSIZE[dt]:
            raise BadDataError(f"{path}: tensor {name!r} of shape {shape} {ST_DTYPES.get(dt, dt)} needs {count * ITEMSIZE[dt]} bytes, the header gives it {stop - begin}")
        entries[name] = (dt, shape)
        spans[name] = (base + begin, base + stop)
        end = max(end, stop)
    if base + end > size:
        raise BadDataError(f"{path}: truncated: the header promises {base + end} bytes, the file has {size}")
    parsed = Header(meta, entries, spans, checksums)
    with _PARSED_LOCK:
        _PARSED[key] = parsed
        while len(_PARSED) > 32:
            _PARSED.popitem(last=False)
    return parsed


def check_regular_file(path: str | Path) -> int:
    """The size of ``path``; BadDataError unless it is an existing regular file (after symlinks)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise BadDataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadDataError(f"{path}: not a regular file")
    note_input(path)  # an input of the running command: no output may be it
    return st.st_size


class KVFile:
    """One open safetensors file with its checked header (see the module docstring).

    ``read(names)`` returns each tensor's raw bytes (a numpy uint8 array), checked against its CRC
    (when the file has checksums and checking is on) and, with ``finite``, for NaN/infinite values;
    ``crc32(name)`` streams a tensor's bytes without keeping them; ``read_rows`` reads a sub-range of
    every outer row (a tail of tokens) after checking the whole tensor's CRC."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise BadDataError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise BadDataError(f"{self.path}: is a folder, not a kvtool file")
        check_regular_file(self.path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise BadDataError(f"{self.path}: cannot read ({exc.strerror or exc})") from exc
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadDataError(f"{self.path}: not a regular file")
            self.size = st.st_size
            self.stat_key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            head = os.pread(self.fd, 8, 0)
            if len(head) < 8:
                raise BadDataError(f"{self.path}: not a safetensors file (too short)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > min(self.size - 8, MAX_HEADER_BYTES):
                raise BadDataError(f"{self.path}: not a safetensors file (bad header length)")
            raw = bytearray(n)
            if _pread_into(self.fd, memoryview(raw), 8) != n:
                raise BadDataError(f"{self.path}: not a safetensors file (too short)")
            self.raw_header = bytes(raw)
            self.header = parse_header(self.path, self.raw_header, self.size)
        except OSError as exc:
            self.close()
            raise BadDataError(f"{self.path}: cannot read ({exc.strerror or exc})") from exc
        except BaseException:
            self.close()
            raise

    # -- header facts
    @property
    def meta(self) -> dict[str, str]:
        return self.header.meta

    @property
    def entries(self) -> dict[str, tuple[str, list[int]]]:
        return self.header.entries

    @property
    def checksums(self) -> dict[str, str] | None:
        return self.header.checksums

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> "KVFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def _span(self, name: str) -> tuple[int, int]:
        if name not in self.header.spans:
            raise BadDataError(f"{self.path}: no tensor {name!r} in the file")
        return self.header.spans[name]

    # -- checks
    def check_crc(self, name: str, crc: int) -> None:
        checksums = self.header.checksums
        if checksums is None:
            return
        want = checksums.get(name)
        if want is None:
            raise BadDataError(f"{self.path}: tensor {name!r} has no checksum in {CHECKSUM_KEY} (the header is corrupted)")
        if want != f"{crc:08x}":
            raise BadDataError(f"{self.path}: tensor {name!r} fails its checksum (its bytes are corrupted); --no-verify-checksums skips the check")

    def check_nonfinite(self, name: str, bad: int) -> None:
        if bad:
            dt, shape = self.header.entries[name]
            count = 1
            for s in shape:
                count *= s
            raise BadDataError(f"{self.path}: tensor {name!r} holds {bad} NaN or infinite values of {count}; kvtool --allow-nonfinite accepts them")

    # -- reading
    def _chunks(self, begin: int, end: int) -> list[tuple[int, int]]:
        return [(o, min(o + CHUNK, end)) for o in range(begin, end, CHUNK)]

    def _run(self, tasks: list[Callable[[], Any]]) -> list[Any]:
        # inline when there is one task, or when called from a reader thread (waiting on the pool
        # from inside it could wait forever)
        if len(tasks) <= 1 or threading.current_thread().name.startswith("kvtool-read"):
            return [t() for t in tasks]
        return [f.result() for f in [pool().submit(t) for t in tasks]]

    def read(self, names: list[str], finite: bool = False, allow_nonfinite: bool | None = None,
             out: dict[str, Any] | None = None) -> dict[str, Any]:
        """``{name: numpy uint8 array}`` of the tensors' bytes, read in parallel chunks, each checked
        against its CRC (when the file has checksums and checking is on) and, with ``finite`` (and
        unless NaN/infinite values are allowed), for NaN or infinite values. ``out`` may hold
        preallocated writable byte buffers (``name -> buffer`` of the tensor's size), e.g. pinned
        host memory."""
        import numpy as np

        do_crc = self.header.checksums is not None
        do_finite = finite and not allowing_nonfinite(allow_nonfinite)
        bufs: dict[str, Any] = {}
        tasks: list[Callable[[], Any]] = []
        layout: list[tuple[str, int]] = []
        for name in names:
            begin, end = self._span(name)
            dt = self.header.entries[name][0]
            buf = out[name] if out is not None and name in out else np.empty(end - begin, dtype=np.uint8)
            if len(memoryview(buf).cast("B")) != end - begin:
                raise ValueError(f"buffer for {name} holds {len(memoryview(buf).cast('B'))} bytes, not {end - begin}")
            bufs[name] = buf
            mv = memoryview(buf).cast("B")
            for lo, hi in self._chunks(begin, end):
                tasks.append(self._chunk_task(mv[lo - begin : hi - begin], lo, dt if do_finite else None, do_crc))
                layout.append((name, hi - lo))
        results = self._run(tasks)
        crcs: dict[str, int] = {}
        bad: dict[str, int] = {}
        for (name, n), (got, crc, nonfinite) in zip(layout, results):
            if got != n:
                raise BadDataError(f"{self.path}: truncated: tensor {name!r} ends past the end of the file")
            crcs[name] = crc32_combine(crcs[name], crc, n) if name in crcs else crc
            bad[name] = bad.get(name, 0) + nonfinite
        for name in names:
            if do_crc:
                self.check_crc(name, crcs.get(name, 0))
            self.check_nonfinite(name, bad.get(name, 0))
        return bufs

    def _chunk_task(self, view: memoryview, offset: int, finite_dtype: str | None, crc: bool) -> Callable[[], tuple[int, int, int]]:
        def task() -> tuple[int, int, int]:
            got = _pread_into(self.fd, view, offset)
            part = view[:got]
            return got, zlib.crc32(part) if crc else 0, nonfinite_count(part, finite_dtype) if finite_dtype else 0
        return task

    def scan(self, names: list[str], finite: bool = False, allow_nonfinite: bool | None = None) -> None:
        """Check tensors as :meth:`read` does (CRC, and NaN/infinite values with ``finite``) without
        keeping their bytes: memory stays at a chunk per reader thread."""
        do_crc = self.header.checksums is not None
        do_finite = finite and not allowing_nonfinite(allow_nonfinite)
        if not do_crc and not do_finite:
            return
        for name in names:
            begin, end = self._span(name)
            dt = self.header.entries[name][0] if do_finite else None

            def task(lo: int, hi: int) -> tuple[int, int, int]:
                buf = _scratch_buffer(hi - lo)
                got = _pread_into(self.fd, buf, lo)
                part = buf[:got]
                return got, zlib.crc32(part) if do_crc else 0, nonfinite_count(part, dt) if dt else 0

            crc, bad = None, 0
            for (lo, hi), (got, part, nonfinite) in zip(self._chunks(begin, end), self._run([lambda lo=lo, hi=hi: task(lo, hi) for lo, hi in self._chunks(begin, end)])):
                if got != hi - lo:
                    raise BadDataError(f"{self.path}: truncated: tensor {name!r} ends past the end of the file")
                crc = part if crc is None else crc32_combine(crc, part, got)
                bad += nonfinite
            if do_crc:
                self.check_crc(name, crc or 0)
            self.check_nonfinite(name, bad)

    def crc32(self, name: str) -> int:
        """CRC-32 of tensor ``name``'s bytes as they lie in the file, streamed in parallel chunks."""
        begin, end = self._span(name)

        def task(lo: int, hi: int) -> tuple[int, int]:
            buf = _scratch_buffer(hi - lo)
            got = _pread_into(self.fd, buf, lo)
            return got, zlib.crc32(buf[:got])

        crc = None
        for got, part in self._run([lambda lo=lo, hi=hi: task(lo, hi) for lo, hi in self._chunks(begin, end)]):
            crc = part if crc is None else crc32_combine(crc, part, got)
        return crc or 0

    def verify(self, name: str) -> None:
        """Check tensor ``name``'s CRC (nothing when the file has no checksums or checking is off)."""
        if self.header.checksums is not None:
            self.check_crc(name, self.crc32(name))

    def read_rows(self, name: str, axis: int, start: int, finite: bool = False, allow_nonfinite: bool | None = None) -> tuple[Any, list[int]]:
        """Entries ``start:`` along ``axis`` of tensor ``name`` (every axis before it an outer row),
        as raw bytes (numpy uint8) and their shape; the whole tensor's CRC is checked by streaming it."""
        import numpy as np

        self.verify(name)
        dt, shape = self.header.entries[name]
        begin, _ = self._span(name)
        start = min(max(start, 0), shape[axis])
        rows = 1
        for s in shape[:axis]:
            rows *= s
        inner = ITEMSIZE[dt]
        for s in shape[axis + 1:]:
            inner *= s
        piece = (shape[axis] - start) * inner
        out = np.empty(rows * piece, dtype=np.uint8)
        mv = memoryview(out)
        for r in range(rows):
            at = begin + (r * shape[axis] + start) * inner
            if _pread_into(self.fd, mv[r * piece : (r + 1) * piece], at) != piece:
                raise BadDataError(f"{self.path}: truncated: tensor {name!r} ends past the end of the file")
        if finite and not allowing_nonfinite(allow_nonfinite):
            self.check_nonfinite(name, nonfinite_count(out, dt))
        return out, [*shape[:axis], shape[axis] - start, *shape[axis + 1:]]


def read_header(path: str | Path) -> tuple[dict[str, str], dict[str, tuple[str, list[int]]]]:
    """Metadata and ``{name: (dtype, shape)}`` of a safetensors file, without loading tensors.

    Raises BadDataError for a missing, unreadable, truncated or non-safetensors file."""
    with KVFile(path) as f:
        return f.meta, f.entries


# ----------------------------------------------------------------------------- SHA-256


_SHA_MEMO: dict[tuple, str] = {}


def _sha_cache_dir() -> Path | None:
    root = os.environ.get("KVTOOL_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(base) / "kvtool")
    folder = Path(root).expanduser() / "sha256"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.stat(folder)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None  # not ours alone: do not trust what it holds
    except (OSError, AttributeError):
        return None
    return folder


def _version_key(st: os.stat_result, path: str | Path) -> str:
    return f"{os.path.realpath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _hash_fd(fd: int) -> str:
    h = hashlib.sha256()
    view = memoryview(bytearray(8 << 20))
    offset = 0
    while True:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            break
        h.update(view[:n])
        offset += n
    return h.hexdigest()


def sha256_file(path: str | Path, cache: bool = True) -> str:
    """sha256 of a regular file (BadDataError for a FIFO, device or folder: no unbounded reads).

    With ``cache`` a digest is remembered per file version (real path, device, inode, size, mtime,
    ctime), in this process and in ``$KVTOOL_CACHE/sha256`` (a folder only this user may write), so
    each version of a file is hashed once; rewriting the file changes its ctime and so its key."""
    check_regular_file(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise BadDataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        key = _version_key(st, path)
        entry = hashlib.sha256(key.encode()).hexdigest()[:32]
        if cache:
            if key in _SHA_MEMO:
                return _SHA_MEMO[key]
            folder = _sha_cache_dir()
            if folder is not None:
                with contextlib.suppress(OSError, ValueError):
                    saved = json.loads((folder / entry).read_text())
                    if saved.get("key") == key and len(saved.get("sha256", "")) == 64:
                        _SHA_MEMO[key] = saved["sha256"]
                        return saved["sha256"]
        digest = _hash_fd(fd)
        after = os.fstat(fd)
        if cache and _version_key(after, path) == key:  # unchanged while it was read
            _SHA_MEMO[key] = digest
            folder = _sha_cache_dir()
            if folder is not None:
                with contextlib.suppress(OSError):
                    tmp = folder / f".{entry}.{os.getpid()}.tmp"
                    tmp.write_text(json.dumps({"key": key, "sha256": digest}))
                    os.replace(tmp, folder / entry)
        return digest
    finally:
        os.close(fd)


def source_sha256(path: str | Path) -> str:
    """The SHA-256 that names a kvtool file as the source of another (``source_sha256``): of its
    header when the header carries ``kvtool.checksums`` (the CRC-32 of every tensor and of the
    metadata: the header pins the whole payload, and hashing it costs nothing), else of the whole
    file (:func:`sha256_file`, once per file version)."""
    with KVFile(path) as f:
        if CHECKSUM_KEY in f.meta:
            return hashlib.sha256(f.raw_header).hexdigest()
    return sha256_file(path)


# ----------------------------------------------------------------------------- describing


def describe(path: str | Path, meta: dict[str, str] | None = None, entries: dict[str, tuple[str, list[int]]] | None = None) -> dict[str, Any]:
    """Metadata (JSON decoded), tensors with shapes, dtypes and bytes, totals, from the header alone."""
    path = Path(path)
    if meta is None or entries is None:
        meta, entries = read_header(path)
    decoded: dict[str, Any] = {}
    for key, value in meta.items():
        try:
            decoded[key] = json.loads(value)
        except json.JSONDecodeError:
            decoded[key] = value
        except RecursionError:
            raise BadDataError(f"{path}: metadata {key!r} nests too deeply") from None
    tensors = []
    total = 0
    for name, (dt, shape) in sorted(entries.items(), key=lambda kv: natural_key(kv[0])):
        n = 1
        for s in shape:
            n *= s
        nbytes = n * ITEMSIZE.get(dt, 0)
        total += nbytes
        tensors.append({"name": name, "dtype": ST_DTYPES.get(dt, dt), "shape": shape, "bytes": nbytes})
    return {"path": str(path), "metadata": decoded, "tensors": tensors, "tensor_bytes": total, "file_bytes": path.stat().st_size}


def natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in name.split(".")]
