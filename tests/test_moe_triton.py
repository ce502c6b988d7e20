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
import subprocess
import sys

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


# Each rank's expert map: global expert -> its row in the rank's stack, -1 for the other's.
EXPERT_MAPS = {"linear": [[0, 1, 2, -1, -1, -1], [-1, -1, -1, 0, 1, 2]],
               "round_robin": [[0, -1, 1, -1, 2, -1], [-1, 0, -1, 1, -1, 2]]}


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("num_tokens", [1, 33])
@pytest.mark.parametrize("style", ["mixtral", "qwen"])
def test_fused_moe_under_expert_parallel_runs_only_the_ranks_experts(style, num_tokens,
                                                                     placement) -> None:
    """Two ranks (6 experts, 3 each): a rank's fused layer stacks its own experts only,
    equals the core layer of the same rank (other ranks' pairs add nothing), and the two
    ranks' outputs add up to one process's; one token (decode-sized blocks; Mixtral's picks
    experts 3 and 5, so rank 0 skips every block) and 33, with each rank's experts
    contiguous or interleaved."""
    from ep_helpers import as_rank, rank_share

    full = _moe(style, 2)
    x = _inputs(num_tokens)
    parts = []
    for rank in (0, 1):
        with as_rank(rank, 2, placement):
            part = rank_share(full, HIDDEN, INTER, SHARED if style == "qwen" else None)
            fused = FusedSparseMoE(part, moe_kernels)
            assert fused.w13.shape == (3, 2 * INTER, HIDDEN)
            assert fused.expert_map.tolist() == EXPERT_MAPS[placement][rank]
            with torch.no_grad():
                got = fused(x)
                torch.testing.assert_close(got, part(x), atol=1e-5, rtol=1e-5)
            parts.append(got)
    with torch.no_grad():
        torch.testing.assert_close(parts[0] + parts[1], full(x), atol=1e-5, rtol=1e-5)


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
    assert fused.shared_expert is not None and fused.expert_map is None


# The interpreter runs code that the compiler rejects, so the kernels are also compiled for
# sm_90 (H100/H200) ahead of time, as tests/test_cuda_kernels.py does for the attention
# kernels (no GPU needed). bf16 with 16-row blocks only, the serving case (about 8 s); fp16,
# fp32 (IEEE dots) and 64-row blocks compile too (docs/models.md).
_SM90_SCRIPT = """
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cadence.backends.cuda import moe_kernels as mk

def compile_sm90(kernel, types, constexprs):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: types.get(n, "i32") for n in names} | {n: "constexpr" for n in constexprs}
    try:
        src = ASTSource(fn=kernel, signature=sig,
                        constexprs={(names.index(n),): v for n, v in constexprs.items()})
    except TypeError as e:
        print("ASTSource API differs:", e)
        sys.exit(3)
    triton.compile(src, target=GPUTarget("cuda", 90, 32))

idx = {"sorted_ptr": "*i64", "block_expert_ptr": "*i32"}
compile_sm90(mk._gate_up_kernel, idx | {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16"},
             dict(TOP_K=2, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, IEEE=False))
compile_sm90(mk._down_kernel, idx | {"h_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                                     "weight_ptr": "*fp32"},
             dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, IEEE=False))
print("compiled")
"""


def test_moe_kernels_compile_for_sm90(tmp_path) -> None:
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cache hit
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True,
                          text=True, timeout=600, env=env, check=False)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU (tests/test_families_cuda.py runs this on the CPU)")
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_families_on_a_gpu_equal_transformers(name, tokenizer_dir, tmp_path) -> None:
    from family_factory import build_family_model
    from transformers import AutoModelForCausalLM

    from cadence import LLM, SamplingParams

    prompts = [[(7 * i + 3) % 600 + 2 for i in range(12)], [(5 * i + 11) % 600 + 2
                                                           for i in range(5)]]
    model = build_family_model(name, tmp_path / "m", tokenizer_dir)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    want = [hf.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6,
                        do_sample=False)[0, len(p):].tolist() for p in prompts]
    llm = LLM(model=model, backend="cuda", dtype="float32", max_model_len=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        llm.shutdown()
