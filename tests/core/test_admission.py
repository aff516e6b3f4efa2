"""Admission that keeps room for growth running sequences are certain of (core/admission.py), driven without a
model: each step appends one token to every sequence whose known tokens are all computed, and a sequence
finishes at its max_tokens."""

from __future__ import annotations

import argparse

from kvpage.core.admission import certain_length
from kvpage.core.beam import BeamGroup
from kvpage.core.scheduler import Scheduler, SchedulerConfig
from kvpage.core.sequence import Request, Sequence
from kvpage.engine.arg_utils import EngineArgs
from kvpage.kv import KVCacheManager
from kvpage.outputs import RequestMetrics
from kvpage.sampling_params import SamplingParams, StructuredOutputsParams

_order = iter(range(10**6))


def make_seq(sid: str, prompt_len: int, **params) -> Sequence:
    """A request of its own tokens (no prefix hits between them)."""
    order = next(_order)
    req = Request(sid, None, list(range(1000 * order + 1, 1000 * order + prompt_len + 1)), SamplingParams(**params),
                  order, RequestMetrics(0.0))
    seq = Sequence(f"{sid}#0", req, 0, list(req.prompt_token_ids), prompt_len)
    req.seqs.append(seq)
    return seq


def make_sched(num_blocks: int, reserve: bool, block_size: int = 4, budget: int = 64, watermark: float = 0.0,
               max_model_len: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, watermark=watermark, max_model_len=max_model_len)
    cfg = SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=budget, max_num_seqs=16,
                          reserve_certain_growth=reserve)
    return Scheduler(cfg, kv)


def run(s: Scheduler, arrivals: dict[int, list[Sequence]], max_steps: int = 500) -> list[tuple[str, int]]:
    """Step until every sequence finished at its max_tokens; arrivals[k] join before step k. Returns each
    step's admissions (sequence id, step) and checks the pool's invariants and that every block came back."""
    admitted: list[tuple[str, int]] = []
    everyone = [q for group in arrivals.values() for q in group]
    for step in range(max_steps):
        for seq in arrivals.get(step, []):
            s.add(seq)
        if not s.has_unfinished and step > max(arrivals):
            break
        out = s.schedule()
        admitted += [(w.seq.seq_id, step) for w in out.work if w.start_pos == 0 and w.seq.num_computed_tokens == 0]
        s.mark_computed(out)
        for w in out.work:
            if w.completes_prompt:
                w.seq.token_ids.append(7)
                if w.seq.num_output_tokens >= w.seq.request.params.max_tokens:
                    s.finish(w.seq, "length")
        s.kv.check_invariants()
    assert all(q.finish_reason == "length" and q.num_output_tokens == q.request.params.max_tokens for q in everyone)
    assert s.kv.num_free_blocks == s.kv.num_blocks, "blocks leaked"
    return admitted


def five_known_lengths() -> dict[int, list[Sequence]]:
    """Five requests of 12 prompt tokens and 20 output tokens each under ignore_eos: 8 blocks of 4 at the end, where
    the pool holds 32 blocks, four such sequences."""
    return {0: [make_seq(f"r{i}", 12, max_tokens=20, ignore_eos=True) for i in range(5)]}


def test_known_output_lengths_never_preempt_where_plain_admission_does():
    plain = make_sched(32, reserve=False)
    run(plain, five_known_lengths())
    assert plain.num_preemptions > 0  # all five came in on their prompts' 3 blocks and outgrew the pool
    reserving = make_sched(32, reserve=True)
    admitted = run(reserving, five_known_lengths())
    assert reserving.num_preemptions == 0
    assert [sid for sid, step in admitted if step == 0] == ["r0#0", "r1#0", "r2#0", "r3#0"]
    assert [sid for sid, step in admitted if step > 0] == ["r4#0"]  # once the first four gave their blocks back


