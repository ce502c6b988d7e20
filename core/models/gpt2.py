"""GPT-2 over a flat token batch.

What sets it apart: learned absolute position embeddings (``wpe``) instead of rotary ones,
LayerNorm with a bias, a GELU MLP with biases, and checkpoints whose projections are
``Conv1D`` layers: weights stored [in, out], the transpose of a linear layer's, with q, k
and v fused in ``c_attn``. The loader transposes them once, so every GEMM is a plain
``Linear`` a backend can pack. The attention scale follows ``scale_attn_weights`` and
``scale_attn_by_inverse_layer_idx`` (1 / (layer + 1) more per layer), passed to the backend
per layer.

Under tensor parallel ``c_attn`` is column-parallel by heads (each rank takes its rows of
q, k and v from the fused checkpoint tensor, ``ColumnParallelLinear.tp_load``), ``c_fc``
column-parallel, the two ``c_proj`` row-parallel and ``wte`` split by vocabulary rows; the
position table ``wpe`` is whole on every rank. Under pipeline parallel the first stage holds
``wte`` and ``wpe``, the last ``ln_f``; the inverse-layer scale reads the layer's index in
the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from cadence.distributed import pp_size, recv_from_previous_stage, send_to_next_stage
from cadence.layers.activation import Activation
from cadence.layers.attention import attend, attention_features
from cadence.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
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
    """Multi-head attention from the fused ``c_attn`` (rows q, k, v after the transpose).
    ``index``: the layer's index in the model; ``layer_idx``: its KV cache slot."""

    def __init__(self, config: Any, index: int, layer_idx: int, dims: dict[str, int]
                 ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = dims["num_heads"], dims["head_dim"]
        self.size = self.num_heads * self.head_dim  # this rank's q (and k, v) width
        heads = dims["total_num_heads"]
        self.c_attn = QKVParallelLinear(hidden, heads, heads, self.head_dim, bias=True)
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        self.features = attention_features(
            self.head_dim, scale=attention_scale(config, index, self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.c_attn(x).split(self.size, dim=-1)  # 3 x [T, H * D]
        shape = (t, self.num_heads, self.head_dim)
        out = attend(self.layer_idx, q.view(shape), k.view(shape), v.view(shape),
                     self.features)  # [T, H, D]
        return self.c_proj(out.reshape(t, self.size))


class GPT2MLP(nn.Module):
    """c_fc -> activation -> c_proj, with biases."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.c_fc = ColumnParallelLinear(config.hidden_size, inner, bias=True)
        self.act = Activation(config.activation_function, "activation_function")
        self.c_proj = RowParallelLinear(inner, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``+ mlp(ln_2(.))``."""

    def __init__(self, config: Any, index: int, layer_idx: int, dims: dict[str, int]
                 ) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, index, layer_idx, dims)
        self.ln_2 = LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.ln_1(x)) + x
        return self.mlp(self.ln_2(x)) + x


class GPT2Model(nn.Module):
    """Token and position embeddings, blocks and ``ln_f`` (HF's ``transformer.*``); under
    pipeline parallel ``stage``'s parts only, as Llama's ``DecoderModel``."""

    def __init__(self, config: Any, dims: dict[str, int], stage: base.CausalLM) -> None:
        super().__init__()
        held, first = stage.layer_range, stage.is_first_stage
        missing = base.NotOnThisStage
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if first \
            else missing()
        self.wpe = base.empty_embedding(config.max_position_embeddings, config.hidden_size) \
            if first else missing()
        self.h = nn.ModuleList(GPT2Block(config, i, i - held.start, dims) if i in held
                               else missing() for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon) \
            if stage.is_last_stage else missing()


class GPT2LMHeadModel(base.CausalLM):
    """GPT-2 causal LM; see the module docstring."""

    final_norm = "ln_f"

    def __init__(self, config: Any, dtype: torch.dtype, max_model_len: int | None = None):
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention (an encoder-decoder's decoder) "
                             "is not supported: cadence runs decoder-only models")
        super().__init__(config, dtype)
        dims = {"num_heads": self.num_heads, "head_dim": self.head_dim,
                "total_num_heads": self.total_num_heads}
        self.build("transformer", lambda: GPT2Model(config, dims, self), "wte")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden_size]; None on
        a pipeline stage before the last (its activations went to the next stage)."""
        tf = self.transformer
        if self.is_first_stage:
            x = tf.wte(input_ids) + tf.wpe(positions)  # [T, hidden]
        else:
            x = recv_from_previous_stage((input_ids.shape[0], self.hidden_size), self.dtype)
        for i in self.layer_range:
            x = tf.h[i](x)
        if not self.is_last_stage:
            send_to_next_stage(x)
            return None
        return tf.ln_f(x)

    def stage_weight_name(self, name: str) -> str | None:
        """The base's rule with GPT-2's names: blocks are ``h.<i>``, and the position table
        goes with the token embeddings to the first stage."""
        if pp_size() == 1:
            return name
        if name.startswith("transformer.h."):
            return name if int(name.split(".", 3)[2]) in self.layer_range else None
        if name.startswith("transformer.wpe."):
            return name if self.is_first_stage else None
        return super().stage_weight_name(name)

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
