"""What runs in Ray Serve's HTTP proxy, ahead of every replica: a request's whole body first.

Ray Serve's proxy (ray 2.60, ``ray/serve/_private/proxy.py``, ``HTTPProxy.send_request_to_replica``)
hands a request to its router as soon as the request's headers are in: the router gives it one of
a replica's ``max_ongoing_requests`` (or a place among ``max_queued_requests``), and the replica
then pulls the body from the proxy (``receive_asgi_messages``) as the client sends it. A client
that sends its headers and then nothing holds that slot until the replica's own body deadline
(``args.http.body_timeout_s``): 200 of them filled the CPU config's 32 + 64 and every other client
got a 503 until they timed out.

``BodyFirst`` wraps the proxy's ASGI app: it reads each request's whole body, within a deadline
(408) and a size limit (413), before the proxy routes it, so a request takes a replica's slot
only once its body is in; a stalled client costs the proxy a socket and a coroutine, and no
replica anything. It also gives a 503 without ``Retry-After`` one (Ray's own answer for an
unavailable deployment carries none, nor does its answer for one over its queue unless the
deployment sets ``backpressure_config.retry_after_s``). Ray builds it in each proxy from
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.server.proxy:middlewares`` in the proxy's
environment (serve_config.yaml's ``controller_options``, the image's ``ENV``); its limits are
``COLDSTART_PROXY_BODY_TIMEOUT_S`` and ``COLDSTART_PROXY_MAX_BODY_BYTES`` (``deployments.envs``).
It imports nothing of the replica: the proxy's process loads it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

from deployments import envs
from deployments.server.api import RETRY_AFTER_S, error_body, replay

log = logging.getLogger("coldstart.proxy")

_NO_BODY = (None, b"0")


class BodyFirst:
    """ASGI middleware: an HTTP request goes on to ``app`` only with its whole body, read within
    ``timeout_s`` (else a 408) and ``max_bytes`` (else a 413); a 503 gets a ``Retry-After``.
    ``count(status)``, where given, counts each request answered here ("408", "413") and each
    client that went away while sending its body ("disconnected")."""

    def __init__(self, app: Any, *, timeout_s: float, max_bytes: int, count: Callable[[str], None] | None = None):
        self.app, self.timeout_s, self.max_bytes, self.count = app, timeout_s, max_bytes, count

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def retry_after(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers") or [])
                if not any(bytes(k).lower() == b"retry-after" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"retry-after", str(RETRY_AFTER_S).encode())]}
            await send(message)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared in _NO_BODY and b"transfer-encoding" not in headers:
            return await self.app(scope, receive, retry_after)  # nothing to wait for
        body = await self._read(scope, receive, send, declared)
        if body is None:
            return
        # what comes after the body is the client's disconnect: the proxy listens for it
        await self.app(scope, replay(body, receive), retry_after)

    async def _read(self, scope: dict, receive: Callable, send: Callable, declared: bytes | None) -> bytes | None:
        """The whole body; None where it was answered here (408, 413) or its client went away."""
        too_big = f"request body is {{}} bytes, more than this server takes ({self.max_bytes:,}); shorten it"
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, send, 413, too_big.format(f"{int(declared):,}"))
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await self._refuse(scope, send, 408, f"request body not received within {self.timeout_s:g} s "
                                                     f"({len(body):,} bytes came); send it at once")
                return None
            if message["type"] == "http.disconnect":
                log.debug("%s %s: the client went away while sending its body", scope["method"], scope["path"][:200])
                self._count("disconnected")
                return None
            body += message.get("body", b"")
            if len(body) > self.max_bytes:  # a chunked body says no length: counted as it comes
                await self._refuse(scope, send, 413, too_big.format(f"more than {self.max_bytes:,}"))
                return None
            if not message.get("more_body", False):
                return bytes(body)

    async def _refuse(self, scope: dict, send: Callable, status: int, message: str) -> None:
        """Answer here, and close the connection: the rest of the body is never read."""
        log.info("%s %s: %d %s", scope["method"], scope["path"][:200], status, message)
        self._count(str(status))
        data = json.dumps(error_body(message, status)).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})

    def _count(self, status: str) -> None:
        if self.count is not None:
            self.count(status)


def middlewares() -> list:
    """What Ray's proxy calls through ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``: ``BodyFirst``
    with the limits of ``COLDSTART_PROXY_BODY_TIMEOUT_S`` and ``COLDSTART_PROXY_MAX_BODY_BYTES``,
    its refusals counted in ``ray_coldstart_proxy_refused_total{status}``."""
    from ray.util.metrics import Counter
    from starlette.middleware import Middleware

    timeout_s, max_bytes = envs.read("COLDSTART_PROXY_BODY_TIMEOUT_S"), envs.read("COLDSTART_PROXY_MAX_BODY_BYTES")
    refused = Counter("coldstart_proxy_refused_total", tag_keys=("status",),
                      description="Requests the HTTP proxy answered itself before routing them (408: body too "
                                  "slow, 413: too large) or whose client left while sending the body.")
    log.info("proxy reads each request's body before routing it: within %g s, at most %d bytes", timeout_s, max_bytes)
    return [Middleware(BodyFirst, timeout_s=timeout_s, max_bytes=max_bytes,
                       count=lambda status: refused.inc(tags={"status": status}))]
