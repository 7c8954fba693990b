"""The Ray Serve application: ``serve run serve_config.yaml`` imports ``deployments.app:app``.

``LLMDeployment`` is ``LLMServer`` plus deployment options; ``build_app(args)``
is the application builder that serve_config.yaml points at, so operators set
the model, device, engine and load options under ``args`` without code. The
module imports no torch: a replica's process reaches the constructor (and
its read-ahead) before paying for torch.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from deployments import early
from deployments.config import DeploymentArgs
from deployments.metrics import Metrics
from deployments.server import LLMServer


@serve.deployment(
    # one replica answers many requests at once (continuous batching); Ray's own queue
    # beyond max_queued_requests answers 503 instead of letting latency grow without bound
    max_ongoing_requests=32,
    max_queued_requests=64,
    health_check_period_s=5,
    health_check_timeout_s=10,
    graceful_shutdown_wait_loop_s=2,
    graceful_shutdown_timeout_s=30,
    user_config={"warmup": {}},
)
class LLMDeployment(LLMServer):
    def __init__(self, **args: Any):
        # a replica is a process of its own: it may keep its compiled modules per node, and its
        # start runs without the garbage collector's full scans (the worker setup hook paused it
        # already where it ran; deployments.early.pause_gc)
        early.pause_gc()
        try:
            super().__init__(**args, metrics=Metrics(use_ray=True), keep_bytecode=True)
        except BaseException:
            early.resume_gc(freeze=False)
            raise

    def reconfigure(self, user_config: dict | None) -> None:
        try:
            super().reconfigure(user_config)
        finally:
            # warm: what the start made lives as long as the process (frozen, never scanned
            # again); a first warm-up that failed fails the replica: back on, nothing frozen
            early.resume_gc(freeze=self.warm)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Application builder for serve_config.yaml's ``import_path: deployments.app:build_app``.

    ``args`` are ``DeploymentArgs`` fields; they are checked here, in the
    controller, so a typo fails ``serve run`` at once rather than in every replica.
    """
    a = DeploymentArgs.from_dict(args)
    # resolve a relative model path where `serve run` was started, not in the replica
    a.model = str(a.model_path())
    return LLMDeployment.bind(model=a.model, model_name=a.model_name, device=a.device,
                              engine=a.engine, load=a.load, fault_injection=a.fault_injection)
