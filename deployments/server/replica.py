"""A replica's lifecycle as a plain class: start, warm-up, health, stats, shutdown.

``LLMServer`` has the shape Ray Serve expects but needs no Ray: tests and tools build it
directly. Its constructor runs the replica's start (``deployments.server.start``: one list of
timed steps); ``reconfigure(user_config)`` runs the warm-up plan through the same path as
requests, and only then does ``check_health`` pass, so Ray routes traffic to warm replicas
only. The HTTP front (``deployments.server.http``) is built over it; ``deployments.app`` adds
the deployment options.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from deployments.config import DeploymentArgs, UserConfig, parse
from deployments.server.metrics import Metrics
from deployments.server.start import Start, Started
from weights.timing import PhaseTimer

if TYPE_CHECKING:
    from deployments.engine.engine import Engine
    from deployments.engine.tokenizer import Tokenizer
    from weights.loader import LoadedModel

log = logging.getLogger("coldstart.server")

WARMUP_SEED = "The answer is forty-two. " * 8


class NotWarm(RuntimeError):
    pass


class LLMServer:
    """A replica: one model on one device (or, with ``tp`` > 1, on that many: rank 0 here).

    Args (keyword, as serve_config.yaml's ``args``): see ``DeploymentArgs``. ``metrics``: where
    phases and request figures go (``Metrics(use_ray=True)`` inside Ray). ``own_process``: the
    process is the replica's own (a Ray worker: ``deployments.server.start.Start``). ``start``:
    the start's class (``Start`` by default; tests pass a subclass that changes a step).
    """

    def __init__(self, model: str = "weights/demo", *, model_name: str | None = None, device: str = "auto",
                 engine: dict | None = None, load: dict | None = None, http: dict | None = None, tp: int = 1,
                 fault_injection: bool = False, metrics: Metrics | None = None, own_process: bool = False,
                 start: type[Start] = Start):
        self.started_at = time.time()  # Unix times of the start-up milestones, for /stats
        self.warm_at: float | None = None
        self._t0 = time.perf_counter()
        self.args = parse(DeploymentArgs, {
            "model": model, "model_name": model_name, "device": device, "engine": engine or {},
            "load": load or {}, "http": http or {}, "tp": tp, "fault_injection": fault_injection}, "args")
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}"  # every response says which replica answered
        self.metrics = metrics or Metrics()
        self.timer = PhaseTimer(sinks=[self.metrics.phase])
        self.warm = False
        self.started: Started = start(self.args, self.timer, own_process=own_process).run().started()
        self.model_name = self.args.model_label()

    # what the HTTP routes read of the start (deployments.server.routes)
    @property
    def engine(self) -> Engine:
        return self.started.engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self.started.tokenizer

    @property
    def loaded(self) -> LoadedModel:
        return self.started.loaded

    def reconfigure(self, user_config: dict | None) -> None:
        """Run the warm-up plan; the replica is warm (and healthy) only after the first one.

        A later call (the plan changed) re-warms while the replica keeps serving: its weights
        and engine are loaded, and the router may still send it requests while it is being
        updated, so it must not turn them away."""
        from deployments.engine.warmup import run_warmup
        first, ok = not self.warm, False
        try:
            plan = parse(UserConfig, user_config, "user_config").warmup
            with self.timer.phase("warmup"):
                seed = self.tokenizer.encode(WARMUP_SEED, add_special_tokens=False) or [3]
                run_warmup(self.engine, plan, seed)
            if plan.hold_s and first:
                time.sleep(plan.hold_s)
            ok = True
        finally:
            if first:  # the start's own end: its garbage-collector pause (Start.finish)
                self.started.finish(warm=ok)
        if first:
            self.warm = True
            self.warm_at = time.time()
            self.timer.record("total", time.perf_counter() - self._t0)

    def check_health(self) -> None:
        """Cheap; raises when not warm, when the engine loop died, or on a GPU error."""
        from deployments.device import device_error
        if not self.warm:
            raise NotWarm("replica is not warm yet")
        if not self.engine.alive():
            raise RuntimeError(f"engine loop is not running: {self.engine.error!r}")
        if self.started.ranks is not None:
            self.started.ranks.check()
        with self.engine.capture_lock:  # its device-wide synchronize never lands inside a capture
            err = device_error(self.started.device)
        if err:
            raise RuntimeError(err)
        self.metrics.sample_gpu(self.started.device)
        self.metrics.sample_kv(self.engine.blocks)
        # The graphs of the batch sizes the warm-up did not use (engine.lazy_graphs): captured by
        # the engine's loop whenever it is idle from the first health check that passed on. Not
        # at the end of the warm-up: Ray's first health check comes right after it, and would
        # wait for a capture under way, holding the replica's RUNNING back.
        self.engine.capture_deferred()

    def fault(self, kind: str) -> None:
        """Drills (``args.fault_injection``): stop the engine loop, as a crashed one would be."""
        log.warning("fault injection (%s): stopping the engine loop", kind)
        self.engine.shutdown()

    def stats(self) -> dict:
        """What ``GET /stats`` answers: start-up milestones and phases, request counts, the engine."""
        from deployments import IMPORTED_AT
        from deployments.device import process_start_time
        from deployments.server.autoscale import capacity_ratio
        from deployments.startup import early
        return {"warm": self.warm, "replica": self.replica_id, "model": self.model_name,
                "process_started_at": process_start_time(), "imported_at": IMPORTED_AT,
                "early_import": early.times(), "gc": early.gc_state(),
                "constructor_started_at": self.started_at, "warm_at": self.warm_at,
                "engine": (engine := self.engine.stats()), **self.metrics.snapshot(),
                "capacity_ratio": capacity_ratio(engine, self.engine.config.max_slots),
                **({"ranks": ranks.describe()} if (ranks := self.started.ranks) is not None else {}),
                **({"weights": self.started.transfer} if self.started.transfer is not None else {})}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics, every ``metrics_interval_s``: the share of its
        slots this replica's KV cache holds now (``deployments.server.autoscale``, read by the
        deployment's ``capacity_policy``)."""
        from deployments.server.autoscale import CAPACITY, capacity_ratio
        ratio = capacity_ratio(self.engine.stats(), self.engine.config.max_slots)
        self.metrics.sample_capacity(ratio)
        return {CAPACITY: ratio}

    def shutdown(self) -> None:
        self.engine.shutdown()
        ranks = self.started.ranks
        if ranks is not None:  # their loops end with rank 0's (a stuck loop: their processes end)
            # (rank 0's runner is mirrored to them: its stop() ends their loops)
            ranks.shutdown(None if self.engine.alive() else self.engine.runner.stop)
