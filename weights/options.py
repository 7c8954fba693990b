"""``LoadOptions``: the load path's settings (``args.load`` in serve_config.yaml). Imports no
torch, so a replica can read and check them before its imports (it decides on its trickle from
them before ``import torch``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LoadOptions(BaseModel):
    """How a packed model is read onto the device. Unknown fields and wrong types are refused
    with the field's name. The defaults are the load sweep's fastest (docs/measurements.md)."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, frozen=True)

    threads: int = Field(8, ge=1)
    """Reader threads, each with its own CUDA stream (page cache warm: more only contend)."""
    read_bytes: int = 4 << 20
    """Bytes per read and per host->device copy (a multiple of 4096)."""
    cold_threads: int = Field(16, ge=1)
    """Reader threads where most of the file is not in the page cache (``adapt``)."""
    cold_read_bytes: int = 8 << 20
    """Bytes per read where most of the file is not in the page cache (a multiple of 4096)."""
    adapt: bool = True
    """Sample the page cache (mincore) before reading and use the cold settings when most of the
    file is not there."""
    slots_per_thread: int = Field(2, ge=1)
    """Pinned staging slots per reader thread (2: double buffering)."""
    verify: bool = True
    """Check every chunk's checksum while loading (on the device for GPU loads)."""
    headroom_bytes: int = Field(0, ge=0)
    """Device memory that must stay free after the weights; the load is refused up front otherwise."""
    readahead: bool = True
    """Read the file ahead of the readers into the page cache once they start (a cold disk
    streams ahead of them)."""
    trickle: bool = True
    """On a GPU replica whose weights are mostly not in the page cache: read them one piece at a
    time from the replica's first instant, and hold the bulk read until its engine is built."""
    trickle_read_bytes: int = 1 << 20
    """The trickle's one read at a time (a multiple of 4096): a page fault of the imports beside it
    waits for one such read at most."""
    remote_timeout_s: float = Field(60.0, gt=0)
    """A remote model (``s3://``, ``https://``): seconds one ranged read of a piece (16 MiB) may take
    before it counts as failed and the piece is asked of the next source (the default allows a
    source as slow as 0.3 MB/s per read)."""
    direct_io: bool = False
    """Read with O_DIRECT, past the page cache (buffered reads where the filesystem refuses it)."""
    cold_direct_io: bool = False
    """O_DIRECT for the cold settings only."""

    @model_validator(mode="after")
    def _aligned(self) -> "LoadOptions":
        for name in ("read_bytes", "cold_read_bytes", "trickle_read_bytes"):
            v = getattr(self, name)
            if v < 4096 or v % 4096:
                raise ValueError(f"{name}={v} must be a positive multiple of 4096")
        return self
