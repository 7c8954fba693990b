"""Engine: greedy parity with transformers, continuous batching, cancel, stops, errors (CPU, fp32)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from deployments.engine import Engine, EngineConfig, NonFiniteLogits, SamplingParams
from deployments.engine.runner import check_fits
from deployments.model import build_model
from deployments.engine.request import TextState
from deployments.engine.sampling import sample, sample_on_device
from deployments.engine.tokenizer import Tokenizer
from helpers_engine import GREEDY, PROMPTS, hf_greedy, hf_model, make_engine, state_tensors, write_tokenizer_dir



@pytest.fixture
def engine():
    eng, hf = make_engine()
    yield eng, hf
    eng.shutdown()


@pytest.mark.parametrize("arch, kw", [("llama", {}), ("mistral", {"sliding_window": 6}), ("qwen2", {"tie_word_embeddings": True})])
def test_greedy_matches_transformers_generate(arch, kw):
    eng, hf = make_engine(arch, hf_kw=kw)
    try:
        for prompt in PROMPTS[:3]:  # prompt 3 spans 4 prefill chunks
            ids, _, reason = eng.generate(prompt, SamplingParams(max_new_tokens=24, **GREEDY))
            assert reason == "length"
            assert ids == hf_greedy(hf, prompt, 24)
    finally:
        eng.shutdown()


def test_batched_equals_one_at_a_time(engine):
    eng, _ = engine
    params = [SamplingParams(max_new_tokens=n, **GREEDY) for n in (20, 9, 15, 30, 3)]
    params.append(SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=20, seed=7))
    prompts = PROMPTS + [[8, 6, 4]]
    alone = [eng.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    handles = [eng.submit(p, sp) for p, sp in zip(prompts, params)]  # 6 requests, 4 slots: two wait
    together = [h.result(timeout=60)[0] for h in handles]
    assert together == alone
    assert eng.stats()["free_slots"] == 4


def test_seeded_sampling_is_reproducible_and_varies(engine):
    eng, _ = engine
    runs = [eng.generate([5, 6, 7], SamplingParams(max_new_tokens=16, temperature=1.5, seed=s))[0] for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_cancel_frees_the_slot():
    eng, _ = make_engine(max_slots=1, max_seq_len=256)
    try:
        h = eng.submit([1, 2, 3], SamplingParams(max_new_tokens=250, **GREEDY))
        first = next(iter(h))
        assert first.finish_reason is None
        waiting = eng.submit([4, 5], SamplingParams(max_new_tokens=4, **GREEDY))
        h.cancel()
        ids, _, reason = h.result(timeout=30)
        assert reason == "cancelled" and len(ids) < 250
        assert waiting.result(timeout=30)[2] == "length"  # got the freed slot
        assert eng.stats()["free_slots"] == 1 and eng.stats()["running"] == 0
    finally:
        eng.shutdown()


def test_cancel_while_waiting():
    eng, _ = make_engine(max_slots=1, max_seq_len=256)
    try:
        busy = eng.submit([3, 4], SamplingParams(max_new_tokens=250, **GREEDY))  # holds the one slot
        h = eng.submit([1, 2], SamplingParams(max_new_tokens=3, **GREEDY))
        h.cancel()
        assert h.result(timeout=30) == ([], "", "cancelled")
        busy.cancel()
        assert busy.result(timeout=30)[2] == "cancelled"
    finally:
        eng.shutdown()


def test_submit_before_start_is_refused():
    eng, _ = make_engine(start=False)
    with pytest.raises(RuntimeError, match=r"not started: call Engine.start\(\)"):
        eng.submit([1, 2], SamplingParams(max_new_tokens=3, **GREEDY))
    eng.start()
    try:
        assert eng.generate([1, 2], SamplingParams(max_new_tokens=3, **GREEDY))[2] == "length"
    finally:
        eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.submit([1, 2], SamplingParams(max_new_tokens=3, **GREEDY))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(write_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def _text_engine(tok, **cfg):
    return make_engine(tokenizer=tok, hf_kw={"vocab_size": tok.vocab_size}, max_seq_len=128, **cfg)


def test_stop_string_and_streaming(tok):
    eng, _ = _text_engine(tok)
    try:
        prompt = tok.encode("Hello world")
        ids, full, _ = eng.generate(prompt, SamplingParams(max_new_tokens=40, **GREEDY))
        assert len(full) >= 8, full
        stop = full[4:7]
        cut = full[: full.index(stop)]
        h = eng.submit(prompt, SamplingParams(max_new_tokens=40, stop=["\x00never", stop], **GREEDY))
        chunks = list(h)
        assert chunks[-1].finish_reason == "stop"
        assert "".join(c.text for c in chunks) == cut
        assert h.result()[1] == cut
        # streamed text equals the full decode of the same tokens when no stop applies
        out = eng.submit(prompt, SamplingParams(max_new_tokens=40, **GREEDY))
        assert "".join(c.text for c in out) == tok.decode(ids) == full
    finally:
        eng.shutdown()


def test_stop_string_mid_batch_drops_the_step_already_running(tok):
    """The text of step N is made while step N+1 runs: a stop string found there ends the
    request without the token of step N+1, and its neighbour's tokens are unaffected."""
    eng, _ = _text_engine(tok, max_slots=2)
    try:
        prompt, other = tok.encode("Hello world"), tok.encode("The answer is")
        ids, full, _ = eng.generate(prompt, SamplingParams(max_new_tokens=40, **GREEDY))
        solo = eng.generate(other, SamplingParams(max_new_tokens=40, **GREEDY))[0]
        stop = full[4:7]
        cut = full[: full.index(stop)]
        hs = [eng.submit(prompt, SamplingParams(max_new_tokens=40, stop=[stop], **GREEDY)),
              eng.submit(other, SamplingParams(max_new_tokens=40, **GREEDY))]
        got_ids, text, reason = hs[0].result(timeout=60)
        assert (text, reason) == (cut, "stop")
        # exactly the tokens up to the one whose text completed the stop string
        state = TextState(tok.incremental_decoder(prompt), [stop])
        n = next(i + 1 for i, t in enumerate(ids) if state.push(t)[1])
        assert got_ids == ids[:n]
        assert hs[1].result(timeout=60)[0] == solo
        assert eng.stats()["free_slots"] == 2
    finally:
        eng.shutdown()


