"""Continuous-batching generation engine: a loop thread over a scheduler, an executor and an
output processor.

Each step is a contract of three parts: the scheduler decides and returns a plain ``Plan``
(``scheduler``, ``plan``: no torch); the executor runs it on the model runner and samples
(``executor``); the scheduler's ``update`` turns what was sampled into outcomes, and the output
processor turns those into text, stop-string matches and stream chunks (``output``).

One background thread owns the device. Each turn of its loop:
  1. the scheduler takes new submissions and cancellations, and gives waiting requests free
     KV-cache slots;
  2. admitted prompts are prefilled, ``prefill_chunk`` tokens per turn, so a long prompt does
     not stall running sequences for more than one chunk (prompts that start at one position,
     0 or past one shared prefix, and pad to one length share one forward);
  3. one decode step for every decoding sequence is launched (a CUDA-graph replay on CUDA), and
     its tokens are sampled on the device, where they are the next step's inputs;
  4. the previous step's tokens are read back (the one wait on the device, while it runs this
     step), turned into text and streamed; sequences that hit a stop token, a stop string or
     their length end there, and their row of the step just launched is dropped.
So the device has the next step queued while the host reads one: up to a step's time of the
host's work between steps (or of the loop thread's wait for Python's lock) overlaps the device's.
A tensor-parallel model's ranks take each step's tokens before the next (they feed the host's).

A failure inside one request fails only that request; a device error (or any error inside a
batched forward) stops the loop, fails every request, and ``alive()`` turns False with the
exception in ``.error``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from deployments.engine.blocks import BlockPool
from deployments.engine.config import EngineConfig, prefill_lengths
from deployments.engine.decoder import Decoder
from deployments.engine.executor import Executor
from deployments.engine.output import OutputProcessor
from deployments.engine.plan import Outcome, Plan
from deployments.engine.request import Chunk, RequestHandle, SamplingParams, TextState
from deployments.engine.runner import ModelRunner
from deployments.engine.scheduler import NonFiniteLogits, Scheduler, SchedulerConfig, Seq

if TYPE_CHECKING:  # annotations only: torch.distributed and the tokenizer's module stay unimported here
    from deployments.engine.mirror import Channel, Mirrored
    from deployments.engine.tokenizer import Tokenizer

__all__ = ["Chunk", "Engine", "EngineConfig", "NonFiniteLogits", "RequestHandle", "SamplingParams",
           "prefill_lengths"]

log = logging.getLogger(__name__)


class Engine:
    """Continuous-batching engine over ``model`` (the native decoder or the transformers
    wrapper). See the module docstring for the loop.

    Example:
        engine = Engine(model, tokenizer, EngineConfig(max_slots=8))
        engine.start()
        ids, text, reason = engine.generate(tokenizer.encode("The answer is "), SamplingParams(temperature=0))
    """

    def __init__(self, model: Decoder, tokenizer: Tokenizer | None, config: EngineConfig, *,
                 channel: Channel | None = None):
        # channel: a tensor-parallel model's rank 0 sends its runner's calls to the other ranks
        # over it (``deployments.engine.mirror``); they run them in ``follow``
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config.resolved(model.max_position_embeddings)
        self.device = model.device
        self.vocab_size = model.vocab_size  # the logits' width (a tensor-parallel rank's config holds its slice)
        self._eos = set(tokenizer.eos_token_ids if tokenizer is not None else [])
        self.runner: ModelRunner | Mirrored = ModelRunner(model, cfg)
        if channel is not None:
            from deployments.engine.mirror import Mirrored
            self.runner = Mirrored(self.runner, channel)
        cache = self.runner.cache
        self.blocks = (BlockPool(cache.num_blocks, cache.block_size, cfg.prefix_cache)
                       if cache.paged else None)
        r = self.runner
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_slots, cfg.max_seq_len, cfg.prefill_chunk,
                                                   tuple(r.prefill_lengths), r.batched_prefill, r.group_read),
                                   self.blocks)
        self.executor = Executor(r, cfg)
        self.output = OutputProcessor()
        self.capture_lock = self.runner.capture_lock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()  # set by the loop once its first prefills have run
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self._capture_when_idle = False  # capture_deferred() called
        # a decode step whose tokens are sampled and not read back yet: (its plan, read them)
        self._inflight: tuple[Plan, Any] | None = None
        # the next step launched before this one's tokens are read: not where other ranks mirror
        # the runner's calls (their inputs are the tokens rank 0 sends)
        self._ahead = channel is None
        self.error: BaseException | None = None
        # busy_s: the loop's time in turns that had requests (its idle waits left out), of it
        # prefill_s in admissions and prefills, decode_s in decode steps (each with the read of the
        # step before: where the host keeps up, the device's time per step)
        self._stats = {"busy_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0}

    # ---------------------------------------------------------------- public
    def start(self) -> None:
        """Capture the decode step's CUDA graphs (where they are used), start the loop thread and
        wait until it has run every prefill shape once (``ModelRunner.first_prefills``)."""
        if self._thread is not None:
            return
        self.runner.capture()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise RuntimeError(f"engine loop failed at start: {self.error!r}") from self.error

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request (thread-safe). Raises ValueError for a bad prompt or params,
        RuntimeError before ``start`` and once the loop has stopped or died."""
        return self.submit_many([(prompt_ids, params)])[0]

    def submit_many(self, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestHandle]:
        """Queue several requests at once: every one is checked first (nothing is queued if one is
        bad), then all reach the loop at the same step boundary, so that they are admitted
        together (prompts of one start and one padded length then share a prefill)."""
        made = [self._request(ids, params) for ids, params in requests]
        for handle, text, _ in made:
            self.output.add(handle, text)
        self.scheduler.add(*(seq for _, _, seq in made))
        self._wake.set()
        return [handle for handle, _, _ in made]

    def _request(self, prompt_ids: list[int], params: SamplingParams) -> tuple[RequestHandle, TextState, Seq]:
        if self.error is not None:
            raise RuntimeError(f"engine loop is dead: {self.error!r}")
        if self._stop.is_set():  # nothing would ever serve it: refuse instead of hanging
            raise RuntimeError("engine is shut down")
        if self._thread is None:
            raise RuntimeError("engine is not started: call Engine.start() before submitting requests")
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        prompt = [int(t) for t in prompt_ids]
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        total = len(prompt) + params.max_new_tokens
        if total > self.config.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                             f"exceeds max_seq_len={self.config.max_seq_len}")
        if self.blocks is not None:
            self.blocks.check(len(prompt), params.max_new_tokens)
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs text, but this engine was built without a tokenizer")
        handle = RequestHandle(next(self._ids), len(prompt), self._wake)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos)
        text = TextState(self.tokenizer.incremental_decoder(prompt) if self.tokenizer else None, params.stop)
        return handle, text, Seq(handle.id, prompt, params, stops)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
        """Blocking convenience: (token_ids, text, finish_reason)."""
        return self.submit(prompt_ids, params).result()

    def capture_deferred(self) -> None:
        """Let the loop thread capture the graphs ``start`` deferred (``lazy_graphs``) whenever it
        is idle, one batch size at a time, smallest first (a step that needs one first captures
        it anyway). A replica calls this once warm, from its health check, so that neither its
        warm-up's requests nor that check wait behind a capture."""
        if self._capture_when_idle:
            return
        self._capture_when_idle = True
        self._wake.set()

    def prefill_lengths(self) -> tuple[int, ...]:
        """The prompt-chunk lengths prefill runs at (empty: any length, no padding)."""
        return self.runner.prefill_lengths

    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict:
        s, r = self.scheduler, self.runner
        late = dict(r.stats["late_captures"])  # (a copy: the loop thread adds to it)
        b = self.blocks
        kv = {} if b is None else {"kv_blocks": b.capacity, "kv_blocks_free": b.free, "kv_blocks_cached": b.cached,
                                   "kv_block_size": b.block_size, **b.counts}
        return {"running": len(s.prefilling) + len(s.decoding), "waiting": s.waiting_count(),
                "free_slots": len(s.free), **kv, "graphs": r.graphs(), "graphs_deferred": len(r.deferred),
                **s.counts, **self.executor.stats, **self._stats, **r.stats, "late_captures": late,
                "late_capture_s": sum(ms for ms, _ in late.values()) / 1e3}

    def shutdown(self) -> None:
        """Stop the loop; unfinished requests end with finish_reason "cancelled"."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._deliver(self.scheduler.fail_all("cancelled", self.error))

    def __enter__(self) -> "Engine":
        self.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- the loop
    def _run(self) -> None:
        s = self.scheduler
        try:
            if self.device.type == "cuda":
                # a new thread starts on device 0; Triton launches on the current device
                torch.cuda.set_device(self.device)
            with torch.inference_mode():
                self.runner.first_prefills()
                self._ready.set()
                while not self._stop.is_set():
                    self._settle(s.intake(self.output.cancelled()))
                    if s.idle():
                        self._read_inflight()  # (a step of sequences cancelled since)
                        if self._capture_when_idle and self.runner.deferred:  # one size, then look again
                            self.runner.capture_late(self.runner.deferred[0], "idle")
                            continue
                        self._wake.wait(0.1)
                        self._wake.clear()
                        continue
                    t0 = time.perf_counter()
                    self._prefill()
                    t1 = time.perf_counter()
                    self._decode()
                    t2 = time.perf_counter()
                    st = self._stats
                    st["prefill_s"] += t1 - t0
                    st["decode_s"] += t2 - t1
                    st["busy_s"] += t2 - t0
        except BaseException as e:  # noqa: BLE001 - the loop must record why it died
            log.exception("engine loop died")
            self.error = e
            self._ready.set()
            self._deliver(s.fail_all("error", e))

    def _prefill(self) -> None:
        """Admissions and this turn's prompt chunks; the first tokens of the prompts they end."""
        plan = self.scheduler.schedule_prefill()
        self.output.admitted(plan.admitted)
        sampled = self.executor.run_prefill(plan)
        self._settle(self.scheduler.update(plan, sampled))

    def _decode(self) -> None:
        """Launch the next decode step, then take the step before's tokens while it runs."""
        s = self.scheduler
        if s.short_of_blocks():  # sequences that end with the tokens on the device free blocks
            self._read_inflight()
        plan = s.schedule_decode()
        step = self.executor.run_decode(plan)
        if step is None:
            self._read_inflight()
            return
        if not step.fed:  # its rows were sampled one by one: after the step before's tokens
            self._read_inflight()
            self._settle(s.update(plan, step.read()))
            return
        last, self._inflight = self._inflight, (plan, step.read)
        if last is not None:
            self._settle(s.update(last[0], last[1]()))  # while the device runs the step just launched
        if not self._ahead:
            self._read_inflight()

    def _read_inflight(self) -> None:
        """Read back the launched step's tokens, if any (waits for it), and stream them."""
        if self._inflight is not None:
            (plan, read), self._inflight = self._inflight, None
            self._settle(self.scheduler.update(plan, read()))

    def _settle(self, outcomes: list[Outcome]) -> None:
        """Outcomes to text; requests their text ended (a stop string) end in the scheduler; the
        ended requests' cache is zeroed (``Scheduler._retire``), then their callers hear of it."""
        if not outcomes:
            return
        for seq_id, reason, error in self.output.process(outcomes):
            self.scheduler.finish(seq_id, reason, error)
        self.executor.run_cache_ops(self.scheduler.schedule_frees())
        self.output.deliver()

    def _deliver(self, outcomes: list[Outcome]) -> None:
        """Outcomes of a loop that stopped: to the callers, with nothing more run on the device."""
        self.output.process(outcomes)
        self.output.deliver()
