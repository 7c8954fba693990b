"""The static KV cache: every layer's keys and values for a fixed number of slots."""

from __future__ import annotations

import contextlib

import torch

from deployments.model.config import ModelConfig
from weights.segments import one_segment as plain_segment


class KVCache:
    """Static KV cache: per layer k and v of shape [slots, n_kv_heads, max_seq_len, head_dim]."""

    def __init__(self, cfg: ModelConfig, max_slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device,
                 one_segment: bool = True):
        shape = (max_slots, cfg.num_key_value_heads, max_seq_len, cfg.head_dim)
        # zeros, not empty: a never-written position must hold finite values, since masked-out
        # scores still multiply it (0 * NaN = NaN). One allocation and one memset for every
        # layer's keys and values, each layer's k and v a contiguous view of it; made as one plain
        # segment where the allocator uses expandable segments, which map it piece by piece
        # (weights.segments.one_segment, which changes the allocator's settings for the whole
        # process while it runs: a small cache made beside other allocations passes
        # one_segment=False)
        with plain_segment(torch.device(device)) if one_segment else contextlib.nullcontext():
            self.data = torch.zeros((2, cfg.num_hidden_layers, *shape), dtype=dtype, device=device)
        self.k = list(self.data[0].unbind(0))
        self.v = list(self.data[1].unbind(0))
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
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * max_slots * cfg.num_key_value_heads * max_seq_len * cfg.head_dim * itemsize
