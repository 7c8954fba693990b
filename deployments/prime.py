"""The engine's first-use costs, paid on a side thread while the replica builds its model.

The first launch of each of torch's kernels in a process loads its module (torch's fatbins
are compressed, so a module is inflated on its first use) and the first matrix product
starts cuBLAS. In a replica on an H200 those came to most of the engine's first eager
decode launches, 0.3 s at batch 1 and 0.25 s at batch 2 (bench/results/runs/
first-launch-v1-torch-profile.json: ``index_select`` 70 ms, cuBLAS's first ``mm`` 115 ms,
``ne``/``index``/``bitwise_not``/``softmax`` ~20 ms each), all of it on the main thread,
one after another, after the model was built.

``start`` runs the same code paths (``deployments.model.Transformer``'s prefill, batched
prefill and decode at batches 1 and 2, and ``deployments.sampling.sample``'s greedy rows)
through a one-layer model with the served model's dtype, head size, heads per kv head,
window and biases but small widths (a few MB), as soon as the weights' views exist. It
runs while the main thread builds the model over them, reads the tokenizer and allocates
the KV cache; the engine's first launches then find those modules loaded. Kernels whose
choice depends on the real widths (cuBLAS's per shape, Triton's) still load at their
first launch. Outside Ray, a 7B replica's first launches took 0.77-0.96 s primed against
0.97-1.45 s (bench/results/runs/prime-v1-start-profile.json, prime-order-v1-...); in Ray
the gain is below the run's drift (docs/measurements.md, "What the first launches wait for").

Only what is process-wide carries over: module loads and cuBLAS's library set-up. Each
thread still makes its own cuBLAS handle. ``wait`` is called before the CUDA graphs are
captured, so nothing runs beside a capture. It runs on a stream of its own: its waits
(each step's time, its end) wait for its own work, not for the loader's copies (a first
use of a kernel may still wait for the whole device: CUDA may synchronize the context to
load a module lazily; the loader keeps a few milliseconds of copies in flight). Env
COLDSTART_PRIME=0 turns it off (a comma-separated list of ``STEPS`` runs only those, in
that order); it never fails a replica (an error is logged and the engine pays those costs
itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Mapping

log = logging.getLogger(__name__)

_STATE: dict[str, Any] = {}


def wanted(device: Any) -> bool:
    """Whether to prime on ``device`` (a torch.device): CUDA only, and not with COLDSTART_PRIME=0."""
    return getattr(device, "type", None) == "cuda" and bool(chosen_steps())


def small_config(cfg: Any) -> Any:
    """A one-layer ``ModelConfig`` with ``cfg``'s head size, query heads per kv head, sliding
    window, biases and rope, and small widths: the same kernels, a few MB of weights."""
    window = next((w for w in cfg.layer_windows if w is not None), None)
    return dataclasses.replace(
        cfg, vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=cfg.n_rep, num_key_value_heads=1, head_dim=cfg.head_dim,
        tie_word_embeddings=False, layer_windows=[window])


STEPS = ("prefill", "prefill_batch", "decode_1", "decode_2", "sample")


def chosen_steps() -> tuple[str, ...]:
    """The steps env COLDSTART_PRIME picks: 1 (or unset) all of ``STEPS``, 0 none, or a
    comma-separated list of them (for measuring what each one is worth)."""
    v = os.environ.get("COLDSTART_PRIME", "1")
    if v in ("1", ""):
        return STEPS
    if v == "0":
        return ()
    names = tuple(n.strip() for n in v.split(",") if n.strip())
    bad = [n for n in names if n not in STEPS]
    if bad:
        log.warning("COLDSTART_PRIME=%r: %s not among %s; priming all of them", v, ", ".join(bad), ", ".join(STEPS))
        return STEPS
    return names


def run(config: Mapping[str, Any], device: Any, dtype: Any, steps: dict | None = None,
        chosen: tuple[str, ...] = STEPS) -> float:
    """Run the engine's code paths once through a small model (``small_config``) on
    ``device`` in ``dtype``; returns the seconds it took, up to the device's completion.
    (Any device: the tests run it on the CPU, where it primes nothing.) ``steps`` (a dict):
    each step's seconds, each up to the device's completion (bench/prime_steps.py)."""
    import torch
    from torch import nn

    from deployments.model import KVCache, ModelConfig, Transformer
    from deployments.sampling import sample

    t0 = time.perf_counter()
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    last = [t0]

    if cuda:
        torch.cuda.set_device(device)  # a new thread starts on device 0
    # its own stream: waiting for a step waits for that step, not for the loader's copies
    stream = torch.cuda.Stream(device) if cuda else None

    def done(name: str) -> None:
        if steps is not None:
            if stream is not None:
                stream.synchronize()
            now = time.perf_counter()
            steps[name] = round(now - last[0], 4)
            last[0] = now

    cfg = small_config(ModelConfig.from_hf(config))
    with torch.device("meta"):
        model = Transformer(cfg)
    with torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        # each parameter made anew on the device, as build_native assigns the loader's views:
        # Module.to_empty would go through torch._refs.empty_like, which imports sympy (0.7 s
        # alone; 4-6 s beside a replica's build, on whose imports and GIL it weighed)
        for name, p in list(model.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf,
                    nn.Parameter(torch.full(p.shape, 0.02, dtype=dtype, device=device), requires_grad=False))
        # rope tables of any values: only the kernels' shapes matter here
        model._cos = model._sin = torch.zeros(64, cfg.head_dim, dtype=dtype, device=device)
        model.rope_len = 64
        cache = KVCache(cfg, 2, 64, dtype, device, one_segment=False)
        done("model")

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)
        logits = None
        for name in chosen:
            if name == "prefill":
                model.prefill(zeros(1, 16), cache, 0, 0)
            elif name == "prefill_batch":
                logits = model.prefill_batch(zeros(2, 16), cache, [0, 1], [16, 16], logit_rows=2)
            elif name.startswith("decode_"):
                B = int(name[7:])
                logits = model.decode(zeros(B), torch.full((B,), 16, device=device), torch.ones_like(zeros(B)),
                                      cache, 32)
            elif name == "sample" and logits is not None:  # greedy rows, as the warm-up's
                sample(logits, [0.0] * len(logits), [1.0] * len(logits), [0] * len(logits), [None] * len(logits))
            done(name)
    if stream is not None:
        stream.synchronize()
    return time.perf_counter() - t0


def start(config: Mapping[str, Any], device: Any, dtype: Any) -> threading.Thread | None:
    """Start ``run`` on a side thread (once per process); None where not ``wanted``."""
    if not wanted(device) or "thread" in _STATE:
        return None

    def go() -> None:
        try:
            _STATE["seconds"] = run(config, device, dtype, _STATE.setdefault("steps", {}), chosen_steps())
        except Exception as e:  # noqa: BLE001 - never fail a replica over a head start
            _STATE["error"] = e
            log.warning("priming the engine's kernels failed (%r): its first launches load them instead", e)

    t = threading.Thread(target=go, name="engine-prime", daemon=True)
    _STATE["thread"] = t
    t.start()
    return t


def steps() -> dict:
    """Each step's seconds in this process's prime (see ``run``), so far."""
    return dict(_STATE.get("steps", {}))


def wait(timeout: float = 60.0) -> float | None:
    """Wait for ``start``'s thread; the seconds it ran, or None (not started, or failed)."""
    t = _STATE.get("thread")
    if t is None:
        return None
    t.join(timeout)
    if t.is_alive():
        log.warning("priming the engine's kernels still runs after %.0f s; going on without it", timeout)
    return _STATE.get("seconds")
