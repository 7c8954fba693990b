"""Remote packed models without Ray: a real S3-speaking server (moto, its own process) and a plain
HTTP range server, pushed to, fetched from, with faults mid-transfer, on the wire and in the cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import gpu
from helpers_remote import RangeServer, make_bucket, no_partials, s3_server
from weights import PackOptions, load, pack
from weights.cache import CacheFullError, NodeCache
from weights.fetch import Fetch, resolve
from weights.remote import RemoteError, RemoteNotFound, check_uri, push

CHUNK = 64 << 10  # many chunks in a tiny model: pieces, faults and peers have something to work on


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3") / "moto.log") as url:
        make_bucket("models")
        yield url


@pytest.fixture(scope="module")
def chunked(tiny_hf, tmp_path_factory) -> Path:
    return pack(tiny_hf, tmp_path_factory.mktemp("chunked") / "tiny", PackOptions(progress=False, chunk_bytes=CHUNK))


@pytest.fixture
def served(chunked, tmp_path):
    """The chunked model under a plain HTTP range server of its own (a copy: tests may damage it)."""
    root = tmp_path / "www"
    shutil.copytree(chunked, root / "tiny")
    srv = RangeServer(root, tmp_path / "range.log").start()
    yield srv
    srv.stop()


def _same(a, b) -> bool:
    return all(torch.equal(a.tensors[k], b.tensors[k]) for k in b.tensors)


def test_a_pushed_model_loads_from_s3_into_the_node_cache_and_then_from_it(s3, chunked, tmp_path):
    uri = "s3://models/a/tiny"
    assert "model.cst" in push(chunked, uri)
    cache = NodeCache(tmp_path / "cache")
    m = load(uri, "cpu", cache=cache)
    assert _same(m, load(chunked, "cpu"))
    assert (m.path / "model.cst").is_file() and m.path.is_relative_to(cache.root)
    assert "fetch" in [p.name for p in m.timer.phases]
    again = load(uri, "cpu", cache=cache)  # the node's copy: nothing fetched
    assert again.path == m.path and "fetch" not in [p.name for p in again.timer.phases]
    assert not no_partials(cache.root)


def test_a_model_changed_at_its_source_is_fetched_again_never_served_stale(s3, tiny_hf, chunked, tmp_path):
    uri = "s3://models/b/tiny"
    push(chunked, uri)
    cache = NodeCache(tmp_path / "cache")
    first = load(uri, "cpu", cache=cache)
    other = pack(tiny_hf, tmp_path / "f32" / "tiny", PackOptions(progress=False, chunk_bytes=CHUNK, dtype="float32"))
    push(other, uri)
    second = load(uri, "cpu", cache=cache)
    assert second.path != first.path
    assert _same(second, load(other, "cpu"))


def test_a_plain_http_source_serves_and_a_byte_changed_on_the_wire_is_refused(served, chunked, tmp_path):
    uri = f"{served.url}/tiny"
    served.fault(corrupt=1)  # one answer damaged on the way: asked again, the next is right
    cache = NodeCache(tmp_path / "cache")
    assert _same(load(uri, "cpu", cache=cache), load(chunked, "cpu"))


def test_a_source_that_always_sends_a_changed_byte_fails_the_load_and_leaves_no_entry(served, tmp_path):
    served.fault(corrupt=-1)
    cache = NodeCache(tmp_path / "cache")
    with pytest.raises(RemoteError, match=r"checksum mismatch in chunk \d+.*tiny/model.cst|tiny/model.cst.*checksum"):
        load(f"{served.url}/tiny", "cpu", cache=cache)
    assert not list(cache.root.rglob("model.cst")) and not no_partials(cache.root)


def test_a_source_that_vanishes_mid_transfer_fails_cleanly_and_the_next_start_completes(served, chunked, tmp_path):
    served.fault(die_after=200 << 10)
    cache = NodeCache(tmp_path / "cache")
    with pytest.raises(RemoteError, match=r"tiny/model.cst"):
        load(f"{served.url}/tiny", "cpu", cache=cache)
    assert not list(cache.root.rglob("model.cst")) and not no_partials(cache.root)
    served.start()  # back (a new process, no fault)
    assert _same(load(f"{served.url}/tiny", "cpu", cache=cache), load(chunked, "cpu"))


def test_an_unreachable_source_names_itself_and_a_node_copy_is_used_instead(served, chunked, tmp_path):
    uri = f"{served.url}/tiny"
    empty = NodeCache(tmp_path / "empty")
    served.stop()
    with pytest.raises(RemoteError, match=rf"{uri}/model.cst.*HEAD failed"):
        load(uri, "cpu", cache=empty)
    held = NodeCache(tmp_path / "held")
    served.start()
    load(uri, "cpu", cache=held)
    served.stop()
    assert _same(load(uri, "cpu", cache=held), load(chunked, "cpu"))


def test_a_model_removed_at_its_source_is_not_served_from_a_nodes_copy(s3, chunked, tmp_path):
    import boto3
    uri = "s3://models/gone/tiny"
    push(chunked, uri)
    cache = NodeCache(tmp_path / "cache")
    first = load(uri, "cpu", cache=cache)
    bucket = boto3.resource("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).Bucket("models")
    bucket.objects.filter(Prefix="gone/tiny/").delete()
    with pytest.raises(RemoteNotFound, match=r"gone/tiny/model.cst: not found.*holds an earlier copy") as e:
        load(uri, "cpu", cache=cache)
    assert str(first.path) in str(e.value)
    assert (first.path / "model.cst").is_file()  # kept (the cache's own eviction decides), only not served


def test_a_missing_model_says_what_to_do(s3, tmp_path):
    with pytest.raises(RemoteError, match=r"s3://models/none/model.cst: not found.*coldstart push"):
        load("s3://models/none", "cpu", cache=NodeCache(tmp_path / "cache"))


def test_credentials_in_the_uri_are_refused_and_never_echoed():
    with pytest.raises(ValueError, match="carries a credential") as e:
        check_uri("https://user:hunter2@example.org/models/tiny")
    assert "hunter2" not in str(e.value)
    with pytest.raises(ValueError, match="carries a credential"):
        check_uri("https://example.org/models/tiny?X-Amz-Signature=abc")


def test_a_cache_limit_below_the_model_fails_naming_the_directory(s3, chunked, tmp_path):
    push(chunked, "s3://models/d/tiny")
    cache = NodeCache(tmp_path / "cache", max_bytes=4096)
    with pytest.raises(CacheFullError, match=rf"{cache.root}.*more than the cache's limit"):
        load("s3://models/d/tiny", "cpu", cache=cache)
    assert not list(cache.root.rglob("model.cst")) and not no_partials(cache.root)


def test_the_least_recently_used_model_is_evicted_to_make_room(s3, chunked, tiny_hf, tmp_path):
    other = pack(tiny_hf, tmp_path / "f32" / "tiny", PackOptions(progress=False, chunk_bytes=CHUNK, dtype="float32"))
    push(chunked, "s3://models/e1/tiny")
    push(other, "s3://models/e2/tiny")
    size = (chunked / "model.cst").stat().st_size + (other / "model.cst").stat().st_size
    cache = NodeCache(tmp_path / "cache", max_bytes=size)  # room for both files, not both entries' side files
    a = load("s3://models/e1/tiny", "cpu", cache=cache).path
    b = load("s3://models/e2/tiny", "cpu", cache=cache).path
    assert not a.exists() and b.exists()


def test_a_disk_without_room_fails_before_the_transfer_naming_the_cache(s3, chunked, tmp_path):
    push(chunked, "s3://models/f/tiny")
    root = tmp_path / "cache"
    # the process may write files of at most 64 KiB: the weight file's allocation fails as a full disk would
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); "
            "from weights import load; from weights.cache import NodeCache; "
            f"load('s3://models/f/tiny', 'cpu', cache=NodeCache({str(root)!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode != 0
    assert f"{root}" in r.stderr and "cannot hold the model" in r.stderr
    assert not list(root.rglob("model.cst")) and not no_partials(root)


def test_two_loads_on_one_node_share_one_transfer(served, chunked, tmp_path):
    served.fault(delay_s=0.05)  # transfers long enough to overlap
    cache_dir = tmp_path / "cache"
    code = ("import sys; from weights import load; from weights.cache import NodeCache; "
            f"print(load({served.url + '/tiny'!r}, 'cpu', cache=NodeCache({str(cache_dir)!r})).path)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs[0] == outs[1]
    data = (chunked / "model.cst").stat().st_size
    assert served.stats()["sent"]["tiny/model.cst"] < 1.5 * data  # one copy (plus the header reads)


def test_a_split_pack_rank_fetches_only_its_own_file(tiny_hf, tmp_path):
    split = pack(tiny_hf, tmp_path / "www" / "tiny", PackOptions(progress=False, tp=2, chunk_bytes=CHUNK))
    srv = RangeServer(tmp_path / "www", tmp_path / "range.log").start()
    try:
        cache = NodeCache(tmp_path / "cache")
        m = load(f"{srv.url}/tiny", "cpu", rank=1, cache=cache)
        assert m.tp == {"size": 2, "rank": 1}
        assert _same(m, load(split, "cpu", rank=1))
        sent = srv.stats()["sent"]
        assert "tiny/rank-1/model.cst" in sent and "tiny/rank-0/model.cst" not in sent
    finally:
        srv.stop()


def test_a_transfer_that_fails_mid_way_keeps_the_entry_unfinished(served, tmp_path):
    """``resolve`` and ``Fetch`` directly: an abort leaves the side files' entry but no weights."""
    cache = NodeCache(tmp_path / "cache")
    got = resolve(f"{served.url}/tiny", cache)
    assert isinstance(got, Fetch)
    got.abort()
    assert (got.entry / "config.json").is_file() and not (got.entry / "model.cst").exists()
    assert not no_partials(cache.root)
    again = resolve(f"{served.url}/tiny", cache)  # the lock was let go: a new transfer may begin
    assert isinstance(again, Fetch)
    again.run(threads=4)
    assert (again.entry / "model.cst").is_file()


