"""Load a packed model into ONE device buffer, verifying it as it loads.

GPU path: one ``torch.empty(data_bytes, uint8)`` on the device; reader threads
``preadv`` the file in ``read_bytes`` pieces into a small pinned staging ring
(``slots_per_thread`` slots per thread, so pinning costs tens of ms, not the
seconds a whole-model pinned buffer would) and each thread copies its slot to
the device on its own CUDA stream, overlapping the next read. ``preadv``
releases the GIL, so threads read the page cache in parallel. Once every byte
is on the device, the chunk checksums are computed there (two reductions over
the buffer, milliseconds) and compared with the index; a mismatch names the
chunk, its tensors and the file. Every tensor is then a view of the buffer:
no per-tensor allocation, no second copy.

CPU path: the data region is memory-mapped (copy-on-write, never written) and
tensors are views of the map: zero copy, and nothing is read until used,
except that verification (on by default) reads every chunk once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import checksum
from .format import DTYPES, PackedFile, PackedFormatError, read_packed
from .timing import PhaseTimer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadOptions:
    """Tuning of the GPU load path (defaults measured on an H200 host, see bench/).

    Attributes:
        threads: reader threads; each has its own CUDA stream.
        read_bytes: bytes per read and per host->device copy (a multiple of 4096).
        slots_per_thread: pinned staging slots per thread (2 = double buffering).
        verify: check every chunk's checksum (on the device for GPU loads).
        headroom_bytes: device memory that must stay free after the weights
            (activations, the KV cache); the load is refused up front otherwise.
    """

    threads: int = 16
    read_bytes: int = 8 << 20
    slots_per_thread: int = 2
    verify: bool = True
    headroom_bytes: int = 0

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads={self.threads} must be at least 1")
        if self.read_bytes < 4096 or self.read_bytes % 4096:
            raise ValueError(f"read_bytes={self.read_bytes} must be a positive multiple of 4096")
        if self.slots_per_thread < 1:
            raise ValueError(f"slots_per_thread={self.slots_per_thread} must be at least 1")

    @property
    def ring_bytes(self) -> int:
        return self.threads * self.slots_per_thread * self.read_bytes


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


def load(path: str | os.PathLike, device: str | torch.device = "cuda", *,
         options: LoadOptions | None = None, timer: PhaseTimer | None = None) -> LoadedModel:
    """Load a packed model directory into one buffer on ``device``.

    Args:
        path: packed model directory (or its ``model.cst``).
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        options: ``LoadOptions``.
        timer: a ``PhaseTimer`` to record phases into (a new one by default).
    Returns:
        ``LoadedModel`` whose ``tensors`` map every name (aliases included) to a
        view of ``buffer``.
    Raises:
        PackedFormatError: bad structure or a checksum mismatch (names the chunk,
            its tensors and the file).
        DeviceMemoryError: the model does not fit in free device memory.

    Example:
        >>> m = load("weights/demo", "cpu")
        >>> m.tensors["model.embed_tokens.weight"].shape
    """
    opts = options or LoadOptions()
    timer = timer or PhaseTimer()
    dev = torch.device(device)
    with timer.phase("open"):
        packed = read_packed(path)
        d = packed.path.parent
        config = _read_config(d)
    if dev.type == "cpu":
        buffer = _load_cpu(packed, opts, timer)
    elif dev.type == "cuda":
        buffer = _load_cuda(packed, dev, opts, timer)
    else:
        raise ValueError(f"device={device!r}: only cpu and cuda are supported")
    with timer.phase("assemble"):
        tensors = _views(packed, buffer)
    return LoadedModel(d, packed, dev, buffer, tensors, config, timer)


def _read_config(d: Path) -> dict:
    p = d / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{d}: no config.json beside the weights; re-pack the model")
    with open(p) as f:
        return json.load(f)


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
    got = checksum.chunk_sums_tensor(data, packed.index.chunk_bytes)
    bad = checksum.first_mismatch(got, checksum.as_signed(packed.index.chunk_sums))
    if bad is not None:
        raise PackedFormatError(
            f"{packed.path}: checksum mismatch in {packed.describe_chunk(bad)}; the file is "
            "corrupt: re-copy or re-pack the model (coldstart verify names every bad chunk)")


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


def _load_cuda(packed: PackedFile, dev: torch.device, opts: LoadOptions,
               timer: PhaseTimer) -> torch.Tensor:
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    n = packed.data_bytes
    with timer.phase("alloc"):
        free, total = torch.cuda.mem_get_info(dev)
        check_fits(n, free, total, str(dev), opts.headroom_bytes)
        buffer = torch.empty(n, dtype=torch.uint8, device=dev)
    with timer.phase("pin", nbytes=opts.ring_bytes):
        ring = torch.empty(opts.ring_bytes, dtype=torch.uint8, pin_memory=True)
    with timer.phase("read_copy", nbytes=n, sync=lambda: torch.cuda.synchronize(dev)):
        _stream_into(packed, buffer, ring, dev, opts)
    if opts.verify:
        with timer.phase("verify", nbytes=n, sync=lambda: torch.cuda.synchronize(dev)):
            _verify(packed, buffer)
    return buffer


def _stream_into(packed: PackedFile, buffer: torch.Tensor, ring: torch.Tensor,
                 dev: torch.device, opts: LoadOptions) -> None:
    n, step, nthreads = packed.data_bytes, opts.read_bytes, opts.threads
    pieces = [(off, min(step, n - off)) for off in range(0, n, step)]
    nthreads = min(nthreads, len(pieces))
    fd = os.open(packed.path, os.O_RDONLY)
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(k: int) -> None:
        try:
            torch.cuda.set_device(dev)
            stream = torch.cuda.Stream(dev)
            base = k * opts.slots_per_thread * step
            slots = [ring[base + i * step: base + (i + 1) * step]
                     for i in range(opts.slots_per_thread)]
            views = [memoryview(s.numpy()) for s in slots]
            events: list[torch.cuda.Event | None] = [None] * len(slots)
            # piece j goes to thread j % nthreads: together the threads sweep the
            # file front to back, which keeps a cold disk's reads sequential
            for i, (off, length) in enumerate(pieces[k::nthreads]):
                if stop.is_set():
                    return
                s = i % len(slots)
                if events[s] is not None:
                    events[s].synchronize()  # the slot's previous copy has left it
                _read_exact(fd, views[s][:length], packed.data_offset + off, packed)
                with torch.cuda.stream(stream):
                    buffer[off: off + length].copy_(slots[s][:length], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                events[s] = ev
            stream.synchronize()
        except BaseException as e:  # re-raised in the caller's thread below
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=worker, args=(k,), name=f"coldstart-load-{k}")
               for k in range(nthreads)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    if errors:
        raise errors[0]


def _read_exact(fd: int, view: memoryview, offset: int, packed: PackedFile) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise PackedFormatError(f"{packed.path}: truncated while loading at byte "
                                    f"{offset + done}; the file changed after it was opened")
        done += got
