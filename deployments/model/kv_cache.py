"""The KV caches: every layer's keys and values, per slot (``KVCache``) or in blocks (``PagedKVCache``)."""

from __future__ import annotations

import contextlib

import torch

from deployments.model.config import ModelConfig
from weights.segments import one_segment as plain_segment


def _allocate(cfg: ModelConfig, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              one_segment: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's keys and values of ``shape``: (the one tensor, each layer's k, each layer's v).

    Zeros, not empty: a never-written position must hold finite values, since masked-out scores
    still multiply it (0 * NaN = NaN). One allocation and one memset for every layer's keys and
    values, each layer's k and v a contiguous view of it; made as one plain segment where the
    allocator uses expandable segments, which map it piece by piece (weights.segments.one_segment,
    which changes the allocator's settings for the whole process while it runs: a small cache made
    beside other allocations passes one_segment=False)."""
    with plain_segment(torch.device(device)) if one_segment else contextlib.nullcontext():
        data = torch.zeros((2, cfg.num_hidden_layers, *shape), dtype=dtype, device=device)
    return data, list(data[0].unbind(0)), list(data[1].unbind(0))


def _bytes(cfg: ModelConfig, positions: int, dtype: torch.dtype) -> int:
    """Every layer's keys and values for ``positions`` positions."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * positions * cfg.head_dim * itemsize


class KVCache:
    """Static KV cache: per layer k and v of shape [slots, n_kv_heads, max_seq_len, head_dim]."""

    paged = False

    def __init__(self, cfg: ModelConfig, max_slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device,
                 one_segment: bool = True):
        shape = (max_slots, cfg.num_key_value_heads, max_seq_len, cfg.head_dim)
        self.data, self.k, self.v = _allocate(cfg, shape, dtype, device, one_segment)
        self.max_slots, self.max_seq_len = max_slots, max_seq_len

    def zero_(self) -> None:
        """Every position back to zero (one memset, queued on the current stream)."""
        self.data.zero_()

    def zero_slot(self, slot: int, upto: int) -> None:
        """Positions [0, upto) of one slot back to zero, in every layer's keys and values (one
        fill over a strided view, queued on the current stream)."""
        self.data[:, :, slot, :, :upto].zero_()

    @staticmethod
    def bytes_needed(cfg: ModelConfig, max_slots: int, max_seq_len: int, dtype: torch.dtype) -> int:
        return _bytes(cfg, max_slots * max_seq_len, dtype)


class PagedKVCache:
    """Keys and values in fixed-size blocks: per layer k and v of shape
    [num_blocks, n_kv_heads, block_size, head_dim], and ``block_table`` [max_slots, blocks per
    sequence] (int32, on the device): slot s's position p lies in block
    ``block_table[s, p // block_size]`` at offset ``p % block_size``.

    Block 0 is the null block: every table entry no sequence owns points there, so a padding
    row's writes and a read past a sequence's end land in it and never in another sequence's
    blocks. It holds only finite values (what padding wrote), which masked scores multiply by 0.
    The engine's scheduler hands out blocks 1..num_blocks-1 (``assign``) and takes them back
    (``release``)."""

    paged = True

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, max_slots: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device, one_segment: bool = True):
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"engine.kv_block_size must be a power of two >= 16, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        shape = (num_blocks, cfg.num_key_value_heads, block_size, cfg.head_dim)
        self.data, self.k, self.v = _allocate(cfg, shape, dtype, device, one_segment)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_slots, self.max_seq_len = max_slots, max_seq_len
        self.blocks_per_seq = -(-max_seq_len // block_size)
        self.block_table = torch.zeros((max_slots, self.blocks_per_seq), dtype=torch.int32, device=device)

    def assign(self, slot: int, blocks: list[int], clear: list[int] = ()) -> None:
        """Slot ``slot``'s positions now lie in ``blocks`` (in order); the rest of its row points
        to the null block. One small copy, queued on the current stream; ``clear`` (blocks that
        held something else) are zeroed first."""
        if len(blocks) > self.blocks_per_seq:
            raise ValueError(f"{len(blocks)} blocks for one sequence of at most {self.blocks_per_seq}")
        self._zero_blocks(clear)
        row = torch.zeros(self.blocks_per_seq, dtype=torch.int32)
        row[: len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.block_table[slot].copy_(row, non_blocking=True)

    def release(self, slot: int, blocks: list[int]) -> None:
        """Slot ``slot`` gives ``blocks`` back: they are zeroed (a later owner reads masked keys
        of them, and 0 * NaN = NaN) and its row points to the null block again."""
        self._zero_blocks(blocks)
        self.block_table[slot].zero_()

    def _zero_blocks(self, blocks: list[int]) -> None:
        if blocks:
            idx = torch.tensor(blocks, dtype=torch.long).to(self.data.device, non_blocking=True)
            self.data.index_fill_(2, idx, 0)

    def zero_(self) -> None:
        self.data.zero_()

    def locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each position: slots [R], positions [R, S] -> two [R, S] tensors."""
        blocks = self.block_table[slots.unsqueeze(1), torch.div(positions, self.block_size, rounding_mode="floor")]
        return blocks.long(), positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Keys and values [R, n_kv, S, Dh] of rows at ``positions`` [R, S] of ``slots`` [R];
        ``at``: their ``locate`` already (the same for every layer of one forward)."""
        blk, off = at if at is not None else self.locate(slots, positions)
        self.k[layer][blk, :, off] = k.transpose(1, 2)  # indexed [R, S, n_kv, Dh]
        self.v[layer][blk, :, off] = v.transpose(1, 2)

    def table_rows(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """The blocks holding positions 0..length-1 of ``slots`` [R]: [R, blocks] (what ``read``
        gathers through; the same for every layer of one forward)."""
        return self.block_table[slots, : -(-length // self.block_size)].long()

    def read(self, layer: int, slots: torch.Tensor, length: int,
             blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..length-1 of ``slots`` [R], gathered: keys and values [R, n_kv, length, Dh]
        (a copy; the Triton decode attention reads through the table instead). ``blocks``: their
        ``table_rows`` already."""
        blocks = self.table_rows(slots, length) if blocks is None else blocks  # [R, nb]
        nb = blocks.shape[1]

        def gather(c: torch.Tensor) -> torch.Tensor:
            g = c[blocks]  # [R, nb, n_kv, bs, Dh]
            R, _, n_kv, bs, Dh = g.shape
            return g.transpose(1, 2).reshape(R, n_kv, nb * bs, Dh)[:, :, :length]
        return gather(self.k[layer]), gather(self.v[layer])

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return _bytes(cfg, block_size, dtype)
