"""Scheduler: token budget, chunked prefill, preemption through settle, policies, scaling.

The engine is simulated: schedule -> append a fake token per sampling entry ->
update_after_step -> finish at max_tokens (FINISHED_LENGTH) and free.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from cadence.block_manager import BlockManager
from cadence.config import SchedulerConfig
from cadence.request import Request, RequestStatus
from cadence.sampling_params import SamplingParams
from cadence.scheduler import Scheduler, StepPlan

_seq = itertools.count()


def make_request(rid: str, tokens: list[int] | int, max_tokens: int = 4,
                 priority: int = 0) -> Request:
    prompt = list(range(tokens)) if isinstance(tokens, int) else list(tokens)
    return Request(request_id=rid, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=max_tokens),
                   priority=priority, arrival_seq=next(_seq))


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 64,
                   max_num_seqs: int = 8, chunked: bool = True, policy: str = "fcfs",
                   max_model_len: int = 64, prefix: bool = True,
                   settle: Callable[[Request], None] | None = None) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len, enable_chunked_prefill=chunked,
                             policy=policy)
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix), settle=settle)


def fake_token(req: Request) -> int:
    # Deterministic in the token history, so siblings generate alike and share blocks.
    return hash(tuple(req.all_token_ids)) % 3


def run_step(sched: Scheduler) -> StepPlan:
    """One simulated engine step; finished requests are freed at once."""
    plan = sched.schedule()
    finished = []
    for entry in plan.scheduled:
        req = entry.request
        if entry.samples:
            req.output_token_ids.append(fake_token(req))
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                req.status = RequestStatus.FINISHED_LENGTH
                finished.append(req)
    sched.update_after_step(plan)
    for req in finished:
        sched.free_request(req)
    return plan


def tokens_of(plan: StepPlan) -> dict[str, int]:
    return {e.request.request_id: e.num_new_tokens for e in plan.scheduled}


def test_chunked_prefill_splits_long_prompt() -> None:
    sched = make_scheduler(budget=16)
    req = make_request("a", 40, max_tokens=2)
    sched.add_request(req)
    plans = [run_step(sched) for _ in range(3)]
    assert [p.num_batched_tokens for p in plans] == [16, 16, 8]
    assert [p.scheduled[0].samples for p in plans] == [False, False, True]
    assert req.num_output_tokens == 1 and req.num_computed_tokens == 40
    plan = run_step(sched)
    assert plan.num_decodes == 1 and req.is_finished
    assert not sched.has_unfinished_requests()
    assert sched.block_manager.num_free_blocks == 64


def test_chunking_disabled_prefill_waits_for_whole_budget() -> None:
    sched = make_scheduler(budget=32, max_model_len=32, chunked=False)
    a, b = make_request("a", 4, max_tokens=3), make_request("b", [7] * 32, max_tokens=1)
    sched.add_request(a)
    run_step(sched)
    sched.add_request(b)
    plan = run_step(sched)  # a decodes (1 token); b needs 32 > 31 left: it waits whole
    assert tokens_of(plan) == {"a": 1}
    plan = run_step(sched)
    assert tokens_of(plan) == {"a": 1} and a.is_finished
    assert tokens_of(run_step(sched)) == {"b": 32}


def test_decodes_come_first() -> None:
    sched = make_scheduler(budget=16, policy="priority")
    b = make_request("b", [1, 2], max_tokens=10, priority=5)
    sched.add_request(b)
    run_step(sched)
    a = make_request("a", [3] * 20, priority=0)  # more important: served first in running
    sched.add_request(a)
    # 15 tokens of budget are left for "a"; the chunk is cut at a block boundary (4).
    assert tokens_of(run_step(sched)) == {"b": 1, "a": 12}
    assert sched.running == [a, b]
    plan = run_step(sched)
    assert [e.request.request_id for e in plan.scheduled] == ["b", "a"]
    assert plan.num_decodes == 1 and plan.scheduled[0].is_decode
    assert plan.scheduled[1].samples and not plan.scheduled[1].is_decode
    assert plan.num_batched_tokens == 9


def test_chunk_boundaries_do_not_depend_on_the_decodes_in_the_step() -> None:
    """The same prompt is split at the same places however many decodes share the steps,
    which keeps its K/V bit-identical with async output processing on or off."""
    splits = []
    for num_decoders in (0, 1, 3):
        sched = make_scheduler(budget=10, block_size=4, max_num_seqs=8)
        for i in range(num_decoders):
            sched.add_request(make_request(f"d{i}", [1], max_tokens=40))
        run_step(sched)
        p = make_request("p", list(range(2, 32)), max_tokens=2)
        sched.add_request(p)
        ends = []
        while p.num_computed_tokens < p.num_prompt_tokens:
            plan = run_step(sched)
            if any(e.request is p for e in plan.scheduled):
                ends.append(p.num_computed_tokens)
        assert all(e % 4 == 0 for e in ends[:-1]) and ends[-1] == 30
        splits.append(set(ends))
    # Fewer tokens per step with more decodes, but every boundary is a block boundary.
    assert all(s <= set(range(0, 31, 4)) | {30} for s in splits)


def test_prefix_cache_hit_in_scheduler() -> None:
    sched = make_scheduler(block_size=4)
    a = make_request("a", list(range(10)), max_tokens=8)
    sched.add_request(a)
    run_step(sched)
    b = make_request("b", list(range(10)), max_tokens=4)
    sched.add_request(b)
    plan = run_step(sched)
    assert tokens_of(plan) == {"a": 1, "b": 2}
    assert b.num_cached_tokens == 8
    bm = sched.block_manager
    assert bm.get_block_table("b")[:2] == bm.get_block_table("a")[:2]
    bm.check_invariants()


def test_preemption_settles_first_then_recomputes() -> None:
    seen: list[tuple[str, RequestStatus, int]] = []

    def settle(req: Request) -> None:
        seen.append((req.request_id, req.status, len(sched.block_manager.get_block_table(
            req.request_id))))

    # 4 blocks of 4 tokens: two 7-token prompts fill them; the first decode needs a 5th.
    sched = make_scheduler(num_blocks=4, block_size=4, settle=settle)
    a, b = make_request("a", 7, max_tokens=4), make_request("b", 7, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    run_step(sched)  # both decode at position 7: still 2 blocks each
    plan = run_step(sched)  # a needs a 3rd block: b (latest arrival) is preempted
    assert seen == [("b", RequestStatus.RUNNING, 2)]
    assert plan.preempted == [b] and tokens_of(plan) == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_waiting == 1
    sched.block_manager.check_invariants()
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        run_step(sched)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4
    assert sched.block_manager.num_free_blocks == 4


def test_settle_that_finishes_the_victim_prevents_preemption() -> None:
    def settle(req: Request) -> None:
        req.status = RequestStatus.FINISHED_STOPPED  # a stop string in its pending output
        sched.free_request(req)

    sched = make_scheduler(num_blocks=4, block_size=4, settle=settle)
    a, b = make_request("a", 7, max_tokens=4), make_request("b", 7, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    run_step(sched)
    plan = run_step(sched)
    assert plan.preempted == [] and tokens_of(plan) == {"a": 1}
    assert b.num_preemptions == 0 and b.status == RequestStatus.FINISHED_STOPPED
    assert sched.get_request("b") is None and sched.num_waiting == 0
    sched.block_manager.check_invariants()


def test_finished_request_not_scheduled_and_blocks_kept() -> None:
    sched = make_scheduler()
    a = make_request("a", 5, max_tokens=10)
    sched.add_request(a)
    run_step(sched)
    a.status = RequestStatus.FINISHED_STOPPED  # commit saw EOS; finalize frees it later
    plan = sched.schedule()
    assert plan.is_empty and sched.num_running == 0
    assert sched.block_manager.get_block_table("a")  # not freed by the scheduler
    assert not sched.has_unfinished_requests()
    sched.free_request(a)
    assert sched.block_manager.num_free_blocks == 64


def test_priority_admission_and_victim() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=2, policy="priority")
    low = make_request("low", [1] * 7, max_tokens=8, priority=5)
    sched.add_request(low)
    run_step(sched)
    mid = make_request("mid", [2] * 7, priority=1)
    high = make_request("high", [3] * 7, priority=0)
    sched.add_request(mid)
    sched.add_request(high)
    plan = run_step(sched)  # one free seat: the more important request gets it
    assert set(tokens_of(plan)) == {"low", "high"}
    for _ in range(3):
        plan = run_step(sched)
        if plan.preempted:
            break
    assert plan.preempted == [low]  # the largest (priority, arrival) is the victim
    assert sched.waiting.peek() is mid  # mid (priority 1) is ahead of low in waiting


def test_fcfs_preempts_latest_arrival() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4)
    reqs = [make_request(f"r{i}", 7, max_tokens=8) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_step(sched)
    run_step(sched)
    plan = run_step(sched)
    assert plan.preempted == [reqs[2]]


def test_abort_waiting_and_running() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 5), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    assert sched.abort_request("b") is b and sched.num_waiting == 0
    assert sched.abort_request("a") is a and sched.num_running == 0
    assert sched.abort_request("a") is None
    assert sched.schedule().is_empty and not sched.has_unfinished_requests()
    assert sched.block_manager.num_free_blocks == 64


def test_request_larger_than_cache_raises() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4, chunked=False)
    sched.add_request(make_request("a", 9))
    with pytest.raises(RuntimeError, match="whole cache"):
        sched.schedule()


def test_waiting_scan_does_not_grow_with_queue() -> None:
    def setup(n: int) -> Scheduler:
        sched = make_scheduler(num_blocks=4096, budget=64, max_num_seqs=256)
        for i in range(n):
            sched.add_request(make_request(f"q{i}", 16))
        return sched

    peeks, times = {}, {}
    for n in (100, 10_000):
        best = float("inf")
        for _ in range(3):
            sched = setup(n)
            start = time.perf_counter()
            plan = sched.schedule()
            best = min(best, time.perf_counter() - start)
            assert len(plan.scheduled) == 4
        peeks[n], times[n] = sched.waiting.num_peeks, best
    assert peeks[10_000] == peeks[100] <= 5
    assert times[10_000] < 5 * times[100] + 1e-3


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    bs = draw(st.sampled_from([1, 2, 4]))
    shared = draw(st.lists(st.integers(0, 2), max_size=12))
    reqs = []
    for _ in range(draw(st.integers(1, 10))):
        keep = draw(st.integers(0, len(shared)))
        tail = draw(st.lists(st.integers(0, 2), min_size=0 if keep else 1, max_size=8))
        reqs.append((shared[:keep] + tail, draw(st.integers(1, 6)),
                     draw(st.integers(0, 3)), draw(st.integers(0, 4))))
    max_len = max(len(p) + m for p, m, _, _ in reqs)
    need = max(-(-(len(p) + m - 1) // bs) for p, m, _, _ in reqs)
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 24)) if chunked else draw(st.integers(max_len, max_len + 8))
    return {
        "reqs": reqs, "bs": bs, "chunked": chunked, "budget": budget, "max_len": max_len,
        "num_blocks": draw(st.integers(need, need + 3)),
        "max_num_seqs": draw(st.integers(1, 5)),
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "prefix": draw(st.booleans()), "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_random_workloads_run_to_completion(w: dict) -> None:
    rng = random.Random(w["seed"])
    bs = w["bs"]
    kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, slot) -> prefix it encodes
    deferred: list[Request] = []

    def settle(req: Request) -> None:
        # Called before preemption, while the victim still runs and holds its blocks.
        assert req.status == RequestStatus.RUNNING and bm.get_block_table(req.request_id)
        if rng.random() < 0.2:
            req.status = RequestStatus.FINISHED_STOPPED
            sched.free_request(req)

    sched = make_scheduler(num_blocks=w["num_blocks"], block_size=bs, budget=w["budget"],
                           max_num_seqs=w["max_num_seqs"], chunked=w["chunked"],
                           policy=w["policy"], max_model_len=w["max_len"], prefix=w["prefix"],
                           settle=settle)
    bm = sched.block_manager
    pending = [make_request(f"r{i}", p, m, prio) for i, (p, m, prio, _) in enumerate(w["reqs"])]
    reqs = list(pending)
    arrive = {r.request_id: at for r, (*_, at) in zip(pending, w["reqs"], strict=True)}
    for step in range(500):
        for r in [r for r in pending if arrive[r.request_id] <= step]:
            pending.remove(r)
            sched.add_request(r)
        if not pending and not sched.has_unfinished_requests() and not deferred:
            break
        victim = sched.get_request(f"r{rng.randrange(len(reqs))}")
        if rng.random() < 0.05 and victim is not None and not victim.is_finished:
            assert sched.abort_request(victim.request_id) is victim
            victim.status = RequestStatus.FINISHED_ABORTED
        plan = sched.schedule()
        # Finished requests from the last step are freed after scheduling (the lag).
        for r in deferred:
            sched.free_request(r)
        deferred = []
        assert plan.num_batched_tokens <= w["budget"]
        assert plan.num_batched_tokens == sum(e.num_new_tokens for e in plan.scheduled)
        assert len(plan.scheduled) <= w["max_num_seqs"] and sched.num_running <= w["max_num_seqs"]
        assert len({id(e.request) for e in plan.scheduled}) == len(plan.scheduled)
        assert all(e.is_decode for e in plan.scheduled[:plan.num_decodes])
        assert not any(e.is_decode for e in plan.scheduled[plan.num_decodes:])
        bm.check_invariants()
        for entry in plan.scheduled:
            req, n = entry.request, entry.num_new_tokens
            assert not req.is_finished and req.status == RequestStatus.RUNNING and n >= 1
            assert w["chunked"] or req.num_computed_tokens + n == req.num_tokens
            table, toks = bm.get_block_table(req.request_id), req.all_token_ids
            assert len(table) * bs >= req.num_computed_tokens + n
            # Cached/earlier KV must encode exactly this request's prefix.
            for p in range(req.num_computed_tokens):
                assert kv[table[p // bs], p % bs] == tuple(toks[: p + 1])
            for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                kv[table[p // bs], p % bs] = tuple(toks[: p + 1])
            if entry.samples:
                req.output_token_ids.append(fake_token(req))
                if req.num_output_tokens >= req.sampling_params.max_tokens:
                    req.status = RequestStatus.FINISHED_LENGTH
                    if rng.random() < 0.5:  # freed by a later finalize, after next schedule
                        deferred.append(req)
        sched.update_after_step(plan)
        for entry in plan.scheduled:
            req = entry.request
            if req.status == RequestStatus.FINISHED_LENGTH and req not in deferred:
                sched.free_request(req)
        bm.check_invariants()
    else:
        pytest.fail("workload did not finish in 500 steps")
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
    assert all(r.is_finished for r in reqs)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens
               for r in reqs if r.status == RequestStatus.FINISHED_LENGTH)
    event(f"preempted: {any(r.num_preemptions for r in reqs)}")
    event(f"prefix hits: {bm.num_cached_hits > 0}")
