"""Load a packed model into ONE device buffer, verifying it as it loads.

GPU path: one ``torch.empty(data_bytes, uint8)`` on the device; reader threads
``preadv`` the file in ``read_bytes`` pieces into a small pinned staging ring
(``slots_per_thread`` slots per thread, pinned by each thread itself so the
pinning runs in parallel; tens of MB, not the seconds a whole-model pinned
buffer would cost) and each thread copies its slot to the device on its own
CUDA stream, overlapping its next read (``weights.stream``). ``preadv`` and the ctypes CUDA calls
(``weights.cudart``) release the GIL, so the threads really run in parallel.
As soon as a group of chunks has landed, a verifier thread computes their
checksums on the device (two reductions, milliseconds) on its own stream; the
sums are compared with the index at the end, and a mismatch names the chunk,
its tensors and the file. Every tensor is then a view of the buffer: no
per-tensor allocation, no second copy.

CPU path: the data region is memory-mapped (copy-on-write, never written) and
tensors are views of the map: zero copy, and nothing is read until used,
except that verification (on by default) reads every chunk once.

Split packs (``coldstart pack --tp N``): ``load(DEST, rank=K)`` (or ``load(DEST/rank-K)``)
loads rank K's file the same way, its side files checked in DEST; ``config`` is the whole
model's config.json, ``tp`` says which rank of how many the tensors are.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import checksum, readahead, stream
from .cache import NodeCache, default_root, drop_corrupt
from .fetch import Fetch, resolve
from .format import DTYPES, PackedFile, PackedFormatError, check_side_files, read_json, read_packed
from .options import LoadOptions
from .remote import is_remote
from .segments import one_segment
from .timing import PhaseTimer
from .tp import rank_path

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """What ``load`` returns: the buffer, the tensors (views of it) and the config."""

    path: Path
    packed: PackedFile
    device: torch.device
    buffer: torch.Tensor
    tensors: dict[str, torch.Tensor]
    config: dict
    timer: PhaseTimer

    @property
    def nbytes(self) -> int:
        return self.packed.data_bytes

    @property
    def tp(self) -> dict | None:
        """``{"size": N, "rank": K}`` for rank K's part of a split pack (``path`` is then the pack's
        directory, where config.json and the tokenizer are), else None."""
        return self.packed.tp


class DeviceMemoryError(RuntimeError):
    """The packed model does not fit in the device's free memory."""


def check_fits(need: int, free: int, total: int, device: str, headroom: int = 0) -> None:
    """Raise ``DeviceMemoryError`` with both numbers if ``need`` (+ headroom) exceeds ``free``."""
    if need + headroom > free:
        extra = f" plus {headroom / 2**30:.2f} GiB of headroom" if headroom else ""
        raise DeviceMemoryError(
            f"the model needs {need / 2**30:.2f} GiB{extra} on {device}, which has "
            f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB; free device memory "
            "(other processes, a smaller max_slots for the KV cache) or use a larger GPU")


def load(path: str | os.PathLike, device: str | torch.device | None = None, *, rank: int | None = None,
         options: LoadOptions | None = None, timer: PhaseTimer | None = None,
         cache: NodeCache | None = None) -> LoadedModel:
    """Load a packed model directory into one buffer on ``device``.

    Args:
        path: packed model directory (or its ``model.cst``), or with ``rank`` a split pack's; or
            a remote one's URI (``s3://``, ``gs://``, ``https://``; see ``start_load``).
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``; ``None`` (the default) is the GPU
            where torch sees one, else the CPU.
        rank: load rank ``rank``'s part of the split pack ``path`` (``coldstart pack --tp N``).
        options: ``LoadOptions``.
        timer: a ``PhaseTimer`` to record phases into (a new one by default).
        cache: the node cache a remote model is kept in (``weights.cache.NodeCache``).
    Returns:
        ``LoadedModel`` whose ``tensors`` map every name (aliases included) to a
        view of ``buffer``.
    Raises:
        PackedFormatError: bad structure, a checksum mismatch (names the chunk, its
            tensors and the file), or a side file (config.json, tokenizer files...)
            missing, changed, or not listed in the index (names the file).
        TensorParallelPackError: ``path`` is a split pack and no ``rank`` was given.
        DeviceMemoryError: the model does not fit in free device memory.
        ValueError: a device other than cpu and cuda, or cuda where torch sees no GPU; a
            ``rank`` the split pack does not have, or a ``rank`` for a plain packed model.

    Example:
        >>> m = load("weights/demo", "cpu")
        >>> m.tensors["model.embed_tokens.weight"].shape
    """
    return start_load(path, device, rank=rank, options=options, timer=timer, cache=cache).wait()


