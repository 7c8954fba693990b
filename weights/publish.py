"""How a pack appears at DEST: the lock, the leftovers of earlier packs, and the last rename.

Publishing. Everything is written in a temporary directory beside DEST,
``.NAME.partial-PID.HOST-XXXXXXXX`` (PID: the packing process; HOST: 8 hex digits of a digest
of its host's name), in this order: the side files, each fsynced; the weights as ``model.cst.partial``
(data, index, and last the preamble, so until then it has no valid magic), fsynced; then
``model.cst.partial`` is renamed ``model.cst``, the directory is fsynced and renamed to
DEST. An existing DEST (only under --force, and only a packed model or an empty directory)
is swapped with it in one step where the kernel and filesystem can (``renameat2`` with
``RENAME_EXCHANGE``: DEST is never missing, not even for an instant), then removed from
under the temporary name, which every reader refuses; elsewhere it is first renamed aside as
``.NAME.old-PID.HOST-XXXXXXXX`` and removed after. So only a finished pack's directory holds
a ``model.cst``: a pack interrupted at any point leaves no DEST and no ``model.cst``
anywhere, and ``read_packed`` also refuses a ``.NAME.partial-*`` directory by name, saying
it is such a leftover. (Marking completion by the last rename, rather than by a flag inside
the file, keeps every reader, old ones included, from taking a partial file for a model, and
needs nothing but rename's atomicity.)

Leftovers. A pack that is killed (SIGKILL, a crash, a power cut) cannot remove
its temporary directory, a full-size copy of the model. While it runs, a pack
holds an ``flock`` on ``.NAME.lock`` in DEST's parent, so two packs into one
DEST run one after the other, and a pack that holds it knows that no other pack
into DEST is running: it removes the ``.NAME.partial-*`` and ``.NAME.old-*``
leftovers of earlier packs into DEST, logging each with its size. It keeps one
whose PID is a process still running, which is also what protects a running
pack where the filesystem has no locks; leftovers named without a PID (by an
older coldstart) are removed only under the lock. One left by a pack on another host (a
directory several hosts share) is kept, whatever the lock says: its PID means nothing here,
and a filesystem's locks need not reach across hosts; the log names it, to be removed there.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
from pathlib import Path

from .format import MAGIC, TP_MANIFEST, WEIGHTS_FILE, rank_dir

log = logging.getLogger(__name__)
# this host, in the names of its packs' temporary directories (owner())
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def check_replace(dest: Path, force: bool) -> None:
    """Refuse an existing DEST unless ``force`` is set and DEST is a packed model (a model.cst
    with coldstart's magic) or an empty directory: --force never deletes anything else."""
    if not (dest.exists() or dest.is_symlink()):
        return
    if not _replaceable(dest):
        raise FileExistsError(f"{dest} exists and is not a packed model (no {WEIGHTS_FILE}, nor a split "
                              f"pack's {TP_MANIFEST} and {rank_dir(0)}/{WEIGHTS_FILE}, with a coldstart "
                              "header, and not an empty directory); it will not be "
                              "replaced, with --force or without: choose another DEST")
    if not force:
        raise FileExistsError(f"{dest} exists; pass --force to replace it")


def _replaceable(dest: Path) -> bool:
    if not dest.is_dir():
        return False
    if not any(dest.iterdir()):
        return True
    return _has_magic(dest / WEIGHTS_FILE) or (
        (dest / TP_MANIFEST).is_file() and _has_magic(dest / rank_dir(0) / WEIGHTS_FILE))  # a split pack


def _has_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:  # none there, or not a file
        return False


def publish(tmp: Path, dest: Path, force: bool) -> None:
    """Rename the finished temporary directory to DEST, replacing it only as ``check_replace``
    allows (``swap_in``)."""
    if dest.exists() or dest.is_symlink():
        check_replace(dest, force)
    swap_in(tmp, dest)


def swap_in(tmp: Path, dest: Path) -> None:
    """Rename the finished directory ``tmp`` to ``dest``. An existing ``dest`` is swapped with it
    in one step where the system can, so that ``dest`` is never missing (else renamed aside
    first), then removed."""
    old = None
    if dest.exists() or dest.is_symlink():
        if exchange(tmp, dest):  # DEST is the new one; tmp's name holds the old one
            old = tmp
        else:
            old = dest.with_name(f".{dest.name}.old-{owner()}-{secrets.token_hex(4)}")
            os.rename(dest, old)
    if old is not tmp:
        os.rename(tmp, dest)
    fsync(dest.parent)
    if old is not None:
        with contextlib.suppress(OSError):  # what is left, the next pack into DEST removes
            _remove(old)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one step (Linux's renameat2 with RENAME_EXCHANGE); False,
    having changed nothing, where the C library, the kernel or the filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # no such call in this C library (glibc before 2.28, musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextlib.contextmanager
def locked(dest: Path):
    """Hold an exclusive flock on ``.NAME.lock`` beside DEST while the body runs (waiting for
    another pack into DEST to finish); yields whether it is held: False where the filesystem
    refuses locks. The holder removes the file as it lets go; a waiter that then gets the lock
    of the removed file sees that and locks the path's new file instead."""
    path = dest.with_name(f".{dest.name}.lock")
    fd = _lock(path, dest)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)


def _lock(path: Path, dest: Path) -> int | None:
    """A descriptor of ``path`` holding its exclusive flock (waiting for the holder to let go);
    None where the filesystem refuses locks."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("another pack into %s is running: waiting for it to finish", dest)
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # ENOLCK, EOPNOTSUPP: some network filesystems
            os.close(fd)
            log.warning("cannot lock %s (%s): packs into %s are not serialized; leftovers of "
                        "earlier packs are removed only where their process has ended", path, e, dest)
            return None
        try:
            st, now = os.fstat(fd), os.stat(path)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder removed that file as it let go: lock the path's new one


def owner() -> str:
    """``PID.HOST`` of this process, in the names of its temporary and set-aside directories."""
    return f"{os.getpid()}.{HOST}"


def _leftover_re(dest: Path) -> re.Pattern:
    """Names of the temporary and set-aside directories of packs into DEST; groups ``pid`` and
    ``host``: the packing process's (none in names by older coldstarts: no host, or no pid)."""
    n, who = re.escape(dest.name), r"(?P<pid{0}>\d+)(?:\.(?P<host{0}>[0-9a-f]{{8}}))?"
    return re.compile(rf"\.{n}\.(?:partial-(?:{who.format(1)}-)?[a-z0-9_]{{8}}|old-{who.format(2)}(?:-[0-9a-f]{{8}})?)")


def remove_leftovers(dest: Path, src: Path, locked: bool) -> None:
    """Remove what earlier packs into DEST left in its parent, but never a running pack's (see
    the module's docstring) nor SRC."""
    pattern, rs = _leftover_re(dest), src.resolve()
    for p in sorted(dest.parent.iterdir()):
        m = pattern.fullmatch(p.name)
        if not m or is_within(rs, p.resolve()):
            continue
        digits, host = m["pid1"] or m["pid2"], m["host1"] or m["host2"]
        pid = int(digits) if digits else None
        if host is not None and host != HOST:
            log.warning("kept %s: left by a pack on another host (pid %s there), which may still be running; "
                        "remove it by hand once that pack has ended", p, pid)
            continue
        if not _ended(pid, locked):
            log.info("kept %s: the pack that left it (pid %s) may still be running", p, pid)
            continue
        size = _disk_bytes(p)
        try:
            _remove(p)
        except OSError as e:
            log.warning("could not remove %s, left by an earlier pack into %s: %s", p, dest, e)
            continue
        log.info("removed %s, left by an interrupted pack into %s (%.1f MiB)", p, dest, size / 2**20)


def _ended(pid: int | None, locked: bool) -> bool:
    """Whether the pack on this host that left a leftover has ended: its process is gone. Under
    the lock, one with no pid or with ours is no running pack's (each running pack holds the lock)."""
    if pid is None or pid == os.getpid():
        return locked
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        return False
    return False


def _disk_bytes(p: Path) -> int:
    """Bytes that ``p`` takes on disk (a partial model.cst is sparse where it was not written)."""
    if not p.is_dir() or p.is_symlink():
        return p.lstat().st_blocks * 512
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512
               for d, _, fs in os.walk(p) for f in fs)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


def fsync(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_within(inner: Path, outer: Path) -> bool:
    """Whether ``inner`` (resolved; it need not exist) is ``outer`` (resolved, existing) or
    lies inside it."""
    want = file_id(outer)
    return any(p.exists() and file_id(p) == want for p in (inner, *inner.parents))


def file_id(p: Path) -> tuple[int, int]:
    """The (device, inode) pair that names ``p``'s file or directory, whatever its path."""
    st = p.stat()
    return st.st_dev, st.st_ino
