"""An adapter's tensors, loaded where the model lives and laid out for the wrapped layers.

Per wrapped layer the adapter becomes one shrink and one expand: A stacks the ranks of every
fused part it changes ([sum of ranks, in]), B places each part's rows, scaled, in that
part's output rows and its own rank columns (block diagonal, zeros elsewhere), so q/k/v or
gate/up take two GEMMs, not two per part. A part the adapter leaves alone has zero rows.

A step's adapters are then stacked the same way (``stack_updates``): every adapter's A
rows one after the other, their B columns side by side, so that a layer runs two GEMMs
per step whatever the number of adapters; each row keeps only its own adapter's columns of
the shrink (``LoRAStep``'s mask), so the others add exact zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    """One wrapped layer's update under one adapter, in the model's dtype on its device:
    ``x @ a.T @ b.T`` with a [rank, in] and b [out, rank] (the scale folded into b)."""

    a: torch.Tensor
    b: torch.Tensor


def load_adapter(spec: AdapterSpec, layers: dict[str, LoRALinear], body: str,
                 dtype: torch.dtype, device: torch.device) -> dict[str, LayerUpdate]:
    """The adapter's updates by wrapped layer name; layers this rank or stage does not
    hold are skipped."""
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
    return {key: _layer_update(layers[key], parts, dtype, device)
            for key, parts in grouped.items()}


def _layer_update(layer: LoRALinear, parts: list[tuple[int, torch.Tensor, torch.Tensor]],
                  dtype: torch.dtype, device: torch.device) -> LayerUpdate:
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
    return LayerUpdate(a_all.to(dtype=dtype, device=device).contiguous(),
                       b_all.to(dtype=dtype, device=device).contiguous())


# Each adapter's columns in a stacked update start at a multiple of this. A row takes only
# its own adapter's columns (the kernels read just those; the masked GEMM adds exact zeros
# for the others), so its update has the same bits whichever adapters share its step.
STACK_ALIGN = 16


@dataclass(slots=True)
class StackedUpdate:
    """One wrapped layer's updates under a step's adapters: ``shrink`` (every adapter's A,
    stacked) gives each row every adapter's columns; adapter ``i``'s are
    ``spans[i] = (first, count)`` (count 0: it leaves this layer alone), and ``owner[c]``
    names the adapter of column ``c``. The expand is ``expand`` (their B side by side, a
    GEMM over masked columns), or ``prepared``: the same B as the backend's own kernels
    took it (``UpdateKernels.prepare``)."""

    shrink: Gemm
    expand: Gemm | None
    prepared: Any
    spans: tuple[tuple[int, int], ...]
    owner: tuple[int, ...]


def stack_updates(adapters: list[dict[str, LayerUpdate]], make_gemm: GemmFactory,
                  prepare: Callable[[torch.Tensor], Any] | None = None
                  ) -> dict[str, StackedUpdate]:
    """Per wrapped layer, the stacked update of ``adapters`` (a step's, in order); a layer
    no adapter changes has none. ``prepare``: the backend's kernels take B (instead of a
    GEMM on it)."""
    out = {}
    for key in sorted({k for updates in adapters for k in updates}):
        a_parts, b_parts, owner, spans = [], [], [], []
        for i, updates in enumerate(adapters):
            u = updates.get(key)
            if u is None:
                spans.append((0, 0))
                continue
            rank = u.a.shape[0]
            width = -(-rank // STACK_ALIGN) * STACK_ALIGN
            spans.append((len(owner), rank))
            a_parts.append(torch.cat([u.a, u.a.new_zeros(width - rank, u.a.shape[1])]))
            b_parts.append(torch.cat([u.b, u.b.new_zeros(u.b.shape[0], width - rank)], 1))
            owner += [i] * width
        b = torch.cat(b_parts, 1).contiguous()
        out[key] = StackedUpdate(make_gemm(torch.cat(a_parts).contiguous()),
                                 None if prepare else make_gemm(b),
                                 prepare(b) if prepare else None, tuple(spans), tuple(owner))
    return out
