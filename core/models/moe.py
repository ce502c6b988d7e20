"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

Each is its Llama-family sibling (Mistral's, Qwen2's, Qwen3's attention) with the MLP of
its sparse layers replaced by ``SparseMoE`` (core/layers/moe.py). The dense MLPs are swapped
while the model is still on the meta device, so they never take memory.

Checkpoints come in two layouts, both loaded: one tensor per expert and projection (the
Hub's, and what transformers writes: ``experts.<e>.w1`` for Mixtral, ``experts.<e>.
gate_proj`` for Qwen), and transformers 5's in-memory stacks (``experts.gate_up_proj``
[E, 2I, H], ``experts.down_proj`` [E, H, I]), split per expert at load.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
from torch import nn

from cadence.layers.moe import SparseMoE, expert_parallel_share
from cadence.models import llama

# Qwen's expert projections -> ExpertMLP's (Mixtral's) names.
_QWEN_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERT_RE = re.compile(r"^(.*\.mlp\.(?:experts\.\d+|shared_expert))\.(gate_proj|up_proj|down_proj)"
                        r"\.weight$")
_STACKED_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_EXPERT_INDEX_RE = re.compile(r"\.experts\.(\d+)\.")
_HALF_RE = re.compile(r"^(.*\.mlp\.(?:experts\.\d+|shared_expert))\.(w1|w3)\.weight$")


class _MoECausalLM(llama.CausalLM):
    """A Llama-family model whose sparse layers' MLPs are ``SparseMoE`` blocks."""

    renormalize_default = True
    weights_in_model_dtype = False
    # The core's expert loop sizes the token groups on the host (one sync per layer), which
    # a captured CUDA graph cannot replay. The CUDA backend's fused kernels have no host
    # sync and static shapes per token count, but have not yet been captured and checked
    # on a GPU, so the CUDA backend still runs these models eagerly (docs/models.md).
    graph_capturable = False

    def build(self, prefix: str, body: Callable[[], nn.Module], embed: str,
              head_bias: bool = False) -> None:
        super().build(prefix, lambda: self._with_experts(body()), embed, head_bias)

    def _with_experts(self, model: nn.Module) -> nn.Module:
        cfg = self.config
        self.held_experts = expert_parallel_share(self.num_experts())
        for i, layer in enumerate(model.layers):
            # Layers of other pipeline stages are placeholders: no experts for them.
            if i in self.layer_range and self.is_sparse(i):
                layer.mlp = SparseMoE(
                    cfg.hidden_size, self.expert_size(), self.num_experts(),
                    cfg.num_experts_per_tok,
                    bool(getattr(cfg, "norm_topk_prob", self.renormalize_default)),
                    self.weights_in_model_dtype, self.shared_expert_size(),
                    self.held_experts)
        return model

    def stage_weight_name(self, name: str) -> str | None:
        """None also for the experts another expert-parallel rank holds (checkpoint names,
        either family's, and ours name an expert ``experts.<index>.``)."""
        name = super().stage_weight_name(name)
        if name is None or self.held_experts is None:
            return name
        expert = _EXPERT_INDEX_RE.search(name)
        return None if expert and int(expert.group(1)) not in self.held_experts else name

    def num_experts(self) -> int:
        return int(self.config.num_experts)

    def expert_size(self) -> int:
        return int(self.config.moe_intermediate_size)

    def shared_expert_size(self) -> int | None:
        return None

    def is_sparse(self, layer: int) -> bool:
        """Qwen-MoE's rule: not in ``mlp_only_layers``, and every ``decoder_sparse_step``-th."""
        cfg = self.config
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        return (layer not in (getattr(cfg, "mlp_only_layers", None) or [])
                and self.num_experts() > 0 and (layer + 1) % step == 0)

    def convert_weight(self, name: str, tensor: torch.Tensor
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        stacked = _STACKED_RE.match(name)
        if stacked is not None:  # transformers 5's stacked experts: one tensor per expert
            prefix, kind = stacked.groups()
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.{'w2' if kind == 'down_proj' else 'w13'}.weight", tensor[e]
            return
        expert = _EXPERT_RE.match(name)
        if expert is not None:
            name = f"{expert.group(1)}.{_QWEN_EXPERT_NAMES[expert.group(2)]}.weight"
        half = _HALF_RE.match(name)
        if half is None:
            yield from super().convert_weight(name, tensor)
            return
        # w1 and w3 arrive as two tensors; the expert holds them as one (ExpertMLP's NOTE).
        prefix, which = half.groups()
        pending = self.__dict__.setdefault("_pending_halves", {})
        other = pending.pop((prefix, "w3" if which == "w1" else "w1"), None)
        if other is None:
            pending[(prefix, which)] = tensor
            return
        gate, up = (tensor, other) if which == "w1" else (other, tensor)
        yield f"{prefix}.w13.weight", torch.cat([gate, up])


class MixtralForCausalLM(_MoECausalLM):
    """Mixtral: Mistral's attention, every layer sparse, top-k weights renormalized and
    applied in fp32; checkpoint names under ``block_sparse_moe``."""

    qkv_bias = False
    o_bias = False

    def num_experts(self) -> int:
        return int(self.config.num_local_experts)

    def expert_size(self) -> int:
        return int(self.config.intermediate_size)

    def is_sparse(self, layer: int) -> bool:
        return True

    def convert_weight(self, name: str, tensor: torch.Tensor
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from super().convert_weight(name.replace(".block_sparse_moe.", ".mlp."), tensor)


class Qwen2MoeForCausalLM(_MoECausalLM):
    """Qwen2-MoE: Qwen2's attention (q/k/v bias), a shared expert gated by a sigmoid,
    routing weights in the model's dtype, ``norm_topk_prob`` (off by default)."""

    o_bias = False
    renormalize_default = False
    weights_in_model_dtype = True

    def __init__(self, config, dtype: torch.dtype, max_model_len: int | None = None) -> None:
        self.qkv_bias = bool(getattr(config, "qkv_bias", True))  # Qwen2MoeConfig's flag
        super().__init__(config, dtype, max_model_len)

    def shared_expert_size(self) -> int | None:
        return int(getattr(self.config, "shared_expert_intermediate_size", 0) or 0) or None


class Qwen3MoeForCausalLM(_MoECausalLM):
    """Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm), no shared expert."""

    qk_norm = True
    renormalize_default = False
    weights_in_model_dtype = True


__all__ = ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]
