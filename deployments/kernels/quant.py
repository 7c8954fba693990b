"""Quantized projections' kernels, with their torch references (``WeightSpec`` describes one
layer's stored tensors, in the layouts of ``weights.quant``'s docstring):

- `dequantize`      the weight as a plain [N, K] matrix: the reference every kernel is tested against,
                    and the CPU's path (dequantize, then matmul: a transient copy of one layer);
- `wo_matmul`       weight-only Triton matmul for a decode step's rows (batch 1 up to
                    ``WO_MAX_ROWS``): the stored weight read once, dequantized in registers; one
                    row (batch-1 decode) takes a GEMV on the CUDA cores, more rows a tensor-core
                    tile;
- `dequantize_kernel` `dequantize` in one Triton pass (equal to it bit for bit, no temporaries of
                    the weight's size): the int4 layers' weight for wider batches and prefill,
                    multiplied by cuBLAS;
- `fp8_scaled_mm`   an fp8 tensor-core matmul (``torch._scaled_mm``, Hopper and Ada) for wider
                    batches and prefill: activations quantized per row on the fly, the weight's
                    per-channel (or per-tensor) scale applied by the matmul.

`choose` decides which a model uses, once per node (``policy.kept_test``): each kernel is run on
the model's own layers and compared with `dequantize`; one that fails or disagrees is left out
with a log line, and the layer keeps the dequantize-then-matmul path. Block sizes are fixed from
the shapes (no autotuning: compile time counts at a replica's start)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from deployments.kernels import ops, policy
from weights.quant import AWQ_ORDER, FP8_MAX

if ops.triton is not None:
    from deployments.kernels.quant_jit import _dequant_kernel, _quant_rows_kernel, _wo_gemv_kernel, _wo_matmul_kernel

log = logging.getLogger(__name__)

FP8_TENSOR, FP8_CHANNEL, FP8_BLOCK, AWQ, GPTQ = range(5)
WO_MAX_ROWS = 128  # rows up to which the weight-only kernel runs (a decode step's batch); wider: dequantize
WO_SMALL_ROWS = 16  # rows up to which its tiles take 16 rows (the tensor cores' least), 64 beyond; and
# past which fp8's _scaled_mm runs instead, where it passed its test (bench/kernel_sweep.py --only quant)


@dataclass
class WeightSpec:
    """One quantized layer's stored tensors (views of the loaded buffer) and how to read them."""

    scheme: int  # FP8_TENSOR .. GPTQ
    n: int  # out_features
    k: int  # in_features
    q: torch.Tensor  # fp8 weight [N, K]; AWQ qweight [K, N/8]; GPTQ qweight [K/8, N]
    s: torch.Tensor  # fp8: weight_scale [N, 1] / [1] or weight_scale_inv [N/bn, K/bk]; int4: scales [K/G, N]
    z: torch.Tensor | None = None  # int4 qzeros [K/G, N/8]
    g_idx: torch.Tensor | None = None  # GPTQ: each input row's group [K]
    group: int = 0  # int4: input rows per group
    block: tuple[int, int] = (0, 0)  # FP8_BLOCK: (rows, columns) per scale
    zero_offset: int = 0  # GPTQ checkpoint_format "gptq": stored zero points lack 1


@dataclass
class QuantKernels:
    """Which kernels a quantized model's layers run (all False: dequantize, then matmul)."""

    weight_only: bool = False
    scaled_mm: bool = False
    seconds: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        used = [n for n, on in (("Triton weight-only", self.weight_only), ("fp8 _scaled_mm", self.scaled_mm)) if on]
        if not used:
            return "dequantize + matmul"
        wide = "Triton dequantize + matmul" if self.weight_only else "dequantize + matmul"
        return ", ".join(used) + f" (else {wide})"


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """The inverse of ``weights.quant.pack_int4``: int32 words -> eight values (0..15, int32)
    each along ``dim``, element 8 j + order[i] from nibble i of word j. Only device work (shifts by
    Python ints): a host tensor (an index list, a table of shifts) would be copied to the device at
    each call, which a CUDA graph's capture refuses (the dequantize path of a decode step wider
    than ``WO_MAX_ROWS`` runs in one)."""
    inv = [0] * 8
    for i, j in enumerate(order):
        inv[j] = i
    x = packed.movedim(dim, -1)
    nib = torch.stack([(x >> (4 * i)) & 0xF for i in inv], dim=-1)  # [..., words, 8] in element order
    return nib.reshape(*x.shape[:-1], -1).movedim(-1, dim)