def test_outputs_that_may_stop_at_any_token_are_admitted_as_before():
    """Without ignore_eos nothing but the next slot is certain: admission is unchanged, preemption does the rest."""
    reqs = {0: [make_seq(f"r{i}", 12, max_tokens=20) for i in range(5)]}
    s = make_sched(32, reserve=True)
    admitted = run(s, reqs)
    assert s.num_preemptions > 0
    assert sum(1 for _, step in admitted if step == 0) == 5


def test_min_tokens_is_certain_growth():
    reqs = {0: [make_seq(f"r{i}", 12, max_tokens=20, min_tokens=20) for i in range(5)]}
    s = make_sched(32, reserve=True)
    run(s, reqs)
    assert s.num_preemptions == 0


def test_a_prompt_is_admitted_where_all_of_it_fits_not_only_its_first_chunk():
    """A 32-token prompt arriving while a 40-token one is prefilled 16 tokens a step would get the budget's last
    8 tokens (2 blocks) beside the other's last chunk; the rest of it, 6 blocks more, is certain to come, and the
    pool (16 blocks of 4) cannot hold that beside the first one's 11: it waits instead of being preempted."""
    def arrivals() -> dict[int, list[Sequence]]:
        return {0: [make_seq("first", 40, max_tokens=4)], 1: [make_seq("late", 32, max_tokens=4)]}
    plain = make_sched(16, reserve=False, budget=16)
    run(plain, arrivals())
    assert plain.num_preemptions > 0
    s = make_sched(16, reserve=True, budget=16)
    admitted = dict(run(s, arrivals()))
    assert s.num_preemptions == 0
    assert admitted["late#0"] == 6  # once the first one is done: its prompt in steps 0-2, its last tokens in 3-5


def test_a_request_that_needs_the_whole_pool_still_starts_alone():
    s = make_sched(8, reserve=True, watermark=0.25)  # 8 + 24 tokens: all 8 blocks; 2 kept back at admission
    run(s, {0: [make_seq("big", 8, max_tokens=24, ignore_eos=True)], 1: [make_seq("next", 4, max_tokens=4)]})
    assert s.num_preemptions == 0


def test_certain_length():
    assert certain_length(make_seq("a", 10, max_tokens=20, ignore_eos=True), 64) == 30
    assert certain_length(make_seq("a", 10, max_tokens=80, ignore_eos=True), 64) == 64  # the context ends it
    assert certain_length(make_seq("a", 10, max_tokens=None, ignore_eos=True), 64) == 64  # None: the context's room
    assert certain_length(make_seq("a", 10, max_tokens=20), 64) == 10  # EOS may come at any token
    assert certain_length(make_seq("a", 10, max_tokens=20, min_tokens=5), 64) == 15
    for stops in ({"stop": ["x"]}, {"stop_token_ids": [3]}):
        assert certain_length(make_seq("a", 10, max_tokens=20, min_tokens=5, ignore_eos=True, **stops), 64) == 15
    form = StructuredOutputsParams(regex="[ab]+")  # complete at any token, min_tokens or not
    assert certain_length(make_seq("a", 10, max_tokens=20, min_tokens=5, structured_outputs=form), 64) == 10
    beam = make_seq("b", 10, max_tokens=20, ignore_eos=True)
    beam.request.beam = BeamGroup(width=2, max_tokens=20, stop_ids=(), eos_ids=frozenset())
    assert certain_length(beam, 64) == 10
    grown = make_seq("a", 10, max_tokens=20)
    grown.token_ids += [7, 7, 7]
    assert certain_length(grown, 64) == 13  # never less than what it holds


def test_the_switch_reaches_the_scheduler_from_the_command_line():
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli_args(p.parse_args([])).scheduler_config(64).reserve_certain_growth
    off = EngineArgs.from_cli_args(p.parse_args(["--no-reserve-certain-growth"]))
    assert not off.scheduler_config(64).reserve_certain_growth
