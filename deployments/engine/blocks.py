"""The paged KV cache's blocks, as the scheduler hands them out.

A request is admitted when the blocks of its prompt and its first new token are free, beside a
small headroom for the running sequences to grow into (``admit``); each running sequence then
takes one more block as its tokens reach the end of its last (``grow``). When none is free, the
scheduler preempts the sequence admitted last: its blocks go back, and it waits at the front of
the queue to be prefilled again over its prompt and the tokens it has generated (recompute), then
goes on where it stopped. A request's blocks go back at its end. So blocks are held by what
sequences have written, not by what they might write (a request's max_new_tokens), and there is
never an out-of-memory. A request that the whole cache could never hold is refused when it is
submitted (``check``).

Prefix reuse: once a prompt is in the cache, each of its full blocks is kept under a key of all
the tokens up to its end (a chained digest: a block's key names its whole prefix, not only its
own tokens). A later prompt that begins with the same blocks of tokens (a chat's system prompt,
a few-shot preamble) is admitted with those blocks shared, read-only, and is prefilled from the
first block it does not share. A shared block holds only prompt positions, which no sequence
writes again (decode writes after its own prompt, in blocks of its own). At its last holder's end a
kept block stays filled, counted free, and is reused for another prefix only when no empty block
is left, least recently used first (the last blocks of a prefix before its first ones).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Grant:
    """What admission gives a sequence: its ``blocks`` in order, the first ``cached`` positions
    already in them (shared blocks of its prompt's prefix), the ``keys`` of its prompt's full
    blocks (to keep them once prefilled), and the blocks that held another prefix and must be
    cleared before use (``clear``)."""

    blocks: list[int]
    cached: int = 0
    keys: list[bytes] = field(default_factory=list)
    clear: list[int] = field(default_factory=list)


class BlockPool:
    """Blocks 1..num_blocks-1 of a paged cache (block 0 is its null block), ``block_size``
    positions each; ``prefix``: keep and share the full blocks of prompts (above)."""

    def __init__(self, num_blocks: int, block_size: int, prefix: bool = True):
        self.block_size, self.prefix = block_size, prefix
        self.capacity = num_blocks - 1
        self._empty = list(range(num_blocks - 1, 0, -1))  # a stack: low blocks first
        self._refs = [0] * num_blocks  # sequences holding each block
        self._block_of: dict[bytes, int] = {}  # a kept prefix's key -> its block
        self._key_of: dict[int, bytes] = {}  # and back
        self._idle: OrderedDict[int, None] = OrderedDict()  # kept blocks nobody holds, least recently used first
        self.counts = {"prefix_hit_tokens": 0, "prefix_evictions": 0, "preemptions": 0}

    def need(self, positions: int) -> int:
        return -(-positions // self.block_size)

    @property
    def free(self) -> int:
        """Blocks a new sequence can have: empty ones, and kept ones nobody holds."""
        return len(self._empty) + len(self._idle)

    @property
    def cached(self) -> int:
        """Of the free blocks, those holding a kept prefix."""
        return len(self._idle)

    def check(self, prompt: int, new_tokens: int) -> None:
        """ValueError, with the numbers, for a request no state of the cache could hold."""
        n = self.need(prompt + new_tokens)
        if n > self.capacity:
            raise ValueError(
                f"prompt ({prompt} tokens) + max_new_tokens ({new_tokens}) needs {n} KV-cache blocks of "
                f"{self.block_size} positions, but this replica's cache holds {self.capacity} "
                f"({self.capacity * self.block_size} positions): shorten the prompt or max_new_tokens")

    def keys(self, prompt: list[int]) -> list[bytes]:
        """The key of each full block of ``prompt``: a digest of every token up to its end."""
        bs, out, prev = self.block_size, [], b""
        for end in range(bs, len(prompt) + 1, bs):
            prev = hashlib.blake2b(prev + array("q", prompt[end - bs:end]).tobytes(), digest_size=16).digest()
            out.append(prev)
        return out

    def shareable(self, prompt: list[int], keys: list[bytes]) -> list[bytes]:
        """Of a prompt's ``keys``, those of the blocks it may share: at least its last token is
        left to compute (its logits give the first new token)."""
        return keys[: (len(prompt) - 1) // self.block_size]

    def first_missing(self, prompt: list[int], keys: list[bytes]) -> bytes | None:
        """The key of the first block of ``prompt``'s shareable prefix that is not kept, if any."""
        return next((k for k in self.shareable(prompt, keys) if k not in self._block_of), None)

    def admit(self, prompt: list[int], positions: int, headroom: int = 0,
              keys: list[bytes] | None = None) -> Grant | None:
        """The blocks of ``positions`` positions of a sequence whose prompt is ``prompt`` (its
        ``keys``, if computed already), sharing the kept blocks of its longest kept prefix; None
        (nothing taken) when fewer than they and ``headroom`` more are free."""
        if keys is None:
            keys = self.keys(prompt) if self.prefix else []
        hits: list[int] = []
        for key in self.shareable(prompt, keys):
            b = self._block_of.get(key)
            if b is None:
                break
            hits.append(b)
        fresh = self.need(positions) - len(hits)
        if fresh + headroom > self.free - sum(1 for b in hits if self._refs[b] == 0):
            return None
        for b in hits:
            if self._refs[b] == 0:
                del self._idle[b]
            self._refs[b] += 1
        new, clear = self._claim(fresh)
        self.counts["prefix_hit_tokens"] += len(hits) * self.block_size
        return Grant(hits + new, len(hits) * self.block_size, keys, clear)

    def grow(self) -> tuple[int, bool] | None:
        """One more block for a running sequence, and whether it held a kept prefix (to be
        cleared before use); None when none is free."""
        if not self.free:
            return None
        new, clear = self._claim(1)
        return new[0], bool(clear)

    def _claim(self, n: int) -> tuple[list[int], list[int]]:
        """``n`` blocks held once each, empty ones first: (blocks, those that held a kept prefix)."""
        new, clear = [], []
        for _ in range(n):
            if self._empty:
                b = self._empty.pop()
            else:  # the least recently used kept block: its prefix is forgotten
                b, _ = self._idle.popitem(last=False)
                del self._block_of[self._key_of.pop(b)]
                self.counts["prefix_evictions"] += 1
                clear.append(b)
            self._refs[b] = 1
            new.append(b)
        return new, clear

    def keep(self, blocks: list[int], keys: list[bytes]) -> None:
        """A sequence's prompt is in the cache: keep its full blocks (``keys[i]`` for ``blocks[i]``)
        for later prompts with the same prefix; a prefix kept already (another sequence's) stays."""
        if not self.prefix:
            return
        for b, key in zip(blocks, keys):
            if key not in self._block_of and b not in self._key_of:
                self._block_of[key], self._key_of[b] = b, key

    def give(self, blocks: list[int]) -> list[int]:
        """A sequence's end: its hold on ``blocks`` ends. Returns those that are empty again, to
        be zeroed; kept blocks nobody holds stay filled for reuse (the last ones of a prefix
        first in line to be reused for another)."""
        empty = []
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] > 0:
                continue
            if b in self._key_of:
                self._idle[b] = None
            else:
                self._empty.append(b)
                empty.append(b)
        empty.reverse()
        return empty
