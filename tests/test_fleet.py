"""bench/fleet.py: the simulation of a fleet fetching one packed model from object storage and
from its peers, held to what its limits imply, and its --check against a one-host measurement."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from fleet import GB, MiB, Fleet, main, share_rates, simulate  # noqa: E402

PIECE = 16 * MiB


def _one(**kw) -> float:
    return simulate(Fleet(nodes=1, tp=1, peers=False, latency_ms=0, **kw))["transfer_s"]["p100"]


@pytest.mark.parametrize("limits", [
    {"nic_gbits": 100, "egress_gbps": 0, "connection_mbps": 0},     # the NIC: 12.5 GB/s
    {"nic_gbits": 100, "egress_gbps": 2, "connection_mbps": 0},     # the store's egress
    {"nic_gbits": 100, "egress_gbps": 0, "connection_mbps": 90},    # 16 connections of 90 MB/s
    {"nic_gbits": 10, "egress_gbps": 5, "connection_mbps": 100},    # the NIC again: 1.25 GB/s
])
def test_one_node_without_peers_takes_size_over_its_tightest_limit(limits):
    size = 160 * PIECE  # ten rounds of 16 pieces
    rate = min(limits["nic_gbits"] / 8 * GB, limits["egress_gbps"] * GB or float("inf"),
               16 * limits["connection_mbps"] * 1e6 or float("inf"))
    assert _one(model_gb=size / GB, threads=16, **limits) == pytest.approx(size / rate, abs=1e-3)


def test_a_model_of_ragged_pieces_and_the_reads_latency():
    # 100.5 pieces in 7 rounds of 16 reads of 100 MB/s each (the last round's pieces take as long
    # as any, bar the half one); then each read waits 20 ms for its first byte
    size = 100.5 * PIECE
    bare = _one(model_gb=size / GB, connection_mbps=100, egress_gbps=0)
    assert bare == pytest.approx(7 * PIECE / 100e6, abs=1e-3)
    slow = simulate(Fleet(nodes=1, tp=1, peers=False, latency_ms=20, model_gb=size / GB,
                          connection_mbps=100, egress_gbps=0))["transfer_s"]["p100"]
    assert slow - bare == pytest.approx(7 * 0.020, rel=0.05)


def test_peers_beat_an_egress_limited_store_and_what_the_store_serves():
    """10 nodes, 4 GB each, a 2 GB/s store: alone from the store the fleet needs 20 s.

    With peers it is done in a quarter of that. The store serves about two copies of the model,
    not one: every node's first 16 reads come from the store at once, they share its egress
    fairly and end together, and at that instant no node has yet seen the pieces its neighbour
    just finished (a peer's piece counts only once whole and seen at a refresh), so the next
    round reads them from the store again, unless a piece a peer is reading is put off (peers
    publish their reads in flight, as the loader does): that cuts it to about 1.3 copies and the
    fleet's time by a quarter."""
    kw = dict(nodes=10, model_gb=4, tp=1, egress_gbps=2, connection_mbps=0)
    alone = simulate(Fleet(peers=False, **kw))
    assert alone["store_egress_models"] == pytest.approx(10)
    assert alone["transfer_s"]["p100"] >= 10 * 4 / 2
    base = simulate(Fleet(defer_in_flight=False, **kw))
    assert base["transfer_s"]["p100"] < 0.25 * 10 * 4 / 2
    assert 1 <= base["store_egress_models"] < 2.2
    assert base["store_egress_GB"] + base["peer_GB"] == pytest.approx(10 * 4, rel=1e-6)
    deferred = simulate(Fleet(**kw))
    assert deferred["store_egress_models"] < 1.4
    assert deferred["transfer_s"]["p100"] < 0.8 * base["transfer_s"]["p100"]


def test_a_running_replica_serves_the_fleet_and_the_store_serves_nothing():
    res = simulate(Fleet(nodes=10, model_gb=4, tp=1, egress_gbps=2, holders=1))
    assert res["store_egress_GB"] == 0
    assert res["peer_GB"] == pytest.approx(10 * 4, rel=1e-6)


def test_more_nodes_never_make_a_node_sooner_without_peers():
    before = None
    for n in (1, 2, 3, 5, 8, 13):
        res = simulate(Fleet(nodes=n, model_gb=2, tp=2, peers=False, egress_gbps=3, connection_mbps=80))
        if before is not None:
            assert res["transfer_s"]["min"] >= before["transfer_s"]["min"] - 1e-9
            assert res["transfer_s"]["p100"] >= before["transfer_s"]["p100"] - 1e-9
        before = res


def test_70b_tp4_on_100_nodes_with_peers_is_warm_within_twice_one_node():
    """The issue's goal, with the defaults (100 Gb/s NICs, a 10 GB/s store of 100 MB/s reads,
    16 threads of 16 MiB per rank, peers refreshed every 0.5 s). The model says it is met, by
    little (48.3 s against 49.6 s): docs/fleet.md says why, and what gives it room."""
    res = simulate(Fleet(nodes=100, model_gb=141, tp=4, nic_gbits=100, peers=True))
    assert res["one_node_transfer_s"] > 141 / 6.4  # 64 reads of 100 MB/s at most
    assert res["warm_s"]["p100"] <= 2 * res["one_node_transfer_s"]
    assert res["goal_met"]


def test_jitter_is_seeded_and_keeps_a_lone_nodes_time():
    kw = dict(nodes=1, model_gb=2, tp=1, peers=False, connection_mbps=100, egress_gbps=0, latency_ms=20)
    plain = simulate(Fleet(**kw))["transfer_s"]
    first, again = (simulate(Fleet(jitter=True, seed=3, **kw))["transfer_s"] for _ in range(2))
    assert first == again
    assert first["p100"] == pytest.approx(plain["p100"], rel=0.05)


def test_share_rates_is_max_min_fair():
    # two links of 10 and 4; group a crosses both, b only the first, c only the second
    rates = share_rates([(1, (0, 1), float("inf")), (2, (0,), float("inf")), (1, (1,), 1.0)], {0: 10, 1: 4})
    assert rates == pytest.approx([3.0, 3.5, 1.0])


def _measurement(tmp_path: Path, **kw) -> str:
    m = {"model_bytes": 13_476_000_000, "threads": 16, "piece_mib": 16, "connection_mbps": 130,
         "source_gbps": None, "nic_gbits": None, "fetch_gbps": 2.0, "replica_start_s": 6.4,
         "replica_warm_s": 9.5}
    m.update(kw)
    path = tmp_path / "fetch.json"
    path.write_text(json.dumps(m))
    return str(path)


def test_check_reproduces_a_one_host_measurement(tmp_path, capsys):
    assert main(["--check", _measurement(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "within 10 %" in out and "NOT" not in out
    res = json.loads(out[:out.rindex("}") + 1])
    assert res["measured_s"] == pytest.approx(6.738, abs=1e-3)
    assert abs(res["off_pct"]) <= 10
    assert res["overlap_s"] == pytest.approx(9.5 - 6.738, abs=1e-3)


def test_check_fails_when_the_simulation_is_off(tmp_path, capsys):
    assert main(["--check", _measurement(tmp_path, connection_mbps=60)]) == 1
    assert "NOT within 10 %" in capsys.readouterr().out


def test_check_says_when_the_host_not_the_network_was_the_limit(tmp_path, capsys):
    # a source of 22 GB/s and no other limit, the transfer at 4.85 GB/s (one H100 host's figures)
    path = _measurement(tmp_path, connection_mbps=None, source_gbps=22.4, fetch_gbps=4.85)
    assert main(["--check", path]) == 1
    out = capsys.readouterr().out
    assert "NOT within 10 %" in out and "the transfer ran at 4.85 GB/s where the network's limits allow 22.4" in out
    assert main(["--check", _measurement(tmp_path)]) == 0  # where the network was the limit: no such line
    assert "the host's own work" not in capsys.readouterr().out


@pytest.mark.parametrize("bad, field", [({"threads": 0}, "threads"), ({"fetch_gbps": "fast"}, "fetch_gbps"),
                                        ({"model_bytes": None}, "model_bytes")])
def test_check_names_the_bad_field(tmp_path, capsys, bad, field):
    assert main(["--check", _measurement(tmp_path, **bad)]) == 2
    err = capsys.readouterr().err
    assert "fetch.json" in err and repr(field) in err


def test_check_of_a_missing_file(tmp_path, capsys):
    assert main(["--check", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--nodes", "0"), ("--piece-mib", "-1"), ("--egress-gbps", "-2")])
def test_a_bad_flag_is_named(capsys, flag, value):
    assert main([flag, value]) == 2
    assert flag in capsys.readouterr().err


def test_holders_need_peers(capsys):
    assert main(["--holders", "1", "--no-peers"]) == 2
    assert "--holders" in capsys.readouterr().err
