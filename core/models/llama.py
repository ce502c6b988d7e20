"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat token batch.

The model sees ``input_ids``/``positions`` of all scheduled sequences concatenated ([T], no
batch dimension). Attention goes through the forward context, so the model knows nothing
about KV caches or sequence boundaries. q/k/v and gate/up are fused into one linear each
(weights concatenated at load time): fewer, larger GEMMs are faster on the CPU.

NOTE sliding windows: each attention layer knows its window (``layer_windows`` in
core/model_limits.py reads it from the config the way transformers does: Mistral's
``sliding_window`` on every layer, Qwen2/Qwen3's with ``use_sliding_window`` on the layers
``layer_types`` or ``max_window_layers`` pick) and passes it to the backend's attention, which
lets the query at position i see keys i - W < j <= i only. A full-attention layer passes
nothing, so a backend whose attention predates windows still runs every other model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cadence.distributed import recv_from_previous_stage, send_to_next_stage
from cadence.layers.activation import SiluAndMul
from cadence.layers.attention import attend, attention_features
from cadence.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from cadence.layers.norm import RMSNorm
from cadence.layers.rotary import ApplyRotary, RotaryEmbedding
from cadence.models import base


class Attention(nn.Module):
    """Fused-qkv self-attention; the attention itself is the backend's (forward context).

    ``sliding_window``: the layer's window in tokens, None for full attention. ``dims``
    holds this rank's head counts (all heads on one rank) and, under tensor parallel, the
    model's ``total_num_heads``/``total_num_kv_heads``: q/k/v are column-parallel by heads
    and o_proj row-parallel (docs/distributed.md).
    """

    def __init__(self, config: Any, layer_idx: int, spec: dict[str, bool], dims: dict[str, int],
                 sliding_window: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.features = attention_features(dims["head_dim"], sliding_window)
        self.num_heads = dims["num_heads"]
        self.num_kv_heads = dims["num_kv_heads"]
        self.head_dim = dims["head_dim"]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        hidden = config.hidden_size
        total_heads = dims.get("total_num_heads", self.num_heads)
        total_kv_heads = dims.get("total_num_kv_heads", self.num_kv_heads)
        self.qkv_proj = QKVParallelLinear(hidden, total_heads, total_kv_heads, self.head_dim,
                                          bias=spec["qkv_bias"])
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden,
                                        bias=spec["o_bias"])
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if spec["qk_norm"] else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if spec["qk_norm"] else None
        self.rotary = ApplyRotary()

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, cos_sin)
        out = attend(self.layer_idx, q, k, v, self.features)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # [T, hidden]


class MLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one linear; column-parallel gate/up and
    row-parallel down under tensor parallel."""

    # act_fn reads gate_up_proj's output and nothing else reads it: a backend may run the
    # two as one GEMM with the activation in its epilogue (backends/cpu/gated.py).
    gate_act_fusable = True

    def __init__(self, config: Any, bias: bool) -> None:
        super().__init__()
        size = self.intermediate_size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * size, bias=bias,
                                                 part_sizes=[size, size])
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, H]


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: attention and MLP, each with a residual.

    The residual stream travels beside the hidden states (vLLM's layout): each norm adds the
    branch output to it and normalises the sum in one call, which a backend can fuse
    (``RMSNorm.forward(x, residual)``). ``a + b`` is ``b + a`` in IEEE arithmetic, so the
    bits are those of the textbook ``x = x + branch(norm(x))``.
    """

    def __init__(self, config: Any, layer_idx: int, spec: dict[str, bool], dims: dict[str, int],
                 sliding_window: int | None = None):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, spec, dims, sliding_window)
        self.mlp = MLP(config, spec["mlp_bias"])
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(branch output, residual stream) -> the same pair after this layer."""
        if residual is None:  # the first layer: the embeddings are the residual stream
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos_sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's ``model.*`` weights).

    Under pipeline parallel only ``stage``'s parts are built (``base.CausalLM``); the
    others are ``NotOnThisStage``, so HF's names and layer indices stay as they are. A
    layer's ``layer_idx`` is its slot in this stage's KV cache: its index among the
    stage's layers."""

    def __init__(self, config: Any, spec: dict[str, bool], dims: dict[str, int],
                 windows: list[int | None], layer_cls: type[nn.Module] = DecoderLayer,
                 stage: base.CausalLM | None = None) -> None:
        super().__init__()
        held = stage.layer_range if stage is not None else range(config.num_hidden_layers)
        first = stage is None or stage.is_first_stage
        last = stage is None or stage.is_last_stage
        # Uninitialized (no random init on the meta device: that imports torch._dynamo,
        # ~1-2 s of start-up); split by vocabulary rows under tensor parallel.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) \
            if first else base.NotOnThisStage()
        self.layers = nn.ModuleList(
            layer_cls(config, i - held.start, spec, dims, windows[i]) if i in held
            else base.NotOnThisStage()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last \
            else base.NotOnThisStage()


# HF checkpoint names of the projections we fuse -> (our fused name, shard index).
FUSED_QKV_GATE_UP = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class CausalLM(base.CausalLM):
    """Llama-family causal LM built from a transformers config; see the module docstring.

    Built on the meta device and materialized on the CPU with uninitialized weights:
    ``load_weights`` must be called before use (it checks that every weight was loaded).
    """

    # Per-architecture differences; subclasses override (read-only class data).
    qkv_bias: bool | None = None  # None: follow config.attention_bias
    o_bias: bool | None = None
    qk_norm: bool = False
    decoder_layer: type[nn.Module] = DecoderLayer
    fused_parts = FUSED_QKV_GATE_UP

    def __init__(self, config: Any, dtype: torch.dtype, max_model_len: int | None = None):
        super().__init__(config, dtype)
        attention_bias = bool(getattr(config, "attention_bias", False))
        spec = {
            "qkv_bias": attention_bias if self.qkv_bias is None else self.qkv_bias,
            "o_bias": attention_bias if self.o_bias is None else self.o_bias,
            "qk_norm": self.qk_norm,
            "mlp_bias": bool(getattr(config, "mlp_bias", False)),
        }
        dims = {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "total_num_heads": self.total_num_heads,
            "total_num_kv_heads": self.total_num_kv_heads,
        }
        # Each layer's sliding window (None: full attention); see the module NOTE.
        self.layer_windows = base.sliding_windows(config, max_model_len)
        self.build("model", lambda: DecoderModel(config, spec, dims, self.layer_windows,
                                                 self.decoder_layer, self), "embed_tokens")
        self.rotary_emb = RotaryEmbedding(
            config, self.rotary_dim(), max_model_len or config.max_position_embeddings, dtype
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input: the token embeddings (a family may scale them)."""
        return self.model.embed_tokens(input_ids)

    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates: all of them here."""
        return self.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden_size]; None on
        a pipeline stage before the last (its activations went to the next stage)."""
        cos_sin = self.rotary_emb(positions)  # 2 x [T, 1, head_dim]
        if self.is_first_stage:
            x, residual = self.embed(input_ids), None  # [T, hidden]
        else:
            # The previous stage's branch output and residual stream, stacked.
            x, residual = recv_from_previous_stage(
                (2, input_ids.shape[0], self.hidden_size), self.dtype).unbind(0)
        for i in self.layer_range:
            x, residual = self.model.layers[i](x, residual, cos_sin)
        if not self.is_last_stage:
            send_to_next_stage(torch.stack((x, residual)))
            return None
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    """Llama: biases follow ``attention_bias`` (q/k/v and o) and ``mlp_bias``."""


class MistralForCausalLM(CausalLM):
    """Mistral: Llama without biases; ``sliding_window`` on every layer (module NOTE)."""

    qkv_bias = False
    o_bias = False


class Qwen2ForCausalLM(CausalLM):
    """Qwen2: always a bias on q/k/v, never on o_proj."""

    qkv_bias = True
    o_bias = False


class Qwen3ForCausalLM(CausalLM):
    """Qwen3: per-head RMSNorm on q and k before RoPE; explicit head_dim."""

    qk_norm = True