def test_stop_token_ids_and_eos(tok):
    eng, _ = _text_engine(tok)
    try:
        prompt = tok.encode("The quick")
        ids, _, _ = eng.generate(prompt, SamplingParams(max_new_tokens=20, **GREEDY))
        stop_tok = ids[5]
        got, text, reason = eng.generate(prompt, SamplingParams(max_new_tokens=20, stop_token_ids=[stop_tok], **GREEDY))
        assert reason == "stop" and got == ids[: ids.index(stop_tok) + 1]
        assert text == tok.decode(got[:-1])  # the stop token's text is not returned
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"seed": 1 << 64}, "seed"),  # torch's generators take 64 bits
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_bad_sampling_params_name_the_field(engine, kw, field):
    eng, _ = engine
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        eng.submit([1, 2], SamplingParams(**kw))


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"max_slots": 0}, "max_slots"),
        ({"max_seq_len": 1}, "max_seq_len"),
        ({"max_seq_len": 10_000}, "max_seq_len"),  # above max_position_embeddings=256
        ({"prefill_chunk": -1}, "prefill_chunk"),
        ({"cuda_graphs": "yes"}, "cuda_graphs"),
        ({"lazy_graphs": 1}, "lazy_graphs"),
        ({"graph_batch_sizes": (1, 8)}, "graph_batch_sizes"),
        ({"kv_len_buckets": (0,)}, "kv_len_buckets"),
    ],
)
def test_bad_engine_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"(EngineConfig\n|engine\.){field}\b|\b{field} "):
        make_engine(start=False, **kw)


