"""A request's chunks handed from the engine's thread to an asyncio consumer: one at a time, or a
step's together (``delivered_together``), in order either way, over real event loops and threads."""

from __future__ import annotations

import asyncio
import threading

import pytest

from deployments.engine.request import Chunk, RequestHandle, delivered_together


def _loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


def _handles(loop: asyncio.AbstractEventLoop, n: int) -> list[RequestHandle]:
    async def make() -> list[RequestHandle]:
        return [RequestHandle(i, 4, threading.Event()) for i in range(n)]
    return asyncio.run_coroutine_threadsafe(make(), loop).result(timeout=10)


@pytest.mark.parametrize("together", [False, True])
def test_every_consumer_gets_its_chunks_in_order(together):
    loop = _loop()
    handles = _handles(loop, 5)

    async def consume(h: RequestHandle) -> list[str]:
        return [c.text async for c in h]

    futs = [asyncio.run_coroutine_threadsafe(consume(h), loop) for h in handles]
    calls = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (calls.append(a[0]), real(*a))[1]  # counts the hand-overs
    for step in range(4):  # one engine step: a chunk for every request
        with delivered_together() if together else _nothing():
            for h in handles:
                h._put(Chunk([step], f"{h.id}:{step}", "length" if step == 3 else None))
    assert [f.result(timeout=10) for f in futs] == [[f"{i}:{s}" for s in range(4)] for i in range(5)]
    assert len(calls) == (4 if together else 20)  # one per step, or one per request and step
    assert all(h.result(timeout=1)[2] == "length" for h in handles)
    loop.call_soon_threadsafe(loop.stop)


def test_chunks_for_two_loops_go_to_each_and_nested_blocks_deliver_once():
    loops = [_loop(), _loop()]
    a, b = _handles(loops[0], 1)[0], _handles(loops[1], 1)[0]

    async def consume(h: RequestHandle) -> list[int]:
        return [t for c in [c async for c in h] for t in c.token_ids]

    fa = asyncio.run_coroutine_threadsafe(consume(a), loops[0])
    fb = asyncio.run_coroutine_threadsafe(consume(b), loops[1])
    with delivered_together():
        a._put(Chunk([1], "", None))
        with delivered_together():  # the outer block delivers
            b._put(Chunk([2], "", None))
        assert not b._aq.qsize()
        a._put(Chunk([3], "", "stop"))
        b._put(Chunk([4], "", "stop"))
    assert fa.result(timeout=10) == [1, 3] and fb.result(timeout=10) == [2, 4]
    for loop in loops:
        loop.call_soon_threadsafe(loop.stop)


def test_a_consumer_whose_loop_closed_cancels_its_request():
    loop = _loop()
    h = _handles(loop, 1)[0]
    loop.call_soon_threadsafe(loop.stop)
    while loop.is_running():
        pass
    loop.close()
    with delivered_together():
        h._put(Chunk([1], "x", None))
    assert h.cancelled  # the engine frees its slot at the next step


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: object) -> None:
        return None


def test_waiting_for_the_end_is_one_wake_up_with_the_whole_answer():
    loop = _loop()
    h = _handles(loop, 1)[0]
    h._put(Chunk([7], "a", None))  # before the wait began: already in its queue
    fut = asyncio.run_coroutine_threadsafe(h.finished(), loop)
    while not h._final_only:
        pass
    calls = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (calls.append(a[0]), real(*a))[1]
    for i, reason in enumerate([None, None, "length"]):
        h._put(Chunk([8 + i], "bcd"[i], reason))
    assert fut.result(timeout=10) == ([7, 8, 9, 10], "abcd", "length")
    assert len(calls) == 1  # the last chunk only
    loop.call_soon_threadsafe(loop.stop)


def test_a_cancelled_wait_cancels_the_request():
    loop = _loop()
    h = _handles(loop, 1)[0]
    fut = asyncio.run_coroutine_threadsafe(h.finished(), loop)
    while not h._final_only:
        pass
    fut.cancel()
    for _ in range(1000):
        if h.cancelled:
            break
        threading.Event().wait(0.01)
    assert h.cancelled
    loop.call_soon_threadsafe(loop.stop)