class PendingLoad:
    """A load under way (``start_load``): the buffer and every tensor view exist already,
    their bytes arrive on the loader's threads.

    Work that needs only the tensors' shapes and addresses (building a model over the
    views, self-tests of kernels, CUDA graph capture) can run meanwhile; nothing may read
    the weights' values before ``wait()`` has returned, which is also what raises a
    checksum mismatch or a read error.

    A load started with ``hold=True`` reads nothing until ``release()`` (or ``wait()``):
    the caller first runs work whose page faults must not queue behind a bulk read of
    the same disk. ``cancel()`` ends a load that has not begun reading.
    """

    def __init__(self, path: Path, packed: PackedFile, device: torch.device, buffer: torch.Tensor,
                 config: dict, timer: PhaseTimer, work: "Callable[[], None] | None" = None,
                 hold: bool = False):
        self.path, self.packed, self.device, self.buffer = path, packed, device, buffer
        self.config, self.timer = config, timer
        with timer.phase("assemble"):
            self.tensors = _views(packed, buffer)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._gate = threading.Event()
        self._cancelled = False
        self.held_s = 0.0  # how long the bytes waited for release()
        if not hold:
            self._gate.set()
        self.finished_at = time.perf_counter()  # perf_counter() when the last byte was checked
        if work is not None:
            self._thread = threading.Thread(target=self._run, args=(work,), name="coldstart-load",
                                            daemon=True)
            self._thread.start()

    def _run(self, work: "Callable[[], None]") -> None:
        if not self._gate.is_set():
            t = time.perf_counter()
            self._gate.wait()
            self.held_s = time.perf_counter() - t
        try:
            if self._cancelled:
                raise RuntimeError(f"{self.packed.path}: load cancelled before it began reading")
            work()
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            self._error = e
        self.finished_at = time.perf_counter()

    def release(self) -> None:
        """Let a load started with ``hold=True`` begin reading (a no-op otherwise)."""
        self._gate.set()

    def cancel(self) -> None:
        """End a held load without reading (its ``wait()`` then raises); a load already
        reading goes on to its end."""
        if not self._gate.is_set():
            self._cancelled = True
        self._gate.set()

    @property
    def background(self) -> bool:
        """Whether the bytes arrive on the load's own thread (a GPU load), not before start_load returned."""
        return self._thread is not None

    def done(self) -> bool:
        """Whether every byte has arrived and been checked (or the load failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> LoadedModel:
        """Block until the load has finished (releasing a held one); re-raise its error in
        the caller's thread."""
        self.release()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"{self.packed.path}: still loading after {timeout} s")
        if self._error is not None:
            raise self._error
        return LoadedModel(self.path, self.packed, self.device, self.buffer, self.tensors, self.config,
                           self.timer)


