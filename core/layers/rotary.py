"""Rotary position embeddings (Neox style: HF's ``rotate_half``) with a precomputed cos/sin cache.

The inverse frequencies and the attention factor come from transformers' own
``ROPE_INIT_FUNCTIONS`` for the scaled types, so linear, dynamic, llama3 and yarn match
transformers bit for bit; only the default type is computed here (same formula).

NOTE (dynamic NTK): transformers recomputes ``inv_freq`` in the forward pass once the largest
position passes ``max_position_embeddings``, from ``seq_len = max position + 1``. In cached
generation each decode step therefore rotates the token at position ``p`` with the NTK
frequencies for ``seq_len = p + 1`` while earlier keys keep their rotation. We precompute
exactly that per position, so we match transformers' cached ``generate`` whenever the prompt
fits in ``max_position_embeddings``. (A single prefill longer than that is rotated by
transformers with one stretched set for all positions; a KV cache cannot reproduce that.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of ``config`` as one flat dict, from either config layout.

    transformers 5.x keeps them in ``config.rope_parameters`` (with ``rope_type`` and
    ``rope_theta``); older configs have ``rope_scaling`` (``type`` or ``rope_type``) plus a
    top-level ``rope_theta``. Models whose layer types rotate differently (Gemma 3: local
    and global layers) key them by ``layer_type``.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return params


def rotary_dim(config: Any, head_dim: int) -> int:
    """How many leading dimensions of each head are rotated: ``head_dim`` times the partial
    rotary factor (``rope_parameters["partial_rotary_factor"]``, where transformers 5.x puts
    it, also GPT-NeoX's ``rotary_pct``; else a top-level ``partial_rotary_factor``)."""
    factor = rope_parameters(config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * factor)


def _longrope_is_long(config: Any, max_len: int) -> bool:
    params = rope_parameters(config)
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None) or config.max_position_embeddings
    return max_len > original


def _inv_freq(config: Any, head_dim: int, max_len: int,
              layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "longrope":
        # NOTE LongRoPE: transformers rotates with the short factors while a sequence fits in
        # original_max_position_embeddings and, once it grows past, recomputes the whole
        # sequence with the long ones (Phi3ForCausalLM drops its cache at that step). A
        # paged cache cannot re-rotate keys it holds, so the choice is made once per engine,
        # from max_model_len: short when every sequence fits, long otherwise. Each matches
        # transformers for the sequences that stay on its side (docs/models.md).
        seq_len = max_len if _longrope_is_long(config, max_len) else None
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu",
                                                                   seq_len=seq_len)
        return inv_freq.float(), float(attention_factor)
    by_type = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **by_type)
    return inv_freq.float(), float(attention_factor)


def _dynamic_ntk_inv_freq(
    params: dict[str, Any], head_dim: int, seq_lens: torch.Tensor
) -> torch.Tensor:
    """transformers' ``_compute_dynamic_ntk_parameters`` for many ``seq_len`` at once.

    seq_lens [P] (each > max_position_embeddings) -> inv_freq [P, head_dim / 2].
    """
    max_pos, factor = params["max_position_embeddings"], params["factor"]
    ratio = (factor * seq_lens.double() / max_pos) - (factor - 1)
    base = params["rope_theta"] * ratio ** (head_dim / (head_dim - 2))  # [P]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base.float()[:, None] ** exponents[None, :])


class RotaryEmbedding(nn.Module):
    """cos/sin tables for all positions; ``apply_rotary`` rotates q and k with a lookup.

    ``head_dim`` is the rotated width (``rotary_dim``: the whole head unless the model
    rotates only part of it). ``max_model_len`` picks LongRoPE's factors (NOTE in
    ``_inv_freq``); the tables cover at least ``max_position_embeddings`` positions.
    ``layer_type`` picks the settings of one kind of layer (``rope_parameters``).
    """

    def __init__(self, config: Any, head_dim: int, max_len: int, dtype: torch.dtype,
                 layer_type: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.layer_type = layer_type
        self.head_dim = head_dim
        self.max_model_len = max_len
        self.max_len = max(max_len, config.max_position_embeddings)
        self.dtype = dtype
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)compute the cos/sin tables on the CPU, e.g. after building on the meta device."""
        inv_freq, attention_factor = _inv_freq(self.config, self.head_dim, self.max_model_len,
                                               self.layer_type)
        if inv_freq.numel() * 2 != self.head_dim:
            raise ValueError(f"the rope parameters give {inv_freq.numel() * 2} rotary "
                             f"dimensions, the model rotates {self.head_dim}")
        positions = torch.arange(self.max_len, dtype=torch.float, device="cpu")
        # Same float32 arithmetic as transformers: positions * inv_freq, then scale cos/sin.
        freqs = positions[:, None] * inv_freq[None, :]  # [max_len, head_dim / 2]
        max_pos = self.config.max_position_embeddings
        params = rope_parameters(self.config, self.layer_type)
        if params["rope_type"] == "dynamic" and self.max_len > max_pos:
            params = {**params, "max_position_embeddings": max_pos}
            # Position p is rotated with the frequencies for seq_len = p + 1 (module NOTE).
            long_inv_freq = _dynamic_ntk_inv_freq(params, self.head_dim, positions[max_pos:] + 1)
            freqs[max_pos:] = positions[max_pos:, None] * long_inv_freq  # [P, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        self.cos_cache = (emb.cos() * attention_factor).to(self.dtype)
        self.sin_cache = (emb.sin() * attention_factor).to(self.dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, head_dim]; looked up once per forward."""
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, head_dim]
        sin = self.sin_cache[positions].unsqueeze(1)  # [T, 1, head_dim]
        return cos, sin


class ApplyRotary(nn.Module):
    """``apply_rotary`` as a module, so a backend can swap in a fused kernel."""

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, cos_sin)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim] -> rotated, same shapes.

    Tables narrower than the head (cos, sin [T, 1, rotary_dim]) rotate the leading
    ``rotary_dim`` dimensions and pass the rest through (partial rotary, GPT-NeoX's
    ``rotary_pct``), as transformers' ``apply_rotary_pos_emb`` does."""
    cos, sin = cos_sin
    rd = cos.shape[-1]
    if rd == q.shape[-1]:
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
    return (torch.cat((_rotate(q[..., :rd], cos, sin), q[..., rd:]), dim=-1),
            torch.cat((_rotate(k[..., :rd], cos, sin), k[..., rd:]), dim=-1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # HF rotate_half
    return x * cos + rotated * sin
