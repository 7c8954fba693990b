"""deployments.prime: the engine's code paths run once through a small model, on a side thread."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from deployments import prime
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


@pytest.fixture(autouse=True)
def fresh_state():
    """prime runs once per process; each test starts as a fresh process would."""
    prime._STATE.clear()
    yield
    prime.wait()
    prime._STATE.clear()


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

    code = ("import sys, torch; from deployments import prime; from tests.test_prime import LLAMA; "
            "prime.run(LLAMA, 'cpu', torch.float16); "
            "print([m for m in ('sympy', 'torch._dynamo', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_env_picks_the_steps(monkeypatch, caplog):
    monkeypatch.delenv("COLDSTART_PRIME", raising=False)
    assert prime.chosen_steps() == prime.STEPS
    monkeypatch.setenv("COLDSTART_PRIME", "decode_1, decode_2")
    assert prime.chosen_steps() == ("decode_1", "decode_2")
    monkeypatch.setenv("COLDSTART_PRIME", "decode_3")
    with caplog.at_level(logging.WARNING, logger="deployments.prime"):
        assert prime.chosen_steps() == prime.STEPS
    assert "decode_3" in caplog.text and "decode_1, decode_2" in caplog.text


def test_run_times_each_chosen_step():
    steps: dict = {}
    prime.run(LLAMA, "cpu", torch.float32, steps, ("decode_2", "sample"))
    assert list(steps) == ["model", "decode_2", "sample"] and all(v >= 0 for v in steps.values())


def test_nothing_starts_on_the_cpu_or_when_turned_off(monkeypatch):
    assert prime.start(LLAMA, torch.device("cpu"), torch.float32) is None
    assert prime.wait() is None
    monkeypatch.setenv("COLDSTART_PRIME", "0")
    assert not prime.wanted(torch.device("cuda"))
    assert prime.start(LLAMA, torch.device("cuda"), torch.float16) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA cannot run")
def test_a_prime_that_fails_is_logged_and_never_raises(caplog):
    with caplog.at_level(logging.WARNING, logger="deployments.prime"):
        t = prime.start(LLAMA, torch.device("cuda"), torch.float16)
        assert t is not None
        assert prime.wait() is None  # failed: no seconds
    assert "priming the engine's kernels failed" in caplog.text
    assert prime.start(LLAMA, torch.device("cuda"), torch.float16) is None  # once per process


@gpu
def test_gpu_primed_replica_serves_what_an_unprimed_one_serves(tiny_packed, monkeypatch):
    from tests.test_server import _gpu_replica_run

    runs = {}
    for flag in ("0", "1"):
        prime._STATE.clear()
        monkeypatch.setenv("COLDSTART_PRIME", flag)
        runs[flag] = _gpu_replica_run(tiny_packed, stats=True)
    assert runs["1"][0] == runs["0"][0]
    assert runs["0"][2]["prime_s"] is None
    assert runs["1"][2]["prime_s"] > 0 and runs["1"][2]["prime_wait_s"] >= 0


@gpu
def test_gpu_prime_waits_for_its_own_work_only():
    """The prime's waits (each step's time, its end) are on its own stream: work queued on
    another stream (the loader's copies, in a replica) is still running when it returns."""
    prime.run(LLAMA, "cuda", torch.float16)  # its kernels' modules loaded: a first load syncs the context
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        torch.cuda._sleep(10_000_000_000)  # 10^10 cycles: 5 s at 2 GHz
    steps: dict = {}
    prime.run(LLAMA, "cuda", torch.float16, steps)
    busy = not other.query()
    other.synchronize()
    assert busy, "the prime waited for another stream's work"
    assert set(steps) == {"model", *prime.STEPS}
