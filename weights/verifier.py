"""``coldstart verify DEST``: check a packed model's structure, every chunk and every side file;
of a split pack (``--tp N``), every rank's file."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import checksum
from .format import (PackedFile, PackedFormatError, rank_dir, read_packed, refuse_leftover, side_file_problems,
                     read_manifest, unprotected_note)
from .tp import is_split_pack

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
        """One line per problem, each naming its file (and a split pack's rank)."""
        tp = self.packed.tp
        where = f"{self.packed.path} (rank {tp['rank']} of {tp['size']})" if tp else self.packed.path
        return [f"{where}: checksum mismatch in {self.packed.describe_chunk(c)}"
                for c in self.bad_chunks] + self.side_problems

    def summary(self) -> str:
        parts = [f"{len(self.bad_chunks)} bad chunk(s)"] if self.bad_chunks else []
        if self.side_problems:
            parts.append(f"{len(self.side_problems)} side file(s) not as packed")
        return " and ".join(parts) or "no problems"


@dataclass
class SplitVerifyReport:
    """What ``verify`` found in a split pack: one ``VerifyReport`` per rank whose file could be
    read as its rank's (``ranks``); the ranks whose file could not, or is another's (``unread``,
    with ``errors`` naming rank, file and why), and directories that are no rank of the pack
    (``errors`` too)."""

    path: Path
    size: int
    ranks: list[VerifyReport] = field(default_factory=list)
    unread: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and all(r.ok for r in self.ranks)

    @property
    def notes(self) -> list[str]:
        return list(dict.fromkeys(n for r in self.ranks for n in r.notes))

    def problems(self) -> list[str]:
        """One line per problem; a side file's (every rank checks them) once."""
        return self.errors + list(dict.fromkeys(p for r in self.ranks for p in r.problems()))

    def summary(self) -> str:
        bad = [f"rank {r.packed.tp['rank']}: {r.summary()}" for r in self.ranks if not r.ok]
        bad += [f"rank {k}: its file refused (above)" for k in self.unread]
        if len(self.errors) > len(self.unread):
            bad.append("directories that are no rank of the pack")
        return f"{'; '.join(bad)} (of {self.size} ranks)" if bad else "no problems"


def verify(path: str | os.PathLike, progress=None) -> "VerifyReport | SplitVerifyReport":
    """Check structure (raises ``PackedFormatError``), every side file and every chunk (each
    problem listed in the report); of a split pack, every rank's file (``SplitVerifyReport``).

    Args:
        path: packed model directory or its ``model.cst``; or a split pack's directory.
        progress: optional callable taking the number of bytes checked so far.
    """
    if Path(path).is_dir() and is_split_pack(path) and not (Path(path) / "model.cst").exists():
        refuse_leftover(Path(path))  # a pack's temporary directory: refused as read_packed refuses it
        return _verify_split(Path(path), progress)
    return _verify_file(path, progress)


def _verify_split(d: Path, progress=None) -> SplitVerifyReport:
    """Every rank's file of the split pack ``d``, each checked as a packed file of its own; a
    rank whose file cannot be read is reported, and the others still checked."""
    size = read_manifest(d)["size"]
    report = SplitVerifyReport(d, size)
    done = [0]
    for k in range(size):
        base = done[0]

        def step(n: int, base: int = base) -> None:
            done[0] = base + n
            if progress:
                progress(done[0])
        try:
            r = _verify_file(d / rank_dir(k), step)
            if r.packed.tp is None or r.packed.tp["size"] != size:
                raise PackedFormatError(f"{r.packed.path}: not a rank's file of this {size}-rank pack "
                                        f"(its index says tp={r.packed.tp}); copy the split pack again")
            report.ranks.append(r)
        except (PackedFormatError, OSError) as e:
            report.errors.append(f"rank {k} of {size}: {e}")
            report.unread.append(k)
    extra = sorted(p.name for p in d.glob("rank-*") if p.name not in {rank_dir(k) for k in range(size)})
    report.errors += [f"{d / n}: not one of the pack's {size} ranks (tp.json); remove it" for n in extra]
    return report


def _verify_file(path: str | os.PathLike, progress=None) -> VerifyReport:
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

