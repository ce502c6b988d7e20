"""Tiny random-weight Llama-family models and a locally trained tokenizer, for tests.

Nothing comes from the hub: the tokenizer is a byte-level BPE trained here on generated text
(with multi-byte characters, so detokenizing a character split over tokens gets exercised) and
the models are transformers models with seeded random weights, saved as HF folders.
transformers is imported inside the functions only: importing it costs ~7 s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BOS, EOS = "<s>", "</s>"
VOCAB_SIZE = 800
MAX_POSITIONS = 512
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + "
    "'</s>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_WORD_TEXT = (
    "the a an cat dog bird fish tree river city house garden music light night day sun moon "
    "star road car train book paper story song friend teacher child mother father water fire "
    "runs jumps sings reads writes sees finds makes takes gives walks talks sleeps eats grows "
    "big small red blue green happy quick slow old new bright dark quiet loud warm cold "
    "and but with under over near far because while after before into from of in on at to"
)
_WORDS = _WORD_TEXT.split()
_EXTRA = [
    "café",
    "naïve",
    "résumé",
    "中文",
    "日本語",
    "한국어",
    "😀",
    "🚀",
    "über",
    "señor",
    "Ω≈ç√",
]

# kind -> (architecture, extra config fields). All share hidden 64 / 4 heads / 512 positions.
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-rope-yarn": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "llama-rope-linear": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ),
    "llama-rope-dynamic": (
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    ),
}
# Saved in small shards (with an index json) so that the sharded loading path gets exercised.
_SHARDED = {"llama-mqa"}


def sample_text(num_sentences: int, seed: int = 0) -> list[str]:
    """English-like sentences sprinkled with multi-byte words (this file's vocabulary)."""
    from cadence.testing.tiny_model import sentences

    return sentences(num_sentences, seed, _WORDS, _EXTRA, lengths=(4, 14))


def build_tokenizer(out_dir: str | Path) -> str:
    """Train a byte-level BPE and save it as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample_text(3000), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama: the tokenizer prepends <s> to every encoded text.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return str(out_dir)


def _config(kind: str, vocab_size: int, bos_id: int, eos_id: int) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    arch, extra = KINDS[kind]
    config_cls = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }[arch]
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    fields.update(extra)
    return config_cls(**fields)


def build_tiny_model(kind: str, out_dir: str | Path, tokenizer_dir: str | Path) -> str:
    """Save a seeded random-weight model of ``kind`` (see KINDS) plus the tokenizer in out_dir."""
    from transformers import AutoTokenizer

    from cadence.testing.tiny_model import save_random_model

    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; valid: {sorted(KINDS)}")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = _config(kind, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    shard = "200KB" if kind in _SHARDED else "50GB"
    save_random_model(config, sorted(KINDS).index(kind), out_dir, max_shard_size=shard)
    tokenizer.save_pretrained(str(out_dir))
    return str(out_dir)