def test_bad_prompts(engine):
    eng, _ = engine
    with pytest.raises(ValueError, match=r"\(60 tokens\) \+ max_new_tokens \(5\) = 65 exceeds max_seq_len=64"):
        eng.submit([1] * 60, SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        eng.submit([], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit([1, 97], SamplingParams())
    with pytest.raises(ValueError, match=r"SamplingParams\.stop needs text"):
        eng.submit([1], SamplingParams(max_new_tokens=2, stop=["x"]))


def test_one_bad_request_does_not_kill_the_loop(engine):
    eng, _ = engine
    bad = {"id": None}
    orig = eng.output._emit

    def emit(s, tok, reason):
        if s.handle.id == bad["id"]:
            raise KeyError("boom")
        orig(s, tok, reason)

    eng.output._emit = emit
    good = eng.submit([1, 2, 3], SamplingParams(max_new_tokens=10, **GREEDY))
    h = eng.submit([4, 5, 6], SamplingParams(max_new_tokens=10, **GREEDY))
    bad["id"] = h.id
    assert h.result(timeout=30)[2] == "error" and isinstance(h.error, KeyError)
    assert good.result(timeout=30)[2] == "length"
    assert eng.alive()
    assert eng.generate([7], SamplingParams(max_new_tokens=3, **GREEDY))[2] == "length"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_non_finite_logits_fail_the_request_and_leave_no_trace(device):
    """A prompt the model overflows on (here: one token's embedding is inf) fails with a message
    that says so, instead of streaming the arbitrary tokens an argmax over NaN picks; and the
    NaN keys and values it wrote do not reach the next requests in its slot, alone or batched
    (a multi-row step multiplies masked values too). On CUDA: through the decode graphs and,
    where Triton runs, its kernels."""
    eng, _ = make_engine(device=device)
    try:
        clean = [[3, 5, 7], [2, 4, 6, 8]]
        params = SamplingParams(max_new_tokens=8, **GREEDY)
        before = [eng.generate(p, params)[0] for p in clean]
        with torch.no_grad():
            eng.model.model.embed_tokens.weight[90] = float("inf")
        h = eng.submit([90] * 20, SamplingParams(max_new_tokens=4, **GREEDY))  # longer than the clean prompts
        assert h.result(timeout=30)[2] == "error"
        assert isinstance(h.error, NonFiniteLogits) and "not finite" in str(h.error) and "bfloat16" in str(h.error)
        assert eng.alive()
        assert [eng.generate(p, params)[0] for p in clean] == before
        hs = [eng.submit(p, params) for p in clean]  # two rows in one decode step, slots 0 and 1
        assert [x.result(timeout=30)[0] for x in hs] == before
    finally:
        eng.shutdown()


def test_a_finished_request_leaves_its_slot_zeroed(engine):
    eng, _ = engine
    ids, _, reason = eng.generate(PROMPTS[2], SamplingParams(max_new_tokens=9, **GREEDY))  # 13 tokens, 4 chunks
    assert reason == "length" and len(ids) == 9
    assert eng.stats()["free_slots"] == 4
    assert not eng.runner.cache.data.any()  # slot 0 held 13 + 8 positions; every one is zero again


def test_sample_gives_no_token_for_non_finite_rows():
    logits = torch.randn(6, 10)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[4, :] = float("-inf")
    logits[5, :4] = float("-inf")  # banned tokens beside finite ones: a normal row
    gens = [None, None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2), None, None]
    toks = sample(logits, [0.0, 0.0, 0.7, 0.7, 0.0, 0.0], [1.0] * 6, [0] * 6, gens)
    assert toks[0] == int(logits[0].argmax()) and toks[1] is None and toks[2] is None and toks[4] is None
    assert isinstance(toks[3], int) and 0 <= toks[3] < 10
    assert toks[5] == int(logits[5].argmax()) and toks[5] >= 4


def test_the_next_step_is_launched_before_the_last_ones_tokens_are_read(engine):
    """Each decode step's tokens are sampled on the device and read back only once the next
    step is launched (the host's work between steps overlaps the device's); the tokens are the
    same as transformers' and the last step is read without a launch after it."""
    eng, hf = engine
    r, order = eng.runner, []
    decode, to_host = r.decode, r.to_host

    def launched(*a):
        order.append("launch")
        return decode(*a)

    def copied(toks):
        read = to_host(toks)

        def wait():
            order.append("read")
            return read()
        return wait

    r.decode, r.to_host = launched, copied
    ids, _, reason = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=10, **GREEDY))
    assert (ids, reason) == (hf_greedy(hf, PROMPTS[0], 10), "length")
    # the first token comes from the prefill: nine steps, each read after the next one's launch
    assert order == ["launch"] + ["launch", "read"] * 8 + ["read"]


