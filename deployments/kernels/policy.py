"""Which decode kernels a model runs, decided once per start and kept per node.

``choose`` is the policy: the fused Triton operations (``ops``) where they compile and match
torch at the model's sizes (``self_test``), the Triton decode attention where it does too
(``attention_self_test``), and the Triton GEMV for the batch-1 projections whose shapes it
multiplies faster than cuBLAS on this GPU (``gemv_choice``). Each verdict is kept beside
Triton's kernel cache (``deployments.node_cache``), keyed on the GPU model, torch, CUDA,
Triton and the kernels' code, so that a later start on the node with the same ones skips the
test or the timing; a failure is never kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from deployments import node_cache
from deployments.kernels import bundle, ops
from deployments.kernels.triton_jit import triton

log = logging.getLogger(__name__)

GemvGroups = dict[str, list[tuple[torch.Tensor, "torch.Tensor | None"]]]


@dataclass
class KernelPlan:
    """What a model's decode step runs: ``fused`` the Triton norm, SwiGLU and rope + KV write;
    ``attention`` the Triton decode attention; ``gemv`` the weight shapes (N, K) whose batch-1
    products use the Triton GEMV. ``seconds``: each decision's time in this start."""

    fused: bool = False
    attention: bool = False
    gemv: frozenset = frozenset()
    seconds: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        if not self.fused:
            return "torch"
        return ("Triton (fused norm, SwiGLU, rope + KV write" + (", attention" if self.attention else "")
                + (f", GEMV for {len(self.gemv)} weight shapes)" if self.gemv else ")"))


def choose(dims: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device,
           gemv_groups: Callable[[], GemvGroups], *, one_dtype: bool = True) -> KernelPlan:
    """The plan for a model of ``dims`` (hidden, intermediate, heads, kv heads, head size) in
    ``dtype`` on ``device``; ``gemv_groups()`` gives its projections' (weight, bias) pairs by
    name (called only where the GEMV is timed); ``one_dtype``: every parameter has ``dtype``
    (the kernels take one). Never raises for a kernel that does not work: it is left out, with
    a log line saying why."""
    plan = KernelPlan()
    if not ops.available(device):
        return plan
    if not one_dtype:
        log.warning("fused Triton kernels off: the checkpoint mixes dtypes")
        return plan
    hidden, inter, heads, kv, head_dim = dims
    where = verdict_dir()
    t = time.perf_counter()
    times: dict[str, float] = {}
    why = self_test(hidden, inter, heads, kv, head_dim, dtype, device, times, keep=where)
    plan.seconds.update({f"kernel_test_{k}": v for k, v in times.items()})
    plan.seconds["kernel_test"], t = time.perf_counter() - t, time.perf_counter()
    if why:
        log.warning("fused Triton kernels off (%s): decoding with torch kernels", why)
        return plan
    plan.fused = True
    times = {}
    why = attention_self_test(heads, kv, head_dim, dtype, device, times, keep=where)
    plan.seconds.update({f"attention_test_{k}": v for k, v in times.items()})
    plan.seconds["attention_test"], t = time.perf_counter() - t, time.perf_counter()
    plan.attention = why is None
    if why:
        log.warning("Triton decode attention off (%s): using batched matmuls", why)
    groups = gemv_groups()
    chosen, report = gemv_choice(groups, keep=where)
    plan.gemv = frozenset(chosen)
    plan.seconds["gemv_choice"] = time.perf_counter() - t
    log.info("batch-1 GEMV%s: %s", " (kept from an earlier start on this node)" if any(
        r.get("cached") for r in report.values()) else "", "; ".join(
        f"{name} {r['triton_ms']:.3f} vs cuBLAS {r['torch_ms']:.3f} ms -> {'Triton' if r['triton'] else 'cuBLAS'}"
        if "error" not in r else f"{name}: cuBLAS ({r['error']})" for name, r in report.items()))
    return plan


