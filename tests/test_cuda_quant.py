"""Compressed linears on the CUDA backend (backends/cuda/quant.py, quant_kernels.py): the
packing, the Triton GEMM against the dequantized weight, and whole engines on AWQ, GPTQ,
int8 and GGUF weights against the CPU backend's outputs on the same weights.

Without a GPU the kernels run in Triton's interpreter on CPU tensors and the backend in
its ``device: cpu`` mode (as in tests/test_families_cuda.py). The interpreter's bf16
arithmetic is broken, so bf16 runs only on a GPU (tests/test_cuda_gpu.py); fp16 takes the
same path through the kernel (the tile rounded to the activations' dtype, fp32
accumulation) and fp32 the full-precision one.
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

from engine_helpers import assert_same_as, generate, refuse_dense_weights_on_the_device
from test_quantization import quant_gguf  # noqa: F401

from cadence import LLM, SamplingParams
from cadence.backend import ProbeResult
from cadence.quantization.weights import QuantizedWeight

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ["the quick brown fox", "hello there", "one two three four five six"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)


def _weight(lo: int, hi: int, n: int, k: int, group: int, offset: bool, seed: int = 0
            ) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(lo, hi + 1, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.05 + 0.01
    return QuantizedWeight(q, scale, -scale * 8 if offset else None)


@pytest.mark.parametrize(("lo", "hi", "group", "bits"), [
    (0, 15, 32, 4),      # AWQ / GPTQ at 4 bits
    (-8, 7, 128, 4),     # Q4 blocks
    (3, 18, 64, 4),      # any 16 consecutive values
    (0, 16, 64, 8),      # 17 values: one nibble is too few
    (-127, 127, 32, 8),  # int8, Q8_0
    (0, 15, 16, 8),      # Q6_K's 16-input groups: a nibble run spans two groups
])
def test_pack_keeps_the_values_in_the_fewest_bits(lo, hi, group, bits) -> None:
    from cadence.backends.cuda.quant_kernels import pack, unpack, unpack_rows

    w = _weight(lo, hi, 24, 256, group, offset=True)
    packed = pack(w.q, w.scale, w.offset)
    assert packed.bits == bits and packed.group == group
    assert packed.data.numel() == w.q.numel() * bits // 8
    assert torch.equal(unpack(packed), w.q)
    rows = torch.tensor([5, 0, 23, 5])
    assert torch.equal(unpack_rows(packed, rows), w.q[rows])


@pytest.mark.parametrize(("lo", "hi", "group", "offset"), [
    (0, 15, 32, True), (0, 15, 128, False), (-8, 7, 64, True), (-127, 127, 32, False),
    (-127, 127, 16, True), (-127, 127, 256, True)])
@pytest.mark.parametrize("rows", [1, 17, 70])
def test_the_kernel_computes_the_dequantized_weights_gemm(lo, hi, group, offset, rows) -> None:
    """fp32 in full precision (to fp32 rounding of the sums' order); a bias added; rows
    past a block's end and columns past the last block masked (N = 100)."""
    from cadence.backends.cuda.quant_kernels import pack, quant_linear

    w = _weight(lo, hi, 100, 256, group, offset)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 256, generator=g)
    bias = torch.randn(100, generator=g)
    want = x @ w.dequantize().T + bias
    got = quant_linear(x.to(DEV), pack(w.q, w.scale, w.offset).to(DEV), bias.to(DEV)).cpu()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("lo", "hi"), [(0, 15), (-127, 127)])
def test_fp16_activations_multiply_the_weights_rounded_to_fp16(lo, hi) -> None:
    from cadence.backends.cuda.quant_kernels import pack, quant_linear

    w = _weight(lo, hi, 64, 128, 32, offset=True)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).half()
    want = x.float() @ w.dequantize().half().float().T
    got = quant_linear(x.to(DEV), pack(w.q, w.scale, w.offset).to(DEV))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.cpu().float(), want, rtol=2e-3, atol=2e-3)


