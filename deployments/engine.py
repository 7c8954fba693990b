"""Continuous-batching generation engine over a static KV cache.

One background thread owns the device. Each turn of its loop:
  1. takes new submissions and cancellations (at a step boundary);
  2. admits waiting requests into free cache slots (lowest slot first, so the
     live slots stay packed at the front and the decode batch stays small);
  3. prefills admitted prompts, `prefill_chunk` tokens per turn, so a long
     prompt does not stall running sequences for more than one chunk; fresh
     prompts that pad to one length share one forward (`_fresh_group`);
  4. launches one decode step for every decoding sequence: cache slots 0..B-1
     in one batch, B rounded up to a graph bucket, keys read up to a kv-length
     bucket (or, through the Triton attention, up to each row's own position, one
     graph per batch size); on CUDA this is a CUDA-graph replay, on CPU the same
     code eagerly (``start`` captures batch 1's graphs; another batch size's are
     captured by the first step that needs them, or by the idle loop once
     ``capture_deferred`` was called: ``EngineConfig.lazy_graphs``);
  5. while the device runs it, detokenizes the previous step's tokens, checks
     stop strings and streams chunks (a sequence that a stop string ends there
     has its token of the running step dropped);
  6. samples the step (the one wait on the device), retires sequences that hit
     a stop token or their length at once, and keeps the tokens' text for 5.

A failure inside one request's sampling / detokenizing fails only that request;
a device error (or any error inside the batched forward) stops the loop,
fails every request, and `alive()` turns False with the exception in `.error`.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from deployments.request import Chunk, RequestHandle, SamplingParams, TextState
from deployments.sampling import sample

__all__ = ["Chunk", "Engine", "EngineConfig", "RequestHandle", "SamplingParams"]

log = logging.getLogger(__name__)
GiB = 1 << 30


@dataclass
class EngineConfig:
    """Engine options; `validate()` (run by Engine) raises ValueError naming the field."""

    max_slots: int = 8
    """Concurrent sequences (KV-cache slots)."""
    max_seq_len: int | None = None
    """Prompt + generated tokens per sequence; None -> min(model max_position_embeddings, 4096)."""
    prefill_chunk: int = 512
    """Prompt tokens prefilled per loop turn (and per forward)."""
    cuda_graphs: bool = True
    """Capture the decode step as CUDA graphs (ignored on CPU and for the transformers fallback)."""
    lazy_graphs: bool = True
    """Capture only the smallest batch size's graphs in ``start``; the loop thread captures each
    other batch size when a decode step first needs it, or when it is idle once
    ``capture_deferred`` was called (the replica calls it at its first health check once warm).
    Each batch size's first launch loads kernels of its own (58-111 ms on an H200 for 2-16 rows
    of the 7B), so this takes some 0.3 s off a replica's start; a batch size's first step pays
    its capture (~0.1 s) only where the replica was never idle before it. False: every graph in
    ``start``."""
    graph_batch_sizes: tuple[int, ...] | None = None
    """Decode batch buckets; None -> 1, 2, 4, ... < max_slots, and max_slots."""
    kv_len_buckets: tuple[int, ...] | None = None
    """Decode key-length buckets; None -> 512, 2048, max_seq_len (each graph reads keys up to its bucket;
    a model whose steps read each row's keys only up to its position gets the longest alone)."""
    reserve_bytes: int = 1 * GiB
    """Device memory kept free beside the KV cache for activations, graphs and cuBLAS workspaces."""
    prefill_padding: bool = True
    """Pad each prompt chunk to one of a few lengths (``prefill_lengths``) so that ``start``
    can run every prefill shape once, in the loop thread: a first prompt of a length that
    thread had not run took 40-50 ms longer to its first token on an H200. Native models only."""
    prefill_min_len: int = 128
    """The shortest length a prompt chunk is padded to (``prefill_lengths``). A batch-1 prefill
    of up to some 200 tokens reads every weight once and computes less than that read takes,
    so padding a short prompt up to 128 tokens costs its first token nothing measurable (an H200,
    7B: 13.2-13.7 ms for 16 to 512 tokens, bench/results/runs/first-prefill-anatomy-flash.json),
    while each length more costs the replica's start one first prefill (~45 ms)."""

    def validate(self) -> None:
        for name in ("max_slots", "prefill_chunk", "prefill_min_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {v!r}")
        if self.max_seq_len is not None and (
            not isinstance(self.max_seq_len, int) or isinstance(self.max_seq_len, bool) or self.max_seq_len < 2
        ):
            raise ValueError(f"EngineConfig.max_seq_len must be an int >= 2 or None, got {self.max_seq_len!r}")
        for name in ("cuda_graphs", "lazy_graphs", "prefill_padding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.reserve_bytes, int) or self.reserve_bytes < 0:
            raise ValueError(f"EngineConfig.reserve_bytes must be an int >= 0, got {self.reserve_bytes!r}")
        for name in ("graph_batch_sizes", "kv_len_buckets"):
            v = getattr(self, name)
            if v is None:
                continue
            if not v or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in v):
                raise ValueError(f"EngineConfig.{name} must be a non-empty list of positive ints, got {v!r}")
        if self.graph_batch_sizes is not None and max(self.graph_batch_sizes) > self.max_slots:
            raise ValueError(
                f"EngineConfig.graph_batch_sizes {list(self.graph_batch_sizes)} has sizes above max_slots={self.max_slots}"
            )

    def resolved(self, model_max_len: int) -> "EngineConfig":
        """A copy with defaults filled in against the model; raises ValueError naming the field."""
        self.validate()
        msl = self.max_seq_len or min(model_max_len, 4096)
        if msl > model_max_len:
            raise ValueError(
                f"EngineConfig.max_seq_len={msl} exceeds the model's max_position_embeddings={model_max_len}"
            )
        bs = sorted(set(self.graph_batch_sizes or [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < self.max_slots]))
        bs = sorted(set(bs) | {self.max_slots})  # the largest batch must always have a graph
        kv = sorted({min(b, msl) for b in (self.kv_len_buckets or (512, 2048))} | {msl})
        return dataclasses.replace(self, max_seq_len=msl, prefill_chunk=min(self.prefill_chunk, msl),
                                   graph_batch_sizes=tuple(bs), kv_len_buckets=tuple(kv))


def prefill_lengths(chunk: int, min_len: int = 16) -> tuple[int, ...]:
    """The lengths a prompt chunk of at most ``chunk`` tokens is padded to: powers of two
    from ``min_len`` (rounded up to one), and ``chunk`` itself. Each costs ``Engine.start`` a
    first run (~45 ms of one-off set-up per shape on an H200), so there are few; padding a
    prompt's last chunk at most doubles it, or brings it up to ``min_len``
    (``EngineConfig.prefill_min_len``: free below the length where a prefill starts to compute
    more than it reads)."""
    first = 1 << max(0, min_len - 1).bit_length()
    out = {b for b in (first << k for k in range(31)) if b < chunk} | {chunk}
    return tuple(sorted(out))


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise AssertionError(f"{n} above the largest bucket {buckets[-1]}")


def _is_device_error(e: BaseException) -> bool:
    # torch raises CUDA failures as RuntimeError (torch.AcceleratorError in newer releases)
    return type(e).__name__ == "AcceleratorError" or "CUDA" in str(e) or "cuda" in type(e).__module__


class NonFiniteLogits(RuntimeError):
    """A request's logits held NaN or inf: the request fails, with this message, instead of
    streaming the arbitrary tokens an argmax over them picks."""


class _Seq:
    """Engine-side state of one request (touched only by the loop thread)."""

    __slots__ = ("handle", "prompt", "params", "slot", "prefilled", "pos", "written", "last", "n_gen", "text", "gen",
                 "stops")

    def __init__(self, handle: RequestHandle, prompt: list[int], params: SamplingParams, text: TextState, stops: set):
        self.handle, self.prompt, self.params, self.text, self.stops = handle, prompt, params, text, stops
        self.slot = -1
        self.prefilled = 0  # prompt tokens in the cache
        self.pos = 0  # next cache position to write (tokens in the cache)
        self.written = 0  # cache positions [0, written) of its slot its prefills wrote (padding included)
        self.last = -1  # last sampled token, fed at `pos` by the next decode step
        self.n_gen = 0
        self.gen: torch.Generator | None = None


class Engine:
    """Continuous-batching engine. See the module docstring for the loop."""

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig):
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config.resolved(model.max_position_embeddings)
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        self._eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
        need = model.cache_bytes(cfg.max_slots, cfg.max_seq_len)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            _check_fits(need, cfg, free, total, str(self.device))
        log.info("KV cache: %.2f GiB for %d slots x %d tokens", need / GiB, cfg.max_slots, cfg.max_seq_len)
        model.setup_rope(cfg.max_seq_len)
        self.cache = model.new_cache(cfg.max_slots, cfg.max_seq_len)
        maxb = cfg.max_slots
        # decode inputs: rows = token, position, valid; one host->device copy per step
        self._inp = torch.zeros(3, maxb, dtype=torch.int64, device=self.device)
        self._stage = torch.zeros(3, maxb, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None  # the graphs' shared memory pool (made by the first capture)
        self._deferred: list[int] = []  # batch sizes whose graphs are not captured yet (lazy_graphs)
        self._eager_sizes: set[int] = set()  # batch sizes whose late capture ran out of memory
        self._capture_when_idle = False  # capture_deferred() called
        # held by the loop thread while it captures: a device-wide synchronize from another
        # thread (the replica's health check) waits instead of landing inside a capture
        self.capture_lock = threading.Lock()
        # the decode steps' key-length bounds (a graph each per batch size): all of kv_len_buckets
        # where a step reads keys up to the bound, the longest alone where it reads each row's own
        kv_lens = getattr(model, "decode_kv_lens", None)
        self._kv_lens = kv_lens(cfg.kv_len_buckets) if kv_lens else cfg.kv_len_buckets
        self._use_graphs = cfg.cuda_graphs and self.device.type == "cuda" and model.supports_cuda_graphs
        self._prefill_lengths = (prefill_lengths(cfg.prefill_chunk, cfg.prefill_min_len)
                                 if cfg.prefill_padding and getattr(model, "supports_prefill_padding", False) else ())
        # fresh prompts of one padded length share a forward (_fresh_group); its head always
        # multiplies the most rows a group can have, one shape for every group
        self._batched_prefill = bool(self._prefill_lengths) and getattr(model, "supports_batched_prefill", False)
        self._logit_rows = max(1, cfg.prefill_chunk // 16)
        self._free = list(range(cfg.max_slots))  # min-heap: lowest slot first keeps the batch packed
        self._inbox: deque[_Seq] = deque()
        self._waiting: deque[_Seq] = deque()
        self._prefilling: list[_Seq] = []
        self._decoding: list[_Seq] = []
        self._pending: list[tuple[_Seq, int, str | None]] = []  # sampled, text not emitted yet
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()  # set by the loop once its first prefills have run
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self.error: BaseException | None = None
        self._stats = {"tokens_generated": 0, "prompt_tokens": 0, "steps": 0, "finished": 0, "capture_s": 0.0,
                       "first_launch_s": 0.0, "first_prefill_s": 0.0, "batched_prefills": 0,
                       "late_captures": {}}

    # ---------------------------------------------------------------- public
    def start(self) -> None:
        """Capture CUDA graphs (if enabled), start the loop thread and wait until it has run
        every prefill shape once (``_first_prefills``)."""
        if self._thread is not None:
            return
        if self._use_graphs:
            self._capture()
        # Everything made so far (modules, the model, the graphs) lives as long as the process:
        # move it out of the garbage collector's generations, so that a collection the first
        # requests trigger does not walk the whole start-up heap (~0.1 s with Ray and torch)
        gc.freeze()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        self._ready.wait()  # the loop's first prefills
        if self.error is not None:
            raise RuntimeError(f"engine loop failed at start: {self.error!r}") from self.error

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request (thread-safe). Raises ValueError for a bad prompt or params,
        RuntimeError once the loop has died."""
        if self.error is not None:
            raise RuntimeError(f"engine loop is dead: {self.error!r}")
        if self._stop.is_set():  # nothing would ever serve it: refuse instead of hanging
            raise RuntimeError("engine is shut down")
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        prompt = [int(t) for t in prompt_ids]
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        total = len(prompt) + params.max_new_tokens
        if total > self.config.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds max_seq_len={self.config.max_seq_len}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs text, but this engine was built without a tokenizer")
        handle = RequestHandle(next(self._ids), len(prompt), self._wake)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos)
        text = TextState(self.tokenizer.incremental_decoder(prompt) if self.tokenizer else None, params.stop)
        with self._lock:
            self._inbox.append(_Seq(handle, prompt, params, text, stops))
        self._wake.set()
        return handle

    def capture_deferred(self) -> None:
        """Let the loop thread capture the graphs ``start`` deferred (``lazy_graphs``) whenever it
        is idle, one batch size at a time, smallest first (a step that needs one first captures
        it anyway). The replica calls this at every health check once warm (the first one
        counts), so that neither the warm-up's own requests nor that check wait behind a
        capture."""
        if self._capture_when_idle:
            return
        self._capture_when_idle = True
        self._wake.set()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
        """Blocking convenience: (token_ids, text, finish_reason)."""
        return self.submit(prompt_ids, params).result()

    def prefill_lengths(self) -> tuple[int, ...]:
        """The prompt-chunk lengths prefill runs at (empty: any length, no padding);
        ``start`` runs each once."""
        return self._prefill_lengths

    def _padded_len(self, n: int, start: int) -> int:
        for b in self._prefill_lengths:
            if b >= n:
                return b if start + b <= self.config.max_seq_len else n  # no room: this once, as is
        return n

    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict:
        with self._lock:
            waiting = len(self._inbox) + len(self._waiting)
        late = dict(self._stats["late_captures"])  # (a copy: the loop thread adds to it)
        return {
            "running": len(self._prefilling) + len(self._decoding),
            "waiting": waiting,
            "free_slots": len(self._free),
            "graphs": len(self._graphs),
            "graphs_deferred": len(self._deferred),
            **self._stats,
            "late_captures": late,
            "late_capture_s": sum(ms for ms, _ in late.values()) / 1e3,
        }

    def shutdown(self) -> None:
        """Stop the loop; unfinished requests end with finish_reason "cancelled"."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._fail_all("cancelled")

    def _first_prefills(self) -> None:
        """One prefill at each padded chunk length, into slot 0 (rewritten by its first real
        use), run by the loop thread itself before it serves: the kernels and GEMM algorithms
        a prompt of that length needs are loaded and chosen now, not in a user's first request.
        In this thread, because that first-time cost is paid per thread (torch's cuBLAS handles
        are): run on another thread, a 64-token prompt still took 59 ms to its first token
        instead of 13 (bench/results/runs/first-prefill-per-thread.json). Only the shapes
        matter, so this may run while the weights are still loading.

        What start ran wrote keys and values computed from such weights: these prefills into
        slots 0 and 1, the graphs' first launches a padding row into every slot. A masked key
        still multiplies its value (0 * NaN = NaN), so one non-finite value left there would
        poison every later request in its slot (in a GPU test, a cold replica, whose weights'
        bytes arrive only after its build, over a buffer that held freed memory, decoded token 0
        after its first). So the whole cache is zeroed after them: one memset of its block,
        queued on the device (32 GiB at the HBM's write rate is some 10 ms; not timed on its
        own)."""
        t0 = time.perf_counter()
        each: dict[int | str, float] = {}

        def timed(key: int | str, run: Any) -> None:
            t = time.perf_counter()
            run()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            each[key] = round((time.perf_counter() - t) * 1e3, 2)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=self.device)
        for n in self._prefill_lengths:
            timed(n, lambda: self.model.prefill(zeros(1, n), self.cache, 0, 0))
        L0 = self._prefill_lengths[0] if self._prefill_lengths else 0
        if self._batched_prefill and self.config.max_slots >= 2 and L0 and not L0 & (L0 - 1) \
                and 2 * L0 <= self.config.prefill_chunk:
            # and two prompts in one forward (_prefill_group): its cache writes by slot, its row
            # gather and its head's one shape
            timed(f"2x{L0}", lambda: self.model.prefill_batch(zeros(2, L0), self.cache, [0, 1], [L0, L0],
                                                             logit_rows=self._logit_rows))
        if self._prefill_lengths or self._graphs:
            self.cache.zero_()
        self._stats["first_prefill_s"] = time.perf_counter() - t0
        self._stats["first_prefill_ms"] = each  # per length: what the first one pays for the thread

    # ---------------------------------------------------------------- graphs
    def _decode_eager(self, B: int, L: int) -> torch.Tensor:
        inp = self._inp[:, :B]
        return self.model.decode(inp[0], inp[1], inp[2], self.cache, L)  # valid: 1 live row, 0 padding

    @torch.inference_mode()
    def _capture(self) -> None:
        """``start``'s graphs: one per (batch bucket, kv-length bucket), largest first, sharing one
        memory pool; with ``lazy_graphs`` the smallest batch size's alone (the rest are deferred)."""
        t0 = time.perf_counter()
        cfg = self.config
        sizes = cfg.graph_batch_sizes[:1] if cfg.lazy_graphs else cfg.graph_batch_sizes
        self._deferred = [b for b in cfg.graph_batch_sizes if b not in sizes]
        self._pool = torch.cuda.graph_pool_handle()
        from deployments import head_start
        head_start.wait()  # Triton's per-process set-up (the kernels' self-tests may not have launched any)
        each = self._first_launches(sizes)
        self._stats["first_launch_s"] = time.perf_counter() - t0
        self._stats["first_launch_ms"] = each  # per batch size: the kernels it is the first to load
        from deployments import prime
        t = time.perf_counter()
        self._stats["prime_s"] = prime.wait()  # nothing launches beside the capture (None: not primed)
        self._stats["prime_wait_s"] = round(time.perf_counter() - t, 4)
        self._stats["prime_steps_s"] = prime.steps()
        self._stats["graphs_uploaded"] = self._upload_graphs(self._capture_graphs(sizes))
        torch.cuda.synchronize(self.device)
        self._stats["capture_s"] = time.perf_counter() - t0
        log.info("captured %d decode graphs in %.2f s (%.2f s of it the first eager launches)%s",
                 len(self._graphs), self._stats["capture_s"], self._stats["first_launch_s"],
                 f"; batch sizes {self._deferred} deferred" if self._deferred else "")

    def _first_launches(self, sizes: tuple[int, ...] | list[int]) -> dict[int, float]:
        """One eager decode step per batch size, every row padding, on a side stream (warm-up:
        cuBLAS handles, lazily loaded kernels, must precede a capture); ms each: the kernels that
        size is the first to load."""
        self._stage_inputs(max(sizes), [])
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        each: dict[int, float] = {}
        with torch.cuda.stream(side):
            for B in sizes:
                t = time.perf_counter()
                self._decode_eager(B, self.config.kv_len_buckets[-1])
                side.synchronize()
                each[B] = round((time.perf_counter() - t) * 1e3, 2)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        return each

    def _capture_graphs(self, sizes: tuple[int, ...] | list[int]) -> list[Any]:
        """Capture each batch size's graphs (one per key-length bound) into the shared pool; the
        new graphs. The inputs' rows must hold padding (``_first_launches`` staged it)."""
        new = []
        for B in sorted(sizes, reverse=True):
            for L in reversed(self._kv_lens):
                g = torch.cuda.CUDAGraph()
                # thread_local: the loader's threads may still be copying weights meanwhile (their
                # CUDA calls must not invalidate this capture, nor be refused because of it)
                with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                    out = self._decode_eager(B, L)
                self._graphs[(B, L)] = (g, out)
                new.append(g)
        return new

    def _capture_late(self, B: int, why: str) -> None:
        """In the loop thread, between steps: capture deferred batch size ``B`` (first launch,
        capture, upload), recorded in stats ``late_captures`` as {B: [ms, why]}. Out of device
        memory, ``B`` stays eager (logged) instead of failing the loop."""
        t = time.perf_counter()
        with self.capture_lock:
            try:
                self._first_launches([B])
                self._upload_graphs(self._capture_graphs([B]))
                torch.cuda.synchronize(self.device)
            except torch.OutOfMemoryError as e:
                for L in self._kv_lens:
                    self._graphs.pop((B, L), None)
                self._eager_sizes.add(B)
                log.warning("no CUDA graph for batch size %d (%s): its steps run eagerly", B, e)
            finally:
                # only now: stats' graphs_deferred counts the sizes whose capture has not ended
                # (one read while this capture ran found 0 deferred and 4 of 6 graphs)
                self._stats["late_captures"][B] = [round((time.perf_counter() - t) * 1e3, 2), why]
                self._deferred.remove(B)

    def _upload_graphs(self, graphs: list[Any]) -> int:
        """Upload ``graphs`` to the device now; returns how many were. A graph
        that is not uploaded is uploaded by its first launch, which would be a user's decode
        step: the warm-up replays only the graphs of its own batch sizes and key lengths.
        Needs the graph's executable handle (torch >= 2.9) and torch's libcudart; 0 without."""
        from weights.cudart import CudaError, CudaRT

        if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
            return 0
        rt = CudaRT.shared()
        if rt is None:
            return 0
        stream = torch.cuda.current_stream(self.device).cuda_stream
        n = 0
        for g in graphs:
            try:
                rt.graph_upload(g.raw_cuda_graph_exec(), stream)
            except (CudaError, RuntimeError) as e:  # nothing lost: the first launch uploads it
                log.info("CUDA graphs not uploaded ahead (%s): each one's first launch does it", e)
                break
            n += 1
        return n

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                # a new thread starts on device 0; Triton launches on the current device
                torch.cuda.set_device(self.device)
            with torch.inference_mode():
                self._first_prefills()
                self._ready.set()
                while not self._stop.is_set():
                    self._intake()
                    if not (self._waiting or self._prefilling or self._decoding or self._pending):
                        if self._capture_when_idle and self._deferred:  # one size, then look again
                            self._capture_late(self._deferred[0], "idle")
                            continue
                        self._wake.wait(0.1)
                        self._wake.clear()
                        continue
                    self._admit()
                    self._prefill_turn()
                    self._decode_step()
                self._emit_pending()
        except BaseException as e:  # noqa: BLE001 - the loop must record why it died
            log.exception("engine loop died")
            self.error = e
            self._ready.set()
            self._fail_all("error")

    def _intake(self) -> None:
        with self._lock:
            while self._inbox:
                self._waiting.append(self._inbox.popleft())
        for s in [s for s in self._waiting if s.handle.cancelled]:
            self._waiting.remove(s)
            self._finish(s, "cancelled")
        for s in [s for s in self._prefilling + self._decoding if s.handle.cancelled]:
            self._finish(s, "cancelled")

    def _admit(self) -> None:
        while self._waiting and self._free:
            s = self._waiting.popleft()
            s.slot = heapq.heappop(self._free)
            s.handle.admitted_at = time.perf_counter()
            self._prefilling.append(s)

    def _fresh_group(self) -> tuple[list[_Seq], int]:
        """Prompts to prefill in one forward: the first fresh prompt that fits one chunk and
        the next ones of its padded length L, as many as make a number of rows R, a power of
        two, with R x L <= prefill_chunk. Every matrix product then has R x L rows, a length
        ``start`` has run (prefill_lengths are powers of two), so no first-time cost reaches
        a request. ([], 0) when there is no such pair of prompts."""
        if not self._batched_prefill:
            return [], 0
        chunk = self.config.prefill_chunk
        fresh = [s for s in self._prefilling if s.prefilled == 0 and len(s.prompt) <= chunk]
        if len(fresh) < 2:
            return [], 0
        L = self._padded_len(len(fresh[0].prompt), 0)
        if L & (L - 1):  # chunk itself, not a power of two: alone
            return [], 0
        same = [s for s in fresh if self._padded_len(len(s.prompt), 0) == L]
        R = 1
        while R * 2 <= len(same) and R * 2 * L <= chunk:
            R *= 2
        return (same[:R], L) if R > 1 else ([], 0)

    def _prefill_group(self, group: list[_Seq], L: int) -> None:
        """One forward for ``group`` (``_fresh_group``); their first tokens are sampled at once."""
        tokens = torch.tensor([s.prompt + [0] * (L - len(s.prompt)) for s in group], device=self.device)
        for s in group:
            s.written = max(s.written, L)
        try:
            logits = self.model.prefill_batch(tokens, self.cache, [s.slot for s in group],
                                              [len(s.prompt) for s in group], logit_rows=self._logit_rows)
        except Exception as e:
            if _is_device_error(e) and not isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            log.exception("requests %s failed in prefill", [s.handle.id for s in group])
            for s in group:
                self._finish(s, "error", e)
            return
        for s in group:
            s.prefilled = len(s.prompt)
            self._stats["prompt_tokens"] += len(s.prompt)
        self._stats["batched_prefills"] += 1
        self._to_decoding(group, logits)

    def _prefill_turn(self) -> None:
        budget = self.config.prefill_chunk
        group, L = self._fresh_group()
        if group:
            self._prefill_group(group, L)
            budget -= len(group) * L
        for s in list(self._prefilling):
            if budget <= 0:
                break
            try:
                while s.prefilled < len(s.prompt) and budget > 0:
                    n = min(self.config.prefill_chunk, len(s.prompt) - s.prefilled)
                    ids = s.prompt[s.prefilled : s.prefilled + n]
                    padded = self._padded_len(n, s.prefilled)
                    s.written = max(s.written, s.prefilled + padded)
                    if padded > n:  # the positions after the prompt are written again by decode
                        chunk = torch.tensor([ids + [0] * (padded - n)], device=self.device)
                        logits = self.model.prefill(chunk, self.cache, s.slot, s.prefilled, n_valid=n)  # [V]
                    else:
                        logits = self.model.prefill(torch.tensor([ids], device=self.device), self.cache, s.slot,
                                                    s.prefilled)
                    s.prefilled += n
                    budget -= n
                    self._stats["prompt_tokens"] += n
            except Exception as e:
                if _is_device_error(e) and not isinstance(e, torch.cuda.OutOfMemoryError):
                    raise
                log.exception("request %d failed in prefill", s.handle.id)
                self._finish(s, "error", e)
                continue
            if s.prefilled == len(s.prompt):
                self._to_decoding([s], logits.unsqueeze(0))

    def _to_decoding(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """Sequences whose whole prompt is in the cache start decoding; logits [R, V] (row j
        for seqs[j], at its last prompt token) give their first tokens, which stream now."""
        rows = []
        for j, s in enumerate(seqs):
            self._prefilling.remove(s)
            s.pos = len(s.prompt)
            try:
                s.gen = self._make_generator(s.params)
            except Exception as e:  # one request's setting must not stop the loop
                if _is_device_error(e):
                    raise
                log.exception("request %d failed: its sampling generator", s.handle.id)
                self._finish(s, "error", e)
                continue
            self._decoding.append(s)
            rows.append(j)
        if len(rows) < len(seqs):
            seqs = [seqs[j] for j in rows]
            logits = logits[rows]
        if seqs:
            self._sample(seqs, logits, defer=False)

    def _stage_inputs(self, B: int, seqs: list[_Seq]) -> None:
        # Padding rows: token 0 at the last cache position, which no live sequence ever
        # reaches (prompt + max_new_tokens <= max_seq_len and the last token is never fed).
        # One host tensor and one copy per step: per-element tensor writes cost ~us each.
        rows = [[0] * B, [self.config.max_seq_len - 1] * B, [0] * B]
        for s in seqs:
            rows[0][s.slot], rows[1][s.slot], rows[2][s.slot] = s.last, s.pos, 1
        self._stage[:, :B] = torch.tensor(rows, dtype=torch.int64)
        self._inp[:, :B].copy_(self._stage[:, :B], non_blocking=True)

    def _decode_step(self) -> None:
        seqs = list(self._decoding)
        if not seqs:
            self._emit_pending()
            return
        cfg = self.config
        B = _bucket(max(s.slot for s in seqs) + 1, cfg.graph_batch_sizes)
        L = _bucket(max(s.pos for s in seqs) + 1, self._kv_lens)
        if self._use_graphs and B in self._deferred:  # (stages padding: before this step's inputs)
            self._capture_late(B, "step")
        self._stage_inputs(B, seqs)
        if self._use_graphs and B not in self._eager_sizes:
            g, logits = self._graphs[(B, L)]
            g.replay()
        else:
            logits = self._decode_eager(B, L)
        for s in seqs:
            s.pos += 1
        self._stats["steps"] += 1
        self._emit_pending()  # the previous step's text, while the device works on this one
        live = [s for s in seqs if s.slot >= 0]  # a stop string may have ended some just now
        if not live:
            return
        slots = [s.slot for s in live]
        if slots != list(range(B)):  # some rows are padding or ended: pick the live ones
            logits = logits.index_select(0, torch.tensor(slots, device=self.device))
        self._sample(live, logits, defer=True)

    def _make_generator(self, p: SamplingParams) -> torch.Generator | None:
        if p.temperature == 0:
            return None
        g = torch.Generator(device=self.device)
        if p.seed is None:
            g.seed()
        else:
            g.manual_seed(p.seed)
        return g

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor, defer: bool) -> None:
        # logits: [R, V], row j for seqs[j]
        args = ([s.params.temperature for s in seqs], [s.params.top_p for s in seqs], [s.params.top_k for s in seqs])
        try:
            toks: list[int | None] = sample(logits, *args, [s.gen for s in seqs])
        except Exception as e:
            if _is_device_error(e):
                raise
            # find the row at fault: sample one by one, failing only the bad ones
            toks = []
            for j, s in enumerate(seqs):
                try:
                    toks.extend(sample(logits[j : j + 1], *[[a[j]] for a in args], [s.gen]))
                except Exception as e1:
                    if _is_device_error(e1):
                        raise
                    log.exception("request %d failed in sampling", s.handle.id)
                    self._finish(s, "error", e1)
                    toks.append(None)
        for s, tok in zip(seqs, toks):
            if tok is None:
                if not s.handle.done and s.slot >= 0:  # (None from a failed row: finished above)
                    log.error("request %d: non-finite logits at generated token %d", s.handle.id, s.n_gen + 1)
                    self._finish(s, "error", NonFiniteLogits(
                        f"the model's logits were not finite (NaN or inf) at generated token {s.n_gen + 1}: "
                        f"it overflowed its dtype ({self.model.dtype}) on this prompt; a float16 checkpoint "
                        f"may need packing as bfloat16 (coldstart pack --dtype bfloat16)"))
                continue
            reason = self._take(s, tok)
            if defer:
                if reason is not None:  # decided now: the next step must not run this sequence
                    self._retire(s)
                self._pending.append((s, tok, reason))
            else:
                self._emit_safely(s, tok, reason)

    def _take(self, s: _Seq, tok: int) -> str | None:
        """Record a sampled token; returns "stop" / "length" when it ends the sequence
        without looking at text (stop strings are found when the text is made)."""
        s.last = tok
        s.n_gen += 1
        self._stats["tokens_generated"] += 1
        s.handle._mark_token()
        if tok in s.stops:
            return "stop"
        return "length" if s.n_gen >= s.params.max_new_tokens else None

    def _emit_pending(self) -> None:
        pending, self._pending = self._pending, []
        for s, tok, reason in pending:
            if not s.handle.done:  # not cancelled or failed since it was sampled
                self._emit_safely(s, tok, reason)

    def _emit_safely(self, s: _Seq, tok: int, reason: str | None) -> None:
        try:
            self._emit(s, tok, reason)
        except Exception as e:  # one request's text failed: only that request ends
            log.exception("request %d failed after sampling", s.handle.id)
            self._finish(s, "error", e)

    def _emit(self, s: _Seq, tok: int, reason: str | None) -> None:
        """Detokenize one token, check stop strings, stream it or finish the request."""
        if reason == "stop":
            text = s.text.finish(stopped=True)  # the stop token's text is not returned
        else:
            text, hit = s.text.push(tok)
            if hit:
                reason = "stop"
            elif reason == "length":
                text += s.text.finish(stopped=False)
        if reason is None:
            s.handle._put(Chunk([tok], text, None))
        else:
            self._finish(s, reason, token=tok, text=text)

    def _retire(self, s: _Seq) -> None:
        """Stop scheduling ``s`` and free its cache slot (its last chunk may still be pending).

        The positions it wrote are zeroed first (one fill, queued behind its last step): a
        multi-row decode step reads every key of its length bucket, masked ones included, and
        a masked key still multiplies its value (0 * NaN = NaN). A request whose keys or values
        overflowed (fp16) would otherwise leave non-finite values behind, and every later
        request in that slot would decode garbage (tests/test_engine.py). Only on the loop's
        own thread while it is healthy: after a device error, or from ``shutdown``, nothing
        more is launched."""
        for lst in (self._prefilling, self._decoding):
            if s in lst:
                lst.remove(s)
        if s.slot >= 0:
            upto = min(max(s.written, s.pos), self.config.max_seq_len)
            if upto and self.error is None and threading.current_thread() is self._thread:
                self.cache.zero_slot(s.slot, upto)
            heapq.heappush(self._free, s.slot)
            s.slot = -1

    def _finish(self, s: _Seq, reason: str, error: BaseException | None = None, *, token: int | None = None, text: str = "") -> None:
        try:
            self._retire(s)  # (a device error here still ends the request, then the loop)
        finally:
            self._stats["finished"] += 1
            s.handle._put(Chunk([] if token is None else [token], text, reason), error=error)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            pending = list(self._inbox) + list(self._waiting) + self._prefilling + self._decoding
            pending += [s for s, _, _ in self._pending if s not in pending]
            self._inbox.clear()
        self._pending = []
        self._waiting.clear()
        for s in pending:
            if not s.handle.done:
                self._finish(s, reason, self.error)

    def __enter__(self) -> "Engine":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _check_fits(need: int, cfg: EngineConfig, free: int, total: int, device: str) -> None:
    """Raise ValueError (which knob to lower, needed vs free) if the KV cache does not fit."""
    if need + cfg.reserve_bytes > free:
        raise ValueError(
            f"KV cache needs {need / GiB:.2f} GiB ({cfg.max_slots} slots x {cfg.max_seq_len} tokens) plus "
            f"{cfg.reserve_bytes / GiB:.2f} GiB reserve, but only {free / GiB:.2f} GiB of {total / GiB:.2f} GiB "
            f"is free on {device}; lower EngineConfig.max_slots or EngineConfig.max_seq_len (or reserve_bytes)"
        )


def iter_text(handle: RequestHandle) -> Iterator[str]:
    """Blocking iteration over a request's text deltas (tests, CLI)."""
    for chunk in handle:
        yield chunk.text
