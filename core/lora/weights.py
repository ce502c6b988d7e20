"""An adapter's tensors, loaded where the model lives and laid out for the wrapped layers.

Per wrapped layer the adapter becomes one shrink and one expand: A stacks the ranks of every
fused part it changes ([sum of ranks, in]), B places each part's rows, scaled, in that
part's output rows and its own rank columns (block diagonal, zeros elsewhere), so q/k/v or
gate/up take two GEMMs, not two per part. A part the adapter leaves alone has zero rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cadence.lora.adapter import AdapterSpec
from cadence.lora.layers import LoRALinear

Gemm = Callable[[torch.Tensor], torch.Tensor]
#: weight [out, in] -> a function of x [T, in] -> x @ weight.T [T, out].
GemmFactory = Callable[[torch.Tensor], Gemm]

# HF projection -> (our module under the layer, fused part index).
_TARGET = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", 0)}


@dataclass(slots=True)
class LayerUpdate:
    """One wrapped layer's update under one adapter: ``expand(shrink(x))``."""

    shrink: Gemm
    expand: Gemm


def load_adapter(spec: AdapterSpec, layers: dict[str, LoRALinear], body: str,
                 dtype: torch.dtype, device: torch.device, make_gemm: GemmFactory
                 ) -> dict[str, LayerUpdate]:
    """The adapter's updates by wrapped layer name, in ``dtype`` on ``device``; layers this
    rank or stage does not hold are skipped."""
    from safetensors.torch import load_file

    tensors = load_file(spec.weights_file)
    grouped: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for m in spec.modules:
        sub, part = _TARGET[m.projection]
        key = f"{body}.layers.{m.layer}.{sub}"
        if key not in layers:
            continue
        a = tensors[m.a_name].to(torch.float32)
        b = tensors[m.b_name].to(torch.float32) * m.scale
        grouped.setdefault(key, []).append((part, a, b))
    return {key: _layer_update(layers[key], parts, dtype, device, make_gemm)
            for key, parts in grouped.items()}


def _layer_update(layer: LoRALinear, parts: list[tuple[int, torch.Tensor, torch.Tensor]],
                  dtype: torch.dtype, device: torch.device, make_gemm: GemmFactory
                  ) -> LayerUpdate:
    parts.sort(key=lambda p: p[0])
    rank = sum(a.shape[0] for _, a, _ in parts)
    a_all = torch.cat([a for _, a, _ in parts])
    if layer.column_slice is not None:
        first, count = layer.column_slice
        a_all = a_all[:, first:first + count]
    b_all = torch.zeros(layer.out_features, rank)
    row0 = [sum(rows for _, rows in layer.part_slices[:p])
            for p in range(len(layer.part_slices))]
    col = 0
    for part, a, b in parts:
        first, rows = layer.part_slices[part]
        block = b[first:first + rows]  # this rank's rows (all of them on one rank)
        b_all[row0[part]:row0[part] + block.shape[0], col:col + a.shape[0]] = block
        col += a.shape[0]
    a_all = a_all.to(dtype=dtype, device=device).contiguous()
    b_all = b_all.to(dtype=dtype, device=device).contiguous()
    return LayerUpdate(make_gemm(a_all), make_gemm(b_all))
