"""The paged KV cache (engine.kv_cache: paged): blocks addressed through a table, handed out at
admission and as sequences grow, taken back at a request's end or its preemption, and shared
between prompts with a common beginning; the engine's tokens equal the static cache's and
transformers' and each request's equal its own alone; requests wait for blocks in order, and one
the cache could never hold is refused with its numbers (CPU, fp32; the CUDA cases run on a GPU)."""

from __future__ import annotations

import time

import pytest
import torch
from fastapi.testclient import TestClient

from deployments.engine import Engine, EngineConfig, SamplingParams
from deployments.engine.blocks import BlockPool
from deployments.model import build_model
from deployments.model.config import ModelConfig
from deployments.model.kv_cache import PagedKVCache
from helpers_engine import hf_greedy, hf_model, state_tensors

GREEDY = dict(temperature=0.0, ignore_eos=True)
# one prompt over several prefill chunks, two that share a padded length (one batched prefill)
PROMPTS = [list(range(3, 43)), [9, 8, 7, 6, 5], [11, 12, 13, 14], [2] * 9, [5] * 20]
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA device")])


def _engine(hf_cfg: dict, hf: torch.nn.Module, device: str = "cpu", **cfg) -> Engine:
    model = build_model(hf_cfg, {k: v.to(device) for k, v in state_tensors(hf).items()})
    base = {"max_slots": 3, "max_seq_len": 96, "prefill_chunk": 16, "prefill_min_len": 8, "kv_cache": "paged"}
    return Engine(model, None, EngineConfig(**{**base, **cfg}))


def _run(eng: Engine, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    hs = eng.submit_many([(p, SamplingParams(max_new_tokens=n, **GREEDY)) for p in prompts])
    return [h.result(timeout=120)[0] for h in hs]


# ----------------------------------------------------------------------------- the cache itself
def _cache(blocks: int = 6, block_size: int = 16, slots: int = 3, max_seq_len: int = 64) -> PagedKVCache:
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 10,
                               "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64})
    return PagedKVCache(cfg, blocks, block_size, slots, max_seq_len, torch.float32, torch.device("cpu"),
                        one_segment=False)


def test_positions_land_in_their_blocks_and_read_back_in_order():
    c = _cache()
    c.assign(1, [4, 2, 5])  # slot 1: positions 0-15 in block 4, 16-31 in block 2, 32-47 in block 5
    k = torch.randn(1, 2, 40, 8)
    v = torch.randn(1, 2, 40, 8)
    c.write(0, torch.tensor([1]), torch.arange(40).unsqueeze(0), k, v)
    assert torch.equal(c.k[0][4, :, :16], k[0, :, :16]) and torch.equal(c.k[0][2, :, :16], k[0, :, 16:32])
    assert torch.equal(c.v[0][5, :, :8], v[0, :, 32:40]) and not c.v[0][5, :, 8:].any()
    rk, rv = c.read(0, torch.tensor([1]), 40)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert not c.k[1].any() and not c.k[0][[0, 1, 3]].any()  # nothing else written: other layer, other blocks
    c.release(1, [4, 2, 5])
    assert not c.data.any() and not c.block_table.any()


def test_a_slot_without_blocks_writes_only_the_null_block():
    c = _cache()
    c.assign(0, [1])
    c.write(0, torch.tensor([2]), torch.tensor([[63]]), torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))
    assert c.k[0][0].any() and not c.k[0][1:].any()  # a padding row's write: block 0 only


@pytest.mark.parametrize("kw, msg", [(dict(block_size=24), "power of two >= 16"), (dict(blocks=1), "at least 2 blocks")])
def test_bad_cache_shapes_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _cache(**kw)


def test_the_pool_hands_out_and_takes_back_blocks():
    p = BlockPool(5, 16, prefix=False)  # blocks 1-4
    assert (p.capacity, p.free, p.need(17), p.need(16)) == (4, 4, 2, 1)
    a = p.admit(list(range(40)), 48)
    assert (a.blocks, a.cached, a.clear) == ([1, 2, 3], 0, []) and p.admit([1], 17) is None and p.free == 1
    p.keep(a.blocks, a.keys)  # (nothing is kept: prefix reuse is off)
    assert p.give(a.blocks) == [1, 2, 3] and p.free == 4 and p.cached == 0
    assert sorted(p.admit([1] * 64, 64).blocks) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_new_tokens \(20\) needs 5 KV-cache blocks "
                                         r"of 16 positions, but this replica's cache holds 4 \(64 positions\)"):
        p.check(60, 20)


