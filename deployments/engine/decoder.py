"""What the engine asks of a decoder: the ``Decoder`` protocol.

Two decoders implement it: the native one (``deployments.model.llama.Transformer``) and the
transformers fallback (``deployments.model.hf_fallback.HFModel``). Its optional capabilities are
members every decoder has: a ``supports_*`` flag says whether the methods that go with it may be
called (a decoder without the capability raises ``NotImplementedError`` from them), and the rest
have an answer for a decoder that lacks them (``activation_bytes`` None, ``decode_kv_lens`` the
buckets given). So the engine reads them directly and a type checker sees every use.

Caches are the decoder's own objects; the engine reads only their ``paged`` flag, and of a paged
one ``num_blocks`` and ``block_size``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Decoder(Protocol):
    """A causal LM the engine serves: prefill a prompt into a cache slot, decode a batch of slots.

    Shapes: ``prefill`` takes tokens [1, C] and returns the last position's logits [V];
    ``decode`` takes tokens, positions and valid [B] and returns logits [B, V]."""

    # ---- the model
    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def vocab_size(self) -> int: ...  # the logits' width (a tensor-parallel rank's: all ranks')

    @property
    def max_position_embeddings(self) -> int: ...

    build_s: dict[str, float]  # the build's own steps, seconds (empty where it has none)

    # ---- capabilities: each flag says whether the methods named beside it may be called
    supports_cuda_graphs: bool  # decode may be captured in a CUDA graph
    supports_paged_cache: bool  # new_paged_cache, cache_block_bytes, check_paged_kernels
    supports_prefill_padding: bool  # prefill(..., n_valid=): a chunk padded to a fixed length
    supports_batched_prefill: bool  # prefill_batch

    def weights_loaded(self) -> None:
        """The weights' values arrived (a model built beside its load sees them from now on)."""

    def setup_rope(self, max_seq_len: int) -> None: ...

    def new_cache(self, max_slots: int, max_seq_len: int) -> Any: ...

    def cache_bytes(self, max_slots: int, max_seq_len: int) -> int: ...

    def new_paged_cache(self, num_blocks: int, block_size: int, max_slots: int, max_seq_len: int) -> Any: ...

    def cache_block_bytes(self, block_size: int) -> int: ...

    def check_paged_kernels(self, cache: Any) -> float:
        """Test the paged variants of its kernels at ``cache``'s geometry; the seconds it took."""

    def activation_bytes(self, tokens: int, logit_rows: int, gathered: int) -> int | None:
        """Device bytes its largest prefill forward needs beside the cache; None: no estimate."""

    def decode_kv_lens(self, buckets: tuple[int, ...]) -> tuple[int, ...]:
        """The key-length bounds its decode steps need of ``buckets`` (a graph each)."""

    def prefill(self, tokens: torch.Tensor, cache: Any, slot: int, start: int, **kw: Any) -> torch.Tensor: ...

    def prefill_batch(self, tokens: torch.Tensor, cache: Any, slots: list[int], n_valid: list[int],
                      **kw: Any) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: Any,
               kv_len: int) -> torch.Tensor: ...