def test_the_cache_file_holds_the_source_bytes(served, chunked, tmp_path):
    """The reader threads' pieces, written side by side at their offsets, make the node's copy the
    source's file byte for byte (its header and tail included)."""
    got = resolve(f"{served.url}/tiny", NodeCache(tmp_path / "cache"))
    assert isinstance(got, Fetch)
    got.run(threads=4, piece_bytes=1)  # (one chunk a piece: many writes at many offsets)
    assert (got.entry / "model.cst").read_bytes() == (chunked / "model.cst").read_bytes()


def test_push_refuses_a_damaged_model(chunked, tmp_path):
    d = tmp_path / "tiny"
    shutil.copytree(chunked, d)
    with open(d / "model.cst", "r+b") as f:
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ValueError, match="not pushed: 1 bad chunk"):
        push(d, "s3://models/never/tiny")


def test_loads_from_threads_in_one_process_share_the_entry(served, chunked, tmp_path):
    cache = NodeCache(tmp_path / "cache")
    out: list = []
    ts = [threading.Thread(target=lambda: out.append(load(f"{served.url}/tiny", "cpu", cache=cache).path))
          for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert len(out) == 2 and out[0] == out[1]


def test_a_corrupt_node_copy_is_removed_and_fetched_again(s3, chunked, tmp_path):
    from weights.format import PackedFormatError
    push(chunked, "s3://models/g/tiny")
    cache = NodeCache(tmp_path / "cache")
    entry = load("s3://models/g/tiny", "cpu", cache=cache).path
    with open(entry / "model.cst", "r+b") as f:  # a torn write: a block of zeros
        f.seek(4096 + 2 * CHUNK)
        f.write(bytes(4096))
    with pytest.raises(PackedFormatError, match="node cache's copy: removed"):
        load("s3://models/g/tiny", "cpu", cache=cache)
    assert not (entry / "model.cst").exists()
    assert _same(load("s3://models/g/tiny", "cpu", cache=cache), load(chunked, "cpu"))


@gpu
def test_on_a_gpu_the_bytes_stream_into_the_device_and_the_cache_in_one_pass(served, chunked, tmp_path):
    cache = NodeCache(tmp_path / "cache")
    f = resolve(f"{served.url}/tiny", cache)
    assert isinstance(f, Fetch)
    m = load(f, "cuda")
    assert f.stats.idle_s["pin"] > 0  # (each reader pinned its slots before its first read)
    ref = load(chunked, "cuda")
    assert all(torch.equal(m.tensors[k], ref.tensors[k]) for k in ref.tensors)
    assert f.cached(60) == m.path  # (written behind the device's copies)
    assert (m.path / "model.cst").read_bytes() == (chunked / "model.cst").read_bytes()
    served.fault(corrupt=2)  # two answers with a changed byte, found on the device: fetched again
    again = load(f"{served.url}/tiny", "cuda", cache=NodeCache(tmp_path / "again"))
    assert all(torch.equal(again.tensors[k], ref.tensors[k]) for k in ref.tensors)
    served.fault(corrupt=-1)
    with pytest.raises(RemoteError, match="checksum mismatch"):
        load(f"{served.url}/tiny", "cuda", cache=NodeCache(tmp_path / "other"))
    assert not list((tmp_path / "other").rglob("model.cst")) and not no_partials(tmp_path / "other")


class _HostCopy:
    """A write-behind's way back to a "device" that is a host array (on a GPU: ``weights.stream.Slots``)."""

    def __init__(self, device, step: int):
        import numpy as np
        self.device, self.views = device, [memoryview(np.empty(step, dtype=np.uint8))]

    def copy_back(self, s: int, off: int, length: int) -> None:
        self.views[s][:length] = memoryview(self.device[off:off + length])

    def close(self) -> None:
        self.views = []


def _load_behind(fetch: Fetch, device, threads: int = 3, after=None, copy=_HostCopy):
    """What a GPU's load does with a transfer (``weights.stream.stream_into`` with a ``Behind``),
    into a host array: each piece read and checked without writing, put on the "device", handed to
    the writers (each with a ``copy`` of its own); ``after(off, length)`` runs once a piece is on
    the device."""
    import numpy as np
    step = fetch.piece_step(CHUNK)
    behind = fetch.write_behind(lambda: copy(device, step), threads)
    buf = np.empty(step, dtype=np.uint8)
    try:
        for off, length in fetch.pieces(CHUNK):
            fetch.read_into(memoryview(buf), off, length, write=False)
            device[off:off + length] = buf[:length]
            if after is not None:
                after(off, length)
            behind.put(off, length)
    except BaseException:
        behind.cancel()
        raise
    behind.close()
    return behind


def _checked_on_device(fetch: Fetch):
    """The GPU's way with a transfer (``stream_into``: a ``PieceVerifier`` and a ``Behind``) over a
    CPU tensor: each piece read unchecked, put on the "device" and checked there, the good ones
    handed to the writers. Returns the pieces found bad, and ``again()``, what the loader's thread
    then does: each fetched again (``Fetch.refetch``), put on the device and handed on; the
    writers closed."""
    import numpy as np

    from weights.stream import PieceVerifier
    device = torch.zeros(fetch.packed.data_bytes, dtype=torch.uint8)
    host = device.numpy()  # (the same memory)
    step = fetch.piece_step(CHUNK)
    behind = fetch.write_behind(lambda: _HostCopy(host, step))
    checks = PieceVerifier(fetch.packed, device, device.device, behind)
    buf = np.empty(step, dtype=np.uint8)
    for off, length in fetch.pieces(CHUNK):
        fetch.read_into(memoryview(buf), off, length, write=False, check=False)
        host[off:off + length] = buf[:length]
        checks.put(off, length)
    bad = checks.finish()

    def again() -> None:
        for off, length in bad:
            fetch.refetch(memoryview(buf), off, length)
            host[off:off + length] = buf[:length]
            behind.put(off, length)
        behind.close()
    return bad, again


def test_writes_behind_the_device_make_the_sources_file_and_free_the_entry(served, chunked, tmp_path):
    import numpy as np
    cache = NodeCache(tmp_path / "cache")
    f = resolve(f"{served.url}/tiny", cache)
    assert isinstance(f, Fetch)
    device = np.zeros(f.packed.data_bytes, dtype=np.uint8)
    _load_behind(f, device)
    assert f.cached(60) == f.entry
    assert (f.entry / "model.cst").read_bytes() == (chunked / "model.cst").read_bytes()
    assert not no_partials(cache.root) and f.stats.busy_s["write"] > 0
    assert resolve(f"{served.url}/tiny", cache) == f.entry  # committed, and the entry's lock let go


def test_a_piece_the_device_finds_corrupt_is_fetched_again_and_the_cache_gets_good_bytes(served, chunked, tmp_path,
                                                                                        caplog):
    """The GPU's way with a transfer: the readers only read, each piece is checked where it landed
    (``weights.stream.PieceVerifier``, here over a CPU tensor) before the cache's writes get it, and
    a corrupt one is fetched again, checked on the host (``Fetch.refetch``)."""
    cache = NodeCache(tmp_path / "cache")
    f = resolve(f"{served.url}/tiny", cache)
    assert isinstance(f, Fetch)
    served.fault(corrupt=1)  # the next answer carries a changed byte: unchecked on the host
    bad, again = _checked_on_device(f)
    assert len(bad) == 1 and not (f.entry / "model.cst").exists()
    with caplog.at_level("WARNING", logger="weights.fetch"):
        again()
    assert "found on the device: fetched again" in caplog.text
    assert f.cached(60) == f.entry
    assert (f.entry / "model.cst").read_bytes() == (chunked / "model.cst").read_bytes()


def test_a_device_copy_changed_after_its_check_is_kept_out_of_the_cache(served, tmp_path, caplog):
    """The writers check each piece again as it comes back from the device: a byte changed there
    never reaches the node's copy (nor its peers); the load itself is not failed by it."""
    import numpy as np
    cache = NodeCache(tmp_path / "cache")
    f = resolve(f"{served.url}/tiny", cache)
    assert isinstance(f, Fetch)
    device = np.zeros(f.packed.data_bytes, dtype=np.uint8)
    victim = f.pieces(CHUNK)[3][0]

    def change(off: int, length: int) -> None:
        if off == victim:
            device[off + 7] ^= 1
    with caplog.at_level("WARNING", logger="weights.fetch"):
        _load_behind(f, device, after=change)
        with pytest.raises(RemoteError, match=r"checksum mismatch in chunk 3 .*device's copy"):
            f.cached(60)
    assert "not kept in the node cache" in caplog.text and "model.cst" in caplog.text
    assert not (f.entry / "model.cst").exists() and not no_partials(cache.root)
    again = resolve(f"{served.url}/tiny", cache)  # the entry's lock was let go: the next start fetches it
    assert isinstance(again, Fetch)
    again.abort()


def test_a_transfer_failing_with_writes_behind_it_leaves_no_file(served, tmp_path):
    import numpy as np
    cache = NodeCache(tmp_path / "cache")
    f = resolve(f"{served.url}/tiny", cache)
    assert isinstance(f, Fetch)
    device = np.zeros(f.packed.data_bytes, dtype=np.uint8)
    served.fault(corrupt=-1)  # every answer from now on has a changed byte
    with pytest.raises(RemoteError, match="could not be fetched from any source"):
        _load_behind(f, device)
    with pytest.raises(RemoteError, match="nothing kept"):
        f.cached(10)
    assert not (f.entry / "model.cst").exists() and not no_partials(cache.root)


def test_an_abort_while_writes_are_behind_waits_for_them_and_keeps_nothing(served, tmp_path):
    """A replica's start failing after its load (its writes still behind it): the abort stops the
    writers and waits for the write under way before the file's descriptor closes."""
    import numpy as np
    cache = NodeCache(tmp_path / "cache")
    f = resolve(f"{served.url}/tiny", cache)
    assert isinstance(f, Fetch)
    device = np.zeros(f.packed.data_bytes, dtype=np.uint8)
    gate, inside = threading.Event(), threading.Event()

    class Held(_HostCopy):
        def copy_back(self, s: int, off: int, length: int) -> None:
            inside.set()
            gate.wait(30)
            super().copy_back(s, off, length)
    _load_behind(f, device, 2, copy=Held)
    assert inside.wait(30)
    aborting = threading.Thread(target=f.abort)
    aborting.start()
    time.sleep(0.3)
    assert aborting.is_alive() and f.tmp.exists()  # waiting for the writes under way
    gate.set()
    aborting.join(30)
    with pytest.raises(RemoteError, match="aborted"):
        f.cached(30)
    assert not (f.entry / "model.cst").exists() and not no_partials(cache.root)


def test_pieces_checked_but_not_yet_written_are_told_to_peers_as_coming(served, tmp_path):
    """A piece on the device but not yet in the file is announced as being read (a peer waits for
    it instead of reading it from the source), and as held once written."""
    import numpy as np
    told: list = []

    class Told:
        def sources(self, key, rel):
            return []

        def start_piece(self, n):
            return 0

        def announce(self, key, rel, path, chunks, reading, seq):
            told.append((chunks, reading))
    f = resolve(f"{served.url}/tiny", NodeCache(tmp_path / "cache"), peers=Told())
    assert isinstance(f, Fetch)
    off, length = f.pieces(CHUNK)[0]
    buf = np.empty(length, dtype=np.uint8)
    f.read_into(memoryview(buf), off, length, write=False)
    assert told[-1] == ([], [0])  # checked, not written: coming
    f._land(memoryview(buf), off, length)
    assert told[-1] == ([0], [])
    f.abort()


def test_a_refused_credential_names_the_source_never_the_secret(chunked, tmp_path, monkeypatch):
    """moto with its IAM checks on: the right key reads, a wrong secret gets the server's 403. (moto
    in this mode fails every GET by signed URL: the ranged reads fall back to obstore's own
    requests, as they do where a bucket's policy allows signed headers only.)"""
    import json
    import urllib.request

    import boto3
    with s3_server(tmp_path / "moto.log") as url:
        make_bucket("locked")
        push(chunked, "s3://locked/tiny")
        iam = boto3.client("iam", endpoint_url=url)
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset-auth", data=b"0", method="POST",
                                                      headers={"Content-Type": "text/plain"})).close()
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-42")
        cache = NodeCache(tmp_path / "cache")
        with pytest.raises(RemoteError, match=r"s3://locked/tiny/model.cst: HEAD failed.*credentials were refused") as e:
            load("s3://locked/tiny", "cpu", cache=cache)
        assert "not-the-secret-42" not in str(e.value) and key["SecretAccessKey"] not in str(e.value)
        assert not list(cache.root.rglob("model.cst")) and not no_partials(cache.root)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        assert _same(load("s3://locked/tiny", "cpu", cache=cache), load(chunked, "cpu"))


