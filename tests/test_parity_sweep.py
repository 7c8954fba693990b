"""Parity over configurations drawn at random (fixed seeds), on the torch path and on the GPU's
fused path (its kernels' torch references): model shapes (heads, grouped kv
heads, head sizes, biases, tied embeddings, sliding windows, rope scaling) and engine settings
(static or paged cache, block sizes and counts small enough to preempt, prefix reuse, chunk and
padding lengths, slots), with requests submitted together, some a moment apart. Greedy tokens
equal transformers' `generate`; seeded sampled tokens equal the same request run alone."""

from __future__ import annotations

import random
import time

import pytest

from deployments.engine import Engine, EngineConfig, SamplingParams
from deployments.model import build_model
from helpers_engine import hf_greedy, hf_model, state_tensors


def _model_kw(rng: random.Random) -> tuple[str, dict]:
    arch = rng.choice(["llama", "mistral", "qwen2"])
    heads = rng.choice([2, 4, 8])
    kw = dict(vocab_size=rng.choice([97, 131]), hidden_size=rng.choice([32, 64]),
              intermediate_size=rng.choice([48, 96]), num_hidden_layers=rng.choice([1, 2, 3]),
              num_attention_heads=heads, num_key_value_heads=rng.choice([d for d in (1, 2, 4, 8) if heads % d == 0]),
              max_position_embeddings=512, head_dim=rng.choice([8, 16, 32]),
              rope_theta=rng.choice([10000.0, 500000.0]), rms_norm_eps=rng.choice([1e-5, 1e-6]),
              tie_word_embeddings=rng.random() < 0.3)
    if arch == "llama":
        kw["attention_bias"] = rng.random() < 0.3
        kw["mlp_bias"] = rng.random() < 0.2
        if rng.random() < 0.3:
            kw["rope_scaling"] = rng.choice([
                {"rope_type": "linear", "factor": 2.0},
                {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 64}])
    elif arch == "mistral" and rng.random() < 0.6:
        kw["sliding_window"] = rng.choice([4, 7, 16])
    elif arch == "qwen2" and rng.random() < 0.4:
        kw.update(use_sliding_window=True, sliding_window=rng.choice([5, 8]), max_window_layers=rng.choice([0, 1]))
    return arch, kw


def _engine_kw(rng: random.Random) -> dict:
    kw = dict(max_slots=rng.choice([1, 3, 8]), max_seq_len=rng.choice([128, 256]),
              prefill_chunk=rng.choice([4, 16, 64]), prefill_min_len=rng.choice([4, 16]),
              kv_cache=rng.choice(["static", "paged"]))
    if kw["kv_cache"] == "paged":
        kw.update(kv_block_size=rng.choice([16, 32]), prefix_cache=rng.random() < 0.7)
        if rng.random() < 0.5:
            kw["kv_blocks"] = rng.choice([6, 10, 40])
    return kw


def _fused(hf, tmp_path, attention: bool):
    """The model over its packed copy (q/k/v and gate/up back to back where the packer's alignment
    leaves them so: the fused views), for the Triton path's ops (their torch references on the
    CPU); returns (model, a function that puts the plan on it, called after the engine's own kernel
    checks, which turn it off without Triton). ``attention``: the flash-decoding attention too,
    which takes head sizes that are powers of two from 16 (the GPU's kernel test leaves it off
    for others)."""
    from deployments.kernels.policy import KernelPlan
    from weights import PackOptions, load, pack
    hf.save_pretrained(tmp_path / "hf")
    m = load(pack(tmp_path / "hf", tmp_path / "packed", PackOptions(progress=False)), "cpu")
    model = build_model(m.config, m.tensors)
    attention = attention and model.config.head_dim >= 16

    def plan() -> None:
        model.kernels = KernelPlan(fused=True, attention=attention)
    return model, plan


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
@pytest.mark.parametrize("seed", range(24))
def test_random_configurations_give_transformers_tokens_and_their_own_alone(seed, fused, tmp_path):
    """``fused``: the GPU's path (one op for rope and the cache's writes in prefill and decode, the
    flash-decoding attention in half the cases), through the kernels' torch references."""
    rng = random.Random(seed)
    arch, mkw = _model_kw(rng)
    hf, config = hf_model(arch, seed=seed, **mkw)
    model, plan = (_fused(hf, tmp_path, attention=seed % 4 < 2) if fused
                   else (build_model(config, state_tensors(hf)), lambda: None))
    eng = Engine(model, None, EngineConfig(**_engine_kw(rng)))
    plan()
    eng.start()
    try:
        V = mkw["vocab_size"]
        shared = [rng.randrange(1, V) for _ in range(rng.choice([0, 20, 40]))]  # a system prompt, or none
        reqs = [(shared + [rng.randrange(1, V) for _ in range(rng.randint(1, 40))], rng.randint(1, 30))
                for _ in range(rng.randint(2, 6))]
        sampled = seed % 2 == 1
        top_k = [rng.choice([0, 20]) for _ in reqs]

        def params(j: int, n: int) -> SamplingParams:
            if sampled:
                return SamplingParams(max_new_tokens=n, temperature=0.9, top_p=0.9, top_k=top_k[j], seed=1000 + j,
                                      ignore_eos=True)
            return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

        def fits(p: list[int], n: int) -> bool:  # (a request the cache can never hold is refused)
            if len(p) + n > eng.config.max_seq_len:
                return False
            try:
                if eng.blocks is not None:
                    eng.blocks.check(len(p), n)
            except ValueError:
                return False
            return True

        ok = [fits(p, n) for p, n in reqs]
        want = [(eng.generate(p, params(j, n))[0] if sampled else hf_greedy(hf, p, n)) if ok[j] else None
                for j, (p, n) in enumerate(reqs)]
        handles = []
        for j, (p, n) in enumerate(reqs):
            if ok[j]:
                handles.append(eng.submit(p, params(j, n)))
            else:
                with pytest.raises(ValueError, match="max_seq_len|KV-cache blocks"):
                    eng.submit(p, params(j, n))
                handles.append(None)
            if rng.random() < 0.3:
                time.sleep(0.01)  # some join the running batch a moment later
        got = [h.result(timeout=120)[0] if h is not None else None for h in handles]
        assert got == want
        assert any(ok)
    finally:
        eng.shutdown()