def test_the_pool_grows_a_sequence_by_one_block_and_keeps_headroom_at_admission():
    p = BlockPool(5, 16, prefix=False)  # blocks 1-4
    a = p.admit([1] * 20, 21)
    assert a.blocks == [1, 2] and p.admit([2] * 20, 21, headroom=1) is None  # 2 + 1 > 2 free
    assert p.grow() == (3, False) and p.grow() == (4, False) and p.grow() is None and p.free == 0
    assert p.give(a.blocks + [3, 4]) == [1, 2, 3, 4]


def test_the_pool_shares_the_full_blocks_of_a_kept_prefix_and_reuses_them_last():
    p = BlockPool(7, 4)  # blocks 1-6 of 4 positions
    sys_prompt = [7, 7, 1, 2, 9, 9, 9, 3]  # two full blocks
    a = p.admit(sys_prompt + [5, 6, 4], 13)  # 4 blocks, nothing kept yet
    assert (a.blocks, a.cached) == ([1, 2, 3, 4], 0) and len(a.keys) == 2
    p.keep(a.blocks, a.keys)  # its prompt is in the cache
    b = p.admit(sys_prompt + [8], 10)  # shares blocks 1, 2 (held by a too) and takes one more
    assert (b.blocks, b.cached, b.clear) == ([1, 2, 5], 8, []) and p.free == 1
    assert p.give(a.blocks) == [3, 4]  # 1, 2 are b's too; 3, 4 held no full prompt block: zeroed
    assert p.give(b.blocks) == [5] and (p.free, p.cached) == (6, 2)
    # the same prompt again: its last token is computed (its logits give the first new token)
    assert p.admit(sys_prompt, 9).cached == 4
    # a block's key is its whole prefix: the second block's tokens after another first block are no hit
    assert p.admit([0, 0, 0, 0, 9, 9, 9, 3, 1], 9).cached == 0
    assert p.counts["prefix_hit_tokens"] == 8 + 4


def test_kept_blocks_are_reused_for_other_prompts_last_blocks_first_and_cleared():
    p = BlockPool(4, 4)  # blocks 1-3
    a = p.admit(list(range(9)), 9)  # 3 blocks; its two full prompt blocks are kept
    p.keep(a.blocks, a.keys)
    assert p.give(a.blocks) == [3] and (p.free, p.cached) == (3, 2)
    b = p.admit([50, 51], 6)  # 2 blocks: the empty one, then the kept block of the prefix's end
    assert (b.blocks, b.clear, p.counts["prefix_evictions"]) == ([3, 2], [2], 1)
    assert p.give(b.blocks) == [3, 2] and p.admit(list(range(9)), 9).cached == 4  # its first block still kept


# ----------------------------------------------------------------------------- the engine over it
@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("arch, kw", [("llama", {}), ("mistral", {"sliding_window": 5}),
                                      ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1})])
def test_paged_engine_gives_the_static_cache_and_transformers_tokens(arch, kw, device):
    hf, cfg = hf_model(arch, **kw)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    got = {}
    for kind in ("static", "paged"):
        # (paged: as many blocks as the static cache's positions, on the GPU too, where the free
        # memory would decide otherwise)
        eng = _engine(cfg, hf, device, kv_cache=kind, **({"kv_blocks": 3 * 6 + 1} if kind == "paged" else {}))
        with eng:
            got[kind] = _run(eng, PROMPTS)
            got[kind + " again"] = _run(eng, PROMPTS)  # over blocks the first batch used and gave back
            if kind == "paged":
                st = eng.stats()
                assert st["kv_blocks_free"] == st["kv_blocks"] == 3 * 6 and st["kv_block_size"] == 16
    if device == "cpu":
        assert got["paged"] == got["paged again"] == got["static"] == want
    else:  # fp32 on the GPU: the kernels' sums in another order may move a near tie
        assert got["paged"] == got["paged again"] == got["static"]


