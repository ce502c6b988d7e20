"""GPT-NeoX (Pythia, GPT-NeoX-20B, StableLM-alpha) over a flat token batch.

What sets it apart from the Llama family: LayerNorm with a bias, attention and MLP that both
read the block's input and are added to it together (``use_parallel_residual``), a GELU MLP
with biases, rotary embeddings on the first ``rotary_pct`` of each head only, and one fused
``query_key_value`` projection whose rows interleave the heads ([H, 3, D]: each head's q, k
and v together). The loader reorders those rows to [3, H, D] once, so q, k and v are three
contiguous slices of one GEMM's output, as in every other family here.

Under tensor parallel, after that reorder, ``query_key_value`` is column-parallel by heads
(each rank takes its rows of q, k and v, ``ColumnParallelLinear.tp_load``),
``dense_h_to_4h`` column-parallel, ``dense`` and ``dense_4h_to_h`` row-parallel, and
``embed_in`` split by vocabulary rows. Under pipeline parallel the first stage holds
``embed_in``, the last ``final_layer_norm`` and the head.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from cadence.distributed import recv_from_previous_stage, send_to_next_stage
from cadence.layers.activation import Activation
from cadence.layers.attention import attend, attention_features
from cadence.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from cadence.layers.norm import LayerNorm
from cadence.layers.rotary import ApplyRotary, RotaryEmbedding, rotary_dim
from cadence.models import base


class NeoXAttention(nn.Module):
    """Multi-head attention (no GQA) with partial rotary; q/k/v from one projection."""

    def __init__(self, config: Any, layer_idx: int, dims: dict[str, int]) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = dims["num_heads"], dims["head_dim"]
        self.size = self.num_heads * self.head_dim  # this rank's q (and k, v) width
        heads = dims["total_num_heads"]
        bias = bool(getattr(config, "attention_bias", True))
        # rows [3, H, D] (module docstring)
        self.query_key_value = QKVParallelLinear(hidden, heads, heads, self.head_dim,
                                                 bias=bias)
        self.dense = RowParallelLinear(hidden, hidden, bias=bias)
        self.rotary = ApplyRotary()
        self.features = attention_features(self.head_dim)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.query_key_value(x).split(self.size, dim=-1)  # 3 x [T, H * D]
        shape = (t, self.num_heads, self.head_dim)
        q, k = self.rotary(q.view(shape), k.view(shape), cos_sin)  # [T, H, D]
        out = attend(self.layer_idx, q, k, v.view(shape), self.features)
        return self.dense(out.reshape(t, self.size))


class NeoXMLP(nn.Module):
    """dense_h_to_4h -> activation -> dense_4h_to_h, with biases."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, config.intermediate_size,
                                                  bias=True)
        self.act = Activation(config.hidden_act)
        self.dense_4h_to_h = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                               bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class NeoXLayer(nn.Module):
    """One block; the parallel form is ``x + attn(ln1(x)) + mlp(ln2(x))``."""

    def __init__(self, config: Any, layer_idx: int, dims: dict[str, int]) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.use_parallel_residual = bool(config.use_parallel_residual)
        self.input_layernorm = LayerNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps=eps)
        self.attention = NeoXAttention(config, layer_idx, dims)
        self.mlp = NeoXMLP(config)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(x), cos_sin)
        if self.use_parallel_residual:
            # transformers' order of the two additions, for the same bits.
            return self.mlp(self.post_attention_layernorm(x)) + attn + x
        h = attn + x
        return self.mlp(self.post_attention_layernorm(h)) + h


class GPTNeoXModel(nn.Module):
    """Embeddings, blocks and the final LayerNorm (HF's ``gpt_neox.*`` weights); under
    pipeline parallel ``stage``'s parts only, as Llama's ``DecoderModel``."""

    def __init__(self, config: Any, dims: dict[str, int], stage: base.CausalLM) -> None:
        super().__init__()
        held = stage.layer_range
        self.embed_in = VocabParallelEmbedding(config.vocab_size, config.hidden_size) \
            if stage.is_first_stage else base.NotOnThisStage()
        # A layer's index in this stage's KV cache is its index among the stage's layers.
        self.layers = nn.ModuleList(NeoXLayer(config, i - held.start, dims) if i in held
                                    else base.NotOnThisStage()
                                    for i in range(config.num_hidden_layers))
        self.final_layer_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps) \
            if stage.is_last_stage else base.NotOnThisStage()


class GPTNeoXForCausalLM(base.CausalLM):
    """GPT-NeoX causal LM; see the module docstring."""

    final_norm = "final_layer_norm"

    def __init__(self, config: Any, dtype: torch.dtype, max_model_len: int | None = None):
        super().__init__(config, dtype)
        dims = {"num_heads": self.num_heads, "head_dim": self.head_dim,
                "total_num_heads": self.total_num_heads}
        self.build("gpt_neox", lambda: GPTNeoXModel(config, dims, self), "embed_in")
        self.rotary_emb = RotaryEmbedding(config, rotary_dim(config, self.head_dim),
                                          max_model_len or config.max_position_embeddings,
                                          dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden_size]; None on
        a pipeline stage before the last (its activations went to the next stage)."""
        body = self.gpt_neox
        if self.is_first_stage:
            x = body.embed_in(input_ids)  # [T, hidden]
        else:
            x = recv_from_previous_stage((input_ids.shape[0], self.hidden_size), self.dtype)
        cos_sin = self.rotary_emb(positions)  # 2 x [T, 1, rotary_dim]
        for i in self.layer_range:
            x = body.layers[i](x, cos_sin)
        if not self.is_last_stage:
            send_to_next_stage(x)
            return None
        return body.final_layer_norm(x)

    def convert_weight(self, name: str, tensor: torch.Tensor
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        # Older checkpoints (Pythia) store the causal mask and rotary frequencies as buffers.
        if name.endswith((".attention.bias", ".attention.masked_bias", ".inv_freq")):
            return
        if name == "embed_out.weight":  # the head's name before transformers 5
            name = "lm_head.weight"
        if ".attention.query_key_value." in name:
            h, d = self.total_num_heads, self.head_dim
            # rows [H, 3, D] -> [3, H, D] (module docstring)
            tensor = tensor.reshape(h, 3, d, -1).transpose(0, 1).reshape(tensor.shape)
        yield name, tensor
