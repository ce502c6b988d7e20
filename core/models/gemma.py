"""Gemma 2 and Gemma 3 (text) over a flat token batch.

What sets them apart from the Llama decoder:
- every RMSNorm scales by ``1 + weight`` in float32 (``RMSNormWeightFirst(offset=1)``), and
  each block has four: before and after attention, before and after the MLP;
- a GeGLU MLP (``hidden_activation``, the tanh GELU);
- the embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype first
  as transformers does;
- the attention scale is ``query_pre_attn_scalar ** -0.5`` (the ``scale`` keyword);
- local layers attend to a sliding window and global ones to everything, alternating as
  ``layer_types`` says (core/model_limits.py);
- Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``, the ``soft_cap``
  keyword: a backend without it refuses the model) and the final logits
  (``final_logit_softcapping``, here in ``finish_logits``);
- Gemma 3 norms q and k per head and rotates local and global layers with different RoPE
  settings (``rope_parameters`` keyed by layer type).

Under tensor parallel the heads and the MLP columns split over the ranks as Llama's do; the
scale, the soft caps and the norms act per score, per logit or per hidden vector, so every
rank applies them to its share unchanged. Under pipeline parallel a stage holds its layers
(``layer_types`` and windows are read at each layer's index in the whole model).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cadence.distributed import recv_from_previous_stage, send_to_next_stage
from cadence.layers.activation import ActAndMul
from cadence.layers.attention import attend, attention_features
from cadence.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from cadence.layers.norm import RMSNormWeightFirst
from cadence.layers.rotary import ApplyRotary, RotaryEmbedding
from cadence.models import base
from cadence.models.llama import FUSED_QKV_GATE_UP


def _norm(size: int, config: Any) -> RMSNormWeightFirst:
    return RMSNormWeightFirst(size, config.rms_norm_eps, offset=1.0)


class GemmaAttention(nn.Module):
    """Fused-qkv attention with Gemma's scale, optional per-head q/k norms, window and
    soft cap; heads column-parallel and o_proj row-parallel under tensor parallel."""

    def __init__(self, config: Any, layer_idx: int, dims: dict[str, int],
                 sliding_window: int | None, qk_norm: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = dims["num_heads"], dims["num_kv_heads"]
        self.head_dim = d = dims["head_dim"]
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        total_heads = dims["total_num_heads"]
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, total_heads,
                                          dims["total_num_kv_heads"], d, bias=bias)
        self.o_proj = RowParallelLinear(total_heads * d, config.hidden_size, bias=bias)
        self.q_norm = _norm(d, config) if qk_norm else None
        self.k_norm = _norm(d, config) if qk_norm else None
        self.rotary = ApplyRotary()
        self.features = attention_features(
            d, sliding_window, scale=config.query_pre_attn_scalar ** -0.5,
            soft_cap=getattr(config, "attn_logit_softcapping", None))

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, cos_sin)
        out = attend(self.layer_idx, q, k, v.view(t, self.num_kv_heads, self.head_dim),
                     self.features)
        return self.o_proj(out.reshape(t, self.q_size))


class GemmaMLP(nn.Module):
    """GeGLU: down(act(gate) * up), gate and up fused into one GEMM (column-parallel,
    down row-parallel under tensor parallel)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * size, bias=False,
                                                 part_sizes=[size, size])
        self.act_fn = ActAndMul(config.hidden_activation, "hidden_activation")
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """``h = x + post(attn(pre(x)))``, then ``h + post(mlp(pre(h)))``. ``index``: the
    layer's index in the model; ``layer_idx``: its slot in this stage's KV cache."""

    def __init__(self, config: Any, index: int, layer_idx: int, dims: dict[str, int],
                 sliding_window: int | None, qk_norm: bool) -> None:
        super().__init__()
        self.layer_type = config.layer_types[index]
        self.self_attn = GemmaAttention(config, layer_idx, dims, sliding_window, qk_norm)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = _norm(config.hidden_size, config)
        self.post_attention_layernorm = _norm(config.hidden_size, config)
        self.pre_feedforward_layernorm = _norm(config.hidden_size, config)
        self.post_feedforward_layernorm = _norm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's ``model.*`` weights); under
    pipeline parallel ``stage``'s parts only, as Llama's ``DecoderModel``."""

    def __init__(self, config: Any, dims: dict[str, int], windows: list[int | None],
                 qk_norm: bool, stage: base.CausalLM) -> None:
        super().__init__()
        held = stage.layer_range
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) \
            if stage.is_first_stage else base.NotOnThisStage()
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, i - held.start, dims, windows[i], qk_norm)
            if i in held else base.NotOnThisStage() for i in range(config.num_hidden_layers))
        self.norm = _norm(config.hidden_size, config) if stage.is_last_stage \
            else base.NotOnThisStage()


class Gemma2ForCausalLM(base.CausalLM):
    """Gemma 2 causal LM; see the module docstring."""

    qk_norm = False
    fused_parts = FUSED_QKV_GATE_UP

    def __init__(self, config: Any, dtype: torch.dtype, max_model_len: int | None = None):
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is "
                             "not supported: cadence runs causal decoders")
        super().__init__(config, dtype)
        dims = {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "total_num_heads": self.total_num_heads,
                "total_num_kv_heads": self.total_num_kv_heads}
        self.layer_windows = base.sliding_windows(config, max_model_len)
        self.build("model", lambda: GemmaModel(config, dims, self.layer_windows, self.qk_norm,
                                               self), "embed_tokens")
        max_len = max_model_len or config.max_position_embeddings
        per_type = isinstance(config.rope_parameters.get(config.layer_types[0]), dict)
        # One table per kind of layer where their RoPE settings differ (Gemma 3).
        self.rotary_emb = nn.ModuleDict({
            t: RotaryEmbedding(config, self.head_dim, max_len, dtype, t if per_type else None)
            for t in sorted(set(config.layer_types))})
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden_size]; None on
        a pipeline stage before the last (its activations went to the next stage)."""
        if self.is_first_stage:
            x = self.model.embed_tokens(input_ids)  # [T, hidden]
            # sqrt(hidden) in the embeddings' dtype first, as transformers rounds it.
            x = x * torch.tensor(self.hidden_size ** 0.5, dtype=x.dtype)
        else:
            x = recv_from_previous_stage((input_ids.shape[0], self.hidden_size), self.dtype)
        cos_sin = {t: table(positions) for t, table in self.rotary_emb.items()}
        for i in self.layer_range:
            layer = self.model.layers[i]
            x = layer(x, cos_sin[layer.layer_type])
        if not self.is_last_stage:
            send_to_next_stage(x)
            return None
        return self.model.norm(x)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: Gemma 2 plus per-head q/k norms and RoPE per layer type; without soft
    caps in its released configs (both are honoured when set)."""

    qk_norm = True