def test_requests_wait_in_order_for_blocks_and_all_finish():
    hf, cfg = hf_model("llama")
    # 5 free blocks of 16: the 40-token prompt (+12) needs 4, the others 1 or 2; at most two run at once
    eng = _engine(cfg, hf, kv_blocks=6)
    with eng:
        admitted = []
        hs = eng.submit_many([(p, SamplingParams(max_new_tokens=12, **GREEDY)) for p in PROMPTS])
        outs = [h.result(timeout=120)[0] for h in hs]
        admitted = [h.admitted_at for h in hs]
        assert eng.stats()["kv_blocks_free"] == 5
    assert admitted == sorted(admitted)  # first come, first served: nobody jumps the queue for blocks
    assert outs == [hf_greedy(hf, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["paged", "static"])
def test_device_memory_run_out_before_serving_names_what_to_change(monkeypatch, kind):
    """A cache sized to the free memory leaves reserve_bytes for the rest; where the first
    prefills need more (a CPU cannot run out: the prefill of 64 tokens raises what CUDA's
    allocator would), the start fails saying which knobs leave more, not with the bare error."""
    hf, cfg = hf_model("llama")
    eng = _engine(cfg, hf, kv_cache=kind, prefill_chunk=64, prefill_min_len=16)
    prefill = eng.model.prefill

    def short_of_memory(tokens, *a, **kw):
        if tokens.shape[1] == 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 44.00 MiB.")
        return prefill(tokens, *a, **kw)

    monkeypatch.setattr(eng.model, "prefill", short_of_memory)
    fewer = r"set engine.kv_blocks below the cache's 19" if kind == "paged" else r"lower engine.max_slots or"
    with pytest.raises(RuntimeError, match=r"ran out of device memory in its first prefill of 64 prompt tokens, "
                                           r"beside a KV cache of 0\.00 GiB and engine.reserve_bytes=1\.00 GiB .* "
                                           + fewer + r".* engine.prefill_chunk=64"):
        eng.start()
    eng.shutdown()


def test_the_default_reserve_grows_with_the_prefill_chunk_and_a_set_one_stands():
    """engine.reserve_bytes left out: 1 GiB plus twice the model's estimate of its largest prefill
    forward, which grows with the chunk (a 7B model's shapes, on the meta device: nothing allocated)."""
    from deployments.engine.runner import default_reserve
    from deployments.model.llama import Transformer
    with torch.device("meta"):
        model = Transformer(ModelConfig("LlamaForCausalLM", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                        num_hidden_layers=1, num_attention_heads=32)).half()
    GiB = 1 << 30
    at = {c: default_reserve(model, EngineConfig(prefill_chunk=c).resolved(4096), 4 * 4096) for c in (512, 2048, 4096)}
    assert GiB < at[512] < at[2048] < at[4096]
    # the estimate: 2048 rows through one layer (123 KB each in fp16), 16384 gathered positions'
    # keys and values (268 MB) and 128 rows of logits (25 MB), twice, beside 1 GiB
    assert 2.0 * GiB < at[2048] < 2.2 * GiB
    # a model with no estimate (one served through transformers): 1 GiB; a reserve set in the
    # config is what the runner keeps
    from deployments.model.hf_fallback import HFModel
    hf, cfg = hf_model("llama")
    assert default_reserve(HFModel(hf, cfg), EngineConfig().resolved(4096), 0) == GiB
    assert _engine(cfg, hf, reserve_bytes=3 * GiB).runner.reserve_bytes == 3 * GiB
    assert GiB < _engine(cfg, hf).runner.reserve_bytes < 1.01 * GiB  # a tiny model's activations: little


def test_a_request_the_cache_can_never_hold_is_refused_with_its_numbers():
    hf, cfg = hf_model("llama")
    eng = _engine(cfg, hf, kv_blocks=4)  # 3 blocks: 48 positions
    with eng:
        with pytest.raises(ValueError, match=r"prompt \(40 tokens\) \+ max_new_tokens \(20\) needs 4 KV-cache blocks "
                                             r".* holds 3 \(48 positions\)"):
            eng.submit(list(range(3, 43)), SamplingParams(max_new_tokens=20, **GREEDY))
        assert _run(eng, [[5, 6, 7]], 4)  # and the engine goes on


def test_cancelled_and_finished_requests_give_their_blocks_back_zeroed():
    hf, cfg = hf_model("llama")
    eng = _engine(cfg, hf, prefix_cache=False)  # (kept prefixes stay filled: the next test)
    with eng:
        h = eng.submit(list(range(3, 40)), SamplingParams(max_new_tokens=50, **GREEDY))
        while not h.admitted_at:
            time.sleep(0.01)
        h.cancel()
        h.result(timeout=60)
        _run(eng, [[4, 5, 6]], 5)
        deadline = time.time() + 10
        while eng.stats()["kv_blocks_free"] != eng.stats()["kv_blocks"] and time.time() < deadline:
            time.sleep(0.01)
        cache = eng.runner.cache
        assert eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks"]
        assert not cache.data[:, :, 1:].any() and not cache.block_table.any()  # only the null block written


def test_http_refuses_a_request_the_cache_cannot_hold_with_a_400(tiny_packed):
    from deployments.server.http import build
    from deployments.server.replica import LLMServer
    s = LLMServer(str(tiny_packed), device="cpu", engine={"max_slots": 2, "max_seq_len": 256, "kv_cache": "paged",
                                                          "kv_blocks": 5})
    try:
        c = TestClient(build(s))
        s.reconfigure({"warmup": {"requests": 1, "decode_tokens": 4, "prompt_fraction": 0.05}})
        r = c.post("/generate", json={"prompt": "The answer is ", "max_new_tokens": 100, "temperature": 0})
        assert r.status_code == 400 and "KV-cache blocks" in r.text and "holds 4 (64 positions)" in r.text, r.text
        r = c.post("/generate", json={"prompt": "The answer is ", "max_new_tokens": 8, "temperature": 0})
        assert r.status_code == 200
        assert c.get("/stats").json()["engine"]["kv_blocks"] == 4
    finally:
        s.shutdown()


def test_a_mixed_load_on_a_small_cache_never_fails_and_each_request_gets_its_tokens_alone():
    """30 requests of random lengths on a cache that holds two or three of them at a time:
    every one finishes, with the tokens it gets alone (no memory error; those preempted are
    computed again and go on)."""
    hf, cfg = hf_model("llama")
    g = torch.Generator().manual_seed(3)
    reqs = []
    for _ in range(30):
        n = int(torch.randint(1, 60, (1,), generator=g))
        reqs.append((torch.randint(3, 97, (n,), generator=g).tolist(), int(torch.randint(1, 30, (1,), generator=g))))
    eng = _engine(cfg, hf, max_slots=4, kv_blocks=10)  # 9 blocks of 16: 144 positions
    with eng:
        alone = [eng.generate(p, SamplingParams(max_new_tokens=m, **GREEDY))[0] for p, m in reqs]
        hs = eng.submit_many([(p, SamplingParams(max_new_tokens=m, **GREEDY)) for p, m in reqs])
        together = [h.result(timeout=300)[0] for h in hs]
        assert eng.stats()["kv_blocks_free"] == 9
    assert together == alone and all(len(t) == m for t, (_, m) in zip(together, reqs))


@pytest.mark.parametrize("arch, kw", [("llama", {}), ("mistral", {"sliding_window": 7})])
@pytest.mark.parametrize("attention", [True, False])
def test_the_fused_decode_reads_and_writes_through_the_table(attention, arch, kw, tmp_path):
    """The prefills and decode steps the GPU runs (rope + cache write in one op; the flash-decoding
    attention or the batched matmuls over a gather), here through the ops' references on the CPU:
    prompts of several chunks, and prompts that share a forward."""
    from deployments.kernels.policy import KernelPlan
    from weights import PackOptions, load, pack
    hf, cfg = hf_model(arch, intermediate_size=128, hidden_size=128, num_attention_heads=8, num_key_value_heads=4,
                       **kw)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    hf.save_pretrained(tmp_path / "hf")
    m = load(pack(tmp_path / "hf", tmp_path / "p", PackOptions(progress=False)), "cpu")
    model = build_model(m.config, m.tensors)  # packed: q/k/v and gate/up lie back to back (the fused views)
    eng = Engine(model, None, EngineConfig(max_slots=3, max_seq_len=96, prefill_chunk=16, prefill_min_len=8,
                                           kv_cache="paged"))
    # set after the engine's paged-kernel check, which turns them off where Triton is not (the CPU)
    model.kernels = KernelPlan(fused=True, attention=attention)
    assert model.kernels.fused and model.attention_kernel() == attention
    with eng:
        assert _run(eng, PROMPTS) == want


@pytest.mark.parametrize("arch, kw", [("llama", {}), ("mistral", {"sliding_window": 5}),
                                      ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1})])
