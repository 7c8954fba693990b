"""The inference engine: continuous batching over a scheduler and a model runner.

``Engine`` (``engine``) runs requests on a model; ``EngineConfig`` (``config``) is its options;
``SamplingParams``, ``RequestHandle`` and ``Chunk`` (``request``) are a request's side;
``Tokenizer`` (``tokenizer``) reads a packed model's tokenizer files; ``run_warmup`` and
``WarmupPlan`` (``warmup``) warm a replica up. Names are imported on first use, so that the
config and request types can be read without importing torch::

    from deployments.engine import Engine, EngineConfig, SamplingParams
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine", "NonFiniteLogits": "scheduler",
    "EngineConfig": "config",
    "SamplingParams": "request", "RequestHandle": "request", "Chunk": "request",
    "Tokenizer": "tokenizer",
    "WarmupPlan": "warmup", "run_warmup": "warmup",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'deployments.engine' has no attribute {name!r}")
