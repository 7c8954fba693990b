"""Typed configuration of the deployment: its args and its warm-up plan (user_config).

Both are built from plain dicts (what ``serve_config.yaml`` holds) and reject
unknown keys and wrong types with the field's name, what was expected and
what was given. No torch import here: the replica reads its config first.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


def _from_dict(cls, d: Mapping[str, Any] | None, where: str):
    """Build dataclass ``cls`` from ``d``, naming ``where`` and the field in every error."""
    d = dict(d or {})
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(names))}")
    for k, v in d.items():
        want = names[k].type
        _check_type(f"{where}.{k}", v, want)
    return cls(**d)


_SIMPLE = {"int": int, "float": (int, float), "str": str, "bool": bool}


def _check_type(name: str, v: Any, want: str) -> None:
    want = want.replace(" ", "")
    if want.endswith("|None"):
        if v is None:
            return
        want = want[: -len("|None")]
    if want in _SIMPLE:
        ok = isinstance(v, _SIMPLE[want]) and not (want in ("int", "float") and isinstance(v, bool))
    elif want.startswith("list[int]"):
        ok = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    elif want.startswith("dict"):
        ok = isinstance(v, dict)
    else:
        ok = True
    if not ok:
        raise ValueError(f"{name} must be {want}, got {type(v).__name__} {v!r}")


@dataclass
class WarmupPlan:
    """The warm-up plan, from ``user_config``; changing it re-warms the replica."""

    requests: int = 1
    """Shadow rounds run one after another (the first pays lazy initialisation)."""
    prompt_fraction: float = 0.125
    """Prompt length of each shadow request as a fraction of max_seq_len."""
    decode_tokens: int = 16
    """Tokens generated per shadow request (greedy, KV cache on, graphs replayed)."""
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    """Concurrent shadow requests per round, so every decode graph bucket used in
    serving has run once before the first user arrives."""
    hold_s: float = 0.0
    """Stay un-routable this many seconds after the first warm-up (for drills and tests)."""

    def __post_init__(self) -> None:
        if self.requests < 0:
            raise ValueError(f"warmup.requests must be >= 0, got {self.requests}")
        if not 0 < self.prompt_fraction <= 1:
            raise ValueError(f"warmup.prompt_fraction must be in (0, 1], got {self.prompt_fraction}")
        if self.decode_tokens < 1:
            raise ValueError(f"warmup.decode_tokens must be >= 1, got {self.decode_tokens}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"warmup.batch_sizes must be positive ints, got {self.batch_sizes}")
        if self.hold_s < 0:
            raise ValueError(f"warmup.hold_s must be >= 0, got {self.hold_s}")

    @classmethod
    def from_user_config(cls, user_config: Mapping[str, Any] | None) -> "WarmupPlan":
        uc = dict(user_config or {})
        unknown = sorted(set(uc) - {"warmup"})
        if unknown:
            raise ValueError(f"user_config: unknown field(s) {', '.join(unknown)}; known: warmup")
        return _from_dict(cls, uc.get("warmup"), "user_config.warmup")


@dataclass
class DeploymentArgs:
    """The application's args in serve_config.yaml."""

    model: str = "weights/demo"
    """Packed model directory; a relative path is taken from $COLDSTART_HOME, else the
    directory `serve run` was started in."""
    model_name: str | None = None
    """Model id in the OpenAI API (default: the directory's name)."""
    device: str = "auto"
    """auto (cuda when a GPU is visible, else cpu), cuda, cuda:N or cpu."""
    engine: dict = field(default_factory=dict)
    """EngineConfig fields: max_slots, max_seq_len, prefill_chunk, cuda_graphs, ..."""
    load: dict = field(default_factory=dict)
    """LoadOptions fields: threads, read_bytes, cold_threads, cold_read_bytes, verify, readahead,
    trickle, trickle_read_bytes, direct_io, cold_direct_io, ..."""
    fault_injection: bool = False
    """Enable POST /admin/fault for drills (stops the engine loop so health checks fail)."""

    def __post_init__(self) -> None:
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"args.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "DeploymentArgs":
        return _from_dict(cls, d, "args")

    def model_path(self) -> Path:
        p = Path(self.model).expanduser()
        if not p.is_absolute():
            p = Path(os.environ.get("COLDSTART_HOME", os.getcwd())) / p
        return p
