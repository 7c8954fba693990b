"""Tensor-parallel ranks for the tests: real processes on the CPU, joined by gloo.

``run_ranks(world, fn, payload)`` starts ``world`` processes (torch.multiprocessing's spawn),
joins them in one gloo process group on a free localhost port and runs ``fn(payload)`` in each;
a rank's exception fails the call with the rank's traceback. ``rank_model_runs`` is such an
``fn``: each rank builds its part of every packed model it is given and saves what
``model_runs`` records, which the tests compare with the one-device model's and transformers'.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deployments.server.ranks import free_port


def run_ranks(world: int, fn: Callable[[Any], None], payload: Any) -> None:
    mp.spawn(_rank_main, args=(world, free_port(), fn, payload), nprocs=world, join=True)


def _rank_main(rank: int, world: int, port: int, fn: Callable[[Any], None], payload: Any) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        fn(payload)
    finally:
        dist.destroy_process_group()


def greedy(model: Any, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuations through the model's own cache paths: prompt 0 prefilled alone in two
    chunks (slot 0), the others in one batched prefill (slots 1, 2, ...), then ``steps - 1``
    decode steps of every row at once. Returns each row's ``steps`` tokens and the logits they
    were taken from, [steps, rows, vocab]."""
    rows = len(prompts)
    cache = model.new_cache(rows, 64)
    first = torch.tensor([prompts[0]])
    cut = len(prompts[0]) // 2
    model.prefill(first[:, :cut], cache, 0, 0)
    logits = [model.prefill(first[:, cut:], cache, 0, cut)]
    width = max(len(p) for p in prompts[1:])
    batch = torch.tensor([p + [0] * (width - len(p)) for p in prompts[1:]])
    logits += list(model.prefill_batch(batch, cache, list(range(1, rows)), [len(p) for p in prompts[1:]]))
    step = torch.stack(logits)  # [rows, V]
    seen, tok = [step], step.argmax(-1)
    chosen, pos = [tok], torch.tensor([len(p) for p in prompts])
    for _ in range(steps - 1):
        step = model.decode(tok, pos, torch.ones(rows, dtype=torch.bool), cache, 64)
        tok, pos = step.argmax(-1), pos + 1
        seen.append(step)
        chosen.append(tok)
    return torch.stack(chosen, 1).tolist(), torch.stack(seen)


def fused_views(model: Any) -> bool:
    """Whether every layer's q/k/v and gate/up are one view each over the loader's buffer."""
    return all(la.self_attn.qkv_w is not None and la.mlp.gate_up_w is not None
               and la.self_attn.qkv_w.data_ptr() == la.self_attn.q_proj.weight.data_ptr()
               and la.mlp.gate_up_w.data_ptr() == la.mlp.gate_proj.weight.data_ptr()
               for la in model.model.layers)


def model_runs(model: Any, tokens: torch.Tensor, prompts: list[list[int]], steps: int) -> dict:
    """What the tests compare of one model: its logits without a cache, its greedy continuations
    and their logits, on the torch path and on the fused one (on the CPU the fused operations'
    torch references run, with the model's own head counts)."""
    from deployments.kernels.policy import KernelPlan

    with torch.no_grad():
        out = {"logits": model(tokens), "fused_views": fused_views(model)}
        out["greedy"], out["step_logits"] = greedy(model, prompts, steps)
        model.kernels = KernelPlan(fused=True, attention=True)
        out["logits_fused"] = model(tokens)
        out["greedy_fused"], out["step_logits_fused"] = greedy(model, prompts, steps)
    return out


def rank_model_runs(payload: dict) -> None:
    """One rank's part: for each job (case, ranks N, split pack), the model of this process's rank
    in a group of N ranks (the whole world, or consecutive ranks of it: a group whose ranks are
    not the world's), its ``model_runs`` saved as OUT/CASE-tpN-rankR.pt (R: the world's rank)."""
    from deployments.model import build_model
    from weights import load

    me, world = dist.get_rank(), dist.get_world_size()
    groups = {}
    for n in sorted({n for _, n, _ in payload["jobs"]}):
        subs = [dist.new_group(list(range(i, i + n))) for i in range(0, world, n)]  # every rank makes each
        groups[n] = dist.group.WORLD if n == world else subs[me // n]
    for case, n, dest in payload["jobs"]:
        m = load(dest, "cpu", rank=dist.get_rank(groups[n]))
        model = build_model(m.config, m.tensors, tp=groups[n])
        out = model_runs(model, payload["tokens"], payload["prompts"], payload["steps"])
        out["tp"], out["vocab_size"] = (model.tp.rank, model.tp.size), model.vocab_size
        out["cache_kv_heads"] = model.new_cache(1, 8).k[0].shape[1]  # [slots, kv heads, positions, head_dim]
        if n != world:  # this rank's tensors in a group of another size
            try:
                build_model(m.config, m.tensors, tp=dist.group.WORLD)
            except ValueError as e:
                out["wrong_group"] = str(e)
        try:  # a config served through transformers cannot be split
            build_model({**m.config, "hidden_act": "quick_gelu"}, m.tensors, tp=groups[n])
        except ValueError as e:
            out["not_native"] = str(e)
        torch.save(out, Path(payload["out"]) / f"{case}-tp{n}-rank{me}.pt")
