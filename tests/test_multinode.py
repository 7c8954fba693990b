"""A remote model on a real multi-node Ray cluster on one host (``ray.cluster_utils.Cluster``):
three nodes, each with its own node cache (COLDSTART_CACHE_DIR in its raylet's environment), an
S3-speaking server (moto) and a plain HTTP range server as sources, both their own processes.

Peers: a node that never held the model gets it from a node that does, through Ray; a corrupt or
failing peer is dropped and its pieces come from elsewhere. Serve: a deployment scaled to zero
answers its first request once a replica is warm, grows to a second replica on another node (which
takes the weights from the first node, not the source), and goes back to zero, with no request lost.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from helpers_remote import RangeServer, free_port, make_bucket, no_partials, s3_server
from weights import PackOptions, pack
from weights.remote import push

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.ray
CHUNK = 64 << 10
NODES = ("a", "b", "c")
ENGINE = {"max_slots": 4, "max_seq_len": 512}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world(tiny_hf, tmp_path_factory):
    """(cluster, caches by node, the chunked packed model, an S3 URI of it, the HTTP range server)."""
    tmp = tmp_path_factory.mktemp("multinode")
    model = pack(tiny_hf, tmp / "www" / "tiny", PackOptions(progress=False, chunk_bytes=CHUNK))
    with s3_server(tmp / "moto.log"):
        make_bucket("fleet")
        push(model, "s3://fleet/tiny")
        www = RangeServer(tmp / "www", tmp / "range.log").start()
        caches = {n: tmp / f"cache-{n}" for n in NODES}
        cluster = Cluster()
        for i, n in enumerate(NODES):
            args = {"num_cpus": 2 if i == 0 else 1, "resources": {f"node_{n}": 1, "slot": 1},
                    "env_vars": {"COLDSTART_CACHE_DIR": str(caches[n]), "TOKENIZERS_PARALLELISM": "false"},
                    "object_store_memory": 80 << 20}
            if i == 0:
                args["include_dashboard"] = False
                cluster.add_node(**args)
            else:
                cluster.add_node(**args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield cluster, caches, model, "s3://fleet/tiny", www
        finally:
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()
            www.stop()


@ray.remote(num_cpus=0)
def _fetch_here(uri: str, piece: int = 16 << 20) -> tuple[dict, dict, str]:
    """On the node the task is pinned to: the model into its cache, from its peers or the source, in
    pieces of ``piece`` bytes, beginning where this node begins (as a replica's start does)."""
    from deployments.node_cache import model_cache
    from deployments.peers import RayPeers
    from weights.fetch import Fetch, resolve
    cache = model_cache()
    got = resolve(uri, cache, peers=RayPeers(cache.root))
    if isinstance(got, Fetch):
        got.run(threads=2, piece_bytes=piece)
        return dict(got.stats.bytes_from), dict(got.stats.dropped), str(got.entry)
    return {}, {}, str(got)


def _on(node: str, uri: str):
    return ray.get(_fetch_here.options(resources={f"node_{node}": 0.01}).remote(uri), timeout=180)


def _weights(entry: str) -> bytes:
    return (Path(entry) / "model.cst").read_bytes()


def _damage(path: Path, at: int, truncate: bool = False) -> None:
    with open(path, "r+b") as f:
        if truncate:
            f.truncate(at)
            return
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_new_node_gets_the_model_from_its_peer_and_a_bad_peer_is_dropped(world):
    _, caches, model, uri, _ = world
    want = (model / "model.cst").read_bytes()
    from_a, dropped_a, entry_a = _on("a", uri)
    assert set(from_a) == {uri} and not dropped_a  # nobody else has it: the source
    from_b, dropped_b, entry_b = _on("b", uri)
    assert uri not in from_b and sum(from_b.values()) > 0 and not dropped_b  # all of it from node a
    assert _weights(entry_a) == want and _weights(entry_b) == want
    # a's copy corrupt in its second chunk, b's cut short: c drops both and still gets every byte right
    _damage(Path(entry_a) / "model.cst", 4096 + CHUNK + 10)
    _damage(Path(entry_b) / "model.cst", 4096 + 3 * CHUNK, truncate=True)
    from_c, dropped_c, entry_c = _on("c", uri)
    assert _weights(entry_c) == want
    assert len(dropped_c) == 2 and any("checksum mismatch" in why for why in dropped_c.values())
    assert from_c.get(uri, 0) > 0
    assert not no_partials(caches["c"])


def _generate(base: str, n: int = 12, timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{base}/generate", json={"prompt": "The answer is ", "max_new_tokens": n,
                                                 "temperature": 0, "ignore_eos": True}, timeout=timeout)


