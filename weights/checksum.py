"""Chunk checksums that a GPU checks at memory speed (``wfletcher64-512``).

A chunk is viewed as 64-bit words ``x_i`` (i = 0..n-1) and summarised by::

    s1 = sum(x_i)            mod 2**64
    s2 = sum((i + 1) * x_i)  mod 2**64

``s2`` weights every word by its position, so a swapped or shifted block changes
it even where ``s1`` stays. Computing ``s2`` directly needs a weight vector and
a product as large as the data; instead the chunk is laid out as rows of
``COLS`` = 512 words (4 KiB, so every aligned region is whole rows) and, with
``i = r * COLS + c``::

    s2 = COLS * sum_r(r * rowsum_r) + sum_c((c + 1) * colsum_c)

Two reductions over the data (row sums and column sums) and a few tiny ones,
no temporary of the data's size: a GPU checks a 7B's weights in milliseconds,
a CPU at memory speed with torch's threaded reductions. Integer sums wrap
modulo 2**64 on both devices, so CPU and GPU give the same numbers; words
past the end of a short last chunk count as zero.
"""

from __future__ import annotations

import numpy as np
import torch

COLS = 512  # words per row: 4 KiB


def _to_u64(v: int) -> int:
    return v & 0xFFFFFFFFFFFFFFFF


def chunk_sums_tensor(data: torch.Tensor, chunk_bytes: int, first_chunk: int = 0,
                      n_chunks: int | None = None) -> torch.Tensor:
    """Sums of whole chunks as an int64 tensor ``[n, 2]`` on ``data``'s device.

    Args:
        data: uint8 tensor of the data region (or a prefix of it); its length
            is a multiple of 4096 bytes.
        chunk_bytes: chunk size, a multiple of 4096.
        first_chunk, n_chunks: which chunks to sum (default: all chunks of ``data``).
    Returns:
        int64 tensor ``[n, 2]`` holding (s1, s2) per chunk as two's complement.
    """
    rows_per_chunk = chunk_bytes // (COLS * 8)
    total = data.numel()
    if n_chunks is None:
        n_chunks = -(-total // chunk_bytes) - first_chunk
    out = torch.empty((n_chunks, 2), dtype=torch.int64, device=data.device)
    full_end = min(first_chunk + n_chunks, total // chunk_bytes)  # chunks that are whole
    r_w = torch.arange(rows_per_chunk, dtype=torch.int64, device=data.device) * COLS
    c_w = torch.arange(1, COLS + 1, dtype=torch.int64, device=data.device)
    if full_end > first_chunk:
        k = full_end - first_chunk
        # x: [k, R, COLS] int64 words of k whole chunks
        x = data[first_chunk * chunk_bytes: full_end * chunk_bytes].view(torch.int64)
        x = x.view(k, rows_per_chunk, COLS)
        rows = x.sum(dim=2)  # [k, R]
        cols = x.sum(dim=1)  # [k, COLS]
        out[:k, 0] = rows.sum(dim=1)
        out[:k, 1] = (rows * r_w).sum(dim=1) + (cols * c_w).sum(dim=1)
    if first_chunk + n_chunks > full_end:  # a short last chunk
        tail = data[full_end * chunk_bytes:].view(torch.int64).view(-1, COLS)  # [R', COLS]
        rows = tail.sum(dim=1)
        cols = tail.sum(dim=0)
        out[-1, 0] = rows.sum()
        out[-1, 1] = (rows * r_w[: rows.numel()]).sum() + (cols * c_w).sum()
    return out


def chunk_sums_host(data: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """``chunk_sums_tensor`` of a host buffer (uint8, a multiple of 4096 bytes) with numpy: the
    same sums, ``[n, 2]`` int64. For many threads checking pieces at once (a remote model's
    transfer): numpy's reductions run in the calling thread without the GIL, where each of torch's
    would start a pool of threads of its own in every calling thread, many times the cores."""
    words = data.view(np.int64)
    per_chunk = chunk_bytes // 8
    full = words.size // per_chunk
    tail = words[full * per_chunk:]
    out = np.empty((full + (tail.size > 0), 2), dtype=np.int64)
    r_w = np.arange(per_chunk // COLS, dtype=np.int64) * COLS
    c_w = np.arange(1, COLS + 1, dtype=np.int64)
    if full:
        x = words[: full * per_chunk].reshape(full, -1, COLS)
        rows = x.sum(axis=2)  # [k, R]
        cols = x.sum(axis=1)  # [k, COLS]
        out[:full, 0] = rows.sum(axis=1)
        out[:full, 1] = (rows * r_w).sum(axis=1) + (cols * c_w).sum(axis=1)
    if tail.size:
        t = tail.reshape(-1, COLS)
        rows = t.sum(axis=1)
        out[-1, 0] = rows.sum()
        # as arrays: their sums wrap at 64 bits silently, where numpy's scalars warn
        out[-1:, 1] = (rows * r_w[: rows.size]).sum(keepdims=True) + (t.sum(axis=0) * c_w).sum(keepdims=True)
    return out


def chunk_sums(data: torch.Tensor, chunk_bytes: int) -> list[tuple[int, int]]:
    """All chunk sums of ``data`` as unsigned Python ints (what the index stores)."""
    t = chunk_sums_tensor(data, chunk_bytes).cpu().tolist()
    return [(_to_u64(a), _to_u64(b)) for a, b in t]


def as_signed(sums: list[tuple[int, int]]) -> torch.Tensor:
    """Index sums (unsigned) as the int64 tensor ``chunk_sums_tensor`` returns."""
    def s(v: int) -> int:
        return v - (1 << 64) if v >= 1 << 63 else v
    return torch.tensor([[s(a), s(b)] for a, b in sums], dtype=torch.int64).view(-1, 2)


def first_mismatch(got: torch.Tensor, want: torch.Tensor) -> int | None:
    """Index of the first chunk whose sums differ, or None. Both ``[n, 2]`` int64."""
    bad = (got.cpu() != want).any(dim=1).nonzero()
    return int(bad[0, 0]) if bad.numel() else None
