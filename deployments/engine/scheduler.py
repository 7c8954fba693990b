"""The scheduler: which request runs when, decided, never run. It imports no torch and calls
nothing outside itself; each decision comes back as a ``Plan`` (``deployments.engine.plan``).

It owns the requests' queues and the KV-cache slots (and, paged, the blocks' pool). At a step
boundary new submissions join the waiting queue and cancelled requests end (``intake``).
``schedule_prefill``: waiting requests get free slots, lowest first, so the live slots stay
packed at the front and the decode batch stays small; then up to ``prefill_chunk`` prompt
tokens are planned, prompts whose rest starts at one position (0, or past one shared prefix) and
pads to one length sharing one forward. ``schedule_decode``: each decoding sequence gets a row of
the next step (paged: a block more where its next position needs one, preempting the sequence
admitted last where none is free). ``update`` applies what a plan's run sampled: a sequence
that hit a stop token or its length ends there; ``finish`` ends one for a reason found outside
(a stop string in its text). A retired sequence's cache is zeroed by the next plan's
``cache_ops`` (``schedule_frees`` gives them at once).

Only the engine's loop thread calls it, but for ``add`` and ``waiting_count``.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import deque
from dataclasses import dataclass

from deployments.engine.blocks import BlockPool
from deployments.engine.config import padded_len
from deployments.engine.plan import DecodeRow, Outcome, Plan, Prefill, PrefillChunk, PrefillGroup, Sampled
from deployments.engine.request import SamplingParams

log = logging.getLogger(__name__)


class NonFiniteLogits(RuntimeError):
    """A request's logits held NaN or inf: the request fails, with this message, instead of
    streaming the arbitrary tokens an argmax over them picks."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine's limits as the scheduler needs them (``EngineConfig`` resolved, and the
    runner's prefill lengths)."""

    max_slots: int
    max_seq_len: int
    prefill_chunk: int
    prefill_lengths: tuple[int, ...] = ()  # the padded chunk lengths (empty: no padding)
    batched_prefill: bool = False  # prompts of one start and padded length may share a forward
    group_read: int = 0  # past a prefix, the cached positions one shared forward may gather


class Seq:
    """The scheduler's state of one request."""

    __slots__ = ("id", "prompt", "prompt_len", "params", "stops", "slot", "blocks", "prompt_keys", "admitted",
                 "prefilled", "pos", "written", "last", "ahead", "n_gen", "out", "done")

    def __init__(self, seq_id: int, prompt: list[int], params: SamplingParams, stops: set[int] | frozenset = frozenset()):
        self.id, self.prompt, self.params, self.stops = seq_id, prompt, params, stops
        self.prompt_len = len(prompt)
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
        self.ahead = 0  # its rows in decode steps whose tokens are not back yet (then `last` is not its last)
        self.n_gen = 0
        self.out: list[int] = []  # the tokens it generated (a preempted sequence is prefilled again over them)
        self.done = False

    def runs_next(self) -> bool:
        """Whether the next decode step has a row for it: not once its last token is sampled."""
        return self.n_gen + self.ahead < self.params.max_new_tokens


