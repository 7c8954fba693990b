"""``coldstart verify DEST``: check a packed model's structure and every chunk."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import checksum
from .format import PackedFile, read_packed

_GROUP = 64  # chunks summed per reduction: bounded temporaries, a progress step


@dataclass
class VerifyReport:
    packed: PackedFile
    bad_chunks: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_chunks

    def problems(self) -> list[str]:
        return [f"checksum mismatch in {self.packed.describe_chunk(c)}" for c in self.bad_chunks]


def verify(path: str | os.PathLike, progress=None) -> VerifyReport:
    """Check structure (raises ``PackedFormatError``) and every chunk (listed in the report).

    Args:
        path: packed model directory or its ``model.cst``.
        progress: optional callable taking the number of bytes checked so far.
    """
    packed = read_packed(path)
    cb = packed.index.chunk_bytes
    region = np.memmap(packed.path, dtype=np.uint8, mode="c", offset=packed.data_offset,
                       shape=(packed.data_bytes,))
    data = torch.from_numpy(region)
    want = checksum.as_signed(packed.index.chunk_sums)
    report = VerifyReport(packed)
    n = len(packed.index.chunk_sums)
    for first in range(0, n, _GROUP):
        k = min(_GROUP, n - first)
        got = checksum.chunk_sums_tensor(data, cb, first, k)
        for i in (got != want[first: first + k]).any(dim=1).nonzero().flatten().tolist():
            report.bad_chunks.append(first + i)
        if progress:
            progress(min((first + k) * cb, packed.data_bytes))
    return report


def is_packed_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / "model.cst").is_file()
