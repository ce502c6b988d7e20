"""IBM Granite (3.x dense) over a flat token batch.

The Llama decoder with four scalars from the config:
- ``embedding_multiplier`` scales the token embeddings;
- ``residual_multiplier`` scales each branch's output before it joins the residual;
- ``attention_multiplier`` is the attention scale (instead of ``head_dim ** -0.5``), passed
  to the backend by keyword (core/layers/attention.py);
- ``logits_scaling`` divides the fp32 logits, after the tied maxima of a bf16 head were
  recomputed exactly (a positive divisor keeps them the maxima).

Tensor and pipeline parallel come with Llama's layers and stages; the scalars are per
token and per feature, so every rank and stage applies them to its share unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cadence.layers.attention import attention_features
from cadence.layers.norm import RMSNorm
from cadence.models.llama import MLP, Attention, CausalLM


class GraniteDecoderLayer(nn.Module):
    """The Llama block with ``residual_multiplier`` on both branches and
    ``attention_multiplier`` as the attention scale.

    Same residual-stream layout as Llama's ``DecoderLayer``: each norm adds the (scaled)
    branch output to the residual; ``residual + branch * m`` is transformers' expression.
    """

    def __init__(self, config: Any, layer_idx: int, spec: dict[str, bool], dims: dict[str, int],
                 sliding_window: int | None = None):
        super().__init__()
        assert sliding_window is None  # Granite configs have no windows (model_limits)
        self.residual_multiplier = float(config.residual_multiplier)
        self.self_attn = Attention(config, layer_idx, spec, dims)
        self.self_attn.features = attention_features(dims["head_dim"],
                                                     scale=config.attention_multiplier)
        self.mlp = MLP(config, spec["mlp_bias"])
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scaled branch output, residual stream) -> the same pair after this layer."""
        if residual is None:  # the first layer: the scaled embeddings are the residual
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos_sin) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteForCausalLM(CausalLM):
    """Granite causal LM; see the module docstring."""

    decoder_layer = GraniteDecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, max_model_len: int | None = None):
        if config.hidden_act != "silu":
            raise ValueError(f"Granite with hidden_act {config.hidden_act!r} is not "
                             "supported; supported: 'silu'")
        super().__init__(config, dtype, max_model_len)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.embedding_multiplier

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.logits_scaling
