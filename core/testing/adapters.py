"""Random LoRA adapters for a model folder, saved as PEFT saves them, for the conformance
kit: installed users have no PEFT requirement, and the kit needs adapters that change the
tokens, on whatever model it was handed."""

from __future__ import annotations

import json
import os
from typing import Any

from cadence.lora.adapter import PROJECTIONS, expected_shapes


def write_random_lora(model_dir: str, out_dir: str, seed: int, rank: int,
                      targets: tuple[str, ...] = PROJECTIONS, alpha: float = 16.0) -> str:
    """Save an adapter on ``targets`` of every decoder layer of the model in ``model_dir``:
    ``adapter_config.json`` and ``adapter_model.safetensors`` with seeded random A and B
    (PEFT zeroes B at creation, which would change nothing)."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg: dict[str, Any] = json.load(f)
    shapes = expected_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj in targets:
            out_f, in_f = shapes[proj]
            parent = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.5
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                   "target_modules": list(targets), "bias": "none",
                   "base_model_name_or_path": model_dir}, f)
    return out_dir