def test_a_batch_whose_sampling_fails_is_sampled_row_by_row_with_the_same_tokens(engine, monkeypatch):
    """Where sampling a decode step's batch on the device raises (not a device error), its rows
    are sampled one by one, after the step before it is taken: every request gets the tokens it
    gets alone, and the loop goes on."""
    import deployments.engine.executor as sched

    eng, _ = engine
    params = SamplingParams(max_new_tokens=12, **GREEDY)
    alone = [eng.generate(p, params)[0] for p in PROMPTS[:3]]
    failed = []

    def flaky(logits, *a):
        if logits.shape[0] > 1 and len(failed) < 3:  # three batched steps fail
            failed.append(logits.shape[0])
            raise ValueError("a batch this sampler cannot take")
        return sample_on_device(logits, *a)

    monkeypatch.setattr(sched, "sample_on_device", flaky)
    hs = [eng.submit(p, params) for p in PROMPTS[:3]]
    assert [h.result(timeout=60)[0] for h in hs] == alone
    assert len(failed) == 3 and eng.alive()


def test_a_step_feeds_its_tokens_to_the_next_and_the_host_fills_the_rest():
    """The decode inputs: slots fed from the device keep their token, those the host staged
    (a prompt's first token, padding) get the host's; a failed row's -1 is fed as a valid id."""
    eng, _ = make_engine(start=False, max_slots=4)
    r = eng.runner
    r.feed(torch.tensor([7, 8, -1]), None)
    r.feed(torch.tensor([9]), torch.tensor([3]))
    assert r._inp[0].tolist() == [7, 8, 0, 9]
    r._stage_inputs(4, [(0, None, 5), (1, 42, 6), (3, None, 2)])
    msl = eng.config.max_seq_len
    assert r._inp.tolist() == [[7, 42, 0, 9], [5, 6, msl - 1, 2], [1, 1, 0, 1]]
    r._stage_inputs(2, [(0, 11, 1), (1, 12, 3)])  # every token from the host: one plain copy
    assert r._inp[:, :2].tolist() == [[11, 12], [1, 3], [1, 1]]


