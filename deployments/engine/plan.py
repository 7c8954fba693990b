"""The records the engine's step passes between its parts: plain data, no torch.

The scheduler decides a step and returns a ``Plan`` (as vLLM's ``SchedulerOutput``): the cache
changes to make first, then the prompt chunks to prefill or the rows of one decode step. The
executor runs it on the model runner and samples; what it sampled comes back as ``Sampled``, and
the scheduler's ``update`` turns that into one ``Outcome`` per request, which the output
processor makes into text and stream chunks.

The records made per sequence per step are slotted, not frozen: a frozen dataclass's
construction costs about five times as much, on the loop thread, for every row of every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from deployments.engine.request import SamplingParams

# A change to the KV cache, named as the model runner's method that makes it, in plan order:
#   ("zero_slot", slot, upto): a static cache's slot back to zero up to position ``upto``
#   ("release", slot, blocks): a paged slot leaves the block table; ``blocks`` (empty again) zeroed
#   ("assign", slot, blocks, clear): a paged slot reads and writes ``blocks``; ``clear`` zeroed first
CacheOp = tuple


@dataclass(slots=True)
class PrefillChunk:
    """``tokens`` of one prompt, written into ``slot`` from position ``start``; ``last``: the
    chunk ends the prompt, so its last logits give the request's next token."""

    seq_id: int
    slot: int
    tokens: list[int]
    start: int
    params: SamplingParams
    last: bool


@dataclass(frozen=True)
class PrefillGroup:
    """The rests of several prompts from one position ``start``, each padded to ``length``, in one
    forward; every one ends its prompt."""

    seq_ids: list[int]
    slots: list[int]
    prompts: list[list[int]]
    length: int
    start: int
    params: list[SamplingParams]


Prefill = Union[PrefillChunk, PrefillGroup]


@dataclass(slots=True)
class DecodeRow:
    """One sequence's row of a decode step: it feeds ``token`` at ``pos`` of ``slot`` (None: the
    token the step before sampled, still on the device)."""

    seq_id: int
    slot: int
    token: int | None
    pos: int
    params: SamplingParams


@dataclass
class Plan:
    """One step's decisions, in the order they run: ``cache_ops``, then ``prefills`` or
    ``decode``. ``ended``: requests that ended since the last plan (the executor forgets their
    samplers); ``admitted``: requests that got a cache slot in this plan."""

    cache_ops: list[CacheOp] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    prefills: list[Prefill] = field(default_factory=list)
    decode: list[DecodeRow] = field(default_factory=list)


@dataclass
class Sampled:
    """What running a plan gave: each request's sampled token (None: its logits were not finite),
    and the requests that failed, with the index in ``Plan.prefills`` of the item they failed at
    (``len(prefills)``: after every one ran, in making their sampler or sampling) and the error.
    ``dtype``: the logits' dtype, for the message of a non-finite one."""

    tokens: dict[int, int | None] = field(default_factory=dict)
    failed: dict[int, tuple[int, BaseException]] = field(default_factory=dict)
    dtype: str = ""


@dataclass(slots=True)
class Outcome:
    """A request's result of one step, for the output processor: ``token`` (None: it ended without
    one) and ``reason``: None (it goes on), "stop", "length", "cancelled" or "error" (``error``)."""

    seq_id: int
    token: int | None
    reason: str | None
    error: BaseException | None = None