def start_load(path: "str | os.PathLike | Fetch", device: str | torch.device | None = None, *,
               rank: int | None = None, options: LoadOptions | None = None, timer: PhaseTimer | None = None,
               hold: bool = False, cache: NodeCache | None = None, from_cache: bool = False) -> PendingLoad:
    """Start loading a packed model (see ``load``; ``rank``: one rank's part of a split pack)
    and return as soon as the device buffer is allocated and its tensor views exist;
    ``PendingLoad.wait()`` finishes the load. ``device=None`` is the GPU where torch sees one,
    else the CPU.

    On a GPU the reads, copies and checksums go on in a background thread; with
    ``hold=True`` they begin only at ``PendingLoad.release()``. On the CPU the load is a
    memory map and its verification, done before this returns. Errors found up front (a
    bad file, a side file that does not match the index, too little device memory) raise
    here; later ones from ``wait()``.

    ``path`` may be a remote packed model (``s3://...``, ``https://...``: ``weights.remote``) or
    the ``Fetch`` of one (``weights.fetch.resolve``): a node that holds it in ``cache`` (default
    ``~/.cache/coldstart/models``) loads that copy; otherwise its bytes stream from the source
    into the device buffer and the cache in one pass (on the CPU: into the cache, then mapped).
    """
    opts = options or LoadOptions()
    timer = timer or PhaseTimer()
    dev = _device(device)
    fetch = None
    if isinstance(path, str) and is_remote(path):
        with timer.phase("resolve"):
            path = resolve(path, cache or NodeCache(default_root()), rank=rank, timeout_s=opts.remote_timeout_s)
        from_cache = True
    if isinstance(path, Fetch):
        fetch, path = path, path.entry
        if dev.type == "cpu":  # the CPU load maps the cache's file: the transfer first, whole
            with timer.phase("fetch", nbytes=fetch.packed.data_bytes):
                fetch.run(opts.cold_threads, _piece_bytes(opts, fetch.packed))
            fetch = None
            opts = opts.model_copy(update={"verify": False})  # every chunk was checked as it landed
    with timer.phase("open"):
        if fetch is not None:
            packed = fetch.packed  # (its file is still arriving; the header came from the source)
        else:
            packed = read_packed(path if rank is None else rank_path(path, rank))
        note = check_side_files(packed)  # before any weight byte is read (they are small)
        if note:
            log.warning(note)
        d = packed.model_dir
        config = _read_config(d)
    if dev.type == "cpu":
        try:
            return PendingLoad(d, packed, dev, _load_cpu(packed, opts, timer), config, timer)
        except PackedFormatError as e:
            if from_cache:
                raise PackedFormatError(str(e) + drop_corrupt(packed.path, e)) from None
            raise
    if dev.type == "cuda":
        try:
            buffer, work = _start_cuda(packed, dev, opts, timer, fetch)
        except BaseException:
            if fetch is not None:
                fetch.abort()
            raise
        if from_cache and fetch is None:
            work = _dropping_corrupt(work, packed.path)
        return PendingLoad(d, packed, buffer.device, buffer, config, timer, work, hold=hold)
    raise ValueError(f"device={device!r}: only cpu and cuda are supported")


def _device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch.device (None: cuda where available, else cpu). A CUDA device where
    torch sees none is refused here, in words, not by torch's driver error at allocation."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}: CUDA is not available here (torch sees no GPU: "
                         "no device, no driver, or a CPU-only torch); pass device=\"cpu\" to load "
                         "on the CPU")
    return dev


def _read_config(d: Path) -> dict:
    p = d / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{d}: no config.json beside the weights; re-pack the model")
    return read_json(p, "re-pack the model from its source")


