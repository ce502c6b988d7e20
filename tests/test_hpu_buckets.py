"""HPU shape buckets, padding and the warmup plan: pure logic, no torch, no device."""

from __future__ import annotations

import pytest
from cadence.backend import ModelInput, SamplingMetadata
from cadence.backends.hpu import buckets as bk
from hypothesis import given, settings
from hypothesis import strategies as st


def test_exponential_and_linear_examples() -> None:
    assert bk.generate_buckets(bk.BucketRange(1, 32, 6), "exponential") == [1, 2, 4, 6]
    assert bk.generate_buckets(bk.BucketRange(16, 16, 128), "exponential") == [16, 32, 64, 128]
    assert bk.generate_buckets(bk.BucketRange(1, 32, 100), "linear") == [
        1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert bk.generate_buckets(bk.BucketRange(5, 5, 5), "linear") == [5]


def test_invalid_ranges_name_the_problem() -> None:
    with pytest.raises(ValueError, match="min <= max"):
        bk.BucketRange(8, 1, 4)
    with pytest.raises(ValueError, match="min:step:max"):
        bk.BucketRange.parse("1:2")
    with pytest.raises(ValueError, match="exponential"):
        bk.generate_buckets(bk.BucketRange(1, 1, 4), "cubic")
    assert bk.BucketRange.parse("2:4:64") == bk.BucketRange(2, 4, 64)


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(1, 64), step=st.integers(1, 64), span=st.integers(0, 500),
       strategy=st.sampled_from(bk.STRATEGIES))
def test_buckets_cover_every_value(lo: int, step: int, span: int, strategy: str) -> None:
    r = bk.BucketRange(lo, step, lo + span)
    buckets = bk.generate_buckets(r, strategy)
    assert buckets == sorted(set(buckets))
    assert buckets[0] == r.min and buckets[-1] == r.max
    for v in range(1, r.max + 1):
        b = bk.find_bucket(buckets, v)
        assert b >= v and b in buckets
        assert all(x < v for x in buckets if x < b)  # the smallest that fits
    assert bk.find_bucket(buckets, r.max + 1) > r.max  # past the range: still padded up


def _greedy(n: int) -> SamplingMetadata:
    return SamplingMetadata([0.0] * n, [0] * n, [1.0] * n, [0.0] * n, [None] * n, [0] * n, True)


def _model_input(decode_lens: list[int], prefills: list[tuple[int, int]], block_size: int
                 ) -> ModelInput:
    """Decodes with the given seq lens, then prefills (query_len, context_len); block ids are
    consecutive per sequence so every slot is distinct."""
    ids, pos, slots, qlens, slens, tables = [], [], [], [], [], []
    next_block = 0
    seqs = [(1, n - 1) for n in decode_lens] + list(prefills)
    for q, ctx in seqs:
        n = q + ctx
        nblocks = -(-n // block_size)
        table = list(range(next_block, next_block + nblocks))
        next_block += nblocks
        for p in range(ctx, n):
            ids.append(1000 + p)
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        qlens.append(q)
        slens.append(n)
        tables.append(table)
    sampled = list(range(len(seqs)))
    return ModelInput(ids, pos, slots, qlens, slens, tables, len(decode_lens), sampled,
                      _greedy(len(sampled)))


def test_pad_batch_keeps_real_tokens_and_sends_padding_to_the_dummy_slot() -> None:
    bs, dummy = 4, 99
    mi = _model_input([5, 9], [(3, 0), (6, 4)], bs)
    dec = bk.BucketShape("decode", 4, 1, 4)
    pb = bk.pad_batch(mi, range(2), dec, dummy, bs)
    assert pb.input_ids[:2] == mi.input_ids[:2] and pb.input_ids[2:] == [0, 0]
    assert pb.slot_mapping[2:] == [dummy * bs] * 2
    assert pb.block_tables[0] == [0, 1, dummy, dummy] and pb.block_tables[3] == [dummy] * 4
    assert pb.seq_lens == [5, 9, 1, 1] and pb.logits_indices == [0, 1, 2, 3]

    pre = bk.BucketShape("prefill", 2, 8, 4)
    pb = bk.pad_batch(mi, range(2, 4), pre, dummy, bs)
    assert len(pb.input_ids) == 16 and pb.num_real == 2
    assert pb.input_ids[:3] == mi.input_ids[2:5] and pb.input_ids[3:8] == [0] * 5
    assert pb.positions[8:14] == [4, 5, 6, 7, 8, 9] and pb.positions[14:] == [0, 0]
    assert pb.slot_mapping[3:8] == [dummy * bs] * 5
    assert pb.logits_indices == [2, 8 + 5]


def test_dummy_batch_is_all_padding() -> None:
    pb = bk.dummy_batch(bk.BucketShape("prefill", 2, 4, 0), 7, 16)
    assert pb.num_real == 0 and set(pb.slot_mapping) == {7 * 16}
    assert pb.block_tables == [[], []] and pb.logits_indices == [0, 4]


def _cfg(with_context: bool = True) -> bk.BucketConfig:
    ranges = {"prompt_bs": bk.BucketRange(1, 2, 4), "prompt_seq": bk.BucketRange(4, 4, 32),
              "decode_bs": bk.BucketRange(1, 2, 4), "decode_blocks": bk.BucketRange(1, 2, 16)}
    return bk.BucketConfig.from_ranges("exponential", ranges, 4, 32, 64, with_context)


def test_warmup_plan_is_largest_first_and_unique() -> None:
    plan = bk.warmup_plan(_cfg())
    assert len(plan) == len(set(plan))
    sizes = [s.size for s in plan]
    assert sizes == sorted(sizes, reverse=True)
    assert {s.kind for s in plan} == {"decode", "prefill"}
    assert not any(s.num_blocks for s in bk.warmup_plan(_cfg(False)) if s.kind == "prefill")


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_schedulable_step_pads_to_a_warmed_shape(data: st.DataObject) -> None:
    cfg = _cfg()
    plan = set(bk.warmup_plan(cfg))
    num_dec = data.draw(st.integers(0, 4))
    decode_lens = data.draw(st.lists(st.integers(2, 64), min_size=num_dec, max_size=num_dec))
    prefills, budget = [], cfg.max_num_batched_tokens
    for _ in range(data.draw(st.integers(0 if num_dec else 1, 4))):
        if budget < 1:
            break
        q = data.draw(st.integers(1, min(budget, 32)))
        ctx = data.draw(st.integers(0, 64 - q))
        prefills.append((q, ctx))
        budget -= q
    mi = _model_input(decode_lens, prefills, cfg.block_size)
    if num_dec:
        assert bk.bucket_for(cfg, mi, range(num_dec), "decode") in plan
    if prefills:
        assert bk.bucket_for(cfg, mi, range(num_dec, mi.num_seqs), "prefill") in plan
