"""The Ray Serve application: ``serve run serve_config.yaml`` calls ``deployments.app:build_app``.

``LLMDeployment`` is ``LLMServer`` plus the deployment's options, with the HTTP front
(``deployments.server.http``) as its ingress, built once the constructor has run. ``build_app``
is the application builder serve_config.yaml names: it checks ``args`` on Serve's controller,
so a typo fails ``serve run`` at once, not every replica after its imports. This module
imports no torch: a replica's process reaches its constructor (and the start's first steps)
before paying for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray import serve

from deployments.config import DeploymentArgs, parse
from deployments.server.api import RETRY_AFTER_S
from deployments.server.metrics import Metrics
from deployments.server.replica import LLMServer

if TYPE_CHECKING:
    from fastapi import FastAPI


@serve.deployment(
    # one replica answers many requests at once (continuous batching); Ray's own queue beyond
    # max_queued_requests answers 503 instead of letting latency grow without bound
    max_ongoing_requests=32,
    max_queued_requests=64,
    # Ray's own 503 for a request beyond that queue says when to retry, as the replica's do
    backpressure_config={"retry_after_s": RETRY_AFTER_S},
    health_check_period_s=5,
    health_check_timeout_s=10,
    graceful_shutdown_wait_loop_s=2,
    graceful_shutdown_timeout_s=30,
    user_config={"warmup": {}},
)
@serve.ingress()
class LLMDeployment(LLMServer):
    def __init__(self, **args: Any):
        super().__init__(**args, metrics=Metrics(use_ray=True), own_process=True)

    def __serve_build_asgi_app__(self) -> FastAPI:
        from deployments.server.http import build
        return build(self)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Application builder for serve_config.yaml's ``import_path: deployments.app:build_app``:
    ``args`` are ``DeploymentArgs`` fields, checked here, on the controller."""
    a = parse(DeploymentArgs, args, "args")
    deployment = LLMDeployment
    if a.tp > 1:  # one replica over tp devices of one node: its placement group (serve_config.yaml may set its own)
        deployment = LLMDeployment.options(placement_group_bundles=a.bundles(),
                                           placement_group_strategy="STRICT_PACK")
    # a relative model path is resolved where `serve run` was started, not in the replica
    model = a.model if a.is_remote() else str(a.model_path())
    return deployment.bind(**a.model_copy(update={"model": model}).model_dump())
