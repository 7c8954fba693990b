"""Prefill: the padded chunk lengths the engine runs at, the shapes it runs once before serving,
and prompts that share one forward (fresh ones, and the rests of prompts past one cached prefix),
against transformers and against one prompt at a time (CPU, fp32; the CUDA cases on a GPU)."""

from __future__ import annotations

import threading

import pytest
import torch

from deployments.engine import Engine, EngineConfig, SamplingParams
from deployments.model import build_model
from helpers_engine import GREEDY, PROMPTS, hf_greedy, hf_model, make_engine, state_tensors


def test_prefill_lengths():
    from deployments.engine.config import prefill_lengths
    assert prefill_lengths(512) == (16, 32, 64, 128, 256, 512)
    assert prefill_lengths(100) == (16, 32, 64, 100)
    assert prefill_lengths(4) == (4,)
    # the engine's default: nothing shorter than 128 (a prefill that short costs what 128 does)
    assert prefill_lengths(512, EngineConfig().prefill_min_len) == (128, 256, 512)
    assert prefill_lengths(512, 100) == (128, 256, 512)  # rounded up to a power of two
    assert prefill_lengths(128, 128) == (128,)
    assert prefill_lengths(100, 128) == (100,)
    with pytest.raises(ValueError, match="prefill_min_len"):
        EngineConfig(prefill_min_len=0).validate()


