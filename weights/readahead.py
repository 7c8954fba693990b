"""The page cache and a packed model: read-ahead ahead of the loader, residency.

``prefetch(path)`` starts reading the weight file into the page cache and
returns at once. The loader calls it as its reads begin, so on a cold page
cache the disk works ahead of the loader's threads. Not earlier: a bulk read of
the same disk starves the page faults of an import, of the CUDA context and of
the first uses of torch's, CUDA's and Triton's code, which then end only when
the read does.

``trickle(path)`` is the read that may run beside them: one piece at a time,
with the kernel's read-ahead off, so a page fault waits behind one piece at
most. A cold replica starts it at its first instant and the loader stops it
when its own reads begin (``stop_trickle``).

One ``posix_fadvise(WILLNEED)`` over the whole file is not enough: Linux reads
at most max(read_ahead_kb, max_sectors_kb) per call (128 KiB to a few MiB), so
the hint is issued per 128 KiB piece, front to back. Both run in a small helper
process rather than a thread (``weights.pagein``: their programs and why). The
kernel reads asynchronously; no data is copied.

``resident_bytes`` / ``resident_fraction`` say how much of a file is already
in the page cache (mincore(2)), so the loader can pick disk or memory settings
and ``coldstart doctor`` can report it. This module imports nothing heavy on
purpose.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path

from .format import WEIGHTS_FILE

log = logging.getLogger(__name__)

PIECE = 128 << 10  # read_ahead_kb's usual default: every call of this size is read whole

# the trickle's read: small enough that a page fault behind it waits little
TRICKLE_PIECE = 1 << 20

_started: dict[str, subprocess.Popen] = {}
_trickles: dict[str, subprocess.Popen] = {}
_lock = threading.Lock()


def _weight_file(path: str | os.PathLike) -> Path | None:
    """``model.cst`` itself or in a packed directory; None where it is missing or the
    platform has no ``posix_fadvise``."""
    p = Path(path)
    if p.is_dir():
        p = p / WEIGHTS_FILE
    return p if p.is_file() and hasattr(os, "posix_fadvise") else None


# the directory that holds the ``weights`` package: the helper's ``python -m`` finds it from there
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def _helper(registry: dict[str, subprocess.Popen], program: str, path: str | os.PathLike, piece: int,
            what: str) -> subprocess.Popen | None:
    """Start ``weights.pagein``'s ``program`` on ``path`` in a helper process once per file and
    registry."""
    p = _weight_file(path)
    if p is None:
        return None
    key = str(p.resolve())
    # read ahead no more than half the free memory: a file larger than that would push
    # its own first pages out before the loader got to them, and be read twice
    limit = p.stat().st_size if (avail := _available_memory()) is None else avail // 2
    with _lock:
        proc = registry.get(key)
        if proc is None:
            try:  # -E -s -S: no environment, no site packages: the interpreter's start alone
                proc = subprocess.Popen([sys.executable, "-E", "-s", "-S", "-m", "weights.pagein", program, key,
                                         str(piece), str(limit)], cwd=_PACKAGE_ROOT, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
            except OSError as e:
                log.warning("%s of %s skipped: %s", what, p, e)
                return None
            registry[key] = proc
    return proc


def prefetch(path: str | os.PathLike) -> subprocess.Popen | None:
    """Start read-ahead of ``model.cst`` (or a packed directory's one) in the background.

    Returns the helper process (``wait()`` returns once every piece is queued;
    the reads themselves finish shortly after), or None where the file is
    missing or the platform has no ``posix_fadvise``. A second call for the
    same file in this process returns the first one's helper. At most half of
    the memory available now is read ahead (the front of the file).
    """
    return _helper(_started, "hint", path, PIECE, "prefetch")


def trickle(path: str | os.PathLike, piece: int = TRICKLE_PIECE) -> subprocess.Popen | None:
    """Start reading ``model.cst`` into the page cache one ``piece`` at a time, front to
    back, in a helper process; returns it (None as for ``prefetch``).

    Made to run beside work that faults in pages of other files on the same disk (a
    replica's imports, its CUDA context, the first launches of its kernels): they wait
    behind one piece at most, where ``prefetch`` or the loader's many readers would make
    them wait for most of the file. At most half the available memory is read. A second
    call for the same file returns the first one's helper; ``stop_trickle`` ends it.
    """
    return _helper(_trickles, "trickle", path, piece, "trickle")


def stop_trickle(path: str | os.PathLike) -> bool:
    """End ``trickle``'s helper for this file, if one runs; whether one was running. What
    it read stays in the page cache."""
    p = _weight_file(path)
    if p is None:
        return False
    with _lock:
        proc = _trickles.pop(str(p.resolve()), None)
    if proc is None:
        return False
    running = proc.poll() is None
    if running:
        proc.kill()
    proc.wait()
    return running


def is_cold(path: str | os.PathLike, below: float = 0.5) -> bool:
    """Whether less than ``below`` of ``model.cst`` is in the page cache (False when that
    cannot be told, or the file is missing)."""
    p = _weight_file(path)
    if p is None:
        return False
    frac = resident_fraction(p)
    return frac is not None and frac < below


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        lib = ctypes.CDLL(name, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        _libc = lib
    return _libc


# translate table: each mincore byte -> its residency bit (the other bits are reserved)
_LOW_BIT = bytes(b & 1 for b in range(256))


def resident_bytes(path: Path, offset: int = 0, length: int | None = None) -> int | None:
    """How many bytes of `path[offset:offset+length]` are in the page cache, via
    mincore(2) on a fresh read-only mapping (mapping does not fault pages in).
    None where mincore or mmap is not available (non-Linux, some sandboxes)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = _load_libc()
    if libc is None:
        return None
    size = path.stat().st_size
    length = size - offset if length is None else min(length, size - offset)
    if length <= 0:
        return 0
    page = mmap.PAGESIZE
    start = offset - offset % page
    span = offset + length - start
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            npages = (span + page - 1) // page
            vec = (ctypes.c_ubyte * npages)()
            if libc.mincore(ctypes.c_void_p(addr), span, vec) != 0:
                return None
            resident = bytes(vec).translate(_LOW_BIT).count(1)
        finally:
            libc.munmap(ctypes.c_void_p(addr), span)
    finally:
        os.close(fd)
    return min(resident * page, length)


def resident_fraction(path: Path, offset: int = 0, length: int | None = None,
                      samples: int = 32, window: int = 64 << 10) -> float | None:
    """Fraction of ``path[offset:offset+length]`` in the page cache, from ``samples``
    windows spread over it (tens of microseconds for any size); None if unknown."""
    size = path.stat().st_size
    length = size - offset if length is None else min(length, size - offset)
    if length <= 0:
        return None
    step = max(length // samples, 1)
    got = want = 0
    for i in range(0, length, step):
        n = min(window, length - i)
        r = resident_bytes(path, offset + i, n)
        if r is None:
            return None
        got, want = got + r, want + n
    return got / want if want else None
