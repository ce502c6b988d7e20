"""AWQ and GPTQ checkpoints run from their own packed weights.

What must hold: a checkpoint whose config.json names AWQ or GPTQ runs quantized without
being asked, and its outputs are those of its exactly dequantized fp32 weights (token ids,
texts and logprobs, greedy and seeded) bit for bit, whatever the bits and the zero-point
convention; act-order groups run their fp32 weights, still exact; tensor parallel cuts the
packed weights as it cuts the fp32 ones; anything else is refused, naming what is read.
"""

from __future__ import annotations

import json
import logging

import pytest
from engine_helpers import make_llm

from cadence import EngineArgs, SamplingParams
from cadence.testing.packed_checkpoint import write_packed

# The quantized kernel shares the fp32 tiled GEMM's bits (docs/quantization.md).
TILED = {"overlap": "sync", "linear": "tiled"}
PROMPTS = ["the cat runs over the", "café 中文 😀 and", "one two three four five"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, seed=11, ignore_eos=True, logprobs=2)


def _outputs(llm) -> list:
    got = []
    for params in (GREEDY, SEEDED):
        for o in llm.generate(PROMPTS, params, use_tqdm=False):
            got.append((o.outputs[0].token_ids, o.outputs[0].text,
                        [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]))
    return got


def _run(path: str, **kw) -> tuple[list, dict]:
    llm = make_llm(path, **kw)
    try:
        return _outputs(llm), llm.engine.backend.env_info()
    finally:
        llm.shutdown()


# (family, method, bits, format, extra write_packed arguments)
CASES = {
    "awq-llama": ("llama", "awq", 4, "gptq", {}),
    # The model's own biases beside the packed weights, and AutoGPTQ's all-zero ones beside
    # the linears that have none.
    "gptq4-qwen2": ("qwen2", "gptq", 4, "gptq", {"zero_biases": True}),
    "gptq8v2-llama-tied": ("llama-tied", "gptq", 8, "gptq_v2", {}),
    "gptq2-mistral": ("mistral", "gptq", 2, "gptq", {}),
    "gptq4sym-llama": ("llama", "gptq", 4, "gptq", {"sym": True, "zero_biases": True}),
    # llm-compressor's W4A16 (symmetric, by group) and W8A16 by channel, asymmetric
    "ct4-qwen3": ("qwen3", "compressed-tensors", 4, "", {"sym": True}),
    "ct8ch-llama": ("llama", "compressed-tensors", 8, "", {"group": -1}),
}


@pytest.mark.parametrize("case,overlap", [("awq-llama", "process"), ("gptq4-qwen2", "sync"),
                                          ("gptq8v2-llama-tied", "sync"),
                                          ("gptq2-mistral", "sync"),
                                          ("gptq4sym-llama", "sync"),
                                          ("ct4-qwen3", "process"), ("ct8ch-llama", "sync")])
def test_a_packed_checkpoint_gives_its_dequantized_weights_outputs(case, overlap,
                                                                   tiny_model_dir, tmp_path):
    kind, method, bits, fmt, extra = CASES[case]
    packed, plain = write_packed(tiny_model_dir(kind), tmp_path, method, bits, fmt=fmt,
                                 **extra)
    options = {**TILED, "overlap": overlap}
    want, _ = _run(plain, dtype="float32", backend_options=options)
    # No --quantization: the checkpoint's quantization_config says it.
    got, info = _run(packed, backend_options=options)
    # qkv, o, gate/up (fused) and down in each of the two layers; the head stays as it is.
    assert info["cpu_quantized_linears"] == "8", info
    assert info["dtype"] == "float32"
    assert got == want


@pytest.mark.parametrize("method", ["gptq", "compressed-tensors"])
def test_act_order_groups_run_their_exact_fp32_weights(method, tiny_model_dir, tmp_path,
                                                       caplog):
    packed, plain = write_packed(tiny_model_dir("llama"), tmp_path, method, 4, act_order=True)
    want, _ = _run(plain, dtype="float32", backend_options=TILED)
    with caplog.at_level(logging.WARNING):
        got, info = _run(packed, quantization=method, backend_options=TILED)
    assert info["cpu_quantized_linears"] == "0", info
    assert any("use act-order groups (desc_act)" in r.getMessage() for r in caplog.records)
    assert got == want


