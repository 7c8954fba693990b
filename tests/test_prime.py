"""deployments.startup.prime: the engine's code paths run once through a small model, on a side thread."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from deployments.startup import prime
from deployments.model import ModelConfig
from tests.conftest import gpu

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 300,
         "max_position_embeddings": 256}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 300,
         "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
MISTRAL = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 300,
           "sliding_window": 8, "head_dim": 32, "tie_word_embeddings": True,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 128}}


@pytest.mark.parametrize("config", [LLAMA, QWEN2, MISTRAL], ids=["llama-gqa", "qwen2-bias-window", "mistral-rope"])
def test_small_config_keeps_what_picks_the_kernels(config):
    real = ModelConfig.from_hf(config)
    small = prime.small_config(real)
    assert small.num_hidden_layers == 1 and small.vocab_size == 256
    assert small.head_dim == real.head_dim and small.n_rep == real.n_rep
    assert (small.qkv_bias, small.o_bias, small.mlp_bias, small.rope_type) == \
        (real.qkv_bias, real.o_bias, real.mlp_bias, real.rope_type)
    assert small.layer_windows == [next((w for w in real.layer_windows if w is not None), None)]
    assert not small.tie_word_embeddings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [LLAMA, QWEN2, MISTRAL], ids=["llama-gqa", "qwen2-bias-window", "mistral-rope"])
def test_run_goes_through_the_engine_paths_of_each_native_architecture(config, dtype):
    # on the CPU it primes nothing, but every call it makes is the model's and the sampler's own:
    # a change to their signatures fails here, not silently in a GPU replica's side thread
    assert prime.run(config, "cpu", dtype) > 0


def test_run_imports_nothing_heavy():
    """A replica imports its modules on the main thread meanwhile: a prime that imported sympy
    (as Module.to_empty does, through torch._refs) took 4-6 s beside a 7B replica's build
    on an H200 and slowed the build and the load with it."""
    import subprocess
    import sys

    code = ("import sys, torch; from deployments.startup import prime; from tests.test_prime import LLAMA; "
            "prime.run(LLAMA, 'cpu', torch.float16); "
            "print([m for m in ('sympy', 'torch._dynamo', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA cannot run")
def test_a_prime_that_fails_is_logged_and_never_raises(caplog):
    with caplog.at_level(logging.WARNING, logger="deployments.startup.side"):
        task = prime.start(LLAMA, torch.device("cuda"), torch.float16).wait()
    assert task.result is None and task.error is not None  # failed: no seconds, nothing raised
    assert "engine-prime failed" in caplog.text


@gpu
def test_gpu_primed_replica_serves_what_an_unprimed_one_serves(tiny_packed, monkeypatch):
    from tests.test_server import _gpu_replica_run

    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("COLDSTART_PRIME", flag)
        runs[flag] = _gpu_replica_run(tiny_packed)
    assert runs["1"][0] == runs["0"][0]
    assert "engine_prime_wait" not in runs["0"][1] and runs["1"][1]["engine_prime_wait"] >= 0


@gpu
def test_gpu_prime_waits_for_its_own_work_only():
    """The prime's waits (each step's time, its end) are on its own stream: work queued on
    another stream (the loader's copies, in a replica) is still running when it returns."""
    prime.run(LLAMA, "cuda", torch.float16)  # its kernels' modules loaded: a first load syncs the context
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        torch.cuda._sleep(10_000_000_000)  # 10^10 cycles: 5 s at 2 GHz
    prime.run(LLAMA, "cuda", torch.float16)
    busy = not other.query()
    other.synchronize()
    assert busy, "the prime waited for another stream's work"
