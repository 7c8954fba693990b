"""Block-size sweep of the decode kernels that read the most memory, against torch's.

    python bench/kernel_sweep.py --out OUT/kernel-sweep.json

GEMV (`deployments.kernels.ops._launch_gemv`, batch 1) for each projection shape of a
Llama-2-7B against cuBLAS (`F.linear`), and the flash-decoding attention
(`_launch_decode_attention`) against the batched matmuls + softmax the model uses
where it is off; and the attention over a paged cache (block sizes 16 and 32, through a
shuffled block table) beside the same keys in the static cache; and a 128-row decode step's
parts (``--only wide``); and the quantized layers' kernels (``--only quant``: AWQ and GPTQ
int4, fp8 per channel, at 1 to 128 rows: the one-row GEMV's `kernels.quant.GemvBlocks`
variants, the weight-only tile, the dequantize + cuBLAS and fp8's `_scaled_mm`) against cuBLAS
on the fp16 weight. Each figure is one CUDA
graph over 32 distinct weight matrices / KV caches (one per layer, so the L2 cache does not
hold them), the best of 5 replays. Random fp16 data; nothing is loaded. Prints and writes
the best block sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.meta import stamp  # noqa: E402
from deployments.kernels import ops, policy  # noqa: E402
from deployments.model.attention import matmul_decode_attention  # noqa: E402

LAYERS = 32
# (name, N, K, copies): the 7B's batch-1 products; lm_head once per step
GEMV_SHAPES = [("qkv", 12288, 4096, LAYERS), ("o_proj", 4096, 4096, LAYERS), ("gate_up", 22016, 4096, LAYERS),
               ("down_proj", 4096, 11008, LAYERS), ("lm_head", 32000, 4096, 4)]
GEMV_BLOCKS = [(bn, bk, w) for bn in (1, 2, 4, 8) for bk in (256, 512, 1024) for w in (4, 8)] + \
              [(16, 256, 8), (16, 512, 8), (2, 2048, 8), (1, 2048, 4), (4, 128, 2), (8, 128, 4)]
# (name, B, n_heads, n_kv, kv_len, spread): every row at position kv_len - 1, or (spread) rows
# evenly from kv_len / B to kv_len, as a batch of sequences of different lengths in one bucket
ATTN_CASES = [("mha-b1-L512", 1, 32, 32, 512, False), ("mha-b1-L2048", 1, 32, 32, 2048, False),
              ("mha-b2-L2048", 2, 32, 32, 2048, False), ("mha-b4-L2048", 4, 32, 32, 2048, False),
              ("mha-b16-L512", 16, 32, 32, 512, False), ("mha-b16-L2048", 16, 32, 32, 2048, False),
              ("mha-b16-spread-L4096", 16, 32, 32, 4096, True),
              ("gqa-b1-L2048", 1, 32, 8, 2048, False), ("gqa-b16-L2048", 16, 32, 8, 2048, False),
              ("gqa-b16-spread-L4096", 16, 32, 8, 4096, True)]
# (block_n, num_warps, target, num_stages)
ATTN_CONFIGS = [(bn, w, t, st) for bn in (32, 64, 128) for w in (4, 8) for t in (264, 528) for st in (2, 3, 4)]
T_CACHE = 4096  # every cache this long: a graph per batch size launches with kv_len = the whole cache
PAGED_BLOCK_SIZES = (16, 32)

def graph_ms(fn, replays: int = 5) -> float:
    return policy.graph_ms(fn, "cuda", replays)


def try_configs(configs, tag, once, every, want) -> tuple[list[dict], dict]:
    """Each config: ``once(cfg)`` on one layer checked against ``want`` (max abs error), then
    ``every(cfg)`` over all the layers timed as one graph. A config that does not compile is a
    result too. Returns the rows (``tag(cfg)`` plus ms / max_err, or error) and the fastest."""
    rows = []
    for cfg in configs:
        try:
            err = (once(cfg).float() - want.float()).abs().max().item()
            rows.append({**tag(cfg), "ms": graph_ms(lambda: every(cfg)), "max_err": err})
        except Exception as e:  # noqa: BLE001
            rows.append({**tag(cfg), "error": f"{type(e).__name__}: {e}"[:200]})
    return rows, min((r for r in rows if "ms" in r), key=lambda r: r["ms"])


def sweep_gemv(dtype: torch.dtype) -> dict:
    out = {}
    for name, N, K, copies in GEMV_SHAPES:
        ws = [torch.randn(N, K, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
        x = torch.randn(1, K, device="cuda", dtype=dtype)
        gb = copies * N * K * ws[0].element_size() / 1e9
        want = F.linear(x.float(), ws[0].float()).to(dtype)
        r = {"N": N, "K": K, "copies": copies, "GB": gb}
        ms = graph_ms(lambda: [F.linear(x, w) for w in ws])
        r["cublas"] = {"ms": ms, "GBps": gb / ms * 1e3}
        r["triton"], best = try_configs(
            GEMV_BLOCKS, lambda b: {"blocks": b}, lambda b: ops._launch_gemv(x, ws[0], None, b),
            lambda b: [ops._launch_gemv(x, w, None, b) for w in ws], want)
        for t in r["triton"]:
            if "ms" in t:
                t["GBps"] = gb / t["ms"] * 1e3
        r["best"] = best
        print(f"gemv {name:10s} {N:6d}x{K:<6d} cuBLAS {r['cublas']['ms'] / copies * 1e3:7.1f} us "
              f"{r['cublas']['GBps']:6.0f} GB/s | best Triton {best['blocks']} {best['ms'] / copies * 1e3:7.1f} us "
              f"{best['GBps']:6.0f} GB/s", flush=True)
        out[name] = r
        ws.clear()
        torch.cuda.empty_cache()
    # one block config for every shape: the one with the least total time
    totals = {}
    for blocks in GEMV_BLOCKS:
        ts = [next((t["ms"] for t in out[n]["triton"] if t["blocks"] == blocks and "ms" in t), None)
              for n, *_ in GEMV_SHAPES]
        if None not in ts:
            # per decode step: the layers' products plus one lm_head
            totals[str(blocks)] = sum(t / c * (1 if n == "lm_head" else LAYERS)
                                      for t, (n, _, _, c) in zip(ts, GEMV_SHAPES))
    step = {"cublas_ms": sum(out[n]["cublas"]["ms"] / c * (1 if n == "lm_head" else LAYERS)
                             for n, _, _, c in GEMV_SHAPES),
            "best_per_shape_ms": sum(min(out[n]["cublas"]["ms"], out[n]["best"]["ms"]) / c
                                     * (1 if n == "lm_head" else LAYERS) for n, _, _, c in GEMV_SHAPES),
            "one_config_ms": totals, "best_one_config": min(totals, key=totals.get)}
    print(f"gemv per step: cuBLAS {step['cublas_ms']:.3f} ms, best of both per shape "
          f"{step['best_per_shape_ms']:.3f} ms, best single Triton config {step['best_one_config']} "
          f"{totals[step['best_one_config']]:.3f} ms", flush=True)
    return {"shapes": out, "step": step}


def attention_case(B: int, H: int, n_kv: int, L: int, spread: bool, Dh: int, dtype: torch.dtype
                   ) -> tuple[list, torch.Tensor, torch.Tensor]:
    """One attention case's static caches (one per layer), queries and positions: every row at
    L - 1, or (spread) rows spread evenly up to it."""
    caches = [(torch.randn(B, n_kv, T_CACHE, Dh, device="cuda", dtype=dtype),
               torch.randn(B, n_kv, T_CACHE, Dh, device="cuda", dtype=dtype)) for _ in range(LAYERS)]
    q = torch.randn(B, H, Dh, device="cuda", dtype=dtype)
    pos = (torch.tensor([L * (i + 1) // B - 1 for i in range(B)], device="cuda") if spread
           else torch.full((B,), L - 1, device="cuda", dtype=torch.int64))
    return caches, q, pos


def sweep_attention(dtype: torch.dtype) -> dict:
    """Per case: the batched matmuls reading up to kv_len (the bucket), the Triton attention
    at each config with kv_len, and its defaults again with kv_len = the whole cache (one
    graph per batch size: each row still reads only up to its position). (The sweep that
    chose tensor-core dots for one query head per kv head too, against the CUDA-core dots
    the kernel had for those: `git show 2adce49^:bench/results/runs/attention-sweep-v1.json`.)"""
    out = {}
    Dh = 128
    for name, B, H, n_kv, L, spread in ATTN_CASES:
        caches, q, pos = attention_case(B, H, n_kv, L, spread, Dh, dtype)
        keys = torch.arange(L, device="cuda")
        mask = torch.zeros(B, L, device="cuda", dtype=dtype).masked_fill_(keys[None, :] > pos[:, None], float("-inf"))
        mask = mask[:, None, None].expand(B, n_kv, H // n_kv, L).reshape(-1, H // n_kv, L)
        scale = Dh ** -0.5
        want = ops._ref_decode_attention(q, *caches[0], pos, L, 0, scale)

        def launch(k, v, c, kv_len=L):
            return ops._launch_decode_attention(q, k, v, pos, kv_len, 0, scale, *c)

        r = {"torch_ms": graph_ms(lambda: [matmul_decode_attention(q, k[:, :, :L], v[:, :, :L], mask, scale)
                                             for k, v in caches])}
        rows, best = try_configs(
            ATTN_CONFIGS, lambda c: dict(zip(("block_n", "warps", "target", "stages"), c)),
            lambda c: launch(*caches[0], c), lambda c: [launch(k, v, c) for k, v in caches], want)
        r.update(triton=rows, best=best, default_ms=graph_ms(lambda: [launch(k, v, ()) for k, v in caches]),
                 default_whole_cache_ms=graph_ms(lambda: [launch(k, v, (), T_CACHE) for k, v in caches]),
                 whole_cache_max_err=(launch(*caches[0], (), T_CACHE).float() - want.float()).abs().max().item())
        print(f"attn {name:22s} torch {r['torch_ms'] / LAYERS * 1e3:7.1f} us/layer | Triton default "
              f"{r['default_ms'] / LAYERS * 1e3:6.1f}, whole cache {r['default_whole_cache_ms'] / LAYERS * 1e3:6.1f}, "
              f"best {best['block_n']}/{best['warps']}/{best['target']}/{best['stages']} "
              f"{best['ms'] / LAYERS * 1e3:6.1f}", flush=True)
        out[name] = r
        caches.clear()
        torch.cuda.empty_cache()
    return out


def to_paged(k: torch.Tensor, block_size: int, table: torch.Tensor) -> torch.Tensor:
    """A static cache [B, n_kv, T, Dh] as a paged one [1 + B * T / block_size, n_kv, block_size, Dh]:
    row b's block j in block table[b, j]; block 0 (the null block) zeros."""
    B, n_kv, T, Dh = k.shape
    paged = torch.zeros(1 + B * (T // block_size), n_kv, block_size, Dh, device=k.device, dtype=k.dtype)
    paged[table.long()] = k.view(B, n_kv, T // block_size, block_size, Dh).transpose(1, 2)
    return paged


def sweep_paged_attention(dtype: torch.dtype) -> dict:
    """Per case of the attention sweep: the Triton attention at its defaults over the static
    caches (and with its key blocks as short as the paged one's, BLOCK_N = block_size), and
    over the same keys in paged caches of each block size, through one shuffled block table
    (every layer's), with kv_len and with kv_len = the whole cache."""
    out = {}
    Dh = 128
    for name, B, H, n_kv, L, spread in ATTN_CASES:
        caches, q, pos = attention_case(B, H, n_kv, L, spread, Dh, dtype)
        scale = Dh ** -0.5
        want = ops._ref_decode_attention(q, *caches[0], pos, L, 0, scale)

        def launch(k, v, kv_len=L, block_n=None, table=None):
            return ops._launch_decode_attention(q, k, v, pos, kv_len, 0, scale, block_n, block_table=table)

        r = {"static_ms": graph_ms(lambda: [launch(k, v) for k, v in caches])}
        line = f"paged {name:22s} static {r['static_ms'] / LAYERS * 1e3:6.1f} us/layer"
        for bs in PAGED_BLOCK_SIZES:
            nb = T_CACHE // bs
            table = (1 + torch.randperm(B * nb, device="cuda")).view(B, nb).to(torch.int32)
            pages = [(to_paged(k, bs, table), to_paged(v, bs, table)) for k, v in caches]
            r[f"bs{bs}"] = b = {
                "static_block_n_ms": graph_ms(lambda: [launch(k, v, block_n=bs) for k, v in caches]),
                "paged_ms": graph_ms(lambda: [launch(k, v, table=table) for k, v in pages]),
                "paged_whole_cache_ms": graph_ms(lambda: [launch(k, v, T_CACHE, table=table) for k, v in pages]),
                "max_err": (launch(*pages[0], table=table).float() - want.float()).abs().max().item(),
                "whole_cache_max_err": (launch(*pages[0], T_CACHE, table=table).float()
                                        - want.float()).abs().max().item()}
            line += (f" | bs {bs}: paged {b['paged_ms'] / LAYERS * 1e3:6.1f}, whole cache "
                     f"{b['paged_whole_cache_ms'] / LAYERS * 1e3:6.1f}, static at BLOCK_N {bs} "
                     f"{b['static_block_n_ms'] / LAYERS * 1e3:6.1f}")
            pages.clear()
            torch.cuda.empty_cache()
        print(line, flush=True)
        out[name] = r
        caches.clear()
        torch.cuda.empty_cache()
    return out


def sweep_wide(dtype: torch.dtype, B: int = 128) -> dict:
    """Where a decode step of ``B`` rows spends its device time: each projection of the 7B at B
    rows through cuBLAS (its layers' distinct weights), and the paged attention of B rows at
    positions spread over 128..255 (a 128-token prompt's 128 new tokens, the engine benchmark's
    load) through a shuffled block table of 16-position blocks, at the defaults and at each
    config of the attention sweep; with the GB each reads and the rate."""
    out: dict = {"rows": B, "gemm": {}}
    total = 0.0
    default = torch.backends.cuda.preferred_blas_library()
    for name, N, K, copies in GEMV_SHAPES:
        ws = [torch.randn(N, K, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
        x = torch.randn(B, K, device="cuda", dtype=dtype)
        gb = copies * N * K * ws[0].element_size() / 1e9
        for lib in ("cublas", "cublaslt"):  # torch's default library, and cuBLASLt's own choice of kernel
            torch.backends.cuda.preferred_blas_library(lib)
            ms = graph_ms(lambda: [F.linear(x, w) for w in ws])
            per_step = ms / copies * (1 if name == "lm_head" else LAYERS)
            key = name if lib == "cublas" else f"{name}-{lib}"
            out["gemm"][key] = {"N": N, "K": K, "ms_per_step": per_step, "GBps": gb / ms * 1e3}
            total += per_step if lib == "cublas" else 0.0
            print(f"wide gemm {key:18s} {N:6d}x{K:<6d} {per_step:7.3f} ms/step {gb / ms * 1e3:6.0f} GB/s", flush=True)
        torch.backends.cuda.preferred_blas_library(default)
        ws.clear()
        torch.cuda.empty_cache()
    out["gemm_ms_per_step"] = total
    H = n_kv = 32
    Dh, bs, T = 128, 16, 256
    pos = torch.tensor([128 + (128 * i) // B for i in range(B)], device="cuda")
    nb = T // bs
    table = (1 + torch.randperm(B * nb, device="cuda")).view(B, nb).to(torch.int32)
    pages = [(torch.randn(1 + B * nb, n_kv, bs, Dh, device="cuda", dtype=dtype),
              torch.randn(1 + B * nb, n_kv, bs, Dh, device="cuda", dtype=dtype)) for _ in range(LAYERS)]
    q = torch.randn(B, H, Dh, device="cuda", dtype=dtype)
    scale = Dh ** -0.5
    read_gb = LAYERS * 2 * int((pos + 1).sum()) * n_kv * Dh * 2 / 1e9

    def launch(k, v, c=()):
        return ops._launch_decode_attention(q, k, v, pos, T, 0, scale, *c, block_table=table)

    want = launch(*pages[0])
    out["attention_read_gb"] = read_gb
    out["attention_default_ms"] = graph_ms(lambda: [launch(k, v) for k, v in pages])
    rows, best = try_configs(ATTN_CONFIGS, lambda c: dict(zip(("block_n", "warps", "target", "stages"), c)),
                             lambda c: launch(*pages[0], c), lambda c: [launch(k, v, c) for k, v in pages], want)
    out["attention"], out["attention_best"] = rows, best
    print(f"wide attention {read_gb:.2f} GB: default {out['attention_default_ms']:.3f} ms "
          f"({read_gb / out['attention_default_ms'] * 1e3:.0f} GB/s), best {best['block_n']}/{best['warps']}/"
          f"{best['target']}/{best['stages']} {best['ms']:.3f} ms ({read_gb / best['ms'] * 1e3:.0f} GB/s); "
          f"projections {total:.3f} ms", flush=True)
    pages.clear()
    torch.cuda.empty_cache()
    return out


QUANT_SHAPES = [("qkv_o", 4096, 4096), ("gate_up", 11008, 4096), ("down", 4096, 11008)]
QUANT_COPIES = 32  # distinct layers per graph, as many as the 7B has (the L2 cache holds none)


def _quant_layer(scheme: str, N: int, K: int, seed: int):
    from deployments.kernels import quant as qk
    d, G = "cuda", 128
    if scheme == "fp8":
        t = qk.WeightSpec(qk.FP8_CHANNEL, N, K, torch.empty(N, K, device=d, dtype=torch.float8_e4m3fn),
                          torch.empty(N, 1, device=d))
    elif scheme == "awq":
        t = qk.WeightSpec(qk.AWQ, N, K, torch.empty(K, N // 8, device=d, dtype=torch.int32),
                          torch.empty(K // G, N, device=d, dtype=torch.float16),
                          torch.empty(K // G, N // 8, device=d, dtype=torch.int32), group=G)
    else:
        t = qk.WeightSpec(qk.GPTQ, N, K, torch.empty(K // 8, N, device=d, dtype=torch.int32),
                          torch.empty(K // G, N, device=d, dtype=torch.float16),
                          torch.empty(K // G, N // 8, device=d, dtype=torch.int32), group=G, zero_offset=1)
    return qk.synthetic(t, seed)


def _gemv_variants(spec) -> list:
    """The one-row GEMV's default blocks first, then the grid around it."""
    from deployments.kernels import quant as qk
    base = qk._gemv_blocks(spec)
    if spec.scheme in (qk.AWQ, qk.GPTQ):
        grid = [qk.GemvBlocks(n, k, w, base.per_sm) for n in (64, 128, 256) for k in (64, 128) for w in (4, 8)]
    else:
        grid = [qk.GemvBlocks(n, k, w, base.per_sm) for n in (1, 2, 4) for k in (512, 1024) for w in (4, 8)]
    grid += [base._replace(per_sm=p) for p in (2, 8)]
    return [base] + [g for g in grid if g != base]


def sweep_quant(dtype: torch.dtype, schemes=("awq", "fp8", "gptq"), row_counts=(1, 16, 64, 128)) -> dict:
    """Each scheme and 7B projection shape, over QUANT_COPIES layers: at one row, cuBLAS on the
    fp16 weight, the 16-row tile and the GEMV under each `GemvBlocks` variant (the default
    first); at 16 rows the tile; at 64 and 128 rows the tile with 16 and 64 rows a program, the
    Triton dequantize + cuBLAS, and fp8's `_scaled_mm` (its rows quantized in one pass)."""
    from deployments.kernels import quant as qk
    out: dict = {}
    for scheme in schemes:
        for name, N, K in QUANT_SHAPES:
            specs = [_quant_layer(scheme, N, K, i) for i in range(QUANT_COPIES)]
            tile = qk._wo_blocks(specs[0])
            w16 = [torch.randn(N, K, device="cuda", dtype=dtype) * 0.02 for _ in range(4)]
            for m in row_counts:
                x = torch.randn(m, K, device="cuda", dtype=dtype)
                want = F.linear(x.float(), qk.dequantize(specs[0], torch.float32))
                r = {"scheme": scheme, "N": N, "K": K, "rows": m,
                     "cublas_fp16_ms": graph_ms(lambda: [F.linear(x, w) for w in w16]) / len(w16)}
                paths = {f"tile-m{b.m}": (lambda b: (lambda s: qk._launch_wo_matmul(x, s, None, b)))(b)
                         for b in ([tile] if m < 64 else [tile, tile._replace(m=64)])}
                if m == 1:
                    paths.update({f"gemv-{tuple(g)}": (lambda g: (lambda s: qk._launch_wo_gemv(x, s, None, g)))(g)
                                  for g in _gemv_variants(specs[0])})
                if m >= 64:
                    paths["dequantize+cublas"] = lambda s: F.linear(x, qk.dequantize_kernel(s, x.dtype))
                    if scheme == "fp8":
                        paths["scaled_mm"] = lambda s: qk.fp8_scaled_mm(x, s)
                rows, _ = try_configs(list(paths), lambda k: {"path": k}, lambda k: paths[k](specs[0]),
                                      lambda k: [paths[k](s) for s in specs], want)
                top = want.abs().max().item()
                for row in rows:
                    if "ms" in row:
                        row["ms"] /= QUANT_COPIES
                        row["GBps"] = specs[0].q.nbytes / row["ms"] / 1e6
                        row["rel_err"] = row["max_err"] / top
                        # the fp8 matmul's rows are quantized too: a few percent of the range
                        row["ok"] = row["rel_err"] <= (6e-2 if row["path"] == "scaled_mm" else 2e-2)
                best = min((row for row in rows if row.get("ok")), key=lambda row: row["ms"],
                           default={"path": "none", "ms": float("nan"), "GBps": float("nan")})
                r.update(paths=rows, best=best)
                first = {row["path"]: row.get("ms") for row in rows}
                gemv0 = next((v for k, v in first.items() if k.startswith("gemv")), None)
                print(f"quant {scheme:4s} {name:7s} {N:5d}x{K:<5d} rows {m:3d}: cuBLAS fp16 "
                      f"{r['cublas_fp16_ms'] * 1e3:6.1f} us | tile {(first.get(f'tile-m{tile.m}') or 0) * 1e3:6.1f} us"
                      + (f" | gemv default {gemv0 * 1e3:6.1f} us" if gemv0 else "")
                      + f" | best {best['ms'] * 1e3:6.1f} us {best['path']} ({best['GBps']:.0f} GB/s)"
                      + "".join(f" | WRONG {row['path']} {row['rel_err']:.2g}" for row in rows if row.get("ok") is False)
                      + "".join(f" | ERROR {row['path']}: {row['error'][:80]}" for row in rows if "error" in row),
                      flush=True)
                out[f"{scheme}-{name}-m{m}"] = r
            specs.clear()
            w16.clear()
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=["gemv", "attention", "paged", "wide", "quant"])
    ap.add_argument("--schemes", type=lambda v: tuple(v.split(",")), default=("awq", "fp8", "gptq"),
                    help="--only quant: these schemes")
    ap.add_argument("--rows", type=lambda v: tuple(int(r) for r in v.split(",")), default=(1, 16, 64, 128),
                    help="--only quant: at these row counts")
    a = ap.parse_args()
    if not ops.available("cuda"):
        sys.exit("needs CUDA and Triton")
    t0 = time.perf_counter()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python bench/kernel_sweep.py " + " ".join(sys.argv[1:])}
    if a.only in (None, "gemv"):
        res["gemv"] = sweep_gemv(torch.float16)
    if a.only in (None, "attention"):
        res["attention"] = sweep_attention(torch.float16)
    if a.only in (None, "paged"):
        res["paged_attention"] = sweep_paged_attention(torch.float16)
    if a.only in (None, "wide"):
        res["wide"] = sweep_wide(torch.float16)
    if a.only in (None, "quant"):
        res["quant"] = sweep_quant(torch.float16, a.schemes, a.rows)
    res["seconds"] = time.perf_counter() - t0
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(stamp(res), indent=1))
    print(f"wrote {a.out} in {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
