"""A replica's warm-up: shadow requests through the same path as a user's, before it serves."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.engine.request import SamplingParams

if TYPE_CHECKING:
    from deployments.engine.engine import Engine


class WarmupPlan(BaseModel):
    """The warm-up plan (``user_config.warmup`` in serve_config.yaml); changing it re-warms the replicas."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, frozen=True)

    requests: int = Field(1, ge=0)
    """Shadow rounds run one after another (the first pays what the engine's start left lazy)."""
    prompt_fraction: float = Field(0.125, gt=0, le=1)
    """Prompt length of each shadow request as a fraction of max_seq_len."""
    decode_tokens: int = Field(16, ge=1)
    """Tokens generated per shadow request (greedy, KV cache on, graphs replayed)."""
    batch_sizes: list[int] = Field(default_factory=lambda: [1], min_length=1)
    """Concurrent shadow requests per round, so that every decode batch size used in serving has
    run once before the first user arrives."""
    hold_s: float = Field(0.0, ge=0)
    """Stay un-routable this many seconds after the first warm-up (drills and tests)."""

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if min(v) < 1:
            raise ValueError(f"must be positive ints, got {v}")
        return v


def run_warmup(engine: Engine, plan: WarmupPlan, seed: list[int]) -> None:
    """Run ``plan`` on ``engine``: per round and batch size, that many greedy shadow requests at
    once, each a prompt of ``plan.prompt_fraction`` of the context (``seed`` repeated) and
    ``plan.decode_tokens`` new tokens. Raises RuntimeError where one fails."""
    cfg = engine.config
    plen = max(1, min(int(plan.prompt_fraction * cfg.max_seq_len), cfg.max_seq_len - plan.decode_tokens))
    prompt = (seed * (plen // len(seed) + 1))[:plen]
    params = SamplingParams(max_new_tokens=plan.decode_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(plan.requests):
        for b in plan.batch_sizes:
            handles = engine.submit_many([(prompt, params)] * min(b, cfg.max_slots))
            for h in handles:
                _, _, reason = h.result()
                if reason == "error":
                    raise RuntimeError(f"warm-up request failed: {h.error!r}")
