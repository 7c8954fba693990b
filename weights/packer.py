"""``coldstart pack SRC DEST``: a Hugging Face model directory -> a packed model directory.

Streams tensor by tensor (the model is never instantiated and never held twice
in memory), lays tensors out sorted by name, each 4 KiB-aligned, writes the
chunk checksums and the index, and publishes DEST atomically.

Publishing. Everything is written in a temporary directory beside DEST,
``.NAME.partial-PID-XXXXXXXX`` (PID: the packing process), in this order: the
side files, each fsynced; the weights as ``model.cst.partial`` (data, index, and
last the preamble, so until then it has no valid magic), fsynced; then
``model.cst.partial`` is renamed ``model.cst``, the directory is fsynced and
renamed to DEST. An existing DEST (only under --force, and only a packed model
or an empty directory) is first renamed aside as ``.NAME.old-PID-XXXXXXXX`` and
removed after. So only a finished pack's directory holds a ``model.cst``: a pack
interrupted at any point leaves no DEST and no ``model.cst`` anywhere, and
``read_packed`` also refuses a ``.NAME.partial-*`` directory by name, saying it
is such a leftover. (Marking completion by the last rename, rather than by a
flag inside the file, keeps every reader, old ones included, from taking a
partial file for a model, and needs nothing but rename's atomicity.)

Leftovers. A pack that is killed (SIGKILL, a crash, a power cut) cannot remove
its temporary directory, a full-size copy of the model. While it runs, a pack
holds an ``flock`` on ``.NAME.lock`` in DEST's parent, so two packs into one
DEST run one after the other, and a pack that holds it knows that no other pack
into DEST is running: it removes the ``.NAME.partial-*`` and ``.NAME.old-*``
leftovers of earlier packs into DEST, logging each with its size. It keeps one
whose PID is a process still running, which is also what protects a running
pack where the filesystem has no locks; leftovers named without a PID (by an
older coldstart) are removed only under the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import checksum
from .format import (ALIGN, DEFAULT_CHUNK_BYTES, DTYPES, MAGIC, PREAMBLE_BYTES, SIDE_FILES,
                     WEIGHTS_FILE, Index, SideFile, TensorEntry, align_up, encode_preamble,
                     file_sha256)
from .sources import SourceError, check_apart, check_source, is_within, iter_tensors, open_sources

log = logging.getLogger(__name__)

CAST_DTYPES = ("float32", "float16", "bfloat16")
_PARTIAL = WEIGHTS_FILE + ".partial"  # the weights' name until the pack is complete


@dataclass(frozen=True)
class PackOptions:
    """How to pack.

    Attributes:
        dtype: cast floating-point tensors to this dtype (float32, float16 or
            bfloat16); integer tensors (quantized weights) are stored as they are.
        force: replace an existing DEST, if it is a packed model or an empty directory
            (anything else is never replaced).
        chunk_bytes: checksum chunk size, a multiple of 4096.
        progress: show a progress bar (only on a terminal).
    """

    dtype: str | None = None
    force: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    progress: bool = True

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in CAST_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported for casting; "
                             f"use one of {', '.join(CAST_DTYPES)}")
        if self.chunk_bytes <= 0 or self.chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes={self.chunk_bytes} must be a positive multiple of {ALIGN}")


# Projections a decoder multiplies by the same input: stored back to back (each a
# multiple of 4 KiB in real models), they form one [rows, hidden] matrix that the
# engine uses as a zero-copy view, one matmul instead of three (or two).
_FUSE_RANK = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "o_proj": 3,
              "gate_proj": 4, "up_proj": 5, "down_proj": 6}


def _layout_key(name: str) -> list:
    """Natural order (model.layers.10 after model.layers.9, so the file is in layer
    order), except that within a module q/k/v and gate/up weights sit side by side."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[-2] in _FUSE_RANK:
        # ...self_attn.{q,k,v,o}_proj.{weight,bias}: weights together, then biases
        parts = parts[:-2] + [parts[-1], f"{_FUSE_RANK[parts[-2]]}"]
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", ".".join(parts))]