def paged_check(dims: tuple[int, int, int], block_size: int, blocks_per_seq: int, dtype: torch.dtype,
                device: torch.device, plan: KernelPlan) -> KernelPlan:
    """``plan`` as a paged KV cache of ``block_size`` positions per block and ``blocks_per_seq``
    blocks per sequence can use it: its kernels' paged variants (rope + KV write, attention)
    tested once per node (``paged_self_test``); where one fails, what it needs is off, with a
    log line saying why (the static cache's kernels are unaffected)."""
    if not plan.fused:
        return plan
    times: dict[str, float] = {}
    t = time.perf_counter()
    fused_why, attention_why = paged_self_test(*dims, block_size, blocks_per_seq, dtype, device, times,
                                               keep=verdict_dir(), attention=plan.attention)
    seconds = {**plan.seconds, "paged_kernel_test": time.perf_counter() - t}
    if fused_why:
        log.warning("fused Triton kernels off for the paged KV cache (%s): decoding with torch kernels", fused_why)
        return KernelPlan(seconds=seconds)
    if attention_why:
        log.warning("Triton decode attention off for the paged KV cache (%s): using batched matmuls", attention_why)
    return KernelPlan(True, plan.attention and attention_why is None, plan.gemv, seconds)


def paged_self_test(n_heads: int, n_kv: int, head_dim: int, block_size: int, blocks_per_seq: int,
                    dtype: torch.dtype, device: torch.device | str, times: dict[str, float] | None = None,
                    keep: Path | None = None, attention: bool = True) -> tuple[str | None, str | None]:
    """As `self_test`, for the paged variants of `rope_store_kv` and (``attention``) of
    `decode_attention`, at a model's head sizes and a cache's geometry (the block size is a
    compile-time constant of both): (why the first is not usable, why the second is not), each
    None when usable."""
    if not ops.available(device):
        why = "Triton or a CUDA device is not available (or COLDSTART_TRITON=0)"
        return why, why
    timed = _timing(times, device)
    cases = paged_cases(n_heads, n_kv, head_dim, block_size, blocks_per_seq, dtype, device, timed)
    judged = ["paged", n_heads, n_kv, head_dim, block_size, blocks_per_seq % 16 == 0, str(dtype)]
    fused = kept_test(_selftest_path([*judged, "rope_store_kv"], device, keep),
                      lambda: _compare(lambda: cases("rope_store_kv"), dtype))
    if fused or not attention:
        return fused, None
    return None, kept_test(_selftest_path([*judged, "decode_attention"], device, keep),
                           lambda: _compare(lambda: cases("decode_attention"), dtype))