def _groups(spec: WeightSpec) -> torch.Tensor:
    if spec.g_idx is not None:
        return spec.g_idx.long()
    return torch.arange(spec.k, device=spec.q.device) // spec.group


def dequantize(spec: WeightSpec, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in ``dtype``, computed in fp32 and rounded once."""
    if spec.scheme in (FP8_TENSOR, FP8_CHANNEL):
        return (spec.q.float() * spec.s.float().reshape(-1, 1)).to(dtype)
    if spec.scheme == FP8_BLOCK:
        bn, bk = spec.block
        s = spec.s.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        return (spec.q.float() * s[: spec.n, : spec.k]).to(dtype)
    g = _groups(spec)
    if spec.scheme == AWQ:
        q, z = unpack_int4(spec.q, 1, AWQ_ORDER), unpack_int4(spec.z, 1, AWQ_ORDER)[g]  # [K, N]
    else:
        q, z = unpack_int4(spec.q, 0), unpack_int4(spec.z, 1)[g] + spec.zero_offset
    return ((q - z).float() * spec.s.float()[g]).t().to(dtype)


def _ref_wo_matmul(x: torch.Tensor, spec: WeightSpec, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, dequantize(spec, x.dtype), bias)


class WoBlocks(NamedTuple):
    """How the weight-only kernel tiles a layer (and the one-pass dequantize: n, k, tile, warps)."""

    m: int  # BLOCK_M: rows of x per program (16: the tensor cores' least)
    n: int  # BLOCK_N: output columns per program
    k: int  # BLOCK_K: input rows per step
    tile: bool  # GROUP_TILE: a step's rows lie in one int4 group (one row of scales and zero points)
    warps: int = 4
    stages: int | None = None  # Triton's software pipelining depth (None: its default)


def _wo_blocks(spec: WeightSpec, rows: int = 1) -> WoBlocks:
    """16 rows a tile up to ``WO_SMALL_ROWS`` rows, 64 beyond (at 64 and 128 rows 2.2-3.1 times
    faster than 16, whose tiles each dequantize the weight again); column tiles of 32 for fp8 and
    64 for int4 (the fastest at one row for each of the 7B's shapes: ``bench/kernel_sweep.py
    --only quant``); for int4 groups of a power of two (no act-order), steps no taller than a
    group, so that each reads one row of scales and zero points instead of one per element."""
    bk = max(16, min(128, 1 << (spec.k - 1).bit_length()))
    int4 = spec.scheme in (AWQ, GPTQ)
    tile = int4 and spec.g_idx is None and spec.group >= 16 and not spec.group & (spec.group - 1)
    return WoBlocks(16 if rows <= WO_SMALL_ROWS else 64, 64 if int4 else 32, min(bk, spec.group) if tile else bk,
                    tile)


def _stored(spec: WeightSpec, b: WoBlocks) -> tuple[tuple, tuple, dict]:
    """How both kernels take a layer's stored weight: its tensors (Q, S, Z, GI; a scheme without
    zero points or g_idx passes Q there, never read), its layout's scalars (stride_q, stride_s,
    stride_z, group, bn, bk, zero_offset) and its constexprs (with ``b``'s launch options)."""
    z = spec.z if spec.z is not None else spec.q
    gi = spec.g_idx if spec.g_idx is not None else spec.q
    layout = (spec.q.stride(0), spec.s.stride(0) if spec.s.dim() == 2 else 0, z.stride(0) if z.dim() == 2 else 0,
              max(spec.group, 1), max(spec.block[0], 1), max(spec.block[1], 1), spec.zero_offset)
    consts = {"SCHEME": spec.scheme, "HAS_GIDX": spec.g_idx is not None, "GROUP_TILE": b.tile,
              "BLOCK_N": b.n, "BLOCK_K": b.k, "num_warps": b.warps}
    if b.stages is not None:
        consts["num_stages"] = b.stages
    return (spec.q, spec.s, z, gi), layout, consts


class GemvBlocks(NamedTuple):
    """How the one-row GEMV tiles a layer."""

    n: int  # BLOCK_N: outputs per program (int4: a multiple of 8, a word's columns)
    k: int  # BLOCK_K: input rows per unrolled step (int4 groups of a power of two: at most a group)
    warps: int = 4
    per_sm: int = 4  # K is cut into parts until there are about this many programs per multiprocessor


def _gemv_blocks(spec: WeightSpec) -> GemvBlocks:
    """fp8 [N, K] rows are contiguous along K: few outputs a program, long steps along K, as the
    fp16 GEMV (``ops._gemv_blocks``); int4 words hold 8 columns (AWQ) or 8 rows (GPTQ) of a
    [K, N]-major layout: wide column tiles (AWQ 64, GPTQ 128: the least time over the 7B's three
    shapes in ``bench/kernel_sweep.py --only quant``), steps no taller than a group."""
    b = _wo_blocks(spec)
    if spec.scheme in (AWQ, GPTQ):
        return GemvBlocks(64 if spec.scheme == AWQ else 128, b.k if b.tile else 64, 4, 4)
    return GemvBlocks(2, max(16, min(1024, 1 << (spec.k - 1).bit_length())), 4, 4)


GEMV_STEPS = 32  # unrolled steps a GEMV program takes at most (K is cut into more parts beyond)
_SMS: dict[int, int] = {}


def _split_k(programs: int, k_tiles: int, device: torch.device, per_sm: int = 4, least: int = 2) -> int:
    """Into how many parts the weight-only kernels cut K: enough programs for about ``per_sm`` per
    multiprocessor (a decode step's few rows over a narrow layer leave most of the GPU idle), each
    part at least ``least`` tiles."""
    if device.type == "cuda":
        i = device.index if device.index is not None else torch.cuda.current_device()
        if i not in _SMS:
            _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
        sms = _SMS[i]
    else:
        sms = 2  # (the Triton interpreter: the split's path is exercised on small layers)
    return max(1, min(16, per_sm * sms // programs, k_tiles // least))


_COUNTERS: dict[str, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeros (int32) on ``device``, one per output tile of a split launch: the
    kernels count a tile's finished parts there and set it back to 0 (``quant_jit._store_out``).
    Made once per device, by `choose` before any graph's capture; the launches of one device run
    in one stream at a time (the engine's loop), so one array serves them all."""
    key = str(device)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        c = _COUNTERS[key] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return c


def _parts(x: torch.Tensor, split: int, rows: int, n: int) -> torch.Tensor:
    """The fp32 workspace of a split launch's parts (unused where ``split`` is 1)."""
    return torch.empty((split, rows, n) if split > 1 else (1,), dtype=torch.float32, device=x.device)


def _launch_wo_matmul(x: torch.Tensor, spec: WeightSpec, bias: torch.Tensor | None,
                      blocks: WoBlocks | None = None) -> torch.Tensor:
    x2 = x.reshape(-1, spec.k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    b = blocks or _wo_blocks(spec, M)
    bm, bn, bk = b.m, b.n, b.k
    grid_n, grid_m, k_tiles = ops.triton.cdiv(spec.n, bn), ops.triton.cdiv(M, bm), ops.triton.cdiv(spec.k, bk)
    split = _split_k(grid_n * grid_m, k_tiles, x.device)
    k_split = ops.triton.cdiv(k_tiles, split) * bk
    split = ops.triton.cdiv(spec.k, k_split)  # (no part left empty)
    y = torch.empty((M, spec.n), dtype=x.dtype, device=x.device)
    tensors, layout, consts = _stored(spec, b)
    _wo_matmul_kernel[(grid_n, grid_m, split)](
        x2, *tensors, bias if bias is not None else x2, y, _parts(x, split, M, spec.n),
        _counters(x.device, grid_n * grid_m), M, spec.n, spec.k, x2.stride(0), *layout,
        k_split, **consts, HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=bm)
    return y.view(*x.shape[:-1], spec.n)


def _launch_wo_gemv(x: torch.Tensor, spec: WeightSpec, bias: torch.Tensor | None,
                    blocks: GemvBlocks | None = None) -> torch.Tensor:
    """One row x [..., K] (every leading dim 1) @ W^T (+ bias) with the GEMV."""
    x1 = x.reshape(spec.k)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    g = blocks or _gemv_blocks(spec)
    tile = _wo_blocks(spec)._replace(n=g.n, k=g.k, warps=g.warps, stages=None)
    if tile.tile and spec.group % g.k or spec.scheme in (AWQ, GPTQ) and g.n % 8:
        raise ValueError(f"GEMV blocks {g}: an int4 step must lie in one group of {spec.group} rows and "
                         "cover whole words (BLOCK_N a multiple of 8)")
    grid_n, k_tiles = ops.triton.cdiv(spec.n, g.n), ops.triton.cdiv(spec.k, g.k)
    # (the compile's time and the code grow with the unrolled steps)
    split = max(_split_k(grid_n, k_tiles, x.device, g.per_sm, least=1), ops.triton.cdiv(k_tiles, GEMV_STEPS))
    k_part = ops.triton.cdiv(k_tiles, split) * g.k
    split = ops.triton.cdiv(spec.k, k_part)  # (no part left empty)
    y = torch.empty(spec.n, dtype=x.dtype, device=x.device)
    tensors, layout, consts = _stored(spec, tile)
    _wo_gemv_kernel[(grid_n, split)](
        x1, *tensors, bias if bias is not None else x1, y, _parts(x, split, 1, spec.n), _counters(x.device, grid_n),
        spec.n, spec.k, *layout, **consts, HAS_BIAS=bias is not None, SPLIT=split, K_PART=k_part)
    return y.view(*x.shape[:-1], spec.n)


def wo_matmul(x: torch.Tensor, spec: WeightSpec, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with the weight-only kernel; the reference where Triton does not run."""
    if x.shape[-1] != spec.k:
        raise ValueError(f"wo_matmul: x has {x.shape[-1]} columns, the layer takes {spec.k}")
    if not ops.available(x.device):
        return _ref_wo_matmul(x, spec, bias)
    if x.numel() == spec.k:
        return _launch_wo_gemv(x, spec, bias)
    return _launch_wo_matmul(x, spec, bias)


def dequantize_kernel(spec: WeightSpec, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize`'s weight [N, K] in ``dtype`` through one Triton pass (the same fp32 products,
    rounded once); `dequantize` itself where Triton does not run."""
    if not ops.available(spec.q.device):
        return dequantize(spec, dtype)
    w = torch.empty((spec.n, spec.k), dtype=dtype, device=spec.q.device)
    b = _wo_blocks(spec)
    tensors, layout, consts = _stored(spec, b)
    _dequant_kernel[(ops.triton.cdiv(spec.n, b.n), ops.triton.cdiv(spec.k, b.k))](
        *tensors, w, spec.n, spec.k, *layout, **consts)
    return w


def _quantize_rows(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [M, K] as float8_e4m3fn, its per-row scale [M, 1] fp32): dynamic per-token quantisation;
    ``rows`` (at least M): the result padded with zero rows of scale 1 to that many. One Triton
    pass where Triton runs (the same values)."""
    M, K = x.shape
    rows = M if rows is None else rows
    if ops.available(x.device):
        xq = torch.empty((rows, K), dtype=torch.float8_e4m3fn, device=x.device)
        xs = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
        if x.stride(1) != 1:
            x = x.contiguous()
        _quant_rows_kernel[(rows,)](x, xq, xs, M, K, x.stride(0), FP8_MAX=FP8_MAX,
                                    BLOCK_K=min(4096, ops.triton.next_power_of_2(K)))
        return xq, xs
    if rows > M:
        x = F.pad(x, (0, 0, 0, rows - M))
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    if rows > M:
        scale[M:] = 1.0
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_scaled_mm(x: torch.Tensor, spec: WeightSpec, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) on fp8 tensor cores: rows quantized per token, the weight's
    per-channel (or per-tensor, broadcast) scales applied row-wise by ``torch._scaled_mm``. Rows
    are padded to a multiple of 16 (its kernels' requirement) by the quantisation itself."""
    x2 = x.reshape(-1, spec.k)
    M = x2.shape[0]
    xq, xs = _quantize_rows(x2, M + (-M % 16))
    ws = spec.s.float().reshape(1, -1).expand(1, spec.n).contiguous()
    y = torch._scaled_mm(xq, spec.q.t(), scale_a=xs, scale_b=ws, out_dtype=x.dtype,
                         bias=bias.to(x.dtype) if bias is not None else None)
    return y[:M].view(*x.shape[:-1], spec.n)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()


def synthetic(spec: WeightSpec, seed: int = 0) -> WeightSpec:
    """A layer of ``spec``'s scheme, shape and dtypes with random contents (valid scales, groups and
    fp8 values): what the self-tests run on, since a model built over a buffer still loading has
    no weights yet, and unloaded bytes may hold fp8 NaNs."""
    dev = spec.q.device
    g = torch.Generator(device=dev).manual_seed(seed)

    def words(t: torch.Tensor) -> torch.Tensor:
        return torch.randint(-2**31, 2**31, t.shape, device=dev, generator=g, dtype=torch.int64).to(torch.int32)
    if spec.q.dtype == torch.float8_e4m3fn:
        q = (torch.randn(spec.q.shape, device=dev, generator=g) * 16).to(torch.float8_e4m3fn)
    else:
        q = words(spec.q)
    s = (torch.rand(spec.s.shape, device=dev, generator=g) * 0.01 + 0.001).to(spec.s.dtype)
    g_idx = None
    if spec.g_idx is not None:
        g_idx = (torch.randperm(spec.k, device=dev, generator=g) // spec.group).to(torch.int32)
    return WeightSpec(spec.scheme, spec.n, spec.k, q, s, None if spec.z is None else words(spec.z), g_idx,
                      spec.group, spec.block, spec.zero_offset)


def choose(specs: dict[str, WeightSpec], dtype: torch.dtype, device: torch.device) -> QuantKernels:
    """The kernels a model whose quantized layers are ``specs`` (one per distinct shape, by a
    name for the log) uses on ``device``: each run on a `synthetic` layer of every spec at 1, 5 and
    100 rows (the weight-only kernel: its GEMV, and its 16- and 64-row tiles, each with a partial
    tile) or 48 rows (``_scaled_mm``) and compared with `dequantize`'s product; a pass is kept per
    node (``policy.kept_test``). Never raises."""
    plan = QuantKernels()
    if not specs or not ops.available(device):
        return plan
    _counters(device, 0)
    where = policy.verdict_dir()
    shapes = sorted((s.scheme, s.n, s.k, s.group, list(s.block), s.g_idx is not None) for s in specs.values())
    t = time.perf_counter()
    why = policy.kept_test(policy._selftest_path(["quant-wo", "dequantize", shapes, str(dtype)], device, where),
                           lambda: _test(specs, dtype, device, wo_matmul, (1, 5, 100), 2e-2)
                           or _test_dequantize(specs, dtype))
    plan.weight_only = why is None
    plan.seconds["quant_kernel_test"] = time.perf_counter() - t
    if why:
        log.warning("Triton weight-only kernel off (%s): quantized layers dequantize, then multiply", why)
    fp8 = all(s.scheme in (FP8_TENSOR, FP8_CHANNEL) for s in specs.values())
    if fp8 and dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(device) >= (8, 9):
        t = time.perf_counter()
        # activations quantized per row: a few percent of the output's range, not the kernels' rounding
        why = policy.kept_test(policy._selftest_path(["quant-scaled-mm", shapes, str(dtype)], device, where),
                               lambda: _test(specs, dtype, device, fp8_scaled_mm, (48,), 6e-2))
        plan.scaled_mm = why is None
        plan.seconds["scaled_mm_test"] = time.perf_counter() - t
        if why:
            log.warning("fp8 _scaled_mm off (%s): wide batches dequantize, then multiply", why)
    return plan


def _test_dequantize(specs: dict[str, WeightSpec], dtype: torch.dtype) -> str | None:
    """`dequantize_kernel` against `dequantize` on a `synthetic` layer of each spec: equal bit for bit."""
    try:
        for name, spec in specs.items():
            spec = synthetic(spec)
            if not torch.equal(dequantize_kernel(spec, dtype), dequantize(spec, dtype)):
                return f"dequantize_kernel on {name} differs from dequantize"
    except Exception as e:  # noqa: BLE001 - any failure means: don't use the kernel
        return f"dequantize_kernel: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _test(specs: dict[str, WeightSpec], dtype: torch.dtype, device: torch.device, fn, rows: tuple[int, ...],
          tol: float) -> str | None:
    g = torch.Generator(device=device).manual_seed(0)
    try:
        for name, spec in specs.items():
            spec = synthetic(spec)
            for m in rows:
                x = torch.randn(m, spec.k, device=device, generator=g).to(dtype)
                err = _relative_error(fn(x, spec, None), _ref_wo_matmul(x, spec, None))
                if not err <= tol:
                    return f"{fn.__name__} on {name} ({m} rows) differs from the reference by {err:.3g} of its range"
    except Exception as e:  # noqa: BLE001 - any failure means: don't use the kernel
        return f"{fn.__name__}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None