def _check_replace(dest: Path, force: bool) -> None:
    """Refuse an existing DEST unless ``force`` is set and DEST is a packed model (a model.cst
    with coldstart's magic) or an empty directory: --force never deletes anything else."""
    if not (dest.exists() or dest.is_symlink()):
        return
    if not _replaceable(dest):
        raise FileExistsError(f"{dest} exists and is not a packed model (no {WEIGHTS_FILE} with a "
                              "coldstart header, and not an empty directory); it will not be "
                              "replaced, with --force or without: choose another DEST")
    if not force:
        raise FileExistsError(f"{dest} exists; pass --force to replace it")


def _replaceable(dest: Path) -> bool:
    if not dest.is_dir():
        return False
    if not any(dest.iterdir()):
        return True
    try:
        with open(dest / WEIGHTS_FILE, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:  # none there, or not a file
        return False


def _stored_dtype(name: str, dtype: str, file: Path, cast: str | None) -> str:
    tdt = getattr(torch, dtype, None) if dtype in DTYPES else None
    if tdt is None:
        # safetensors codes were mapped to torch already; only odd .bin dtypes land here
        raise SourceError(f"{file}: tensor {name!r} has dtype {dtype}, which a packed file cannot "
                          f"hold; supported: {', '.join(DTYPES)}")
    if cast and tdt.is_floating_point and tdt.itemsize >= 2:
        return cast  # fp8 stays fp8: casting it up would change what was quantized
    return dtype


def pack(src: str | os.PathLike, dest: str | os.PathLike, options: PackOptions | None = None
         ) -> Path:
    """Pack a Hugging Face model directory into a packed model directory.

    Args:
        src: local HF model directory (config.json plus safetensors shards, with
            or without an index, or ``.bin`` files).
        dest: the packed directory to create.
        options: ``PackOptions``; defaults keep dtypes as they are.
    Returns:
        ``dest`` as a Path.
    Raises:
        SourceError: SRC is missing, empty, has no config or weights, a bad shard,
            a duplicate or unsupported tensor.
        ValueError: DEST is SRC, contains it or lies inside it (symlinks resolved).
        FileExistsError: DEST exists and ``force`` is not set, or DEST is something
            other than a packed model or an empty directory (never replaced).

    Example:
        >>> pack("Llama-2-7b-hf", "weights/llama-2-7b", PackOptions(dtype="float16"))
    """
    opts = options or PackOptions()
    src, dest = Path(src), Path(dest)
    files = check_source(src)
    check_apart(src, dest)
    _check_replace(dest, opts.force)
    metas, handles, aliases = open_sources(files)
    if not metas:
        raise SourceError(f"{src}: the weight files hold no tensors")

    # Layout first (metadata only), so every tensor can be written where it belongs.
    entries: list[TensorEntry] = []
    off = 0
    for name in sorted(metas, key=_layout_key):
        m = metas[name]
        stored = _stored_dtype(name, m.dtype, m.file, opts.dtype)
        nbytes = int(np.prod(m.shape, dtype=np.int64)) * DTYPES[stored][0]
        entries.append(TensorEntry(name, stored, m.shape, off, nbytes))
        off = align_up(off + nbytes)
    data_bytes = max(align_up(off), ALIGN)
    by_name = {e.name: e for e in entries}

    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _locked(dest) as locked:
            _check_replace(dest, opts.force)  # again: another pack may have published it meanwhile
            _remove_leftovers(dest, src, locked)
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-{os.getpid()}-", dir=dest.parent))
            try:
                _write_pack(tmp, src, files, handles, by_name, data_bytes, aliases, opts)
                _publish(tmp, dest, opts.force)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    finally:
        for h in handles:
            if hasattr(h, "close"):
                h.close()
    log.info("packed %d tensors (%.2f GB) from %s into %s", len(entries), data_bytes / 1e9, src, dest)
    return dest


def _write_pack(tmp: Path, src: Path, files, handles, by_name: dict[str, TensorEntry],
                data_bytes: int, aliases: dict[str, str], opts: PackOptions) -> None:
    """Write the packed model into ``tmp``: side files, then the weights as model.cst.partial,
    renamed model.cst once complete, all fsynced (see the module's docstring for why)."""
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary directory
    side = _copy_side_files(src, tmp)
    _write_weights(tmp / _PARTIAL, files, handles, by_name, data_bytes, aliases, opts,
                   {"source": src.name, "cast": opts.dtype}, side)
    os.rename(tmp / _PARTIAL, tmp / WEIGHTS_FILE)  # complete from here on
    _fsync_dir(tmp)


def _copy_side_files(src: Path, tmp: Path) -> dict[str, SideFile]:
    """Copy SRC's side files into ``tmp``, each fsynced; their index entries, hashed from the
    copies (what the packed directory will hold)."""
    out = {}
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
            fd = os.open(tmp / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            out[name] = SideFile(file_sha256(tmp / name), (tmp / name).stat().st_size)
    return out


def _write_weights(path: Path, files, handles, by_name: dict[str, TensorEntry], data_bytes: int,
                   aliases: dict[str, str], opts: PackOptions, meta: dict,
                   side: dict[str, SideFile]) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, PREAMBLE_BYTES + data_bytes)  # zero padding for free (sparse)
        bar = _progress(sum(e.nbytes for e in by_name.values()), opts.progress)
        for name, t, file in iter_tensors(files, handles, skip=set(aliases)):
            e = by_name[name]
            if tuple(t.shape) != e.shape:
                raise SourceError(f"{file}: tensor {name!r} changed shape while reading")
            t = t.to(getattr(torch, e.dtype)) if str(t.dtype) != f"torch.{e.dtype}" else t
            buf = t.contiguous().view(-1).view(torch.uint8).numpy()
            _pwrite_all(fd, buf, PREAMBLE_BYTES + e.offset, file, name)
            bar.update(e.nbytes)
        bar.close()
        # Sums over what is on disk now (mostly still in the page cache), via a map.
        # mode "c": a private map torch may wrap without a read-only warning; never written
        region = np.memmap(path, dtype=np.uint8, mode="c", offset=PREAMBLE_BYTES, shape=(data_bytes,))
        sums = checksum.chunk_sums(torch.from_numpy(region), opts.chunk_bytes)
        del region
        index = Index(sorted(by_name.values(), key=lambda e: e.offset), opts.chunk_bytes, sums,
                      aliases, meta, side).to_bytes()
        _pwrite_all(fd, np.frombuffer(index, np.uint8), PREAMBLE_BYTES + data_bytes, path, "index")
        # The preamble goes last: until it is written the file has no valid magic.
        _pwrite_all(fd, np.frombuffer(encode_preamble(data_bytes, index), np.uint8), 0, path, "header")
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, buf: np.ndarray, offset: int, file, name: str) -> None:
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        n = os.pwrite(fd, mv[done:], offset + done)
        if n <= 0:
            raise OSError(f"short write of {name!r} from {file}")
        done += n


