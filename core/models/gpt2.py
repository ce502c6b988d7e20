"""GPT-2 over a flat token batch.

What sets it apart: learned absolute position embeddings (``wpe``) instead of rotary ones,
LayerNorm with a bias, a GELU MLP with biases, and checkpoints whose projections are
``Conv1D`` layers: weights stored [in, out], the transpose of a linear layer's, with q, k
and v fused in ``c_attn``. The loader transposes them once, so every GEMM is a plain
``Linear`` a backend can pack. The attention scale follows ``scale_attn_weights`` and
``scale_attn_by_inverse_layer_idx`` (1 / (layer + 1) more per layer), passed to the backend
per layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from cadence.layers.activation import Activation
from cadence.layers.attention import attend, attention_features
from cadence.layers.linear import Linear
from cadence.layers.norm import LayerNorm
from cadence.models import base

# Conv1D layers of a GPT-2 checkpoint, whose weights are stored transposed.
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
           ".mlp.c_proj.weight")


def attention_scale(config: Any, layer_idx: int, head_dim: int) -> float:
    """transformers' GPT2Attention.scaling for this layer."""
    scale = head_dim ** -0.5 if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
        scale /= float(layer_idx + 1)
    return scale


class GPT2Attention(nn.Module):
    """Multi-head attention from the fused ``c_attn`` (rows q, k, v after the transpose)."""

    def __init__(self, config: Any, layer_idx: int, head_dim: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = head_dim
        self.c_attn = Linear(hidden, 3 * hidden)
        self.c_proj = Linear(hidden, hidden)
        self.features = attention_features(
            head_dim, scale=attention_scale(config, layer_idx, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, hidden = x.shape
        q, k, v = self.c_attn(x).split(hidden, dim=-1)  # 3 x [T, hidden]
        shape = (t, self.num_heads, self.head_dim)
        out = attend(self.layer_idx, q.view(shape), k.view(shape), v.view(shape),
                     self.features)  # [T, H, D]
        return self.c_proj(out.reshape(t, hidden))


class GPT2MLP(nn.Module):
    """c_fc -> activation -> c_proj, with biases."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.c_fc = Linear(config.hidden_size, inner)
        self.act = Activation(config.activation_function, "activation_function")
        self.c_proj = Linear(inner, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``+ mlp(ln_2(.))``."""

    def __init__(self, config: Any, layer_idx: int, head_dim: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx, head_dim)
        self.ln_2 = LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.ln_1(x)) + x
        return self.mlp(self.ln_2(x)) + x


class GPT2Model(nn.Module):
    """Token and position embeddings, blocks and ``ln_f`` (HF's ``transformer.*``)."""

    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        self.wte = base.empty_embedding(config.vocab_size, config.hidden_size)
        self.wpe = base.empty_embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i, head_dim)
                               for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class GPT2LMHeadModel(base.CausalLM):
    """GPT-2 causal LM; see the module docstring."""

    def __init__(self, config: Any, dtype: torch.dtype, max_model_len: int | None = None):
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention (an encoder-decoder's decoder) "
                             "is not supported: cadence runs decoder-only models")
        super().__init__(config, dtype)
        self.build("transformer", lambda: GPT2Model(config, self.head_dim), "wte")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden_size]."""
        tf = self.transformer
        x = tf.wte(input_ids) + tf.wpe(positions)  # [T, hidden]
        for block in tf.h:
            x = block(x)
        return tf.ln_f(x)

    def convert_weight(self, name: str, tensor: torch.Tensor
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        # The causal mask buffers of older checkpoints.
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return
        if not name.startswith(("transformer.", "lm_head.")):
            name = f"transformer.{name}"  # the original checkpoints name the body bare
        if name.endswith(_CONV1D):
            tensor = tensor.t()
        yield name, tensor
