"""Whether a model can be split over tensor-parallel ranks or pipeline stages, read from
its config.json (no torch), so a bad split is refused before any rank starts."""

from __future__ import annotations

import json
import os

from cadence.models import BASE_MODELS, is_base_model

# The mixture-of-experts families (core/models/moe.py): each expert splits like a dense MLP.
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

# The families whose layers shard across ranks (core/models/).
TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                 "Qwen3ForCausalLM", "GraniteForCausalLM", "Phi3ForCausalLM",
                                 "Olmo2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                                 "GPT2LMHeadModel", "GPTNeoXForCausalLM") + MOE_ARCHITECTURES \
    + tuple(BASE_MODELS)


# The families whose layers split into stages (the same families; a base model without an
# LM head is refused below: the last stage has no embeddings to stand in for the head).
PIPELINE_PARALLEL_ARCHITECTURES = TENSOR_PARALLEL_ARCHITECTURES


def _read_config(model: str) -> dict:
    try:
        with open(os.path.join(model, "config.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model folder {model!r}: unreadable config.json ({e})") from e


def _field(cfg: dict, name: str, gpt2_name: str) -> tuple[int, str]:
    """(value, the config field it came from): GPT-2's config.json names some fields
    its own way (``n_head``, ``n_layer``, ``n_inner``)."""
    if cfg.get(name) is not None:
        return int(cfg[name]), name
    if gpt2_name == "n_inner":  # null: four times the width
        inner = cfg.get("n_inner") or 4 * int(cfg.get("n_embd") or 0)
        return int(inner), "n_inner"
    return int(cfg.get(gpt2_name) or 0), gpt2_name


def check_pipeline_parallel_model(model: str, size: int) -> None:
    """ValueError naming the problem when ``model`` cannot be split into ``size`` stages:
    an architecture without stage support, or fewer decoder layers than stages."""
    cfg = _read_config(model)
    archs = cfg.get("architectures") or []
    if not any(a in PIPELINE_PARALLEL_ARCHITECTURES for a in archs):
        raise ValueError(f"--pipeline-parallel-size {size}: architecture {archs} has no "
                         f"pipeline parallel support yet; supported: "
                         f"{list(PIPELINE_PARALLEL_ARCHITECTURES)}")
    if is_base_model(archs) and not cfg.get("tie_word_embeddings"):
        raise ValueError(f"--pipeline-parallel-size {size}: architecture {archs} is a base "
                         "model without an LM head, and a last stage has no embeddings to "
                         "stand in for one; serve it without pipeline parallel")
    layers, field = _field(cfg, "num_hidden_layers", "n_layer")
    if layers < size:
        raise ValueError(f"--pipeline-parallel-size {size} needs at least one decoder layer "
                         f"per stage; the model has {layers} ({field})")


def check_tensor_parallel_model(model: str, size: int, expert_parallel: bool = False,
                                quantization: str | None = None) -> None:
    """ValueError naming the problem when ``model`` cannot be split over ``size`` ranks: an
    architecture without tensor parallel layers, or heads/MLP columns that do not divide.
    Under ``expert_parallel`` the experts are not split but spread, one at least per rank.
    Under ``quantization='int8'`` each rank's share of a row-parallel layer's inputs must be
    whole groups (the rank checks each layer again as it loads)."""
    cfg = _read_config(model)
    archs = cfg.get("architectures") or []
    if not any(a in TENSOR_PARALLEL_ARCHITECTURES for a in archs):
        raise ValueError(f"--tensor-parallel-size {size}: architecture {archs} has no tensor "
                         f"parallel support yet; supported under tensor parallel: "
                         f"{list(TENSOR_PARALLEL_ARCHITECTURES)}")
    heads, heads_field = _field(cfg, "num_attention_heads", "n_head")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % size:
        raise ValueError(f"--tensor-parallel-size {size} must divide the model's "
                         f"{heads} attention heads ({heads_field})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"--tensor-parallel-size {size} and the model's {kv_heads} KV heads "
                         "(num_key_value_heads): one must divide the other (KV heads are "
                         "split across ranks, or replicated when fewer than the ranks)")
    moe = any(a in MOE_ARCHITECTURES for a in archs)
    whole_experts = moe and expert_parallel
    inter, inter_field = _field(cfg, "intermediate_size", "n_inner")
    # Mixtral's intermediate_size is its experts' width: not split under expert parallel.
    if inter % size and not (whole_experts and "MixtralForCausalLM" in archs):
        raise ValueError(f"--tensor-parallel-size {size} must divide the model's MLP width "
                         f"{inter} ({inter_field})")
    if whole_experts:
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        if experts < size:
            raise ValueError(f"--enable-expert-parallel over {size} ranks needs at least one "
                             f"expert per rank; the model has {experts} per layer")
    if moe:
        widths = ("shared_expert_intermediate_size",) if whole_experts else \
            ("moe_intermediate_size", "shared_expert_intermediate_size")
        for field in widths:
            width = int(cfg.get(field) or 0)
            if width % size:
                raise ValueError(f"--tensor-parallel-size {size} must divide the experts' "
                                 f"width {width} ({field})")
    if quantization == "int8":
        _check_int8_shares(cfg, size, heads, inter, inter_field, moe, whole_experts)


def _check_int8_shares(cfg: dict, size: int, heads: int, inter: int, inter_field: str,
                       moe: bool, whole_experts: bool) -> None:
    from cadence.quantization import check_int8_split

    hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    # The inputs of each row-parallel layer: o_proj, the MLP's down (a dense model's, or
    # Mixtral's experts'), Qwen-MoE's experts and shared expert.
    inputs = [(heads * head_dim, "the attention output (heads x head_dim)"),
              (inter, inter_field)]
    if moe and "MixtralForCausalLM" in (cfg.get("architectures") or []) and whole_experts:
        inputs.pop()  # whole experts, not split
    if moe:
        fields = ("shared_expert_intermediate_size",) if whole_experts else \
            ("moe_intermediate_size", "shared_expert_intermediate_size")
        inputs += [(int(cfg.get(f) or 0), f) for f in fields]
    for width, what in inputs:
        if width:
            check_int8_split(f"{what} is", width, size)
