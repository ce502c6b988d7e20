"""Block manager: allocation, ref counts, prefix caching, collision safety, LRU eviction."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cadence.prefix_cache as prefix_cache_module
from cadence.block_manager import BlockManager
from cadence.request import Request
from cadence.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=4))


def compute_all(bm: BlockManager, req: Request) -> None:
    """Pretend the whole prompt was computed in one step (lookup, allocate, cache)."""
    req.num_computed_tokens = bm.get_computed_blocks(req)
    bm.allocate(req, req.num_tokens - req.num_computed_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    bm.check_invariants()


def test_no_torch_import() -> None:
    code = ("import sys, cadence.block_manager, cadence.prefix_cache, cadence.scheduler, "
            "cadence.sched_policy; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_and_free() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    req = make_request("a", range(9))
    assert bm.can_allocate(req, 9)
    bm.allocate(req, 9)
    assert len(bm.get_block_table("a")) == 3
    assert bm.num_free_blocks == 1
    assert bm.usage == pytest.approx(0.75)
    big = make_request("b", range(8))
    assert not bm.can_allocate(big, 8)
    with pytest.raises(RuntimeError):
        bm.allocate(big, 8)
    # Growing by tokens that fit the last block needs nothing new.
    req.num_computed_tokens = 9
    assert bm.can_allocate(req, 3)
    bm.allocate(req, 3)
    assert len(bm.get_block_table("a")) == 3
    bm.check_invariants()
    bm.free(req)
    bm.free(req)  # idempotent
    bm.free(big)  # never allocated: no-op
    assert bm.num_free_blocks == 4
    assert bm.get_block_table("a") == []
    bm.check_invariants()


def test_prefix_hit_shares_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(10)))
    compute_all(bm, a)
    assert bm.num_cached_blocks == 2  # the third block is partial
    b = make_request("b", list(range(8)) + [99, 98, 97])
    assert bm.get_computed_blocks(b) == 8
    assert bm.get_block_table("b") == bm.get_block_table("a")[:2]
    assert bm.num_cached_hits == 8
    bm.check_invariants()
    # Partial overlap within a block shares nothing of that block.
    c = make_request("c", list(range(6)) + [50, 51, 52])
    assert bm.get_computed_blocks(c) == 4
    bm.check_invariants()
    for r in (a, b, c):
        bm.free(r)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_hit_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    compute_all(bm, make_request("a", list(range(12))))
    assert bm.get_computed_blocks(make_request("b", list(range(8)))) == 4
    assert bm.get_computed_blocks(make_request("c", list(range(9)))) == 8
    bm.check_invariants()


def test_cached_block_survives_free_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4  # cached blocks are evictable, so they count as free
    b = make_request("b", list(range(9)))
    assert bm.get_computed_blocks(b) == 8
    assert bm.num_free_blocks == 2  # the two hits left the free pool
    bm.check_invariants()


def test_lru_eviction_order() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    b = make_request("b", [6, 7, 8, 9, 10])
    compute_all(bm, a)
    bm.free(a)  # a's blocks are now the least recently freed
    compute_all(bm, b)
    bm.free(b)
    assert bm.num_cached_blocks == 4
    # The two hash-less free blocks are handed out before any cached block...
    for rid in ("c", "d"):
        bm.allocate(make_request(rid, [20]), 1)
        assert bm.num_cached_blocks == 4
    # ...then the least recently freed cached block goes: a's tail block.
    bm.allocate(make_request("e", [30]), 1)
    assert bm.num_cached_blocks == 3
    probe_a = make_request("pa", [1, 2, 3, 4, 5])
    assert bm.get_computed_blocks(probe_a) == 2  # a's first block survived, its tail did not
    probe_b = make_request("pb", [6, 7, 8, 9, 10])
    assert bm.get_computed_blocks(probe_b) == 4
    bm.check_invariants()


def test_constant_hash_never_gives_wrong_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache_module, "hash_block_tokens", lambda parent, tokens: 0)
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    compute_all(bm, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same hash, different tokens: the token compare refuses the hit.
    assert bm.get_computed_blocks(make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == 0
    # A genuine match of the first block still hits; a colliding second block does not.
    assert bm.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])) == 4
    bm.check_invariants()


def test_parent_identity_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    # A hash that ignores the parent: equal blocks after different prefixes collide.
    monkeypatch.setattr(prefix_cache_module, "hash_block_tokens", lambda parent, tokens: hash(tokens))
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    compute_all(bm, make_request("c", [7, 7, 1, 1, 0]))  # caches [7, 7] then [1, 1]
    compute_all(bm, make_request("a", [5, 5, 3, 3, 0]))  # caches [5, 5] then [3, 3]
    # [7, 7] hits; [3, 3] matches by hash and tokens but was computed after [5, 5].
    b = make_request("b", [7, 7, 3, 3, 0])
    assert bm.get_computed_blocks(b) == 2
    bm.check_invariants()


def test_duplicate_prefix_computed_twice_still_chains() -> None:
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    a, b = make_request("a", [1, 2, 3, 4, 5]), make_request("b", [1, 2, 3, 4, 5])
    for r in (a, b):  # both computed in the same step, neither saw the other's blocks
        assert bm.get_computed_blocks(r) == 0
        bm.allocate(r, 5)
        r.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    bm.check_invariants()
    assert bm.num_cached_blocks == 2
    bm.free(a)
    assert bm.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5])) == 4
    bm.check_invariants()


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    compute_all(bm, make_request("a", [1, 2, 3, 4, 5]))
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == 0


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_operations_keep_invariants(data: st.DataObject) -> None:
    bs = data.draw(st.sampled_from([1, 2, 4]))
    num_blocks = data.draw(st.integers(1, 12))
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=data.draw(st.booleans()))
    live: dict[str, Request] = {}
    for step in range(data.draw(st.integers(1, 30))):
        if live and data.draw(st.booleans()):
            bm.free(live.pop(data.draw(st.sampled_from(sorted(live)))))
        else:
            tokens = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=12))
            req = make_request(f"r{step}", tokens)
            req.num_computed_tokens = bm.get_computed_blocks(req)
            new = req.num_tokens - req.num_computed_tokens
            if bm.can_allocate(req, new):
                bm.allocate(req, new)
                req.num_computed_tokens = req.num_tokens
                bm.cache_full_blocks(req)
                live[req.request_id] = req
            else:
                bm.free(req)
        bm.check_invariants()
    for req in live.values():
        bm.free(req)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks


@given(prompt_len=st.integers(1, 40), computed=st.integers(0, 40), new=st.integers(1, 20))
@settings(max_examples=200, deadline=None)
def test_holds_is_exactly_nothing_to_allocate(prompt_len, computed, new) -> None:
    """The scheduler's fast path for a running request (``holds``) says yes exactly when
    ``allocate`` would take no block."""
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    req = make_request("a", range(prompt_len))
    assert not bm.holds(req, new)  # no table yet
    bm.allocate(req, prompt_len)
    req.num_computed_tokens = min(computed, prompt_len)
    free_before = bm.num_free_blocks
    held = bm.holds(req, new)
    assert held == (bm._num_missing(req, new) == 0)
    if held:
        bm.allocate(req, new)
        assert bm.num_free_blocks == free_before


def test_blocks_come_into_being_when_first_handed_out() -> None:
    """A cache of 10**8 blocks (small blocks of a small model) costs nothing up front, and
    the hand-out order is the eager pool's: blocks freed empty first (the latest first),
    then never-used ones in id order, then cached ones, least recently freed first."""
    bm = BlockManager(10**8, 4)
    assert bm.num_free_blocks == 10**8 and bm.usage == 0.0 and len(bm._blocks) == 0
    small = BlockManager(6, 4)
    a, b, c = (make_request(n, list(range(k, k + 8))) for n, k in
               (("a", 0), ("b", 100), ("c", 200)))
    compute_all(small, a)  # a's two blocks are cached when freed; b's are not
    small.allocate(b, 8)
    assert small.get_block_table("a") == [0, 1] and small.get_block_table("b") == [2, 3]
    small.free(a)
    small.free(b)
    c.prompt_token_ids = list(range(200, 224))
    small.allocate(c, 24)
    assert small.get_block_table("c") == [2, 3, 4, 5, 1, 0]
    small.check_invariants()