@pytest.mark.parametrize("group,quantized", [(32, "8"), (64, "6")])
def test_packed_weights_split_over_tensor_parallel_ranks(tiny_model_dir, tmp_path, group,
                                                         quantized):
    """Two ranks give the dequantized fp32 model's two-rank outputs bit for bit. With groups
    of 64, o (64 inputs, 32 a rank) would be cut inside a group: it runs its fp32 weights,
    written from the packed values (which are never in fp32 otherwise)."""
    packed, plain = write_packed(tiny_model_dir("llama"), tmp_path, "awq", group=group)
    kw = {"tensor_parallel_size": 2, "num_kv_blocks": 64, "backend_options": TILED}
    want, _ = _run(plain, dtype="float32", **kw)
    got, info = _run(packed, **kw)
    assert info["executor"] == "mp" and info["cpu_quantized_linears"] == quantized, info
    assert got == want


def test_the_reader_takes_a_linears_parts_in_any_order_and_across_files():
    """A sharded checkpoint may store a linear's parts apart; each is kept until the rest
    arrives, and GPTQ without ``g_idx`` has consecutive groups."""
    import numpy as np
    import torch

    from cadence.quantization.checkpoint import PackedSpec
    from cadence.quantization.packed import PackedReader
    from cadence.testing.packed_checkpoint import _pack

    rng = np.random.default_rng(5)
    q = rng.integers(0, 16, size=(16, 64))
    zero = rng.integers(0, 16, size=(16, 2))
    scale = rng.uniform(0.01, 0.1, size=(16, 2)).astype(np.float16)
    parts = {"qweight": np.ascontiguousarray(_pack(q, 4).T), "qzeros": _pack(zero.T, 4),
             "scales": np.ascontiguousarray(scale.T)}
    stream = [("l.qzeros", parts["qzeros"]), ("norm.weight", np.ones(4, np.float32)),
              ("l.scales", parts["scales"]), ("l.qweight", parts["qweight"])]
    reader = PackedReader(PackedSpec("gptq", 4, 32, zero_offset=0))
    out = dict(reader.read((n, torch.from_numpy(t)) for n, t in stream))
    want = (scale.astype(np.float64).repeat(32, 1) * (q - zero.repeat(32, 1))).astype(np.float32)
    assert list(out) == ["norm.weight", "l.weight"]
    # The model gets the weight's shape only (no memory); the values stay packed.
    assert out["l.weight"].shape == (16, 64) and out["l.weight"].stride() == (0, 0)
    assert reader.shape_only == {"l.weight"}
    assert torch.equal(reader.blocks["l.weight"].dequantize(), torch.from_numpy(want))


def _with_config(tiny_model_dir, tmp_path, quant: dict | None, name: str = "") -> str:
    import shutil

    folder = tmp_path / f"checkpoint{name}"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    if quant is not None:
        config["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "fp8"}, ("quantized with 'fp8' (quantization_config in its config.json), "
                               "which cadence does not read; it reads awq, gptq, "
                              "compressed-tensors checkpoints")),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"},
     "AWQ version 'gemv'; cadence reads AWQ's 'gemm' layout"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32},
     "GPTQ at 3 bits; cadence reads 2, 4 and 8 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
     "GPTQ in the 'marlin' format; cadence reads the 'gptq' and 'gptq_v2' formats"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "is_marlin_format": True},
     "GPTQ in the 'marlin' format"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}},
     "compressed-tensors in the 'float-quantized' format; cadence reads 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"},
                              "input_activations": {"num_bits": 8, "type": "int"}}}},
     "compressed-tensors that quantizes activations too; cadence reads weight-only"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                          "strategy": "block"}}}},
     "compressed-tensors by 'block'; cadence reads the 'group' and 'channel' strategies"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "kv_cache_scheme": {"num_bits": 8, "type": "float"},
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     "compressed-tensors that quantizes the KV cache (kv_cache_scheme)"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "sparsity_config": {"format": "sparse-24-bitmask"},
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     "compressed-tensors sparsity ('sparse-24-bitmask')"),
])
def test_methods_and_variants_not_read_are_refused(quant, message, tiny_model_dir, tmp_path):
    folder = _with_config(tiny_model_dir, tmp_path, quant)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(model=folder).create_engine_config()


def test_misuse_is_refused_with_the_way_out(tiny_model_dir, tmp_path):
    packed, _ = write_packed(tiny_model_dir("llama"), tmp_path, "awq")
    with pytest.raises(ValueError, match="is already quantized with awq .* leave "
                                         "--quantization unset or pass --quantization awq"):
        EngineArgs(model=packed, quantization="int8").create_engine_config()
    with pytest.raises(ValueError, match="--quantization gptq reads a checkpoint quantized "
                                         "with GPTQ, and the config.json of .* has no "
                                         "quantization_config naming it"):
        EngineArgs(model=tiny_model_dir("llama"), quantization="gptq").create_engine_config()
    assert EngineArgs(model=packed).create_engine_config().model_config.quantization == "awq"


