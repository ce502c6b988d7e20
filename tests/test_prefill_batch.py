"""Fresh prompts of a step in one attention call per layer (core/layers/prefill_batch.py):
the grouping, and outputs equal to one call per prompt wherever a layer can use the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cadence.layers.paged_attention import PrefillSeq, run_prefills
from cadence.layers.prefill_batch import plan_fresh_batches

BLOCK = 4
# Fresh prompts of 7, 3, 7, 2 and 6 tokens, and a chunk of 3 after 5 cached tokens.
LENS = [7, 3, 7, 2, 6]


def _step(heads: int, kvh: int, dim: int = 16):
    g = torch.Generator().manual_seed(0)
    prefills, start = [], 0
    for n in LENS:
        prefills.append(PrefillSeq(start, n, 0, None))
        start += n
    ctx_slots = torch.arange(8)  # the context chunk's 5 cached + 3 new tokens
    prefills.append(PrefillSeq(start, 3, 5, ctx_slots))
    start += 3
    q = torch.randn(start, heads, dim, generator=g)
    k, v = torch.randn(start, kvh, dim, generator=g), torch.randn(start, kvh, dim, generator=g)
    kc, vc = torch.randn(16, kvh, dim, generator=g), torch.randn(16, kvh, dim, generator=g)
    kc[5:8], vc[5:8] = k[-3:], v[-3:]
    return prefills, q, k, v, kc, vc


def test_grouping_pads_within_the_slack_and_leaves_singletons_alone() -> None:
    prefills, *_ = _step(4, 2)
    batches = plan_fresh_batches(prefills, "cpu")
    # Longest first: 7, 7, 6, 3 pad to 28 positions for 23 tokens (<= 1.25x); adding the
    # 2 would make 35 for 25. The 2 is alone, and the chunk with context is never batched.
    assert len(batches) == 1
    (b,) = batches
    assert b.members == {0, 1, 2, 4} and b.count == 4 and b.length == 7
    assert b.gather.numel() == 28 and b.keep.numel() == b.rows.numel() == 23
    assert sorted(b.rows.tolist()) == [t for i in (0, 1, 2, 4) for t in
                                       range(sum(LENS[:i]), sum(LENS[:i + 1]))]


@pytest.mark.parametrize(("heads", "kvh", "window", "cap", "calls"), [
    (4, 4, None, None, 3),  # the batch, the lone 2, the chunk with context
    (4, 2, None, None, 3),  # grouped-query heads
    (4, 2, 7, None, 3),  # a window no prompt reaches: the batch still runs
    (4, 2, 6, None, 6),  # a prompt reaches the window: one call per prompt
    (4, 2, None, 5.0, 0),  # soft-capped scores: their own kernel, per prompt
])
def test_batched_equals_one_call_per_prompt(monkeypatch, heads, kvh, window, cap,
                                            calls) -> None:
    prefills, q, k, v, kc, vc = _step(heads, kvh)
    scale = 0.25
    want = torch.zeros_like(q)
    run_prefills(q, k, v, kc, vc, prefills, scale, want, fused_context=True,
                 sliding_window=window, soft_cap=cap)
    n = [0]
    sdpa = F.scaled_dot_product_attention

    def counting(*a, **kw):
        n[0] += 1
        return sdpa(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    got = torch.zeros_like(q)
    run_prefills(q, k, v, kc, vc, prefills, scale, got, fused_context=True,
                 sliding_window=window, soft_cap=cap,
                 fresh_batches=plan_fresh_batches(prefills, "cpu"))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert n[0] == calls


def test_nothing_to_group() -> None:
    one = [PrefillSeq(0, 5, 0, None), PrefillSeq(5, 3, 4, torch.arange(7))]
    assert plan_fresh_batches(one, "cpu") == []
    # Lengths too far apart to pad: 40 and 2 would be 80 positions for 42 tokens.
    assert plan_fresh_batches([PrefillSeq(0, 40, 0, None), PrefillSeq(40, 2, 0, None)],
                              "cpu") == []
