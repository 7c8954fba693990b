"""What the HTTP routes answer with: errors, the end of a failed request, streamed bodies."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi.responses import JSONResponse

from deployments.engine.request import Chunk, RequestHandle
from deployments.server import api
from deployments.server.api import RETRY_AFTER_S

if TYPE_CHECKING:
    from deployments.server.replica import LLMServer

log = logging.getLogger("coldstart.server")

# Text is refused before tokenizing above this many characters per context token: natural text
# averages about four, so only a text made of a vocabulary's longest tokens could fit beyond it
MAX_CHARS_PER_TOKEN = 64
# and a body is refused unread above 12 bytes per such character (JSON's longest spelling of one:
# a surrogate pair as two \u escapes) plus this much for everything else it carries
BODY_SLACK_BYTES = 1 << 20
# Text longer than this is tokenized on a worker thread instead of the event loop, which every
# request's streaming shares
TOKENIZE_INLINE_CHARS = 8192


class Unfinished(RuntimeError):
    """A request that ended without its answer, as its client hears it: ``status`` 500 where the
    engine failed it, 503 (retry) where the replica stopped under it; ``kind``, the status its
    request is counted under in the metrics ("error", "stopped")."""

    def __init__(self, message: str, status: int, kind: str):
        super().__init__(message)
        self.status, self.kind = status, kind


def unfinished(handle: RequestHandle) -> Unfinished | None:
    """Why ``handle``'s request ended without its answer; None when it finished, or when its own
    client cancelled it (nobody is left to tell)."""
    if handle.finish_reason == "error":
        return Unfinished(f"generation failed: {handle.error!r}", 500, "error")
    if handle.finish_reason == "cancelled" and not handle.cancelled:
        return Unfinished("the replica stopped before the generation finished; retry", 503, "stopped")
    return None


def error(message: str, status: int, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    """An error response in OpenAI's shape (``api.error_body``); a 503 (warming up, overloaded,
    stopped: try again) says when, in Retry-After."""
    return JSONResponse(api.error_body(message, status, param=param, code=code), status_code=status,
                        headers={"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None)


def cancelled(e: BaseException) -> bool:
    """A request its client (or Ray's proxy for it) cancelled, rather than one that failed."""
    return isinstance(e, asyncio.CancelledError) or type(e).__name__ == "TaskCancelledError"


def text_limit(server: LLMServer) -> tuple[int, int]:
    """(the context's tokens, the most characters of text a request may send for it)."""
    tokens = server.engine.config.max_seq_len
    return tokens, tokens * MAX_CHARS_PER_TOKEN


def json_line(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()


async def stream_body(handle: RequestHandle, render: Callable[[Chunk], bytes | None],
                      tail: Callable[[RequestHandle], bytes] | None, fail: Callable[[Unfinished], bytes],
                      account: Callable[[RequestHandle], None]) -> AsyncIterator[bytes]:
    """A streamed response's body: ``render`` per chunk, then ``tail``. A request that ends without
    its answer (``unfinished``), or a fault of this code's own, ends with ``fail`` instead."""
    try:
        async for ch in handle:
            failed = unfinished(handle) if ch.finish_reason is not None else None
            if failed is not None:
                log.error("streamed request failed: %s", failed)
                piece = render(Chunk(ch.token_ids, ch.text, None)) if ch.text or ch.token_ids else None
                if piece:
                    yield piece
                yield fail(failed)
                return
            piece = render(ch)
            if piece:
                yield piece
        if tail is not None:
            yield tail(handle)
    except Exception as e:  # noqa: BLE001 - the stream still ends with its marker
        if cancelled(e):
            raise
        log.exception("streamed request %d failed", handle.id)
        yield fail(Unfinished(f"internal error ({type(e).__name__}: {e})", 500, "error"))
    finally:
        if not handle.done:
            handle.cancel()  # the client went away: free the slot
        account(handle)


def sse_fail(e: Unfinished) -> bytes:
    """An SSE stream's end for a request that failed: an error event, then [DONE]."""
    return api.sse(api.error_body(str(e), e.status)) + api.sse("[DONE]")
