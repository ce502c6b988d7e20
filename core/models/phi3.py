"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini) over a flat token batch.

The Llama decoder with three differences, all handled without new layers:
- checkpoints store q/k/v and gate/up already fused (``qkv_proj``, ``gate_up_proj``), in the
  order the Llama module runs them, so they load as they are;
- RoPE may rotate only part of each head (``partial_rotary_factor``, Phi-4-mini's 0.75) and
  may use LongRoPE ("longrope", formerly "su"): short factors while every sequence fits in
  ``original_max_position_embeddings``, long ones otherwise (the NOTE in
  core/layers/rotary.py says how that choice is made per engine);
- ``sliding_window``, when set, windows every layer (core/model_limits.py).

Tensor and pipeline parallel are Llama's; under tensor parallel each rank takes its rows of
every part of the fused checkpoint tensors (``ColumnParallelLinear.tp_load``).
"""

from __future__ import annotations

from typing import Any

import torch

from cadence.layers.rotary import rotary_dim
from cadence.models.llama import CausalLM


class Phi3ForCausalLM(CausalLM):
    """Phi-3 causal LM; see the module docstring."""

    qkv_bias = False
    o_bias = False

    def __init__(self, config: Any, dtype: torch.dtype, max_model_len: int | None = None):
        if config.hidden_act != "silu":
            raise ValueError(f"Phi-3 with hidden_act {config.hidden_act!r} is not supported; "
                             "supported: 'silu'")
        super().__init__(config, dtype, max_model_len)

    def rotary_dim(self) -> int:
        return rotary_dim(self.config, self.head_dim)
