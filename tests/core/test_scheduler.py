"""The scheduler's rules, driven without a model (the 'model' appends a fixed token per step)."""

from __future__ import annotations

import pytest

from kvpage.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpage.core.sequence import Request, Sequence, SequenceStatus
from kvpage.engine.arg_utils import EngineArgs
from kvpage.kv import KVCacheManager
from kvpage.outputs import RequestMetrics
from kvpage.sampling_params import SamplingParams

_order = iter(range(10**6))


def make_seq(sid: str, prompt_len: int, priority: int = 0, use_priority: bool = False) -> Sequence:
    req = Request(sid, None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=64), next(_order),
                  RequestMetrics(0.0), priority, use_priority=use_priority)
    seq = Sequence(f"{sid}#0", req, 0, list(req.prompt_token_ids), prompt_len)
    req.seqs.append(seq)
    return seq


def fake_step(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after the forward pass: count computed tokens, append one sampled token."""
    s.mark_computed(out)
    for w in out.work:
        if w.completes_prompt:
            w.seq.token_ids.append(token)


def sched(num_blocks=32, block_size=4, **kw) -> Scheduler:
    cfg = dict(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=8)
    cfg.update(kw)
    watermark = cfg.pop("watermark", 0.0)
    caching = cfg.pop("prefix_caching", True)
    kv = KVCacheManager(num_blocks, block_size, watermark=watermark, num_swap_blocks=cfg.pop("swap", 0),
                        max_model_len=cfg["max_model_len"], enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(**cfg), kv)


def test_long_prompt_is_chunked_and_shares_steps_with_decodes():
    s = sched()
    short = make_seq("short", 3)
    s.add(short)
    fake_step(s, s.schedule())  # short's prompt done, one token appended
    long = make_seq("long", 40)
    s.add(long)
    out = s.schedule()
    assert [(w.seq.seq_id, w.num_tokens) for w in out.work] == [("short#0", 1), ("long#0", 15)]
    assert out.num_batched_tokens == 16
    fake_step(s, out)
    out = s.schedule()
    assert [(w.seq.seq_id, w.num_tokens, w.start_pos) for w in out.work] == [("short#0", 1, 4), ("long#0", 15, 15)]
    assert not out.work[1].completes_prompt


def test_max_num_seqs_and_budget_limit_admissions():
    s = sched(max_num_seqs=2)
    for i in range(4):
        s.add(make_seq(f"r{i}", 3))
    out = s.schedule()
    assert [w.seq.seq_id for w in out.work] == ["r0#0", "r1#0"]
    assert len(s.waiting) == 2


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    with pytest.raises(ValueError, match="must be >= max_model_len"):
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1, got 0"):  # 0 is no default
        EngineArgs(max_num_batched_tokens=0).scheduler_config(max_model_len=64)
    assert EngineArgs(enable_chunked_prefill=False).scheduler_config(64).max_num_batched_tokens == 64
    s = sched(max_num_batched_tokens=64, enable_chunked_prefill=False)
    a, b = make_seq("a", 40), make_seq("b", 30)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(w.seq.seq_id, w.num_tokens) for w in out.work] == [("a#0", 40)]  # b does not fit the rest


def run_until_preemption(s: Scheduler, limit: int = 20) -> SchedulerOutput:
    for _ in range(limit):
        out = s.schedule()
        if out.preempted:
            return out
        fake_step(s, out)
    raise AssertionError("no preemption happened")


def test_preemption_takes_the_latest_arrival_and_blocks_admissions():
    s = sched(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    a, b = make_seq("a", 8), make_seq("b", 8)
    s.add(a)
    s.add(b)
    fake_step(s, s.schedule())
    c = make_seq("c", 2)
    s.add(c)
    out = run_until_preemption(s)  # both grow; at 13 tokens each needs a 4th block and the pool has 6
    assert [v.seq_id for v in out.preempted] == ["b#0"]
    assert [w.seq.seq_id for w in out.work] == ["a#0"], "no admissions in a step that preempted"
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and len(b.token_ids) == 13
    s.kv.check_invariants()
    fake_step(s, out)
    out = s.schedule()  # b returns first (earlier arrival than c); its full blocks are still cached
    assert [(w.seq.seq_id, w.start_pos) for w in out.work][:2] == [("a#0", 13), ("b#0", 12)]


def test_recompute_keeps_generated_tokens_and_recomputes_them():
    s = sched(num_blocks=5, block_size=4, max_num_batched_tokens=64, prefix_caching=False)
    a, b = make_seq("a", 7), make_seq("b", 7)
    s.add(a)
    s.add(b)
    run_until_preemption(s)
    kept = list(b.token_ids)
    assert kept[:7] == list(range(1, 8)) and len(kept) > 7
    s.finish(a, "stop")
    out = s.schedule()
    assert out.work[0].seq is b and out.work[0].start_pos == 0 and out.work[0].num_tokens == len(kept)
    assert out.work[0].completes_prompt and b.token_ids == kept


def test_swap_preemption_and_return():
    s = sched(num_blocks=5, block_size=4, max_num_batched_tokens=64, preemption_mode="swap", swap=8,
              prefix_caching=False)
    a, b = make_seq("a", 7), make_seq("b", 7)
    s.add(a)
    s.add(b)
    out = run_until_preemption(s)
    assert out.swap_out and b.status is SequenceStatus.SWAPPED and s.num_swap_preemptions == 1
    fake_step(s, out)
    s.finish(a, "stop")
    out = s.schedule()
    assert out.swap_in and out.work[0].seq is b and b.status is SequenceStatus.RUNNING
    assert out.work[0].start_pos == b.num_computed_tokens  # nothing recomputed
    s.kv.check_invariants()


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    s = sched(num_blocks=5, block_size=4, max_num_batched_tokens=64, preemption_mode="swap", swap=1)
    a, b = make_seq("a", 7), make_seq("b", 7)
    s.add(a)
    s.add(b)
    out = run_until_preemption(s)
    assert not out.swap_out and s.num_swap_preemptions == 0
    assert b.status is SequenceStatus.WAITING


def test_priority_policy_runs_urgent_requests_first():
    s = sched(max_num_seqs=1, policy="priority")
    low = make_seq("low", 3, priority=5, use_priority=True)
    high = make_seq("high", 3, priority=-1, use_priority=True)
    s.add(low)
    s.add(high)
    out = s.schedule()
    assert [w.seq.seq_id for w in out.work] == ["high#0"]


def test_check_fits_rejects_requests_that_can_never_run():
    s = sched(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="needs 8 KV blocks but the whole pool has 4"):
        s.check_fits(10, 20)
    with pytest.raises(ValueError, match="leaves no room to generate"):
        s.check_fits(64, 1)
    with pytest.raises(ValueError, match="empty"):
        s.check_fits(0, 1)
    s.check_fits(10, 6)


def test_finish_and_abort_return_blocks_from_any_queue():
    s = sched(num_blocks=8, block_size=4, max_num_batched_tokens=64, preemption_mode="swap", swap=8)
    a, b, c = make_seq("a", 5), make_seq("b", 5), make_seq("c", 5)
    for x in (a, b, c):
        s.add(x)
    fake_step(s, s.schedule())
    s.kv.swap_out(b)
    s.running.remove(b)
    s.swapped.add(b)
    b.status = SequenceStatus.SWAPPED
    for x in (a, b, c):
        s.finish(x, "abort")
    assert s.kv.num_free_blocks == 8 and s.kv.num_free_swap_blocks == 8 and not s.has_unfinished
