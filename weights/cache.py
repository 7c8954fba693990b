"""A node's cache of remote packed models: one directory, entries keyed by the model's digest.

Layout (``root``: ``COLDSTART_CACHE_DIR``, by default ``~/.cache/coldstart/models``)::

    root/<name>.<uri8>/<key>/          one entry: the packed model as it is at its source
        config.json, tokenizer.json, ...   side files, checked against the index as they arrive
        kernels/<gpu-key>/...              the kernel bundle, where the source has one
        model.cst                          the weights (a split pack: tp.json, rank-K/model.cst)
        .model.cst.partial-PID.HOST-XXXX   a transfer under way (never read as a model)

``uri8`` is a digest of the source's URI; ``key`` the first 16 hex digits of the digest of what
the source holds now (the weight file's index, or a split pack's ``tp.json``), so a model changed
at its source gets a new entry and is never served from a stale copy. An entry directory appears
whole (its side files are written in a temporary directory and renamed), and a weight file
appears only by the rename of its completed, verified transfer: nothing partial is ever named
``model.cst``. One transfer per entry at a time: a replica that finds another one's transfer
under way (``lock``) waits for it and then reads the local copy.

Size. ``max_bytes`` bounds the cache: before a transfer, the least recently used entries (their
directory's mtime, touched at every use) are removed until the new one fits; an entry in use is
kept (its lock is held). A transfer's file is allocated whole before its first byte, so a disk
without room fails at once, naming the directory, not half-way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .publish import HOST, _disk_bytes, fsync, locked, owner

log = logging.getLogger(__name__)

PARTIAL = re.compile(r"\.(?P<name>.+)\.partial-(?P<pid>\d+)\.(?P<host>[0-9a-f]{8})-[0-9a-f]{8}")


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "coldstart" / "models"


class CacheFullError(OSError):
    """The node cache has no room for a model: the message names the directory and both sizes."""


@dataclass
class NodeCache:
    """The node-local cache directory (see the module's docstring). ``max_bytes`` 0: no bound but
    the disk."""

    root: Path
    max_bytes: int = 0

    def __post_init__(self) -> None:
        self.root = Path(self.root).expanduser()

    def entry(self, uri: str, key: str, name: str) -> Path:
        h = hashlib.sha256(uri.encode()).hexdigest()[:8]
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:80] or "model"
        return self.root / f"{safe}.{h}" / key

    def entries_of(self, uri: str, name: str) -> list[Path]:
        """The complete entries of ``uri`` on this node, most recently used first."""
        d = self.entry(uri, "x", name).parent
        if not d.is_dir():
            return []
        out = [p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".") and _complete(p)]
        return sorted(out, key=lambda p: p.stat().st_mtime, reverse=True)

    @contextlib.contextmanager
    def lock(self, entry: Path) -> Iterator[None]:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with locked(entry):
            yield

    def touch(self, entry: Path) -> None:
        with contextlib.suppress(OSError):
            os.utime(entry)

    def clean(self, entry: Path) -> None:
        """Remove what killed transfers into ``entry`` left (the caller holds its lock, so no
        transfer of this host into it is running)."""
        for d in (entry.parent, entry, *(p for p in entry.glob("rank-*") if p.is_dir())):
            if not d.is_dir():
                continue
            for p in d.iterdir():
                m = PARTIAL.fullmatch(p.name)
                if m and m["host"] == HOST:
                    size = _disk_bytes(p)
                    _remove(p)
                    log.info("removed %s, left by an interrupted transfer (%.1f MiB)", p, size / 2**20)

    def make_room(self, need: int, keep: Path) -> None:
        """Evict least recently used entries until ``need`` more bytes fit under ``max_bytes`` and on
        the disk; CacheFullError naming the directory where they cannot."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self.max_bytes and need > self.max_bytes:
            raise CacheFullError(errno.ENOSPC, f"{self.root}: the model needs {need / 2**30:.2f} GiB, more than "
                                 f"the cache's limit of {self.max_bytes / 2**30:.2f} GiB "
                                 "(COLDSTART_CACHE_MAX_GB); raise the limit")
        victims = self._lru(keep)
        while True:
            used = sum(size for _, size in victims) if self.max_bytes else 0
            free = shutil.disk_usage(self.root).free
            over = self.max_bytes and used + need > self.max_bytes
            if not over and need <= free:
                return
            if not victims:
                raise CacheFullError(errno.ENOSPC, f"{self.root}: no room for the model ({need / 2**30:.2f} GiB "
                                     f"needed, {free / 2**30:.2f} GiB free on its disk, nothing left to "
                                     "evict); free space there or point COLDSTART_CACHE_DIR at a larger disk")
            p, size = victims.pop()
            self._evict(p, size)

    def _lru(self, keep: Path) -> list[tuple[Path, int]]:
        """Complete entries other than ``keep``, most recently used first, with their sizes."""
        out = []
        if not self.root.is_dir():
            return out
        for model in self.root.iterdir():
            if not model.is_dir() or model.name.startswith("."):
                continue
            for e in model.iterdir():
                if e.is_dir() and not e.name.startswith(".") and e != keep:
                    out.append((e.stat().st_mtime, e, _disk_bytes(e)))
        out.sort(key=lambda x: x[0], reverse=True)
        return [(e, size) for _, e, size in out]

    def _evict(self, entry: Path, size: int) -> None:
        """Remove ``entry`` unless a transfer into it holds its lock (then it is in use: kept)."""
        path = entry.with_name(f".{entry.name}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("kept %s in the node cache: a transfer into it is under way", entry)
                return
            # a memory-mapped or open file stays readable to whoever holds it: unlinking is safe
            _remove(entry)
        finally:
            os.close(fd)
        log.info("evicted %s from the node cache (%.1f MiB; least recently used)", entry, size / 2**20)


def _complete(entry: Path) -> bool:
    if (entry / "model.cst").is_file():
        return True
    return (entry / "tp.json").is_file() and any((entry / r / "model.cst").is_file() for r in
                                                  os.listdir(entry) if r.startswith("rank-"))


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def partial_name(name: str) -> str:
    """The temporary name of a transfer into ``name`` (matched by ``PARTIAL``)."""
    return f".{name}.partial-{owner()}-{os.urandom(4).hex()}"


def publish_file(tmp: Path, final: Path) -> None:
    """The finished transfer ``tmp`` becomes ``final``. Its data is not flushed to the disk first (for
    a 7B, seconds of the replica's start): a copy torn by a crash fails its checksums at its next load,
    which removes it (``drop_corrupt``), and the node fetches it again."""
    os.rename(tmp, final)
    fsync(final.parent)


def drop_corrupt(weights: Path, error: BaseException) -> str:
    """A node cache's weight file failed its checksums: remove it (the next start fetches it again);
    returns what to add to the error's message."""
    try:
        os.unlink(weights)
    except OSError as e:
        return f" (the node cache's copy {weights} is corrupt and could not be removed: {e}; remove it)"
    log.warning("removed %s from the node cache: %s", weights, error)
    return " (it was the node cache's copy: removed, the next start fetches the model again)"
