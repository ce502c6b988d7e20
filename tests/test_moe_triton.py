"""The CUDA backend's fused mixture-of-experts kernels (backends/cuda/moe_kernels.py) against
the core's ``SparseMoE`` on the CPU, with interpreted Triton when there is no GPU.

Mixtral-style routing (top-k renormalized, fp32 weights) and Qwen-MoE-style (not
renormalized, weights in the model dtype, a sigmoid-gated shared expert), over token counts
1, 7 and 33 (one, a partial and several row blocks), top-1 and top-2, with experts that no
token chooses. The CUDA backend's whole forward for the MoE families, with these kernels
swapped in, is in tests/test_families_cuda.py (greedy tokens equal transformers').
"""

from __future__ import annotations

import os

import pytest
import torch  # does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from cadence.backends.cuda import moe_kernels
from cadence.backends.cuda.moe import FusedSparseMoE, install_fused_moe
from cadence.layers.moe import SparseMoE, route

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
HIDDEN, INTER, SHARED, EXPERTS = 16, 24, 20, 6
UNUSED = (1, 4)  # experts the router never picks (module docstring)


def _moe(style: str, top_k: int) -> SparseMoE:
    torch.manual_seed(top_k)
    qwen = style == "qwen"
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, top_k, renormalize=not qwen,
                    weights_in_model_dtype=qwen, shared_intermediate=SHARED if qwen else None)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
        # Feature 0 of every input is 1 (``_inputs``): these experts' logits sit near -50.
        moe.gate.weight[list(UNUSED), 0] = -50.0
    return moe.to(DEVICE)


def _inputs(num_tokens: int) -> torch.Tensor:
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    x[:, 0] = 1.0
    return x.to(DEVICE)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("style", ["mixtral", "qwen"])
def test_fused_moe_equals_the_torch_reference(style, num_tokens, top_k) -> None:
    moe = _moe(style, top_k)
    x = _inputs(num_tokens)
    with torch.no_grad():
        _, ids = route(moe.gate(x), top_k, moe.renormalize)
        assert not set(UNUSED) & set(ids.flatten().tolist())  # some experts get no token
        want = moe(x)
        got = FusedSparseMoE(moe, moe_kernels)(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_align_puts_each_pair_once_in_a_block_of_its_expert() -> None:
    ids = torch.tensor([[3, 0], [3, 5], [0, 3], [5, 2]])
    pairs, experts = moe_kernels.align_by_expert(ids, num_experts=6, block_m=4)
    flat = ids.flatten()
    n = flat.numel()
    # Bounded from the sizes alone: 8 pairs + 6 experts x 3 padding rows = 26 -> 7 blocks.
    assert experts.numel() == 7 and pairs.numel() == 28
    blocks = pairs.view(-1, 4)
    seen = []
    for b, e in enumerate(experts.tolist()):
        real = [p for p in blocks[b].tolist() if p < n]
        if e < 0:
            assert not real  # blocks past the last expert's hold only padding
        assert all(int(flat[p]) == e for p in real)
        seen += real
    assert sorted(seen) == list(range(n))
    assert experts.tolist() == [0, 2, 3, 5, -1, -1, -1]  # empty experts take no block


def test_no_token_gives_an_empty_output() -> None:
    moe = _moe("qwen", 2)
    x = _inputs(0)
    with torch.no_grad():
        out = FusedSparseMoE(moe, moe_kernels)(x)
    assert out.shape == (0, HIDDEN)


def test_install_swaps_every_sparse_moe_and_keeps_the_dense_layers() -> None:
    layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
    layers[0].mlp = _moe("mixtral", 2)
    layers[1].mlp = torch.nn.Linear(4, 4)
    layers[2].mlp = _moe("qwen", 2)
    model = torch.nn.Module()
    model.layers = layers
    assert install_fused_moe(model, moe_kernels) == 2
    assert [type(m.mlp) for m in layers] == [FusedSparseMoE, torch.nn.Linear, FusedSparseMoE]
    assert not any(isinstance(m, SparseMoE) for m in model.modules())
    fused = layers[2].mlp
    assert fused.w13.shape == (EXPERTS, 2 * INTER, HIDDEN)
    assert fused.w2.shape == (EXPERTS, HIDDEN, INTER)
    assert fused.shared_expert is not None
