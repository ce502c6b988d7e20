"""A bf16 LM head rounds logits to 8 bits of mantissa, so near-equal candidates tie and
argmax takes the lower id; the entries tied at a row's maximum are recomputed in fp32
(core/layers/logits.py) by the torch path and by the CPU backend's kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cadence.layers.logits import TOP_K, RefineTopLogits, refine_top_logits


def _near_twins(twins: int = 2, vocab: int = 512, hidden: int = 64, rows: int = 5, seed: int = 0):
    """A head whose first ``twins`` rows differ from row 0 by less than a bf16 step of their
    (large) logits, so the bf16 GEMM ties them while fp32 orders them."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).bfloat16()
    # Every hidden row gets a large logit for rows 0..twins-1 (around 25, where a bf16 step
    # is 0.125); twin i differs in one coordinate by a few hundredths of a logit.
    lead = (h.float() / h.float().norm(dim=1, keepdim=True)).mean(0)
    base = (lead / lead.norm() * 25 / h.float().norm(dim=1).mean()).bfloat16()
    for i in range(twins):
        w[i] = base
        w[i, i % hidden] = (base[i % hidden].float() + 0.004 * (i + 1)).bfloat16()
    return h, w


def _exact(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return h.double() @ w.double().t()


def test_tied_maxima_are_recomputed_and_greedy_follows_fp32():
    h, w = _near_twins()
    low = F.linear(h, w)
    lowf = low.float()
    exact = _exact(h, w)
    top = lowf.max(dim=1, keepdim=True).values
    tied = lowf == top
    assert (tied.sum(1) >= 2).any(), "the precondition failed: bf16 made no ties"
    assert (lowf.argmax(1) != exact.argmax(1)).any(), "bf16's argmax was right by luck"
    out = refine_top_logits(low, h, w)
    assert out.dtype == torch.float32
    assert torch.equal(out[~tied], lowf[~tied])  # everything else is the GEMM's own value
    assert torch.allclose(out[tied].double(), exact[tied], rtol=0, atol=1e-4)
    assert torch.equal(out.argmax(1), exact.argmax(1))


def test_bias_is_added_to_recomputed_entries():
    h, w = _near_twins()
    bias = torch.zeros(w.shape[0]).bfloat16()
    bias[1] = 0.5
    out = refine_top_logits(F.linear(h, w, bias), h, w, bias)
    assert torch.equal(out.argmax(1), (_exact(h, w) + bias.double()).argmax(1))


def test_fp32_logits_pass_through_untouched():
    logits = torch.randn(3, 10)
    assert RefineTopLogits()(logits, torch.randn(3, 4), None) is logits


def test_rows_do_not_depend_on_the_batch():
    h, w = _near_twins(rows=64, hidden=576, vocab=4096)
    low = F.linear(h, w)
    whole = refine_top_logits(low, h, w)
    for r, n in ((0, 1), (5, 1), (3, 2), (8, 5), (1, 17), (40, 24)):
        part = refine_top_logits(low[r:r + n], h[r:r + n], w)
        assert torch.equal(part, whole[r:r + n]), (r, n)


@pytest.fixture(scope="module")
def kernels():
    from cadence.backends.cpu.kernels import load_kernels

    ops = load_kernels()
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here (no C++ compiler)")
    return ops


def test_kernel_matches_the_torch_path(kernels):
    h, w = _near_twins(rows=7, vocab=1000)  # a vocabulary that is not a multiple of 16
    bias = (torch.randn(1000, generator=torch.Generator().manual_seed(5)) * 0.01).bfloat16()
    low = F.linear(h, w, bias)
    ours = kernels.refine_top_logits(low, h, w, bias)
    ref = refine_top_logits(low, h, w, bias)
    lowf = low.float()
    tied = lowf == lowf.max(dim=1, keepdim=True).values
    assert torch.equal(ours[~tied], ref[~tied])
    assert torch.allclose(ours[tied], ref[tied], rtol=0, atol=1e-5)
    assert torch.equal(ours.argmax(1), _exact(h, w).add(bias.double()).argmax(1))


def test_kernel_refines_more_ties_than_the_torch_top_k(kernels):
    twins = TOP_K + 4
    h, w = _near_twins(twins=twins, hidden=64)
    low = F.linear(h, w)
    lowf = low.float()
    tied = lowf == lowf.max(dim=1, keepdim=True).values
    assert (tied.sum(1) > TOP_K).any(), "the precondition failed: too few ties"
    ours = kernels.refine_top_logits(low, h, w, None)
    assert torch.allclose(ours[tied].double(), _exact(h, w)[tied], rtol=0, atol=1e-4)
    assert torch.equal(ours.argmax(1), _exact(h, w).argmax(1))


def test_kernel_refuses_other_dtypes(kernels):
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        kernels.refine_top_logits(x, torch.randn(2, 4), torch.randn(8, 4), None)