def _views(packed: PackedFile, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for t in packed.tensors:
        dt = getattr(torch, DTYPES[t.dtype][1])
        # [nbytes] uint8 -> [numel] dtype -> shape; offsets are 4 KiB-aligned
        out[t.name] = buffer[t.offset: t.offset + t.nbytes].view(dt).view(t.shape)
    for alias, target in packed.index.aliases.items():
        out[alias] = out[target]
    return out


def _verify(packed: PackedFile, data: torch.Tensor) -> None:
    stream.check_sums(packed, checksum.chunk_sums_tensor(data, packed.index.chunk_bytes))


def _load_cpu(packed: PackedFile, opts: LoadOptions, timer: PhaseTimer) -> torch.Tensor:
    with timer.phase("map"):
        # copy-on-write private map: torch gets a writable array, the file is never written
        region = np.memmap(packed.path, dtype=np.uint8, mode="c", offset=packed.data_offset,
                           shape=(packed.data_bytes,))
        buffer = torch.from_numpy(region)
    if opts.verify:
        with timer.phase("verify", nbytes=packed.data_bytes):
            _verify(packed, buffer)
    return buffer


def _dropping_corrupt(work: Callable[[], None], weights: Path) -> Callable[[], None]:
    def run() -> None:
        try:
            work()
        except PackedFormatError as e:
            raise PackedFormatError(str(e) + drop_corrupt(weights, e)) from None
    return run


def _piece_bytes(opts: LoadOptions, packed: PackedFile) -> int:
    """A remote transfer's piece: whole chunks, at least ``cold_read_bytes``."""
    cb = packed.index.chunk_bytes
    return max(cb, -(-opts.cold_read_bytes // cb) * cb)


def _start_cuda(packed: PackedFile, dev: torch.device, opts: LoadOptions,
                timer: PhaseTimer, fetch: Fetch | None = None) -> tuple[torch.Tensor, Callable[[], None]]:
    """Allocate the device buffer (after checking it fits); return it and the work that
    fills and verifies it, for the load's own thread (``fetch``: a remote model's transfer, each
    piece checked on the host as it lands, into the node cache too)."""
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    n = packed.data_bytes
    with timer.phase("alloc"):
        free, total = torch.cuda.mem_get_info(dev)
        check_fits(n, free, total, str(dev), opts.headroom_bytes)
        with one_segment(dev):
            buffer = torch.empty(n, dtype=torch.uint8, device=dev)
        # the buffer's (uninitialised) allocation must be complete before other streams write it
        torch.cuda.current_stream(dev).synchronize()

    def work() -> None:
        # On the load's thread, so from the moment the buffer and its views exist, or the
        # caller released a held load (never before: a bulk read of the same disk starves
        # the page faults of whatever the caller's thread still runs on torch's and CUDA's
        # libraries: with it started before the views, a cold replica took seconds instead
        # of milliseconds to make them)
        if fetch is not None:
            _fetch_work(packed, buffer, dev, opts, timer, fetch)
            return
        readahead.stop_trickle(packed.path)  # the caller's gentle reader, if any: from here on, these reads
        o = _settings_for_cache(packed, opts) if opts.adapt else opts  # what is in the page cache now
        if o.readahead and not o.direct_io:
            readahead.prefetch(packed.path)
        torch.cuda.set_device(dev)
        rt = stream.cudart()
        verifier = stream.DeviceVerifier(packed, buffer, dev) if o.verify else None
        # no device-wide sync in these phases: other threads may be using the GPU meanwhile;
        # every copy has been waited for (its event) when stream_into returns
        with timer.phase("read_copy", nbytes=n):
            stream.stream_into(packed, buffer, dev, o, rt, verifier)
        if verifier is not None:
            # the sums of most chunks were computed while later ones were still loading;
            # this phase is only what was left when the last byte arrived
            with timer.phase("verify", nbytes=n):
                verifier.finish()
    return buffer, work


def _fetch_work(packed: PackedFile, buffer: torch.Tensor, dev: torch.device, opts: LoadOptions,
                timer: PhaseTimer, fetch: Fetch) -> None:
    """A remote model's bytes into the device buffer and the node cache: the cold settings' threads,
    pieces of whole chunks (each checked on the device as it lands, ``stream.PieceVerifier``, so no
    ``DeviceVerifier``); the cache's writes go
    on behind the copies (``weights.fetch.Behind``) and may end after this returns
    (``Fetch.cached``); any failure of the transfer removes the cache's file."""
    torch.cuda.set_device(dev)
    o = opts.model_copy(update={"threads": opts.cold_threads, "read_bytes": _piece_bytes(opts, packed)})
    rt = stream.cudart()
    step = min(fetch.piece_step(o.read_bytes), -(-packed.data_bytes // 4096) * 4096)
    behind = fetch.write_behind(lambda: stream.Slots(rt, dev, buffer, 1, step))
    try:
        with timer.phase("fetch", nbytes=packed.data_bytes):
            stream.stream_into(packed, buffer, dev, o, rt, None, fetch, behind)
    except BaseException:
        behind.cancel()
        raise
    behind.close()


def _settings_for_cache(packed: PackedFile, opts: LoadOptions) -> LoadOptions:
    """Disk settings when more than a tenth of the data region is not in the page cache (a
    replica's trickle may have read the front of a cold file: the rest is a disk read)."""
    frac = readahead.resident_fraction(packed.path, packed.data_offset, packed.data_bytes)
    if frac is None or frac >= 0.9:
        return opts
    log.info("%.0f%% of %s is in the page cache: reading it from disk with %d threads x %d MiB",
             100 * frac, packed.path, opts.cold_threads, opts.cold_read_bytes >> 20)
    return opts.model_copy(update={"threads": opts.cold_threads, "read_bytes": opts.cold_read_bytes,
                                   "direct_io": opts.direct_io or opts.cold_direct_io})