def test_default_start_runs_few_prefill_shapes():
    """With the default prefill_min_len and a 512-token chunk, start runs three lengths and one
    batched pair of the shortest, and short prompts share forwards in rows it ran."""
    eng, hf = make_engine(start=False, hf_kw={"max_position_embeddings": 1024}, max_seq_len=1024,
                          prefill_chunk=512, prefill_min_len=128)
    try:
        eng.start()
        assert eng.prefill_lengths() == (128, 256, 512)
        assert list(eng.stats()["first_prefill_ms"]) == [128, 256, 512, "2x128"]
        hs = [eng.submit(p, SamplingParams(max_new_tokens=4, **GREEDY)) for p in PROMPTS[:4]]
        got = [h.result(timeout=60)[0] for h in hs]
        assert got == [hf_greedy(hf, p, 4) for p in PROMPTS[:4]]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_padded_prefill_gives_what_exact_lengths_give(device):
    """Prompt chunks padded to a few lengths (Engine.start runs each once) must not change a
    single token: greedy outputs equal the unpadded engine's and transformers', including a
    prompt whose last chunk has no room to be padded before max_seq_len. On CUDA through the
    fused kernels and the decode graphs."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (1, 5, 16, 17, 33, 41, 58)]
    outs = {}
    for pad in (True, False):
        eng, hf = make_engine(prefill_chunk=40, prefill_padding=pad, device=device)
        try:
            assert eng.prefill_lengths() == ((16, 32, 40) if pad else ())
            hs = [eng.submit(p, SamplingParams(max_new_tokens=6, **GREEDY)) for p in prompts]
            outs[pad] = [h.result(timeout=60)[0] for h in hs]
        finally:
            eng.shutdown()
    assert outs[True] == outs[False]
    for p, got in zip(prompts[::3], outs[True][::3]):
        assert got == hf_greedy(hf, p, 6)


def test_start_runs_every_prefill_length_once():
    """Engine.start has the loop thread prefill each padded chunk length once (the kernels and
    GEMM algorithms of every prompt shape are ready before the first request) before it
    returns; a real request afterwards is unaffected by what that left in the cache."""
    eng, hf = make_engine(start=False, prefill_chunk=40)
    calls = []
    real, real_batch = eng.model.prefill, eng.model.prefill_batch
    eng.model.prefill = lambda tokens, *a, **k: (
        calls.append((tokens.shape[1], threading.current_thread().name)), real(tokens, *a, **k))[1]
    eng.model.prefill_batch = lambda tokens, *a, **k: (
        calls.append((tuple(tokens.shape), threading.current_thread().name)), real_batch(tokens, *a, **k))[1]
    try:
        eng.start()
        # in the loop thread, which serves the requests: the first-time cost is per thread;
        # then two prompts in one forward, as fresh prompts of one length share one
        assert calls == [(16, "engine-loop"), (32, "engine-loop"), (40, "engine-loop"), ((2, 16), "engine-loop")]
        assert eng.stats()["first_prefill_s"] > 0
        assert list(eng.stats()["first_prefill_ms"]) == [16, 32, 40, "2x16"]
        assert eng.stats()["prompt_tokens"] == 0  # not requests
        assert eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=8, **GREEDY))[0] == hf_greedy(hf, PROMPTS[0], 8)
    finally:
        eng.shutdown()


def test_start_over_weights_still_loading_leaves_no_trace():
    """A replica builds and starts its engine while the weights' bytes arrive (on a cold page
    cache, before any has): start's first prefills then run over garbage, here NaN. Once the
    real bytes are in place, every request, alone or batched, gets what an engine started
    over loaded weights gives."""
    hf, config = hf_model("llama")
    real = state_tensors(hf)
    buffer = {k: torch.full_like(v, float("nan")) for k, v in real.items()}  # bytes not arrived yet
    model = build_model(config, buffer)
    eng = Engine(model, None, EngineConfig(max_slots=4, max_seq_len=64, prefill_chunk=32, prefill_min_len=16))
    try:
        eng.start()
        assert eng.prefill_lengths() == (16, 32)  # start prefilled slots 0 and 1 over the NaNs
        for k, v in real.items():  # the load ends: the bytes land in the tensors the model views
            buffer[k].copy_(v)
        model.weights_loaded()
        params = SamplingParams(max_new_tokens=8, **GREEDY)
        want = [hf_greedy(hf, p, 8) for p in PROMPTS[:4]]
        assert [eng.generate(p, params)[0] for p in PROMPTS[:4]] == want
        handles = [eng.submit(p, params) for p in PROMPTS[:4]]  # slots 0..3 decoding together
        assert [h.result(timeout=60)[0] for h in handles] == want
    finally:
        eng.shutdown()


@pytest.mark.parametrize("arch, kw", [("llama", {}), ("mistral", {"sliding_window": 6}),
                                      ("qwen2", {"tie_word_embeddings": True})])
def test_prefill_batch_equals_one_prompt_at_a_time(arch, kw):
    """Fresh prompts in one forward (right-padded to one length, each into its own slot) give
    each prompt's logits and cache entries as a prefill of that prompt alone; the head's row
    padding changes nothing."""
    hf, config = hf_model(arch, **kw)
    model = build_model(config, state_tensors(hf))
    lens, slots = [16, 9, 3, 12], [2, 0, 3, 1]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in lens]
    alone, together = model.new_cache(4, 32), model.new_cache(4, 32)
    with torch.inference_mode():
        want = torch.stack([model.prefill(torch.tensor([p]), alone, s, 0) for p, s in zip(prompts, slots)])
        tokens = torch.tensor([p + [0] * (16 - len(p)) for p in prompts])
        got = model.prefill_batch(tokens, together, slots, lens, logit_rows=8)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for p, s in zip(prompts, slots):
        for layer in range(len(alone.k)):
            torch.testing.assert_close(together.k[layer][s, :, : len(p)], alone.k[layer][s, :, : len(p)])
            torch.testing.assert_close(together.v[layer][s, :, : len(p)], alone.v[layer][s, :, : len(p)])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("arch, kw", [("llama", {}), ("mistral", {"sliding_window": 6}),
                                      ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1})])
def test_prefill_batch_after_each_rows_prefix_equals_one_prompt_at_a_time(arch, kw, paged, device):
    """The rests of prompts whose first ``start`` positions are in the cache (each slot its own
    prefix here) in one forward at ``start``: each row's logits and cache entries are those of
    its prompt's prefill alone, over a static cache and over a paged one."""
    hf, config = hf_model(arch, **kw)
    model = build_model(config, {k: v.to(device) for k, v in state_tensors(hf).items()})
    tol = {"rtol": 1e-4, "atol": 1e-4} if device == "cpu" else {"rtol": 1e-3, "atol": 1e-3}
    start, lens, slots = 16, [16, 9, 3, 12], [2, 0, 3, 1]
    g = torch.Generator().manual_seed(4)
    prefixes = [torch.randint(1, 90, (start,), generator=g).tolist() for _ in lens]
    rests = [torch.randint(1, 90, (n,), generator=g).tolist() for n in lens]

    def new_cache():
        if not paged:
            return model.new_cache(4, 48)
        cache = model.new_paged_cache(13, 16, 4, 48)  # 3 blocks per slot, not in slot order
        for s in range(4):
            cache.assign(s, [1 + 3 * ((s + 1) % 4) + b for b in range(3)])
        return cache
    alone, together = new_cache(), new_cache()
    with torch.inference_mode():
        for cache in (alone, together):
            for pre, s in zip(prefixes, slots):
                model.prefill(torch.tensor([pre], device=device), cache, s, 0)
        want = torch.stack([model.prefill(torch.tensor([r], device=device), alone, s, start)
                            for r, s in zip(rests, slots)])
        tokens = torch.tensor([r + [0] * (16 - len(r)) for r in rests], device=device)
        got = model.prefill_batch(tokens, together, slots, lens, logit_rows=8, start=start)
        torch.testing.assert_close(got, want, **tol)
        for r, s in zip(rests, slots):
            end = start + len(r)
            for layer in range(len(alone.k)):
                if paged:
                    row = torch.tensor([s], device=device)
                    (ka, va), (kt, vt) = (c.read(layer, row, end) for c in (alone, together))
                else:
                    ka, va = alone.k[layer][s, :, :end], alone.v[layer][s, :, :end]
                    kt, vt = together.k[layer][s, :, :end], together.v[layer][s, :, :end]
                torch.testing.assert_close(kt, ka, **tol)
                torch.testing.assert_close(vt, va, **tol)


