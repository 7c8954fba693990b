"""The application on a real Ray instance (CPU): serve run, routing, autoscaling, health, failures.

One Ray instance for the module; each test deploys its own application under
its own route prefix and deletes it afterwards. Loads are bounded in count and
time and go to 127.0.0.1 only.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers_http import response, stalled

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from deployments.app import LLMDeployment  # noqa: E402

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
BASE = "http://127.0.0.1:8000"
ENGINE = {"max_slots": 4, "max_seq_len": 512}


def _controller_options() -> dict:
    """serve_config.yaml's controller_options (the proxies' body-first middleware), with a body
    deadline of 3 s."""
    import yaml
    opts = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["controller_options"]
    opts["runtime_env"]["env_vars"]["COLDSTART_PROXY_BODY_TIMEOUT_S"] = "3"
    return opts


@pytest.fixture(scope="module")
def ray_instance():
    ctx = ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                   runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    serve.start(http_options={"host": "127.0.0.1", "port": 8000}, controller_options=_controller_options())
    yield ctx
    serve.shutdown()
    ray.shutdown()


def _wait(pred, timeout: float, what: str, step: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _deploy(name: str, model: Path, *, user_config=None, blocking=True, http=None, engine=None, **opts):
    opts.setdefault("ray_actor_options", {"num_cpus": 1})
    opts.setdefault("health_check_period_s", 1)
    opts.setdefault("health_check_timeout_s", 10)
    dep = LLMDeployment.options(name=name, user_config=user_config or {"warmup": {"requests": 1}},
                                **opts)
    app = dep.bind(model=str(model), engine=engine or ENGINE, http=http or {}, fault_injection=True)
    try:
        serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
    except RuntimeError:  # serve.run reports a failed deploy itself; callers read serve.status()
        if blocking:
            raise
    if blocking:
        _wait(lambda: _app_status(name) == "RUNNING", 180, f"{name} RUNNING")


def _app_status(name: str) -> str | None:
    app = serve.status().applications.get(name)
    return None if app is None else str(app.status).split(".")[-1]


def _replicas(name: str) -> int:
    app = serve.status().applications.get(name)
    if app is None:
        return 0
    counts = next(iter(app.deployments.values())).replica_states
    return counts.get("RUNNING", 0)


def _post(path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(BASE + path, json=body, timeout=timeout)


@contextlib.contextmanager
def _coldstart_serve(tmp_path: Path, *args: str):
    """`coldstart serve ARGS` from tmp_path (with the project's serve_config.yaml), on its own Ray
    instance; stopped with Ctrl-C, as a user would, and Ray stopped after it."""
    shutil.copy(ROOT / "serve_config.yaml", tmp_path / "serve_config.yaml")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "deployments.tools.cli", "serve", *args], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
                       capture_output=True, timeout=120)


def _answers_generate(timeout: float = 240) -> httpx.Response:
    def up():
        try:
            r = _post("/generate", {"prompt": "The answer is ", "max_new_tokens": 128,
                                    "temperature": 0}, timeout=30)
            return r if r.status_code == 200 else None
        except httpx.HTTPError:
            return None
    return _wait(up, timeout, "serve run to answer /generate", step=2)


def test_serve_run_config_answers_generate_and_openai_streaming(tmp_path):
    """The README's main command, on its own Ray instance: `coldstart serve` -> `serve run`."""
    with _coldstart_serve(tmp_path):
        r = _answers_generate()
        assert (tmp_path / "weights" / "demo" / "model.cst").is_file()  # made on first run
        assert r.json()["usage"]["completion_tokens"] >= 1
        # serve_config.yaml's worker setup hook ran in the replica's process and imported the
        # engine's modules there, before Ray handed it the actor
        stats = httpx.get(BASE + "/stats", timeout=30).json()
        early = stats["early_import"]
        assert {"hook_at", "torch_at", "done_at"} <= set(early), early
        assert early["hook_at"] < stats["constructor_started_at"], (early, stats["constructor_started_at"])
        # and paused the garbage collector until the replica was warm, which then froze what
        # its start had made
        assert stats["gc"]["frozen"] > 50_000 and 0 < stats["gc"]["paused_s"], stats["gc"]
        assert stats["gc"]["paused_s"] <= stats["warm_at"] - early["hook_at"] + 1.0, (stats["gc"], early)

        from openai import OpenAI
        client = OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0)
        assert client.models.list().data[0].id == "demo"
        stream = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, temperature=0,
            stream=True)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        full = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, temperature=0)
        # greedy: the stream and the whole answer are the same tokens and end the same way (the random demo
        # model may pick its end-of-text token under sampling, so neither call samples)
        assert full.choices[0].message.content == text
        assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
        assert full.choices[0].finish_reason == "stop" or full.usage.completion_tokens == 8
        # a bad request through Ray's proxy is still a 4xx with a message
        bad = _post("/generate", {"prompt": "", "max_new_tokens": 3})
        assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]
        # and a body larger than any request for the demo's 1024-token context is refused unparsed
        big = _post("/generate", {"prompt": "a" * 2_000_000})
        assert big.status_code == 413, big.text
        assert "more than a request for a context of 1024 tokens can need" in big.json()["error"]["message"]
        assert "ready: http://127.0.0.1:8000 answers after" in (tmp_path / "serve.log").read_text()
        # `serve status` needs the Ray token that `coldstart status` sends
        env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
        st = subprocess.run([str(Path(sys.executable).with_name("coldstart")), "status"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
        assert st.returncode == 0 and "status: RUNNING" in st.stdout, st.stdout + st.stderr


def test_coldstart_serve_model_serves_that_packed_model(tmp_path, tiny_packed):
    """`coldstart serve --model DIR`: the config's application serves DIR (named after it), and
    no demo model is made."""
    model = tmp_path / "models" / "my-llama"
    shutil.copytree(tiny_packed, model)
    run = tmp_path / "run"
    run.mkdir()
    with _coldstart_serve(run, "--model", str(model)):
        assert _answers_generate().json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(BASE + "/v1/models", timeout=30).json()["data"][0]["id"] == "my-llama"
        assert not (run / "weights").exists()
        # the derived config is removed once the application is up (`serve run` read it as it began)
        derived = Path(re.search(r"serve_config.yaml with .*: (\S+\.yaml)", (run / "serve.log").read_text())[1])
        _wait(lambda: not derived.exists(), 30, f"{derived} removed")


def test_serve_model_serves_a_split_pack_over_its_ranks(tmp_path, tiny_hf):
    """`coldstart serve --model DIR` with a split pack: the ranks come from the pack, the replica
    gets its placement group, and its rank 1 is in /stats."""
    from weights import PackOptions, pack
    model = pack(tiny_hf, tmp_path / "models" / "split", PackOptions(tp=2, progress=False))
    run = tmp_path / "run"
    run.mkdir()
    with _coldstart_serve(run, "--model", str(model)):
        assert _answers_generate().json()["usage"]["completion_tokens"] >= 1
        stats = httpx.get(BASE + "/stats", timeout=30).json()
        assert [r["rank"] for r in stats["ranks"]] == [1] and stats["ranks"][0]["phases"]["load"] > 0
    assert "args.tp=2" in (run / "serve.log").read_text()


def test_autoscaling_up_under_load_never_routes_to_a_warming_replica_and_back(ray_instance,
                                                                              tiny_packed):
    """1 -> 2 replicas under a bounded load and back to 1. The new replica holds 6 s in its
    warm-up (un-routable): any request sent to it while cold would get a 503, so every
    request succeeding shows Ray routed only to warm replicas."""
    name = "auto"
    _deploy(name, tiny_packed, max_ongoing_requests=4,
            user_config={"warmup": {"requests": 1, "hold_s": 6}},
            autoscaling_config={
                "min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                "target_ongoing_requests": 1, "upscale_delay_s": 1, "downscale_delay_s": 3,
                "metrics_interval_s": 0.5, "look_back_period_s": 2})
    assert _replicas(name) == 1
    body = {"prompt": "go", "max_new_tokens": 300, "ignore_eos": True, "temperature": 0}
    scaled_at: list[float] = []
    stop_at = time.time() + 150

    def worker():
        out = []
        while time.time() < stop_at and not (scaled_at and time.time() > scaled_at[0] + 10):
            r = _post(f"/{name}/generate", body, timeout=120)
            out.append((r.status_code, r.headers.get("x-coldstart-replica")))
        return out
    with cf.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(worker) for _ in range(6)]
        _wait(lambda: _replicas(name) == 2, 120, "scale-up to 2 replicas")
        scaled_at.append(time.time())
        results = [x for f in futs for x in f.result()]
    codes = [c for c, _ in results]
    assert codes and set(codes) == {200}, codes     # none answered 503 from a cold replica
    assert len({rid for _, rid in results}) == 2    # the new replica served once warm
    _wait(lambda: _replicas(name) == 1, 120, "scale-down to 1 replica after the load")
    serve.delete(name)


def test_a_replica_whose_cache_long_requests_fill_gets_a_second_one(ray_instance, tiny_packed):
    """target_ongoing_requests = max_slots = 4, and four requests all the time: by Ray's own rule
    one replica is enough. But these are long (~200-token prompts, 250 new tokens: 29 of the
    replica's 39 paged-cache blocks each at their end), so its cache holds one to three of them at
    once and the rest wait for blocks or are preempted: with serve_config.yaml's capacity policy its
    reported share scales the target down, and Ray adds the second replica."""
    name = "capacity"
    engine = {"max_slots": 4, "max_seq_len": 512, "kv_cache": "paged", "kv_blocks": 40}  # 39 blocks: 624 positions
    _deploy(name, tiny_packed, engine=engine, max_ongoing_requests=8,
            autoscaling_config={
                "min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "target_ongoing_requests": 4,
                "upscale_delay_s": 1, "downscale_delay_s": 600, "metrics_interval_s": 0.5, "look_back_period_s": 2,
                "policy": {"policy_function": "deployments.server.autoscale:capacity_policy"}})
    assert _replicas(name) == 1
    body = {"prompt": "The answer is forty-two. " * 18, "max_new_tokens": 250, "ignore_eos": True, "temperature": 0}
    scaled: list[float] = []
    stop_at = time.time() + 150

    def worker() -> list[int]:
        codes = []
        while time.time() < stop_at and not scaled:
            codes.append(_post(f"/{name}/generate", body, timeout=120).status_code)
        return codes
    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(worker) for _ in range(4)]
        try:
            ratio = _wait(lambda: (r := httpx.get(f"{BASE}/{name}/stats", timeout=10).json()["capacity_ratio"]) < 1 and r,
                          60, "the replica to report a share below 1", step=0.2)
            _wait(lambda: _replicas(name) == 2, 120, "scale-up to 2 replicas")
        finally:
            scaled.append(time.time())
        codes = [c for f in futs for c in f.result()]
    assert 0 < ratio < 1
    assert codes and set(codes) == {200}, codes
    serve.delete(name)


