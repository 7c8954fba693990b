"""The engine's first-use costs, paid on a side thread while the replica builds its model.

The first launch of each of torch's kernels in a process loads its module (torch's fatbins are
compressed, so a module is inflated on its first use) and the first matrix product starts
cuBLAS. ``start`` runs the engine's code paths (``Transformer``'s prefill, batched prefill and
decode at batches 1 and 2, and greedy sampling) through a one-layer model with the served
model's dtype, head size, heads per kv head, window and biases but small widths (a few MB), as
soon as the weights' views exist, while the main thread builds the model over them, reads the
tokenizer and allocates the KV cache; the engine's first launches then find those modules
loaded. Kernels whose choice depends on the real widths (cuBLAS's per shape, Triton's) still
load at their first launch. Only what is process-wide carries over: module loads and cuBLAS's
library set-up (each thread makes its own cuBLAS handle). The replica's start waits for it
before the CUDA graphs are captured, so nothing runs beside a capture. It runs on a stream of
its own, so that its waits wait for its own work, not for the loader's copies.
COLDSTART_PRIME=0 turns it off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Mapping

from deployments.startup.side import SideTask

def small_config(cfg: Any) -> Any:
    """A one-layer ``ModelConfig`` with ``cfg``'s head size, query heads per kv head, sliding
    window, biases and rope, and small widths: the same kernels, a few MB of weights."""
    window = next((w for w in cfg.layer_windows if w is not None), None)
    return dataclasses.replace(
        cfg, vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=cfg.n_rep, num_key_value_heads=1, head_dim=cfg.head_dim,
        tie_word_embeddings=False, layer_windows=[window])


def run(config: Mapping[str, Any], device: Any, dtype: Any) -> float:
    """Run the engine's code paths once through a small model (``small_config``) on ``device`` in
    ``dtype``; the seconds it took, up to the device's completion. (Any device: the tests run it
    on the CPU, where it primes nothing.)"""
    import torch
    from torch import nn

    from deployments.engine.sampling import sample
    from deployments.model import KVCache, ModelConfig, Transformer

    t0 = time.perf_counter()
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # a new thread starts on device 0
    # its own stream: waiting for it waits for its work, not for the loader's copies
    stream = torch.cuda.Stream(device) if cuda else None
    cfg = small_config(ModelConfig.from_hf(config))
    with torch.device("meta"):
        model = Transformer(cfg)
    with torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        # each parameter made anew on the device, as the model's build assigns the loader's views
        # (Module.to_empty would import sympy through torch._refs: seconds beside a replica's build)
        for name, p in list(model.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf,
                    nn.Parameter(torch.full(p.shape, 0.02, dtype=dtype, device=device), requires_grad=False))
        # rope tables of any values: only the kernels' shapes matter here
        model._cos = model._sin = torch.zeros(64, cfg.head_dim, dtype=dtype, device=device)
        model.rope_len = 64
        cache = KVCache(cfg, 2, 64, dtype, device, one_segment=False)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)
        model.prefill(zeros(1, 16), cache, 0, 0)
        model.prefill_batch(zeros(2, 16), cache, [0, 1], [16, 16], logit_rows=2)
        for B in (1, 2):
            logits = model.decode(zeros(B), torch.full((B,), 16, device=device), torch.ones_like(zeros(B)), cache, 32)
        sample(logits, [0.0] * B, [1.0] * B, [0] * B, [None] * B)  # greedy rows, as the warm-up's
    if stream is not None:
        stream.synchronize()
    return time.perf_counter() - t0


def start(config: Mapping[str, Any], device: Any, dtype: Any) -> SideTask:
    """Start ``run`` on a side thread; its ``SideTask.result`` is the seconds it ran."""
    return SideTask("engine-prime", lambda: run(config, device, dtype))
