"""A tensor-parallel replica on a real Ray instance (CPU, gloo): rank 0 is the replica, ranks
1..N-1 are Ray actors that follow its engine. Its requests give the tokens the one-device
replica gives; a rank that fails to start, load or keep running fails the replica, named; a
split pack and args.tp that disagree are refused before anything starts; and the application
deployed through serve_config.yaml's builder answers over HTTP with its ranks in /stats."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from deployments.app import build_app  # noqa: E402
from deployments.engine import SamplingParams  # noqa: E402
from deployments.server.replica import LLMServer  # noqa: E402
from helpers_engine import hf_greedy, hf_model, random_biases, write_tokenizer_dir  # noqa: E402
from weights import PackOptions, pack  # noqa: E402
from weights.format import PREAMBLE_BYTES  # noqa: E402

pytestmark = pytest.mark.ray

# vocab 97 (helpers_engine.TINY) divides by neither 2 nor 4; requests here give ids, not text
CASES = {
    # kv heads split over the ranks
    "llama-kv-split": ("llama", 2, dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4)),
    # one kv head, replicated on both ranks; biases and tied embeddings
    "qwen2-kv-replicated": ("qwen2", 2, dict(num_attention_heads=4, num_key_value_heads=1,
                                              tie_word_embeddings=True)),
    # 2 kv heads over 4 ranks (each on two); sliding window
    "mistral-tp4": ("mistral", 4, dict(sliding_window=6)),
}
ENGINE = {"max_slots": 4, "max_seq_len": 96, "prefill_chunk": 16, "prefill_min_len": 8}
# one prompt longer than a prefill chunk, two that share a padded length (one batched prefill)
PROMPTS = [list(range(3, 43)), [9, 8, 7, 6, 5], [11, 12, 13, 14], [2] * 9]
STEPS = 12


@pytest.fixture(scope="module")
def ray_instance():
    ctx = ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                   runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield ctx
    ray.shutdown()


def _model(root: Path, case: str) -> tuple[Path, list[list[int]]]:
    arch, n, kw = CASES[case]
    hf, _ = hf_model(arch, intermediate_size=128, **kw)
    random_biases(hf)
    hf.save_pretrained(root / "hf")
    write_tokenizer_dir(root / "hf")
    pack(root / "hf", root / "one", PackOptions(progress=False))
    pack(root / "hf", root / f"tp{n}", PackOptions(tp=n, progress=False))
    return root, [hf_greedy(hf, p, STEPS) for p in PROMPTS]


def _generate(server: LLMServer) -> list[list[int]]:
    """PROMPTS at once (one batch), greedy."""
    handles = server.engine.submit_many([(p, SamplingParams(max_new_tokens=STEPS, temperature=0, ignore_eos=True))
                                         for p in PROMPTS])
    return [h.result()[0] for h in handles]


@pytest.mark.parametrize("case", CASES)
def test_a_tensor_parallel_replica_generates_what_one_device_and_transformers_do(ray_instance, tmp_path, case):
    root, hf_tokens = _model(tmp_path, case)
    n = CASES[case][1]
    one = LLMServer(str(root / "one"), device="cpu", engine=ENGINE)
    try:
        want = _generate(one)
    finally:
        one.shutdown()
    split = LLMServer(str(root / f"tp{n}"), device="cpu", engine=ENGINE, tp=n)
    try:
        assert len(split.started.ranks.actors) == n - 1
        assert _generate(split) == want == hf_tokens
        assert _generate(split) == want  # and again, over caches the first batch used
        stats = split.stats()
        assert [r["rank"] for r in stats["ranks"]] == list(range(1, n))
        assert all(r["phases"]["load"] > 0 and r["phases"]["tp_group"] >= 0 for r in stats["ranks"])
        assert stats["engine"]["batched_prefills"] >= 2
    finally:
        split.shutdown()
    assert not split.started.ranks.actors


def test_a_tensor_parallel_replica_over_a_paged_cache_hands_every_rank_the_same_blocks(ray_instance, tmp_path):
    """Rank 0's scheduler hands out the blocks; the other ranks' tables follow (mirrored), so the
    tokens equal transformers' while requests wait for blocks and take freed ones, and again when
    prompts share the blocks the first ones kept (the ranks clear a kept block before its reuse),
    and when sequences that outgrow the cache are preempted and computed again."""
    root, hf_tokens = _model(tmp_path, "llama-kv-split")
    paged = {**ENGINE, "kv_cache": "paged", "kv_blocks": 6}  # 5 blocks of 16: the requests take turns
    split = LLMServer(str(root / "tp2"), device="cpu", engine=paged, tp=2)
    try:
        assert _generate(split) == hf_tokens
        assert split.engine.stats()["kv_blocks_free"] == 5
        greedy = SamplingParams(max_new_tokens=STEPS, temperature=0, ignore_eos=True)
        for _ in range(2):  # the second shares the first one's two full blocks
            assert split.engine.generate(PROMPTS[0], greedy)[0] == hf_tokens[0]
        assert split.engine.stats()["prefix_hit_tokens"] >= 32
        assert _generate(split) == hf_tokens
        # three that each grow to 4 of the 5 blocks: the one admitted last is preempted, its blocks
        # given back on every rank, and it is computed again; each gets the tokens it gets alone
        long = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
        prompts = [[20 + i] * 10 for i in range(3)]
        alone = [split.engine.generate(p, long)[0] for p in prompts]
        together = [h.result()[0] for h in split.engine.submit_many([(p, long) for p in prompts])]
        st = split.engine.stats()
        assert together == alone and st["preemptions"] > 0 and st["kv_blocks_free"] == 5
        assert st["prefix_evictions"] > 0  # kept blocks were cleared and taken for other tokens
    finally:
        split.shutdown()


@pytest.fixture(scope="module")
def split_demo(tiny_hf, tmp_path_factory) -> Path:
    """The tiny demo (its tokenizer matches its vocabulary) split over 2 ranks."""
    return pack(tiny_hf, tmp_path_factory.mktemp("split") / "tiny", PackOptions(tp=2, progress=False))


def test_a_rank_that_dies_fails_the_health_check_naming_it(ray_instance, split_demo):
    s = LLMServer(str(split_demo), device="cpu", engine=ENGINE, tp=2)
    try:
        s.reconfigure({"warmup": {"requests": 1}})
        s.check_health()
        ray.kill(s.started.ranks.actors[0])
        deadline = time.time() + 30
        while True:
            try:
                s.check_health()
            except RuntimeError as e:
                assert "tensor-parallel rank 1 (" in str(e) and "stopped" in str(e)
                break
            assert time.time() < deadline, "health stayed good after rank 1 was killed"
            time.sleep(0.2)
    finally:
        s.shutdown()


def test_a_rank_whose_weights_are_corrupt_fails_the_start_naming_it(ray_instance, split_demo, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(split_demo, bad)
    f = bad / "rank-1" / "model.cst"
    with open(f, "r+b") as fh:  # one byte of the first tensor's data
        fh.seek(PREAMBLE_BYTES + (f.stat().st_size - PREAMBLE_BYTES) // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(RuntimeError, match=r"rank 1 \(.*\): .*checksum"):
        LLMServer(str(bad), device="cpu", engine=ENGINE, tp=2)
    # nothing left behind: the next replica in this process starts its group again
    s = LLMServer(str(split_demo), device="cpu", engine=ENGINE, tp=2)
    s.shutdown()


@pytest.mark.parametrize("model, tp, msg", [
    ("split", 1, r"is split over 2 ranks \(`coldstart pack --tp 2`\): set args.tp to 2"),
    ("split", 4, r"args.tp is 4, but .* is split over 2 ranks: set args.tp to 2"),
    ("one", 2, r"args.tp is 2, but .* is one unsplit model: .* --tp 2"),
])
def test_a_pack_and_args_tp_that_disagree_are_refused_before_any_rank_starts(split_demo, tiny_packed, model,
                                                                              tp, msg):
    with pytest.raises(ValueError, match=msg):
        LLMServer(str(split_demo if model == "split" else tiny_packed), device="cpu", engine=ENGINE, tp=tp)


def test_args_tp_with_one_named_gpu_is_refused():
    from deployments.config import DeploymentArgs, parse
    with pytest.raises(ValueError, match=r"tp: each of the 2 ranks uses the GPU Ray gives it"):
        parse(DeploymentArgs, {"tp": 2, "device": "cuda:1"}, "args")
    assert parse(DeploymentArgs, {"tp": 2}, "args").bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 2


def test_the_application_serves_a_split_model_over_http_in_its_placement_group(ray_instance, split_demo, tiny_packed):
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    try:
        got = {}
        for name, model, tp in (("one", tiny_packed, 1), ("split", split_demo, 2)):
            app = build_app({"model": str(model), "device": "cpu", "tp": tp, "engine": ENGINE})
            serve.run(app, name=name, route_prefix=f"/{name}")
            r = httpx.post(f"http://127.0.0.1:8000/{name}/generate", timeout=60,
                           json={"prompt": "The answer is ", "max_new_tokens": 16, "temperature": 0})
            assert r.status_code == 200, r.text
            got[name] = r.json()["text"]
            stats = httpx.get(f"http://127.0.0.1:8000/{name}/stats", timeout=30).json()
            assert ("ranks" in stats) == (tp > 1)
        assert got["split"] == got["one"]
        pg = [p for p in ray.util.placement_group_table().values() if p["state"] == "CREATED"]
        assert any(p["strategy"] == "STRICT_PACK" and len(p["bundles"]) == 2 for p in pg)
    finally:
        serve.shutdown()


def test_coldstart_serve_reads_the_ranks_from_a_split_pack_and_asks_for_their_placement_group(split_demo,
                                                                                              tiny_packed):
    import yaml

    from deployments.tools.cli import derived_config, model_to_serve
    assert model_to_serve(split_demo, None) == (split_demo.resolve(), 2)
    assert model_to_serve(tiny_packed, None) == (tiny_packed.resolve(), None)
    with pytest.raises(ValueError, match=r"--tp 4: .* is split over 2 ranks"):
        model_to_serve(split_demo, 4)
    with pytest.raises(ValueError, match=r"--tp 2: .* is one unsplit model"):
        model_to_serve(tiny_packed, 2)
    text = (Path(__file__).resolve().parents[1] / "serve_config.gpu.yaml").read_text()
    cfg = yaml.safe_load(derived_config(text, model=split_demo, tp=2))
    app, dep = cfg["applications"][0], cfg["applications"][0]["deployments"][0]
    assert app["args"]["tp"] == 2 and app["args"]["model"] == str(split_demo)
    # every bundle holds what the replica's own actor asks for (Serve puts it in bundle 0)
    assert dep["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1.0}] * 2
    assert dep["placement_group_strategy"] == "STRICT_PACK"
    back = yaml.safe_load(derived_config(yaml.safe_dump(cfg), tp=1))["applications"][0]
    assert back["args"]["tp"] == 1 and "placement_group_bundles" not in back["deployments"][0]


def test_coldstart_serve_refuses_a_split_pack_with_a_bad_rank_before_ray_starts(split_demo, tmp_path):
    import subprocess
    import sys
    bad = tmp_path / "bad"
    shutil.copytree(split_demo, bad)
    (bad / "rank-1" / "model.cst").write_bytes(b"not a packed model")
    r = subprocess.run([sys.executable, "-m", "deployments.tools.cli", "serve", "--model", str(bad)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1 and "rank-1/model.cst: not a coldstart packed file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "serve run" not in r.stdout


def test_rank_0_holds_the_groups_port_from_launch_until_its_store_serves_on_it():
    """No other process can take the port between rank 0 choosing it (its first step, before
    torch) and the store serving on it; another rank reaches the store by the address it is given."""
    import socket

    from deployments.server.ranks import GroupStore
    ends = GroupStore.listen("127.0.0.1")
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", ends.port))
        master = ends.store(2)
        assert ends.listener is None  # the store owns the socket now
        client = GroupStore.at(ends.address).store(2)
        client.set("k", "v")
        assert master.get("k") == b"v"
    finally:
        ends.close()
    v6 = GroupStore.at("tcp://[::1]:29500")
    assert (v6.host, v6.port, v6.address) == ("::1", 29500, "tcp://[::1]:29500")