def _fsync_dir(d: Path) -> None:
    for p in d.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, dest: Path, force: bool) -> None:
    """Rename the finished temporary directory to DEST (replacing it under --force)."""
    old = None
    if dest.exists() or dest.is_symlink():
        _check_replace(dest, force)
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(dest, old)
    os.rename(tmp, dest)
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        with contextlib.suppress(OSError):  # what is left, the next pack into DEST removes
            _remove(old)


@contextlib.contextmanager
def _locked(dest: Path):
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


def _leftover_re(dest: Path) -> re.Pattern:
    """Names of the temporary and set-aside directories of packs into DEST; group 1 or 2: the
    packing process's pid (none in a temporary directory named by an older coldstart)."""
    n = re.escape(dest.name)
    return re.compile(rf"\.{n}\.(?:partial-(?:(\d+)-)?[a-z0-9_]{{8}}|old-(\d+)(?:-[0-9a-f]{{8}})?)")


def _remove_leftovers(dest: Path, src: Path, locked: bool) -> None:
    """Remove what earlier packs into DEST left in its parent, but never a running pack's (see
    the module's docstring) nor SRC."""
    pattern, rs = _leftover_re(dest), src.resolve()
    for p in sorted(dest.parent.iterdir()):
        m = pattern.fullmatch(p.name)
        if not m or is_within(rs, p.resolve()):
            continue
        digits = m.group(1) or m.group(2)
        pid = int(digits) if digits else None
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
    """Whether the pack that left a leftover has ended: its process is gone. Under the lock, one
    with no pid or with ours is no running pack's (each running pack holds the lock)."""
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


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="pack")