def test_ranged_reads_land_in_the_callers_buffer_and_outlive_a_closed_connection(served, chunked):
    """The reads a transfer makes (straight into its staging memory, over one kept connection per
    thread): the file's bytes at any offset; a connection the server closed in between (here: the
    server restarted) is opened again, not reported as a failure."""
    from weights.remote import Origin
    origin = Origin(f"{served.url}/tiny")
    data = (chunked / "model.cst").read_bytes()
    buf = bytearray(3 * 4096)
    origin.read_into("model.cst", 4096, memoryview(buf))
    assert buf == data[4096:4 * 4096]
    served.stop()
    served.start()
    view = memoryview(buf)[:5000]
    origin.read_into("model.cst", len(data) - 5000, view)
    assert bytes(view) == data[-5000:]


def test_a_source_that_ignores_ranges_is_refused_naming_it(served, tmp_path):
    served.fault(ignore_range=True)
    cache = NodeCache(tmp_path / "cache")
    with pytest.raises(RemoteError, match=r"tiny/model.cst: .*ignores range requests"):
        load(f"{served.url}/tiny", "cpu", cache=cache)
    assert not list(cache.root.rglob("model.cst")) and not no_partials(cache.root)


def test_a_source_slower_than_the_timeout_fails_saying_so(served, tmp_path):
    from weights import LoadOptions
    served.fault(delay_s=3)
    cache = NodeCache(tmp_path / "cache")
    with pytest.raises(RemoteError, match=r"tiny/model.cst.*too slowly.*load.remote_timeout_s \(now 1 s"):
        load(f"{served.url}/tiny", "cpu", cache=cache, options=LoadOptions(remote_timeout_s=1.0))
    assert not list(cache.root.rglob("model.cst")) and not no_partials(cache.root)