def test_prompts_that_share_a_prefix_share_its_blocks_and_get_their_own_tokens(arch, kw):
    """A system prompt's blocks are computed once: later prompts that begin with it (alone, or
    several at once, one identical to it) prefill only the rest, and each gets the tokens
    transformers gives it; kept blocks overwritten by other prompts are zeroed first."""
    hf, cfg = hf_model(arch, **kw)
    system = list(range(3, 38))  # 35 tokens: two full blocks of 16
    prompts = [system + [40, 41, 42], system + [50] * 20, system, system[:20], system + [60]]
    want = [hf_greedy(hf, p, 10) for p in prompts]
    eng = _engine(cfg, hf, max_slots=3, kv_blocks=13)  # 12 blocks: a few prompts' worth
    with eng:
        assert _run(eng, [prompts[0]], 10) == [want[0]]
        assert eng.stats()["kv_blocks_cached"] == 2 and eng.stats()["prefix_hit_tokens"] == 0
        assert _run(eng, prompts[1:], 10) == want[1:]
        st = eng.stats()
        assert st["prefix_hit_tokens"] == 32 + 32 + 16 + 32  # (the same prompt: its last block is computed)
        other = [[90 - i] * 70 for i in range(3)]  # 5 blocks each with their 10 new tokens: kept blocks go
        assert _run(eng, other, 10) == [hf_greedy(hf, p, 10) for p in other]
        assert eng.stats()["prefix_evictions"] > 0
        assert _run(eng, prompts, 10) == want  # over blocks that held other prompts
        st = eng.stats()
        assert st["kv_blocks_free"] == st["kv_blocks"] == 12


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_burst_behind_one_system_prompt_computes_it_once(device):
    """Prompts that arrive together behind one system prompt, none of it in the cache yet: the
    first is admitted and computes it; the others wait until it is in the cache, then share it
    (a prompt of other tokens behind them goes on meanwhile), and their rests, which pad to one
    length, share one forward from the prefix's end; each gets its own tokens (on the GPU, the
    tokens of each prompt alone there)."""
    hf, cfg = hf_model("llama")
    system = list(range(3, 51))  # 48 tokens: three full blocks of 16
    prompts = [system + [60 + i] * (i + 1) for i in range(6)] + [[90] * 20]
    if device == "cpu":
        want = [hf_greedy(hf, p, 8) for p in prompts]
    else:  # fp32 on the GPU: the kernels' sums in another order may move a near tie
        with _engine(cfg, hf, device, max_slots=7, kv_blocks=40, prefill_chunk=32, prefix_cache=False) as alone:
            want = [alone.generate(p, SamplingParams(max_new_tokens=8, **GREEDY))[0] for p in prompts]
    eng = _engine(cfg, hf, device, max_slots=7, kv_blocks=40, prefill_chunk=32)
    groups = []
    real = eng.model.prefill_batch
    eng.model.prefill_batch = lambda tokens, *a, start=0, **k: (
        groups.append((*tokens.shape, start)), real(tokens, *a, start=start, **k))[1]
    with eng:
        hs = eng.submit_many([(p, SamplingParams(max_new_tokens=8, **GREEDY)) for p in prompts])
        got = [h.result(timeout=120)[0] for h in hs]
        st = eng.stats()
        admitted = [h.admitted_at for h in hs]
    assert got == want
    assert st["prefix_hit_tokens"] == 5 * 48  # five prompts shared the first one's three blocks
    assert admitted[6] < min(admitted[1:6])  # the other prompt did not wait behind them
    # start's own (2 x 8 at 0); then four of the five rests (2..6 tokens, each padded to 8) at 48,
    # and the fifth alone
    assert groups == [(2, 8, 0), (4, 8, 48)]
    assert st["batched_prefills"] == 1


