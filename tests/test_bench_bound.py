"""bench/bound.py: a load's bound, worked by hand on small shapes and checked on the
benchmark subjects' real ones (no torch, no device)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bound import Dims, decode_step_bound_s, kv_bytes_per_position, load_bound, prefill_flops

ROOT = Path(__file__).resolve().parents[1]

# hidden 8, 2 layers, 2 heads of 4 (1 kv head), intermediate 16, vocab 10
SMALL = Dims(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)


def test_the_arithmetic_imports_no_torch():
    r = subprocess.run([sys.executable, "-c", "import sys, bench.bound; assert 'torch' not in sys.modules"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_positions_keys_and_values_count_only_the_kv_heads():
    assert kv_bytes_per_position(SMALL, 2) == 2 * 2 * 1 * 4 * 2  # k and v, layers, kv heads, head_dim, bytes
    from weights.demo import SHAPES, config_dict
    gqa, mha = Dims.of(config_dict(SHAPES["llama3-8b"])), Dims.of(config_dict(SHAPES["llama-7b"]))
    assert kv_bytes_per_position(gqa, 2) == 128 * 1024  # Llama-3-8B: 128 KiB a position in bf16
    assert kv_bytes_per_position(mha, 2) == 4 * kv_bytes_per_position(gqa, 2)


def test_prefill_flops_by_hand():
    # projections per token per layer: q 8x8, k and v 8x4 each, o 8x8, mlp 3 x 8x16 = 576 weights
    proj = 64 + 2 * 32 + 64 + 384
    # 3 tokens from 0: they read 1 + 2 + 3 keys; attention 4 x heads x head_dim = 32 FLOPs a key
    assert prefill_flops(SMALL, 3) == 2 * (2 * proj * 3 + 32 * 6) + 2 * 10 * 8
    # the same 3 tokens after 5 cached positions: 6 + 7 + 8 keys
    assert prefill_flops(SMALL, 3, start=5) == 2 * (2 * proj * 3 + 32 * 21) + 2 * 10 * 8


def test_the_8b_subject_has_llama3_8bs_shapes():
    from weights.demo import SHAPES, config_dict, tensor_specs
    params = sum(math.prod(s) for _, s in tensor_specs(SHAPES["llama3-8b"]))
    assert 8.03e9 < params < 8.04e9  # Llama-3-8B: 8,030,261,248
    c = config_dict(SHAPES["llama3-8b"])
    assert (c["num_key_value_heads"], c["num_attention_heads"], c["vocab_size"], c["intermediate_size"],
            c["rope_theta"]) == (8, 32, 128256, 14336, 500000.0)


def test_the_8b_subjects_prefill_is_twice_its_weights_per_token():
    from weights.demo import SHAPES, config_dict, tensor_specs
    d = Dims.of(config_dict(SHAPES["llama3-8b"]))
    weights = sum(math.prod(s) for n, s in tensor_specs(SHAPES["llama3-8b"]) if "layers." in n and s[1:])
    assert 6.9e9 < weights < 7.0e9  # the projections of 32 layers (embedding and head apart)
    # one token from 0: its projections, its attention to its own key, the head
    assert prefill_flops(d, 1) == 2 * weights + d.layers * 4 * d.heads * d.head_dim + 2 * d.vocab * d.hidden


def test_a_load_bound_by_hand():
    # two prompts of 4 and 6 tokens, 3 new tokens each: 2 decode steps; step k reads p + k positions
    b = load_bound(SMALL, weight_bytes=1000, kv_itemsize=2, prompt_lens=[4, 6], new_tokens=3,
                   copy_bytes_per_s=100.0, flops_per_s=1e4)
    positions = (4 + 1) + (4 + 2) + (6 + 1) + (6 + 2)
    assert b.decode_steps == 2 and b.decode_bytes == 2 * 1000 + positions * 32
    assert b.prefill_flops == prefill_flops(SMALL, 4) + prefill_flops(SMALL, 6)
    assert b.decode_s == pytest.approx(b.decode_bytes / 100) and b.prefill_s == pytest.approx(b.prefill_flops / 1e4)
    assert b.seconds == pytest.approx(b.decode_s + b.prefill_s)


def test_a_cached_prefix_is_not_prefilled_but_is_read():
    whole = load_bound(SMALL, 1000, 2, [20], 2, 100.0, 1e4)
    hit = load_bound(SMALL, 1000, 2, [20], 2, 100.0, 1e4, cached=16)
    assert hit.prefill_flops == prefill_flops(SMALL, 4, start=16) < whole.prefill_flops
    assert hit.decode_bytes == whole.decode_bytes
    # the last prompt token is always computed (its logits give the first new token)
    assert load_bound(SMALL, 1000, 2, [20], 2, 100.0, 1e4, cached=20).prefill_flops == prefill_flops(SMALL, 1, 19)


def test_one_new_token_is_the_prefill_alone():
    b = load_bound(SMALL, 1000, 2, [8], 1, 100.0, 1e4)
    assert b.decode_steps == 0 and b.decode_bytes == 0 and b.decode_s == 0


def test_a_decode_steps_bound():
    assert decode_step_bound_s(SMALL, 1000, 2, 10, 100.0) == pytest.approx((1000 + 10 * 32) / 100)


@pytest.mark.parametrize("kw, what", [(dict(prompt_lens=[]), "0 prompts"), (dict(new_tokens=0), "new_tokens=0"),
                                      (dict(copy_bytes_per_s=0.0), "0.0 B/s")])
def test_bad_loads_are_refused(kw, what):
    args = dict(d=SMALL, weight_bytes=1, kv_itemsize=2, prompt_lens=[4], new_tokens=2, copy_bytes_per_s=1.0,
                flops_per_s=1.0) | kw
    with pytest.raises(ValueError, match=what):
        load_bound(**args)


def test_a_config_without_the_sizes_is_refused():
    with pytest.raises(ValueError, match="config lacks intermediate_size, vocab_size"):
        Dims.of({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2})
