"""Model registry: HF architecture name -> model class, imported lazily.

Imports no torch: the engine's configuration checks a model's architecture against this
list before any backend starts."""

from __future__ import annotations

import importlib

# architecture -> (module under cadence.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtralForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "Qwen3MoeForCausalLM"),
}

# Base models saved without their LM head, as embedding models are (e5-mistral,
# gte-Qwen2): the family's class loads them, with the head standing in from the
# embeddings; they serve embeddings only (``ModelConfig.has_lm_head``).
BASE_MODELS: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
_MODELS.update({base: _MODELS[full] for base, full in BASE_MODELS.items()})


# model_type -> the class transformers' AutoModelForCausalLM builds for it: a config.json
# that names no ``architectures`` is loaded by its model_type, as transformers loads it.
_BY_MODEL_TYPE = {
    "gpt2": "GPT2LMHeadModel", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "gpt_neox": "GPTNeoXForCausalLM",
    "granite": "GraniteForCausalLM", "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM", "mistral": "MistralForCausalLM",
    "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def architectures_of(architectures: object, model_type: object) -> list[str]:
    """config.json's ``architectures``, or where it names none, the causal-LM class of its
    ``model_type`` (empty when cadence knows neither)."""
    if isinstance(architectures, list) and architectures:
        return [str(a) for a in architectures]
    arch = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    return [arch] if arch else []


def supported_architectures() -> list[str]:
    """Architecture names (``config.architectures`` entries) that cadence can load."""
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None, model_type: str | None = None) -> type:
    """The class for the first supported name in ``architectures`` (``config.architectures``,
    or where that is empty, the class of ``model_type``)."""
    for arch in architectures_of(architectures, model_type):
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            module = importlib.import_module(f"{__name__}.{module_name}")
            return getattr(module, class_name)
    raise ValueError(
        f"unsupported model architecture(s) {architectures}; supported: {supported_architectures()}"
    )


def is_base_model(architectures: list[str] | None) -> bool:
    """Whether ``config.architectures`` names a base model (no LM head) and nothing else."""
    return bool(architectures) and all(a in BASE_MODELS for a in architectures)
