"""A replica's start without Ray: warm-up and health before it serves, the trickle of cold weights,
configs refused with the field's name, drills, and (on the GPU machine) its start's paths: the
engine built while the weights arrive, graphs captured once warm, a cold page cache, corrupt
weights."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from conftest import gpu
from deployments.config import DeploymentArgs, UserConfig, parse
from deployments.server.http import build
from deployments.server.replica import LLMServer, NotWarm
from deployments.server.start import Start
from weights import LoadOptions
from weights.timing import PhaseTimer


def _start_trickle(d, gpu: bool, opts: LoadOptions) -> bool:
    """Whether a replica of ``d`` with load options ``opts`` starts its trickle (its first step)."""
    start = Start(DeploymentArgs(model=str(d), device="cuda" if gpu else "cpu", load=opts), PhaseTimer())
    start.imports()
    return start.trickling


def test_cold_replica_answers_503_and_fails_health(tiny_packed):
    s = LLMServer(str(tiny_packed), engine={"max_slots": 2, "max_seq_len": 128})
    try:
        c = TestClient(build(s))
        r = c.post("/generate", json={"prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert "warming up" in r.json()["error"]["message"]
        with pytest.raises(NotWarm):
            s.check_health()
        s.reconfigure({"warmup": {"requests": 1}})
        s.check_health()
        assert c.post("/generate", json={"prompt": "hi", "max_new_tokens": 2}).status_code == 200
        # drills are off unless args.fault_injection is set
        assert c.post("/admin/fault", json={"kind": "engine_stop"}).status_code == 404
    finally:
        s.shutdown()


def test_a_gpu_replica_trickles_cold_weights_from_its_first_instant(cold_packed):
    """Before its imports, a GPU replica whose weights are not in the page cache starts
    reading them one piece at a time; not on the CPU, not with load.trickle false, not
    when they are cached already."""
    from weights import readahead

    d = cold_packed
    assert _start_trickle(d, False, LoadOptions()) is False
    assert _start_trickle(d, True, LoadOptions(trickle=False)) is False
    assert _start_trickle(d, True, LoadOptions(cold_direct_io=True)) is False
    assert readahead.stop_trickle(d) is False  # none was started
    assert _start_trickle(d, True, LoadOptions()) is True
    helper = readahead.trickle(d)  # the one the replica started
    assert helper is not None and helper.wait(timeout=60) == 0
    readahead.stop_trickle(d)
    assert not readahead.is_cold(d)
    assert _start_trickle(d, True, LoadOptions()) is False  # cached now: nothing to trickle
    assert readahead.stop_trickle(d) is False


def test_the_trickle_reads_pieces_of_the_size_asked(cold_packed):
    from weights import readahead

    d = cold_packed
    assert _start_trickle(d, True, LoadOptions(trickle_read_bytes=4 << 20)) is True
    helper = readahead.trickle(d)
    assert helper.args[-2] == str(4 << 20)  # (the helper's argv: code, file, piece, limit)
    assert helper.wait(timeout=60) == 0
    readahead.stop_trickle(d)
    with pytest.raises(ValueError, match="trickle_read_bytes"):
        LoadOptions(trickle_read_bytes=1000)


@pytest.mark.parametrize("uc, msg", [
    ({"warmup": {"requests": -1}}, "user_config.warmup.requests must be >= 0, got -1"),
    ({"warmup": {"prompt_fraction": 2}}, "user_config.warmup.prompt_fraction must be <= 1.0, got 2"),
    ({"warmup": {"batch_sizes": [0]}}, "user_config.warmup.batch_sizes: must be positive ints, got [0]"),
    ({"warmup": {"tokens": 3}}, "user_config.warmup: unknown field 'tokens'; known: batch_sizes, decode_tokens"),
    ({"warmup": {"decode_tokens": "8"}}, "user_config.warmup.decode_tokens must be int, got str '8'"),
    ({"warm_up": {}}, "user_config: unknown field 'warm_up'; known: warmup"),
])
def test_bad_user_config(uc, msg):
    with pytest.raises(ValueError) as e:
        parse(UserConfig, uc, "user_config")
    assert msg in str(e.value)


@pytest.mark.parametrize("args, msg", [
    ({"modle": "x"}, "args: unknown field 'modle'; known: device, engine"),
    ({"device": "tpu"}, "args.device: must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    ({"engine": 3}, "args.engine must be an object, got int 3"),
    ({"engine": {"max_slot": 8}}, "args.engine: unknown field 'max_slot'; known: cuda_graphs"),
    ({"http": {"body_timeout_s": 0}}, "args.http.body_timeout_s must be > 0.0, got 0"),
])
def test_bad_args(args, msg):
    with pytest.raises(ValueError) as e:
        parse(DeploymentArgs, args, "args")
    assert msg in str(e.value) and "docs/configuration.md" in str(e.value)


def test_bad_engine_and_load_options_name_the_field(tiny_packed):
    with pytest.raises(ValueError, match=r"args.engine: unknown field 'slots'"):
        LLMServer(str(tiny_packed), engine={"slots": 3})
    with pytest.raises(ValueError, match=r"args.load.threads must be int, got str"):
        LLMServer(str(tiny_packed), load={"threads": "many"})


def test_missing_model_dir_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="coldstart pack HF_DIR"):
        LLMServer(str(tmp_path / "nothing"))


def test_fault_injection_fails_health_and_requests_get_503(tiny_packed):
    s = LLMServer(str(tiny_packed), engine={"max_slots": 2, "max_seq_len": 128}, fault_injection=True)

    c = TestClient(build(s))
    s.reconfigure({"warmup": {"requests": 1}})
    s.check_health()
    assert c.post("/admin/fault", json={"kind": "engine_stop"}).status_code == 200
    with pytest.raises(RuntimeError, match="engine loop is not running"):
        s.check_health()
    r = c.post("/generate", json={"prompt": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"]


# ---- GPU: run on the GPU machine ----

def _greedy(server, prompt: str = "The answer is ", n: int = 12) -> list[int]:
    from deployments.engine.request import SamplingParams
    return server.engine.generate(server.tokenizer.encode(prompt),
                                  SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))[0]


def _gpu_replica_run(path, stats: bool = False, start: type = Start) -> tuple:
    """A GPU replica of ``path`` started, warmed and shut down: (its greedy output, its phases),
    and its engine's stats with ``stats``."""
    s = LLMServer(str(path), device="cuda", engine={"max_slots": 2, "max_seq_len": 128}, start=start)
    try:
        s.reconfigure({"warmup": {"requests": 1}})
        return (_greedy(s), s.timer.as_dict()) + ((s.engine.stats(),) if stats else ())
    finally:
        s.shutdown()


