"""A fleet of N nodes fetching one packed model at once from object storage and from each other.

Pure Python, flow-level and event-driven; no GPU, no network. Run from the repository root:

    python bench/fleet.py --nodes 100 --model 70b                 # one run: JSON + a short table
    python bench/fleet.py --nodes 100 --model 7b --no-peers --out fleet.json
    python bench/fleet.py --matrix                                # docs/fleet.md's table
    python bench/fleet.py --check FETCH.json                      # against a one-host measurement

What is simulated (docs/fleet.md has the model and its assumptions). Every node joins at t = 0
and needs the whole model: for tensor parallelism TP one rank file per GPU, TP files per node.
A rank's loader keeps up to ``threads`` ranged reads of ``piece`` bytes in flight and takes the
pieces in its own rotated order (node k starts at piece k * pieces / N). Before it starts a piece
it looks at what its peers held at the last refresh of their holdings (every ``refresh`` s):
a piece some peer holds comes from the least-loaded holder (fewest uploads in flight), else from
the object store. A piece is held once all its bytes have arrived (its checksum verified).
Peers also publish the pieces they are reading from the store, and a loader takes such a piece
last (from its reader once held, waiting for the next refresh when nothing else is left) instead
of reading it from the store too, as ``weights.fetch.PieceOrder`` does (``--no-defer-in-flight``:
without it, for comparison).
``--holders K`` adds K nodes holding the whole model from the start (running replicas).
Bandwidth is shared max-min fairly (progressive filling) among the transfers in flight under
these limits: each node's NIC down and up (full duplex, one limit per direction), the store's
total egress, and the store's rate per connection. A request's first byte comes ``latency``
after it is sent (``--jitter``: uniformly within 0 and twice that). The ranks of a node are
alike (files of one size, taken in one order), so the simulation runs one rank per node with
1/TP of every shared limit, which is exact while they stay in step.
A node's replica is warm at max(its transfer, the replica's start with a local model)
plus what overlapping the two cost on one host (both from docs/measurements.md, "A new node's
first replica").
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import platform
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

GB = 1e9
MiB = 1 << 20
INF = math.inf

# name -> (bytes of the whole model, tensor-parallel ranks per node)
PRESETS = {"7b": (13.5 * GB, 1), "70b": (141 * GB, 4)}

# One H100 host, a fresh node's first replica with its weights read from a 1.50 GB/s disk
# (docs/measurements.md, "A new node's first replica", first round): the replica was RUNNING at
# 16.42 s, of which 4.83 s it waited for the bulk of the weights after every other step was done;
# the read alone took 9.02 s. So its start with the weights at hand is 16.42 - 4.83 = 11.59 s,
# and the overlap cost 16.42 - max(9.02, 11.59) = 4.83 s beyond the longer of the two.
FRESH_NODE_START_S = 11.59
FRESH_NODE_OVERLAP_S = 4.83


@dataclass(frozen=True)
class Fleet:
    """One scenario. Rates: NIC in Gb/s (bits), egress GB/s and per connection MB/s (bytes)."""
    nodes: int = 100
    model_gb: float = PRESETS["70b"][0] / GB  # the whole model, all ranks' files together
    tp: int = 4                  # rank files per node, one per GPU, sharing the node's NIC
    nic_gbits: float = 100.0     # per node and per direction
    egress_gbps: float = 10.0    # the object store's total egress; 0: unlimited
    connection_mbps: float = 100.0  # one ranged read from the store; 0: unlimited
    peer_connection_mbps: float = 0.0  # one piece from a peer; 0: only the NICs limit it
    peers: bool = True
    piece_mib: float = 16.0
    threads: int = 16            # reads in flight per rank's loader
    latency_ms: float = 20.0     # first byte of a ranged read from the store
    peer_latency_ms: float = 5.0  # first byte of a piece from a peer
    jitter: bool = False         # each first byte uniformly within 0..2 x its latency (seeded)
    seed: int = 0
    refresh_s: float = 0.5       # how old a node's view of its peers' holdings may be
    holders: int = 0             # nodes already holding the whole model (running replicas)
    defer_in_flight: bool = True  # put off a piece a peer was reading from the store at the refresh
                                   # (with peers only)
    local_start_s: float = FRESH_NODE_START_S
    overlap_s: float = FRESH_NODE_OVERLAP_S
    step_s: float = 0.02         # the shortest step between two events

    def __post_init__(self) -> None:
        positive = ("nodes", "model_gb", "tp", "nic_gbits", "piece_mib", "threads", "refresh_s", "step_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"--{_flag(name)} must be > 0, got {getattr(self, name)!r}")
        for name in ("egress_gbps", "connection_mbps", "peer_connection_mbps", "latency_ms",
                     "peer_latency_ms", "holders", "local_start_s", "overlap_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)!r}")
        if self.holders and not self.peers:
            raise ValueError("--holders needs peers: nodes holding the model serve it only to peers; "
                             "drop --holders or --no-peers")

    @property
    def file_bytes(self) -> float:
        return self.model_gb * GB / self.tp


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _cap(rate: float) -> float:
    return rate if rate > 0 else INF


def share_rates(groups: list[tuple[int, tuple, float]], caps: dict) -> list[float]:
    """Max-min fair rates by progressive filling. ``groups``: (flows, resources, cap per flow);
    flows of a group cross the same resources and get one rate each. ``caps``: resource ->
    capacity (a resource absent from it is unlimited). Returns the rate of one flow per group."""
    left = {}
    count = {}
    members: dict = {}
    for g, (k, res, _) in enumerate(groups):
        for r in res:
            if r in caps:
                left[r] = caps[r]
                count[r] = count.get(r, 0) + k
                members.setdefault(r, []).append(g)
    heap = [(left[r] / count[r], 0, r) for r in count]
    heap += [(c, 1, g) for g, (_, _, c) in enumerate(groups) if c < INF]
    heapq.heapify(heap)
    rate = [INF] * len(groups)
    frozen = [False] * len(groups)

    def freeze(g: int, level: float) -> None:
        frozen[g] = True
        rate[g] = level
        k = groups[g][0]
        for r in groups[g][1]:
            if r in count:
                left[r] = max(0.0, left[r] - k * level)
                count[r] -= k
                if count[r]:
                    heapq.heappush(heap, (left[r] / count[r], 0, r))

    while heap:
        level, kind, key = heapq.heappop(heap)
        if kind == 1:
            if not frozen[key]:
                freeze(key, level)
            continue
        if not count[key] or left[key] / count[key] > level * (1 + 1e-12):
            continue  # stale: the resource's level rose since this entry was pushed
        for g in members[key]:
            if not frozen[g]:
                freeze(g, level)
    if any(r == INF for r in rate):
        raise ValueError("a transfer has no limit: give --nic-gbits, --egress-gbps or --connection-mbps")
    return rate


class _Sim:
    """One rank per node (see the module's docstring); node ids 0..nodes-1 join, the
    ``holders`` after them hold every piece from the start."""

    STORE = -1
    WAIT = -2  # a slot waiting for the next refresh (no bytes)

    def __init__(self, f: Fleet):
        self.f = f
        self.piece = f.piece_mib * MiB
        self.npieces = math.ceil(f.file_bytes / self.piece)
        self.last = f.file_bytes - (self.npieces - 1) * self.piece
        n = f.nodes
        # resources by number: node i's NIC down i, up all + i; the store's egress 2 * all
        self.all = all_ = n + f.holders
        self.caps = {i: f.nic_gbits / 8 * GB / f.tp for i in range(2 * all_)}
        if f.egress_gbps > 0:
            self.caps[2 * all_] = f.egress_gbps * GB / f.tp
        self.conn = _cap(f.connection_mbps * 1e6)
        self.peer_conn = _cap(f.peer_connection_mbps * 1e6)
        seeded = [(-INF, h) for h in range(n, n + f.holders)]
        self.holders = [list(seeded) for _ in range(self.npieces)]  # (time held, node), by time
        self.uploads = [0] * (n + f.holders)
        self.next = [0] * n          # how many of its pieces a node has started
        self.deferred: list[list[int]] = [[] for _ in range(n)]
        self.claimed = [INF] * self.npieces  # when a node first began to read a piece from the store
        self.held = [0] * n
        self.done = [INF] * n
        self.bytes_store = 0.0
        self.bytes_peer = 0.0
        self.flows: list[list] = []  # [node, piece, source, bytes left, first byte at, rate]
        self.rng = random.Random(f.seed)

    def size(self, p: int) -> float:
        return self.last if p == self.npieces - 1 else self.piece

    def start_piece(self, node: int, now: float, rate: float) -> None:
        """The node's next piece in its order, from a peer that held it at the last refresh."""
        seen = math.floor(now / self.f.refresh_s) * self.f.refresh_s
        while True:
            m = self.next[node]
            if m < self.npieces:
                self.next[node] = m + 1
                p = (node * self.npieces // self.f.nodes + m) % self.npieces
            elif self.deferred[node]:
                p = self.deferred[node].pop(0)
            else:
                return
            src = self.peer_for(p, seen) if self.f.peers else self.STORE
            if src == self.STORE and self.f.peers and self.f.defer_in_flight and self.claimed[p] < seen:
                if m < self.npieces:
                    self.deferred[node].append(p)  # a peer is reading it: come back to it last
                    continue
                # only pieces peers are reading are left: look again at the next refresh
                self.deferred[node].insert(0, p)
                self.flows.append([node, -1, self.WAIT, 0.0, seen + self.f.refresh_s, rate])
                return
            break
        if src == self.STORE:
            self.claimed[p] = min(self.claimed[p], now)
        else:
            self.uploads[src] += 1
        lat = (self.f.latency_ms if src == self.STORE else self.f.peer_latency_ms) / 1e3
        if self.f.jitter:
            lat *= 2 * self.rng.random()
        self.flows.append([node, p, src, self.size(p), now + lat, rate])

    def peer_for(self, p: int, seen: float) -> int:
        """The least-loaded peer that held piece ``p`` at time ``seen``, else the store."""
        held = self.holders[p]
        k = bisect.bisect_right(held, (seen, INF))
        if not k:
            return self.STORE
        return min(held[:k], key=lambda h: self.uploads[h[1]])[1]

    def finish(self, fl: list, now: float) -> None:
        node, p, src = fl[0], fl[1], fl[2]
        if src == self.WAIT:
            return
        bisect.insort(self.holders[p], (now, node))
        if src == self.STORE:
            self.bytes_store += self.size(p)
        else:
            self.bytes_peer += self.size(p)
            self.uploads[src] -= 1
        self.held[node] += 1
        if self.held[node] == self.npieces:
            self.done[node] = now

    def allocate(self, t: float, horizon: float) -> None:
        """Rates for the flows whose first byte comes before ``horizon``; others wait."""
        keys: dict = {}
        for fl in self.flows:
            if fl[4] < horizon and fl[2] != self.WAIT:
                node, src = fl[0], fl[2]
                keys[(node, src)] = keys.get((node, src), 0) + 1
        groups = []
        for (node, src), k in keys.items():
            if src == self.STORE:
                groups.append((k, (node, 2 * self.all), self.conn))
            else:
                groups.append((k, (node, self.all + src), self.peer_conn))
        rates = dict(zip(keys, share_rates(groups, self.caps)))
        for fl in self.flows:
            if fl[4] < horizon and fl[2] != self.WAIT:
                fl[5] = rates[(fl[0], fl[2])]

    def step_end(self, t: float) -> float:
        """The next event (a piece done, a first byte), no sooner than one step."""
        soonest = INF
        for fl in self.flows:
            at = fl[4] if fl[4] > t or not fl[3] else t + fl[3] / fl[5]
            soonest = min(soonest, at)
        return max(soonest, t + self.f.step_s)

    def advance(self, t: float, end: float) -> None:
        """Move every flow to ``end``. A flow that finishes inside the step hands its rate to
        its slot's next piece, which starts at once (after its latency)."""
        flows, self.flows = self.flows, []
        for fl in flows:
            now = t
            while True:
                now = max(now, fl[4])
                if now >= end:
                    self.flows.append(fl)
                    break
                need = fl[3] / fl[5] if fl[3] else 0.0
                if now + need > end:
                    fl[3] -= fl[5] * (end - now)
                    self.flows.append(fl)
                    break
                now += need
                self.finish(fl, now)
                before = len(self.flows)
                self.start_piece(fl[0], now, fl[5])
                if len(self.flows) == before:
                    break
                fl = self.flows.pop()

    def run(self) -> dict:
        f = self.f
        for node in range(f.nodes):
            for _ in range(f.threads):
                self.start_piece(node, 0.0, 0.0)
        t, steps = 0.0, 0
        while self.flows:
            horizon = t + f.step_s
            self.allocate(t, horizon)
            waiting = [fl for fl in self.flows if fl[4] >= horizon]
            end = self.step_end(t) if len(waiting) < len(self.flows) else min(fl[4] for fl in waiting)
            self.advance(t, end)
            t, steps = end, steps + 1
        return {"transfer_s": self.done, "store_bytes": self.bytes_store * f.tp,
                "peer_bytes": self.bytes_peer * f.tp, "steps": steps}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _spread(xs: list[float]) -> dict:
    return {"min": round(min(xs), 3), "p50": round(_pct(xs, 0.5), 3), "p100": round(max(xs), 3)}


def simulate(f: Fleet) -> dict:
    """Every node's transfer and warm time, the store's egress and the bytes from peers, beside
    one node's transfer under the same limits (the goal: every node warm within twice that)."""
    t0 = time.perf_counter()
    out = _Sim(f).run()
    alone = out if f.nodes == 1 and not f.holders else _Sim(replace(f, nodes=1, holders=0)).run()
    one = alone["transfer_s"][0]
    transfer = out["transfer_s"]
    warm = [max(x, f.local_start_s) + f.overlap_s for x in transfer]
    model = f.model_gb * GB
    res = {
        "scenario": asdict(f),
        "one_node_transfer_s": round(one, 3),
        "transfer_s": _spread(transfer),
        "warm_s": _spread(warm),
        "goal_s": round(2 * one, 3),
        "goal_met": max(warm) <= 2 * one,
        "store_egress_GB": round(out["store_bytes"] / GB, 2),
        "store_egress_models": round(out["store_bytes"] / model, 3),
        "peer_GB": round(out["peer_bytes"] / GB, 2),
        "peer_models": round(out["peer_bytes"] / model, 3),
        "sim": {"steps": out["steps"], "wall_s": round(time.perf_counter() - t0, 2)},
    }
    return res


def table(rows: list[dict]) -> str:
    """A short markdown table of simulate()'s results."""
    head = ("| model | nodes | peers | one node s | transfer p50 / p100 s | warm p50 / p100 s "
            "| goal (2x one node) | store egress GB (models) | from peers GB |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        s = r["scenario"]
        name = f"{s['model_gb']:g} GB" + (f" TP={s['tp']}" if s["tp"] > 1 else "")
        lines.append(
            f"| {name} | {s['nodes']} | {'on' if s['peers'] else 'off'} | {r['one_node_transfer_s']:.1f} "
            f"| {r['transfer_s']['p50']:.1f} / {r['transfer_s']['p100']:.1f} "
            f"| {r['warm_s']['p50']:.1f} / {r['warm_s']['p100']:.1f} "
            f"| {'met' if r['goal_met'] else 'missed'} ({r['goal_s']:.1f} s) "
            f"| {r['store_egress_GB']:.0f} ({r['store_egress_models']:.2f}) | {r['peer_GB']:.0f} |")
    return "\n".join(lines)


# --check: the fields of a one-host fetch measurement (docs/fleet.md lists them)
CHECK_FIELDS = {
    "model_bytes": "bytes the host fetched (the packed file, or its rank's file)",
    "fetch_s": "the measured transfer time (or fetch_gbps: model_bytes / fetch_s in GB/s)",
    "connection_mbps": "one ranged read's rate alone, MB/s (null: not limited)",
    "source_gbps": "the source's total egress, GB/s (null: not limited)",
    "nic_gbits": "the host's NIC, Gb/s (null: not limited)",
    "threads": "reads in flight",
    "piece_mib": "bytes per read, MiB",
}


def _number(m: dict, key: str, path: str, *, optional: bool = False) -> float | None:
    v = m.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"{path}: field {key!r} must be a number > 0 ({CHECK_FIELDS.get(key, key)}), "
                         f"got {v!r}")
    return float(v)


def check(path: str) -> dict:
    """Simulate one node under the limits a one-host measurement names; compare its transfer
    time with the measured one (within 10 %)."""
    try:
        with open(path) as fh:
            m = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a JSON object of the fetch measurement ({e})") from e
    if not isinstance(m, dict):
        raise ValueError(f"{path}: expected one JSON object with the fields {', '.join(CHECK_FIELDS)}")
    size = _number(m, "model_bytes", path)
    if m.get("fetch_s") is None and m.get("fetch_gbps") is not None:
        measured = size / (_number(m, "fetch_gbps", path) * GB)
    else:
        measured = _number(m, "fetch_s", path)
    nic = _number(m, "nic_gbits", path, optional=True)
    source = _number(m, "source_gbps", path, optional=True)
    conn = _number(m, "connection_mbps", path, optional=True)
    if nic is None and source is None and conn is None:
        raise ValueError(f"{path}: give at least one of nic_gbits, source_gbps, connection_mbps: "
                         "with no limit the transfer takes no time")
    f = Fleet(nodes=1, model_gb=size / GB, tp=1, peers=False,
              nic_gbits=nic or 1e6, egress_gbps=source or 0, connection_mbps=conn or 0,
              threads=int(_number(m, "threads", path)), piece_mib=_number(m, "piece_mib", path),
              latency_ms=float(m.get("latency_ms") or 0.0))
    simulated = _Sim(f).run()["transfer_s"][0]
    off = simulated / measured - 1
    res = {"file": path, "measured_s": round(measured, 3), "simulated_s": round(simulated, 3),
           "off_pct": round(100 * off, 1), "within_10pct": abs(off) <= 0.10}
    if off < -0.10:  # the model's network would have been faster: the host's own work was the limit
        res["host_limited"] = (f"the transfer ran at {size / measured / GB:.2f} GB/s where the network's limits "
                               f"allow {size / simulated / GB:.2f}: the host's own work (checks, cache writes, "
                               "copies to the GPU) limited it; a fleet run with this host's figures takes "
                               "--nic-gbits at most 8 x its rate")
    start, warm = m.get("replica_start_s"), m.get("replica_warm_s")
    if isinstance(start, (int, float)) and isinstance(warm, (int, float)):
        # the flags a fleet run takes from this host: --local-start-s and --overlap-s
        res["local_start_s"] = start
        res["overlap_s"] = round(max(0.0, warm - max(measured, start)), 3)
    return res


def _scenario(a: argparse.Namespace, **over) -> Fleet:
    size, tp = PRESETS[a.model]
    kw = {k: getattr(a, k) for k in Fleet.__dataclass_fields__ if getattr(a, k, None) is not None}
    kw.setdefault("model_gb", size / GB)
    kw.setdefault("tp", tp)
    kw.update(over)
    return Fleet(**kw)


def _parser() -> argparse.ArgumentParser:
    d = Fleet()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(PRESETS), default="70b",
                    help="7b: 13.5 GB fp16, one file; 70b: 141 GB fp16 at TP=4, four rank files per node")
    ap.add_argument("--model-gb", type=float, help="the model's size instead of the preset's, GB")
    ap.add_argument("--tp", type=int, help="rank files per node instead of the preset's")
    ap.add_argument("--nodes", type=int, default=d.nodes)
    ap.add_argument("--nic-gbits", type=float, default=d.nic_gbits, help="per node and direction, Gb/s")
    ap.add_argument("--egress-gbps", type=float, default=d.egress_gbps,
                    help="the object store's total egress, GB/s; 0: unlimited")
    ap.add_argument("--connection-mbps", type=float, default=d.connection_mbps,
                    help="one ranged read from the store, MB/s; 0: unlimited")
    ap.add_argument("--peer-connection-mbps", type=float, default=d.peer_connection_mbps,
                    help="one piece from a peer, MB/s; 0: only the NICs limit it")
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=d.peers)
    ap.add_argument("--piece-mib", type=float, default=d.piece_mib)
    ap.add_argument("--threads", type=int, default=d.threads, help="reads in flight per rank's loader")
    ap.add_argument("--latency-ms", type=float, default=d.latency_ms, help="a store read's first byte")
    ap.add_argument("--peer-latency-ms", type=float, default=d.peer_latency_ms, help="a peer's first byte")
    ap.add_argument("--jitter", action=argparse.BooleanOptionalAction, default=d.jitter,
                    help="each read's first byte uniformly within 0 to twice its latency, so that "
                         "reads begun together do not end together")
    ap.add_argument("--seed", type=int, default=d.seed, help="for --jitter")
    ap.add_argument("--refresh-s", type=float, default=d.refresh_s, help="peers' holdings refreshed every")
    ap.add_argument("--holders", type=int, default=d.holders,
                    help="nodes already holding the model (running replicas), serving it to peers")
    ap.add_argument("--defer-in-flight", action=argparse.BooleanOptionalAction, default=d.defer_in_flight,
                    help="a node puts off a piece some peer was reading from the store at the last "
                         "refresh (peers then publish their reads in flight too) and takes it last")
    ap.add_argument("--local-start-s", type=float, default=d.local_start_s,
                    help="the replica's start with its model local (a fresh node, measured)")
    ap.add_argument("--overlap-s", type=float, default=d.overlap_s,
                    help="what overlapping the fetch with the start costs beyond the longer of the two")
    ap.add_argument("--step-s", type=float, default=d.step_s, help="the simulation's shortest step")
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--matrix", action="store_true",
                    help="docs/fleet.md's table: 7B and 70B TP=4, with and without peers, the other flags as given")
    ap.add_argument("--check", metavar="FETCH_JSON",
                    help="simulate one node under a one-host measurement's limits; exit 1 if its "
                         "transfer time is more than 10 %% off the measured one")
    return ap


def _made() -> dict:
    """Where and when the figures were made: the host, the commit, the time (UTC)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=sys.path[0] or ".", check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"host": platform.node(), "commit": commit,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.check:
            res = check(a.check)
            print(json.dumps(res, indent=2))
            print(f"one node, {a.check}: measured {res['measured_s']:.2f} s, simulated "
                  f"{res['simulated_s']:.2f} s ({res['off_pct']:+.1f} %): "
                  f"{'within' if res['within_10pct'] else 'NOT within'} 10 %"
                  + (f"; {res['host_limited']}" if "host_limited" in res else ""))
            return 0 if res["within_10pct"] else 1
        if a.matrix:
            runs = [simulate(_scenario(a, model_gb=PRESETS[m][0] / GB, tp=PRESETS[m][1], peers=p))
                    for m in ("7b", "70b") for p in (True, False)]
        else:
            runs = [simulate(_scenario(a))]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = {**runs[0], "made": _made()} if len(runs) == 1 else {"runs": runs, "made": _made()}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=2)
    print(json.dumps(res, indent=2))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
