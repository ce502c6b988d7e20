"""The CPU backend's sampling kernel (``draw_from_logits``, csrc/logits.cpp): the last step
of random sampling, against an fp64 CDF and against the torch path it replaces, and its place
in the engine (the runner draws through it; seeded runs stay reproducible; async == sync).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import generate, make_llm

from cadence import SamplingParams
from cadence.backend import SamplingMetadata
from cadence.backends.cpu.fused import KernelDraw
from cadence.layers import sampler

NEG_INF = float("-inf")


def _gap(logits: torch.Tensor, frac: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """How far (as a share of the row's mass) each row's target lies outside the fp64 CDF
    interval of the token drawn for it; 0 when that token is exactly the right one."""
    p = torch.softmax(logits.double(), dim=-1)
    cdf = p.cumsum(dim=-1)
    target = frac.double().reshape(-1, 1) * cdf[:, -1:]
    hi = cdf.gather(1, idx.unsqueeze(1))
    lo = hi - p.gather(1, idx.unsqueeze(1))
    return torch.maximum(lo - target, target - hi).clamp(min=0).squeeze(1)


def _masked_logits(b: int, v: int, g: torch.Generator) -> torch.Tensor:
    logits = torch.randn(b, v, generator=g) * 3
    mask = torch.rand(b, v, generator=g) < 0.5
    mask[:, 255:v:256] = True  # the last token of every chunk
    mask[::2, 256:512] = True  # a whole chunk
    mask[1::3, -1] = True  # the last token of the vocabulary
    mask[::5, 768:] = True  # every chunk after the third
    mask[:, 0] = False  # at least one token left per row
    return logits.masked_fill(mask, NEG_INF)


@pytest.mark.parametrize("v", [1000, 4096, 255, 257, 49152, 17])
def test_draw_lands_in_the_right_token(ops, v: int) -> None:
    g = torch.Generator().manual_seed(v)
    logits = torch.randn(64, v, generator=g) * 4
    frac = 1.0 - torch.rand(64, generator=g)  # as the sampler draws it: (0, 1]
    idx = ops.draw_from_logits(logits, frac)
    assert idx.shape == (64,) and idx.dtype == torch.int64
    assert _gap(logits, frac, idx).max() < 1e-5
    # The torch path rounds differently, so a draw within rounding of a boundary may differ;
    # elsewhere both pick the same token.
    torch_idx = sampler.draw_softmax(logits, frac.unsqueeze(1))
    assert (idx == torch_idx).float().mean() >= 0.95


def test_draw_never_returns_a_masked_token(ops) -> None:
    g = torch.Generator().manual_seed(1)
    b = 512
    for v in (1000, 1024, 300):
        logits = _masked_logits(b, v, g)
        for frac in (1.0 - torch.rand(b, generator=g), torch.ones(b), torch.full((b,), 2.0 ** -24),
                     torch.full((b,), 1e-30), 1.0 - torch.rand(b, generator=g) * 1e-6):
            idx = ops.draw_from_logits(logits, frac)
            assert int(idx.min()) >= 0 and int(idx.max()) < v
            assert torch.isfinite(logits.gather(1, idx.unsqueeze(1))).all()
            assert _gap(logits, frac, idx).max() < 1e-5


def test_draw_edges(ops) -> None:
    v = 1000  # not a multiple of 256 (a short last chunk) nor of the vector width
    logits = torch.full((5, v), NEG_INF)
    logits[:, :10] = 0.0
    logits[0, 999] = 1.0  # the very last token
    logits[1, 767] = 1.0  # the last token of a chunk, followed by a masked chunk
    logits[2, 511] = 1.0
    logits[4] = NEG_INF  # nothing left: token 0, never an index outside the row
    idx = ops.draw_from_logits(logits, torch.ones(5))
    assert idx.tolist() == [999, 767, 511, 9, 0]
    # A one-hot row draws its token whatever the fraction.
    one_hot = torch.full((3, 300), NEG_INF)
    one_hot[:, 123] = 5.0
    assert ops.draw_from_logits(one_hot, torch.tensor([1e-30, 0.5, 1.0])).tolist() == [123] * 3
    # Large logits do not overflow (the max is subtracted first).
    big = torch.tensor([[1e30, 1e30 - 1e24, NEG_INF, -1e30]])
    assert ops.draw_from_logits(big, torch.tensor([0.25])).item() == 0


@pytest.mark.parametrize("low", [-1e15, -1e30, -3e38])
def test_draw_extreme_spreads_weigh_nothing(ops, low: float) -> None:
    """Rows wide enough for the vector path: logits far below the maximum (a repetition
    penalty near 0 makes them) weigh ~0, never inf or NaN, and x - max overflowing to -inf
    is no different."""
    for top in (0.0, 3e38):
        row = torch.full((1, 700), low)
        row[0, 413] = top
        row[0, 5] = NEG_INF
        fracs = torch.tensor([1e-30, 0.3, 0.999, 1.0])
        idx = ops.draw_from_logits(row.expand(4, 700).contiguous(), fracs)
        assert idx.tolist() == [413] * 4, (low, top)


def test_draw_rows_the_softmax_is_undefined_on(ops) -> None:
    """A NaN or +inf logit: the row's largest logit's first token, never a masked one."""
    v = 300
    rows = torch.randn(3, v, generator=torch.Generator().manual_seed(6))
    rows[:, 0] = NEG_INF
    rows[0, 40] = float("nan")
    rows[0, 77] = 50.0
    rows[1, 123] = float("inf")
    rows[1, 200] = float("inf")
    rows[2] = float("nan")
    idx = ops.draw_from_logits(rows, torch.full((3,), 0.5))
    assert idx.tolist() == [77, 123, 0]


def test_draw_rows_do_not_depend_on_other_rows(ops) -> None:
    g = torch.Generator().manual_seed(2)
    logits = _masked_logits(48, 1000, g)
    frac = 1.0 - torch.rand(48, generator=g)
    batch = ops.draw_from_logits(logits, frac)
    for i in range(48):
        assert torch.equal(ops.draw_from_logits(logits[i:i + 1], frac[i:i + 1]), batch[i:i + 1])
    perm = torch.randperm(48, generator=g)
    assert torch.equal(ops.draw_from_logits(logits[perm], frac[perm]), batch[perm])


def test_draw_follows_the_softmax(ops) -> None:
    """Many draws from one row: the frequencies match the softmax (a wrong chunk sum, an
    off-by-one inside a chunk or a bad exp shows up as a skew)."""
    v = 600
    g = torch.Generator().manual_seed(3)
    row = torch.randn(v, generator=g) * 1.5
    row[::3] = NEG_INF
    n = 200_000
    idx = ops.draw_from_logits(row.expand(n, v).contiguous(), 1.0 - torch.rand(n, generator=g))
    freq = torch.bincount(idx, minlength=v).double() / n
    p = torch.softmax(row.double(), dim=-1)
    assert freq[::3].sum() == 0
    # Per token: within 5 standard deviations of a binomial count.
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-9).all()


def test_draw_refuses_bad_shapes(ops) -> None:
    with pytest.raises(RuntimeError, match="float32"):
        ops.draw_from_logits(torch.zeros(2, 5, dtype=torch.bfloat16), torch.ones(2))
    with pytest.raises(RuntimeError, match="one value per row"):
        ops.draw_from_logits(torch.zeros(2, 5), torch.ones(3))
    with pytest.raises(RuntimeError, match="empty vocabulary"):
        ops.draw_from_logits(torch.zeros(2, 0), torch.ones(2))


def test_sampler_uses_the_draw_it_is_given(ops) -> None:
    """``sample`` hands the filtered, temperature-scaled logits to ``draw``: with top-k 1 any
    draw must return the argmax; with the kernel, seeded rows repeat."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 700, generator=g) * 3
    b = logits.shape[0]
    meta = SamplingMetadata([0.7] * b, [1] * b, [1.0] * b, [0.0] * b, [None] * b, [0] * b, False)
    out = sampler.sample(logits, meta, torch.Generator().manual_seed(0), draw=KernelDraw(ops))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    seeded = SamplingMetadata([1.0] * b, [0] * b, [1.0] * b, [0.0] * b, list(range(b)),
                              [0] * b, False)
    draws = [sampler.sample(logits, seeded, torch.Generator().manual_seed(s),
                            draw=KernelDraw(ops)).token_ids for s in (0, 1)]
    assert torch.equal(draws[0], draws[1])


def test_engine_draws_through_the_kernel(ops, tiny_model_dir, monkeypatch) -> None:
    """The CPU backend's runner samples through the kernel; seeded sampling repeats run to run
    and async output processing on == off, in both in-process strategies."""
    calls = []
    real = KernelDraw.__call__

    def counting(self, logits, frac):
        calls.append(logits.shape[0])
        return real(self, logits, frac)

    monkeypatch.setattr(KernelDraw, "__call__", counting)
    model = tiny_model_dir("llama")
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7 + i,
                             ignore_eos=True) for i in range(4)]
    prompts = ["the quick brown fox", "jumps over", "the lazy dog", "and runs"]
    outs = []
    for overlap, async_on in (("sync", True), ("sync", False), ("thread", True)):
        llm = make_llm(model, disable_async_output_proc=not async_on,
                       backend_options={"overlap": overlap})
        outs.append([o.outputs[0].token_ids for o in generate(llm, prompts, params)])
    assert calls, "the runner never drew through the kernel"
    assert outs[0] == outs[1] == outs[2]
    assert all(len(t) == 12 for t in outs[0])