class _Node:
    """One node's peers as a transfer sees them, for nodes in one process: each node's real
    ``NodeService``, called directly where a cluster calls it through Ray (that transport is what
    tests/test_multinode.py covers)."""

    def __init__(self, services: dict, name: str, root: Path):
        from deployments.peers import NodeService
        self.services, self.name = services, name
        services[name] = NodeService(str(root))

    def sources(self, key: str, rel: str) -> list:
        from deployments.peers import PeerSource

        class Direct(PeerSource):
            def read_into(self, rel: str, offset: int, view: memoryview) -> None:
                view[:] = memoryview(self.handle.read(self.key, rel, offset, len(view)))
        return [Direct(n, svc, key, *held) for n, svc in self.services.items()
                if n != self.name and (held := svc.holds(key, rel)) is not False]

    def start_piece(self, n_pieces: int) -> int:
        return 0

    def announce(self, key: str, rel: str, path: str, chunks, reading, seq: int) -> None:
        self.services[self.name].announce(key, rel, path, chunks, reading, seq, os.getpid())


def _two_nodes(served, tmp_path, **kw) -> tuple[dict, Fetch, Fetch]:
    services: dict = {}
    a, b = (resolve(f"{served.url}/tiny", NodeCache(tmp_path / n), peers=_Node(services, n, tmp_path / n), **kw)
            for n in "ab")
    assert isinstance(a, Fetch) and isinstance(b, Fetch)
    return services, a, b