def test_a_compressed_heads_rows_are_read_for_the_tie_refinement() -> None:
    """A 16-bit head's logits tied at a row's maximum are recomputed in fp32 from the
    head's rows (core/layers/logits.py): a compressed head gives them dequantized."""
    from cadence.backends.cuda.quant import QuantLinear
    from cadence.layers.linear import Linear
    from cadence.layers.logits import refine_top_logits

    w = _weight(0, 15, 40, 64, 32, offset=True)
    head = Linear(64, 40, bias=False)
    head.quantized = w
    layer = QuantLinear(head, torch.device(DEV))
    idx = torch.tensor([3, 39, 0, 3])
    rows = layer.weight.index_select(0, idx.to(DEV)).cpu()
    assert torch.equal(rows, w.dequantize()[idx])
    hidden = torch.randn(2, 64)
    logits = torch.zeros(2, 40, dtype=torch.float16)  # every entry tied at the maximum
    refined = refine_top_logits(logits.to(DEV), hidden.to(DEV), layer.weight).cpu()
    exact = hidden @ w.dequantize().T
    top = logits.float().topk(8).indices  # the entries the refinement recomputes
    torch.testing.assert_close(refined.gather(1, top), exact.gather(1, top))
    assert refined.count_nonzero() == top.numel()


def _cuda_llm(model: str, monkeypatch, **kw) -> LLM:
    from cadence.backends.cuda.backend import CudaBackend

    if not torch.cuda.is_available():
        monkeypatch.setattr(CudaBackend, "probe",
                            classmethod(lambda cls: ProbeResult(True, "")))
    kw.setdefault("dtype", "float32")
    return LLM(model=model, backend="cuda", max_model_len=64, num_kv_blocks=32,
               backend_options={"device": DEV, "cuda_graph_max_bs": 4}, **kw)


def _cpu_outputs(model: str, **kw) -> list:
    llm = LLM(model=model, backend="cpu", dtype="float32", max_model_len=64,
              num_kv_blocks=32, backend_options={"overlap": "sync"}, **kw)
    try:
        return generate(llm, PROMPTS, GREEDY)
    finally:
        llm.shutdown()


def _dense_linears(llm: LLM) -> set[str]:
    from cadence.layers.linear import Linear

    return {name for name, m in llm.engine.backend.runner.model.named_modules()
            if isinstance(m, Linear) and m.weight.numel()}


# The linears that stay dense: an untied head that AWQ and GPTQ leave unquantized, a tied
# one (the embedding table), and the GGUF file's projection stored in fp32.
DENSE = {"awq": {"lm_head"}, "gptq8-tied": {"lm_head"}, "int8": set(),
         "gguf": {"model.layers.1.self_attn.qkv_proj"}}


@pytest.mark.parametrize(("case", "bits"), [("awq", "8 at 4 bits"),
                                            ("gptq8-tied", "8 at 8 bits"),
                                            ("int8", "9 at 8 bits"),
                                            ("gguf", None)])
def test_quantized_weights_give_the_cpu_backends_outputs(case, bits, tiny_model_dir,
                                                         quant_gguf, tmp_path,  # noqa: F811
                                                         monkeypatch) -> None:
    """Tokens and logprobs (within 1e-4) of the CPU backend, which runs the same weights
    exactly; every block free at the end; the linears that run compressed hold no dense
    weight on the device."""
    from cadence.testing.packed_checkpoint import write_packed

    kw = {}
    if case == "awq":
        model, _ = write_packed(tiny_model_dir("llama"), tmp_path, "awq")
    elif case == "gptq8-tied":
        model, _ = write_packed(tiny_model_dir("llama-tied"), tmp_path, "gptq", 8,
                                fmt="gptq_v2")
    elif case == "int8":
        model, kw = tiny_model_dir("llama"), {"quantization": "int8"}
    else:
        model, kw = str(quant_gguf), {"quantization": "gguf"}
    want = _cpu_outputs(model, **kw)
    refuse_dense_weights_on_the_device(monkeypatch)
    llm = _cuda_llm(model, monkeypatch, **kw)
    try:
        got = generate(llm, PROMPTS, GREEDY)
        info = llm.engine.backend.env_info()
        if bits is not None:
            assert info["cuda_quantized_linears"] == bits, info
        else:  # the GGUF file's mix: Q4_1 and Q5_1 blocks, one linear left in fp32
            assert "4 bits" in info["cuda_quantized_linears"], info
        assert _dense_linears(llm) == DENSE[case]
        assert_same_as(want, got)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