def test_prefill_batch_rejects_bad_rows():
    hf, config = hf_model()
    model = build_model(config, state_tensors(hf))
    cache = model.new_cache(4, 32)
    with pytest.raises(ValueError, match="own cache slot"):
        model.prefill_batch(torch.ones(2, 16, dtype=torch.int64), cache, [1, 1], [16, 16])
    with pytest.raises(ValueError, match="1..16 valid tokens"):
        model.prefill_batch(torch.ones(2, 16, dtype=torch.int64), cache, [0, 1], [16, 17])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_fresh_prompts_of_one_length_share_a_prefill(device):
    """Prompts that arrive together and pad to one length are prefilled in one forward (the
    rows a power of two, rows x length within the chunk); every output is still transformers'
    greedy one, and a prompt of another length is prefilled on its own. On CUDA through the
    fused kernels and the decode graphs."""
    eng, hf = make_engine(start=False, prefill_chunk=64, max_slots=6, device=device)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (3, 9, 14, 16, 11, 20)]
    groups = []
    real = eng.model.prefill_batch
    eng.model.prefill_batch = lambda tokens, *a, **k: (groups.append(tuple(tokens.shape)), real(tokens, *a, **k))[1]
    try:
        eng.start()
        handles = eng.submit_many([(p, SamplingParams(max_new_tokens=5, **GREEDY)) for p in prompts])
        outs = [h.result(timeout=60)[0] for h in handles]
    finally:
        eng.shutdown()
    # start's own (2, 16); then the first four 16-token prompts together (4 x 16 = 64); the
    # fifth (11 -> 16) has no partner left, the sixth pads to 32: each alone
    assert groups == [(2, 16), (4, 16)] and eng.stats()["batched_prefills"] == 1
    assert eng.stats()["prompt_tokens"] == sum(map(len, prompts))
    for p, got in zip(prompts, outs):
        assert got == hf_greedy(hf, p, 5)