def test_a_linear_missing_a_part_is_named(tiny_model_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    packed, _ = write_packed(tiny_model_dir("llama"), tmp_path, "awq")
    tensors = load_file(f"{packed}/model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, f"{packed}/model.safetensors")
    with pytest.raises(ValueError, match=r"awq checkpoint: model.layers.1.mlp.down_proj has "
                                         r"qweight, scales but no qzeros"):
        make_llm(packed)


def test_an_older_gptq_folders_quantize_config_is_read(tiny_model_dir, tmp_path):
    """Before transformers kept it in config.json, AutoGPTQ wrote quantize_config.json."""
    from pathlib import Path

    packed, _ = write_packed(tiny_model_dir("llama"), tmp_path, "gptq")
    config_path = Path(packed) / "config.json"
    config = json.loads(config_path.read_text())
    quant = config.pop("quantization_config")
    quant.pop("quant_method")
    config_path.write_text(json.dumps(config))
    (Path(packed) / "quantize_config.json").write_text(json.dumps(quant))
    assert EngineArgs(model=packed).create_engine_config().model_config.quantization == "gptq"


def test_a_backend_that_does_not_run_the_checkpoints_method_says_so(tiny_model_dir, tmp_path,
                                                                    monkeypatch):
    """Dropping --quantization is no way out for a checkpoint that is itself quantized."""
    from engine_helpers import register_backend_without_quantization

    from cadence.engine import LLMEngine

    name = register_backend_without_quantization(monkeypatch)
    packed, _ = write_packed(tiny_model_dir("llama"), tmp_path, "gptq")
    config = EngineArgs(model=packed, backend=name, dtype="float32").create_engine_config()
    with pytest.raises(ValueError, match=r"is quantized with gptq \(quantization_config in "
                                         r"its config.json\), which backend 'noquant' does "
                                         r"not run; backends that run it: cpu, cuda, hpu$"):
        LLMEngine(config)


def test_without_the_cpu_kernels_the_dequantized_weights_run(tiny_model_dir, tmp_path,
                                                             monkeypatch, caplog):
    """Where the kernels did not build, the checkpoint still runs, from its exact fp32
    weights (one warning), rather than being refused."""
    from cadence.backends.cpu import kernels

    packed, plain = write_packed(tiny_model_dir("llama"), tmp_path, "awq")
    monkeypatch.setenv("CADENCE_CPU_KERNELS", "0")
    monkeypatch.setattr(kernels, "_loaded", {})
    with caplog.at_level(logging.WARNING):
        got, info = _run(packed, backend_options={"overlap": "sync"})  # --cpu-linear auto
    assert info["cpu_quantized_linears"] == "0", info
    want, _ = _run(plain, dtype="float32",
                   backend_options={"overlap": "sync", "linear": info["cpu_linear"]})
    assert any("linears run their dequantized fp32 weights" in r.getMessage()
               for r in caplog.records)
    assert got == want


def test_a_symmetric_schemes_stored_zero_points_are_dropped_when_zero():
    """Some writers store a symmetric compressed-tensors scheme's zero points anyway; zero
    ones are dropped (wherever they stream past), others refused."""
    import numpy as np
    import torch

    from cadence.quantization.checkpoint import PackedSpec
    from cadence.quantization.packed import PackedReader
    from cadence.testing.packed_checkpoint import _pack

    rng = np.random.default_rng(7)
    q = rng.integers(0, 16, size=(16, 64))
    scale = rng.uniform(0.01, 0.1, size=(16, 2)).astype(np.float16)
    parts = {"weight_packed": _pack(q, 4), "weight_scale": scale,
             "weight_shape": np.array([16, 64], dtype=np.int32)}
    spec = PackedSpec("compressed-tensors", 4, 32)
    want = (scale.astype(np.float64).repeat(32, 1) * (q - 8)).astype(np.float32)
    for zero in (np.full((2, 2), 0x88888888, dtype=np.uint32).view(np.int32),
                 np.zeros((16, 2), dtype=np.int8)):
        stream = [*parts.items(), ("weight_zero_point", zero)]
        reader = PackedReader(spec)
        out = dict(reader.read((f"l.{n}", torch.from_numpy(t)) for n, t in stream))
        assert list(out) == ["l.weight"]
        assert torch.equal(reader.blocks["l.weight"].dequantize(), torch.from_numpy(want))
    bad = np.full((2, 2), 0x88888889, dtype=np.uint32).view(np.int32)
    with pytest.raises(ValueError, match="l.weight_zero_point holds zero points other than "
                                         "zero, but the scheme is symmetric"):
        dict(PackedReader(spec).read((f"l.{n}", torch.from_numpy(t))
                                     for n, t in [*parts.items(), ("weight_zero_point", bad)]))


def test_a_last_group_shorter_than_the_others_is_refused():
    import numpy as np
    import torch

    from cadence.quantization.checkpoint import PackedSpec
    from cadence.quantization.packed import PackedReader
    from cadence.testing.packed_checkpoint import _pack

    q = np.zeros((8, 96), dtype=np.int64)  # 96 inputs, group_size 64: groups of 64 and 32
    parts = {"weight_packed": _pack(q, 4), "weight_scale": np.ones((8, 2), np.float16),
             "weight_shape": np.array([8, 96], dtype=np.int32)}
    with pytest.raises(ValueError, match="96 inputs and 2 groups of scales, which are not "
                                         "whole groups of group_size 64"):
        dict(PackedReader(PackedSpec("compressed-tensors", 4, 64)).read(
            (f"l.{n}", torch.from_numpy(t)) for n, t in parts.items()))


def test_a_family_that_converts_its_tensors_gets_the_dequantized_weights(tmp_path,
                                                                          tokenizer_dir):
    """Qwen3-MoE's loader joins each expert's gate and up into one tensor a layer: such a
    family is handed the dequantized weights (not their shapes), its experts run those,
    and its other linears still run packed; the outputs are the dequantized model's."""
    from family_factory import build_family_model

    from cadence.models.base import CausalLM
    from cadence.models.moe import Qwen3MoeForCausalLM

    assert Qwen3MoeForCausalLM.convert_weight is not CausalLM.convert_weight
    packed, plain = write_packed(build_family_model("qwen3_moe", tmp_path / "m",
                                                    tokenizer_dir), tmp_path, "gptq")
    want, _ = _run(plain, dtype="float32", backend_options=TILED)
    got, info = _run(packed, backend_options=TILED)
    assert int(info["cpu_quantized_linears"]) > 0, info
    assert got == want


def test_a_tied_head_stays_the_embeddings_beside_a_stored_packed_head(tiny_model_dir,
                                                                      tmp_path):
    """A checkpoint of a tied model that also stores a packed head (as llm-compressor may):
    the head stays the embeddings, as the model ties them, and the stored one is not run."""
    import shutil

    from safetensors.numpy import load_file, save_file

    def packed_of(source, out):
        return write_packed(source, out, "compressed-tensors", 4, sym=True)

    packed, plain = packed_of(tiny_model_dir("llama-tied"), tmp_path)
    # The stored head: half the embeddings, packed as a linear named like a projection.
    donor = tmp_path / "donor"
    shutil.copytree(tiny_model_dir("llama-tied"), donor)
    tensors = load_file(str(donor / "model.safetensors"))
    tensors["lm_head.proj.weight"] = tensors["model.embed_tokens.weight"] * 0.5
    save_file(tensors, str(donor / "model.safetensors"))
    head_packed, _ = packed_of(str(donor), tmp_path / "h")
    extra = {k.replace("lm_head.proj.", "lm_head."): v
             for k, v in load_file(f"{head_packed}/model.safetensors").items()
             if k.startswith("lm_head.proj.")}
    assert "lm_head.weight_packed" in extra
    mine = load_file(f"{packed}/model.safetensors")
    save_file({**mine, **extra}, f"{packed}/model.safetensors")
    want, _ = _run(plain, dtype="float32", backend_options=TILED)
    got, _ = _run(packed, backend_options=TILED)
    assert got == want


def test_packed_weights_over_pipeline_stages(tiny_model_dir, tmp_path):
    """Each stage reads its own layers' packed tensors only, and the two stages give the
    dequantized model's two-stage outputs."""
    packed, plain = write_packed(tiny_model_dir("llama"), tmp_path, "gptq")
    kw = {"pipeline_parallel_size": 2, "num_kv_blocks": 64, "backend_options": TILED}
    want, _ = _run(plain, dtype="float32", **kw)
    got, info = _run(packed, **kw)
    assert int(info["cpu_quantized_linears"]) > 0, info
    assert got == want