class Scheduler:
    """Queues, slots and (paged) blocks of one engine; ``pool`` holds a paged cache's blocks
    (``deployments.engine.blocks``): a waiting request is admitted once a slot and the blocks of
    its prompt are free, sharing those of a kept prefix and prefilled from the first it does not
    share."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool | None = None):
        self.config, self.pool = config, pool
        self.free = list(range(config.max_slots))  # min-heap: lowest slot first keeps the batch packed
        self.inbox: deque[Seq] = deque()
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []
        self.decoding: list[Seq] = []
        self.lock = threading.Lock()
        self.counts = {"tokens_generated": 0, "prompt_tokens": 0, "finished": 0}
        self._live: dict[int, Seq] = {}  # taken in, not ended
        self._admissions = 0
        self._ops: list = []  # cache changes decided since the last plan
        self._ended: list[int] = []

    # ---------------------------------------------------------------- queues
    def add(self, *seqs: Seq) -> None:
        """Queue new requests (any thread); ``intake`` takes them at one step boundary."""
        with self.lock:
            self.inbox.extend(seqs)

    def waiting_count(self) -> int:
        with self.lock:
            return len(self.inbox) + len(self.waiting)

    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)

    def intake(self, cancelled: set[int] | frozenset = frozenset()) -> list[Outcome]:
        """New requests join the waiting queue; those in ``cancelled`` end wherever they are."""
        with self.lock:
            while self.inbox:
                s = self.inbox.popleft()
                self._live[s.id] = s
                self.waiting.append(s)
        return [self._end(self._live[i], "cancelled") for i in sorted(cancelled) if i in self._live]

    # ---------------------------------------------------------------- plans
    def schedule_prefill(self) -> Plan:
        """Admit waiting requests, then plan this turn's prompt chunks (``prefill_chunk`` tokens)."""
        admitted = self._admit()
        plan = self._plan(admitted=admitted)
        budget = self.config.prefill_chunk
        rest = list(self.prefilling)
        while self.config.batched_prefill and budget > 0:  # as many shared forwards as the chunk holds
            group, L, start = self.group(rest, budget)
            if not group:
                break
            for s in group:
                s.written = max(s.written, start + L)
                rest.remove(s)
            plan.prefills.append(PrefillGroup([s.id for s in group], [s.slot for s in group],
                                              [s.prompt[start:] for s in group], L, start, [s.params for s in group]))
            budget -= len(group) * L
        for s in rest:
            if budget <= 0:
                break
            at = s.prefilled
            while at < len(s.prompt) and budget > 0:
                n = min(self.config.prefill_chunk, len(s.prompt) - at)
                plan.prefills.append(PrefillChunk(s.id, s.slot, s.prompt[at: at + n], at, s.params,
                                                  at + n == len(s.prompt)))
                s.written = max(s.written, at + self._padded(n, at))
                at += n
                budget -= n
        return plan

    def short_of_blocks(self) -> bool:
        """Paged: whether the next decode step needs more new blocks than are free (then the
        tokens still on the device are best taken first: sequences that ended give theirs back,
        and a sequence preempted for blocks is prefilled again over every token it has)."""
        if self.pool is None:
            return False
        return len(self._short()) > self.pool.free

    def schedule_decode(self) -> Plan:
        """The next decode step: a row for every decoding sequence that runs next, each with the
        blocks its next position needs (``_grow``)."""
        self._grow()
        plan = self._plan()
        for s in self.decoding:
            if s.runs_next():
                plan.decode.append(DecodeRow(s.id, s.slot, None if s.ahead else s.last, s.pos, s.params))
                s.pos += 1
                s.ahead += 1
        return plan

    def schedule_frees(self) -> Plan:
        """The cache changes decided since the last plan alone (retired sequences' slots), to
        run before their requests' ends are delivered."""
        return self._plan()

    def _plan(self, **kw) -> Plan:
        ops, self._ops = self._ops, []
        ended, self._ended = self._ended, []
        return Plan(cache_ops=ops, ended=ended, **kw)

    def _padded(self, n: int, start: int) -> int:
        return padded_len(n, start, self.config.prefill_lengths, self.config.max_seq_len)

    # ---------------------------------------------------------------- admission and blocks
    def _admit(self) -> list[int]:
        """Waiting requests take free slots (and, paged, their blocks) in order. Paged with prefix
        reuse, a prompt whose next block of shareable prefix another admitted prompt is computing
        now (a burst of chats behind one system prompt) waits until that one is in the cache and
        then shares it; those behind it go on meanwhile."""
        pool, admitted = self.pool, []
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
                self._ops.append(("assign", s.slot, list(s.blocks), grant.clear))
            self._admissions += 1
            s.admitted = self._admissions
            admitted.append(s.id)
            self.prefilling.append(s)
        return admitted

    def _short(self) -> list[Seq]:
        return [s for s in self.decoding if s.runs_next() and self.pool.need(s.pos + 1) > len(s.blocks)]

    def _grow(self) -> None:
        """Paged: each sequence the next step runs whose next position lies past its blocks takes
        one more, oldest sequences first; where none is free, the sequence admitted last is
        preempted, until one is, or until it is the sequence itself."""
        if self.pool is None:
            return
        for s in sorted(self._short(), key=lambda q: q.admitted):  # (a few per step)
            while s.slot >= 0 and s.runs_next() and self.pool.need(s.pos + 1) > len(s.blocks):
                got = self.pool.grow()
                if got is None:
                    self._preempt(max(self.prefilling + self.decoding, key=lambda q: q.admitted))
                    continue
                block, clear = got
                s.blocks.append(block)
                self._ops.append(("assign", s.slot, list(s.blocks), [block] if clear else []))

    def _preempt(self, s: Seq) -> None:
        """Give ``s``'s slot and blocks back and queue it first, to be prefilled again over its
        prompt and the tokens it generated; it then samples on from where it stopped."""
        self._leave(s)
        s.prompt = s.prompt[: s.prompt_len] + s.out
        s.prompt_keys, s.prefilled, s.pos, s.written = None, 0, 0, 0
        self.waiting.appendleft(s)
        self.pool.counts["preemptions"] += 1
        log.debug("request %d preempted for KV-cache blocks after %d tokens", s.id, s.n_gen)

    def group(self, prefilling: list[Seq], chunk: int) -> tuple[list[Seq], int, int]:
        """Of ``prefilling``, prompts to prefill in one forward, (seqs, L, start): prompts whose rest
        fits one chunk and starts at one position ``start`` (0 for fresh prompts; the length of a
        prefix they found in the cache) and pads to one length L, as many as make a number of rows
        R, a power of two, with R x L <= chunk and, past a prefix, R x (start + L) <=
        ``group_read`` (the cached positions the forward gathers for its attention); the first
        pair in admission order that can decides (start, L). Every matrix product then has R x L
        rows, a length the engine ran before serving (prefill lengths are powers of two), so no
        first-time cost of a GEMM shape reaches a request. ([], 0, 0) when there is no such pair."""
        groups: dict[tuple[int, int], list[Seq]] = {}
        pairs = []  # the keys that have two prompts, in order
        for s in prefilling:
            n = len(s.prompt) - s.prefilled
            if n > chunk:
                continue
            L = self._padded(n, s.prefilled)
            if L & (L - 1):  # chunk itself, or no room to pad, not a power of two: alone
                continue
            same = groups.setdefault((s.prefilled, L), [])
            same.append(s)
            if len(same) == 2:
                pairs.append((s.prefilled, L))
        read = self.config.group_read
        for start, L in pairs:
            same, R = groups[start, L], 1
            while R * 2 <= len(same) and R * 2 * L <= chunk and (start == 0 or R * 2 * (start + L) <= read):
                R *= 2
            if R > 1:
                return same[:R], L, start
        return [], 0, 0

    # ---------------------------------------------------------------- after a run
    def update(self, plan: Plan, sampled: Sampled) -> list[Outcome]:
        """Apply what running ``plan`` gave: prompt chunks in the cache, sequences whose whole
        prompt is start decoding, sampled tokens join their sequences (a sequence that ended
        meanwhile drops its own). One ``Outcome`` per request that got a token or ended."""
        out: list[Outcome | None] = []
        for i, item in enumerate(plan.prefills):
            out += self._prefilled(i, item, sampled)
        for row in plan.decode:
            s = self._live.get(row.seq_id)
            if s is not None:
                s.ahead -= 1
                out.append(self._fail(s, sampled) or self._record(s, sampled.tokens.get(s.id), sampled.dtype))
        return [o for o in out if o is not None]

    def _prefilled(self, i: int, item: Prefill, sampled: Sampled) -> list[Outcome]:
        group = isinstance(item, PrefillGroup)
        out = []
        for sid in item.seq_ids if group else [item.seq_id]:
            s = self._live.get(sid)
            failed = sampled.failed.get(sid)
            if s is None or (failed and failed[0] < i):  # it failed at an earlier chunk
                continue
            if failed and failed[0] == i:
                out.append(self._end(s, "error", failed[1]))
                continue
            end = len(s.prompt) if group else item.start + len(item.tokens)
            self.counts["prompt_tokens"] += end - item.start
            s.prefilled = end
            if group or item.last:  # its whole prompt is in the cache: it decodes from here
                self.prefilling.remove(s)
                s.pos = len(s.prompt)
                if s.prompt_keys:
                    self.pool.keep(s.blocks, s.prompt_keys)
                self.decoding.append(s)
                out.append(self._fail(s, sampled) or self._record(s, sampled.tokens.get(sid), sampled.dtype))
        return out

    def _fail(self, s: Seq, sampled: Sampled) -> Outcome | None:
        """``s``'s end where its sampler or its sampling failed."""
        failed = sampled.failed.get(s.id)
        return None if failed is None or s.done or s.slot < 0 else self._end(s, "error", failed[1])

    def _record(self, s: Seq, tok: int | None, dtype: str) -> Outcome | None:
        """A sampled token joins ``s`` (None: its logits were not finite, and it fails); it ends
        ``s`` at a stop token or at its length."""
        if s.done or s.slot < 0:  # ended (or preempted) since the step was planned: dropped
            return None
        if tok is None:
            log.error("request %d: non-finite logits at generated token %d", s.id, s.n_gen + 1)
            return self._end(s, "error", NonFiniteLogits(
                f"the model's logits were not finite (NaN or inf) at generated token {s.n_gen + 1}: "
                f"it overflowed its dtype ({dtype}) on this prompt; a float16 checkpoint "
                f"may need packing as bfloat16 (coldstart pack --dtype bfloat16)"))
        s.last = tok
        s.n_gen += 1
        s.out.append(tok)
        self.counts["tokens_generated"] += 1
        reason = "stop" if tok in s.stops else "length" if s.n_gen >= s.params.max_new_tokens else None
        if reason is not None:
            self._retire(s)
        return Outcome(s.id, tok, reason)

    # ---------------------------------------------------------------- endings
    def finish(self, seq_id: int, reason: str, error: BaseException | None = None) -> None:
        """End a running request for a reason found outside (a stop string in its text, a failure
        of its text); nothing if it has ended already."""
        s = self._live.get(seq_id)
        if s is not None and not s.done:
            self._end(s, reason, error)

    def _end(self, s: Seq, reason: str, error: BaseException | None = None) -> Outcome:
        self._retire(s)
        return Outcome(s.id, None, reason, error)

    def _retire(self, s: Seq) -> None:
        """Stop scheduling ``s`` and free its slot: the positions it wrote are zeroed (or, paged,
        its blocks no one else holds): a multi-row decode step reads every key of its length
        bucket, masked ones included, and a masked key still multiplies its value (0 * NaN =
        NaN); a request whose keys or values overflowed (fp16) would otherwise leave non-finite
        values behind for every later request in that slot."""
        s.done = True
        self._live.pop(s.id, None)
        self._ended.append(s.id)
        self.counts["finished"] += 1
        if s in self.waiting:
            self.waiting.remove(s)
        upto = max(s.written, s.pos)
        if s.slot >= 0 and s.blocks is None and upto:
            self._ops.append(("zero_slot", s.slot, min(upto, self.config.max_seq_len)))
        self._leave(s)

    def _leave(self, s: Seq) -> None:
        """``s`` leaves the running lists and gives its slot and blocks back."""
        for lst in (self.prefilling, self.decoding):
            if s in lst:
                lst.remove(s)
        if s.slot < 0:
            return
        if s.blocks is not None:
            blocks, s.blocks = s.blocks, None
            self._ops.append(("release", s.slot, self.pool.give(blocks)))
        heapq.heappush(self.free, s.slot)
        s.slot = -1

    def fail_all(self, reason: str, error: BaseException | None) -> list[Outcome]:
        """End every request not ended yet (the loop stopped or died)."""
        with self.lock:
            pending = list(self.inbox) + list(self.waiting) + self.prefilling + self.decoding
            self.inbox.clear()
        return [self._end(s, reason, error) for s in pending if not s.done]