@gpu
def test_gpu_engine_built_during_the_load_serves_what_a_sequential_start_serves(tiny_packed, monkeypatch):
    """By default a GPU replica builds its engine (kernel self-tests, CUDA graphs) while the
    weights' bytes arrive; it must then serve exactly what a replica that waited serves."""
    class Sequential(Start):
        def start_load(self) -> None:
            super().start_load()
            self.overlap = False  # as for a model served through transformers
    runs = {"overlap": _gpu_replica_run(tiny_packed), "sequential": _gpu_replica_run(tiny_packed, start=Sequential)}
    assert runs["overlap"][0] == runs["sequential"][0]
    assert "load_wait" in runs["overlap"][1] and "load_first" not in runs["overlap"][1]
    assert "load_first" in runs["sequential"][1] and "load_wait" not in runs["sequential"][1]
    assert runs["overlap"][1]["load"] > 0 and runs["sequential"][1]["load"] > 0


@gpu
def test_gpu_replica_captures_the_rest_of_its_graphs_once_warm(tiny_packed):
    """A GPU replica starts with batch 1's graph alone; once warm and past its first health check
    (Ray's comes right after reconfigure and must not wait behind a capture), its engine's idle
    loop captures the other batch sizes', while health checks (a device-wide synchronize) go on."""
    import time

    s = LLMServer(str(tiny_packed), device="cuda", engine={"max_slots": 4, "max_seq_len": 128})
    try:
        assert s.engine.stats()["graphs_deferred"] == 2  # batch sizes 2 and 4
        s.reconfigure({"warmup": {"requests": 1}})
        time.sleep(1.0)  # an idle loop: nothing captured before the first health check
        assert s.engine.stats()["graphs_deferred"] == 2
        deadline = time.time() + 60
        while s.engine.stats()["graphs_deferred"] and time.time() < deadline:
            s.check_health()
        s.check_health()
        st = s.engine.stats()
        assert {b: why for b, (_, why) in st["late_captures"].items()} == {2: "idle", 4: "idle"}, st
        assert len(_greedy(s)) > 0
    finally:
        s.shutdown()


@gpu
def test_gpu_cold_replica_trickles_holds_its_load_and_serves_the_same(tiny_packed, tmp_path):
    """Weights not in the page cache: the replica trickles them in, its loader's bulk read
    waits for the engine's build (load_held), and it serves what a warm replica serves."""
    import shutil

    from deployments.tools.doctor import drop_page_cache
    from weights import readahead

    d = tmp_path / "m"
    shutil.copytree(tiny_packed, d)
    runs = {}
    for cache in ("warm", "cold"):
        if cache == "cold":
            drop_page_cache([d / "model.cst"])
            if not readahead.is_cold(d):
                pytest.skip("this filesystem kept the pages despite POSIX_FADV_DONTNEED")
        runs[cache] = _gpu_replica_run(d)
    assert runs["cold"][0] == runs["warm"][0]
    assert "load_held" in runs["cold"][1] and "load_held" not in runs["warm"][1]
    assert readahead.stop_trickle(d) is False  # the loader ended it when its reads began


@gpu
def test_gpu_corrupt_weights_fail_the_replica_even_with_its_engine_built(tiny_packed, tmp_path):
    import shutil
    import threading

    from weights import PackedFormatError, read_packed
    from weights.format import PREAMBLE_BYTES

    d = tmp_path / "m"
    shutil.copytree(tiny_packed, d)
    victim = read_packed(d).tensors[0]
    with open(d / "model.cst", "r+b") as f:
        f.seek(PREAMBLE_BYTES + victim.offset)
        b = f.read(1)
        f.seek(PREAMBLE_BYTES + victim.offset)
        f.write(bytes([b[0] ^ 1]))
    before = {t.ident for t in threading.enumerate() if t.name == "engine-loop"}
    with pytest.raises(PackedFormatError, match="checksum mismatch"):
        LLMServer(str(d), device="cuda", engine={"max_slots": 2, "max_seq_len": 128})
    assert not [t for t in threading.enumerate() if t.name == "engine-loop" and t.ident not in before]
