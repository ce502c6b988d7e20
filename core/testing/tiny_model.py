"""A tiny random-weight Llama and a locally trained tokenizer, for the conformance kit.

Installed users have no access to cadence's ``tests/`` folder or to the hub, so the kit
builds its own model folder: a byte-level BPE trained on generated sentences and a 2-layer
Llama with seeded random weights, saved the way Hugging Face saves a checkpoint. Weights are
larger than usual so that greedy decoding wanders instead of repeating one token, which makes
"same tokens" a meaningful comparison. transformers is imported inside the functions only.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

BOS, EOS = "<s>", "</s>"
VOCAB_SIZE = 600
MAX_POSITIONS = 256
_WORDS = ["the", "a", "cat", "dog", "bird", "tree", "river", "city", "house", "light", "night", "sun", "moon", "road", "train", "book", "song", "friend", "water", "fire", "runs", "jumps", "sings", "reads", "sees", "finds", "makes", "walks", "talks", "big", "small", "red", "blue", "green", "happy", "quick", "slow", "old", "new", "bright", "dark", "and", "but", "with", "under", "over", "near", "into", "from", "of", "in"]
_RARE = ["café", "naïve", "中文", "日本語", "😀", "über"]  # multi-byte: split over tokens


def sentences(count: int, seed: int = 0, words: list[str] | None = None,
              rare: list[str] | None = None, lengths: tuple[int, int] = (3, 12)) -> list[str]:
    """Deterministic English-like sentences with a few multi-byte words (``rare``)."""
    words, rare = words or _WORDS, rare or _RARE
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        line = [rng.choice(words) for _ in range(rng.randint(*lengths))]
        if rng.random() < 0.3:
            line.insert(rng.randrange(len(line)), rng.choice(rare))
        out.append(" ".join(line).capitalize() + rng.choice(".!?,"))
    return out


def build_tokenizer(out_dir: str | Path) -> str:
    """Train the byte-level BPE (bos ``<s>`` prepended, eos ``</s>``) and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(sentences(1500), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=EOS)
    fast.save_pretrained(str(out_dir))
    return str(out_dir)


def build_tiny_llama(out_dir: str | Path, seed: int = 0, sliding_window: int | None = None
                     ) -> str:
    """Save a tokenizer plus a 2-layer GQA Llama (hidden 64, 4 heads) in ``out_dir``; with
    ``sliding_window``, the same shape as a Mistral whose every layer attends to that many
    tokens."""
    from transformers import LlamaConfig, MistralConfig

    out = Path(out_dir)
    tokenizer_dir = build_tokenizer(out)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    kind, extra = (LlamaConfig, {}) if sliding_window is None else \
        (MistralConfig, {"sliding_window": sliding_window})
    config = kind(
        **extra,
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id)
    save_random_model(config, seed, out)
    return str(out)


def save_random_model(config: Any, seed: int, out_dir: str | Path,
                      max_shard_size: str = "50GB") -> None:
    """Build a transformers model from ``config`` with seeded random weights and save it.

    Weights are larger than the usual 0.02 so that greedy decoding wanders instead of
    repeating one token; norms stay near 1.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.25 if "embed" in name else 0.15)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id)
    model.save_pretrained(str(out_dir), max_shard_size=max_shard_size)
