"""The GPU half of a load: reader threads ``preadv`` the weight file into pinned staging slots
and copy each slot to the device buffer on their own CUDA stream, while a verifier thread sums
the chunks that have landed (``weights.loader`` allocates the buffer and runs this on the load's
thread)."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import checksum
from .format import PackedFile, PackedFormatError
from .options import LoadOptions

if TYPE_CHECKING:
    from .fetch import Behind, Fetch

log = logging.getLogger(__name__)


def check_sums(packed: PackedFile, got: torch.Tensor) -> None:
    """Compare computed chunk sums ``[n, 2]`` with the index; name the first bad chunk."""
    bad = checksum.first_mismatch(got, checksum.as_signed(packed.index.chunk_sums))
    if bad is not None:
        raise PackedFormatError(
            f"{packed.path}: checksum mismatch in {packed.describe_chunk(bad)}; the file is "
            "corrupt: re-copy or re-pack the model (coldstart verify names every bad chunk)")


_RT: list = []


def cudart():
    """libcudart through ctypes (GIL-free copies), found once; None -> torch calls."""
    if not _RT:
        from .cudart import CudaRT
        rt = CudaRT.shared()
        if rt is None:
            log.warning("libcudart not found in this process: loading through torch's copy calls, "
                        "which hold the GIL per piece (slower with many threads)")
        _RT.append(rt)
    return _RT[0]


class DeviceVerifier:
    """Checks groups of chunks on the device as soon as all their bytes have landed.

    Runs in its own thread and CUDA stream while the readers go on, so for all
    but the last group the check costs no wall time.
    """

    GROUP = 32  # chunks per reduction: 512 MiB with 16 MiB chunks

    def __init__(self, packed: PackedFile, buffer: torch.Tensor, dev: torch.device):
        self.packed, self.buffer, self.dev = packed, buffer, dev
        self.cb = packed.index.chunk_bytes
        self.n_chunks = len(packed.index.chunk_sums)
        self.sums = torch.empty((self.n_chunks, 2), dtype=torch.int64, device=dev)
        self.landed = 0  # bytes [0, landed) are on the device
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="coldstart-verify", daemon=True)
        self.thread.start()

    def advance(self, upto: int) -> None:
        with self.cond:
            if upto > self.landed:
                self.landed = upto
                self.cond.notify_all()

    def abort(self) -> None:
        self.advance(1 << 62)

    def _run(self) -> None:
        try:
            torch.cuda.set_device(self.dev)
            stream = torch.cuda.Stream(self.dev)
            with torch.cuda.stream(stream):
                # load the reduction kernels now, not when the last byte has arrived
                checksum.chunk_sums_tensor(torch.zeros(4096, dtype=torch.uint8, device=self.dev), 4096)
                for first in range(0, self.n_chunks, self.GROUP):
                    k = min(self.GROUP, self.n_chunks - first)
                    end = min((first + k) * self.cb, self.packed.data_bytes)
                    with self.cond:
                        self.cond.wait_for(lambda: self.landed >= end)
                    self.sums[first:first + k] = checksum.chunk_sums_tensor(
                        self.buffer, self.cb, first, k)
            stream.synchronize()
        except BaseException as e:  # reported by finish()
            self.error = e

    def finish(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error
        check_sums(self.packed, self.sums)


class PieceVerifier:
    """A remote model's pieces checked on the device as they land (``stream_into`` with a fetch):
    the host's readers then only read and copy. Each piece's chunk sums are computed on this
    thread's stream and compared with the index's; a good piece goes on to the cache's writes
    (``behind``), a bad one is kept for ``finish``, which the loader's thread follows by fetching
    it again (``Fetch.refetch``)."""

    def __init__(self, packed: PackedFile, buffer: torch.Tensor, dev: torch.device, behind: "Behind"):
        self.buffer, self.dev, self.behind = buffer, dev, behind
        self.cb = packed.index.chunk_bytes
        self.want = checksum.as_signed(packed.index.chunk_sums).to(dev)
        self.bad: list[tuple[int, int]] = []
        self.error: BaseException | None = None
        self._q: "queue.Queue[tuple[int, int] | None]" = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="coldstart-verify", daemon=True)
        self.thread.start()

    def put(self, off: int, length: int) -> None:
        """Data-region bytes ``off..off+length`` (whole chunks, or the region's end) are on the device."""
        self._q.put((off, length))

    def _run(self) -> None:
        try:
            cuda = self.dev.type == "cuda"
            if cuda:
                torch.cuda.set_device(self.dev)
            with torch.cuda.stream(torch.cuda.Stream(self.dev)) if cuda else contextlib.nullcontext():
                while (p := self._q.get()) is not None:
                    if self.error is not None:
                        continue
                    off, length = p
                    first, k = off // self.cb, -(-length // self.cb)
                    got = checksum.chunk_sums_tensor(self.buffer, self.cb, first, k)
                    if bool((got == self.want[first:first + k]).all()):  # (waits for this stream only)
                        self.behind.put(off, length)
                    else:
                        self.bad.append(p)
        except BaseException as e:  # reported by finish()
            self.error = e
            while self._q.get() is not None:
                pass

    def finish(self) -> list[tuple[int, int]]:
        """Every piece was put: wait for their checks; the pieces found bad."""
        self._q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.bad


class Slots:
    """One reader thread's pinned staging slots, stream and copies.

    With libcudart (``rt``) every call is a ctypes call that drops the GIL;
    otherwise the same steps go through torch.
    """

    def __init__(self, rt, dev: torch.device, buffer: torch.Tensor, n: int, step: int):
        self.rt, self.buffer = rt, buffer
        self.stream = torch.cuda.Stream(dev)
        if rt is not None:
            from .cudart import host_view
            rt.set_device(dev.index)
            self.ptrs = [rt.host_alloc(step) for _ in range(n)]
            self.views = [host_view(p, step) for p in self.ptrs]
            self.events = [rt.event() for _ in range(n)]
            self.handle = self.stream.cuda_stream
            self.base = buffer.data_ptr()
        else:
            self.tensors = [torch.empty(step, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
            self.views = [memoryview(t.numpy()) for t in self.tensors]
            self.events = [torch.cuda.Event() for _ in range(n)]
        self.pending: list[tuple[int, int] | None] = [None] * n  # (offset, length) of each slot's copy in flight

    def wait(self, s: int) -> tuple[int, int] | None:
        """Wait until slot ``s`` is free; returns (offset, length) of the copy that freed it."""
        piece, self.pending[s] = self.pending[s], None
        if piece is not None:
            self._sync(s)
        return piece

    def _sync(self, s: int) -> None:
        if self.rt is not None:
            self.rt.wait(self.events[s])
        else:
            self.events[s].synchronize()

    def copy(self, s: int, off: int, length: int) -> None:
        if self.rt is not None:
            self.rt.copy_h2d(self.base + off, self.ptrs[s], length, self.handle)
            self.rt.record(self.events[s], self.handle)
        else:
            with torch.cuda.stream(self.stream):
                self.buffer[off: off + length].copy_(self.tensors[s][:length], non_blocking=True)
                self.events[s].record(self.stream)
        self.pending[s] = (off, length)

    def copy_back(self, s: int, off: int, length: int) -> None:
        """The device buffer's bytes ``off..off+length`` into slot ``s``; returns when they are there."""
        if self.rt is not None:
            self.rt.copy_d2h(self.ptrs[s], self.base + off, length, self.handle)
            self.rt.record(self.events[s], self.handle)
        else:
            with torch.cuda.stream(self.stream):
                self.tensors[s][:length].copy_(self.buffer[off: off + length], non_blocking=True)
                self.events[s].record(self.stream)
        self._sync(s)

    def close(self) -> None:
        if self.rt is not None:
            for e in self.events:
                self.rt.destroy(e)
            for p in self.ptrs:
                self.rt.free_host(p)


def stream_into(packed: PackedFile, buffer: torch.Tensor, dev: torch.device, opts: LoadOptions,
                 rt, verifier: DeviceVerifier | None, fetch: "Fetch | None" = None,
                 behind: "Behind | None" = None) -> None:
    """Fill ``buffer`` with the data region: from the file, or through ``fetch`` (a remote model's
    transfer, ``weights.fetch``: its pieces in its order, each checked on the device as it lands
    (``PieceVerifier``; no ``verifier``) and then given to ``behind``, the node cache's writes)."""
    n, step = packed.data_bytes, opts.read_bytes
    order = None
    if fetch is not None and behind is None:
        raise ValueError("stream_into: a fetch's pieces are written to the node cache through its Behind "
                         "(Fetch.write_behind)")
    if fetch is not None:
        pieces = fetch.pieces(step)
        step = max(length for _, length in pieces)
        order = fetch.order(pieces)  # taken as the threads come free (pieces peers read are put off)
    else:
        pieces = [(off, min(step, n - off)) for off in range(0, n, step)]
    nthreads = min(opts.threads, len(pieces))
    fd, direct = _open(packed.path, opts.direct_io) if fetch is None else (-1, False)
    errors: list[BaseException] = []
    stop = threading.Event()
    # a local file's piece j goes to thread j % nthreads: together the threads sweep the file front
    # to back (sequential for a cold disk, and chunks complete roughly in order)
    done_upto = [0] * nthreads  # per thread: all its pieces below this offset are on the device
    lock = threading.Lock()
    all_slots: list[Slots] = []  # freed after every thread is done: cudaFreeHost can sync the device

    checks = PieceVerifier(packed, buffer, dev, behind) if fetch is not None else None

    def landed(k: int, piece: tuple[int, int] | None) -> None:
        if piece is None:
            return
        if checks is not None:
            checks.put(*piece)
        advance(k, sum(piece))

    def advance(k: int, upto: int) -> None:
        if verifier is None:
            return
        with lock:
            done_upto[k] = upto
            low = min(done_upto)
        verifier.advance(low)

    def worker(k: int) -> None:
        # a fetch's reader seconds outside its reads, by what they waited for (``Fetch.add_idle``):
        # pinning the slots, a slot's copy to the device, the next piece
        t = time.perf_counter()
        idle = {"pin": 0.0, "slot": 0.0, "next": 0.0}

        def took(what: str) -> None:
            nonlocal t
            now = time.perf_counter()
            idle[what] += now - t
            t = now
        try:
            torch.cuda.set_device(dev)
            # each thread pins its own slots, which overlaps other threads' reads (the driver pins
            # one allocation at a time: a transfer's 16 x 2 x 16 MiB cost its readers seconds, idle_s)
            slots = Slots(rt, dev, buffer, opts.slots_per_thread, step)
            with lock:
                all_slots.append(slots)
            mine = pieces[k::nthreads] if order is None else iter(order.next, None)
            took("pin")
            for i, (off, length) in enumerate(mine):
                took("next")
                if stop.is_set():
                    return
                s = i % len(slots.views)
                landed(k, slots.wait(s))
                took("slot")
                if fetch is not None:
                    fetch.read_into(slots.views[s], off, length, write=False, check=False)
                else:
                    _read_exact(fd, slots.views[s], length, packed.data_offset + off, packed, direct)
                slots.copy(s, off, length)
                t = time.perf_counter()
            took("next")
            for s in range(len(slots.views)):
                landed(k, slots.wait(s))
            took("slot")
            advance(k, n)
        except BaseException as e:  # re-raised in the caller's thread below
            errors.append(e)
            stop.set()
            if order is not None:
                order.close()
        finally:
            if fetch is not None:
                fetch.add_idle(idle)

    threads = [threading.Thread(target=worker, args=(k,), name=f"coldstart-load-{k}")
               for k in range(nthreads)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if checks is not None:
            bad = checks.finish()
            if bad and not errors:
                _again(fetch, all_slots[0], bad, checks)
    finally:
        if fd >= 0:
            os.close(fd)
        for sl in all_slots:
            sl.close()
        if errors and verifier is not None:
            verifier.abort()
            verifier.thread.join()
    if errors:
        raise errors[0]


def _again(fetch: "Fetch", slots: Slots, bad: list[tuple[int, int]], checks: PieceVerifier) -> None:
    """The pieces the device found corrupt, fetched again (checked on the host this time) and
    copied once more; then on to the cache's writes."""
    for off, length in bad:
        slots.wait(0)
        fetch.refetch(slots.views[0], off, length)
        slots.copy(0, off, length)
        slots.wait(0)
        checks.behind.put(off, length)


def _open(path: Path, direct: bool) -> tuple[int, bool]:
    """The weight file's descriptor, with O_DIRECT when asked and the filesystem allows it."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError as e:  # tmpfs and some network filesystems refuse it
            log.info("O_DIRECT refused for %s (%s): buffered reads", path, e)
    return os.open(path, os.O_RDONLY), False


def _read_exact(fd: int, slot: memoryview, length: int, offset: int, packed: PackedFile,
                direct: bool = False) -> None:
    """Read ``length`` bytes at ``offset`` into the start of ``slot``.

    O_DIRECT needs block-aligned sizes: the read is rounded up to 4 KiB (the slot
    is a multiple of that and the data region's offsets are 4 KiB-aligned), so it
    may take in a few bytes of what follows, which are never copied.
    """
    want = -(-length // 4096) * 4096 if direct else length
    done = 0
    while done < length:
        got = os.preadv(fd, [slot[done:want]], offset + done)
        if got == 0:
            raise PackedFormatError(f"{packed.path}: truncated while loading at byte "
                                    f"{offset + done}; the file changed after it was opened")
        done += got
