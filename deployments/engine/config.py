"""The engine's options (``args.engine`` in serve_config.yaml), checked when they are made."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GiB = 1 << 30


class EngineConfig(BaseModel):
    """Engine options. Unknown fields and wrong types are refused with the field's name; ``resolved``
    fills the defaults that depend on the model."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, frozen=True)

    max_slots: int = Field(8, gt=0)
    """Sequences decoded at once (KV-cache slots); requests beyond them wait in the engine."""
    kv_cache: Literal["static", "paged"] = "static"
    """static: max_slots x max_seq_len positions reserved at start. paged: keys and values in
    blocks of kv_block_size positions, as many as the device's free memory holds beside
    reserve_bytes (kv_blocks sets the number); a request is admitted when the blocks of its
    prompt are free (it waits in the queue until they are) and takes more as it generates; where
    none is left, the request admitted last is preempted and computed again later. max_slots
    bounds only the decode batch (native decoders; others stay static)."""
    kv_block_size: int = Field(16, ge=16)
    """Positions per block of the paged cache (a power of two)."""
    kv_blocks: int | None = Field(None, ge=2)
    """Blocks of the paged cache, the null block included; default: what free device memory holds
    beside reserve_bytes (on the CPU: max_slots x max_seq_len positions' worth)."""
    prefix_cache: bool = True
    """paged: keep the full blocks of prompts in the cache, and admit a prompt that begins with
    the same tokens (a chat's system prompt) sharing them, prefilling only the rest; kept blocks
    are reused for other prompts when no empty one is left. Off: every prompt is computed whole."""
    max_seq_len: int | None = Field(None, ge=2)
    """Prompt + generated tokens per sequence; default min(the model's max_position_embeddings, 4096)."""
    prefill_chunk: int = Field(512, gt=0)
    """Prompt tokens prefilled per loop turn (and per forward), so a long prompt holds the running
    sequences up for one chunk at a time. Prompts that start at one position (fresh, or past one
    prefix found in the paged cache) and pad to one length share a forward, as many as make a
    power of two within the chunk."""
    cuda_graphs: bool = True
    """Replay the decode step as CUDA graphs (CUDA and the native decoder only)."""
    lazy_graphs: bool = True
    """Capture only the smallest batch size's graphs before serving; each other batch size's are
    captured when a decode step first needs them, or when the loop is idle once the replica is
    warm. False: every graph before serving (a longer start)."""
    graph_batch_sizes: list[int] | tuple[int, ...] | None = None
    """Decode batch buckets, each a CUDA graph; default 1, 2, 4, ... below max_slots, and max_slots."""
    kv_len_buckets: list[int] | tuple[int, ...] | None = None
    """Decode key-length buckets for the torch attention path; default 512, 2048, max_seq_len."""
    reserve_bytes: int | None = Field(None, ge=0)
    """Device memory kept free beside the KV cache for activations, graphs and cuBLAS workspaces.
    Default: 1 GiB plus twice what the model's largest prefill forward is estimated to allocate
    (it grows with prefill_chunk; about 2.1 GiB for a 7B model at 2048 tokens); the engine's
    start runs that forward once, so a reserve too small fails the start, naming this field."""
    prefill_padding: bool = True
    """Pad each prompt chunk to one of a few lengths (powers of two from prefill_min_len, and
    prefill_chunk), each run once before serving, so no request pays a first run of its shape."""
    prefill_min_len: int = Field(128, gt=0)
    """The shortest length a prompt chunk is padded to. A short prefill reads every weight once and
    computes less than that read takes, so padding it costs its first token nothing measurable."""

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        for name in ("graph_batch_sizes", "kv_len_buckets"):
            v = getattr(self, name)
            if v is not None and (not v or min(v) <= 0):
                raise ValueError(f"{name} must be a non-empty list of positive ints, got {v}")
        if self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size must be a power of two, got {self.kv_block_size}")
        if self.graph_batch_sizes is not None and max(self.graph_batch_sizes) > self.max_slots:
            raise ValueError(f"graph_batch_sizes {self.graph_batch_sizes} has sizes above max_slots={self.max_slots}")
        return self

    def resolved(self, model_max_len: int) -> "EngineConfig":
        """A copy with the model-dependent defaults filled in; ValueError naming the field."""
        msl = self.max_seq_len or min(model_max_len, 4096)
        if msl > model_max_len:
            raise ValueError(f"engine.max_seq_len={msl} exceeds the model's max_position_embeddings={model_max_len}")
        bs = sorted(set(self.graph_batch_sizes or [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < self.max_slots]))
        bs = sorted(set(bs) | {self.max_slots})  # the largest batch must always have a graph
        kv = sorted({min(b, msl) for b in (self.kv_len_buckets or (512, 2048))} | {msl})
        return self.model_copy(update={"max_seq_len": msl, "prefill_chunk": min(self.prefill_chunk, msl),
                                       "graph_batch_sizes": tuple(bs), "kv_len_buckets": tuple(kv)})


def prefill_lengths(chunk: int, min_len: int = 16) -> tuple[int, ...]:
    """The lengths a prompt chunk of at most ``chunk`` tokens is padded to: powers of two from
    ``min_len`` (rounded up to one), and ``chunk`` itself. Each costs the engine's start one
    first run, so there are few; padding a prompt's last chunk at most doubles it, or brings it
    up to ``min_len``."""
    first = 1 << max(0, min_len - 1).bit_length()
    out = {b for b in (first << k for k in range(31)) if b < chunk} | {chunk}
    return tuple(sorted(out))


def padded_len(n: int, start: int, lengths: tuple[int, ...], max_seq_len: int) -> int:
    """The length a chunk of ``n`` prompt tokens at ``start`` is run at: the first of ``lengths``
    (``prefill_lengths``; empty: no padding) that holds it, or ``n`` itself where none does or
    the padding would run past ``max_seq_len`` (this once, as is)."""
    for b in lengths:
        if b >= n:
            return b if start + b <= max_seq_len else n
    return n
