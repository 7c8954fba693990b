"""The replica's metrics: start-up phases, load speed, per-request latency, GPU memory.

``Metrics`` keeps the latest values (served on ``GET /stats``) and, inside a
Ray Serve replica, also feeds ``ray.serve.metrics`` so they reach the Ray
dashboard and Prometheus (exported with a ``ray_`` prefix, e.g.
``ray_coldstart_startup_phase_seconds{phase="load"}``). Every start-up phase
also appears as a ``[METRIC]`` log line (``weights.timing``).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deployments.engine.blocks import BlockPool

log = logging.getLogger(__name__)

_LATENCY_BOUNDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
_TPS_BOUNDS = [1, 5, 10, 25, 50, 100, 200, 400, 800, 1600]


class Metrics:
    def __init__(self, use_ray: bool = False):
        self.lock = threading.Lock()
        self.phases: dict[str, float] = {}
        self.load_gbps: float | None = None
        self.requests: dict[str, int] = defaultdict(int)
        self.last: dict[str, float] = {}
        self.gpu: dict[str, float] = {}
        self._ray: dict[str, Any] = {}
        if use_ray:
            from ray.serve import metrics as m
            self._ray = {
                "phase": m.Gauge("coldstart_startup_phase_seconds",
                                 description="Seconds spent in each replica start-up phase.",
                                 tag_keys=("phase",)),
                "gbps": m.Gauge("coldstart_load_gbps", description="Weight load speed, GB/s."),
                "ttft": m.Histogram("coldstart_ttft_seconds", description="Time to first token.",
                                    boundaries=_LATENCY_BOUNDS),
                "tps": m.Histogram("coldstart_decode_tokens_per_second",
                                   description="Decode tokens per second per request.",
                                   boundaries=_TPS_BOUNDS),
                "queue": m.Histogram("coldstart_queue_wait_seconds",
                                     description="Seconds a request waited for a KV-cache slot.",
                                     boundaries=_LATENCY_BOUNDS),
                "requests": m.Counter("coldstart_requests_total", description="Requests by outcome.",
                                      tag_keys=("status",)),
                "gpu": m.Gauge("coldstart_gpu_memory_bytes", description="GPU memory by kind.",
                               tag_keys=("kind",)),
                "kv": m.Gauge("coldstart_kv_blocks", description="Paged KV-cache blocks: used, cached (a kept prompt prefix "
                                                                  "nobody holds, reusable), free.",
                              tag_keys=("state",)),
                "preempted": m.Gauge("coldstart_kv_preemptions",
                                     description="Requests preempted for KV-cache blocks since the replica "
                                                 "started (computed again later): a cache too small for the load."),
                "capacity": m.Gauge("coldstart_capacity_ratio",
                                    description="The share of its slots the replica's KV cache holds at its running "
                                                "requests' length (what the autoscaling policy scales its target by)."),
                "retries": m.Gauge("coldstart_alloc_retries_ratio",
                                   description="Allocator retries (cudaMalloc after a cache flush) "
                                               "per allocation: fragmentation pressure."),
            }

    # start-up -------------------------------------------------------------
    def phase(self, name: str, seconds: float, nbytes: int | None = None) -> None:
        """A ``weights.timing.PhaseTimer`` sink."""
        with self.lock:
            self.phases[name] = seconds
        if self._ray:
            self._ray["phase"].set(seconds, tags={"phase": name})
        if name == "load" and nbytes:
            self.set_load_gbps(nbytes / seconds / 1e9 if seconds > 0 else 0.0)

    def set_load_gbps(self, gbps: float) -> None:
        self.load_gbps = gbps
        if self._ray:
            self._ray["gbps"].set(gbps)

    # requests -------------------------------------------------------------
    def request(self, status: str) -> None:
        with self.lock:
            self.requests[status] += 1
        if self._ray:
            self._ray["requests"].inc(tags={"status": status})

    def finished(self, ttft: float | None, tps: float | None, queue_wait: float | None) -> None:
        for key, v in (("ttft", ttft), ("tps", tps), ("queue", queue_wait)):
            if v is None:
                continue
            with self.lock:
                self.last[key] = v
            if self._ray:
                self._ray[key].observe(v)

    # device ---------------------------------------------------------------
    def sample_gpu(self, device) -> None:
        """GPU memory and allocator fragmentation (alloc retries over allocations)."""
        if device.type != "cuda":
            return
        import torch
        s = torch.cuda.memory_stats(device)
        allocs = s.get("allocation.all.allocated", 0)
        vals = {"allocated": float(s.get("allocated_bytes.all.current", 0)),
                "reserved": float(s.get("reserved_bytes.all.current", 0))}
        ratio = s.get("num_alloc_retries", 0) / allocs if allocs else 0.0
        with self.lock:
            self.gpu = {**vals, "alloc_retries_ratio": ratio}
        if self._ray:
            for kind, v in vals.items():
                self._ray["gpu"].set(v, tags={"kind": kind})
            self._ray["retries"].set(ratio)

    def sample_kv(self, blocks: BlockPool | None) -> None:
        """A paged KV cache's blocks (None for a static cache): held by sequences, kept with a prefix that nobody holds, empty (they sum to its capacity)."""
        if blocks is None or not self._ray:
            return
        free, cached = blocks.free, blocks.cached
        self._ray["kv"].set(float(blocks.capacity - free), tags={"state": "used"})
        self._ray["kv"].set(float(cached), tags={"state": "cached"})
        self._ray["kv"].set(float(free - cached), tags={"state": "free"})
        self._ray["preempted"].set(float(blocks.counts["preemptions"]))

    def sample_capacity(self, ratio: float) -> None:
        """The share ``record_autoscaling_stats`` reports (``deployments.server.autoscale``)."""
        if self._ray:
            self._ray["capacity"].set(float(ratio))

    def snapshot(self) -> dict:
        with self.lock:
            return {"startup_phases_s": dict(self.phases), "load_GBps": self.load_gbps,
                    "requests": dict(self.requests), "last_request": dict(self.last),
                    "gpu": dict(self.gpu)}
