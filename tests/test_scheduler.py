"""The scheduler alone: its plans for admission, chunked prefill, decode rows, block grants and
preemption, driven step by step as the engine drives it, with what a model would have sampled
written down by hand. No model, and no torch: this file imports none (conftest does, for the
other tests), and the subprocess below shows the scheduler's modules do not either."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deployments.engine.blocks import BlockPool
from deployments.engine.plan import Outcome, Plan, PrefillChunk, PrefillGroup, Sampled
from deployments.engine.request import SamplingParams
from deployments.engine.scheduler import NonFiniteLogits, Scheduler, SchedulerConfig, Seq

ROOT = Path(__file__).resolve().parents[1]


def test_the_scheduler_its_plan_and_the_output_processor_import_no_torch():
    code = ("import sys\nimport deployments.engine.scheduler, deployments.engine.plan, deployments.engine.output\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _sch(slots: int = 2, chunk: int = 16, pool: BlockPool | None = None, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(slots, 64, chunk, **kw), pool)


def _seq(i: int, n: int, new: int = 8, stops: frozenset = frozenset()) -> Seq:
    return Seq(i, [10 + i] * n, SamplingParams(max_new_tokens=new, temperature=0.0), stops)


def _prefill(sch: Scheduler, tok: int = 7) -> tuple[Plan, list[Outcome]]:
    """One prefill turn: every prompt the plan ends samples ``tok``."""
    plan = sch.schedule_prefill()
    ended = [item.seq_ids if isinstance(item, PrefillGroup) else [item.seq_id] for item in plan.prefills
             if isinstance(item, PrefillGroup) or item.last]
    return plan, sch.update(plan, Sampled({i: tok for ids in ended for i in ids}, dtype="torch.float16"))


def _decode(sch: Scheduler, tok: int = 5) -> tuple[Plan, list[Outcome]]:
    """One decode step whose rows all sample ``tok``, its tokens taken at once."""
    plan = sch.schedule_decode()
    return plan, sch.update(plan, Sampled({row.seq_id: tok for row in plan.decode}))


def test_admission_gives_the_lowest_free_slots_in_order_and_the_rest_wait():
    sch = _sch(slots=2)
    sch.add(_seq(1, 3), _seq(2, 3), _seq(3, 3))
    sch.intake()
    plan, out = _prefill(sch)
    assert plan.admitted == [1, 2] and [(c.seq_id, c.slot) for c in plan.prefills] == [(1, 0), (2, 1)]
    assert [s.id for s in sch.waiting] == [3] and sch.waiting_count() == 1
    assert out == [Outcome(1, 7, None), Outcome(2, 7, None)]  # each prompt's first token
    assert sch.finish(1, "stop") is None and sch.free == [0]  # slot 0 back ...
    assert sch.schedule_frees().cache_ops == [("zero_slot", 0, 3)]  # ... its 3 positions zeroed first
    plan, _ = _prefill(sch)
    assert plan.admitted == [3] and plan.prefills[0].slot == 0  # ... and the next waiting request takes it


def test_a_long_prompt_is_prefilled_a_chunk_per_turn_and_decodes_after_its_last():
    sch = _sch(slots=2, chunk=16)
    sch.add(_seq(1, 40), _seq(2, 5))
    sch.intake()
    plans = [_prefill(sch) for _ in range(3)]
    chunks = [[(c.seq_id, c.start, len(c.tokens), c.last) for c in p.prefills] for p, _ in plans]
    # the first prompt takes each turn's 16 tokens until its last 8; the second has the other 8
    assert chunks == [[(1, 0, 16, False)], [(1, 16, 16, False)], [(1, 32, 8, True), (2, 0, 5, True)]]
    assert [out for _, out in plans[:2]] == [[], []]  # no token before a prompt's end
    assert sch.counts["prompt_tokens"] == 45 and [s.id for s in sch.decoding] == [1, 2]
    plan = sch.schedule_decode()
    assert [(r.seq_id, r.slot, r.token, r.pos) for r in plan.decode] == [(1, 0, 7, 40), (2, 1, 7, 5)]


def test_padding_counts_as_written_and_is_zeroed_at_the_end():
    sch = _sch(slots=1, chunk=64, prefill_lengths=(16, 32, 64))
    sch.add(_seq(1, 20, new=1))
    sch.intake()
    _, out = _prefill(sch)
    assert out == [Outcome(1, 7, "length")]  # one new token: it ends with its prefill
    assert sch.schedule_frees().cache_ops == [("zero_slot", 0, 32)]  # 20 tokens run padded to 32


def test_fresh_prompts_of_one_padded_length_share_a_forward():
    sch = _sch(slots=4, chunk=64, prefill_lengths=(8, 16, 32, 64), batched_prefill=True)
    sch.add(_seq(1, 5), _seq(2, 7), _seq(3, 12), _seq(4, 6))
    sch.intake()
    plan, out = _prefill(sch)
    group, *alone = plan.prefills
    # 1, 2 and 4 pad to 8: a power of two of them, 2, share one forward; 3 (16) and 4 go alone
    assert isinstance(group, PrefillGroup) and (group.seq_ids, group.length, group.start) == ([1, 2], 8, 0)
    assert all(isinstance(c, PrefillChunk) for c in alone) and [(c.seq_id, len(c.tokens)) for c in alone] == [
        (3, 12), (4, 6)]
    assert group.prompts == [[11] * 5, [12] * 7] and group.slots == [0, 1]
    assert len(out) == 4 and not sch.prefilling and sch.counts["prompt_tokens"] == 30


def test_decode_rows_feed_the_device_token_while_one_is_on_its_way():
    sch = _sch(slots=1)
    sch.add(_seq(1, 3, new=4))
    sch.intake()
    _prefill(sch)
    first = sch.schedule_decode()
    second = sch.schedule_decode()  # launched before the first's tokens are back
    assert [(r.token, r.pos) for r in first.decode] == [(7, 3)]
    assert [(r.token, r.pos) for r in second.decode] == [(None, 4)]  # its token is on the device
    assert sch.update(first, Sampled({1: 8})) == [Outcome(1, 8, None)]
    assert sch.update(second, Sampled({1: 9})) == [Outcome(1, 9, None)]
    # 4 new tokens: the prefill's, two steps' and the last step, whose token ends it
    last = sch.schedule_decode()
    assert [(r.token, r.pos) for r in last.decode] == [(9, 5)] and sch.schedule_decode().decode == []
    assert sch.update(last, Sampled({1: 3})) == [Outcome(1, 3, "length")]
    assert sch.idle() and sch.counts["tokens_generated"] == 4


def test_a_stop_token_ends_a_request_and_a_late_token_of_an_ended_one_is_dropped():
    sch = _sch(slots=1)
    sch.add(_seq(1, 3, new=10, stops=frozenset({2})))
    sch.intake()
    _prefill(sch)
    step, ahead = sch.schedule_decode(), sch.schedule_decode()
    assert sch.update(step, Sampled({1: 2})) == [Outcome(1, 2, "stop")]
    assert sch.update(ahead, Sampled({1: 4})) == []  # the row launched meanwhile is dropped
    assert sch.schedule_frees().cache_ops == [("zero_slot", 0, 5)]  # the prompt and both steps' positions


def test_cancelled_requests_end_wherever_they_are():
    sch = _sch(slots=1)
    sch.add(_seq(1, 3), _seq(2, 3))
    sch.intake()
    _prefill(sch)
    out = sch.intake({1, 2})
    assert out == [Outcome(1, None, "cancelled"), Outcome(2, None, "cancelled")]
    assert sch.idle() and not sch.waiting and sch.free == [0]
    plan = sch.schedule_frees()
    assert plan.cache_ops == [("zero_slot", 0, 3)] and plan.ended == [1, 2]


def test_failures_and_non_finite_logits_end_only_their_requests():
    sch = _sch(slots=2, chunk=16)
    sch.add(_seq(1, 12), _seq(2, 3))
    sch.intake()
    plan = sch.schedule_prefill()
    assert [(c.seq_id, c.start, c.last) for c in plan.prefills] == [(1, 0, True), (2, 0, True)]
    out = sch.update(plan, Sampled({2: None}, failed={1: (0, ValueError("bad chunk"))}, dtype="torch.float16"))
    assert [(o.seq_id, o.reason, type(o.error)) for o in out] == [(1, "error", ValueError),
                                                                  (2, "error", NonFiniteLogits)]
    assert "float16" in str(out[1].error) and sch.counts["prompt_tokens"] == 3  # the failed chunk's not counted
    assert sch.idle() and sorted(sch.free) == [0, 1]


def test_paged_admission_grants_blocks_and_growth_takes_one_at_a_time():
    pool = BlockPool(num_blocks=9, block_size=4, prefix=False)  # blocks 1..8
    sch = _sch(slots=2, pool=pool)
    sch.add(_seq(1, 6, new=20))
    sch.intake()
    plan, _ = _prefill(sch)
    assert plan.cache_ops == [("assign", 0, [1, 2], [])] and pool.free == 6  # 6 prompt + 1 new position
    for _ in range(2):  # positions 6, 7: in its two blocks
        plan, _ = _decode(sch)
        assert plan.cache_ops == []
    plan, _ = _decode(sch)  # position 8: a third block
    assert plan.cache_ops == [("assign", 0, [1, 2, 3], [])] and pool.free == 5
    sch.finish(1, "stop")
    assert sch.schedule_frees().cache_ops == [("release", 0, [1, 2, 3])] and pool.free == 8


def test_out_of_blocks_the_request_admitted_last_is_preempted_and_prefilled_again_first():
    pool = BlockPool(num_blocks=5, block_size=4, prefix=False)  # blocks 1..4
    sch = _sch(slots=2, pool=pool)
    sch.add(_seq(1, 3, new=20), _seq(2, 3, new=20), _seq(3, 2, new=2))
    sch.intake()
    _prefill(sch)  # 1 and 2 take a block each (3 waits: a block of headroom stays for them)
    assert [s.id for s in sch.decoding] == [1, 2] and [s.id for s in sch.waiting] == [3]
    assert not sch.short_of_blocks()
    _decode(sch)  # position 3
    plan, _ = _decode(sch)  # position 4: a second block each
    assert plan.cache_ops == [("assign", 0, [1, 3], []), ("assign", 1, [2, 4], [])] and pool.free == 0
    for _ in range(3):  # positions 5..7 in their blocks
        assert not sch.short_of_blocks()
        _decode(sch)
    assert sch.short_of_blocks()  # position 8 needs a third block each, and none is free
    two = sch.decoding[1]
    plan, _ = _decode(sch)
    # the request admitted last gives its blocks back; the other grows into one of them
    assert plan.cache_ops == [("release", 1, [2, 4]), ("assign", 0, [1, 3, 2], [])]
    assert [r.seq_id for r in plan.decode] == [1] and pool.counts["preemptions"] == 1
    assert [s.id for s in sch.waiting] == [2, 3] and two.slot == -1
    assert two.prompt == [12] * 3 + two.out and len(two.out) == 6  # recomputed over what it generated
    sch.finish(1, "stop")
    plan, out = _prefill(sch)
    assert plan.admitted == [2] and (plan.prefills[0].seq_id, plan.prefills[0].start) == (2, 0)
    assert len(plan.prefills[0].tokens) == 9 and out == [Outcome(2, 7, None)]  # its seventh token
