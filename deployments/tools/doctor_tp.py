"""`coldstart doctor --tp N`: can this node hold a tensor-parallel replica of N ranks, and start it fast?

A tensor-parallel replica (``args.tp``) is N processes on one node, one GPU each, joined in one
NCCL group whose all-reduce runs inside every decode step. Three rows:

- tp gpus: N GPUs visible to this process (a Ray node whose `ray start` saw fewer cannot place
  the replica's N bundles);
- tp peer access: every pair of them reads the other's memory directly (NVLink or PCIe P2P);
  where not, NCCL stages the all-reduce through host memory, many times slower;
- tp group start: N processes join an NCCL group and run one all-reduce (gloo without a GPU),
  timed: what every start of such a replica pays before its first graph capture.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

from deployments.server.ranks import free_port
from deployments.tools.check import Check, DoctorOptions

GROUP_WARN_S = 10.0  # a group's start beyond this is the node's (NCCL's topology search, a slow interface)


def _gpus(opts: DoctorOptions, torch: ModuleType) -> int:
    return torch.cuda.device_count() if torch is not None and torch.version.cuda is not None else 0


def check_tp_gpus(opts: DoctorOptions, torch: ModuleType, no_gpu: Any) -> Check:
    name, n = "tp gpus", opts.tp
    have = _gpus(opts, torch)
    if not have:
        return no_gpu(name, opts, f"no GPU visible for {n} tensor-parallel ranks")
    data = {"tp": n, "visible": have}
    if have < n:
        return Check(name, "fail", f"{have} GPUs visible, a replica of tp {n} needs {n} on one node",
                     "run it on a node with that many GPUs (cluster.yaml's tensor-parallel workers), "
                     "or pack the model for fewer ranks", data)
    names = {torch.cuda.get_device_name(i) for i in range(n)}
    if len(names) > 1:
        return Check(name, "warn", f"{have} GPUs visible, of different kinds: {sorted(names)}",
                     "every rank runs at the slowest GPU's pace: give the replica GPUs of one kind", data)
    return Check(name, "ok", f"{have} GPUs visible ({names.pop()}); tp {n} uses {n}", "", data)


def check_tp_peers(opts: DoctorOptions, torch: ModuleType, no_gpu: Any) -> Check:
    name, n = "tp peer access", opts.tp
    if _gpus(opts, torch) < n:
        return no_gpu(name, opts, f"fewer than {n} GPUs visible")
    missing = [(i, j) for i in range(n) for j in range(n)
               if i != j and not torch.cuda.can_device_access_peer(i, j)]
    data = {"pairs_without_peer_access": missing}
    if missing:
        return Check(name, "warn", f"GPU pairs without direct access: {missing}",
                     "NCCL then stages the all-reduce through host memory: pick nodes whose GPUs share "
                     "NVLink (or allow PCIe P2P: IOMMU, ACS and the hypervisor's settings)", data)
    return Check(name, "ok", f"every pair of the {n} GPUs accesses the other's memory directly", "", data)


def _rank(rank: int, n: int, port: int, backend: str, out: Any) -> None:
    import torch
    import torch.distributed as dist
    t0 = time.perf_counter()
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", world_size=n, rank=rank)
    x = torch.ones(1, device=f"cuda:{rank}" if cuda else "cpu")
    dist.all_reduce(x)
    if cuda:
        torch.cuda.synchronize()
    out.put((rank, time.perf_counter() - t0, float(x.item())))
    dist.destroy_process_group()


def check_tp_group(opts: DoctorOptions, torch: ModuleType, no_gpu: Any, timeout_s: float = 120) -> Check:
    name, n = "tp group start", opts.tp
    gpus = _gpus(opts, torch)
    if gpus and gpus < n:
        return no_gpu(name, opts, f"fewer than {n} GPUs visible")
    if not gpus and opts.require_gpu:
        return no_gpu(name, opts, "no GPU visible")
    import torch.multiprocessing as mp
    backend = "nccl" if gpus else "gloo"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_rank, args=(k, n, port, backend, out), daemon=True) for k in range(n)]
    for p in procs:
        p.start()
    got = []
    try:
        for _ in range(n):
            got.append(out.get(timeout=max(1.0, timeout_s - (time.perf_counter() - t0))))
    except Exception:  # noqa: BLE001 - a rank that died or hung is the finding
        codes = [p.exitcode for p in procs]
        return Check(name, "fail", f"{n} ranks did not all join a {backend} group within {timeout_s:.0f} s "
                     f"(exit codes {codes})", "run with NCCL_DEBUG=INFO to see where it stops", {"backend": backend})
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    wall = time.perf_counter() - t0
    slowest = max(s for _, s, _ in got)
    data = {"backend": backend, "ranks": n, "join_and_all_reduce_s": round(slowest, 3), "wall_s": round(wall, 3)}
    if any(v != n for _, _, v in got):
        return Check(name, "fail", f"the {backend} all-reduce of {n} ones gave {sorted(v for _, _, v in got)}",
                     "report this output", data)
    detail = f"{n} processes joined a {backend} group and all-reduced in {slowest:.2f} s ({wall:.2f} s with their start)"
    if slowest > GROUP_WARN_S:
        return Check(name, "warn", detail, "NCCL_DEBUG=INFO shows which step is slow (topology search, "
                     "the network interface: NCCL_SOCKET_IFNAME)", data)
    return Check(name, "ok", detail, "", data)
