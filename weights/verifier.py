"""``coldstart verify DEST``: check a packed model's structure, every chunk and every side file."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import checksum
from .format import PackedFile, read_packed, side_file_problems, unprotected_note

_GROUP = 64  # chunks summed per reduction: bounded temporaries, a progress step


@dataclass
class VerifyReport:
    """What ``verify`` found: bad chunks, side files that do not match the index (each a
    problem), and notes that do not fail it (a pack whose side files are unprotected)."""

    packed: PackedFile
    bad_chunks: list[int] = field(default_factory=list)
    side_problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_chunks and not self.side_problems

    def problems(self) -> list[str]:
        """One line per problem, each naming its file."""
        return [f"{self.packed.path}: checksum mismatch in {self.packed.describe_chunk(c)}"
                for c in self.bad_chunks] + self.side_problems

    def summary(self) -> str:
        parts = [f"{len(self.bad_chunks)} bad chunk(s)"] if self.bad_chunks else []
        if self.side_problems:
            parts.append(f"{len(self.side_problems)} side file(s) not as packed")
        return " and ".join(parts) or "no problems"


def verify(path: str | os.PathLike, progress=None) -> VerifyReport:
    """Check structure (raises ``PackedFormatError``), every side file and every chunk (each
    problem listed in the report).

    Args:
        path: packed model directory or its ``model.cst``.
        progress: optional callable taking the number of bytes checked so far.
    """
    packed = read_packed(path)
    report = VerifyReport(packed, side_problems=side_file_problems(packed))
    if packed.index.side_files is None:
        report.notes.append(unprotected_note(packed))
    cb = packed.index.chunk_bytes
    region = np.memmap(packed.path, dtype=np.uint8, mode="c", offset=packed.data_offset,
                       shape=(packed.data_bytes,))
    data = torch.from_numpy(region)
    want = checksum.as_signed(packed.index.chunk_sums)
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
