"""Whether a model can be split over tensor-parallel ranks, read from its config.json
(no torch), so a bad split is refused before any rank starts."""

from __future__ import annotations

import json
import os

# The families whose layers shard across ranks (core/models/llama.py); others run on one.
TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                 "Qwen3ForCausalLM")


def check_tensor_parallel_model(model: str, size: int) -> None:
    """ValueError naming the problem when ``model`` cannot be split over ``size`` ranks: an
    architecture without tensor parallel layers, or heads/MLP columns that do not divide."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model folder {model!r}: unreadable config.json ({e})") from e
    archs = cfg.get("architectures") or []
    if not any(a in TENSOR_PARALLEL_ARCHITECTURES for a in archs):
        raise ValueError(f"--tensor-parallel-size {size}: architecture {archs} has no tensor "
                         f"parallel support yet; supported under tensor parallel: "
                         f"{list(TENSOR_PARALLEL_ARCHITECTURES)}")
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % size:
        raise ValueError(f"--tensor-parallel-size {size} must divide the model's "
                         f"{heads} attention heads (num_attention_heads)")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"--tensor-parallel-size {size} and the model's {kv_heads} KV heads "
                         "(num_key_value_heads): one must divide the other (KV heads are "
                         "split across ranks, or replicated when fewer than the ranks)")
    inter = int(cfg["intermediate_size"])
    if inter % size:
        raise ValueError(f"--tensor-parallel-size {size} must divide the model's MLP width "
                         f"{inter} (intermediate_size)")
