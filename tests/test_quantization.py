"""``--quantization gguf``: a GGUF file's linear weights run from their own blocks.

What must hold: every block format unpacks to exactly what gguf's dequantization gives; the
export keeps a tensor only where its blocks give the converted folder's fp32 weight, and
says why it kept another in fp32; and the engine on the blocks gives the outputs of the
engine on the fp32 folder, token ids and logprobs bit for bit, with async output processing
on and off. Misuse is refused with the reason and the way out.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import make_llm
from gguf_helpers import write_llama_gguf

from cadence import EngineArgs, SamplingParams
from cadence.quantization.gguf_blocks import FORMATS, unpack
from cadence.quantization.gguf_export import (
    BLOCKS_DIR,
    INDEX_FILE,
    SOURCE_FILE,
    ensure_blocks,
)

gguf = pytest.importorskip("gguf")

# Plain fp32 runs on the GEMM whose bits the quantized kernel shares (docs/quantization.md).
TILED = {"overlap": "sync", "linear": "tiled"}


def _random_blocks(fmt: str, rows: int, k: int, rng) -> np.ndarray:
    """Random bytes with finite fp16 scale fields where ``fmt`` keeps them."""
    per_block, nbytes, _, _ = FORMATS[fmt]
    n = rows * k // per_block
    raw = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)

    def f16(col: int, lo: float, hi: float) -> None:
        values = rng.uniform(lo, hi, n).astype(np.float16)
        raw[:, col:col + 2] = np.frombuffer(values.tobytes(), np.uint8).reshape(n, 2)

    if fmt == "Q6_K":
        f16(208, 1e-4, 0.05)
    elif fmt.endswith("_K"):
        f16(0, 1e-4, 0.05)
        f16(2, 1e-4, 0.05)
    else:
        f16(0, -0.05, 0.05)  # a negative scale is legal
        if fmt in ("Q4_1", "Q5_1"):
            f16(2, -0.2, 0.2)
    return raw


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_unpacks_to_ggufs_own_dequantization(fmt):
    rng = np.random.default_rng(len(fmt) * 7 + ord(fmt[1]))
    rows, k = 5, 512
    raw = _random_blocks(fmt, rows, k, rng)
    want = gguf.quants.dequantize(raw.reshape(rows, -1), getattr(gguf.GGMLQuantizationType, fmt))
    got = unpack(raw, fmt, (rows, k))
    assert got.q.dtype == np.int8 and got.scale.dtype == np.float32
    assert got.group == FORMATS[fmt][2]
    assert np.array_equal(got.dequantize().view(np.uint32),
                          want.reshape(rows, k).astype(np.float32).view(np.uint32))


def test_a_fused_modules_parts_share_the_finest_group():
    import torch

    from cadence.quantization.weights import QuantizedWeight, _stack

    g = torch.Generator().manual_seed(3)
    coarse = QuantizedWeight(torch.randint(0, 16, (3, 64), generator=g, dtype=torch.int8),
                             torch.rand(3, 2, generator=g), torch.rand(3, 2, generator=g))
    fine = QuantizedWeight(torch.randint(-32, 32, (2, 64), generator=g, dtype=torch.int8),
                           torch.rand(2, 4, generator=g), None)
    both = _stack([coarse, fine])
    assert both.group == 16 and both.shape == (5, 64)
    assert torch.equal(both.dequantize(), torch.cat([coarse.dequantize(), fine.dequantize()]))


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        unpack(np.zeros(144, np.uint8), "Q4_K", (1, 128))


def _formats(name: str) -> str | None:
    # A mix as llama.cpp's quantizer makes one, with a tensor kept in F32 (layer 1's v_proj):
    # layer 1's fused qkv then stays fp32, the rest of the model runs from blocks.
    if name == "model.layers.1.self_attn.v_proj.weight":
        return None
    for part, fmt in (("q_proj", "Q4_1"), ("k_proj", "Q4_0"), ("v_proj", "Q8_0"),
                      ("o_proj", "Q5_0"), ("gate_proj", "Q4_1"), ("up_proj", "Q4_1"),
                      ("down_proj", "Q5_1"), ("embed_tokens", "Q8_0"), ("lm_head", "Q8_0")):
        if part in name:
            return fmt
    return None


@pytest.fixture
def quant_gguf(tmp_path, monkeypatch, tiny_model_dir, request):
    from cadence import gguf_model

    monkeypatch.setattr(gguf_model, "cache_root", lambda: tmp_path / "cadence-cache")
    out = tmp_path / "ggufs" / "tiny-quant.gguf"
    out.parent.mkdir()
    write_llama_gguf(tiny_model_dir(getattr(request, "param", "llama")), out, _formats)
    return out


def test_export_keeps_what_matches_and_says_why_the_rest_stays_fp32(quant_gguf):
    from cadence.model_source import resolve_model_source

    folder = resolve_model_source(str(quant_gguf))
    source = json.loads((Path(folder) / SOURCE_FILE).read_text())
    assert source["file"] == str(quant_gguf.resolve())
    assert not (Path(folder) / BLOCKS_DIR).exists()  # only on demand
    where = ensure_blocks(folder)
    index = json.loads((where / INDEX_FILE).read_text())
    assert index["formats"]["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert index["formats"]["model.layers.0.mlp.down_proj.weight"] == "Q5_1"
    assert index["dense"] == {"model.layers.1.self_attn.v_proj.weight": "stored as F32"}
    assert ensure_blocks(folder) == where  # once


def test_blocks_are_exported_again_when_the_folders_weights_change(quant_gguf):
    """The blocks stand in for the folder's weights unread (the lean load): weights
    rewritten in place must not run as the blocks of the old ones."""
    from safetensors.torch import load_file, save_file

    from cadence.model_source import resolve_model_source

    folder = Path(resolve_model_source(str(quant_gguf)))
    where = ensure_blocks(str(folder))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert name in json.loads((where / INDEX_FILE).read_text())["formats"]
    assert ensure_blocks(str(folder)) == where  # unchanged: kept
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(str(file))
    tensors[name] = tensors[name] * 3
    save_file(tensors, str(file), metadata={"format": "pt"})
    index = json.loads((ensure_blocks(str(folder)) / INDEX_FILE).read_text())
    assert name not in index["formats"]
    assert index["dense"][name] == "its Q4_1 blocks do not give the converted weight"


def test_a_folder_converted_before_the_source_record_gets_one(quant_gguf):
    from cadence.model_source import resolve_model_source

    folder = Path(resolve_model_source(str(quant_gguf)))
    (folder / SOURCE_FILE).unlink()
    assert resolve_model_source(str(quant_gguf)) == str(folder)  # no second conversion
    assert ensure_blocks(str(folder)).is_dir()


def _outputs(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text,
             [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


# An untied head runs from its own blocks; a tied one from the embeddings' (the lookup itself
# stays fp32).
@pytest.mark.parametrize("quant_gguf,overlap", [("llama", "process"), ("llama-tied", "sync")],
                         indirect=["quant_gguf"])
def test_blocks_give_the_fp32_models_outputs_bit_for_bit(quant_gguf, overlap):
    prompts = ["the cat runs over the", "café 中文 😀 and", "one two three four five"]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, seed=11, ignore_eos=True,
                            logprobs=2)
    # The quantized kernel shares the fp32 tiled GEMM's bits; auto may time another GEMM
    # faster for plain fp32 weights on some CPUs.
    kw = {"dtype": "float32", "backend_options": {"overlap": overlap, "linear": "tiled"}}
    plain = make_llm(str(quant_gguf), **kw)
    want = [_outputs(plain, prompts, p) for p in (greedy, seeded)]
    plain.shutdown()
    quant = make_llm(str(quant_gguf), quantization="gguf", **kw)
    info = quant.engine.backend.env_info()
    # Every linear but layer 1's qkv: o, gate/up (fused) and down per layer, qkv of the
    # other layer, and the head.
    assert info["cpu_quantized_linears"] == str(2 * 3 + 1 + 1), info
    assert info["dtype"] == "float32"
    got = [_outputs(quant, prompts, p) for p in (greedy, seeded)]
    quant.shutdown()
    assert got == want


@pytest.mark.parametrize("extra", [
    {"async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1}},
    {"pipeline_parallel_size": 2}], ids=["async_scheduling", "speculative", "pp2"])
def test_blocks_run_with_the_other_step_strategies(quant_gguf, extra):
    # A repetitive prompt, so that n-gram drafts are proposed and some accepted.
    prompts = ["one two one two one two one two", "the cat runs over the"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = make_llm(str(quant_gguf), dtype="float32", backend_options=TILED)
    want = _outputs(plain, prompts, params)
    plain.shutdown()
    quant = make_llm(str(quant_gguf), quantization="gguf", **extra)
    got = _outputs(quant, prompts, params)
    quant.shutdown()
    assert got == want


def test_misuse_is_refused_with_the_way_out(quant_gguf, tiny_model_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(model=str(quant_gguf), quantization="nf4").create_engine_config()
    with pytest.raises(ValueError, match="was not converted from a GGUF file"):
        EngineArgs(model=tiny_model_dir("llama"), quantization="gguf").create_engine_config()
    with pytest.raises(ValueError, match="runs float32 activations"):
        EngineArgs(model=str(quant_gguf), quantization="gguf",
                   dtype="bfloat16").create_engine_config()
    # dtype auto is float32 beside quantized weights, whatever the CPU.
    config = EngineArgs(model=str(quant_gguf), quantization="gguf").create_engine_config()
    assert config.model_config.dtype == "float32"
    assert config.model_config.quantization == "gguf"


def test_a_backend_that_does_not_run_it_refuses_it(quant_gguf, monkeypatch):
    from engine_helpers import register_backend_without_quantization

    from cadence.engine import LLMEngine

    name = register_backend_without_quantization(monkeypatch)
    refusal = ("quantization 'gguf' is not supported by backend 'noquant'; backends that run "
               "it: cpu, cuda, hpu")
    # Before the blocks are exported (that can take minutes)...
    with pytest.raises(ValueError, match=refusal):
        EngineArgs(model=str(quant_gguf), backend=name, quantization="gguf",
                   dtype="float32").create_engine_config()
    folder = Path(EngineArgs(model=str(quant_gguf)).resolve_model())
    assert not (folder / BLOCKS_DIR).exists()
    # ...and by the engine, whoever built its config.
    config = EngineArgs(model=str(quant_gguf), backend=name, quantization="int8",
                        dtype="float32").create_engine_config()
    with pytest.raises(ValueError, match=refusal.replace("gguf", "int8")):
        LLMEngine(config)


def test_int8_rounds_each_group_to_its_own_scale():
    import torch

    from cadence.quantization.weights import quantize_int8

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 96, generator=g)
    w[1, 32:64] = 0.0  # an all-zero group
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.scale.shape == (6, 3) and qw.offset is None
    assert qw.q.abs().max() == 127
    err = (qw.dequantize() - w).abs()
    assert torch.all(err <= qw.scale.repeat_interleave(32, dim=1) / 2 + 1e-7)
    assert torch.equal(qw.dequantize()[1, 32:64], torch.zeros(32))
    # A width that is not a multiple of the group: one scale for the whole row.
    assert quantize_int8(torch.randn(3, 40, generator=g)).scale.shape == (3, 1)


def test_int8_gives_the_outputs_of_its_rounded_weights(tiny_model_dir, tmp_path):
    """int8 is not the checkpoint's result: it is exactly the result of a checkpoint whose
    linears, the head's included, hold the rounded weights."""
    source = tiny_model_dir("llama")
    rounded = _round_linears(source, tmp_path / "rounded")
    prompts = ["the cat runs over the", "one two three four five"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = make_llm(rounded, dtype="float32", backend_options=TILED)
    want = _outputs(plain, prompts, params)
    plain.shutdown()
    quant = make_llm(source, quantization="int8")
    info = quant.engine.backend.env_info()
    # qkv, o, gate/up (fused) and down in each of the two layers, and the head.
    assert info["cpu_quantized_linears"] == "9", info
    assert info["dtype"] == "float32"
    assert _outputs(quant, prompts, params) == want
    quant.shutdown()


@pytest.mark.parametrize("family", ["mixtral", "gpt2"])
def test_int8_runs_other_families_close_to_their_weights(family, tmp_path, tokenizer_dir):
    """Experts and Conv1D-converted layers run from int8 too (routers stay as they are), and
    the first step's log-probabilities stay near the checkpoint's."""
    from family_factory import build_family_model

    path = build_family_model(family, tmp_path / family, tokenizer_dir)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = ["the cat runs over the", "one two three four five"]
    plain = make_llm(path, dtype="float32")
    want = _outputs(plain, prompts, params)
    plain.shutdown()
    quant = make_llm(path, quantization="int8")
    count = int(quant.engine.backend.env_info()["cpu_quantized_linears"])
    got = _outputs(quant, prompts, params)
    quant.shutdown()
    assert count >= 5
    for (_, _, [lp_want]), (_, _, [lp_got]) in zip(want, got):
        top = max(lp_want, key=lp_want.get)
        assert top in lp_got and abs(lp_got[top] - lp_want[top]) < 0.1, (lp_want, lp_got)


def _round_linears(source: str, out) -> str:
    """A copy of ``source`` whose linears (the head's included) hold int8's rounded weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from cadence.quantization.weights import quantize_int8

    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and ("proj" in name or name == "lm_head.weight"):
            tensors[name] = quantize_int8(tensor).dequantize().to(tensor.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _with_adapters(llm, adapters, params) -> list:
    from test_lora import PROMPTS

    got = []
    for lora in [None, *adapters]:
        outs = llm.generate(PROMPTS, params, lora_request=lora, use_tqdm=False)
        got.append([(o.outputs[0].token_ids,
                     [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                    for o in outs])
    llm.shutdown()
    return got


@pytest.mark.parametrize("method", ["int8", "gguf", "awq"])
def test_lora_adapters_run_on_quantized_weights(method, quant_gguf, tiny_model_dir, tmp_path):
    """An adapter's update adds to the quantized linear's output: the base model and two
    adapters (some projections; all, rank-stabilized) in one batch give what the same
    adapters give on the weights the quantized ones stand for, bit for bit."""
    from test_lora import make_adapters

    if method == "gguf":
        model = str(quant_gguf)
        reference = EngineArgs(model=model).resolve_model()  # the fp32 folder converted
        options = {"overlap": "process"}
    elif method == "awq":
        from cadence.testing.packed_checkpoint import write_packed

        model, reference = write_packed(tiny_model_dir("llama"), tmp_path, "awq")
        options = {"overlap": "sync"}
    else:
        model = tiny_model_dir("llama")
        reference = _round_linears(model, tmp_path / "rounded")
        options = {"overlap": "sync"}
    adapters = make_adapters(reference, tmp_path / "adapters")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    lora = {"enable_lora": True, "max_loras": 2, "dtype": "float32"}
    want = _with_adapters(make_llm(reference, backend_options={**options, "linear": "tiled"},
                                   **lora), adapters, params)
    quant = make_llm(model, quantization=method, backend_options=options, **lora)
    assert int(quant.engine.backend.env_info()["cpu_quantized_linears"]) >= 8
    if options["overlap"] == "sync":  # every linear quantized: the updates still run tiled
        from cadence.lora.runtime import torch_gemm

        assert quant.engine.backend.runner.lora.make_gemm is not torch_gemm
    got = _with_adapters(quant, adapters, params)
    assert got == want
    assert got[1] != got[0] and got[2] != got[0], "an adapter changed nothing"


def test_blocks_split_over_tensor_parallel_ranks(quant_gguf):
    """Each rank runs its share of the blocks (q/k/v, gate/up and the head by rows, o and
    down by inputs): the fp32 model's outputs on two ranks, bit for bit."""
    prompts = ["the cat runs over the", "one two three four five"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    kw = {"dtype": "float32", "tensor_parallel_size": 2, "num_kv_blocks": 64}
    plain = make_llm(str(quant_gguf), backend_options={"linear": "tiled"}, **kw)
    want = _outputs(plain, prompts, params)
    plain.shutdown()
    quant = make_llm(str(quant_gguf), quantization="gguf", **kw)
    assert quant.engine.backend.env_info()["cpu_quantized_linears"] == "8"  # rank 0's
    got = _outputs(quant, prompts, params)
    quant.shutdown()
    assert got == want


def test_int8_over_tensor_parallel_ranks_rounds_as_one_process(tiny_model_dir, tokenizer_dir,
                                                                tmp_path):
    """The ranks round the same groups as one process does, so two ranks give its tokens
    (logprobs within the all-reduce's rounding); a split that would cut a group is refused."""
    from family_factory import build_family_model

    prompts = ["the cat runs over the", "one two three four five"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    model = tiny_model_dir("llama")
    one = make_llm(model, quantization="int8")
    want = _outputs(one, prompts, params)
    one.shutdown()
    two = make_llm(model, quantization="int8", tensor_parallel_size=2, num_kv_blocks=64)
    assert two.engine.backend.env_info()["cpu_quantized_linears"] == "9"
    got = _outputs(two, prompts, params)
    two.shutdown()
    for (ids_w, _, lps_w), (ids_g, _, lps_g) in zip(want, got):
        assert ids_g == ids_w
        for a, b in zip(lps_w, lps_g):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4
    # The tiny MoE's MLP widths (96, 48) give 48 and 24 inputs a rank: refused from its
    # config.json, before any rank loads it...
    moe = build_family_model("qwen2_moe", tmp_path / "moe", tokenizer_dir)
    with pytest.raises(ValueError, match="intermediate_size is 96 inputs, 48 on each rank, "
                                         "not whole groups of 32"):
        make_llm(moe, quantization="int8", tensor_parallel_size=2, num_kv_blocks=64)


def test_a_rank_refuses_int8_groups_its_share_would_cut():
    """...and by each rank as it rounds a layer, whatever built the config."""
    from cadence.layers.linear import RowParallelLinear
    from cadence.quantization.weights import _check_int8_share

    down = RowParallelLinear(48, 8)
    down.tp_rank, down.tp_size, down.in_features = 0, 2, 24
    with pytest.raises(ValueError, match="mlp.down_proj has 48 inputs, 24 on each rank"):
        _check_int8_share("mlp.down_proj", down)
    down.in_features = 32
    _check_int8_share("mlp.down_proj", down)  # 64 inputs, 32 a rank: whole groups
