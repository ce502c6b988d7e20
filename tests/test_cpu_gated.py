"""The gated MLP's gate/up GEMM with SiLU-and-mul in its epilogue (backends/cpu/gated.py,
csrc/tiled_linear.cpp ``tiled_linear_gated``): the bits of the unfused pair, row by row
independent of the batch, and the model surgery that installs it."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy_with_logprobs
from test_engine_parity import NUM_TOKENS, _prompts, hf_greedy

from cadence.backends.cpu import gated
from cadence.backends.cpu import linear as cpu_linear
from cadence.backends.cpu.fused import KernelSiluAndMul, install_fused_ops
from cadence.layers.activation import SiluAndMul
from cadence.layers.linear import Linear


def _gate_up(k: int, h: int, bias: bool, seed: int) -> Linear:
    lin = Linear(k, 2 * h, bias=bias)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(2 * h, k, generator=g) * k ** -0.5)
        if bias:
            lin.bias.copy_(torch.randn(2 * h, generator=g))
    return lin


def _load_tiny(model_dir: str):
    from cadence.config import ModelConfig
    from cadence.model_loader import load_model

    model, _ = load_model(ModelConfig(model_dir, "float32", 256))
    return model


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k,h", [(576, 1536), (37, 64), (2000, 48), (64, 16)])
def test_gated_kernel_gives_the_bits_of_tiled_then_silu_and_mul(ops, k, h, bias) -> None:
    # 2000: two K blocks (partial sums stored and reloaded); 37: K not a vector multiple.
    lin = _gate_up(k, h, bias, seed=k + h)
    plain = ops.tiled_pack(lin.weight.detach())
    fused = ops.tiled_pack_gated(lin.weight.detach())
    b = None if lin.bias is None else lin.bias.detach()
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(1))
    reference = ops.silu_and_mul(ops.tiled_linear(x, plain, 2 * h, b))
    full = ops.tiled_linear_gated(x, fused, h, b)
    assert full.shape == (300, h) and torch.equal(full, reference)
    # Every tail of the register tile (6 rows on AVX2, 12 on AVX-512), a second chunk.
    for m in (1, 2, 3, 5, 6, 7, 9, 10, 11, 12, 13, 23, 64, 129):
        assert torch.equal(ops.tiled_linear_gated(x[:m], fused, h, b), full[:m]), m
        assert torch.equal(ops.tiled_linear_gated(x[-m:], fused, h, b), full[-m:]), m
    wide = torch.cat([x, torch.randn(300, 3)], dim=1)[:, :k]  # rows k + 3 floats apart
    assert torch.equal(ops.tiled_linear_gated(wide, fused, h, b), full)
    assert ops.tiled_linear_gated(x[:0], fused, h, b).shape == (0, h)
    # And the maths: silu(gate) * up of the plain weight, within fp32 rounding.
    w = lin.weight.detach().double()
    y = x.double() @ w.T + (0 if b is None else b.double())
    expected = torch.nn.functional.silu(y[:, :h]) * y[:, h:]
    torch.testing.assert_close(full.double(), expected, atol=1e-4, rtol=1e-4)


def test_gated_kernel_is_independent_of_the_thread_count(ops) -> None:
    lin = _gate_up(1600, 96, True, seed=3)
    packed = ops.tiled_pack_gated(lin.weight.detach())
    x = torch.randn(200, 1600, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    out = {}
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            out[t] = ops.tiled_linear_gated(x, packed, 96, lin.bias.detach())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[1], out[3])


def test_gated_kernel_refuses_what_its_layout_cannot_hold(ops) -> None:
    vector = ops.tiled_panel_width() // 2
    with pytest.raises(RuntimeError, match=f"multiple of {vector}"):
        ops.tiled_pack_gated(torch.randn(2 * (vector + 1), 8))
    with pytest.raises(RuntimeError, match="gate rows, then up rows"):
        ops.tiled_pack_gated(torch.randn(2 * vector + 1, 8))
    packed = ops.tiled_pack_gated(torch.randn(4 * vector, 8))
    with pytest.raises(RuntimeError, match="h does not match"):
        ops.tiled_linear_gated(torch.randn(3, 8), packed, vector)
    with pytest.raises(RuntimeError, match=rf"bias must have 2 \* h elements \({4 * vector}\)"):
        ops.tiled_linear_gated(torch.randn(3, 8), packed, 2 * vector, torch.zeros(2 * vector))
    with pytest.raises(RuntimeError, match="K = x.size"):
        ops.tiled_linear_gated(torch.randn(3, 9), packed, 2 * vector)


def test_gated_module_is_tiled_linear_then_silu_and_mul(ops) -> None:
    lin = _gate_up(576, 128, True, seed=7)
    unfused = cpu_linear.TiledLinear(lin)
    act = KernelSiluAndMul(ops)
    module = gated.TiledGatedLinear(lin)
    assert (module.in_features, module.out_features) == (576, 128)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        full = module(x)
        assert torch.equal(full, act(unfused(x)))
        for m in range(1, 70):  # the module pads rows to a multiple of four
            assert torch.equal(module(x[:m]), full[:m]), m


def test_fuse_gated_mlps_swaps_every_declared_mlp_and_keeps_the_bits(ops,
                                                                     tiny_model_dir) -> None:
    reference = _load_tiny(tiny_model_dir("llama"))
    cpu_linear.pack_linears(reference, kind="tiled")
    install_fused_ops(reference, ops)
    model = _load_tiny(tiny_model_dir("llama"))
    layers = model.config.num_hidden_layers
    assert gated.fuse_gated_mlps(model) == layers
    assert cpu_linear.pack_linears(model, kind="tiled") == 3 * layers + 1  # qkv, o, down, head
    install_fused_ops(model, ops)
    for layer in model.model.layers:
        assert isinstance(layer.mlp.gate_up_proj, gated.TiledGatedLinear)
        assert isinstance(layer.mlp.act_fn, torch.nn.Identity)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer_ref, layer in zip(reference.model.layers, model.model.layers, strict=True):
            h = torch.randn(37, model.config.hidden_size, generator=g)
            assert torch.equal(layer.mlp(h), layer_ref.mlp(h))


def test_fuse_gated_mlps_leaves_what_it_cannot_fuse(ops, tiny_model_dir, monkeypatch) -> None:
    model = _load_tiny(tiny_model_dir("llama"))
    mlp = model.model.layers[0].mlp
    # Another activation than SiLU: the unfused path.
    mlp.act_fn = torch.nn.GELU()
    assert gated.fuse_gated_mlps(model) == model.config.num_hidden_layers - 1
    assert isinstance(mlp.gate_up_proj, Linear) and isinstance(mlp.act_fn, torch.nn.GELU)
    # A module that does not declare itself fusable is never touched, whatever its names.
    plain = torch.nn.Module()
    plain.gate_up_proj, plain.act_fn = _gate_up(8, 16, False, seed=0), SiluAndMul()
    assert gated.fuse_gated_mlps(plain) == 0
    # Halves that are not whole vectors, and bf16 weights, stay unfused.
    vector = ops.tiled_panel_width() // 2
    assert not gated.gated_width_ok(_gate_up(8, vector + 1, False, seed=0), vector)
    assert not gated.gated_width_ok(_gate_up(8, vector, False, seed=0).to(torch.bfloat16), vector)
    assert gated.gated_width_ok(_gate_up(8, vector, False, seed=0), vector)
    # Without the compiled kernels nothing is fused.
    monkeypatch.setattr(cpu_linear, "tiled_ops", lambda: None)
    assert gated.fuse_gated_mlps(_load_tiny(tiny_model_dir("llama"))) == 0


def _run(model: str, options: dict, prompts: list[list[int]]):
    """(tokens, logprobs, runtime info, fused modules) of a greedy run with logprobs."""
    def fused(llm):
        return [m for m in llm.engine.backend.runner.model.modules()
                if isinstance(m, gated.TiledGatedLinear)]
    return greedy_with_logprobs(model, prompts, NUM_TOKENS, fused,
                                backend_options={"kv_cache_gb": 0.02, **options})


def test_engine_on_the_tiled_gemm_fuses_and_keeps_its_bits(ops, tiny_model_dir,
                                                           monkeypatch) -> None:
    model = tiny_model_dir("qwen2")  # biases on q/k/v; the MLP is Llama's
    prompts = _prompts()
    expected = hf_greedy(model, prompts, NUM_TOKENS)
    tiled = {"linear": "tiled", "attention": "kernel"}
    runs = {overlap: _run(model, {"overlap": overlap, **tiled}, prompts)
            for overlap in ("sync", "thread")}
    for tokens, lps, info, fused in runs.values():
        assert len(fused) == 2 and info["cpu_fused_mlps"] == "2"
        assert tokens == expected
    assert runs["sync"][:2] == runs["thread"][:2]  # async == sync, logprobs bit for bit
    # The unfused pair (tiled GEMM, then the silu_and_mul kernel) gives the same bits.
    monkeypatch.setattr(gated, "fuse_gated_mlps", lambda model, kind="tiled": 0)
    tokens, lps, info, fused = _run(model, {"overlap": "sync", **tiled}, prompts)
    assert not fused and info["cpu_fused_mlps"] == "0"
    assert (tokens, lps) == runs["sync"][:2]


def test_torch_attention_path_keeps_torch_activation(ops, tiny_model_dir) -> None:
    # The torch attention path is the reference: no compiled activation beside it.
    _, _, info, fused = _run(tiny_model_dir("llama"),
                             {"overlap": "sync", "linear": "tiled", "attention": "torch"},
                             _prompts()[:2])
    assert info["cpu_attention"] == "torch" and info["cpu_linear"] == "tiled"
    assert not fused and info["cpu_fused_mlps"] == "0"
