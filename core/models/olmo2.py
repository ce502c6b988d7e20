"""OLMo 2 over a flat token batch.

The Llama decoder with the norms moved: no norm before attention or the MLP, an RMSNorm on
each branch's output before it joins the residual (``post_attention_layernorm``,
``post_feedforward_layernorm``), and RMSNorms on q and k over the whole projection (all
heads at once, before the split into heads; Qwen3 norms each head). Every OLMo 2 norm
applies its weight in float32 before casting back (``RMSNormWeightFirst``).

NOTE tensor parallel: a rank holds some heads of q and k, but their norms' statistics run
over all heads. Each rank gathers the whole projection (all-gather), norms it with the full
weight as one process does, and keeps its own heads' columns; replicated KV heads (fewer
than ranks) appear once per replica in the gather and are taken once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cadence.distributed import (
    all_gather,
    recv_from_previous_stage,
    send_to_next_stage,
    tp_rank,
    tp_size,
)
from cadence.layers.attention import attend, attention_features
from cadence.layers.linear import QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from cadence.layers.norm import RMSNormWeightFirst
from cadence.layers.rotary import ApplyRotary, RotaryEmbedding
from cadence.models import base
from cadence.models.llama import FUSED_QKV_GATE_UP, MLP


class ShardedQKNorm(RMSNormWeightFirst):
    """``RMSNormWeightFirst`` over a projection whose heads are split across the
    tensor-parallel ranks (module NOTE): the full weight on every rank, this rank's columns
    of the result. ``replicas``: how many ranks hold each of the projection's heads."""

    def __init__(self, total_size: int, local_size: int, eps: float, replicas: int) -> None:
        super().__init__(total_size, eps)
        self.tp_size = tp_size()
        self.local_size, self.replicas = local_size, replicas
        self.start = (tp_rank() // replicas) * local_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        full = all_gather(x, dim=-1)  # [T, ranks * local]
        if self.replicas > 1:
            full = full.view(x.shape[0], -1, self.local_size)[:, ::self.replicas].flatten(1)
        return super().forward(full)[:, self.start:self.start + self.local_size]


class Olmo2Attention(nn.Module):
    """Fused-qkv attention with q and k normed over the whole projection; heads split over
    the tensor-parallel ranks as Llama's."""

    def __init__(self, config: Any, layer_idx: int, dims: dict[str, int]) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = dims["num_heads"], dims["num_kv_heads"]
        self.head_dim = d = dims["head_dim"]
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        total_heads, total_kv = dims["total_num_heads"], dims["total_num_kv_heads"]
        bias = bool(getattr(config, "attention_bias", False))
        eps = config.rms_norm_eps
        self.qkv_proj = QKVParallelLinear(config.hidden_size, total_heads, total_kv, d,
                                          bias=bias)
        self.o_proj = RowParallelLinear(total_heads * d, config.hidden_size, bias=bias)
        self.q_norm = ShardedQKNorm(total_heads * d, self.q_size, eps, 1)
        self.k_norm = ShardedQKNorm(total_kv * d, self.kv_size, eps,
                                    self.qkv_proj.kv_replicas)
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
    """Embeddings, decoder layers and the final norm (HF's ``model.*`` weights); under
    pipeline parallel ``stage``'s parts only, as Llama's ``DecoderModel``."""

    def __init__(self, config: Any, dims: dict[str, int], stage: base.CausalLM) -> None:
        super().__init__()
        held = stage.layer_range
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) \
            if stage.is_first_stage else base.NotOnThisStage()
        # A layer's index in this stage's KV cache is its index among the stage's layers.
        self.layers = nn.ModuleList(
            Olmo2DecoderLayer(config, i - held.start, dims) if i in held
            else base.NotOnThisStage() for i in range(config.num_hidden_layers))
        self.norm = RMSNormWeightFirst(config.hidden_size, config.rms_norm_eps) \
            if stage.is_last_stage else base.NotOnThisStage()


class Olmo2ForCausalLM(base.CausalLM):
    """OLMo 2 causal LM; see the module docstring."""

    fused_parts = FUSED_QKV_GATE_UP

    def __init__(self, config: Any, dtype: torch.dtype, max_model_len: int | None = None):
        if config.hidden_act != "silu":
            raise ValueError(f"OLMo 2 with hidden_act {config.hidden_act!r} is not supported; "
                             "supported: 'silu'")
        super().__init__(config, dtype)
        dims = {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "total_num_heads": self.total_num_heads,
                "total_num_kv_heads": self.total_num_kv_heads}
        self.build("model", lambda: Olmo2Model(config, dims, self), "embed_tokens")
        self.rotary_emb = RotaryEmbedding(config, self.head_dim,
                                          max_model_len or config.max_position_embeddings,
                                          dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden_size]; None on
        a pipeline stage before the last (its activations went to the next stage)."""
        if self.is_first_stage:
            x = self.model.embed_tokens(input_ids)  # [T, hidden]
        else:
            x = recv_from_previous_stage((input_ids.shape[0], self.hidden_size), self.dtype)
        cos_sin = self.rotary_emb(positions)  # 2 x [T, 1, head_dim]
        for i in self.layer_range:
            x = self.model.layers[i](x, cos_sin)
        if not self.is_last_stage:
            send_to_next_stage(x)
            return None
        return self.model.norm(x)