def paged_cases(n_heads: int, n_kv: int, head_dim: int, block_size: int, blocks_per_seq: int, dtype: torch.dtype,
                device: torch.device | str, timed: Callable[..., Any], rope: Callable[..., Any] | None = None,
                attention: Callable[..., Any] | None = None
                ) -> Callable[[str], Iterator[tuple[str, torch.Tensor, torch.Tensor]]]:
    """The paged self-test's cases, per kernel: two rows over a block table of ``blocks_per_seq``
    columns (its row stride, like the cache's block size, selects what is compiled), their blocks
    out of order, the rest of each row on the null block 0; ``rope``, ``attention``: the kernels
    under test (``ops``' by default; the Triton interpreter's tests pass the launchers)."""
    rope, attention = rope or ops.rope_store_kv, attention or ops.decode_attention

    def run(kernel: str) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        # (made here, inside `_compare`: a failure to make them is a failed test, not a failed start)
        rnd = _rand(dtype, device)
        per_row = min(blocks_per_seq, -(-320 // block_size))  # up to position 319
        table = torch.zeros(2, blocks_per_seq, dtype=torch.int32, device=device)
        order = torch.randperm(2 * per_row, generator=torch.Generator().manual_seed(0)) + 1
        table[:, :per_row] = order.view(2, per_row).to(device=device, dtype=torch.int32)
        shape = (2 * per_row + 1, n_kv, block_size, head_dim)
        last = per_row * block_size - 1
        pos = torch.tensor([min(300, last), min(77, last)], device=device)
        if kernel == "rope_store_kv":
            qkv, cos, sin = rnd(2, (n_heads + 2 * n_kv) * head_dim), rnd(2, head_dim), rnd(2, head_dim)
            caches = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(4)]
            yield ("rope_store_kv (paged)",
                   timed("triton", rope, qkv, cos, sin, caches[0], caches[1], pos, n_heads, n_kv, head_dim, table),
                   timed("torch", ops._ref_rope_store_kv, qkv, cos, sin, caches[2], caches[3], pos, n_heads, n_kv,
                         head_dim, table))
            yield "kv_cache (paged)", torch.cat(caches[:2]), torch.cat(caches[2:])
            return
        q, kc, vc = rnd(2, n_heads, head_dim), rnd(*shape), rnd(*shape)
        kv_len = per_row * block_size
        for window in (0, 64):
            yield (f"decode_attention (paged, window {window})",
                   timed("triton", attention, q, kc, vc, pos, kv_len, window, head_dim**-0.5, table),
                   timed("torch", ops._ref_decode_attention, q, kc, vc, pos, kv_len, window, head_dim**-0.5, table))
    return run


# ----------------------------------------------------------------------------- timing on the device


def capture_graph(fn: Callable[[], object], device: torch.device | str) -> torch.cuda.CUDAGraph:
    """``fn`` run once on a side stream (compiles, picks algorithms), then captured as a CUDA graph."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):  # loader threads may run meanwhile
        fn()
    return g


def graph_ms(fn: Callable[[], object], device: torch.device | str, replays: int = 3) -> float:
    """GPU time of one call of ``fn`` (several launches), captured as a CUDA graph so that
    Python's launch overhead is not what is measured; the best of a few replays."""
    g = capture_graph(fn, device)
    best = float("inf")
    for _ in range(replays + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


# ----------------------------------------------------------------------------- verdicts kept per node


def verdict_dir() -> Path:
    """Where a replica keeps its kernel verdicts: beside Triton's compiled kernels."""
    return node_cache.triton_cache_dir()




def verdict_path(kind: str, judged: Any, device: torch.device, where: Path) -> Path:
    """The file for the verdict on ``judged`` (shapes, dtypes, options) on this GPU, keyed on
    everything else that could change it: the GPU model, torch, its CUDA, Triton, this
    module's code. A node with another of these gets its own verdict."""
    props = torch.cuda.get_device_properties(device)
    code = bundle.code_hash()
    blob = json.dumps([kind, judged, props.name, [props.major, props.minor], torch.__version__,
                       torch.version.cuda, getattr(triton, "__version__", None), code], sort_keys=True, default=str)
    return where / f"coldstart-{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:32]}.json"


def _read_verdict(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # torn or foreign: judged again and rewritten
        log.warning("ignoring kernel verdict %s (%s); judging again", path, e)
        return None
    return doc if isinstance(doc, dict) else None


def _write_verdict(path: Path, doc: dict) -> None:
    """Atomically (a reader sees the old file, no file, or the whole new one); a directory
    that cannot be written just means judging again at the next start."""
    e = node_cache.write_kept(path, json.dumps(doc, indent=1))
    if e is not None:
        log.info("kernel verdict not kept (%s): the next start judges again", e)


def _cached_gemv_choice(doc: dict | None, names: list[str]
                        ) -> tuple[set[tuple[int, int]], dict[str, dict]] | None:
    try:
        chosen = {(int(n), int(k)) for n, k in doc["chosen"]}  # type: ignore[index]
        report = {name: dict(doc["report"][name], cached=True) for name in names}  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None
    return chosen, report


def gemv_choice(groups: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]], margin: float = 0.02,
                keep: Path | None = None) -> tuple[set[tuple[int, int]], dict[str, dict]]:
    """Which weight shapes a batch-1 decode step should multiply with the Triton GEMV.

    ``groups``: projection name -> its (weight, bias) in every layer. For each, checks the
    GEMV against F.linear on one layer's weight, then times both over all the layers (the
    real weights, so caches behave as in decoding) and picks the GEMV where it is faster by
    more than ``margin``. The weights' values are never read for the verdict (the timing does
    not depend on them). About a millisecond per projection and method. Returns the chosen
    (N, K) shapes and, per projection, the timings or why the GEMV was not usable.

    ``keep``: a directory (``verdict_dir()``) where a verdict without errors is kept and
    found again by the next start with the same shapes on the same kind of GPU and software;
    its report rows then say ``cached``.
    """
    path = None
    if keep is not None and groups:
        w0 = next(iter(groups.values()))[0][0]
        if ops.available(w0.device) and w0.device.type == "cuda":  # (the interpreter's runs are never kept)
            judged = {name: [list(p[0][0].shape), str(p[0][0].dtype), len(p), p[0][1] is not None]
                      for name, p in groups.items()}
            path = verdict_path("gemv", [judged, margin], w0.device, keep)
            found = _cached_gemv_choice(_read_verdict(path), list(groups))
            if found is not None:
                return found
    chosen, report = _time_gemv_choice(groups, margin)
    if path is not None and not any("error" in r for r in report.values()):
        _write_verdict(path, {"chosen": sorted(chosen), "report": report})
    return chosen, report


def _time_gemv_choice(groups: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]], margin: float
                      ) -> tuple[set[tuple[int, int]], dict[str, dict]]:
    chosen: set[tuple[int, int]] = set()
    report: dict[str, dict] = {}
    for name, pairs in groups.items():
        w0, b0 = pairs[0]
        if not ops.available(w0.device):
            report[name] = {"error": "Triton or a CUDA device is not available (or COLDSTART_TRITON=0)"}
            continue
        rnd = _rand(w0.dtype, w0.device)
        x = rnd(1, w0.shape[1])
        # checked on random values of the weight's width, never on the weights themselves: a
        # replica builds its model while the weights' bytes are still arriving. Up to 4096 rows
        # plus the shape's remainder modulo 64, so the kernel's tail handling is covered too
        N, K = w0.shape
        wt = rnd(min(N, 4096 + N % 64), K) * K**-0.5  # outputs of a real layer's size
        bt = None if b0 is None else rnd(wt.shape[0])
        why = _compare(lambda: iter([(name, ops.gemv(x, wt, bt), F.linear(x, wt, bt))]), w0.dtype)
        wt = bt = None  # free it before the timing
        if why:
            report[name] = {"error": why}
            continue
        try:
            ms_torch = graph_ms(lambda: [F.linear(x, w, b) for w, b in pairs], w0.device)
            ms_triton = graph_ms(lambda: [ops._launch_gemv(x, w, b) for w, b in pairs], w0.device)
        except Exception as e:  # noqa: BLE001 - a failed timing just keeps cuBLAS
            report[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        faster = ms_triton < ms_torch * (1 - margin)
        report[name] = {"shape": list(w0.shape), "torch_ms": round(ms_torch, 4), "triton_ms": round(ms_triton, 4),
                        "triton": faster}
        if faster:
            chosen.add(tuple(w0.shape))
    return chosen, report


def _rand(dtype: torch.dtype, device: torch.device | str) -> Callable[..., torch.Tensor]:
    """Seeded standard-normal tensors of ``dtype`` on ``device``, for the self-tests."""
    g = torch.Generator(device=device).manual_seed(0)
    return lambda *shape: torch.randn(shape, device=device, dtype=torch.float32, generator=g).to(dtype)


def _timing(times: dict[str, float] | None, device: torch.device | str) -> Callable[..., Any]:
    """``timed(key, fn, *args)``: ``fn(*args)``, and where ``times`` is a dict, its seconds up to
    the device's completion added to ``times[key]`` (the self-tests' split: Triton's first
    launches against the torch references')."""
    cuda = torch.device(device).type == "cuda"  # (the Triton interpreter runs on the CPU)

    def timed(key: str, fn: Callable[..., Any], *args: Any) -> Any:
        if times is None:
            return fn(*args)
        t = time.perf_counter()
        out = fn(*args)
        if cuda:
            torch.cuda.synchronize(device)
        times[key] = times.get(key, 0.0) + time.perf_counter() - t
        return out
    return timed


def _compare(cases: Callable[[], Iterator[tuple[str, torch.Tensor, torch.Tensor]]], dtype: torch.dtype) -> str | None:
    """Run ``(name, kernel result, torch reference)`` cases; why one failed or disagreed, else None."""
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    try:
        for name, got, want in cases():
            if not torch.allclose(got.float(), want.float(), **tol):
                err = (got.float() - want.float()).abs().max().item()
                return f"{name} differs from the torch reference by up to {err:.3g}"
    except Exception as e:  # noqa: BLE001 - any failure means: don't use the kernels
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _selftest_path(judged: list, device: torch.device | str, keep: Path | None) -> Path | None:
    """Where a self-test's pass is kept: only for a CUDA device (the Triton interpreter's
    runs on the CPU are never kept)."""
    device = torch.device(device)
    return None if keep is None or device.type != "cuda" else verdict_path("selftest", judged, device, keep)


def kept_test(path: Path | None, run: Callable[[], str | None]) -> str | None:
    """``run()``, a self-test (why the kernels are not usable, or None), unless a start before
    this one passed the same test on this node: its verdict, kept at ``path`` (``verdict_path``:
    same GPU model, torch, CUDA, Triton and kernel code), says so. A pass is kept; a failure
    never is (the next start tests again). A torn or foreign file is tested again and rewritten."""
    doc = None if path is None else _read_verdict(path)
    if path is not None and doc is not None and doc.get("passed") is True:
        log.info("kernel self-test passed on this node before (%s): not run again", path.name)
        return None
    why = run()
    if why is None and path is not None:
        _write_verdict(path, {"passed": True})
    return why


def self_test(hidden: int, intermediate: int, n_heads: int, n_kv: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str, times: dict[str, float] | None = None,
              keep: Path | None = None) -> str | None:
    """Run each kernel once at a model's sizes and compare it with the torch reference.

    The first launch compiles a kernel (or takes it from Triton's cache), so this
    is where a missing C compiler or a broken Triton shows up: the caller then
    decodes with torch kernels instead of failing. One-row inputs with the real
    widths hit the same compiled specialisations as a batch-1 decode step.
    Returns why the kernels are not usable, or None when they are. ``times`` (a dict): seconds
    added under "triton" (the kernels) and "torch" (the references), each up to the device's
    completion. ``keep``: a directory (``verdict_dir()``) where a pass is kept, so that the next
    start on this node with the same GPU and software skips the comparison (``kept_test``).
    """
    if not ops.available(device):
        return "Triton or a CUDA device is not available (or COLDSTART_TRITON=0)"
    judged = ["kernels", hidden, intermediate, n_heads, n_kv, head_dim, str(dtype)]
    path = _selftest_path(judged, device, keep)
    timed = _timing(times, device)

    def cases() -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        rnd = _rand(dtype, device)
        x, r, w = rnd(1, hidden), rnd(1, hidden), rnd(hidden)
        yield ("add_rms_norm", timed("triton", ops.add_rms_norm, x, r, w, 1e-5)[0],
               timed("torch", ops._ref_add_rms_norm, x, r, w, 1e-5)[0])
        gu = rnd(1, 2 * intermediate)
        yield "silu_mul", timed("triton", ops.silu_mul, gu), timed("torch", ops._ref_silu_mul, gu)
        qkv, cos, sin = rnd(1, (n_heads + 2 * n_kv) * head_dim), rnd(1, head_dim), rnd(1, head_dim)
        # T=16: the divisibility of a real cache length, so the compiled kernel is the one decode uses
        caches = [torch.zeros(1, n_kv, 16, head_dim, device=device, dtype=dtype) for _ in range(4)]
        pos = torch.tensor([5], device=device)
        yield ("rope_store_kv",
               timed("triton", ops.rope_store_kv, qkv, cos, sin, caches[0], caches[1], pos, n_heads, n_kv, head_dim),
               timed("torch", ops._ref_rope_store_kv, qkv, cos, sin, caches[2], caches[3], pos, n_heads, n_kv,
                     head_dim))
        yield "kv_cache", torch.cat(caches[:2]), torch.cat(caches[2:])

    return kept_test(path, lambda: _compare(cases, dtype))


def attention_self_test(n_heads: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                        device: torch.device | str, times: dict[str, float] | None = None,
                        keep: Path | None = None) -> str | None:
    """As `self_test`, for `decode_attention` at a model's head sizes; None when usable."""
    if not ops.available(device):
        return "Triton or a CUDA device is not available (or COLDSTART_TRITON=0)"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    timed = _timing(times, device)
    judged = ["attention", n_heads, n_kv, head_dim, str(dtype)]
    path = _selftest_path(judged, device, keep)

    def cases() -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        # One row over 512 keys of a longer cache: the kernels are compiled for the model's head
        # sizes and dtype only (not for the lengths and split counts, which are runtime
        # arguments), so this compiles (or loads) exactly what every decode step launches
        rnd = _rand(dtype, device)
        q, kc, vc = rnd(1, n_heads, head_dim), rnd(1, n_kv, 1024, head_dim), rnd(1, n_kv, 1024, head_dim)
        pos = torch.tensor([300], device=device)
        for window in (0, 64):
            yield ("decode_attention", timed("triton", ops.decode_attention, q, kc, vc, pos, 512, window, head_dim**-0.5),
                   timed("torch", ops._ref_decode_attention, q, kc, vc, pos, 512, window, head_dim**-0.5))

    return kept_test(path, lambda: _compare(cases, dtype))
