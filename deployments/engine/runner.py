"""The model runner: the device side of the engine.

It owns the KV cache, the decode step's input buffers and its CUDA graphs, and runs the
model's prefills and decode steps for the engine's loop thread. It decides nothing about
which request runs when (``scheduler``), and starts no thread of its own.

Decode: cache slots 0..B-1 in one batch, B rounded up to a graph bucket, keys read up to a
kv-length bucket (or, through the Triton attention, up to each row's own position, one graph
per batch size). On CUDA this is a CUDA-graph replay, on the CPU the same code eagerly.
``capture`` takes the smallest batch size's graphs (``EngineConfig.lazy_graphs``; every batch
size's otherwise); ``capture_late`` takes another's when a step first needs it or the loop is
idle.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from deployments.engine.config import GiB, EngineConfig, padded_len, prefill_lengths
from deployments.engine.decoder import Decoder

log = logging.getLogger(__name__)


def is_device_error(e: BaseException) -> bool:
    """A failure of the device itself, which stops the loop (one request's bad input does not);
    torch raises CUDA failures as RuntimeError (torch.AcceleratorError in newer releases)."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    return type(e).__name__ == "AcceleratorError" or "CUDA" in str(e) or "cuda" in type(e).__module__


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise AssertionError(f"{n} above the largest bucket {buckets[-1]}")


def check_fits(need: int, reserve: int, cfg: EngineConfig, free: int, total: int, device: str) -> None:
    """Raise ValueError (which knob to lower, needed vs free) if the KV cache does not fit."""
    if need + reserve > free:
        raise ValueError(
            f"KV cache needs {need / GiB:.2f} GiB ({cfg.max_slots} slots x {cfg.max_seq_len} tokens) plus "
            f"{reserve / GiB:.2f} GiB reserve, but only {free / GiB:.2f} GiB of {total / GiB:.2f} GiB "
            f"is free on {device}; lower engine.max_slots or engine.max_seq_len (or engine.reserve_bytes)")


def default_reserve(model: Decoder, cfg: EngineConfig, gathered: int) -> int:
    """engine.reserve_bytes where it is not set: 1 GiB (graphs, cuBLAS workspaces, sampling) plus
    twice the model's estimate of its largest prefill forward (``activation_bytes``: a chunk of
    ``prefill_chunk`` tokens reading ``gathered`` cached positions), or 1 GiB alone for a model
    without one."""
    estimate = model.activation_bytes(cfg.prefill_chunk, max(1, cfg.prefill_chunk // 16), gathered)
    return GiB if estimate is None else GiB + 2 * estimate


class ModelRunner:
    """KV cache, decode inputs, CUDA graphs and the model's forward calls for one engine.

    ``cfg`` is the engine's resolved config. Everything but ``capture_lock`` and ``stats``
    is used by the engine's loop thread only (and ``capture`` before that thread starts).
    """

    def __init__(self, model: Decoder, cfg: EngineConfig):
        self.model, self.cfg = model, cfg
        self.device = model.device
        model.setup_rope(cfg.max_seq_len)
        paged = cfg.kv_cache == "paged"
        if paged and not model.supports_paged_cache:
            log.warning("engine.kv_cache paged: %s has no paged cache; a static one instead", type(model).__name__)
            paged = False
        # past a prefix, a group's attention gathers each row's cached positions: at most four
        # longest prompts' worth (a single prompt's chunk gathers up to one)
        self.group_read = 4 * cfg.max_seq_len
        self.reserve_bytes = (cfg.reserve_bytes if cfg.reserve_bytes is not None
                              else default_reserve(model, cfg, self.group_read if paged else cfg.max_seq_len))
        self.cache = self._paged_cache() if paged else self._static_cache()
        # its kernels' paged variants, tested before any graph or key-length bound depends on them
        paged_test_s = model.check_paged_kernels(self.cache) if paged else 0.0
        # decode inputs: rows = token, position, valid; one host->device copy per step. A slot's
        # token may instead be the one its last step sampled on the device (``feed``).
        pin = self.device.type == "cuda"
        self._inp = torch.zeros(3, cfg.max_slots, dtype=torch.int64, device=self.device)
        self._staged = torch.zeros(3, cfg.max_slots, dtype=torch.int64, device=self.device)
        # host buffers, two of each, taken in turn: the engine launches a step before it reads the
        # last one's tokens, so a buffer may still be in a queued copy when the next step is staged
        self._stage = torch.zeros(2, 3, cfg.max_slots, dtype=torch.int64, pin_memory=pin)
        self._out = torch.zeros(2, cfg.max_slots, dtype=torch.int64, pin_memory=pin)
        self._staged_n = self._out_n = 0  # buffers used so far (their parity picks the next)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None  # the graphs' shared memory pool (made by the first capture)
        self.deferred: list[int] = []  # batch sizes whose graphs are not captured yet (lazy_graphs)
        self._eager_sizes: set[int] = set()  # batch sizes whose late capture ran out of memory
        # held while capturing: a device-wide synchronize from another thread (the replica's
        # health check) waits instead of landing inside a capture
        self.capture_lock = threading.Lock()
        # the decode steps' key-length bounds (a graph each per batch size): all of kv_len_buckets
        # where a step reads keys up to the bound, the longest alone where it reads each row's own
        self.kv_lens = model.decode_kv_lens(cfg.kv_len_buckets)
        self.use_graphs = cfg.cuda_graphs and self.device.type == "cuda" and model.supports_cuda_graphs
        self.prefill_lengths = (prefill_lengths(cfg.prefill_chunk, cfg.prefill_min_len)
                                if cfg.prefill_padding and model.supports_prefill_padding else ())
        # prompts of one start and one padded length share a forward; its head always multiplies the most
        # rows a group can have, one shape for every group
        self.batched_prefill = bool(self.prefill_lengths) and model.supports_batched_prefill
        self._logit_rows = max(1, cfg.prefill_chunk // 16)
        self.stats: dict[str, Any] = {"reserve_bytes": self.reserve_bytes, "capture_s": 0.0, "first_launch_s": 0.0,
                                      "first_prefill_s": 0.0, "late_captures": {},
                                      **({"paged_kernel_test_s": paged_test_s} if paged else {})}

    def _static_cache(self) -> Any:
        cfg, model = self.cfg, self.model
        need = model.cache_bytes(cfg.max_slots, cfg.max_seq_len)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            check_fits(need, self.reserve_bytes, cfg, free, total, str(self.device))
        log.info("KV cache: %.2f GiB for %d slots x %d tokens", need / GiB, cfg.max_slots, cfg.max_seq_len)
        self.cache_bytes = need
        return model.new_cache(cfg.max_slots, cfg.max_seq_len)

    def _paged_cache(self) -> Any:
        """As many blocks as engine.kv_blocks says, else as the device's free memory holds beside
        the reserve (on the CPU: max_slots x max_seq_len positions' worth, and the null block)."""
        cfg, model, reserve = self.cfg, self.model, self.reserve_bytes
        bs, per = cfg.kv_block_size, model.cache_block_bytes(cfg.kv_block_size)
        n = cfg.kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            if n is None:
                n = max(0, free - reserve) // per
                if n < 2:
                    raise ValueError(f"a paged KV cache needs 2 blocks of {per / 2**20:.1f} MiB beside "
                                     f"{reserve / GiB:.2f} GiB reserve, but only {free / GiB:.2f} GiB of "
                                     f"{total / GiB:.2f} GiB is free on {self.device}; lower engine.reserve_bytes")
            elif n * per + reserve > free:
                raise ValueError(f"engine.kv_blocks={n} needs {n * per / GiB:.2f} GiB plus {reserve / GiB:.2f} "
                                 f"GiB reserve, but only {free / GiB:.2f} GiB of {total / GiB:.2f} GiB is free on "
                                 f"{self.device}; lower engine.kv_blocks (or leave it out: the free memory decides)")
        elif n is None:
            n = cfg.max_slots * -(-cfg.max_seq_len // bs) + 1
        log.info("KV cache: %.2f GiB, %d blocks of %d positions (%d positions), for up to %d sequences",
                 n * per / GiB, n, bs, (n - 1) * bs, cfg.max_slots)
        self.cache_bytes = n * per
        return model.new_paged_cache(n, bs, cfg.max_slots, cfg.max_seq_len)

    def out_of_memory(self, what: str) -> RuntimeError:
        """The error for device memory run out before serving, in ``what``: which knobs leave more."""
        cfg, paged = self.cfg, self.cache.paged
        fewer = ("set engine.kv_blocks below the cache's %d" % self.cache.num_blocks if paged
                 else "lower engine.max_slots or engine.max_seq_len")
        return RuntimeError(
            f"the engine ran out of device memory in {what}, beside a KV cache of {self.cache_bytes / GiB:.2f} GiB "
            f"and engine.reserve_bytes={self.reserve_bytes / GiB:.2f} GiB kept free for this: raise "
            f"engine.reserve_bytes, or {fewer}, or lower engine.prefill_chunk={cfg.prefill_chunk}")

    def assign(self, slot: int, blocks: list[int], clear: list[int] = ()) -> None:
        """A paged cache: ``slot``'s sequence now reads and writes ``blocks`` (the scheduler's
        admission); ``clear``, those of them that held another prompt's prefix, are zeroed first."""
        self.cache.assign(slot, blocks, clear)

    def release(self, slot: int, blocks: list[int]) -> None:
        """A paged cache: ``slot``'s sequence ended; ``blocks`` (those now empty) are zeroed."""
        self.cache.release(slot, blocks)

    # ---------------------------------------------------------------- forward calls
    def padded_len(self, n: int, start: int) -> int:
        """The length a chunk of ``n`` prompt tokens at ``start`` is run at (``prefill_lengths``)."""
        return padded_len(n, start, self.prefill_lengths, self.cfg.max_seq_len)

    def prefill(self, ids: list[int], slot: int, start: int) -> tuple[torch.Tensor, int]:
        """One chunk of one prompt into ``slot`` at ``start``: (logits [V] at its last token, the
        positions written, padding included; those after the prompt are written again by decode)."""
        n = len(ids)
        padded = self.padded_len(n, start)
        if padded > n:
            chunk = torch.tensor([ids + [0] * (padded - n)], device=self.device)
            return self.model.prefill(chunk, self.cache, slot, start, n_valid=n), padded
        return self.model.prefill(torch.tensor([ids], device=self.device), self.cache, slot, start), n

    def prefill_group(self, prompts: list[list[int]], slots: list[int], L: int, start: int = 0) -> torch.Tensor:
        """The rests of prompts from ``start`` (their positions before it in the cache already),
        each padded to ``L``, in one forward: logits [R, V]."""
        tokens = torch.tensor([p + [0] * (L - len(p)) for p in prompts], device=self.device)
        return self.model.prefill_batch(tokens, self.cache, slots, [len(p) for p in prompts],
                                        logit_rows=self._logit_rows, start=start)

    def decode(self, B: int, L: int, rows: list[tuple[int, int | None, int]]) -> torch.Tensor:
        """One decode step over slots 0..B-1 reading keys up to ``L``; ``rows``: (slot, token,
        position) of each live sequence, token None where ``feed`` left it on the device.
        Launched, not waited for: logits [B, V]."""
        if self.use_graphs and B in self.deferred:  # (stages padding: before this step's inputs)
            self.capture_late(B, "step")
        self._stage_inputs(B, rows)
        if self.use_graphs and B not in self._eager_sizes:
            g, logits = self._graphs[(B, L)]
            g.replay()
            return logits
        return self._decode_eager(B, L)

    def zero_slot(self, slot: int, upto: int) -> None:
        self.cache.zero_slot(slot, upto)

    def feed(self, toks: torch.Tensor, slots: torch.Tensor | None) -> None:
        """A step's sampled tokens ([R] on the device, -1 where not finite) become the next
        step's inputs of their slots (``slots`` [R]; None: slots 0..R-1) without the host."""
        toks = toks.clamp_min(0)  # (a failed row's next step is dropped; its id must still be one)
        if slots is None:
            self._inp[0, : toks.shape[0]].copy_(toks)
        else:
            self._inp[0].index_copy_(0, slots, toks)

    def to_host(self, toks: torch.Tensor) -> Any:
        """Start copying ``toks`` ([R] int64 on the device) to the host; returns a function that
        waits for that copy alone (not for later work on the stream) and gives the list."""
        if self.device.type != "cuda":
            return toks.tolist
        self._out_n += 1
        buf = self._out[self._out_n % 2, : toks.shape[0]]
        buf.copy_(toks, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> list[int]:
            done.synchronize()
            return buf.tolist()
        return wait

    def _stage_inputs(self, B: int, rows: list[tuple[int, int | None, int]]) -> None:
        # Padding rows: token 0 at the last cache position, which no live sequence ever
        # reaches (prompt + max_new_tokens <= max_seq_len and the last token is never fed).
        # One host tensor and one copy per step: per-element tensor writes cost ~us each. A row
        # whose token is on the device already (None) stages -1 and keeps it.
        staged = [[0] * B, [self.cfg.max_seq_len - 1] * B, [0] * B]
        fed = False
        for slot, token, pos in rows:
            if token is None:
                token, fed = -1, True
            staged[0][slot], staged[1][slot], staged[2][slot] = token, pos, 1
        self._staged_n += 1
        stage = self._stage[self._staged_n % 2, :, :B]
        stage.copy_(torch.tensor(staged, dtype=torch.int64))
        if not fed:
            self._inp[:, :B].copy_(stage, non_blocking=True)
            return
        dev = self._staged[:, :B]
        dev.copy_(stage, non_blocking=True)
        self._inp[1:, :B].copy_(dev[1:])
        self._inp[0, :B].copy_(torch.where(dev[0] >= 0, dev[0], self._inp[0, :B]))

    def _decode_eager(self, B: int, L: int) -> torch.Tensor:
        inp = self._inp[:, :B]
        return self.model.decode(inp[0], inp[1], inp[2], self.cache, L)  # valid: 1 live row, 0 padding

    # ---------------------------------------------------------------- first runs
    def first_prefills(self) -> None:
        """One prefill at each padded chunk length, into slot 0, run by the loop thread before it
        serves: the kernels and GEMM algorithms a prompt of that length needs are loaded and
        chosen now, not in a user's first request. In the loop thread, because that cost is paid
        per thread (torch's cuBLAS handles are). Only the shapes matter, so this may run while
        the weights are still loading.

        What ran before serving wrote keys and values computed from such weights (these
        prefills into slots 0 and 1, the graphs' first launches a padding row into every slot).
        A masked key still multiplies its value (0 * NaN = NaN), so one non-finite value left
        there would poison every later request in its slot: the whole cache is zeroed after
        them (one memset, queued on the device)."""
        t0 = time.perf_counter()
        each: dict[int | str, float] = {}
        cuda = self.device.type == "cuda"
        if cuda:  # what the longest chunk's activations take beside the cache (reserve_bytes holds them)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

        def timed(key: int | str, run: Callable[[], object]) -> None:
            t = time.perf_counter()
            try:
                run()
                if cuda:
                    torch.cuda.synchronize(self.device)
            except torch.OutOfMemoryError as e:
                raise self.out_of_memory(f"its first prefill of {key} prompt tokens") from e
            each[key] = round((time.perf_counter() - t) * 1e3, 2)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=self.device)
        for n in self.prefill_lengths:
            timed(n, lambda: self.model.prefill(zeros(1, n), self.cache, 0, 0))
        L0 = self.prefill_lengths[0] if self.prefill_lengths else 0
        if self.batched_prefill and self.cfg.max_slots >= 2 and L0 and not L0 & (L0 - 1) \
                and 2 * L0 <= self.cfg.prefill_chunk:
            # and two prompts in one forward: its cache writes by slot, its row gather, its head's one shape
            timed(f"2x{L0}", lambda: self.model.prefill_batch(zeros(2, L0), self.cache, [0, 1], [L0, L0],
                                                             logit_rows=self._logit_rows))
        if self.prefill_lengths or self._graphs:
            self.cache.zero_()
        if cuda:
            self.stats["prefill_peak_bytes"] = torch.cuda.max_memory_allocated(self.device) - base[0]
            self.stats["prefill_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device) - base[1]
        self.stats["first_prefill_s"] = time.perf_counter() - t0
        self.stats["first_prefill_ms"] = each  # per length: what the first one pays for the thread

    # ---------------------------------------------------------------- graphs
    @torch.inference_mode()
    def capture(self) -> None:
        """The graphs taken before serving: one per (batch bucket, kv-length bound), largest first,
        sharing one memory pool; with ``lazy_graphs`` the smallest batch size's alone."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        cfg = self.cfg
        sizes = cfg.graph_batch_sizes[:1] if cfg.lazy_graphs else cfg.graph_batch_sizes
        self.deferred = [b for b in cfg.graph_batch_sizes if b not in sizes]
        self._pool = torch.cuda.graph_pool_handle()
        try:
            self.stats["first_launch_ms"] = self._first_launches(sizes)  # the kernels each size is first to load
            self.stats["first_launch_s"] = time.perf_counter() - t0
            self.stats["graphs_uploaded"] = self._upload(self._capture_graphs(sizes))
        except torch.OutOfMemoryError as e:
            raise self.out_of_memory(f"the decode graphs of batch sizes {list(sizes)}") from e
        torch.cuda.synchronize(self.device)
        self.stats["capture_s"] = time.perf_counter() - t0
        log.info("captured %d decode graphs in %.2f s (%.2f s of it the first eager launches)%s",
                 len(self._graphs), self.stats["capture_s"], self.stats["first_launch_s"],
                 f"; batch sizes {self.deferred} deferred" if self.deferred else "")

    def graphs(self) -> int:
        return len(self._graphs)

    def _first_launches(self, sizes: tuple[int, ...] | list[int]) -> dict[int, float]:
        """One eager decode step per batch size, every row padding, on a side stream (cuBLAS
        handles and lazily loaded kernels must precede a capture); ms each."""
        self._stage_inputs(max(sizes), [])
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        each: dict[int, float] = {}
        with torch.cuda.stream(side):
            for B in sizes:
                t = time.perf_counter()
                self._decode_eager(B, self.cfg.kv_len_buckets[-1])
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
            for L in reversed(self.kv_lens):
                g = torch.cuda.CUDAGraph()
                # thread_local: the loader's threads may still be copying weights meanwhile (their
                # CUDA calls must not invalidate this capture, nor be refused because of it)
                with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                    out = self._decode_eager(B, L)
                self._graphs[(B, L)] = (g, out)
                new.append(g)
        return new

    def capture_late(self, B: int, why: str) -> None:
        """Between steps: capture deferred batch size ``B`` (first launch, capture, upload),
        recorded in stats ``late_captures`` as {B: [ms, why]}. Out of device memory, ``B`` stays
        eager (logged) instead of failing the loop."""
        t = time.perf_counter()
        tokens = self._inp[0].clone()  # the tokens ``feed`` left there (the first launch stages padding)
        with self.capture_lock:
            try:
                self._first_launches([B])
                self._upload(self._capture_graphs([B]))
                torch.cuda.synchronize(self.device)
            except torch.OutOfMemoryError as e:
                for L in self.kv_lens:
                    self._graphs.pop((B, L), None)
                self._eager_sizes.add(B)
                log.warning("no CUDA graph for batch size %d (%s): its steps run eagerly", B, e)
            finally:
                self._inp[0].copy_(tokens)
                # only now: graphs_deferred counts the sizes whose capture has not ended
                self.stats["late_captures"][B] = [round((time.perf_counter() - t) * 1e3, 2), why]
                self.deferred.remove(B)

    def _upload(self, graphs: list[Any]) -> int:
        """Upload ``graphs`` to the device now; how many were. A graph not uploaded is uploaded by
        its first launch, which would be a user's decode step (the warm-up replays only its own
        batch sizes' graphs). Needs the graph's executable handle (torch >= 2.9) and torch's
        libcudart; 0 without."""
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