def test_lora_adapters_on_an_awq_base_give_the_cpu_backends_outputs(tiny_model_dir, tmp_path,
                                                                     monkeypatch) -> None:
    """The adapters wrap the projections before they turn compressed; the wrapper keeps
    working around the Triton GEMM (base model and two adapters in one batch)."""
    from test_lora import make_adapters

    from cadence.testing.packed_checkpoint import write_packed

    model, plain = write_packed(tiny_model_dir("llama"), tmp_path, "awq")
    adapters = make_adapters(plain, tmp_path / "adapters")
    prompts = PROMPTS[:2] * 3
    loras = [None, None, *[a for a in adapters for _ in range(2)]]
    lora = {"enable_lora": True, "max_loras": 2}
    outs = []
    for make in (lambda: LLM(model=model, backend="cpu", dtype="float32", max_model_len=64,
                             num_kv_blocks=32, backend_options={"overlap": "sync"}, **lora),
                 lambda: _cuda_llm(model, monkeypatch, **lora)):
        llm = make()
        try:
            outs.append(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
        finally:
            llm.shutdown()
    want, got = outs
    assert_same_as(want, got)
    assert want[2].outputs[0].token_ids != want[0].outputs[0].token_ids, "no adapter effect"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs GPUs per rank, not this mode")
def test_awq_over_two_tensor_parallel_ranks(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """Each rank runs its share of the packed weights (o and down by inputs, summed over
    the ranks by the compressed layer itself): one process's tokens and logprobs."""
    from cadence.testing.packed_checkpoint import write_packed

    model, _ = write_packed(tiny_model_dir("llama"), tmp_path, "awq")
    results = []
    for tp in (1, 2):
        llm = _cuda_llm(model, monkeypatch, tensor_parallel_size=tp)
        try:
            results.append(generate(llm, PROMPTS, GREEDY))
            if tp == 2:
                assert llm.engine.backend.env_info()["cuda_quantized_linears"] == \
                    "8 at 4 bits"
            assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
        finally:
            llm.shutdown()
    assert_same_as(*results)


def test_int8_mixture_of_experts_runs_its_routed_experts_dense(tokenizer_dir, tmp_path,
                                                               monkeypatch) -> None:
    """The fused MoE kernels take dense experts: theirs are written from the int8 values
    (the CPU backend's outputs on the same weights); attention, the shared expert and the
    head run compressed."""
    from family_factory import build_family_model

    model = build_family_model("qwen2_moe", tmp_path, tokenizer_dir)
    want = _cpu_outputs(model, quantization="int8")
    llm = _cuda_llm(model, monkeypatch, quantization="int8")
    try:
        got = generate(llm, PROMPTS, GREEDY)
        from cadence.backends.cuda.moe import FusedSparseMoE

        moe = [m for m in llm.engine.backend.runner.model.modules()
               if isinstance(m, FusedSparseMoE)]
        assert moe and all(m.w13.numel() for m in moe)
        assert "8 bits" in llm.engine.backend.env_info()["cuda_quantized_linears"]
        assert_same_as(want, got)
    finally:
        llm.shutdown()


def test_a_family_that_converts_its_tensors_runs_compressed_in_fp16(tokenizer_dir, tmp_path,
                                                                    monkeypatch) -> None:
    """Qwen2-MoE loads the dequantized weights (its experts joined) and checks the packed
    ones against them: in the model's 16-bit dtype they are the values rounded, and still
    match; its attention and shared expert run compressed, with the tokens of the
    dequantized model."""
    from family_factory import build_family_model

    from cadence.testing.helpers import assert_same_tokens
    from cadence.testing.packed_checkpoint import write_packed

    source = build_family_model("qwen2_moe", tmp_path / "src", tokenizer_dir)
    # Groups of 16: the shared expert's 80 inputs are no whole groups of 32.
    packed, plain = write_packed(source, tmp_path, "awq", group=16)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)
    outs = []
    for model in (packed, plain):
        llm = _cuda_llm(model, monkeypatch, dtype="float16")
        try:
            outs.append(llm.generate(PROMPTS, params, use_tqdm=False))
            if model == packed:
                info = llm.engine.backend.env_info()
                assert info.get("cuda_quantized_linears", "").endswith("at 8 bits"), info
        finally:
            llm.shutdown()
    assert_same_tokens(outs[0], outs[1], 0.05, "fp16 AWQ vs its dequantized weights")
