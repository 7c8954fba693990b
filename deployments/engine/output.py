"""The output processor: what a step's outcomes become for the callers (no torch).

Each request's ``RequestHandle`` and ``TextState`` live here from its submission to its end.
``process`` turns the scheduler's outcomes into text: it detokenizes each token, finds stop
strings and makes the request's chunk (its last one where it ended), and returns the requests
that their text ended (a stop string; a failure of the text itself), for the scheduler to
retire. ``deliver`` then hands the chunks over, one hand-over per consumer for the whole step.
The engine calls ``deliver`` after the retired requests' cache is zeroed, so a caller that sees
a request end sees its slot free.

A failure in one request's text fails only that request.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from deployments.engine.plan import Outcome
from deployments.engine.request import Chunk, RequestHandle, TextState, delivered_together

log = logging.getLogger(__name__)


@dataclass
class Stream:
    """One request's caller side: its handle and its text so far."""

    handle: RequestHandle
    text: TextState


class OutputProcessor:
    def __init__(self) -> None:
        self._streams: dict[int, Stream] = {}
        self._lock = threading.Lock()  # add runs on the submitting threads
        self._chunks: list[tuple[Stream, Chunk, BaseException | None]] = []  # made, not delivered yet
        self._ends: list[tuple[int, str, BaseException | None]] = []  # requests their text ended

    def add(self, handle: RequestHandle, text: TextState) -> None:
        """A new request (any thread), before the scheduler sees it."""
        with self._lock:
            self._streams[handle.id] = Stream(handle, text)

    def cancelled(self) -> set[int]:
        """The requests their callers cancelled."""
        with self._lock:
            return {i for i, st in self._streams.items() if st.handle.cancelled}

    def admitted(self, ids: list[int]) -> None:
        """Requests that got a cache slot (a preempted one keeps its first time)."""
        now = time.perf_counter()
        for i in ids:
            st = self._streams.get(i)
            if st is not None and st.handle.admitted_at is None:
                st.handle.admitted_at = now

    def process(self, outcomes: list[Outcome]) -> list[tuple[int, str, BaseException | None]]:
        """Make each outcome's chunk; returns (request, reason, error) of the requests their text
        ended, to be finished in the scheduler."""
        for o in outcomes:
            st = self._streams.get(o.seq_id)
            if st is None:
                continue
            if o.token is None:
                self._chunks.append((st, Chunk([], "", o.reason), o.error))
                continue
            st.handle._mark_token()
            try:
                self._emit(st, o.token, o.reason)
            except Exception as e:  # one request's text failed: only that request ends
                log.exception("request %d failed after sampling", o.seq_id)
                self._chunks.append((st, Chunk([], "", "error"), e))
                if o.reason is None:
                    self._ends.append((o.seq_id, "error", e))
        ends, self._ends = self._ends, []
        return ends

    def _emit(self, st: Stream, tok: int, reason: str | None) -> None:
        """Detokenize one token and check stop strings: the request's next chunk, or its last."""
        if reason == "stop":
            text = st.text.finish()  # the stop token's text is not returned
        else:
            text, hit = st.text.push(tok)
            if hit:
                reason = "stop"
                self._ends.append((st.handle.id, "stop", None))
            elif reason == "length":
                text += st.text.finish()
        self._chunks.append((st, Chunk([tok], text, reason), None))

    def deliver(self) -> None:
        """Hand the chunks made so far to their callers, one hand-over per consumer."""
        chunks, self._chunks = self._chunks, []
        with delivered_together():
            for st, chunk, error in chunks:
                st.handle._put(chunk, error=error)
                if chunk.finish_reason is not None:
                    with self._lock:
                        self._streams.pop(st.handle.id, None)
