"""The HTTP routes' handlers: parse, tokenize, submit to the engine, answer or stream.

``Routes.guard`` turns every outcome into a response, each request counted once in the metrics:
a ``BadRequest`` its 4xx, an ``Unavailable`` (warming up, engine loop stopped) a 503 with
Retry-After, a request the engine failed a 500 (503 where the replica stopped under it), a fault
of this code's own a 500 naming it (counted as ``error`` and logged with its traceback; the
replica serves on).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.server import api
from deployments.engine.request import cut
from deployments.server.api import BadRequest, Parsed, Unavailable
from deployments.server.responses import (MAX_CHARS_PER_TOKEN, TOKENIZE_INLINE_CHARS, Unfinished, cancelled, error,
                                          json_line, sse_fail, stream_body, text_limit, unfinished)

log = logging.getLogger("coldstart.server")

Handler = Callable[[Request], Awaitable[Response]]


class Routes:
    def __init__(self, server: Any):
        self.server = server

    def guard(self, fn: Handler, warm: bool = True) -> Handler:
        """``fn`` with every outcome a response (see the module docstring); ``warm``: a replica
        that is not warm answers 503 instead."""
        s = self.server

        async def route(request: Request) -> Response:
            request.state.started = time.perf_counter()  # (the route's own time: the timing headers)
            try:
                if warm and not s.warm:
                    raise Unavailable("replica is warming up; retry shortly", "not_warm")
                return await fn(request)
            except BadRequest as e:
                s.metrics.request("bad_request")
                return error(str(e), e.status, param=e.param, code=e.code)
            except Unavailable as e:
                s.metrics.request(e.kind)
                return error(str(e), e.status)
            except Unfinished as e:  # counted by the request's own accounting
                log.error("request failed: %s", e)
                return error(str(e), e.status)
            except Exception as e:
                if cancelled(e):
                    raise
                log.exception("%s %s failed", request.method, request.url.path)
                s.metrics.request("error")
                return error(f"internal error ({type(e).__name__}: {e}); the replica's log has the traceback", 500)
        route.__name__ = fn.__name__
        route.__doc__ = fn.__doc__
        return route

    # ---------------------------------------------------------------- generation
    async def generate(self, request: Request) -> Response:
        doc = api.parse_json(await request.body())
        p = api.parse_generate(doc)
        ids = await self._encode(p.prompt)
        handle = await self._submit(ids, p)
        if p.stream:
            def render(ch: Any) -> bytes:
                return json_line({"text": ch.text, "token_ids": ch.token_ids, "finish_reason": ch.finish_reason})

            def fail(e: Unfinished) -> bytes:  # the last line: finish_reason "error" and why
                return json_line({"text": "", "token_ids": [], "finish_reason": "error",
                                  **api.error_body(str(e), e.status)})
            return StreamingResponse(stream_body(handle, render, None, fail, self._account),
                                     media_type="application/x-ndjson")
        text, out, reason = await self._collect(handle)
        # timings go in headers and /stats: the same tokens make a body of the same length
        return JSONResponse({"text": text, "token_ids": out, "finish_reason": reason,
                             "usage": api.usage(len(ids), len(out))}, headers=_timing(handle, request))

    async def completions(self, request: Request) -> Response:
        doc = api.parse_json(await request.body())
        p = api.parse_completion(doc)
        self._check_model(p.model)
        ids = await self._encode(p.prompt)
        rid, model = api.new_id("cmpl"), self.server.model_name
        handle = await self._submit(ids, p)
        if p.stream:
            return StreamingResponse(stream_body(
                handle, lambda ch: api.sse(api.completion_chunk(rid, model, ch.text, ch.finish_reason)),
                self._sse_tail(p, rid, "text_completion", len(ids)), sse_fail, self._account),
                media_type="text/event-stream")
        text, out, reason = await self._collect(handle)
        return JSONResponse(api.completion_body(rid, model, text, reason, len(ids), len(out)),
                            headers=_timing(handle, request))

    async def chat(self, request: Request) -> Response:
        doc = api.parse_json(await request.body())
        p = api.parse_chat(doc)
        self._check_model(p.model)
        chars = sum(len(m["content"]) for m in p.messages)
        self._check_size(chars, "field 'messages' (their content)")
        try:
            ids = await _off_loop(chars, self.server.tokenizer.apply_chat_template, p.messages,
                                  add_generation_prompt=True, tokenize=True)
        except ValueError as e:  # no template, or the template rejected the messages
            raise BadRequest(str(e)) from e
        except Exception as e:  # jinja2 raises its own types for a template's raise_exception
            raise BadRequest(f"chat template rejected the messages: {e}") from e
        rid, model = api.new_id("chatcmpl"), self.server.model_name
        handle = await self._submit(ids, p)
        if p.stream:
            first = [True]

            def render(ch: Any) -> bytes:
                out = b""
                if first[0]:
                    first[0] = False
                    out += api.sse(api.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
                if ch.text or ch.finish_reason:
                    delta = {"content": ch.text} if ch.text else {}
                    out += api.sse(api.chat_chunk(rid, model, delta, ch.finish_reason))
                return out
            return StreamingResponse(stream_body(handle, render, self._sse_tail(p, rid, "chat.completion.chunk",
                                                                                len(ids)), sse_fail, self._account),
                                     media_type="text/event-stream")
        text, out, reason = await self._collect(handle)
        return JSONResponse(api.chat_body(rid, model, text, reason, len(ids), len(out)),
                            headers=_timing(handle, request))

    # ---------------------------------------------------------------- the rest
    async def models(self, request: Request) -> Response:
        s = self.server
        return JSONResponse({"object": "list", "data": [
            {"id": s.model_name, "object": "model", "created": 0, "owned_by": "coldstart",
             "digest": s.loaded.packed.digest}]})

    async def health(self, request: Request) -> Response:
        if not self.server.warm:
            return error("warming up", 503)
        return JSONResponse({"status": "ok", "model": self.server.model_name})

    async def stats(self, request: Request) -> Response:
        return JSONResponse(self.server.stats())

    async def fault(self, request: Request) -> Response:
        kind = api.validate(api.FaultRequest, api.parse_json(await request.body())).kind
        self.server.fault(kind)
        return JSONResponse({"injected": kind, "replica": self.server.replica_id})

    # ---------------------------------------------------------------- helpers
    def _check_model(self, model: str | None) -> None:
        """An OpenAI request that names a model this replica does not serve gets OpenAI's 404;
        one that names none is served."""
        served = self.server.model_name
        if model is not None and model != served:
            raise BadRequest(f"the model {cut(repr(model))} does not exist here: this server serves {served!r} "
                             f"(GET /v1/models); send \"model\": {served!r}, or leave the field out", 404,
                             param="model", code="model_not_found")

    async def _encode(self, prompt: str) -> list[int]:
        self._check_size(len(prompt), "field 'prompt'")
        return await _off_loop(len(prompt), self.server.tokenizer.encode, prompt)

    def _check_size(self, chars: int, what: str) -> None:
        """Refuse text no context could hold before tokenizing it: 10 MB of text, tokenized on the
        event loop, held every other request up for seconds (and on a worker thread would still
        take them)."""
        tokens, limit = text_limit(self.server)
        if chars > limit:
            raise BadRequest(f"{what} is {chars:,} characters, more than a context of {tokens} tokens takes "
                             f"({limit:,}: {MAX_CHARS_PER_TOKEN} per token); shorten it")

    async def _submit(self, ids: list[int], p: Parsed) -> Any:
        engine = self.server.engine
        p.fit_default_length(len(ids), engine.config.max_seq_len)
        if not engine.alive():  # check_health will fail and Ray will replace this replica
            raise Unavailable(f"replica unavailable: engine loop is not running ({engine.error!r}); retry", "stopped")
        try:
            return engine.submit(ids, p.params)
        except ValueError as e:  # prompt too long, ids outside the vocabulary, ...: named as the client did
            raise BadRequest(str(e).replace("max_new_tokens", p.length_key)) from e
        except RuntimeError as e:  # the engine loop died: this replica is going away
            raise Unavailable(f"replica unavailable: {e}; retry", "stopped") from e

    async def _collect(self, handle: Any) -> tuple[str, list[int], str]:
        try:
            ids, text, reason = await handle.finished()  # one wake-up at its end, not one per token
        finally:
            if not handle.done:
                handle.cancel()  # the caller went away: free the slot
            self._account(handle)
        failed = unfinished(handle)
        if failed is not None:
            raise failed
        return text, ids, reason

    def _account(self, handle: Any) -> None:
        # a client that went away has cancelled its handle; the engine may not have seen it yet
        failed = unfinished(handle)
        status = ("cancelled" if handle.cancelled and handle.finish_reason in (None, "cancelled")
                  else "ok" if failed is None else failed.kind)
        self.server.metrics.request(status)
        self.server.metrics.finished(handle.ttft_s, handle.decode_tokens_per_s, handle.queue_wait_s)

    def _sse_tail(self, p: Parsed, rid: str, obj: str, n_prompt: int) -> Callable[[Any], bytes]:
        """The end of an SSE stream: an optional usage chunk, then [DONE]."""
        model = self.server.model_name

        def tail(h: Any) -> bytes:
            out = api.sse(api.usage_chunk(rid, model, obj, n_prompt, h.n_tokens)) if p.usage_chunk else b""
            return out + api.sse("[DONE]")
        return tail


def _timing(handle: Any, request: Request) -> dict[str, str]:
    """A finished request's times in the engine: to its first token, and from its submission to its
    end; and the route's, from its start to this answer (beyond the engine's: parsing, tokenizing,
    the wait for this process's event loop). The rest of what a client waited is the path to and
    from the route: Ray's proxy and router, the replica's own handling."""
    out = {} if handle.ttft_s is None else {"x-coldstart-ttft-s": f"{handle.ttft_s:.4f}"}
    if handle.finished_at is not None:
        out["x-coldstart-engine-s"] = f"{handle.finished_at - handle.submitted_at:.4f}"
    out["x-coldstart-route-s"] = f"{time.perf_counter() - request.state.started:.4f}"
    return out


async def _off_loop(chars: int, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) for ``chars`` characters of text: inline when short, else on a worker
    thread (``TOKENIZE_INLINE_CHARS``), so that the event loop goes on streaming meanwhile."""
    if chars <= TOKENIZE_INLINE_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)
