"""Where a replica's start spends its time, function by function (GPU machine).

Builds the replica (``deployments.server.replica.LLMServer``: its start's steps, then the
warm-up plan of serve_config.yaml) in this process under cProfile, and writes
the phases and the functions with the most cumulative and own time. The loader's threads
are the phase ``load`` (their own time), the main thread's wait for them is ``load_wait``;
cProfile records the main thread only up to Python 3.11, every thread from 3.12.

    PYTHONPATH=$PWD python bench/start_profile.py PACKED_DIR --out start-profile.json

``--scope engine-start`` profiles only while ``Engine.start`` runs (the first eager launches, the
capture of the decode graphs and, in the loop thread, the first prefills), with the whole
start's phases still timed (on Python 3.12 the loader's threads show in it too: ``preadv``,
``copy_h2d``). ``--profiler torch`` profiles ``Engine.start`` with torch.profiler instead
(CPU and, on a GPU, CUDA activity: every thread's CUDA runtime and driver calls, so a
kernel launch that loads its module lazily shows as one long ``cudaLaunchKernel`` or
``cuLaunchKernel``) and writes the calls with the most own time and the longest single
calls, each with its thread and its start from ``Engine.start``'s.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.meta import stamp  # noqa: E402


def top(stats: pstats.Stats, key: str, n: int) -> list[dict]:
    """The n functions with the most ``key`` time ('cumulative' or 'tottime')."""
    rows = []
    for (path, line, name), (_cc, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(path).name}:{line}({name})" if path != "~" else name,
                     "where": path, "calls": nc, "own_s": round(tt, 4), "cumulative_s": round(ct, 4)})
    rows.sort(key=lambda r: r["cumulative_s" if key == "cumulative" else "own_s"], reverse=True)
    return rows[:n]


def torch_profiled(fn, n: int) -> dict:
    """Run fn() under torch.profiler: the n calls (ops, CUDA runtime and driver API calls)
    with the most own CPU time, summed per name, and the n longest single calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    t0 = min((e.time_range.start for e in events), default=0)
    own = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    longest = sorted(events, key=lambda e: e.time_range.elapsed_us(), reverse=True)[:n]
    return {"profiled_ms": round((max((e.time_range.end for e in events), default=t0) - t0) / 1e3, 2),
            "top_own_calls": [{"name": e.key, "calls": e.count, "own_ms": round(e.self_cpu_time_total / 1e3, 3),
                               "total_ms": round(e.cpu_time_total / 1e3, 3)} for e in own],
            "longest_calls": [{"name": e.name, "ms": round(e.time_range.elapsed_us() / 1e3, 3),
                               "at_ms": round((e.time_range.start - t0) / 1e3, 2), "thread": e.thread}
                              for e in longest]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packed", help="packed model directory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--max-slots", type=int, default=16)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--pstats", type=Path, help="also write the raw profile here (python -m pstats FILE; callers)")
    ap.add_argument("--scope", choices=["start", "engine-start"], default="start",
                    help="profile the whole start (default) or only Engine.start")
    ap.add_argument("--profiler", choices=["cprofile", "torch"], default="cprofile",
                    help="torch: Engine.start under torch.profiler (implies --scope engine-start)")
    a = ap.parse_args(argv)
    if a.profiler == "torch":
        a.scope = "engine-start"
    import yaml

    from deployments.server.replica import LLMServer

    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    user_config = cfg["applications"][0]["deployments"][0]["user_config"]
    prof = cProfile.Profile()
    whole = a.scope == "start"
    if not whole:
        from deployments.engine.engine import Engine
        real_start = Engine.start

        def profiled_start(self) -> None:
            if a.profiler == "torch":
                torch_calls.update(torch_profiled(lambda: real_start(self), a.top))
                return
            prof.enable()
            try:
                real_start(self)
            finally:
                prof.disable()
        Engine.start = profiled_start
    torch_calls: dict = {}
    t0 = time.perf_counter()
    if whole:
        prof.enable()
    server = LLMServer(a.packed, device=a.device, engine={"max_slots": a.max_slots, "max_seq_len": a.max_seq_len})
    server.reconfigure(user_config)
    if whole:
        prof.disable()
    wall = time.perf_counter() - t0
    server.shutdown()
    res = {"command": "PYTHONPATH=$PWD python bench/start_profile.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "scope": a.scope,
           "wall_s": round(wall, 3), "phases_s": server.timer.as_dict(),
           "engine_stats": server.engine.stats()}
    if a.profiler == "torch":
        res.update(torch_calls)
    else:
        stats = pstats.Stats(prof, stream=io.StringIO())
        res.update(top_cumulative=top(stats, "cumulative", a.top), top_own=top(stats, "tottime", a.top))
    if a.pstats and a.profiler == "cprofile":
        prof.dump_stats(a.pstats)
    for row in res.get("top_own", [])[:15]:
        print(f"{row['own_s']:8.3f} {row['cumulative_s']:8.3f} {row['calls']:7d}  {row['function']}")
    for row in res.get("longest_calls", [])[:25]:
        print(f"{row['ms']:9.2f} ms at {row['at_ms']:9.2f} ms  thread {row['thread']}  {row['name']}")
    print(json.dumps(res["phases_s"]))
    st = res["engine_stats"]
    keys = ("first_launch_s", "first_launch_ms", "capture_s", "first_prefill_ms")
    print(json.dumps({k: st.get(k) for k in keys}
                     | {k: res["phases_s"].get(k) for k in ("engine_graphs", "engine")}))
    if a.out:
        a.out.write_text(json.dumps(stamp(res), indent=2))
    return res


if __name__ == "__main__":
    main()
