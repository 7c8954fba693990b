"""The executor: runs a scheduler's ``Plan`` on the model runner and samples.

It makes a plan's cache changes, then its prefills (each prompt's first token sampled at once,
waiting for the device) or its decode step: launched, its tokens sampled on the device and fed
to the next step there, and copied back to the host without waiting (``Launched.read`` waits).
It keeps each request's sampling generator, from its first token to its end.

A failure of one request (its prefill, its sampler, its row of a batch's sampling) is reported
in ``Sampled.failed`` and the others go on; a device error is raised for the loop to stop on,
as is any error of a decode step's forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from deployments.engine.config import EngineConfig
from deployments.engine.plan import Plan, PrefillGroup, Sampled
from deployments.engine.request import SamplingParams
from deployments.engine.runner import bucket, is_device_error
from deployments.engine.sampling import sample, sample_on_device, tokens

if TYPE_CHECKING:
    from deployments.engine.mirror import Mirrored
    from deployments.engine.runner import ModelRunner

log = logging.getLogger(__name__)


def _generator(p: SamplingParams, device: torch.device) -> torch.Generator | None:
    if p.greedy:
        return None
    g = torch.Generator(device=device)
    if p.seed is None:
        g.seed()
    else:
        g.manual_seed(p.seed)
    return g


@dataclass
class Launched:
    """A decode step on its way: ``read`` waits for its tokens. ``fed``: its tokens are the next
    step's inputs on the device already (False: its batch's sampling failed, and ``read``
    samples its rows one by one)."""

    read: Callable[[], Sampled]
    fed: bool


class Executor:
    """Runs plans on ``runner`` (a ``ModelRunner``, or a tensor-parallel rank 0's ``Mirrored``)."""

    def __init__(self, runner: ModelRunner | Mirrored, config: EngineConfig):
        self.runner, self.config = runner, config
        self.device = runner.device
        self._gens: dict[int, torch.Generator | None] = {}  # request -> its sampler (None: greedy)
        self.stats = {"steps": 0, "batched_prefills": 0}

    def run_cache_ops(self, plan: Plan) -> None:
        """The plan's cache changes, in order; ended requests' samplers are dropped."""
        for name, *args in plan.cache_ops:
            getattr(self.runner, name)(*args)
        for i in plan.ended:
            self._gens.pop(i, None)

    def run_prefill(self, plan: Plan) -> Sampled:
        """The plan's cache changes and prefills; the first token of each prompt they end."""
        self.run_cache_ops(plan)
        out = Sampled()
        for i, item in enumerate(plan.prefills):
            if isinstance(item, PrefillGroup):
                try:
                    logits = self.runner.prefill_group(item.prompts, item.slots, item.length, item.start)
                except Exception as e:
                    if is_device_error(e):
                        raise
                    log.exception("requests %s failed in prefill", item.seq_ids)
                    out.failed.update({sid: (i, e) for sid in item.seq_ids})
                    continue
                self.stats["batched_prefills"] += 1
                self._first_tokens(item.seq_ids, item.params, logits, out, len(plan.prefills))
                continue
            if item.seq_id in out.failed:  # an earlier chunk of its prompt failed
                continue
            try:
                logits, _ = self.runner.prefill(item.tokens, item.slot, item.start)
            except Exception as e:
                if is_device_error(e):
                    raise
                log.exception("request %d failed in prefill", item.seq_id)
                out.failed[item.seq_id] = (i, e)
                continue
            if item.last:
                self._first_tokens([item.seq_id], [item.params], logits.unsqueeze(0), out, len(plan.prefills))
        return out

    def _first_tokens(self, ids: list[int], params: list[SamplingParams], logits: torch.Tensor, out: Sampled,
                      after: int) -> None:
        """Sample the first tokens of prompts just prefilled (logits [R, V], row j for ids[j]),
        making each new request's sampler first (a preempted one's goes on)."""
        rows = []
        for j, (sid, p) in enumerate(zip(ids, params)):
            if sid not in self._gens:
                try:
                    self._gens[sid] = _generator(p, self.device)
                except Exception as e:  # one request's setting must not stop the loop
                    if is_device_error(e):
                        raise
                    log.exception("request %d failed: its sampling generator", sid)
                    out.failed[sid] = (after, e)
                    continue
            rows.append(j)
        if len(rows) < len(ids):
            ids, params, logits = [ids[j] for j in rows], [params[j] for j in rows], logits[rows]
        if ids:
            self._sample(ids, params, logits, out, after)

    def _sample(self, ids: list[int], params: list[SamplingParams], logits: torch.Tensor, out: Sampled,
                after: int) -> None:
        """Sample rows [R, V] on the host (waits for the device); where the batch fails, row by
        row, failing only the rows at fault."""
        args = _params(params)
        gens = [self._gens.get(i) for i in ids]
        out.dtype = str(logits.dtype)
        try:
            out.tokens.update(zip(ids, sample(logits, *args, gens)))
            return
        except Exception as e:
            if is_device_error(e):
                raise
        for j, sid in enumerate(ids):
            try:
                out.tokens[sid] = sample(logits[j: j + 1], *[[a[j]] for a in args], [gens[j]])[0]
            except Exception as e:
                if is_device_error(e):
                    raise
                log.exception("request %d failed in sampling", sid)
                out.failed[sid] = (after, e)

    def run_decode(self, plan: Plan) -> Launched | None:
        """The plan's cache changes and its decode step, launched (None: the plan has no rows)."""
        self.run_cache_ops(plan)
        rows = plan.decode
        if not rows:
            return None
        r = self.runner
        B = bucket(max(row.slot for row in rows) + 1, self.config.graph_batch_sizes)
        L = bucket(max(row.pos for row in rows) + 1, r.kv_lens)
        logits = r.decode(B, L, [(row.slot, row.token, row.pos) for row in rows])
        self.stats["steps"] += 1
        slots = [row.slot for row in rows]
        index = None
        if slots == list(range(len(slots))):  # slots 0..R-1, padding rows after them
            logits = logits[: len(slots)]
        else:  # padding rows among them: pick the live ones
            index = torch.tensor(slots, device=self.device)
            logits = logits.index_select(0, index)
        ids, params = [row.seq_id for row in rows], [row.params for row in rows]
        try:
            toks = sample_on_device(logits, *_params(params), [self._gens.get(i) for i in ids])
        except Exception as e:
            if is_device_error(e):
                raise
            log.warning("sampling a decode step failed (%s): its rows one by one", e)
            return Launched(lambda: self._sampled(ids, params, logits), fed=False)
        r.feed(toks, index)
        read, dtype = r.to_host(toks), str(logits.dtype)
        return Launched(lambda: Sampled(dict(zip(ids, tokens(read()))), dtype=dtype), fed=True)

    def _sampled(self, ids: list[int], params: list[SamplingParams], logits: torch.Tensor) -> Sampled:
        out = Sampled()
        self._sample(ids, params, logits, out, 0)
        return out


def _params(params: list[SamplingParams]) -> tuple[list, list, list]:
    return [p.temperature for p in params], [p.top_p for p in params], [p.top_k for p in params]