def test_unhealthy_replica_is_replaced_while_requests_succeed(ray_instance, tiny_packed):
    name = "heal"
    _deploy(name, tiny_packed, num_replicas=2)
    r = _post(f"/{name}/admin/fault", {"kind": "engine_stop"})
    broken = r.json()["replica"]

    def request_with_retry() -> httpx.Response:
        # a broken replica answers 503 + Retry-After until Ray replaces it; clients retry
        for _ in range(20):
            resp = _post(f"/{name}/generate", {"prompt": "a", "max_new_tokens": 2})
            if resp.status_code != 503:
                return resp
            assert resp.headers["retry-after"]
            time.sleep(0.2)
        return resp
    ids = set()
    deadline = time.time() + 120
    while time.time() < deadline:
        resp = request_with_retry()
        assert resp.status_code == 200, resp.text
        ids.add(resp.headers["x-coldstart-replica"])
        if len(ids - {broken}) >= 2:
            break
    assert len(ids - {broken}) >= 2, "the broken replica was not replaced by a new one"
    serve.delete(name)


def test_corrupt_model_fails_the_deployment_with_the_checksum_message(ray_instance, tiny_packed,
                                                                      tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_packed, bad)
    with open(bad / "model.cst", "r+b") as f:
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    name = "corrupt"
    _deploy(name, bad, num_replicas=1, blocking=False)
    _wait(lambda: _app_status(name) == "DEPLOY_FAILED", 180, "DEPLOY_FAILED")
    app = serve.status().applications[name]
    msg = next(iter(app.deployments.values())).message
    assert "checksum mismatch in chunk 0" in msg and "model.cst" in msg
    serve.delete(name)


