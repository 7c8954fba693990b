"""The HTTP front: FastAPI routes over a replica (``LLMServer``), the Ray Serve way.

``build(server)`` makes the app; inside Ray, ``deployments.app`` hands it to ``serve.ingress``
once the replica's constructor has run. Request bodies are pydantic models
(``deployments.server.api``; ``/openapi.json`` and ``/docs``, whose scripts the replica serves
itself: ``deployments.server.docs``, describe them), read by ``BodyGuard`` before any route
runs: a body larger than any request for the context could need is a 413 before it is parsed,
one that does not arrive within ``args.http.body_timeout_s`` a 408 that frees the replica's
request slot, and a client that goes away while sending it is counted as ``cancelled``,
quietly, as is one that goes away while its answer is made (whatever the next read of the
client raises, inside Ray too, is its disconnect). Every 4xx names the field; every response
carries ``x-coldstart-replica``. A streamed answer ends with its final marker (NDJSON: a line
whose ``finish_reason`` is not null; SSE: ``data: [DONE]``) whenever the replica itself ends
it; a failure ends it with an error line or event first, never with a finish reason that reads
as a normal end.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from deployments.engine.request import cut
from deployments.server import api
from deployments.server.docs import add_docs
from deployments.server.responses import BODY_SLACK_BYTES, cancelled, error, text_limit
from deployments.server.routes import Routes

if TYPE_CHECKING:
    from deployments.server.replica import LLMServer

log = logging.getLogger("coldstart.server")


class _Refused(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class BodyGuard:
    """ASGI middleware: reads a request's whole body before the app runs, within a size limit
    (413) and a deadline (408), then hands it on; tags every response with the replica."""

    def __init__(self, app: ASGIApp, server: LLMServer):
        self.app, self.server = app, server

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tag = [(b"x-coldstart-replica", self.server.replica_id.encode())]

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *tag]}
            await send(message)
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, tagged)
        try:
            body = await self._read(scope, receive)
        except _Refused as e:
            self.server.metrics.request("bad_request")
            return await error(str(e), e.status)(scope, receive, tagged)
        except BaseException as e:
            if not cancelled(e):
                raise
            self.server.metrics.request("cancelled")
            log.info("%s %s: the client went away while sending its body", scope["method"], cut(scope["path"]))
            raise asyncio.CancelledError() from None
        if body is None:  # the client disconnected: nobody to answer
            self.server.metrics.request("cancelled")
            log.info("%s %s: the client disconnected while sending its body", scope["method"], cut(scope["path"]))
            return
        await self.app(scope, api.replay(body, lambda: _until_disconnect(receive, scope)), tagged)

    async def _read(self, scope: dict, receive: Callable) -> bytes | None:
        """The body, or None where the client disconnected first; ``_Refused`` where it is larger
        than any request could need (413) or does not arrive in time (408)."""
        tokens, chars = text_limit(self.server)
        limit = 12 * chars + BODY_SLACK_BYTES
        too_big = (f"request body is {{}} bytes, more than a request for a context of {tokens} tokens can need "
                   f"({limit:,}); shorten it")
        declared = dict(scope.get("headers") or []).get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > limit:
            raise _Refused(too_big.format(f"{int(declared):,}"), 413)
        timeout = self.server.args.http.body_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise _Refused(f"request body not received within {timeout:g} s ({len(body):,} bytes came); "
                               "send it at once", 408) from None
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > limit:  # a chunked body says no length: counted as it comes
                raise _Refused(too_big.format(f"more than {limit:,}"), 413)
            if not message.get("more_body", False):
                return bytes(body)


async def _until_disconnect(receive: Callable, scope: dict) -> dict:
    """The next message after the body: the client's disconnect, as the ASGI spec has it, also
    where Ray's ``receive`` raises instead. Inside Ray, ``receive`` fetches from the proxy, and a
    request the proxy cancelled (its client went away) makes that fetch raise
    ``TaskCancelledError``: raised on through a streamed response's disconnect listener, it ended
    the request's task with that exception, which Ray's replica had wrapped in a future that
    nobody awaits once the request is cancelled (``_run_user_code``: ``asyncio.wrap_future``), so
    every such disconnect logged a "Future exception was never retrieved" traceback."""
    try:
        return await receive()
    except Exception as e:  # noqa: BLE001 - whatever broke the way back, nobody is left to answer
        if not cancelled(e):
            log.warning("%s %s: reading the client's next message failed (%s: %s); taken as its disconnect",
                        scope["method"], cut(scope["path"]), type(e).__name__, e)
        return {"type": "http.disconnect"}


def _schema(model: type[BaseModel]) -> dict:
    """OpenAPI's request body for a route that reads its body itself (``BodyGuard``)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def build(server: LLMServer) -> FastAPI:
    """The replica's HTTP app over ``server``."""
    app = FastAPI(title="coldstart", summary="An LLM replica that starts in seconds.",
                  version="0.1.0", docs_url=None, redoc_url=None)  # /docs: add_docs, without a CDN
    r = Routes(server)
    app.add_api_route("/generate", r.guard(r.generate), methods=["POST"], openapi_extra=_schema(api.GenerateRequest),
                      summary="Continue a prompt (NDJSON lines with stream: true)")
    app.add_api_route("/v1/completions", r.guard(r.completions), methods=["POST"],
                      openapi_extra=_schema(api.CompletionRequest), summary="OpenAI's completions")
    app.add_api_route("/v1/chat/completions", r.guard(r.chat), methods=["POST"],
                      openapi_extra=_schema(api.ChatRequest), summary="OpenAI's chat completions")
    app.add_api_route("/v1/models", r.guard(r.models, warm=False), methods=["GET"], summary="The served model")
    # GET and HEAD as two routes: one route with both gave both one operation id in the OpenAPI document
    health = r.guard(r.health, warm=False)
    app.add_api_route("/health", health, methods=["GET"], summary="200 once warm, 503 while warming up")
    app.add_api_route("/health", health, methods=["HEAD"], name="health_head",
                      summary="200 once warm, 503 while warming up (no body: load balancers' probe)")
    app.add_api_route("/stats", r.guard(r.stats, warm=False), methods=["GET"],
                      summary="Start-up phases, request counts, the engine's state")
    if server.args.fault_injection:
        app.add_api_route("/admin/fault", r.guard(r.fault), methods=["POST"], openapi_extra=_schema(api.FaultRequest),
                          summary="Drills: stop the engine loop")
    add_docs(app)
    known = sorted({route.path for route in app.routes if not route.path.startswith(("/docs", "/openapi"))})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        path = cut(request.url.path)
        if e.status_code == 404:
            return error(f"no route {path}; routes: {', '.join(known)}", 404)
        if e.status_code == 405:
            allowed = (e.headers or {}).get("Allow", "")
            return error(f"{request.method} not allowed on {path}; use {allowed}", 405)
        return error(str(e.detail), e.status_code)
    app.add_middleware(BodyGuard, server=server)
    return app
