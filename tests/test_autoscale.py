"""Autoscaling on what a replica holds: its KV cache's share of its slots, and the policy that
scales Ray's target by it (deployments/server/autoscale.py)."""

from __future__ import annotations

import inspect
import time

import pytest
from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.engine import Engine, EngineConfig, SamplingParams
from deployments.model import build_model
from deployments.server.autoscale import CAPACITY, MIN_RATIO, capacity_policy, capacity_ratio
from helpers_engine import hf_model, state_tensors


def test_the_share_follows_the_blocks_the_running_sequences_take():
    # 100 blocks, 10 in use by 5 sequences (2 each): 50 such sequences fit, of 128 slots
    assert capacity_ratio({"kv_blocks": 100, "kv_blocks_free": 90, "running": 5}, 128) == pytest.approx(50 / 128)
    # room for more than the slots: all of them
    assert capacity_ratio({"kv_blocks": 100, "kv_blocks_free": 90, "running": 5}, 16) == 1.0
    # a cache one sequence fills: the floor, not 0
    assert capacity_ratio({"kv_blocks": 100, "kv_blocks_free": 0, "running": 1}, 128) == MIN_RATIO
    # nothing running, or a static cache (no blocks): the slots are what it holds
    assert capacity_ratio({"kv_blocks": 100, "kv_blocks_free": 100, "running": 0}, 128) == 1.0
    assert capacity_ratio({"running": 8}, 8) == 1.0


def _engine(**cfg) -> Engine:
    hf, hf_cfg = hf_model("llama")
    model = build_model(hf_cfg, state_tensors(hf))
    base = {"max_slots": 4, "max_seq_len": 256, "prefill_chunk": 32, "prefill_min_len": 16}
    return Engine(model, None, EngineConfig(**{**base, **cfg}))


def test_a_paged_engine_full_of_long_sequences_holds_fewer_than_its_slots():
    """Four requests of 150 positions each over a cache of 24 blocks (384 positions): while they
    run, the share its stats give is what their blocks say, below 1; idle again, 1."""
    with _engine(kv_cache="paged", kv_blocks=25) as eng:
        assert capacity_ratio(eng.stats(), 4) == 1.0
        hs = eng.submit_many([([7 + i] * 100, SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True))
                              for i in range(4)])
        seen = []
        deadline = time.time() + 120
        while not all(h.finish_reason for h in hs) and time.time() < deadline:
            s = eng.stats()
            used = s["kv_blocks"] - s["kv_blocks_free"]
            if s["running"] and used:
                seen.append((capacity_ratio(s, 4), s["running"] * s["kv_blocks"] / used / 4))
            time.sleep(0.005)
        assert all(h.result(timeout=60)[2] == "length" for h in hs)
        assert seen, "no sample while the requests ran"
        assert all(got == pytest.approx(min(1.0, want)) for got, want in seen)
        assert min(got for got, _ in seen) < 1.0  # at some point the cache, not the slots, was the limit
        assert capacity_ratio(eng.stats(), 4) == 1.0


def test_a_static_engine_holds_its_slots():
    with _engine() as eng:
        h = eng.submit([5] * 20, SamplingParams(max_new_tokens=5, temperature=0))
        assert capacity_ratio(eng.stats(), 4) == 1.0
        h.result(timeout=60)


def _context(total: float, ratios: dict[str, float], running: list[str], target: float = 8) -> AutoscalingContext:
    """Ray's own context, as its controller makes it for a policy (fields this policy does not
    read left None, whatever this version of Ray adds)."""
    given = {"deployment_id": None, "deployment_name": "LLMDeployment", "app_name": "coldstart",
             "current_num_replicas": len(running), "target_num_replicas": len(running),
             "running_replicas": running, "total_num_requests": total, "total_queued_requests": 0.0,
             "aggregated_metrics": {CAPACITY: ratios} if ratios else {}, "raw_metrics": {},
             "capacity_adjusted_min_replicas": 1, "capacity_adjusted_max_replicas": 8, "policy_state": {},
             "config": AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=target)}
    params = inspect.signature(AutoscalingContext.__init__).parameters
    return AutoscalingContext(**{n: given.get(n) for n in params if n != "self"})


def test_the_policy_is_rays_rule_with_the_target_scaled_by_the_replicas_share():
    # 32 requests on two replicas of target 8: Ray's rule asks for 4 replicas, so does this one at share 1
    ctx = _context(32, {"a": 1.0, "b": 1.0}, ["a", "b"])
    assert capacity_policy(ctx)[0] == pytest.approx(replica_queue_length_autoscaling_policy(ctx)[0]) == 4
    # the same requests on replicas whose caches hold half their slots: twice as many
    assert capacity_policy(_context(32, {"a": 0.5, "b": 0.5}, ["a", "b"]))[0] == pytest.approx(8)
    # no report yet, and a report of a replica that is gone: Ray's rule
    assert capacity_policy(_context(32, {}, ["a", "b"]))[0] == pytest.approx(4)
    assert capacity_policy(_context(32, {"gone": 0.25}, ["a", "b"]))[0] == pytest.approx(4)
    # a share out of range is clipped: never a division by 0, never fewer than Ray's rule
    clipped = capacity_policy(_context(32, {"a": 0.0, "b": 3.0}, ["a", "b"]))[0]
    assert clipped == pytest.approx(32 / (8 * (MIN_RATIO + 1) / 2))
    # no replica yet: what the controller targets already (its cold start is Ray's own)
    assert capacity_policy(_context(5, {}, []))[0] == 0