def _replica_log(ctx, name: str) -> str:
    """What app ``name``'s replicas wrote to their stderr (where asyncio reports a future whose
    exception nobody retrieved)."""
    logs = Path(ctx.address_info["session_dir"]) / "logs"
    texts = (f.read_text(errors="replace") for f in logs.glob("worker-*.err"))
    return "".join(t for t in texts if f":actor_name:ServeReplica:{name}:" in t)


def test_client_disconnect_cancels_generation(ray_instance, tiny_packed):
    """A client that hangs up mid-stream or mid-generation cancels its request, quietly: each
    streamed one used to leave a 65-line "Future exception was never retrieved ...
    TaskCancelledError" traceback in the replica's log."""
    name = "cancel"
    # the whole context: the answer asked for mid-generation below takes many polls of /stats to make
    _deploy(name, tiny_packed, num_replicas=1, engine={**ENGINE, "max_seq_len": 1024})

    def stats() -> dict:
        return httpx.get(f"{BASE}/{name}/stats", timeout=30).json()

    def ended(cancelled: int) -> dict:  # the route counts it as the client goes; the engine ends it at a step's end
        return _wait(lambda: (s := stats())["requests"].get("cancelled", 0) >= cancelled
                     and s["engine"]["running"] == 0 and s, 30, f"{cancelled} requests to be cancelled and ended")
    with httpx.stream("POST", f"{BASE}/{name}/generate", json={
            "prompt": "x", "max_new_tokens": 480, "ignore_eos": True, "stream": True}, timeout=60) as r:
        next(r.iter_lines())  # the first token arrived; now hang up
    first = ended(1)
    assert first["engine"]["free_slots"] == ENGINE["max_slots"]
    # stopped early: far fewer than the 480 tokens asked for (warm-up made 16)
    assert first["engine"]["tokens_generated"] - 16 < 240
    with httpx.stream("POST", f"{BASE}/{name}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 480, "ignore_eos": True, "stream": True},
            timeout=60) as r:
        next(r.iter_lines())
    ended(2)
    # mid-generation: a whole answer asked for, the client gone while it is generated
    s = stalled(8000, f"/{name}/v1/completions", declared=len(b := json.dumps(
        {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}).encode()), sent=b)
    _wait(lambda: stats()["engine"]["running"] == 1, 30, "the request to generate", step=0.02)
    s.close()
    last = ended(3)
    assert last["requests"]["cancelled"] == 3 and not last["requests"].get("error"), last["requests"]
    assert _post(f"/{name}/generate", {"prompt": "hi", "max_new_tokens": 2}).status_code == 200
    log = _replica_log(ray_instance, name)
    assert "ServeReplica" in log and "never retrieved" not in log and "TaskCancelledError" not in log, log[-3000:]
    serve.delete(name)


