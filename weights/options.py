"""``LoadOptions``: the GPU load path's settings. Imports no torch, so a replica can read and
check them before its imports (``deployments.server.LLMServer`` decides on its trickle from
them before ``import torch``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadOptions:
    """Tuning of the GPU load path (defaults measured on an H200 host, see bench/).

    Attributes:
        threads: reader threads; each has its own CUDA stream.
        read_bytes: bytes per read and per host->device copy (a multiple of 4096).
        slots_per_thread: pinned staging slots per thread (2 = double buffering).
        verify: check every chunk's checksum (on the device for GPU loads).
        cold_threads, cold_read_bytes: used instead when ``adapt`` is on and most of
            the file is not in the page cache (sampled with mincore before reading).
        readahead: start ``weights.readahead.prefetch`` as the load's thread starts
            (after the buffer and its views), so a cold disk streams ahead of the readers.
        trickle: read by a replica (``LLMServer``), not here: when most of the file is not
            in the page cache, the replica trickles it in (``weights.readahead.trickle``)
            from its first instant and holds this load's reads until its engine is built.
        trickle_read_bytes: the trickle's one read at a time (a multiple of 4096). A page
            fault of the imports beside it waits for one such read at most; a larger one
            reads more of the file before the bulk read starts but slows the imports: at
            4 MiB a cold replica's start on an H200 host took 0.57 s longer than at 1 MiB
            (median of three rounds), without the trickle 1.67 s longer
            (bench/results/runs/serve-v15-cold-trickle.json).
        direct_io: read with O_DIRECT, past the page cache (falls back to buffered
            reads where the filesystem refuses it); ``cold_direct_io`` turns it on
            for the cold settings only.
        headroom_bytes: device memory that must stay free after the weights
            (activations, the KV cache); the load is refused up front otherwise.
    """

    # From the page cache, 8 threads x 4 MiB was the fastest of 8/16/24 threads x
    # 4/8 MiB on an H200 host (bench/results/runs/load-v2-*.json): more threads only
    # contend. From disk, 16 x 8 MiB did better (94 % vs 85 % of the disk's rate).
    threads: int = 8
    read_bytes: int = 4 << 20
    cold_threads: int = 16
    cold_read_bytes: int = 8 << 20
    adapt: bool = True
    slots_per_thread: int = 2
    verify: bool = True
    headroom_bytes: int = 0
    readahead: bool = True
    trickle: bool = True
    trickle_read_bytes: int = 1 << 20
    direct_io: bool = False
    cold_direct_io: bool = False

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads={self.threads} must be at least 1")
        for name in ("read_bytes", "cold_read_bytes", "trickle_read_bytes"):
            v = getattr(self, name)
            if v < 4096 or v % 4096:
                raise ValueError(f"{name}={v} must be a positive multiple of 4096")
        if self.cold_threads < 1:
            raise ValueError(f"cold_threads={self.cold_threads} must be at least 1")
        if self.slots_per_thread < 1:
            raise ValueError(f"slots_per_thread={self.slots_per_thread} must be at least 1")