@pytest.mark.parametrize("sampling", [GREEDY, dict(temperature=0.8, top_k=20, seed=5, ignore_eos=True)])
def test_sequences_that_outgrow_the_cache_are_preempted_and_go_on_with_the_tokens_they_get_alone(sampling):
    """Blocks are taken as tokens are written, not for max_new_tokens up front: three requests
    that each end up needing 4 of the cache's 6 blocks run at once; when a growing one finds no
    free block, the one admitted last gives its blocks back and is prefilled again over its prompt
    and its tokens, then goes on. Every request streams each token once, the tokens it gets
    alone (seeded sampling included: its generator goes on), and all blocks come back."""
    hf, cfg = hf_model("llama")
    prompts = [[7 + i] * 10 for i in range(3)]
    params = SamplingParams(max_new_tokens=50, **sampling)
    eng = _engine(cfg, hf, kv_blocks=7, prefix_cache=False)  # 6 blocks of 16
    with eng:
        alone = [eng.generate(p, params)[0] for p in prompts]
        assert eng.stats()["preemptions"] == 0
        hs = eng.submit_many([(p, params) for p in prompts])
        streamed = [[t for ch in h for t in ch.token_ids] for h in hs]
        st = eng.stats()
    assert [h.result()[0] for h in hs] == streamed == alone and all(len(t) == 50 for t in alone)
    assert st["preemptions"] > 0 and st["kv_blocks_free"] == st["kv_blocks"] == 6
    if sampling is GREEDY:
        assert alone == [hf_greedy(hf, p, 50) for p in prompts]


