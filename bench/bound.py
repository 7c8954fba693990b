"""What the hardware allows a load: the bound bench/engine.py prints beside each figure.

A decode step must read every weight once and, for each sequence it runs, the keys and values
of every position it attends to; no engine does it in less than those bytes over the device's
copy bandwidth. A prefill must do its matrix products' FLOPs; no engine does it in less than
those over the device's matmul rate. A load's bound is the two added up (the engine may overlap
them, but the device does one at a time); the engine's share is the bound's time over the time
it took (1.0: at the hardware's ceiling).

The arithmetic below imports no torch (tested on the CPU); ``measure_ceilings`` measures the two
ceilings once, on the device: a large device-to-device copy and a large matrix product.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Dims:
    """The sizes the bound needs, from a Llama-family config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: dict) -> "Dims":
        """ValueError naming the key a config lacks."""
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in keys if k not in config]
        if missing:
            raise ValueError(f"config lacks {', '.join(missing)}: the bound needs a Llama-family config.json")
        heads = config["num_attention_heads"]
        return cls(config["hidden_size"], config["num_hidden_layers"], heads,
                   config.get("num_key_value_heads", heads), config.get("head_dim", config["hidden_size"] // heads),
                   config["intermediate_size"], config["vocab_size"])


def kv_bytes_per_position(d: Dims, itemsize: int) -> int:
    """One position's keys and values over every layer: 2 x layers x kv_heads x head_dim."""
    return 2 * d.layers * d.kv_heads * d.head_dim * itemsize


def prefill_flops(d: Dims, tokens: int, start: int = 0) -> int:
    """A prompt's prefill from position ``start`` (a prefix in the cache before it) over
    ``tokens`` more: each token's projections (2 FLOPs a weight), its attention to every key up to
    its own (QK^T and PV: 4 x heads x head_dim a key), and the head for its last token alone."""
    proj = d.hidden * (d.heads + 2 * d.kv_heads) * d.head_dim + d.heads * d.head_dim * d.hidden \
        + 3 * d.hidden * d.intermediate
    keys = tokens * start + tokens * (tokens + 1) // 2  # token i of the chunk reads start + i + 1 keys
    return d.layers * (2 * proj * tokens + 4 * d.heads * d.head_dim * keys) + 2 * d.vocab * d.hidden


@dataclass(frozen=True)
class LoadBound:
    """The least time a load can take: ``prefill_s`` (FLOPs / matmul rate) + ``decode_s``
    (bytes / copy bandwidth, over its ``decode_steps``)."""

    prefill_flops: int
    decode_bytes: int
    decode_steps: int
    prefill_s: float
    decode_s: float

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


def load_bound(d: Dims, weight_bytes: int, kv_itemsize: int, prompt_lens: list[int], new_tokens: int,
               copy_bytes_per_s: float, flops_per_s: float, cached: int = 0) -> LoadBound:
    """The bound of ``len(prompt_lens)`` requests submitted together, each generating
    ``new_tokens`` (its first from its prefill, the others from ``new_tokens - 1`` decode steps
    that run all of them), ``cached`` positions of each prompt found in the cache (not prefilled).
    Decode step k (1..new_tokens-1) reads the weights and, for a prompt of p tokens, p + k
    positions (its keys so far and the one it writes)."""
    if not prompt_lens or new_tokens < 1 or copy_bytes_per_s <= 0 or flops_per_s <= 0:
        raise ValueError(f"load_bound: want prompts, new_tokens >= 1 and positive ceilings; got {len(prompt_lens)} "
                         f"prompts, new_tokens={new_tokens}, {copy_bytes_per_s} B/s, {flops_per_s} FLOP/s")
    flops = sum(prefill_flops(d, p - min(cached, p - 1), min(cached, p - 1)) for p in prompt_lens)
    steps = new_tokens - 1
    positions = sum(steps * p + steps * (steps + 1) // 2 for p in prompt_lens)
    nbytes = steps * weight_bytes + positions * kv_bytes_per_position(d, kv_itemsize)
    return LoadBound(flops, nbytes, steps, flops / flops_per_s, nbytes / copy_bytes_per_s)


def decode_step_bound_s(d: Dims, weight_bytes: int, kv_itemsize: int, positions: int,
                        copy_bytes_per_s: float) -> float:
    """One decode step's least time: the weights and ``positions`` cached positions over the bandwidth."""
    return (weight_bytes + positions * kv_bytes_per_position(d, kv_itemsize)) / copy_bytes_per_s


def measure_ceilings(device, dtype, *, copy_bytes: int | None = None, matmul_n: int | None = None,
                     repeats: int = 10) -> dict:
    """The device's copy bandwidth (bytes read and written per second by a device-to-device copy
    of ``copy_bytes``) and matmul rate (FLOP/s of an n x n x n product in ``dtype``), each the best
    of ``repeats`` timed runs after a warm-up; sizes default to 2 GiB and 8192 on a GPU, 64 MiB and
    512 on the CPU (where the figures only exercise the code)."""
    import torch

    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (2 << 30 if cuda else 64 << 20)
    matmul_n = matmul_n or (8192 if cuda else 512)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
        return min(times)

    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = best(lambda: dst.copy_(src))
    src = dst = None  # their memory back before the matmul's
    a = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    b = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    mm_s = best(lambda: a @ b)
    return {"copy_bytes_per_s": 2 * copy_bytes / copy_s, "flops_per_s": 2 * matmul_n ** 3 / mm_s,
            "copy_bytes": copy_bytes, "matmul_n": matmul_n, "dtype": str(dtype).replace("torch.", "")}
