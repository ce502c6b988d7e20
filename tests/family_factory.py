"""Tiny random-weight models of the families beyond Llama, built from transformers' own
config classes with each family's distinctive options switched on.

The weights are seeded; norm scales sit near their neutral value (1, or 0 where the family
scales by 1 + weight), norm biases near 0 (a large one favours the same tokens at every
step), and everything else is much larger than usual, so that greedy decoding wanders
instead of repeating one token (each family's ``std`` was picked by looking at that).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COMMON = {"max_position_embeddings": 512, "tie_word_embeddings": False}

# name -> (model_type, config fields, init: "norm" the neutral norm scale, "std" the weights')
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, float]]] = {
    # Parallel attention/MLP, half of each head rotated, the exact GELU.
    "gpt_neox": ("gpt_neox", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "rotary_pct": 0.5, "use_parallel_residual": True,
        "hidden_act": "gelu", "layer_norm_eps": 1e-5}, {"norm": 1.0, "std": 0.5}),
    # The sequential residual, the tanh GELU, a tied head, all of each head rotated.
    "gpt_neox-sequential": ("gpt_neox", {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 2, "rotary_pct": 1.0, "use_parallel_residual": False,
        "hidden_act": "gelu_new", "tie_word_embeddings": True}, {"norm": 1.0, "std": 0.5}),
    # Learned positions, Conv1D checkpoints, a tied head, gelu_new.
    "gpt2": ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512,
                      "activation_function": "gelu_new", "tie_word_embeddings": True},
             {"norm": 1.0, "std": 0.5}),
    # Per-layer attention scale 1 / sqrt(D) / (layer + 1), an own head, n_inner, exact GELU.
    "gpt2-layer-scaled": ("gpt2", {
        "n_embd": 64, "n_layer": 3, "n_head": 2, "n_inner": 96, "n_positions": 512,
        "activation_function": "gelu", "scale_attn_by_inverse_layer_idx": True,
        "tie_word_embeddings": False}, {"norm": 1.0, "std": 0.5}),
    # LongRoPE on half of each head (short factors: every sequence here fits in 256), GQA.
    "phi3": ("phi3", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5,
                            "original_max_position_embeddings": 256,
                            "short_factor": [1.0, 1.3, 1.9, 2.6],
                            "long_factor": [1.5, 2.5, 4.0, 7.0]}}, {"norm": 1.0, "std": 0.15}),
    # A sliding window of 16 on every layer, plain RoPE on the whole head, a tied head.
    "phi3-window": ("phi3", {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "sliding_window": 16,
        "tie_word_embeddings": True}, {"norm": 1.0, "std": 0.15}),
    # Post-norms, q/k norms over the whole projection, GQA, q/k/v/o biases.
    "olmo2": ("olmo2", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": True,
        "rms_norm_eps": 1e-6}, {"norm": 1.0, "std": 0.3}),
    # All four multipliers (attention scale 0.1, not 1/sqrt(16)), attention biases.
    "granite": ("granite", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "embedding_multiplier": 2.0,
        "residual_multiplier": 0.8, "attention_multiplier": 0.1, "logits_scaling": 4.0,
        "attention_bias": True}, {"norm": 1.0, "std": 0.15}),
    # Soft caps on the attention scores and the logits, a window of 16 on every other
    # layer, query_pre_attn_scalar 24 (scale 24 ** -0.5, not 16 ** -0.5), GeGLU.
    "gemma2": ("gemma2", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "sliding_window": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 10.0}, {"norm": 0.0, "std": 0.15}),
    # Local and global layers with their own RoPE (linear scaling on the global one), per-head
    # q/k norms, two windowed layers out of three.
    "gemma3": ("gemma3_text", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "sliding_window": 16, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0,
                               "rope_theta": 1000000.0}}}, {"norm": 0.0, "std": 0.15}),
    # Mixture of experts: 4 experts, top 2 renormalized, on every layer.
    "mixtral": ("mixtral", {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2}, {"norm": 1.0, "std": 0.3}),
    # ... with a window of 16 on every layer, past which the prompts run.
    "mixtral-window": ("mixtral", {
        "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "num_local_experts": 3,
        "num_experts_per_tok": 2, "sliding_window": 16}, {"norm": 1.0, "std": 0.3}),
    # A sigmoid-gated shared expert, top-2 of 4 not renormalized, layer 1 dense (mlp_only).
    "qwen2_moe": ("qwen2_moe", {
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 80, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
        "num_experts_per_tok": 2, "norm_topk_prob": False, "mlp_only_layers": [1]},
        {"norm": 1.0, "std": 0.3}),
    # q/k norms, top-2 of 6 renormalized, every second layer sparse (decoder_sparse_step).
    "qwen3_moe": ("qwen3_moe", {
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 48,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "decoder_sparse_step": 2}, {"norm": 1.0, "std": 0.3}),
}


def family_config(name: str, vocab_size: int, bos_id: int, eos_id: int) -> Any:
    from transformers import AutoConfig

    model_type, fields, _ = FAMILIES[name]
    merged = {**_COMMON, **fields, "vocab_size": vocab_size, "bos_token_id": bos_id,
              "eos_token_id": eos_id, "pad_token_id": eos_id}
    return AutoConfig.for_model(model_type, **merged)


def _is_norm(name: str) -> bool:
    return any(part in name for part in ("norm", "ln_", ".ln"))


def build_family_model(name: str, out_dir: str | Path, tokenizer_dir: str | Path,
                       seed: int = 0) -> str:
    """Save a seeded random-weight model of family ``name`` plus the tokenizer in out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = family_config(name, len(tokenizer), tokenizer.bos_token_id,
                           tokenizer.eos_token_id)
    init = FAMILIES[name][2]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if _is_norm(pname) and pname.endswith("weight"):
                param.copy_(init["norm"] + 0.1 * torch.randn_like(param))
            elif _is_norm(pname):
                param.normal_(0.0, 0.02)
            else:
                param.normal_(0.0, 0.25 if "embed" in pname or "wte" in pname else init["std"])
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return str(out_dir)


def load_reference(path: str | Path) -> Any:
    """transformers' float32 model of a family folder, with eager attention: some releases
    (5.17 among them) run Gemma 2 through SDPA, which drops its attention soft-capping, so
    only eager is every release's exact reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()
