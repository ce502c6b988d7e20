"""Compressed linears on the HPU backend (backends/hpu/quant.py), in its emulation
(CADENCE_HPU_EMULATE=1): the int8 values reach the card, the dense weights never do, and
the outputs are those of the dequantized weights, bit for bit in the emulation's fp32.
(The conformance kit checks int8 and an AWQ checkpoint against the CPU backend too.)"""

from __future__ import annotations

import pytest
from engine_helpers import assert_same_as, generate, refuse_dense_weights_on_the_device

from cadence import LLM, SamplingParams
from cadence.testing.packed_checkpoint import write_packed

PROMPTS = ["the quick brown fox", "hello there", "one two three four five six"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)


def _hpu(model: str, monkeypatch, **kw) -> LLM:
    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")
    return LLM(model=model, backend="hpu", dtype="float32", max_model_len=64, **kw)


def _outputs(llm: LLM) -> list:
    outs = generate(llm, PROMPTS, GREEDY)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()}
                                      for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_packed_checkpoint_gives_its_dequantized_weights_outputs(method, tiny_model_dir,
                                                                   tmp_path, monkeypatch):
    from cadence.backends.hpu import backend as hpu_backend

    packed, plain = write_packed(tiny_model_dir("llama"), tmp_path, method)
    refuse_dense_weights_on_the_device(monkeypatch)
    results = []
    for model in (packed, plain):
        llm = _hpu(model, monkeypatch)
        try:
            results.append(_outputs(llm))
            info = llm.engine.backend.env_info()
            # qkv, o, gate/up and down in each of the two layers; the head stays dense.
            assert info.get("hpu_quantized_linears") == ("8" if model == packed else None)
            assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
        finally:
            llm.shutdown()
    assert results[0] == results[1]
    assert hpu_backend.HpuBackend.supports_quantization == (
        "gguf", "int8", "awq", "gptq", "compressed-tensors")


def test_int8_weights_give_the_cpu_backends_outputs(tiny_model_dir, monkeypatch):
    model = tiny_model_dir("llama")
    cpu = LLM(model=model, backend="cpu", dtype="float32", max_model_len=64,
              quantization="int8", backend_options={"overlap": "sync"})
    try:
        want = generate(cpu, PROMPTS, GREEDY)
    finally:
        cpu.shutdown()
    llm = _hpu(model, monkeypatch, quantization="int8")
    try:
        got = generate(llm, PROMPTS, GREEDY)
        assert llm.engine.backend.env_info()["hpu_quantized_linears"] == "9"  # and the head
    finally:
        llm.shutdown()
    assert_same_as(want, got)


@pytest.mark.parametrize("offset", [False, True])
def test_the_weight_expands_a_block_of_rows_at_a_time_to_the_same_values(monkeypatch, offset):
    """In bf16 the fp32 temporary is one block of rows, not the weight: the same values
    as expanding it whole and rounding once (the blocks split unevenly here)."""
    import types

    import torch

    from cadence.backends.hpu import quant
    from cadence.quantization.weights import QuantizedWeight

    g = torch.Generator().manual_seed(0)
    n, k, group = 37, 64, 16
    w = QuantizedWeight(torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g),
                        torch.rand(n, k // group, generator=g),
                        torch.rand(n, k // group, generator=g) if offset else None)
    lin = types.SimpleNamespace(quantized=w, in_features=k, out_features=n, bias=None)
    layer = quant.DequantLinear(lin, torch.device("cpu"))
    whole = w.dequantize()
    assert torch.equal(layer.dense(torch.float32), whole)
    monkeypatch.setattr(quant, "_BLOCK_ELEMS", 5 * k)  # 8 blocks, the last of 2 rows
    assert torch.equal(layer.dense(torch.bfloat16), whole.to(torch.bfloat16))
