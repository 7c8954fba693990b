"""The engine thread's hand-over of one step's tokens to the HTTP side's event loop.

    python bench/handoff.py [--requests 128] [--steps 128] [--rounds 3]

N requests bound to an asyncio loop in another thread (as the replica's routes are) each get one
chunk per step from this thread, as the engine's emit of a step does, with a 2 ms pause between
steps (the device's step). Side by side, in alternating rounds: one ``call_soon_threadsafe`` per
request ("each"), and the step's chunks handed over in one call per loop (``delivered_together``,
what the engine does). Prints the engine thread's time per step (median, p90) and the wall time
until every consumer has every chunk. CPU only; nothing is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.meta import stamp  # noqa: E402
from deployments.engine.request import Chunk, RequestHandle, delivered_together  # noqa: E402


def one_round(n: int, steps: int, together: bool) -> dict:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    wake = threading.Event()

    async def make() -> list[RequestHandle]:
        return [RequestHandle(i, 8, wake) for i in range(n)]

    handles = asyncio.run_coroutine_threadsafe(make(), loop).result()
    got = [0]

    async def consume(h: RequestHandle) -> None:
        async for _ in h:
            got[0] += 1

    futs = [asyncio.run_coroutine_threadsafe(consume(h), loop) for h in handles]
    time.sleep(0.2)
    per = []
    t0 = time.perf_counter()
    for step in range(steps):
        t = time.perf_counter()
        with delivered_together() if together else contextlib.nullcontext():
            for h in handles:
                h._put(Chunk([1], "x", "length" if step == steps - 1 else None))
        per.append(time.perf_counter() - t)
        time.sleep(0.002)
    for f in futs:
        f.result(timeout=120)
    wall = time.perf_counter() - t0
    loop.call_soon_threadsafe(loop.stop)
    assert got[0] == n * steps, (got[0], n * steps)
    per.sort()
    return {"ms_per_step_median": per[len(per) // 2] * 1e3, "ms_per_step_p90": per[int(len(per) * 0.9)] * 1e3,
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    res: dict = {"each": [], "together": []}
    for _ in range(a.rounds):
        for kind in ("each", "together"):
            r = one_round(a.requests, a.steps, kind == "together")
            res[kind].append(r)
            print(f"{kind:9s} engine thread {r['ms_per_step_median']:.3f} ms/step (p90 {r['ms_per_step_p90']:.3f}), "
                  f"every chunk delivered after {r['wall_s']:.2f} s", flush=True)
    if a.out:
        res["command"] = "python bench/handoff.py " + " ".join(sys.argv[1:])
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(stamp(res), indent=2) + "\n")


if __name__ == "__main__":
    main()