def _replicas(name: str) -> int:
    app = serve.status().applications.get(name)
    if app is None or not app.deployments:
        return 0
    return next(iter(app.deployments.values())).replica_states.get("RUNNING", 0)


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_scale_from_zero_to_two_nodes_and_back_with_no_request_lost(world, tiny_hf):
    from deployments.app import LLMDeployment
    from deployments.server.replica import LLMServer
    from test_replica_start import _greedy
    cluster, caches, model, _, www = world
    # a pack of its own (another chunk size: another digest): a model no node has any of yet
    model = pack(tiny_hf, www.root / "scale", PackOptions(progress=False, chunk_bytes=2 * CHUNK))
    uri = f"{www.url}/scale"
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
    base = f"http://127.0.0.1:{port}/scale"
    # the shipped scale-to-zero settings (serve_config.zero.yaml), with the test's own scale: a target
    # of one request per replica, two replicas at most, and seconds instead of minutes before zero
    shipped = yaml.safe_load((ROOT / "serve_config.zero.yaml").read_text())["applications"][0]["deployments"][0]
    auto = {k: v for k, v in shipped["autoscaling_config"].items() if k != "policy"}
    assert auto["min_replicas"] == auto["initial_replicas"] == 0
    auto.update(max_replicas=2, target_ongoing_requests=1, downscale_delay_s=4, downscale_to_zero_delay_s=4,
                look_back_period_s=2)
    dep = LLMDeployment.options(
        name="scale", ray_actor_options={"num_cpus": 0, "resources": {"slot": 1}}, autoscaling_config=auto,
        health_check_period_s=1, user_config={"warmup": {"requests": 1}})
    serve.run(dep.bind(model=uri, engine=ENGINE), name="scale", route_prefix="/scale", blocking=False)
    _wait(lambda: "scale" in serve.status().applications, 60, "the application")
    assert _replicas("scale") == 0
    first = _generate(base)  # held by Ray's proxy until a replica is warm: no 404 or 503
    assert first.status_code == 200, first.text
    local = LLMServer(str(model), device="cpu", engine=ENGINE)
    assert first.json()["token_ids"] == _greedy(local, n=12)
    local.shutdown()

    stop, codes = threading.Event(), []

    def client() -> None:
        while not stop.is_set():
            codes.append(_generate(base, n=200).status_code)
    with cf.ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            pool.submit(client)
        try:
            _wait(lambda: _replicas("scale") == 2, 240, "a second replica")
        finally:
            stop.set()
    assert codes and set(codes) == {200}
    held = [n for n in NODES if list(caches[n].rglob("scale.*/*/model.cst"))]
    assert len(held) == 2, held  # two nodes hold it now
    size = (model / "model.cst").stat().st_size
    assert www.stats()["sent"]["scale/model.cst"] < 1.5 * size  # the second node's copy came from the first
    seen = {}
    for _ in range(20):  # each replica's /stats says where its weights came from
        w = httpx.get(f"{base}/stats", timeout=30).json()
        seen[w["replica"]] = w["weights"]
    if len(seen) == 2:
        assert sorted(uri in v.get("bytes_from", {}) for v in seen.values()) == [False, True], seen
    _wait(lambda: _replicas("scale") == 0, 120, "scale back to zero")
    again = _generate(base)
    assert again.status_code == 200 and again.json()["token_ids"] == first.json()["token_ids"]
    serve.delete("scale")


def test_nodes_starting_together_pass_pieces_to_each_other(world, tiny_hf):
    """Two nodes fetch a model no node holds, at once, from a slow source: each begins at its own
    piece and takes from the other what it already checked, so the source sends less than two copies."""
    _, caches, _, _, www = world
    # a pack of its own (another chunk size: another digest), so no node's earlier copy serves it
    model = pack(tiny_hf, www.root / "together", PackOptions(progress=False, chunk_bytes=CHUNK // 2))
    www.fault(delay_s=0.1)
    try:
        uri = f"{www.url}/together"
        refs = [_fetch_here.options(resources={f"node_{n}": 0.01}).remote(uri, CHUNK // 2) for n in ("b", "c")]
        results = ray.get(refs, timeout=300)
    finally:
        www.fault(delay_s=0)
    want = (model / "model.cst").read_bytes()
    for _, dropped, entry in results:
        assert not dropped and _weights(entry) == want
    from_peers = [sum(v for k, v in got.items() if k != uri) for got, _, _ in results]
    assert sum(from_peers) > 0, results
    assert www.stats()["sent"]["together/model.cst"] < 2 * len(want)


@ray.remote(num_cpus=0)
def _start_piece(n_pieces: int) -> int:
    from deployments.node_cache import model_cache
    from deployments.peers import RayPeers
    return RayPeers(model_cache().root).start_piece(n_pieces)


def test_nodes_begin_their_transfers_evenly_spaced(world):
    """Each node begins a transfer at its own place, a third of the file apart on three nodes,
    whatever their ids: none two begin close enough to read the same pieces from the source."""
    starts = ray.get([_start_piece.options(resources={f"node_{n}": 0.01}).remote(30) for n in NODES], timeout=60)
    assert sorted(starts) == [0, 10, 20], starts
    assert ray.get(_start_piece.options(resources={"node_b": 0.01}).remote(0), timeout=60) == 0
