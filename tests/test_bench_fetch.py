"""bench/fetch.py's CPU parts and its source, run as a user runs them: the paced file server over
real HTTP, and nodes of a real Ray cluster fetching one model at once from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers_remote import _wait_up, free_port
from weights import PackOptions, pack
from weights.format import read_packed

ROOT = Path(__file__).resolve().parents[1]


def test_the_paced_source_serves_ranges_exactly_and_no_faster_than_its_rate(tmp_path):
    (tmp_path / "b").mkdir()
    data = os.urandom(3 << 20)
    (tmp_path / "b" / "f").write_bytes(data)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "file_server.py"), str(tmp_path), "--port", str(port),
                             "--procs", "1", "--latency-ms", "50", "--egress-mbps", "10"], stdout=subprocess.DEVNULL)
    try:
        _wait_up(f"http://127.0.0.1:{port}/b/none", proc, "file_server")  # (a 404: an answer)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/b/f", headers={"Range": "bytes=1000-2000999"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=30) as r:
            got, status = r.read(), r.status
        took = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert status == 206 and got == data[1000:2001000]
    assert took >= 0.05 + 2e6 / 10e6  # its first byte's wait and 2 MB at 10 MB/s, at the least


def test_nodes_fetching_together_report_what_the_source_sent(tiny_hf, tmp_path):
    model = pack(tiny_hf, tmp_path / "tiny", PackOptions(progress=False))
    out = tmp_path / "fetch.json"
    r = subprocess.run([sys.executable, "bench/fetch.py", "--packed", str(model), "--parts", "together", "--nodes", "2",
                        "--rounds", "1", "--store", "5,50", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["store"] == [5.0, 50.0]
    run = doc["together"]["rounds"][0]
    data = read_packed(model / "model.cst").data_bytes
    for node in run["nodes"]:  # every node got the whole data region, each byte from one source
        assert node["data_bytes"] == data and sum(node["bytes_from"].values()) == data and not node["dropped"]
    assert run["source_copies"] >= 1 and run["source_copies"] + run["peer_copies"] == pytest.approx(2)
    assert "together round 0: 2 nodes" in r.stdout


def test_the_transfer_steps_are_each_timed_over_the_whole_data_region(tiny_hf, tmp_path):
    """bench/transfer_steps.py on a CPU host: every write way and every pipeline step through the
    real source and a real cache file, over the model's whole data region; its files removed."""
    model = pack(tiny_hf, tmp_path / "tiny", PackOptions(progress=False))
    out, work = tmp_path / "steps.json", tmp_path / "steps"
    r = subprocess.run([sys.executable, "bench/transfer_steps.py", "--packed", str(model), "--out", str(out),
                        "--threads", "2", "--dir", str(work)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["bytes"] == read_packed(model / "model.cst").data_bytes and doc["threads"] == 2
    assert set(doc["writes"]) == {"pwrite_one_file", "pwrite_file_per_thread", "mapped_populated_one_file",
                                  "o_direct_one_file"}
    assert set(doc["compute"]) == {"chunk_sums", "copies"}
    assert list(doc["pipeline"]) == ["reads", "copy", "sums", "pwrite", "mapped"]  # no GPU: no "gpu" step
    for part in ("writes", "compute", "pipeline"):
        for name, step in doc[part].items():  # (O_DIRECT may be refused by the filesystem: said so)
            assert step.get("GBps", 0) > 0 or (name == "o_direct_one_file" and step["error"]), (name, step)
    assert not work.exists()
    assert "pwrite" in r.stdout and f"wrote {out}" in r.stdout