def test_a_piece_a_peer_is_reading_from_the_source_is_taken_last_and_from_that_peer(served, chunked, tmp_path):
    import numpy as np
    services, a, b = _two_nodes(served, tmp_path)
    pieces = b.pieces(CHUNK)
    off, length = pieces[2]  # in b's first round of reads
    served.fault(delay_s=1.0)
    try:
        buf = np.empty(length, dtype=np.uint8)
        t = threading.Thread(target=a.read_into, args=(memoryview(buf), off, length))
        t.start()
        assert services["a"].holds(a.key, a.rel)[1] == [off // CHUNK]  # told before its first byte
        time.sleep(Fetch.REFRESH_S)  # b's next look at its peers sees it
        order = b.order(pieces)
        first = [order.next() for _ in pieces[1:]]  # all at once, while a's read goes on
        last = order.next()  # only the piece a reads is left: given once a holds it
        t.join()
        assert order.next() is None
    finally:
        served.fault(delay_s=0)
    assert first == pieces[:2] + pieces[3:] and last == pieces[2]
    for p in first + [last]:
        b.read_into(memoryview(np.empty(length, dtype=np.uint8)), *p)
    assert b.stats.bytes_from == {"a": length, served.url + "/tiny": b.packed.data_bytes - length}
    b.commit()
    assert (b.entry / "model.cst").read_bytes() == (chunked / "model.cst").read_bytes()
    a.abort()
    assert services["a"].holds(a.key, a.rel) is False


def test_a_piece_a_peer_never_delivers_comes_from_the_source_after_a_wait(served, chunked, tmp_path):
    """A peer whose process died mid-read still says it reads a piece: the transfer waits for it
    no longer than twice its slowest piece from the source, then reads it there."""
    services, a, b = _two_nodes(served, tmp_path, timeout_s=5.0)
    stuck = b.pieces(CHUNK)[4]
    services["a"].announce(a.key, a.rel, str(a.tmp), [], [stuck[0] // CHUNK], time.monotonic_ns())
    b._refresh(force=True)
    t = threading.Thread(target=b.run, kwargs={"threads": 2, "piece_bytes": CHUNK})
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    assert b.stats.bytes_from == {served.url + "/tiny": b.packed.data_bytes}
    assert (b.entry / "model.cst").read_bytes() == (chunked / "model.cst").read_bytes()
    a.abort()


def test_a_late_announcement_never_overwrites_a_newer_one(tmp_path):
    """A node service runs its calls on several threads: a piece's word, sent before the transfer
    completed, may arrive after the completion's. The service keeps the newer."""
    from deployments.peers import NodeService
    svc = NodeService(str(tmp_path))
    svc.announce("k", "model.cst", str(tmp_path / "model.cst"), None, [], 20)
    svc.announce("k", "model.cst", str(tmp_path / "model.cst.partial"), [0, 1], [2], 10)
    assert svc.holds("k", "model.cst") == (None, [])
    svc.announce("k", "model.cst", "", [], [], 30)  # forgotten (an aborted transfer) ...
    svc.announce("k", "model.cst", str(tmp_path / "model.cst.partial"), [0], [1], 25)  # ... for good
    assert svc.holds("k", "model.cst") is False


def test_pieces_a_dead_transfer_was_reading_are_not_waited_for(tmp_path):
    """A transfer killed mid-read never tells its node's service it stopped: the service sees its
    process gone and no longer says those chunks are coming (the checked ones stay readable)."""
    from deployments.peers import NodeService
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    svc = NodeService(str(tmp_path))
    svc.announce("k", "model.cst", str(tmp_path / "p"), [0, 1], [2, 3], 10, gone.pid)
    assert svc.holds("k", "model.cst") == ([0, 1], [])
    svc.announce("k", "model.cst", str(tmp_path / "p"), [0, 1], [2, 3], 11, os.getpid())
    assert svc.holds("k", "model.cst") == ([0, 1], [2, 3])


def test_a_peer_whose_piece_the_device_finds_corrupt_is_dropped_and_the_piece_read_elsewhere(served, chunked,
                                                                                          tmp_path):
    """The GPU's checks as a transfer from a peer meets them: the peer's piece lands unchecked on
    the host, the device finds it corrupt, and ``refetch`` drops that peer and reads the piece from
    the source, checked."""
    services, a, b = _two_nodes(served, tmp_path)
    a.run(threads=2, piece_bytes=CHUNK)  # node a holds the whole file now: b's pieces come from it
    with open(a.final, "r+b") as fh:  # a's copy damaged after its transfer (a bad disk)
        fh.seek(a.packed.data_offset + 3 * CHUNK + 10)
        fh.write(b"\xff\x00\xff")
    b._refresh(force=True)
    bad, again = _checked_on_device(b)
    assert bad == [(3 * CHUNK, CHUNK)] and set(b.stats.bytes_from) == {"a"}
    again()
    assert "a" in b.stats.dropped and "chunk 3" in b.stats.dropped["a"]
    assert b.stats.bytes_from[served.url + "/tiny"] == CHUNK
    assert b.cached(60) == b.entry
    assert (b.entry / "model.cst").read_bytes() == (chunked / "model.cst").read_bytes()


def test_a_transfer_streamed_without_its_cache_writer_is_refused(served, tmp_path):
    """``weights.stream.stream_into`` reads a fetch's pieces without writing them: the cache's
    file is written by its ``Behind``, so a call without one is refused before any read."""
    from weights.options import LoadOptions
    from weights.stream import stream_into
    f = resolve(f"{served.url}/tiny", NodeCache(tmp_path / "cache"))
    assert isinstance(f, Fetch)
    buffer = torch.empty(f.packed.data_bytes, dtype=torch.uint8)
    sent = served.stats()["weights_sent"]  # (the header, read by resolve)
    with pytest.raises(ValueError, match="through its Behind"):
        stream_into(f.packed, buffer, buffer.device, LoadOptions(), None, None, f)
    assert served.stats()["weights_sent"] == sent
    f.abort()
