"""The scheduler: which request runs when, and what becomes of its tokens.

It owns the requests' queues and the KV-cache slots: new submissions and cancellations are
taken at a step boundary (``intake``); waiting requests get free slots, lowest first, so the
live slots stay packed at the front and the decode batch stays small (``admit``); prompts
whose rest starts at one position (0, or past one shared prefix) and pads to one length share
one forward (``prefill_group``). A decode step's tokens are sampled on the device and read
back one step later (``take``: the engine launches the next step first): sequences that hit a
stop token, a stop string or their length end there, and their row of the step launched
meanwhile is dropped. A prefill's first tokens are sampled and streamed at once (``sample``).
Only the engine's loop thread calls it, but for ``add``.

A failure inside one request's sampling or detokenizing fails only that request; a device
error is re-raised for the loop to stop on.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from typing import Callable

import torch

from deployments.engine.blocks import BlockPool
from deployments.engine.request import Chunk, RequestHandle, SamplingParams, TextState, delivered_together
from deployments.engine.sampling import sample, sample_on_device

log = logging.getLogger(__name__)


def is_device_error(e: BaseException) -> bool:
    """A failure of the device itself, which stops the loop (one request's bad input does not);
    torch raises CUDA failures as RuntimeError (torch.AcceleratorError in newer releases)."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    return type(e).__name__ == "AcceleratorError" or "CUDA" in str(e) or "cuda" in type(e).__module__


class NonFiniteLogits(RuntimeError):
    """A request's logits held NaN or inf: the request fails, with this message, instead of
    streaming the arbitrary tokens an argmax over them picks."""


class Seq:
    """Engine-side state of one request (touched only by the loop thread)."""

    __slots__ = ("handle", "prompt", "params", "slot", "blocks", "prompt_keys", "admitted", "prefilled", "pos",
                 "written", "last", "ahead", "n_gen", "out", "text", "gen", "stops")

    def __init__(self, handle: RequestHandle, prompt: list[int], params: SamplingParams, text: TextState, stops: set):
        self.handle, self.prompt, self.params, self.text, self.stops = handle, prompt, params, text, stops
        self.slot = -1
        self.blocks: list[int] | None = None  # a paged cache's blocks it holds
        # its prompt's full blocks' keys (blocks.py), computed once per prompt while it waits; its
        # blocks are kept under them once it is prefilled
        self.prompt_keys: list[bytes] | None = None
        self.admitted = 0  # the scheduler's count of admissions when it was last admitted
        self.prefilled = 0  # prompt tokens in the cache
        self.pos = 0  # next cache position to write (tokens in the cache)
        self.written = 0  # cache positions [0, written) of its slot its prefills wrote (padding included)
        self.last = -1  # last sampled token, fed at `pos` by the next decode step
        self.ahead = 0  # its tokens sampled on the device and not taken yet (then `last` is not its last)
        self.n_gen = 0
        self.out: list[int] = []  # the tokens it generated (a preempted sequence is prefilled again over them)
        self.gen: torch.Generator | None = None

    def runs_next(self) -> bool:
        """Whether the next decode step has a row for it: not once its last token is sampled."""
        return self.n_gen + self.ahead < self.params.max_new_tokens


class Scheduler:
    """Queues and slots of one engine. ``zero_slot(slot, upto)`` clears what a retired sequence
    wrote in the cache (the engine passes the runner's, or nothing once the device failed). With
    a paged cache, ``pool`` holds its blocks (``deployments.engine.blocks``): a waiting request is
    admitted once a slot and the blocks of its prompt are free, sharing those of a kept prefix and
    prefilled from the first it does not share; a decoding one takes a block more as it needs one
    (``make_room``), preempting the sequence admitted last where none is free; each change of a
    slot's blocks is ``assign(slot, blocks, clear)``, and a sequence's end or preemption gives them
    back (``release(slot, empty)``: those no one holds or keeps are zeroed, instead of ``zero_slot``)."""

    def __init__(self, max_slots: int, device: torch.device, zero_slot: Callable[[int, int], None],
                 pool: BlockPool | None = None, assign: Callable[[int, list[int], list[int]], None] | None = None,
                 release: Callable[[int, list[int]], None] | None = None):
        self.device = device
        self._zero_slot = zero_slot
        self.pool, self._assign, self._release = pool, assign, release
        self.free = list(range(max_slots))  # min-heap: lowest slot first keeps the batch packed
        self.inbox: deque[Seq] = deque()
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []
        self.decoding: list[Seq] = []
        self.lock = threading.Lock()
        self.counts = {"tokens_generated": 0, "prompt_tokens": 0, "finished": 0}
        self._admissions = 0

    # ---------------------------------------------------------------- queues
    def add(self, *seqs: Seq) -> None:
        """Queue new requests (any thread); the loop takes them at one step boundary."""
        with self.lock:
            self.inbox.extend(seqs)

    def intake(self) -> None:
        """New requests join the waiting queue; cancelled ones end (their slots are freed)."""
        with self.lock:
            while self.inbox:
                self.waiting.append(self.inbox.popleft())
        for s in [s for s in self.waiting if s.handle.cancelled]:
            self.waiting.remove(s)
            self.finish(s, "cancelled")
        for s in [s for s in self.prefilling + self.decoding if s.handle.cancelled]:
            self.finish(s, "cancelled")

    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)

    def admit(self) -> None:
        """Waiting requests take free slots (and, paged, their blocks) in order. Paged with prefix
        reuse, a prompt whose next block of shareable prefix another admitted prompt is computing
        now (a burst of chats behind one system prompt) waits until that one is in the cache and
        then shares it; those behind it go on meanwhile."""
        pool = self.pool
        computing = ({k for q in self.prefilling for k in q.prompt_keys} if pool is not None and pool.prefix
                     else None)
        i = 0
        while i < len(self.waiting) and self.free:
            s = self.waiting[i]
            grant = None
            if pool is not None:
                if s.prompt_keys is None:
                    s.prompt_keys = pool.keys(s.prompt) if pool.prefix else []
                if computing and pool.first_missing(s.prompt, s.prompt_keys) in computing:
                    i += 1
                    continue
                # its prompt and its first token's position; while others run, a hundredth of the
                # cache stays free for them to grow into (fewer preemptions)
                room = -(-pool.capacity // 100) if self.prefilling or self.decoding else 0
                grant = pool.admit(s.prompt, len(s.prompt) + 1, room, s.prompt_keys)
                if grant is None:  # in order: the first in the queue waits for its blocks
                    break
            del self.waiting[i]
            s.slot = heapq.heappop(self.free)
            if grant is not None:
                s.blocks = grant.blocks
                if computing is not None:
                    computing.update(grant.keys)
                s.prefilled = s.written = grant.cached  # its shared prefix is in the cache already
                self._assign(s.slot, s.blocks, grant.clear)
            self._admissions += 1
            s.admitted = self._admissions
            if s.handle.admitted_at is None:  # (a preempted sequence keeps its first)
                s.handle.admitted_at = time.perf_counter()
            self.prefilling.append(s)

    def make_room(self, drain: Callable[[], None]) -> None:
        """A paged cache: each sequence the next decode step runs whose next position lies past
        its blocks takes one more, oldest sequences first; where none is free, the tokens still
        on the device are taken first (``drain``: a preempted sequence is prefilled again over
        every token it has, and sequences that ended give their blocks back), then the sequence
        admitted last is preempted (``preempt``), until one is, or until it is the sequence itself."""
        if self.pool is None:
            return
        short = [s for s in self.decoding if s.runs_next() and self.pool.need(s.pos + 1) > len(s.blocks)]
        drained = False
        for s in sorted(short, key=lambda q: q.admitted):  # (a few per step)
            while s.slot >= 0 and s.runs_next() and self.pool.need(s.pos + 1) > len(s.blocks):
                got = self.pool.grow()
                if got is None:
                    if not drained:
                        drained = True
                        drain()
                        continue
                    self.preempt(max(self.prefilling + self.decoding, key=lambda q: q.admitted))
                    continue
                block, clear = got
                s.blocks.append(block)
                self._assign(s.slot, s.blocks, [block] if clear else [])

    def preempt(self, s: Seq) -> None:
        """Give ``s``'s slot and blocks back and queue it first, to be prefilled again over its
        prompt and the tokens it generated; it then samples on from where it stopped (its
        generator and text go on)."""
        for lst in (self.prefilling, self.decoding):
            if s in lst:
                lst.remove(s)
        blocks, s.blocks = s.blocks, None
        self._release(s.slot, self.pool.give(blocks))
        heapq.heappush(self.free, s.slot)
        s.slot = -1
        s.prompt = s.prompt[: s.handle.prompt_len] + s.out
        s.prompt_keys, s.prefilled, s.pos, s.written = None, 0, 0, 0
        self.waiting.appendleft(s)
        self.pool.counts["preemptions"] += 1
        log.debug("request %d preempted for KV-cache blocks after %d tokens", s.handle.id, s.n_gen)

    def waiting_count(self) -> int:
        with self.lock:
            return len(self.inbox) + len(self.waiting)

    def prefill_group(self, chunk: int, padded_len: Callable[[int, int], int], max_read: int
                      ) -> tuple[list[Seq], int, int]:
        """Prompts to prefill in one forward, (seqs, L, start): prompts whose rest fits one chunk
        and starts at one position ``start`` (0 for fresh prompts; the length of a prefix they
        found in the cache, as a burst behind one system prompt does) and pads to one length L, as
        many as make a number of rows R, a power of two, with R x L <= chunk and, past a prefix,
        R x (start + L) <= ``max_read`` (the cached positions the forward gathers for its
        attention); the first pair in admission order that can decides (start, L). Every matrix
        product then has R x L rows, a length the engine ran before serving (prefill lengths are
        powers of two), so no first-time cost of a GEMM shape reaches a request. ([], 0, 0) when
        there is no such pair of prompts."""
        groups: dict[tuple[int, int], list[Seq]] = {}
        pairs = []  # the keys that have two prompts, in order
        for s in self.prefilling:
            n = len(s.prompt) - s.prefilled
            if n > chunk:
                continue
            L = padded_len(n, s.prefilled)
            if L & (L - 1):  # chunk itself, or no room to pad, not a power of two: alone
                continue
            same = groups.setdefault((s.prefilled, L), [])
            same.append(s)
            if len(same) == 2:
                pairs.append((s.prefilled, L))
        for start, L in pairs:
            same, R = groups[start, L], 1
            while R * 2 <= len(same) and R * 2 * L <= chunk and (start == 0 or R * 2 * (start + L) <= max_read):
                R *= 2
            if R > 1:
                return same[:R], L, start
        return [], 0, 0

    # ---------------------------------------------------------------- after a forward
    def prefilled(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        """Sequences whose whole prompt is in the cache start decoding; logits [R, V] (row j for
        seqs[j], at its last prompt token) give their first tokens, which stream now."""
        rows = []
        for j, s in enumerate(seqs):
            self.prefilling.remove(s)
            s.pos = len(s.prompt)
            if s.prompt_keys:
                self.pool.keep(s.blocks, s.prompt_keys)
            if s.n_gen:  # prefilled again after a preemption: its generator goes on
                self.decoding.append(s)
                rows.append(j)
                continue
            try:
                s.gen = _generator(s.params, self.device)
            except Exception as e:  # one request's setting must not stop the loop
                if is_device_error(e):
                    raise
                log.exception("request %d failed: its sampling generator", s.handle.id)
                self.finish(s, "error", e)
                continue
            self.decoding.append(s)
            rows.append(j)
        if len(rows) < len(seqs):
            seqs = [seqs[j] for j in rows]
            logits = logits[rows]
        if seqs:
            self.sample(seqs, logits)

    @staticmethod
    def _params(seqs: list[Seq]) -> tuple[list, list, list]:
        return [s.params.temperature for s in seqs], [s.params.top_p for s in seqs], [s.params.top_k for s in seqs]

    def sample(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        """Sample each sequence's next token from logits [R, V] (row j for seqs[j]) and stream it
        now (waits for the device)."""
        args = self._params(seqs)
        try:
            toks: list[int | None] = sample(logits, *args, [s.gen for s in seqs])
        except Exception as e:
            if is_device_error(e):
                raise
            toks = self._sample_one_by_one(seqs, logits, args)
        self.take(seqs, toks, logits.dtype)

    def sample_step(self, seqs: list[Seq], logits: torch.Tensor) -> torch.Tensor | None:
        """A decode step's tokens, ``sample`` left on the device: [R] (-1: not finite), for ``take`` once
        read back; None where sampling the batch failed (``sample`` row by row then finds the
        rows at fault)."""
        try:
            return sample_on_device(logits, *self._params(seqs), [s.gen for s in seqs])
        except Exception as e:
            if is_device_error(e):
                raise
            log.warning("sampling a decode step failed (%s): its rows one by one", e)
            return None

    def take(self, seqs: list[Seq], toks: list[int | None], dtype: torch.dtype) -> None:
        """A step's tokens (row j for seqs[j]; None: its logits were not finite) join their
        sequences and stream, in one hand-over per consumer; a sequence that ended meanwhile
        (a stop, its length, a cancel) drops its token."""
        with delivered_together():
            for s, tok in zip(seqs, toks):
                if s.handle.done or s.slot < 0:
                    continue
                if tok is None:
                    log.error("request %d: non-finite logits at generated token %d", s.handle.id, s.n_gen + 1)
                    self.finish(s, "error", NonFiniteLogits(
                        f"the model's logits were not finite (NaN or inf) at generated token {s.n_gen + 1}: "
                        f"it overflowed its dtype ({dtype}) on this prompt; a float16 checkpoint "
                        f"may need packing as bfloat16 (coldstart pack --dtype bfloat16)"))
                    continue
                self._emit_safely(s, tok, self._take(s, tok))

    def _sample_one_by_one(self, seqs: list[Seq], logits: torch.Tensor, args: tuple) -> list[int | None]:
        """Find the row at fault: sample each on its own, failing only the bad ones (None)."""
        toks: list[int | None] = []
        for j, s in enumerate(seqs):
            try:
                toks.extend(sample(logits[j: j + 1], *[[a[j]] for a in args], [s.gen]))
            except Exception as e:
                if is_device_error(e):
                    raise
                log.exception("request %d failed in sampling", s.handle.id)
                self.finish(s, "error", e)
                toks.append(None)
        return toks

    def _take(self, s: Seq, tok: int) -> str | None:
        """Record a sampled token; "stop" / "length" when it ends the sequence without looking at
        text (stop strings are found when the text is made)."""
        s.last = tok
        s.n_gen += 1
        s.out.append(tok)
        self.counts["tokens_generated"] += 1
        s.handle._mark_token()
        if tok in s.stops:
            return "stop"
        return "length" if s.n_gen >= s.params.max_new_tokens else None

    def _emit_safely(self, s: Seq, tok: int, reason: str | None) -> None:
        try:
            self._emit(s, tok, reason)
        except Exception as e:  # one request's text failed: only that request ends
            log.exception("request %d failed after sampling", s.handle.id)
            self.finish(s, "error", e)

    def _emit(self, s: Seq, tok: int, reason: str | None) -> None:
        """Detokenize one token, check stop strings, stream it or finish the request."""
        if reason == "stop":
            text = s.text.finish()  # the stop token's text is not returned
        else:
            text, hit = s.text.push(tok)
            if hit:
                reason = "stop"
            elif reason == "length":
                text += s.text.finish()
        if reason is None:
            s.handle._put(Chunk([tok], text, None))
        else:
            self.finish(s, reason, token=tok, text=text)

    # ---------------------------------------------------------------- endings
    def _retire(self, s: Seq) -> None:
        """Stop scheduling ``s`` and free its cache slot (its last chunk may still be pending).

        The positions it wrote are zeroed first (one fill, queued behind its last step): a
        multi-row decode step reads every key of its length bucket, masked ones included, and a
        masked key still multiplies its value (0 * NaN = NaN). A request whose keys or values
        overflowed (fp16) would otherwise leave non-finite values behind, and every later
        request in that slot would decode garbage."""
        for lst in (self.prefilling, self.decoding):
            if s in lst:
                lst.remove(s)
        if s.slot >= 0:
            if s.blocks is not None:
                blocks, s.blocks = s.blocks, None
                self._release(s.slot, self.pool.give(blocks))
            else:
                upto = max(s.written, s.pos)
                if upto:
                    self._zero_slot(s.slot, upto)
            heapq.heappush(self.free, s.slot)
            s.slot = -1

    def finish(self, s: Seq, reason: str, error: BaseException | None = None, *, token: int | None = None,
               text: str = "") -> None:
        try:
            self._retire(s)  # (a device error here still ends the request, then the loop)
        finally:
            self.counts["finished"] += 1
            s.handle._put(Chunk([] if token is None else [token], text, reason), error=error)

    def fail_all(self, reason: str, error: BaseException | None) -> None:
        """End every request not finished yet (the loop stopped or died)."""
        with self.lock:
            pending = list(self.inbox) + list(self.waiting) + self.prefilling + self.decoding
            self.inbox.clear()
        self.waiting.clear()
        for s in pending:
            if not s.handle.done:
                self.finish(s, reason, error)


def _generator(p: SamplingParams, device: torch.device) -> torch.Generator | None:
    if p.greedy:
        return None
    g = torch.Generator(device=device)
    if p.seed is None:
        g.seed()
    else:
        g.manual_seed(p.seed)
    return g