def test_a_paged_replica_gives_each_http_request_the_tokens_it_gets_alone(ray_instance, tiny_packed):
    """A paged replica whose cache holds fewer requests than come at once: behind one shared
    system prompt (its blocks reused), some requests are preempted and computed again; each
    answer over HTTP is the one that request gets alone, and every block comes back."""
    from concurrent.futures import ThreadPoolExecutor
    name = "paged"
    engine = {"max_slots": 4, "max_seq_len": 512, "kv_cache": "paged", "kv_blocks": 13}  # 12 blocks of 16
    _deploy(name, tiny_packed, num_replicas=1, engine=engine)
    system = "You are a terse assistant; answer in one line, then stop. " * 2
    prompts = [system + q for q in ("What is two and two?", "Name a colour.", "Count to three.", "Say hi.")]

    def ask(prompt: str) -> list[int]:
        r = _post(f"/{name}/generate", {"prompt": prompt, "max_new_tokens": 60, "temperature": 0,
                                        "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["token_ids"]
    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    stats = httpx.get(f"{BASE}/{name}/stats").json()["engine"]
    assert together == alone
    assert stats["prefix_hit_tokens"] > 0 and stats["preemptions"] > 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks"] == 12
    serve.delete(name)


def test_stalled_clients_never_hold_a_replica_slot(ray_instance, tiny_packed):
    """200 clients that send their headers and part of a body, then nothing, against the CPU
    config's limits (max_ongoing_requests 32, max_queued_requests 64): Ray's proxy routed each to
    the replica at once, and while they were open every other client got a 503. The proxy now
    reads a body before it routes the request (serve_config.yaml's controller_options): other
    clients are served beside them, each stalled one gets the proxy's 408, and neither they nor
    clients that hang up while sending reach the replica."""
    name = "stall"
    _deploy(name, tiny_packed, num_replicas=1, max_ongoing_requests=32, max_queued_requests=64)
    socks = [stalled(8000, f"/{name}/generate", sent=b'{"prompt": "x"') for _ in range(200)]
    try:
        for _ in range(3):
            r = _post(f"/{name}/generate", {"prompt": "hi", "max_new_tokens": 4}, timeout=60)
            assert r.status_code == 200, r.text
        for _ in range(3):
            hung = stalled(8000, f"/{name}/generate", declared=1000, sent=b'{"prompt": "x')
            hung.close()
        answers = [response(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert {status for status, _, _ in answers} == {408}, answers[:3]
    status, headers, body = answers[0]
    assert b"request body not received within 3 s (14 bytes came)" in body
    assert "x-coldstart-replica" not in headers  # the proxy answered it, not a replica
    assert _post(f"/{name}/generate", {"prompt": "hi", "max_new_tokens": 2}).status_code == 200
    requests = httpx.get(f"{BASE}/{name}/stats", timeout=30).json()["requests"]
    assert set(requests) == {"ok"}, requests  # the replica saw the served requests only
    serve.delete(name)


def test_a_503_from_rays_backpressure_says_when_to_retry(ray_instance, tiny_packed):
    """Ray's proxy answers a request beyond max_queued_requests with a 503 of its own: it carries
    a Retry-After like the replica's."""
    name = "busy"
    _deploy(name, tiny_packed, num_replicas=1, max_ongoing_requests=1, max_queued_requests=1)
    body = {"prompt": "x", "max_new_tokens": 480, "ignore_eos": True}
    with cf.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: _post(f"/{name}/generate", body), range(6)))
    busy = [r for r in answers if r.status_code == 503]
    assert busy and {r.status_code for r in answers} == {200, 503}
    assert all(r.headers["retry-after"] == "5" and "backpressure" in r.text for r in busy), busy[0].headers
    serve.delete(name)