def test_prompts_of_two_padded_lengths_share_two_forwards_in_one_turn():
    """Where the chunk holds them, each padded length's prompts share a forward in the same turn
    (not one shared forward and the rest one by one)."""
    eng, hf = make_engine(start=False, prefill_chunk=128, max_slots=4, max_seq_len=128)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (5, 20, 12, 30)]
    groups = []
    real = eng.model.prefill_batch
    eng.model.prefill_batch = lambda tokens, *a, **k: (groups.append(tuple(tokens.shape)), real(tokens, *a, **k))[1]
    single = []
    real_one = eng.model.prefill
    eng.model.prefill = lambda tokens, *a, **k: (single.append(tuple(tokens.shape)), real_one(tokens, *a, **k))[1]
    try:
        eng.start()
        started = len(single)
        handles = eng.submit_many([(p, SamplingParams(max_new_tokens=4, **GREEDY)) for p in prompts])
        outs = [h.result(timeout=60)[0] for h in handles]
    finally:
        eng.shutdown()
    assert groups[1:] == [(2, 16), (2, 32)] and len(single) == started  # 32 + 64 rows of the 128
    assert eng.stats()["batched_prefills"] == 2
    assert outs == [hf_greedy(hf, p, 4) for p in prompts]


def test_a_failed_shared_prefill_fails_only_its_requests():
    eng, hf = make_engine(start=False, prefill_chunk=64)
    real = eng.model.prefill_batch
    eng.model.prefill_batch = lambda tokens, *a, **k: (
        real(tokens, *a, **k) if tokens.shape[0] == 2 and eng.stats()["first_prefill_s"] == 0
        else (_ for _ in ()).throw(ValueError("a bad row")))
    try:
        eng.start()
        handles = eng.submit_many([(p, SamplingParams(max_new_tokens=4, **GREEDY)) for p in ([3, 4], [5, 6, 7], [8] * 20)])
        reasons = [h.result(timeout=60)[2] for h in handles]
        assert reasons == ["error", "error", "length"] and eng.alive()
        assert eng.generate([9, 10], SamplingParams(max_new_tokens=3, **GREEDY))[0] == hf_greedy(hf, [9, 10], 3)
        assert eng.stats()["free_slots"] == 4
    finally:
        eng.shutdown()


def test_a_request_whose_sampler_cannot_be_made_fails_alone():
    """A request whose sampling generator cannot be made (here: made to raise) fails alone,
    even in a prefill it shares; the loop, and the request beside it, go on."""
    from deployments.engine import executor
    eng, hf = make_engine(prefill_chunk=64)
    real = executor._generator

    def make(p, device):
        if p.seed == 13:
            raise OverflowError("seed out of range")
        return real(p, device)
    executor._generator = make
    try:
        bad, good = eng.submit_many([([7, 8, 9, 10], SamplingParams(max_new_tokens=4, temperature=1.0, seed=13)),
                                     ([3, 4, 5, 6], SamplingParams(max_new_tokens=4, **GREEDY))])
        assert bad.result(timeout=60)[2] == "error" and isinstance(bad.error, OverflowError)
        assert good.result(timeout=60)[0] == hf_greedy(hf, [3, 4, 5, 6], 4)
        assert eng.stats()["batched_prefills"] == 1  # the two shared one prefill
        assert eng.alive() and eng.stats()["free_slots"] == eng.config.max_slots
    finally:
        executor._generator = real
        eng.shutdown()


def test_a_failed_first_prefill_fails_start():
    eng, _ = make_engine(start=False, prefill_chunk=40)

    def broken(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    eng.model.prefill = broken
    with pytest.raises(RuntimeError, match="engine loop failed at start.*illegal memory access"):
        eng.start()
    assert not eng.alive()
