"""OLMo 2 over a flat token batch.

The Llama decoder with the norms moved: no norm before attention or the MLP, an RMSNorm on
each branch's output before it joins the residual (``post_attention_layernorm``,
``post_feedforward_layernorm``), and RMSNorms on q and k over the whole projection (all
heads at once, before the split into heads; Qwen3 norms each head). Every OLMo 2 norm
applies its weight in float32 before casting back (``RMSNormWeightFirst``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cadence.layers.attention import attend, attention_features
from cadence.layers.linear import Linear
from cadence.layers.norm import RMSNormWeightFirst
from cadence.layers.rotary import ApplyRotary, RotaryEmbedding
from cadence.models import base
from cadence.models.llama import FUSED_QKV_GATE_UP, MLP


class Olmo2Attention(nn.Module):
    """Fused-qkv attention with q and k normed over the whole projection."""

    def __init__(self, config: Any, layer_idx: int, dims: dict[str, int]) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = dims["num_heads"], dims["num_kv_heads"]
        self.head_dim = dims["head_dim"]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        eps = config.rms_norm_eps
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNormWeightFirst(self.q_size, eps)
        self.k_norm = RMSNormWeightFirst(self.kv_size, eps)
        self.rotary = ApplyRotary()
        self.features = attention_features(self.head_dim)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_norm(k).view(t, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        q, k = self.rotary(q, k, cos_sin)
        out = attend(self.layer_idx, q, k, v.view(t, self.num_kv_heads, self.head_dim),
                     self.features)
        return self.o_proj(out.reshape(t, self.q_size))


class Olmo2DecoderLayer(nn.Module):
    """``h = x + norm(attn(x))``, then ``h + norm(mlp(h))``."""

    def __init__(self, config: Any, layer_idx: int, dims: dict[str, int]) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Olmo2Attention(config, layer_idx, dims)
        self.mlp = MLP(config, bias=False)
        self.post_attention_layernorm = RMSNormWeightFirst(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNormWeightFirst(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(x, cos_sin))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Olmo2Model(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's ``model.*`` weights)."""

    def __init__(self, config: Any, dims: dict[str, int]) -> None:
        super().__init__()
        self.embed_tokens = base.empty_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, i, dims)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNormWeightFirst(config.hidden_size, config.rms_norm_eps)


class Olmo2ForCausalLM(base.CausalLM):
    """OLMo 2 causal LM; see the module docstring."""

    fused_parts = FUSED_QKV_GATE_UP

    def __init__(self, config: Any, dtype: torch.dtype, max_model_len: int | None = None):
        if config.hidden_act != "silu":
            raise ValueError(f"OLMo 2 with hidden_act {config.hidden_act!r} is not supported; "
                             "supported: 'silu'")
        super().__init__(config, dtype)
        dims = {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim}
        self.build("model", lambda: Olmo2Model(config, dims), "embed_tokens")
        self.rotary_emb = RotaryEmbedding(config, self.head_dim,
                                          max_model_len or config.max_position_embeddings,
                                          dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden_size]."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos_sin = self.rotary_emb(positions)  # 2 x [T, 1, head_dim]
        for layer in self.model.layers:
            x = layer(x, cos_sin)
        return self.model.norm(x)
