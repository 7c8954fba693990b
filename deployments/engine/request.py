"""Request-side types of the engine: parameters, streamed chunks, the handle, stop-string text.

`RequestHandle` is filled by the engine thread and read by the caller: async
iteration from an asyncio event loop in another thread (chunks are handed over
with `loop.call_soon_threadsafe`), blocking iteration, or `result()`. Inside
`delivered_together()` (the engine's emit of one step's tokens), the chunks for
each event loop go over in one call at its end, not one call per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from deployments.engine.tokenizer import IncrementalDecoder

# Stop strings per request: bounded because they are looked for after each token in the
# engine's loop, which every request's steps share (docs/measurements.md).
MAX_STOP_STRINGS = 64
# Stop token ids are one set lookup per token; the bound only keeps a request's set small.
MAX_STOP_TOKEN_IDS = 1024
# A temperature below this is greedy: dividing the logits by it would overflow float32 (a
# temperature of 1e-300 made every logit inf and every token 0), and it would pick the likeliest
# token anyway
GREEDY_BELOW = 1e-5


def cut(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters: an error message quotes what was sent, not all of it."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _shown(v: Any) -> str:
    return cut(repr(v))


@dataclass
class SamplingParams:
    """Per-request generation options; `validate()` raises ValueError naming the field."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # on detokenized text; the stop string is not returned
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) or not (
            0.0 <= self.temperature <= 100.0
        ):
            raise ValueError(f"SamplingParams.temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 1 << 64):
            raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be a list of non-empty strings, got {_shown(self.stop)}")
        if len(self.stop) > MAX_STOP_STRINGS:  # each is looked for after every token, in the loop all share
            raise ValueError(f"SamplingParams.stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of ints >= 0, "
                             f"got {_shown(self.stop_token_ids)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"SamplingParams.stop_token_ids has {len(self.stop_token_ids)} ids; "
                             f"at most {MAX_STOP_TOKEN_IDS}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")


@dataclass
class Chunk:
    """One streamed piece of a request's output."""

    token_ids: list[int]
    text: str
    finish_reason: str | None  # None, "stop", "length", "cancelled", "error"


class TextState:
    """Incremental text with stop strings: holds back any tail that could start a stop string."""

    def __init__(self, decoder: IncrementalDecoder | None, stop: list[str]):
        self._dec = decoder
        self._stop = list(stop)
        self._max_stop = max((len(s) for s in stop), default=0)
        self.text = ""  # decoded so far (after a stop: cut at the stop string)
        self._emitted = 0

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (text to emit now, whether a stop string ended the output)."""
        if self._dec is None:
            return "", False
        self.text += self._dec.push(token_id)
        if not self._stop:
            return self._emit_upto(len(self.text)), False
        hits = [i for i in (self.text.find(s, self._emitted) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return self._emit_upto(len(self.text)), True
        return self._emit_upto(len(self.text) - self._held()), False

    def finish(self) -> str:
        """Everything still held back (incomplete character, partial stop string)."""
        if self._dec is not None:
            self.text += self._dec.flush()
        return self._emit_upto(len(self.text))

    def _held(self) -> int:
        # longest tail of the text (not yet emitted) that is a prefix of some stop string
        t = self.text
        for k in range(min(self._max_stop - 1, len(t) - self._emitted), 0, -1):
            tail = t[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def _emit_upto(self, end: int) -> str:
        """The text not emitted yet up to ``end``, now emitted."""
        out = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return out


class _Together(threading.local):
    # per thread: event loop -> [(handle, its queue, chunk)] while delivered_together() is open
    pending: dict | None = None


_together = _Together()


@contextlib.contextmanager
def delivered_together() -> Iterator[None]:
    """Chunks put in this thread meanwhile reach each asyncio consumer's loop in one
    ``call_soon_threadsafe`` at the end, in order: one wake-up of a loop per step, not one call
    per request, each of which costs the engine's thread (docs/measurements.md)."""
    if _together.pending is not None:  # nested: the outer one delivers
        yield
        return
    _together.pending = {}
    try:
        yield
    finally:
        pending, _together.pending = _together.pending, None
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody listens any more
                for h, _, _ in items:
                    h._cancel = True


def _deliver(items: list[tuple["RequestHandle", asyncio.Queue, "Chunk"]]) -> None:
    for _, q, chunk in items:
        q.put_nowait(chunk)


class RequestHandle:
    """The caller's side of one request: stream of `Chunk`s, cancel, timing metrics."""

    def __init__(self, request_id: int, prompt_len: int, wake: threading.Event):
        self.id = request_id
        self.prompt_len = prompt_len
        self._wake = wake
        self._cond = threading.Condition()
        self._chunks: list[Chunk] = []
        self._cancel = False
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.submitted_at = time.perf_counter()
        self.admitted_at: float | None = None  # when it got a KV-cache slot
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None  # when the last token was sampled
        self.finished_at: float | None = None
        self.n_tokens = 0
        # bind to the submitter's event loop, if any, so chunks can be awaited there
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aq: asyncio.Queue | None = None
        self._final_only = False  # ``finished()`` waits: only the last chunk goes to the loop
        try:
            self._bind(asyncio.get_running_loop())
        except RuntimeError:
            pass

    # -------------------------------------------------------------- metrics
    @property
    def ttft_s(self) -> float | None:
        """Seconds from submit to the first token."""
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def queue_wait_s(self) -> float | None:
        """Seconds from submit until the request got a KV-cache slot."""
        return None if self.admitted_at is None else self.admitted_at - self.submitted_at

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second after the first one (None until finished with >= 2 tokens)."""
        if self.finished_at is None or self.first_token_at is None or self.n_tokens < 2:
            return None
        dt = self.last_token_at - self.first_token_at
        return (self.n_tokens - 1) / dt if dt > 0 else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def cancelled(self) -> bool:
        return self._cancel

    def cancel(self) -> None:
        """Ask the engine to stop this request; its slot is freed at the next step boundary."""
        self._cancel = True
        self._wake.set()

    # -------------------------------------------------------------- engine side
    def _mark_token(self) -> None:
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.n_tokens += 1

    def _put(self, chunk: Chunk, error: BaseException | None = None) -> None:
        with self._cond:
            if self.finish_reason is not None:
                return
            if chunk.finish_reason is not None:
                self.finish_reason, self.error, self.finished_at = chunk.finish_reason, error, time.perf_counter()
            self._chunks.append(chunk)
            self._cond.notify_all()
            if self._aq is not None and (chunk.finish_reason is not None or not self._final_only):
                if _together.pending is not None:
                    _together.pending.setdefault(self._loop, []).append((self, self._aq, chunk))
                    return
                try:
                    self._loop.call_soon_threadsafe(self._aq.put_nowait, chunk)
                except RuntimeError:  # the caller's loop is closed: nobody listens any more
                    self._cancel = True

    # -------------------------------------------------------------- caller side
    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        # called on `loop`'s thread; replays chunks that arrived before binding
        with self._cond:
            self._loop, self._aq = loop, asyncio.Queue()
            for c in self._chunks:
                self._aq.put_nowait(c)

    def __aiter__(self) -> "RequestHandle":
        return self

    def _queue(self) -> asyncio.Queue:
        """This handle's queue in the running event loop (bound to it on first use there)."""
        if self._aq is None or self._loop is not asyncio.get_running_loop():
            self._bind(asyncio.get_running_loop())
        return self._aq

    async def _next(self, q: asyncio.Queue) -> Chunk:
        """The next chunk from ``q``; a cancelled wait (the consumer went away: a client's
        disconnect) cancels the request."""
        try:
            chunk = await q.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if chunk.finish_reason is not None:
            self._aended = True
        return chunk

    async def __anext__(self) -> Chunk:
        q = self._queue()
        if getattr(self, "_aended", False):
            raise StopAsyncIteration
        return await self._next(q)

    async def finished(self) -> tuple[list[int], str, str]:
        """Wait in the caller's event loop for the request's end, woken once rather than per
        token: (token_ids, text, finish_reason), as ``result``. A cancelled wait cancels the
        request, as a cancelled async iteration does."""
        q = self._queue()
        with self._cond:
            self._final_only = True
        while (await self._next(q)).finish_reason is None:  # (chunks queued before this call)
            pass
        return self.result(timeout=0)

    def __iter__(self) -> Iterator[Chunk]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._chunks):
                    self._cond.wait()
                chunk = self._chunks[i]
            i += 1
            yield chunk
            if chunk.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> tuple[list[int], str, str]:
        """Block until finished; returns (token_ids, text, finish_reason). Raises TimeoutError."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.finish_reason is not None, timeout):
                raise TimeoutError(f"request {self.id} not finished after {timeout} s")
            chunks = list(self._chunks)
        ids = [t for c in chunks for t in c.token_ids]
        return ids, "".join(c.text for c in chunks), self.finish_reason
