"""A request id is free for reuse once its request's final output is out, while work of the
old request may still be pending (a step planned under async scheduling, a finished sample's
finalize): that old work must never touch the new request's KV blocks, which the scheduler
and block manager keep by id. And a prefix computed twice stays cached and findable."""

from __future__ import annotations

import pytest

from cadence import SamplingParams
from cadence.block_manager import BlockManager
from cadence.engine import LLMEngine
from cadence.engine_args import EngineArgs
from cadence.request import Request

OLD = list(range(5, 22))
NEW = [(3 * i + 7) % 300 + 5 for i in range(36)]
GREEDY6 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model: str, **kw) -> LLMEngine:
    kw = {"max_model_len": 64, "block_size": 4, "num_kv_blocks": 16,
          "max_num_batched_tokens": 64, **kw}
    return LLMEngine.from_engine_args(EngineArgs(
        model=model, backend_options={"overlap": "sync", "kv_cache_gb": 0.01}, **kw))


def _drain(engine: LLMEngine) -> dict:
    finals = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return finals


def _tokens(out) -> list[tuple[int, ...]]:
    return [tuple(c.token_ids) for c in out.outputs]


def _assert_clean(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.output_processor.parents


def _alone(model: str, prompt: list[int], params: SamplingParams, **kw):
    e = _engine(model, **kw)
    try:
        e.add_request("alone", prompt, params)
        return _tokens(_drain(e)["alone"])
    finally:
        e.shutdown()


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def stop_string(model) -> SamplingParams:
    """Params under which OLD ends on a stop string some tokens in: found at finalize, one
    step after the token that completed it, so a step planned past it is in flight when the
    final output comes out."""
    e = _engine(model)
    try:
        e.add_request("probe", OLD, SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True))
        text = _drain(e)["probe"].outputs[0].text
    finally:
        e.shutdown()
    assert len(text) > 8, text
    return SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[text[4:8]])


def test_an_id_reused_while_the_old_requests_step_is_in_flight(model, stop_string) -> None:
    """Async scheduling: the old request's last planned step commits after the new request
    took its id; it used to free the new one's blocks (wrong tokens) and register them under
    the old prompt (another request's K/V served from the prefix cache)."""
    want_new = _alone(model, NEW, GREEDY6)
    e = _engine(model, async_scheduling=True)
    try:
        e.add_request("a", OLD, stop_string)
        while not any(o.request_id == "a" and o.finished for o in e.step()):
            pass
        assert e._loop.has_in_flight  # the step planned past the stop string
        e.add_request("a", NEW, GREEDY6)
        assert _tokens(_drain(e)["a"]) == want_new
        _assert_clean(e)
        # A prompt that runs through the old request's tokens finds only its own K/V.
        (old_out,) = _alone(model, OLD, stop_string)
        follow = OLD + list(old_out) + [7]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        e.add_request("c", follow, params)
        assert _tokens(_drain(e)["c"]) == _alone(model, follow, params,
                                                 enable_prefix_caching=False)
        _assert_clean(e)
    finally:
        e.shutdown()


def test_a_finished_samples_id_stays_taken_until_its_parent_ends(model) -> None:
    """A sample of n > 1 that finished leaves the scheduler before its parent's output is
    done; its id ('0_x') stays taken until then (a new request under it used to lose its
    blocks to the old sample's late finalize), and is free afterwards."""
    stops = list(range(3, 200))

    def params(seed: int) -> SamplingParams:
        return SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=8,
                              stop_token_ids=stops, ignore_eos=True)

    probe = _engine(model, num_kv_blocks=256)
    try:
        for seed in range(40):
            probe.add_request(f"s{seed}", OLD, params(seed))
        lengths = {rid: [len(t) for t in _tokens(o)] for rid, o in _drain(probe).items()}
    finally:
        probe.shutdown()
    # Seeded samples do not depend on the batch: one whose first sample stops at once.
    seed = next(s for s in range(40) if lengths[f"s{s}"][0] == 1 and lengths[f"s{s}"][1] >= 4)
    e = _engine(model, num_kv_blocks=64)
    try:
        e.add_request("x", OLD, params(seed))
        child = e.output_processor.parents["x"].children[0]
        while not child.is_finished:
            e.step()
        assert e.scheduler.get_request("0_x") is None  # out of the scheduler already
        assert "x" in e.output_processor.parents
        with pytest.raises(ValueError, match="'0_x' of one of its samples is in use"):
            e.add_request("0_x", NEW, GREEDY6)
        _drain(e)
        e.add_request("0_x", NEW, GREEDY6)
        assert _tokens(_drain(e)["0_x"]) == _alone(model, NEW, GREEDY6)
        _assert_clean(e)
    finally:
        e.shutdown()


def test_a_late_free_of_an_old_request_leaves_the_new_ones_blocks(model) -> None:
    """The scheduler frees by identity: freeing a request already freed does nothing, even
    where a newer request now holds its id and its blocks."""
    e = _engine(model)
    try:
        e.add_request("a", OLD, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        old = e.scheduler.get_request("a")
        _drain(e)
        e.add_request("a", NEW, GREEDY6)
        e.step()
        table = list(e.block_manager.get_block_table("a"))
        assert table
        e.scheduler.free_request(old)
        assert e.block_manager.get_block_table("a") == table
        assert e.scheduler.get_request("a") is not None
        assert _tokens(_drain(e)["a"]) == _alone(model, NEW, GREEDY6)
        _assert_clean(e)
    finally:
        e.shutdown()


def test_a_prefix_computed_twice_stays_findable_after_one_copy_is_evicted() -> None:
    """Two samples compute the same prompt in one step: the second one's later blocks are
    registered after the first one's copy. Once that copy is evicted, a request computing
    the prefix again registers its own blocks in their place, so the next finds them."""
    bs, prompt = 4, list(range(100, 108))
    bm = BlockManager(num_blocks=12, block_size=bs)

    def req(rid: str, tokens: list[int]) -> Request:
        return Request(rid, list(tokens), SamplingParams(max_tokens=8))

    def compute(r: Request) -> int:
        hit = r.num_computed_tokens = bm.get_computed_blocks(r)
        bm.allocate(r, r.num_tokens - hit)
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r)
        return hit

    a, b = req("0_r", [*prompt, 1]), req("1_r", [*prompt, 1])
    for r in (a, b):
        r.num_computed_tokens = bm.get_computed_blocks(r)
        bm.allocate(r, r.num_tokens)
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r)
    for t in (7, 8, 9):
        b.output_token_ids.append(t)
        bm.allocate(b, 1)
        b.num_computed_tokens += 1
        bm.cache_full_blocks(b)
    bm.free(a)
    bm.free(b)
    filler = req("F", list(range(200, 240)))  # evicts the first sample's copy
    bm.allocate(filler, filler.num_tokens)
    bm.free(filler)
    turn = [*prompt, 1, 7, 8, 9, 42]
    c = req("C", turn)
    compute(c)
    bm.free(c)
    d = req("D", turn)
    assert compute(d) == 12
    bm.free(d)
    bm.check_invariants()