def test_a_group_past_a_prefix_is_bounded_by_the_positions_it_gathers():
    """Rests that start past a prefix share a forward in powers of two, no more rows than the
    chunk holds and, since each row's attention gathers its cached positions, no more than
    ``max_read`` positions in all; fresh prompts gather none. The first pair in order that can
    share a forward decides."""
    from deployments.engine.config import prefill_lengths
    from deployments.engine.scheduler import Scheduler, SchedulerConfig, Seq

    def seq(n: int, prefilled: int) -> Seq:
        s = Seq(0, [5] * n, SamplingParams())
        s.prefilled = prefilled
        return s

    def grouped(chunk: int, max_read: int) -> tuple:  # prompts padded to powers of two from 8
        return Scheduler(SchedulerConfig(16, 10**6, chunk, prefill_lengths(1 << 20, 8), True, max_read)).group(
            sch.prefilling, chunk)

    sch = Scheduler(SchedulerConfig(16, 10**6, 64))
    alone, past = seq(50, 0), [seq(64 + 5, 64) for _ in range(8)]
    fresh = [seq(6, 0) for _ in range(8)]
    sch.prefilling = [alone, *past, *fresh]
    group, L, start = grouped(64, 4 * 72)
    assert (group, L, start) == (past[:4], 8, 64)  # 4 x (64 + 8) positions; 8 would gather twice that
    group, L, start = grouped(64, 7 * 72)
    assert len(group) == 4  # a power of two
    group, L, start = grouped(64, 71)
    assert (group, L, start) == (fresh, 8, 0)  # not two rows past the prefix: the next pair, 8 x 8 rows
    sch.prefilling = [alone, past[0], *fresh[:3]]
    assert grouped(64, 0) == (fresh[:2], 8, 0)  # no prefix to gather
    sch.prefilling = [alone, past[0], fresh[0]]
    assert grouped(64, 10**6) == ([], 0, 0)  # no two alike: each alone