def test_device_error_kills_the_loop():
    eng, _ = make_engine()

    def broken(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    eng.model.decode = broken
    try:
        h = eng.submit([1, 2, 3], SamplingParams(max_new_tokens=5, **GREEDY))
        assert h.result(timeout=30)[2] == "error"
        assert not eng.alive() and "illegal memory access" in str(eng.error)
        with pytest.raises(RuntimeError, match="engine loop is dead"):
            eng.submit([1], SamplingParams())
    finally:
        eng.shutdown()


def test_async_iteration_from_another_loop(engine):
    eng, _ = engine

    async def consume():
        h = eng.submit([3, 4, 5], SamplingParams(max_new_tokens=8, **GREEDY))
        chunks = [c async for c in h]
        return h, chunks

    h, chunks = asyncio.run(consume())
    assert chunks[-1].finish_reason == "length"
    assert [t for c in chunks for t in c.token_ids] == h.result()[0]
    assert threading.current_thread() is threading.main_thread()
    assert h.ttft_s is not None and h.ttft_s >= 0 and h.decode_tokens_per_s > 0


def test_async_consumer_cancelled_cancels_request():
    eng, _ = make_engine(max_slots=1, max_seq_len=256)

    async def consume():
        h = eng.submit([3, 4, 5], SamplingParams(max_new_tokens=250, **GREEDY))
        task = asyncio.ensure_future(h.__anext__())
        await task
        task = asyncio.ensure_future(h.__anext__())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return h

    try:
        h = asyncio.run(consume())
        assert h.result(timeout=30)[2] in ("cancelled", "length")
        assert h.cancelled
    finally:
        eng.shutdown()


def test_stats_and_shutdown(engine):
    eng, _ = engine
    t0 = time.perf_counter()
    busy0 = eng.stats()["busy_s"]
    eng.generate([1, 2, 3], SamplingParams(max_new_tokens=5, **GREEDY))
    time.sleep(0.3)  # (the loop's last turn ends after the request's)
    wall = time.perf_counter() - t0
    s = eng.stats()
    assert s["tokens_generated"] >= 5 and s["steps"] >= 4 and s["prompt_tokens"] >= 3
    assert 0 < s["busy_s"] - busy0 < wall  # the loop's turns for this request, not its idle waits
    assert s["prefill_s"] > 0 and s["decode_s"] > 0
    assert s["prefill_s"] + s["decode_s"] == pytest.approx(s["busy_s"])
    time.sleep(0.3)
    assert eng.stats()["busy_s"] == s["busy_s"]
    assert (s["running"], s["waiting"], s["free_slots"]) == (0, 0, 4)


def test_submit_after_shutdown_is_refused():
    eng, _ = make_engine(max_slots=2, max_seq_len=64)
    eng.shutdown()
    assert not eng.alive()
    with pytest.raises(RuntimeError, match="engine is shut down"):
        eng.submit([1, 2, 3], SamplingParams(max_new_tokens=2, **GREEDY))


def test_fallback_engine_matches_transformers():
    hf, cfg = hf_model("gpt2", vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    model = build_model(cfg, state_tensors(hf))
    eng = Engine(model, None, EngineConfig(max_slots=2, max_seq_len=64, prefill_chunk=4))
    eng.start()
    try:
        hs = [eng.submit(p, SamplingParams(max_new_tokens=10, **GREEDY)) for p in PROMPTS[:2]]
        for p, h in zip(PROMPTS[:2], hs):
            assert h.result(timeout=30)[0] == hf_greedy(hf, p, 10)
    finally:
        eng.shutdown()


def test_kv_cache_too_large_message():
    cfg = EngineConfig(max_slots=64, max_seq_len=8192).resolved(8192)
    with pytest.raises(ValueError, match=r"needs 64\.00 GiB.*only 10\.00 GiB of 80\.00 GiB.*lower engine\.max_slots"):
        check_fits(64 << 30, 1 << 30, cfg, 10 << 30, 80 << 30, "cuda:0")


def test_default_buckets():
    cfg = EngineConfig(max_slots=12, max_seq_len=4096).resolved(8192)
    assert cfg.graph_batch_sizes == (1, 2, 4, 8, 12)
    assert cfg.kv_len_buckets == (512, 2048, 4096)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_equals_eager():
    hf, config = hf_model("llama", num_hidden_layers=3)
    tensors = {k: v.to("cuda") for k, v in state_tensors(hf).items()}
    outs = []
    for graphs, lazy in ((False, False), (True, False), (True, True)):
        model = build_model(config, tensors)
        eng = Engine(model, None, EngineConfig(max_slots=4, max_seq_len=128, cuda_graphs=graphs, kv_len_buckets=(32,),
                                               lazy_graphs=lazy))
        eng.start()
        try:
            st = eng.stats()
            # batch (1, 2, 4) x the kv lengths (32, 128) that need a graph each (the Triton attention: the
            # longest alone); lazy: batch 1's alone, 2 and 4 deferred
            n_kv = len(model.decode_kv_lens((32, 128)))
            assert (st["graphs"], st["graphs_deferred"]) == ((n_kv, 2) if lazy else (3 * n_kv, 0) if graphs else (0, 0))
            if graphs:  # each batch size's first eager step, timed on its own
                assert sorted(st["first_launch_ms"]) == ([1] if lazy else [1, 2, 4])
            if graphs and hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
                assert st["graphs_uploaded"] == st["graphs"]  # none waits for its first launch to upload
            hs = [eng.submit(p, SamplingParams(max_new_tokens=40, **GREEDY)) for p in PROMPTS]
            outs.append([h.result(timeout=60)[0] for h in hs])
            if lazy:  # five prompts on four slots: a decode step needed batch 4's graphs, and captured them
                st = eng.stats()
                assert st["late_captures"][4][1] == "step" and set(st["late_captures"]) <= {2, 4}, st
        finally:
            eng.shutdown()
    assert outs[0] == outs[1] == outs[2]
    assert outs[0][0] == hf_greedy(hf, PROMPTS[0], 40)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_deferred_graphs_are_captured_when_the_loop_is_idle():
    hf, config = hf_model("llama", num_hidden_layers=3)
    tensors = {k: v.to("cuda") for k, v in state_tensors(hf).items()}
    params = SamplingParams(max_new_tokens=30, **GREEDY)
    eager = Engine(build_model(config, tensors), None, EngineConfig(max_slots=4, max_seq_len=128, cuda_graphs=False))
    eager.start()
    try:
        want = [h.result(timeout=60)[0] for h in [eager.submit(p, params) for p in PROMPTS[:4]]]
    finally:
        eager.shutdown()
    model = build_model(config, tensors)
    eng = Engine(model, None, EngineConfig(max_slots=4, max_seq_len=128, kv_len_buckets=(32,)))  # lazy: the default
    eng.start()
    try:
        time.sleep(0.3)
        assert eng.stats()["graphs_deferred"] == 2  # nothing captured until capture_deferred
        eng.capture_deferred()
        deadline = time.time() + 60
        while eng.stats()["graphs_deferred"] and time.time() < deadline:
            time.sleep(0.01)
        st = eng.stats()
        assert st["graphs"] == 3 * len(model.decode_kv_lens((32, 128))) and {b: why for b, (_, why) in st["late_captures"].items()} == {2: "idle", 4: "idle"}
        # what the graphs captured while idle compute is what eager steps compute
        assert [h.result(timeout=60)[0] for h in [eng.submit(p, params) for p in PROMPTS[:4]]] == want
    finally:
        eng.shutdown()


def test_queue_wait_is_the_time_until_a_slot_was_free():
    eng, _ = make_engine(max_slots=1, max_seq_len=128)
    try:
        a = eng.submit([3, 4, 5], SamplingParams(max_new_tokens=30, **GREEDY))
        b = eng.submit([3, 4, 6], SamplingParams(max_new_tokens=2, **GREEDY))
        a.result(timeout=60)
        b.result(timeout=60)
        # one slot: b was admitted only once a's last token was sampled and its slot freed
        assert b.admitted_at >= a.last_token_at
        assert b.queue_wait_s >= a.queue_wait_s >= 0
    finally:
        eng.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_engine_on_the_second_gpu():
    """The loop thread decodes on the engine's device, not on the new thread's default
    (device 0): Triton launches on the current device. (The building thread selects the
    device first, as a replica's context set-up does.)"""
    with torch.cuda.device(1):
        eng, hf = make_engine(device="cuda:1", prefill_chunk=40, max_seq_len=128)
    try:
        ids = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, **GREEDY))[0]
        assert ids == hf_greedy(hf, PROMPTS[0], 12)
    finally:
        eng.shutdown()
