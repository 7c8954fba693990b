"""Autoscaling on what a replica really holds.

Ray's own rule adds replicas when the requests per replica pass the deployment's
``target_ongoing_requests``; serve_config.gpu.yaml sets that to ``engine.max_slots`` (128), the
sequences a replica decodes at once. With a paged KV cache a replica holds that many only while
they are short: 128 sequences of 3,000 tokens need more blocks than a 7B replica's GPU has left,
and the rest wait in its engine's queue while Ray, counting 128 requests, adds nothing.

So each replica reports, with Ray's own metrics (``record_autoscaling_stats``), the share of its
slots its cache holds at the length its running sequences have now (``capacity_ratio``: 1 with a
static cache, when nothing runs, or while the running sequences leave room for all the slots),
and ``capacity_policy`` (the deployment's ``autoscaling_config.policy``) is Ray's rule with each
replica's target scaled by that share. Ray applies its delays, factors and bounds around it as it
does around its own rule. This module imports no more than the policy needs: Serve's controller
imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

CAPACITY = "capacity_ratio"
"""The metric's name in ``record_autoscaling_stats``."""

MIN_RATIO = 1 / 64
"""The smallest share a replica is taken to hold (a cache one long request fills)."""


def capacity_ratio(engine_stats: dict, max_slots: int) -> float:
    """The share of ``max_slots`` sequences a replica's KV cache holds at the blocks its running
    sequences take each now (``Engine.stats()``: blocks in use / running sequences; blocks a
    prompt prefix shares count once). 1 for a static cache, when nothing runs, or when the cache
    holds all the slots at that length."""
    blocks, running = engine_stats.get("kv_blocks"), engine_stats.get("running") or 0
    if not blocks or running <= 0 or max_slots <= 0:
        return 1.0
    used = blocks - engine_stats.get("kv_blocks_free", 0)
    if used <= 0:
        return 1.0
    holds = running * blocks / used  # sequences of the running ones' mean size that fit
    return max(MIN_RATIO, min(1.0, holds / max_slots))


def capacity_policy(ctx: AutoscalingContext) -> tuple[float, dict]:
    """The replicas a deployment needs: Ray's rule (the requests in and queued for the replicas /
    ``target_ongoing_requests``), with the target scaled by the running replicas' mean
    ``capacity_ratio`` over Ray's look-back window (1 where none reported one yet). ``ctx``:
    Ray Serve's ``AutoscalingContext``."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    reported = (ctx.aggregated_metrics or {}).get(CAPACITY) or {}
    running = set(ctx.running_replicas)
    ratios = [min(1.0, max(MIN_RATIO, float(v))) for rid, v in reported.items() if rid in running]
    ratio = sum(ratios) / len(ratios) if ratios else 1.0
    return ctx.total_num_requests / (ctx.config.get_target_ongoing_requests() * ratio), {}
